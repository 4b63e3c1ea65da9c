"""Retention: pruning counts only checkpoints that pass the full check, and never removes the newest good one."""

from __future__ import annotations

import warnings

import pytest

from trainguard.resilience import CheckpointManager, _format

from .conftest import make_state


def _flip_a_bit(directory) -> None:
    """Same size, different content: only the full check (SHA-256) sees it."""
    data = next(directory.glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))


def _fully_valid(directory) -> list[int]:
    return [i.step for i in _format.list_checkpoints(directory, verify=True) if i.valid]


def _run_after_falling_back(ckpt_dir, **policy) -> CheckpointManager:
    """Checkpoints 10, 20, 30; 30 silently damaged; a new run resumes from 20 and saves 21, 22."""
    first = CheckpointManager(ckpt_dir, keep=3)
    state = make_state()
    for step in (10, 20, 30):
        first.save(state, step)
    first.close()
    _flip_a_bit(ckpt_dir / "step-00000030")
    m = CheckpointManager(ckpt_dir, **policy)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert m.restore(state) == 20
    return m


@pytest.mark.parametrize("keep", [1, 2])
def test_a_silently_damaged_newer_checkpoint_does_not_count_as_kept(ckpt_dir, keep):
    m = _run_after_falling_back(ckpt_dir, keep=keep)
    state = make_state()
    for step in (21, 22):
        m.save(state, step)
        good = _fully_valid(ckpt_dir)
        assert step in good, f"the save of step {step} was pruned right after it committed"
        assert len(good) >= keep
    assert _fully_valid(ckpt_dir) == [21, 22][-keep:]
    m.close()


def test_keep_every_hours_with_keep_one_never_prunes_the_new_save(ckpt_dir):
    m = _run_after_falling_back(ckpt_dir, keep=1, keep_every_hours=1000.0)
    state = make_state()
    m.save(state, 21)
    assert 21 in _fully_valid(ckpt_dir)
    m.save(state, 22)
    assert 22 in _fully_valid(ckpt_dir)
    m.close()


def test_pruning_keeps_an_older_good_one_when_a_kept_one_turns_out_damaged(ckpt_dir):
    m = CheckpointManager(ckpt_dir, keep=2)
    state = make_state()
    for step in (1, 2):
        m.save(state, step)
    _flip_a_bit(ckpt_dir / "step-00000002")  # damaged after it was written
    m.save(state, 3)
    # two checkpoints that pass the full check remain: 3 and 1; the damaged 2 is not one of them
    assert _fully_valid(ckpt_dir) == [1, 3]
    m.close()
