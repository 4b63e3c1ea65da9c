"""The origin's fix when the weights that overflowed were adapted inside the step (MAML's fast weights).

Derived from dragen1860/MAML-Pytorch's ``Meta.forward``: ``grad = torch.autograd.grad(loss,
fast_weights)`` then ``fast_weights = list(map(lambda p: p[1] - self.update_lr * p[0], ...))``
and the query forward through ``F.linear(x, w, b)`` with those weights. An inner learning rate
far too high (``update_lr``) overflows the query forward in step 0, before any optimizer step:
the fix must point at that line's learning rate, not at the initialisation and the inputs.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import trainguard as tg
from trainguard.analysis import origin
from trainguard.store import open_run


class Learner(nn.Module):
    def __init__(self):
        super().__init__()
        self.vars = nn.ParameterList([nn.Parameter(torch.randn(16, 6) * 0.4), nn.Parameter(torch.zeros(16)),
                                      nn.Parameter(torch.randn(3, 16) * 0.25), nn.Parameter(torch.zeros(3))])

    def forward(self, x, vars=None):
        vars = self.vars if vars is None else vars
        x = F.relu(F.linear(x, vars[0], vars[1]))
        return F.linear(x, vars[2], vars[3])


def meta_train(update_lr: float, second_order: bool, steps: int = 2, by_alpha: bool = False) -> None:
    torch.manual_seed(0)
    net = Learner()
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x_spt, x_qry = torch.randn(2, 9, 6, generator=g)
        y = torch.arange(9) % 3
        fast = list(net.vars)
        loss = F.cross_entropy(net(x_spt, fast), y)
        grad = torch.autograd.grad(loss, fast, create_graph=second_order)
        if by_alpha:
            fast = [torch.add(w, gw, alpha=-update_lr) for gw, w in zip(grad, fast)]  # the inner update
        else:
            fast = list(map(lambda p: p[1] - update_lr * p[0], zip(grad, fast)))  # the inner update
        loss_q = F.cross_entropy(net(x_qry, fast), y)
        opt.zero_grad()
        loss_q.backward()
        opt.step()


UPDATE_LINES = [i for i, t in enumerate(inspect.getsource(inspect.getmodule(meta_train)).splitlines(), 1)
                if "# the inner update" in t]


@pytest.mark.parametrize("second_order", [False, True])
@pytest.mark.parametrize("by_alpha", [False, True])
def test_an_overflow_of_fast_weights_names_the_inner_learning_rate(tmp_path, second_order, by_alpha):
    with tg.record(tmp_path / "r", buffer=-1):
        meta_train(update_lr=1e30, second_order=second_order, by_alpha=by_alpha)
    o = origin(open_run(tmp_path / "r"))
    assert (o.origin.step, o.origin.phase, o.origin.module) == (0, "forward", ""), o.summary  # the Learner, the root
    line = UPDATE_LINES[1 if not by_alpha else 0]
    assert "initialisation" not in o.suggestion, o.suggestion
    assert "inner learning rate" in o.suggestion and f"test_origin_inner_loop.py:{line}" in o.suggestion, o.suggestion


def test_a_healthy_inner_loop_records_no_origin(tmp_path):
    with tg.record(tmp_path / "r", buffer=-1):
        meta_train(update_lr=0.4, second_order=True)
    assert origin(open_run(tmp_path / "r")) is None
