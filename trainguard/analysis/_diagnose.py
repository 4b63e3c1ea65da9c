"""``diagnose(run)``: every training-health rule over a run, plus an explicit verdict."""

from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np

# Importing the rule modules registers their rules.
from trainguard.analysis import (  # noqa: F401
    _axis_rules,
    _buffer_rules,
    _chance_rules,
    _collapse_rules,
    _function_rules,
    _graph_rules,
    _layer_rules,
    _loss_rules,
    _param_rules,
    _run_rules,
    _target_rules,
    _time_rules,
    _val_rules,
)
from trainguard.analysis._causes import explain
from trainguard.analysis._context import Context, fmt, median
from trainguard.analysis._layer_rules import dead_series
from trainguard.analysis._outcome import NONFINITE_KINDS, harm_finding, interruption_finding, outcome_finding
from trainguard.analysis._rules import RULES
from trainguard.analysis._thresholds import Thresholds
from trainguard.store import Finding, sort_findings

log = logging.getLogger("trainguard.analysis")

# The monitor's rules, in the order they are run (the report sorts by severity anyway).
MONITOR_RULES = (
    "losses_summed",
    "loss_changes_sign",
    "objectives_in_sequence",
    "models_in_sequence",
    "nonfinite_loss",
    "nonfinite_gradient",
    "loss_not_decreasing",
    "loss_saturated",
    "loss_above_chance",
    "accumulation_not_averaged",
    "muon_on_embedding",
    "loss_oscillating",
    "loss_spike",
    "lr_too_high",
    "lr_too_low",
    "rewards_too_large",
    "dead_units",
    "exploding_activations",
    "collapsed_activations",
    "representation_collapse",
    "target_collapse",
    "codebook_collapse",
    "posterior_collapse",
    "saturated_activations",
    "vanishing_gradient",
    "exploding_gradient",
    "inputs_not_normalized",
    "model_not_trained",
    "param_no_gradient",
    "param_zero_gradient",
    "param_not_in_optimizer",
    "param_not_updating",
    "params_frozen",
    "buffer_not_updated",
    "gradients_accumulating",
    "eval_mode_in_training",
    "train_mode_in_eval",
    "grad_scaler_skips",
    "iterations_skipped",
    "replicas_not_synchronized",
    "checkpoint_misses_loss_params",
    # loss misuse read off the op graph (analysis/_graph_rules.py)
    "loss_broadcast",
    "per_sample_broadcast",  # analysis/_axis_rules.py
    "targets_out_of_range",
    "softmax_before_cross_entropy",
    "sigmoid_before_bce_with_logits",
    "nll_loss_on_probabilities",
    "nll_loss_on_logits",
    "cross_entropy_targets_not_probabilities",
    "bce_targets_not_probabilities",
    "cross_entropy_one_class",
    "ctc_loss_on_probabilities",
    "ctc_loss_on_logits",
    "ctc_log_softmax_wrong_dim",
    "ctc_targets_zeroed",
    "padding_in_loss",
    "dice_not_probabilities",
    # custom autograd Functions checked live (analysis/_function_rules.py)
    "custom_gradient_wrong",
    "nonfinite_val_loss",
    "overfitting",
    "labels_unrelated",
    "labels_one_class",
    "train_val_leakage",
    "gradient_explodes_through_time",
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
    loss (``no_model_called`` when backward() ran but no module was called as ``module(x)``; a
    crashed run is a problem, never healthy).
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
    explain(findings)  # causes over symptoms
    crash = outcome_finding(getattr(run, "meta", None) or {})
    if crash is not None:  # a script that raised is never healthy
        findings.append(crash)
    if not any(f.kind in NONFINITE_KINDS for f in findings):
        harm = harm_finding(run)  # a NaN only the validation metric and the scheduler read is no health either
        if harm is not None:
            findings.append(harm)
    stopped = interruption_finding(getattr(run, "meta", None) or {})
    if stopped is not None:
        findings.append(stopped)
    if not any(f.is_problem for f in findings):
        findings.append(_verdict(ctx, untrended=any(f.kind in UNTRENDED for f in findings)))
    return sort_findings(findings)


# Findings that say the loss's trend is not judged (a surrogate, a sum of separate objectives,
# several models' losses one after another).
UNTRENDED = ("loss_changes_sign", "losses_summed", "models_in_sequence")


def _verdict(ctx: Context, untrended: bool = False) -> Finding:
    n = len(ctx.loss)
    func_model = ctx.meta.get("torch_func_model")
    if not n and func_model:
        return Finding(
            kind="model_in_torch_func",
            severity="info",
            title=f"The script called its model ({func_model}) only through torch.func (functional_call under vmap "
            "or grad, as model ensembles and per-sample gradients do): its trained parameters are plain tensors "
            "outside any nn.Module, so the monitor watched no layer, gradient or loss",
            evidence={"model": func_model, "backward_calls": int(ctx.meta.get("unattached_backwards") or 0),
                      "loss_points": 0},
            suggestion="the recorder still sees every op (`trainguard run --check-numerics script.py` stops at the "
            "first harmful NaN/Inf); to judge training health, monitor one member trained as a module: "
            "`trainguard.Monitor(model, logdir)` around a loop that calls model(x)",
            source="monitor",
        )
    unattached = int(ctx.meta.get("unattached_backwards") or 0)
    outside = int(ctx.meta.get("parameters_outside_modules") or 0)
    if not n and unattached and outside:
        return Finding(
            kind="no_model_parameters",
            severity="warning",
            title=f"The script ran {unattached:,} backward() pass(es) into {outside} parameter tensor(s) that no "
            "nn.Module holds (pyro.param sites, tensors made with requires_grad=True): the monitor watches "
            "modules, so it watched nothing",
            evidence={"backward_calls": unattached, "parameters_outside_modules": outside, "loss_points": 0},
            suggestion="hold the parameters in an nn.Module called as module(x) (nn.Parameter attributes; in pyro, "
            "a PyroModule with PyroParam attributes, or an autoguide, in place of pyro.param sites); the recorder "
            "still sees every op (`trainguard run --check-numerics script.py` stops at the first harmful NaN/Inf)",
            source="monitor",
        )
    if not n and unattached:
        return Finding(
            kind="no_model_called",
            severity="warning",
            title=f"The script ran {unattached:,} backward() pass(es) but called no nn.Module as module(x): "
            "a direct .forward(x) call skips the hooks the monitor finds models by, so it watched nothing",
            evidence={"backward_calls": unattached, "loss_points": 0},
            suggestion="call each module as layer(x), not layer.forward(x) (module hooks, torch.compile and "
            "every tool's instrumentation go through module(x)); or give the model: "
            "`trainguard.Monitor(model, logdir)`, with its layers in an nn.ModuleList so that it owns them",
            source="monitor",
        )
    children = int((getattr(ctx.run, "meta", None) or {}).get("untraced_children") or 0)
    if not n and children:
        return Finding(
            kind="trained_in_child_processes",
            severity="info",
            title=f"The script trained in {children} child process{'es' if children > 1 else ''} that trainguard "
            "did not follow (multiprocessing.Process, as Hogwild does) and ran no backward() itself: nothing of "
            "the training was watched",
            evidence={"child_processes": children, "loss_points": 0},
            suggestion="open `trainguard.Monitor(model, logdir)` (or `trainguard.record`) inside the function each "
            "process runs, with a logdir of its own per process; `torch.multiprocessing.spawn`'s processes and "
            "torchrun's ranks (`trainguard run --nproc-per-node N`) are followed",
            source="monitor",
        )
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
    dead = [median(ctx.window(dead_series(ctx, la)).values)
            for la in ctx.layers_with("activation", "dead_frac")]
    dead = [d for d in dead if math.isfinite(d)]
    if dead:
        ev["max_dead_fraction"] = float(np.max(dead))
    title = "Training looks healthy"
    if ctx.undone_before:
        ev["undone_steps"] = ctx.undone_before
    if untrended:  # its start and end would read as a trend
        title += f" over {n} steps (the loss's trend is not judged)"
    elif "loss_start" in ev:
        title += f": loss {fmt(ev['loss_start'])} -> {fmt(ev['loss_end'])} over {n} steps"
    if ctx.undone_before:
        # an LR range test's divergence is its purpose, not the run's
        title += (f" (steps 0-{ctx.undone_before - 1} are not judged: the model's weights were loaded back "
                  f"after them, as an LR range test such as fastai's lr_find does)")
    title += ", no rule found a problem"
    # What the verdict could not look at (Keras 3 on torch: layers that are no torch modules, a rate
    # kept in a Keras Variable): said, not left to "layers: 0" and a missing lr/0.
    unseen = []
    if ctx.params and not ctx.layer_order:
        unseen.append("activations")
    if ctx.params and not ctx.lrs:
        unseen.append("learning_rate")
    if unseen:
        ev["not_judged"] = unseen
        title += " it could judge (" + "; ".join(
            {"activations": f"no layer's activations were recorded, though {len(ctx.params)} parameters were "
                            "watched: the model's layers are no torch modules, as Keras', or none ran under the "
                            "monitor; no activation rule ran",
             "learning_rate": "no learning rate was seen: no torch.optim optimizer stepped, so no rule read the "
                              "rate"}[u] for u in unseen) + ")"
    return Finding(
        kind="healthy",
        severity="info",
        title=title,
        evidence=ev,
        steps=(int(ctx.loss.steps[0]), int(ctx.loss.steps[-1])) if n else None,
        source="monitor",
    )
