"""The runs under one logdir: discovery, stable ids, opened readers, and safe paths inside a run.

A run is addressed by an id that is only ever a key into the table of runs found under the
logdir, never joined onto a path, so no id can name a directory the server was not started on.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainguard._errors import CorruptRun, RunNotFound, TrainguardError
from trainguard.store import Run, find_runs, open_run

# Separator of path components in a run id: "/" would need encoded slashes in URLs, which the
# server refuses on principle.
ID_SEP = ":"
# Re-scan the logdir for new runs at most this often (seconds): a scan walks the tree.
RESCAN_SECONDS = 2.0


class PathRefused(TrainguardError):
    """A request named a path that leaves the run directory, or goes through a symlink."""

    http_status = 403


class BadRequest(TrainguardError):
    """A query parameter has a value the API does not accept."""

    http_status = 400


def run_id_for(root: Path, run_dir: Path) -> str:
    rel = run_dir.relative_to(root)
    if rel == Path("."):
        return root.resolve().name or "run"
    return ID_SEP.join(rel.parts)


@dataclass
class RunHandle:
    """One opened reader with the lock that serialises queries on its SQLite connection."""

    run_id: str
    path: Path
    rank: int | None
    run: Run
    lock: threading.RLock = field(default_factory=threading.RLock)
    cache: dict[str, Any] = field(default_factory=dict)


class Registry:
    """Finds runs under ``root`` and keeps one open reader per (run, rank)."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        if not self.root.exists():
            raise RunNotFound(f"no such logdir: {str(self.root)!r}")
        if not self.root.is_dir():
            raise RunNotFound(f"logdir {str(self.root)!r} is a file, not a directory")
        self._lock = threading.Lock()
        self._paths: dict[str, Path] = {}
        self._scanned = 0.0
        self._open: dict[tuple[str, int | None], RunHandle] = {}

    # ------------------------------------------------------------------ discovery
    def scan(self, force: bool = False) -> dict[str, Path]:
        with self._lock:
            if force or time.monotonic() - self._scanned > RESCAN_SECONDS:
                paths: dict[str, Path] = {}
                for d in find_runs(self.root):
                    rid = run_id_for(self.root, d)
                    base, n = rid, 2
                    while rid in paths:  # two folders whose names differ only by the separator
                        rid, n = f"{base}~{n}", n + 1
                    paths[rid] = d
                self._paths = paths
                self._scanned = time.monotonic()
            return dict(self._paths)

    def path_of(self, run_id: str) -> Path:
        paths = self.scan()
        if run_id not in paths:
            paths = self.scan(force=True)
        if run_id not in paths:
            raise RunNotFound(f"no run {run_id!r} under this logdir")
        return paths[run_id]

    def handle(self, run_id: str, rank: int | None = None) -> RunHandle:
        """The open reader of a run; raises RunNotFound / CorruptRun (the server keeps going)."""
        path = self.path_of(run_id)
        key = (run_id, rank)
        with self._lock:
            h = self._open.get(key)
            if h is not None and h.path == path:
                return h
        run = open_run(path, rank=rank)  # raises for a missing or damaged run; nothing is cached
        h = RunHandle(run_id, path, rank, run)
        with self._lock:
            old = self._open.get(key)
            if old is not None and old.path == path:
                run.close()
                return old
            self._open[key] = h
        return h

    def close(self) -> None:
        with self._lock:
            for h in self._open.values():
                try:
                    h.run.close()
                except Exception:
                    pass
            self._open.clear()


def safe_file(base: Path, name: str) -> Path:
    """The regular file ``name`` (relative, "/"-separated) inside ``base``, or PathRefused.

    Refused: empty names, absolute paths, ``..`` or ``.`` parts, backslashes, NUL, percent signs
    (a second round of URL encoding), and any symlink along the way, even one that points back
    inside the run.
    """
    if not name or name.startswith("/") or "\\" in name or "\x00" in name or "%" in name:
        raise PathRefused(f"refused path {name!r}: only plain relative names inside the run are served")
    parts = name.split("/")
    if any(p in ("", ".", "..") for p in parts) or (len(parts[0]) >= 2 and parts[0][1] == ":"):
        raise PathRefused(f"refused path {name!r}: it would leave the run directory")
    cur = base
    for p in parts:
        cur = cur / p
        if cur.is_symlink():
            raise PathRefused(f"refused path {name!r}: it goes through a symbolic link")
    root = base.resolve()
    target = cur.resolve()
    if root != target and root not in target.parents:
        raise PathRefused(f"refused path {name!r}: it would leave the run directory")
    if not target.is_file():
        raise KeyError(f"no file {name!r} in this run")
    return target


__all__ = ["BadRequest", "CorruptRun", "PathRefused", "Registry", "RunHandle", "RunNotFound", "safe_file"]
