"""Healthy: an MLP with a hand-written ``torch.autograd.Function`` (a Swish activation with a
correct backward, and a straight-through rounding of the first activations, a surrogate gradient by
design), Adam. The live gradient check passes the first and skips the second.

Expected: no warning-level finding (verdict ``healthy``).
"""

import torch
import torch.nn.functional as F
from _common import Teacher, log, parse_args
from torch import nn


class Swish(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        s = torch.sigmoid(x)
        ctx.save_for_backward(x, s)
        return x * s

    @staticmethod
    def backward(ctx, grad):
        x, s = ctx.saved_tensors
        return grad * (s + x * s * (1 - s))


class RoundSTE(torch.autograd.Function):
    """Quantise to steps of 1/8; the gradient passes straight through."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x * 8) / 8

    @staticmethod
    def backward(ctx, grad):
        return grad


class SwishMLP(nn.Module):
    def __init__(self, dims):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))

    def forward(self, x):
        for i, layer in enumerate(self.layers[:-1]):
            x = Swish.apply(layer(x))
            if i == 0:
                x = RoundSTE.apply(x)  # quantised activations
        return self.layers[-1](x)


def main(argv=None):
    args = parse_args(200, argv)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    task = Teacher()
    model = SwishMLP([task.dim, 64, 64, task.classes])
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for step in range(args.steps):
        x, y = task.batch(64, gen)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        log(args, step, loss.item())


if __name__ == "__main__":
    main()
