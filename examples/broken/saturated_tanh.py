"""Broken: a tanh MLP initialised with N(0, 1) weights: pre-activations have std ~8, so most tanh
units sit at +-1 where their gradient is nearly zero.

Expected finding: ``saturated_activations`` (fix: Xavier/Glorot initialisation).
"""

import torch
import torch.nn.functional as F
from _common import Teacher, log, mlp, parse_args
from torch import nn


def main(argv=None):
    args = parse_args(120, argv)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    task = Teacher()
    model = mlp([task.dim, 64, 64, task.classes], act=nn.Tanh)
    for m in model:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=1.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(args.steps):
        x, y = task.batch(64, gen)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        log(args, step, loss.item())


if __name__ == "__main__":
    main()
