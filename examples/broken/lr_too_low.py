"""Broken: plain SGD with a learning rate of 1e-5: each step moves the weights by about 2e-6 of
their norm, so the loss stays where it started. The flat loss is the symptom; the
update-to-weight ratio says why.

Expected finding: ``lr_too_low``, explaining ``loss_not_decreasing``.
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
