"""Broken: a ReLU RNN unrolled over 40 steps, recurrent weights at 0.9x identity, no gradient clipping.

Back-propagation through time multiplies the gradient by the recurrent matrix at every step; as
the recurrent weights drift above 1 the gradient norm jumps by orders of magnitude ("cliffs")
and then overflows.
Expected finding: ``exploding_gradient`` (fix: ``clip_grad_norm_`` at the suggested value).
"""

import torch
import torch.nn.functional as F
from _common import log, parse_args
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.RNN(4, 32, nonlinearity="relu", batch_first=True)
        with torch.no_grad():
            self.rnn.weight_hh_l0.copy_(0.9 * torch.eye(32))
        self.head = nn.Linear(32, 1)

    def forward(self, x):
        out, _ = self.rnn(x)
        return self.head(out[:, -1])


def main(argv=None):
    args = parse_args(80, argv)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=3e-3)
    for step in range(args.steps):
        x = torch.randn(32, 40, 4, generator=gen)
        y = x[:, :, 0].sum(1, keepdim=True)
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        log(args, step, loss.item())


if __name__ == "__main__":
    main()
