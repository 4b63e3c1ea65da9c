"""Broken: plain SGD with a learning rate of 1e-5: the weights barely move.

Expected finding: ``lr_too_low``.
"""

import torch
import torch.nn.functional as F
from _common import Teacher, log, mlp, parse_args


def main(argv=None):
    args = parse_args(150, argv)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    task = Teacher()
    model = mlp([task.dim, 64, 64, task.classes])
    opt = torch.optim.SGD(model.parameters(), lr=1e-5)
    for step in range(args.steps):
        x, y = task.batch(64, gen)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        log(args, step, loss.item())


if __name__ == "__main__":
    main()
