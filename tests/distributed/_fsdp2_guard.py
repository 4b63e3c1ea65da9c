"""``_fsdp2_example``'s model (pytorch/examples distributed/FSDP2, every block initialised) trained in
the guard's loop: ``TrainState`` + ``CheckpointManager.resume(guard=Guard)`` + ``loop.batches()`` over
a ``DistributedSampler``. Rank 1's batch holding sample BAD is padding only: its loss is a sum
divided by a zero count (NaN), and the gradient reduce-scatter takes the NaN to rank 0.

usage: _fsdp2_guard.py CKPT LOGDIR BAD
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _fsdp2_example import SEQ, VOCAB, sharded_transformer
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import trainguard as tg


def main(ckpt: str, logdir: str, bad: int) -> None:
    dist.init_process_group("gloo")
    model = sharded_transformer()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randint(0, VOCAB, (128, SEQ + 1), generator=g), torch.arange(128))
    sampler = DistributedSampler(data, shuffle=False)
    state = tg.TrainState(model=model, optimizer=opt, loader=DataLoader(data, batch_size=4, sampler=sampler),
                          sampler=sampler)
    loop = tg.CheckpointManager(ckpt).resume(state, total_steps=10, guard=tg.Guard(logdir, snapshot_every=4))
    for _, (tokens, index) in loop.batches():
        logits = model(tokens[:, :-1])
        keep = torch.ones(tokens[:, 1:].shape)
        if dist.get_rank() == 1 and bool((index == bad).any()):
            keep.zero_()  # a batch of padding only
        per_token = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1), reduction="none")
        loss = (per_token * keep.reshape(-1)).sum() / keep.sum()  # LOSS_LINE
        opt.zero_grad()
        loss.backward()
        opt.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
