"""Recorded, monitored, checkpointed DDP under trainguard's launcher: stopped by SIGTERM (one
rank, or the launcher in the middle of a save) and resumed, bitwise equal to a run that never
stopped, and to one that was not recorded at all."""

from __future__ import annotations

import signal

import pytest
import torch

import trainguard as tg

from .conftest import TRAIN, losses, run, start, torchrun, trainguard, wait_for

STEPS = 10


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Plain torchrun, no trainguard anywhere: the uninterrupted run's losses and final state."""
    root = tmp_path_factory.mktemp("reference")
    code, out = run(torchrun(TRAIN, "--out", root / "out", "--steps", STEPS), root / "log")
    assert code == 0, out[-3000:]
    return root / "out"


def assert_same_as(reference, out) -> None:
    for rank in (0, 1):
        assert losses(out, rank) == losses(reference, rank), f"rank {rank}: losses differ"
        want = torch.load(reference / f"final-rank{rank}.pt", weights_only=True)
        got = torch.load(out / f"final-rank{rank}.pt", weights_only=True)
        for key, value in want["model"].items():
            assert torch.equal(value, got["model"][key]), f"rank {rank}: {key} differs"
        for pid, entry in want["optimizer"]["state"].items():
            for key, value in entry.items():
                assert torch.equal(value, got["optimizer"]["state"][pid][key]), f"rank {rank}: optimizer {pid}/{key}"
    assert losses(reference, 0) != losses(reference, 1)  # the ranks really saw different data


def test_sigterm_to_one_rank_while_recording_monitoring_and_saving_asynchronously(tmp_path, reference):
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    job = ("--out", out, "--ckpt", ckpt, "--steps", STEPS, "--async")
    # Rank 1 alone gets SIGTERM during step 4: both ranks save step 5 and stop with 143.
    code, log = run(trainguard("run", "--nproc-per-node", 2, "--monitor", "--every", 2, "--logdir", tmp_path / "run1",
                               TRAIN, *job, "--sigterm-at", "1:4"), tmp_path / "log1")
    assert code == 143, log[-3000:]
    assert [i.step for i in tg.list_checkpoints(ckpt, verify=True) if i.valid][-1] == 5
    assert [s for s, _ in losses(out, 1)] == list(range(5))
    with tg.open(tmp_path / "run1") as first:  # both ranks were recorded and monitored up to the stop
        assert first.ranks == [0, 1]
        for rank in (0, 1):
            r = first.rank_run(rank)
            assert r.count() > 100 and r.meta["rank"] == rank and r.meta["world_size"] == 2
            assert {s for s, _ in r.scalars()["loss"]} == set(range(5))
        first_counts = {rank: first.rank_run(rank).count() for rank in (0, 1)}

    # The requeued job runs the same command again with --resume: each rank continues its own run.
    code, log = run(trainguard("run", "--nproc-per-node", 2, "--monitor", "--every", 2, "--resume",
                               "--logdir", tmp_path / "run1", TRAIN, *job), tmp_path / "log2")
    assert code == 0, log[-3000:]
    assert_same_as(reference, out)
    with tg.open(tmp_path / "run1") as both:
        assert both.ranks == [0, 1]
        for rank in (0, 1):
            r = both.rank_run(rank)
            assert [s for s, _ in r.scalars()["loss"]] == list(range(STEPS)), rank
            assert r.count() > first_counts[rank] and r.meta["status"] == "finished"
            steps = {e["step"] for e in r.executions()}  # (and the ops after the last update: step STEPS)
            assert set(range(STEPS)) <= steps <= set(range(STEPS + 1)), rank


def test_sigterm_to_the_launcher_in_the_middle_of_a_save(tmp_path, reference):
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    job = ("--out", out, "--ckpt", ckpt, "--steps", STEPS, "--async")
    launcher = start(trainguard("run", "--nproc-per-node", 2, "--logdir", tmp_path / "run1", TRAIN, *job,
                                "--hold-save", 4), tmp_path / "log1")
    wait_for([out / "saving-rank0", out / "saving-rank1"], launcher)  # both ranks are inside the save of step 4
    assert not (ckpt / "step-00000004").exists()
    launcher.proc.send_signal(signal.SIGTERM)
    code = launcher.wait()
    assert code == 143, launcher.output()[-3000:]
    valid = [i.step for i in tg.list_checkpoints(ckpt, verify=True) if i.valid]
    assert valid[-2:] == [4, 5]  # the held save finished, and the step the signal ended was saved

    code, log = run(trainguard("run", "--nproc-per-node", 2, "--logdir", tmp_path / "run2", TRAIN, *job),
                    tmp_path / "log2")
    assert code == 0, log[-3000:]
    assert_same_as(reference, out)
