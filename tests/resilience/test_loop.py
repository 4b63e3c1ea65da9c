"""The resumable loop: intervals, preemption by signal, the epoch form, cleanup on success."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest
import torch

from trainguard.resilience import CheckpointManager, Preempted, list_checkpoints
from trainguard.resilience import _manager as manager_mod

from .conftest import (
    assert_same_final,
    assert_same_training_state,
    make_state,
    read_final,
    read_losses,
    script_command,
)


def run_steps(state, loop, *, stop_at=None, sig=signal.SIGTERM):
    """The usual step loop; at ``stop_at`` the process signals itself in the middle of the step."""
    losses = {}
    it = None
    for step in loop:
        if it is None:
            it = iter(state.loader)
        try:
            x, y = next(it)
        except StopIteration:
            state.epoch += 1
            it = iter(state.loader)
            x, y = next(it)
        loss = torch.nn.functional.mse_loss(state.model(x), y)
        state.optimizer.zero_grad()
        loss.backward()
        if step == stop_at:
            os.kill(os.getpid(), sig)
        state.optimizer.step()
        state.scheduler.step()
        losses[step] = loss.item()
    return losses


def test_sigterm_in_a_separate_process_saves_that_step_and_exits_143(tmp_path, reference_run):
    ref_losses, ref_final = reference_run
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    first = subprocess.run(script_command(ckpt, out, "--every", "5", "--sigterm-at", "11"),
                           capture_output=True, text=True, timeout=120)
    assert first.returncode == 143, first.stderr
    assert "received SIGTERM" in first.stderr and "Traceback" not in first.stderr
    assert [i.step for i in list_checkpoints(ckpt)][-1] == 12  # step 11 finished: 12 steps done
    assert max(s for _, s, _ in read_losses(out)) == 11

    second = subprocess.run(script_command(ckpt, out, "--every", "5"), timeout=120)
    assert second.returncode == 0
    starts = [int(line.split()[1]) for line in (out / "starts.txt").read_text().splitlines()]
    assert starts == [0, 12]
    assert [loss for _, s, loss in read_losses(out)] == [ref_losses[s] for s in range(30)]
    assert_same_final(ref_final, read_final(out))


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_preempted_in_process(ckpt_dir, sig, code):
    reference = make_state()
    expected = run_steps(reference, CheckpointManager(tmp := ckpt_dir.parent / "ref").resume(reference, total_steps=9))
    assert [i.step for i in list_checkpoints(tmp)] == [9]  # the final save

    state = make_state()
    handlers = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with pytest.raises(Preempted) as info:
        run_steps(state, CheckpointManager(ckpt_dir, every_steps=100).resume(state, total_steps=9), stop_at=4, sig=sig)
    assert info.value.code == code and info.value.step == 5
    assert info.value.path == ckpt_dir / "step-00000005"
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == handlers
    assert [i.step for i in list_checkpoints(ckpt_dir)] == [5]

    resumed = make_state(seed=3)
    loop = CheckpointManager(ckpt_dir).resume(resumed, total_steps=9)
    assert (loop.restored_step, loop.start_step) == (5, 5)
    got = run_steps(resumed, loop)
    assert got == {s: expected[s] for s in range(5, 9)}
    assert_same_training_state(reference, resumed)


def test_a_second_ctrl_c_stops_at_once(ckpt_dir):
    state = make_state()
    loop = CheckpointManager(ckpt_dir).resume(state, total_steps=5)
    with pytest.raises(KeyboardInterrupt):
        for _ in loop:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
    assert CheckpointManager(ckpt_dir).list() == []


def test_every_steps_and_every_seconds(ckpt_dir, monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(manager_mod, "_now", lambda: clock[0])
    state = make_state()
    m = CheckpointManager(ckpt_dir, keep=10, every_steps=4, every_seconds=60)
    for step in m.resume(state, total_steps=10):
        clock[0] += 10 if step != 6 else 100  # a slow step 6 makes the time interval due
    assert [i.step for i in m.list()] == [4, 7, 8, 10]


def epoch_run(state, loop, *, crash_after_batches=None):
    seen = []
    for epoch in loop:
        for x, y in state.loader:
            loss = torch.nn.functional.mse_loss(state.model(x), y)
            state.optimizer.zero_grad()
            loss.backward()
            state.optimizer.step()
            seen.append((epoch, loss.item()))
            loop.step()
            if crash_after_batches is not None and len(seen) == crash_after_batches:
                return seen
        state.scheduler.step()
    return seen


def test_epoch_form_resumes_mid_epoch(tmp_path):
    reference = make_state()
    expected = epoch_run(reference, CheckpointManager(tmp_path / "ref").resume(reference, epochs=3))
    assert [e for e, _ in expected] == [0] * 5 + [1] * 5 + [2] * 5

    state = make_state()
    m = CheckpointManager(tmp_path / "ck", keep=10, every_steps=3)
    head = epoch_run(state, m.resume(state, epochs=3), crash_after_batches=8)  # a crash after step 8
    assert [i.step for i in m.list()] == [3, 5, 6]  # step interval, end of epoch 0 (step 5), interval
    m.close()  # the crashed run is gone
    resumed = make_state(seed=11)
    loop = CheckpointManager(tmp_path / "ck", every_steps=3).resume(resumed, epochs=3)
    assert (loop.start_step, loop.start_epoch) == (6, 1)
    tail = epoch_run(resumed, loop)
    assert head[:6] + tail == expected
    assert_same_training_state(reference, resumed)


def test_epoch_form_saves_each_step_once_when_the_interval_ends_an_epoch(tmp_path, monkeypatch):
    reference = make_state()
    expected = epoch_run(reference, CheckpointManager(tmp_path / "ref").resume(reference, epochs=3))
    saved = []
    real = CheckpointManager.save

    def spy(self, state, step=None, **kwargs):
        saved.append((state.step if step is None else step, state.epoch))
        return real(self, state, step, **kwargs)

    monkeypatch.setattr(CheckpointManager, "save", spy)
    state = make_state()
    m = CheckpointManager(tmp_path / "ck", keep=10, every_steps=5)  # 5 batches an epoch
    head = epoch_run(state, m.resume(state, epochs=3), crash_after_batches=12)
    assert saved == [(5, 1), (10, 2)]  # once each, at the end of the epoch
    assert [(i.step, i.epoch) for i in m.list()] == [(5, 1), (10, 2)]
    m.close()
    resumed = make_state(seed=11)
    loop = CheckpointManager(tmp_path / "ck", every_steps=5).resume(resumed, epochs=3)
    assert (loop.start_step, loop.start_epoch) == (10, 2)
    tail = epoch_run(resumed, loop)
    assert head[:10] + tail == expected
    assert_same_training_state(reference, resumed)


def test_epoch_form_without_step_calls_counts_epochs(ckpt_dir):
    state = make_state()
    m = CheckpointManager(ckpt_dir, keep=10)
    for _ in m.resume(state, epochs=3):
        for _batch in state.loader:
            pass
    assert [(i.step, i.epoch) for i in m.list()] == [(1, 1), (2, 2), (3, 3)]


def test_delete_on_success_removes_the_backup(ckpt_dir):
    state = make_state()
    m = CheckpointManager(ckpt_dir, every_steps=2)
    for _ in m.resume(state, total_steps=5, delete_on_success=True):
        pass
    assert not ckpt_dir.exists()


def test_loop_misuse(ckpt_dir):
    m = CheckpointManager(ckpt_dir)
    state = make_state()
    with pytest.raises(ValueError, match="exactly one of total_steps and epochs"):
        m.resume(state, total_steps=3, epochs=2)
    with pytest.raises(ValueError, match="total_steps must be an int >= 0, got -1"):
        m.resume(state, total_steps=-1)
    loop = m.resume(state, total_steps=1)
    with pytest.raises(RuntimeError, match="step\\(\\) is for the epoch form"):
        loop.step()
    list(loop)
    with pytest.raises(RuntimeError, match="iterated once"):
        iter(loop)
    done = m.resume(make_state(), total_steps=1)  # restored at step 1: nothing left to run
    assert list(done) == [] and done.start_step == 1


def accumulate_steps(state, loop, *, k=2, stop_at=None, crash_at=None):
    """The loop of huggingface/transformers examples/pytorch/language-modeling/run_clm_no_trainer.py
    with --gradient_accumulation_steps k (`with accelerator.accumulate(model)`), written out: the
    optimizer steps and zeroes the gradients every k micro-batches; a loop step is a micro-batch."""
    losses = {}
    for step, (x, y) in loop.batches():
        loss = torch.nn.functional.mse_loss(state.model(x), y) / k
        loss.backward()
        if step == stop_at:
            os.kill(os.getpid(), signal.SIGTERM)
        if step == crash_at:
            raise RuntimeError("crash")
        if (step + 1) % k == 0:
            state.optimizer.step()
            state.scheduler.step()
            state.optimizer.zero_grad()
        losses[step] = loss.item()
    return losses


@pytest.mark.parametrize("how", ["sigterm", "every_steps"])
def test_a_save_inside_a_gradient_accumulation_window_waits_for_the_optimizer_step(tmp_path, how):
    # run_clm_no_trainer.py with TrainState + CheckpointManager and --gradient_accumulation_steps 2:
    # SIGTERM after the first micro-batch of a window (or every_steps=3) saved a checkpoint without
    # the gradients accumulated so far; the resumed run lost them and differed from the next step on.
    reference = make_state()
    expected = accumulate_steps(reference, CheckpointManager(tmp_path / "ref").resume(reference, total_steps=12))
    state = make_state()
    if how == "sigterm":
        with pytest.raises(Preempted) as info:
            accumulate_steps(state, CheckpointManager(tmp_path / "ck").resume(state, total_steps=12), stop_at=4)
        assert info.value.step == 6  # step 4 began a window: saved once step 5 had stepped the optimizer
    else:
        with pytest.raises(RuntimeError, match="crash"):
            accumulate_steps(state, CheckpointManager(tmp_path / "ck", every_steps=3).resume(state, total_steps=12),
                             crash_at=5)
        assert [i.step for i in list_checkpoints(tmp_path / "ck")] == [4]  # due at 3, inside a window
    assert [i.step for i in list_checkpoints(tmp_path / "ck")][-1] % 2 == 0
    resumed = make_state(seed=3)
    loop = CheckpointManager(tmp_path / "ck").resume(resumed, total_steps=12)
    got = accumulate_steps(resumed, loop)
    assert got == {s: expected[s] for s in range(loop.start_step, 12)}
    assert_same_training_state(reference, resumed)


def test_resume_strict_false_continues_a_run_whose_state_gained_an_object(tmp_path):
    # run_clm_no_trainer.py checkpointed with TrainState(model, optimizer, scheduler, loader), then
    # resumed with accelerator=accelerator added (or on 2 ranks instead of 1): the error advised
    # restore(strict=False), which a loop written with resume() had no way to pass.
    from trainguard import CheckpointError
    from trainguard.resilience import TrainState

    state = make_state()
    state.step = 3
    CheckpointManager(tmp_path).save(state)
    grown = TrainState(**dict(make_state(seed=1).items()), generator=torch.Generator().manual_seed(7))
    with pytest.raises(CheckpointError, match=r"no state saved for generator.*resume\(\.\.\., strict=False\)"):
        CheckpointManager(tmp_path).resume(grown, total_steps=5)
    loop = CheckpointManager(tmp_path).resume(grown, total_steps=5, strict=False)
    assert loop.restored_step == 3 and grown.step == 3
    assert_same_training_state(state, grown)
