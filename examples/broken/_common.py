"""Shared helpers of the gallery: small synthetic tasks that a healthy model learns in seconds.

Every batch is freshly sampled (an endless data set), so the loss curve carries minibatch noise
but no epoch pattern. The task itself (the "teacher") is fixed by ``TASK_SEED``.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

TASK_SEED = 1234


def parse_args(default_steps: int, argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=default_steps, help="training steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="do not print the loss")
    return p.parse_args(argv)


def log(args, step: int, loss: float, every: int = 20) -> None:
    if not args.quiet and step % every == 0:
        print(f"step {step:4d}  loss {loss:.4f}")


class Teacher:
    """Classification: labels from a fixed random two-layer network over Gaussian inputs."""

    def __init__(self, dim: int = 20, classes: int = 5, hidden: int = 32):
        g = torch.Generator().manual_seed(TASK_SEED)
        self.w1 = torch.randn(dim, hidden, generator=g) / dim**0.5
        self.w2 = torch.randn(hidden, classes, generator=g) / hidden**0.5
        self.dim = dim
        self.classes = classes

    def batch(self, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(n, self.dim, generator=gen)
        y = (torch.tanh(x @ self.w1) @ self.w2).argmax(1)
        return x, y


class Regression:
    """Regression: a fixed smooth function of Gaussian inputs plus a little noise."""

    def __init__(self, dim: int = 10, out: int = 1):
        g = torch.Generator().manual_seed(TASK_SEED + 1)
        self.w = torch.randn(dim, out, generator=g) / dim**0.5
        self.dim = dim

    def batch(self, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(n, self.dim, generator=gen)
        y = torch.sin(x @ self.w) + 0.05 * torch.randn(n, self.w.shape[1], generator=gen)
        return x, y


class Images:
    """8x8 single-channel images: one of four oriented bars at a random place, plus noise."""

    classes = 4

    def batch(self, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.randint(0, 4, (n,), generator=gen)
        x = 0.3 * torch.randn(n, 1, 8, 8, generator=gen)
        pos = torch.randint(1, 7, (n,), generator=gen)
        for i in range(n):
            k, p = int(y[i]), int(pos[i])
            if k == 0:
                x[i, 0, p, :] += 1.0
            elif k == 1:
                x[i, 0, :, p] += 1.0
            elif k == 2:
                x[i, 0].diagonal().add_(1.0)
            else:
                x[i, 0].flip(1).diagonal().add_(1.0)
        return x, y


class Sequences:
    """Token sequences; the label is the most frequent token among the first ``vocab`` kinds."""

    def __init__(self, vocab: int = 8, length: int = 12):
        self.vocab = vocab
        self.length = length

    def batch(self, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.randint(0, self.vocab, (n,), generator=gen)
        x = torch.randint(0, self.vocab, (n, self.length), generator=gen)
        extra = torch.rand(n, self.length, generator=gen) < 0.35
        x = torch.where(extra, y[:, None], x)
        return x, y


def mlp(dims: list[int], act: type[nn.Module] = nn.ReLU, dropout: float = 0.0) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i in range(len(dims) - 1):
        layers.append(nn.Linear(dims[i], dims[i + 1]))
        if i < len(dims) - 2:
            layers.append(act())
            if dropout:
                layers.append(nn.Dropout(dropout))
    return nn.Sequential(*layers)


def epochs(x: torch.Tensor, y: torch.Tensor, batch: int, n_epochs: int, gen: torch.Generator):
    """Minibatches of a fixed data set, reshuffled each epoch: yields (epoch, x, y)."""
    for epoch in range(n_epochs):
        order = torch.randperm(len(x), generator=gen)
        for i in range(0, len(x), batch):
            idx = order[i : i + batch]
            yield epoch, x[idx], y[idx]


def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int = 128) -> tuple[float, float]:
    """Mean cross-entropy and accuracy over (x, y), in eval mode under no_grad (the usual way)."""
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    model.eval()
    total, correct = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(x), batch):
            out = model(x[i : i + batch])
            total += loss_fn(out, y[i : i + batch]).item()
            correct += int((out.argmax(1) == y[i : i + batch]).sum())
    model.train()
    return total / len(x), correct / len(x)


def fit_with_validation(model: nn.Module, opt: torch.optim.Optimizer, train: tuple, val: tuple, args,
                        gen: torch.Generator, batch: int = 64) -> None:
    """``args.steps`` epochs of cross-entropy training on ``train``, evaluating on ``val`` at each
    epoch's end (and once after the last), as most scripts with a validation set do."""
    last = 0
    for epoch, x, y in epochs(*train, batch, args.steps, gen):
        if epoch != last:
            val_loss, val_acc = evaluate(model, *val)
            if not args.quiet:
                print(f"epoch {last}  val loss {val_loss:.4f}  accuracy {val_acc:.3f}")
            last = epoch
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    evaluate(model, *val)
