"""Iterations a training loop skips itself: the model ran its training forward, the program
checked the loss for NaN/Inf, found it non-finite, and went on to the next iteration without
``backward()`` (so without ``optimizer.step()`` either).

normflows' example loop does ``if ~(torch.isnan(loss) | torch.isinf(loss)): loss.backward();
optimizer.step()``; others write ``if not torch.isfinite(loss): continue`` or ``if not
math.isfinite(loss.item()): continue``. Steps and the loss come from ``backward()`` and the
optimizer, which never run there, so without this watch such an iteration leaves no trace.

What counts, and why not less:

- A **check**: ``torch.isnan`` / ``isinf`` / ``isfinite`` (the functions and the Tensor methods) or
  ``Tensor.item()`` of a one-element floating tensor with an autograd graph (a loss, not a
  parameter or a detached log value), after a training forward (a watched model in train mode
  with gradients on; unknown when nothing announces forwards: the guard alone).
- A **skip**: such a check saw a non-finite value, and the next training forward (or the guard's
  end of the step) came with no ``backward()`` in between. Running a model with gradients and no
  backward through it is common and healthy (a GAN's generator in the discriminator step, an EMA
  teacher, a rollout collected without ``no_grad``, a warm-up forward): none of these checks a
  non-finite loss and then runs the next iteration, so only that stronger signal counts.

A check after ``backward()`` (DeiT's ``loss.item()`` before ``sys.exit``) is no skip: backward ran.
The value a ``torch.isnan`` check saw is read only at the next training forward and only when
no backward came after the check (the loop branched on it already: no extra device sync).

A skip ends the step (as a ``GradScaler``'s skip does) when trainguard counts steps itself and
nothing moved the count since the check, so that later steps keep the loop's own numbers.
Listeners (the monitor, the recorder, the guard) get a :class:`Skip`.
"""

from __future__ import annotations

import logging
import math
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from trainguard.capture import _monitor_tap, _steps
from trainguard.capture._patch import ClassPatch

log = logging.getLogger("trainguard.monitor")

_CHECKS = ("isnan", "isinf", "isfinite")
_is_compiling = torch.compiler.is_compiling
_in_functorch = torch._C._are_functorch_transforms_active


@dataclass(frozen=True)
class Skip:
    """One iteration the loop skipped: the step it was (the clock's count at the check), the
    value the check saw, where the program checked it, and how (``isnan``, ``isfinite``, ``item``)."""

    step: int
    loss: float
    file: str | None
    line: int | None
    check: str

    def to_dict(self) -> dict:
        return {"step": self.step, "loss": self.loss, "file": self.file, "line": self.line, "check": self.check}


# The steps of skipped iterations a run's account lists (the count goes on past them).
MAX_LISTED = 200
# Checks of one iteration kept until it ends (the loop's test comes first).
MAX_CHECKS = 4


def count(account: dict | None, skip: Skip) -> dict:
    """``account`` (a run's ``skipped_iterations``: count, steps, first, last, and how many were
    nan, inf, -inf) with ``skip`` added; a new one for None."""
    if account is None:
        account = {"count": 0, "steps": [], "first": skip.to_dict(), "nonfinite": {}}
    account["count"] += 1
    if len(account["steps"]) < MAX_LISTED:
        account["steps"].append(skip.step)
        account.setdefault("losses", []).append(skip.loss)
    account["last"] = skip.to_dict()
    kind = _kind(skip.loss)
    account["nonfinite"][kind] = account["nonfinite"].get(kind, 0) + 1
    return account


def _kind(v: float) -> str:
    return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")


def forget(account: dict, step: int) -> dict | None:
    """``account`` without the skips of ``step`` and later (a checkpoint of ``step`` was restored:
    those iterations run again); None when none is left."""
    steps, losses = account["steps"], account.get("losses") or []
    keep = [i for i, s in enumerate(steps) if s < step]
    if not keep:
        return None
    if len(keep) == len(steps):  # unlisted ones (past MAX_LISTED) may lie on either side: kept
        return account
    kept_losses = [losses[i] for i in keep if i < len(losses)]
    nonfinite: dict[str, int] = {}
    for v in kept_losses:
        nonfinite[_kind(v)] = nonfinite.get(_kind(v), 0) + 1
    last = keep[-1]
    return dict(account, count=len(keep), steps=[steps[i] for i in keep], losses=kept_losses, nonfinite=nonfinite,
                last=dict(account["first"], step=steps[last], loss=losses[last] if last < len(losses) else None))


class _Watch:
    def __init__(self) -> None:
        self.users = 0
        self.listeners: list[Callable[[Skip], None]] = []
        # [(value: 0-d detached tensor or float, step, file, line, check), ...]: the first checks
        # since the iteration began (the loop's own test of the loss comes first; a log line's
        # loss.item() after it is not where it skips), or None.
        self.pending: list | None = None
        # Whether the last forward with gradients was a training one (None: nothing announces
        # forwards, the guard alone).
        self.training: bool | None = None
        # backward() ran since the iteration began: a check after it reads a loss that trained
        # (DeiT's loss.item() after backward), never a skip.
        self.backed = False

    # ------------------------------------------------------------------ events
    def forward(self, training: bool) -> None:
        """A watched model starts a forward with gradients on (``training``: in train mode)."""
        if training:
            self.begin()
        self.training = training

    def begin(self) -> None:
        """An iteration begins (a training forward; the guard's loop drew a batch)."""
        if self.pending is not None:
            self.boundary()
        self.backed = False

    def on_backward(self, loss=None) -> None:
        self.pending = None
        self.backed = True

    def check(self, x, how: str, value: float | None = None) -> None:
        if self.backed or self.training is False or _in_functorch():
            return
        if not (isinstance(x, torch.Tensor) and x.grad_fn is not None and x.is_floating_point() and x.numel() == 1):
            return
        f = sys._getframe(2)  # the program's line: check <- the wrapper <- the caller
        if value is None:
            with _monitor_tap.quiet():
                value = x.detach().reshape(())
        entry = (value, _steps.clock.step, f.f_code.co_filename, f.f_lineno, how)
        if self.pending is None:
            self.pending = [entry]
        elif len(self.pending) < MAX_CHECKS:
            self.pending.append(entry)

    def boundary(self) -> Skip | None:
        """A new iteration starts (a training forward, the guard's end of a step): the pending
        check, if it saw a non-finite loss, was a skipped iteration."""
        pending, self.pending = self.pending, None
        if pending is None:
            return None
        try:
            skip = None
            for value, step, file, line, how in pending:  # the first check that saw NaN/Inf
                if isinstance(value, torch.Tensor):
                    with _monitor_tap.quiet():
                        value = float(value)  # the loop branched on this value already: computed
                if not math.isfinite(value):
                    skip = Skip(step=step, loss=value, file=file, line=line, check=how)
                    break
            if skip is None:
                return None
            for fn in list(self.listeners):
                try:
                    fn(skip)
                except Exception:  # observing training never kills training
                    log.exception("trainguard: a skipped-iteration listener failed")
            c = _steps.clock
            if c.driver is None and c.step == skip.step and c.users > 0:
                _steps.advance()  # the skipped iteration is a step, as a GradScaler's skip is
            return skip
        except Exception:
            log.exception("trainguard: judging a skipped iteration failed")
            return None


watch = _Watch()
_lock = threading.Lock()
_saved: dict[str, Callable] = {}
# The wrappers of torch.isnan & co., made once and kept: TorchScript finds a builtin by the id of
# the function a script names, so each is registered as its original's op (a script compiled while
# a monitor is open calls torch.isnan; a wrapper it did not know it would try to compile).
_functions: dict[str, Callable] = {}


def _function(name: str, original: Callable) -> Callable:
    fn = _functions.get(name)
    if fn is None or fn.__wrapped__ is not original:  # type: ignore[attr-defined]
        fn = _functions[name] = _wrap_function(name, original)
        try:
            from torch.jit import _builtins

            op = _builtins._find_builtin(original)
            if op is not None:
                _builtins._register_builtin(fn, op)
        except Exception:  # a torch without that table: scripts that call torch.isnan fail to compile
            log.debug("trainguard: could not register %s with TorchScript", name, exc_info=True)
    return fn


def _wrap_function(name: str, original: Callable) -> Callable:
    def check(input, *args, **kwargs):
        out = original(input, *args, **kwargs)
        if not _is_compiling() and watch.users and type(input) is torch.Tensor and input.grad_fn is not None:
            watch.check(input, name)
        return out

    check.__name__ = check.__qualname__ = name
    check.__doc__ = original.__doc__
    check.__wrapped__ = original  # type: ignore[attr-defined]
    return check


def _wrap_method(name: str, original: Callable) -> Callable:
    if name == "item":
        def item(self):
            out = original(self)
            if (watch.users and self.grad_fn is not None and isinstance(out, float) and not math.isfinite(out)
                    and not _is_compiling()):
                watch.check(self, "item", out)
            return out

        fn = item
    else:
        def method(self, *args, **kwargs):
            out = original(self, *args, **kwargs)
            if watch.users and self.grad_fn is not None and not _is_compiling():
                watch.check(self, name)
            return out

        fn = method
    fn.__name__ = name
    fn.__qualname__ = f"Tensor.{name}"
    fn.__doc__ = getattr(original, "__doc__", None)
    fn.__wrapped__ = original  # type: ignore[attr-defined]
    return fn


_METHODS = ClassPatch(torch.Tensor, {name: lambda original, name=name: _wrap_method(name, original)
                                     for name in (*_CHECKS, "item")})


def acquire(listener: Callable[[Skip], None] | None = None) -> None:
    """Watch for skipped iterations (reference counted); ``listener(skip)`` for each one."""
    with _lock:
        if listener is not None:
            watch.listeners.append(listener)
        watch.users += 1
        if watch.users == 1:
            watch.pending, watch.training, watch.backed = None, None, False
            for name in _CHECKS:
                _saved[name] = getattr(torch, name)
                setattr(torch, name, _function(name, _saved[name]))
            _METHODS.install(watch)
            _monitor_tap.add_listener("backward", watch.on_backward)


def release(listener: Callable[[Skip], None] | None = None) -> None:
    with _lock:
        if listener is not None and listener in watch.listeners:
            watch.listeners.remove(listener)
        if watch.users == 0:
            return
        watch.users -= 1
        if watch.users == 0:
            _monitor_tap.remove_listener("backward", watch.on_backward)
            _METHODS.remove(watch)
            for name, original in _saved.items():
                if getattr(torch, name, None) is not original and getattr(getattr(torch, name), "__wrapped__",
                                                                          None) is original:
                    setattr(torch, name, original)
            _saved.clear()
            watch.pending, watch.training = None, None
