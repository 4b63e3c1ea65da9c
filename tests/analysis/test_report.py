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


class _RMSNorm(nn.Module):
    """alxndrTL/mamba.py's RMSNorm (mambapy/mamba.py): x * rsqrt(mean(x^2) + eps) * weight."""

    def __init__(self, d: int = 4, eps: float = 1e-5):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def test_an_overflow_absorbed_by_arithmetic_is_not_called_intended(tmp_path):
    """Found on mamba.py with dt_proj's bias at 1e38: RMSNorm's x.pow(2) overflowed, rsqrt(inf) gave 0,
    the block's outputs were 0 and the loss sat at ln(vocab). The report called the overflow
    "intended +inf from pow, absorbed by rsqrt", a word for masks and sentinels a program writes."""
    model = nn.Sequential(nn.Linear(4, 4), _RMSNorm(), nn.Linear(4, 3))
    with torch.no_grad():
        model[0].bias.fill_(1e20)  # finite, but its square is beyond float32
    with tg.record(tmp_path / "run"):
        F.cross_entropy(model(torch.randn(2, 4)), torch.tensor([0, 1])).backward()
    [line] = build_report(open_run(tmp_path / "run"))["intended"]
    assert "from pow, absorbed by rsqrt" in line and "intended" not in line, line
