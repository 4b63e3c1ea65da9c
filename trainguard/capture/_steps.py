"""The training step and phase, shared by the recorder and the monitor.

The step counts ``optimizer.step()`` calls (of the first optimizer that steps, so a GAN's two
optimizers do not double it) until the user calls :func:`step`, after which the user owns it.
While any optimizer's ``step`` runs, the phase is "optimizer". Hooks are global and installed
while at least one user holds them (:func:`acquire` / :func:`release`).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable

import torch

_lock = threading.Lock()


class _Clock:
    def __init__(self) -> None:
        self.step = 0
        self.manual = False
        self.in_optimizer = 0
        self.primary: weakref.ref | None = None
        self.users = 0
        self.handles: list = []
        # Called after each automatic or manual step change, with the new step.
        self.on_step: list[Callable[[int], None]] = []
        # Called after each optimizer.step() with the optimizer (the monitor reads lr and updates).
        self.on_optimizer_step: list[Callable[[torch.optim.Optimizer], None]] = []
        self.before_optimizer_step: list[Callable[[torch.optim.Optimizer], None]] = []


clock = _Clock()


def _pre(optimizer, args, kwargs) -> None:
    clock.in_optimizer += 1
    for fn in list(clock.before_optimizer_step):
        fn(optimizer)


def _post(optimizer, args, kwargs) -> None:
    clock.in_optimizer = max(0, clock.in_optimizer - 1)
    for fn in list(clock.on_optimizer_step):
        fn(optimizer)
    if clock.manual:
        return
    if clock.primary is None or clock.primary() is None:
        clock.primary = weakref.ref(optimizer)
    if clock.primary() is optimizer:
        clock.step += 1
        for fn in list(clock.on_step):
            fn(clock.step)


def _keep_dynamo_out() -> None:
    # The optimizer hooks run trainguard's per-step work; Dynamo must not compile them as frames.
    from trainguard.capture._compile import keep_dynamo_out

    keep_dynamo_out(_pre, _post)


def acquire() -> None:
    """Install the global optimizer hooks (reference counted)."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    _keep_dynamo_out()
    with _lock:
        clock.users += 1
        if clock.users == 1:
            clock.handles = [register_optimizer_step_pre_hook(_pre), register_optimizer_step_post_hook(_post)]


def release() -> None:
    with _lock:
        clock.users = max(0, clock.users - 1)
        if clock.users == 0:
            for h in clock.handles:
                h.remove()
            clock.handles = []
            clock.in_optimizer = 0


def reset() -> None:
    """Start counting from step 0 again (a new recording with no other users)."""
    clock.step = 0
    clock.manual = False
    clock.primary = None


def step(n: int | None = None) -> int:
    """Advance the training step by one, or set it to ``n``; from then on the user owns the count.

    Returns the new step. Use it when a loop has no optimizer, several, or steps the optimizer
    less often than it wants steps counted (gradient accumulation).
    """
    if n is not None and (not isinstance(n, int) or n < 0):
        raise ValueError(f"step must be a non-negative int, got {n!r}")
    clock.manual = True
    clock.step = clock.step + 1 if n is None else n
    for fn in list(clock.on_step):
        fn(clock.step)
    return clock.step


def current_step() -> int:
    return clock.step
