"""A cross entropy that stays above chance: worse than a uniform guess over its C classes.

A uniform guess loses ln C whatever the targets are (hard labels, label-smoothed or mixed ones: any
distribution over the C classes). A model that starts far above it is confidently wrong at
initialisation (an output layer or tied embedding initialised with std 1, a missing 1/sqrt(d), a
temperature that multiplies the logits) and a run that ends still above it has spent its steps
undoing that. Judged only where the loss is KNOWN to be that cross entropy and nothing else: the
loss watch (``capture/_loss_watch.py``) recomputed one head's value per inspected backward and
found it equal to the loss backward ran on.
"""

from __future__ import annotations

import math

from trainguard.analysis._context import Context, fmt
from trainguard.analysis._loss_rules import finite_loss, progress
from trainguard.analysis._origin import _python_ref
from trainguard.analysis._rules import register_rule
from trainguard.store import Finding

SOURCE = "monitor"

# The loss backward ran on and the head's own cross entropy agree to this fraction: the loss is that
# cross entropy (float32 against the float64 recomputation), not a sum of it and other terms.
_SAME = 1e-3
# Soft targets sum to 1 per row to this tolerance: a distribution over the classes.
_ROW_SUM = 1e-3


def _valid_head(h: dict) -> bool:
    """A per-row mean cross entropy whose value the loss watch recomputed: ``nll_loss`` with
    ``reduction="mean"``, or a soft-target one whose targets are a distribution over the classes."""
    facts = h.get("facts")
    if not isinstance(facts, dict):
        return False
    if not all(isinstance(facts.get(k), (int, float)) and math.isfinite(facts[k]) for k in ("value", "loss")):
        return False
    if h.get("loss") == "nll_loss":
        return h.get("reduction") == "mean"
    if h.get("loss") == "soft_cross_entropy":
        sums = (facts.get("row_sum_max"), facts.get("row_sum_min"))
        return (all(isinstance(v, (int, float)) and abs(v - 1) <= _ROW_SUM for v in sums)
                and isinstance(facts.get("target_min"), (int, float)) and facts["target_min"] >= 0)
    return False


def _cross_entropy_heads(ctx: Context) -> list[dict] | None:
    """The heads of every inspected loss graph, when each is a per-row mean cross entropy (see
    ``_valid_head``) and the loss backward ran on is their mean (one head's value; CLIP's symmetric
    loss, the mean of its image and text cross entropies): a uniform guess then loses ln C. None
    when any is not: a sum, a loss with other terms, a mixup weighting two cross entropies unequally,
    targets that are no distribution."""
    recs = ctx.run.meta.get("loss_graph") or []
    heads: list[dict] = []
    for rec in recs:
        hs = [h for h in rec.get("heads") or [] if isinstance(h, dict)]
        if not hs or len(hs) != len(rec.get("heads") or []) or not all(_valid_head(h) for h in hs):
            return None
        loss = hs[0]["facts"]["loss"]
        mean = sum(h["facts"]["value"] for h in hs) / len(hs)
        if abs(loss - mean) > _SAME * max(1.0, abs(mean)):
            return None
        heads.extend(hs)
    return heads or None


@register_rule("loss_above_chance")
def loss_above_chance(ctx: Context) -> list[Finding]:
    classes = ctx.loss_classes()
    if classes is None or not ctx.weights_initial:
        return []
    heads = _cross_entropy_heads(ctx)
    if heads is None or any(h.get("classes") != classes for h in heads):
        return []
    prog = progress(ctx)  # None for a run too short to judge its end (min_loss_points)
    loss = finite_loss(ctx)
    if prog is None or not len(loss):
        return []
    chance = math.log(classes)
    bar = ctx.th.loss_above_chance_ratio * chance
    first = float(loss.values[0])
    if not (first > bar and prog["start"] > bar and prog["end"] > bar):
        return []
    ev = {
        "classes": classes,
        "chance": chance,
        "first_loss": first,
        "loss_start": prog["start"],
        "loss_end": prog["end"],
        "steps": prog["steps"],
    }
    std = heads[0]["facts"].get("logit_std")
    if isinstance(std, (int, float)) and math.isfinite(std):
        ev["logit_std"] = float(std)
    layer, tied = ctx.output_layer(classes)
    if layer is not None:
        ev["output_layer"] = layer
    if tied is not None:
        ev["tied_to"] = tied
        init = ctx.weight_init_check(tied)
        if init is not None:
            ev["tied_weight_rms"] = init["rms"]
    spread = f", logits spread with std {fmt(ev['logit_std'])} over a row" if "logit_std" in ev else ""
    title = (f"The cross-entropy stays above chance: {fmt(prog['start'])} -> {fmt(prog['end'])} over "
             f"{len(loss)} steps, where a uniform guess over its {classes} classes loses ln {classes} = {fmt(chance)}: "
             f"the model is confidently wrong from its initialisation{spread}")
    if tied is not None:
        rms = f" (its values have RMS {fmt(ev['tied_weight_rms'])})" if "tied_weight_rms" in ev else ""
        suggestion = (f"the output layer `{layer}` shares its weight with `{tied}`{rms}, so its logits are as large as "
                      f"the embedding's rows (nn.Embedding starts them N(0, 1)); initialise the shared weight small, "
                      f"`nn.init.normal_(model{_python_ref(tied)}, std=0.02)` as GPT-2 does, or scale the logits down by "
                      "1/sqrt(d_model) (`logits = logits * d_model ** -0.5`); the loss then starts near ln C")
    elif layer is not None:
        suggestion = (f"initialise the output layer `{layer}` small (`nn.init.normal_(model{_python_ref(layer)}.weight, std=0.02)` "
                      "as GPT-2 does, or `nn.init.zeros_`), and check that no missing 1/sqrt(d) scale or temperature "
                      "multiplies the logits; the loss then starts near ln C")
    else:  # no layer has C outputs: the logits are a product (a contrastive loss's similarities)
        suggestion = ("check the scale that multiplies the logits (a contrastive loss's temperature or logit scale: "
                      "CLIP's starts at 1/0.07 = 14.3, on unit-length features; a missing 1/sqrt(d) on dot products), "
                      "or initialise the layer that makes them small (`nn.init.normal_(weight, std=0.02)` as GPT-2 "
                      "does); the loss then starts near ln C")
    return [Finding(kind="loss_above_chance", severity="warning", title=title, evidence=ev, suggestion=suggestion,
                    steps=prog["steps"], layers=[layer] if layer else [], source=SOURCE)]


# The first step's loss over one backward's loss lies this close to a whole number of backward passes.
_WHOLE = 0.05


@register_rule("accumulation_not_averaged")
def accumulation_not_averaged(ctx: Context) -> list[Finding]:
    """Several ``backward()`` calls accumulate into one step, each on a mean cross entropy divided by
    d, while the step holds k of them, d != k: the gradients are k/d times the batch's mean (the
    step's loss, the sum of what backward ran on, is k/d times the cross entropy). Read off the
    loss watch's first backward passes (one mean cross-entropy head each, the same divisor) and the
    first step's loss (the sum of its backward passes' losses)."""
    if ctx.losses_summed or ctx.objectives_in_sequence is not None or ctx.models_in_sequence:
        return []
    recs = ctx.run.meta.get("loss_graph") or []
    if len(recs) < 2 or not len(ctx.loss):
        return []
    divisors, losses = [], []
    for rec in recs:
        hs = rec.get("heads") or []
        if len(hs) != 1 or not isinstance(hs[0], dict) or not _valid_head(hs[0]):
            return []
        facts = hs[0]["facts"]
        if not (facts["loss"] > 0 and facts["value"] > 0):
            return []
        divisors.append(facts["value"] / facts["loss"])
        losses.append(facts["loss"])
    d = sorted(divisors)[len(divisors) // 2]
    if any(abs(x - d) > _SAME * 10 * d for x in divisors):
        return []
    first = float(ctx.loss.values[0])
    per_backward = sorted(losses)[len(losses) // 2]
    if not math.isfinite(first):
        return []
    k_est = first / per_backward
    k = round(k_est)
    if k < 2 or abs(k_est - k) > _WHOLE * k or abs(d - k) <= _WHOLE * k:
        return []
    at = recs[0].get("backward_at") or {}
    where = f" before `backward()` at {at['file']}:{at['line']}" if at.get("file") and at.get("line") else ""
    scale = k / d
    ev = {"backward_per_step": k, "divisor": d, "gradient_scale": scale, "first_loss": first,
          "backward_loss": per_backward, "cross_entropy": per_backward * d}
    how = "the full mean loss" if abs(d - 1) <= _WHOLE else f"the loss divided by {fmt(d)}"
    title = (f"Gradient accumulation: each of the {k} backward() calls of a step runs on {how}, not on the loss "
             f"divided by {k}: the gradients are {fmt(scale)}x the accumulated batch's mean, and the step's loss "
             f"({fmt(first)} at step {ctx.loss.steps[0]}) is {fmt(scale)}x its cross-entropy")
    effect = (f"under SGD the step is {fmt(scale)}x what the rate says, and with Adam or Muon, which normalise its "
              "size, a clip norm, epsilon and the logged loss still see the scaled values")
    trainer = ctx.meta.get("trainer") or {}
    if trainer.get("framework") == "transformers" and trainer.get("accepts_loss_kwargs"):
        # The HF Trainer's own backward: it passed num_items_in_batch and left the division to a
        # model whose forward takes **kwargs, and this model's loss is a plain mean.
        model = trainer.get("model") or "the model"
        suggestion = (f"the Trainer passes `num_items_in_batch` to {model}, whose forward takes **kwargs, and so "
                      f"does not divide the loss by gradient_accumulation_steps ({k}); its loss is a plain mean "
                      "that ignores that count. Set `model.accepts_loss_kwargs = False` before building the "
                      "Trainer (it then divides), or give the Trainer a `compute_loss_func` that sums the loss "
                      f"and divides by num_items_in_batch; {effect}")
    else:
        suggestion = (f"divide each micro-batch's loss by the number of backward() calls per step{where}: "
                      f"`loss = loss / {k}` (nanochat's `loss / grad_accum_steps`); {effect}")
    return [Finding(kind="accumulation_not_averaged", severity="warning", title=title, evidence=ev,
                    suggestion=suggestion, steps=(int(ctx.loss.steps[0]), int(ctx.loss.steps[0])), source=SOURCE)]
