"""Healthy: an embedding and a GRU classifying token sequences, Adam with gradient clipping.

Expected: no warning-level finding (verdict ``healthy``).
"""

import torch
import torch.nn.functional as F
from _common import Sequences, log, parse_args
from torch import nn


class Net(nn.Module):
    def __init__(self, vocab: int, classes: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, 16)
        self.rnn = nn.GRU(16, 32, batch_first=True)
        self.head = nn.Linear(32, classes)

    def forward(self, x):
        out, _ = self.rnn(self.embed(x))
        return self.head(out[:, -1])


def main(argv=None):
    args = parse_args(200, argv)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    task = Sequences()
    model = Net(task.vocab, task.vocab)
    opt = torch.optim.Adam(model.parameters(), lr=5e-3)
    for step in range(args.steps):
        x, y = task.batch(32, gen)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        log(args, step, loss.item())


if __name__ == "__main__":
    main()
