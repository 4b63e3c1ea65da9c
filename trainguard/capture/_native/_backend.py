"""The native backend of a Recorder: installs the C++ core, feeds it the Python hooks' state, and
turns its drained records into the writer's batches (the same tuples the dispatch mode makes)."""

from __future__ import annotations

import logging
import os
import threading

from trainguard._errors import TrainguardError
from trainguard.capture import _steps

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


class NativeBackend:
    """The C++ core of one recording, with the hooks that keep it informed."""

    def __init__(self, rec, module) -> None:
        self.rec = rec
        self.mod = module
        pattern = rec.ops_pattern
        wanted = (lambda name: pattern.search(name) is not None) if pattern is not None else None
        self.core = module.Core(MODE_CODE[rec.mode], STRATEGY_CODE[rec.strategy], wanted,
                                sorted(rec.dtypes, key=str) if rec.dtypes else [], rec._on_new_stack)
        self.unsure_warned: set[str] = set()
        self.unsure = 0
        self._stop = threading.Event()
        self.thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        rec = self.rec
        if not self.core.start():
            raise RuntimeError("too many native recordings at once")
        self.mod.set_step(_steps.clock.step)
        self.mod.set_in_optimizer(_steps.clock.in_optimizer)
        _steps.clock.before_optimizer_step.append(self._optimizer_moved)
        _steps.clock.on_optimizer_step.append(self._optimizer_moved)
        rec.modules.on_change = self.core.set_module
        rec.modules.on_named = self.core.name_tensor
        self.thread = threading.Thread(target=self._drain_loop, name="trainguard-native-drain", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.core.stop()
        self._stop.set()
        self.core.wake()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout=10)
        for hooks in (_steps.clock.before_optimizer_step, _steps.clock.on_optimizer_step):
            if self._optimizer_moved in hooks:
                hooks.remove(self._optimizer_moved)
        self.rec.modules.on_change = None
        self.rec.modules.on_named = None

    def _optimizer_moved(self, optimizer) -> None:
        self.mod.set_in_optimizer(_steps.clock.in_optimizer)

    def on_step(self, step: int) -> None:
        self.mod.set_step(step)
        self.core.on_step(step)

    def _drain_loop(self) -> None:
        """Hands records over every FLUSH_SECONDS, at FLUSH_RECORDS and soon after a NaN, from
        this thread (the training thread only appends to the C++ buffer)."""
        from trainguard.capture._recorder import FLUSH_SECONDS

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
        """(records, deferred {device: [summaries]}, bad) since the last drain; payloads and
        failures are handed on here."""
        records, deferred, payloads, bad, failures, unsure = self.core.drain()
        rec = self.rec
        if payloads and rec.writer is not None:
            for seq, slot, tensor in payloads:
                rec.writer.put_payload_tensor(seq, slot, tensor)
        for name, message in failures:
            if name not in rec.failed_ops:
                rec.failed_ops.add(name)
                log.warning("trainguard: could not record an output of %s (%s); training goes on", name, message)
        for name in unsure:
            if name not in self.unsure_warned:
                self.unsure_warned.add(name)
                log.warning("trainguard: the native recorder does not record %s on tensor subclasses or under "
                            "another dispatch mode; record with backend='python' to see those ops", name)
        return records, deferred, bad

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
