"""Small models and loops shared by the capture tests."""

from __future__ import annotations

import pytest
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(6, 6)
        self.act = nn.Tanh()

    def forward(self, x):
        return self.act(self.proj(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        for block in self.encoder:
            x = block(x)
        return self.head(x)


@pytest.fixture
def net():
    torch.manual_seed(0)
    return Net()


@pytest.fixture
def train():
    return train_steps


def train_steps(model, steps=2, lr=0.1):
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    x = torch.randn(4, 6)
    y = torch.randint(0, 3, (4,))
    for _ in range(steps):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
    return loss
