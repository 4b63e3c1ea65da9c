"""A compiled graph call's records, made from the graph's templates on the writer's thread.

A call whose records need nothing judged on the training thread (no output non-finite, no graph
input tainted, no ``check_numerics``) is handed over as one :class:`GraphCall`: what the call
adds to the graph's compile-time templates (the first seq, the clock, module and stack ids,
where the graph's inputs came from, the key of its summary matrix). The writer's thread expands
it into one record per op in the eager recorder's format (``store.ExecBatch``), with each op's
summary taken from the host copy of the matrix. The training thread's cost per call is then one
object, whatever the number of ops. A call that must be judged op by op in graph order
(``_compile_run._emit``) builds its records there with the same helpers.
"""

from __future__ import annotations

import math

from trainguard.capture._summary import unknown_summary


def op_phase(t, mid, backward: bool, training: bool, grad: bool, in_opt: int) -> str:
    """The phase of op template ``t`` in one call (the eager recorder's rules)."""
    if backward:
        return "backward"
    if t.stage == 1 or in_opt:  # inside an optimizer step traced into the graph, or called from one
        return "optimizer"
    return "forward" if training or mid is not None or grad else "other"


def op_inputs(t, base: int, refs) -> tuple:
    """Where each tensor input of ``t`` comes from: another op of this call, or a graph input's producer."""
    return tuple(("op", base + j) if kind == "n" else (refs[j] or ("input", None)) if kind == "p"
                 else ("input", None) for kind, j in t.inputs)


def unknown_parts(mode: str, meta, cache: dict) -> tuple:
    """The summary of an output the compiled code did not summarise (no values to read)."""
    n = math.prod(meta[1]) if all(s >= 0 for s in meta[1]) else -1
    u = cache.get(n)
    if u is None:
        u = cache[n] = unknown_summary(mode, n if n >= 0 else 0)
    return u


class GraphCall:
    """One call's records, expanded by :meth:`expand` on the writer's thread (``store._writer``)."""

    __slots__ = ("after", "backward", "base", "before", "fw_base", "fwd_of", "grad", "health", "key", "metas",
                 "mids", "mode", "n", "ops", "refs", "sids", "training")

    def __init__(self, ops, base, before, after, backward, training, grad, mids, sids, fw_base, fwd_of, refs,
                 metas, key, mode, health, n):
        self.n = n  # records it stands for
        self.ops, self.base, self.before, self.after = ops, base, before, after
        self.backward, self.training, self.grad = backward, training, grad
        self.mids, self.sids, self.fw_base, self.fwd_of = mids, sids, fw_base, fwd_of
        self.refs, self.metas, self.key, self.mode, self.health = refs, metas, key, mode, health

    def expand(self, hosts: dict) -> list[tuple]:
        """The records (``hosts``: summary matrices on the host as row lists, by key)."""
        rows = hosts[self.key] if self.key is not None else None
        ops, base, refs, metas, mids, sids = self.ops, self.base, self.refs, self.metas, self.mids, self.sids
        backward, training, grad, fw_base, fwd_of = self.backward, self.training, self.grad, self.fw_base, self.fwd_of
        health = taint = self.health  # 0: judged finite on the training thread; None: the writer's judge decides
        unknown: dict = {}
        mode = self.mode
        out = []
        for k, t in enumerate(ops):
            if not t.wanted:
                continue
            step, in_opt = self.after if t.stage == 2 else self.before
            mid = mids[k]
            fwd_seq = None
            if backward:
                j = fwd_of[k]
                if fw_base is not None and j is not None:
                    fwd_seq = fw_base + j
            summary = None
            if mode is not None:
                summary = tuple(tuple(rows[row]) if row is not None and rows is not None
                                else unknown_parts(mode, meta, unknown) for row, meta in zip(t.rows, metas[k]))
            out.append((base + k, step, op_phase(t, mid, backward, training, grad, in_opt), t.name, mid, sids[k],
                        fwd_seq, health, op_inputs(t, base, refs), metas[k], summary, taint, None))
        return out
