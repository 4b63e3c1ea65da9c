"""Broken: the model ends in ``nn.Softmax`` and its probabilities go to ``nn.CrossEntropyLoss``,
which applies log_softmax again: the scores are squashed twice and the gradients shrink.

Expected finding: ``softmax_before_cross_entropy``.
"""

import torch
from _common import Teacher, log, mlp, parse_args
from torch import nn


def main(argv=None):
    args = parse_args(150, argv)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    task = Teacher()
    model = nn.Sequential(mlp([task.dim, 64, 64, task.classes]), nn.Softmax(dim=1))
    loss_fn = nn.CrossEntropyLoss()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for step in range(args.steps):
        x, y = task.batch(64, gen)
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        log(args, step, loss.item())


if __name__ == "__main__":
    main()
