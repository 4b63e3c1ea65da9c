"""The owner of a checkpoint directory: one :class:`CheckpointManager`, for as long as it lives.

The lock is ``flock`` on ``.trainguard-ckpt.lock``, which holds the owner's pid, host and start
time so that a refused manager can say who has the directory. The kernel drops it when the
owning process dies, however it dies. Processes forked from the owner (data-loader workers)
close their copy at once: they would otherwise hold the lock on after a SIGKILL of the owner.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
import weakref
from pathlib import Path
from typing import Any

from trainguard._errors import CheckpointError
from trainguard.resilience._format import LOCK_FILE

_held: weakref.WeakSet[DirectoryLock] = weakref.WeakSet()


class DirectoryLock:
    """Exclusive ownership of one checkpoint directory; :meth:`acquire` is idempotent."""

    def __init__(self, directory: Path):
        self.directory = directory
        self._file: Any = None

    @property
    def held(self) -> bool:
        return self._file is not None

    def acquire(self, *, to_write: bool = True) -> None:
        """Own the directory (creating it), or raise :class:`CheckpointError` naming the owner.

        ``to_write=False`` (a restore) goes on without ownership where the directory cannot be
        written at all (read-only media, another user's): no run can save there either.
        """
        if self._file is not None:
            return
        path = self.directory / LOCK_FILE
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            f = open(path, "a+b")  # noqa: SIM115 - held open for the manager's life
        except OSError as exc:
            if not to_write and exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
                return
            raise CheckpointError(f"cannot own {self.directory}: {exc.strerror or exc}") from None
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _holder(f)
            f.close()
            if exc.errno in (errno.EAGAIN, errno.EACCES):
                raise CheckpointError(
                    f"{self.directory} is in use by another CheckpointManager ({holder}); two runs must "
                    "not share a checkpoint directory: give this one its own, or stop the other") from None
            raise CheckpointError(f"cannot lock {path}: {exc.strerror or exc}") from None
        f.truncate(0)
        f.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}).encode())
        f.flush()
        self._file = f
        _held.add(self)

    def release(self) -> None:
        f, self._file = self._file, None
        _held.discard(self)
        if f is not None:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)
            finally:
                f.close()

    def __del__(self) -> None:  # a manager dropped without close(): free the directory quietly
        try:
            self.release()
        except Exception:
            pass

    def _forget_in_child(self) -> None:
        # Close only this process's descriptor: unlocking would unlock the parent's lock too.
        f, self._file = self._file, None
        if f is not None:
            f.close()


def _holder(f: Any) -> str:
    try:
        f.seek(0)
        doc = json.loads(f.read(4096) or b"null")
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(doc["since"])))
        return f"pid {int(doc['pid'])} on {doc['host']}, since {since}"
    except (OSError, ValueError, TypeError, KeyError):
        return "its pid and host were not written yet"


def _after_fork_in_child() -> None:
    for lock in list(_held):
        lock._forget_in_child()
    _held.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
