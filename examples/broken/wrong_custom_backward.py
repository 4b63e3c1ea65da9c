"""Broken: a hand-written ``torch.autograd.Function`` (a Swish activation, ``x * sigmoid(x)``)
whose ``backward`` forgets the product rule: it returns ``sigmoid(x)`` instead of
``sigmoid(x) + x * sigmoid(x) * (1 - sigmoid(x))``. Training still runs, on wrong gradients.

Expected finding: ``custom_gradient_wrong``.
"""

import torch
import torch.nn.functional as F
from _common import Teacher, log, parse_args
from torch import nn


class Swish(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        s = torch.sigmoid(x)
        ctx.save_for_backward(s)
        return x * s

    @staticmethod
    def backward(ctx, grad):
        (s,) = ctx.saved_tensors
        return grad * s  # WRONG: d/dx x*s(x) = s + x * s * (1 - s)


class SwishMLP(nn.Module):
    def __init__(self, dims):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))

    def forward(self, x):
        for layer in self.layers[:-1]:
            x = Swish.apply(layer(x))
        return self.layers[-1](x)


def main(argv=None):
    args = parse_args(150, argv)
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
