"""find_runs: runs side by side, one folder down, ranks, and the runs inside a run's replays/."""

from __future__ import annotations

from trainguard.store import RunWriter, find_runs


def test_find_runs_lists_the_replays_inside_a_run(tmp_path):
    for rel in ("a", "group/b", "a/replays/step-60", "a/replays/step-60-2", "c/rank-0", "c/rank-1",
                "c/replays/step-3/rank-0", "c/replays/step-3/rank-1", "a/not-replays/x"):
        RunWriter(tmp_path / rel, mode="no_tensor").close()
    found = [str(p.relative_to(tmp_path)) for p in find_runs(tmp_path)]
    # a run is not searched below, except its replays/ folder
    assert found == ["a", "a/replays/step-60", "a/replays/step-60-2", "c", "c/replays/step-3", "group/b"]
