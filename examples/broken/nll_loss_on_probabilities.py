"""Broken: ``F.nll_loss`` on ``softmax`` outputs: it expects log-probabilities, so it minimises
``-p`` of the true class instead of ``-log p``.

Expected finding: ``nll_loss_on_probabilities``.
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
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for step in range(args.steps):
        x, y = task.batch(64, gen)
        opt.zero_grad()
        probs = F.softmax(model(x), dim=1)
        loss = F.nll_loss(probs, y)
        loss.backward()
        opt.step()
        log(args, step, loss.item())


if __name__ == "__main__":
    main()
