"""How a training script ended, as a run stores it: one record for the CLI, the recorder, the monitor
and the framework callbacks, read by :mod:`trainguard.analysis._outcome` (a crash is an error finding)."""

from __future__ import annotations

import sys
from typing import Any

from trainguard._errors import Diverged


def ending(error: BaseException | str | None, step: int | None = None) -> dict[str, Any]:
    """The run's top-level metadata for how training ended: ``{}`` when it finished.

    A crash is ``{"status": "crashed", "error": "Type: message", "crash_step": step}`` (the step
    clock's step when ``step`` is None); ``KeyboardInterrupt`` is ``{"status": "interrupted"}``;
    ``sys.exit(n)`` with ``n != 0`` is ``{"status": "exited", "exit_code": n}``.
    """
    if error is None:
        return {}
    if isinstance(error, KeyboardInterrupt):
        return {"status": "interrupted"}
    if isinstance(error, SystemExit):
        code = error.code if isinstance(error.code, int) else (0 if error.code is None else 1)
        return {"status": "exited", "exit_code": code} if code else {}
    if step is None and isinstance(error, Diverged):  # the step clock is one past it: the guard reads a step late
        step = error.step
    if step is None:
        from trainguard.capture._steps import current_step

        step = current_step()
    if isinstance(error, str):
        text = error
    else:
        message = str(error).splitlines()[0] if str(error) else ""
        text = f"{type(error).__name__}: {message}".rstrip(": ")
    return {"status": "crashed", "error": text[:500], "crash_step": int(step)}


# The exception that ended the program, seen by sys.excepthook: what a monitor, a recorder or a
# framework session still open at interpreter exit (the HF Trainer has no exception callback) was
# ended by. sys.last_value is not used: a notebook sets it for every failed cell.
_uncaught: BaseException | None = None
_chained: Any = None


def watch_uncaught() -> None:
    """Remember an uncaught exception from now on (chained before the current ``sys.excepthook``)."""
    global _chained
    if _chained is None:
        _chained = sys.excepthook
        sys.excepthook = _excepthook


def _excepthook(tp: type[BaseException], value: BaseException, tb: Any) -> None:
    global _uncaught
    _uncaught = value
    (_chained or sys.__excepthook__)(tp, value, tb)


def uncaught() -> BaseException | None:
    """The exception that is ending the program (called at exit), or None."""
    return _uncaught
