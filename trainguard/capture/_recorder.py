"""The recorder: a private ``TorchDispatchMode`` plus module hooks, installed by ``record``.

Every aten op that runs eagerly reaches ``__torch_dispatch__`` (``_recorder_mode``) or the
native core (``_native``) — forward ops from user code, backward ops from the autograd engine,
optimizer ops — and is recorded with its sequence number, step, phase, module, interned stack,
input producers and output summaries. Records are batched and handed to the run writer's thread
(``_recorder_flush``); nothing here waits on disk or on a device.
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

from trainguard.capture import (
    _compile,
    _loss_watch,
    _monitor_tap,
    _params,
    _reads,
    _recorder_mode,
    _skips,
    _steps,
    _swap,
)
from trainguard.capture._ending import ending, uncaught, watch_uncaught
from trainguard.capture._local import stats_written, written_args
from trainguard.capture._modules import ModuleTracker
from trainguard.capture._recorder_flush import LOSS_PIN_WINDOW, FlushHooks  # noqa: F401 - re-exported
from trainguard.capture._recorder_harm import HarmHooks

# Re-exported: the compiled graphs' records, the native backend and the cold paths use them.
from trainguard.capture._recorder_mode import (  # noqa: F401
    _OP,
    _STACK,
    FLUSH_RECORDS,
    FLUSH_SECONDS,
    FWD_NODES_MAX,
    _DispatchMode,
    _dtype_name,
    _monotonic,
    _record_failed,
    _register,
    op_facts,
    op_facts_by_name,
)
from trainguard.capture._scaler_verdict import ScalerVerdicts
from trainguard.capture._stacks import StackInterner
from trainguard.capture._summary import ALLOCATION_OPS, WORKSPACE_OUTPUTS
from trainguard.capture._taint import Tracker
from trainguard.store import (
    ALIAS_OPS,
    MODE_FIELDS,
    MODES,
    acquire_writer,
    is_collective,
    release_writer,
)
from trainguard.store import rank_dir as _rank_dir

log = logging.getLogger("trainguard.capture")

_get_seq_nr = torch._C._autograd._get_sequence_nr
_OpOverload = torch._ops.OpOverload
_Tensor = torch.Tensor
_clock = _steps.clock

BACKENDS = ("auto", "native", "python")


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


class Recorder(FlushHooks, HarmHooks):
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
        self.seq = 0  # the first execution's number (a run continued: after the earlier process's)
        self.start_step = 0  # where the step clock starts when no one else holds it (likewise)
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
        # The guard's replay (guard/_replay): for each op that made a new non-finite value, the
        # size of its output's first dimension and the rows of it that hold one (Python backend).
        self.nonfinite_rows: dict[int, tuple[int, list[int]]] | None = None
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
        self.scaler_verdicts: ScalerVerdicts | None = None
        self.clipping: dict | None = None  # how the loop clips its gradients, once it does
        # Iterations the loop skipped itself (capture/_skips): the run's ``skipped_iterations``.
        self.skipped: dict | None = None

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
            _steps.reset(self.start_step)
        _steps.acquire()
        _steps.clock.on_step.append(self._on_step)
        if self.writer is not None:
            self.writer.idle_callbacks.append(self._flush_if_stale)
            self.writer.sources.append(self.flush)
            self.scaler_verdicts = ScalerVerdicts(self.writer)
            self.loss_watch = _loss_watch.acquire(self.writer)
            _monitor_tap.add_listener("loss_graph", self._pin_loss)
            _monitor_tap.add_listener("clip", self._note_clipping)
        self.modules.on_outermost = self._outermost
        self.modules.install()
        _skips.acquire(self._on_skip)
        _swap.hold(self._release)
        _reads.install(self)
        _params.install(self)
        _monitor_tap.add_listener("root", self.on_backward)
        self._thread = threading.get_ident()
        self.last_nr = _get_seq_nr()
        if native is not None:
            from trainguard.capture._native._backend import NativeBackend

            self._native = NativeBackend(self, native)
            if self.seq:  # numbering goes on from an earlier run's (a resumed framework run)
                self._native.core.reserve(self.seq)
            self._native.start()
            self.stacks.id_base = NativeBackend.PYTHON_STACK_IDS
        else:
            self._mode = _DispatchMode(self)
            self._mode.__enter__()
        _compile.install(self)
        self.active = True
        _started.add(self)
        return self

    def stop(self, **final_meta: Any) -> None:
        if not self.active:
            return
        self.active = False
        _started.discard(self)
        try:
            _compile.uninstall(self)
            if self._native is not None:
                self._native.stop()
            else:
                self._mode.__exit__(None, None, None)
        finally:
            self.modules.remove()
            _skips.release(self._on_skip)
            _swap.unhold(self._release)
            _reads.remove(self)
            _params.remove(self)
            _monitor_tap.remove_listener("root", self.on_backward)
            self.stacks.release_frames()
            if self._on_step in _steps.clock.on_step:
                _steps.clock.on_step.remove(self._on_step)
            _steps.release()
            _monitor_tap.remove_listener("loss_graph", self._pin_loss)
            _monitor_tap.remove_listener("clip", self._note_clipping)
            if self.loss_watch is not None:
                _loss_watch.release(self.loss_watch)
                self.loss_watch = None
            self.flush()
            if self.scaler_verdicts is not None:
                self.scaler_verdicts.close()
                self.scaler_verdicts = None
            if self.writer is not None:
                if self._flush_if_stale in self.writer.idle_callbacks:
                    self.writer.idle_callbacks.remove(self._flush_if_stale)
                if self.flush in self.writer.sources:
                    self.writer.sources.remove(self.flush)
                if self._native is not None:
                    counts = self._native.counts()
                    # Compiled graphs' records are numbered by the core and counted here.
                    self.seq, self.recorded = counts["seq"], counts["recorded"] + self.recorded
                    self.failures += counts["failures"]
                    if counts["unsure"]:
                        final_meta["native_unsure"] = counts["unsure"]
                if self.failures:
                    final_meta["record_errors"] = self.failures
                if self.skipped:
                    final_meta["skipped_iterations"] = self.skipped
                final_meta.update(_compile.run_meta(self))
                release_writer(
                    self.writer,
                    executions=self.seq,
                    recorded=self.recorded,
                    recording=False,
                    **final_meta,
                )
                self.writer = None

    def _outermost(self, module: torch.nn.Module) -> None:
        # An outermost module call with gradients on, of a module holding parameters: a model's
        # forward (not the criterion's, called after the model), which tells the skip
        # watch where an iteration begins (a loop that checked a non-finite loss and called no
        # backward() before it skipped the last one).
        if torch.is_grad_enabled() and next(torch.nn.Module.parameters(module), None) is not None:  # not a loss module
            _skips.watch.forward(module.training)

    def _on_skip(self, skip: _skips.Skip) -> None:
        self.skipped = _skips.count(self.skipped, skip)

    @property
    def executions(self) -> int:
        """Executions numbered so far, under either backend (the native core keeps its own count)."""
        return self._native.core.counts()["seq"] if self._native is not None and self.active else self.seq

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

    def on_alias(self, source: _Tensor, alias: _Tensor) -> None:
        """``alias`` (a Parameter, capture/_params) holds ``source``'s values, made where the
        dispatch mode does not see it: it takes ``source``'s producer. The native core sees that
        ``detach`` itself."""
        if not self.active or self._native is not None or threading.get_ident() != self._thread:
            return
        p = self.producers.get(id(source))
        if p is not None and p[0]() is source:
            _register(self, self.producers, alias, p[1], p[2], p[3], p[4])

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
        # How many of its outputs hold values: none, or the result before a workspace (WORKSPACE_OUTPUTS).
        known = 0 if name in ALLOCATION_OPS or collective else WORKSPACE_OUTPUTS.get(name, -1)
        writes = () if collective else written_args(func)  # a void op's outputs: the arguments it wrote
        info = (name, wanted, known, name in ALIAS_OPS, call, func, cls, overwrite, inplace, collective, marker,
                writes, stats_written(name))
        self.op_info[id(func)] = info
        return info

    def _prune_fwd_nodes(self) -> None:
        """Keep the forward ops of the last two steps; if that is still over half the limit
        (a loop that never calls optimizer.step()), the newest half of them."""
        step = _clock.step
        items = [(k, v) for k, v in self.fwd_nodes.items() if v[3] >= step - 2]  # in the order they ran
        if len(items) > _recorder_mode.FWD_NODES_MAX // 2:
            items = items[len(items) // 2:]
        self.fwd_nodes = dict(items)

    def _sweep(self) -> None:
        """Drop the entries of tensors that died (per step, and when the table doubles), and
        the taint states of the tensors that died with them."""
        self.producers = {k: p for k, p in self.producers.items() if p[0]() is not None}
        self.sweep_at = max(4096, 2 * len(self.producers))
        if self.judge_here and self.taint.states:
            self.taint.prune({p[1] for p in self.producers.values()})


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
                   strict: bool = False, overwrite: bool = False) -> Recorder:
    """Raise :class:`trainguard.NonFiniteError` at the first op (forward or backward) that makes
    a harmful value: a NaN, or a +-inf that reaches the loss, a gradient, a parameter, optimizer
    state or a value the program reads. The message names where that value was made (the op
    that first made the inf, with its module, the user's ``file:line`` and its inputs) and
    where it became harmful. Intended infinities (masks absorbed by softmax, sentinels) pass.
    ``strict=True`` raises at any non-finite output instead. With ``logdir`` the ops are also
    recorded there, with the op that raised and its chain (``overwrite=True`` replaces a run
    already there).
    """
    return Recorder(logdir, mode=mode, buffer=buffer, check_numerics=True, strict=strict, overwrite=overwrite)


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


# Recorders started and not stopped yet. At exit they are stopped, as enable()'s is: the native
# core's drain thread would otherwise be waiting outside the GIL when the interpreter ends its
# daemon threads, and that aborts the process ("terminate called without an active exception").
_started: weakref.WeakSet[Recorder] = weakref.WeakSet()


@atexit.register
def _at_exit() -> None:
    global _global
    with _global_lock:
        first, _global = _global, None
    # a script that died with enable() on is stored as crashed
    for rec in [first, *(r for r in list(_started) if r is not first)]:
        if rec is not None and rec.active:
            try:
                rec.stop(**ending(uncaught()))
            except Exception:  # pragma: no cover - best effort at interpreter exit
                pass


