"""Broken: a distance loss ``sqrt(sum((a - b)**2))`` where some pairs are identical.

``sqrt`` at exactly 0 is finite in the forward pass but its gradient is ``0 * inf = NaN``; the
loss is finite at the step the gradients turn NaN and NaN from the next step on.
Expected finding: ``nonfinite_gradient`` (fix: ``sqrt(x + eps)`` or ``clamp(min=eps)``).
"""

import torch
from _common import log, mlp, parse_args


def main(argv=None):
    args = parse_args(60, argv)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    model = mlp([16, 32, 8])
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(args.steps):
        a = torch.randn(32, 16, generator=gen)
        b = a + 0.1 * torch.randn(32, 16, generator=gen)
        if step >= 10:
            b[:4] = a[:4]  # duplicated pairs from the data pipeline: distance exactly 0
        opt.zero_grad()
        dist = torch.sqrt(((model(a) - model(b)) ** 2).sum(1))
        loss = dist.mean()
        loss.backward()
        opt.step()
        log(args, step, loss.item())


if __name__ == "__main__":
    main()
