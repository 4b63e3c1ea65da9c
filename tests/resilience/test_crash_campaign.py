"""A short run of the crash campaign (benchmarks/crash_campaign.py): one SIGKILL at a random moment
for each way of checkpointing (sync and async saves, pruning at keep=1, the epoch form), each
resume checked to start from the newest committed checkpoint and the run to end bitwise equal.
The full campaign (40 kills) is the benchmark script."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import crash_campaign  # noqa: E402


@pytest.mark.timeout(900)
def test_one_kill_per_way_of_checkpointing_loses_and_changes_nothing():
    tallies = crash_campaign.main(["--kills", "4", "--seed", "7", "--quiet"])
    assert set(tallies) == set(crash_campaign.CONFIGS)
    assert all(t.kills == 1 for t in tallies.values())
    assert [f for t in tallies.values() for f in t.failures] == []
