"""Harmful values in a run: alerts, the first harmful value, intended infinities, per-step counts.

A mixin of :class:`trainguard.store._reader.Run` (docs/recorder.md, "Harmful, intended,
unknown"): it needs the run's ``_q`` query helper, ``meta``, ``tainted`` (format 3 or later)
and ``execution``. Runs before format 3 read as format 2 meant them: every non-finite
execution harmful, the first one the origin.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import Any

from trainguard.store._codec import T_HARMFUL


def short_op(name: str) -> str:
    """``aten.log.default`` -> ``aten.log``; other overloads keep their name (``aten.add.Tensor``)."""
    return name[: -len(".default")] if name.endswith(".default") else name


class RunHarm:
    meta: dict[str, Any]
    tainted: bool
    _q: Callable[..., list[tuple]]
    execution: Callable[[int], dict]

    def _counted(self) -> bool:
        """True when the recorder counted every harmful execution (format 3 recordings): the
        ``harmful`` table, not the rows the buffer kept, is then the count."""
        return bool(self.meta.get("harm_counts")) and self.tainted

    def scaler_skipped(self) -> list[tuple[int, int]]:
        """The ``(first, last)`` step ranges whose update a GradScaler skipped (Inf/NaN gradients):
        their harmful values never reached the weights (capture/_scaler_verdict.py)."""
        raw = self.meta.get("scaler_skipped")
        if not isinstance(raw, list):
            return []
        return [(int(r[0]), int(r[1])) for r in raw
                if isinstance(r, list) and len(r) == 2 and all(isinstance(v, int) for v in r)]

    def _handled_test(self) -> Callable[[int | None, int | None], bool]:
        """``handled(step, phase)``: a value made after the forward pass of a step whose update a
        GradScaler skipped (its gradients, the scaler's own checks). A forward value of such a step
        (a NaN loss) stays harmful: the program used it."""
        ranges = self.scaler_skipped()
        starts = [a for a, _ in ranges]

        def handled(step: int | None, phase: int | None = None) -> bool:
            if step is None or not ranges or phase == 0:
                return False
            i = bisect.bisect_right(starts, step) - 1
            return i >= 0 and step <= ranges[i][1]

        return handled

    def steps(self) -> list[dict]:
        """Per step: first and last sequence number, execution count, harmful count, and
        ``scaler_skipped`` when a GradScaler skipped its update."""
        harm = "health != 0" if not self.tainted else f"taint = {T_HARMFUL}"
        rows = self._q(
            f"SELECT step, min(seq), max(seq), count(*), sum({harm}) FROM executions GROUP BY step ORDER BY step"
        )
        in_skipped = self._handled_test()
        out = [{"step": s, "first": a, "last": b, "count": c, "nonfinite": n or 0, "scaler_skipped": in_skipped(s)}
               for s, a, b, c, n in rows]
        if self._counted():
            counted = dict(self._q("SELECT step, sum(count) FROM harmful GROUP BY step"))
            for d in out:
                d["nonfinite"] = max(d["nonfinite"], counted.get(d["step"], 0))
        return out

    def alerts(self) -> dict:
        """Harmful events counted by op type, with the first one of each; ``first_seq`` is where
        the first harmful value was made (its origin: what an alert leads to), ``harm_seq`` where
        it became harmful. Intended infinities are only counted (``intended``), never alerts.
        Harmful values of steps a GradScaler skipped are counted apart (``scaler``), not alerts."""
        if self._counted():  # the phase of an op type's first harmful execution in the step stands for all
            rows = self._q("SELECT h.op, h.step, h.count, h.first_seq, e.phase FROM harmful h "
                           "LEFT JOIN executions e ON e.seq = h.first_seq")
        else:
            harm = "e.health != 0" if not self.tainted else f"e.taint = {T_HARMFUL}"
            rows = self._q(
                "SELECT o.name, e.step, count(*), min(e.seq), e.phase FROM executions e "
                f"JOIN op_types o ON o.id = e.op_id WHERE {harm} GROUP BY o.name, e.step, e.phase"
            )
        handled = self._handled_test()
        groups: tuple[dict, dict] = ({}, {})  # op -> [count, first seq]: (alerts, GradScaler-skipped)
        for name, step, count, first, phase in rows:
            g = groups[handled(step, phase)].setdefault(short_op(name), [0, first])
            g[0] += count
            g[1] = min(g[1], first)
        by_op, skipped = ([{"op": op, "count": c, "first_seq": f}
                           for op, (c, f) in sorted(g.items(), key=lambda x: x[1][1])] for g in groups)
        harm = self.first_harm()
        out = {
            "total": sum(r["count"] for r in by_op),
            "by_op": by_op,
            "first_seq": harm["origin"] if harm else None,
            "harm_seq": harm["seq"] if harm else None,
            "intended": [dict(g, chosen=chosen_by_program(g.get("made_by"))) for g in self.intended()],
        }
        ranges = self.scaler_skipped()
        if ranges:
            first = min(skipped, key=lambda r: r["first_seq"]) if skipped else None
            out["scaler"] = {"skipped_steps": sum(b - a + 1 for a, b in ranges), "ranges": [list(r) for r in ranges],
                             "events": sum(r["count"] for r in skipped), "by_op": skipped,
                             "first_seq": first["first_seq"] if first else None}
        return out

    def first_harm(self, since_step: int | None = None, handled: bool = False) -> dict | None:
        """Where the first harmful value became harmful: {seq, origin, reason, op, step}, or None.

        ``reason`` says how: ``nan`` (a NaN was made), ``loss`` (backward() was called on it),
        ``gradient``, ``optimizer``, ``parameter`` (written into one), ``read`` (``.item()``,
        ``.tolist()``, printing). Runs before format 3: the first non-finite execution.
        ``since_step``: the first one in that step or later (a GradScaler's overflowing steps,
        long after a routine overflow while its scale settled); ``reason`` may then be None.
        Gradients of steps a GradScaler skipped are passed over unless ``handled`` (the scaler's
        own rule looks there): their update never ran.
        """
        skipped = (lambda step, phase: False) if handled else self._handled_test()
        h = self.meta.get("first_harm")
        if isinstance(h, dict) and isinstance(h.get("seq"), int):
            step = h.get("step")
            # in a skipped step its phase decides (below: the stored row has it)
            if (since_step is None or (isinstance(step, int) and step >= since_step)) and not skipped(step, None):
                return h
        if self.tainted:
            sql = f"SELECT seq, coalesce(origin, seq), step, phase FROM executions WHERE taint = {T_HARMFUL}"
        else:
            sql = "SELECT seq, seq, step, phase FROM executions WHERE health != 0"
        params: tuple = ()
        if since_step is not None:
            sql, params = sql + " AND step >= ?", (int(since_step),)
        if handled or not self.scaler_skipped():
            rows = self._q(sql + " ORDER BY seq LIMIT 1", params)
        else:  # harmful rows are few (a storm is counted, not stored): filter the skipped steps here
            rows = [r for r in self._q(sql + " ORDER BY seq", params) if not skipped(r[2], r[3])][:1]
        return {"seq": rows[0][0], "origin": rows[0][1], "reason": None} if rows else None

    def first_damage(self) -> dict | None:
        """Where a harmful value first reached training: {seq, origin, reason, op, step} with
        ``reason`` ``loss``, ``gradient``, ``optimizer`` or ``parameter``; None when none did (or
        the run predates this record). Its origin differs from :meth:`first_harm`'s when the first
        NaN was made in a value nothing used (nerf's disparity of a ray with no density)."""
        h = self.meta.get("first_damage")
        return h if isinstance(h, dict) and isinstance(h.get("seq"), int) else None

    def reached_training(self, origin: int | None) -> bool | None:
        """Whether the harmful value made at execution ``origin`` reached training (a loss, a
        gradient, the optimizer or a parameter): False when no harmful value did, None when the
        run does not say (it predates the record, another value reached training first, or
        check_numerics stopped the program at the harmful value, before anything could use it)."""
        if "first_damage" not in self.meta:
            return None
        damage = self.meta["first_damage"]
        if damage is None:
            return None if self.meta.get("check_numerics_stop") else False
        return True if isinstance(damage, dict) and damage.get("origin") == origin else None

    def first_harmful(self) -> dict | None:
        """The execution where the first harmful value became harmful, in full; None if none."""
        h = self.first_harm()
        if h is None:
            return None
        try:
            return self.execution(h["seq"])
        except KeyError:
            return None

    def intended(self) -> list[dict]:
        """Infinities that were never harmful, counted by kind, the op that made them and the op
        that absorbed them (``absorbed_by`` None: never absorbed nor harmful, e.g. unused), as the
        recorder stored them; :meth:`alerts` adds whether the op that made them writes values the
        program chose (``chosen``, see :func:`chosen_by_program`)."""
        groups = self.meta.get("intended")
        return groups if isinstance(groups, list) else []


# Ops that write a +-inf the program chose (a mask, a sentinel, a constant): what "intended" means in
# report and the UI. An inf that arithmetic made (an overflow of pow or exp, a division by 0) and a
# later op absorbed is not: rsqrt(inf) = 0 in mamba.py's RMSNorm zeroed a whole block's outputs.
_WRITERS = frozenset({"masked_fill", "fill", "full", "full_like", "new_full", "where", "index_put", "index_fill",
                      "scatter", "masked_scatter", "scalar_tensor", "lift_fresh", "lift_fresh_copy", "copy",
                      "to_copy", "clone", "tensor", "zeros_like", "ones_like"})


def chosen_by_program(op: str | None) -> bool:
    """Whether ``op`` (``aten.masked_fill_.Scalar``) writes values the program chose (see _WRITERS)."""
    parts = (op or "").split(".")
    base = parts[1] if parts[0] in ("aten", "prims", "torch") and len(parts) > 1 else parts[0]
    return base.strip("_") in _WRITERS

