"""SIGTERM while a command runs a user's script: the run is closed, never cut short.

A preempted job (a scheduler, torchrun's agent stopping the other ranks of a failed job,
``timeout``) gets SIGTERM, whose default action kills the process at once: the run would keep
``status: running`` and lose what is only written when it closes (the monitor's findings).
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path

from trainguard._errors import TrainguardError


class Terminated(SystemExit):
    """The script was stopped by SIGTERM: exit code 143; ``signal`` says which (as the resumable
    loop's ``Preempted`` does), so that the run is told interrupted, not exited."""

    signal = signal.SIGTERM

    def __init__(self) -> None:
        super().__init__(128 + signal.SIGTERM)


def _terminate(signum, frame):
    raise Terminated()


class Preemption:
    """While the script runs, SIGTERM raises :class:`Terminated` (``SystemExit(143)``) in it (so the command's own
    ``finally`` closes the run); after :meth:`closing`, a SIGTERM is only noted in ``late`` and
    the closing goes on (SIGKILL stays the sender's backstop). Outside the main thread, where
    Python cannot install handlers, it does nothing."""

    def __init__(self) -> None:
        self.late: list[int] = []
        self._previous = None
        self._installed = False

    def __enter__(self) -> Preemption:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, _terminate)
            self._installed = True
        return self

    def closing(self) -> None:
        if self._installed:
            signal.signal(signal.SIGTERM, lambda signum, frame: self.late.append(signum))

    def __exit__(self, *exc) -> None:
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous)
            self._installed = False

    def code(self, code: int) -> int:
        """The exit code: a SIGTERM that came while closing ends the process as 143 when it would
        have ended with 0."""
        return 128 + signal.SIGTERM if self.late and not code else code


def resume_point(logdir: str | Path, resume: bool, overwrite: bool) -> int | None:
    """``--resume``: None when there is no run in ``logdir`` to continue (a new one is made), else
    the step its monitor's loss reached plus one, where this process's steps go on (a requeued job
    runs the same command again, and its script resumes from its own checkpoint)."""
    if resume and overwrite:
        raise TrainguardError("choose one of --resume and --overwrite")
    from trainguard.store import open_run
    from trainguard.store._codec import DB_NAME

    if not resume or not (Path(logdir) / DB_NAME).exists():
        return None
    with open_run(logdir) as run:
        steps = [s for s, _ in run.scalars("loss").get("loss", [])]
    return max(steps) + 1 if steps else 0
