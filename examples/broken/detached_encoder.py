"""Broken: the encoder's output is ``.detach()``-ed, so the encoder is frozen by mistake: its
parameters are in the optimizer but never receive a gradient.

Expected finding: ``param_no_gradient``.
"""

import torch
import torch.nn.functional as F
from _common import Teacher, log, parse_args
from torch import nn


class Net(nn.Module):
    def __init__(self, dim: int, classes: int):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(dim, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.head = nn.Linear(64, classes)

    def forward(self, x):
        h = self.encoder(x).detach()  # meant for logging, but it cuts the graph
        return self.head(h)


def main(argv=None):
    args = parse_args(100, argv)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    task = Teacher()
    model = Net(task.dim, task.classes)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for step in range(args.steps):
        x, y = task.batch(64, gen)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        log(args, step, loss.item())


if __name__ == "__main__":
    main()
