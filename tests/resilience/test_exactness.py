"""End to end: a run killed with SIGKILL at random points and resumed each time is bitwise the same.

Model with dropout, a shuffled DataLoader with 2 workers, Adam and a StepLR schedule; each run is
a separate process. Saves go to the background (async) in the interrupted runs and are
synchronous in the reference, so this also shows the two write the same state.
"""

from __future__ import annotations

import random
import signal
import subprocess
import time

from trainguard.resilience import list_checkpoints

from .conftest import assert_same_final, read_final, read_losses, script_command


def _wait_for_step(proc: subprocess.Popen, out, step: int, timeout: float = 60) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        if (out / "losses.txt").exists() and any(s >= step for _, s, _ in read_losses(out)):
            return True
        time.sleep(0.002)
    raise AssertionError(f"the training process never reached step {step}")


def test_sigkill_at_random_points_then_resume_is_bitwise_identical(tmp_path, reference_run):
    ref_losses, ref_final = reference_run
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    chooser = random.Random(20240611)
    targets = sorted(chooser.sample(range(3, 27), 4))
    killed = 0
    for target in targets:
        proc = subprocess.Popen(script_command(ckpt, out, "--async-save"))
        if _wait_for_step(proc, out, target):
            time.sleep(chooser.uniform(0, 0.03))  # land anywhere: mid-step, mid-save, between
            proc.send_signal(signal.SIGKILL)
        if proc.wait(timeout=60) == -signal.SIGKILL:
            killed += 1
    final = subprocess.run(script_command(ckpt, out, "--async-save"), timeout=120)
    assert final.returncode == 0
    assert killed >= 3

    rows = read_losses(out)
    assert {s for _, s, _ in rows} == set(range(30))
    for pid, step, loss in rows:  # re-run steps (after a kill) must repeat the same loss exactly
        assert loss == ref_losses[step], f"step {step} (pid {pid}): {loss} != {ref_losses[step]}"
    starts = [int(line.split()[1]) for line in (out / "starts.txt").read_text().splitlines()]
    assert starts[0] == 0 and max(starts[1:]) > 0  # later runs really resumed
    assert_same_final(ref_final, read_final(out))
    assert all(i.valid for i in list_checkpoints(ckpt, verify=True) if i.complete)
