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

import logging
import math
import weakref

import torch

from trainguard._errors import NonFiniteError
from trainguard.capture import _steps
from trainguard.capture._compile_graph import GraphPlan
from trainguard.capture._compile_numerics import first_bad, numerics_message
from trainguard.capture._summary import summarize_deferred, summarize_immediate, unknown_summary
from trainguard.store import MODE_FIELDS
from trainguard.store._codec import health_of

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
            refs.append((n[0], name))
            continue
        p = producers.get(key)
        refs.append(("op", p[1]) if p is not None and p[0]() is a else ("input", None))
    return refs


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
    refs = input_refs(r, args, plan.input_names, cur)
    metas = _metas(g, args)
    # The dispatch mode lets ops pass while this is set: the compiled code's own (extern kernels),
    # and the few this recording makes (reading the flag, starting a copy).
    r.in_graph += 1
    try:
        out = g.compiled(args)
        n = plan.n_outputs
        extra = out[n:] if plan.extra else ()
        out = out[:n] if plan.extra else out
        try:
            _emit(g, r, refs, metas, cur, outer_sid, out, extra)
        except NonFiniteError:
            raise
        except Exception as exc:  # observing training never kills training
            from trainguard.capture._recorder import _record_failed

            _record_failed(r, f"compiled graph {g.label}", exc)
    finally:
        r.in_graph -= 1
    r.last_nr = _get_seq_nr()
    return out


def _emit(g: RecordedGraph, r, refs, metas, cur, outer_sid, out, extra) -> None:
    from trainguard.capture._recorder import FLUSH_RECORDS, FLUSH_SECONDS, _monotonic, _register

    plan = g.plan
    ops = plan.ops
    base = r.seq
    r.seq = base + len(ops)
    seen = r.compiled_graphs.get(g.label)
    if seen is None:
        r.compiled_graphs[g.label] = [len(ops), 1]
        if r.mode == "full_tensor" and len(r.compiled_graphs) == 1:
            log.warning("trainguard: full_tensor inside compiled graphs stores the values of the graphs' outputs "
                        "only; every op inside has its summary")
    else:
        seen[1] += 1
    step = _clock.step
    backward = plan.kind == "backward"
    if backward:
        fw = g.pair.last_fw
        if g.fwd_of is None:
            index = g.pair.fw.fwd_index if g.pair.fw is not None else {}
            g.fwd_of = [index.get(t.seq_nr) if t.seq_nr is not None else None for t in ops]
        fwd_of = g.fwd_of
        mids, sids = _backward_where(g, r, fw)
    else:
        mids = _module_ids(g, r, cur)
        sids = _stack_ids(g, r, outer_sid)
    fields = r.fields
    key = bad = None
    last = len(ops)
    if extra:
        matrix, flag = extra
        key = ("graph", base)
        if r.check or matrix.is_cpu:
            bad = bool(flag)  # CPU: no device to wait for; check_numerics: may synchronise
        if bad and r.check:
            last = first_bad(plan, matrix.tolist()) + 1
        if fields:
            _ship(r, key, matrix, plan.mode)
        else:
            key = None
    if r.writer is None:  # check_numerics without a run directory: nothing to keep
        last = last if bad and r.check else 0
    pending = r.pending
    in_opt = _clock.in_optimizer
    # A training graph runs inside an autograd.Function's forward, where grad mode is off.
    training = plan.kind == "forward"
    grad = _grad_enabled()
    unknown = {}
    recorded = 0
    for k in range(last):
        t = ops[k]
        if not t.wanted:
            continue
        mid = mids[k]
        fwd_seq = None
        if backward:
            phase = "backward"
            j = fwd_of[k]
            if fw is not None and j is not None:
                fwd_seq = fw[0] + j
        elif in_opt:
            phase = "optimizer"
        else:
            phase = "forward" if training or mid is not None or grad else "other"
        inputs = tuple(("op", base + j) if kind == "n" else (refs[j] or ("input", None)) if kind == "p"
                       else ("input", None) for kind, j in t.inputs)
        summary = None
        health = 0
        if fields:
            parts = []
            for row, meta in zip(t.rows, metas[k]):
                if row is not None and key is not None:
                    parts.append(("d", key, row))
                    health = None
                else:
                    n = math.prod(meta[1]) if all(s >= 0 for s in meta[1]) else -1
                    u = unknown.get(n)
                    if u is None:
                        u = unknown[n] = unknown_summary(r.mode, n if n >= 0 else 0)
                    parts.append(u)
            summary = tuple(parts)
        pending.append((base + k, step, phase, t.name, mid, sids[k], fwd_seq, health, inputs, metas[k], summary))
        recorded += 1
    r.recorded += recorded
    if bad:
        r.pending_bad = True
    if bad and r.check:
        k = first_bad(plan, matrix.tolist())
        r.flush()
        t = ops[k]
        raise NonFiniteError(numerics_message(g, r, k, matrix.tolist(), mids[k], sids[k], refs, base, fw if backward else None),
                             execution={"seq": base + k, "op": t.name, "phase": "backward" if backward else "forward"})
    producers = r.producers
    for i, o in enumerate(out):
        po = plan.out_ops[i]
        if po is not None and isinstance(o, _Tensor):
            k = po[0]
            _register(r, producers, o, base + k, ops[k].name, sids[k], None)
            if r.mode == "full_tensor" and r.writer is not None and ops[k].wanted:
                r.writer.put_payload_tensor(base + k, po[1], o.detach().to("cpu", copy=True))
    if not backward:
        g.pair.last_fw = (base, mids, sids)
    if r.writer is None:
        return
    n = len(pending)
    if n >= FLUSH_RECORDS or r.pending_bad or _monotonic() - r.last_flush > FLUSH_SECONDS:
        r.flush()


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
            elif f == "nonfinite" and "nan" in have:
                bad = sum(matrix[:, have.index(x)] for x in ("neg_inf", "pos_inf", "nan"))
                cols.append((bad > 0).to(matrix.dtype))
            else:
                cols.append(torch.full_like(matrix[:, 0], math.nan))
        return torch.stack(cols, dim=1) if cols else matrix[:, :0]


# ---------------------------------------------------------------------- graphs compiled before recording
def record_opaque(r, label: str, call, args):
    """One record for a whole graph compiled before the recording started (or by a compiler
    trainguard cannot instrument): its inputs and outputs, as if it were one op."""
    refs = input_refs(r, args)
    inputs = {id(a) for a in args if isinstance(a, _Tensor)}  # the call empties args
    cur = r.modules.current()
    sid = r.stacks.capture(3)
    r.in_graph += 1
    try:
        out = call(args)
        try:
            _emit_opaque(r, label, refs, cur, sid, out, inputs)
        except Exception as exc:  # observing training never kills training
            from trainguard.capture._recorder import _record_failed

            _record_failed(r, f"compiled graph {label}", exc)
    finally:
        r.in_graph -= 1
    r.last_nr = _get_seq_nr()
    return out


def _emit_opaque(r, label: str, refs, cur, sid, out, inputs: set) -> None:
    from trainguard.capture._recorder import _register

    seq = r.seq
    r.seq = seq + 1
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
    phase = "backward" if "backward" in label else ("forward" if cur is not None or _grad_enabled() else "other")
    for o in tensors:
        _register(r, r.producers, o, seq, name, sid, None)
    if r.writer is None:
        return
    inputs = tuple(x for x in refs if x is not None)
    r.pending.append((seq, _clock.step, phase, name, cur, sid, None, None if deferred else health, inputs, tuple(metas),
                      None if summaries is None else tuple(summaries)))
    r.recorded += 1
    if health:
        r.pending_bad = True
