"""Broken: after the first validation the loop never calls ``model.train()`` again, so dropout
and batch norm run in inference mode for the rest of training.

Expected finding: ``eval_mode_in_training``.
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
        if step == 19:
            model.eval()
            with torch.no_grad():
                xv, yv = task.batch(256, gen)
                acc = (model(xv).argmax(1) == yv).float().mean().item()
            if not args.quiet:
                print(f"eval accuracy {acc:.3f}")
            # missing: model.train()


if __name__ == "__main__":
    main()
