"""Broken: validation runs under ``torch.no_grad()`` but without ``model.eval()``: dropout is
still active and batch norm updates its running statistics with validation data.

Expected finding: ``train_mode_in_eval``.
"""

import torch
import torch.nn.functional as F
from _common import Teacher, log, parse_args
from torch import nn


def main(argv=None):
    args = parse_args(100, argv)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    task = Teacher()
    model = nn.Sequential(
        nn.Linear(task.dim, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Dropout(0.3), nn.Linear(64, task.classes)
    )
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for step in range(args.steps):
        x, y = task.batch(64, gen)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        log(args, step, loss.item())
        if step % 25 == 24:
            with torch.no_grad():  # missing: model.eval() before, model.train() after
                xv, yv = task.batch(256, gen)
                acc = (model(xv).argmax(1) == yv).float().mean().item()
            if not args.quiet:
                print(f"eval accuracy {acc:.3f}")


if __name__ == "__main__":
    main()
