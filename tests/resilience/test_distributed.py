"""Two ranks (gloo, separate processes) save and resume a DDP model exactly, and stop together
when only one of them is told to stop."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import torch

from trainguard.resilience import list_checkpoints

SCRIPT = Path(__file__).with_name("_ddp_script.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(phase: str, root: Path, total: int, sigterm_at: int) -> None:
    subprocess.run([sys.executable, str(SCRIPT), phase, str(root), str(free_port()), str(total), str(sigterm_at)],
                   check=True, timeout=240)


def losses(out: Path, rank: int) -> list[tuple[int, str]]:
    return [(int(s), v) for s, v in (line.split() for line in (out / f"losses-rank{rank}.txt").read_text().splitlines())]


def test_two_ranks_save_and_resume_a_ddp_model_exactly(tmp_path):
    run("first", tmp_path, 14, 4)  # SIGTERM to rank 1 during step 4: mid-epoch (6 batches per rank)
    ckpt = tmp_path / "ckpt"
    for rank in (0, 1):  # both ranks saved step 5 (steps 0-4 done) and stopped with the SIGTERM code
        assert (tmp_path / "out" / f"preempted-rank{rank}.txt").read_text() == "143 5"
    infos = list_checkpoints(ckpt, verify=True)
    assert [(i.step, i.valid, i.world_size) for i in infos][-1] == (5, True, 2)
    files = sorted(p.name for p in (ckpt / "step-00000005").iterdir())
    assert files == ["__0_0.distcp", "__1_0.distcp", "manifest.json"]  # each rank wrote its own part
    run("second", tmp_path, 14, 0)  # new processes: restore step 5, run to 14

    ref, out = tmp_path / "ref", tmp_path / "out"
    for rank in (0, 1):
        assert losses(out, rank) == losses(ref, rank), f"rank {rank} losses differ"
        want = torch.load(ref / f"final-rank{rank}.pt", weights_only=True)
        got = torch.load(out / f"final-rank{rank}.pt", weights_only=True)
        for key, value in want["model"].items():
            assert torch.equal(value, got["model"][key]), f"rank {rank}: {key} differs"
        for pid, entry in want["optimizer"]["state"].items():
            for key, value in entry.items():
                assert torch.equal(value, got["optimizer"]["state"][pid][key])
    assert losses(out, 0) != losses(out, 1)  # the ranks really saw different data
