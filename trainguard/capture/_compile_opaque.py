"""Graphs compiled before the recording started (or by a compiler trainguard cannot instrument):
each call is one execution, ``compiled_graph.<id> <kind>``, with the graph's inputs and the
outputs it made, summarised eagerly. What happens inside is not seen; the report names these
graphs (``analysis.compiled_summary``).
"""

from __future__ import annotations

import logging

import torch

from trainguard.capture import _steps
from trainguard.capture._compile_run import _in_taint
from trainguard.capture._compile_where import input_refs, produced, python_records
from trainguard.capture._summary import summarize_deferred, summarize_immediate
from trainguard.capture._taint import DEFAULT, HARMFUL, PENDING, UNKNOWN
from trainguard.store._codec import health_of

log = logging.getLogger("trainguard.capture")

_Tensor = torch.Tensor
_clock = _steps.clock
_grad_enabled = torch.is_grad_enabled
_get_seq_nr = torch._C._autograd._get_sequence_nr


def record_opaque(r, label: str, call, args):
    """One record for a whole graph: its inputs and outputs, as if it were one op."""
    cur = r.modules.current()
    sid = r.stacks.capture(3)
    r.in_graph += 1
    try:
        with python_records(r):
            refs = input_refs(r, args)
            inputs = {id(a) for a in args if isinstance(a, _Tensor)}  # the call empties args
            out = call(args)
            try:
                _emit_opaque(r, label, refs, cur, sid, out, inputs)
            except Exception as exc:  # observing training never kills training (check_numerics aside)
                from trainguard._errors import NonFiniteError
                from trainguard.capture._recorder import _record_failed

                if isinstance(exc, NonFiniteError):
                    raise
                _record_failed(r, f"compiled graph {label}", exc)
    finally:
        r.in_graph -= 1
    r.last_nr = _get_seq_nr()
    return out


def _emit_opaque(r, label: str, refs, cur, sid, out, inputs: set) -> None:
    seq = r._reserve(1)
    calls = r.opaque_graphs.get(label, 0)
    r.opaque_graphs[label] = calls + 1
    if not calls:
        log.warning("trainguard: compiled graph %s was compiled before the recording started: it is recorded "
                    "whole (inputs and outputs), not op by op", label)
    name = f"compiled_graph.{label}"
    # A forward graph also returns what its backward needs, parameters among them: those are
    # inputs passed through, not values it made.
    tensors = [o for o in out if isinstance(o, _Tensor) and id(o) not in inputs]
    metas, summaries, health, deferred = [], [] if r.fields else None, 0, False
    for o in tensors:
        metas.append((str(o.dtype).replace("torch.", ""), tuple(o.shape), str(o.device)))
        if summaries is None:
            continue
        if o.is_cpu or o.is_meta or o.layout is not torch.strided:
            s = summarize_immediate(o, r.mode)
            health |= health_of(r.fields, s)
            summaries.append(s)
        else:
            deferred = True
            lst = r.deferred.setdefault(o.device, [])
            summaries.append(("d", o.device, len(lst)))
            lst.append(summarize_deferred(o, r.mode))
            r.deferred_used = True
    backward = "backward" in label
    phase = "backward" if backward else ("forward" if cur is not None or _grad_enabled() else "other")
    if not backward:
        r.in_backward = False
    ins = tuple(x for x in refs if x is not None)
    # The graph as one op that computes new values: a NaN it returns is its own, an inf pending
    # until it reaches a sink (its inside, where a mask may have been absorbed, is not seen).
    taint, origin = 0, None
    if deferred or not r.judge_here:
        if r.judge_here:
            r._judge_in_writer()
        taint = None
    elif health or r.taint.states:
        in_taint, in_origin = _in_taint(r.taint.states, ins, False)
        if health or in_taint:
            taint, origin = r.taint.settle(seq, _clock.step, phase, name, DEFAULT, False, in_taint, in_origin, health,
                                           ins, None, r.fields, summaries, (cur, sid, None))
    for o in tensors:
        produced(r, o, seq, name, sid)
    rec = (seq, _clock.step, phase, name, cur, sid, None, None if deferred else health, ins, tuple(metas),
           None if summaries is None else tuple(summaries), taint, origin)
    if taint == PENDING:
        r.taint.keep(rec)
    if r.check and (taint == HARMFUL or (r.strict and health and taint != UNKNOWN)):
        r._stop_at(rec, (), tensors, health, None)
    if r.writer is None:
        return
    r.pending.append(rec)
    r.recorded += 1
    if r.taint.urgent:
        r.flush()
