"""Fixtures shared across packages; the small real models of ``true_models.py`` are importable
from every test folder."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

# One intra-op thread per test process. Two xdist workers share two cores: with torch's default of
# a thread per core each, four spinning OpenMP threads fight over two cores, and small ops get ten
# times slower (the 40-step x-transformers test of test_diagnose.py: 64 s with two threads, 3.9 s
# with one, on a loaded machine). Subprocesses the tests start inherit the variable.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Inductor compiles in this process, not in a pool of worker processes: on two cores the pool's
# start (two more processes importing torch) costs more than it saves. test_compile.py and
# test_compile_origin.py with a warm cache, one after the other on the same loaded machine: 84.7 s
# of CPU and 424 s wall with the pool, 73.5 s and 365 s without.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")


def pytest_configure(config) -> None:
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


# The files that take longest (Inductor compiles, spawned ranks, subprocess runs), longest first.
# `make test` hands whole files to two workers in collection order (`--dist loadfile
# --no-loadscope-reorder`): these go first and the many short files fill in at the end. By default
# xdist orders files by their number of tests, which put these few-test, slow files last, where
# one worker ran the last of them while the other sat idle.
SLOW_FILES = (
    "examples/test_gallery.py",
    "capture/test_compile.py",
    "test_benchmarks.py",
    "integrations/test_build_nanogpt_real.py",
    "distributed/test_fsdp2_real.py",
    "integrations/test_build_nanogpt_real_masked.py",
    "capture/test_compile_origin.py",
    "integrations/test_lightning.py",
    "capture/test_recorder.py",
    "resilience/test_crash_campaign.py",
    "capture/test_compile_ddp.py",
    "capture/test_compile_cost.py",
    "guard/test_guard.py",
    "distributed/test_launch.py",
    "integrations/test_docs_examples.py",
    "integrations/test_transformers.py",
    "resilience/test_exactness.py",
    "distributed/test_resume.py",
    "cli/test_crashed_script.py",
    "cli/test_guard_cli.py",
    "cli/test_spawned.py",
)


def pytest_collection_modifyitems(config, items) -> None:
    """The slow files first, then the others by their number of tests (xdist's own order): each
    file's tests stay together and in order."""
    def file_of(item) -> str:
        return item.nodeid.split("::", 1)[0].removeprefix("tests/")

    rank = {name: k for k, name in enumerate(SLOW_FILES)}
    counts: dict[str, int] = {}
    for item in items:
        counts[file_of(item)] = counts.get(file_of(item), 0) + 1
    items.sort(key=lambda item: (rank.get(file_of(item), len(rank)), -counts[file_of(item)], file_of(item)))


@dataclass
class TwoRanks:
    root: Path  # the logdir: root/rank-0, root/rank-1
    log_file: str  # where rank 1 made its -inf
    log_line: int


def _rank0(tg, torch, dist) -> None:
    w = torch.ones(4)
    for _ in range(3):  # steps 0, 1, 2; from step 1 on the reduced buffer holds a NaN "from rank 1"
        buf = (w * 0.5).clone()
        dist.all_reduce(buf)
        if tg.capture.current_step() >= 1:
            buf.numpy()[2] = float("nan")  # arrived through the all-reduce: no op of this rank made it
        (buf * 2).sum()
        tg.step()


def _rank1(tg, torch, dist) -> None:
    w = torch.ones(4)
    for _ in range(3):
        x = w - float(tg.capture.current_step() >= 1)  # zeros from step 1
        torch.log(x).sum().item()  # -inf from step 1 on: made here, and read (harmful)
        buf = (w * 0.5).clone()
        dist.all_reduce(buf)
        tg.step()


@pytest.fixture(scope="session")
def two_ranks(tmp_path_factory) -> TwoRanks:
    """A run of two ranks in which rank 1 makes a -inf (log of 0) in step 1 and rank 0 only
    receives a NaN through an all-reduce in the same step.

    The ranks are recorded here, one after the other, in one process: the environment says which
    rank is recording (as torchrun's does), a one-rank gloo group runs the real collective, and
    rank 0's reduced buffer is written behind the recorder's back, as another rank's contribution
    is. The end-to-end version under torchrun is in tests/distributed.
    """
    import torch
    import torch.distributed as dist

    import trainguard as tg

    root = tmp_path_factory.mktemp("ranks") / "job"
    mp = pytest.MonkeyPatch()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for rank, body in ((0, _rank0), (1, _rank1)):
            mp.setenv("RANK", str(rank))
            mp.setenv("WORLD_SIZE", "2")
            mp.setattr(dist, "is_initialized", lambda: False)  # the rank comes from the environment
            with tg.record(root, buffer=-1):
                tg.step(0)
                body(tg, torch, dist)
            mp.undo()
    finally:
        mp.undo()
        dist.destroy_process_group()
    line = next(i for i, t in enumerate(Path(__file__).read_text().splitlines(), 1) if "torch.log(x).sum()" in t)
    return TwoRanks(root, __file__, line)


class SmallDisk:
    """A directory on a file system that can be filled: :meth:`leave_free` leaves ``n`` bytes.

    ``real`` is True on a 16 MiB tmpfs mounted for the test (root, where mounting is allowed);
    otherwise the test falls back to :meth:`patch_writes`, which makes the writes that go
    through a given ``open`` seam fail with ENOSPC once ``n`` bytes are spent.
    """

    SIZE = 16 << 20

    def __init__(self, path: Path, real: bool):
        self.path = path
        self.real = real
        self._budget: list[int] | None = None

    def leave_free(self, n: int) -> None:
        if self.real:
            filler = self.path / f".filler-{uuid.uuid4().hex[:6]}"
            free = shutil.disk_usage(self.path).free
            with open(filler, "wb") as f:
                f.write(b"\0" * max(free - n, 0))
        else:
            self._budget = [n]

    def free_up(self) -> None:
        for p in self.path.glob(".filler-*"):
            p.unlink()
        self._budget = None

    def patch_writes(self, monkeypatch, owner, name: str) -> None:
        """The fallback: files made by ``owner.name(path)`` fill the budget; disk_usage reports it."""
        if self.real:
            return
        monkeypatch.setattr(owner, name, self.opener(getattr(owner, name)))
        real_usage = shutil.disk_usage

        def usage(path):
            u = real_usage(path)
            if self._budget is None:
                return u
            return type(u)(u.total, u.total - self._budget[0], self._budget[0])

        monkeypatch.setattr(shutil, "disk_usage", usage)

    def opener(self, real_open):
        """Wrap a ``path -> file`` function so that, in the fallback, its files fill the budget."""
        disk = self

        class _Limited:
            def __init__(self, path):
                self._f = real_open(path)

            def write(self, data):
                budget = disk._budget
                if budget is not None:
                    n = len(memoryview(data).cast("B"))
                    if n > budget[0]:
                        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                    budget[0] -= n
                return self._f.write(data)

            def __getattr__(self, name):
                return getattr(self._f, name)

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self._f.close()

        return _Limited


def _mount_tmpfs(where: Path, size: int) -> bool:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                          capture_output=True, timeout=30)
    return done.returncode == 0


@pytest.fixture
def small_disk(tmp_path):
    where = tmp_path / "small-disk"
    # TRAINGUARD_TEST_NO_TMPFS=1 runs the fallback on a machine that could mount (to test it).
    real = not os.environ.get("TRAINGUARD_TEST_NO_TMPFS") and _mount_tmpfs(where, SmallDisk.SIZE)
    where.mkdir(exist_ok=True)
    try:
        yield SmallDisk(where, real)
    finally:
        if real:
            subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=30)
