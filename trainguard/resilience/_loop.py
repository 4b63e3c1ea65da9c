"""The resumable loop: Keras ``BackupAndRestore`` for hand-written PyTorch loops."""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainguard.resilience import _dist, _format
from trainguard.resilience._loader import ResumableLoader
from trainguard.resilience._state import TrainState

if TYPE_CHECKING:
    from trainguard.resilience._manager import CheckpointManager

log = logging.getLogger("trainguard.resilience")

_SIGNALS = (signal.SIGTERM, signal.SIGINT)


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
    """

    def __init__(self, manager: CheckpointManager, state: TrainState, *, total_steps: int | None,
                 epochs: int | None, delete_on_success: bool, handle_signals: bool):
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
        self.restored_step = manager.restore(state, _stacklevel=4)  # warn at the caller of resume()
        self.start_step = state.step
        self.start_epoch = state.epoch
        self._signal: int | None = None
        self._steps_in_epoch = 0
        self._deferred = False
        self._started = False

    def __iter__(self) -> Iterator[int]:
        if self._started:
            raise RuntimeError("a ResumeLoop can be iterated once; call resume() again for a new loop")
        self._started = True
        return self._step_form() if self.total_steps is not None else self._epoch_form()

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
        m = self.manager
        more = int(in_epoch and not _last_batch_out(self.state))
        flags = [self._signal or 0, int(force or m.due(self.state.step)), more]
        if _dist.is_distributed():
            # Every rank must take the same decision at the same step, or the save's collectives hang.
            flags = _dist.all_max(flags, m._groups.ctl())
        signum, due, more = flags
        if signum:
            if force or due or m.last_saved_step != self.state.step:
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
            m.save(self.state)

    def _finish(self) -> None:
        m = self.manager
        m.wait()
        if self.delete_on_success:
            m.delete_all()
        elif m.last_saved_step != self.state.step:
            m.save(self.state, blocking=True)

    @contextmanager
    def _signals(self) -> Iterator[None]:
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
