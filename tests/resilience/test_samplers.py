"""Samplers with ``set_epoch`` (``DistributedSampler``) in a TrainState, and exact mid-epoch resume
per rank. The sampler's ``num_replicas``/``rank`` stand in for a process group: its order
depends only on them, its seed and its epoch."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from trainguard.resilience import CheckpointManager, TrainState

DATA = TensorDataset(torch.arange(40.0).reshape(20, 2), torch.arange(20))


def make(rank: int, *, with_sampler: bool = True) -> tuple[TrainState, DistributedSampler]:
    sampler = DistributedSampler(DATA, num_replicas=2, rank=rank, shuffle=True, seed=5)
    loader = DataLoader(DATA, batch_size=3, sampler=sampler)
    objects = {"loader": loader, "gen": torch.Generator().manual_seed(rank)}
    if with_sampler:
        objects["sampler"] = sampler
    return TrainState(**objects), sampler


def batches(state: TrainState, sampler: DistributedSampler, epochs: range, *, skip_set_epoch: bool = False,
            stop_after: int | None = None) -> list[list[int]]:
    """Labels of every batch over ``epochs``; with ``stop_after`` return after that many batches."""
    seen: list[list[int]] = []
    for epoch in epochs:
        if not (skip_set_epoch and epoch == epochs[0]):
            sampler.set_epoch(epoch)
        for _, y in state.loader:
            seen.append(y.tolist())
            if stop_after is not None and len(seen) == stop_after:
                state.epoch = epoch
                return seen
    return seen


def test_a_sampler_with_set_epoch_is_accepted_and_its_epoch_saved():
    state, sampler = make(0)
    assert state.sampler is sampler  # the object itself, so that state.sampler.set_epoch() works
    assert state.is_rank_local("sampler")
    sampler.set_epoch(3)
    assert state.capture().local["sampler"] == {"epoch": 3}


def test_a_sampler_without_state_or_epoch_is_still_refused():
    with pytest.raises(TypeError, match="set_epoch"):
        TrainState(sampler=torch.utils.data.SequentialSampler(DATA))


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("with_sampler", [True, False], ids=["sampler-in-state", "loader-only"])
def test_mid_epoch_resume_is_exact_per_rank(tmp_path, rank, with_sampler):
    ref_state, ref_sampler = make(rank, with_sampler=with_sampler)
    reference = batches(ref_state, ref_sampler, range(3))  # 4 batches per epoch and rank

    state, sampler = make(rank, with_sampler=with_sampler)
    first = batches(state, sampler, range(3), stop_after=6)  # mid-way through epoch 1
    CheckpointManager(tmp_path / "ckpt").save(state, step=6)

    resumed, resumed_sampler = make(rank, with_sampler=with_sampler)
    CheckpointManager(tmp_path / "ckpt").restore(resumed)
    assert resumed.epoch == 1
    if with_sampler:
        assert resumed_sampler.epoch == 1
    # The interrupted epoch continues without set_epoch (the loader knows which epoch it drew).
    rest = batches(resumed, resumed_sampler, range(resumed.epoch, 3), skip_set_epoch=True)
    assert first + rest == reference
