"""Rules over the per-step loss, gradient norm and learning rate."""

from __future__ import annotations

import math

import numpy as np

from trainguard.analysis._context import Context, Series, fmt, median, rolling_median
from trainguard.analysis._layer_rules import gradient_blocked
from trainguard.analysis._param_rules import _names, frozen_copies, moving_targets
from trainguard.analysis._rules import register_rule
from trainguard.analysis._suggest import (
    ADAPTIVE_FIRST_UPDATE_RATIO,
    LR_RANGE_TEST,
    SCHEDULE_PEAK_GAP,
    TARGET_UPDATE_RATIO,
    clip_text,
    lr_higher,
    lr_lower,
    op_fix,
    origin_of,
    where,
)
from trainguard.store import Finding

SOURCE = "monitor"


def _first_nonfinite(s: Series) -> int | None:
    bad = np.nonzero(~np.isfinite(s.values))[0]
    return int(s.steps[bad[0]]) if len(bad) else None


def finite_loss(ctx: Context) -> Series:
    """The loss up to its first non-finite value; nothing when it sums separate objectives or
    changes sign from step to step or strings them (or several models' losses) one after another
    (the trend rules then judge nothing: see ``losses_summed``, ``loss_changes_sign``,
    ``objectives_in_sequence`` and ``models_in_sequence``)."""
    if (ctx.losses_summed or ctx.objectives_in_sequence is not None or ctx.models_in_sequence
            or sign_changes(ctx)):
        return Series.of([])
    first = _first_nonfinite(ctx.loss)
    return ctx.loss if first is None else ctx.loss.before(first)


# At least this many sign changes, whatever the run's length: a loss falling through 0 may cross
# back once or twice in its noise.
_MIN_SIGN_CHANGES = 3


def sign_changes(ctx: Context) -> dict | None:
    """How often the finite loss changes sign between consecutive steps, when that is often enough
    to make it a surrogate objective (its value is not an error training drives toward 0)."""
    first = _first_nonfinite(ctx.loss)
    vals = (ctx.loss if first is None else ctx.loss.before(first)).values
    signs = np.sign(vals[vals != 0])
    pairs = len(signs) - 1
    changes = int(np.count_nonzero(signs[1:] != signs[:-1])) if pairs > 0 else 0
    if changes < _MIN_SIGN_CHANGES or changes < ctx.th.loss_sign_changes * pairs:
        return None
    return {"sign_changes": changes, "pairs": pairs, "negative_steps": int(np.count_nonzero(signs < 0))}


def progress(ctx: Context) -> dict | None:
    """How far the loss came down: start level, best smoothed level, end level, relative progress."""
    loss = finite_loss(ctx)
    n = len(loss)
    if n < ctx.th.min_loss_points:
        return None
    w = max(3, int(n * ctx.th.window_fraction))
    start = float(np.median(loss.values[:w]))
    end = float(np.median(loss.values[-w:]))
    best = float(np.min(rolling_median(loss.values, w)))
    scale = max(abs(start), 1e-12)
    return {
        "start": start,
        "best": best,
        "end": end,
        "progress": (start - best) / scale,
        "window": w,
        "steps": (int(loss.steps[0]), int(loss.steps[-1])),
    }


# Losses the initial level of a noisy loss is the median of (see ``loss_noisy``).
_NOISY_START = 5


def log_noise(vals: np.ndarray) -> float | None:
    """The robust spread of a positive loss's log around its local level (the MAD of its distance
    from the median of the 5 steps around it: a trend, however steep, and a few spikes barely move
    it), or None for a loss not positive."""
    if len(vals) < 5 or not np.all(vals > 0):
        return None
    logs = np.log(vals)
    return 1.4826 * float(np.median(np.abs(logs[2:-2] - rolling_median(logs, 5))))


def diverged(ctx: Context) -> dict | None:
    """Where the smoothed loss first rose above ``loss_diverge_ratio`` times its initial value.

    The initial value is the first loss, the only one no update has touched; a loss noisier than
    ``loss_noisy`` (one whose value is mostly a random draw, as a diffusion loss at random
    timesteps) starts at the median of its first steps instead, and must stay above the bar."""
    loss = finite_loss(ctx)  # a non-finite loss is reported on its own
    if len(loss) < 6:
        return None
    vals = loss.values
    init = vals[0]
    if not math.isfinite(init) or init <= 0:
        return None
    noise = log_noise(vals)
    noisy = noise is not None and noise > ctx.th.loss_noisy and not _first_update_rewrote(ctx, loss)
    apart = not noisy and _first_batch_apart(ctx, loss)
    if noisy:
        init = float(np.median(vals[:_NOISY_START]))
    elif apart:
        init = float(np.median(vals[1:1 + _NOISY_START]))
    bar = ctx.th.loss_diverge_ratio * init
    classes = ctx.loss_classes()
    if classes and init < math.log(classes):
        # An untrained model beat a uniform guess: the task started easy (MoCo's queue of random
        # negatives) and a loss rising toward chance is the task growing harder, not the updates
        # making the model worse; a rate that diverges drives cross-entropy past chance.
        bar = max(bar, math.log(classes))
    smooth = rolling_median(vals[1:], 5)
    over = np.nonzero(smooth > bar)[0]
    if not len(over):
        return None
    i = int(over[0])
    if noisy and float(np.median(vals[1 + i:])) <= bar:
        return None  # most of what follows is back below the bar: the noise's excursion, undone
    # The window's median is over the bar, so most of its losses are: the step is the first of
    # them, where the loss rose (the window's first step may be one before anything rose).
    at = 1 + i + int(np.argmax(vals[1 + i:1 + i + 5] > bar))
    # update_step: the step whose update the loss rose after (its rate is the one that diverged)
    out = {"initial_loss": float(init), "step": int(loss.steps[at]), "smoothed_loss": float(smooth[i]),
           "update_step": int(loss.steps[at - 1])}
    if noisy:
        out["initial_steps"] = _NOISY_START  # the median of these: the first loss is one noisy draw
        out["log_noise"] = noise
    elif apart:
        out["first_loss_apart"] = float(vals[0])  # the initial level is steps 1-5's (see _first_batch_apart)
    return out


def _first_update_rewrote(ctx: Context, loss) -> bool:
    """The next losses lie above ``loss_diverge_ratio`` times the first, and the update between
    them moved the weights by ``update_ratio_high`` of their norm or more: the jumps that follow
    are the update's doing, not a noisy loss whose first value is one random draw (an MLP under
    Adam at lr 10: 1.1, then 2021, 2683, 3936 after a 4760% first update)."""
    vals = loss.values
    if ctx.environment or len(vals) < _NOISY_START + 1 or not vals[0] > 0:
        return False  # (a reinforcement learning loss's targets move with the policy: no level to leave)
    if not float(np.median(vals[1:1 + _NOISY_START])) > ctx.th.loss_diverge_ratio * vals[0]:
        return False
    r0 = ctx.update_ratio_by_step().at(int(loss.steps[0]))
    return r0 is not None and r0 >= ctx.th.update_ratio_high


def _first_batch_apart(ctx: Context, loss) -> bool:
    """The first loss lies below 1/``loss_diverge_ratio`` of the next ones, the update between them
    moved the weights by under ``update_ratio_calm`` of their norm, and the loss falls from there (and
    never climbs):
    the first batch was unlike the rest, not made worse by an update. lucidrains' VQ autoencoder on
    an all-zero first batch: 0.0075, then 0.54 on real images after a 0.6% update, falling to 0.36."""
    vals = loss.values
    if len(vals) < 2 * _NOISY_START + 1:
        return False
    after = float(np.median(vals[1:1 + _NOISY_START]))
    if not vals[0] * ctx.th.loss_diverge_ratio < after:
        return False
    r0 = ctx.update_ratio_by_step().at(int(loss.steps[0]))
    if r0 is None or not r0 < ctx.th.update_ratio_calm:
        return False
    # from step 1 on it falls, and never climbs past loss_diverge_ratio times step 1's value (lucidrains'
    # ViT at lr 5 went 2.05, 4.08, 27.5, 63.8: the updates went on making it worse)
    climb = float(rolling_median(vals[1:], 5).max())
    falls = float(np.median(vals[-_NOISY_START:])) <= (1 - ctx.th.loss_slow_progress) * after  # not flat (DINO at lr 200)
    return falls and climb <= ctx.th.loss_diverge_ratio * vals[1]


@register_rule("losses_summed")
def losses_summed(ctx: Context) -> list[Finding]:
    if not ctx.losses_summed:
        return []
    return [
        Finding(
            kind="losses_summed",
            severity="info",
            title="The loss of each step sums separate objectives (a backward after another optimizer's update, "
            "as in a GAN): its trend is not judged",
            evidence={"loss_points": len(ctx.loss)},
            suggestion="pass the loss to judge to `monitor.step(loss)` after the step's last update (a GAN's "
            "generator loss, say); the gradient, activation and update rules still apply",
            source=SOURCE,
        )
    ]


@register_rule("loss_changes_sign")
def loss_changes_sign(ctx: Context) -> list[Finding]:
    if ctx.losses_summed:
        return []  # said by losses_summed
    ev = sign_changes(ctx)
    if ev is None:
        return []
    return [
        Finding(
            kind="loss_changes_sign",
            severity="info",
            title=f"The loss changes sign between {ev['sign_changes']} of {ev['pairs'] + 1} consecutive steps "
            "(a policy-gradient or other surrogate objective, not an error training drives toward 0): "
            "its trend is not judged",
            evidence=ev,
            suggestion="to have a trend judged, pass `monitor.step(value)` a quantity that falls as training "
            "improves (the negative episode return, say); the gradient, activation and update rules still apply",
            source=SOURCE,
        )
    ]


@register_rule("objectives_in_sequence")
def objectives_in_sequence(ctx: Context) -> list[Finding]:
    if ctx.objectives_in_sequence is None or ctx.losses_summed:
        return []
    at = ctx.objectives_in_sequence
    return [
        Finding(
            kind="objectives_in_sequence",
            severity="info",
            title=f"Optimizers stepped in turn on different parameters from step {at}, each after a backward of "
            "its own loss (layers trained one after another as in forward-forward, an actor updated between a "
            "critic's steps as in SAC): the loss is one curve per objective, and its trend is not judged as one",
            evidence={"takeover_step": at, "loss_points": len(ctx.loss)},
            suggestion="the gradient, activation and update rules still apply to every optimizer's parameters; to "
            "have one objective's loss judged, monitor its loop on its own (one `Monitor` per forward-forward layer)",
            source=SOURCE,
        )
    ]


@register_rule("models_in_sequence")
def models_in_sequence(ctx: Context) -> list[Finding]:
    models = ctx.models_in_sequence
    if len(models) < 2:
        return []
    later = ", ".join(str(m.get("first_step")) for m in models[1:])
    names = ", ".join(f"`{m.get('prefix') or '(no prefix)'}`" for m in models)
    return [
        Finding(
            kind="models_in_sequence",
            severity="info",
            title=f"{len(models)} models were trained one after another, each new one after the one before was "
            f"freed (from steps {later}: a sweep's trials, cross-validation's folds): the loss is one curve per "
            "model, and its trend is not judged as one",
            evidence={"models": models, "loss_points": len(ctx.loss)},
            suggestion=f"each model's layers and parameters are named apart ({names}) and the gradient, activation "
            "and update rules judge each; to have each model's loss judged, give each its own run: "
            "`with trainguard.Monitor(model, f\"runs/trial-{n}\"):` around its training loop",
            source=SOURCE,
        )
    ]


@register_rule("nonfinite_loss")
def nonfinite_loss(ctx: Context) -> list[Finding]:
    step = _first_nonfinite(ctx.loss)
    if step is None:
        return []
    bad = ~np.isfinite(ctx.loss.values)
    value = ctx.loss.at(step)
    ev: dict = {
        "first_step": step,
        "value": value,
        "nonfinite_steps": int(bad.sum()),
        "steps": len(ctx.loss),
    }
    before = ctx.loss.before(step).finite()
    if len(before):
        ev["last_finite_loss"] = float(before.values[-1])
        ev["initial_loss"] = float(before.values[0])
    origin = origin_of(ctx.run, before_step=step)
    fixes = []
    if origin:
        ev["origin"] = origin
        fix = origin.get("fix") or op_fix(origin.get("op"))
        fixes.append(f"the first harmful NaN/Inf came from {where(origin)}: "
                     f"{fix or 'guard that op against 0 and overflow'}")
    grad_bad = _first_nonfinite(ctx.grad_norm)
    if grad_bad is not None and grad_bad < step and not origin:
        ev["after_nonfinite_gradients_at"] = grad_bad
        fixes.append(
            f"the NaN/Inf gradients of step {grad_bad} (finite loss) broke the weights: fix that first "
            "(see nonfinite_gradient)"
        )
    # a value the program handed in (the data) is no divergence, however the loss moved before it
    grew = (len(before) >= 2 and before.values[-1] > 10 * max(abs(before.values[0]), 1e-12)
            and not (origin and origin.get("given")))
    if grew:
        ev["loss_grew"] = f"{fmt(before.values[0])} -> {fmt(before.values[-1])} before turning {fmt(value)}"
        _, text, clip = _lower_where_it_went_wrong(ctx, diverged(ctx), step)
        fixes.append(f"the loss grew before it broke (divergence): {text}")
        if clip:
            fixes.append(clip)
    if not fixes:
        fixes.append(
            "record the run (`trainguard.record(logdir)` or `trainguard run --monitor script.py`) to find the op "
            "that made the first NaN/Inf; usual suspects: log of 0, division by 0, sqrt of a negative, exp overflow"
        )
    return [
        Finding(
            kind="nonfinite_loss",
            severity="critical",
            title=f"Loss became {fmt(value)} at step {step}" + (f" ({where(origin)})" if origin else ""),
            evidence=ev,
            suggestion="; ".join(fixes),
            steps=(step, int(ctx.loss.steps[bad][-1])),  # the first to the last non-finite step
            layers=[origin["module"]] if origin and origin.get("module") else [],
            source=SOURCE,
        )
    ]


@register_rule("nonfinite_gradient")
def nonfinite_gradient(ctx: Context) -> list[Finding]:
    step = _first_nonfinite(ctx.grad_norm)
    layer_steps = []
    for p in ctx.params:
        s = ctx.stat(p, "gradient", "nonfinite")
        hit = np.nonzero(s.values > 0)[0]
        if len(hit):
            layer_steps.append((int(s.steps[hit[0]]), p, float(s.values[hit[0]])))
    if layer_steps:
        first_layer_step = min(s for s, _, _ in layer_steps)
        step = first_layer_step if step is None else min(step, first_layer_step)
    if step is None:
        return []
    loss_bad = _first_nonfinite(ctx.loss)
    if loss_bad is not None and loss_bad <= step:
        return []  # a consequence of the non-finite loss, reported there
    params = ctx.ordered([p for s, p, _ in layer_steps if s == min(x[0] for x in layer_steps)])
    ev: dict = {"first_step": step, "loss_at_step": ctx.loss.at(step)}
    if params:
        ev["params_with_nonfinite_gradients"] = {p: c for s, p, c in layer_steps if p in params}
    before = ctx.grad_norm.before(step).finite()
    if len(before):
        ev["grad_norm_before"] = {"median": median(before.values), "max": float(before.values.max())}
    origin = origin_of(ctx.run, before_step=step)
    overflow = None if origin or params else _norm_overflow(ctx, step, before)
    if overflow is not None:
        # Finite gradients past float32's range (each value above ~1.8e19) square to inf: the norm
        # overflows, as clip_grad_norm_'s does, with no NaN or inf in the gradients themselves.
        ev["last_finite_grad_norm"] = overflow
        ev["began"] = step  # a rate far too high that diverged no later explains it (_causes.IN_TRAINING)
        grew, began = _loss_grew(ctx, step) or (None, step)
        _, lower, clip = _lower_where_it_went_wrong(ctx, diverged(ctx), began)
        if grew:
            ev["loss_grew"] = grew
        return [
            Finding(
                kind="nonfinite_gradient",
                severity="critical",
                title=f"The gradient norm overflowed to inf at step {step} "
                f"{'as the loss diverged to ' + grew.split(' -> ')[1] if grew else 'while the loss was finite'}: "
                f"the gradients exploded past float32's range ({fmt(overflow)} the step before, median "
                f"{fmt(median(before.values))})",
                evidence=ev,
                suggestion=(f"the loss diverged ({grew}) and " if grew else "")
                + "the gradients grew step after step until their squares overflowed (not a NaN made "
                f"in the backward pass): {lower}" + (f"; {clip}" if clip else ""),
                steps=(step, int(ctx.grad_norm.steps[-1])),
                source=SOURCE,
            )
        ]
    if origin:
        ev["origin"] = origin
        fix = origin.get("fix") or op_fix(origin.get("op")) or "guard that op against 0 and overflow"
        suggestion = f"the first harmful NaN/Inf came from {where(origin)} ({origin.get('phase')} pass): {fix}"
    else:
        suggestion = (
            "the loss was finite, so the NaN/Inf arose in the backward pass: look for sqrt, norm or pow at 0 and "
            "division by a value that can be 0 in the forward pass (add an epsilon: `torch.sqrt(x + 1e-12)`, "
            "`F.normalize(x, eps=1e-12)`); `trainguard.record(logdir)` finds the op and line"
        )
    # The loss up to this step grew by orders of magnitude: the gradients overflowed with it (a
    # learning rate far too high), not at a sqrt of 0 (as nonfinite_loss reads a divergence).
    grew, began = _loss_grew(ctx, step) or (None, step)
    title_loss = "while the loss was finite"
    if grew and not origin:
        ev["loss_grew"] = grew
        title_loss = f"as the loss diverged to {grew.split(' -> ')[1]}"
        _, text, clip = _lower_where_it_went_wrong(ctx, diverged(ctx), began)
        suggestion = f"the loss diverged ({ev['loss_grew']}) and the gradients overflowed with it: {text}"
        if clip:
            suggestion += f"; {clip}"
    return [
        Finding(
            kind="nonfinite_gradient",
            severity="critical",
            title=f"Gradients became NaN/Inf at step {step} {title_loss}",
            evidence=ev,
            suggestion=suggestion,
            steps=(step, int(ctx.grad_norm.steps[-1]) if len(ctx.grad_norm) else step),
            layers=list(dict.fromkeys(ctx.params.get(p, {}).get("layer", p) for p in params)),
            source=SOURCE,
        )
    ]


def _loss_grew(ctx: Context, step: int) -> tuple[str, int] | None:
    """``("first -> last", the step it first passed 10x)`` when the finite loss up to ``step`` grew
    more than 10x (a divergence): the gradient norms from that step on measure the blow-up."""
    upto = ctx.loss.before(step + 1).finite()
    bar = 10 * max(abs(upto.values[0]), 1e-12) if len(upto) else math.inf
    if len(upto) >= 2 and upto.values[-1] > bar:
        began = int(upto.steps[np.nonzero(upto.values > bar)[0][0]])
        return f"{fmt(upto.values[0])} -> {fmt(upto.values[-1])}", began
    return None


def _norm_overflow(ctx: Context, step: int, before: Series) -> float | None:
    """The last finite gradient norm when the one of ``step`` is +inf (a NaN is no overflow) after the
    norms exploded to ``grad_spike_factor`` times their median, else None."""
    v = ctx.grad_norm.at(step)
    if v is None or not math.isinf(v) or v < 0 or len(before) < 2:
        return None
    last = float(before.values[-1])
    return last if last > ctx.th.grad_spike_factor * median(before.values[:-1]) else None


def _targets_check(ctx: Context) -> str:
    """What to check about the targets, from what the loss watch read off the loss's graph: that
    they match the inputs (a supervised loss, or not known); for a language model, whose targets
    are its inputs shifted (the cross-entropy's classes are its token embedding's rows), the shift;
    for a loss that compares no targets (a flow's -log q(x), a GP's -mll, an ELBO), its sign."""
    recs = ctx.run.meta.get("loss_graph") or []
    if recs and all(r.get("log_sigmoid") for r in recs):
        # trl's DPO loss read as "a flow's likelihood, check its sign", and, with the log-probs
        # gathered from a log_softmax, as "targets match inputs (shuffle them together)"
        return ("that the loss is the quantity to minimise: a -logsigmoid of a margin (DPO's "
                "`-logsigmoid(beta * margin)`, a reward model's `-logsigmoid(r_chosen - r_rejected)`) falls as the "
                "margin grows, so that the margin is chosen minus rejected (not swapped; for DPO, the reference's "
                "log-probs subtracted, not added) and its scale (beta) not 0; a binary cross-entropy written with "
                "logsigmoid the same way round")
    if recs and all(isinstance(r.get("loss_functions"), list) and not r["loss_functions"] for r in recs):
        return ("that the loss is the quantity to minimise: its graph holds no comparison with targets (no "
                "cross-entropy, MSE, L1 or BCE: a likelihood of the data, as a flow's or a Gaussian process's, or an "
                "ELBO), so check its sign (-log_prob(x).mean() falls as the fit improves)")
    classes = ctx.loss_classes()
    if classes is not None and classes in _token_embedding_rows(ctx):
        return (f"that the targets are the inputs shifted by one token (the cross-entropy's {classes} classes are "
                "the token embedding's rows: a language model; logits[:, :-1] against input_ids[:, 1:], or the "
                "labels a Hugging Face model shifts itself)")
    return "that targets match inputs (shuffle them together)"


def _token_embedding_rows(ctx: Context) -> set[int]:
    """Rows of the model's token embeddings: the first embedding in forward order under each module
    that holds embeddings (BERT's word_embeddings before its position and token_type ones, nanoGPT's
    wte before wpe; a translation model's source and target embeddings each). A binary classifier's
    2 classes are no vocabulary because BERT's token_type_embeddings has 2 rows."""
    embeddings = [p for p, info in ctx.params.items()
                  if info.get("module_type") == "Embedding" and len(info.get("shape", [])) == 2]
    first: dict[str, int] = {}
    for p in ctx.ordered(embeddings):
        parent = ctx.params[p].get("layer", p).rpartition(".")[0]
        first.setdefault(parent, int(ctx.params[p]["shape"][0]))
    return set(first.values())


def saturated(ctx: Context) -> dict | None:
    """Where one update took the loss and its gradient norm to ``loss_saturated_ratio`` of their
    values before it, and both stayed there for at least half the run: the loss is at its floor
    with nothing left to move the weights. A DPO loss ``-logsigmoid(beta * margin)`` at beta 1000
    went 0.693 -> 0.0 at step 1 under trl's DPOTrainer (gradient norm 9836 -> 0.0): its median
    start is then 0, and the loss "does not decrease"."""
    loss = finite_loss(ctx)
    n = len(loss)
    if n < ctx.th.min_loss_points or ctx.environment or not len(ctx.grad_norm) or np.any(loss.values < 0):
        return None  # a floor at 0 is what saturates; a loss below it (a policy gradient's) has none
    r = ctx.th.loss_saturated_ratio
    vals = np.abs(loss.values)
    above = np.nonzero(vals > r * vals[0])[0]
    i = int(above[-1]) + 1 if len(above) else 0
    if i == 0 or 2 * (n - i) < n or not vals[i] <= r * vals[i - 1]:
        return None  # never above its floor, not at it for half the run, or it got there step by step
    norms = [ctx.grad_norm.at(int(s)) for s in loss.steps[i - 1:]]
    if any(g is None or not math.isfinite(g) for g in norms):
        return None
    before, after = norms[0], max(norms[1:])
    if not (before > 0 and after <= r * before):
        return None
    return {"step": int(loss.steps[i]), "steps_since": n - i, "loss_before": float(loss.values[i - 1]),
            "loss_after": float(np.max(vals[i:])), "grad_norm_before": before, "grad_norm_after": after}


@register_rule("loss_saturated")
def loss_saturated(ctx: Context) -> list[Finding]:
    sat = saturated(ctx)
    if sat is None:
        return []
    return [
        Finding(
            kind="loss_saturated",
            severity="warning",
            title=(f"Loss saturated at step {sat['step']}: one update took it from {fmt(sat['loss_before'])} to "
                   f"{fmt(sat['loss_after'])} and the gradient norm from {fmt(sat['grad_norm_before'])} to "
                   f"{fmt(sat['grad_norm_after'])}; the {sat['steps_since']} steps since learned nothing"),
            evidence=dict(sat),
            suggestion=(
                "a loss that passes a scaled score through a sigmoid or softplus (DPO's `-logsigmoid(beta * margin)`, "
                "a reward model's `-logsigmoid(r_chosen - r_rejected)`, a hinge, a cross-entropy of huge logits) is "
                "flat at 0 once the scaled margin passes a few dozen (float32 rounds exp(-100) to 0), and one update "
                "took every sample there: the scale is far too large for these margins: lower it (DPO's beta is "
                "usually 0.1 to 0.5; a temperature goes up) or the learning rate, so that the margins grow over many "
                "steps; if one token or feature tells every pair apart, the data teaches nothing more either"
            ),
            steps=(sat["step"], int(finite_loss(ctx).steps[-1])),
            source=SOURCE,
        )
    ]


@register_rule("loss_not_decreasing")
def loss_not_decreasing(ctx: Context) -> list[Finding]:
    p = progress(ctx)
    if p is None or p["progress"] >= ctx.th.loss_min_progress or saturated(ctx):
        return []  # a loss at its floor after one update did decrease: loss_saturated says so
    ev = {
        "start_loss": p["start"],
        "best_loss": p["best"],
        "end_loss": p["end"],
        "relative_progress": p["progress"],
        "window_steps": p["window"],
    }
    hints = []
    classes = ctx.loss_classes()  # a contrastive loss's candidates per row, not the embedding's units
    units = classes or ctx.output_units()
    teachers = moving_targets(ctx)  # an EMA teacher or momentum encoder: the loss's target moves
    at_chance = bool(units and units > 1 and abs(p["end"] - math.log(units)) < 0.05 * math.log(units))
    if at_chance:
        ev["chance_loss"] = f"ln({units}) = {math.log(units):.4f}"
        hints.append(f"the loss sits at ln({units}), the cross-entropy of a uniform guess over {units} classes"
                     + ("; in a contrastive loss every candidate scores alike: the embeddings collapsed to one "
                        "vector, or the logit scale (exp of a learned logit_scale, 1 / temperature) fell to 0"
                        if classes and classes != ctx.output_units() else "")
                     + ("; with a teacher moved by hand (DINO) the teacher's softmax went uniform: its temperature "
                        "is too high for its logits (DINO's 0.04, warmed up to at most 0.07: the cosine logits of a "
                        "weight-normed last layer span only [-1, 1]), or its centering outweighs its sharpening"
                        if teachers else ""))
    ratio = median(ctx.update_ratio_by_step().values)
    if math.isfinite(ratio):
        ev["update_ratio_median"] = ratio
    rising = p["end"] > p["start"] * (1 + ctx.th.loss_min_progress)
    blocked = gradient_blocked(ctx)
    if blocked:
        hints.append(f"gradients do not reach the weights ({blocked}): fix that first (see its finding)")
    elif ctx.environment:
        hints.append(
            f"the script steps a reinforcement learning environment ({ctx.environment}): the loss's targets (returns, "
            "advantages) come from what the policy collects and move as it learns (PPO's value loss grows with the "
            "returns), so a loss that does not fall says little: judge the run by the episode return"
        )
    elif copies := frozen_copies(ctx):
        pre, of = next(iter(copies.items()))
        ev["frozen_copy"] = {"model": ctx.model_name(pre), "of": ctx.model_name(of)}
        hints.append(
            f"{ev['frozen_copy']['model']} is a copy of {ev['frozen_copy']['of']}'s weights at the first recording "
            "and never moved while those trained: a teacher or momentum encoder whose EMA update does nothing (a "
            "momentum of 1: DINO's momentum_teacher, MoCo's m; or the update is never called) gives targets from "
            "a random network; a momentum of 0.99-0.9995 (DINO's 0.996 -> 1 cosine schedule) lets it follow. If "
            "it is a reference frozen on purpose (DPO's), check the loss compares the right tensors"
        )
    elif teachers and not at_chance:
        ev["moving_target"] = teachers[:6]
        hints.append(
            f"the loss's target comes from weights no optimizer steps that move all the same ({_names(teachers)}): "
            "an EMA teacher or momentum encoder (DINO, BYOL, MoCo's key encoder), so the loss is no fixed objective "
            "(DINO's cross-entropy rises while centering spreads the teacher's outputs): judge the run by a k-NN or "
            "linear probe on the features; it has collapsed when the teacher's softmax is one-hot for every input "
            "or uniform (the loss then sits at 0 or ln of its output size)"
        )
    elif rising and (div := diverged(ctx)) and _slow_under_calm_updates(ctx, div, _ratio_max(ctx)):
        hints.append(
            f"the loss rose slowly while no step moved the weights by more than {_ratio_max(ctx):.2g} of their norm "
            f"({_ratio_max(ctx):.2%}): not the step size. A target that moves as training goes does this (reinforcement learning: value "
            "targets grow with the returns, as PPO's value loss does while the agent learns; a curriculum; a "
            "regulariser whose weight grows): judge such a run by its own metric (the episode return). If the "
            f"objective is fixed, check {_targets_check(ctx)} and that the loss compares the right tensors"
        )
    elif (math.isfinite(ratio) and ratio >= ctx.th.update_ratio_low
          and ratio * (p["steps"][1] - p["steps"][0] + 1) < ctx.th.update_total_small):
        n = p["steps"][1] - p["steps"][0] + 1
        hints.append(
            f"the weights moved little: {fmt(ratio)} of their norm per step, about {ratio * n:.2%} over the {n} steps, "
            "too little for the loss to follow: check the rate in force first: a warmup longer than the run (a "
            "scheduler's, or the optimizer's own, as schedule-free's `warmup_steps`, which the logged lr does not "
            "show), an optimizer that sets its own step size (Adafactor's `relative_step` and `warmup_init`), or a rate "
            f"too low ({LR_RANGE_TEST}); then, if the loss still does not follow, {_targets_check(ctx)}"
        )
    elif math.isfinite(ratio) and ratio >= ctx.th.update_ratio_low:
        hints.append(
            f"the weights do move (update/weight ratio {fmt(ratio)} per step) but the loss does not follow: check "
            f"{_targets_check(ctx)}, that the loss compares the right tensors, and that "
            "nothing detaches the output; `trainguard.doctor.overfit_one_batch` checks the model can learn at all"
        )
    elif math.isfinite(ratio):
        hints.append("the weights barely move: see the learning-rate finding")
    else:
        hints.append(
            f"check the learning rate, {_targets_check(ctx)}, and that gradients reach the parameters; "
            "`trainguard.doctor.overfit_one_batch` checks the model can learn at all"
        )
    title = "Loss rose instead of decreasing" if rising else "Loss is not decreasing"
    return [
        Finding(
            kind="loss_not_decreasing",
            # an agent's loss trend says little (its targets move with the policy): the episode return judges it
            # so does a loss against a teacher that moves, unless it sits at a uniform guess (collapse)
            severity="info" if (ctx.environment or (teachers and not at_chance)) and not blocked else "warning",
            title=f"{title}: {fmt(p['start'])} -> {fmt(p['end'])} (best {fmt(p['best'])}) over {p['steps'][1] - p['steps'][0] + 1} steps",
            evidence=ev,
            suggestion="; ".join(hints),
            steps=p["steps"],
            source=SOURCE,
        )
    ]


def _autocorr(r: np.ndarray, k: int) -> float:
    a, b = r[:-k], r[k:]
    den = math.sqrt(float(np.dot(a, a)) * float(np.dot(b, b)))
    return float(np.dot(a, b)) / den if den > 0 else 0.0


def _fisher_p(r: np.ndarray) -> float:
    """Fisher's g test: the chance that white noise puts this large a share of its power into one
    frequency (the periodogram's largest ordinate over their sum)."""
    power = np.abs(np.fft.rfft(r))[1:] ** 2
    m = len(power)
    total = float(power.sum())
    if m < 2 or total <= 0:
        return 1.0
    g = float(power.max()) / total
    return min(1.0, m * (1.0 - g) ** (m - 1))


@register_rule("loss_oscillating")
def loss_oscillating(ctx: Context) -> list[Finding]:
    if ctx.environment:
        return []  # a reinforcement-learning loss rises and falls with each rollout the policy collects
    loss = finite_loss(ctx)
    n = len(loss)
    skip = int(n * ctx.th.window_fraction)  # the early transient is not an oscillation
    vals = loss.values[skip:]
    steps = loss.steps[skip:]
    if len(vals) < max(40, ctx.th.min_loss_points):
        return []
    positive = bool(np.all(vals > 0))
    y = np.log(vals) if positive else vals / max(float(np.median(np.abs(vals))), 1e-12)
    t = np.arange(len(y), dtype=float)
    r = y - np.polyval(np.polyfit(t, y, 2), t)
    amplitude = float(np.std(r))
    if amplitude < ctx.th.osc_min_amplitude:
        return []
    if _fisher_p(r) > ctx.th.osc_fisher_p:
        return []  # no periodic component stands out of the noise
    lags = range(1, len(r) // 6 + 1)  # at least three periods inside the window
    rho = {k: _autocorr(r, k) for k in lags}
    low = min(rho.values())
    if low > ctx.th.osc_autocorr:
        return []
    # The fundamental: the first lag nearly as anti-correlated as the deepest (odd multiples of a
    # half period are anti-correlated too).
    k = next(k for k in lags if rho[k] <= 0.9 * low)
    if 2 * k < len(r) and _autocorr(r, 2 * k) <= 0:
        return []  # no repetition at the full period: a single bump, not an oscillation
    ev = {
        "period_steps": 2 * k,
        "autocorrelation_at_half_period": rho[k],
        "relative_amplitude": amplitude,
        "window": (int(steps[0]), int(steps[-1])),
    }
    _, lr_text = lr_lower(ctx, None)
    return [
        Finding(
            kind="loss_oscillating",
            severity="warning",
            title=f"Loss oscillates with a period of about {2 * k} steps (±{amplitude:.0%})",
            evidence=ev,
            suggestion=f"{lr_text}; with momentum, lower it (e.g. 0.9) so the updates stop overshooting",
            steps=(int(steps[0]), int(steps[-1])),
            source=SOURCE,
        )
    ]


@register_rule("loss_spike")
def loss_spike(ctx: Context) -> list[Finding]:
    loss = finite_loss(ctx)
    n = len(loss)
    if n < ctx.th.min_loss_points:
        return []
    vals = loss.values
    w = max(10, int(n * ctx.th.window_fraction / 2))
    # The ratios are rises measured in the loss's height above its floor: 0 for a loss that never
    # went below it (x > 3 * base is x - base > 2 * base). A loss that did has no floor at 0: its
    # offset is arbitrary (gpytorch's -mll, a flow's or Gaussian NLL), and |median| blocked nothing
    # near 0 and everything far below it (a 13-sigma spike 2 nats below 0). Its heights are measured
    # from its lowest value so far, and its rise must be a share of the span it fell since the
    # start: tests that do not change when a constant is added to the loss.
    floorless = bool(np.any(vals < 0))
    start = float(np.median(vals[:3]))  # the loss at initialisation sets the scale
    lowest = np.minimum.accumulate(vals)
    min_rise = ctx.th.loss_spike_min_rise_span if floorless else ctx.th.loss_spike_min_rise
    spikes = []
    for i in range(w, n):
        prev = vals[i - w : i]
        base = float(np.median(prev))
        top_prev = float(prev.max())
        floor = float(lowest[i - 1]) if floorless else 0.0
        mad = 1.4826 * float(np.median(np.abs(prev - base))) + 1e-12
        rise = vals[i] - base
        if (
            rise > (ctx.th.loss_spike_ratio - 1) * (base - floor)
            and vals[i] - top_prev > (ctx.th.loss_spike_over_max - 1) * (top_prev - floor)
            and rise > ctx.th.loss_spike_min_z * mad
            and rise > min_rise * max(abs(start - floor), base - floor, 1e-12)
        ):
            spikes.append((int(loss.steps[i]), float(vals[i]), base, floor))
    if not spikes:
        return []
    # The largest rise over the median's height: top / base - 1 for a positive loss.
    first_step, top, base, _ = max(spikes, key=lambda s: (s[1] - s[2]) / max(s[2] - s[3], 1e-12))
    largest = {"step": first_step, "loss": top, "recent_median": base}
    if base > 0:
        largest["ratio"] = top / base
        how = f"{top / base:.0f}x its recent median"
    else:
        largest["rise"] = top - base
        how = f"{fmt(top - base)} above its recent median ({fmt(base)})"
    ev = {
        "spike_steps": [s[0] for s in spikes[:20]],
        "count": len(spikes),
        "largest": largest,
        "began": spikes[0][0],  # a rate far too high that diverged no later explains them (_causes.IN_TRAINING)
    }
    gn = ctx.grad_norm.at(first_step)
    quiet = False
    if gn is not None:
        ev["largest"]["grad_norm"] = gn
        ev["grad_norm_median"] = gmed = median(ctx.grad_norm.values)
        at_spikes = [ctx.grad_norm.at(s[0]) for s in spikes]
        quiet = all(g is not None and math.isfinite(g) and g < ctx.th.loss_spike_quiet_grad * gmed for g in at_spikes)
    if ctx.environment:
        # A rollout holding an episode's end (the value target drops to the last reward) or a rare
        # large reward makes one update's loss jump: SB3's A2C on CartPole, healthy, 35x its median.
        fixes = [f"the script steps a reinforcement learning environment ({ctx.environment}): a one-update spike is "
                 "usually a rollout holding an episode's end or a rare large reward, not a fault; judge the run by its "
                 f"episode return, and if that falls after step {first_step}, check the rewards of that rollout "
                 "(normalise or clip them, e.g. stable-baselines3's VecNormalize)"]
    elif quiet:
        # The loss of the batch was high, not its update: clipping would leave those steps as they were.
        ev["quiet_gradient"] = True
        fixes = [f"the gradient norm at the spike ({fmt(gn)}) was below the run's median ({fmt(gmed)}): the update was "
                 "an ordinary one and training went on undisturbed, so clipping would change nothing; the batch was "
                 "hard for the model, most often because it holds something rare (a class few samples have: weight "
                 "the classes or oversample those samples if it should be learnt) or a wrong label "
                 f"(inspect the batch of step {first_step})"]
    else:
        fixes = [f"inspect the batch of step {first_step} (a corrupted or mislabelled batch makes a one-step spike)"]
        clip = clip_text(ctx)
        if clip:
            fixes.append(clip)
        fixes.append("if spikes recur, lower the learning rate or add warmup")
    return [
        Finding(
            kind="loss_spike",
            severity="info" if ctx.environment or quiet else "warning",
            title=f"Loss spiked to {fmt(top)} at step {first_step} ({how})"
            + (f", {len(spikes)} spikes in all" if len(spikes) > 1 else ""),
            evidence=ev,
            suggestion="; ".join(fixes),
            steps=(spikes[0][0], spikes[-1][0]),
            source=SOURCE,
        )
    ]


@register_rule("lr_too_high")
def lr_too_high(ctx: Context) -> list[Finding]:
    ratios = ctx.update_ratio_by_step()
    r_max = _ratio_max(ctx)
    div = diverged(ctx)
    prog = progress(ctx)
    bad_step = _first_nonfinite(ctx.loss)
    if div and bad_step is None and _slow_under_calm_updates(ctx, div, r_max):
        div = None  # not the step size's doing: loss_not_decreasing says what else rises so
    reasons = []
    ev: dict = {}
    if math.isfinite(r_max):
        ev["update_ratio_max"] = r_max
        ev["update_ratio_median"] = median(ratios.values)
    if div:
        ev["divergence"] = div
        reasons.append(
            f"the smoothed loss rose to {fmt(div['smoothed_loss'])} by step {div['step']}, "
            f"from {fmt(div['initial_loss'])} "
            + (f"over its first {div['initial_steps']} steps" if "initial_steps" in div
               else f"over the 5 steps after the first (whose batch, at {fmt(div['first_loss_apart'])}, was unlike the "
               "rest)" if "first_loss_apart" in div else "at initialisation")
        )
    high = math.isfinite(r_max) and r_max >= ctx.th.update_ratio_high
    if high and _first_update_sized_by_rate(ctx, ratios, int(ratios.steps[int(np.argmax(ratios.values))]),
                                            warmed=True):
        # Adam's first update moves each weight by about the rate: on weights initialised far below their
        # Kaiming scale (seq2seq's std 0.01) that is most of their norm at any rate that trains, so that
        # update is judged against a third of the Kaiming norm at least (the later ones as they are)
        high = max([ctx.update_ratio_by_step(floor=True).values[0], *ratios.values[1:]]) >= ctx.th.update_ratio_high
    # a reinforcement learning loss's targets move with the policy: its progress says nothing
    stuck = ctx.environment is not None or (prog is not None and prog["progress"] < 0.5)
    moved = None  # the step whose update moved the weights most, when that is the reason
    if high and (stuck or div or bad_step is not None):
        moved = int(ratios.steps[int(np.argmax(ratios.values))])
        reasons.append(f"one step moved the weight matrices by {r_max:.0%} of their norm (step {moved})")
    if bad_step is not None and not reasons:
        before = ctx.loss.before(bad_step).finite()
        # from the first loss that is not an exact 0 (SAC's split first step: only the entropy
        # coefficient's loss, 0 at log_ent_coef = 0)
        start = next((abs(float(v)) for v in before.values if v != 0), 0.0)
        given = (origin_of(ctx.run, before_step=bad_step) or {}).get("given")  # written into the data
        if len(before) >= 2 and start > 0 and before.values[-1] > 10 * start and not given:
            reasons.append(f"the loss grew {fmt(before.values[-1] / start)}x before turning NaN/Inf")
    if not reasons:
        return []
    at = div["update_step"] if div else bad_step if bad_step is not None else moved
    new, text, clip = _lower_where_it_went_wrong(ctx, div, bad_step, moved)
    if new is not None:
        ev["suggested_lr"] = new
        ev["lr"] = ctx.lr(at)
        peak = ctx.lr_peak()
        if peak is not None and peak != ev["lr"]:
            ev["lr_peak"] = peak
    warm = _no_warmup(ctx, ratios, moved) if bad_step is None else None
    if warm:
        ev["no_warmup"] = True
        text = f"{warm}; or {text}"
    steps = (int(ctx.loss.steps[0]), int(ctx.loss.steps[-1])) if len(ctx.loss) else None
    return [
        Finding(
            kind="lr_too_high",
            severity="error" if bad_step is not None else "warning",
            title="Learning rate too high: " + reasons[0],
            evidence=ev | {"reasons": reasons},
            suggestion=text + (f"; {clip}" if clip else ""),
            steps=steps,
            source=SOURCE,
        )
    ]


def _no_warmup(ctx: Context, ratios: Series, moved: int | None) -> str | None:
    """The advice to warm the rate up when the update that rewrote the weights was the run's first,
    made at the schedule's peak rate, and every later recording moved them calmly: Adam's first
    update moves each weight by about the rate whatever its gradient (MAE at lr 0.03 with
    ``warmup_epochs=0`` moved them by 27% at step 0, 0.28% after; with a warmup it trained). None otherwise."""
    if moved is None or not ctx.weights_initial or not len(ratios) or moved != int(ratios.steps[0]):
        return None
    lr, peak = ctx.lr(moved), ctx.lr_peak()
    later = ratios.values[1:]
    if not lr or peak is None or lr * SCHEDULE_PEAK_GAP < peak or not len(later):
        return None
    rest = median(later)
    if not (math.isfinite(rest) and rest < ctx.th.update_ratio_calm):
        return None
    return (f"the update that moved the weights most was the first (step {moved}), at the full rate {fmt(lr)}, and "
            f"later ones moved them by {rest:.2%} (median): warm the rate up from near 0 over the first steps (a "
            "linear warmup: MAE's and DeiT's warmup_epochs, `LinearLR(optimizer, start_factor=0.01, total_iters=...)`); "
            "an adaptive optimizer's (Adam's) first update moves every weight by about the rate, whatever its gradient")


def _lower_where_it_went_wrong(ctx: Context, div: dict | None, bad_step: int | None,
                               moved: int | None = None) -> tuple[float | None, str, str]:
    """(the lower rate, its text, a clip_grad_norm_ call or "") for a run that went wrong at the
    divergence's step, else at the first non-finite loss, else at ``moved``, the step whose update
    rewrote the weights (a run that collapsed without diverging): the rate in force there (not the
    schedule's median) scaled by the update ratio it made before it, and a clip norm read off the
    gradient norms before it (after it they are exploding, or collapsed). lr_too_high and
    nonfinite_loss give the same fix."""
    at = div["update_step"] if div else bad_step if bad_step is not None else moved
    ratios = ctx.update_ratio_by_step()
    r_at, read_at = _ratio_before(ctx, ratios, at)
    if r_at is None and len(ratios):  # nothing recorded before it: the update that moved the weights most
        read_at = int(ratios.steps[int(np.argmax(ratios.values))])
        r_at = float(ratios.values.max())
    if _first_update_sized_by_rate(ctx, ratios, read_at, warmed=True):
        ratios = ctx.update_ratio_by_step(floor=True)  # as lr_too_high judged it
        r_at = _ratio_before(ctx, ratios, max(at, read_at) if at is not None else read_at)[0]
    later = _after_the_first_update(ctx, ratios, at) if div is None and bad_step is None else None
    if later is not None:
        r_at, how = later
        new, text = lr_lower(ctx, r_at, step=at)
        return new, f"{text}; {how}", clip_text(ctx, before_step=at)
    r_at = r_at if r_at is not None and math.isfinite(r_at) else None
    if r_at is not None and _sign_sized_first_update(ctx, ratios, read_at):
        new, text = lr_lower(ctx, r_at, step=at, target=ADAPTIVE_FIRST_UPDATE_RATIO, why=(
            f" (read off the first update and aimed at {ADAPTIVE_FIRST_UPDATE_RATIO:.0%} of the weights' norm: Adam's, "
            "Lion's and Muon's first update moves every weight by about the rate, whatever the gradient)"))
        return new, text, clip_text(ctx, before_step=at)
    new, text = lr_lower(ctx, r_at, step=at)
    return new, text, clip_text(ctx, before_step=at)


def _adaptive(name: object) -> bool:
    """An optimizer whose first update is sized by the rate, whatever the gradient: Adam's (and
    AdamW's, NAdam's...), Adagrad's, Adafactor's (its rate is relative to the weights' RMS), Lion's (a
    sign) and Muon's (an orthogonalised matrix) move each weight by about the rate, RMSprop's by about
    10x it (the root of a square average that holds a hundredth of one squared gradient)."""
    return isinstance(name, str) and (_sign_sized(name) or name == "RMSprop")


def _sign_sized(name: object) -> bool:
    """An optimizer whose first update moves each weight by about the rate itself, whatever the
    gradient's scale: Adam's family (AdamW, NAdam, RAdam, Adamax: m/sqrt(v) is sign(g) at the first
    step), Adagrad's (g / |g|), Adafactor's (relative to the weights' RMS), Lion's (a sign at every step),
    Muon's (an orthogonalised momentum: KellerJordan's Muon, SingleDeviceMuon, MuonWithAuxAdam). Not
    RMSprop's: about 10x the rate at first."""
    return isinstance(name, str) and ("Adam" in name or "Muon" in name or name in ("Adagrad", "Adafactor", "Lion"))


def _sign_sized_first_update(ctx: Context, ratios: Series, step: int | None) -> bool:
    """``step`` is the run's first recorded update, from initial weights, made by optimizers that size it
    by the rate alone (every trainable weight matrix's: Adam's family, Lion, Muon), at any rate of the
    schedule: the update ratio it makes is the rate over the weights' RMS, whatever the gradient."""
    if not _first_update_sized_by_rate(ctx, ratios, step, warmed=True):
        return False
    names = {ctx.params[p].get("optimizer") for p in ctx.weight_matrices() if ctx.params[p].get("requires_grad", True)}
    return all(_sign_sized(n) for n in names)


def _first_update_sized_by_rate(ctx: Context, ratios: Series, step: int | None, warmed: bool = False) -> bool:
    """``step`` is the run's first recorded update, from initial weights, made at the full rate (no
    warm-up; with ``warmed``, at any rate of the schedule) by adaptive optimizers only (every
    trainable weight matrix's). A warm-up's first rate moves weights initialised far below their
    Kaiming scale by most of their norm too (nanochat's lm_head, N(0, 0.001), by 139% at a tenth of
    the peak rate): the Kaiming floor judges that update whatever the schedule."""
    if step is None or not ctx.weights_initial or not len(ratios) or step != int(ratios.steps[0]):
        return False
    names = {ctx.params[p].get("optimizer") for p in ctx.weight_matrices() if ctx.params[p].get("requires_grad", True)}
    lr, peak = ctx.lr(step), ctx.lr_peak()
    return (bool(names) and all(_adaptive(n) for n in names) and bool(lr)
            and (warmed or not (peak and lr * SCHEDULE_PEAK_GAP < peak)))


def _after_the_first_update(ctx: Context, ratios: Series, at: int | None) -> tuple[float, str] | None:
    """(the update ratio to lower the rate by, how it was found) when the ratio the rate would be read
    off is RMSprop's first update, at the full rate (no warm-up), in a run that did not diverge (the
    step moved the weights most and the rest went on): the median of the recordings after it.
    Read off the first update, the rate came out 100x below one that trains (Pytorch-UNet's RMSprop
    at 0.1: 7e-06 where 1e-3 trains). None otherwise."""
    if len(ratios) < 2 or not _first_update_sized_by_rate(ctx, ratios, at):
        return None
    names = {ctx.params[p].get("optimizer") for p in ctx.weight_matrices()}
    if names != {"RMSprop"}:
        return None  # Adam's first update is the rate's own size: a rate too high for it is too high
    first = int(ratios.steps[0])
    lr_at = ctx.lr(first)
    floored = ctx.update_ratio_by_step(floor=True)
    later = [r * lr_at / lr_s for s, r in zip(floored.steps.tolist(), floored.values.tolist())
             if s > first and math.isfinite(r) and r > 0
             and (lr_s := ctx.lr(s))]
    if not later:
        return None
    r = median(np.array(later))
    return r, (f"the rate aims the update-to-weight ratio at {TARGET_UPDATE_RATIO:g} from {fmt(r)}, the median of the "
               f"{len(later)} recording(s) after the first update, not from the first update itself (RMSprop's "
               "first update moves each weight by about 10x the rate, whatever the gradient)")


def _ratio_max(ctx: Context) -> float:
    ratios = ctx.update_ratio_by_step()
    return float(ratios.values.max()) if len(ratios) else math.nan


def _slow_under_calm_updates(ctx: Context, div: dict, r_max: float) -> bool:
    """The loss passed twice its initial value only after the first tenth of the run, stayed
    under ten times it, and no recorded step moved the weight matrices by ``update_ratio_calm`` of
    their norm: a target that moves as training goes (reinforcement learning's value targets grow
    with the returns), not a rate that throws the weights about."""
    loss = finite_loss(ctx)
    steps = loss.steps
    # An agent's updates are larger (TorchRL's PPO on Pendulum at its default rate: up to 7% of the
    # weights' norm in a healthy run, 12% with rewards 1e6x too large); a rate-driven divergence
    # moves them by update_ratio_high or more.
    calm = ctx.th.update_ratio_high if ctx.environment else ctx.th.update_ratio_calm
    if not math.isfinite(r_max) or r_max >= calm or len(steps) < 6:
        return False
    if float(rolling_median(loss.values, 5).max()) >= 10 * div["initial_loss"]:
        return False  # an explosion is a rate's, whatever the ratios said between recordings
    return div["step"] >= steps[0] + 0.1 * (steps[-1] - steps[0])


def _ratio_before(ctx: Context, ratios: Series, step: int | None) -> tuple[float | None, int | None]:
    """(the update ratio the rate in force at ``step`` (where the run diverged) made before it, the step
    it was recorded at): the last recording at or before ``step``, scaled from the rate then to the rate
    at ``step`` (a warm-up's). A ratio read after the divergence measures weights that had already blown up."""
    if step is None:
        return None, None
    lr_at = ctx.lr(step)
    for s, r in zip(ratios.steps[::-1].tolist(), ratios.values[::-1].tolist()):
        if s > step or not (math.isfinite(r) and r > 0):
            continue
        lr_s = ctx.lr(s)
        return (r * lr_at / lr_s, s) if lr_at and lr_s else (None, None)
    return None, None


@register_rule("rewards_too_large")
def rewards_too_large(ctx: Context) -> list[Finding]:
    """A reinforcement learning loss that starts enormous: the returns its value loss regresses are (a
    value loss is their squared error), and no learning rate fixes that."""
    loss = finite_loss(ctx)
    if not ctx.environment or len(loss) < 6:
        return []
    start = float(np.median(np.abs(loss.values[:5])))
    if not start > ctx.th.rl_loss_large:
        return []
    clip = ctx.clipping or {}
    starved = (f"; the loop's {clip['function']}(max_norm={fmt(clip.get('value'))}) over all parameters scales "
               "every gradient by the value loss's, so the rest of the agent (its policy) barely moves"
               if clip.get("function") == "clip_grad_norm_" else "")
    return [
        Finding(
            kind="rewards_too_large",
            severity="warning",
            title=f"The loss of this reinforcement learning run starts at {fmt(start)}: the returns it regresses are "
            f"of order {fmt(math.sqrt(start))}",
            evidence={"start_loss": start, "return_scale": math.sqrt(start), "environment": ctx.environment},
            suggestion=f"the script steps a reinforcement learning environment ({ctx.environment}) and its value loss "
            "is the squared error of the returns: scale or normalise the rewards before the loss sees them (torchrl's "
            "RewardScaling or VecNorm on the reward, gymnasium's NormalizeReward, stable-baselines3's VecNormalize), "
            "or normalise the value targets; a lower learning rate would only hide it" + starved,
            steps=(int(loss.steps[0]), int(loss.steps[-1])),
            source=SOURCE,
        )
    ]


@register_rule("lr_too_low")
def lr_too_low(ctx: Context) -> list[Finding]:
    prog = progress(ctx)
    if prog is None or gradient_blocked(ctx):
        return []  # with no gradient to scale, a larger step size is not the fix
    # The layer that moves most: if even it barely moves, the step size is to blame.
    per_layer = [median(ctx.stat(p, "update", "ratio").values) for p in ctx.weight_matrices()]
    per_layer = [r for r in per_layer if math.isfinite(r)]
    if not per_layer:
        return []
    r_med = max(per_layer)
    # Weights that barely move cannot have made a dip the loss did not keep: the best smoothed level
    # of a noisy loss is a low draw of its batches (timm's LARS at its batch-scaled default rate, 24
    # steps of 4 images at under 4e-7 of the weights per step: best 0.649 against 0.803 at the start and
    # 0.776 at the end). What counts is what is left at the end.
    kept = (prog["start"] - prog["end"]) / max(abs(prog["start"]), 1e-12)
    improved = max(0.0, min(prog["progress"], kept))
    if not (r_med < ctx.th.update_ratio_low and improved < ctx.th.loss_slow_progress):
        return []
    new, text = lr_higher(ctx, r_med)
    ev = {
        "update_ratio_median": r_med,
        "relative_progress": improved,
        "start_loss": prog["start"],
        "end_loss": prog["end"],
        "lr": ctx.lr(),
        "suggested_lr": new,
    }
    title = (
        f"Learning rate too low: each step moves the weights by {fmt(r_med)} of their norm "
        f"(the most-moved layer) and the loss improved {improved:.1%}"
    )
    if ctx.lr() == 0:
        title = f"Learning rate is 0: the weights do not move and the loss improved {improved:.1%}"
    return [
        Finding(
            kind="lr_too_low",
            severity="warning",
            title=title,
            evidence=ev,
            suggestion=text,
            steps=prog["steps"],
            source=SOURCE,
        )
    ]
