"""The native backend of a Recorder: installs the C++ core, feeds it the Python hooks' state, and
turns its drained records into the writer's batches (the same tuples the dispatch mode makes)."""

from __future__ import annotations

import bisect
import contextlib
import logging
import os
import sys
import threading
import weakref

import torch

from trainguard._errors import TrainguardError
from trainguard.capture import _steps
from trainguard.capture._stacks import frame_hint

_clock = _steps.clock

log = logging.getLogger("trainguard.capture")

# Summary modes as the C++ core numbers them (native.h).
MODE_CODE = {"no_tensor": 0, "curt_health": 1, "concise_health": 2, "full_health": 3, "shape": 4,
             "full_tensor": 5, "stats": 6}
STRATEGY_CODE = {"auto": 0, "immediate": 1, "deferred": 2}


def choose_backend(rec):
    """The native core's module for this recording, or None for the Python dispatch mode.

    ``auto`` takes the native core unless the recording must raise at the op (check_numerics)
    or the core cannot be built here (then one warning says how to get it); ``native`` insists.
    The core's summary kernel serves the Python backend's CPU summaries too, when built.
    """
    from trainguard.capture import _native

    module = _native.load()
    if rec.requested_backend == "auto" and os.environ.get("TRAINGUARD_BACKEND") in ("native", "python"):
        rec.requested_backend = os.environ["TRAINGUARD_BACKEND"]  # e.g. to run a suite on one backend
    if rec.requested_backend == "python" or rec.check or rec.logdir is None:
        return None
    if module is None:
        if rec.requested_backend == "native":
            raise TrainguardError(f"the native recorder core is not available: {_native.error()}")
        _warn_no_native(_native.error())
    return module


_warned_no_native = False


def _warn_no_native(reason: str | None) -> None:
    global _warned_no_native
    if not _warned_no_native:
        _warned_no_native = True
        log.warning("trainguard: recording with the Python dispatch mode, which is slower, because the native "
                    "core could not be built (%s); install a C++ compiler (g++) and ninja (pip install ninja) "
                    "for the fast path", reason)


def _with_hint(on_new_stack):
    """The core's new-stack callback: the recorder's, then what the stack's live frames say for
    ops no module claims (_stacks.frame_hint; the core keeps it per stack, see by_frames in
    recorder.cpp). Called from C++ inside the op: the frame below this one is the op's innermost."""
    def on_new(sid: int, frames: list):
        on_new_stack(sid, frames)
        return frame_hint(sys._getframe(1))
    return on_new


def _owner_hook(tracker, backend_ref):
    """The core's callback for a module whose method runs an op no hook claims: its interned id
    (ModuleTracker.owner, as the dispatch mode names it); the core keeps the module's address
    until the module dies. Holds the backend weakly (the core holds this)."""
    refs: dict[int, weakref.ref] = {}

    def owner(module) -> int:
        mid = tracker.owner(module)
        key = id(module)
        if key not in refs:
            def forget(_r, key=key):
                refs.pop(key, None)
                backend = backend_ref()
                if backend is not None:
                    backend.core.forget_owner(key)
            refs[key] = weakref.ref(module, forget)
        return mid
    return owner


class NativeBackend:
    """The C++ core of one recording, with the hooks that keep it informed."""

    # Stack ids interned in Python (compiled graphs' records) start above the core's own.
    PYTHON_STACK_IDS = 1 << 32

    def __init__(self, rec, module) -> None:
        self.rec = rec
        self.mod = module
        pattern = rec.ops_pattern
        wanted = (lambda name: pattern.search(name) is not None) if pattern is not None else None
        on_new_stack = _with_hint(rec._on_new_stack)
        self.core = module.Core(MODE_CODE[rec.mode], STRATEGY_CODE[rec.strategy], wanted,
                                sorted(rec.dtypes, key=str) if rec.dtypes else [], on_new_stack)
        on_owner = _owner_hook(rec.modules, weakref.ref(self))
        self.core.set_owner_hooks(torch.nn.Module, torch._C._FunctionBase, on_owner)
        self.unsure_warned = False
        self.unsure = 0
        self._prev_records: list = []  # the batch drained before: a view made just before a drain
        # Taint (capture/_taint.py): the core's records are judged in Python as they are drained,
        # by the recorder's Tracker and its rule, in seq order; records whose health reaches the
        # host later (device summaries) by the writer's thread, as the dispatch mode hands them on.
        from trainguard.capture._compile import keep_dynamo_out
        from trainguard.capture._recorder import op_facts_by_name

        # The core calls these when it first sees an op or a stack. At a graph break the op that
        # broke the graph runs eagerly with Dynamo's frame callback set: Dynamo must not compile them.
        keep_dynamo_out(op_facts_by_name, rec._on_new_stack, on_new_stack, on_owner,
                        *([wanted] if wanted is not None else []))
        rec.taint.resolve_op = op_facts_by_name
        module.set_op_classes(op_facts_by_name)  # the core's fast path: records it judges finite
        self._pruned_step: int | None = None
        self._prune_at = 4096
        self._stop = threading.Event()
        self.thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        rec = self.rec
        if not self.core.start():
            raise RuntimeError("too many native recordings at once")
        self.mod.set_step(_steps.clock.step)
        self.mod.set_in_optimizer(_steps.clock.in_optimizer)
        _steps.clock.on_in_optimizer.append(self.mod.set_in_optimizer)
        rec.modules.on_change = self.core.set_module
        rec.modules.on_named = self._on_named
        self.thread = threading.Thread(target=self._drain_loop, name="trainguard-native-drain", daemon=True)
        self.thread.start()

    def _on_named(self, t, name: str, kind: str) -> None:
        self.core.name_tensor(t, name, kind)
        p = self.core.producer_of(t)
        if p is not None and p[1] != 0:  # made not finite (before its module first ran): keep its state
            self.rec.taint.named[name] = p[0]

    def stop(self) -> None:
        self.core.stop()
        self._stop.set()
        self.core.wake()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout=10)
        if self.mod.set_in_optimizer in _steps.clock.on_in_optimizer:
            _steps.clock.on_in_optimizer.remove(self.mod.set_in_optimizer)
        self.rec.modules.on_change = None
        self.rec.modules.on_named = None

    def on_step(self, step: int) -> None:
        self.mod.set_step(step)
        self.core.on_step(step)

    def _drain_loop(self) -> None:
        """Hands records over every FLUSH_SECONDS, at FLUSH_RECORDS and soon after a NaN, from
        this thread (the training thread only appends to the C++ buffer)."""
        from trainguard.capture._recorder_mode import FLUSH_SECONDS

        while not self._stop.is_set():
            self.core.wait(FLUSH_SECONDS)
            if self._stop.is_set():
                break
            try:
                self.rec.flush()
            except Exception:  # observing training never kills training
                log.exception("trainguard: handing native records to the writer failed")

    # ------------------------------------------------------------------ drain
    def drain(self):
        """(records, deferred {device: [summaries]}, pins, resend, harm counts, meta) since the
        last drain, the records judged (taint, origin); payloads and failures are handed on here.
        Called with the recorder's lock held."""
        rec = self.rec
        tracker = rec.taint
        # The states of dead tensors go once per step (as the dispatch mode drops them), by the
        # producers alive when the batch was taken: a later record names only those as inputs.
        # With no states yet, only a batch holding a non-finite value can bring some (a first
        # drain that comes late, many steps of them).
        due = rec.judge_here and (self._pruned_step != _clock.step or len(tracker.states) > self._prune_at)
        records, deferred, payloads, bad, failures, unsure, live, judge, cut = self.core.drain(
            due and bool(tracker.states), due)
        if payloads and rec.writer is not None:
            for seq, slot, tensor in payloads:
                rec.writer.put_payload_tensor(seq, slot, tensor)
        for name, message in failures:
            if name not in rec.failed_ops:
                rec.failed_ops.add(name)
                log.warning("trainguard: could not record an output of %s (%s); training goes on", name, message)
        if unsure and not self.unsure_warned:
            self.unsure_warned = True
            log.warning("trainguard: the native recorder records the ops that tensor subclasses (DTensor) and other "
                        "dispatch modes run on the tensors they hold, not their own calls (%s first); record with "
                        "backend='python' to see those calls whole", unsure[0])
        if not rec.judge_here:  # the writer's thread judges (device summaries came before)
            return records, deferred, None, None, None, None
        # Judged here up to the first record whose health is not on the host yet (cut); from it
        # on, by the writer's thread, which waits for those summaries (Recorder._judge_in_writer).
        # The judge sees only the records the core did not judge finite itself (see core.h,
        # Core::last_seq), in seq order.
        if cut < len(records):
            judge = [i for i in judge if i < cut]
        tracker.find_record = _finder(self._prev_records, records)
        self._prev_records = records
        try:
            if len(judge) == len(records):
                records, pins, resend, counts, meta = tracker.judge(records, rec.fields)
            else:
                judged, pins, resend, counts, meta = tracker.judge([records[i] for i in judge], rec.fields)
                for i, r in zip(judge, judged):
                    records[i] = r
        finally:
            tracker.find_record = None
        if live is not None:
            tracker.prune(set(live))
            self._pruned_step = _clock.step
            self._prune_at = max(4096, 2 * len(tracker.states))
        if cut < len(records):
            rec._judge_in_writer()
        return records, deferred, pins, resend, counts, meta

    def on_sink(self, t, reason: str) -> None:
        """``t`` reached a sink from outside an op: the program reads it (``read``,
        capture/_reads.py) or ``backward()`` runs from it (``loss``): a pending inf it holds
        becomes harmful."""
        p = self.core.producer_of(t)
        if p is None or p[1] == 0:
            return  # not made by a recorded op, or finite: never pending (see _taint.RULES)
        rec = self.rec
        with rec._lock:
            rec.flush()  # everything recorded before the read is judged first
            if not rec.judge_here or not rec.taint.states:
                return
            state = rec.taint.reached(p[0], _clock.step, reason)
        rec._reached(state, p[0])

    @contextlib.contextmanager
    def python_records(self):
        """Around a compiled graph's call, whose records are made in Python (capture/_compile_run):
        the core records none of the ops it dispatches, and its records are numbered and judged
        after everything recorded before it (drained first, with the lock held).

        The graph's own records stay in ``rec.pending`` after the call: the next hand-over (this
        one at the next graph call, the drain thread's, a read's) puts them before the core's
        records, which are all later (their seqs were reserved from the core before the graph
        ran, and the core was paused while it did). Only device summaries of a graph recorded
        whole (``rec.deferred``, indexed per batch) and an urgent taint are handed over at once."""
        rec = self.rec
        with rec._lock, paused():
            # Unless judging what waits in the core could change something (see Core::serious),
            # it stays there, for the drain thread, and the next hand-over merges the graph's
            # records in by seq (FlushHooks._flush_native).
            if not rec.judge_here or rec.taint.states or rec.taint.urgent or self.core.needs_judge():
                rec.flush()
            # Where a backward pass starts: the judge follows it by phase over the core's records
            # (Tracker.judge), the compiled graphs by in_backward (capture/_compile_run).
            rec.in_backward = rec.taint._last_phase == "backward"
            try:
                yield
            finally:
                rec.taint._last_phase = "backward" if rec.in_backward else "forward"
                if rec.deferred or rec.taint.urgent:
                    rec.flush()

    def producer_seq(self, t) -> int | None:
        p = self.core.producer_of(t)
        return None if p is None else p[0]

    def release(self, t, restore_name):
        """torch is about to swap ``t`` (capture/_swap): the core lets go of it (swap_tensors
        refuses a tensor with C++ weak references too); a named parameter is named again after."""
        named = self.core.release(t)
        if named is None:
            return restore_name

        def restore() -> None:
            if restore_name is not None:
                restore_name()
            self.core.name_tensor(t, *named)

        return restore

    def loss_end(self, t) -> int:
        """The seq of the op that made ``t`` (the loss backward() runs from), or of the last op
        recorded when no recorded op did (see Recorder._pin_loss)."""
        p = self.core.producer_of(t)
        return p[0] if p is not None else self.core.counts()["seq"] - 1

    def counts(self) -> dict:
        return self.core.counts()


def paused():
    """A context manager that keeps the native core from recording this thread's ops."""
    from trainguard.capture import _native

    mod = _native._module
    return _Paused(mod) if mod is not None else _NULL


class _Paused:
    __slots__ = ("mod", "old")

    def __init__(self, mod) -> None:
        self.mod = mod

    def __enter__(self):
        self.old = self.mod.set_paused(True)

    def __exit__(self, *exc) -> None:
        self.mod.set_paused(self.old)


class _Null:
    def __enter__(self):
        return None

    def __exit__(self, *exc) -> None:
        return None


_NULL = _Null()


def _finder(*batches: list):
    """seq -> record of the drained batches (each in seq order), for the judge's rare look-ups (an
    in-place write with a non-finite value into a view: is it a parameter's?)."""

    def find(seq: int):
        for records in batches:
            i = bisect.bisect_left(records, seq, key=lambda r: r[0])
            if i < len(records) and records[i][0] == seq:
                return records[i]
        return None

    return find
