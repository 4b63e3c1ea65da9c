"""Where a compiled graph call's records point: its inputs' producers and names, its ops'
module and stack ids, its outputs' shapes (dynamic shapes), and its outputs registered as
producers for the ops after it. Per graph the answers are cached by the calling module and stack.
"""

from __future__ import annotations

import contextlib
import weakref

import torch

_Tensor = torch.Tensor


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


def produced(r, o: _Tensor, seq: int, name: str, sid, finite: bool = False) -> None:
    """``o`` holds the values of record ``seq`` (a graph's output): later ops name it as input.
    ``finite``: judged finite and untainted here, as the native core's fast path takes it."""
    if r._native is not None:
        r._native.core.set_producer(o, seq, sid or 0, finite)
    else:
        from trainguard.capture._recorder import _register

        _register(r, r.producers, o, seq, name, sid, None)


def python_records(r):
    """Around a graph's call and its records: under the native core, see
    NativeBackend.python_records; the dispatch mode lets its ops pass by ``in_graph``."""
    return r._native.python_records() if r._native is not None else contextlib.nullcontext()


def module_ids(g, r, cur: int | None) -> tuple:
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


def stack_ids(g, r, outer_sid: int | None) -> tuple:
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


def metas_of(g, args) -> tuple:
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


def backward_where(g, r, fw) -> tuple[tuple, tuple]:
    """Backward ops take the module and stack of the forward op they differentiate."""
    ops = g.plan.ops
    if fw is None:
        return (None,) * len(ops), stack_ids(g, r, None)
    # The forward's per-op tuples are cached objects (one per calling module and stack).
    hit = g.where
    if hit is not None and hit[0] is fw[1] and hit[1] is fw[2]:
        return hit[2], hit[3]
    fwd_of = g.fwd_of
    own = stack_ids(g, r, None)
    mids = tuple(fw[1][j] if j is not None else None for j in fwd_of)
    sids = tuple(fw[2][j] if j is not None else own[k] for k, j in enumerate(fwd_of))
    g.where = (fw[1], fw[2], mids, sids)
    return mids, sids
