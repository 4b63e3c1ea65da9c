"""Broken: a one-output regression head whose targets lost their last dimension (``y[:, 0]``, as a
CSV column read into a 1-D tensor): ``mse_loss`` of a ``[64, 1]`` prediction against ``[64]``
targets broadcasts to ``[64, 64]`` and compares every prediction with every target. torch only
warns; the model learns the batch mean of the targets and the loss stops at their variance.

Expected finding: ``loss_broadcast``.
"""

import warnings

import torch
import torch.nn.functional as F
from _common import Regression, log, mlp, parse_args
from torch import nn


def main(argv=None):
    args = parse_args(200, argv)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    task = Regression()
    model = mlp([task.dim, 64, 64, 1], act=nn.Tanh)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    warnings.filterwarnings("ignore", message="Using a target size")  # as a long log scrolls it away
    for step in range(args.steps):
        x, y = task.batch(64, gen)
        opt.zero_grad()
        loss = F.mse_loss(model(x), y[:, 0])
        loss.backward()
        opt.step()
        log(args, step, loss.item())


if __name__ == "__main__":
    main()
