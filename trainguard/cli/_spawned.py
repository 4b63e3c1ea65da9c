"""Processes started with ``torch.multiprocessing.spawn``: recorded like the script, one run per rank.

DDP started as pytorch/examples start it, ``mp.spawn(train, args=(world,), nprocs=world)``,
trains only in its children. While ``trainguard run`` runs a script, :class:`Follow` hands each
spawned process its function wrapped in :class:`Spawned` (picklable: the function by reference,
the options as plain values), which opens the same trainguard options the script got (the
recorder or ``check_numerics``, the monitor) into ``LOGDIR/rank-K`` (K: the process index spawn
passes, the rank by convention), as a torchrun launch would, and closes them with the function's
ending. The child's rank reaches the run store through ``TRAINGUARD_RANK`` and
``TRAINGUARD_WORLD_SIZE`` (see ``store._ranks``), never through the ``RANK`` a user's script may read.

Readers take a run in ``LOGDIR`` itself before its ranks, so the launching process's own run
moves to ``LOGDIR/launcher`` when it ran no ``backward()`` itself (see :func:`move_launcher_run`).
Not followed: processes started with ``start_method="fork"`` (a copy of this process, its
open runs included) or by ``multiprocessing.Process`` directly (mnist_hogwild), and any process
under the guard, which rewinds the process it runs in: for those ChildWatch's note says how to
watch them.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainguard._errors import TrainguardError
from trainguard.store._codec import DB_NAME
from trainguard.store._ranks import ENV_RANK, ENV_WORLD_SIZE, RANK_PREFIX

LAUNCHER = "launcher"


@dataclass(frozen=True)
class Options:
    """What each spawned process opens: plain values, pickled to the child."""

    logdir: str
    record: dict[str, Any] | None = None  # tg.record's keywords (mode, buffer, ops, dtypes); None: no recorder
    check_numerics: dict[str, Any] | None = None  # tg.check_numerics's keywords (buffer, strict), instead
    monitor: dict[str, Any] | None = None  # the Monitor's keywords (every, gradcheck); None: no monitor
    overwrite: bool = False


class Spawned:
    """``fn`` run in a spawned process under ``options``: ``Spawned(fn, options, nprocs)(i, *args)``."""

    def __init__(self, fn, options: Options, nprocs: int) -> None:
        self.fn, self.options, self.nprocs = fn, options, nprocs

    def __call__(self, i: int, *args):
        os.environ[ENV_RANK], os.environ[ENV_WORLD_SIZE] = str(i), str(self.nprocs)
        import trainguard as tg
        from trainguard.capture._ending import ending as run_ending

        o = self.options
        recorder = None
        if o.check_numerics is not None:
            recorder = tg.check_numerics(o.logdir, mode="full_health", **o.check_numerics)
        elif o.record is not None:
            recorder = tg.record(o.logdir, overwrite=o.overwrite, **o.record)
        if recorder is not None:
            recorder.start()
        monitor = None
        error: BaseException | None = None
        try:
            if o.monitor is not None:
                from trainguard._wiring import Monitor
                from trainguard.integrations import watch_frameworks

                monitor = Monitor(None, logdir=o.logdir, overwrite=o.overwrite, **o.monitor)
                watch_frameworks(monitor)
            return self.fn(i, *args)
        except BaseException as exc:
            error = exc
            raise
        finally:
            ending = run_ending(error)
            if monitor is not None:
                monitor.close(error=error)
            if recorder is not None:
                recorder.stop(**ending)


class Follow:
    """While started, ``torch.multiprocessing.spawn`` and ``start_processes`` run their function
    wrapped in :class:`Spawned`. ``spawned`` counts the processes so started."""

    def __init__(self, options: Options) -> None:
        self.options = options
        self.spawned = 0
        self._saved: list[tuple[Any, str, Any]] = []

    def start(self) -> None:
        import torch.multiprocessing as tmp

        tmp_spawn = sys.modules["torch.multiprocessing.spawn"]  # the package's `spawn` is the function

        original = tmp_spawn.start_processes
        follow = self

        def start_processes(fn, args=(), nprocs=1, join=True, daemon=False, start_method="spawn"):
            if start_method != "fork":  # a forked child carries this process's open runs: not followed
                follow._refuse_stale(nprocs)
                follow.spawned += nprocs
                fn = Spawned(fn, follow.options, nprocs)
            return original(fn, args, nprocs, join, daemon, start_method)

        # spawn() calls its module's start_processes; torch.multiprocessing re-exports it.
        for owner in (tmp_spawn, tmp):
            self._saved.append((owner, "start_processes", owner.start_processes))
            owner.start_processes = start_processes

    def stop(self) -> None:
        while self._saved:
            owner, name, value = self._saved.pop()
            setattr(owner, name, value)

    def _refuse_stale(self, nprocs: int) -> None:
        """Before any process starts: a rank run left in LOGDIR by an earlier job is not replaced
        without --overwrite (the child would refuse it after its start, with a traceback)."""
        if self.options.overwrite:
            return
        base = Path(self.options.logdir)
        old = [p.name for p in sorted(base.glob(f"{RANK_PREFIX}*")) if (p / DB_NAME).is_file()]
        if old:
            raise SpawnRefused(f"logdir {str(base)!r} already holds rank runs ({', '.join(old)}) from an earlier "
                               "job; choose a new logdir or pass --overwrite")

    def ranks(self) -> list[Path]:
        base = Path(self.options.logdir)
        return sorted((p for p in base.glob(f"{RANK_PREFIX}*") if (p / DB_NAME).is_file()),
                      key=lambda p: int(p.name[len(RANK_PREFIX):]) if p.name[len(RANK_PREFIX):].isdigit() else 1 << 30)


class SpawnRefused(TrainguardError):
    """The script's spawn call was refused before any process started."""


def move_launcher_run(logdir: Path) -> Path | None:
    """Move the launching process's closed run from ``logdir`` to ``logdir/launcher`` (so that
    readers open the ranks); returns where it went, or None when there was none."""
    db = logdir / DB_NAME
    if not db.is_file():
        return None
    target = logdir / LAUNCHER
    if target.exists():
        shutil.rmtree(target)
    target.mkdir()
    for name in (DB_NAME, DB_NAME + "-wal", DB_NAME + "-shm", "tensors"):
        if (logdir / name).exists():
            os.replace(logdir / name, target / name)
    return target


def ended_with_nonfinite(run_dir: Path) -> bool:
    """Whether the run in ``run_dir`` ended with a NonFiniteError (check_numerics in that rank)."""
    from trainguard.store import open_run

    try:
        with open_run(run_dir) as run:
            error = run.meta.get("error")
    except Exception:  # a rank that died before writing: nothing to explain
        return False
    return isinstance(error, str) and error.startswith("NonFiniteError")
