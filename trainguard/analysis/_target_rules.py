"""Regression targets the prediction cannot reach: a bounded prediction (a sigmoid, a tanh) against
targets far outside its range (capture/_loss_watch.py's ``regression`` facts)."""

from __future__ import annotations

import math

from trainguard.analysis._context import Context, fmt
from trainguard.analysis._rules import register_rule
from trainguard.store import Finding

SOURCE = "monitor"


@register_rule("targets_out_of_range")
def targets_out_of_range(ctx: Context) -> list[Finding]:
    """An L1/MSE/Huber loss whose prediction comes out of a bounded op while its targets lie beyond the
    bound by at least ``target_range_excess`` times its width: DETR's sigmoid boxes against boxes in
    pixels. The loss stalls at a huge value (the prediction pinned at the bound), which the trend rules
    read as a loss not decreasing."""
    for rec in ctx.run.meta.get("loss_graph") or []:
        for r in rec.get("regression") or []:
            f = r.get("facts") or {}
            reach = r.get("reach") or []
            above, below = f.get("target_max_at_least"), f.get("target_min_at_most")
            if len(reach) != 2 or not isinstance(above, float) or not isinstance(below, float):
                continue
            lo, hi = float(reach[0]), float(reach[1])
            margin = ctx.th.target_range_excess * (hi - lo)
            high, low = math.isfinite(above) and above > hi + margin, math.isfinite(below) and below < lo - margin
            if not (high or low):
                continue
            b = rec.get("backward_at")
            where = f" (the loss backward() ran on at {b['file']}:{b['line']})" if b else ""
            op = r.get("bounded_by")
            ev = {"source": "autograd graph", "loss": r.get("loss"), "bounded_by": op, "reach": [lo, hi],
                  "chain": [{"op": o} for o in r.get("chain") or []], "backward_at": b}
            if high:
                ev["target_max_at_least"] = above
                side = f"reach at least {fmt(above)}"
                factor = above / hi if hi > 0 else None
            else:
                ev["target_min_at_most"] = below
                side = f"go down to {fmt(below)} or lower"
                factor = below / lo if lo < 0 else None
            scale = (f" ({fmt(factor)}x its upper bound: boxes in pixels rather than fractions of the image?)"
                     if factor and factor > 1 and high else "")
            fix = (f"The targets of {r.get('loss')}{where} {side}, but its prediction comes out of a {op}, which "
                   f"stays within {fmt(lo)}..{fmt(hi)}{scale}: the prediction pins at the bound and the loss stalls "
                   f"far above 0: normalise the targets into the {op}'s range (DETR: boxes as (cx, cy, w, h) divided "
                   "by the image's (w, h, w, h), as its datasets/transforms.py Normalize does, and scale predictions "
                   f"back up only to draw them), or drop the {op} and predict in the targets' units")
            return [Finding(
                kind="targets_out_of_range",
                severity="error",
                title=f"{r.get('loss')}'s targets {side}, beyond what its {op} prediction can reach "
                      f"({fmt(lo)}..{fmt(hi)}){where}",
                evidence=ev,
                suggestion=fix,
                source=SOURCE,
            )]
    return []
