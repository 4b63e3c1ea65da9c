"""The guard inside ckpt.resume(): rewinding to a newer checkpoint, checkpoints that only ever hold
verified steps, preemption and resume of a guarded run."""

from __future__ import annotations

import os
import signal

import pytest
import torch

import trainguard as tg
from trainguard.resilience import list_checkpoints

from .conftest import assert_bitwise, finite, make_data, make_state, params, train


def test_it_rewinds_to_the_newest_checkpoint_when_newer_than_the_snapshot(tmp_path):
    state = make_state(make_data(60, poison_batch=25))
    ckpt = tg.CheckpointManager(tmp_path / "ckpt", every_steps=10, keep=2)
    guard = tg.Guard(tmp_path / "run", snapshot_every=50)
    seen = train(ckpt.resume(state, total_steps=60, guard=guard).batches(), state)
    [event] = guard.events
    assert event["rewound_from"] == "checkpoint" and event["rewound_to"] == 20
    assert event["replay"]["bitwise_equal"] is True and event["replay"]["steps"] == 5
    assert seen[:26] == list(range(26)) and seen[26:32] == list(range(20, 26))  # step 25 read when it ended
    assert state.step == 60 and finite(state)


def test_a_rewind_to_a_checkpoint_keeps_the_monitors_rows_of_the_steps_it_replays(tmp_path):
    # A restore after a kill drops the run's rows of the steps it undoes (they run again); the
    # guard's rewind to a checkpoint is a replay instead: its rows go beside the first ones, as
    # after a rewind to its snapshot, so the NaN loss of step 25 stays in the run.
    from trainguard.store import open_run

    state = make_state(make_data(60, poison_batch=25))
    ckpt = tg.CheckpointManager(tmp_path / "ckpt", every_steps=10, keep=2)
    guard = tg.Guard(tmp_path / "run", snapshot_every=50)
    with tg.Monitor(state.model, tmp_path / "mon", every=1):
        train(ckpt.resume(state, total_steps=60, guard=guard).batches(), state)
    [event] = guard.events
    assert event["rewound_from"] == "checkpoint"
    with open_run(tmp_path / "mon") as run:
        losses = run.scalars("loss")["loss"]
    assert [s for s, _ in losses].count(21) == 2, losses  # the first run of step 21 and its replay
    assert any(s == 25 and v != v for s, v in losses), losses  # the NaN the guard rewound from


def test_a_checkpoint_never_holds_a_step_that_was_not_verified(tmp_path):
    state = make_state(make_data(40, poison_batch=24))
    ckpt = tg.CheckpointManager(tmp_path / "ckpt", every_steps=5, keep=10)
    guard = tg.Guard(tmp_path / "run", snapshot_every=50)
    saved = []
    real_save = ckpt.save

    def save(st, *args, **kwargs):
        saved.append((st.step, finite(st)))
        return real_save(st, *args, **kwargs)

    ckpt.save = save
    with ckpt:  # the manager holds its directory's lock until it is closed
        train(ckpt.resume(state, total_steps=40, guard=guard).batches(), state)
    assert [e["step"] for e in guard.events] == [24]
    assert all(ok for _, ok in saved), saved  # the save due after step 24 waited for its verdict
    assert [s for s, _ in saved] == [5, 10, 15, 20, 25, 30, 35, 40]
    restored = make_state(make_data(40, poison_batch=24))
    assert tg.CheckpointManager(tmp_path / "ckpt").restore(restored) == 40
    assert_bitwise(params(restored), params(state))


def test_a_preempted_guarded_run_resumes_exactly(tmp_path):
    data = make_data(50, poison_sample=77)
    ref = make_state(data, dropout=0.2, shuffle=True)
    ref_guard = tg.Guard(tmp_path / "ref-run", snapshot_every=10)
    with tg.CheckpointManager(tmp_path / "ref-ckpt") as ref_ckpt:
        train(ref_ckpt.resume(ref, total_steps=40, guard=ref_guard).batches(), ref)
    bad = [e["step"] for e in ref_guard.events]
    assert len(bad) == 1

    first = make_state(data, dropout=0.2, shuffle=True)
    guard = tg.Guard(tmp_path / "run", snapshot_every=10)
    with pytest.raises(tg.Preempted) as info, tg.CheckpointManager(tmp_path / "ckpt") as ckpt:
        for step, (x, y) in ckpt.resume(first, total_steps=40, guard=guard).batches():
            loss = torch.nn.functional.mse_loss(first.model(x), y)
            first.optimizer.zero_grad()
            loss.backward()
            first.optimizer.step()
            first.scheduler.step()
            if step == 30:
                os.kill(os.getpid(), signal.SIGTERM)
    assert info.value.step == 31 and len(guard.events) == 1
    with tg.open(tmp_path / "run") as run:
        assert run.meta["guard"]["status"] == "interrupted"
    second = make_state(data, dropout=0.2, shuffle=True)
    with tg.CheckpointManager(tmp_path / "ckpt") as ckpt:
        loop = ckpt.resume(second, total_steps=40, guard=tg.Guard(tmp_path / "run2"))
        assert loop.restored_step == 31
        train(loop.batches(), second)
    assert_bitwise(params(ref), params(second))
    assert [i.step for i in list_checkpoints(tmp_path / "ckpt")][-1] == 40


def test_a_rewind_to_a_checkpoint_at_the_failing_step_says_what_it_replayed(tmp_path):
    # A checkpoint at step 20 and the NaN at step 20: no step runs again before the failing one,
    # and the line read "rewound to step 20 (checkpoint); replayed; origin: ..." (diffusers trial).
    state = make_state(make_data(30, poison_batch=20))
    ckpt = tg.CheckpointManager(tmp_path / "ckpt", every_steps=10, keep=2)
    guard = tg.Guard(tmp_path / "run", snapshot_every=50)
    train(ckpt.resume(state, total_steps=30, guard=guard).batches(), state)
    [event] = guard.events
    assert event["rewound_to"] == 20 and event["replay"]["steps"] == 0
    assert "; replayed;" not in event["message"], event["message"]
    assert "rewound to step 20 (checkpoint); replayed step 20 alone, under recording; origin: " in event["message"]
