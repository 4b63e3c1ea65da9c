"""What a framework callback drives: one training run's recorder and monitor, and the step clock.

Framework-agnostic: the Lightning and Hugging Face callbacks translate their hooks into
:meth:`Session.start`, :meth:`Session.step`, :meth:`Session.gradients_ready` and
:meth:`Session.close`. A session either owns its recorder and monitor (the user's
``TrainguardCallback``) or drives a monitor someone else opened (``trainguard run --monitor`` on
an unmodified script, see :mod:`._auto`).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import weakref
from pathlib import Path
from typing import Any

from trainguard._errors import TrainguardError

GUARD_PENDING = (
    "guard= is not supported inside a framework's own training loop yet: the Trainer owns its batches, "
    "so trainguard.Guard cannot rewind and replay them; leave guard=None here, or guard a plain loop "
    "with ckpt.resume(state, total_steps=N, guard=tg.Guard(...)).batches()"
)


def _check_options(logdir: Any, record: Any, mode: Any, monitor: Any, every: Any, guard: Any,
                   check_numerics: Any) -> None:
    from trainguard.store import MODES

    if not isinstance(logdir, (str, os.PathLike)) or not str(logdir):
        raise TrainguardError(f"logdir must be a path, got {logdir!r}")
    for name, value in (("record", record), ("monitor", monitor), ("check_numerics", check_numerics)):
        if not isinstance(value, bool):
            raise TrainguardError(f"{name} must be True or False, got {value!r}")
    if mode not in MODES:
        raise TrainguardError(f"mode must be one of {list(MODES)}, got {mode!r}")
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise TrainguardError(f"every must be an int >= 1, got {every!r}")
    if guard is not None:
        raise TrainguardError(GUARD_PENDING)
    if not (record or monitor or check_numerics):
        raise TrainguardError("nothing to do: record, monitor and check_numerics are all off")


def rank_dir(logdir: Path, rank: int, world_size: int) -> Path:
    """Each rank of a distributed run writes ``logdir/rank-K`` (readers merge ranks)."""
    return logdir / f"rank-{int(rank)}" if int(world_size) > 1 else logdir


def continue_counts(rec, run_dir: Path) -> None:
    """A recorder continuing the run in ``run_dir`` (resumed): its executions are numbered after the
    earlier processes', and counted with them (``meta.recorded``; ``executions`` is the next number).
    A process killed before it stopped wrote no count: without filters it recorded every op it
    numbered; with them, at least those stored."""
    from trainguard.store import open_run

    try:
        with open_run(run_dir) as run:
            n = run.count()
            rec.seq = run.executions(n - 1, n)[0]["seq"] + 1 if n else 0
            meta = run.meta
            if meta.get("ops_filter") or meta.get("dtypes_filter"):
                rec.recorded = max(int(meta.get("recorded") or 0), n)
            else:
                rec.recorded = rec.seq
    except Exception:  # no recording there yet: the recorder counts from 0
        return


def resumed_at(step: int) -> None:
    """The framework resumed its checkpoint of ``step``: what the run holds of steps ``step`` and
    later (a killed process that ran past that checkpoint, or a resume from an earlier one) belongs
    to training the resume undid; the steps that run again replace it."""
    from trainguard.capture import restored_step

    restored_step(step)


class Session:
    """One run's trainguard objects. ``owner=False``: drive ``monitor`` only, open and close nothing."""

    def __init__(self, logdir: str | os.PathLike | None = None, *, record: bool = False, mode: str = "full_health",
                 monitor: bool = True, every: int = 10, guard: Any = None, check_numerics: bool = False,
                 attached: Any = None):
        self.owner = attached is None
        if self.owner:
            _check_options(logdir, record, mode, monitor, every, guard, check_numerics)
        self.logdir = Path(logdir) if logdir is not None else None
        self.record, self.mode, self.every = record, mode, every
        self.want_monitor, self.check_numerics = monitor, check_numerics
        self.monitor = attached
        self.recorder = None
        self.run_dir: Path | None = None
        self._writer = None
        self.started = not self.owner

    def __getstate__(self) -> dict:
        # Spawned ranks (ddp_spawn) receive the callback before training starts: options only.
        state = dict(self.__dict__)
        state.update(monitor=None, recorder=None, _writer=None, started=False)
        return state

    def start(self, model: Any, *, step: int, rank: int = 0, world_size: int = 1, resumed: bool = False,
              holder: Any = None) -> None:
        """Open the run (``append`` when the framework resumed its checkpoint) and take the step clock.

        ``holder``: a module holding ``model`` that the training step calls instead (a Trainer's
        loss module): watched in its place, under ``model``'s own names and ``loss.`` for its own."""
        if self.started:
            self.step(step)
            return
        import trainguard
        from trainguard.capture import Recorder, drive_step
        from trainguard.store import acquire_writer

        self.run_dir = rank_dir(self.logdir, rank, world_size)
        recording = self.record or self.check_numerics
        # The session holds the run's writer, so that the monitor and the recorder join one run,
        # appended to when the framework resumed.
        self._writer = acquire_writer(self.run_dir, append=resumed, resume=resumed, process=recording)
        try:
            if self.want_monitor:
                self.monitor = trainguard.Monitor(holder if holder is not None else model, self.run_dir, self.every,
                                                  append=resumed, rank_dir=False)
                if holder is not None:
                    self.monitor.name_after(holder, model, "loss.")
            if recording:
                rec = Recorder(self.run_dir, mode=self.mode if self.record else "curt_health",
                               check_numerics=self.check_numerics, rank_dir=False)
                if resumed:
                    continue_counts(rec, self.run_dir)  # executions of the earlier run keep their numbers
                self.recorder = rec.start()
        except BaseException:
            self.close()
            raise
        self.started = True
        _OPEN.add(self)
        from trainguard.capture._ending import watch_uncaught

        watch_uncaught()  # the HF Trainer has no exception callback: closed at exit with the error
        drive_step(int(step))

    def step(self, step: int) -> None:
        """The framework's ``global_step`` now (a no-op while it has not moved)."""
        if self.started and (self.monitor is not None or self.recorder is not None):
            from trainguard.capture import drive_step

            drive_step(int(step))

    def gradients_ready(self, optimizer: Any) -> None:
        if self.monitor is not None:
            self.monitor.gradients_ready(optimizer)

    def forward_started(self, model: Any, inputs: Any) -> None:
        if self.monitor is not None and self.owner:
            self.monitor.forward_started(model, inputs)

    def checkpoint_saved(self) -> None:
        """The framework saved a checkpoint: what the run buffers goes to disk now, so that a kill
        before the next flush loses none of the steps a resume from that checkpoint will not run
        again."""
        if not self.started:
            return
        if self.monitor is not None:
            self.monitor.framework_checkpoint()
            self.monitor.flush()  # its buffered steps, then the writer (the recorder's records too)
        elif self._writer is not None:
            self._writer.flush()

    def close(self, error: BaseException | None = None) -> None:
        """Stop recording and close the monitor (which diagnoses the run); ``error`` ended training.

        A driving session (``owner=False``) hands the step count back and looks for the next
        trainer (a second ``fit`` in the same script).
        """
        if not self.owner:
            if self.monitor is not None:
                from trainguard.capture import release_step
                from trainguard.integrations._auto import rearm

                release_step()
                rearm(self.monitor)
            return
        from trainguard.capture import release_step
        from trainguard.capture._ending import ending
        from trainguard.store import release_writer

        rec, mon, writer = self.recorder, self.monitor, self._writer
        self.recorder = self.monitor = self._writer = None
        self.started = False
        _OPEN.discard(self)
        ended = ending(error)  # while the framework's step is still the clock's
        release_step()  # training goes on without the framework: optimizer steps count again
        try:
            if rec is not None:
                rec.stop(**ended)
        finally:
            try:
                if mon is not None:
                    mon.close(error=error)
            finally:
                if writer is not None:
                    release_writer(writer, **ended)


_OPEN: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_at_exit() -> None:
    from trainguard.capture._ending import uncaught

    for session in list(_OPEN):
        with contextlib.suppress(Exception):
            session.close(error=uncaught())
