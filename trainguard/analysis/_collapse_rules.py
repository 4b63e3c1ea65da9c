"""Representation collapse: a model's output the same for every input while the loss stalls (the
failure of self-supervised training: DINO, BYOL, SimSiam)."""

from __future__ import annotations

import math
import re

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


def _codes(ctx: Context, layer: str) -> list[tuple[int, float, float]]:
    """Per recording: (step, distinct rows of the output in effect, of its input), from the monitor's
    ``codes`` statistics; recordings where under half the output's rows are non-zero are left out (a layer
    mostly off is ``dead_units``' business)."""
    def by_step(stat: str) -> dict[int, float]:
        s = ctx.stat(layer, "activation", stat)
        return dict(zip((int(v) for v in s.steps.tolist()), s.values.tolist()))

    codes, ins, live, n = by_step("codes"), by_step("in_codes"), by_step("code_rows"), by_step("code_sample")
    out = []
    for s, c in codes.items():
        i, m, k = ins.get(s), live.get(s), n.get(s)
        if i is None or m is None or not k or m < k / 2 or not (math.isfinite(c) and math.isfinite(i)):
            continue
        out.append((s, c, i))
    return out


def _rms_at(ctx: Context, name: str, kind: str) -> float | None:
    """A layer's activation RMS (kind "activation") or a parameter's (kind "weight") at
    initialisation (see :func:`_at_init`; None when the weights were trained before the first
    recording)."""
    if kind == "weight":
        norm = _at_init(ctx, ctx.stat(name, "weight", "norm"), name)
        size = math.prod(ctx.params.get(name, {}).get("shape") or [0])
        return norm / math.sqrt(size) if norm is not None and size else None
    mean = _at_init(ctx, ctx.stat(name, "activation", "mean"), name)
    std = _at_init(ctx, ctx.stat(name, "activation", "std"), name)
    return math.hypot(mean, std) if mean is not None and std is not None else None


def _output_fake_quant(ctx: Context, layer: str) -> str | None:
    """The fake-quantizer (or observer) torch.ao.quantization's prepare_qat put on ``layer``'s output
    (its ``activation_post_process`` child, which a forward hook applies to what the layer returns), or
    None."""
    child = layer + ".activation_post_process"
    for name, kind in ctx.layer_type.items():
        if (name == child or name.startswith(child + ".")) and ("FakeQuant" in kind or "Observer" in kind):
            return child
    return None


# torch.nn's own layers with parameters: none of them looks a code up by nearest neighbour.
_TORCH_LAYER = re.compile(r"^(Lazy)?(Linear|Bilinear|Conv(Transpose)?[123]d|(Batch|Layer|Group|Instance|RMS)Norm\w*"
                          r"|RNN|LSTM|GRU|\w*Cell|MultiheadAttention|PReLU|Embedding|EmbeddingBag|Transformer\w*)$")


def _is_codebook(ctx: Context, layer: str) -> bool:
    """Whether ``layer`` can be a vector quantizer: a module of the user's own (no torch.nn layer: a
    ConvTranspose2d with few distinct outputs is no codebook) holding a 2-D table, its own or an
    ``nn.Embedding``'s, whose rows it looks up."""
    if _TORCH_LAYER.match(ctx.layer_type.get(layer, "")):
        return False
    return any((info.get("layer") == layer or info.get("layer", "").startswith(layer + "."))
               and len(info.get("shape") or []) == 2
               and (info.get("layer") == layer or info.get("module_type") == "Embedding")
               for info in ctx.params.values())


@register_rule("codebook_collapse")
def codebook_collapse(ctx: Context) -> list[Finding]:
    """A codebook (see :func:`_is_codebook`; or a fake-quantized layer) whose outputs take one or two
    values (in effect) while its inputs take many: a vector quantizer using 1-2 of its codes
    (zalandoresearch/pytorch-vq-vae on the wrong scale)."""
    limit, factor = ctx.th.codebook_collapse_codes, ctx.th.codebook_input_factor
    found: dict[str, dict] = {}
    for la in ctx.layers_with("activation", "in_codes"):
        if not (_output_fake_quant(ctx, la) or _is_codebook(ctx, la)):
            continue
        recs = _codes(ctx, la)
        if len(recs) < 2:
            continue
        later = recs[len(recs) // 2:]
        codes = median(np.array([r[1] for r in later]))
        inputs = median(np.array([r[2] for r in later]))
        if not (codes < limit and inputs >= factor * codes):
            continue
        collapsed = [r[1] < limit and r[2] >= factor * r[1] for r in recs]
        since = next(r[0] for r, c in zip(recs, collapsed) if c)
        found[la] = {"codes": codes, "input_codes": inputs, "initial_codes": recs[0][1], "first_step": recs[0][0],
                     "since_step": since,
                     "from_start": collapsed[0] and ctx.weights_initial and recs[0][0] == ctx.initial_step(la)}
    if not found:
        return []
    layers = ctx.ordered(list(found))
    first = layers[0]
    c = found[first]
    order = ctx.layer_order
    pos = order.index(first) if first in order else len(order)
    model = next((g for g in ctx.by_model(order) if first in g), order)
    downstream = [la for la in model if la in order and order.index(la) > pos]
    before = [la for la in model if la in order and order.index(la) < pos]
    n = int(max(ctx.stat(first, "activation", "code_sample").values.tolist() or [0]))
    ev: dict = {
        "layer": first,
        "codes": c["codes"],
        "input_codes": c["input_codes"],
        "initial_codes": c["initial_codes"],
        "rows_sampled": n,
        "since_step": c["since_step"],
        "from_start": c["from_start"],
        "limit": limit,
        "downstream": downstream,
    }
    if len(layers) > 1:
        ev["also"] = layers[1:]
    if not c["from_start"] and ctx.weights_initial and c["first_step"] == ctx.initial_step(first):
        ev["arose_in_training"] = True
    book = [p for p, info in ctx.params.items()
            if (info.get("layer") == first or info.get("layer", "").startswith(first + "."))
            and len(info.get("shape") or []) == 2]
    # the table the codes are read from first (an nn.Embedding's weight), then an EMA sum beside it
    book.sort(key=lambda p: ctx.params[p].get("module_type") != "Embedding")
    by_hand = [p for p in book if not ctx.params[p].get("optimizer")]
    if c["from_start"]:
        when = f"from initialisation (step {c['first_step']})"
    elif c["since_step"] == c["first_step"]:
        # watched from a later step (a quantizer found at the first recording: see stand_ins)
        when = f"from its first recording (step {c['first_step']})"
    else:
        when = f"since step {c['since_step']} ({fmt(c['initial_codes'])} at step {c['first_step']})"
    fake_quant = _output_fake_quant(ctx, first)
    if fake_quant:
        ev["fake_quantized"] = fake_quant
        w_rms = _rms_at(ctx, first + ".weight", "weight") if first + ".weight" in ctx.params else None
        start = f" (its weight starts at RMS {fmt(w_rms)})" if w_rms else ""
        fix = (f"{first}'s fake-quantized outputs take {fmt(c['codes'])} distinct value(s) in effect while its "
               f"inputs take {fmt(c['input_codes'])} (of {n} positions sampled per recording), {when}: its outputs "
               f"differ between inputs by less than one step of its activation fake-quantizer ({fake_quant}: the "
               "range it observed over all the outputs, split into 128 or 256 levels), so every input gets the same quantized output and the "
               "layers after it see one input whatever the data. Quantization-aware training fine-tunes a trained "
               "model: train the float model first (or load its trained weights), then fuse and prepare_qat it; "
               f"from random weights, initialise {first} at a larger scale{start}, or keep fake quantization off for the first epochs "
               "(model.apply(torch.ao.quantization.disable_fake_quant), enable_fake_quant later) while the "
               "observers still run")
        return [_collapse(ctx, c, ev, layers, "Fake-quantized outputs collapsed", first, when, fix)]
    fix = (f"{first}'s outputs take {fmt(c['codes'])} distinct value(s) in effect while its inputs take "
           f"{fmt(c['input_codes'])} (of {n} positions sampled per recording), {when}: a quantizer that gives "
           "nearly every input the same code, so the layers after it see one input whatever the data. ")
    scale = ""
    code_rms = {p: _rms_at(ctx, p, "weight") for p in book}
    in_rms = _rms_at(ctx, before[-1], "activation") if before else None
    for p, rms in code_rms.items():
        if rms and in_rms and (rms > 4 * in_rms or rms < in_rms / 4):
            ev.setdefault("scale", {})[p] = {"code_rms": rms, "input_rms": in_rms}
            big = rms > in_rms
            scale = (f"The codes ({p}) start at RMS {fmt(rms)} against inputs ({before[-1]}) at RMS {fmt(in_rms)}: "
                     + ("the code nearest to every input is the one nearest to 0. " if big else
                        "the codes all sit near the inputs' origin, and the same few are nearest to every input. "))
            break
    fix += scale
    fix += ("Initialise the codebook from the inputs (k-means on the first batch's inputs: vector-quantize-pytorch's "
            "kmeans_init=True; or codes drawn from them, at their scale), re-initialise the codes no input picks "
            "from inputs of the batch (a dead-code reset: threshold_ema_dead_code=2), and compare l2-normalised "
            "inputs and codes (use_cosine_sim=True); ")
    if by_hand:
        fix += (f"an EMA codebook ({', '.join(by_hand)}, updated by hand) moves only the codes inputs pick, so "
                "the others never come back without a reset; ")
    elif book:
        fix += ("a codebook trained by its loss: lower the commitment cost (beta 0.25 -> 0.1) so that the encoder "
                "is not pinned to the codes it has, or update the codes by EMA (decay 0.99); ")
    fix += "a layer that is not a quantizer ignores its input (a step or sign function, a saturated bound)"
    return [_collapse(ctx, c, ev, layers, "Codebook collapse", first, when, fix)]


def _collapse(ctx: Context, c: dict, ev: dict, layers: list, what: str, first: str, when: str, fix: str) -> Finding:
    return Finding(
        kind="codebook_collapse",
        severity="warning",
        title=f"{what}: {first}'s outputs take {fmt(c['codes'])} distinct value(s) in effect while its inputs take "
        f"{fmt(c['input_codes'])}, {when}",
        evidence=ev,
        suggestion=fix,
        steps=(c["since_step"], ctx.recorded_steps[-1]),
        layers=layers,
        source=SOURCE,
    )


def _gaussian_heads(ctx: Context) -> list[tuple[str, str, int]]:
    """(mean head, log-variance head, latent width) of a Gaussian encoder, as VAEs write it: two
    Linear layers side by side (run one after the other, one parent) of one shape, read by a later
    Linear layer whose input is that width (the decoder's first layer, fed z = mu + eps * std)."""
    order = ctx.layer_order
    shape = {la: (ctx.params.get(la + ".weight") or {}).get("shape") for la in order}
    out = []
    for i, (a, b) in enumerate(zip(order, order[1:])):
        if not (ctx.layer_type.get(a) == ctx.layer_type.get(b) == "Linear") or a.rpartition(".")[0] != b.rpartition(".")[0]:
            continue
        if not shape[a] or shape[a] != shape[b] or len(shape[a]) != 2:
            continue
        width = int(shape[a][0])
        if any(ctx.layer_type.get(c) == "Linear" and shape[c] and len(shape[c]) == 2 and int(shape[c][1]) == width
               for c in order[i + 2:]):
            out.append((a, b, width))
    return out


def _kl_per_dim(ctx: Context, mu: str, logvar: str) -> tuple[list[int], np.ndarray]:
    """Per recording, the mean KL(N(mu, exp(logvar)) || N(0, 1)) per latent dimension (the average over
    dimensions: times their number, the latent's KL per input), from the two
    heads' output mean and std: 0.5 E[mu^2] + 0.5 E[exp(lv) - 1 - lv], with E[exp(lv)] taken as a
    normal lv's, exp(mean + std^2 / 2)."""
    stats = [ctx.stat(la, "activation", s) for la in (mu, logvar) for s in ("mean", "std")]
    steps = sorted(set.intersection(*(set(s.steps.tolist()) for s in stats)))
    vals = []
    for step in steps:
        m_mean, m_std, v_mean, v_std = (s.at(step) for s in stats)
        var_term = math.exp(min(v_mean + v_std ** 2 / 2, 80.0)) - 1 - v_mean
        vals.append(0.5 * (m_mean ** 2 + m_std ** 2) + 0.5 * var_term)
    return steps, np.array(vals, dtype=float)


@register_rule("posterior_collapse")
def posterior_collapse(ctx: Context) -> list[Finding]:
    """A Gaussian VAE whose encoder gives every input the prior: KL -> 0, the decoder ignores z."""
    out = []
    for mu, logvar, width in _gaussian_heads(ctx):
        steps, kl = _kl_per_dim(ctx, mu, logvar)
        if len(steps) < 4 or not np.all(np.isfinite(kl)):
            continue
        # the whole latent's KL: a wide latent keeps most dimensions at the prior, by design
        total = kl * width
        later = total[len(total) // 2:]
        limit = ctx.th.posterior_kl_nats
        if median(later) >= limit:
            continue
        since = next(s for s, v in zip(steps, total) if v < limit)
        ev = {"mean_head": mu, "logvar_head": logvar, "latent_dims": width, "kl_nats": float(median(later)),
              "kl_nats_first": float(total[0]), "kl_per_dim": float(median(later)) / width,
              "first_step": steps[0], "since_step": since,
              "mean_head_std": float(median(ctx.window(ctx.stat(mu, "activation", "std")).values)),
              "logvar_head_mean": float(median(ctx.window(ctx.stat(logvar, "activation", "mean")).values)),
              "limit": limit}
        out.append(Finding(
            kind="posterior_collapse",
            severity="warning",
            title=f"Posterior collapse: {mu} and {logvar} give every input the prior N(0, 1) (KL about "
            f"{fmt(ev['kl_nats'])} nats over {width} latent dimensions since step {since}): the decoder gets noise and "
            "learns to ignore z",
            evidence=ev,
            suggestion="the KL term outweighs the reconstruction: weigh it by batch size / dataset size (PyTorch-VAE's "
            "kld_weight M_N, 0.00025 in its configs, not 1) or lower beta, anneal its weight from 0 (a KL warm-up "
            "over the first thousands of steps), or keep a floor of KL per dimension (free bits); with a "
            "powerful decoder, weaken it",
            steps=(steps[0], steps[-1]),
            layers=[mu, logvar],
            source=SOURCE,
        ))
    return out


SOFT_TARGET = "<loss>"


@register_rule("target_collapse")
def target_collapse(ctx: Context) -> list[Finding]:
    """The soft targets of a cross entropy (a teacher's probabilities: DINO's, a distillation's) that
    collapsed during training: onto one class for every input (DINO without centering, whose student
    then copies a constant target and whose loss falls to 0, so no loss rule sees it), or to uniform
    rows (too hot a teacher). From the monitor's ``soft_target`` entropies at each recording."""
    rows = ctx.stat(SOFT_TARGET, "soft_target", "row_entropy").finite()
    means = ctx.stat(SOFT_TARGET, "soft_target", "mean_entropy").finite()
    classes = ctx.stat(SOFT_TARGET, "soft_target", "classes").finite()
    if len(rows) < 4 or len(means) != len(rows) or not len(classes) or classes.values[-1] < 2:
        return []
    k = int(classes.values[-1])
    chance = math.log(k)
    steps = [int(s) for s in rows.steps.tolist()]
    half = len(steps) // 2
    perplexity = np.exp(means.values)
    limit, uniform = ctx.th.target_collapse_perplexity, ctx.th.target_uniform_entropy * chance
    ev: dict = {"classes": k, "chance": chance, "first_step": steps[0]}
    if median(perplexity[half:]) < limit and perplexity[0] >= 2 * limit:
        kind = "one_class"
        since = next(s for s, v in zip(steps, perplexity) if v < limit)
        ev |= {"kind": kind, "mean_target_perplexity": float(median(perplexity[half:])),
               "initial_mean_target_perplexity": float(perplexity[0]), "limit": limit}
        what = (f"every input's target is the same class: the rows' mean target takes "
                f"{fmt(ev['mean_target_perplexity'])} of {k} classes in effect since step {since} "
                f"({fmt(perplexity[0])} at step {steps[0]})")
    elif median(rows.values[half:]) >= uniform and rows.values[0] < uniform:
        kind = "uniform"
        since = next(s for s, v in zip(steps, rows.values) if v >= uniform)
        ev |= {"kind": kind, "row_target_entropy": float(median(rows.values[half:])),
               "initial_row_target_entropy": float(rows.values[0]), "limit": uniform}
        what = (f"every target row is uniform: {fmt(ev['row_target_entropy'])} nats of entropy against "
                f"ln {k} = {fmt(chance)} since step {since} ({fmt(rows.values[0])} at step {steps[0]})")
    else:
        return []
    ev["since_step"] = since
    graph = ctx.run.meta.get("loss_graph") or []
    at = next((r.get("backward_at") for r in graph if r.get("backward_at")), None)
    if at:
        ev["backward_at"] = at
    where = f" (the loss backward() ran on at {at['file']}:{at['line']})" if at else ""
    p = progress(ctx)
    if p is not None:
        ev["start_loss"], ev["end_loss"] = p["start"], p["end"]
    teachers = sorted({ctx.model_name(pre) for pre in untrained_models(ctx)})
    if teachers:
        ev["teacher"] = teachers
    if kind == "one_class":
        fix = (f"The soft targets of the cross entropy{where} collapsed onto one class: a teacher that sends every "
               "input to the same output, which the student copies (its loss falls toward 0 and it learns nothing). "
               "DINO: subtract the running center from the teacher's output before its softmax "
               "(F.softmax((teacher_output - self.center) / temp, dim=-1)) and update the center at every step "
               "(center_momentum 0.9, update_center(teacher_output) in DINOLoss.forward); keep the teacher's EMA "
               "momentum between 0.99 and 1 (0 makes the teacher the student); a teacher temperature at or above "
               "0.04 (0.07 at most)")
    else:
        fix = (f"The soft targets of the cross entropy{where} turned uniform: they carry nothing, so the loss sits at "
               f"ln {k}. DINO: lower the teacher temperature (0.04, warmed up to at most 0.07), keep the center's "
               "momentum below 1 but not far below 0.9 (centering alone flattens the targets), and check that the "
               "teacher's output still depends on its input")
    title_loss = f"; loss {fmt(p['start'])} -> {fmt(p['end'])}" if p is not None else ""
    return [Finding(
        kind="target_collapse",
        severity="warning",
        title=f"Soft targets collapsed: {what}{title_loss}",
        evidence=ev,
        suggestion=fix,
        steps=(since, steps[-1]),
        layers=[],
        source=SOURCE,
    )]
