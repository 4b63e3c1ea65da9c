"""The recorder: a private ``TorchDispatchMode`` plus module hooks, installed by ``record``.

Every aten op that runs eagerly reaches ``__torch_dispatch__`` — forward ops from user code,
backward ops from the autograd engine, optimizer ops — and is recorded with its sequence
number, step, phase, module, interned stack, input producers and output summaries. Records
are batched and handed to the run writer's thread; nothing here waits on disk or on a device.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import threading
import time
import weakref
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from trainguard._errors import NonFiniteError
from trainguard.capture import _compile, _loss_watch, _monitor_tap, _numerics, _reads, _steps, _swap
from trainguard.capture._ending import ending, uncaught, watch_uncaught
from trainguard.capture._local import local as _local
from trainguard.capture._local import written as _written
from trainguard.capture._modules import ModuleTracker
from trainguard.capture._recorder_harm import HarmHooks
from trainguard.capture._stacks import StackInterner
from trainguard.capture._summary import (
    ALIAS_OPS,
    ALLOCATION_OPS,
    summarize_deferred,
    summarize_immediate,
    unknown_summary,
)
from trainguard.capture._taint import (
    ALLOC,
    COPY,
    HARMFUL,
    OVERWRITE_OPS,
    PENDING,
    UNKNOWN,
    VIEW,
    Tracker,
    classify,
)
from trainguard.store import (
    MODE_FIELDS,
    MODES,
    ExecBatch,
    acquire_writer,
    is_collective,
    release_writer,
)
from trainguard.store import rank_dir as _rank_dir
from trainguard.store._codec import health_of

log = logging.getLogger("trainguard.capture")

_get_seq_nr = torch._C._autograd._get_sequence_nr
_OpOverload = torch._ops.OpOverload
_current_node = torch._C._current_autograd_node
_Tensor = torch.Tensor
_FakeTensor = torch._subclasses.fake_tensor.FakeTensor
_strided = torch.strided
_weakref = weakref.ref
_grad_enabled = torch.is_grad_enabled
_monotonic = time.monotonic
_clock = _steps.clock

# Records are handed to the writer in batches: every FLUSH_SECONDS, at FLUSH_RECORDS, soon
# after a non-finite value, and at stop. Each hand-over wakes the writer thread, which then
# competes for the GIL, so a fast loop must not hand over every step.
FLUSH_RECORDS = 4096
FLUSH_SECONDS = 0.25

# Forward ops remembered for the backward ops of their autograd nodes: pruned to the last two
# steps at each step, and when this many accumulate (a loop that never calls optimizer.step()
# or trainguard.step()), so memory stays bounded (see Recorder._prune_fwd_nodes).
FWD_NODES_MAX = 200_000

BACKENDS = ("auto", "native", "python")

# The executions before each of the first backward passes' loss that the circular buffer keeps:
# the loss function's op and the ops that made its input (analysis/_graph_rules.py reads them).
LOSS_PIN_WINDOW = 48


_DTYPE_NAMES: dict[torch.dtype, str] = {}


def _dtype_name(dt: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dt)
    if name is None:
        name = _DTYPE_NAMES[dt] = str(dt).replace("torch.", "")
    return name


_DEVICE_NAMES: dict[torch.device, str] = {}


def _device_name(dev: torch.device) -> str:
    name = _DEVICE_NAMES.get(dev)
    if name is None:
        name = _DEVICE_NAMES[dev] = str(dev)
    return name


_ALL_DTYPES = {
    _dtype_name(v): v for v in vars(torch).values() if isinstance(v, torch.dtype)
}


def _validate(mode: str, buffer: int, ops: Any, dtypes: Any) -> tuple[re.Pattern | None, frozenset | None]:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {list(MODES)}, got {mode!r}")
    if isinstance(buffer, bool) or not isinstance(buffer, int) or (buffer < 1 and buffer != -1):
        raise ValueError(f"buffer must be -1 (keep all) or a positive int, got {buffer!r}")
    pattern = None
    if ops is not None:
        if isinstance(ops, re.Pattern):
            pattern = ops
        else:
            text = ops if isinstance(ops, str) else "|".join(f"(?:{o})" for o in ops)
            try:
                pattern = re.compile(text)
            except re.error as exc:
                raise ValueError(f"ops must be a valid regular expression, got {text!r}: {exc}") from None
    wanted = None
    if dtypes is not None:
        if isinstance(dtypes, (str, torch.dtype)):
            dtypes = [dtypes]
        out = set()
        for d in dtypes:
            if isinstance(d, torch.dtype):
                out.add(d)
            elif isinstance(d, str) and d.replace("torch.", "") in _ALL_DTYPES:
                out.add(_ALL_DTYPES[d.replace("torch.", "")])
            else:
                raise ValueError(
                    f"dtypes must name torch dtypes, got {d!r}; allowed: {sorted(_ALL_DTYPES)}"
                )
        wanted = frozenset(out)
    return pattern, wanted


# A producer entry, per live output tensor, keyed by id(tensor) (its taint is kept by seq, in
# the recorder's Tracker):
#   (weakref to the tensor, seq, op name, stack id, immediate summary or None, version counter)
# The weak reference has no callback (a callback per tensor costs more than the op's own
# bookkeeping); an entry whose tensor died is ignored on lookup, overwritten when the id is
# reused, and swept out every step and when the table doubles (see Recorder._sweep).
_OP, _STACK = 2, 3  # positions in an entry, for the cold paths (capture/_numerics.py)


class Recorder(HarmHooks):
    """State of one recording. Use :func:`trainguard.record` rather than this class."""

    def __init__(
        self,
        logdir: str | os.PathLike | None,
        *,
        mode: str = "full_health",
        buffer: int = 1000,
        ops: Any = None,
        dtypes: Any = None,
        check_numerics: bool = False,
        strict: bool = False,
        strategy: str = "auto",
        overwrite: bool = False,
        backend: str = "auto",
        rank_dir: bool = True,
    ):
        self.ops_pattern, self.dtypes = _validate(mode, buffer, ops, dtypes)
        if strategy not in ("auto", "immediate", "deferred"):
            raise ValueError(f"strategy must be 'auto', 'immediate' or 'deferred', got {strategy!r}")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {list(BACKENDS)}, got {backend!r}")
        if backend == "native" and (check_numerics or logdir is None):
            raise ValueError("backend='native' cannot raise at the failing op: check_numerics runs on the Python backend")
        self.requested_backend = backend
        self.backend: str | None = None  # which one ran: "native" or "python" (set by start)
        self._native = None
        self.mode = mode
        self.fields = MODE_FIELDS[mode]
        self.buffer = buffer
        self.check = check_numerics
        self.strict = strict
        self.strategy = strategy
        # ``rank_dir=False``: the caller (a framework integration) already chose the rank's directory.
        self.logdir = None if logdir is None else (_rank_dir(logdir) if rank_dir else Path(logdir))
        self.overwrite = overwrite
        self.writer = None
        self.seq = 0
        self.recorded = 0
        self.failures = 0  # outputs that could not be recorded (see _record_failed)
        self.failed_ops: set[str] = set()
        self.last_nr = 0
        # id(op overload) -> (name, wanted, allocation op, alias op, callable, the overload).
        # Keyed by id: an OpOverload hashes in Python, which costs more than the lookup; the
        # overload itself is held in the entry, so its id cannot be reused.
        self.op_info: dict[int, tuple] = {}
        self.producers: dict[int, tuple] = {}  # id(tensor) -> producer entry (see _REF ...)
        self.sweep_at = 4096
        self.fwd_nodes: dict[int, tuple[int, int | None, int | None, int]] = {}
        self.pending: list[tuple] = []
        # Harmful, intended, unknown (docs/recorder.md): judged here while the health of each
        # output is known on this thread; by the writer's thread once accelerator summaries
        # arrive later than their op (judge_here False).
        self.taint = Tracker()
        self.judge_here = True
        self.in_backward = False
        self._thread = threading.get_ident()
        self.deferred: dict[torch.device, list[torch.Tensor]] = {}
        self.deferred_used = False
        # Compiled graphs (see _compile_run): their summary matrices waiting for the next flush,
        # a count of compiled code running now (its few dispatched ops pass unrecorded), and the
        # calls of graphs compiled before the recording, which are recorded whole.
        self.graph_summaries: list[tuple] = []
        self.in_graph = 0
        self.opaque_graphs: dict[str, int] = {}
        self.compiled_graphs: dict[str, list[int]] = {}  # label -> [ops, calls]
        self.last_flush = time.monotonic()
        self.stacks = StackInterner(self._on_new_stack)
        self.modules = ModuleTracker(self._on_new_module)
        self._mode: _DispatchMode | None = None
        self._lock = threading.RLock()
        self.active = False
        self.loss_watch: _loss_watch.LossWatch | None = None
        self.loss_pins: list[int] = []
        self.losses_pinned = 0

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> Recorder:
        if self.active:
            raise RuntimeError("this recorder is already active")
        from trainguard.capture._native._backend import choose_backend

        native = choose_backend(self)
        self.backend = "native" if native is not None else "python"
        if self.logdir is not None:
            self.writer = acquire_writer(
                self.logdir,
                mode=self.mode,
                buffer=self.buffer,
                overwrite=self.overwrite,
                process=True,
                meta={
                    "ops_filter": self.ops_pattern.pattern if self.ops_pattern else None,
                    "dtypes_filter": sorted(_dtype_name(d) for d in self.dtypes) if self.dtypes else None,
                    "check_numerics": ("strict" if self.strict else True) if self.check else False,
                    "recording": True,
                    "backend": self.backend,
                    # Every harmful execution is counted in the harmful table (format 3).
                    "harm_counts": True,
                },
            )
        self.taint.keep_records = self.writer is not None or self.check
        if _steps.clock.users == 0:
            _steps.reset()
        _steps.acquire()
        _steps.clock.on_step.append(self._on_step)
        if self.writer is not None:
            self.writer.idle_callbacks.append(self._flush_if_stale)
            self.loss_watch = _loss_watch.acquire(self.writer)
            _monitor_tap.add_listener("loss_graph", self._pin_loss)
        self.modules.install()
        _swap.hold(self._release)
        _reads.install(self)
        _monitor_tap.add_listener("root", self.on_backward)
        self._thread = threading.get_ident()
        self.last_nr = _get_seq_nr()
        if native is not None:
            from trainguard.capture._native._backend import NativeBackend

            self._native = NativeBackend(self, native)
            self._native.start()
            self.stacks.id_base = NativeBackend.PYTHON_STACK_IDS
        else:
            self._mode = _DispatchMode(self)
            self._mode.__enter__()
        _compile.install(self)
        self.active = True
        return self

    def stop(self, **final_meta: Any) -> None:
        if not self.active:
            return
        self.active = False
        try:
            _compile.uninstall(self)
            if self._native is not None:
                self._native.stop()
            else:
                self._mode.__exit__(None, None, None)
        finally:
            self.modules.remove()
            _swap.unhold(self._release)
            _reads.remove(self)
            _monitor_tap.remove_listener("root", self.on_backward)
            self.stacks.release_frames()
            if self._on_step in _steps.clock.on_step:
                _steps.clock.on_step.remove(self._on_step)
            _steps.release()
            _monitor_tap.remove_listener("loss_graph", self._pin_loss)
            if self.loss_watch is not None:
                _loss_watch.release(self.loss_watch)
                self.loss_watch = None
            self.flush()
            if self.writer is not None:
                if self._flush_if_stale in self.writer.idle_callbacks:
                    self.writer.idle_callbacks.remove(self._flush_if_stale)
                if self._native is not None:
                    counts = self._native.counts()
                    # Compiled graphs' records are numbered by the core and counted here.
                    self.seq, self.recorded = counts["seq"], counts["recorded"] + self.recorded
                    self.failures += counts["failures"]
                    if counts["unsure"]:
                        final_meta["native_unsure"] = counts["unsure"]
                if self.failures:
                    final_meta["record_errors"] = self.failures
                final_meta.update(_compile.run_meta(self))
                release_writer(
                    self.writer,
                    executions=self.seq,
                    recorded=self.recorded,
                    recording=False,
                    **final_meta,
                )
                self.writer = None

    def __enter__(self) -> Recorder:
        return self.start()

    def __exit__(self, exc_type, exc, tb) -> None:
        self.stop(**ending(exc))  # a block that raised is stored as crashed, as ``trainguard run`` stores it

    def _release(self, t: _Tensor):
        """torch is about to swap ``t`` (capture/_swap): let go of it. Its producer no longer
        describes what it will hold; a named parameter keeps its name."""
        if self._native is not None:
            return self._native.release(t, self.modules.release(t))
        p = self.producers.get(id(t))
        if p is not None and p[0]() is t:
            del self.producers[id(t)]
        return self.modules.release(t)

    # ------------------------------------------------------------------ writer plumbing
    def _on_new_stack(self, sid: int, frames: list) -> None:
        if self.writer is not None:
            self.writer.put_stack(sid, frames)

    def _on_new_module(self, mid: int, path: str, type_name: str) -> None:
        if self.writer is not None:
            self.writer.put_module(mid, path, type_name)

    def _on_step(self, step: int) -> None:
        if self._native is not None:
            self._native.on_step(step)  # its drain thread hands records over
            return
        if self.taint.urgent or time.monotonic() - self.last_flush > FLUSH_SECONDS:
            self.flush()
        # Drop the entries of the step's dead tensors now, while they are young: left to the
        # size-based sweep they would live long enough to be promoted to the collector's oldest
        # generation, whose full collections then traverse every object of the process.
        self._sweep()
        if len(self.fwd_nodes) > 4096:
            self._prune_fwd_nodes()

    def flush(self) -> None:
        """Hand pending records to the writer (by time, by count, after a NaN, and at stop),
        with what the taint tracker wants kept: pins, records sent again, counts, metadata."""
        if self._native is not None:
            self._flush_native()
            return
        with self._lock:
            pending = self.pending
            n = len(pending)
            pins, resend, counts, urgent = self.taint.take() if self.judge_here else ([], [], [], False)
            if self.loss_pins:
                pins = pins + self._take_loss_pins()
            meta = self.taint.meta() if self.judge_here else {}
            if not (n or pins or resend or counts or meta):
                return
            # Copy, then delete what was copied: the hot path appends to this same list without
            # the lock, and an append between the two (atomic) steps stays for the next flush.
            records = pending[:n]
            del pending[:n]
            deferred = self._ship_deferred()
            self.last_flush = time.monotonic()
        w = self.writer
        if w is not None:
            if counts:
                w.add_harm_counts(counts)
            w.put_executions(ExecBatch(records, deferred, pins=pins, resend=resend),
                             must_keep=urgent or bool(pins or resend))
            if meta:
                w.set_meta(**meta)

    def _flush_native(self) -> None:
        from trainguard.capture._native._backend import paused

        # The whole hand-over under the lock: the drain thread and a read on the training thread
        # (on_read) both flush, and their batches must reach the writer in the order judged.
        with self._lock, paused():  # stacking the device summaries is trainguard's own work
            records, deferred, pins, resend, counts, meta = self._native.drain()
            if self.pending:
                # Compiled graphs' records (capture/_compile_run), judged when made: the core was
                # drained before their graph ran and paused while it did, so they precede these.
                k = len(self.pending)
                records = self.pending[:k] + records
                del self.pending[:k]
            if self.loss_pins:
                pins = (pins or []) + self._take_loss_pins()
            if not (records or pins or resend or counts or meta):
                return
            if deferred:
                # The core's device summaries; a compiled graph's own (recorded whole, its rows
                # in self.deferred) were shipped by the flush that ended its call.
                self.deferred = deferred
            deferred = self._ship_deferred()
            self.last_flush = time.monotonic()
            w = self.writer
            if w is None:
                return
            if counts:
                w.add_harm_counts(counts)
            # The drain thread (and stop) may wait for room: the native core drops nothing, its
            # recording thread waits instead when far behind (see core.h, back-pressure).
            w.put_executions(ExecBatch(records, deferred, pins=pins, resend=resend), must_keep=True)
            if meta:
                w.set_meta(**meta)

    def _pin_loss(self, loss: torch.Tensor) -> None:
        """Before one of the first backward passes: keep the ops that made the loss (see LOSS_PIN_WINDOW)."""
        if self.losses_pinned >= _loss_watch.INSPECTIONS or threading.get_ident() != self._thread:
            return
        self.losses_pinned += 1
        end = self._loss_end(loss)
        self.loss_pins.extend(range(max(0, end - LOSS_PIN_WINDOW), end + 1))

    def _reserve(self, n: int) -> int:
        """The first of ``n`` seqs for records made in Python outside the hot path (compiled graphs)."""
        if self._native is not None:
            return self._native.core.reserve(n)
        seq = self.seq
        self.seq = seq + n
        return seq

    def _loss_end(self, loss: torch.Tensor) -> int:
        """The seq of the op that made ``loss``, or of the last op recorded when none did."""
        if self._native is not None:
            return self._native.loss_end(loss)
        p = self.producers.get(id(loss))
        return p[1] if p is not None and p[0]() is loss else self.seq - 1

    def _take_loss_pins(self) -> list[int]:
        # Copy, then delete what was copied: the training thread extends the list without the lock.
        k = len(self.loss_pins)
        pins = self.loss_pins[:k]
        del self.loss_pins[:k]
        return pins

    def _flush_if_stale(self) -> None:
        """Called by the writer thread when idle: a loop that stopped making ops still reaches disk.

        Not with accelerator summaries, whose batch the hot path indexes without the lock.
        """
        if self._native is not None:
            return  # the native core's drain thread hands records over
        if (self.pending and not self.deferred_used and time.monotonic() - self.last_flush > 2 * FLUSH_SECONDS
                and self.writer.queue_room() > 64):
            self.flush()

    def _ship_deferred(self) -> list | None:
        """Stack the accelerator summaries and start their copy to the host; no waiting here."""
        out = self.graph_summaries  # compiled graphs' matrices: copies started at each call
        self.graph_summaries = []
        if not self.deferred:
            return out or None
        # Not recorded: a step's flush runs while the dispatch mode is active, and its own stack
        # would add a row to the very batch being shipped (the next batch's rows would then no
        # longer match its records). The native core is paused by its caller.
        with _disable_current_modes():
            return self._ship_deferred_now(out)

    def _ship_deferred_now(self, out: list) -> list:
        for dev, tensors in self.deferred.items():
            stacked = torch.stack(tensors)
            event = None
            if dev.type == "cuda":
                host = torch.empty(stacked.shape, dtype=stacked.dtype, pin_memory=True)
                host.copy_(stacked, non_blocking=True)
                event = torch.cuda.Event()
                event.record()
            else:
                host = stacked.to("cpu")
            out.append((dev, host, event))
        self.deferred = {}
        return out

    # ------------------------------------------------------------------ hot path helpers
    def _info(self, func) -> tuple:
        name = str(func)
        # Profiler markers (record_function) are not tensor ops: passed through and not numbered,
        # as RecordFunction does not observe them (the native core never sees them).
        marker = name.startswith("profiler.")
        wanted = self.ops_pattern is None or self.ops_pattern.search(name) is not None
        # A plain OpOverload's __call__ only forwards to its C++ op: call that directly.
        call = func._op if type(func) is _OpOverload else func
        cls, overwrite, inplace = self.taint.op_classes[name] = op_facts(func, name)
        collective = is_collective(name)
        # Values nobody may read yet: uninitialised memory, and what a collective writes (it
        # arrives later, from other ranks, while another thread fills it in).
        unknown = name in ALLOCATION_OPS or collective
        info = (name, wanted, unknown, name in ALIAS_OPS, call, func, cls, overwrite, inplace, collective, marker)
        self.op_info[id(func)] = info
        return info

    def _prune_fwd_nodes(self) -> None:
        """Keep the forward ops of the last two steps; if that is still over half the limit
        (a loop that never calls optimizer.step()), the newest half of them."""
        step = _clock.step
        items = [(k, v) for k, v in self.fwd_nodes.items() if v[3] >= step - 2]  # in the order they ran
        if len(items) > FWD_NODES_MAX // 2:
            items = items[len(items) // 2:]
        self.fwd_nodes = dict(items)

    def _sweep(self) -> None:
        """Drop the entries of tensors that died (per step, and when the table doubles), and
        the taint states of the tensors that died with them."""
        self.producers = {k: p for k, p in self.producers.items() if p[0]() is not None}
        self.sweep_at = max(4096, 2 * len(self.producers))
        if self.judge_here and self.taint.states:
            self.taint.prune({p[1] for p in self.producers.values()})


def op_facts(func, name: str) -> tuple[int, bool, bool]:
    """What the taint rule needs of an op overload: (class, overwrites its first input, writes
    in place), from its name and schema (see _taint.classify)."""
    try:
        schema = func._schema
        first = schema.arguments[0].alias_info if schema.arguments else None
        inplace = first is not None and first.is_write
        is_view = bool(func.is_view)
    except Exception:  # not an OpOverload with a schema (a HigherOrderOperator, ...)
        inplace = is_view = False
    return classify(name, is_view), name in OVERWRITE_OPS, inplace


def op_facts_by_name(name: str) -> tuple[int, bool, bool]:
    """:func:`op_facts` of the overload named ``aten.add_.Tensor`` (the native core's records
    name their ops; the dispatch mode holds the overload)."""
    ns, _, rest = name.partition(".")
    op, _, overload = rest.rpartition(".")
    try:
        func = getattr(getattr(getattr(torch.ops, ns), op), overload)
    except Exception:  # not a registered overload: classified by name alone
        func = None
    return op_facts(func, name)


class _DispatchMode(TorchDispatchMode):
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Otherwise the base class wraps __torch_dispatch__ in a dynamo-disable shim that costs
        # microseconds per op; keep_dynamo_out (below the class) marks its code instead.
        return False

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # torch.compile compiles while this mode is active (with the mode off) instead of falling
        # back to eager; compiled graphs record their own ops (see _compile).
        return True

    def __init__(self, rec: Recorder):
        super().__init__()
        self.rec: Recorder | None = rec
        _live_modes.add(self)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # The hot path: locals instead of attribute lookups, no helper calls for common cases.
        r = self.rec
        if r is None or r.in_graph:  # a forked child (a DataLoader worker), or compiled code running
            return func(*args, **(kwargs or {}))
        info = r.op_info.get(id(func))
        if info is None:
            info = r._info(func)
        if info[10]:
            return info[4](*args, **kwargs) if kwargs else info[4](*args)
        node = _current_node()
        nr = _get_seq_nr()
        out = info[4](*args, **kwargs) if kwargs else info[4](*args)
        try:
            outs = out if type(out) in (tuple, list) else (out,)
            if outs and type(outs[0]) is _FakeTensor:  # a compiler tracing (a lazy backward compile)
                return out
            seq = r.seq
            r.seq = seq + 1
            if info[9]:
                outs = _written(info[0], args, out)
            producers = r.producers
            name = info[0]
            if not info[1]:  # filtered out: consumers still learn who made their inputs
                for o in outs:
                    if isinstance(o, _Tensor):
                        _register(r, producers, o, seq, name, None, None)
                r.last_nr = _get_seq_nr()
                return out

            # Where and when: phase, module, stack (backward ops inherit them from their forward op).
            fwd_seq = fwd_op = None
            if node is not None:
                phase = "backward"
                fwd = r.fwd_nodes.get(node._sequence_nr())
                if fwd is not None:
                    fwd_seq, module_id, stack_id, _, fwd_op = fwd
                else:
                    module_id = None
                    stack_id = r.stacks.capture(2)
                if not r.in_backward:  # the first op of a backward pass: it runs from the loss
                    r.in_backward = True
                    r.backward_starts(fwd_seq)
            else:
                r.in_backward = False
                module_id = r.modules.current()
                stack_id = r.stacks.capture(2)
                if _clock.in_optimizer:
                    phase = "optimizer"
                elif module_id is not None or _grad_enabled():
                    phase = "forward"
                else:
                    phase = "other"
                if nr != r.last_nr:
                    # The autograd node of this op was numbered nr - 1 just before dispatch.
                    fwd_nodes = r.fwd_nodes
                    fwd_nodes[nr - 1] = (seq, module_id, stack_id, _clock.step, name)
                    if len(fwd_nodes) > FWD_NODES_MAX:
                        r._prune_fwd_nodes()
            if r.dtypes is not None and not any(isinstance(o, _Tensor) and o.dtype in r.dtypes for o in outs):
                for o in outs:
                    if isinstance(o, _Tensor):
                        _register(r, producers, o, seq, name, stack_id, None)
                r.last_nr = _get_seq_nr()
                return out

            # Inputs: a parameter or buffer by name, else the recorded op that produced it; and
            # the highest taint among them (see _taint: FINITE < UNKNOWN < PENDING < HARMFUL).
            named = r.modules.named_tensors
            states = r.taint.states if r.judge_here else None
            in_taint = 0
            in_origin = None
            inputs = []
            first = None
            for a in (args if not kwargs else (*args, *kwargs.values())):
                if isinstance(a, _Tensor):
                    group = (a,)
                elif type(a) in (list, tuple) and a and isinstance(a[0], _Tensor):
                    group = a
                else:
                    continue
                for t in group:
                    key = id(t)
                    e = named.get(key)
                    if e is not None and e[0]() is t:
                        inputs.append((e[2], e[1]))
                    else:
                        p = producers.get(key)
                        if p is not None and p[0]() is t:
                            inputs.append(("op", p[1]))
                            # (an overwrite, copy_ or fill_, does not count its first input's old values)
                            if states and not (info[7] and first is None):
                                st = states.get(p[1])
                                if st is not None and (st[0] > in_taint or (
                                        st[0] == in_taint and st[1] is not None and st[1] < in_origin)):
                                    in_taint, in_origin = st
                        else:
                            inputs.append(("input", None))
                    if first is None:
                        first = t

            cls = info[6]
            fields = r.fields
            summaries = [] if fields else None
            metas = []
            health = 0
            immediate_only = True
            alias = None
            garbage = in_taint == UNKNOWN and (cls == VIEW or cls == COPY)  # a view or copy of uninitialised memory
            if info[3] and first is not None and summaries is not None:
                # A pure alias (view, t, detach, ...) holds the same values as its input: reuse that
                # input's summary while the shared version counter says nothing wrote to it since.
                p = producers.get(id(first))
                if (p is not None and p[4] is not None and p[0]() is first and p[5] is not None
                        and p[5] == first._version):
                    alias = p[4]
            for o in outs:
                if not isinstance(o, _Tensor):
                    continue
                v = o if type(o) is _Tensor else _local(o)  # a DTensor: the shard this rank holds
                cpu = v.is_cpu
                dt = v.dtype
                metas.append((_DTYPE_NAMES.get(dt) or _dtype_name(dt), tuple(v.shape),
                              "cpu" if cpu else _device_name(v.device)))
                s = None
                if summaries is not None:
                    if info[2] or garbage:  # uninitialised memory, or a collective's: no evidence
                        s = unknown_summary(r.mode, v.numel())
                    elif alias is not None:
                        s = alias
                    elif ((cpu and r.strategy != "deferred") or r.strategy == "immediate"
                          or v.is_meta or v.layout is not _strided):  # no data, or sparse: rare, may sync
                        s = summarize_immediate(v, r.mode, in_taint == HARMFUL)
                    else:
                        immediate_only = False
                        r.deferred_used = True
                        dev = v.device
                        lst = r.deferred.setdefault(dev, [])
                        summaries.append(("d", dev, len(lst)))
                        lst.append(summarize_deferred(v, r.mode))
                        if r.check and not bool(torch.isfinite(v).all()):
                            # check_numerics may synchronise: it must stop at this op.
                            health |= _numerics.health_sync(v)
                    if s is not None:
                        health |= health_of(fields, s)
                        summaries.append(s)
                # A collective's output must never lend its summary to a later view: its values
                # arrive after this, without moving the version counter.
                _register(r, producers, o, seq, name, stack_id, None if info[9] else s)
            if r.mode == "full_tensor" and not info[9]:  # a collective's values are not there yet
                _save_payloads(r, seq, outs)

            # The taint of the outputs, where their health is known now (see _taint.Tracker).
            taint = 0
            origin = None
            if not r.judge_here or not (immediate_only or r.check):
                if r.judge_here:
                    r._judge_in_writer()
                taint = None
            elif health or in_taint or cls == ALLOC:
                taint, origin = r.taint.settle(
                    seq, _clock.step, phase, name, cls, info[8] and bool(inputs) and inputs[0][0] == "param",
                    in_taint, in_origin, health, inputs, fwd_seq, fields, summaries, (module_id, stack_id, fwd_op))
                if r.check and origin == seq:
                    r._note_origin(seq, args, outs)
            stop = r.check and (taint == HARMFUL or (r.strict and health and taint != UNKNOWN))
            if r.writer is None and not taint:  # check_numerics without a run directory, finite
                r.last_nr = _get_seq_nr()
                return out
            # A record is a tuple of atoms and tuples: the garbage collector untracks such tuples, so
            # the thousands of records the writer holds never make its full collections slower.
            rec = (seq, _clock.step, phase, name, module_id, stack_id, fwd_seq,
                   health if immediate_only or r.check else None, tuple(inputs), tuple(metas),
                   None if summaries is None else tuple(summaries), taint, origin)
            if taint == PENDING:
                r.taint.keep(rec)
            if stop:
                r._stop_at(rec, args, outs, health, fwd_op)
            if r.writer is None:
                r.last_nr = _get_seq_nr()
                return out
            pending = r.pending
            pending.append(rec)
            r.recorded += 1
            n = len(pending)
            if n >= FLUSH_RECORDS or (n & 31 == 0 and (r.taint.urgent or _monotonic() - r.last_flush > FLUSH_SECONDS)):
                r.flush()
            r.last_nr = _get_seq_nr()
            return out
        except NonFiniteError:
            raise
        except Exception as exc:  # observing training never kills training
            _record_failed(r, str(func), exc)
            return out


def _record_failed(r: Recorder, name: str, exc: Exception) -> None:
    """An op's output could not be recorded: say so once per op type, keep training."""
    r.failures += 1
    if name not in r.failed_ops:
        r.failed_ops.add(name)
        log.warning("trainguard: could not record an output of %s (%s: %s); training goes on",
                    name, type(exc).__name__, exc)
    r.last_nr = _get_seq_nr()


# A process forked while recording (DataLoader workers, by default on Linux) inherits the
# active mode in its thread state, but not the writer's thread: its ops pass through unrecorded.
_live_modes: weakref.WeakSet = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for mode in list(_live_modes):
        mode.rec = None
    _compile.reset_after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


_compile.keep_dynamo_out(_DispatchMode.__torch_dispatch__)


def _register(r: Recorder, producers: dict, o: _Tensor, seq: int, name: str, stack_id, summary) -> None:
    key = id(o)
    try:
        version = o._version
    except RuntimeError:  # an inference tensor (torch.inference_mode) has no version counter
        version = None
    p = producers.get(key)
    if p is not None and p[0]() is o:  # an in-place op: o now holds this op's output
        producers[key] = (p[0], seq, name, stack_id, summary, version)
        return
    producers[key] = (_weakref(o), seq, name, stack_id, summary, version)
    if len(producers) > r.sweep_at:
        r._sweep()


def _save_payloads(r: Recorder, seq: int, outs) -> None:
    if r.writer is None:
        return
    for slot, o in enumerate(x for x in outs if isinstance(x, _Tensor)):
        # full_tensor mode copies values to the host by definition; the file is written by the
        # writer. One copy, already contiguous: the writer appends its memory as it is (a
        # transposed output copied with its strides would be copied again there).
        o = o.detach()
        fmt = torch.contiguous_format if o.layout is _strided else torch.preserve_format
        r.writer.put_payload_tensor(seq, slot, o.to("cpu", copy=True, memory_format=fmt))


# ---------------------------------------------------------------------- public entry points
_global: Recorder | None = None
_global_lock = threading.Lock()


def record(
    logdir: str | os.PathLike,
    mode: str = "full_health",
    buffer: int = 1000,
    ops: str | Iterable[str] | re.Pattern | None = None,
    dtypes: Iterable[torch.dtype | str] | None = None,
    *,
    overwrite: bool = False,
    strategy: str = "auto",
    backend: str = "auto",
) -> Recorder:
    """Record every aten op the program runs into the run directory ``logdir``.

    Use as a context manager::

        with trainguard.record("runs/exp1", mode="full_health"):
            train()

    ``mode`` picks the per-tensor summary (``no_tensor``, ``curt_health``, ``concise_health``,
    ``full_health``, ``shape``, ``full_tensor``, ``stats``). ``buffer=N`` keeps the last N
    executions (``-1`` keeps all); the first harmful value's chain back to its origin, and the
    first harmful execution of each op type and step, are always kept. ``ops`` is a regular
    expression on the op name (``aten.log.default``) and ``dtypes`` a list of output dtypes: only
    matching executions are recorded. ``backend`` picks the recorder: ``native`` (the C++ core on
    ``at::RecordFunction``), ``python`` (a ``TorchDispatchMode``), or ``auto`` (native when it can
    be built here); the run's metadata says which ran.
    """
    return Recorder(logdir, mode=mode, buffer=buffer, ops=ops, dtypes=dtypes, overwrite=overwrite, strategy=strategy,
                    backend=backend)


def check_numerics(logdir: str | os.PathLike | None = None, *, mode: str = "curt_health", buffer: int = 1000,
                   strict: bool = False) -> Recorder:
    """Raise :class:`trainguard.NonFiniteError` at the first op (forward or backward) that makes
    a harmful value: a NaN, or a +-inf that reaches the loss, a gradient, a parameter, optimizer
    state or a value the program reads. The message names where that value was made (the op
    that first made the inf, with its module, the user's ``file:line`` and its inputs) and
    where it became harmful. Intended infinities (masks absorbed by softmax, sentinels) pass.
    ``strict=True`` raises at any non-finite output instead. With ``logdir`` the ops are also
    recorded there, with the op that raised and its chain.
    """
    return Recorder(logdir, mode=mode, buffer=buffer, check_numerics=True, strict=strict)


def enable(logdir: str | os.PathLike, mode: str = "full_health", buffer: int = 1000, ops=None, dtypes=None,
           **kwargs: Any) -> Recorder:
    """Start recording for the rest of the program (``disable()`` or exit stops it).

    The equivalent of ``tf.debugging.experimental.enable_dump_debug_info``: call it early.
    """
    global _global
    with _global_lock:
        if _global is not None and _global.active:
            raise RuntimeError(f"trainguard is already recording to {_global.logdir}; call disable() first")
        _global = Recorder(logdir, mode=mode, buffer=buffer, ops=ops, dtypes=dtypes, **kwargs).start()
        watch_uncaught()  # stopped at exit with the script's error, if one ends it
        return _global


def disable() -> None:
    """Stop the recording started by :func:`enable`; a no-op when none is active."""
    global _global
    with _global_lock:
        if _global is not None:
            _global.stop()
            _global = None


@atexit.register
def _at_exit() -> None:
    global _global
    if _global is not None and _global.active:
        try:
            with _global_lock:
                rec, _global = _global, None
            rec.stop(**ending(uncaught()))  # a script that died with enable() on is stored as crashed
        except Exception:  # pragma: no cover - best effort at interpreter exit
            pass


