"""Checkpointing is trainguard's own work: a recording (or any TorchDispatchMode) never sees it,
and what a mode does to ops can never make one rank's collectives differ from another's."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import trainguard as tg
from trainguard.resilience import CheckpointManager, TrainState


class Counting(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _state() -> TrainState:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    return TrainState(model=model, optimizer=opt)


@pytest.mark.parametrize("backend", ["python", "native"])
def test_saving_and_restoring_while_recording_records_nothing(tmp_path, backend):
    state = _state()
    with tg.record(tmp_path / "run", buffer=-1, backend=backend) as rec:
        state.model(torch.randn(2, 3))
        before = rec.executions
        manager = CheckpointManager(tmp_path / "ckpt", async_save=True)
        manager.save(state, step=1)
        manager.wait()
        manager.save(state, step=2, blocking=True)
        assert manager.restore(state) == 2
        assert rec.executions == before
        state.model(torch.randn(2, 3))  # and recording goes on afterwards
        assert rec.executions > before


def test_a_users_dispatch_mode_sees_no_checkpoint_op(tmp_path):
    state = _state()
    with Counting() as mode:
        CheckpointManager(tmp_path / "ckpt").save(state, step=1)
        CheckpointManager(tmp_path / "ckpt").restore(state)
    assert mode.ops == []
