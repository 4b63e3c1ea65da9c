"""The single-feature leak check: one input feature that predicts the label almost perfectly."""

from __future__ import annotations

import numpy as np

from trainguard.doctor._data_inputs import Split
from trainguard.doctor._results import finding
from trainguard.store import Finding

# A feature predicts the label "almost perfectly" at this held-out accuracy (classification) or
# absolute correlation (regression) ...
LEAK_SCORE = 0.99
# ... when always guessing the majority class does at least this much worse.
LEAK_MARGIN = 0.2
# How many cells (features x samples) the single-feature predictor may look at: it subsamples
# rows beyond that, so the check stays fast on any dataset.
LEAK_CELLS = 4_000_000


def feature_leak(tr: Split, classification: bool) -> list[Finding]:
    """A finding when one feature alone gives the target away (held-out 1-NN accuracy for
    classes, correlation for a regression target)."""
    flat = tr.flat
    y = tr.y
    if flat.dtype.kind not in "biuf" or y is None:
        return []
    n, d = flat.shape
    if n < 20 or d == 0:
        return []
    rng = np.random.default_rng(0)
    rows = min(n, max(200, LEAK_CELLS // d))
    pick = np.sort(rng.choice(n, size=rows, replace=False)) if rows < n else np.arange(n)
    xs = flat[pick].astype(np.float64)
    # Rows with a non-finite input or target are data_nonfinite's: here they would make every
    # correlation NaN, which no threshold comparison rejects.
    ok = np.isfinite(xs).all(axis=1) & np.isfinite(y[pick].reshape(len(pick), -1).astype(np.float64)).all(axis=1)
    xs, ys = xs[ok], y[pick][ok]
    live = np.flatnonzero(xs.std(axis=0) > 0)
    if xs.shape[0] < 20 or live.size == 0:
        return []
    xs = xs[:, live]
    if classification:
        scores, baseline = _neighbour_accuracy(xs, ys, rng)
        best = int(np.argmax(scores))
        score = float(scores[best])
        if not (score >= LEAK_SCORE and score - baseline >= LEAK_MARGIN):
            return []
        what = f"predicts the class with {score:.1%} held-out accuracy (majority class: {baseline:.1%})"
    else:
        yv = ys.reshape(ys.shape[0], -1).astype(np.float64)
        if yv.shape[1] != 1 or yv.std() == 0:
            return []
        yc = yv[:, 0] - yv[:, 0].mean()
        xc = xs - xs.mean(axis=0)
        corr = (xc * yc[:, None]).sum(axis=0) / (np.sqrt((xc ** 2).sum(axis=0) * (yc ** 2).sum()) + 1e-300)
        best = int(np.argmax(np.abs(corr)))
        score = float(abs(corr[best]))
        if score < LEAK_SCORE:
            return []
        what = f"has correlation {corr[best]:+.4f} with the target"
    feature = int(live[best])
    return [finding(
        "feature_leak", "warning", f"{tr.name}: input feature {feature} alone {what}",
        "A single input that gives the answer away is usually derived from the label (an id ordered by "
        "class, a field filled in after the outcome, a file path); drop it unless it is truly available "
        "at prediction time.",
        feature=feature, score=score, samples_used=int(xs.shape[0]))]


def _neighbour_accuracy(xs: np.ndarray, ys: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, float]:
    """Held-out accuracy, per feature, of a one-feature nearest-neighbour classifier.

    Half of the rows are the reference; each other row takes the label of the nearer of the
    reference rows just below and just above it in that feature's sorted order. A feature that splits
    the classes into clean intervals scores near 1 whatever their number; an unrelated one
    scores about chance. All features at once, with sorts along the columns.
    """
    n, d = xs.shape
    _, yi = np.unique(ys, return_inverse=True)
    yi = yi.ravel()
    is_ref = np.zeros(n, bool)
    is_ref[rng.permutation(n)[: n // 2]] = True
    order = np.argsort(xs, axis=0, kind="stable")
    ref = is_ref[order]
    labels = yi[order]
    pos = np.arange(n)[:, None]
    below = np.maximum.accumulate(np.where(ref, pos, -1), axis=0)
    above = np.flip(np.minimum.accumulate(np.flip(np.where(ref, pos, n), axis=0), axis=0), axis=0)
    values = np.take_along_axis(xs, order, axis=0)
    gap_below = np.where(below >= 0, values - np.take_along_axis(values, np.maximum(below, 0), axis=0), np.inf)
    gap_above = np.where(above < n, np.take_along_axis(values, np.minimum(above, n - 1), axis=0) - values, np.inf)
    source = np.where(gap_below <= gap_above, np.maximum(below, 0), np.minimum(above, n - 1))
    pred = np.take_along_axis(labels, source, axis=0)
    held = ~ref
    acc = ((pred == labels) & held).sum(axis=0) / max(int(held[:, 0].sum()), 1)
    held_labels = yi[~is_ref]
    baseline = float(np.bincount(held_labels).max() / held_labels.size)
    return acc, baseline


# A target window is "inside the input" when it equals the input's steps there in this share of
# the samples checked (a few samples of a constant stretch match anywhere by chance).
WINDOW_MATCH = 0.99
# Samples compared per offset: enough to see a systematic copy, cheap for long windows.
WINDOW_SAMPLES = 256


def target_in_input(tr: Split) -> list[Finding]:
    """A finding when every target is a shorter stretch of its own input along one axis (a forecasting
    target window that overlaps the input window: ``r_begin`` off by ``pred_len``). The decoder's
    start tokens, the input's last ``label_len`` steps at the head of ``seq_y``, are no leak: only
    a whole target inside the input is."""
    x, y = tr.x, tr.y
    if y is None or x.ndim < 2 or x.ndim != y.ndim or x.dtype.kind != "f" or y.dtype.kind != "f":
        return []
    n = min(tr.n, WINDOW_SAMPLES)
    xs, ys = x[:n], y[:n]
    for axis in range(1, x.ndim):
        other = [d for d in range(1, x.ndim) if d != axis]
        # a target as long as the input along the axis is a reconstruction (an autoencoder's), not a window of it
        if any(x.shape[d] != y.shape[d] for d in other) or not 0 < y.shape[axis] < x.shape[axis]:
            continue
        steps = y.shape[axis]
        for start in range(x.shape[axis] - steps + 1):
            part = np.take(xs, np.arange(start, start + steps), axis=axis)
            same = np.isclose(part, ys, rtol=1e-6, atol=0).reshape(n, -1).all(axis=1).mean()
            if same >= WINDOW_MATCH and np.ptp(ys) > 0:
                return [finding(
                    "target_in_input", "error",
                    f"{tr.name}: the targets are the inputs' steps {start}..{start + steps - 1} along axis {axis} "
                    f"({same:.0%} of {n} samples): the model reads the answer",
                    "The target window must start where the input window ends: in a forecasting dataset "
                    "seq_x = data[s_begin:s_end] and the horizon data[s_end:s_end + pred_len] (Time-Series-Library's "
                    "r_begin = s_end - label_len puts only the decoder's label_len start steps inside the input).",
                    axis=axis, first_step=start, steps=steps, share=float(same), samples_used=n)]
    return []
