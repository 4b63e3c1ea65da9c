"""The resumable loop: Keras ``BackupAndRestore`` for hand-written PyTorch loops."""

from __future__ import annotations

import atexit
import logging
import signal
import threading
import weakref
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainguard.resilience import _dist, _format
from trainguard.resilience._grads import StepWatch
from trainguard.resilience._loader import ResumableLoader
from trainguard.resilience._state import TrainState

if TYPE_CHECKING:
    from trainguard.resilience._manager import CheckpointManager

log = logging.getLogger("trainguard.resilience")

_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_END = object()

# The guard every resume() uses when it is given none (``trainguard run --guard`` sets it).
_default_guard: Any = None


def set_default_guard(guard: Any) -> Any:
    """Make ``guard`` the one every :meth:`CheckpointManager.resume` without ``guard=`` uses (None
    removes it); returns the previous one. ``trainguard run --guard`` installs one this way."""
    global _default_guard
    previous, _default_guard = _default_guard, guard
    return previous


class Preempted(SystemExit):
    """Raised at a step boundary after SIGTERM or SIGINT, once the checkpoint of that step is saved.

    It is a ``SystemExit`` whose code is the shell convention for death by that signal, 128 plus
    the signal number: 143 for SIGTERM, 130 for SIGINT. Uncaught, the process exits with it; the
    next run's ``resume()`` continues with the following step.
    """

    def __init__(self, signum: int, step: int, path: Path):
        super().__init__(128 + signum)
        self.signal = signum
        self.step = step
        self.path = path

    def __str__(self) -> str:
        return f"stopped by {signal.Signals(self.signal).name} after step {self.step}; saved {self.path}"


def _last_batch_out(state: TrainState) -> bool:
    """Whether every epoch under way in the state's loaders has handed out its last batch.

    Known only for :class:`ResumableLoader` (their length and position); False when unknown.
    """
    found = False
    for _, obj in state.items():
        if isinstance(obj, ResumableLoader) and obj.in_epoch:
            try:
                n = len(obj)
            except TypeError:
                return False
            if obj.batches_yielded < n:
                return False
            found = True
    return found


class ResumeLoop:
    """What :meth:`CheckpointManager.resume` returns: restored on creation, iterate it once.

    Step form (``total_steps=N``): yields the steps still to run, ``state.step`` first. After each
    step (when the loop body finishes) it counts the step, saves when ``every_steps`` /
    ``every_seconds`` say so, and on SIGTERM/SIGINT saves and raises :class:`Preempted`.

    Epoch form (``epochs=E``): yields the epochs still to run, the interrupted one first (its
    loader continues mid-epoch), saves at the end of every epoch, and honours signals there. Call
    :meth:`step` after each training step to count steps, save on the step interval and honour
    signals mid-epoch; an epoch without :meth:`step` calls counts as one step.

    After the last step or epoch it saves a final checkpoint, or with ``delete_on_success=True``
    removes the checkpoints instead. A second Ctrl-C while a save is pending stops at once.

    :meth:`batches` is the step form with the data in it: it yields ``(step, batch)`` from
    ``state.loader`` and rolls epochs over itself. A ``guard`` (:class:`trainguard.Guard`) watches
    it: it rewinds, replays and skips through the same generator, so it needs :meth:`batches`.
    With ``manager=None`` the loop keeps no checkpoints (the guard's in-memory form).
    """

    def __init__(self, manager: CheckpointManager | None, state: TrainState, *, total_steps: int | None,
                 epochs: int | None, delete_on_success: bool, handle_signals: bool, guard: Any = None,
                 strict: bool = True):
        if (total_steps is None) == (epochs is None):
            raise ValueError("pass exactly one of total_steps and epochs")
        for name, value in (("total_steps", total_steps), ("epochs", epochs)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        self.manager = manager
        self.state = state
        self.total_steps = total_steps
        self.epochs = epochs
        self.delete_on_success = delete_on_success
        self.handle_signals = handle_signals
        self.restored_step = manager.restore(state, strict=strict, _stacklevel=4) if manager is not None else None
        self.start_step = state.step
        self.start_epoch = state.epoch
        self._signal: int | None = None
        self._steps_in_epoch = 0
        self._deferred = False
        self._started = False
        self._watch = StepWatch()
        self._save_waiting = False  # a save that waits for the optimizer to apply pending gradients
        self.grads_pending = False  # the last step ended inside a window of gradient accumulation
        self._explicit_guard = guard is not None
        self.guard = guard if guard is not None else _default_guard
        if self.guard is not None and epochs is not None:
            if self._explicit_guard:
                raise ValueError("a guard needs the step form: resume(state, total_steps=N, guard=guard)")
            self.guard = None
        self._groups = _dist.Groups() if manager is None else manager._groups
        self._active_guard: Any = None  # the guard while batches() runs
        self._still: Any = None  # modules left out of the state that should not move (_unheld.Still)

    def __iter__(self) -> Iterator[int]:
        self._start()
        if self.guard is not None:
            if self._explicit_guard:
                raise RuntimeError("a guard replays the same batches, so it needs the loop to hand them out: "
                                   "write `for step, batch in loop.batches():` instead of `for step in loop:`")
            log.warning("trainguard: the guard needs `for step, batch in loop.batches():`; this loop "
                        "(`for step in loop:`) runs unguarded")
        return self._step_form() if self.total_steps is not None else self._epoch_form()

    def _start(self) -> None:
        if self._started:
            raise RuntimeError("a ResumeLoop can be iterated once; call resume() again for a new loop")
        self._started = True

    def batches(self) -> Iterator[tuple[int, Any]]:
        """Step form: yield ``(step, batch)`` for the steps still to run, batches from ``state.loader``.

        Epochs roll over by themselves (``state.epoch`` counts them; a sampler with
        ``set_epoch``, such as ``DistributedSampler``, is told the epoch before each pass). After
        a restore the interrupted epoch continues with exactly the next batch. Each step ends when
        the loop body ends, as in ``for step in loop``.
        """
        if self.total_steps is None:
            raise RuntimeError("batches() is the step form: resume(state, total_steps=N)")
        if "loader" not in self.state.names():
            raise RuntimeError("batches() hands out the batches of state.loader: pass loader=... to TrainState")
        self._start()
        gen = self._batch_form(self.state.loader)
        _open_batches.add(gen)
        return gen

    def report(self, loss: Any) -> None:
        """Give the guard this step's loss (e.g. the unscaled one, with a ``GradScaler``); it then
        replaces the one seen through ``backward()``. Without a guard it does nothing."""
        if self._active_guard is not None:
            self._active_guard._report(loss)

    def guarded(self) -> AbstractContextManager[None]:
        """Wrap the loop body of ``batches()`` in ``with loop.guarded():`` to hand the guard an
        exception the body raises on the step's NaN/Inf (``Guard.guarded``): the step is then
        rewound and its batch skipped instead of ending the script. Without a guard it does nothing."""
        g = self._active_guard
        return g.guarded() if g is not None else nullcontext()

    def step(self) -> None:
        """Epoch form only: one training step finished."""
        if self.total_steps is not None:
            raise RuntimeError("in the step form the loop counts steps itself; step() is for the epoch form")
        self._steps_in_epoch += 1
        self.state.step += 1
        # A save left to the epoch's end that did not come (the epoch went on): save now.
        self._boundary(force=self._deferred, in_epoch=True)

    def _step_form(self) -> Iterator[int]:
        assert self.total_steps is not None
        with self._signals():
            while self.state.step < self.total_steps:
                yield self.state.step
                self.state.step += 1
                self._boundary(force=False)
            self._finish()

    def _batch_form(self, loader: Any) -> Iterator[tuple[int, Any]]:
        g = self.guard
        with self._signals():
            if g is not None:
                g._attach(self)
                self._active_guard = g
            try:
                it: Iterator[Any] | None = None
                restores = -1
                while True:
                    while self.state.step < self.total_steps:  # type: ignore[operator]
                        if it is None or (g is not None and g._restores != restores):
                            it = self._epoch_iter(loader)  # after a rewind: from the restored position
                            restores = g._restores if g is not None else 0
                        discard = g._discard_before(self.state.step) if g is not None else 0
                        batch, it = self._next_batch(loader, it)
                        for _ in range(discard):  # batches the guard skipped at this step
                            g._skipped_batch()
                            batch, it = self._next_batch(loader, it)
                        while g is not None and g._known_bad():  # a corrupt sample come back
                            batch, it = self._next_batch(loader, it)
                        if g is not None:
                            g._begin_step(self.state.step, batch)
                        yield self.state.step, batch
                        if g is not None:
                            g._end_step(self.state.step)
                        self.state.step += 1
                        self._boundary(force=False)
                    if g is None or not g._verify_last():  # the last steps' flags are read before the end
                        break
                self._finish()
            finally:
                if g is not None:
                    self._active_guard = None
                    g._detach()

    def _epoch_iter(self, loader: Any) -> Iterator[Any]:
        sampler = getattr(loader, "sampler", None)
        if callable(getattr(sampler, "set_epoch", None)):
            sampler.set_epoch(self.state.epoch)
        own = getattr(type(loader), "_loop_iter", None)  # a ResumableLoader: see its __iter__
        return own(loader) if own is not None else iter(loader)

    def _next_batch(self, loader: Any, it: Iterator[Any]) -> tuple[Any, Iterator[Any]]:
        batch = next(it, _END)
        if batch is _END:  # the epoch is over: the next one starts
            self.state.epoch += 1
            it = self._epoch_iter(loader)
            batch = next(it, _END)
            if batch is _END:
                raise RuntimeError("state.loader yields no batches")
        return batch, it

    def _epoch_form(self) -> Iterator[int]:
        assert self.epochs is not None
        with self._signals():
            while self.state.epoch < self.epochs:
                self._steps_in_epoch = 0
                yield self.state.epoch
                if self._steps_in_epoch == 0:
                    self.state.step += 1
                self.state.epoch += 1
                self._boundary(force=True)
            self._finish()

    def _boundary(self, *, force: bool, in_epoch: bool = False) -> None:
        m, g = self.manager, self._active_guard
        more = int(in_epoch and not _last_batch_out(self.state))
        due = force or self._save_waiting or (m is not None and m.due(self.state.step))
        flags = [self._signal or 0, int(due), more, int(self._watch.pending(self.state))]
        if g is not None:  # the guard's verdict on the last steps rides on the same collective
            flags += g._flags(self.state.step, saving=force or _steps_due(m, self.state.step))
        if _dist.is_distributed():
            # Every rank must take the same decision at the same step, or the save's collectives hang.
            flags = _dist.all_max(flags, self._groups.ctl())
        signum, due, more, self.grads_pending = flags[0], flags[1], flags[2], bool(flags[3])
        if g is not None:
            if g._decide(flags[4:]):
                due = 0  # rewound: nothing new to save
            elif (signum or due) and g._verify_last():
                due = 0  # a checkpoint only ever holds verified steps
        if m is None:  # the guard's in-memory loop: nothing to save, no signals handled
            return
        if (signum or due) and self.grads_pending and not force:
            # A checkpoint holds no gradients: saved now, the resumed run would lose this
            # accumulation window's first micro-batches. Save once the optimizer has stepped.
            if signum and not self._save_waiting:
                log.warning("gradients of an accumulation window are pending: saving once the optimizer steps")
            self._save_waiting = True
            return
        self._save_waiting = False
        if signum:
            if force or due or m.last_saved_step != self.state.step:
                self._check_still()
                m.save(self.state, blocking=True)
            else:
                m.wait()  # this step is already being saved in the background
            m.close()  # the run stops here: the next one may own the directory at once
            raise Preempted(signum, self.state.step, m.directory / _format.checkpoint_name(self.state.step))
        if due and in_epoch and not more and not force:
            # The epoch's last batch is out: the epoch boundary, next, saves this step once, with
            # the epoch's end in it (a second save of the same step would only replace this one).
            self._deferred = True
            return
        self._deferred = False
        if due:
            self._check_still()
            m.save(self.state)

    def _check_still(self) -> None:
        if self._still is not None:
            self._still.check()

    def _finish(self) -> None:
        m = self.manager
        if m is None:
            return
        m.wait()
        if self.delete_on_success:
            m.delete_all()
        elif m.last_saved_step != self.state.step:
            self._check_still()
            m.save(self.state, blocking=True)

    @contextmanager
    def _signals(self) -> Iterator[None]:
        self._watch.open()
        try:
            with self._handlers():
                yield
        finally:
            self._watch.close()

    @contextmanager
    def _handlers(self) -> Iterator[None]:
        if not self.handle_signals or threading.current_thread() is not threading.main_thread():
            yield
            return

        def handler(signum: int, frame: Any) -> None:
            if self._signal is not None and signum == signal.SIGINT:
                raise KeyboardInterrupt  # a second Ctrl-C: stop now
            if self._signal is None:
                self._signal = signum
                log.warning("received %s: saving a checkpoint when this step ends", signal.Signals(signum).name)

        previous = {s: signal.signal(s, handler) for s in _SIGNALS}
        try:
            yield
        finally:
            for s, h in previous.items():
                signal.signal(s, h)


# batches() generators handed out and not closed. A script that ended by an exception in the loop
# body while still holding its generator (in a variable, a closure, a cycle) would have it closed
# only at interpreter teardown, when the writer threads of a guard's run are gone and modules are
# half torn down: they are closed at exit instead (their `finally` detaches the guard, restores the
# signal handlers).
_open_batches: weakref.WeakSet[Iterator[tuple[int, Any]]] = weakref.WeakSet()


@atexit.register
def _close_open_batches() -> None:
    for gen in list(_open_batches):
        try:
            gen.close()
        except Exception:  # pragma: no cover - best effort at interpreter exit
            log.exception("trainguard: closing an unfinished loop at exit failed")


def _steps_due(m: CheckpointManager | None, step: int) -> bool:
    """A save on the step interval (the same on every rank, unlike ``every_seconds``)."""
    every = m.policy.every_steps if m is not None else None
    return every is not None and step % every == 0 and m.last_saved_step != step  # type: ignore[union-attr]
