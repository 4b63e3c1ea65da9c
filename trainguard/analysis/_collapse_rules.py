"""Representation collapse: a model's output the same for every input while the loss stalls (the
failure of self-supervised training: DINO, BYOL, SimSiam)."""

from __future__ import annotations

import math

import numpy as np

from trainguard.analysis._context import Context, fmt, median
from trainguard.analysis._layer_rules import _at_init
from trainguard.analysis._loss_rules import progress
from trainguard.analysis._param_rules import untrained_models
from trainguard.analysis._rules import register_rule
from trainguard.store import Finding

SOURCE = "monitor"


def _row_ratio(ctx: Context, layer: str) -> tuple[list[float], list[int]]:
    """How much the rows of a [rows, units] output differ (``row_std``) against the spread of all its
    values (``std``), per recording: 1 for rows independent of each other, 0 for identical rows."""
    rows, std = ctx.stat(layer, "activation", "row_std"), ctx.stat(layer, "activation", "std")
    by_step = dict(zip(std.steps.tolist(), std.values.tolist()))
    out, steps = [], []
    for s, v in zip(rows.steps.tolist(), rows.values.tolist()):
        sd = by_step.get(s)
        if sd is not None and sd > 0 and math.isfinite(v) and math.isfinite(sd):
            out.append(v / sd)
            steps.append(int(s))
    return out, steps


def _outputs(ctx: Context) -> dict[str, str]:
    """Each watched model's output layer: the last in forward order with a [rows, units] output.
    Model prefix -> layer."""
    prefixes = sorted({r.get("prefix") or "" for r in ctx.meta.get("roots") or []} or {""}, key=len, reverse=True)
    out: dict[str, str] = {}
    for la in reversed(ctx.layer_order):
        pre = next((p for p in prefixes if la.startswith(p)), None)
        if pre is not None and pre not in out and ctx.has(la, "activation", "row_std"):
            out[pre] = la
    return out


@register_rule("representation_collapse")
def representation_collapse(ctx: Context) -> list[Finding]:
    p = progress(ctx)
    if p is None or p["progress"] >= ctx.th.loss_min_progress:
        return []
    limit = ctx.th.row_collapse_ratio
    untrained = untrained_models(ctx)
    collapsed: dict[str, dict] = {}
    for pre, layer in _outputs(ctx).items():
        ratios, steps = _row_ratio(ctx, layer)
        if len(ratios) < 2:
            continue
        later = ratios[len(ratios) // 2:]
        initial = _at_init(ctx, ctx.stat(layer, "activation", "row_std"), layer)
        # Rows alike from the first recording are the inputs' doing (or the initialisation's), not
        # a collapse the training made.
        if initial is None or ratios[0] < limit or steps[0] != ctx.initial_step(layer) or median(np.array(later)) >= limit:
            continue
        collapsed[layer] = {"trained": pre not in untrained, "initial_ratio": ratios[0], "ratio": median(np.array(later)),
                            "since": next(s for s, r in zip(steps, ratios) if r < limit)}
    if not collapsed:
        return []
    layers = sorted(collapsed, key=lambda la: not collapsed[la]["trained"])
    first = layers[0]
    c = collapsed[first]
    ev = {
        "layer": first,
        "row_to_value_spread": c["ratio"],
        "initial_row_to_value_spread": c["initial_ratio"],
        "since_step": c["since"],
        "arose_in_training": True,  # rows apart at initialisation, by construction
        "limit": limit,
        "start_loss": p["start"],
        "end_loss": p["end"],
    }
    if len(layers) > 1:
        ev["also"] = layers[1:]
    teacher = any(not collapsed[la]["trained"] for la in layers) or bool(untrained)
    fix = (f"{first}'s rows (one per input) differ {fmt(c['ratio'])}x as much as its values do "
           f"({fmt(c['initial_ratio'])}x at initialisation): every input gets the same output, and the loss "
           "stalled with it. ")
    if teacher:
        fix += ("With a teacher or EMA target (DINO, iBOT, BYOL), the targets collapsed too: sharpen the teacher "
                "(a lower teacher temperature: DINO's 0.04, warmed up to at most 0.07), keep its centering on "
                "(a center momentum below 1, e.g. 0.9), raise the EMA momentum (0.996-0.9995 for small batches) "
                "and lower the learning rate; ")
    fix += ("BYOL/SimSiam need the stop-gradient on the target branch and the predictor; a variance term "
            "(VICReg) or Barlow Twins' off-diagonal weight (lambda > 0) keeps the embeddings apart. If the model "
            "is not self-supervised, its output ignores the input: check that the inputs differ and reach it")
    return [
        Finding(
            kind="representation_collapse",
            severity="warning",
            title=f"Representation collapse: {first} gives every input the same output since step {c['since']} "
            f"(rows differ {fmt(c['ratio'])}x as much as its values; {fmt(c['initial_ratio'])}x at step "
            f"{ctx.recorded_steps[0]}) while the loss stalled ({fmt(p['start'])} -> {fmt(p['end'])})",
            evidence=ev,
            suggestion=fix,
            steps=(c["since"], ctx.recorded_steps[-1]),
            layers=layers,
            source=SOURCE,
        )
    ]
