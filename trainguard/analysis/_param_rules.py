"""Rules about parameters and modes: no gradient, not in the optimizer, never updated, frozen,
gradients accumulating (missing ``zero_grad``), train/eval mode mistakes."""

from __future__ import annotations

import math

import numpy as np

from trainguard.analysis._context import Context, fmt
from trainguard.analysis._layer_rules import fully_dead_layers, negative_layers
from trainguard.analysis._rules import register_rule
from trainguard.store import Finding

SOURCE = "monitor"
# A relative change below float32's resolution (2**-23 ~ 1.2e-7, with margin) rounds to no change.
FLOAT32_RESOLUTION = 1e-6
# Parameters kept in a 16-bit float lose any step below half their spacing: |w| * 2**-8 in
# bfloat16 (7 stored mantissa bits), |w| * 2**-11 in float16 (10).
LOW_PRECISION_HALF_SPACING = {"bfloat16": 2.0**-8, "float16": 2.0**-11}


def _steps(ctx: Context) -> tuple[int, int] | None:
    return (ctx.recorded_steps[0], ctx.recorded_steps[-1]) if ctx.recorded_steps else None


def _layers(ctx: Context, params: list[str]) -> list[str]:
    out = []
    for p in params:
        la = ctx.params.get(p, {}).get("layer", p)
        if la not in out:
            out.append(la)
    return out


def _names(params: list[str], limit: int = 6) -> str:
    return ", ".join(params[:limit]) + (f" and {len(params) - limit} more" if len(params) > limit else "")


def _who(some: list[str], of: list[str]) -> str:
    return "they" if len(some) == len(of) else _names(some, 3)


def _all_zero(ctx: Context, p: str, stat: str) -> bool:
    s = ctx.stat(p, "gradient", stat)
    return len(s) >= 2 and not np.any(s.values)


def untrained_models(ctx: Context) -> dict[str, list[str]]:
    """Watched models (of several) that nothing trains: no optimizer holds a parameter of theirs and
    no gradient reaches one (a DQN's target network, an EMA copy, a teacher). Prefix -> parameters."""
    prefixes = sorted({r.get("prefix") or "" for r in ctx.meta.get("roots") or []}, key=len, reverse=True)
    if len(prefixes) < 2:
        return {}
    groups: dict[str, list[str]] = {}
    for p in ctx.params:
        groups.setdefault(next((x for x in prefixes if p.startswith(x)), ""), []).append(p)
    return {pre: ps for pre, ps in groups.items() if all(_untrained(ctx, p) for p in ps)}


def _untrained(ctx: Context, p: str) -> bool:
    info = ctx.params.get(p, {})
    if not info.get("requires_grad", True) and not info.get("optimizer"):
        # frozen and in no optimizer: an EMA copy run only to sample after (or between) the
        # recordings has no statistics, and needs none
        return True
    return _all_zero(ctx, p, "present") and _all_zero(ctx, p, "in_optimizer")


def hand_copies(ctx: Context) -> list[str]:
    """Parameters that require grad but that no optimizer holds and no gradient reaches, whose weights
    change between recordings all the same: a copy moved by hand inside a trained model (timm's
    ModelEmaV3 beside the model it averages, a momentum encoder left requiring grad)."""
    aside = {p for ps in untrained_models(ctx).values() for p in ps}
    return [p for p, info in ctx.params.items()
            if info.get("requires_grad", True) and p not in aside and not info.get("optimizer")
            and _all_zero(ctx, p, "present") and _all_zero(ctx, p, "in_optimizer") and _moved_without_update(ctx, p)]


def moving_targets(ctx: Context) -> list[str]:
    """Parameters in no optimizer, reached by no gradient, whose weights change between recordings
    all the same, in layers that run in the recorded steps: an EMA teacher or momentum encoder whose
    output is the loss's target (DINO's teacher, BYOL's target, MoCo's key encoder). An EMA copy run
    only to sample has no activation statistics and is not one."""
    return [p for p, info in ctx.params.items()
            if not info.get("optimizer") and (not info.get("requires_grad", True) or _all_zero(ctx, p, "present"))
            and ctx.has(info.get("layer", p), "activation", "mean") and _moved_without_update(ctx, p)]


def frozen_copies(ctx: Context) -> dict[str, str]:
    """Models nothing trains whose weights never changed and were, at the first recording, the
    weights of a trained model of the same shape (DINO's teacher loaded from the student, MoCo's key
    encoder copied from the query encoder) while those moved since: an EMA or momentum update that
    does nothing (a momentum of 1, or never called). Untrained prefix -> trained prefix."""
    prefixes = sorted({r.get("prefix") or "" for r in ctx.meta.get("roots") or []}, key=len, reverse=True)
    out: dict[str, str] = {}
    for pre, ps in untrained_models(ctx).items():
        for other in prefixes:
            if other == pre or other in out.values():
                continue
            pairs = [(p, other + p[len(pre):]) for p in ps]
            if pairs and all(q in ctx.params and _copy_kept(ctx, p, q) for p, q in pairs) and any(
                    _moved(ctx, q) for _, q in pairs):
                out[pre] = other
                break
    return out


def _moved(ctx: Context, p: str) -> bool:
    w = ctx.stat(p, "weight", "norm").finite()
    return len(w) >= 2 and bool(np.max(np.abs(w.values - w.values[0])) > 1e-6 * max(abs(w.values[0]), 1e-12))


def _copy_kept(ctx: Context, p: str, q: str) -> bool:
    """``p`` never moved and started where ``q`` started."""
    w, v = ctx.stat(p, "weight", "norm").finite(), ctx.stat(q, "weight", "norm").finite()
    if len(w) < 2 or not len(v) or _moved(ctx, p):
        return False
    return abs(w.values[0] - v.values[0]) <= 1e-6 * max(abs(v.values[0]), 1e-12)


def _trainable(ctx: Context) -> list[str]:
    """Parameters that require grad, outside the models nothing trains and the copies moved by hand."""
    aside = {p for ps in untrained_models(ctx).values() for p in ps} | set(hand_copies(ctx))
    return [p for p, info in ctx.params.items() if info.get("requires_grad", True) and p not in aside]


@register_rule("model_not_trained")
def model_not_trained(ctx: Context) -> list[Finding]:
    out = []
    types = {r.get("prefix") or "": r.get("type") for r in ctx.meta.get("roots") or []}
    # In a reinforcement learning run a model kept at a trained model's initial weights is a target
    # network never synced: its targets come from the random initial network (a frozen reference
    # outside RL, DPO's, is frozen on purpose).
    copies = frozen_copies(ctx) if ctx.environment else {}
    for pre, ps in untrained_models(ctx).items():
        name = ctx.model_name(pre)
        if pre in copies:
            of = ctx.model_name(copies[pre])
            out.append(Finding(
                kind="model_not_trained",
                severity="warning",
                title=f"Target network {name} ({types.get(pre)}) never synced: it kept {of}'s weights from the first "
                f"recording while {of} trained",
                evidence={"model": name, "type": types.get(pre), "params": len(ps),
                          "frozen_copy": {"model": name, "of": of}, "environment": ctx.environment},
                suggestion=f"the script steps a reinforcement learning environment ({ctx.environment}): targets "
                f"computed by {name} come from the initial network, and the loss falls onto them whatever the "
                f"agent learns; copy {of}'s weights into it every N updates (target.load_state_dict("
                "online.state_dict())) or soft-update it each step (tau 0.005, as the PyTorch DQN tutorial); in "
                "stable-baselines3 keep target_update_interval well below learn()'s total_timesteps",
                layers=_layers(ctx, ps),
                source=SOURCE,
            ))
            continue
        out.append(Finding(
            kind="model_not_trained",
            severity="info",
            title=f"Model {name} ({types.get(pre)}) is not trained: no optimizer holds its {len(ps)} parameter(s) "
            "and no gradient reaches them (a target network, an EMA copy or a teacher)",
            evidence={"model": name, "type": types.get(pre), "params": len(ps)},
            suggestion="nothing to do for a target, EMA or teacher model (`requires_grad_(False)` on it says so); "
            "a model that should learn needs its parameters in an optimizer and a path from the loss",
            layers=_layers(ctx, ps),
            source=SOURCE,
        ))
    copies = hand_copies(ctx)
    if copies:
        out.append(Finding(
            kind="model_not_trained",
            severity="info",
            title=f"{len(copies)} parameter(s) ({_names(copies, 3)}) are in no optimizer and get no gradient but "
            "change between recordings: an EMA or momentum copy updated by hand",
            evidence={"params": copies, "updated_by_hand": copies},
            suggestion="nothing to do for an EMA, momentum or teacher copy (`requires_grad_(False)` on it says so)",
            layers=_layers(ctx, copies),
            source=SOURCE,
        ))
    return out


def _never_routed(ctx: Context, missing: list[str]) -> tuple[dict[str, list[str]], set[str]]:
    """Members of a ModuleList (``experts.2``) none of whose parameters got a gradient while some
    sibling's did: an expert of a mixture of experts that the router never sent a token. By list
    path, the members' indices; and their parameters."""
    gone = set(missing)

    def member(name: str) -> tuple[str, str] | None:
        parts = ctx.params[name].get("layer", "").split(".") if name in ctx.params else []
        idx = [i for i, x in enumerate(parts) if x.isdigit() and i > 0]
        return (".".join(parts[:idx[-1]]), parts[idx[-1]]) if idx else None

    members: dict[tuple[str, str], list[str]] = {}
    for p in _trainable(ctx):
        m = member(p)
        if m is not None:
            members.setdefault(m, []).append(p)
    def ran_on_data(ps: list[str]) -> bool:
        # Activation statistics at a recorded step: the member was called on rows there (an expert
        # with no row is not called, or on an empty split, which has none), so no routing starved
        # it: a block of a layer stack behind a .detach() runs on the whole batch every step.
        return any(len(ctx.stat(ctx.params[p].get("layer", ""), "activation", "mean")) for p in ps)

    out: dict[str, list[str]] = {}
    params: set[str] = set()
    for (path, i), ps in members.items():
        if all(p in gone for p in ps) and not ran_on_data(ps) and any(
                q == path and j != i and not any(p in gone for p in qs) for (q, j), qs in members.items()):
            out.setdefault(path, []).append(i)
            params.update(ps)
    return {path: sorted(ix, key=int) for path, ix in out.items()}, params


def _routing_advice(routed: dict[str, list[str]]) -> str:
    names = [f"{path}.{i}" for path, ix in routed.items() for i in ix]
    return (f"{_names(names)} got no gradient (none, or only zeros) while other members of {', '.join(routed)} "
            "did: as experts of a mixture of experts, the router never sent them a token (a mask or bias that rules "
            "them out, a collapsed router); check the routing, and add a load-balancing loss or raise its "
            "coefficient (if they are layers the forward never calls, use or remove them)")


@register_rule("param_no_gradient")
def param_no_gradient(ctx: Context) -> list[Finding]:
    missing = []
    for p in _trainable(ctx):
        present = ctx.stat(p, "gradient", "present")
        # (a gradient at a step the monitor did not record counts: an expert of a mixture of experts
        # that the router sent tokens to only between recordings)
        if len(present) >= 2 and np.all(present.values == 0) and not ctx.params.get(p, {}).get("gradient_steps"):
            missing.append(p)
    if not missing or len(missing) == len(_trainable(ctx)):
        return []  # no parameter at all with a gradient: nothing was trained under the monitor
    missing = ctx.ordered(missing)
    # Where their layers ran with gradients off inside a training forward (the monitor's note).
    ran = ctx.meta.get("no_grad_layers") or {}
    how = {p: ran.get(ctx.params[p].get("layer")) for p in missing}
    checkpointed = [p for p in missing if how[p] == "checkpoint"]
    no_grad = [p for p in missing if how[p] == "no_grad"]
    evidence: dict = {"params": missing, "recordings": len(ctx.recorded_steps)}
    advice = []
    if checkpointed:
        evidence["checkpointed"] = checkpointed
        advice.append(
            f"{_who(checkpointed, missing)} run inside activation checkpointing with `use_reentrant=True` "
            "(`torch.utils.checkpoint`, transformers' `gradient_checkpointing_enable`) whose inputs need no "
            "gradient (a frozen embedding, as under LoRA): such a checkpoint passes no gradient back. Call "
            "`model.enable_input_require_grads()` before training (or make the checkpoint's input require "
            "grad), or checkpoint with `use_reentrant=False`")
    if no_grad:
        evidence["no_grad"] = no_grad
        advice.append(f"{_who(no_grad, missing)} run with gradients off inside the training forward "
                      "(`torch.no_grad()`, `torch.set_grad_enabled(False)`): compute them outside that block")
    routed, idle = _never_routed(ctx, [p for p in missing if p not in checkpointed and p not in no_grad])
    if routed:
        evidence["never_routed"] = routed
        advice.append(_routing_advice(routed))
    whole = _whole_model(ctx, missing)
    if whole is not None:
        # every trainable parameter of one model among several, while an optimizer holds them: its
        # loss is cut off from it (a GAN's generator scored on detached fakes)
        evidence["model"] = whole[0]
        advice.append(f"every parameter of {_model_text(*whole)} is cut off from the loss while its optimizer "
                      "steps: in a GAN, the generator's loss must run the discriminator on the generated batch "
                      "itself, `discriminator(gen_imgs)`, not on `fake.detach()` (detach only in the "
                      "discriminator's step)")
    if len(checkpointed) + len(no_grad) + len(idle) < len(missing):
        advice.append("no gradient reaches them: look for `.detach()`, `torch.no_grad()`, `.data` or `.item()` "
                      "between them and the loss, or a layer defined but not used in `forward`; if they are "
                      "frozen on purpose, set `requires_grad=False`")
    of = f" (all of {_model_text(*whole)})" if whole is not None else ""
    return [
        Finding(
            kind="param_no_gradient",
            severity="warning",
            title=f"{len(missing)} trainable parameter(s){of} never received a gradient: {_names(missing)}",
            evidence=evidence,
            suggestion="; ".join(advice),
            steps=_steps(ctx),
            layers=_layers(ctx, missing),
            source=SOURCE,
        )
    ]


def _model_text(name: str, kind: str) -> str:
    """``model discriminator (Discriminator)``; the first model found, which has no prefix:
    ``the first model (Generator)``."""
    return f"the first model ({kind})" if name == "(the first model)" else f"model {name} ({kind})"


def _whole_model(ctx: Context, params: list[str]) -> tuple[str, str] | None:
    """(name, type) of the one watched model among several whose trainable parameters ``params`` are
    exactly, all held by an optimizer; otherwise None."""
    models = _model_of(ctx)
    owners = {models[p] for p in params if p in models}
    if len(owners) != 1 or len(params) != sum(1 for p in params if p in models):
        return None
    owner = owners.pop()
    own = [p for p in _trainable(ctx) if models.get(p) == owner]
    if sorted(own) != sorted(params) or not all(ctx.params[p].get("optimizer") for p in params):
        return None
    return owner


@register_rule("param_zero_gradient")
def param_zero_gradient(ctx: Context) -> list[Finding]:
    blocked = _behind_dead_layers(ctx)
    zero = []
    for p in _trainable(ctx):
        norm = ctx.stat(p, "gradient", "norm")
        if len(norm) < 2 or np.any(norm.values != 0):
            continue
        if ctx.params[p].get("layer") in blocked:
            continue  # a dead layer blocks it: reported as dead units
        zero.append(p)
    # A bias whose own layer's weight learns: the loss depends on differences between that layer's
    # outputs only, and a constant added to all of them cancels (a WGAN critic's output bias in
    # -D(real).mean() + D(fake).mean(); a ranking loss on score differences). Nothing is cut off.
    shift = [p for p in zero if _bias_beside_learning_weight(ctx, p)]
    zero = [p for p in zero if p not in shift]
    out = [_shift_invariant(ctx, ctx.ordered(shift))] if shift else []
    if not zero:
        return out
    zero = ctx.ordered(zero)
    evidence: dict = {"params": zero}
    advice = []
    routed, idle = _never_routed(ctx, zero)
    if routed:
        # an expert called on an empty slice of the batch (a split by each expert's token count)
        evidence["never_routed"] = routed
        advice.append(_routing_advice(routed))
    negative = negative_layers(ctx)
    behind = _behind(ctx, negative)
    if negative:
        evidence["negative_layers"] = negative
        top = float(np.max(ctx.stat(negative[0], "activation", "max").values))
        advice.append(
            f"layer {negative[0]}'s outputs are negative for every sample (at most {fmt(top)}): a ReLU after it "
            "(`F.relu`, not a module the monitor sees as a layer) outputs 0 everywhere, so its units are dead and "
            "nothing before it learns; initialise its bias at 0 (or check its weights' initialisation and the "
            "scale of its input)")
    if len([p for p in zero if ctx.params[p].get("layer") not in behind]) > len(idle):
        advice.append("the loss does not depend on them (multiplied by 0, masked out, or behind a constant "
                      "branch); remove them or fix the path to the loss")
    return [
        Finding(
            kind="param_zero_gradient",
            severity="warning",
            title=f"{len(zero)} parameter(s) always get an all-zero gradient: {_names(zero)}",
            evidence=evidence,
            suggestion="; ".join(advice),
            steps=_steps(ctx),
            layers=_layers(ctx, zero),
            source=SOURCE,
        )
    ] + out


def _bias_beside_learning_weight(ctx: Context, p: str) -> bool:
    layer = ctx.params[p].get("layer")
    if not p.endswith(".bias") or not layer or p != f"{layer}.bias":
        return False
    w = ctx.stat(f"{layer}.weight", "gradient", "norm").finite()
    return len(w) >= 2 and bool(np.all(w.values > 0))


def _shift_invariant(ctx: Context, biases: list[str]) -> Finding:
    layers = _layers(ctx, biases)
    return Finding(
        kind="param_zero_gradient",
        severity="info",
        title=f"{len(biases)} bias(es) always get an all-zero gradient while their layer's weights learn: "
        f"{_names(biases)}; the loss depends only on differences between {_names(layers, 3)}'s outputs",
        evidence={"params": biases, "shift_invariant": True},
        suggestion="nothing is cut off: a constant added to every output cancels in the loss (a WGAN critic's "
        "-D(real).mean() + D(fake).mean(), a ranking loss on score differences), so the bias can never learn; "
        "`bias=False` on that layer says so",
        steps=_steps(ctx),
        layers=layers,
        source=SOURCE,
    )


def _behind_dead_layers(ctx: Context) -> set[str]:
    return _behind(ctx, fully_dead_layers(ctx))


def _behind(ctx: Context, dead_layers: list[str]) -> set[str]:
    """Layers whose weight gradient fully dead layers zero: every layer before the last dead
    one (no gradient flows back through it) and the first layer with weights after it (its
    input is all zeros)."""
    order = ctx.layer_order
    dead = [order.index(la) for la in dead_layers if la in order]
    if not dead:
        return set()
    last = max(dead)
    out = set(order[: last + 1])
    with_params = {info.get("layer") for info in ctx.params.values()}
    for la in order[last + 1 :]:
        if la in with_params:
            out.add(la)
            break
    return out


@register_rule("param_not_in_optimizer")
def param_not_in_optimizer(ctx: Context) -> list[Finding]:
    out = []
    for p in _trainable(ctx):
        flag = ctx.stat(p, "gradient", "in_optimizer")
        present = ctx.stat(p, "gradient", "present")
        if len(flag) >= 2 and np.all(flag.values == 0) and len(present) and present.values.mean() > 0.5:
            out.append(p)
    if not out:
        return []
    out = ctx.ordered(out)
    return [
        Finding(
            kind="param_not_in_optimizer",
            severity="warning",
            title=f"{len(out)} parameter(s) get gradients but are in no optimizer: {_names(out)}",
            evidence={"params": out},
            suggestion="they are never updated: build the optimizer after the model is complete (a layer replaced "
            "after `optim.X(model.parameters())` is not in it), or add them with "
            "`optimizer.add_param_group({'params': [...]})`",
            steps=_steps(ctx),
            layers=_layers(ctx, out),
            source=SOURCE,
        )
    ]


@register_rule("param_not_updating")
def param_not_updating(ctx: Context) -> list[Finding]:
    out = []
    lr = ctx.lr()
    for p in _trainable(ctx):
        upd = ctx.stat(p, "update", "norm")
        g = ctx.relgrad(p)
        if len(upd) < 2 or np.any(upd.values != 0) or not len(g):
            continue
        biggest = float(np.nanmax(g.values))
        if lr is not None and lr > 0 and lr * biggest < FLOAT32_RESOLUTION:
            continue  # the gradient is too small to change a float32 weight: vanishing, not frozen
        if biggest > 0:  # a real gradient, yet the optimizer leaves it alone
            out.append(p)
    if not out:
        return []
    out = ctx.ordered(out)
    zero_lr = [k for k, s in ctx.lrs.items() if len(s) and np.all(s.values == 0)]
    evidence: dict = {"params": out, "zero_learning_rates": zero_lr}
    low = {p: ctx.params[p]["dtype"] for p in out if ctx.params.get(p, {}).get("dtype") in LOW_PRECISION_HALF_SPACING}
    if low and not zero_lr:
        evidence["dtypes"] = low
        suggestion = _rounded_away(ctx, low, lr)
    else:
        suggestion = ("check their parameter group's learning rate" + (f" ({', '.join(zero_lr)} is 0)" if zero_lr else "")
                      + " and any code that restores or masks them after `optimizer.step()`")
    return [
        Finding(
            kind="param_not_updating",
            severity="warning",
            title=f"{len(out)} parameter(s) have gradients and an optimizer but never change: {_names(out)}",
            evidence=evidence,
            suggestion=suggestion,
            steps=_steps(ctx),
            layers=_layers(ctx, out),
            source=SOURCE,
        )
    ]


def _rounded_away(ctx: Context, low: dict[str, str], lr: float | None) -> str:
    """Why parameters held in bfloat16 / float16 never change: their steps round back to them."""
    p = next(iter(low))
    dtype = low[p]
    numel = float(np.prod(ctx.params[p].get("shape") or [1]))
    norm = ctx.stat(p, "weight", "norm").values
    size = float(np.nanmedian(norm)) / math.sqrt(numel) if len(norm) and numel else float("nan")
    where = (f"near their size (|w| ~ {fmt(size)}) a step below {fmt(size * LOW_PRECISION_HALF_SPACING[dtype])} "
             if math.isfinite(size) and size > 0 else "a step below half their spacing ")
    rate = f" (learning rate {fmt(lr)})" if lr else ""
    return (f"they are stored in {dtype}: {where}rounds back to the same value, and the optimizer's steps{rate} are "
            f"smaller. Keep the weights in float32 and compute in {dtype} (torch.autocast; Fabric precision="
            f"\"{'bf16' if dtype == 'bfloat16' else '16'}-mixed\", accelerate mixed_precision="
            f"\"{'bf16' if dtype == 'bfloat16' else 'fp16'}\"), or use an optimizer that keeps float32 master weights")


def _moved_without_update(ctx: Context, p: str) -> bool:
    """Whether parameter ``p``'s weights changed between recordings while no optimizer step moved
    them (its update norm 0 or unrecorded): written by hand, as a momentum copy is."""
    w = ctx.stat(p, "weight", "norm").finite()
    if len(w) < 2:
        return False
    u = ctx.stat(p, "update", "norm").finite()
    # any change between two recordings: a norm may come back (a batch norm's ones, averaged)
    moved = np.max(np.abs(np.diff(w.values))) > 1e-6 * max(abs(w.values[0]), 1e-12)
    return not np.any(u.values) and bool(moved)


@register_rule("params_frozen")
def params_frozen(ctx: Context) -> list[Finding]:
    aside = {p for ps in untrained_models(ctx).values() for p in ps}  # model_not_trained says it
    frozen = [p for p, info in ctx.params.items() if not info.get("requires_grad", True) and p not in aside]
    if not frozen:
        return []
    by_hand = [p for p in frozen if _moved_without_update(ctx, p)]
    tables = [p for p in frozen if ctx.params[p].get("fixed") and p not in by_hand]
    ev: dict = {"params": frozen}
    title = f"{len(frozen)} of {len(ctx.params)} parameters are frozen (requires_grad=False)"
    rest = [p for p in frozen if p not in by_hand and p not in tables]
    advice = "expected when fine-tuning part of a model, otherwise set `requires_grad=True`"
    notes = []
    if by_hand:
        ev["updated_by_hand"] = by_hand
        title += (f"; {_who(by_hand, frozen)} change between recordings with no optimizer update: a momentum or EMA "
                  "copy updated by hand (MoCo's key encoder, a target network, a teacher)")
        notes.append("nothing to do for a momentum, EMA or teacher copy")
    if tables:
        ev["fixed_tables"] = tables
        title += (f"; {_names(tables, 3)} {'is a' if len(tables) == 1 else 'are'} fixed sin-cos position "
                  f"table{'' if len(tables) == 1 else 's'}, computed rather than learned (MAE's pos_embed)")
        notes.append("nothing to do for a fixed position table")
    if not notes:
        suggestion = advice.replace(", otherwise", "; otherwise")
    else:
        suggestion = "; ".join(notes) + (f"; the others ({_names(rest, 3)}): {advice}" if rest else "")
    return [
        Finding(
            kind="params_frozen",
            severity="info",
            title=title,
            evidence=ev,
            suggestion=suggestion,
            layers=_layers(ctx, frozen),
            source=SOURCE,
        )
    ]


def _model_of(ctx: Context) -> dict[str, tuple[str, str]]:
    """Parameter -> (name, type) of the watched model holding it, when there are several models."""
    roots = {r.get("prefix") or "": r.get("type") for r in ctx.meta.get("roots") or []}
    if len(roots) < 2:
        return {}
    prefixes = sorted(roots, key=len, reverse=True)
    out = {}
    for p in ctx.params:
        pre = next((x for x in prefixes if p.startswith(x)), "")
        out[p] = (ctx.model_name(pre), str(roots.get(pre)))
    return out


@register_rule("gradients_accumulating")
def gradients_accumulating(ctx: Context) -> list[Finding]:
    # Per optimizer too: a loop with two (SparseAdam for a recommender's embedding tables, Adam for
    # the rest) that zeroes one of them leaves a minority of the parameters stale at every step.
    # Per model too: a GAN's two optimizers are both Adams, and the discriminator whose zero_grad()
    # is missing holds a third of the parameters (PyTorch-GAN's dcgan.py: 8 of 22).
    models = _model_of(ctx)
    groups: dict[tuple[str, str], dict[int, list[float]]] = {("", ""): {}}
    names: dict[tuple[str, str], set[str]] = {}
    for p in ctx.params:
        flag = ctx.stat(p, "gradient", "in_optimizer")
        if len(flag) and np.all(flag.values == 0):
            # In no optimizer: optimizer.zero_grad() never clears it, so its gradient piles up
            # however often the loop zeroes (param_not_in_optimizer names it).
            continue
        opt = ctx.params[p].get("optimizer")
        keys = [("", "")] + ([("optimizer", opt)] if opt else []) + ([("model", models[p][0])] if p in models else [])
        s = ctx.stat(p, "gradient", "stale")
        for step, v in zip(s.steps.tolist(), s.values.tolist()):
            for key in keys:
                groups.setdefault(key, {}).setdefault(step, []).append(v)
                if v >= 1:
                    names.setdefault(key, set()).add(p)
    for by in ("optimizer", "model"):
        if sum(k[0] == by for k in groups) == 1:
            del groups[next(k for k in groups if k[0] == by)]  # one of them: its parameters are all of them
    for key, per_step in groups.items():
        steps = sorted(per_step)[1:]  # the first recording has nothing before it
        if len(steps) < 2:
            continue
        frac = {s: float(np.mean(per_step[s])) for s in steps}
        stale = [s for s in steps if frac[s] >= ctx.th.stale_fraction]
        if len(stale) < max(2, len(steps) / 2):
            continue
        ev = {"stale_fraction_by_step": frac, "recordings": len(steps)}
        g = ctx.grad_norm.finite()
        if len(g) >= 4:
            k = max(1, len(g) // 5)
            ev["grad_norm_early"] = float(np.median(g.values[:k]))
            ev["grad_norm_late"] = float(np.median(g.values[-k:]))
        title = (f"Gradients accumulate across steps: at {len(stale)} of {len(steps)} recordings the new "
                 "gradient was added to the previous step's")
        fix = ("call `optimizer.zero_grad()` (or `model.zero_grad()`) once per step, before `backward()`; "
               "for deliberate accumulation over k micro-batches, zero after each `optimizer.step()`")
        params = ctx.ordered(sorted(names.get(key, ())))
        owners = {models[p] for p in params if p in models}
        if key[0] == "optimizer":
            opt = key[1]
            ev |= {"optimizer": opt, "parameters": params}
            title = (f"Gradients of the {opt} optimizer's parameters ({_names(params, 3)}) accumulate across steps: at "
                     f"{len(stale)} of {len(steps)} recordings the new gradient was added to the previous step's")
            fix = (f"call `zero_grad()` on the {opt} optimizer too, once per step before `backward()` (the loop zeroes "
                   "the other optimizer's gradients only); for deliberate accumulation, zero after its `step()`")
        elif len(owners) == 1 and len(set(models.values())) > 1:
            # one model of several: name it
            name, kind = owners.pop()
            ev |= {"model": name, "parameters": params}
            title = (f"Gradients of model {name} ({kind}) accumulate across steps ({_names(params, 3)}): at {len(stale)} "
                     f"of {len(steps)} recordings the new gradient was added to the previous step's")
            fix = (f"call `zero_grad()` on the optimizer of {name} too, once per step before its `backward()` (the loop "
                   "zeroes the other model's gradients only); for deliberate accumulation, zero after its `step()`")
        return [
            Finding(
                kind="gradients_accumulating",
                severity="error",
                title=title,
                evidence=ev,
                suggestion=fix,
                steps=(stale[0], stale[-1]),
                source=SOURCE,
            )
        ]
    return []


@register_rule("eval_mode_in_training")
def eval_mode_in_training(ctx: Context) -> list[Finding]:
    modes = ctx.meta.get("modes") or {}
    n = int(modes.get("train_steps_in_eval") or 0)
    total = len(ctx.loss) or len(ctx.grad_norm)
    if n < 2 or (total and n < ctx.th.mode_min_fraction * total):
        return []
    first = modes.get("first_train_step_in_eval")
    return [
        Finding(
            kind="eval_mode_in_training",
            severity="warning",
            title=f"The model trained in eval mode for {n} of {total} steps (from step {first}): dropout off, "
            "batch norm frozen",
            evidence={"train_steps_in_eval": n, "steps": total, "first_step": first},
            suggestion="call `model.train()` after each evaluation, before the next training step",
            steps=(int(first), int(first) + n - 1) if first is not None else None,
            source=SOURCE,
        )
    ]


@register_rule("train_mode_in_eval")
def train_mode_in_eval(ctx: Context) -> list[Finding]:
    modes = ctx.meta.get("modes") or {}
    n = int(modes.get("eval_forwards_in_train") or 0)
    if n < 1:
        return []
    total = int(modes.get("eval_forwards") or n)
    first = modes.get("first_eval_forward_in_train")
    return [
        Finding(
            kind="train_mode_in_eval",
            severity="warning",
            title=f"{n} of {total} no-grad (evaluation) forward passes ran in train mode (first at step {first}): "
            "dropout active, batch norm updating its statistics",
            evidence={"eval_forwards_in_train_mode": n, "eval_forwards": total, "first_step": first},
            suggestion="call `model.eval()` before evaluating and `model.train()` afterwards",
            steps=(int(first), int(first)) if first is not None else None,
            source=SOURCE,
        )
    ]



_EMBEDDING_TYPES = ("Embedding", "EmbeddingBag")


@register_rule("muon_on_embedding")
def muon_on_embedding(ctx: Context) -> list[Finding]:
    """Muon's orthogonalised steps given to a token embedding or to the output layer (the layer that
    makes the loss's C logits): Muon is for hidden weight matrices, and the optimizers that pair it
    with AdamW keep those two in AdamW (nanochat's ``setup_optimizer``, modded-nanogpt)."""
    chosen = [name for name, info in ctx.params.items()
              if info.get("orthogonalised") and info.get("module_type") in _EMBEDDING_TYPES]
    classes = ctx.loss_classes()
    if classes is not None:
        layer, _ = ctx.output_layer(classes)
        chosen += [name for name, info in ctx.params.items() if info.get("layer") == layer
                   and info.get("orthogonalised") and len(info.get("shape", [])) == 2 and name not in chosen]
    if not chosen:
        return []
    chosen.sort(key=lambda n: list(ctx.params).index(n))
    optimizer = ctx.params[chosen[0]].get("optimizer") or "Muon"
    kinds = ["the token embedding" if ctx.params[n].get("module_type") in _EMBEDDING_TYPES else "the output layer"
             for n in chosen]
    named = [f"{k} {n}" for k, n in zip(kinds, chosen)]
    what = ", ".join(named[:-1]) + " and " + named[-1] if len(named) > 1 else named[0]
    return [Finding(
        kind="muon_on_embedding", severity="warning",
        title=f"{optimizer} orthogonalises the updates of {what}: Muon is meant for hidden weight matrices",
        evidence={"params": chosen, "optimizer": optimizer},
        suggestion=(f"move {', '.join(chosen)} to the AdamW groups (nanochat's `setup_optimizer` gives `transformer.wte`, "
                    "`value_embeds` and `lm_head` `kind='adamw'` groups, with their own rates; modded-nanogpt and "
                    "Muon's authors do the same, having found AdamW trains them better); with nanochat's model, "
                    "its embedding and lm_head under Muon left the loss at step 50 15x higher than under AdamW"),
        steps=(0, int(ctx.loss.steps[-1])) if len(ctx.loss) else (0, 0),
        layers=[ctx.params[n]["layer"] for n in chosen if ctx.params[n].get("layer")], source=SOURCE)]
