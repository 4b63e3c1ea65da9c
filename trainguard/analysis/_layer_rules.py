"""Rules over per-layer statistics: dead, exploding, collapsed and saturated activations; vanishing
and exploding gradients; unnormalised inputs."""

from __future__ import annotations

import math

import numpy as np

from trainguard.analysis._causes import fp16_inputs
from trainguard.analysis._context import POOL_TYPES, Context, Series, fmt, median
from trainguard.analysis._rules import register_rule
from trainguard.analysis._suggest import activation_family, clip_text, init_advice, slow_updates
from trainguard.store import Finding

SOURCE = "monitor"


def _steps(ctx: Context) -> tuple[int, int] | None:
    return (ctx.recorded_steps[0], ctx.recorded_steps[-1]) if ctx.recorded_steps else None


def _feeding_params(ctx: Context, layer: str) -> list[str]:
    """Weight matrices of the nearest layer with weights at or before ``layer`` in forward order."""
    order = ctx.layer_order
    if layer not in order:
        return []
    mats = set(ctx.weight_matrices())
    for la in reversed(order[: order.index(layer) + 1]):
        found = [p for p in ctx.params if ctx.params[p].get("layer") == la and p in mats]
        if found:
            return found
    return []


def dead_series(ctx: Context, layer: str, stat: str = "dead_frac") -> Series:
    """A layer's dead-unit statistic at the recordings where it saw enough rows to tell a dead unit
    from one that happened to be 0 on the few rows it got (an expert of a mixture that a batch routed
    one token to); runs from before ``dead_rows`` was kept are taken whole."""
    series = ctx.stat(layer, "activation", stat)
    rows = ctx.stat(layer, "activation", "dead_rows")
    if not len(rows):
        return series
    few = {int(s) for s, v in zip(rows.steps, rows.values) if v < ctx.th.dead_units_min_rows}
    keep = np.array([int(s) not in few for s in series.steps], dtype=bool)
    return Series(series.steps[keep], series.values[keep])


def fully_dead_layers(ctx: Context) -> list[str]:
    """Layers whose every unit is silent in the later half of the run."""
    out = []
    for la in ctx.layers_with("activation", "dead_frac"):
        if median(ctx.window(dead_series(ctx, la)).values) >= 0.99:
            out.append(la)
    return out


def negative_layers(ctx: Context) -> list[str]:
    """Layers with weights whose every output was negative at every recording while their weights
    got an all-zero gradient: a ReLU applied as a function after them (``F.relu``, no module the
    monitor could watch) outputs 0 for every sample, and no gradient flows back through it."""
    owned: dict[str, list[str]] = {}
    for p, info in ctx.params.items():
        owned.setdefault(info.get("layer"), []).append(p)
    out = []
    for la in ctx.layers_with("activation", "max"):
        top = ctx.stat(la, "activation", "max")
        if la not in owned or len(top) < 2 or not np.all(top.values < 0):
            continue
        grads = [ctx.stat(p, "gradient", "norm") for p in owned[la]]
        if all(len(g) >= 2 and not np.any(g.values) for g in grads):
            out.append(la)
    return ctx.ordered(out)


def gradient_blocked(ctx: Context) -> str | None:
    """Why gradients cannot reach the weights, if they cannot: no gradient at all, dead layers,
    collapse, vanishing."""
    if len(ctx.grad_norm) and not np.any(ctx.grad_norm.values):
        return "every gradient is 0"
    dead = fully_dead_layers(ctx) or negative_layers(ctx)
    if dead:
        return f"layer {dead[0]} is dead"
    if collapsed_activations(ctx):
        return "activations collapsed"
    if vanishing_gradient(ctx):  # its own exemptions too (an optimizer that moves every layer alike)
        return "gradients vanish"
    return None


# Activations that are not zero for every negative input: a dead unit's inputs went far negative.
# Matched inside the class name too: models bring their own (llm.c's NewGELU, HF's GELUActivation).
_SMOOTH = ("GELU", "SiLU", "Swish", "Mish", "Softplus", "LeakyReLU", "PReLU", "RReLU")
_SMOOTH_EXACT = frozenset({"ELU", "CELU", "SELU"})  # as parts of names they would match ReLU


def _smooth(kind: str) -> bool:
    return kind in _SMOOTH_EXACT or any(name in kind for name in _SMOOTH)


@register_rule("dead_units")
def dead_units(ctx: Context) -> list[Finding]:
    per_layer = {}
    for la in ctx.layers_with("activation", "dead_frac"):
        if ctx.layer_type.get(la) in POOL_TYPES:
            continue  # repeats the dead units of the layer before it
        if len(ctx.stat(la, "activation", "sat_frac")):
            continue  # a Sigmoid's exact zeros are its lower bound: saturated_activations' business
        series = dead_series(ctx, la)
        win = ctx.window(series)
        if len(win) < 2:
            continue
        frac = median(win.values)
        pruned, units = _pruned_before(ctx, la), ctx.unit_count(_upstream_layer(ctx, la))
        if pruned and units:
            # units pruned on purpose (every incoming weight masked) output their bias alone: after a
            # ReLU, those with a negative bias are 0 for every sample, as pruning meant
            series = Series(series.steps, np.maximum(series.values - pruned / units, 0.0))
            frac = max(frac - pruned / units, 0.0)
        if frac < ctx.th.dead_units_warn:
            continue
        stays = dead_series(ctx, la, "dead_stay")
        if (series.values[-1] < ctx.th.dead_units_warn and len(stays) and stays.steps[-1] == series.steps[-1]
                and stays.values[-1] == 0):
            # none of the units dead before is still dead at the last recording: a layer whose output
            # was 0 only until the first updates (a zero-initialised LoRA lora_B) is alive now
            continue
        over = np.nonzero(series.values >= ctx.th.dead_units_warn)[0]
        stay = median(ctx.window(stays).values)
        per_layer[la] = {
            "dead_fraction": frac,
            "first_fraction": float(series.values[0]),
            "since_step": int(series.steps[over[0]]) if len(over) else None,
            "stay_dead": stay,
            "units": ctx.unit_count(_upstream_layer(ctx, la)) or None,
        }
    if not per_layer:
        return []
    worst = max(v["dead_fraction"] for v in per_layer.values())
    layers = ctx.ordered(list(per_layer))
    first = layers[0]
    grew = per_layer[first]["first_fraction"] < ctx.th.dead_units_warn
    fixes = [
        "`trainguard.fix.revive_dead_units(model, inputs)` re-initialises their incoming weights (Kaiming) "
        "and reports how many it revived"
    ]
    params = _feeding_params(ctx, first)
    init_rows, init_text = init_advice(ctx, params, "relu")
    ev: dict = {"layers": per_layer}
    bias = [p.replace(".weight", ".bias") for p in params if p.replace(".weight", ".bias") in ctx.params]
    for b in bias:
        w = ctx.stat(b, "weight", "norm")
        shape = ctx.params[b].get("shape", [1])
        if len(w) and ctx.weights_initial:
            rms = float(w.values[0]) / math.sqrt(max(1, math.prod(shape)))
            ev.setdefault("bias_init_rms", {})[b] = rms
            if rms > 0.5:
                init_text += f"; {b} started with RMS {fmt(rms)}: initialise biases at 0"
    if init_rows and not grew:
        ev["init"] = init_rows
    if grew and ctx.weights_initial:
        ev["arose_in_training"] = True  # alive at step 0: the updates killed them (see _causes.IN_TRAINING)
    if grew:
        kind = ctx.layer_type.get(first, "")
        if _smooth(kind):  # exact zeros only for far negative inputs: no other activation helps
            fixes.append(f"the units died during training: the updates pushed the {kind}'s inputs far negative; "
                         "lower the learning rate")
        else:
            fixes.append("the units died during training: lower the learning rate, or use LeakyReLU/GELU")
    elif ctx.weights_initial:
        fixes.append(f"they were dead from the first step: use {init_text}")
    else:
        fixes.append(f"they were already dead when monitoring began (step {ctx.recorded_steps[0]}); "
                     f"if they were dead from initialisation, use {init_text}; if they died in training, lower "
                     "the learning rate or use LeakyReLU/GELU")
    stays = [v["stay_dead"] for v in per_layer.values() if math.isfinite(v["stay_dead"])]
    share = "" if not stays else "all" if min(stays) >= 1 else f"{min(stays):.0%}+"
    persist = f"; {share} of them stay dead from one recording to the next" if stays else ""
    return [
        Finding(
            kind="dead_units",
            severity="error" if worst >= ctx.th.dead_units_error else "warning",
            title=f"Dead units: {per_layer[first]['dead_fraction']:.0%} of layer {first}'s units output 0 for every sample"
            + (f" ({len(layers)} layers affected)" if len(layers) > 1 else "")
            + persist,
            evidence=ev,
            suggestion="; ".join(fixes),
            steps=_steps(ctx),
            layers=layers,
            source=SOURCE,
        )
    ]


def _pruned_before(ctx: Context, layer: str) -> int:
    """Pruned output units of ``layer`` or, for an activation, of the layer with weights before it."""
    order = ctx.layer_order
    if layer not in order:
        return ctx.layer_pruned.get(layer, 0)
    owners = {info.get("layer") for info in ctx.params.values()}
    for la in reversed(order[: order.index(layer) + 1]):
        if la in ctx.layer_pruned or la in owners:
            return ctx.layer_pruned.get(la, 0)
    return 0


def _upstream_layer(ctx: Context, layer: str) -> str:
    order = ctx.layer_order
    if layer not in order:
        return layer
    for la in reversed(order[: order.index(layer) + 1]):
        if ctx.unit_count(la):
            return la
    return layer


def _hypot(mean: np.ndarray, std: np.ndarray) -> np.ndarray:
    """RMS from mean and std; an output of one value has no std (NaN) and its RMS is |mean|."""
    return np.hypot(mean, np.where(np.isnan(std) & np.isfinite(mean), 0.0, std))


def _rms(ctx: Context, layer: str) -> float:
    mean = ctx.window(ctx.stat(layer, "activation", "mean")).values
    std = ctx.window(ctx.stat(layer, "activation", "std")).values
    if not len(mean) or len(mean) != len(std):
        return math.nan
    return median(_hypot(mean, std))


def _initial_rms(ctx: Context, layers: list[str]) -> dict[str, float] | None:
    """Each layer's activation RMS at the run's first recording, when its weights were the initial
    ones (None otherwise, or when a layer was not recorded there)."""
    if not ctx.weights_initial or not ctx.recorded_steps:
        return None
    out = {}
    for la in layers:
        mean, std = ctx.stat(la, "activation", "mean"), ctx.stat(la, "activation", "std")
        if not len(mean) or not len(std) or mean.steps[0] != ctx.initial_step(la) or std.steps[0] != mean.steps[0]:
            return None
        v = float(_hypot(mean.values[:1], std.values[:1])[0])
        if not math.isfinite(v):
            return None
        out[la] = v
    return out


def _at_init(ctx: Context, series, name: str = "") -> float | None:
    """A series' value at the run's first recording (of layer or parameter ``name``'s own model, for
    a model trained after earlier ones), when the weights were the initial ones (None otherwise,
    when it was not recorded there, or is not finite)."""
    if not ctx.weights_initial or not ctx.recorded_steps or not len(series) or series.steps[0] != ctx.initial_step(name):
        return None
    v = float(series.values[0])
    return v if math.isfinite(v) else None


def _initial(ctx: Context, layers: list[str], stat: str) -> dict[str, float] | None:
    """Each layer's activation ``stat`` (``sat_frac``, ``std``) at initialisation (see :func:`_at_init`),
    None unless every layer has one."""
    out = {la: _at_init(ctx, ctx.stat(la, "activation", stat), la) for la in layers}
    return None if any(v is None for v in out.values()) else out


@register_rule("exploding_activations")
def exploding_activations(ctx: Context) -> list[Finding]:
    def limit_of(la: str) -> float:  # each model's layers against that model's input
        return ctx.th.act_explode_rms * max(1.0, ctx.input_rms(la))

    depth = {la: _rms(ctx, la) for la in ctx.layer_order}
    hot = [la for la, v in depth.items() if math.isfinite(v) and v > limit_of(la)]
    if not hot:
        return []
    first = hot[0]
    scale, limit = ctx.input_rms(first), limit_of(first)
    worst = max(hot, key=lambda la: depth[la])
    ev = {
        "rms_by_layer": {la: depth[la] for la in ctx.layer_order if math.isfinite(depth[la])},
        "input_rms": scale,
        "limit": limit,
    }
    initial = _initial_rms(ctx, hot)
    if initial is not None and all(v <= limit_of(la) for la, v in initial.items()):
        # In range at initialisation: the updates made them grow, a new init would not help.
        ev["initial_rms_by_layer"] = initial
        ev["arose_in_training"] = True
        grew = (f"the activations were in range at initialisation (RMS {fmt(initial[first])} at {first}) "
                "and grew during training: the updates blew them up; ")
        muon = ctx.orthogonalising_optimizer(hot)
        if muon is not None:
            # Muon's step has the learning rate's size whatever the gradient's: clipping cannot shrink it.
            ev["optimizer"] = muon
            suggestion = grew + (f"lower the learning rate of {muon}'s groups that update these layers, or add "
                                 f"weight decay; clipping the gradients does not shrink these updates: {muon} "
                                 "orthogonalises each one, so its size is set by the learning rate alone")
        else:
            if (decay := ctx.weight_decay(hot)) is not None:
                # Weight decay is on for every grown layer already (litgpt's AdamW weight_decay=0.1).
                ev["weight_decay"] = decay
            suggestion = grew + slow_updates(ctx, hot)
    else:
        rows, init_text = init_advice(ctx, ctx.weight_matrices(), activation_family(ctx))
        if rows:
            ev["init"] = rows
        suggestion = (f"each layer amplifies its input: use {init_text}; normalisation layers "
                      "(BatchNorm/LayerNorm) keep the scale in check")
    return [
        Finding(
            kind="exploding_activations",
            severity="warning",
            title=f"Exploding activations: RMS {fmt(depth[first])} at {first}"
            + (f", {fmt(depth[worst])} at {worst}" if worst != first else "") + f" (input RMS {fmt(scale)})",
            evidence=ev,
            suggestion=suggestion,
            steps=_steps(ctx),
            layers=hot,
            source=SOURCE,
        )
    ]


def _enclosing_std(layer: str, stds: dict[str, float]) -> float:
    """The activation std of the nearest module around ``layer`` that has one (NaN when none)."""
    name = layer
    while "." in name:
        name = name.rsplit(".", 1)[0]
        v = stds.get(name)
        if v is not None and math.isfinite(v):
            return v
    return math.nan


@register_rule("collapsed_activations")
def collapsed_activations(ctx: Context) -> list[Finding]:
    scale = ctx.input_rms()
    limit = ctx.th.act_collapse_std * min(1.0, scale) if scale > 0 else ctx.th.act_collapse_std
    dead = set(fully_dead_layers(ctx))
    stds = {}
    for la in ctx.layer_order:
        if la in dead:
            continue
        s = ctx.window(ctx.stat(la, "activation", "std"))
        if len(s) < 2:
            continue
        stds[la] = median(s.values)
    cold = [la for la, v in stds.items() if math.isfinite(v) and v < limit]
    # A small output inside a module whose own output is not small is a branch added to a stream
    # (a residual block's LayerScale at 1e-6, a zero-initialised branch), not a collapsed signal.
    branches = [la for la in cold if _enclosing_std(la, stds) >= limit]
    cold = [la for la in cold if la not in branches]
    if not cold:
        return []
    first = cold[0]
    ev = {"std_by_layer": stds, "input_rms": scale, "limit": limit}
    if branches:
        ev["small_residual_branches"] = branches
    initial = _initial(ctx, cold, "std")
    if initial is not None and all(v >= limit for v in initial.values()):
        # Not collapsed at initialisation: the updates did it (cleanrl's PPO critic at 2000x its
        # rate, behind Tanh layers they saturated), and a new init would not help.
        ev["initial_std"] = initial
        ev["arose_in_training"] = True
        suggestion = (f"layer {first} was not collapsed at initialisation (std {fmt(initial[first])}) and collapsed "
                      "during training: the updates made every sample's output the same (saturated or dead units "
                      f"before it); {slow_updates(ctx, cold)}")
    else:
        rows, init_text = init_advice(ctx, ctx.weight_matrices(), activation_family(ctx))
        if rows:
            ev["init"] = rows
        suggestion = f"the signal shrinks layer by layer: use {init_text}"
    return [
        Finding(
            kind="collapsed_activations",
            severity="warning",
            title=f"Collapsed activations: layer {first}'s outputs have std {fmt(stds[first])} "
            f"(every sample looks the same){f'; {len(cold)} layers' if len(cold) > 1 else ''}",
            evidence=ev,
            suggestion=suggestion,
            steps=_steps(ctx),
            layers=cold,
            source=SOURCE,
        )
    ]


@register_rule("saturated_activations")
def saturated_activations(ctx: Context) -> list[Finding]:
    layers = ctx.layers_with("activation", "sat_frac")
    if ctx.layer_order and layers and layers[-1] == ctx.layer_order[-1]:
        layers = layers[:-1]  # an output sigmoid is meant to reach 0 and 1
    sat = {}
    for la in layers:
        win = ctx.window(ctx.stat(la, "activation", "sat_frac"))
        if len(win) >= 2 and median(win.values) >= ctx.th.saturation_warn:
            sat[la] = median(win.values)
    if not sat:
        return []
    first = next(iter(sat))
    ev: dict = {"saturated_fraction": sat, "types": {la: ctx.layer_type.get(la) for la in sat}}
    initial = _initial(ctx, list(sat), "sat_frac")
    arose = initial is not None and all(v < ctx.th.saturation_warn for v in initial.values())
    head = _grown_value_head(ctx, list(sat)) if arose else None
    severity = "warning"
    if head is not None:
        # A critic learning returns far above its starting range: its Tanh inputs saturate to reach
        # them. Healthy agents do this (SB3's A2C on CartPole reached a return of 294 with its critic
        # 100% saturated); the reward scale is the cause, not the rate.
        ev["initial_saturated_fraction"] = initial
        ev["arose_in_training"] = True
        ev["value_head"] = head
        severity = "info"
        suggestion = (f"the script steps a reinforcement learning environment ({ctx.environment}): the value head "
                      f"{head['layer']} predicts {fmt(head['last'])} (from {fmt(head['initial'])} at the first "
                      f"recording), the scale of the returns, and layer {first} saturated to reach it, so the critic "
                      "gives nearly one value for every state; judge the run by its episode return, and normalise "
                      "the rewards or returns to keep the critic in range (stable-baselines3's "
                      "VecNormalize(norm_reward=True), gymnasium's NormalizeReward)")
    elif arose:
        # Not saturated at initialisation: the updates grew the pre-activations, a new init would not help.
        ev["initial_saturated_fraction"] = initial
        ev["arose_in_training"] = True
        suggestion = (f"layer {first} was not saturated at initialisation ({initial[first]:.0%} of its outputs at the "
                      f"bounds) and saturated during training: the updates grew its pre-activations; "
                      + slow_updates(ctx, [ctx.params[p]["layer"] for p in _feeding_params(ctx, first)]))
    else:
        rows, init_text = init_advice(ctx, _feeding_params(ctx, first), "tanh")
        if rows:
            ev["init"] = rows
        suggestion = (f"the pre-activations are too large: use {init_text}; normalise the inputs, or put a "
                      "LayerNorm before the activation")
    return [
        Finding(
            kind="saturated_activations",
            severity=severity,
            title=f"Saturated activations: {sat[first]:.0%} of layer {first}'s outputs sit at the "
            f"{ctx.layer_type.get(first, 'activation')} bounds, where the gradient is < 2% of its maximum",
            evidence=ev,
            suggestion=suggestion,
            steps=_steps(ctx),
            layers=list(sat),
            source=SOURCE,
        )
    ]


def _grown_value_head(ctx: Context, layers: list[str]) -> dict | None:
    """In a reinforcement learning run, a one-unit head fed by ``layers``' width (a critic's value
    head: a ``[1, units]`` weight) whose mean output grew ``rl_value_growth``x past its initial mean
    plus spread: {"layer", "initial", "last"}, else None."""
    if not ctx.environment:
        return None
    widths = {ctx.layer_units.get(la) for la in layers}
    if len(widths) != 1 or None in widths:
        return None
    width = widths.pop()
    for d in ctx.params.values():
        la = d.get("layer")
        if d.get("shape") != [1, width] or ctx.layer_units.get(la) != 1:
            continue
        mean, std = ctx.stat(la, "activation", "mean"), ctx.stat(la, "activation", "std")
        if len(mean) < 2:
            continue
        initial, last = float(mean.values[0]), float(mean.values[-1])
        spread = float(std.values[0]) if len(std) else 0.0
        if math.isfinite(last) and abs(last) >= max(1.0, ctx.th.rl_value_growth * (abs(initial) + spread)):
            return {"layer": la, "initial": initial, "last": last}
    return None


def _started_at_zero(ctx: Context, param: str) -> bool:
    """The matrix's first recorded norm is 0: initialised to zeros (LoRA's B, so that the wrapped
    model starts equal to the pretrained one; a zero-initialised output projection)."""
    w = ctx.stat(param, "weight", "norm")
    return bool(len(w)) and w.values[0] == 0


def _gradient_flow(ctx: Context) -> dict[str, float]:
    """Median relative gradient (||g|| / ||W||) per weight matrix, forward order, exact zeros left out.

    A matrix that started at zeros is left out too: its ||W|| is only what the updates made, so
    its ratio is huge by construction (LoRA's out_head.lora.B at 36 where the lora.A matrices were
    3e-4 to 0.02), and read as the last layer it made every LoRA run's gradients "vanish"."""
    out = {}
    for p in ctx.weight_matrices():
        if _started_at_zero(ctx, p):
            continue
        r = ctx.window(ctx.relgrad(p))
        v = r.values[np.isfinite(r.values) & (r.values > 0)]
        if len(v):
            out[p] = float(np.median(v))
    # A layer's weights (weight, weight_ih_l0, a parametrization's parametrizations.weight.original)
    # carry the signal; a bare matrix beside them need not: mamba-minimal's A_log, a log decay rate
    # the block exponentiates, was the "last layer" at a relative gradient of 1.6e-5 (in_proj's 0.026),
    # an exploding gradient on a healthy run. Bare matrices count when there are no such weights.
    weights = {p: v for p, v in out.items() if any(part.startswith("weight") for part in p.split(".")[-3:])}
    return weights if len(weights) >= 2 else out


def _update_flow(ctx: Context, names: list[str]) -> dict[str, float]:
    """Median update-to-weight ratio per weight matrix (later half of the recordings)."""
    out = {}
    for p in names:
        r = ctx.window(ctx.stat(p, "update", "ratio"))
        v = r.values[np.isfinite(r.values) & (r.values > 0)]
        if len(v):
            out[p] = float(np.median(v))
    return out


def _initial_flow_ratio(ctx: Context, first: str, last: str) -> float | None:
    """The first weight matrix's relative gradient over the last one's at initialisation (see
    :func:`_at_init`; None when either has no gradient there)."""
    a, b = _at_init(ctx, ctx.relgrad(first), first), _at_init(ctx, ctx.relgrad(last), last)
    return a / b if a and b and a > 0 and b > 0 else None


def _initial_update_balance(ctx: Context, first: str, last: str) -> float | None:
    """The first weight matrix's update ratio over the last one's at the first recorded step, from the
    initial weights (see :func:`_at_init`)."""
    a = _at_init(ctx, ctx.stat(first, "update", "ratio"), first)
    b = _at_init(ctx, ctx.stat(last, "update", "ratio"), last)
    return a / b if a and b and a > 0 and b > 0 else None


@register_rule("vanishing_gradient")
def vanishing_gradient(ctx: Context) -> list[Finding]:
    # The gradient flows back through one model: with several watched (an actor and a critic
    # trained in one step, initialised at gains 1 and 0.01 by TorchRL's PPO), each is judged alone.
    flow = _gradient_flow(ctx)
    for names in ctx.by_model(list(flow)):
        if ctx.environment:
            # A one-unit head in a reinforcement learning run is a critic's value head: its gradient
            # has the scale of the returns it regresses, and an actor-critic held in one module (SB3's
            # ActorCriticPolicy) would compare the policy's first layer with it (healthy PPO on
            # Pendulum: 4.4e-5). The rest of the flow is judged without it.
            names = [n for n in names if ctx.params.get(n, {}).get("shape", [0])[0] != 1]
        found = _vanishing_in(ctx, {n: flow[n] for n in names})
        if found:
            return found
    return []


def _vanishing_in(ctx: Context, flow: dict[str, float]) -> list[Finding]:
    if len(flow) < 2:
        return []
    names = list(flow)
    ratio = flow[names[0]] / flow[names[-1]]
    if ratio >= ctx.th.vanish_ratio:
        return []
    last_moved = ctx.window(ctx.stat(names[-1], "update", "ratio")).values
    if len(last_moved) and not np.any(last_moved[np.isfinite(last_moved)] != 0):
        # No update at the recorded steps (a warm-up's first step, at rate 0): nothing shows
        # whether the optimizer makes up for the small gradients (Adam does, below).
        return []
    ev: dict = {"relative_gradient_by_layer": flow, "first_last_ratio": ratio}
    upd = _update_flow(ctx, [names[0], names[-1]])
    if len(upd) == 2:
        balance = upd[names[0]] / upd[names[-1]]
        ev["first_last_update_ratio"] = balance
        if balance >= ctx.th.vanish_update_balance:
            # An adaptive optimizer (Adam) scales each parameter's step by its own gradient size:
            # the first layer still moves, so the small gradient costs nothing (BERT's query and
            # key projections at initialisation).
            return []
    weak = [p for p in names if flow[p] / flow[names[-1]] < ctx.th.vanish_ratio]
    moved = _update_flow(ctx, weak + [names[-1]])
    if len(weak) >= 2 and names[-1] in moved and all(p in moved for p in weak) \
            and median(np.array([moved[p] for p in weak])) >= ctx.th.vanish_update_balance * moved[names[-1]]:
        # Most layers the gradient hardly reaches still move (Muon's orthogonalised steps have the
        # rate's size, whatever the gradient's): only the first matrix is stuck, a gate scaled by a
        # zero-initialised scalar (nanochat's smear_gate), not a gradient shrinking with depth.
        return []
    initial = _initial_flow_ratio(ctx, names[0], names[-1])
    moved_at_init = _initial_update_balance(ctx, names[0], names[-1])
    if (initial is None or initial < ctx.th.vanish_ratio) and moved_at_init is not None \
            and moved_at_init >= ctx.th.vanish_update_balance:
        # Small at initialisation, but the optimizer moved the first layer as it moved the last
        # (Adam, BERT's first projections): the updates since then stopped it (transformers'
        # run_glue.py at learning rate 1: balance 0.95 at step 0, relative gradients 9.2e-4 -> 6.3e-9).
        ev["initial_first_last_update_ratio"] = moved_at_init
        ev["arose_in_training"] = True
        fix = (f"at initialisation the first layer moved as the last did (update balance {fmt(moved_at_init)} at "
               f"step {ctx.recorded_steps[0]}): the updates saturated or killed the units between; "
               + slow_updates(ctx, [ctx.params[p]["layer"] for p in names if p in ctx.params]))
    elif initial is not None and initial >= ctx.th.vanish_ratio:
        # The gradients reached the first layer at initialisation: the updates saturated or killed
        # the units between (cleanrl's PPO at 2000x its rate), and another activation would not help.
        ev["initial_first_last_ratio"] = initial
        ev["arose_in_training"] = True
        fix = (f"the gradients did not vanish at initialisation (first/last ratio {fmt(initial)} at step "
               f"{ctx.recorded_steps[0]}): the updates saturated or killed the units between; "
               + slow_updates(ctx, [ctx.params[p]["layer"] for p in names if p in ctx.params]))
    else:
        fam = activation_family(ctx)
        _, init_text = init_advice(ctx, names, fam)
        fix = (
            "deep sigmoid/tanh stacks shrink the gradient at every layer: use ReLU/GELU with Kaiming init, add "
            "normalisation layers or residual connections"
            if fam == "tanh"
            else f"use {init_text}; add normalisation layers or residual connections"
        )
    return [
        Finding(
            kind="vanishing_gradient",
            severity="warning",
            title=f"Vanishing gradients: the first layer's relative gradient is {fmt(ratio)} of the last layer's",
            evidence=ev,
            suggestion=fix,
            steps=_steps(ctx),
            layers=[ctx.params[p]["layer"] for p in weak if p in ctx.params],
            source=SOURCE,
        )
    ]


def _sustained_jump(vals: np.ndarray, window: int, factor: float) -> tuple[int, float, float] | None:
    """The first step (within the first window) where the gradient norm jumped ``factor``x above the
    median of the steps before it, and the next window's median stayed there: (index, before, after)."""
    for i in range(1, min(window, len(vals))):
        before = median(vals[:i])
        after = median(vals[i:i + window])
        if math.isfinite(before) and before > 0 and math.isfinite(after) and vals[i] > factor * before \
                and after > factor * before:
            return i, before, after
    return None


@register_rule("exploding_gradient")
def exploding_gradient(ctx: Context) -> list[Finding]:
    reasons = []
    ev: dict = {}
    first_step = None
    flow = _gradient_flow(ctx)
    if len(flow) >= 2:
        names = list(flow)
        ratio = flow[names[0]] / flow[names[-1]]
        if ratio > ctx.th.explode_ratio:
            reasons.append(f"the first layer's relative gradient is {fmt(ratio)}x the last layer's")
            ev["relative_gradient_by_layer"] = flow
            ev["first_last_ratio"] = ratio
    g = ctx.grad_norm
    vals = g.values
    n = len(vals)
    w0 = max(5, int(n * ctx.th.window_fraction))
    if n >= 2 * w0:
        early = median(vals[:w0])
        start = median(vals[:10])  # the gradient scale of the first steps of training
        # A norm below the first step's is no explosion, however far above a collapsed median it
        # flickers (a saturated GAN discriminator: 88 at step 1, then 1e-8 with flickers to 1e-5).
        first = float(vals[0]) if math.isfinite(vals[0]) else 0.0
        spikes = []
        for i in range(1, n):
            v = vals[i]
            recent = median(vals[max(0, i - w0) : i])
            if not (math.isfinite(v) and math.isfinite(recent)):
                continue
            if v > ctx.th.grad_spike_factor * recent and v > ctx.th.grad_spike_vs_start * start and v > first:
                spikes.append((int(g.steps[i]), float(v), recent))
        bad = np.nonzero(~np.isfinite(vals))[0]
        overflow = int(g.steps[bad[0]]) if len(bad) else None
        # One spike that training shrugs off is a bad batch (see loss_spike); an explosion recurs
        # or ends in overflow.
        if spikes and (len(spikes) >= 2 or (overflow is not None and overflow > spikes[0][0])):
            first_step, v, recent = spikes[0]
            ev["spikes"] = {"steps": [s for s, _, _ in spikes[:20]], "count": len(spikes), "first": first_step,
                            "grad_norm": v, "recent_median": recent, "start_median": start}
            reasons.append(
                f"the gradient norm jumped to {fmt(v)} at step {first_step} ({v / recent:.0f}x its recent median)"
                + (f" and overflowed at step {overflow}" if overflow is not None else "")
            )
        late = median(vals[-w0:])
        if math.isfinite(late) and math.isfinite(early) and early > 0 and late > ctx.th.grad_growth * early:
            ev["growth"] = {"early_median": early, "late_median": late}
            reasons.append(f"the typical gradient norm grew from {fmt(early)} to {fmt(late)}")
            first_step = first_step if first_step is not None else int(g.steps[-w0])
        if reasons and overflow is not None:
            ev["overflow_step"] = overflow
        jump = _sustained_jump(vals, w0, ctx.th.grad_growth) if reasons else None
        if jump is not None and (first_step is None or int(g.steps[jump[0]]) < first_step):
            # A rate far too high: the first update blows the weights up and the norm jumps 1e9x at
            # step 1 for good. The early window above, and the spikes' recent medians, hold the
            # jumped norms, and a clip norm read off them would be as large: date it from the jump.
            i, before, after = jump
            first_step = int(g.steps[i])
            ev["jump"] = {"step": first_step, "before_median": before, "after_median": after}
            reasons.append(f"the gradient norm jumped from {fmt(before)} to {fmt(after)} (median) at step "
                           f"{first_step} and stayed there")
    if not reasons:
        return []
    if first_step is not None:
        ev["began"] = first_step  # a cause that came no later explains it (see _causes.IN_TRAINING)
    clip = clip_text(ctx, before_step=first_step)
    return [
        Finding(
            kind="exploding_gradient",
            severity="error",
            title="Exploding gradients: " + reasons[0],
            evidence=ev | {"reasons": reasons},
            suggestion=(clip or "clip the gradient norm (`torch.nn.utils.clip_grad_norm_`)")
            + "; lower the learning rate; for recurrent nets keep the recurrent weights' spectral radius <= 1",
            steps=(first_step, int(g.steps[-1])) if first_step is not None and n else _steps(ctx),
            layers=[ctx.params[p]["layer"] for p in list(flow)[:1] if p in ctx.params],
            source=SOURCE,
        )
    ]


def _pixels(ctx: Context, input_layer: str, m: dict) -> bool:
    """Whether a model's input statistics are those of 8-bit images: values in 0..255 (well above 1)
    into a model whose first layer is channel-first (a convolution), not a tabular column of ages."""
    if not (m["min"] >= 0 and PIXELS_MAX_LOW < m["max"] <= 255):
        return False
    prefix = input_layer.removesuffix("<input>")
    layers = (ctx.run.meta.get("monitor") or {}).get("layers") or []
    first = next((la for la in layers if la.get("name", "").startswith(prefix)), None)
    return bool(first and first.get("channel_first") and "Conv" in str(first.get("type")))


# A maximum above this, with no negative value, reads as 0..255 pixels rather than data scaled to [0, 1].
PIXELS_MAX_LOW = 16


@register_rule("inputs_not_normalized")
def inputs_not_normalized(ctx: Context) -> list[Finding]:
    out = []
    for la in ctx.input_layers():
        m = {st: median(ctx.stat(la, "input", st).values) for st in
             ("mean", "std", "min", "max", "feat_mean_absmax", "feat_std_max", "feat_std_min")}
        big = max(abs(m["mean"]), m["std"], m.get("feat_mean_absmax", 0) or 0, m.get("feat_std_max", 0) or 0)
        spread = (m["feat_std_max"] / m["feat_std_min"]) if m.get("feat_std_min") else math.nan
        reasons = []
        if math.isfinite(big) and big > ctx.th.input_scale_max:
            reasons.append(f"inputs have mean {fmt(m['mean'])} and std {fmt(m['std'])} (range {fmt(m['min'])}..{fmt(m['max'])})")
        if math.isfinite(spread) and spread > ctx.th.input_scale_spread:
            reasons.append(f"feature scales differ {fmt(spread)}x (std {fmt(m['feat_std_min'])}..{fmt(m['feat_std_max'])})")
        if not reasons:
            continue
        fp16 = bool(len(ctx.amp_skipped)) and fp16_inputs(m)  # float16 autocast with a GradScaler
        if fp16:
            reasons[0] += " in float16, whose largest value is 65504"
        mean, std = m["mean"], m["std"] if m["std"] > 0 else 1.0
        if math.isfinite(spread) and spread > ctx.th.input_scale_spread:
            # One global scale would be set by the largest feature and leave the others ~0 (a raw
            # price column beside standardised ones in tabular data): each feature needs its own.
            fix = (f"normalise each feature on its own (their stds range {fmt(m['feat_std_min'])}.."
                   f"{fmt(m['feat_std_max'])}: one global mean and std would leave the small ones near 0), "
                   "with statistics from the training set: `x = (x - x_train.mean(0)) / x_train.std(0)` "
                   "(`sklearn.preprocessing.StandardScaler`; a quantile transform for heavy-tailed columns)")
        elif _pixels(ctx, la, m):
            fix = (f"the inputs look like 8-bit pixels ({fmt(m['min'])}..{fmt(m['max'])}) fed to a convolution: divide "
                   "by 255 first (`transforms.ToTensor()` does), then normalise as the model expects: "
                   "`transforms.Normalize(mean, std)` for a classifier, `x * 2 - 1` into [-1, 1] for a diffusion "
                   "model (lucidrains' GaussianDiffusion takes [0, 1] and does that itself)")
        else:
            shift = f"- {fmt(mean)}" if mean >= 0 else f"+ {fmt(-mean)}"
            fix = (f"normalise the inputs with the observed statistics: `x = (x {shift}) / {fmt(std)}` "
                   "(better: per feature or channel, with mean and std computed on the training set, e.g. "
                   "`torchvision.transforms.Normalize`)")
        if fp16:
            fix += ("; under float16 autocast the first layer's sums of such values leave float16's range "
                    "(max 65504): the Inf/NaN losses and the GradScaler's skipped steps follow from them")
        out.append(
            Finding(
                kind="inputs_not_normalized",
                severity="warning",
                title="Inputs are not normalised: " + "; ".join(reasons),
                evidence={k: v for k, v in m.items() if math.isfinite(v)},
                suggestion=fix,
                steps=_steps(ctx),
                layers=[la],
                source=SOURCE,
            )
        )
    return out
