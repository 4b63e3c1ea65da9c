"""SIGTERM while a command runs a user's script: the run is closed, never cut short.

A preempted job (a scheduler, torchrun's agent stopping the other ranks of a failed job,
``timeout``) gets SIGTERM, whose default action kills the process at once: the run would keep
``status: running`` and lose what is only written when it closes (the monitor's findings).
"""

from __future__ import annotations

import signal
import threading


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
