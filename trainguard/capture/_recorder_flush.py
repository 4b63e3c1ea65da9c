"""The Python recorder's hand-over to the writer: batches of records with what the taint
tracker wants kept, the loss-chain pins, the accelerator summaries' copies, and the native
core's drained batches. A mixin of :class:`trainguard.capture._recorder.Recorder`.
"""

from __future__ import annotations

import threading
import time

import torch
from torch.utils._python_dispatch import _disable_current_modes

from trainguard.capture import _loss_watch, _monitor_tap, _steps
from trainguard.capture import _recorder_mode as _mode
from trainguard.capture._summary import host_copy
from trainguard.store import ExecBatch

# The executions before each of the first backward passes' loss that the circular buffer keeps:
# the loss function's op and the ops that made its input (analysis/_graph_rules.py reads them).
LOSS_PIN_WINDOW = 48


class FlushHooks:
    """Hand-over and writer plumbing (the recorder's state is set up by Recorder.__init__)."""

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
        if self.taint.urgent or time.monotonic() - self.last_flush > _mode.FLUSH_SECONDS:
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
                # Compiled graphs' records (capture/_compile_run), judged when made; the core was
                # paused while their graph ran. Drained before it (as the judge needs, see
                # NativeBackend.python_records), the core's records all follow them; else they go
                # in by seq.
                k = len(self.pending)
                graphs = self.pending[:k]
                del self.pending[:k]
                if records and _seq_of(graphs[-1]) > records[0][0]:
                    records = sorted(graphs + records, key=_seq_of)  # two sorted runs: one merge
                else:
                    records = graphs + records
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

    def _note_clipping(self, params: list, setting: tuple[str, object] | None = None) -> None:
        """The loop clips its gradients: store how in the run's ``clipping`` (the origin's fix of an
        overflow must not advise clipping to a loop that does); written when it changes."""
        if setting is None or self.writer is None:
            return
        known = self.clipping
        now = _monitor_tap.clipping_record(*setting, known["first_step"] if known is not None else _steps.clock.step)
        if known is not None and (known["function"], known["value"]) == (now["function"], now["value"]):
            return
        self.clipping = now
        self.writer.set_meta(clipping=now)

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
        if (self.pending and not self.deferred_used and time.monotonic() - self.last_flush > 2 * _mode.FLUSH_SECONDS
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
            host, event = host_copy(stacked)
            out.append((dev, host, event))
        self.deferred = {}
        return out


def _seq_of(rec) -> int:
    """A pending record's seq: a record tuple's first field, a compiled graph call's base."""
    return rec[0] if isinstance(rec, tuple) else rec.base
