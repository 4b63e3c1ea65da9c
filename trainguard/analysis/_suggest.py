"""Concrete fixes with values read off the run: clip norms, learning rates, epsilons, inits."""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import Any

import numpy as np

from trainguard.analysis._context import Context, fmt, sig

LR_RANGE_TEST = (
    "`trainguard.doctor.lr_range_test(model, data, loss_fn, optimizer_factory)` measures the best rate for this "
    "model and data"
)
# Healthy update-to-weight ratios sit around 1e-3 (Karpathy's rule of thumb); aim new rates there.
TARGET_UPDATE_RATIO = 1e-3
# What an adaptive optimizer's first update is aimed at when the rate is read off it. Adam's first update
# is m/sqrt(v) = sign(g) per element, Lion's is a sign, Muon's an orthogonalised matrix: each weight moves by
# about the rate, whatever the gradient, and the ratio is the rate over the weights' RMS. At the best rates
# of 200-step sweeps (makemore's and nanoGPT's Transformers under Adam/AdamW 1e-3 to 3e-3, an MLP 1e-3 to 3e-3, a LoRA 3e-2,
# Lion 1e-3, Muon 1e-2) that first update moved the weight matrices by 1.4-23% of their norm; read off it
# at TARGET_UPDATE_RATIO, the rate came out 14-300x below the best (makemore at 0.05: 7e-05). At 3e-2 it
# lands within 2x of the best in all of them but the LoRA (4e-3, 7.5x below); 5e-2 would put Lion and Muon 3x above.
ADAPTIVE_FIRST_UPDATE_RATIO = 3e-2
# A scheduled rate (a warmup's, a decay's) this far below the schedule's peak is not the number
# the program set: the suggestion then scales the optimizer's lr, the peak, by the same factor.
SCHEDULE_PEAK_GAP = 1.5


def clip_norm(ctx: Context, before_step: int | None = None) -> float | None:
    """A ``max_norm`` for ``clip_grad_norm_``: the 90th percentile of the finite gradient norms
    seen while training was still healthy (before ``before_step``), so typical steps pass
    untouched and only the outliers are cut."""
    g = ctx.grad_norm.finite()
    if before_step is not None:
        g = g.before(before_step)
    vals = g.values[g.values > 0]
    if len(vals) < 3:
        return None
    return sig(float(np.percentile(vals, 90)))


def clipping_words(c: dict | None, norms: bool = True) -> str:
    """What the loop already does about large gradients, from the run's ``clipping`` record ("" when
    it does not clip). ``norms``: say that the gradient norms the run holds are those before clipping."""
    if not c:
        return ""
    name = "clip_value" if c.get("function") == "clip_grad_value_" else "max_norm"
    value = c.get("value")
    at = f", {name}={fmt(value)}" if isinstance(value, (int, float)) else ""
    before = "; the gradient norms here are the ones before clipping" if norms else ""
    return f"the loop already clips its gradients (`{c.get('function')}`{at}{before}), so clipping is not what is missing"


def clipping_text(ctx: Context, norms: bool = True) -> str:
    """What the loop already does about large gradients ("" when it does not clip)."""
    return clipping_words(ctx.clipping, norms)


def slow_updates(ctx: Context, layers: list[str]) -> str:
    """What slows updates that grew or wore ``layers`` out: a lower rate, and clipping and weight
    decay where the loop does not have them already (it may clip, and decay every one of their
    weight matrices: then it says so, with the values)."""
    decay = ctx.weight_decay(layers)
    text = "lower the learning rate"
    if decay is not None:
        text += f" (weight decay is already on: weight_decay={fmt(decay)} on these layers' weights)"
        return text + ("; " + clipping_text(ctx, norms=False) if ctx.clipping
                       else ", or clip the gradients (`torch.nn.utils.clip_grad_norm_`)")
    if ctx.clipping:
        return text + " or add weight decay; " + clipping_text(ctx, norms=False)
    return text + ", clip the gradients (`torch.nn.utils.clip_grad_norm_`) or add weight decay"


def clip_text(ctx: Context, before_step: int | None = None) -> str:
    """A ``clip_grad_norm_`` call with a norm read off the run; for a loop that clips already, says so."""
    already = clipping_text(ctx)
    if already:
        return already
    c = clip_norm(ctx, before_step)
    if c is None:
        return ""
    g = ctx.grad_norm.finite()
    if before_step is not None:
        g = g.before(before_step)
    med = float(np.median(g.values)) if len(g) else math.nan
    lr = ctx.lr()
    if lr is not None and _one_per_parameter(ctx, ctx.other_optimizers(), lr, None):
        # svi.step() runs backward and the update in one call: pyro clips through the optimizer
        return (f"clip gradients through the optimizer, `pyro.optim.Adam({{'lr': ...}}, {{'clip_norm': {fmt(c)}}})` "
                f"(its clip_args; pyro clips each parameter's gradient to that norm; the 90th percentile of the "
                f"observed gradient norms, median {fmt(med)})")
    return (
        f"clip gradients with `torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm={fmt(c)})` "
        f"(the 90th percentile of the observed gradient norms; median {fmt(med)})"
    )


_ORDINALS = ("first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth", "tenth")


def _one_per_parameter(ctx: Context, others: dict[int, list[int]], lr: float, step: int | None) -> bool:
    """As many optimizers as trainable parameters, one group each, all at the first one's rate: one
    optimizer per parameter, made from one set of arguments (pyro.optim's ``PyroOptim`` makes a torch
    optimizer for each parameter it is handed), not separate objects for the user to change."""
    trainable = sum(1 for info in ctx.params.values() if info.get("requires_grad", True))
    return (bool(others) and len(others) + 1 == trainable and ctx.lr_groups() == [0]
            and all(groups == [0] and ctx.lr(step, group=f"{k}.0") == lr for k, groups in others.items()))


def _other_groups(ctx: Context, lr: float, factor: float, step: int | None = None) -> str:
    """The rates of the other parameter groups (a backbone's lower one, as DETR's ``lr_backbone``)
    and of the other optimizers that step (the AdamW beside Muon), scaled by the same factor; ""
    when there is one optimizer and every group has the first group's rate. Another optimizer's
    rates are named even when equal to the first's: it is a separate object to change."""
    others = ctx.other_optimizers()
    if _one_per_parameter(ctx, others, lr, step):
        return (f" (the rate of all {len(others) + 1} optimizers, one per parameter, as pyro.optim makes them from "
                "its one set of arguments)")
    moves = []
    for g in ctx.lr_groups():
        other = ctx.lr(step, group=g)
        if g != 0 and other is not None and other != lr:
            moves.append(f"parameter group {g}'s from {fmt(other)} to about {fmt(sig(other * factor, 1))}")
    for k, groups in others.items():
        whose = f"the {_ORDINALS[k]} optimizer's" if k < len(_ORDINALS) else f"optimizer {k + 1}'s"
        for g in groups:
            other = ctx.lr(step, group=f"{k}.{g}")
            if other:  # a rate of 0 moves nothing: not one to lower, nor to scale up from
                name = whose if len(groups) == 1 else f"{whose} group {g}'s"
                moves.append(f"{name} from {fmt(other)} to about {fmt(sig(other * factor, 1))}")
    return f", and {', '.join(moves)}" if moves else ""


def lr_lower(ctx: Context, ratio: float | None, step: int | None = None,
             target: float = TARGET_UPDATE_RATIO, why: str = "") -> tuple[float | None, str]:
    """A lower learning rate: scaled so the update-to-weight ratio lands near ``target`` (1e-3), at least
    10x lower than the one in force at ``step`` (where training diverged), or the run's usual one.
    ``why``: how that ratio was aimed, said after the rate."""
    lr = ctx.lr(step)
    if lr is None:
        return None, f"lower the learning rate about 10x; {LR_RANGE_TEST}"
    factor = 0.1
    if ratio is not None and math.isfinite(ratio) and ratio > 0:
        factor = min(0.1, target / ratio)
    new = sig(lr * factor, 1)
    text = f"lower the learning rate from {fmt(lr)} to about {fmt(new)}{_other_groups(ctx, lr, factor, step)}"
    peak = ctx.lr_peak()
    if step is not None and peak is not None and peak > SCHEDULE_PEAK_GAP * lr and ctx.meta.get("lr_by_hand"):
        # Nothing that scales the optimizer's lr (LambdaLR, cosine) owns the rates: the loop writes
        # param_group["lr"] itself (llama2.c's and nanoGPT's get_lr(it)), or ReduceLROnPlateau lowers
        # it, which adds no initial_lr either.
        text += (f" (the rate at step {step}; its peak {fmt(peak)}, set in param_group['lr'] with no scheduler that "
                 "scales it: the loop's own get_lr(it), or ReduceLROnPlateau, which only lowers it): lower the peak "
                 f"the loop computes (or the optimizer's lr) from {fmt(peak)} to about {fmt(sig(peak * factor, 1))}, "
                 "and its other rates (a floor such as a min_lr) by the same factor")
    elif step is not None and peak is not None and peak > SCHEDULE_PEAK_GAP * lr:
        # A scheduler that scales the optimizer's lr (LambdaLR, LinearLR, cosine) follows it; one that
        # sets rates of its own (OneCycleLR's max_lr, ignite's PiecewiseLinear) overwrites it.
        text += (f" (the schedule's rate at step {step}, below its peak {fmt(peak)}): lower the peak from "
                 f"{fmt(peak)} to about {fmt(sig(peak * factor, 1))} and the schedule's other rates by the same "
                 "factor: the optimizer's lr where the scheduler scales it (LambdaLR, LinearLR, cosine), the "
                 "scheduler's own rates where it sets them (OneCycleLR's max_lr, ignite's PiecewiseLinear "
                 "milestones_values)")
    return new, f"{text}{why}; {LR_RANGE_TEST}"


def lr_higher(ctx: Context, ratio: float | None) -> tuple[float | None, str]:
    lr = ctx.lr()
    if lr is None:
        return None, f"raise the learning rate; {LR_RANGE_TEST}"
    if lr == 0:
        return None, (
            "the learning rate is 0: check the scheduler (an integer division such as `step // warmup` gives 0) "
            f"and the parameter groups; {LR_RANGE_TEST}"
        )
    factor = 100.0
    if ratio is not None and math.isfinite(ratio) and ratio > 0:
        factor = min(1000.0, max(10.0, TARGET_UPDATE_RATIO / ratio))
    new = sig(lr * factor, 1)
    return new, f"raise the learning rate from {fmt(lr)} to about {fmt(new)}{_other_groups(ctx, lr, factor)}; {LR_RANGE_TEST}"


def init_advice(ctx: Context, params: list[str], act: str) -> tuple[dict, str]:
    """Compare the initial weight scale of ``params`` with the scale their activation wants.

    Only a run whose first recording came before any update knows the initial scale; otherwise
    (a resumed run, a monitor started mid-training) the rows say at which step the scale was
    measured and the text makes no claim about how the weights started.
    """
    rows = {}
    off = []
    initial = ctx.weights_initial
    for p in params:
        c = ctx.weight_init_check(p)
        if c is None:
            continue
        want = c["kaiming"] if act == "relu" else c["xavier"]
        if initial:
            rows[p] = {"init_rms": c["rms"], "recommended_rms": want, "fan_in": c["fan_in"]}
        else:
            rows[p] = {"rms_at_step": c["rms"], "step": c["step"], "recommended_rms": want, "fan_in": c["fan_in"]}
        if initial and (c["rms"] > 3 * want or c["rms"] < want / 3):
            off.append(f"{p} started with RMS {fmt(c['rms'])} vs {fmt(want)}")
    if act == "relu":
        how = "Kaiming initialisation: `nn.init.kaiming_normal_(layer.weight, nonlinearity='relu')`, bias 0"
    else:
        how = "Xavier/Glorot initialisation: `nn.init.xavier_uniform_(layer.weight, gain=nn.init.calculate_gain('tanh'))`"
    if off:
        return rows, f"{how} ({'; '.join(off[:3])})"
    return rows, how


# Matched inside the class name too: models bring their own (transformers' GELUActivation,
# llm.c's NewGELU, SiLUActivation).
_RELU_LIKE = ("ReLU", "GELU", "SiLU", "Swish", "Mish")
_RELU_EXACT = frozenset({"ELU", "CELU", "SELU"})  # as parts of names they would match ReLU


def activation_family(ctx: Context) -> str:
    """'relu' when the watched layers are mostly ReLU-like, else 'tanh' (sigmoid and tanh stacks)."""
    types = list(ctx.layer_type.values())
    relu = sum(isinstance(t, str) and (t in _RELU_EXACT or any(name in t for name in _RELU_LIKE)) for t in types)
    squash = sum(t in ("Tanh", "Sigmoid", "Hardtanh", "Softsign") for t in types)
    return "tanh" if squash > relu else "relu"


# Op name (as short_op writes it) -> what to do about a non-finite value it produced.
_OP_FIXES = (
    (("log_softmax",), "compute log-probabilities with `F.log_softmax` / `F.cross_entropy` on the logits"),
    (("log", "log2", "log10", "log1p"),
     "the input reached 0 (or below): clamp it first, `torch.log(x.clamp_min(1e-6))`, or use `F.log_softmax` / "
     "`F.cross_entropy` instead of log(softmax)"),
    (("div", "reciprocal"), "a denominator reached 0: add an epsilon, `x / (d + 1e-6)`, or `d.clamp_min(1e-6)`"),
    (("sqrt", "rsqrt"),
     "sqrt/rsqrt of 0 (infinite gradient) or of a negative number: `torch.sqrt(x + 1e-12)` or `x.clamp_min(1e-12)`"),
    (("norm", "linalg_vector_norm"), "the norm of a zero vector has no gradient: `x.norm(dim=-1).clamp_min(1e-12)` "
                                     "or `F.normalize(x, eps=1e-12)`"),
    (("pow",), "a fractional power of 0 or of a negative number: clamp the base, `x.clamp_min(1e-12) ** p`"),
    (("exp",), "exp overflowed: subtract the maximum first (`torch.logsumexp`, `F.softmax`) or clamp the exponent"),
)


def op_fix(op: str | None) -> str | None:
    if not op:
        return None
    base = op.split(".")[1] if op.startswith("aten.") and "." in op else op.split(".")[0]
    for names, text in _OP_FIXES:
        if base in names:
            return text
    return None


def origin_of(run: Any, before_step: int | None = None, since_step: int | None = None,
              handled: bool = False) -> dict | None:
    """Where the recorder's first harmful value was made (when the run was recorded; in a guard's
    run, where the replay of its earliest failing step found it), as finding evidence: the origin
    of the analysis' walk back, not the first non-finite output (an intended -inf mask is never the
    cause). ``since_step``: of the first harmful value in
    that step or later; ``handled``: also among the gradients a GradScaler discarded."""
    from trainguard.analysis._origin import origin

    try:
        o = origin(run, since_step=since_step, handled=handled)
    except Exception:  # a run without a recording, or a damaged one: no origin
        o = None
    if o is None:  # a guard's run: the origin its replay of the failing step found
        return _guard_origin(run, before_step, since_step)
    return _origin_evidence(asdict(o.origin), o.harm, o.suggestion, before_step)


def _guard_origin(run: Any, before_step: int | None, since_step: int | None) -> dict | None:
    """The origin of the earliest guard event in range (``trainguard run --guard --monitor``)."""
    try:
        events = [f.get("event") or {} for f in run.findings(source="guard")]
    except Exception:  # an older run without findings
        return None
    events = [e for e in events if isinstance(e.get("origin"), dict) and isinstance(e.get("step"), int)
              and (since_step is None or e["step"] >= since_step)]
    for e in sorted(events, key=lambda e: e["step"]):
        o = e["origin"]
        if isinstance(o.get("origin"), dict):
            return _origin_evidence(o["origin"], o.get("harm"), o.get("suggestion", ""), before_step)
    return None


# Ops that make a tensor of values the program hands in (``torch.tensor(...)``, ``x[i] = nan``).
_GIVEN_OPS = frozenset({"lift_fresh", "lift_fresh_copy"})


def _origin_evidence(link: dict, harm: str | None, fix: str, before_step: int | None) -> dict | None:
    """An origin link (``asdict(Link)``) as finding evidence; None when it comes after ``before_step``."""
    step = link.get("step")
    if before_step is not None and step is not None and step > before_step:
        return None
    out = {"op": link.get("op"), "step": step, "phase": link.get("phase"), "module": link.get("module"),
           "health": link.get("health")}
    if link.get("file"):
        out["file"] = link["file"]
        out["line"] = link.get("line")
        out["function"] = link.get("function")
    if harm:
        out["harm"] = harm
    if str(link.get("op")).removeprefix("aten.").split(".")[0] in _GIVEN_OPS and link.get("phase") != "backward":
        # a constant, an array or a sample of the data became a tensor holding it: no op computed
        # it, so how the loss moved before says nothing about where it came from
        out["given"] = True
    out["fix"] = fix
    zeros = [f"input {i['slot']} ({i.get('producer_op')}) holds {i['summary']['zero']} zero(s)"
             for i in link.get("inputs") or [] if (i.get("summary") or {}).get("zero")]
    if zeros:
        out["inputs"] = zeros
    return out


def where(origin: dict) -> str:
    if origin.get("file"):
        return f"{origin.get('op')} at {origin['file']}:{origin.get('line')}"
    return str(origin.get("op"))
