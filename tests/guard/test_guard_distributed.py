"""Two gloo ranks, the poisoned batch on one of them: both rewind together, both skip that step's
batch, and the event names the rank and the origin found there."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from trainguard.store import open_run

from .conftest import line_of

SCRIPT = Path(__file__).with_name("_ddp_guard_script.py")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(300)
def test_two_ranks_rewind_together_and_skip_the_batch_of_the_bad_rank(tmp_path):
    subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), str(free_port())], check=True, timeout=280)
    outs = [json.loads((tmp_path / f"out-rank{r}.json").read_text()) for r in (0, 1)]
    for out in outs:
        assert out["step"] == 40 and out["finite"]
        [event] = out["events"]
        assert event["step"] == 25 and event["action"] == "skip" and event["origin_rank"] == 1
        assert event["ranks"] == [0, 1]  # rank 0's averaged gradients went non-finite too
        assert event["rewound_to"] == 20 and event["replay"]["bitwise_equal"] is True
        link = event["origin"]["origin"]
        assert link["op"].startswith("aten.pow") and link["line"] == line_of("POW_LINE")
        assert event["skipped"][0]["batch"] == 25
    assert outs[0]["seen"] == outs[1]["seen"]  # the same decisions at the same steps
    assert outs[0]["digest"] == outs[1]["digest"]  # DDP kept the replicas equal through it all
    assert "on rank 1" in outs[0]["events"][0]["reason"]  # rank 0's own loss stayed finite
    # each rank's run holds the event and its own recording of the replayed step
    for r in (0, 1):
        with open_run(tmp_path / "run", rank=r) as run:
            assert [f["event"]["step"] for f in run.findings(source="guard")] == [25]
        with open_run(tmp_path / "run" / "replays" / "step-25", rank=r) as replay:
            assert {s["step"] for s in replay.steps()} == {25}
