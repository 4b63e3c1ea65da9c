"""Broken: raw pixel-like inputs in [0, 255] fed to an MLP without normalisation.

Expected finding: ``inputs_not_normalized`` (fix: subtract the observed mean, divide by the std).
"""

import torch
import torch.nn.functional as F
from _common import Teacher, log, mlp, parse_args


def main(argv=None):
    args = parse_args(100, argv)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    task = Teacher()
    model = mlp([task.dim, 64, task.classes])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for step in range(args.steps):
        x, y = task.batch(64, gen)
        x = (127.5 + 40.0 * x).clamp(0, 255)  # bug: raw 0..255 values
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        log(args, step, loss.item())


if __name__ == "__main__":
    main()
