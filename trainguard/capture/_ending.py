"""How a training script ended, as a run stores it: one record for the CLI, the recorder, the monitor
and the framework callbacks, read by :mod:`trainguard.analysis._outcome` (a crash is an error finding)."""

from __future__ import annotations

import linecache
import re
import signal
import sys
from typing import Any

from trainguard._errors import Diverged

# Terminal escape sequences (colours, OSC 8 hyperlinks) some libraries put in their messages
# (Lightning's): the run stores plain text, which report and the UI render themselves.
_ESCAPES = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)")


def ending(error: BaseException | str | None, step: int | None = None) -> dict[str, Any]:
    """The run's top-level metadata for how training ended: ``{}`` when it finished.

    A crash is ``{"status": "crashed", "error": "Type: message", "crash_step": step}`` (the step
    clock's step when ``step`` is None); ``sys.exit(n)`` with ``n != 0`` is ``{"status": "exited",
    "exit_code": n}``. A stop by a signal, ``KeyboardInterrupt`` (Ctrl-C) or a ``SystemExit`` that
    carries the ``signal`` it stands for (trainguard's commands on SIGTERM, the resumable loop's
    ``Preempted``), is ``{"status": "interrupted", "signal": "SIGTERM", "stopped_step": step}``
    (with its ``exit_code``): a preemption, not a fault of the training.
    """
    if error is None:
        return {}
    signum = signal.SIGINT if isinstance(error, KeyboardInterrupt) else getattr(error, "signal", None)
    if isinstance(error, (KeyboardInterrupt, SystemExit)) and isinstance(signum, int):
        from trainguard.capture._steps import current_step

        out = {"status": "interrupted", "signal": signal.Signals(signum).name,
               "stopped_step": int(step if step is not None else current_step())}
        if isinstance(error, SystemExit) and isinstance(error.code, int):
            out["exit_code"] = error.code
        return out
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
    out: dict[str, Any] = {"status": "crashed", "error": _ESCAPES.sub("", text)[:500], "crash_step": int(step)}
    if isinstance(error, BaseException):
        try:
            at = crash_site(error)
        except Exception:  # where it crashed is a courtesy: never lose the crash record for it
            at = None
        if at:
            out["crash_at"] = at
    return out


def crash_site(error: BaseException) -> dict[str, Any] | None:
    """Where an exception raised inside a library came from, for a run's ``crash_at`` (None when the
    user's own line raised it with a message; a bare ``assert`` there is kept, ``raised_here``): the innermost line of the user's own code (outside torch,
    trainguard, the standard library and installed packages), the innermost ``nn.Module`` that was
    running, and for an embedding's "index out of range in self" (torch names neither the index
    nor the table) the index and the table's size."""
    from torch import nn

    from trainguard.store import is_user_file

    frames = []
    tb = error.__traceback__
    while tb is not None:
        frames.append((tb.tb_frame, tb.tb_lineno))
        tb = tb.tb_next
    if not frames:
        return None
    mine = [(f, n) for f, n in frames if is_user_file(f.f_code.co_filename)]
    own = bool(mine) and mine[-1][0] is frames[-1][0]
    if own and str(error):
        return None  # raised by the user's own line: its message and traceback already say where
    frame, line = (mine or frames)[-1]
    at: dict[str, Any] = {"file": frame.f_code.co_filename, "line": line, "function": frame.f_code.co_name,
                          "code": linecache.getline(frame.f_code.co_filename, line).strip()}
    if own:  # a bare `assert` (detr's generalized_box_iou on degenerate boxes): nothing but the line says what failed
        at["raised_here"] = True
    modules = [m for f, _ in frames if isinstance(m := f.f_locals.get("self"), nn.Module)]
    module = modules[-1] if modules else None
    if module is not None:
        text = repr(module)
        at["module"] = text if "\n" not in text and len(text) <= 80 else type(module).__name__
        # Its path in the outermost module running, as in the state_dict: one of DLRM's 26 alike
        # tables is emb_l.7, not EmbeddingBag(10, 4, mode='sum')
        path = next((n for n, m in modules[0].named_modules(remove_duplicate=False) if m is module), "")
        if path:
            at["module_path"] = path
    detail = (_embedding_index(frames) or _class_target(frames)) if isinstance(error, IndexError) else (
        _distribution_argument(frames) if isinstance(error, ValueError) else
        _observer_range(module) if isinstance(error, RuntimeError) else None)
    if detail:
        at["detail"] = detail
    return at


def _distribution_argument(frames: list) -> str | None:
    """For torch.distributions' argument check ("Expected parameter scale ... found invalid
    values"): which values of the parameter broke it, and for a scale of 0 what makes one."""
    import torch
    from torch.distributions import Distribution

    init = Distribution.__init__.__code__
    for f, _ in reversed(frames):
        if f.f_code is not init:
            continue
        param, value = f.f_locals.get("param"), f.f_locals.get("value")
        if not isinstance(value, torch.Tensor) or not value.is_floating_point() or value.device.type != "cpu":
            return None
        v = value.detach()
        counts = [(int(torch.isnan(v).sum()), "NaN"), (int(torch.isinf(v).sum()), "inf"),
                  (int((v == 0).sum()), "zero"), (int((v < 0).sum()), "negative")]
        found = ", ".join(f"{n} {word}{'s' if word == 'zero' and n != 1 else ''}" for n, word in counts if n)
        if not found:
            return None
        text = f"{type(f.f_locals.get('self')).__name__}'s {param} holds {found} (of {v.numel()} value{'s' if v.numel() != 1 else ''})"
        if param == "scale" and counts[2][0]:
            text += (": a std of 0 (exp of a log-std below about -103 underflows to 0 in float32): keep it above 0 "
                     "where it is made, e.g. std = log_std.clamp(-20, 2).exp(), or F.softplus(x) + 1e-5")
        return text
    return None


def _observer_range(module: Any) -> str | None:
    """For a quantization-aware model's fake-quant that raised ("`zero_point` must be between
    `quant_min` and `quant_max`"): the non-finite range its observer keeps in min_val/max_val."""
    import torch

    observer = getattr(module, "activation_post_process", module)
    lo, hi = getattr(observer, "min_val", None), getattr(observer, "max_val", None)
    if not (isinstance(lo, torch.Tensor) and isinstance(hi, torch.Tensor)) or not lo.numel() or not hi.numel():
        return None
    if lo.device.type != "cpu" or bool(torch.isfinite(lo).all() and torch.isfinite(hi).all()):
        return None
    return (f"{type(module).__name__}'s observer range holds non-finite values (min_val {lo.min().item():g}, max_val "
            f"{hi.max().item():g}): a NaN/Inf reached this fake-quant in an earlier step (an input, or the weights "
            "an update made NaN) and stays in its min_val/max_val buffers, so every later forward through it raises; "
            "the observer's state must go back to before that step (a checkpoint) once the NaN/Inf is fixed")


def _class_target(frames: list) -> str | None:
    """For cross_entropy's or nll_loss's "Target 255 is out of bounds." (torch names neither the class
    count nor the other values): the targets out of range, the classes, and for 255 what makes it."""
    import torch
    import torch.nn.functional as F

    # by name and file: while a monitor watches, F.cross_entropy is its wrapper around torch's function
    home = F.__file__
    for f, _ in reversed(frames):
        if f.f_code.co_name not in ("cross_entropy", "nll_loss") or f.f_code.co_filename != home:
            continue
        x, t = f.f_locals.get("input"), f.f_locals.get("target")
        if not (isinstance(x, torch.Tensor) and isinstance(t, torch.Tensor)) or t.is_floating_point() or not t.numel():
            return None
        if t.device.type != "cpu" or x.dim() == 0:  # after a device-side assert the device can no longer be read
            return None
        classes = int(x.shape[1] if x.dim() >= 2 else x.shape[0])
        ignore = f.f_locals.get("ignore_index", -100)
        values = t.unique()
        bad = [int(v) for v in values if (v < 0 or v >= classes) and v != ignore]
        if not bad:
            return None
        shown = ", ".join(str(int(v)) for v in values[:8]) + (", ..." if values.numel() > 8 else "")
        text = (f"the targets hold {', '.join(map(str, bad[:4]))}, out of range for {classes} classes (0 to "
                f"{classes - 1}); their values are {shown}")
        if any(v % 255 == 0 for v in bad):
            text += ("; a mask stored as 0/255 (an 8-bit PNG) holds 255 where class 1 is meant: map its values to "
                     "class indices (`mask // 255`, or a lookup of its distinct values)")
        return text
    return None


def _embedding_index(frames: list) -> str | None:
    import torch

    fn = torch.nn.functional.embedding.__code__
    for f, _ in reversed(frames):
        if f.f_code is not fn:
            continue
        idx, weight = f.f_locals.get("input"), f.f_locals.get("weight")
        if not (isinstance(idx, torch.Tensor) and isinstance(weight, torch.Tensor)) or not idx.numel():
            return None
        if idx.device.type != "cpu":  # after a device-side assert the device can no longer be read
            return None
        rows, lo, hi = weight.shape[0], int(idx.min()), int(idx.max())
        bad = hi if hi >= rows else lo if lo < 0 else None
        if bad is None:
            return None
        return f"index {bad} is out of range for an embedding with {rows} rows (0 to {rows - 1})"
    return None


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
