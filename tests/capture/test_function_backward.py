"""The ops a custom autograd.Function's Python ``backward`` runs are recorded at its own lines.

Derived from alxndrTL/mamba.py (mambapy/pscan.py): ``PScan`` runs a scan over time in its
``forward`` (clone, then in-place ``mul``/``add_`` on views) and the reverse scan in its
``backward``, all in Python. The backward node is the Function's, made by ``PScan.apply``: no op
inside ``forward`` made it, so its first op (``A_in.clone()``) is not where the backward ops run.
A NaN that the reverse scan made was reported at ``A = A_in.clone()`` as "the gradient of clone".
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import trainguard as tg
from trainguard.analysis import origin
from trainguard.store import open_run


class Scan(torch.autograd.Function):
    """h[t] = a[t] * h[t-1] + x[t], sequential (mambapy's pscan, without the Blelloch tree)."""

    @staticmethod
    def forward(ctx, a, x):
        h = x.clone()  # FORWARD-FIRST
        for t in range(1, h.size(1)):
            h[:, t].add_(a[:, t] * h[:, t - 1])
        ctx.save_for_backward(a, h)
        return h

    @staticmethod
    def backward(ctx, g):
        a, h = ctx.saved_tensors
        g = g.clone()
        for t in range(g.size(1) - 2, -1, -1):
            g[:, t].add_(a[:, t + 1] * g[:, t + 1])
        norm = g.abs().sum() / (a > 1).sum()  # BACKWARD-DIV: no decay above 1, x / 0
        ga = torch.zeros_like(a)
        ga[:, 1:] = h[:, :-1] * g[:, 1:] * norm
        return ga, g


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.a_log = nn.Parameter(torch.full((8, 4), -1.0))

    def forward(self, x):
        a = torch.exp(self.a_log).expand(x.size(0), -1, -1)
        return Scan.apply(a, self.proj(x))


def _line(marker: str) -> int:
    text = open(__file__).read().splitlines()
    return next(i for i, s in enumerate(text, 1) if s.rstrip().endswith(marker) and "def " not in s)


@pytest.mark.parametrize("backend", ["native", "python"])
def test_backward_ops_of_a_function_are_at_its_backward_lines(tmp_path, backend):
    torch.manual_seed(0)
    model = Block()
    x = torch.randn(2, 8, 4)
    with tg.record(tmp_path / "r", buffer=-1, backend=backend):
        model(x).pow(2).mean().backward()
    assert not model.a_log.grad.isfinite().all()
    run = open_run(tmp_path / "r")
    div = run.executions(op="div.Tensor", phase="backward")
    assert len(div) == 1
    frame = run.user_frame(div[0]["stack_id"])
    assert (frame["filename"], frame["lineno"], frame["name"]) == (__file__, _line("# BACKWARD-DIV: no decay above 1, x / 0"), "backward")
    assert div[0]["module"] == ""  # the module whose forward applied the Function (the root)
    assert div[0]["fwd_seq"] is None  # no forward op made the Function's node
    o = origin(run).origin
    assert (o.op, o.phase, o.line) == ("aten.div.Tensor", "backward", _line("# BACKWARD-DIV: no decay above 1, x / 0"))
    assert o.forward_op is None  # not "the gradient of clone"
