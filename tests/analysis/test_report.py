"""The report's data (``build_report``), on small real recordings."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

import trainguard as tg
from trainguard.analysis import build_report
from trainguard.store import open_run


class _CausalBoW(nn.Module):
    """karpathy/makemore makemore.py's CausalBoW: a causal average by a -inf mask and softmax."""

    def __init__(self, t: int = 6, c: int = 4):
        super().__init__()
        self.register_buffer("bias", torch.tril(torch.ones(t, t)).view(1, t, t))
        self.proj = nn.Linear(c, c)

    def forward(self, x):
        t = x.size(1)
        att = torch.zeros(x.size(0), t, t)
        att = att.masked_fill(self.bias[:, :t, :t] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        return self.proj(att @ x)


def test_intended_infinities_of_training_and_inference_are_one_line(tmp_path):
    """makemore trains with grad (softmax is recorded as aten._softmax) and evaluates under
    inference_mode (aten.softmax.int, not decomposed there): the same mask, absorbed by the same
    softmax, is one count, not two lines that read the same."""
    torch.manual_seed(0)
    model = _CausalBoW()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(2, 6, 4)
    with tg.record(tmp_path / "run"):
        for _ in range(2):
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
        with torch.inference_mode():
            model(x)
    rep = build_report(open_run(tmp_path / "run"))
    assert rep["intended"] == ["90 intended -inf from masked_fill, absorbed by softmax"]  # 3 forwards x 2 rows x 15
