"""Healthy: fine-tuning a new head on a frozen encoder (requires_grad=False, its batch norm kept in
eval mode on purpose), with gradient accumulation over 4 micro-batches per optimizer step.

Expected: no warning-level finding (verdict ``healthy``; an info finding lists the frozen parameters).
"""

import torch
import torch.nn.functional as F
from _common import Teacher, log, parse_args
from torch import nn


class Net(nn.Module):
    def __init__(self, dim: int, classes: int):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(dim, 64), nn.BatchNorm1d(64), nn.ReLU())
        self.head = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, classes))

    def forward(self, x):
        return self.head(self.encoder(x))


def main(argv=None):
    args = parse_args(150, argv)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    task = Teacher()
    model = Net(task.dim, task.classes)
    for p in model.encoder.parameters():
        p.requires_grad_(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    micro = 4
    for step in range(args.steps):
        model.train()
        model.encoder.eval()  # frozen: keep its batch-norm statistics fixed
        opt.zero_grad()
        total = 0.0
        for _ in range(micro):
            x, y = task.batch(16, gen)
            loss = F.cross_entropy(model(x), y) / micro
            loss.backward()
            total += loss.item()
        opt.step()
        log(args, step, total)


if __name__ == "__main__":
    main()
