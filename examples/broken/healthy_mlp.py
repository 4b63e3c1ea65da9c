"""Healthy: a ReLU MLP with dropout, Adam, and a held-out evaluation in eval mode.

Expected: no warning-level finding (verdict ``healthy``).
"""

import torch
import torch.nn.functional as F
from _common import Teacher, log, mlp, parse_args


def main(argv=None):
    args = parse_args(200, argv)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    task = Teacher()
    model = mlp([task.dim, 64, 64, task.classes], dropout=0.1)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for step in range(args.steps):
        x, y = task.batch(64, gen)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        log(args, step, loss.item())
        if step % 50 == 49:
            model.eval()
            with torch.no_grad():
                xv, yv = task.batch(256, gen)
                acc = (model(xv).argmax(1) == yv).float().mean().item()
            model.train()
            if not args.quiet:
                print(f"step {step:4d}  eval accuracy {acc:.3f}")


if __name__ == "__main__":
    main()
