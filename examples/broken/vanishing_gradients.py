"""Broken: a 10-layer sigmoid MLP: each sigmoid scales the gradient by at most 1/4 on the way back.

Expected finding: ``vanishing_gradient`` (the first layer's gradients are orders of magnitude
smaller than the last layer's).
"""

import torch
import torch.nn.functional as F
from _common import Teacher, log, mlp, parse_args
from torch import nn


def main(argv=None):
    args = parse_args(150, argv)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    task = Teacher()
    model = mlp([task.dim] + [64] * 10 + [task.classes], act=nn.Sigmoid)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(args.steps):
        x, y = task.batch(64, gen)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        log(args, step, loss.item())


if __name__ == "__main__":
    main()
