"""Broken: label smoothing by hand that forgets to take the mass off the true class
(``one_hot * 0.9 + 0.1``): each target row sums to 1.4, not 1, and ``cross_entropy`` trains
towards a distribution that does not exist.

Expected finding: ``cross_entropy_targets_not_probabilities``.
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
        target = F.one_hot(y, task.classes).float() * 0.9 + 0.1
        opt.zero_grad()
        loss = F.cross_entropy(model(x), target)
        loss.backward()
        opt.step()
        log(args, step, loss.item())


if __name__ == "__main__":
    main()
