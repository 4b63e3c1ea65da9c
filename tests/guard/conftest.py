"""Small models and data for the guard tests: a poisoned batch, a spike, a bug in the code."""

from __future__ import annotations

import inspect
import random

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import trainguard as tg

BS = 4


class PolyNet(nn.Module):
    """Polynomial features: an input of 1e20 overflows to inf in ``x.pow(2)``, in the forward pass."""

    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.drop = nn.Dropout(dropout)
        self.out = nn.Linear(16, 1)

    def forward(self, x):
        feats = torch.cat([x, x.pow(2)], dim=-1)  # POW_LINE
        return self.out(self.drop(torch.relu(self.fc(feats))))


def line_of(marker: str, obj=PolyNet) -> int:
    lines, start = inspect.getsourcelines(obj)
    return start + next(i for i, text in enumerate(lines) if marker in text)


def make_data(n_batches: int, *, poison_batch: int | None = None, poison_sample: int | None = None,
              spike_batch: int | None = None, seed: int = 1234) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_batches * BS, 4, generator=g)
    y = torch.randn(n_batches * BS, 1, generator=g)
    if poison_batch is not None:
        x[poison_batch * BS:(poison_batch + 1) * BS] = 1e20
    if poison_sample is not None:
        x[poison_sample] = 1e20
    if spike_batch is not None:
        y[spike_batch * BS:(spike_batch + 1) * BS] *= 1000.0  # labels scaled up: a huge but finite loss
    return TensorDataset(x, y)


def make_state(data: TensorDataset, *, seed: int = 0, dropout: float = 0.0, shuffle: bool = False,
               num_workers: int = 0, lr: float = 1e-2, model: nn.Module | None = None) -> tg.TrainState:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    model = model if model is not None else PolyNet(dropout)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=30, gamma=0.5)
    loader = DataLoader(data, batch_size=BS, shuffle=shuffle, num_workers=num_workers)
    return tg.TrainState(model=model, optimizer=opt, scheduler=sched, loader=loader)


def train(batches, state: tg.TrainState, *, log: list | None = None, loss_fn=None) -> list[int]:
    """The user's loop body; returns the steps in the order the loop handed them out."""
    seen = []
    for step, (x, y) in batches:
        seen.append(step)
        out = state.model(x)
        loss = loss_fn(out, y, step) if loss_fn is not None else nn.functional.mse_loss(out, y)
        state.optimizer.zero_grad()
        loss.backward()
        state.optimizer.step()
        state.scheduler.step()
        if log is not None:
            log.append((step, loss.item()))
    return seen


def finite(state: tg.TrainState) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in state.model.parameters())


def params(state: tg.TrainState) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in state.model.state_dict().items()}


def assert_bitwise(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs"


@pytest.fixture(autouse=True)
def _no_default_guard():
    from trainguard.resilience import set_default_guard

    previous = set_default_guard(None)
    yield
    set_default_guard(previous)
