"""Broken: a deep ReLU MLP initialised with N(0, 1) weights instead of N(0, 2/fan_in).

Each layer multiplies the activation scale by about sqrt(fan_in / 2) = 5.7: after six layers
the activations are in the thousands.
Expected finding: ``exploding_activations`` (fix: Kaiming initialisation).
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
    model = mlp([task.dim] + [64] * 6 + [task.classes])
    for m in model:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=1.0)
            nn.init.zeros_(m.bias)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    for step in range(args.steps):
        x, y = task.batch(64, gen)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        log(args, step, loss.item())


if __name__ == "__main__":
    main()
