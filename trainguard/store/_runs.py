"""Finding and opening run directories (a run, or one rank of a torchrun run)."""

from __future__ import annotations

import os
from pathlib import Path

from trainguard._errors import RunNotFound
from trainguard.store._codec import DB_NAME, REPLAYS_DIR
from trainguard.store._ranked import RankedRun
from trainguard.store._reader import Run


def find_runs(root: str | os.PathLike, max_depth: int = 4) -> list[Path]:
    """Run directories under ``root`` (itself included, and the runs in a run's ``replays/``),
    sorted by path."""
    root = Path(root)
    found: list[Path] = []
    if not root.is_dir():
        return found

    def walk(d: Path, depth: int) -> None:
        if (d / DB_NAME).is_file() or _rank_dirs(d):
            found.append(d)
            replays = d / REPLAYS_DIR
            if replays.is_dir() and not replays.is_symlink() and depth < max_depth:
                walk(replays, depth + 1)
            return
        if depth >= max_depth:
            return
        try:
            children = sorted(p for p in d.iterdir() if p.is_dir() and not p.is_symlink())
        except OSError:
            return
        for child in children:
            walk(child, depth + 1)

    walk(root, 0)
    return found


def _rank_dirs(d: Path) -> list[Path]:
    try:
        ranks = [p for p in d.iterdir() if p.name.startswith("rank-") and (p / DB_NAME).is_file()]
    except OSError:
        return []
    return sorted(ranks, key=lambda p: int(p.name[5:]) if p.name[5:].isdigit() else 1 << 30)


def open_run(logdir: str | os.PathLike, rank: int | None = None) -> Run:
    """Open a recorded run for reading. Raises RunNotFound, CorruptRun or SchemaTooNew.

    A run written by several ranks (``logdir/rank-K``) opens as a :class:`RankedRun` that reads
    as rank ``rank`` (default: the first) and merges the others."""
    path = Path(logdir)
    if not path.exists():
        raise RunNotFound(f"no such run directory: {str(path)!r}")
    if path.is_file():
        if path.name == DB_NAME:
            path = path.parent
        else:
            raise RunNotFound(f"{str(path)!r} is a file, not a run directory")
    ranks = _rank_dirs(path)
    if (path / DB_NAME).is_file():
        return Run(path, ranks=[])
    if ranks:
        names = [int(p.name[5:]) for p in ranks if p.name[5:].isdigit()]
        want = names[0] if rank is None else rank
        if want not in names:
            raise RunNotFound(f"run {str(path)!r} has no rank {want}; ranks: {names}")
        return RankedRun(path, names, want)
    try:
        empty = not any(path.iterdir())
    except OSError as exc:
        raise RunNotFound(f"cannot read {str(path)!r}: {exc.strerror}") from None
    what = "is empty" if empty else f"holds no trainguard run (no {DB_NAME})"
    raise RunNotFound(f"{str(path)!r} {what}")
