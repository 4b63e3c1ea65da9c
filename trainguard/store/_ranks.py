"""Ranks in the run directory: under ``torch.distributed`` each rank writes ``logdir/rank-K/``.

Everything that writes a run for the training process (the recorder, the monitor, the doctor,
the guard) goes through :func:`rank_dir`, so that the ranks of one job never share a database.
Nothing here imports torch: the rank comes from an initialised default process group when the
program made one, else from the environment torchrun gives every worker (``RANK``,
``WORLD_SIZE``), which is set before the script starts (``trainguard run`` records from its
first line, long before ``init_process_group``). A process ``trainguard run`` followed into
``torch.multiprocessing.spawn`` has its rank in ``TRAINGUARD_RANK`` and ``TRAINGUARD_WORLD_SIZE``
instead (``cli._spawned``): the script's own code never sees a ``RANK`` it did not set.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

from trainguard.store._codec import DB_NAME

RANK_PREFIX = "rank-"
# A spawned process's rank and world size, set by the process that followed it (cli._spawned).
ENV_RANK, ENV_WORLD_SIZE = "TRAINGUARD_RANK", "TRAINGUARD_WORLD_SIZE"
# Namespaces of communication ops: what torch.distributed and DDP call, the functional collectives.
COLLECTIVE_PREFIXES = ("c10d.", "_c10d_functional.", "c10d_functional.")


def is_collective(op: str | None) -> bool:
    """A communication op, whose output another rank writes (``wait_tensor`` only waits for one)."""
    return bool(op) and op.startswith(COLLECTIVE_PREFIXES) and "wait_tensor" not in op


def process_rank() -> tuple[int, int]:
    """``(rank, world_size)`` of this process; ``(0, 1)`` outside distributed training."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except (RuntimeError, ValueError):  # a group being torn down
        pass
    env = (ENV_RANK, ENV_WORLD_SIZE) if ENV_RANK in os.environ else ("RANK", "WORLD_SIZE")
    try:
        rank, world = int(os.environ.get(env[0], "0")), int(os.environ.get(env[1], "1"))
    except ValueError:
        return 0, 1
    return (rank, world) if 0 <= rank < world else (0, 1)


def spawned() -> bool:
    """Whether this process is a rank ``trainguard run`` followed into ``torch.multiprocessing.spawn``:
    the run in the parent directory is then its launcher's, not an older job's."""
    return ENV_RANK in os.environ


def rank_dir(logdir: str | os.PathLike) -> Path:
    """The directory this process writes: ``logdir/rank-K`` when the job has several ranks.

    A worker group torchrun restarted after a failure writes ``logdir-restart<N>/rank-K``: the
    failed attempt's run is evidence, not something to overwrite or to refuse to start over.
    """
    rank, world = process_rank()
    base = Path(logdir)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if restart.isdigit() and int(restart) > 0:
        base = base.with_name(f"{base.name}-restart{int(restart)}")
    return base / f"{RANK_PREFIX}{rank}" if world > 1 else base


def rank_of_dir(path: Path) -> int | None:
    """K for a directory named ``rank-K``, else None."""
    tail = path.name[len(RANK_PREFIX):]
    return int(tail) if path.name.startswith(RANK_PREFIX) and tail.isdigit() else None


def remove_stale_ranks(logdir: str | os.PathLike) -> list[Path]:
    """Rank 0 replacing a run: remove ``rank-K`` runs with K >= the world size (an older, larger
    job), which a reader would otherwise merge into this one, and a single-process run in
    ``logdir`` itself, which readers would take instead of the ranks. Returns what it removed."""
    rank, world = process_rank()
    base = Path(logdir)
    removed: list[Path] = []
    if rank != 0 or world <= 1 or not base.is_dir():
        return removed
    for suffix in ("", "-wal", "-shm") if not spawned() else ():  # a launcher's run: moved at its end
        db = base / (DB_NAME + suffix)
        if db.is_file():
            db.unlink()
            removed.append(db)
    for p in base.iterdir():
        k = rank_of_dir(p)
        if k is not None and k >= world and (p / DB_NAME).is_file() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def launch_time() -> float:
    """When this job started: the launching agent's start under torchrun (all local ranks agree,
    so default run names match), else now."""
    if "LOCAL_RANK" in os.environ or "TORCHELASTIC_RUN_ID" in os.environ:
        started = _parent_start_time()
        if started is not None:
            return started
    return time.time()


def _parent_start_time() -> float | None:
    try:
        stat = Path(f"/proc/{os.getppid()}/stat").read_text()
        ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22: start time in clock ticks since boot
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def default_name(prefix: str) -> str:
    """``<prefix>-<date>-<time>`` of :func:`launch_time` (the same name on every rank)."""
    return f"{prefix}-{time.strftime('%Y%m%d-%H%M%S', time.localtime(launch_time()))}"
