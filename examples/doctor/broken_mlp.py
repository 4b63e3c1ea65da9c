"""A broken setup for ``trainguard doctor``: every check has something to find.

    trainguard doctor examples/doctor/broken_mlp.py:setup --logdir runs/doctor-broken

- the inputs are in raw units (one feature in the thousands), far from normalised;
- 50 test samples were copied from the training set (leakage);
- one class has 12x fewer samples than another;
- the model detaches its hidden layer, so no gradient reaches the first layer;
- a hand-written linear layer's ``backward`` scales the weight gradient by 2.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

FEATURES = 20
CLASSES = 3


class BadLinearFn(torch.autograd.Function):
    """y = x @ w.T + b, with a wrong weight gradient (twice the true one)."""

    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w)
        return x @ w.t() + b

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        return grad @ w, 2 * grad.t() @ x, grad.sum(0)


class BrokenMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(FEATURES, 8), nn.ReLU())
        self.head = nn.Linear(8, CLASSES)

    def forward(self, x):
        h = self.encoder(x).detach()  # the bug: nothing upstream of here learns
        return BadLinearFn.apply(h, self.head.weight, self.head.bias)


def setup() -> dict:
    g = torch.Generator().manual_seed(0)
    counts = [1200, 600, 100]  # 12:1 between the largest and smallest class
    y = torch.cat([torch.full((n,), c) for c, n in enumerate(counts)])
    centres = torch.randn(CLASSES, FEATURES, generator=g)
    x = centres[y] + torch.randn(len(y), FEATURES, generator=g)
    x[:, 3] = x[:, 3] * 1000 + 5000  # one feature in raw units
    perm = torch.randperm(len(y), generator=g)
    x, y = x[perm], y[perm]
    x_test = torch.randn(300, FEATURES, generator=g)
    y_test = torch.randint(0, CLASSES, (300,), generator=g)
    x_test[:50], y_test[:50] = x[:50], y[:50]  # leaked from training
    torch.manual_seed(0)
    return {
        "model": BrokenMLP(),
        "data": DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True,
                           generator=torch.Generator().manual_seed(0)),
        "loss_fn": nn.CrossEntropyLoss(),
        "test": (x_test, y_test),
    }
