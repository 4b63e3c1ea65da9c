"""Small forecasting models for the tests, derived from thuml/Time-Series-Library @4e938a1."""

from __future__ import annotations

from torch import nn


class DLinear(nn.Module):
    """models/DLinear.py (cure-lab/LTSF-Linear's), smaller: a moving-average trend (Autoformer's
    series_decomp) and one linear map over time each for the trend and the rest, shared by the
    channels; the output is linear in the parameters, by design.
    ``x``: [batch, seq_len, channels] -> [batch, pred_len, channels]."""

    def __init__(self, seq_len: int = 24, pred_len: int = 8, kernel: int = 5):
        super().__init__()
        self.avg = nn.AvgPool1d(kernel, stride=1, padding=kernel // 2, count_include_pad=False)
        self.seasonal, self.trend = nn.Linear(seq_len, pred_len), nn.Linear(seq_len, pred_len)

    def forward(self, x):
        x = x.permute(0, 2, 1)
        trend = self.avg(x)
        return (self.seasonal(x - trend) + self.trend(trend)).permute(0, 2, 1)
