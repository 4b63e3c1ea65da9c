"""How a training script ended, as a run stores it: one record for the CLI, the recorder, the monitor
and the framework callbacks, read by :mod:`trainguard.analysis._outcome` (a crash is an error finding)."""

from __future__ import annotations

from typing import Any


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
    if step is None:
        from trainguard.capture._steps import current_step

        step = current_step()
    if isinstance(error, str):
        text = error
    else:
        message = str(error).splitlines()[0] if str(error) else ""
        text = f"{type(error).__name__}: {message}".rstrip(": ")
    return {"status": "crashed", "error": text[:500], "crash_step": int(step)}
