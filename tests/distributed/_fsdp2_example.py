"""pytorch/examples distributed/FSDP2 (example.py and model.py), shrunk: a two-block toy
Transformer built on the meta device, each block and the root ``fully_shard``-ed, then
``to_empty`` and ``reset_parameters``, Adam, a few steps of random tokens, on gloo and CPU.

``INIT=example`` keeps the example's own ``Transformer.reset_parameters``, which initialises
the embeddings, the final norm and the output layer but not the blocks: their weights stay
the uninitialised memory ``to_empty`` gave them (the example's loss is NaN on CPU). Any other
value also resets every block, as a user who noticed would. ``NAN_EMPTY=1`` fills every
uninitialised allocation with NaN (``torch.utils.deterministic.fill_uninitialized_memory``),
the worst a real allocator can hand back, on every run. ``NAN_RANK=K`` makes rank K's loss of
the second step NaN: its mean over a batch of padding only, a sum divided by a zero count.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

DIM, HEADS, VOCAB, SEQ, LAYERS = 16, 4, 64, 16, 2


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))

    def forward(self, x):
        b, t, _ = x.size()
        q, k, v = (w(x).view(b, t, HEADS, DIM // HEADS).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, None, 0)
        return self.wo(out.transpose(1, 2).contiguous().view(b, t, -1))

    def reset_parameters(self):
        for w in (self.wq, self.wk, self.wv, self.wo):
            w.reset_parameters()


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm = nn.LayerNorm(DIM)
        self.attention = Attention()
        self.ffn_norm = nn.LayerNorm(DIM)
        self.w1, self.w2 = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.w2(F.gelu(self.w1(self.ffn_norm(h))))

    def reset_parameters(self):
        for m in (self.attention_norm, self.attention, self.ffn_norm, self.w1, self.w2):
            m.reset_parameters()


class Transformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.pos_embeddings = nn.Embedding(SEQ, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens) + self.pos_embeddings(torch.arange(tokens.size(1)))
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h)).float()

    def reset_parameters(self):  # as the example's: the blocks are left out
        for m in (self.tok_embeddings, self.pos_embeddings, self.norm, self.output):
            m.reset_parameters()


def sharded_transformer(init_blocks: bool = True) -> Transformer:
    """The example's model built on meta, sharded with fully_shard per block, materialised on CPU
    (seed 0); ``init_blocks=False`` leaves the blocks uninitialised, as the example does."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer()
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    model.to_empty(device="cpu")
    if init_blocks:
        for layer in model.layers:
            layer.reset_parameters()
    model.reset_parameters()
    return model


def main() -> None:
    if os.environ.get("NAN_EMPTY") == "1":
        torch.use_deterministic_algorithms(True)
        torch.utils.deterministic.fill_uninitialized_memory = True
    dist.init_process_group("gloo")
    model = sharded_transformer(init_blocks=os.environ.get("INIT") != "example")
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(3):
        out = model(torch.randint(0, VOCAB, (4, SEQ)))
        keep = torch.ones(out.shape[:2])
        if os.environ.get("NAN_RANK") == str(dist.get_rank()) and step == 1:
            keep.zero_()  # this rank's batch is padding only
        loss = (out.sum(-1) * keep).sum() / keep.sum()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optim.step()
        optim.zero_grad()
        if dist.get_rank() == 0:
            print("loss", loss.item(), "norm", norm.full_tensor().item(), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
