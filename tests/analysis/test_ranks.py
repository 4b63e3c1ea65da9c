"""A run of two ranks read as one: ranks, the merged timeline, alerts side by side, and which rank
made the first non-finite value and which only received it (the run: tests/conftest.py)."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

import trainguard as tg
from trainguard.analysis import ranks_report
from trainguard.cli import main


def test_open_gives_every_rank_and_reads_as_the_first(two_ranks):
    with tg.open(two_ranks.root) as run:
        assert run.ranks == [0, 1] and run.rank == 0
        assert run.path == two_ranks.root / "rank-0" and run.name == "job"
        assert run.rank_run(1).path == two_ranks.root / "rank-1"
        assert run.meta["rank"] == 0 and run.rank_run(1).meta["world_size"] == 2
        with pytest.raises(tg.RunNotFound, match="no rank 2"):
            run.rank_run(2)
    with tg.open(two_ranks.root, rank=1) as run:
        assert run.rank == 1 and run.count() == run.rank_run(1).count()


def test_the_timeline_merges_ranks_by_step_then_rank(two_ranks):
    with tg.open(two_ranks.root) as run:
        total = run.rank_run(0).count() + run.rank_run(1).count()
        assert run.timeline_count() == total
        everything = run.timeline()
        assert len(everything) == total
        keys = [(e["step"], e["rank"], e["seq"]) for e in everything]
        assert keys == sorted(keys)
        assert [k[:2] for k in keys][0] == (0, 0) and {k[:2] for k in keys} == {(s, r) for s in range(3) for r in (0, 1)}
        # Pages are slices of the whole, wherever they cut a (step, rank) block.
        def ids(rows):
            return [(e["step"], e["rank"], e["seq"]) for e in rows]

        assert [ids(run.timeline(b, b + 7)) for b in range(0, total, 7)] == [keys[b:b + 7] for b in range(0, total, 7)]
        bad = run.timeline(health="nonfinite")
        assert bad and all(e["health"] for e in bad) and run.timeline_count(health="nonfinite") == len(bad)
        assert [e["rank"] for e in run.timeline(step=1, op="log")] == [1]
        alerts = run.alerts_by_rank()
        assert alerts[0]["total"] > 0 and alerts[1]["total"] > 0


def test_the_rank_that_made_it_and_the_rank_that_received_it(two_ranks):
    with tg.open(two_ranks.root) as run:
        rr = ranks_report(run)
    assert rr["first_rank"] == 1 and rr["made"] == [1] and rr["received"] == [0]
    made, received = rr["per_rank"][1]["first"], rr["per_rank"][0]["first"]
    assert (made["op"], made["step"], made["received_via"]) == ("aten.log", 1, None)
    assert (made["file"], made["line"]) == (two_ranks.log_file, two_ranks.log_line)
    via = received["received_via"]
    assert (via["op"], via["step"]) == ("c10d.allreduce_", 1)
    assert rr["headline"].startswith("rank 1 first made a -inf in step 1: aten.log at ")
    assert "rank 0 only received it, through an all-reduce (c10d.allreduce_) in step 1" in rr["headline"]


def test_report_leads_with_the_first_rank_and_shows_every_rank(two_ranks, capsys):
    assert main(["report", str(two_ranks.root)]) == 0
    out = capsys.readouterr().out
    first_line = out.splitlines()[0]
    assert first_line.startswith("rank 1 first made a -inf in step 1: aten.log at ")
    assert "rank 0 only received it" in first_line
    # The header panel wraps its lines (a longer temporary path, as under pytest-xdist, moved
    # "(rank 1 of 2)" onto two lines): compared without the panel and its line breaks.
    flat = " ".join(out.replace("│", " ").split())
    assert "(rank 1 of 2)" in flat  # the details are those of the rank that made it
    assert "alerts per rank" in out and "received: c10d.allreduce_" in out and "made (first)" in out
    assert main(["report", str(two_ranks.root), "--rank", "0"]) == 0
    out = capsys.readouterr().out
    flat = " ".join(out.replace("│", " ").split())
    assert "(rank 0 of 2)" in flat and out.splitlines()[0].startswith("rank 1 first made")
    assert "came from another rank" in flat  # rank 0's own origin says so
    assert main(["report", str(two_ranks.root), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["rank"] == 1 and rep["ranks"]["first_rank"] == 1 and rep["origin"]["origin"]["op"] == "aten.log"


def test_a_single_process_run_has_no_ranks_section(tmp_path, capsys):
    with tg.record(tmp_path / "one"):
        torch.log(torch.zeros(2))
    with tg.open(tmp_path / "one") as run:
        assert ranks_report(run) is None and run.ranks == []
    assert main(["report", str(tmp_path / "one")]) == 0
    assert "alerts per rank" not in capsys.readouterr().out


def _replicated_dataset_ranks(root, steps=2, buffer=-1, fill=0):
    """Two ranks that each build the whole data set, one row of it NaN (a corrupt record in the
    file), as pytorch/examples' distributed/ddp-tutorial-series/multigpu_torchrun.py builds
    ``MyTrainDataset`` on every rank; only rank 1's batch holds that row, so rank 0 never reads
    its own copy and gets the NaN through the gradient all-reduce (written behind the recorder's
    back, as another rank's contribution is)."""
    import numpy as np
    import torch.distributed as dist

    mp = pytest.MonkeyPatch()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for rank in (0, 1):
            mp.setenv("RANK", str(rank))
            mp.setenv("WORLD_SIZE", "2")
            mp.setattr(dist, "is_initialized", lambda: False)  # the rank comes from the environment
            with tg.record(root, buffer=buffer):
                rows = np.ones((2 * steps, 3), dtype=np.float32)
                rows[3, 1] = np.nan
                data = [torch.from_numpy(r) for r in rows]  # every rank loads every row
                w = torch.ones(3, requires_grad=True)
                for step in range(steps):
                    tg.step(step)
                    x = torch.stack([data[2 * step + rank]])  # rank 1 reads row 3 in step 1
                    (x * w).sum().backward()
                    buf = torch.zeros(3) + w.grad
                    for _ in range(fill):  # other work of the step, for the circular buffer to drop
                        torch.ones(1) + 1
                    dist.all_reduce(buf)
                    if step >= 1 and rank == 0:
                        buf.numpy()[1] = float("nan")  # rank 1's NaN gradient, averaged in
                    with torch.no_grad():
                        w -= 0.1 * buf.view(3)  # as DDP reads its bucket: through a view
                    w.grad = None
            mp.undo()
    finally:
        mp.undo()
        dist.destroy_process_group()


def test_a_rank_whose_own_copy_of_a_bad_row_was_never_read_only_received_it(tmp_path):
    # Both ranks made the NaN row when they loaded the data set (the same op, line and step), but
    # rank 0's copy was never read: its first harmful value that did anything came through the
    # all-reduce. Rank 1, whose batch read the row, is the one that made it.
    _replicated_dataset_ranks(tmp_path / "job")
    with tg.open(tmp_path / "job") as run:
        rr = ranks_report(run)
    assert rr["first_rank"] == 1 and rr["made"] == [1] and rr["received"] == [0]
    assert rr["per_rank"][0]["first"]["received_via"]["op"] == "c10d.allreduce_"
    assert rr["headline"].startswith("rank 1 first made a NaN in step 0: aten.lift_fresh at ")
    assert "rank 0 only received it, through an all-reduce (c10d.allreduce_) in step 1" in rr["headline"]


def test_a_bad_row_received_after_the_buffer_dropped_the_all_reduce(tmp_path):
    # The same, and ten more steps of work than a small circular buffer holds: the all-reduce that
    # brought the NaN must stay in the run, or no rank can be said to have received it.
    _replicated_dataset_ranks(tmp_path / "job", steps=12, buffer=20, fill=1000)
    with tg.open(tmp_path / "job") as run:
        rr = ranks_report(run)
    assert rr["first_rank"] == 1 and rr["made"] == [1] and rr["received"] == [0]
    assert "rank 0 only received it, through an all-reduce (c10d.allreduce_) in step 1" in rr["headline"]


# pytorch/examples' distributed/ddp-tutorial-series/multigpu_torchrun.py, one rank failing: the
# other rank's all-reduce then raises gloo's "Connection closed by peer" (or "reset by peer").
_STEPS = """
import os, signal, sys, torch
torch.manual_seed(0)
model = torch.nn.Linear(20, 1)
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
for step in range(4):
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(torch.rand(8, 20)), torch.rand(8, 1)).backward()
    opt.step()
"""
_LOST_PEER = _STEPS + ('raise RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] '
                       'Connection closed by peer [127.0.0.1]:7604. This is typically caused by a remote worker '
                       'crashing.")\n')


def _as_rank(monkeypatch, rank: int) -> None:
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", "2")


def test_the_rank_that_crashed_first_leads_and_the_one_that_lost_it_follows(tmp_path, monkeypatch, capsys):
    (tmp_path / "bad.py").write_text(_STEPS + 'raise FileNotFoundError("rank 1 lost its data file")\n')
    (tmp_path / "peer.py").write_text(_LOST_PEER)
    for rank, script in ((1, "bad.py"), (0, "peer.py")):  # rank 1 ends first
        _as_rank(monkeypatch, rank)
        assert main(["run", "--logdir", str(tmp_path / "job"), str(tmp_path / script)]) == 1
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    with tg.open(tmp_path / "job") as run:
        rr = ranks_report(run)
    assert rr["first_rank"] == 1
    assert rr["headline"] == ("rank 1 crashed first, in step 4: FileNotFoundError: rank 1 lost its data file; "
                              "rank 0 crashed after it")
    capsys.readouterr()
    assert main(["report", str(tmp_path / "job")]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "the script crashed at step 4: FileNotFoundError: rank 1 lost its data file"
    assert "(rank 1 of 2)" in " ".join(out.replace("│", " ").split())


def test_a_rank_killed_without_closing_its_run_is_named_before_the_one_that_lost_it(tmp_path, monkeypatch):
    import os
    import subprocess
    import sys

    (tmp_path / "killed.py").write_text(_STEPS + "os.kill(os.getpid(), signal.SIGKILL)\n")  # kill -9, the OOM killer
    (tmp_path / "peer.py").write_text(_LOST_PEER)
    env = {**os.environ, "RANK": "1", "WORLD_SIZE": "2"}
    out = subprocess.run([sys.executable, "-m", "trainguard", "run", "--logdir", str(tmp_path / "job"),
                          str(tmp_path / "killed.py")], env=env, timeout=120)
    assert out.returncode == -9
    _as_rank(monkeypatch, 0)
    assert main(["run", "--logdir", str(tmp_path / "job"), str(tmp_path / "peer.py")]) == 1
    with tg.open(tmp_path / "job") as run:
        rr = ranks_report(run)
    assert rr["first_rank"] == 1
    assert rr["headline"].startswith("rank 1's run never ended (its process was killed, or is still running); "
                                     "rank 0 crashed in step 4: RuntimeError: [/__w/pytorch/"), rr["headline"]


def test_a_hung_job_names_the_rank_that_never_reached_the_collective_the_others_wait_in(tmp_path):
    # The same job, rank 1 stuck before its step's gradient all-reduce (a data loader that never
    # returns, a rank-dependent branch) and rank 0 waiting in it, until the job is killed: neither
    # run ends. What each rank recorded last tells which one the others wait for.
    import os
    import subprocess
    import sys

    waits = _STEPS + textwrap.dedent("""
        import time, torch.distributed as dist
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        buf = torch.ones(3) * 2
        dist.all_reduce(buf)  # rank 0: here it waits for rank 1
        time.sleep(1.0)  # the recording's last records are handed over
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    stuck = _STEPS + textwrap.dedent("""
        import time
        x = torch.rand(8, 20) * 2  # rank 1: the next batch, then nothing
        time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    for rank, text in ((0, waits), (1, stuck)):
        (tmp_path / f"rank{rank}.py").write_text(text)
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2"}
        out = subprocess.run([sys.executable, "-m", "trainguard", "run", "--logdir", str(tmp_path / "job"),
                              str(tmp_path / f"rank{rank}.py")], env=env, timeout=120)
        assert out.returncode == -9
    with tg.open(tmp_path / "job") as run:
        rr = ranks_report(run)
    assert rr["first_rank"] == 1
    assert rr["headline"].startswith("no rank's run ended (the job was killed, or is still running): rank 0 "
                                     "waits in c10d.allreduce_ (step 4), which rank 1 never reached: its last "
                                     "op was aten.mul.Tensor at "), rr["headline"]
