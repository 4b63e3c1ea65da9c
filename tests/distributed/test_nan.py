"""A NaN planted in rank 1's batch under torchrun (recorded and monitored): the merged report names rank 1, the op and the
line, and says that rank 0 only received it through the gradient all-reduce."""

from __future__ import annotations

import json

import trainguard as tg
from trainguard.cli import main

from .conftest import TRAIN, run, torchrun, trainguard

PLANT = 'x[1, 3] = float("nan")'


def test_the_report_names_the_rank_that_made_the_nan(tmp_path, capsys):
    logdir = tmp_path / "run"
    # python -m torch.distributed.run ... -m trainguard run ...: every option after a "--" (see docs/distributed.md)
    code, log = run(torchrun("-m", "trainguard", "--", "run", "--monitor", "--buffer", -1, "--logdir", logdir, TRAIN,
                             "--out", tmp_path / "out", "--steps", 5, "--nan-at", "1:2"), tmp_path / "log")
    assert code == 0, log[-3000:]
    line = next(i for i, t in enumerate(TRAIN.read_text().splitlines(), 1) if PLANT in t)

    with tg.open(logdir) as r:
        assert r.ranks == [0, 1]
        for rank in r.ranks:  # --monitor reached every rank through torchrun
            assert [s for s, _ in r.rank_run(rank).scalars()["loss"]] == [0, 1, 2, 3, 4]
        steps_then_ranks = [(e["step"], e["rank"]) for e in r.timeline()]
        assert steps_then_ranks == sorted(steps_then_ranks) and {k for _, k in steps_then_ranks} == {0, 1}

    assert main(["report", str(logdir), "--json"]) == 0
    ranks = json.loads(capsys.readouterr().out)["ranks"]
    assert (ranks["first_rank"], ranks["made"], ranks["received"]) == (1, [1], [0])
    made = ranks["per_rank"][1]["first"]
    assert (made["step"], made["line"], made["health"]) == (2, line, ["nan"])
    via = ranks["per_rank"][0]["first"]["received_via"]
    assert (via["op"], via["phase"], via["step"]) == ("c10d.allreduce_", "backward", 2)

    assert main(["report", str(logdir)]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith(f"rank 1 first made a NaN in step 2: {made['op']} at ")
    assert f"_train.py:{line} (forward pass)" in first
    assert "rank 0 only received it, through the gradient all-reduce (c10d.allreduce_) in step 2" in first


def test_check_numerics_stops_the_job_at_the_rank_that_made_the_nan(tmp_path, capsys):
    # The guard under trainguard's launcher: rank 1 stops at its NaN (exit 3), the agent stops rank 0,
    # which waits in the all-reduce rank 1 will never join; the launcher says which rank ended first.
    logdir = tmp_path / "run"
    code, log = run(trainguard("run", "--nproc-per-node", 2, "--shutdown-timeout", 5, "--check-numerics", "--logdir",
                               logdir, TRAIN, "--out", tmp_path / "out", "--steps", 4, "--nan-at", "1:2"),
                    tmp_path / "log")
    assert code == 3, log[-3000:]
    assert "rank 1 ended first, with exit code 3" in log
    with tg.open(logdir, rank=1) as r:
        stop = r.meta["check_numerics_stop"]
        assert stop["op"].startswith(r.execution(stop["seq"])["op"]) and r.execution(stop["seq"])["step"] == 2
    assert main(["report", str(logdir), "--json"]) == 0
    ranks = json.loads(capsys.readouterr().out)["ranks"]
    assert (ranks["first_rank"], ranks["made"]) == (1, [1])
