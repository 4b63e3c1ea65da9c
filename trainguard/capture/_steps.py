"""The training step and phase, shared by the recorder and the monitor.

Who counts the steps (``clock.driver``):

- ``None`` (automatic): one step per ``optimizer.step()`` of the first optimizer that steps (a
  GAN's two optimizers do not double it), and per iteration a ``GradScaler`` skipped (frameworks
  count those too). The monitor also ends a step in a loop with no optimizer at all
  (:func:`advance`, see ``Monitor``).
- ``"user"``: :func:`step` was called; from then on the user owns the count.
- ``"framework"``: an integration (Lightning, the Hugging Face ``Trainer``) sets the framework's
  own ``global_step`` with :func:`drive`, so step numbers survive the framework's resume.

While an optimizer's own update runs, the phase is "optimizer". A closure passed to
``optimizer.step(closure)`` (Lightning, LBFGS) is not: it runs the forward and backward pass, so
it is wrapped to run outside the optimizer phase, and the gradients it produced are announced
(``grads_ready``) when its first call returns, before the update. Hooks are global and installed
while at least one user holds them (:func:`acquire` / :func:`release`).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable

import torch

from trainguard.resilience import _clock as _resilience_clock

_lock = threading.Lock()


class _Clock:
    def __init__(self) -> None:
        # Called with the new value whenever in_optimizer changes (the native recorder core keeps
        # its own copy: it cannot read this object per op).
        self.on_in_optimizer: list[Callable[[int], None]] = []
        self._in_optimizer = 0
        self.step = 0
        self.driver: str | None = None
        # 0 outside a closure; k while the k-th call of the current optimizer.step's closure runs.
        self.closure_call = 0
        self.optimizer_calls = 0  # optimizer.step() calls that ran (a GradScaler skip runs none)
        # The optimizer whose update ends a step: the first that steps, until its second update
        # shows whether another one steps in between (see _count).
        self.primary: weakref.ref | None = None
        self.cycle_known = False
        self.others: list[weakref.ref] = []  # other optimizers that stepped since its last update
        self.users = 0
        self.handles: list = []
        # Called after each step change, with the new step.
        self.on_step: list[Callable[[int], None]] = []
        # Called after a checkpoint's restore set the count back to its step, with that step.
        self.on_restore: list[Callable[[int], None]] = []
        # Called before a checkpoint of a step is saved, with that step.
        self.on_save: list[Callable[[int], None]] = []
        # Before optimizer.step(): (optimizer, whether a closure will produce the gradients).
        self.before_optimizer_step: list[Callable[[torch.optim.Optimizer, bool], None]] = []
        # The gradients an optimizer is about to use are complete (a closure has returned).
        self.grads_ready: list[Callable[[torch.optim.Optimizer], None]] = []
        # After each optimizer.step() with the optimizer (the monitor reads lr and updates).
        self.on_optimizer_step: list[Callable[[torch.optim.Optimizer], None]] = []


    @property
    def in_optimizer(self) -> int:
        """How many optimizer updates are running now (0: not the optimizer phase)."""
        return self._in_optimizer

    @in_optimizer.setter
    def in_optimizer(self, n: int) -> None:
        self._in_optimizer = n
        for fn in self.on_in_optimizer:
            fn(n)


clock = _Clock()


def _closure_of(args: tuple, kwargs: dict) -> tuple[Callable | None, bool]:
    """The closure passed to ``optimizer.step`` (args include the optimizer) and whether it was a keyword."""
    c = kwargs.get("closure")
    if callable(c):
        return c, True
    if len(args) > 1 and callable(args[1]):
        return args[1], False
    return None, False


def _wrap_closure(optimizer, closure: Callable) -> Callable:
    calls = [0]

    def closure_outside_the_optimizer_phase(*a, **k):
        calls[0] += 1
        saved_opt, saved_call = clock.in_optimizer, clock.closure_call
        clock.in_optimizer = max(0, saved_opt - 1)
        clock.closure_call = calls[0]
        try:
            out = closure(*a, **k)
        finally:
            clock.in_optimizer, clock.closure_call = saved_opt, saved_call
        if calls[0] == 1:  # later calls (LBFGS line search) evaluate moved weights
            for fn in list(clock.grads_ready):
                fn(optimizer)
        return out

    return closure_outside_the_optimizer_phase


def _pre(optimizer, args, kwargs):
    if torch.compiler.is_compiling():
        _trace_tap(optimizer, PRE)
        return None
    closure, as_kw = _closure_of(args, kwargs)
    _enter(optimizer, closure is not None)
    if closure is None:
        return None
    wrapped = _wrap_closure(optimizer, closure)
    if as_kw:
        return args, {**kwargs, "closure": wrapped}
    return (args[0], wrapped, *args[2:]), kwargs


def _post(optimizer, args, kwargs) -> None:
    if torch.compiler.is_compiling():
        _trace_tap(optimizer, POST)
        return
    _leave(optimizer)


def _enter(optimizer, has_closure: bool) -> None:
    clock.in_optimizer += 1
    for fn in list(clock.before_optimizer_step):
        fn(optimizer, has_closure)


def _leave(optimizer) -> None:
    clock.in_optimizer = max(0, clock.in_optimizer - 1)
    clock.optimizer_calls += 1
    for fn in list(clock.on_optimizer_step):
        fn(optimizer)
    _count(optimizer)


# ---------------------------------------------------------------------- a compiled optimizer step
# Under torch.compile(opt.step) Dynamo inlines the global hooks into the traced step: run there,
# their Python (the clock, the listeners, the native core's setter) would break the graph or be
# frozen at trace time. There they only emit trainguard::step_tap(params, token, which), an op
# with a side effect that the compiled code calls at every step; its kernel does at run time what
# the eager hook does. The pre tap reads the parameters as they are before the update and the
# post tap as they are after it, so that the compiled code orders them around the update.
# (A closure passed to a compiled step is traced with the step: its ops count as the optimizer's.)
PRE, POST = 0, 1
step_tap = None  # the op, defined with the hooks (see _define_tap)
_lib = None  # its library fragment, kept alive with it
_optimizers: dict[int, weakref.ref] = {}  # token -> optimizer
_tokens: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> token


def _step_tap(params, token, which) -> None:
    if clock.users == 0:  # a graph traced while the hooks were installed, run after they went
        return
    ref = _optimizers.get(token)
    optimizer = ref() if ref is not None else None
    if optimizer is None:
        return
    if which == PRE:
        _enter(optimizer, False)
    else:
        _leave(optimizer)


def _step_tap_meta(params, token, which) -> None:
    return None


def _define_tap() -> None:
    """Define ``trainguard::step_tap`` once (with the hooks: importing trainguard defines no op)."""
    global step_tap, _lib
    if step_tap is not None:
        return
    _lib = torch.library.Library("trainguard", "FRAGMENT")
    _lib.define("step_tap(Tensor[] params, int token, int which) -> ()")
    _lib.impl("step_tap", _step_tap, "CompositeExplicitAutograd")
    _lib.impl("step_tap", _step_tap_meta, "Meta")
    op = torch.ops.trainguard.step_tap.default
    torch.fx.node.has_side_effect(op)
    step_tap = op


def _token(optimizer) -> int:
    """The optimizer's token, called by Dynamo while it traces (the result is a constant of the
    graph, guarded on the optimizer's identity)."""
    with _lock:
        t = _tokens.get(optimizer)
        if t is None:
            t = _tokens[optimizer] = len(_optimizers) + 1
            _optimizers[t] = weakref.ref(optimizer)
        return t


# What torch.compiler.assume_constant_result sets, set here without importing Dynamo: Dynamo
# calls the function at trace time with the real optimizer instead of tracing it.
_token._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _trace_tap(optimizer, which: int) -> None:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    step_tap(params, _token(optimizer), which)


def _count(optimizer) -> None:
    """One optimizer update ran (or a GradScaler skipped it): end the step if it is the last of an
    iteration.

    With one optimizer every update ends a step. With several stepping in turn (a GAN's
    discriminator, then its generator; two optimizers over parameter groups), an iteration ends
    with the last of them: that is known at the first optimizer's second update, so the first
    iteration is split (step 0 holds the first optimizer's update, step 1 the rest of that iteration
    and the whole second one) and every later step is one iteration. The choice is made once: an
    optimizer that steps only now and then (every 100 iterations) does not lengthen the steps. An
    optimizer that updates twice while the one that ends steps does not has taken over (layers
    trained one after another, each by its own optimizer): from then on its updates end steps.
    """
    if clock.driver is not None:
        return
    primary = clock.primary() if clock.primary is not None else None
    if primary is None:  # the first update seen, or the optimizer that ended steps is gone
        clock.primary, clock.cycle_known, clock.others = weakref.ref(optimizer), False, []
    elif optimizer is not primary:
        if not any(r() is optimizer for r in clock.others):
            clock.others.append(weakref.ref(optimizer))
            return
        clock.primary, clock.cycle_known = weakref.ref(optimizer), True
    elif not clock.cycle_known:
        clock.cycle_known = True
        last = clock.others[-1]() if clock.others else None
        if last is not None:
            clock.primary, clock.others = weakref.ref(last), []
            return  # this update, and the other optimizer's next, belong to the current step
    clock.others = []
    advance()


def skipped(optimizer) -> None:
    """A ``GradScaler`` skipped ``optimizer.step()`` (non-finite gradients): the iteration still counts."""
    _count(optimizer)


def _keep_dynamo_out() -> None:
    # The optimizer hooks run trainguard's per-step work; Dynamo must not compile them as frames
    # (and where it inlines them into a compiled step, they emit the tap).
    from trainguard.capture._compile import keep_dynamo_out

    keep_dynamo_out(_pre, _post)
    with _lock:
        _define_tap()


def acquire() -> None:
    """Install the global optimizer hooks (reference counted)."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    from trainguard.capture import _amp_tap

    _keep_dynamo_out()
    with _lock:
        clock.users += 1
        if clock.users == 1:
            # Under the same ids every time: Dynamo inlines the global optimizer hooks into a
            # compiled step and guards on their ids (new ones recompiled it at every recording).
            if not clock.handles:
                clock.handles = [register_optimizer_step_pre_hook(_pre), register_optimizer_step_post_hook(_post)]
            else:
                from torch.optim import optimizer

                pre, post = clock.handles
                optimizer._global_optimizer_pre_hooks[pre.id] = _pre
                optimizer._global_optimizer_post_hooks[post.id] = _post
            _amp_tap.install()


def release() -> None:
    from trainguard.capture import _amp_tap

    with _lock:
        clock.users = max(0, clock.users - 1)
        if clock.users == 0:
            _amp_tap.uninstall()
            for h in clock.handles:
                h.remove()  # kept: their ids come back with the next user
            clock.in_optimizer = 0
            clock.closure_call = 0


def reset(start: int = 0) -> None:
    """Start counting from ``start`` again (a new recording with no other users)."""
    clock.step = start
    clock.driver = None
    clock.primary = None
    clock.cycle_known, clock.others = False, []


def advance() -> int:
    """End the current step (automatic counting); the driver, if any, is left alone."""
    clock.step += 1
    for fn in list(clock.on_step):
        fn(clock.step)
    return clock.step


def step(n: int | None = None) -> int:
    """Advance the training step by one, or set it to ``n``; from then on the user owns the count.

    Returns the new step. Use it when a loop has no optimizer, several, or steps the optimizer
    less often than it wants steps counted (gradient accumulation).
    """
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
        raise ValueError(f"step must be a non-negative int, got {n!r}")
    clock.driver = "user"
    clock.step = clock.step + 1 if n is None else n
    for fn in list(clock.on_step):
        fn(clock.step)
    return clock.step


def drive(n: int) -> int:
    """A framework integration sets the step to the framework's ``global_step`` (no-op when unchanged).

    From then on the optimizer hooks no longer count: the framework does.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"step must be a non-negative int, got {n!r}")
    clock.driver = "framework"
    if n != clock.step:
        clock.step = n
        for fn in list(clock.on_step):
            fn(n)
    return n


def before_next_optimizer_step(fn: Callable[[torch.optim.Optimizer], None]) -> None:
    """Call ``fn(optimizer)`` once, before the next ``optimizer.step()`` (while the clock is held),
    ahead of the other listeners: it may move the step (an integration taking the count), and the
    monitor must then see this optimizer step in the new one."""

    def once(optimizer, has_closure):
        with contextlib.suppress(ValueError):
            clock.before_optimizer_step.remove(once)
        fn(optimizer)

    clock.before_optimizer_step.insert(0, once)


def release_drive() -> None:
    """A framework integration hands the count back: optimizer steps count again from here."""
    if clock.driver == "framework":
        clock.driver = None
        clock.primary = None


def current_step() -> int:
    return clock.step


def counted_step() -> int | None:
    """The step while trainguard counts optimizer steps itself (a monitor, recorder or guard holds
    the clock, and neither the user nor a framework drives it), else None: what a checkpoint
    keeps, so that a process resumed from it numbers its steps as the saving process did."""
    return clock.step if clock.users > 0 and clock.driver is None else None


def align(n: int) -> None:
    """Set the step counter to ``n`` without taking it over (automatic counting goes on).

    The guard keeps it equal to its training step, so that a replayed step is recorded under
    its own number and a monitor's steps match the loop's after a resume or a rewind.
    """
    if clock.step != n:
        clock.step = n
        for fn in list(clock.on_step):
            fn(n)


def restored(n: int) -> None:
    """A checkpoint saved at step ``n`` was restored: count from ``n`` again and tell the
    listeners, whose records of steps ``n`` and later belong to training the restore undid."""
    align(n)
    for fn in list(clock.on_restore):
        fn(n)


def saving(n: int) -> None:
    """A checkpoint of step ``n`` is about to be saved: the listeners write what they buffered."""
    for fn in list(clock.on_save):
        fn(n)


# Checkpoints keep this clock's count and put it back (resilience sits below: handed down here).
_resilience_clock.counted = counted_step
_resilience_clock.align = align
_resilience_clock.restored = restored
_resilience_clock.saving = saving
