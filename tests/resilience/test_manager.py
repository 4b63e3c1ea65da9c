"""CheckpointManager: exact restore, fallback past damage, retention, failed writes, async snapshots."""

from __future__ import annotations

import copy
import errno
import os
import re
import shutil
import threading
import warnings
from pathlib import Path

import pytest
import torch

from trainguard import CheckpointError
from trainguard.cli import main
from trainguard.resilience import (
    CheckpointFallbackWarning,
    CheckpointManager,
    TrainState,
    _engine,
    _format,
    list_checkpoints,
)
from trainguard.resilience import _manager as manager_mod

from .conftest import assert_same_training_state, make_state, train_steps


def snapshot(state: TrainState) -> TrainState:
    """A detached copy of the model, optimizer and scheduler state, to compare against later."""
    copy_state = make_state(seed=123)
    copy_state.model.load_state_dict(copy.deepcopy(state.model.state_dict()))
    copy_state.optimizer.load_state_dict(copy.deepcopy(state.optimizer.state_dict()))
    copy_state.scheduler.load_state_dict(copy.deepcopy(state.scheduler.state_dict()))
    return copy_state


def names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if not p.name.startswith(".trainguard"))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_restore_mid_epoch_continues_bitwise_exactly(ckpt_dir, num_workers):
    reference = make_state(num_workers=num_workers)
    expected = train_steps(reference, 13)

    first = make_state(num_workers=num_workers)
    losses = train_steps(first, 7)  # 7 steps: two batches into the second epoch of 5
    CheckpointManager(ckpt_dir).save(first)

    resumed = make_state(seed=99, num_workers=num_workers)  # a new process, other seeds
    assert CheckpointManager(ckpt_dir).restore(resumed) == 7
    assert resumed.step == 7
    losses += train_steps(resumed, 6)
    assert losses == expected
    assert_same_training_state(reference, resumed)


def test_nothing_to_restore(ckpt_dir):
    m = CheckpointManager(ckpt_dir)
    assert m.restore(make_state()) is None
    assert m.latest() is None and m.list() == []


def _three_checkpoints(ckpt_dir):
    m = CheckpointManager(ckpt_dir, keep=5)
    state = make_state()
    kept = {}
    for _ in range(3):
        train_steps(state, 10)
        m.save(state)
        kept[state.step] = snapshot(state)
    return m, kept


def _truncate_largest(d: Path) -> str:
    largest = max((p for p in d.iterdir() if p.name != "manifest.json"), key=lambda p: p.stat().st_size)
    with open(largest, "r+b") as f:
        f.truncate(largest.stat().st_size // 2)
    return f"{largest.name} has"


def _flip_one_byte(d: Path) -> str:
    data = next(d.glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    return "fails its SHA-256 checksum"


def _delete_manifest(d: Path) -> str:
    (d / "manifest.json").unlink()
    return "manifest.json is missing"


def _half_written_temporary(d: Path) -> str:
    tmp = d.parent / ".tmp-step-00000040-0123456789ab"
    tmp.mkdir()
    shutil.copy(next(d.glob("*.distcp")), tmp)
    with open(next(tmp.glob("*.distcp")), "r+b") as f:
        f.truncate(100)
    return "incomplete"


@pytest.mark.parametrize("damage", [_truncate_largest, _flip_one_byte, _delete_manifest, _half_written_temporary])
def test_damage_falls_back_with_a_warning_and_verify_reports_it(ckpt_dir, capsys, damage):
    m, kept = _three_checkpoints(ckpt_dir)
    m.close()  # the run that wrote them is gone
    newest = ckpt_dir / "step-00000030"
    why = damage(newest)
    temporary = damage is _half_written_temporary
    fresh = make_state(seed=5)
    with pytest.warns(CheckpointFallbackWarning) as record:
        step = CheckpointManager(ckpt_dir).restore(fresh)
    message = " ".join(str(w.message) for w in record)
    assert why in message
    assert (".tmp-step-00000040" if temporary else "step-00000030") in message
    expected_step = 30 if temporary else 20
    assert step == expected_step
    assert_same_training_state(kept[expected_step], fresh)

    capsys.readouterr()
    code = main(["ckpt", "verify", str(ckpt_dir)])
    out = capsys.readouterr().out
    assert why in out
    if temporary:
        assert code == 0 and "newest checkpoint step-00000030 is valid" in out
    else:
        assert code == 1 and "newest checkpoint step-00000030 is damaged" in out and "step-00000020" in out


def test_every_checkpoint_damaged_is_an_error_not_a_fresh_start(ckpt_dir):
    _three_checkpoints(ckpt_dir)
    for d in ckpt_dir.glob("step-*"):
        _delete_manifest(d)
    with pytest.raises(CheckpointError, match="no valid checkpoint in .*step-00000030: manifest.json is missing"):
        with pytest.warns(CheckpointFallbackWarning):
            CheckpointManager(ckpt_dir).restore(make_state())


def test_an_incompatible_model_names_missing_unexpected_and_misshaped_keys(ckpt_dir):
    CheckpointManager(ckpt_dir).save(make_state())
    other = make_state(width=9, extra_layer=True)
    with pytest.raises(CheckpointError) as info:
        CheckpointManager(ckpt_dir).restore(other)
    text = str(info.value)
    assert "(missing): 4.weight, 4.bias" in text
    assert "mis-shaped in 'model': 0.weight (checkpoint [8, 4], here [9, 4])" in text
    assert "0.bias (checkpoint [8], here [9])" in text and "3.weight (checkpoint [1, 8], here [1, 9])" in text

    smaller = TrainState(model=torch.nn.Sequential(torch.nn.Linear(4, 8)))
    with pytest.raises(CheckpointError, match=r"no state saved for.*|has no object here"):
        CheckpointManager(ckpt_dir).restore(smaller)


def test_unexpected_keys_are_named(ckpt_dir):
    big = TrainState(model=torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)))
    CheckpointManager(ckpt_dir).save(big)
    small = TrainState(model=torch.nn.Sequential(torch.nn.Linear(2, 2)))
    with pytest.raises(CheckpointError, match=r"\(unexpected\): 1\.weight, 1\.bias"):
        CheckpointManager(ckpt_dir).restore(small)


def test_objects_missing_on_either_side(ckpt_dir):
    state = make_state()
    CheckpointManager(ckpt_dir).save(state)
    fewer = TrainState(model=make_state().model)
    with pytest.raises(CheckpointError, match="saved state for loader, optimizer, scheduler has no object here"):
        CheckpointManager(ckpt_dir).restore(fewer)
    with pytest.warns(UserWarning, match="restoring step-00000000 partially"):
        assert CheckpointManager(ckpt_dir).restore(fewer, strict=False) == 0
    assert all(torch.equal(a, b) for a, b in zip(fewer.model.state_dict().values(),
                                                  state.model.state_dict().values(), strict=True))


def test_keep_three_keeps_exactly_the_three_newest_valid(ckpt_dir):
    m = CheckpointManager(ckpt_dir, keep=3)
    state = make_state()
    for step in range(1, 7):
        m.save(state, step)
    assert names(ckpt_dir) == ["step-00000004", "step-00000005", "step-00000006"]
    _truncate_largest(ckpt_dir / "step-00000006")  # damaged: no longer counts as one of the three
    m.save(state, 7)
    assert names(ckpt_dir) == ["step-00000004", "step-00000005", "step-00000007"]
    assert [i.step for i in m.list() if i.valid] == [4, 5, 7]
    assert m.latest().step == 7


def test_keep_every_hours_pins_one_checkpoint_per_interval(ckpt_dir, monkeypatch):
    clock = [1_000_000.0]
    monkeypatch.setattr(manager_mod, "_now", lambda: clock[0])
    m = CheckpointManager(ckpt_dir, keep=2, keep_every_hours=1.0)
    state = make_state()
    for step in range(1, 10):  # one save every 25 minutes
        clock[0] += 25 * 60
        m.save(state, step)
    pinned = [i.step for i in m.list() if i.pinned]
    assert pinned == [3, 6, 9]  # minutes 75, 150, 225: each at least an hour after the one pinned before
    assert names(ckpt_dir) == ["step-00000003", "step-00000006", "step-00000008", "step-00000009"]


def test_policy_is_validated_with_the_bad_value_quoted(ckpt_dir):
    with pytest.raises(ValueError, match="keep must be an int >= 1, got 0"):
        CheckpointManager(ckpt_dir, keep=0)
    with pytest.raises(ValueError, match="every_steps must be an int >= 1 or None, got -5"):
        CheckpointManager(ckpt_dir, every_steps=-5)
    with pytest.raises(ValueError, match="keep_every_hours must be a number > 0 or None, got nan"):
        CheckpointManager(ckpt_dir, keep_every_hours=float("nan"))
    with pytest.raises(ValueError, match="step must be an int >= 0, got -1"):
        CheckpointManager(ckpt_dir).save(make_state(), -1)


def test_saving_the_same_step_again_replaces_it(ckpt_dir):
    m = CheckpointManager(ckpt_dir)
    state = make_state()
    m.save(state, 5, metadata={"try": 1})
    m.save(state, 5, metadata={"try": 2})
    assert [(i.step, i.metadata) for i in m.list()] == [(5, {"try": 2})]


class _Killed(BaseException):
    """Stands for SIGKILL at a chosen instant (no except clause of the library catches it)."""


def test_replacing_a_checkpoint_never_leaves_that_step_missing(ckpt_dir, monkeypatch):
    m = CheckpointManager(ckpt_dir, keep=1)
    state = make_state()
    m.save(state, 5, metadata={"try": 1})
    seen = []

    def observed(fn):
        def wrapped(*args, **kwargs):
            out = fn(*args, **kwargs)  # after each rename, a reader must find a valid step 5
            seen.append([i.step for i in _format.list_checkpoints(ckpt_dir, verify=True) if i.valid])
            return out
        return wrapped

    # after every change of a directory entry, whatever does it
    for owner, name in ((Path, "rename"), (Path, "replace"), (os, "rename"), (os, "replace"), (shutil, "rmtree"),
                        (_format, "exchange")):
        if hasattr(owner, name):
            monkeypatch.setattr(owner, name, observed(getattr(owner, name)))
    m.save(state, 5, metadata={"try": 2})
    monkeypatch.undo()
    assert seen and all(5 in steps for steps in seen), seen
    assert [(i.step, i.metadata) for i in m.list(verify=True)] == [(5, {"try": 2})]
    m.close()


def test_without_an_atomic_exchange_a_replacement_cut_short_is_undone(ckpt_dir, monkeypatch):
    m = CheckpointManager(ckpt_dir, keep=1)
    state = make_state()
    m.save(state, 5, metadata={"try": 1})
    m.close()
    # a file system without RENAME_EXCHANGE
    monkeypatch.setattr(_format, "exchange", lambda a, b: False, raising=False)
    real = Path.rename

    def dies_after_moving_the_old_one_aside(self, target):
        out = real(self, target)
        if self.name == "step-00000005":
            raise _Killed
        return out

    monkeypatch.setattr(Path, "rename", dies_after_moving_the_old_one_aside)
    with pytest.raises(_Killed):
        CheckpointManager(ckpt_dir, keep=1).save(state, 5, metadata={"try": 2})
    monkeypatch.undo()
    fresh = make_state(seed=9)
    assert CheckpointManager(ckpt_dir).restore(fresh) == 5  # the old one is back, not a fresh start
    assert [(i.step, i.valid, i.metadata) for i in _format.list_checkpoints(ckpt_dir)] == [(5, True, {"try": 1})]


# -- failed writes ---------------------------------------------------------------------------


def _assert_intact(ckpt_dir: Path, kept: dict, m: CheckpointManager) -> None:
    m.close()  # the run whose save failed is gone; the next one finds every earlier checkpoint
    infos = CheckpointManager(ckpt_dir).list(verify=True)
    assert [(i.step, i.valid) for i in infos] == [(10, True), (20, True), (30, True)]
    assert not [p for p in ckpt_dir.iterdir() if p.name.startswith(".tmp")]
    fresh = make_state(seed=4)
    assert CheckpointManager(ckpt_dir).restore(fresh) == 30
    assert_same_training_state(kept[30], fresh)


def test_read_only_directory(ckpt_dir, monkeypatch):
    m, kept = _three_checkpoints(ckpt_dir)
    if os.geteuid() == 0:  # root ignores mode bits: make the directory refuse writes as the kernel would
        real_mkdir = Path.mkdir

        def mkdir(self, *args, **kwargs):
            if self.parent == ckpt_dir and not os.stat(ckpt_dir).st_mode & 0o200:
                raise PermissionError(errno.EACCES, "Permission denied", str(self))
            return real_mkdir(self, *args, **kwargs)

        monkeypatch.setattr(Path, "mkdir", mkdir)
    ckpt_dir.chmod(0o555)
    try:
        state = make_state()
        with pytest.raises(CheckpointError, match=r"cannot save step-00000040 into .*Permission denied"):
            m.save(state, 40)
    finally:
        ckpt_dir.chmod(0o755)
    _assert_intact(ckpt_dir, kept, m)


def test_injected_exception_midway(ckpt_dir, monkeypatch):
    m, kept = _three_checkpoints(ckpt_dir)
    real = _engine.save_tensors

    def explode(tensors, directory, group):
        real(tensors, directory, group)  # the data files are written ...
        raise RuntimeError("injected failure")  # ... and then the save dies

    monkeypatch.setattr(_engine, "save_tensors", explode)
    with pytest.raises(CheckpointError, match="saving step-00000040 .* failed: RuntimeError: injected failure; "
                                              "earlier checkpoints are untouched"):
        m.save(make_state(), 40)
    monkeypatch.undo()
    _assert_intact(ckpt_dir, kept, m)


class _FullDisk:
    """A file that takes ``budget`` bytes and then fails as a full disk does."""

    budget = 4096

    def __init__(self, path):
        self._f = open(path, "wb")

    def write(self, data):
        if _FullDisk.budget < len(data):
            raise OSError(errno.ENOSPC, "No space left on device")
        _FullDisk.budget -= len(data)
        return self._f.write(data)

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


@pytest.mark.parametrize("budget", [4096, 10**9])  # dies in a data file / dies writing the manifest
def test_full_disk(ckpt_dir, monkeypatch, budget):
    m, kept = _three_checkpoints(ckpt_dir)
    if budget > 4096:
        monkeypatch.setattr(_format, "write_manifest", lambda *a: (_ for _ in ()).throw(
            OSError(errno.ENOSPC, "No space left on device")))
    _FullDisk.budget = budget
    monkeypatch.setattr(_format, "open_for_write", _FullDisk)
    with pytest.raises(CheckpointError, match=r"no space left on device writing .*step-00000040 \(needed about"):
        m.save(make_state(), 40)
    monkeypatch.undo()
    _assert_intact(ckpt_dir, kept, m)


def test_a_full_disk_says_so_with_the_room_needed_and_free(small_disk, monkeypatch):
    directory = small_disk.path / "checkpoints"
    m = CheckpointManager(directory, keep=3)
    state = make_state(width=20_000)  # about 0.5 MB of parameters, 1.5 MB with Adam's moments
    train_steps(state, 2)
    m.save(state)
    kept = copy.deepcopy(state.model.state_dict())
    small_disk.patch_writes(monkeypatch, _format, "open_for_write")
    small_disk.leave_free(300_000)
    train_steps(state, 1)
    with pytest.raises(CheckpointError) as info:
        m.save(state)
    message = str(info.value)
    target = re.escape(str(directory / "step-00000003"))
    found = re.search(rf"no space left on device writing {target} \(needed about ([0-9.]+) MB, free ([0-9.]+) MB\)",
                      message)
    assert found, message
    assert 1.3 < float(found.group(1)) < 3 and float(found.group(2)) < 0.5
    assert "pos" not in message and "enforce fail" not in message  # no zip writer internals
    small_disk.free_up()
    m.close()
    assert [(i.step, i.valid) for i in list_checkpoints(directory, verify=True)] == [(2, True)]
    fresh = make_state(width=20_000, seed=3)
    assert CheckpointManager(directory).restore(fresh) == 2
    for key, value in fresh.model.state_dict().items():
        assert torch.equal(value, kept[key])


# -- asynchronous saves ----------------------------------------------------------------------


def test_async_save_owns_a_snapshot(ckpt_dir, monkeypatch):
    release = threading.Event()
    started = threading.Event()
    real = _engine.save_tensors

    def slow(tensors, directory, group):
        started.set()
        assert release.wait(10)
        return real(tensors, directory, group)

    monkeypatch.setattr(_engine, "save_tensors", slow)
    m = CheckpointManager(ckpt_dir, async_save=True)
    state = make_state()
    train_steps(state, 4)
    expected = snapshot(state)
    assert m.save(state) is None  # returned before anything was written
    assert started.wait(10)
    train_steps(state, 3)  # the optimizer updates parameters and moments in place
    with torch.no_grad():
        for p in state.model.parameters():
            p.add_(1.0)
    release.set()
    info = m.wait()
    assert info is not None and info.step == 4 and info.valid
    m.close()
    fresh = make_state(seed=8)
    assert CheckpointManager(ckpt_dir).restore(fresh) == 4
    assert_same_training_state(expected, fresh)


def test_async_failure_is_raised_by_the_next_call(ckpt_dir, monkeypatch):
    def broken(*args):
        raise OSError(errno.EIO, "Input/output error")

    m = CheckpointManager(ckpt_dir, async_save=True)
    state = make_state()
    m.save(state, 1)
    m.wait()
    monkeypatch.setattr(_engine, "save_tensors", broken)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a background failure is logged, not warned
        m.save(state, 2)
    with pytest.raises(CheckpointError, match="background save of step 2 failed: .*Input/output error"):
        m.save(state, 3)
    monkeypatch.undo()
    m.save(state, 3)
    m.close()
    assert [i.step for i in m.list()] == [1, 3]
