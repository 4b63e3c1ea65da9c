"""trainguard.Guard: always on, it rewinds, replays and records a failing step, then goes on by policy.

How a step goes (see docs/guard.md):

1. The sentry reads each step's loss and gradient norm one step late (no host-device sync),
   checks them for NaN/Inf and, with ``spike_factor``, against the median of the last steps.
   Every ``snapshot_every`` steps, once the steps before are verified, the whole train state is
   copied into host memory (one snapshot at a time).
2. A bad step ``f`` rewinds the state to the newest of that snapshot and the manager's newest
   checkpoint. The loop hands out the same batches again with the same RNG; each replayed loss
   is compared bitwise with the original. Before step ``f`` the snapshot moves there (not under
   ``lower_lr``).
3. Step ``f`` runs eagerly under full recording into ``<logdir>/replays/step-<f>``; its origin
   comes from :func:`trainguard.analysis.origin`.
4. The policy: ``skip`` rewinds to ``f`` and discards the batch (``skip_batches`` of them for a
   spike); ``lower_lr`` rewinds to the snapshot before the replay with every learning rate
   halved (the updates before ``f`` made its fault); ``stop`` rewinds to
   ``f`` and raises :class:`~trainguard.Diverged`. When the batch after a skipped one fails the
   same way (same op and line), the fault follows the code: :class:`~trainguard.Diverged`.

The loop (:class:`~trainguard.resilience.ResumeLoop`) calls the ``_``-prefixed hooks below; under
torch.distributed every rank calls them at the same steps and takes the same decisions.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import shlex
import statistics
import struct
import sys
import time
import weakref
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from trainguard._errors import Diverged
from trainguard.capture import _skips, align_step, unrecorded
from trainguard.capture._ending import ending, uncaught, watch_uncaught
from trainguard.guard import _collective, _events, _raising
from trainguard.guard._config import LR_FACTOR, SPIKE_MIN_HISTORY, SPIKE_WINDOW, GuardConfig
from trainguard.guard._events import STOPPED
from trainguard.guard._outside import OutsideOptimizers
from trainguard.guard._replay import (
    StepRecording,
    batch_nonfinite,
    held_before,
    index_in_batch,
    origin_from_dict,
    origin_key,
    rank_dir,
    rows_in_order,
    short_path,
)
from trainguard.guard._sentry import Sentry, StepValues
from trainguard.resilience import MemorySnapshot, ResumeLoop, TrainState, set_default_guard
from trainguard.resilience._unheld import warn_unheld
from trainguard.store import acquire_writer, release_writer

log = logging.getLogger("trainguard.guard")

# Batches in a row the guard skips for holding a known corrupt sample before it lets one through
# (to fail and be replayed): a dataset corrupt throughout must not spin the loop forever.
_MAX_KNOWN_SKIPS = 64
_MAX_EVAL_STEPS = 100  # steps of eval faults kept in the run (an eval every few steps faults each time)


# Guards whose loop stopped early with no ending stored (an exception in the loop body closes the
# generator while it unwinds, before anything says the script is ending): an exception that ends
# the script is stored as their run's ending at exit.
_interrupted: weakref.WeakSet[Guard] = weakref.WeakSet()


@atexit.register
def _store_uncaught() -> None:
    error = uncaught()
    for g in list(_interrupted) if error is not None else ():
        try:
            g._store_ending(ending(error))
        except Exception:  # pragma: no cover - best effort at interpreter exit
            log.exception("trainguard: storing how the script ended in the guard's run failed")


def _default_logdir() -> Path:
    return Path("runs") / time.strftime("guard-%Y%m%d-%H%M%S")


def _nonfinite(v: StepValues) -> dict[str, float]:
    """``{"nonfinite_loss": loss, "nonfinite_grad": grad_norm}`` for the values of ``v`` that are NaN/Inf."""
    return {kind: x for kind, x in (("nonfinite_loss", v.loss), ("nonfinite_grad", v.grad_norm))
            if x is not None and not math.isfinite(x)}


def _first_fault(values: list[StepValues]) -> dict[str, Any] | None:
    """The first step read at the loop's end with a non-finite loss or gradient norm, as the
    guard's metadata keeps it (values as text: JSON has no NaN), or None."""
    for v in values:
        if bad := _nonfinite(v):
            names = {"nonfinite_loss": "loss", "nonfinite_grad": "grad_norm"}
            return {"step": v.step, "kinds": list(bad), **{names[k]: str(x) for k, x in bad.items()}}
    return None


def _crash_batch(loop: Any, batch: Any) -> dict | None:
    """Where the batch of the step the loop body left holds NaN/Inf itself: an error raised on it
    inside the step (detr's ``assert`` on the boxes a NaN image made, in its matcher) came before
    any loss the guard could judge, so nothing was rewound; the report names the sample."""
    if batch is None:
        return None
    try:
        samples = getattr(loop.state.loader, "last_indices", None)
        samples = [int(i) if hasattr(i, "__index__") else i for i in samples] if samples is not None else None
        bad = batch_nonfinite(batch, samples if rows_in_order(loop.state.loader, samples) else None)
    except Exception:  # a device the error left unusable: nothing more to learn
        return None
    return None if bad is None else {"step": loop.state.step, **bad}


def _bits(x: float | None) -> bytes | None:
    return None if x is None else struct.pack("<d", x)


@dataclass
class _Plan:
    """A rewind in progress: replay ``start`` .. ``fail - 1``, then record ``fail``."""

    fail: int
    start: int
    source: str
    kinds: list[str]
    ranks: list[int]
    original: StepValues | None
    median: float | None
    recording: StepRecording | None = None
    compared: int = 0
    mismatch: dict | None = None
    batch: dict | None = None  # the failing step's batch, as the loader tells it
    batch_nonfinite: dict | None = None  # the rows of that batch that held NaN/Inf already (batch_nonfinite)
    rows_named: bool = True  # whether the batch's rows are its samples in the loader's order (rows_in_order)


@dataclass
class _Probation:
    """The step after a skip: failing again the same way there means a bug in the code."""

    step: int
    kinds: list[str]
    key: tuple | None
    event: dict = field(default_factory=dict)


class Guard:
    """Catch a NaN, an Inf or a loss spike, rewind, replay the bad step under full recording, go on.

    Use it through the resumable loop::

        guard = tg.Guard(logdir="runs/exp1")
        loop = ckpt.resume(state, total_steps=N, guard=guard)
        for step, batch in loop.batches():
            loss = loss_fn(model(batch[0]), batch[1])
            opt.zero_grad(); loss.backward(); opt.step()

    or on its own, with in-memory snapshots only (no checkpoint directory)::

        for step, batch in guard.batches(state, total_steps=N):
            ...

    ``policy``: ``"skip"`` the offending batch, ``"lower_lr"`` (every learning rate x0.5) or
    ``"stop"`` (raise :class:`trainguard.Diverged` carrying the origin). ``snapshot_every``: steps
    between host-memory snapshots of the whole state. ``max_rewinds``: rewinds allowed in all,
    then :class:`~trainguard.Diverged`. ``spike_factor``: also treat a loss above this multiple of
    the median of the last 100 steps as a fault. ``skip_batches``: batches a spike skips, the
    failing one first (a NaN or Inf skips exactly the failing batch).

    Each event is logged on ``trainguard.guard`` (a WARNING: stderr when logging is not
    configured), kept in :attr:`events` and stored in the run at ``logdir`` (default
    ``runs/guard-<date>-<time>``), with the replayed step's recording in ``logdir/replays/``. A
    run already there is added to (a rerun after a crash resumes it), or replaced with
    ``overwrite=True``.
    """

    def __init__(self, logdir: str | os.PathLike | None = None, *, policy: str = "skip", snapshot_every: int = 50,
                 max_rewinds: int = 5, spike_factor: float | None = None, skip_batches: int = 1,
                 overwrite: bool = False):
        self.config = GuardConfig(policy=policy, snapshot_every=snapshot_every, max_rewinds=max_rewinds,
                                  spike_factor=spike_factor, skip_batches=skip_batches)
        self.logdir: Path | None = Path(logdir) if logdir is not None else None
        self.events: list[dict] = []
        self.rewinds = 0
        # batches skipped unread because they hold a sample an event found corrupt (see _known_bad)
        self.skipped_known: list[dict] = []
        self._bad_samples: dict[Any, int] = {}  # sample index -> the event that found it
        self._bad_index: dict[Any, str] = {}  # of those, the samples holding an index out of range -> what
        # samples two events blamed for the same fault: sample -> its fault key (_events.fault_key)
        self._repeats: dict[Any, tuple] = {}
        self._culprit_events: dict[tuple, list[int]] = {}  # (fault key, sample) -> events blaming it
        self._by_rows: set[tuple] = set()  # (fault key, sample) blamed by the rows of a NaN/Inf, not a batch
        self._skipping_known = 0  # batches skipped that way in a row
        # the data set the sample indices above point into (see _same_data); None: the first one seen
        self._samples_of: Any = None
        self._earlier_known = 0  # of an earlier process, in the run this one continues
        self._earlier_repeat = 0  # of those, skipped for a sample two events named (see _remember_repeat)
        self.snapshot = MemorySnapshot()
        # lower_lr keeps the snapshot before the newest too: a fault on the newest one's step came
        # from the updates before it, and only a retry from further back can change it
        self._older: tuple[MemorySnapshot, OutsideOptimizers] | None = None
        self._sentry = Sentry()
        self._raising = _raising.Raised()  # what an op of the running step raised on NaN/Inf
        self._raised_at: dict[int, dict] = {}  # step -> that error, for the step's event
        self._outside = OutsideOptimizers()  # pyro.optim's per-parameter Adams, which no TrainState holds
        self._loop: Any = None
        self._run: _events.GuardRun | None = None
        self._earlier = (0, 0)  # (events, rewinds) of earlier processes in the run this one continues
        self._run_dir: Path | None = None  # the last loop's run, where the script's ending goes
        self._ending: dict[str, Any] = {}  # how the script ended, when it is told before the loop closed
        self._installed_previous: Any = None
        self._stored: set[int] = set()  # ids of the events written to the run
        self._overwrite = overwrite  # replace a run already at logdir (the first loop's only)
        # Steps the loop skipped itself (its loss checked non-finite, no backward(): capture/_skips):
        # the run's ``loop_skipped`` account. Nothing was updated, so the guard does not rewind.
        self.loop_skipped: dict | None = None
        # Ops that raised under torch.no_grad() inside the loop body (an evaluation): the run's
        # ``eval_faults`` account. They changed no parameter, so the guard does not rewind for them.
        self.eval_faults: dict | None = None
        self._reset()

    def __repr__(self) -> str:
        return f"Guard({str(self.logdir) if self.logdir else None!r}, {self.config})"

    def _reset(self) -> None:
        self._restores = 0  # the loop re-creates its data iterator when this moves
        self._skips: dict[int, int] = {}  # step -> batches discarded before it runs
        self._window: deque[tuple[int, float]] = deque(maxlen=SPIKE_WINDOW)
        self._history: dict[int, StepValues] = {}
        self._plan: _Plan | None = None
        self._probation: _Probation | None = None
        self._bad_local: dict[int, StepValues] = {}
        self._last_event: dict | None = None
        # the running step's batch: where an index an op raised on came from (_index_samples), and
        # the batch of a step the loop body left by raising (_crash_batch)
        self._batch: Any = None

    # ------------------------------------------------------------------ public
    @property
    def snapshot_bytes(self) -> int:
        """Host memory the snapshot holds (0 before the first)."""
        return self.snapshot.nbytes

    def batches(self, state: TrainState, *, total_steps: int):
        """The guard without a CheckpointManager: yield ``(step, batch)`` from ``state.loader``
        from ``state.step`` to ``total_steps``, with in-memory snapshots only. Nothing is saved
        to disk but the guard's run; signals are left to the program."""
        still = warn_unheld(state, sys._getframe(1).f_locals, stacklevel=2)
        loop = ResumeLoop(None, state, total_steps=total_steps, epochs=None, delete_on_success=False,
                          handle_signals=False, guard=self)
        loop._still = still  # checked at each rewind: a module left out that moved is named then
        return loop.batches()

    @contextmanager
    def guarded(self) -> Iterator[None]:
        """Wrap the loop body (``with loop.guarded():``, or this guard's own for ``guard.batches()``):
        an exception it raises while the step's batch holds NaN/Inf itself, or after the step's
        loss or gradient norm turned NaN/Inf (detr's ``generalized_box_iou`` asserts on the NaN boxes
        of a corrupt image, before any loss), makes the step a bad step: the error ends the body
        there, and the guard rewinds, replays the step under recording and applies its policy, as for
        a NaN loss. Any other exception, and any outside a guarded step, is raised unchanged."""
        try:
            yield
        except Exception as error:
            if not self._body_fault(error):
                raise

    def _body_fault(self, error: BaseException) -> bool:
        """Whether the loop body's ``error`` came from the step's NaN/Inf (see :meth:`guarded`); noted then."""
        if self._loop is None or self._batch is None:
            return False
        try:
            with torch.no_grad(), unrecorded():
                held = (self._raising.first is not None or self._sentry.step_nonfinite()
                        or batch_nonfinite(self._batch, None) is not None)
        except Exception:  # noqa: BLE001 - a device the error left unusable: the error is the user's
            return False
        if held:
            self._raising.note_body(error)
        return held

    def install(self) -> Guard:
        """Guard every ``CheckpointManager.resume()`` of this process that gets no ``guard=``
        (what ``trainguard run --guard`` does); :meth:`uninstall` undoes it."""
        self._installed_previous = set_default_guard(self)
        return self

    def uninstall(self) -> None:
        set_default_guard(self._installed_previous)
        self._installed_previous = None

    # ------------------------------------------------------------------ the loop's hooks
    def _attach(self, loop: Any) -> None:
        if self._loop is not None:
            raise RuntimeError("this guard already watches a loop")
        self._loop = loop
        self._reset()
        if self.logdir is None:
            self.logdir = _default_logdir()
        run_dir = self._run_dir = rank_dir(self.logdir)  # type: ignore[arg-type]
        # A rerun continues the run an earlier process began: its events are numbered after those.
        events, rewinds = (0, 0) if self._overwrite else _events.stored_counts(run_dir)
        if not self._overwrite and _collective.rank_world()[1] == 1:
            self._bad_samples = {**_events.stored_bad_samples(run_dir), **self._bad_samples}
            for (key, sample), (ns, by_rows) in _events.stored_culprits(run_dir).items():
                seen = self._culprit_events.setdefault((key, sample), [])
                seen[:0] = [n for n in ns if n not in seen]
                if by_rows:
                    self._by_rows.add((key, sample))
            for key in {key for key, _ in self._culprit_events}:
                self._remember_repeat(key)
            meta = _events.stored_meta(run_dir)
            self._earlier_known = max(meta.get("skipped_known", 0) - len(self.skipped_known), 0)
            mine = sum(1 for i in self.skipped_known if i.get("why") == "repeat")
            self._earlier_repeat = max(meta.get("skipped_repeat", 0) - mine, 0)
        self._earlier = (max(events - len(self.events), 0), max(rewinds - self.rewinds, 0))
        self._run = _events.GuardRun(run_dir, {**asdict(self.config), "rewinds": self._earlier[1] + self.rewinds,
                                               "events": self._earlier[0] + len(self.events)},
                                     overwrite=self._overwrite)
        self._overwrite = False  # a later loop of this guard adds to the run this one began
        watch_uncaught()  # a loop closed at exit by the exception that ends the script stores it as the run's ending
        self._sentry.start()
        _raising.install()
        _skips.acquire(self._on_loop_skip)
        self._take_snapshot()

    def _detach(self) -> None:
        if self._loop is None:
            return
        plan, self._plan = self._plan, None
        if plan is not None and plan.recording is not None:
            plan.recording.stop()
        loop = self._loop
        # Steps the sentry holds unread: when the loop body raised, the last of them may be a NaN
        # step whose weights made the error (on an accelerator the sentry reads a step when the next one ends).
        try:
            unread = self._sentry.read(before=None) if loop.state.step < loop.total_steps else []
        except Exception:  # a device the error left unusable: nothing more to learn
            unread = []
        self._sentry.stop()
        _raising.end()
        _raising.remove()
        _skips.release(self._on_loop_skip)
        self._loop = None
        batch, self._batch = self._batch, None
        sk = self.loop_skipped
        if sk is not None and sk["count"] > 1:
            log.warning("trainguard: the loop skipped %d steps itself (its loss non-finite, no backward()), the "
                        "first at step %d: those batches trained nothing", sk["count"], sk["first"]["step"])
        final = dict(self._ending)  # the run's own status, as a recording of the script stores it
        if loop.state.step >= loop.total_steps:
            status = "finished"
        elif self._last_event is not None and self._last_event["action"] in STOPPED:
            status = "diverged"
            final = final or ending(f"Diverged: trainguard: {self._last_event['message']}", self._last_event["step"])
        else:
            status = "interrupted"  # an exception in the loop body, a signal, a break
            final = final or ending(uncaught())  # the loop closed at exit (resilience._loop): the script crashed
            if not final:
                _interrupted.add(self)
        if self._run is not None:
            if status == "interrupted":
                self._run.update(stopped_step=loop.state.step)  # the step the loop body left
                fault = _first_fault(unread)
                if fault is not None:
                    self._run.update(fault_before_crash=fault)
                elif (bad := _crash_batch(loop, batch)) is not None:
                    self._run.update(batch_nonfinite_at_crash=bad)
            for event in self.events:
                self._store(event)  # a skip whose batches the loop never drew (it stopped first)
            self._run.close(status, final)
            self._run = None
        self.snapshot.release()
        if self._older is not None:
            self._older[0].release()
            self._older = None

    def _store_ending(self, end: dict[str, Any]) -> None:
        """How the script ended (``trainguard.capture._ending.ending``), stored in the guard's run
        (``trainguard run --guard``): a crash in the loop body, or ``Diverged``, is then no finished run."""
        _interrupted.discard(self)
        if not end.get("status") or self._run_dir is None:
            return
        if self._run is not None:  # the loop is still open (its generator not closed yet): it stores it
            self._ending = dict(end)
            return
        writer = acquire_writer(self._run_dir, append=True)
        release_writer(writer, **end)

    def _report(self, loss: Any) -> None:
        self._sentry.report(loss)

    def _begin_step(self, step: int, batch: Any = None) -> None:
        _skips.watch.begin()
        align_step(step)
        self._batch = batch
        self._raising.take()
        _raising.begin(self._raising)
        plan = self._plan
        if plan is not None and step == plan.fail and plan.recording is None:
            plan.batch = self._batch_info()
            # before recording starts (the probe reads the dataset)
            plan.rows_named = rows_in_order(self._loop.state.loader, plan.batch.get("samples"))
            plan.batch_nonfinite = batch_nonfinite(batch, plan.batch.get("samples") if plan.rows_named else None)
            plan.recording = StepRecording(self.logdir, step)  # type: ignore[arg-type]
            plan.recording.start()

    def _end_step(self, step: int) -> None:
        plan = self._plan
        if plan is not None and plan.recording is not None and step == plan.fail:
            plan.recording.stop()
        _raising.end()
        raised = self._raising.take()
        no_grad = self._raising.take_no_grad()
        if no_grad is not None and raised is None and self._sentry.step_nonfinite():
            raised, no_grad = no_grad, None  # its NaN reached the step's loss or gradients: no eval's, the step's
        batch, self._batch = self._batch, None
        if raised is not None:
            if "index" in raised:
                self._index_samples(raised["index"], batch)
            self._raised_at[step] = raised
            self._sentry.raised()
        if no_grad is not None:
            self._on_no_grad_fault(step, no_grad)
        self._sentry.end_step(step)
        _skips.watch.boundary()  # the loop checked this step's loss, found NaN/Inf and called no backward()

    def _index_samples(self, bad: dict, batch: Any) -> None:
        """An op raised on an index out of range (``_raising``): which rows of the step's batch, and
        which samples, hold those entries (``in_batch``), when the index is a batch tensor or a view
        or copy of one. The tensors the note held are dropped (the event is stored as JSON)."""
        t, mask = bad.pop("tensor", None), bad.pop("mask", None)
        if t is None or batch is None:
            return
        samples = self._batch_info().get("samples")
        if samples is not None and not rows_in_order(self._loop.state.loader, samples):
            samples = None
        found = index_in_batch(batch, {"tensor": t, "mask": mask}, samples)
        if found is not None:
            bad["in_batch"] = found

    def _on_loop_skip(self, skip: _skips.Skip) -> None:
        """The loop skipped a step itself: nothing was updated, so there is nothing to rewind or
        skip again. Logged (the first at WARNING) and counted in the run, once per step: not while
        a replay runs, nor for a step the guard acted on already."""
        if self._plan is not None or any(e.get("step") == skip.step for e in self.events):
            return
        sk = self.loop_skipped
        if sk is not None and sk["last"]["step"] == skip.step:
            return
        sk = self.loop_skipped = _skips.count(sk, skip)
        where = f" (checked by `{skip.check}` at {skip.file}:{skip.line})" if skip.file else ""
        text = (f"step {skip.step:,}: the loop skipped this step itself: its loss was {_events._num(skip.loss)}{where} "
                "and it called no backward(), so nothing was updated and the guard has nothing to rewind")
        if sk["count"] == 1:
            script = shlex.join(sys.argv) if sys.argv and sys.argv[0].endswith(".py") else "script.py"
            log.warning("trainguard: %s; find where the NaN/Inf comes from with `trainguard run --check-numerics "
                        "%s`", text, script)
        else:
            log.info("trainguard: %s", text)
        if self._run is not None:
            self._run.update(loop_skipped=sk)

    def _on_no_grad_fault(self, step: int, fault: dict) -> None:
        """An op raised under ``torch.no_grad()`` in the loop body (an evaluation over a validation
        set holding a bad label or a NaN) and was made to give NaN: no parameter changed, so nothing
        is rewound (a NaN that reaches the step's loss or gradients is caught there as any other).
        Logged (the first at WARNING) and counted in the run; not while a replay runs it again."""
        index = fault.get("index") or {}
        index.pop("tensor", None), index.pop("mask", None)  # the event is stored as JSON
        if self._plan is not None:
            return
        loader = fault.get("loader")
        what = (_events.index_reason(fault) if fault.get("file")
                else f"{fault['op']} raised {fault['error'].rstrip('.')}")
        where = f" in batch {loader['batch']} of `{loader['name']}`" if loader else ""
        held = f" ({_events.index_held(fault)})" if fault.get("index") else ""
        text = (f"step {step:,}: {what} under torch.no_grad(){where}{held}: it changed no parameter, so the "
                "guard made its result NaN, did not rewind, and training goes on")
        ef = self.eval_faults
        if ef is None:
            ef = self.eval_faults = {"count": 0, "steps": [], "first": dict(fault, step=step, message=text)}
        ef["count"] += 1
        if len(ef["steps"]) < _MAX_EVAL_STEPS:
            ef["steps"].append(step)
        ef["last"] = dict(fault, step=step, message=text)
        if ef["count"] == 1:
            log.warning("trainguard: %s; repair or drop that sample of the evaluation's data", text)
        else:
            log.info("trainguard: %s", text)
        if self._run is not None:
            self._run.update(eval_faults=ef)

    def _discard_before(self, step: int) -> int:
        return self._skips.get(step, 0) if self._skips else 0

    def _known_bad(self) -> bool:
        """Whether the batch the loop just drew holds a sample an earlier event found holding
        NaN/Inf in the batch itself (a corrupt sample comes back every epoch): the loop then
        draws the next one instead, with no rewind, no replay and no event. One process only:
        on several ranks a skip must be every rank's, and this is decided alone."""
        self._same_data()
        if not self._bad_samples or self._skipping_known >= _MAX_KNOWN_SKIPS:
            self._skipping_known = 0
            return False
        samples = getattr(self._loop.state.loader, "last_indices", None)
        hit = [s for s in (int(i) if hasattr(i, "__index__") else i for i in samples or ())
               if isinstance(s, (int, str)) and s in self._bad_samples]
        if not hit:
            self._skipping_known = 0
            return False
        self._skipping_known += 1
        info = self._batch_info()
        repeat = self._repeats.get(hit[0])
        info.update(step=self._loop.state.step, known_from_event=self._bad_samples[hit[0]],
                    why="repeat" if repeat else "data")
        if info in self.skipped_known:  # skipped again in a later fault's replay: one batch all the same
            return True
        self.skipped_known.append(info)
        label = _events.batch_label(info)
        which = f"batch {label}" if label else "a batch"
        samples = _events._listed("sample", hit)
        if repeat:
            *earlier, last = self._culprit_events[(repeat, hit[0])]
            op, file, line = repeat
            where = f" at {short_path(file)}:{line}" if file else ""
            if repeat == _events.SPIKE_KEY:
                did = "was in the batches of the loss spikes of"
            elif (repeat, hit[0]) in self._by_rows:
                did = "made the NaN/Inf of"
            else:
                did = "was in the failing batches of"
            fault = "" if repeat == _events.SPIKE_KEY else f" ({op}{where})"
            log.warning("trainguard: skipped %s at step %d: its %s %s events %s and %s%s", which, info["step"],
                        samples, did, ", ".join(map(str, earlier)), last, fault)
        elif hit[0] in self._bad_index:
            log.warning("trainguard: skipped %s at step %d: %s (event %s)", which, info["step"], self._bad_index[hit[0]],
                        info["known_from_event"])
        else:
            log.warning("trainguard: skipped %s at step %d: its %s held NaN/Inf in the batch itself (event %s)",
                        which, info["step"], samples, info["known_from_event"])
        if self._run is not None:
            repeats = sum(1 for i in self.skipped_known if i.get("why") == "repeat")
            self._run.update(skipped_known=self._earlier_known + len(self.skipped_known),
                             skipped_repeat=self._earlier_repeat + repeats, last_skipped_known=info)
        return True

    def _same_data(self) -> None:
        """Sample indices name rows of one data set: a loader over another one (a reinforcement
        learning loop's next rollout, ``state.loader = DataLoader(TensorDataset(b_obs, ...))`` each
        iteration) starts a fresh account, or row 17 of every later rollout was skipped for the
        NaN observation of the first's. A loader over the same data set keeps it."""
        loader = getattr(self._loop.state, "loader", None) if self._loop is not None else None
        data = getattr(loader, "dataset", None)
        if data is None:
            return
        if self._samples_of is not None and self._samples_of() is data:
            return
        if self._samples_of is not None:
            self._bad_samples.clear()
            self._bad_index.clear()
            self._repeats.clear()
            self._culprit_events.clear()
            self._by_rows.clear()
            self._skipping_known = 0
        try:
            self._samples_of = weakref.ref(data)
        except TypeError:  # no weak references to it: hold it
            self._samples_of = lambda data=data: data

    def _note_suspects(self, event: dict, origin: dict | None, kinds: list[str], plan: _Plan) -> None:
        """Count the samples a skip event blames: those whose rows the replay found its first
        NaN/Inf in (``culprits``), else the samples of its batch (a loss spike has no such rows; an
        overflow in the optimizer's state has rows that are no batch's). A sample two events of the
        same fault blame is skipped unread from then on (``event["repeat"]`` says which, and since
        which event). One process only, as ``_known_bad``."""
        if _collective.rank_world()[1] != 1:
            return
        rows = (event.get("culprits") or {}).get("samples")
        samples = rows or (plan.batch or {}).get("samples")
        if not samples:
            return
        key = _events.fault_key(origin, kinds[0] if kinds else "nonfinite")
        for sample in samples:
            if isinstance(sample, (int, str)):
                self._culprit_events.setdefault((key, sample), []).append(event["n"])
                if rows:
                    self._by_rows.add((key, sample))
        sample = self._remember_repeat(key)
        if sample is not None:
            event["repeat"] = {"samples": [sample], "of": self._culprit_events[(key, sample)][0]}

    def _remember_repeat(self, key: tuple) -> Any:
        """The sample now known bad for fault ``key``, or None: the one sample more events of that
        fault blamed than any other, at least two (its row held the first NaN/Inf of the same op and
        line, or it was in the batches of loss spikes). The data holds no NaN/Inf itself (a finite
        outlier that a power overflows, a mislabelled target), yet it comes back every epoch, and
        each time would spend a rewind. Two batches share other samples by chance (about b**2/N):
        while several tie, the next event of the fault decides."""
        counts = {s: len(ns) for (k, s), ns in self._culprit_events.items() if k == key}
        top = max(counts.values(), default=0)
        tied = [s for s, n in counts.items() if n == top]
        if top < 2 or len(tied) != 1 or tied[0] in self._bad_samples:
            return None
        self._bad_samples[tied[0]] = self._culprit_events[(key, tied[0])][-1]
        self._repeats[tied[0]] = key
        return tied[0]

    def _skipped_batch(self) -> None:
        """The loop discarded a batch before this step: the skip event learns which (a spike's
        further batches are known only now; a later replay discards the same ones again)."""
        step = self._loop.state.step
        event = next((e for e in reversed(self.events) if e["step"] == step and e["action"] == "skip"), None)
        if event is None or len(event["skipped"]) >= event["skip_count"]:
            return
        info = self._batch_info()
        if info not in event["skipped"] or _events.batch_label(info) is None:  # unknown positions look alike
            event["skipped"].append(info)
        if len(event["skipped"]) >= event["skip_count"]:
            self._store(event)

    def _batch_info(self) -> dict:
        """The batch handed out last: epoch, index in the epoch, overall number, sample indices."""
        state, loader = self._loop.state, self._loop.state.loader
        index = getattr(loader, "batches_yielded", None)
        index = index - 1 if isinstance(index, int) else None
        try:
            per_epoch = len(loader)
        except TypeError:
            per_epoch = None
        samples = getattr(loader, "last_indices", None)
        return {
            "epoch": state.epoch,
            "index": index,
            "batch": state.epoch * per_epoch + index if index is not None and per_epoch else index,
            "samples": [int(i) if hasattr(i, "__index__") else i for i in samples] if samples is not None else None,
        }

    def _flags(self, step: int, *, saving: bool) -> list[int]:
        """At the boundary after ``step`` steps: read what may be read, return this rank's verdict."""
        plan = self._plan
        force = saving or plan is not None or step % self.config.snapshot_every == 0
        values = self._sentry.read(before=None if force else step - 1)
        return _collective.encode(self._judge(values))

    def _verify_last(self) -> bool:
        """Read every step not read yet (a sync), agree over ranks, act; True when it rewound."""
        if not self._sentry.unread:
            return False
        flags = _collective.encode(self._judge(self._sentry.read(before=None)))
        if _collective.rank_world()[1] > 1:
            flags = _collective.all_max(flags, self._loop._groups.ctl())
        return self._decide(flags)

    def _decide(self, flags: list[int]) -> bool:
        """Act on the combined verdict; True when the state was rewound."""
        verdict = _collective.decode(flags)
        step = self._loop.state.step
        if verdict is not None:
            return self._on_fault(*verdict)
        plan = self._plan
        if plan is not None:
            if plan.recording is not None and plan.recording.done:
                self._conclude(plan, reproduced=False)
            elif step == plan.fail and self.snapshot.step != step and self.config.policy != "lower_lr":
                # the replay reached the failing step: rewind here from now on (lower_lr keeps the
                # snapshot before it: the failing step's loss comes from the updates before it, which
                # only a retry from there at a lower rate can change)
                self._take_snapshot()
            return False
        if (step % self.config.snapshot_every == 0 and self.snapshot.step != step and not self._sentry.unread
                and step < self._loop.total_steps):
            self._take_snapshot()
        return False

    # ------------------------------------------------------------------ judging steps
    def _judge(self, values: list[StepValues]) -> tuple[int, set[str]] | None:
        """Check the steps read, oldest first; the first bad one (step, kinds), or None."""
        plan = self._plan
        for v in values:
            kinds = set(_nonfinite(v))
            factor = self.config.spike_factor
            median = self._median() if factor and not kinds and v.loss is not None else None
            if median is not None and v.loss > factor * median:  # type: ignore[operator]
                kinds.add("spike")
            if plan is not None and v.step < plan.fail:
                self._compare(plan, v)
            if kinds:
                self._bad_local[v.step] = v
                return v.step, kinds
            if v.loss is not None and self.config.spike_factor:
                self._window.append((v.step, v.loss))
            if plan is None:
                self._history[v.step] = v
            if self._probation is not None and v.step == self._probation.step:
                self._probation = None  # the batch after the skipped one trained fine
        return None

    def _median(self) -> float | None:
        if len(self._window) < SPIKE_MIN_HISTORY:
            return None
        m = statistics.median(loss for _, loss in self._window)
        return m if m > 0 else None  # a spike is a multiple of a positive typical loss

    def _compare(self, plan: _Plan, v: StepValues) -> None:
        """A replayed step against the original: bitwise, loss and gradient norm."""
        original = self._history.get(v.step)
        if original is None:
            return
        plan.compared += 1
        if plan.mismatch is None and (_bits(v.loss) != _bits(original.loss)
                                      or _bits(v.grad_norm) != _bits(original.grad_norm)):
            plan.mismatch = {"step": v.step, "original": {"loss": original.loss, "grad_norm": original.grad_norm},
                             "replayed": {"loss": v.loss, "grad_norm": v.grad_norm}}

    # ------------------------------------------------------------------ rewinding
    def _take_snapshot(self) -> None:
        state = self._loop.state
        first = not self.snapshot.taken
        if self.config.policy == "lower_lr" and self.snapshot.taken and self.snapshot.step != state.step:
            older = self._older or (MemorySnapshot(), OutsideOptimizers())
            self._older, (self.snapshot, self._outside) = (self.snapshot, self._outside), older
        # inside an accumulation window the gradients so far are part of the step's state
        self.snapshot.take(state, wait=False, grads=self._loop.grads_pending)
        self._outside.take(state, self._sentry.optimizers())
        self._history = {s: v for s, v in self._history.items() if s >= state.step}
        if first:
            log.info("trainguard: the guard's snapshots hold %.1f MB of host memory", self.snapshot.nbytes / 2**20)
        if self._run is not None:
            self._run.update(snapshot_bytes=self.snapshot.nbytes, snapshot_step=state.step)

    def _restore(self, target: str) -> None:
        state = self._loop.state
        if target == "checkpoint":
            self._loop.manager.restore(state, _replay=True)  # the replay's records go beside the first ones
        else:
            self.snapshot.restore(state)
            self._outside.restore(state, self._sentry.optimizers(), self._sentry.fresh)
        self._restores += 1
        self._loop._check_still()  # what the state does not hold stays as the failed steps left it
        self._sentry.clear()
        while self._window and self._window[-1][0] >= state.step:
            self._window.pop()

    def _rewind_target(self, fail: int) -> str:
        m = self._loop.manager
        if m is not None:
            m.wait()
            latest = m.latest()
            # a checkpoint holds no state of optimizers outside the TrainState: rewind to the snapshot, which does
            outside = OutsideOptimizers.find(self._loop.state, self._sentry.optimizers())
            # (lower_lr: a checkpoint at the failing step holds the updates that made the fault)
            last = fail - 1 if self.config.policy == "lower_lr" else fail
            if latest is not None and (self.snapshot.step or 0) < latest.step <= last and not outside:
                return "checkpoint"
        return "memory"

    def _on_fault(self, fail: int, kinds: list[str], ranks: list[int]) -> bool:
        plan = self._plan
        if plan is not None and plan.recording is not None and plan.recording.done and fail == plan.fail:
            self._conclude(plan, reproduced=True, kinds=kinds, ranks=ranks)
            return True
        if self.rewinds >= self.config.max_rewinds:
            self._give_up(fail, kinds, ranks)
        self.rewinds += 1
        if plan is not None and plan.recording is not None:
            plan.recording.stop()
        median = self._median() if "spike" in kinds else None  # what it was judged by: the rewind trims the window
        target = self._rewind_target(fail)
        older = self._older
        if (self.config.policy == "lower_lr" and target == "memory" and self.snapshot.step == fail
                and older is not None and older[0].taken and (older[0].step or 0) < fail):
            # the fault is on the snapshot's step: no lower rate changes that step's loss, so go back
            # to the one before (the newest, taken after the updates that made the fault, is dropped)
            self._older, (self.snapshot, self._outside) = (self.snapshot, self._outside), older
        self._restore(target)
        start = self._loop.state.step
        self._plan = _Plan(fail=fail, start=start, source=target, kinds=kinds, ranks=ranks,
                           original=self._bad_local.get(fail), median=median)
        if start == fail and self.snapshot.step != fail:
            self._take_snapshot()  # rewound to a checkpoint at the failing step: the policy rewinds here
        return True

    def _conclude(self, plan: _Plan, *, reproduced: bool, kinds: list[str] | None = None,
                  ranks: list[int] | None = None) -> None:
        """The failing step was replayed under recording: find its origin and apply the policy."""
        self._plan = None
        rec = plan.recording
        assert rec is not None
        origin, bad_batch = (self._shared_origin(rec, plan, ranks or plan.ranks) if reproduced
                             else (None, plan.batch_nonfinite))
        kinds = kinds or plan.kinds
        trigger = kinds[0] if kinds else plan.kinds[0]
        local = plan.original or self._bad_local.get(plan.fail)
        event: dict[str, Any] = {
            "n": self._earlier[0] + len(self.events) + 1,
            "step": plan.fail,
            "time": time.time(),
            "trigger": trigger,
            "kinds": kinds,
            "ranks": sorted(ranks or plan.ranks),  # where the fault was seen
            "origin_rank": (ranks or plan.ranks or [0])[0],  # whose recording the origin comes from
            "loss": local.loss if local else None,
            "grad_norm": local.grad_norm if local else None,
            "reason": self._reason(trigger, local, plan.median, ranks or plan.ranks),
            "rewound_to": plan.start,
            "rewound_from": plan.source,
            "replay": {"steps": plan.fail - plan.start, "compared": plan.compared,
                       "bitwise_equal": None if not plan.compared else plan.mismatch is None,
                       "mismatch": plan.mismatch, "reproduced": reproduced, "run": rec.relative,
                       "eager": True},
            "origin": origin,
            "batch": plan.batch,
            "skipped": [],
            "rewinds": self.rewinds,
        }
        index_samples: list = []
        if (raised := self._raised_at.pop(plan.fail, None)) is not None and "index" in raised:
            # an index out of range: the op that raised is the origin (no op made a NaN to trace)
            event["raised"] = raised
            event["reason"] = _events.index_reason(raised)
            origin = event["origin"] = _events.index_origin(raised, plan.fail)
            index_samples = (raised["index"].get("in_batch") or {}).get("samples") or []
            if self.config.policy != "stop" and _collective.rank_world()[1] == 1:
                for sample in index_samples:
                    if isinstance(sample, (int, str)):
                        self._bad_samples.setdefault(sample, event["n"])  # skipped unread when it comes back
                        self._bad_index[sample] = f"{_events.index_held(raised)} ({raised['op']})"
        elif raised is not None:
            event["raised"] = raised  # the op raised on the NaN/Inf; the guard made it NaN and rewound
            if raised["op"] == "the loop body":  # Guard.guarded: no loss came, the body ended there
                event["reason"] = f"the loop body raised {raised['error']} on NaN/Inf"
            else:
                event["reason"] += f" ({raised['op']} raised on NaN/Inf: {raised['error']})"
        if event["origin_rank"] == _collective.rank_world()[0]:
            culprits = rec.culprits(origin, plan.batch if plan.rows_named else None)
            if culprits is not None:
                event["culprits"] = culprits
        if bad_batch is not None:
            # The data held the value before any op ran: whatever op the replay names first only
            # passed it on (a convolution "overflowing" an inf pixel), so the fix is the data's.
            event["batch_nonfinite"] = bad_batch
            if self.config.policy != "stop" and "rank" not in bad_batch and _collective.rank_world()[1] == 1:
                for sample in bad_batch.get("samples") or ():
                    self._bad_samples.setdefault(sample, event["n"])  # skipped unread when it comes back
            if origin is not None:
                origin["suggestion"] = _events.data_fix(bad_batch)
                link = origin["origin"]
                if any(i.get("kind") not in ("op", "param", "buffer") for i in link.get("inputs") or ()):
                    link["explanation"] = _events.passed_on(link, bad_batch)  # not "overflow": it read the batch
        if not reproduced:
            self._finish_event(event, "continue")
            return
        probation, self._probation = self._probation, None
        # The next batch failing the same way is the code's fault, unless it held NaN/Inf itself too
        # (a missing value in a series is in every window over it, batch after batch) or held no
        # sample at all (opacus' Poisson sampling draws empty batches, now and then two in a row),
        # or its NaN came in with a tensor made before the step (data read by the batch's offsets).
        if (probation is not None and probation.step == plan.fail and set(probation.kinds) & set(kinds)
                and "spike" not in kinds and probation.key == origin_key(origin) and bad_batch is None
                and not held_before(origin)
                and (plan.batch or {}).get("samples") != []):
            self._restore("memory")
            event["first_event"] = probation.event.get("n")
            self._finish_event(event, "code_bug")
            self._raise(event)
        policy = self.config.policy
        self._restore("memory")  # the snapshot sits right before the failing step (lower_lr: before the replay)
        if policy == "stop":
            self._finish_event(event, "stop")
            self._raise(event)
        if policy == "lower_lr" and bad_batch is not None:
            # no learning rate repairs a NaN in the data: the batch comes back the same
            event["policy_note"] = "the learning rate is kept (policy lower_lr): no rate repairs NaN/Inf in the data"
        elif policy == "lower_lr" and "index" in (event.get("raised") or {}):
            event["policy_note"] = "the learning rate is kept (policy lower_lr): no rate repairs an index out of range"
        elif policy == "lower_lr":
            event["lr_factor"] = LR_FACTOR
            event["lr"] = self._lower_lr(LR_FACTOR)
            event["retried_from"] = self._loop.state.step
            self._take_snapshot()  # a later rewind must keep the lowered rate
            self._finish_event(event, "lower_lr")
            return
        n = self.config.skip_batches if trigger == "spike" else 1
        self._skips[plan.fail] = self._skips.get(plan.fail, 0) + n
        event["skip_count"] = n
        if plan.batch is not None:
            event["skipped"] = [plan.batch]
        if not index_samples:  # (an index out of range named its samples already)
            self._note_suspects(event, origin, kinds, plan)
        if "spike" not in kinds:
            self._probation = _Probation(step=plan.fail, kinds=kinds, key=origin_key(origin), event=event)
        self._finish_event(event, "skip")

    def _shared_origin(self, rec: StepRecording, plan: _Plan, ranks: list[int]) -> tuple[dict | None, dict | None]:
        """The origin found by the first rank that saw the fault, and the rows of that rank's
        batch that held NaN/Inf already (``batch_nonfinite``; with its ``rank`` when it is another
        rank's: a corrupt sample on rank 1 is the data's fault on rank 0 too), on every rank. What
        an op of that rank raised (``_raised_at``: a label out of range) becomes every rank's, with
        its ``rank``: the event, its origin and the policy's decision must be the same on each."""
        o = rec.origin()
        data = {"origin": o.to_dict() if o is not None else None, "batch_nonfinite": plan.batch_nonfinite,
                "raised": self._raised_at.get(plan.fail)}
        me, world = _collective.rank_world()
        if world > 1:
            src = ranks[0] if ranks else 0
            data = _collective.broadcast_json(data, src, self._loop._groups.ctl())
            if src != me and data["batch_nonfinite"] is not None:
                data["batch_nonfinite"] = dict(data["batch_nonfinite"], rank=src)
            if src != me:
                if data["raised"] is not None:
                    self._raised_at[plan.fail] = dict(data["raised"], rank=src)
                else:
                    self._raised_at.pop(plan.fail, None)
        return data["origin"], data["batch_nonfinite"]

    def _lower_lr(self, factor: float) -> list[float]:
        lrs = []
        outside = OutsideOptimizers.find(self._loop.state, self._sentry.optimizers())
        for obj in [obj for _, obj in self._loop.state.items()] + outside:
            if isinstance(obj, torch.optim.Optimizer):
                for g in obj.param_groups:
                    for key in ("lr", "initial_lr"):
                        if key in g:
                            g[key] = g[key].mul_(factor) if isinstance(g[key], torch.Tensor) else g[key] * factor
                    lrs.append(float(g["lr"]))
            elif isinstance(obj, torch.optim.lr_scheduler.LRScheduler):
                obj.base_lrs = [lr * factor for lr in obj.base_lrs]
                if getattr(obj, "_last_lr", None) is not None:
                    obj._last_lr = [lr * factor for lr in obj._last_lr]
        return lrs

    def _give_up(self, fail: int, kinds: list[str], ranks: list[int]) -> None:
        self._restore("memory")
        previous = self.events[-1] if self.events else None
        event = {
            "n": self._earlier[0] + len(self.events) + 1, "step": fail, "time": time.time(), "trigger": kinds[0], "kinds": kinds,
            "ranks": sorted(ranks), "reason": self._reason(kinds[0], self._bad_local.get(fail), self._median(), ranks),
            "rewound_to": self._loop.state.step, "rewound_from": "memory", "replay": None,
            "origin": previous.get("origin") if previous else None, "skipped": [],
            "max_rewinds": self.config.max_rewinds, "rewinds": self.rewinds,
        }
        found = [e["batch_nonfinite"] for e in self.events if e.get("batch_nonfinite")]
        index = [b for e in self.events if (b := ((e.get("raised") or {}).get("index") or {}).get("in_batch"))]
        if self.events and len(found) == len(self.events):
            # every rewind went to a batch that held NaN/Inf itself: the data set holds them widely
            event["data_samples"] = list(dict.fromkeys(s for b in found for s in b.get("samples") or []))
        elif self.events and len(index) == len(self.events):
            # every rewind went to a batch holding a label (an index) out of range: so does the data set, widely
            event["index_samples"] = list(dict.fromkeys(s for b in index for s in b.get("samples") or []))
        self._finish_event(event, "max_rewinds")
        self._raise(event)

    def _reason(self, trigger: str, values: StepValues | None, median: float | None, ranks: list[int]) -> str:
        return _events.reason(trigger, values.loss if values else None, values.grad_norm if values else None,
                              median, self.config.spike_factor, ranks)

    def _finish_event(self, event: dict, action: str) -> None:
        event["action"] = action
        event["outcome"] = _events.outcome(event)
        event["message"] = _events.message(event)
        self.events.append(event)
        self._last_event = event
        log.warning("trainguard: %s", event["message"])
        if action != "skip" or len(event["skipped"]) >= event["skip_count"]:
            self._store(event)  # a skip is stored once the loop has drawn the batches it skips

    def _store(self, event: dict) -> None:
        if self._run is not None and id(event) not in self._stored:
            self._stored.add(id(event))
            self._run.add_event(event)
            self._run.update(rewinds=self._earlier[1] + self.rewinds, events=self._earlier[0] + len(self.events))
            self._run.commit()  # the evidence: a kill -9 in the next second must not lose it

    def _raise(self, event: dict) -> None:
        raise Diverged(f"trainguard: {event['message']}", step=event["step"],
                       origin=origin_from_dict(event.get("origin")), event=event)
