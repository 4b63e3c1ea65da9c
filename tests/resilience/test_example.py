"""examples/resume/train.py runs, stops on Ctrl-C with a checkpoint, and continues when run again."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).parents[2] / "examples" / "resume" / "train.py"


def test_example_survives_ctrl_c(tmp_path):
    cmd = [sys.executable, str(EXAMPLE), "--run", str(tmp_path), "--steps", "60", "--every", "1000",
           "--step-delay", "0.02"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if line.startswith("step    25"):
            proc.send_signal(signal.SIGINT)
            break
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    saved = sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*"))
    assert len(saved) == 1 and 26 <= int(saved[0][5:]) < 60  # the step in flight finished, then saved
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    assert f"resumed from step {int(saved[0][5:])}" in again.stdout
    assert "done: 60 steps; last checkpoint step-00000060" in again.stdout
