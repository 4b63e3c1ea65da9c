"""Double backward (second-order MAML): the backward of the ops an inner ``autograd.grad(create_graph=True)`` ran.

Derived from dragen1860/MAML-Pytorch's ``Meta.forward`` with ``create_graph=True`` (the second-order
MAML of the paper; the repository's own loop is first order): the fast weights ``w - lr * grad``
carry the inner gradient's graph, and the query loss's ``backward()`` runs the backward of those
backward ops. Each such op is traced through the inner backward op that made its node to the
forward op and line, in the model's module, as a first-order backward op is.
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
    def __init__(self, power: float = 1.0):
        super().__init__()
        self.power = power
        self.vars = nn.ParameterList([nn.Parameter(torch.randn(8, 4) * 0.5), nn.Parameter(torch.zeros(8)),
                                      nn.Parameter(torch.randn(3, 8) * 0.5), nn.Parameter(torch.zeros(3))])

    def forward(self, x, vars=None):
        vars = self.vars if vars is None else vars
        h = F.linear(x, vars[0], vars[1])
        h = h.clamp(min=0) ** self.power  # x ** 1.5: a finite first derivative at 0, an infinite second
        return F.linear(h, vars[2], vars[3])


def meta_step(net: Learner, opt, step: int, zero_row: bool = False) -> None:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(6, 4, generator=g)
    if zero_row:
        x[0] = 0.0
    y = torch.arange(6) % 3
    fast = list(net.vars)
    loss = F.cross_entropy(net(x, fast), y)
    grads = torch.autograd.grad(loss, fast, create_graph=True)
    fast = [w - 0.4 * gw for w, gw in zip(fast, grads)]
    loss_q = F.cross_entropy(net(x, fast), y)
    opt.zero_grad()
    loss_q.backward()
    opt.step()


FORWARD_LINES = {i for i, t in enumerate(inspect.getsource(Learner.forward).splitlines(),
                                          inspect.getsourcelines(Learner.forward)[1]) if "vars[" in t or "**" in t}


@pytest.mark.parametrize("backend", ["python", "native"])
def test_double_backward_ops_are_traced_to_the_forward_ops_module_and_line(tmp_path, backend):
    torch.manual_seed(0)
    net = Learner()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    with tg.record(tmp_path / "r", buffer=-1, backend=backend):
        meta_step(net, opt, 0)
    with open_run(tmp_path / "r") as run:
        backward = run.executions(phase="backward")
        # the ones in the module: every backward op of the model's ops, first and second order
        untraced = [e["op"] for e in backward if e["fwd_seq"] is None and e["op"] != "aten.detach"]
        assert untraced == [], untraced
        lines = set()
        for e in backward:
            if e["module"] != "" or e["fwd_seq"] is None:
                continue
            made_by = run.execution(e["fwd_seq"])
            if made_by["phase"] == "backward":  # the backward of an inner backward op
                lines.add(run.user_frame(e["stack_id"])["lineno"])
        assert lines and lines <= FORWARD_LINES, (lines, FORWARD_LINES)


@pytest.mark.parametrize("backend", ["python", "native"])
def test_a_nan_made_in_the_double_backward_names_the_forward_line(tmp_path, backend):
    torch.manual_seed(0)
    net = Learner(power=1.5)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    with tg.record(tmp_path / "r", buffer=-1, backend=backend):
        meta_step(net, opt, 0, zero_row=True)
    o = origin(open_run(tmp_path / "r"))
    link = o.origin
    pow_line = next(n for n in FORWARD_LINES if "**" in inspect.getsource(inspect.getmodule(Learner)).splitlines()[n - 1])
    assert link.phase == "backward" and link.module == "", o.summary
    assert (link.line, link.forward_op["line"]) == (pow_line, pow_line), o.summary
