"""Rules over the validation pass: a non-finite validation loss, overfitting, labels unrelated to
the inputs, labels all of one class, train/val leakage.

They read the per-step scalars ``val_loss`` / ``val_accuracy`` and the ``validation`` summary the
monitor stores (:mod:`trainguard.capture._monitor_eval`, :mod:`trainguard.capture._monitor_leak`);
a run without evaluation passes gets none of them.
"""

from __future__ import annotations

import math

import numpy as np

from trainguard.analysis._context import Context, Series, fmt
from trainguard.analysis._loss_rules import finite_loss
from trainguard.analysis._rules import register_rule
from trainguard.analysis._suggest import origin_of, where
from trainguard.store import Finding

SOURCE = "monitor"


def _val(ctx: Context, name: str) -> Series:
    return Series.of(ctx.run.scalars(name).get(name)).finite()


def _train_at(train: Series, val: Series) -> np.ndarray:
    """The training loss around each validation point: the median since the previous one."""
    out = []
    prev = -1
    for s in val.steps.tolist():
        window = train.values[(train.steps > prev) & (train.steps <= s)]
        if not len(window):  # evaluated twice with no training between: the last level stands
            window = train.values[train.steps <= s][-3:]
        out.append(float(np.median(window)) if len(window) else math.nan)
        prev = s
    return np.array(out)


@register_rule("nonfinite_val_loss")
def nonfinite_val_loss(ctx: Context) -> list[Finding]:
    """The validation loss is NaN/Inf while the training loss is finite: a bad sample in the
    validation data, or an op that fails in eval mode. Model selection and early stopping on it
    are then meaningless."""
    val = Series.of(ctx.run.scalars("val_loss").get("val_loss"))
    bad = ~np.isfinite(val.values)
    if not bad.any():
        return []
    step = int(val.steps[bad][0])
    train_bad = ctx.loss.steps[~np.isfinite(ctx.loss.values)]
    if len(train_bad) and int(train_bad[0]) <= step:
        return []  # the training loss went first: nonfinite_loss reports it
    value = float(val.values[bad][0])
    ev: dict = {"first_step": step, "value": value, "nonfinite_evaluations": int(bad.sum()),
                "evaluations": len(val)}
    origin = origin_of(ctx.run, since_step=step)
    if origin:
        ev["origin"] = origin
        fix = (f"the first harmful NaN/Inf of the validation pass came from {where(origin)}: "
               f"{origin.get('fix') or 'guard that op against 0 and overflow'}")
    else:
        fix = ("the validation data holds NaN/Inf, or an op makes it in eval mode: check the validation inputs "
               "(`trainguard doctor` validates data), or record the run (`trainguard run --monitor script.py`) "
               "to find the op and line")
    return [
        Finding(
            kind="nonfinite_val_loss",
            severity="error",
            title=f"Validation loss is {fmt(value)} from step {step} ({int(bad.sum())} of {len(val)} evaluations), "
            "the training loss finite" + (f" ({where(origin)})" if origin else ""),
            evidence=ev,
            suggestion=fix,
            steps=(step, int(val.steps[bad][-1])),
            layers=[origin["module"]] if origin and origin.get("module") else [],
            source=SOURCE,
        )
    ]


@register_rule("overfitting")
def overfitting(ctx: Context) -> list[Finding]:
    th = ctx.th
    val = _val(ctx, "val_loss")
    train = finite_loss(ctx)
    if len(val) < th.overfit_min_points or not len(train):
        return []
    tr = _train_at(train, val)
    b = int(np.argmin(val.values))
    if b >= len(val) - 1 or not math.isfinite(tr[b]) or not math.isfinite(tr[-1]):
        return []
    best, end = float(val.values[b]), float(val.values[-1])
    after = val.values[b + 1 :]
    floor = best * (1 + th.overfit_val_rise) if best > 0 else best + th.overfit_val_rise
    gap_best, gap_end = best - tr[b], end - tr[-1]
    if not (
        end >= floor
        and float(np.median(after)) >= floor
        and gap_end - gap_best >= th.overfit_gap_growth * max(abs(best), 1e-12)
        and tr[-1] <= tr[b] * (1 - th.overfit_train_drop)
    ):
        return []
    best_step = int(val.steps[b])
    ev: dict = {
        "best_val_step": best_step,
        "val_loss_best": best,
        "val_loss_end": end,
        "train_loss_at_best": float(tr[b]),
        "train_loss_end": float(tr[-1]),
        "gap_at_best": float(gap_best),
        "gap_end": float(gap_end),
        "val_points": len(val),
    }
    acc = _val(ctx, "val_accuracy")
    if len(acc):
        ev["val_accuracy_best"] = float(acc.values.max())
        ev["val_accuracy_end"] = float(acc.values[-1])
    return [
        Finding(
            kind="overfitting",
            severity="warning",
            title=f"Overfitting: validation loss rose from {fmt(best)} (step {best_step}) to {fmt(end)} while the "
            f"training loss fell from {fmt(tr[b])} to {fmt(tr[-1])}",
            evidence=ev,
            suggestion=f"keep the weights of step {best_step}, where the validation loss was lowest (early stopping: "
            "checkpoint on the validation loss); then regularise: weight decay (e.g. AdamW weight_decay=0.01), "
            "dropout, data augmentation, a smaller model or more training data",
            steps=(best_step, int(val.steps[-1])),
            source=SOURCE,
        )
    ]


def _chance(ctx: Context) -> tuple[int | None, float, float | None, str] | None:
    """(classes, chance loss, chance accuracy, how): what always guessing the validation labels'
    class priors scores (their entropy, the majority share); ln(C) and 1/C when the counts are
    unknown. For an MSE (no classes, no accuracy): the variance of the validation targets, the
    loss of always predicting their mean."""
    val = ctx.meta.get("validation") or {}
    c = val.get("classes")
    moments = val.get("target_moments")
    if c is None and val.get("loss_fn") == "mse_loss" and isinstance(moments, list) and len(moments) == 3:
        n, s, ss = (float(v) for v in moments)
        var = ss / n - (s / n) ** 2 if n > 0 else 0.0
        if var > 0 and math.isfinite(var):
            return None, var, None, "the variance of the validation targets (the MSE of predicting their mean)"
        return None
    if not isinstance(c, int) or c < 2:
        return None
    counts = val.get("label_counts")
    if isinstance(counts, list) and len(counts) == c and sum(counts) > 0:
        p = np.array(counts, dtype=float) / sum(counts)
        nz = p[p > 0]
        return c, float(-(nz * np.log(nz)).sum()), float(p.max()), "the entropy of the validation labels"
    return c, math.log(c), 1.0 / c, f"ln({c})"


@register_rule("labels_unrelated")
def labels_unrelated(ctx: Context) -> list[Finding]:
    th = ctx.th
    level = _chance(ctx)
    val = _val(ctx, "val_loss")
    train = finite_loss(ctx)
    if level is None or len(val) < 3 or len(train) < th.min_loss_points:
        return []
    classes, chance, chance_acc, how = level
    w = max(3, int(len(train) * th.window_fraction))
    start, end = float(np.median(train.values[:w])), float(np.median(train.values[-w:]))
    never_learned = float(val.values.min()) >= (1 - th.chance_tolerance) * chance
    memorised = end <= th.memorise_fraction * chance and start - end >= (1 - th.memorise_fraction) * chance / 2
    acc = _val(ctx, "val_accuracy")
    at_chance_acc = (not len(acc) or chance_acc is None
                     or float(acc.values.max()) <= (1 + th.chance_tolerance) * chance_acc + th.chance_acc_margin)
    if not (never_learned and memorised and at_chance_acc):
        return []
    ev: dict = {
        "classes": classes,
        "chance_loss": f"{how} = {chance:.4f}",
        "val_loss_min": float(val.values.min()),
        "val_loss_end": float(val.values[-1]),
        "train_loss_start": start,
        "train_loss_end": end,
    }
    if len(acc) and chance_acc is not None:
        ev["val_accuracy_max"] = float(acc.values.max())
        ev["chance_accuracy"] = chance_acc
    guess = f"guessing among {classes} classes" if classes else "predicting the validation targets' mean"
    series = ("" if classes else "; for a time series, keep each split in time order: windows cut from shuffled "
              "time steps (a split shuffled before windowing) have horizons unrelated to their inputs")
    return [
        Finding(
            kind="labels_unrelated",
            severity="warning",
            title=f"Labels look unrelated to the inputs: the training loss fell to {fmt(end)} (memorisation) while the "
            f"validation loss never went below chance ({chance:.3g}, {guess})",
            evidence=ev,
            suggestion="check that inputs and labels stay paired: shuffle them with one permutation "
            "(`idx = torch.randperm(n); x, y = x[idx], y[idx]`), not each on its own; check that the Dataset's "
            "`__getitem__` returns the label of the same sample and that the label encoding is the same in both "
            "splits" + series + "; `trainguard.doctor.validate_data((x_train, y_train), (x_val, y_val))` checks the data",
            steps=(int(val.steps[0]), int(val.steps[-1])),
            source=SOURCE,
        )
    ]


@register_rule("labels_one_class")
def labels_one_class(ctx: Context) -> list[Finding]:
    """Every validation label is the same class of several: a model that always answers it scores
    100% and a loss near 0 whatever the inputs (vit-pytorch's ViT on labels that were all 0 looked
    healthy: loss 0.111 -> 0.0045, accuracy 1.0)."""
    val = ctx.meta.get("validation") or {}
    c, counts = val.get("classes"), val.get("label_counts")
    if not (isinstance(c, int) and c >= 2 and isinstance(counts, list) and len(counts) == c):
        return []
    total = sum(counts)
    held = [k for k, n in enumerate(counts) if n > 0]
    if len(held) != 1 or total < ctx.th.one_class_min_labels:
        return []
    k = held[0]
    return [
        Finding(
            kind="labels_one_class",
            severity="warning",
            title=f"Every validation label is class {k} ({total} labels counted, {c} classes): always answering {k} scores "
            "100%, so the loss and accuracy say nothing about the inputs",
            evidence={"classes": c, "label_counts": counts, "class": k},
            suggestion="check the labels: a Dataset that returns the same target for every sample (a placeholder 0, "
            "the wrong column, targets made before the data was filled), or a split cut from data sorted by label "
            "(shuffle before splitting); `trainguard.doctor.validate_data((x_train, y_train), (x_val, y_val))` "
            "checks both splits",
            source=SOURCE,
        )
    ]


@register_rule("train_val_leakage")
def train_val_leakage(ctx: Context) -> list[Finding]:
    th = ctx.th
    leak = (ctx.meta.get("validation") or {}).get("leak") or {}
    batches = leak.get("batches") or []
    rows = near = exact = train_like = other = 0
    first = None
    for b in batches:
        if not b.get("validation", True):
            other += int(b.get("rows", 0))  # a pass before the validation (makemore: the training set)
            continue
        # integer rows (token ids) one id apart are other samples: only exact copies count there
        near_enough = th.leak_exact if b.get("exact_only") else th.leak_near
        close = [d for d in b.get("close", []) if d <= near_enough]
        n = int(b.get("rows", 0)) - int(b.get("seen_before", 0))  # a validation row evaluated again is one sample
        if n and len(close) >= th.leak_train_eval * n:
            train_like += n  # a pass over the training data (a training-accuracy evaluation)
            continue
        rows += n
        near += len(close)
        exact += sum(1 for d in close if d <= th.leak_exact)
        if close and first is None:
            first = int(b.get("step", 0))
    if not rows or near < th.leak_min_rows or near < th.leak_min_fraction * rows:
        return []
    ev = {
        "eval_rows_sampled": rows,
        "copies_of_training_rows": near,
        "exact_copies": exact,
        "near_copies": near - exact,
        "fraction": near / rows,
        "train_rows_sampled": int(leak.get("train_rows", 0)),
        "near_threshold": f"distance <= {fmt(th.leak_near)} x the typical distance between rows",
    }
    if train_like:
        ev["rows_of_training_data_passes_left_out"] = train_like
    if other:
        ev["rows_of_passes_before_the_validation_left_out"] = other
    return [
        Finding(
            kind="train_val_leakage",
            severity="warning",
            title=f"Validation samples leak from the training data: {near} of {rows} sampled validation rows "
            f"({near / rows:.1%}) are copies of training rows ({exact} exact, {near - exact} near)",
            evidence=ev,
            suggestion="split the data before augmenting or oversampling it and remove duplicates across the split "
            "(hash each sample, drop validation samples whose hash is in the training set); "
            "`trainguard.doctor.validate_data((x_train, y_train), (x_val, y_val))` lists the duplicated rows. "
            "The validation loss of this run is optimistic.",
            steps=(first, first) if first is not None else None,
            source=SOURCE,
        )
    ]

