"""Broken: the labels are drawn independently of the inputs (a shuffling bug in the pipeline),
so there is nothing to learn and the loss stays at ln(classes).

Expected finding: ``loss_not_decreasing``.
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
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for step in range(args.steps):
        x, _ = task.batch(64, gen)
        y = torch.randint(0, task.classes, (64,), generator=gen)  # bug: labels not tied to inputs
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        log(args, step, loss.item())


if __name__ == "__main__":
    main()
