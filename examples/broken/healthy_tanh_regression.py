"""Healthy: a tanh MLP (Xavier initialisation) fitting a regression target with SGD.

Expected: no warning-level finding (verdict ``healthy``).
"""

import torch
import torch.nn.functional as F
from _common import Regression, log, mlp, parse_args
from torch import nn


def main(argv=None):
    args = parse_args(200, argv)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    task = Regression()
    model = mlp([task.dim, 64, 64, 1], act=nn.Tanh)
    for m in model:
        if isinstance(m, nn.Linear):
            nn.init.xavier_uniform_(m.weight)
            nn.init.zeros_(m.bias)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(args.steps):
        x, y = task.batch(64, gen)
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        log(args, step, loss.item())


if __name__ == "__main__":
    main()
