"""The recorder's side of harmful values that is not the hot path: sinks seen outside an op
(the start of a backward pass, the program reading a tensor), check_numerics stopping, and
handing the judging to the writer's thread (docs/recorder.md, "Harmful, intended, unknown").

A mixin of :class:`trainguard.capture._recorder.Recorder`.
"""

from __future__ import annotations

import threading

import torch

from trainguard._errors import NonFiniteError
from trainguard.capture import _numerics, _steps
from trainguard.capture._local import local as _local
from trainguard.capture._taint import HARMFUL

_clock = _steps.clock


class HarmHooks:
    # ------------------------------------------------------------------ taint plumbing
    def _judge_in_writer(self) -> None:
        """Accelerator summaries reach the host on the writer's thread: from now on their
        taint is judged there, by the same tracker (this thread no longer touches it)."""
        self.judge_here = False
        tracker, fields = self.taint, self.fields
        tracker.bounded = True
        if self.writer is not None:
            self.writer.judge = lambda records: tracker.judge(records, fields)

    def _note_origin(self, seq: int, args, outs) -> None:
        """check_numerics: describe an op that made an inf while its tensors are at hand, for
        the message that names it if the inf becomes harmful later."""
        o = self.taint.origins.get(seq)
        if o is not None:
            self.taint.origins[seq] = o[:-1] + (_numerics.origin_detail(args, outs, self, seq),)

    def _note_rows(self, seq: int, outs) -> None:
        """The guard's replay: which rows (first dimension) of the op's output hold its new
        non-finite values, for the guard to name the samples of the batch (at most 64 ops)."""
        if len(self.nonfinite_rows) >= 64:
            return
        for o in outs:
            if (isinstance(o, torch.Tensor) and o.dim() and o.numel() and o.layout == torch.strided
                    and (o.is_floating_point() or o.is_complex())):
                # A DTensor (FSDP2's parameters and optimizer state): the shard this rank holds, whose
                # rows are the DTensor's only where its first dimension is not split across ranks
                # (DTensor has no sharding for aten.nonzero, and no collective may be issued here).
                v = _local(o)
                if v is not o and (v.dim() != o.dim() or v.shape[0] != o.shape[0]):
                    continue
                bad = ~torch.isfinite(v.detach())
                rows = bad.reshape(o.shape[0], -1).any(1).nonzero().flatten()
                if rows.numel():
                    self.nonfinite_rows[seq] = (int(o.shape[0]), rows[:64].tolist())
                    return

    def _stop_at(self, rec: tuple, args, outs, health: int, fwd_op) -> None:
        """check_numerics: the op ``rec`` made a harmful value (or, strict, any non-finite one)."""
        seq, phase, name, module_id, stack_id = rec[0], rec[2], rec[3], rec[4], rec[5]
        taint, origin = rec[11], rec[12]
        if self.writer is not None:
            self.pending.append(rec)
            self.recorded += 1
            if taint != HARMFUL:  # strict: not harmful, yet what it stopped at is kept
                self.taint.pins += [seq] + [ref for kind, ref in rec[8] if kind == "op"]
        first = self.taint.first
        o = self.taint.origins.get(origin) if origin is not None and origin != seq else None
        msg = _numerics.message(self, name, phase, module_id, stack_id, fwd_op, args, outs, health, origin=o,
                                reason=first["reason"] if first and first["seq"] == seq else None, seq=seq)
        self._stop_with(msg, seq, name, phase, stack_id if o is None else o[8])

    # ------------------------------------------------------------------ harm seen outside an op
    def backward_starts(self, fwd_seq: int | None) -> None:
        """A backward pass runs from the output of execution ``fwd_seq``: that is the loss."""
        if self.judge_here and self.taint.states:
            self._reached(self.taint.backward_starts(fwd_seq, _clock.step), fwd_seq)

    def on_backward(self, tensors: object) -> None:
        """``backward()`` runs from ``tensors``: each is a loss, a sink. The first backward op
        (:meth:`backward_starts`) may belong to another tensor: a loss that is a sum or
        difference runs no op of its own, and a term without gradient runs none at all."""
        if not self.active or not self.judge_here or threading.get_ident() != self._thread:
            return
        for t in (tensors,) if isinstance(tensors, torch.Tensor) else tensors if isinstance(tensors, (tuple, list)) else ():
            if self._native is not None:
                if isinstance(t, torch.Tensor):
                    self._native.on_sink(t, "loss")
                continue
            if not self.taint.states:
                return
            p = self.producers.get(id(t)) if isinstance(t, torch.Tensor) else None
            if p is not None and p[0]() is t:
                self._reached(self.taint.reached(p[1], _clock.step, "loss"), p[1])

    def on_read(self, t: torch.Tensor) -> None:
        """The program reads ``t`` (``.tolist()``, ``.numpy()``, printing): a sink."""
        if not self.active or not self.judge_here or threading.get_ident() != self._thread:
            return
        if self._native is not None:
            self._native.on_sink(t, "read")
            return
        p = self.producers.get(id(t))
        if p is not None and p[0]() is t and self.taint.states:
            self._reached(self.taint.reached(p[1], _clock.step, "read"), p[1])

    def _reached(self, state: tuple, seq: int | None) -> None:
        if self.taint.urgent:
            self.flush()
        if not self.check or state[0] != HARMFUL or self.taint.first is None or self.taint.first["seq"] != seq:
            return
        rec = self.taint.records.get(seq)
        harm_at = (rec[3], rec[5]) if rec is not None else ("?", None)
        o = self.taint.origins.get(state[1])
        msg = _numerics.message(self, harm_at[0], "forward", None, harm_at[1], None, (), (), 0, origin=o,
                                reason=self.taint.first["reason"], harm_at=harm_at)
        self._stop_with(msg, seq, harm_at[0], None, harm_at[1] if o is None else o[8])

    def _stop_with(self, msg: str, seq: int, op: str, phase: str | None, stack_id: int | None) -> None:
        """check_numerics: write what it stopped at into the run, then raise. ``stack_id``: the
        stack of the op the message names first (the value's origin where there is one); its
        user frame becomes the error's ``execution["file"]``, ``["line"]`` and ``["function"]``."""
        if self.writer is not None:
            self.writer.set_meta(check_numerics_stop={"seq": seq, "op": op, "message": msg})
        self.flush()
        execution = {"seq": seq, "op": op, "phase": phase}
        frame = _numerics.user_frame(self.stacks.frames(stack_id)) if stack_id is not None else None
        if frame is not None:
            execution.update(file=frame[0], line=frame[1], function=frame[2])
        raise NonFiniteError(msg, execution=execution)
