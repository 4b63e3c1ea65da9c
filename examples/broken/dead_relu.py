"""Broken: ReLU layers whose biases were initialised to -2: most units never fire.

Expected finding: ``dead_units`` (fix: Kaiming init with zero bias, or ``trainguard.fix.revive_dead_units``).
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
    model = mlp([task.dim, 128, 128, task.classes])
    for m in list(model)[:-1]:
        if isinstance(m, nn.Linear):
            nn.init.constant_(m.bias, -2.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(args.steps):
        x, y = task.batch(64, gen)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        log(args, step, loss.item())


if __name__ == "__main__":
    main()
