"""karpathy/build-nanogpt's ``train_gpt2.py`` shrunk for tests (used by the
tests/integrations/test_build_nanogpt_real*.py files, which say what each run shows).

The model below is that file's ``GPT`` (``CausalSelfAttention`` with
``F.scaled_dot_product_attention(is_causal=True)``, the tanh-GELU ``MLP``, the pre-LN ``Block``,
tied ``wte``/``lm_head``), shrunk to one layer, with its loss ``F.cross_entropy(logits.view(-1,
V), targets.view(-1))`` given ``ignore_index=PAD`` (a padding token, as a user adds for padded
shards); trained as the script trains: ``torch.compile(model)`` (Inductor), bf16 autocast, AdamW.
A zero-filled region of a token shard makes a batch whose every target is padding.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from torch.nn import functional as F

VOCAB, BLOCK, EMBD, HEADS, PAD = 32, 8, 16, 2, 0


class CausalSelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_attn = nn.Linear(EMBD, 3 * EMBD)
        self.c_proj = nn.Linear(EMBD, EMBD)
        self.pad = None  # set per batch by GPT.forward when it masks padding

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(EMBD, dim=2)
        k = k.view(B, T, HEADS, C // HEADS).transpose(1, 2)
        q = q.view(B, T, HEADS, C // HEADS).transpose(1, 2)
        v = v.view(B, T, HEADS, C // HEADS).transpose(1, 2)
        if self.pad is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # nanoGPT's non-flash path, with a key padding mask added
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            keep = torch.tril(torch.ones(T, T, dtype=torch.bool)).view(1, 1, T, T) & ~self.pad.view(B, 1, 1, T)
            att = F.softmax(att.masked_fill(~keep, float("-inf")), dim=-1)  # SOFTMAX LINE
            y = att @ v
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = nn.LayerNorm(EMBD), CausalSelfAttention(), nn.LayerNorm(EMBD)
        self.mlp = nn.Sequential(nn.Linear(EMBD, 4 * EMBD), nn.GELU(approximate="tanh"), nn.Linear(4 * EMBD, EMBD))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, EMBD), nn.Embedding(BLOCK, EMBD)
        self.h = nn.ModuleList([Block()])
        self.ln_f = nn.LayerNorm(EMBD)
        self.lm_head = nn.Linear(EMBD, VOCAB, bias=False)
        self.wte.weight = self.lm_head.weight

    entropy = False  # a hand-written entropy bonus on the predictions, as users add one
    mask_padding = False  # attention does not look at padding tokens

    def forward(self, idx, targets):
        pos = torch.arange(0, idx.size(1), dtype=torch.long)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            block.attn.pad = (idx == PAD) if self.mask_padding else None
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=PAD)  # LOSS LINE
        if self.entropy:
            probs = F.softmax(logits, dim=-1)
            loss = loss - 0.01 * -(probs * torch.log(probs)).sum(-1).mean()  # ENTROPY LINE
        return logits, loss


def batches(steps: int, zeros_at: int):
    g = torch.Generator().manual_seed(0)
    for step in range(steps):
        buf = torch.randint(1, VOCAB, (4 * BLOCK + 1,), generator=g)
        if step == zeros_at:
            buf = torch.zeros_like(buf)  # a zero-filled region of the shard: every target is PAD
        yield buf[:-1].view(4, BLOCK), buf[1:].view(4, BLOCK)


def train(steps: int = 3, zeros_at: int | None = 2, entropy: bool = False, mask_padding: bool = False) -> list[float]:
    torch.manual_seed(0)
    model = GPT()
    model.entropy, model.mask_padding = entropy, mask_padding
    compiled = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    losses = []
    for step, (x, y) in enumerate(batches(steps, zeros_at)):
        if entropy and step == 2:  # what a one-step learning-rate blow-up leaves: huge logits
            with torch.no_grad():
                model.lm_head.weight.mul_(1e3)
        opt.zero_grad()
        with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
            _, loss = compiled(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def line_of(tag: str) -> int:
    return next(i for i, t in enumerate(open(__file__).read().splitlines(), 1) if t.endswith(f"# {tag}"))


LOSS_LINE = line_of("LOSS LINE")
