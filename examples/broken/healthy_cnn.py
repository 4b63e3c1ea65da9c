"""Healthy: a small CNN (conv, batch norm, ReLU, pooling) trained with SGD and momentum.

Expected: no warning-level finding (verdict ``healthy``).
"""

import torch
import torch.nn.functional as F
from _common import Images, log, parse_args
from torch import nn


class Net(nn.Module):
    def __init__(self, classes: int):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(16)
        self.pool = nn.MaxPool2d(2)
        self.act = nn.ReLU()
        self.head = nn.Linear(16 * 2 * 2, classes)

    def forward(self, x):
        x = self.pool(self.act(self.bn1(self.conv1(x))))
        x = self.pool(self.act(self.bn2(self.conv2(x))))
        return self.head(x.flatten(1))


def main(argv=None):
    args = parse_args(150, argv)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    task = Images()
    model = Net(task.classes)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(args.steps):
        x, y = task.batch(32, gen)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        log(args, step, loss.item())
    model.eval()
    with torch.no_grad():
        xv, yv = task.batch(200, gen)
        acc = (model(xv).argmax(1) == yv).float().mean().item()
    if not args.quiet:
        print(f"eval accuracy {acc:.3f}")


if __name__ == "__main__":
    main()
