"""Small real models for the true-origin tests: healthy ones with intended infinities, faulty ones.

``TinyGPT`` is derived from karpathy/nanoGPT's ``model.py`` (MIT licence; CausalSelfAttention,
MLP, Block, GPT, cut down to a few hundred parameters): the same hand-written causal mask
``att.masked_fill(mask == 0, float('-inf'))`` before ``F.softmax``, or the same
``F.scaled_dot_product_attention(..., is_causal=True)`` call, plus an optional key-padding mask
filled with -inf (what minGPT-style code adds for padded batches). No weights are downloaded:
everything is random-init on synthetic tokens.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

VOCAB, BLOCK, EMBD, HEADS, LAYERS = 32, 8, 16, 2, 2
PAD = 0


class CausalSelfAttention(nn.Module):
    def __init__(self, flash: bool, dropout: float = 0.0):
        super().__init__()
        self.dropout = dropout
        self.c_attn = nn.Linear(EMBD, 3 * EMBD)
        self.c_proj = nn.Linear(EMBD, EMBD)
        self.flash = flash
        self.register_buffer("bias", torch.tril(torch.ones(BLOCK, BLOCK)).view(1, 1, BLOCK, BLOCK))

    def forward(self, x, pad=None):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(EMBD, dim=2)
        k = k.view(B, T, HEADS, C // HEADS).transpose(1, 2)
        q = q.view(B, T, HEADS, C // HEADS).transpose(1, 2)
        v = v.view(B, T, HEADS, C // HEADS).transpose(1, 2)
        if self.flash:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, is_causal=True,
                                               dropout_p=self.dropout if self.training else 0.0)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))  # CAUSAL MASK
            if pad is not None:
                att = att.masked_fill(pad[:, None, None, :], float("-inf"))  # PADDING MASK
            att = F.softmax(att, dim=-1)  # SOFTMAX LINE
            y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class Block(nn.Module):
    def __init__(self, flash: bool, dropout: float = 0.0):
        super().__init__()
        self.ln_1 = nn.LayerNorm(EMBD)
        self.attn = CausalSelfAttention(flash, dropout)
        self.ln_2 = nn.LayerNorm(EMBD)
        self.mlp = nn.Sequential(nn.Linear(EMBD, 4 * EMBD), nn.GELU(), nn.Linear(4 * EMBD, EMBD))

    def forward(self, x, pad=None):
        x = x + self.attn(self.ln_1(x), pad)
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    def __init__(self, flash: bool = False, dropout: float = 0.0):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, EMBD)
        self.wpe = nn.Embedding(BLOCK, EMBD)
        self.h = nn.ModuleList([Block(flash, dropout) for _ in range(LAYERS)])
        self.ln_f = nn.LayerNorm(EMBD)
        self.lm_head = nn.Linear(EMBD, VOCAB, bias=False)

    def forward(self, idx, targets, pad=None):
        pos = torch.arange(0, idx.size(1), dtype=torch.long)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x, pad)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1), ignore_index=PAD)


def token_batches(steps: int, empty_at: int | None = None, batch: int = 4, seed: int = 0):
    """Right-padded token batches; with ``empty_at`` that step's batch holds one sequence of
    length 0 (every key padded: its attention rows are fully masked)."""
    g = torch.Generator().manual_seed(seed)
    for step in range(steps):
        idx = torch.randint(1, VOCAB, (batch, BLOCK), generator=g)
        lengths = torch.randint(3, BLOCK + 1, (batch,), generator=g)
        if step == empty_at:
            lengths[1] = 0
        pad = torch.arange(BLOCK)[None, :] >= lengths[:, None]
        idx = idx.masked_fill(pad, PAD)
        targets = torch.roll(idx, -1, dims=1).masked_fill(pad, PAD)
        yield idx, targets, pad


def train_gpt(steps: int = 3, flash: bool = False, padded: bool = False, empty_at: int | None = None) -> list[float]:
    torch.manual_seed(0)
    model = TinyGPT(flash)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for idx, targets, pad in token_batches(steps, empty_at):
        loss = model(idx, targets, pad if padded else None)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


# ---------------------------------------------------------------------- faults and normalisations
class RMSNormNoEps(nn.Module):
    """RMSNorm with its epsilon outside the root: the forward pass is finite on a zero row,
    the gradient of sqrt at 0 is not."""

    def forward(self, x):
        rms = torch.sqrt(x.pow(2).mean(-1, keepdim=True))  # SQRT LINE
        return x / (rms + 1e-8)


def train_rmsnorm(steps: int = 12, width: int = 64, depth: int = 6) -> list[float]:
    """Token 0 embeds to a zero row: RMSNorm of it is finite (0 / 1e-8), its gradient is NaN
    (sqrt at 0), and the NaN reaches the embedding table, then every parameter."""
    torch.manual_seed(0)
    emb = nn.Embedding(VOCAB, width)
    with torch.no_grad():
        emb.weight[0] = 0.0
    layers = nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width), nn.Tanh())])
    norm = RMSNormNoEps()
    head = nn.Linear(width, VOCAB)
    params = [*emb.parameters(), *layers.parameters(), *head.parameters()]
    opt = torch.optim.SGD(params, lr=0.1)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        idx = torch.randint(0, VOCAB, (16,), generator=g)
        idx[0] = 0
        h = norm(emb(idx))
        logits = head(layers(h))
        loss = F.cross_entropy(logits, torch.randint(0, VOCAB, (16,), generator=g))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def train_gcn(steps: int = 3) -> list[float]:
    """A graph convolution with the normalisation D^-1 A: isolated nodes have degree 0, and
    1/0 = inf is set to 0 on the next line (the usual idiom)."""
    torch.manual_seed(0)
    n = 12
    adj = (torch.rand(n, n) > 0.7).float()
    adj[:, 3] = 0
    adj[3, :] = 0  # node 3 is isolated
    deg = adj.sum(1)
    dinv = 1.0 / deg  # RECIPROCAL LINE
    dinv[torch.isinf(dinv)] = 0.0  # INF TO ZERO LINE
    a_norm = dinv[:, None] * adj
    lin = nn.Linear(8, 4)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    x, y = torch.randn(n, 8), torch.randint(0, 4, (n,))
    losses = []
    for _ in range(steps):
        loss = F.cross_entropy(a_norm @ lin(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


class ExpHead(nn.Module):
    """A positive output through exp; once the pre-activation passes ~88.7 float32 overflows."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 1)

    def forward(self, x):
        return torch.exp(self.fc(x))  # EXP LINE


def train_exp(steps: int = 4, blow_at: int = 2) -> list[float]:
    torch.manual_seed(0)
    model = ExpHead()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    losses = []
    for step in range(steps):
        x = torch.randn(8, 4, generator=g) * (100.0 if step >= blow_at else 1.0)
        y = torch.rand(8, 1, generator=g)
        loss = (model(x) - y).pow(2).mean()  # LOSS LINE
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


class ProbHead(nn.Module):
    """A classifier that takes the log of its softmax probabilities by hand (the common
    ``torch.log(probs)`` mistake): a probability that underflows to exactly 0 gives -inf."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        probs = self.fc(x).softmax(-1)
        logp = torch.log(probs)  # LOG LINE
        return -logp.gather(1, y[:, None]).mean()  # NLL LINE


def train_log_zero(steps: int = 4, blow_at: int = 2) -> list[float]:
    torch.manual_seed(0)
    model = ProbHead()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    losses = []
    for step in range(steps):
        # from blow_at on, inputs so large that some class probabilities underflow to 0
        x = torch.randn(8, 4, generator=g) * (1e4 if step >= blow_at else 1.0)
        y = torch.randint(0, 3, (8,), generator=g)
        loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def line_of(marker: str) -> int:
    with open(__file__) as fh:
        return next(i for i, t in enumerate(fh.read().splitlines(), 1) if f"# {marker}" in t)
