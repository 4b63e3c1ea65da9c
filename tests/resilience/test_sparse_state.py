"""Optimizer state holding sparse tensors: SGD with momentum over nn.EmbeddingBag(sparse=True) keeps
its momentum buffers as sparse COO tensors."""

from __future__ import annotations

import torch
from torch import nn

import trainguard as tg


class TinyDLRM(nn.Module):
    """facebookresearch/dlrm dlrm_s_pytorch.py's DLRM_Net in small: nn.EmbeddingBag(mode="sum",
    sparse=True) tables and an MLP over their pooled rows."""

    def __init__(self) -> None:
        super().__init__()
        self.emb_l = nn.ModuleList(nn.EmbeddingBag(n, 4, mode="sum", sparse=True) for n in (50, 12))
        self.top_l = nn.Linear(8, 1)

    def forward(self, offsets, indices):
        return self.top_l(torch.cat([e(i, offsets) for e, i in zip(self.emb_l, indices)], dim=1))


def batch(step: int):
    g = torch.Generator().manual_seed(step)
    return torch.arange(0, 16, 2), [torch.randint(0, n, (16,), generator=g) for n in (50, 12)], torch.rand(8, 1, generator=g)


def train(model, opt, steps):
    for step in steps:
        offsets, indices, y = batch(step)
        opt.zero_grad()
        nn.functional.mse_loss(model(offsets, indices), y).backward()
        opt.step()


def fresh():
    torch.manual_seed(0)
    model = TinyDLRM()
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def test_sparse_momentum_buffers_are_saved_and_resume_bitwise(tmp_path):
    model, opt = fresh()
    train(model, opt, range(3))
    assert opt.state[model.emb_l[0].weight]["momentum_buffer"].is_sparse
    ckpt = tg.CheckpointManager(tmp_path / "ckpt")
    ckpt.save(tg.TrainState(model=model, optimizer=opt), step=3)
    train(model, opt, range(3, 6))

    again, opt2 = fresh()
    ckpt.restore(tg.TrainState(model=again, optimizer=opt2))
    buf = opt2.state[again.emb_l[0].weight]["momentum_buffer"]
    assert buf.is_sparse and buf.shape == (50, 4)
    train(again, opt2, range(3, 6))
    for (name, a), b in zip(model.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), name


def test_sparse_momentum_buffers_restore_into_an_optimizer_that_has_its_own(tmp_path):
    """An in-process restore (a guard's rewind, a second restore) over momentum buffers of other sizes."""
    model, opt = fresh()
    train(model, opt, range(2))
    ckpt = tg.CheckpointManager(tmp_path / "ckpt")
    state = tg.TrainState(model=model, optimizer=opt)
    ckpt.save(state, step=2)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    train(model, opt, range(2, 5))  # the buffers now hold more rows
    ckpt.restore(state)
    for k, v in model.state_dict().items():
        assert torch.equal(v, saved[k]), k
    train(model, opt, range(2, 4))

    ref, ref_opt = fresh()
    train(ref, ref_opt, range(4))
    for (name, a), b in zip(ref.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), name
