"""A cheap view of each training step for the guard's sentry: the loss and the optimizer steps.

It uses the monitor's taps: the scalar ``backward()`` is called on (the wrapper of
``torch.autograd.backward``, unscaled under a ``GradScaler``) and a hook before every
``optimizer.step()`` (or, with a closure, when its first call returned: the gradients are
complete only then). A closure called again in the same ``optimizer.step`` (LBFGS) evaluates
moved weights, line-search trial points among them: its losses are not the step's loss (the
first call's, as ``optimizer.step`` returns it) and go to ``on_later_loss``. Nothing here syncs or
allocates per op; what the callbacks do with the tensors is theirs.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

import torch

from trainguard.capture import _monitor_tap, _steps

log = logging.getLogger("trainguard.capture")


class StepWatch:
    """Call ``on_loss(loss)`` before every ``backward()`` on a scalar (a detached 0-d tensor), but
    ``on_later_loss(loss)`` for those of a closure's second and later calls, and
    ``before_optimizer(optimizer)`` once an ``optimizer.step()``'s gradients are complete, between :meth:`start` and
    :meth:`stop`. The callbacks run with recording suspended, and an exception in one is logged
    once and swallowed: observing training never kills training.
    """

    def __init__(self, on_loss: Callable[[torch.Tensor], None],
                 before_optimizer: Callable[[torch.optim.Optimizer], None],
                 on_later_loss: Callable[[torch.Tensor], None] | None = None):
        self._on_loss = on_loss
        self._on_later_loss = on_later_loss
        self._before_optimizer = before_optimizer
        self._active = False
        self._warned = False

    def start(self) -> None:
        if self._active:
            return
        self._active = True
        _steps.acquire()
        _steps.clock.before_optimizer_step.append(self._optimizer)
        _steps.clock.grads_ready.append(self._grads_ready)
        _monitor_tap.add_listener("backward", self._loss)

    def stop(self) -> None:
        if not self._active:
            return
        self._active = False
        _monitor_tap.remove_listener("backward", self._loss)
        with contextlib.suppress(ValueError):
            _steps.clock.before_optimizer_step.remove(self._optimizer)
        with contextlib.suppress(ValueError):
            _steps.clock.grads_ready.remove(self._grads_ready)
        _steps.release()

    def _loss(self, loss: torch.Tensor | None) -> None:
        if loss is None:
            return
        if _steps.clock.closure_call > 1:
            if self._on_later_loss is not None:
                self._call(self._on_later_loss, loss)
            return
        self._call(self._on_loss, loss)

    def _optimizer(self, optimizer: torch.optim.Optimizer, has_closure: bool = False) -> None:
        if not has_closure:  # a closure has not run its backward yet: see _grads_ready
            self._call(self._before_optimizer, optimizer)

    def _grads_ready(self, optimizer: torch.optim.Optimizer) -> None:
        self._call(self._before_optimizer, optimizer)

    def _call(self, fn: Callable, arg) -> None:
        try:
            with _monitor_tap.quiet():
                fn(arg)
        except Exception:
            if not self._warned:
                self._warned = True
                log.exception("trainguard: a step observer failed; training goes on")


def unrecorded():
    """A context in which ``trainguard.record`` does not record trainguard's own tensor ops."""
    return _monitor_tap.quiet()
