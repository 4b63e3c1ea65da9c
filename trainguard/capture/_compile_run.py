"""Calling a recorded graph: one record per aten op per call, in the eager recorder's format.

The compiled code computes its summaries itself (see ``_compile_graph``); here, per call, the
graph's inputs are linked to the eager ops, parameters or data that made them, the op records
are built from the compile-time templates (sequence numbers, step, phase, module, stack), the
summary matrix is handed to the writer like an accelerator summary batch (resolved on the
writer thread, never waited for here), and the graph's outputs are registered as produced by
their ops so that later eager ops and the backward graph link to them. While the compiled code
runs, the dispatch mode lets its few Python-dispatched ops (extern kernels) pass unrecorded.
"""

from __future__ import annotations

import contextlib
import logging
import math
import weakref

import torch

from trainguard._errors import NonFiniteError
from trainguard.capture import _numerics, _steps
from trainguard.capture._compile_graph import GraphPlan
from trainguard.capture._compile_numerics import numerics_message, origin_detail
from trainguard.capture._summary import unknown_summary
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

    __slots__ = ("fw", "last_fw", "label", "names")

    def __init__(self, label: str, names: list | None = None):
        self.fw: GraphPlan | None = None
        self.last_fw: tuple | None = None  # (base seq, module ids, stack ids) of the last forward call
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


def input_refs(r, args, names=(), cur: int | None = None) -> list:
    """Where each graph input comes from, as the eager recorder names inputs. Parameters and
    buffers of a compiled module are named here (relative to the module ``cur`` the graph was
    called in): its modules never run eagerly."""
    named = r.modules.named_tensors
    producers = r.producers
    native = r._native
    refs = []
    prefix = False
    for i, a in enumerate(args):
        if not isinstance(a, _Tensor):
            refs.append(None)
            continue
        key = id(a)
        e = named.get(key)
        if e is not None and e[0]() is a:
            refs.append((e[2], e[1]))
            continue
        n = names[i] if i < len(names) else None
        if n is not None:
            if prefix is False:  # once per call that names something new
                entry = r.modules.module_of_id().get(cur) if cur is not None else None
                prefix = entry[0] if entry else ""
            name = f"{prefix}.{n[1]}" if prefix else n[1]
            named[key] = (weakref.ref(a), name, n[0])
            if r.modules.on_named is not None:  # the native core names eager ops' inputs itself
                r.modules.on_named(a, name, n[0])
            refs.append((n[0], name))
            continue
        if native is not None:
            seq = native.producer_seq(a)
            refs.append(("op", seq) if seq is not None else ("input", None))
            continue
        p = producers.get(key)
        refs.append(("op", p[1]) if p is not None and p[0]() is a else ("input", None))
    return refs


def produced(r, o: _Tensor, seq: int, name: str, sid) -> None:
    """``o`` holds the values of record ``seq`` (a graph's output): later ops name it as input."""
    if r._native is not None:
        r._native.core.set_producer(o, seq, sid or 0)
    else:
        from trainguard.capture._recorder import _register

        _register(r, r.producers, o, seq, name, sid, None)


def python_records(r):
    """Around a graph's call and its records: under the native core, see
    NativeBackend.python_records; the dispatch mode lets its ops pass by ``in_graph``."""
    return r._native.python_records() if r._native is not None else contextlib.nullcontext()


def _module_ids(g: RecordedGraph, r, cur: int | None) -> tuple:
    mids = g.mods.get(cur)
    if mids is None:
        outer = r.modules.module_of_id().get(cur) if cur is not None else None
        out = []
        for t in g.plan.ops:
            if t.module is None:
                out.append(cur)
                continue
            rel, type_name = t.module
            path = ".".join(p for p in ((outer[0] if outer else ""), rel) if p)
            out.append(r.modules.intern(path, type_name or (outer[1] if outer else "")))
        mids = g.mods[cur] = tuple(out)
    return mids


def _stack_ids(g: RecordedGraph, r, outer_sid: int | None) -> tuple:
    sids = g.sids.get(outer_sid)
    if sids is None:
        outer = tuple(tuple(f) for f in r.stacks.frames(outer_sid))
        out, cache = [], {}
        for t in g.plan.ops:
            if not t.frames:
                out.append(outer_sid)
                continue
            sid = cache.get(t.frames)
            if sid is None:
                # The live stack holds the compiled function's own frame (at the call of the graph):
                # the node's frames replace it from there on.
                head = t.frames[0]
                cut = len(outer)
                for i in range(len(outer) - 1, -1, -1):
                    if outer[i][0] == head[0] and outer[i][2] == head[2]:
                        cut = i
                        break
                sid = cache[t.frames] = r.stacks.intern(outer[:cut] + t.frames)
            out.append(sid)
        sids = g.sids[outer_sid] = tuple(out)
    return sids


def _metas(g: RecordedGraph, args) -> tuple:
    if g.static_metas is not None:
        return g.static_metas
    plan = g.plan
    values = tuple(int(args[b[1]]) if b[0] == "arg" else int(args[b[1]].shape[b[2]]) for b in plan.symbols)
    metas = g.metas.get(values)
    if metas is None:
        env = {b[-1]: v for b, v in zip(plan.symbols, values)}
        out = []
        for t in plan.ops:
            out.append(tuple((dt, tuple(s if isinstance(s, int) else _eval(s, env) for s in shape), dev)
                             for dt, shape, dev in t.outputs))
        metas = g.metas[values] = tuple(out)
    return metas


def _eval(expr, env) -> int:
    try:
        return int(expr.xreplace(env))
    except (TypeError, ValueError):  # a size the inputs do not determine (data-dependent)
        return -1


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
    metas = _metas(g, args)
    # The clock as the graph's ops see it: an optimizer step traced into the graph moves it while
    # the graph runs (its ops' stage says which side of the step they are on).
    before = (_clock.step, _clock.in_optimizer)
    out = g.compiled(args)
    n = plan.n_outputs
    extra = out[n:] if plan.extra else ()
    out = out[:n] if plan.extra else out
    try:
        _emit(g, r, refs, metas, cur, outer_sid, out, extra, before)
    except NonFiniteError:
        raise
    except Exception as exc:  # observing training never kills training
        from trainguard.capture._recorder import _record_failed

        _record_failed(r, f"compiled graph {g.label}", exc)
    return out


def _emit(g: RecordedGraph, r, refs, metas, cur, outer_sid, out, extra, before) -> None:
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
        mids, sids = _backward_where(g, r, fw)
    else:
        r.in_backward = False
        mids = _module_ids(g, r, cur)
        sids = _stack_ids(g, r, outer_sid)
    fields = r.fields
    key = matrix = None
    bad = False
    # Harmful, intended, unknown (capture/_taint): judged here, op by op in graph order, where
    # the graph's summaries are at hand (CPU, or check_numerics, which may synchronise); else by
    # the writer's thread once the summary matrix reaches the host, as eager accelerator ops.
    local = r.judge_here
    if extra:
        matrix, flag = extra
        key = ("graph", base)
        local = local and (r.check or matrix.is_cpu)
        if local:
            bad = bool(flag)  # CPU: no device to wait for; check_numerics: may synchronise
        if fields:
            _ship(r, key, matrix, plan.mode)
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
    rows = matrix.tolist() if walk and matrix is not None else None
    pfields = MODE_FIELDS[plan.mode]
    pending = r.pending
    # A training graph runs inside an autograd.Function's forward, where grad mode is off.
    training = plan.kind == "forward"
    grad = _grad_enabled()
    states = r.taint.states
    unknown = {}
    recorded = 0
    writer = r.writer is not None
    for k in range(len(ops) if writer or walk else 0):
        t = ops[k]
        if not t.wanted:
            continue
        seq = base + k
        mid = mids[k]
        fwd_seq = None
        stage = t.stage
        st, opt = after if stage == 2 else (step, in_opt)
        if backward:
            phase = "backward"
            j = fwd_of[k]
            if fw is not None and j is not None:
                fwd_seq = fw[0] + j
        elif stage == 1 or opt:
            phase = "optimizer"
        else:
            phase = "forward" if training or mid is not None or grad else "other"
        inputs = tuple(("op", base + j) if kind == "n" else (refs[j] or ("input", None)) if kind == "p"
                       else ("input", None) for kind, j in t.inputs)
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
                    seq, st, "forward" if t.recompute else phase, t.name, cls,
                    t.inplace and bool(inputs) and inputs[0][0] == "param", in_taint, in_origin, health, inputs,
                    fwd_seq, pfields,
                    tuple(tuple(rows[i]) for i in t.rows if i is not None) if rows is not None else None,
                    (mid, sids[k], fwd_op), t.shown)
                if r.check and origin == seq and seq in r.taint.origins:
                    o = r.taint.origins[seq]
                    r.taint.origins[seq] = o[:-1] + (origin_detail(g, r, k, rows, refs),)
        stop = r.check and (taint == HARMFUL or (r.strict and health and taint != UNKNOWN))
        if not writer and not stop:
            continue
        summary = None
        if fields:
            parts = []
            for row, meta in zip(t.rows, metas[k]):
                if row is not None and key is not None:
                    parts.append(("d", key, row))
                else:
                    n = math.prod(meta[1]) if all(s >= 0 for s in meta[1]) else -1
                    u = unknown.get(n)
                    if u is None:
                        u = unknown[n] = unknown_summary(r.mode, n if n >= 0 else 0)
                    parts.append(u)
            summary = tuple(parts)
        rec = (seq, st, phase, t.name, mid, sids[k], fwd_seq, health, inputs, metas[k], summary, taint, origin)
        if taint == PENDING:
            r.taint.keep(rec)
        if stop:
            r.recorded += recorded
            _stop_at(g, r, k, rows, rec, refs, fw)
        pending.append(rec)
        recorded += 1
    r.recorded += recorded
    for i, o in enumerate(out):
        po = plan.out_ops[i]
        if po is not None and isinstance(o, _Tensor):
            k = po[0]
            produced(r, o, base + k, ops[k].name, sids[k])
            if r.mode == "full_tensor" and writer and ops[k].wanted:
                r.writer.put_payload_tensor(base + k, po[1], o.detach().to("cpu", copy=True))
    if not backward:
        g.pair.last_fw = (base, mids, sids)
    if not writer:
        return
    if len(pending) >= FLUSH_RECORDS or r.taint.urgent or _monotonic() - r.last_flush > FLUSH_SECONDS:
        r.flush()


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
    r._stop_with(msg, seq, name, phase)


def _backward_where(g: RecordedGraph, r, fw) -> tuple[tuple, tuple]:
    """Backward ops take the module and stack of the forward op they differentiate."""
    ops = g.plan.ops
    if fw is None:
        return (None,) * len(ops), _stack_ids(g, r, None)
    # The forward's per-op tuples are cached objects (one per calling module and stack).
    hit = g.where
    if hit is not None and hit[0] is fw[1] and hit[1] is fw[2]:
        return hit[2], hit[3]
    fwd_of = g.fwd_of
    own = _stack_ids(g, r, None)
    mids = tuple(fw[1][j] if j is not None else None for j in fwd_of)
    sids = tuple(fw[2][j] if j is not None else own[k] for k, j in enumerate(fwd_of))
    g.where = (fw[1], fw[2], mids, sids)
    return mids, sids


def _ship(r, key, matrix: torch.Tensor, mode: str) -> None:
    """Hand the call's summary matrix to the next flush; an accelerator's copy starts now."""
    if mode != r.mode:
        matrix = convert(matrix, MODE_FIELDS[mode], r.fields)
    event = None
    if matrix.device.type == "cuda":
        host = torch.empty(matrix.shape, dtype=matrix.dtype, pin_memory=True)
        host.copy_(matrix, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        matrix = host
    elif not matrix.is_cpu:
        matrix = matrix.to("cpu")
    r.deferred_used = True  # only the training thread flushes from now on (see Recorder._flush_if_stale)
    r.graph_summaries.append((key, matrix, event))


def convert(matrix: torch.Tensor, have: tuple[str, ...], want: tuple[str, ...]) -> torch.Tensor:
    """Summary rows of one mode as another's: a graph compiled under one recording, run under
    another; what the compiled code did not count is unknown (NaN)."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        cols = []
        for f in want:
            if f in have:
                cols.append(matrix[:, have.index(f)])
            elif f == "nonfinite" and "nan" in have:  # curt_health: the health bits
                bits = sum(w * (matrix[:, have.index(x)] > 0).to(matrix.dtype)
                           for w, x in ((1, "nan"), (2, "pos_inf"), (4, "neg_inf")))
                cols.append(bits)
            else:
                cols.append(torch.full_like(matrix[:, 0], math.nan))
        return torch.stack(cols, dim=1) if cols else matrix[:, :0]
