"""Harmful values in a run: alerts, the first harmful value, intended infinities, per-step counts.

A mixin of :class:`trainguard.store._reader.Run` (docs/recorder.md, "Harmful, intended,
unknown"): it needs the run's ``_q`` query helper, ``meta``, ``tainted`` (format 3 or later)
and ``execution``. Runs before format 3 read as format 2 meant them: every non-finite
execution harmful, the first one the origin.
"""

from __future__ import annotations

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

    def steps(self) -> list[dict]:
        """Per step: first and last sequence number, execution count, harmful count."""
        harm = "health != 0" if not self.tainted else f"taint = {T_HARMFUL}"
        rows = self._q(
            f"SELECT step, min(seq), max(seq), count(*), sum({harm}) FROM executions GROUP BY step ORDER BY step"
        )
        out = [{"step": s, "first": a, "last": b, "count": c, "nonfinite": n or 0} for s, a, b, c, n in rows]
        if self._counted():
            counted = dict(self._q("SELECT step, sum(count) FROM harmful GROUP BY step"))
            for d in out:
                d["nonfinite"] = max(d["nonfinite"], counted.get(d["step"], 0))
        return out

    def alerts(self) -> dict:
        """Harmful events counted by op type, with the first one of each; ``first_seq`` is where
        the first harmful value was made (its origin: what an alert leads to), ``harm_seq`` where
        it became harmful. Intended infinities are only counted (``intended``), never alerts."""
        if self._counted():
            rows = self._q("SELECT op, sum(count), min(first_seq) FROM harmful GROUP BY op ORDER BY min(first_seq)")
        else:
            harm = "e.health != 0" if not self.tainted else f"e.taint = {T_HARMFUL}"
            rows = self._q(
                "SELECT o.name, count(*), min(e.seq) FROM executions e JOIN op_types o ON o.id = e.op_id "
                f"WHERE {harm} GROUP BY o.name ORDER BY min(e.seq)"
            )
        by_op = [{"op": short_op(n), "count": c, "first_seq": f} for n, c, f in rows]
        harm = self.first_harm()
        return {
            "total": sum(r["count"] for r in by_op),
            "by_op": by_op,
            "first_seq": harm["origin"] if harm else None,
            "harm_seq": harm["seq"] if harm else None,
            "intended": self.intended(),
        }

    def first_harm(self, since_step: int | None = None) -> dict | None:
        """Where the first harmful value became harmful: {seq, origin, reason, op, step}, or None.

        ``reason`` says how: ``nan`` (a NaN was made), ``loss`` (backward() was called on it),
        ``gradient``, ``optimizer``, ``parameter`` (written into one), ``read`` (``.item()``,
        ``.tolist()``, printing). Runs before format 3: the first non-finite execution.
        ``since_step``: the first one in that step or later (a GradScaler's overflowing steps,
        long after a routine overflow while its scale settled); ``reason`` may then be None.
        """
        h = self.meta.get("first_harm")
        if isinstance(h, dict) and isinstance(h.get("seq"), int):
            step = h.get("step")
            if since_step is None or (isinstance(step, int) and step >= since_step):
                return h
        if self.tainted:
            sql = f"SELECT seq, coalesce(origin, seq) FROM executions WHERE taint = {T_HARMFUL}"
        else:
            sql = "SELECT seq, seq FROM executions WHERE health != 0"
        params: tuple = ()
        if since_step is not None:
            sql, params = sql + " AND step >= ?", (int(since_step),)
        rows = self._q(sql + " ORDER BY seq LIMIT 1", params)
        return {"seq": rows[0][0], "origin": rows[0][1], "reason": None} if rows else None

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
        that absorbed them (``absorbed_by`` None: never absorbed nor harmful, e.g. unused)."""
        groups = self.meta.get("intended")
        return groups if isinstance(groups, list) else []

