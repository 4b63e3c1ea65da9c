"""A short run of the crash campaign (benchmarks/crash_campaign.py): one SIGKILL at a random moment
for three ways of checkpointing (pruning at keep=1 in the step form, the epoch form with sync and
background saves), each resume checked to start from the newest committed checkpoint and the run
to end bitwise equal. The fourth way (background saves in the step form) is test_exactness.py's;
the full campaign (40 kills, all four) is the benchmark script."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import crash_campaign  # noqa: E402


@pytest.mark.timeout(900)
def test_one_kill_per_way_of_checkpointing_loses_and_changes_nothing():
    ways = ["sync-step-keep1", "sync-epoch-keep1", "async-epoch-keep2"]
    tallies = crash_campaign.main(["--kills", "3", "--ways", ",".join(ways), "--seed", "7", "--quiet"])
    assert list(tallies) == ways
    assert all(t.kills == 1 for t in tallies.values())
    assert [f for t in tallies.values() for f in t.failures] == []
