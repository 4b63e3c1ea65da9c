"""Broken: a hand-written RNN cell (``h = relu(W_x x_t + W_h h)`` in a Python loop over 30 time
steps) with recurrent weights at 1.2x the identity and no gradient clipping. Back-
propagation through time multiplies the gradient by ``W_h`` at every time step, so the gradient
reaching early time steps is orders of magnitude larger than at the last one; the first update
blows the input weights up. Read off the parameters alone, that looks like exploding activations,
vanishing gradients between layers and (some seeds) a learning rate too high; the gradient norm
growing time step over time step through the loop is the cause.

Expected finding: ``gradient_explodes_through_time``, explaining ``vanishing_gradient`` and ``exploding_activations``.
"""

import torch
import torch.nn.functional as F
from _common import log, parse_args
from torch import nn

GAIN = 3.0


class Cell(nn.Module):
    def __init__(self, dim_in: int, hidden: int):
        super().__init__()
        self.inp = nn.Linear(dim_in, hidden)
        self.rec = nn.Linear(hidden, hidden, bias=False)
        with torch.no_grad():
            self.rec.weight.normal_(0.0, GAIN / hidden**0.5)

    def forward(self, x, h):
        return torch.tanh(self.inp(x) + self.rec(h))


class Net(nn.Module):
    def __init__(self, dim_in: int = 4, hidden: int = 32):
        super().__init__()
        self.hidden = hidden
        self.cell = Cell(dim_in, hidden)
        self.head = nn.Linear(hidden, 1)

    def forward(self, x):
        h = x.new_zeros(x.shape[0], self.hidden)
        for t in range(x.shape[1]):  # the recurrent loop: one cell call per time step
            h = self.cell(x[:, t], h)
        return self.head(h)


def main(argv=None):
    args = parse_args(80, argv)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    for step in range(args.steps):
        x = torch.randn(32, 60, 4, generator=gen)
        y = x[:, :, 0].mean(1, keepdim=True)
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        log(args, step, loss.item())


if __name__ == "__main__":
    main()
