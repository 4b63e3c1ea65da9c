"""Broken: one corrupted batch (inputs scaled by 100, as from a unit bug in one data shard)
makes the loss jump far above its trend for a step.

Expected finding: ``loss_spike``.
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
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    bad = (2 * args.steps) // 3
    for step in range(args.steps):
        x, y = task.batch(64, gen)
        if step == bad:
            x = 100.0 * x
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        log(args, step, loss.item())


if __name__ == "__main__":
    main()
