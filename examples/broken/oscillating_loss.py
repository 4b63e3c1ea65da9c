"""Broken: full-batch gradient descent with momentum 0.99 on a linear regression: the heavy
momentum overshoots the minimum back and forth, so the loss rises and falls in regular swings
instead of settling.

Expected finding: ``loss_oscillating``.
"""

import torch
import torch.nn.functional as F
from _common import Regression, log, parse_args
from torch import nn


def main(argv=None):
    args = parse_args(150, argv)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    task = Regression()
    x, y = task.batch(256, gen)
    model = nn.Linear(task.dim, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.99)
    for step in range(args.steps):
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        log(args, step, loss.item())


if __name__ == "__main__":
    main()
