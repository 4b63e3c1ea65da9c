"""Calling a recorded graph: one record per aten op per call, in the eager recorder's format.

The compiled code computes its summaries itself (see ``_compile_graph``); here, per call, the
graph's inputs are linked to the eager ops, parameters or data that made them
(``_compile_where``), the summary matrix is handed to the writer like an accelerator summary
batch (resolved on the writer thread, never waited for here), the op records are built from the
compile-time templates (sequence numbers, step, phase, module, stack), and the graph's outputs
are registered as produced by their ops so that later eager ops and the backward graph link to
them. A call with nothing to judge op by op here (no non-finite value, no tainted input, no
check_numerics) is handed over as one object, whose records the writer's thread makes
(``_compile_records.GraphCall``). While the compiled code runs, the dispatch mode lets its few
Python-dispatched ops (extern kernels) pass unrecorded.
"""

from __future__ import annotations

import logging
import math

import torch

from trainguard._errors import NonFiniteError
from trainguard.capture import _numerics, _steps
from trainguard.capture._compile_graph import GraphPlan
from trainguard.capture._compile_numerics import numerics_message, origin_detail
from trainguard.capture._compile_records import GraphCall, op_inputs, op_phase, unknown_parts
from trainguard.capture._compile_where import (
    backward_where,
    input_refs,
    metas_of,
    module_ids,
    produced,
    python_records,
    stack_ids,
)
from trainguard.capture._summary import host_copy
from trainguard.capture._taint import ALLOC, DEFAULT, HARMFUL, PENDING, RENORM, UNKNOWN
from trainguard.store import MODE_FIELDS
from trainguard.store._codec import NAN, health_of

log = logging.getLogger("trainguard.capture")

_Tensor = torch.Tensor
_clock = _steps.clock
_grad_enabled = torch.is_grad_enabled
_get_seq_nr = torch._C._autograd._get_sequence_nr

# The recorder compiled graphs report to (set by _compile.install, cleared by uninstall and in a
# forked child).
active = None


class Pair:
    """The forward and backward graphs of one compilation: the backward's records name the
    forward ops their gradients come from (by autograd sequence number)."""

    __slots__ = ("fw", "last_fw", "label", "names", "recent")

    def __init__(self, label: str, names: list | None = None):
        self.fw: GraphPlan | None = None
        self.last_fw: tuple | None = None  # (base seq, module ids, stack ids) of the last forward call
        # The summaries of recent forward calls, by the address of their check tensor
        # (GraphPlan.check; None: the last call's), whose rows their backward calls copy.
        self.recent: dict = {}
        self.label = label
        self.names = names  # parameters and buffers among the Dynamo graph's inputs


class RecordedGraph:
    """A compiled graph with summary outputs: strips them, and records when a recording is on."""

    _boxed_call = True

    def __init__(self, compiled, plan: GraphPlan, pair: Pair):
        self._boxed_call = True  # in the instance dict too: wrappers copy it from there
        self.compiled = compiled
        self.plan = plan
        self.pair = pair
        self.label = f"{pair.label} {plan.kind}"
        self.metas: dict = {}  # shape-symbol values -> outputs per op (dynamic shapes)
        self.static_metas = None if plan.dynamic else tuple(t.outputs for t in plan.ops)
        self.fwd_of: list | None = None  # backward: forward op index per op
        self.n_wanted = sum(1 for t in plan.ops if t.wanted)  # records per call
        self.bind(None)

    def bind(self, recorder) -> None:
        """Module and stack ids are the recording's own: a graph run under a new recording
        forgets those of the last."""
        self.owner = recorder
        self.mods: dict = {}  # current module id at the call -> module id per op
        self.sids: dict = {}  # stack id at the call -> stack id per op
        self.where: tuple | None = None  # backward: modules and stacks for the last forward's
        if self.plan.kind != "backward":
            self.pair.last_fw = None
            self.pair.recent.clear()
        if recorder is not None:  # the writer's thread judges by op class when it judges (accelerators)
            classes = recorder.taint.op_classes
            for t in self.plan.ops:
                classes.setdefault(t.name, (t.cls, t.overwrite, t.inplace))

    def __call__(self, args):
        r = active
        if r is None:
            out = self.compiled(args)
            return out[:self.plan.n_outputs] if self.plan.extra else out
        return record_call(self, r, args)

    def __getattr__(self, name):  # the inner OutputCode's attributes (AOT autograd reads some)
        if name == "compiled":
            raise AttributeError(name)
        return getattr(self.compiled, name)


def record_call(g: RecordedGraph, r, args):
    plan = g.plan
    backward = plan.kind == "backward"
    cur = outer_sid = None
    if not backward:
        cur = r.modules.current()
        outer_sid = r.stacks.capture(3)
    if g.owner is not r:
        g.bind(r)
    # The dispatch mode lets ops pass while this is set: the compiled code's own (extern kernels),
    # and the few this recording makes (reading the flag, starting a copy); the native core is
    # paused for as long.
    r.in_graph += 1
    try:
        with python_records(r):
            out = _call(g, r, args, cur, outer_sid)
    finally:
        r.in_graph -= 1
    r.last_nr = _get_seq_nr()
    return out


def _call(g: RecordedGraph, r, args, cur, outer_sid):
    plan = g.plan
    refs = input_refs(r, args, plan.input_names, cur)
    metas = metas_of(g, args)
    # The clock as the graph's ops see it: an optimizer step traced into the graph moves it while
    # the graph runs (its ops' stage says which side of the step they are on).
    before = (_clock.step, _clock.in_optimizer)
    check = plan.check
    if check is not None and plan.kind == "backward":  # which forward call's rows it copies
        check = args[check[0]].data_ptr()
    out = g.compiled(args)
    if check is not None and plan.kind != "backward":
        check = out[check[0]].data_ptr()
    n = plan.n_outputs
    extra = out[n:] if plan.extra else ()
    out = out[:n] if plan.extra else out
    try:
        _emit(g, r, refs, metas, cur, outer_sid, out, extra, before, check)
    except NonFiniteError:
        raise
    except Exception as exc:  # observing training never kills training
        from trainguard.capture._recorder import _record_failed

        _record_failed(r, f"compiled graph {g.label}", exc)
    return out


def _emit(g: RecordedGraph, r, refs, metas, cur, outer_sid, out, extra, before, check) -> None:
    from trainguard.capture._recorder_mode import FLUSH_RECORDS, FLUSH_SECONDS, _monotonic

    plan = g.plan
    ops = plan.ops
    base = r._reserve(len(ops))
    seen = r.compiled_graphs.get(g.label)
    if seen is None:
        r.compiled_graphs[g.label] = [len(ops), 1]
        if r.mode == "full_tensor" and len(r.compiled_graphs) == 1:
            log.warning("trainguard: full_tensor inside compiled graphs stores the values of the graphs' outputs "
                        "only; every op inside has its summary")
    else:
        seen[1] += 1
    step, in_opt = before
    after = (_clock.step, _clock.in_optimizer)  # for ops after an optimizer step in the graph
    backward = plan.kind == "backward"
    fw = None
    if backward:
        fw = g.pair.last_fw
        if g.fwd_of is None:
            index = g.pair.fw.fwd_index if g.pair.fw is not None else {}
            g.fwd_of = [index.get(t.seq_nr) if t.seq_nr is not None else None for t in ops]
        fwd_of = g.fwd_of
        mids, sids = backward_where(g, r, fw)
    else:
        r.in_backward = False
        mids = module_ids(g, r, cur)
        sids = stack_ids(g, r, outer_sid)
    fields = r.fields
    key = matrix = None
    bad = False
    # Harmful, intended, unknown (capture/_taint): judged here, op by op in graph order, where
    # the graph's summaries are at hand (CPU, or check_numerics, which may synchronise); else by
    # the writer's thread once the summary matrix reaches the host, as eager accelerator ops.
    local = r.judge_here
    if extra:
        flag = extra[-1]
        key = ("graph", base)
        local = local and (r.check or flag.is_cpu)
        if local:
            bad = bool(flag)  # CPU: no device to wait for; check_numerics: may synchronise
        matrix = Summaries(extra[:-1], plan.decoder, plan.mode, r.fields)
        if not backward:
            matrix.bad = bad
            recent = g.pair.recent
            recent[check] = recent[None] = matrix
            if len(recent) > _RECENT:
                del recent[next(k for k in recent if k is not None)]  # the oldest call's
        elif plan.fw_rows:
            fw_sums = g.pair.recent.get(check) or g.pair.recent.get(None)
            matrix.fw, matrix.fw_rows = fw_sums, plan.fw_rows
            bad = bad or (local and fw_sums is not None and fw_sums.bad)  # its copied rows' values
        if fields:
            _ship(r, key, matrix)
        else:
            key = None
    if not local and r.judge_here:
        r._judge_in_writer()
    # Every op's health and taint follow when something inside is non-finite or a graph input
    # carries a taint; otherwise every output is finite (the flag says so) and finite it stays.
    walk = local and (bad or _tainted(r, refs))
    if backward and not r.in_backward:  # the first graph of a backward pass: it runs from the loss
        r.in_backward = True
        if local and fw is not None:
            _loss_reached(g, r, fw)
    # A training graph runs inside an autograd.Function's forward, where grad mode is off.
    training = plan.kind == "forward"
    grad = _grad_enabled()
    writer = r.writer is not None
    if writer and not walk and not r.check and key is not None:
        # Nothing to judge op by op here: one object for the whole call, expanded into its
        # records on the writer's thread (capture/_compile_records).
        r.pending.append(GraphCall(ops, base, (step, in_opt), after, backward, training, grad, mids, sids,
                                   fw[0] if backward and fw is not None else None, fwd_of if backward else None,
                                   refs, metas, key, r.mode, 0 if local else None, g.n_wanted))
        recorded = g.n_wanted
    elif writer or walk:
        recorded = _judged(g, r, base, (step, in_opt), after, backward, training, grad, mids, sids, fw,
                           refs, metas, key, matrix, local, walk)
    else:
        recorded = 0
    r.recorded += recorded
    finite = local and not walk  # every summarised output is finite and untainted (the flag)
    for i, o in enumerate(out):
        po = plan.out_ops[i]
        if po is not None and isinstance(o, _Tensor):
            k = po[0]
            produced(r, o, base + k, ops[k].name, sids[k], finite and ops[k].rows[po[1]] is not None)
            if r.mode == "full_tensor" and writer and ops[k].wanted:
                r.writer.put_payload_tensor(base + k, po[1], o.detach().to("cpu", copy=True))
    if not backward:
        g.pair.last_fw = (base, mids, sids)
    if not writer:
        return
    # By time only without the native core, whose drain thread hands records over every
    # FLUSH_SECONDS (this thread would wait for the hand-over).
    if (len(r.pending) >= FLUSH_RECORDS or r.taint.urgent
            or (r._native is None and _monotonic() - r.last_flush > FLUSH_SECONDS)):
        r.flush()


def _judged(g: RecordedGraph, r, base, before, after, backward, training, grad, mids, sids, fw, refs, metas,
            key, matrix, local, walk) -> int:
    """The call's records built here, op by op in graph order: judged where something inside is
    not finite or an input is tainted (``walk``), stopping where check_numerics must. Returns how
    many were recorded."""
    plan = g.plan
    ops = plan.ops
    rows = matrix.rows(own=True) if walk and matrix is not None else None
    pfields = MODE_FIELDS[plan.mode]
    pending = r.pending
    states = r.taint.states
    fwd_of = g.fwd_of
    fw_base = fw[0] if backward and fw is not None else None
    unknown: dict = {}
    recorded = 0
    writer = r.writer is not None
    fields = r.fields
    for k, t in enumerate(ops):
        if not t.wanted:
            continue
        seq = base + k
        mid = mids[k]
        step, in_opt = after if t.stage == 2 else before
        phase = op_phase(t, mid, backward, training, grad, in_opt)
        fwd_seq = None
        if backward:
            j = fwd_of[k]
            if fw_base is not None and j is not None:
                fwd_seq = fw_base + j
        inputs = op_inputs(t, base, refs)
        health = taint = 0 if local else None
        origin = None
        if walk:
            health = op_health(pfields, rows, t.rows) if rows is not None else 0
            in_taint, in_origin = _in_taint(states, inputs, t.overwrite)
            if (health or in_taint or t.cls == ALLOC) and not t.const:
                # A decomposed softmax's parts pass a -inf on or absorb it; a NaN they make is
                # theirs, as softmax's own. A recomputed forward op is judged as the forward.
                cls = (RENORM if health & NAN else DEFAULT) if t.renorm_part else t.cls
                fwd_op = _fwd_op(g, k) if backward else None
                taint, origin = r.taint.settle(
                    seq, step, "forward" if t.recompute else phase, t.name, cls,
                    t.inplace and bool(inputs) and inputs[0][0] == "param", in_taint, in_origin, health, inputs,
                    fwd_seq, pfields,
                    tuple(tuple(rows[i]) for i in t.rows if i is not None) if rows is not None else None,
                    (mid, sids[k], fwd_op), t.shown)
                if r.check and origin == seq and seq in r.taint.origins:
                    o = r.taint.origins[seq]
                    r.taint.origins[seq] = o[:-1] + (origin_detail(g, r, k, rows, refs),)
                first = r.taint.first
                if taint == HARMFUL and first is not None and first["seq"] == seq:
                    r.taint.pins += _pins_through(ops, k, base, refs, rows, pfields)
        stop = r.check and (taint == HARMFUL or (r.strict and health and taint != UNKNOWN))
        if not writer and not stop:
            continue
        summary = None
        if fields:
            summary = tuple(("d", key, row) if row is not None and key is not None
                            else unknown_parts(r.mode, meta, unknown) for row, meta in zip(t.rows, metas[k]))
        rec = (seq, step, phase, t.name, mid, sids[k], fwd_seq, health, inputs, metas[k], summary, taint, origin)
        if taint == PENDING:
            # Kept to be sent again when it turns harmful, with its summary's values: the writer
            # resolves the references into this call's matrix only in the records it ships them
            # with, never in a record sent again (a -inf that a later op turns into NaN).
            r.taint.keep(rec if summary is None or matrix is None else
                         rec[:10] + (_with_values(summary, matrix.rows()),) + rec[11:])
        if stop:
            r.recorded += recorded
            _stop_at(g, r, k, rows, rec, refs, fw)
        pending.append(rec)
        recorded += 1
    return recorded


def _with_values(summary: tuple, rows: list) -> tuple:
    """A record's summary with each reference into its graph call's matrix, ``("d", key, row)``,
    replaced by that row (in the recording's fields)."""
    return tuple(tuple(rows[v[2]]) if isinstance(v[0], str) else v for v in summary)


def _pins_through(ops, k: int, base: int, refs, rows, fields: tuple) -> list[int]:
    """The first harmful value (op ``k``) is pinned with its producers (capture/_taint); inside
    a graph those may have no summary of their own (a decomposition's inner values), and the
    origin reads through them to the summarised values behind (analysis/_origin): pin that
    chain too, or a circular buffer evicts it."""
    known = [i for i, f in enumerate(fields) if f != "size"]

    def unsummarised(t) -> bool:
        return all(i is None or (rows is not None and all(math.isnan(rows[i][j]) for j in known)) for i in t.rows)

    out, todo, seen = [], [k], {k}
    while todo:
        j = todo.pop()
        for kind, i in ops[j].inputs:
            if kind == "p":
                ref = refs[i]
                if ref is not None and ref[0] == "op":
                    out.append(ref[1])
                continue
            if kind != "n" or i in seen:
                continue
            seen.add(i)
            out.append(base + i)
            if unsummarised(ops[i]):
                todo.append(i)
    return out


def op_health(fields: tuple, rows: list, op_rows: tuple) -> int:
    """The health bits of one op's outputs from its rows of the graph's summary matrix."""
    health = 0
    for i in op_rows:
        if i is not None:
            health |= health_of(fields, rows[i])
    return health


def _tainted(r, refs) -> bool:
    """Whether a graph input was made by an op whose output is not finite (a taint is kept)."""
    states = r.taint.states
    if not states:
        return False
    return any(ref is not None and ref[0] == "op" and ref[1] in states for ref in refs)


def _in_taint(states: dict, inputs: tuple, overwrite: bool) -> tuple[int, int | None]:
    """The highest taint among an op's inputs, with its origin (the earliest on a tie), as the
    eager recorder takes it; an overwrite does not count its first input's old values."""
    in_taint, in_origin = 0, None
    for i, (kind, ref) in enumerate(inputs):
        if kind != "op" or (i == 0 and overwrite):
            continue
        st = states.get(ref)
        if st is not None and (st[0] > in_taint or (st[0] == in_taint and st[1] is not None
                                                    and (in_origin is None or st[1] < in_origin))):
            in_taint, in_origin = st
    return in_taint, in_origin


def _fwd_op(g: RecordedGraph, k: int) -> str | None:
    j = g.fwd_of[k] if g.fwd_of else None
    return g.pair.fw.ops[j].name if j is not None and g.pair.fw is not None else None


def _loss_reached(g: RecordedGraph, r, fw) -> None:
    """A backward pass starts in a compiled graph: the forward graph computed the loss. Its
    scalar outputs are the candidates (which one backward() ran from is not visible here); a
    pending infinity among them reached the loss, as in eager recording."""
    plan = g.pair.fw
    if plan is None or not r.taint.states:
        return
    for po in plan.out_ops:
        if po is not None and plan.ops[po[0]].outputs[po[1]][1] == ():
            r.backward_starts(fw[0] + po[0])


def _stop_at(g: RecordedGraph, r, k: int, rows, rec: tuple, refs, fw) -> None:
    """check_numerics stops inside a compiled graph: at the op whose output is harmful (or,
    strict, not finite), named with its line; the op that made the value first, if earlier."""
    seq, phase, name, health, taint, origin = rec[0], rec[2], rec[3], rec[7], rec[11], rec[12]
    if r.writer is not None:
        r.pending.append(rec)
        r.recorded += 1
        if taint != HARMFUL:  # strict: not harmful, yet what it stopped at is kept
            r.taint.pins += [seq] + [ref for kind, ref in rec[8] if kind == "op"]
    o = r.taint.origins.get(origin) if origin is not None and origin != seq else None
    if o is None:
        msg = numerics_message(g, r, k, rows, rec[4], rec[5], refs, fw)
    else:
        first = r.taint.first
        msg = _numerics.message(r, name, phase, rec[4], rec[5], _fwd_op(g, k) if phase == "backward" else None,
                                (), (), health, origin=o,
                                reason=first["reason"] if first and first["seq"] == seq else None)
        msg += f"\n  inside the compiled graph {g.label}"
    r._stop_with(msg, seq, name, phase, rec[5] if o is None else o[8])


# Forward calls whose summaries are kept for their backward calls (more are pending only with
# that many forward calls before their backward calls).
_RECENT = 8


class Summaries:
    """One graph call's summary outputs (0-d reductions and count vectors), as shipped: the rows
    of the mode's fields are made from them off the training thread, by the writer's
    ``tolist()`` (``store._writer._resolve``); on an accelerator from their host copy. A
    backward call's rows may end with rows of its forward call's (``fw``, ``fw_rows``)."""

    __slots__ = ("bad", "decoder", "event", "fields", "fw", "fw_rows", "have", "host", "own", "parts")

    def __init__(self, parts, decoder, mode: str, fields: tuple):
        self.parts, self.decoder, self.have, self.fields = parts, decoder, MODE_FIELDS[mode], fields
        self.host = self.event = None  # the values on the host, copied from an accelerator
        self.own = None  # its decoded rows, once made (a backward call's may read them too)
        self.fw, self.fw_rows, self.bad = None, (), False

    def values(self) -> torch.Tensor:
        """The parts' values as one float64 vector, in the decoder's order."""
        n = self.decoder.runs[-1][1] if self.decoder.runs else 0
        pieces = [torch.stack(self.parts[a:b]).to(torch.float64) for a, b in self.decoder.runs]
        pieces += [p.to(torch.float64) for p in self.parts[n:]]
        if not pieces:
            return torch.zeros(0, dtype=torch.float64)
        return torch.cat(pieces) if len(pieces) > 1 else pieces[0]

    def rows(self, own: bool = False) -> list[tuple]:
        """The rows in the recording's fields (``own``: in the graph's mode's)."""
        rows = self.own
        if rows is None:
            if self.host is not None:
                if self.event is not None:
                    self.event.synchronize()
                values = self.host
            else:
                values = self.values()
            rows = self.decoder.decode(values.tolist())
            if self.fw_rows:
                fw = self.fw.rows(own=True) if self.fw is not None else None
                rows += [fw[i] for i in self.fw_rows] if fw is not None else [(math.nan,) * len(self.have)] * len(
                    self.fw_rows)
            self.own = rows
        return rows if own or self.have == self.fields else convert(rows, self.have, self.fields)

    def tolist(self) -> list[tuple]:
        return self.rows()


def _ship(r, key, summaries: Summaries) -> None:
    """Hand the call's summaries to the next flush; an accelerator's copy starts now."""
    event = None
    if summaries.parts and summaries.parts[0].device.type != "cpu":
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():
            host, event = host_copy(summaries.values())
        summaries.host, summaries.event, summaries.parts = host, event, ()
    r.deferred_used = True  # only the training thread flushes from now on (see Recorder._flush_if_stale)
    r.graph_summaries.append((key, summaries, event))


def convert(rows: list, have: tuple[str, ...], want: tuple[str, ...]) -> list[tuple]:
    """Summary rows of one mode as another's: a graph compiled under one recording, run under
    another; what the compiled code did not count is unknown (NaN)."""
    cols = []
    for f in want:
        if f in have:
            i = have.index(f)
            cols.append(lambda row, i=i: row[i])
        elif f == "nonfinite" and "nan" in have:  # curt_health: the health bits
            at = [have.index(x) for x in ("nan", "pos_inf", "neg_inf")]
            cols.append(lambda row, at=at: float((row[at[0]] > 0) + 2 * (row[at[1]] > 0) + 4 * (row[at[2]] > 0)))
        else:
            cols.append(lambda row: math.nan)
    return [tuple(c(row) for c in cols) for row in rows]
