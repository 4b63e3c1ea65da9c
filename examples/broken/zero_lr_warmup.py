"""Broken: a warmup schedule written with integer division, ``min(1, step // 500)``: the learning
rate factor is 0 for the first 500 steps, so the optimizer steps but no weight ever changes.

Expected finding: ``param_not_updating``.
"""

import torch
import torch.nn.functional as F
from _common import Teacher, log, mlp, parse_args


def main(argv=None):
    args = parse_args(100, argv)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    task = Teacher()
    model = mlp([task.dim, 64, 64, task.classes])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1, s // 500))  # bug: meant s / 500
    for step in range(args.steps):
        x, y = task.batch(64, gen)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        sched.step()
        log(args, step, loss.item())


if __name__ == "__main__":
    main()
