"""Broken: ``optimizer.zero_grad()`` is never called, so every step adds to the old gradients.

Expected finding: ``gradients_accumulating``.
"""

import torch
import torch.nn.functional as F
from _common import Teacher, log, mlp, parse_args


def main(argv=None):
    args = parse_args(100, argv)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    task = Teacher()
    model = mlp([task.dim, 64, task.classes])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(args.steps):
        x, y = task.batch(64, gen)
        loss = F.cross_entropy(model(x), y)
        loss.backward()  # the missing opt.zero_grad() belongs before this line
        opt.step()
        log(args, step, loss.item())


if __name__ == "__main__":
    main()
