"""Causes over symptoms: when several rules fire, the finding that explains the others comes first.

``EXPLAINS`` says which findings a cause explains: a learning rate far too low (update ratio
1e-7) explains a loss that does not decrease; ``IN_TRAINING`` adds the layer findings a cause
explains when they arose in training (a rate far too high and the units its updates killed);
gradients growing through the time steps of a
recurrent loop explain a "learning rate too high", "vanishing" or "exploding" verdict read off
the parameters. :func:`explain` (run by ``diagnose``) lowers each explained finding to ``info``,
with ``evidence["explained_by"]``, and gives its root cause ``evidence["explains"]`` and the
highest severity among the findings it explains, so the cause sorts first. :func:`fold` nests
the explained findings under their root cause (``"symptoms"``): what the terminal report,
``--json`` and the UI show.
"""

from __future__ import annotations

from typing import Any

from trainguard.store import SEVERITIES, Finding

# cause -> the findings it explains. Acyclic: a chain (A explains B explains C) folds C and B
# under A.
EXPLAINS: dict[str, tuple[str, ...]] = {
    "gradient_explodes_through_time": (
        "exploding_gradient", "lr_too_high", "vanishing_gradient", "loss_spike", "loss_oscillating",
        "loss_not_decreasing", "exploding_activations",
    ),
    "labels_unrelated": ("overfitting", "loss_not_decreasing"),
    "dead_units": ("loss_not_decreasing",),
    "vanishing_gradient": ("loss_not_decreasing",),
    "collapsed_activations": ("loss_not_decreasing",),
    "representation_collapse": ("loss_not_decreasing",),
    "saturated_activations": ("loss_not_decreasing",),
    "exploding_activations": ("loss_not_decreasing",),
    "lr_too_low": ("loss_not_decreasing",),
    # the critic's gradient dwarfs the actor's (and a clip over all parameters scales the actor's to
    # nothing: SB3's PPO at rewards 1e6x, first/last relative gradient 1e-11): "vanishing" by comparison
    "rewards_too_large": ("loss_not_decreasing", "exploding_gradient", "loss_spike", "vanishing_gradient"),
    "lr_too_high": ("loss_not_decreasing", "loss_oscillating"),
    "param_not_updating": ("loss_not_decreasing",),
    "param_no_gradient": ("loss_not_decreasing",),
    "param_zero_gradient": ("loss_not_decreasing",),
    "param_not_in_optimizer": ("loss_not_decreasing",),
    "gradients_accumulating": ("loss_not_decreasing",),
    "exploding_gradient": ("loss_not_decreasing", "loss_spike"),
    "codebook_collapse": ("loss_not_decreasing",),
    # a prediction pinned at its sigmoid's bound against targets in other units: the loss cannot fall
    "targets_out_of_range": ("loss_not_decreasing", "lr_too_low", "loss_spike"),
    # the step's loss sums k undivided mean losses: k times the cross entropy, "above chance" by k
    "accumulation_not_averaged": ("loss_above_chance",),
}
# cause -> the layer findings it explains only when they arose in training (evidence
# "arose_in_training": in range at step 0, then the updates did it). Units dead or activations
# exploding from initialisation need a new init whatever the learning rate.
# Gradients that began to explode (evidence "began") no earlier than the loss diverged under a
# rate far too high (its evidence "divergence") are the updates' doing too, and so is a gradient
# norm that overflowed as they exploded (nonfinite_gradient's "began"; a NaN made in the backward
# pass has none); the gradient cliffs of an unclipped RNN come first, and stay a cause of their own.
# So are loss spikes that began no earlier than that divergence (Time-Series-Library's Autoformer at
# lr 0.5 spiked 46x at step 13, its loss already 1e6 times its initial value since step 1).
# Gradients growing through a loop only after that divergence are the blown-up weights' doing too
# (pytorch-tabnet at lr 10: its shared layers' first/last ratio 1.2-1.4 until the loss went 0.87 ->
# 460, then 4e13 once the network had collapsed); such a relation, where it holds, wins over the
# reverse one in EXPLAINS (a loop exploding from the start explains the rate).
IN_TRAINING: dict[str, tuple[str, ...]] = {
    "lr_too_high": ("dead_units", "exploding_activations", "collapsed_activations", "representation_collapse",
                    "saturated_activations", "vanishing_gradient", "exploding_gradient", "nonfinite_gradient",
                    "loss_spike", "gradient_explodes_through_time", "codebook_collapse"),
}
# cause -> the layer findings it explains only when every layer they name comes after the cause's
# layer in its model (evidence "downstream"): a collapsed codebook feeds its decoder one input, whose
# ReLUs are then off for every sample (zalandoresearch/pytorch-vq-vae: 59% of the decoder's
# _res._block.0 "dead"); units dead before the quantizer are a problem of their own.
DOWNSTREAM: dict[str, tuple[str, ...]] = {
    "codebook_collapse": ("dead_units", "collapsed_activations", "representation_collapse",
                          "saturated_activations"),
}
# Inputs beyond float16's comfort explain mixed precision's overflows, while a GradScaler skips steps
# (float16 autocast): milesial/Pytorch-UNet's --amp on raw 16-bit images (up to 65535; float16's
# largest is 65504) made the loss NaN at step 3 and skipped most steps, and those findings led the
# report with generic advice. Inputs off the units' scale but far inside float16's (a mean of 40)
# are no cause of an overflow.
FP16_INPUT_SYMPTOMS: tuple[str, ...] = ("grad_scaler_skips", "nonfinite_loss", "nonfinite_gradient")
FP16_INPUT_MAX = 1024.0  # a first layer summing a few dozen such values leaves float16's range
# A wrong custom gradient and a misused loss function explain what the curves and layers show
# (analysis/_function_rules.py, _graph_rules.py): they are read off the graph, not the numbers.
_GRAPH_SYMPTOMS = ("loss_not_decreasing", "loss_spike", "loss_oscillating", "lr_too_high", "lr_too_low",
                   "exploding_activations", "exploding_gradient", "vanishing_gradient", "saturated_activations")
for _cause in ("custom_gradient_wrong", "softmax_before_cross_entropy", "sigmoid_before_bce_with_logits",
               "nll_loss_on_probabilities", "nll_loss_on_logits", "cross_entropy_targets_not_probabilities",
               "bce_targets_not_probabilities", "dice_not_probabilities",
               "loss_broadcast", "ctc_loss_on_probabilities", "ctc_loss_on_logits", "ctc_log_softmax_wrong_dim"):
    EXPLAINS[_cause] = _GRAPH_SYMPTOMS
# A loss over one class is 0 whatever the weights: no gradient reaches them.
EXPLAINS["cross_entropy_one_class"] = (*_GRAPH_SYMPTOMS, "param_zero_gradient")

_RANK = {s: i for i, s in enumerate(SEVERITIES)}


def explain(findings: list[Finding]) -> None:
    """Mark, in place, which problems explain which (see the module docstring)."""
    problems = {f.kind: f for f in findings if f.is_problem}
    causes = {kind: _causes_of(f, problems) for kind, f in problems.items()}
    original = {kind: f.severity for kind, f in problems.items()}
    for kind, f in problems.items():
        if not causes[kind]:
            continue
        root = _root(kind, causes)
        f.severity = "info"
        f.evidence["explained_by"] = causes[kind]
        f.title += f" (explained by {', '.join(causes[kind])})"
        cause = problems[root]
        cause.evidence.setdefault("explains", []).append(kind)
        if _RANK[original[kind]] > _RANK[cause.severity]:
            cause.severity = original[kind]


def _causes_of(f: Finding, problems: dict[str, Finding]) -> list[str]:
    kind = f.kind
    out = [c for c, explained in EXPLAINS.items() if kind in explained and c in problems and c != kind
           and not (c in IN_TRAINING.get(kind, ()) and _arose_after(f, problems[c]))]
    out += [c for c, explained in IN_TRAINING.items()
            if kind in explained and c in problems and c not in out and _arose_after(problems[c], f)]
    out += [c for c, explained in DOWNSTREAM.items()
            if kind in explained and c in problems and c not in out and _downstream(problems[c], f)]
    if kind == "param_zero_gradient" and "nonfinite_loss" in problems and "nonfinite_loss" not in out \
            and _never_finite(problems["nonfinite_loss"]):
        out.append("nonfinite_loss")
    if kind in FP16_INPUT_SYMPTOMS and "inputs_not_normalized" in problems and "inputs_not_normalized" not in out \
            and "grad_scaler_skips" in problems and fp16_inputs(problems["inputs_not_normalized"].evidence):
        out.append("inputs_not_normalized")
    return out


def fp16_inputs(evidence: dict) -> bool:
    """Whether inputs_not_normalized's statistics reach values a float16 first layer overflows on."""
    top = max((abs(v) for v in (evidence.get("min"), evidence.get("max")) if isinstance(v, (int, float))),
              default=0.0)
    return top >= FP16_INPUT_MAX


def _downstream(cause: Finding, f: Finding) -> bool:
    after = set(cause.evidence.get("downstream") or ())
    return bool(f.layers) and all(la in after for la in f.layers)


def _arose_after(cause: Finding, f: Finding) -> bool:
    if f.evidence.get("arose_in_training"):
        return True
    began, div = f.evidence.get("began"), cause.evidence.get("divergence")
    return began is not None and isinstance(div, dict) and div.get("step") is not None and div["step"] <= began


def _never_finite(f: Finding) -> bool:
    """A loss non-finite at every step: no gradient it made says anything of the model (a mean over no
    counted target, 0/0, backpropagates zeros: run_mlm.py with mlm_probability 0)."""
    n, steps = f.evidence.get("nonfinite_steps"), f.evidence.get("steps")
    return isinstance(n, int) and n > 0 and n == steps


def _root(kind: str, causes: dict[str, list[str]]) -> str:
    seen = {kind}
    while causes.get(kind):
        nxt = causes[kind][0]
        if nxt in seen:  # EXPLAINS is acyclic; stay safe if a caller's table is not
            break
        seen.add(nxt)
        kind = nxt
    return kind


def fold(findings: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Findings (dicts, in display order) with each explained one nested under its root cause's
    ``"symptoms"``; a finding whose cause is absent stays where it is."""
    by_kind = {f.get("kind"): f for f in findings}
    causes = {f.get("kind"): [c for c in ((f.get("evidence") or {}).get("explained_by") or []) if c in by_kind]
              for f in findings}
    out: list[dict[str, Any]] = []
    nested: dict[str, list[dict]] = {}
    for f in findings:
        kind = f.get("kind")
        if causes.get(kind):
            nested.setdefault(_root(kind, causes), []).append(f)
        else:
            out.append(f)
    return [dict(f, symptoms=nested[f["kind"]]) if f.get("kind") in nested else f for f in out]


def unfold(findings: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The inverse of :func:`fold`: every finding at the top level, symptoms after their cause."""
    out: list[dict[str, Any]] = []
    for f in findings:
        symptoms = f.get("symptoms") or []
        out.append({k: v for k, v in f.items() if k != "symptoms"})
        out.extend(unfold(symptoms))
    return out
