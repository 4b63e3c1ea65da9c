"""DDP started with torch.multiprocessing.spawn: trainguard run records each spawned rank into rank-K."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from trainguard.store import open_run
from trainguard.store._ranks import process_rank, rank_dir

# pytorch/examples distributed/ddp/example.py's ToyModel and step, started the way its
# tutorials do (mp.spawn(fn, args=(world_size,), nprocs=world_size)), on gloo for the CPU.
# With NAN_RANK set, that rank's loss takes log(0) at step 3.
SCRIPT = textwrap.dedent("""
    import os, sys
    import torch, torch.distributed as dist, torch.multiprocessing as mp
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    class ToyModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.net1 = nn.Linear(10, 10)
            self.relu = nn.ReLU()
            self.net2 = nn.Linear(10, 5)

        def forward(self, x):
            return self.net2(self.relu(self.net1(x)))

    def demo_basic(rank, world_size, port, nan_rank):
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
        torch.manual_seed(rank)
        model = DDP(ToyModel())
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for step in range(int(os.environ.get("STEPS", "6"))):
            opt.zero_grad()
            out = model(torch.randn(20, 10))
            loss = nn.functional.mse_loss(out, torch.randn(20, 5))
            if rank == nan_rank and step == 3:
                loss = loss + torch.log(torch.zeros(()))  # the bad line
            loss.backward()
            opt.step()
        dist.destroy_process_group()

    if __name__ == "__main__":
        world = 2
        mp.spawn(demo_basic, args=(world, int(sys.argv[1]), int(os.environ.get("NAN_RANK", "-1"))), nprocs=world)
        print("parent done")
""")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(tmp_path, *options, nan_rank=-1):
    script = tmp_path / "ddp_spawn.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, NAN_RANK=str(nan_rank))
    return subprocess.run([sys.executable, "-m", "trainguard", "run", *options, "--logdir", str(tmp_path / "r"),
                           str(script), str(_free_port())], capture_output=True, text=True, timeout=240, env=env)


def test_each_spawned_rank_is_recorded_into_its_rank_directory(tmp_path):
    proc = _run(tmp_path, "--monitor", "--every", "2")
    assert proc.returncode == 0, proc.stderr
    assert "parent done" in proc.stdout
    logdir = tmp_path / "r"
    # The launcher trained nothing: its own run moved aside, so that readers open the ranks.
    assert not (logdir / "run.sqlite").exists()
    assert (logdir / "launcher" / "run.sqlite").is_file()
    line = proc.stderr.strip().splitlines()[-1]
    assert "recorded 2 spawned processes" in line and "rank-0..rank-1" in line and "launcher" in line, proc.stderr
    assert "child process" not in proc.stderr  # the note for unwatched children is not printed
    for k in (0, 1):
        with open_run(logdir / f"rank-{k}") as run:
            assert run.meta["rank"] == k and run.meta["world_size"] == 2 and run.meta["status"] == "finished"
            ops = {r["op"] for r in run.executions()}
            assert "aten.addmm" in ops and any(op.startswith("c10d.") for op in ops), sorted(ops)[:20]
            assert run.layers() and len(run.steps()) == 6, "the monitor ran in the rank"
    with open_run(logdir) as run:  # the ranks, merged
        assert run.ranks == [0, 1]
    report = subprocess.run([sys.executable, "-m", "trainguard", "report", str(logdir)], capture_output=True,
                            text=True, timeout=120)
    assert report.returncode == 0, report.stderr
    # A second job into the same logdir is refused in one line before any process starts.
    again = _run(tmp_path)
    assert again.returncode == 2 and "Traceback" not in again.stderr, again.stderr
    assert "already holds" in again.stderr and "--overwrite" in again.stderr
    with open_run(logdir / "rank-1") as run:  # and the earlier ranks are intact
        assert run.meta["status"] == "finished"


def test_check_numerics_in_a_spawned_rank_names_the_rank_the_op_and_the_line(tmp_path):
    proc = _run(tmp_path, "--check-numerics", nan_rank=1)
    assert proc.returncode == 3, proc.stderr  # as check_numerics exits in the process it runs
    assert "rank-1 stopped at a non-finite value" in proc.stderr, proc.stderr
    assert "why:" in proc.stderr and "fix:" in proc.stderr
    with open_run(tmp_path / "r" / "rank-1") as run:
        assert run.meta["error"].startswith("NonFiniteError") and "ddp_spawn.py" in run.meta["error"]


@pytest.mark.parametrize("env, expected", [
    ({"TRAINGUARD_RANK": "1", "TRAINGUARD_WORLD_SIZE": "2", "RANK": "0", "WORLD_SIZE": "1"}, (1, 2)),
    ({"RANK": "1", "WORLD_SIZE": "4"}, (1, 4)),
    ({"TRAINGUARD_RANK": "3", "TRAINGUARD_WORLD_SIZE": "2"}, (0, 1)),  # out of range: no rank
])
def test_a_spawned_process_takes_its_rank_from_trainguards_own_variables(monkeypatch, tmp_path, env, expected):
    for k in ("RANK", "WORLD_SIZE", "TRAINGUARD_RANK", "TRAINGUARD_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert process_rank() == expected
    assert rank_dir(tmp_path) == (tmp_path / f"rank-{expected[0]}" if expected[1] > 1 else tmp_path)


def test_trainguard_monitor_diagnoses_the_spawned_ranks(tmp_path):
    script = tmp_path / "ddp_spawn.py"
    script.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, "-m", "trainguard", "monitor", "--every", "5", "--logdir",
                           str(tmp_path / "m"), str(script), str(_free_port())], capture_output=True, text=True,
                          timeout=240, env=dict(os.environ, STEPS="25"))
    assert proc.returncode == 0, proc.stderr
    assert "monitored 2 spawned processes" in proc.stderr, proc.stderr
    # The ranks' diagnosis, not the launcher's "insufficient data" (it trained nothing itself).
    assert "insufficient" not in proc.stdout.lower() and "over 25 steps" in proc.stdout, proc.stdout
    assert (tmp_path / "m" / "launcher" / "run.sqlite").is_file() and (tmp_path / "m" / "rank-1").is_dir()
