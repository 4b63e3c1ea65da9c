"""Broken: the classifier head is replaced after the optimizer was built, so the new head's
parameters get gradients but no optimizer ever updates them.

Expected finding: ``param_not_in_optimizer``.
"""

import torch
import torch.nn.functional as F
from _common import Teacher, log, parse_args
from torch import nn


class Net(nn.Module):
    def __init__(self, dim: int, classes: int):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(dim, 64), nn.ReLU())
        self.head = nn.Linear(64, classes)

    def forward(self, x):
        return self.head(self.body(x))


def main(argv=None):
    args = parse_args(100, argv)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    task = Teacher()
    model = Net(task.dim, task.classes)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.head = nn.Linear(64, task.classes)  # "fresh head" added after the optimizer was created
    for step in range(args.steps):
        x, y = task.batch(64, gen)
        opt.zero_grad()
        model.head.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        log(args, step, loss.item())


if __name__ == "__main__":
    main()
