"""Two gloo ranks, the poisoned batch on one of them: both rewind together, both skip that step's
batch, and the event names the rank and the origin found there."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from trainguard.cli import main
from trainguard.store import open_run

from .conftest import line_of

SCRIPT = Path(__file__).with_name("_ddp_guard_script.py")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(root: Path, poison: str = "overflow") -> Path:
    subprocess.run([sys.executable, str(SCRIPT), str(root), str(free_port()), poison], check=True, timeout=280)
    return root


@pytest.fixture(scope="module")
def overflow_job(tmp_path_factory) -> Path:
    return run_job(tmp_path_factory.mktemp("overflow"))


@pytest.mark.timeout(300)
def test_two_ranks_rewind_together_and_skip_the_batch_of_the_bad_rank(overflow_job):
    tmp_path = overflow_job
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


@pytest.mark.timeout(300)
def test_the_report_of_a_guarded_job_leads_with_the_rank_whose_loss_went_bad(overflow_job, capsys):
    # The guard's own runs record nothing (each replay has a run of its own): the report must not
    # say that no rank saw a NaN, and details the rank whose loss went non-finite, not rank 0.
    assert main(["report", str(overflow_job / "run")]) == 0
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    assert "No harmful" not in first
    assert first.startswith("the guard caught a non-finite loss on rank 1 in step 25: aten.pow")
    assert "(rank 1 of 2)" in " ".join(out.replace("│", " ").split())


@pytest.fixture(scope="module")
def data_job(tmp_path_factory) -> list[list[dict]]:
    """Rank 1's data holds a NaN sample at step 25 and a label out of range at step 35: each rank's events."""
    root = run_job(tmp_path_factory.mktemp("data"), "data")
    return [json.loads((root / f"out-rank{r}.json").read_text())["events"] for r in (0, 1)]


@pytest.mark.timeout(300)
def test_a_corrupt_sample_on_one_rank_gets_the_data_fix_on_every_rank(data_job):
    # A NaN sample in rank 1's batch (a corrupt record): rank 0's event, whose own batch was clean,
    # must still say the data is at fault, and where, not "check the inputs".
    events = [rank_events[:1] for rank_events in data_job]
    for rank, [event] in enumerate(events):
        assert event["step"] == 25 and event["origin_rank"] == 1
        assert event["batch_nonfinite"]["samples"] == [102] and event["batch_nonfinite"]["kinds"] == ["nan"]
        assert event["origin"]["suggestion"].startswith("the batch itself held nan before any op ran"), rank
    assert events[1][0]["message"].endswith("skipped batch 25 (its sample 102 holds nan in the batch itself)")
    assert events[0][0]["message"].endswith("skipped batch 25 (rank 1's sample 102 holds nan in the batch itself)")


@pytest.mark.timeout(300)
def test_a_label_out_of_range_on_one_rank_is_the_same_event_on_every_rank(data_job):
    # cross_entropy raised on rank 1's label 2 (two classes): rank 0's event named the replay's
    # stand-in NaN instead ("aten.mul.Tensor ... lower the learning rate"), and its decisions could
    # part from rank 1's.
    assert [len(e) for e in data_job] == [2, 2], data_job
    events = [rank_events[1:] for rank_events in data_job]
    for rank, [event] in enumerate(events):
        # step 34: batch 25 was skipped, so the steps run one behind the batches from there
        assert event["step"] == 34 and event["action"] == "skip", event["message"]
        assert event["raised"]["op"] == "F.cross_entropy", (rank, event["message"])
        assert event["raised"]["index"]["in_batch"]["samples"] == [142], rank
        assert event["origin"]["origin"]["op"] == "F.cross_entropy", rank
    assert events[1][0]["message"].endswith("skipped batch 35 (its sample 142 holds target 2)")
    assert events[0][0]["message"].endswith("skipped batch 35 (rank 1's sample 142 holds target 2)"), events[0][0]["message"]
