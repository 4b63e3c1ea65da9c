"""Gradients through a recurrent loop: the ``through_time`` statistics the monitor keeps for a
layer called many times per forward pass (:mod:`trainguard.capture._monitor_time`)."""

from __future__ import annotations

import math

from trainguard.analysis._context import Context, fmt
from trainguard.analysis._rules import register_rule
from trainguard.analysis._suggest import clip_text
from trainguard.store import Finding

SOURCE = "monitor"
_GATED = frozenset({"GRU", "LSTM", "GRUCell", "LSTMCell"})  # torch's gated recurrent layers


@register_rule("gradient_explodes_through_time")
def gradient_explodes_through_time(ctx: Context) -> list[Finding]:
    th = ctx.th
    worst = None  # (ratio, layer, step, calls, growth)
    hits: dict[str, list[int]] = {}
    for layer in ctx.layers_with("through_time", "growth_per_call"):
        growth = ctx.stat(layer, "through_time", "growth_per_call")
        first = ctx.stat(layer, "through_time", "grad_first")
        last = ctx.stat(layer, "through_time", "grad_last")
        calls = ctx.stat(layer, "through_time", "calls")
        for k, step in enumerate(growth.steps.tolist()):
            g, f, la = float(growth.values[k]), first.at(step), last.at(step)
            if f is None or la is None or not (la > 0) or not math.isfinite(g):
                continue
            ratio = f / la
            if g >= th.tt_growth_per_call and ratio >= th.tt_explode_ratio:
                hits.setdefault(layer, []).append(int(step))
                if worst is None or ratio > worst[0]:
                    worst = (ratio, layer, int(step), int(calls.at(step) or 0), g)
    if worst is None:
        return []
    ratio, layer, step, calls, g = worst
    ev = {
        "layer": layer,
        "calls_per_forward": calls,
        "step": step,
        "grad_first_over_last": ratio,
        "growth_per_call": g,
        "recordings": {la: steps[:10] for la, steps in hits.items()},
        # a rate far too high that diverged no later explains it (_causes.IN_TRAINING)
        "began": min(s for v in hits.values() for s in v),
    }
    fixes = []
    clip = clip_text(ctx, before_step=None)
    if clip:
        fixes.append(clip)
    else:
        fixes.append("clip gradients with `torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)`")
    gated = sorted((name, t) for name, t in ctx.layer_type.items() if t in _GATED)
    if gated:  # the loop runs a gated cell already: its gates did not stop the growth
        name, t = gated[0]
        fixes.append(
            f"initialise the recurrent weights with gain <= 1 (`nn.init.orthogonal_({name}.weight_hh"
            f"{'' if t.endswith('Cell') else '_l0'})`; {name} is an nn.{t} already), or back-propagate through "
            "fewer time steps (truncated BPTT: `h = h.detach()` every k steps)"
        )
    else:
        fixes.append(
            "initialise the recurrent weights with gain <= 1 (`nn.init.orthogonal_(cell.weight)`), back-propagate "
            "through fewer time steps (truncated BPTT: `h = h.detach()` every k steps), or use nn.GRU / nn.LSTM"
        )
    return [
        Finding(
            kind="gradient_explodes_through_time",
            severity="error",
            title=f"Gradients explode through time in {', '.join(sorted(hits))} (called {calls} times per forward): "
            "the gradient at the "
            f"first call is {fmt(ratio)}x the gradient at the last, x{g:.2f} per time step (step {step})",
            evidence=ev,
            suggestion="; ".join(fixes),
            steps=(min(s for v in hits.values() for s in v), max(s for v in hits.values() for s in v)),
            layers=sorted(hits),
            source=SOURCE,
        )
    ]
