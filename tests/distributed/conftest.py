"""Running 2-rank gloo jobs from the tests, each bounded so that a hang fails instead of blocking.

torchrun starts every worker in a session of its own, so killing the launcher's process group
would leave them running: on a timeout the helper kills the launcher and every process below it
(found through /proc), then fails the test with the tail of their output.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

HERE = Path(__file__).parent
TRAIN = HERE / "_train.py"
# A hung collective waits 30 minutes in gloo: a job that takes this long is hung, not slow.
JOB_TIMEOUT = 150


@dataclass
class Job:
    proc: subprocess.Popen
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def wait(self, timeout: float = JOB_TIMEOUT) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(self.proc.pid)
            self.proc.wait()
            pytest.fail(f"job hung for {timeout}s and was killed: {self.proc.args}\n{self.output()[-4000:]}")


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            tree.setdefault(ppid, []).append(int(entry))
    return tree


def descendants(pid: int) -> list[int]:
    tree, out, todo = _children(), [], [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill_tree(pid: int) -> None:
    for p in [pid, *descendants(pid)]:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def start(args: list[str], log: Path, *, cwd: Path | None = None) -> Job:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    with open(log, "wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, cwd=cwd, env=env)
    return Job(proc, log)


def run(args: list[str], log: Path, *, timeout: float = JOB_TIMEOUT, cwd: Path | None = None) -> tuple[int, str]:
    job = start(args, log, cwd=cwd)
    code = job.wait(timeout)
    return code, job.output()


def trainguard(*args: str) -> list[str]:
    return [sys.executable, "-m", "trainguard", *map(str, args)]


def torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *map(str, args)]


def wait_for(paths: list[Path], job: Job, timeout: float = JOB_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        if job.proc.poll() is not None:
            pytest.fail(f"job ended ({job.proc.returncode}) before {[p.name for p in paths]}:\n{job.output()[-4000:]}")
        if time.monotonic() > deadline:
            kill_tree(job.proc.pid)
            pytest.fail(f"no {[p.name for p in paths]} after {timeout}s:\n{job.output()[-4000:]}")
        time.sleep(0.05)


def losses(out: Path, rank: int) -> list[tuple[int, str]]:
    """``(step, loss.hex())`` per step a rank ran, as _train.py wrote them."""
    lines = (out / f"losses-rank{rank}.txt").read_text().splitlines()
    return [(int(s), v) for s, v in (line.split() for line in lines)]
