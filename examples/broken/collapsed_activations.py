"""Broken: a deep tanh MLP initialised with weights of std 1e-3: the signal shrinks ~100x per layer.

By the fourth layer every sample produces the same activation (std ~1e-9).
Expected finding: ``collapsed_activations`` (fix: Xavier/Glorot initialisation for tanh).
"""

import torch
import torch.nn.functional as F
from _common import Teacher, log, mlp, parse_args
from torch import nn


def main(argv=None):
    args = parse_args(100, argv)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    task = Teacher()
    model = mlp([task.dim] + [64] * 5 + [task.classes], act=nn.Tanh)
    for m in model:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=1e-3)
            nn.init.zeros_(m.bias)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(args.steps):
        x, y = task.batch(64, gen)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        log(args, step, loss.item())


if __name__ == "__main__":
    main()
