"""A healthy setup for ``trainguard doctor``: an MLP on ten Gaussian clusters in 20 dimensions.

    trainguard doctor examples/doctor/blobs_mlp.py:setup --logdir runs/doctor-blobs

``setup()`` takes no arguments and returns what the doctor needs: the model, the training data
(an iterable of ``(inputs, targets)`` batches), the loss function, and optionally an optimizer
factory (for the LR range test), a test split (for leakage checks) and the number of classes.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

CLASSES = 10
FEATURES = 20


def make_blobs(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` samples around ten fixed centres (the centres are the same for every seed)."""
    centres = torch.randn(CLASSES, FEATURES, generator=torch.Generator().manual_seed(1234)) * 1.5
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, CLASSES, (n,), generator=g)
    x = centres[y] + torch.randn(n, FEATURES, generator=g)
    return x, y


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(FEATURES, 64), nn.ReLU(),
        nn.Linear(64, 64), nn.ReLU(),
        nn.Linear(64, CLASSES),
    )


def setup() -> dict:
    x_train, y_train = make_blobs(4096, seed=1)
    x_test, y_test = make_blobs(1024, seed=2)
    train = DataLoader(TensorDataset(x_train, y_train), batch_size=64, shuffle=True,
                       generator=torch.Generator().manual_seed(0))
    return {
        "model": model(),
        "data": train,
        "loss_fn": nn.CrossEntropyLoss(),
        "optimizer_factory": lambda params: torch.optim.Adam(params, lr=1e-3),
        "test": TensorDataset(x_test, y_test),
        "num_classes": CLASSES,
    }
