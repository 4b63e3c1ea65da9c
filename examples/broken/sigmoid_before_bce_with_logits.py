"""Broken: a binary classifier ends in ``torch.sigmoid`` and its probabilities go to
``nn.BCEWithLogitsLoss``, which applies the sigmoid again: outputs are stuck between 0.5 and 0.73.

Expected finding: ``sigmoid_before_bce_with_logits``.
"""

import torch
from _common import Teacher, log, mlp, parse_args
from torch import nn


def main(argv=None):
    args = parse_args(150, argv)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    task = Teacher()
    model = mlp([task.dim, 64, 64, 1])
    loss_fn = nn.BCEWithLogitsLoss()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for step in range(args.steps):
        x, y = task.batch(64, gen)
        target = (y == 0).float()[:, None]  # is it class 0?
        opt.zero_grad()
        prob = torch.sigmoid(model(x))
        loss = loss_fn(prob, target)
        loss.backward()
        opt.step()
        log(args, step, loss.item())


if __name__ == "__main__":
    main()
