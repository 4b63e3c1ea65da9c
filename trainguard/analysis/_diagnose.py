"""``diagnose(run)``: every training-health rule over a run, plus an explicit verdict."""

from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np

# Importing the rule modules registers their rules.
from trainguard.analysis import _layer_rules, _loss_rules, _param_rules, _run_rules  # noqa: F401
from trainguard.analysis._context import Context, fmt, median
from trainguard.analysis._outcome import outcome_finding
from trainguard.analysis._rules import RULES
from trainguard.analysis._thresholds import Thresholds
from trainguard.store import Finding, sort_findings

log = logging.getLogger("trainguard.analysis")

# The monitor's rules, in the order they are run (the report sorts by severity anyway).
MONITOR_RULES = (
    "nonfinite_loss",
    "nonfinite_gradient",
    "loss_not_decreasing",
    "loss_oscillating",
    "loss_spike",
    "lr_too_high",
    "lr_too_low",
    "dead_units",
    "exploding_activations",
    "collapsed_activations",
    "saturated_activations",
    "vanishing_gradient",
    "exploding_gradient",
    "inputs_not_normalized",
    "param_no_gradient",
    "param_zero_gradient",
    "param_not_in_optimizer",
    "param_not_updating",
    "params_frozen",
    "gradients_accumulating",
    "eval_mode_in_training",
    "train_mode_in_eval",
    "grad_scaler_skips",
)


def diagnose(
    run: Any,
    thresholds: Thresholds | dict[str, float] | None = None,
    rules: list[str] | tuple[str, ...] | None = None,
) -> list[Finding]:
    """Judge a run's training health from what the monitor recorded; most severe finding first.

    ``run`` is a reader (``trainguard.open(path)``); ``thresholds`` overrides named thresholds
    (see :class:`Thresholds`); ``rules`` picks rules by name (default: all of the monitor's).
    The result always holds a verdict: either problems (warning and above), or one ``healthy``
    finding, or ``insufficient_data`` when the run has fewer than ``min_loss_points`` steps with a
    loss (a crashed run is a problem, never healthy).
    """
    th = Thresholds.from_overrides(thresholds)
    names = tuple(rules) if rules is not None else MONITOR_RULES
    unknown = [n for n in names if n not in RULES]
    if unknown:
        raise ValueError(f"unknown rule(s) {unknown}; known: {', '.join(sorted(RULES))}")
    ctx = Context(run, th)
    findings: list[Finding] = []
    for name in names:
        try:
            findings.extend(RULES[name](ctx))
        except Exception as exc:  # one broken rule must not hide the others
            log.exception("diagnosis rule %s failed", name)
            findings.append(
                Finding(kind="rule_error", severity="info", title=f"rule {name} failed: {type(exc).__name__}: {exc}",
                        source="monitor")
            )
    _fold_symptoms(findings)
    crash = outcome_finding(getattr(run, "meta", None) or {})
    if crash is not None:  # a script that raised is never healthy
        findings.append(crash)
    if not any(f.is_problem for f in findings):
        findings.append(_verdict(ctx))
    return sort_findings(findings)


# A symptom of the loss curve that another finding explains is kept, as info, pointing at its cause.
SYMPTOM_CAUSES = {
    "loss_not_decreasing": (
        "dead_units", "vanishing_gradient", "collapsed_activations", "saturated_activations",
        "exploding_activations", "lr_too_low", "lr_too_high", "param_not_updating", "param_no_gradient",
        "gradients_accumulating", "exploding_gradient",
    ),
    "loss_spike": ("exploding_gradient",),
    "loss_oscillating": ("lr_too_high",),
}


def _fold_symptoms(findings: list[Finding]) -> None:
    present = {f.kind for f in findings if f.is_problem}
    for f in findings:
        causes = [c for c in SYMPTOM_CAUSES.get(f.kind, ()) if c in present]
        if causes and f.is_problem:
            f.severity = "info"
            f.evidence["explained_by"] = causes
            f.title += f" (explained by {', '.join(causes)})"


def _verdict(ctx: Context) -> Finding:
    n = len(ctx.loss)
    if n < ctx.th.min_loss_points:
        # A few steps cannot tell a trend from minibatch noise: "loss 0.0247 -> 0.0432 over 3 steps"
        # is no evidence of health, whatever the layer statistics say.
        return Finding(
            kind="insufficient_data",
            severity="info",
            title=f"Not enough data to judge training health: {n} step(s) with a loss, "
            f"{int(ctx.th.min_loss_points)} needed",
            evidence={"loss_points": n, "needed": int(ctx.th.min_loss_points),
                      "recordings": len(ctx.recorded_steps)},
            suggestion="train under `trainguard.Monitor(model, logdir)` (or `trainguard monitor script.py`) for at "
            f"least {int(ctx.th.min_loss_points)} steps",
            source="monitor",
        )
    ev: dict = {"steps": n, "recordings": len(ctx.recorded_steps), "layers": len(ctx.layer_order)}
    if n:
        k = max(1, int(n * ctx.th.window_fraction))
        ev["loss_start"] = median(ctx.loss.values[:k])
        ev["loss_end"] = median(ctx.loss.values[-k:])
    if len(ctx.grad_norm):
        ev["grad_norm_median"] = median(ctx.grad_norm.values)
    ratios = ctx.update_ratio_by_step()
    if len(ratios):
        ev["update_ratio_median"] = median(ratios.values)
    dead = [median(ctx.window(ctx.stat(la, "activation", "dead_frac")).values)
            for la in ctx.layers_with("activation", "dead_frac")]
    dead = [d for d in dead if math.isfinite(d)]
    if dead:
        ev["max_dead_fraction"] = float(np.max(dead))
    title = "Training looks healthy"
    if "loss_start" in ev:
        title += f": loss {fmt(ev['loss_start'])} -> {fmt(ev['loss_end'])} over {n} steps"
    return Finding(
        kind="healthy",
        severity="info",
        title=title + ", no rule found a problem",
        evidence=ev,
        steps=(int(ctx.loss.steps[0]), int(ctx.loss.steps[-1])) if n else None,
        source="monitor",
    )
