"""One writer per run directory per process: the recorder, the monitor, the guard and the
doctor that write to one run share it (reference counted)."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

from trainguard.store._writer import RunWriter

_shared: dict[Path, list] = {}
_shared_lock = threading.Lock()


def _after_fork_in_child() -> None:
    # A fork copies the lock as it is: held, if another thread was building a writer (a DataLoader
    # worker forked while a recording starts), by a thread the child does not have. The parent's
    # writers are the parent's (their threads are not in the child): the child starts afresh.
    global _shared_lock
    _shared_lock = threading.Lock()
    _shared.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def acquire_writer(run_dir: str | os.PathLike, *, mode: str | None = None, buffer: int | None = None,
                   overwrite: bool = False, append: bool = False, resume: bool = False, process: bool = False,
                   meta: dict[str, Any] | None = None) -> RunWriter:
    """The writer of ``run_dir`` shared by everything in this process that writes to it.

    The recorder and the monitor may write to the same run: the first to arrive creates the
    writer, later ones join it. ``mode``/``buffer`` given by a later caller reconfigure the writer
    (the recorder passes them; the monitor does not). ``append=True`` adds to a run another
    process left in ``run_dir`` (the doctor's results) instead of refusing it; with ``resume=True``
    (a framework resumed the training that run recorded) the writer also takes over the run's
    status from the process that left it (killed, or ended): running, then how this one ends.
    ``process=True``
    (the recorder) builds rows in a child process when this call creates the writer. Pair with
    :func:`release_writer`.
    """
    key = Path(run_dir).resolve()
    with _shared_lock:
        entry = _shared.get(key)
        if entry is None or entry[0]._closed:
            writer = RunWriter(run_dir, mode=mode or "no_tensor", buffer=-1 if buffer is None else buffer,
                               overwrite=overwrite, append=append, resume=resume, process=process, meta=meta)
            _shared[key] = [writer, 1]
            return writer
        writer = entry[0]
        entry[1] += 1
        if (mode is not None and mode != writer.mode) or (buffer is not None and buffer != writer.buffer):
            writer.configure(mode=mode, buffer=buffer)
        if meta:
            writer.set_meta(**meta)
        return writer


def release_writer(writer: RunWriter, **final_meta: Any) -> None:
    """Drop one reference; the last one closes the writer (flush, trim, mark finished)."""
    key = writer.run_dir.resolve()
    with _shared_lock:
        entry = _shared.get(key)
        if entry is not None and entry[0] is writer:
            entry[1] -= 1
            if entry[1] > 0:
                if final_meta:
                    writer.set_meta(**final_meta)
                writer.flush()
                return
            del _shared[key]
    writer.close(**final_meta)
