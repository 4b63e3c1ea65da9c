"""Every trainguard option through torchrun, and the monitor under both launchers."""

from __future__ import annotations

import argparse
import os
import shutil
import sys

import pytest

import trainguard as tg
from trainguard.cli import _build_parser

from .conftest import TRAIN, run, torchrun, trainguard


def _subcommand(name: str) -> argparse.ArgumentParser:
    sub = next(a for a in _build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


@pytest.mark.parametrize("command", ["run", "monitor", "doctor"])
def test_every_option_passes_torchruns_parser_after_a_double_dash(command):
    from torch.distributed.run import get_args_parser

    torchrun_parser = get_args_parser()
    flags = [f for a in _subcommand(command)._actions for f in a.option_strings if f.startswith("--")]
    assert "--monitor" in flags or command != "run"
    for flag in flags:
        args = torchrun_parser.parse_args(["--nproc-per-node", "2", "-m", "trainguard", "--", command, flag, "x.py"])
        assert (args.training_script, args.training_script_args) == ("trainguard", [command, flag, "x.py"]), flag


def test_trainguard_monitor_under_torchrun(tmp_path):
    # (--monitor through trainguard's launcher: test_resume; through torchrun with the recorder: test_nan.)
    code, log = run(torchrun("-m", "trainguard", "--", "monitor", "--every", 1, "--logdir", tmp_path / "monitored",
                             TRAIN, "--out", tmp_path / "out", "--steps", 4), tmp_path / "log")
    assert code == 0, log[-3000:]  # rank 1 used to fail: "logdir already holds a run"
    with tg.open(tmp_path / "monitored") as r:
        assert r.ranks == [0, 1]
        for rank, rr in r.rank_runs().items():
            assert rr.meta["rank"] == rank and rr.meta["monitor"]["status"] == "finished"
            assert [s for s, _ in rr.scalars()["loss"]] == [0, 1, 2, 3]
            assert {"0", "1", "3"} <= set(rr.layers())  # this rank's replica, layer by layer
            assert [f["kind"] for f in rr.findings("monitor")] == ["insufficient_data"]  # no problem in 4 steps


def test_trainguard_monitor_launches_the_ranks_itself(tmp_path):
    # As `trainguard run --nproc-per-node 2` does: pytorch/examples' ddp-tutorial-series under
    # `trainguard monitor --nproc-per-node 2 multigpu_torchrun.py` stopped at "unrecognized arguments".
    code, log = run(trainguard("monitor", "--nproc-per-node", 2, "--every", 1, "--logdir", tmp_path / "monitored",
                               TRAIN, "--out", tmp_path / "out", "--steps", 4), tmp_path / "log")
    assert code == 0, log[-3000:]
    with tg.open(tmp_path / "monitored") as r:
        assert r.ranks == [0, 1]
        for rank, rr in r.rank_runs().items():
            assert rr.meta["rank"] == rank and rr.meta["monitor"]["status"] == "finished"
            assert [s for s, _ in rr.scalars()["loss"]] == [0, 1, 2, 3]
            assert rr.count() == 0  # monitored, not recorded
    assert log.count("insufficient_data") == 2  # each rank's diagnosis, as under torchrun
    # The same command again with --resume: each rank's run goes on after its step 3.
    code, log = run(trainguard("monitor", "--nproc-per-node", 2, "--every", 1, "--resume", "--logdir",
                               tmp_path / "monitored", TRAIN, "--out", tmp_path / "out2", "--steps", 4), tmp_path / "log2")
    assert code == 0, log[-3000:]
    with tg.open(tmp_path / "monitored") as r:
        assert [[s for s, _ in rr.scalars()["loss"]] for rr in r.rank_runs().values()] == [list(range(8))] * 2


def test_the_trainguard_script_under_torchrun_with_the_monitor(tmp_path):
    # torchrun -- "$(which trainguard)" run --monitor ...: the console script as torchrun's training script.
    script = shutil.which("trainguard", path=os.path.dirname(sys.executable))
    assert script is not None
    code, log = run(torchrun("--", script, "run", "--monitor", "--every", 1, "--logdir", tmp_path / "r", TRAIN,
                             "--out", tmp_path / "out", "--steps", 2), tmp_path / "log")
    assert code == 0, log[-3000:]
    with tg.open(tmp_path / "r") as r:
        assert r.ranks == [0, 1]
        for rank, rr in r.rank_runs().items():  # recorded and monitored, each rank into its own directory
            assert rr.meta["rank"] == rank and rr.count() > 0 and rr.meta["monitor"]["status"] == "finished"
            assert [s for s, _ in rr.scalars()["loss"]] == [0, 1]


def test_launcher_errors_are_one_line(tmp_path, capsys):
    from trainguard.cli import main

    assert main(["run", "--nproc-per-node", "2", str(tmp_path / "missing.py")]) == 2
    assert "no such script" in capsys.readouterr().err


def test_workers_get_every_option_but_the_launchers(tmp_path):
    from trainguard.cli._launch import worker_argv

    parser = _subcommand("run")
    args = parser.parse_args(["--nproc-per-node", "2", "--max-restarts", "1", "--monitor", "--every", "3",
                              "--mode", "stats", "--buffer", "-1", "--ops=-x|log", "train.py", "--lr", "0.1", "-v"])
    assert worker_argv(parser, args, tmp_path) == [
        f"--logdir={tmp_path}", "--mode=stats", "--buffer=-1", "--ops=-x|log", "--monitor", "--every=3",
        "train.py", "--lr", "0.1", "-v"]
    args = parser.parse_args(["--nproc-per-node", "2", "-m", "pkg.train", "data.csv", "--epochs", "1"])
    assert worker_argv(parser, args, tmp_path) == [f"--logdir={tmp_path}", "-m", "pkg.train", "data.csv", "--epochs", "1"]
    # options after the module's name are the module's (`python -m`), also in the workers' command line
    args = parser.parse_args(["--nproc-per-node", "2", "-m", "pkg.train", "--epochs", "1", "data.csv"])
    assert worker_argv(parser, args, tmp_path) == [f"--logdir={tmp_path}", "-m", "pkg.train", "--epochs", "1", "data.csv"]


def test_the_rank_that_ended_first_is_read_from_the_runs_own_clocks(tmp_path, monkeypatch):
    # torch's agent times a failure in whole seconds, when it polls: rank 1's NaN stop and the
    # error rank 0 then gets from the all-reduce rank 1 left fall in the same second. Each
    # worker's run says when its script ended; the launcher picks by that.
    from trainguard.cli._launch import first_to_end

    # The agent may also SIGTERM a rank that is still closing its run after its script ended: the
    # code is the run's own then.
    for rank, ended, code in ((0, 1000.5, 1), (1, 1000.25, 3), (2, 1000.125, 1)):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "3")
        tg.record(tmp_path / "job").start().stop(ended_at=ended, exit_code=code)  # as trainguard run stops it
    assert first_to_end(tmp_path / "job", {0: 1, 1: -15}, fallback=0) == (1, 3)
    assert first_to_end(tmp_path / "job", {0: 1, 1: 3, 2: 1}, fallback=0) == (2, 1)
    assert first_to_end(tmp_path / "job", {1: 3, 5: -9}, fallback=5) == (5, -9)  # rank 5 has no run: torch's pick
