"""A process killed with SIGKILL while recording leaves a run that opens and shows what was flushed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from trainguard.capture._loss_watch import INSPECTIONS
from trainguard.capture._recorder import LOSS_PIN_WINDOW
from trainguard.store import open_run

SCRIPT = textwrap.dedent(
    """
    import sys, torch, trainguard as tg
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with tg.record(sys.argv[1], buffer=int(sys.argv[2]), mode=sys.argv[3]):
        for i in range(10**9):
            opt.zero_grad()
            model(torch.randn(4, 8)).pow(2).mean().backward()
            opt.step()
    """
)


@pytest.fixture(autouse=True, params=["native", "python"])
def backend(request, monkeypatch):
    """Every test here on both recorder backends (the child process reads TRAINGUARD_BACKEND)."""
    monkeypatch.setenv("TRAINGUARD_BACKEND", request.param)
    return request.param


def _kill_when(run_dir, buffer: int, progress, target: int, mode: str = "full_health") -> int:
    """Record SCRIPT into run_dir, poll ``progress(run)`` until it passes ``target``, then SIGKILL.

    Returns the last progress seen (the caller checks it passed the target).
    """
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, str(run_dir), str(buffer), mode])
    seen = 0
    try:
        deadline = time.time() + 60
        while time.time() < deadline and seen <= target:
            time.sleep(0.5)
            if (run_dir / "run.sqlite").exists():
                try:
                    with open_run(run_dir) as run:
                        seen = progress(run)
                except Exception:
                    seen = 0
        if seen > target:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == -signal.SIGKILL
    return seen


def test_sigkill_while_recording(tmp_path):
    run_dir = tmp_path / "r"
    seen = _kill_when(run_dir, -1, lambda run: run.count(), 2000)
    assert seen > 2000, "the recording never flushed"
    with open_run(run_dir) as run:
        assert run.status == "running"  # never closed: the reader says so
        n = run.count()
        assert n >= seen
        rows = run.executions(n - 50, n)
        assert len(rows) == 50
        # what is there is whole: every stored execution has its op, outputs and stack
        last = run.execution(rows[-1]["seq"])
        assert last["op"] and last["outputs"] is not None and last["stack"]
        assert run.meta["last_flush"] > run.meta["created"]
        steps = run.steps()
        assert steps[-1]["step"] > 10


def test_sigkill_with_a_circular_buffer_keeps_the_last_window(tmp_path):
    """With buffer=N only the newest N reach the database; after SIGKILL they are all there."""
    run_dir = tmp_path / "r"
    # far more steps than the buffer holds executions
    steps = _kill_when(run_dir, 300, lambda run: run.steps()[-1]["step"] if run.count() else 0, 200)
    assert steps > 200, "the recording never flushed"
    with open_run(run_dir) as run:
        assert run.status == "running"
        rows = run.executions()
        # older than the window: only the loss chains of the first backward passes, which the
        # recorder pins for the loss-misuse rules (LOSS_PIN_WINDOW executions before each loss)
        pinned, rows = rows[:-300], rows[-300:]
        assert len(pinned) <= INSPECTIONS * (LOSS_PIN_WINDOW + 1) and all(r["step"] < INSPECTIONS for r in pinned)
        seqs = [r["seq"] for r in rows]
        # one unbroken window, the newest: only the optimizer's profiler markers (never
        # recorded, but numbered) leave gaps in the sequence numbers
        assert seqs == sorted(set(seqs)) and seqs[-1] - seqs[0] < 400
        assert run.steps()[-1]["step"] >= steps


def test_sigkill_while_saving_full_tensors(tmp_path):
    """Every tensor row a killed full_tensor recording committed points at whole bytes."""
    run_dir = tmp_path / "r"
    steps = _kill_when(run_dir, 200, lambda run: run.steps()[-1]["step"] if run.count() else 0, 30,
                       mode="full_tensor")
    assert steps > 30, "the recording never flushed"
    with open_run(run_dir) as run:
        rows = run._q("SELECT seq, slot, nbytes FROM payloads")
        assert len(rows) >= 200
        for seq, slot, nbytes in rows:
            t = run.tensor(seq, slot)
            assert t.numel() * t.element_size() == nbytes
