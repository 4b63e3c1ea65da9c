"""Broken: a hand-written cross-entropy ``-(onehot * log(softmax(logits)))`` on over-confident logits.

Once a probability underflows to exactly 0, ``log`` gives -inf and ``0 * -inf`` gives NaN.
Expected finding: ``nonfinite_loss`` (fix: ``F.cross_entropy`` / ``log_softmax``, or clamp before log).
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
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(args.steps):
        x, y = task.batch(64, gen)
        opt.zero_grad()
        logits = 50.0 * model(x)  # a temperature bug: logits far too sharp
        probs = torch.softmax(logits, dim=1)
        loss = -(F.one_hot(y, task.classes) * torch.log(probs)).sum(1).mean()
        loss.backward()
        opt.step()
        log(args, step, loss.item())


if __name__ == "__main__":
    main()
