"""Broken: a regression head of one output unit trained with ``cross_entropy`` (as
pytorch/examples' ``distributed/ddp-tutorial-series`` does with ``nn.Linear(20, 1)`` and float
targets): ``log_softmax`` over one score is 0, so the loss is 0 and every gradient is 0, whatever
the model outputs. Nothing trains, and nothing crashes.

Expected finding: ``cross_entropy_one_class``, explaining ``loss_not_decreasing`` and ``param_zero_gradient``.
"""

import torch
import torch.nn.functional as F
from _common import Teacher, log, mlp, parse_args


def main(argv=None):
    args = parse_args(150, argv)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    task = Teacher()
    model = mlp([task.dim, 64, 1])
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    for step in range(args.steps):
        x, _ = task.batch(64, gen)
        target = torch.rand(64, 1, generator=gen)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), target)
        loss.backward()
        opt.step()
        log(args, step, loss.item())


if __name__ == "__main__":
    main()
