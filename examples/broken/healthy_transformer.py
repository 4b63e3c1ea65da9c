"""Healthy: one pre-norm transformer block (attention, LayerNorm, GELU MLP) with AdamW and warmup.

Expected: no warning-level finding (verdict ``healthy``).
"""

import torch
import torch.nn.functional as F
from _common import Sequences, log, parse_args
from torch import nn


class Block(nn.Module):
    def __init__(self, d: int = 32, heads: int = 4):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class Net(nn.Module):
    def __init__(self, vocab: int, length: int, classes: int, d: int = 32):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(0.02 * torch.randn(length, d))
        self.block = Block(d)
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        h = self.block(self.embed(x) + self.pos)
        return self.head(self.ln(h).mean(1))


def main(argv=None):
    args = parse_args(150, argv)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    task = Sequences()
    model = Net(task.vocab, task.length, task.vocab)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))
    for step in range(args.steps):
        x, y = task.batch(32, gen)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        sched.step()
        log(args, step, loss.item())


if __name__ == "__main__":
    main()
