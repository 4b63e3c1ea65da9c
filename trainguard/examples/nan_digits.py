"""The reference scenario: a classifier whose hand-written cross-entropy turns the loss NaN.

An MLP learns the 8x8 handwritten digits with ``-(onehot * log(softmax(logits)))``. The pixels
are not normalised (0..16) and the learning rate is high, so within a few steps the logits grow
until ``softmax`` underflows to exact zeros; ``log(0)`` is ``-inf``, ``0 * -inf`` is NaN, the
gradients and then the weights become NaN, and accuracy falls to chance (about 10%).

Run it plainly, or under the recorder and read the report::

    python -m trainguard.examples.nan_digits
    trainguard run --logdir runs/digits trainguard/examples/nan_digits.py
    trainguard report runs/digits

``--fixed`` clamps the probabilities before the log (the fix the report suggests): the loss
stays finite and the report is clean.
"""

from __future__ import annotations

import argparse
import gzip
import os

import numpy as np
import torch
from torch import nn

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "digits.csv.gz")


def load_digits() -> tuple[torch.Tensor, torch.Tensor]:
    """The 1,797 digits as float pixels in 0..16 (deliberately not normalised) and int labels."""
    with gzip.open(DATA, "rt") as fh:
        table = np.loadtxt(fh, delimiter=",", dtype=np.float32)
    return torch.from_numpy(table[:, :-1].copy()), torch.from_numpy(table[:, -1].astype(np.int64))


class MLP(nn.Module):
    def __init__(self, hidden: int = 64):
        super().__init__()
        self.fc1 = nn.Linear(64, hidden)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(hidden, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, fixed: bool = False) -> torch.Tensor:
    """The hand-written loss. Its ``log`` is where the first -inf appears."""
    probs = torch.softmax(logits, dim=1)
    onehot = nn.functional.one_hot(labels, 10).to(probs.dtype)
    if fixed:
        probs = probs.clamp(min=1e-6, max=1.0)
    return -(onehot * torch.log(probs)).sum(dim=1).mean()


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(x).argmax(dim=1) == y).float().mean())


def train(steps: int = 30, lr: float = 0.1, batch: int = 128, fixed: bool = False, seed: int = 8) -> list[dict]:
    """Train and return per-step history: step, loss, test accuracy.

    The defaults (seed 8, lr 0.1) make the loss turn NaN at step 2; with ``fixed=True`` the same
    run stays finite and reaches about 60% test accuracy in 30 steps.
    """
    torch.manual_seed(seed)
    x, y = load_digits()
    order = torch.randperm(len(x))
    x, y = x[order], y[order]
    x_train, y_train, x_test, y_test = x[:1400], y[:1400], x[1400:], y[1400:]
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    history = []
    for step in range(steps):
        i = (step * batch) % (len(x_train) - batch)
        xb, yb = x_train[i : i + batch], y_train[i : i + batch]
        opt.zero_grad()
        loss = cross_entropy(model(xb), yb, fixed=fixed)
        loss.backward()
        opt.step()
        history.append({"step": step, "loss": float(loss.detach()), "accuracy": accuracy(model, x_test, y_test)})
    return history


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--fixed", action="store_true", help="clamp the probabilities before the log")
    args = parser.parse_args(argv)
    for h in train(steps=args.steps, lr=args.lr, fixed=args.fixed):
        print(f"step {h['step']:3d}  loss {h['loss']:10.4f}  test accuracy {h['accuracy']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
