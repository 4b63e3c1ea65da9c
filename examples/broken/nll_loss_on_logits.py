"""Broken: ``nn.NLLLoss`` on the raw scores of the last layer, without ``log_softmax``: the loss
just pushes the true class's score up, without bound (it goes negative and keeps falling).

Expected finding: ``nll_loss_on_logits``.
"""

import torch
from _common import Teacher, log, mlp, parse_args
from torch import nn


def main(argv=None):
    args = parse_args(150, argv)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    task = Teacher()
    model = mlp([task.dim, 64, 64, task.classes])
    loss_fn = nn.NLLLoss()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for step in range(args.steps):
        x, y = task.batch(64, gen)
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        log(args, step, loss.item())


if __name__ == "__main__":
    main()
