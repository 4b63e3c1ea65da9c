"""Broken: Adam with a learning rate of 0.3 (about 100x too large for this MLP).

Expected finding: ``lr_too_high``, explaining ``dead_units`` and ``exploding_activations``.
The loss does not settle, updates are a large fraction of the weights, and the units and
activations that were healthy at step 0 die or blow up under those updates.
"""

import torch
import torch.nn.functional as F
from _common import Teacher, log, mlp, parse_args


def main(argv=None):
    args = parse_args(150, argv)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    task = Teacher()
    model = mlp([task.dim, 64, 64, task.classes])
    opt = torch.optim.Adam(model.parameters(), lr=0.3)
    for step in range(args.steps):
        x, y = task.batch(64, gen)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        log(args, step, loss.item())


if __name__ == "__main__":
    main()
