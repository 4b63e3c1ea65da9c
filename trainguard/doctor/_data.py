"""Data validation: what is wrong with the data before a model ever sees it.

:func:`validate_data` takes a training split (and optionally a test split) as tensors, NumPy
arrays, ``(inputs, targets)`` pairs of them, ``Dataset``s or ``DataLoader``s, and returns a
:class:`DataReport` whose findings are the same records the monitor produces: non-finite values,
exact duplicates within a split and across splits (leakage), near duplicates, the label
distribution and imbalance, inputs far from normalised (with the values to normalise with),
constant features, and a single feature that predicts the label almost perfectly.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from rich.table import Table

from trainguard.doctor import _dedup
from trainguard.doctor._data_inputs import Split, is_classification, read_split
from trainguard.doctor._data_leak import feature_leak, target_in_input
from trainguard.doctor._results import CheckResult, finding, fmt
from trainguard.doctor._state import DoctorInputError
from trainguard.store import Finding

# A share of duplicated samples above this is a warning (below it, an info): 1% of the data
# seen twice is a mild reweighting; more starts to bias training and inflate metrics.
DUPLICATE_WARN = 0.01
# Label imbalance: most common class over least common class above this is a warning (the
# lesson's 10:1; past it, plain accuracy and unweighted losses favour the big classes).
IMBALANCE = 10.0
# Inputs far from normalised: a feature (or channel) whose mean is further than MEAN_LIMIT from
# 0, or whose std is outside [STD_LOW, STD_HIGH] ...
MEAN_LIMIT = 3.0
STD_HIGH = 10.0
STD_LOW = 0.01
# ... or features whose stds differ by more than this factor (one scale dominates the others).
SCALE_SPREAD = 100.0
# Near duplicates are looked for in inputs with at least this many features: in a few dimensions
# close neighbours are common and mean nothing.
NEAR_MIN_FEATURES = 8
# How many example indices a finding carries.
EXAMPLES = 10
# Per-feature vectors in the report are cut to this length.
MAX_VECTOR = 1024


@dataclass(kw_only=True, repr=False)
class DataReport(CheckResult):
    """Findings about the data, with the numbers they rest on (per-split counts, statistics)."""

    check = "validate_data"
    splits: dict[str, dict[str, Any]]
    stats: dict[str, Any]
    issues: list[Finding] = field(default_factory=list)
    passed: bool = True

    def __post_init__(self) -> None:
        self.passed = not any(f.is_problem for f in self.issues)

    def findings(self) -> list[Finding]:
        return list(self.issues)

    def by_kind(self, kind: str) -> list[Finding]:
        return [f for f in self.issues if f.kind == kind]

    @property
    def summary(self) -> str:
        sizes = ", ".join(f"{k} {v['samples']:,}" for k, v in self.splits.items())
        problems = [f for f in self.issues if f.is_problem]
        if not problems:
            return f"no problems found ({sizes})"
        kinds = sorted({f.kind for f in problems})
        return f"{len(problems)} problem(s): {', '.join(kinds)} ({sizes})"

    def _fields(self) -> dict[str, Any]:
        return {"splits": self.splits, "stats": self.stats}

    def _detail(self) -> Table:
        t = Table(box=None, padding=(0, 2))
        for col in ("split", "samples", "sample shape", "dtype", "labels"):
            t.add_column(col)
        for name, s in self.splits.items():
            labels = s.get("label_counts")
            lab = "-" if not labels else ", ".join(f"{k}: {v}" for k, v in list(labels.items())[:8])
            if labels and len(labels) > 8:
                lab += f" ... ({len(labels)} classes)"
            t.add_row(name, f"{s['samples']:,}", str(s["shape"]), s["dtype"], lab)
        return t


# ---------------------------------------------------------------------- the checks
def validate_data(
    train: Any,
    test: Any = None,
    *,
    task: str = "auto",
    near_duplicates: bool = True,
    leak_check: bool = True,
    targets_read: bool = True,
) -> DataReport:
    """Check a training split (and a test split) for the problems that silently spoil training.

    ``train`` and ``test`` are each a tensor or array of inputs, an ``(inputs, targets)`` pair of
    them, a ``Dataset`` (items ``(x, y)`` or ``x``) or a ``DataLoader``. ``task`` is "auto"
    (integer 1-D targets are class labels), "classification" or "regression". ``targets_read=False``
    says the loss never reads the targets (a self-supervised loader's placeholder labels, as
    ImageFolder's for MAE): they are not judged, and an info finding says so.

    >>> report = validate_data((x_train, y_train), (x_test, y_test))
    >>> [f.title for f in report.findings()]
    """
    if task not in ("auto", "classification", "regression"):
        raise DoctorInputError(f"task must be auto, classification or regression, got {task!r}")
    if train is None:
        raise DoctorInputError("train data is required, got None")
    tr = read_split(train, "train")
    splits = [tr]
    if test is not None:
        te = read_split(test, "test")
        if te.x.shape[1:] != tr.x.shape[1:]:
            raise DoctorInputError(
                f"train samples have shape {list(tr.x.shape[1:])} but test samples {list(te.x.shape[1:])}"
            )
        if (te.y is None) != (tr.y is None):
            raise DoctorInputError("give targets for both splits or for neither")
        if te.y is not None and te.y.shape[1:] != tr.y.shape[1:]:
            raise DoctorInputError(
                f"train targets have shape {list(tr.y.shape[1:])} but test targets {list(te.y.shape[1:])}"
            )
        splits.append(te)
    issues: list[Finding] = []
    if not targets_read and tr.y is not None:
        values = np.unique(tr.y)
        issues.append(finding(
            "targets_unused", "info",
            f"the loss never reads the targets ({'the constant ' + str(values[0].item()) if values.size == 1 else f'{values.size:,} distinct values'}): "
            "placeholder labels of a self-supervised loader; the inputs were checked, the targets not",
            "Nothing to do for a self-supervised loss; if the targets should train the model, pass them to the loss.",
            distinct=int(values.size)))
        splits = [replace(s, y=None) for s in splits]
        tr = splits[0]
    classification = is_classification(splits, task)
    stats: dict[str, Any] = {}
    for s in splits:
        if s.unread_targets:
            issues.append(finding(
                "targets_not_read", "info",
                f"{s.name} targets are a {s.unread_targets} of several tensors (as nn.CTCLoss's targets and "
                "lengths): the inputs were checked, the targets not",
                "To check the labels too, pass validate_data the inputs and one array of labels, "
                "(inputs, labels).", split=s.name, targets=s.unread_targets))
        issues += _nonfinite(s)
    issues += _duplicates(splits, classification)
    if near_duplicates:
        issues += _near_duplicates(splits)
    label_info: dict[str, dict] = {}
    if classification:
        issues += _labels(splits, label_info)
    norm_issues, norm_stats = _normalisation(tr)
    issues += norm_issues
    stats.update(norm_stats)
    issues += _constant(tr)
    if leak_check and tr.y is not None:
        issues += feature_leak(tr, classification)
        issues += target_in_input(tr)
    split_info = {
        s.name: {"samples": s.n, "shape": list(s.x.shape[1:]), "dtype": str(s.x.dtype),
                 "targets": None if s.y is None else {"shape": list(s.y.shape[1:]), "dtype": str(s.y.dtype)},
                 "label_counts": label_info.get(s.name)}
        for s in splits
    }
    stats["task"] = "classification" if classification else ("regression" if tr.y is not None else "unlabelled")
    return DataReport(splits=split_info, stats=stats, issues=issues)


def _float_view(a: np.ndarray) -> np.ndarray | None:
    return a if np.issubdtype(a.dtype, np.floating) or np.issubdtype(a.dtype, np.complexfloating) else None


def _nonfinite(s: Split) -> list[Finding]:
    out = []
    for what, arr in (("inputs", s.x), ("targets", s.y)):
        if arr is None or _float_view(arr) is None:
            continue
        flat = arr.reshape(arr.shape[0], -1)
        if np.isfinite(flat).all():
            continue
        nan = np.isnan(flat)
        inf = np.isinf(flat)
        n_nan, n_inf = int(nan.sum()), int(inf.sum())
        if not (n_nan or n_inf):
            continue
        bad_rows = np.flatnonzero((nan | inf).any(axis=1))
        per_feature = (nan | inf).sum(axis=0)
        worst = np.argsort(-per_feature)[:EXAMPLES]
        worst = [int(i) for i in worst if per_feature[i] > 0]
        out.append(finding(
            "data_nonfinite", "error",
            f"{s.name} {what}: {n_nan:,} NaN and {n_inf:,} Inf values in {bad_rows.size:,} samples",
            "Drop or impute these samples before training (a single NaN input makes the loss NaN); "
            "check the loading and preprocessing code that produced them.",
            split=s.name, part=what, nan=n_nan, inf=n_inf, samples=int(bad_rows.size),
            examples=bad_rows[:EXAMPLES], features=worst))
    return out


def _common(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Both splits in one dtype, so equal values have equal bytes (and -0.0 equals 0.0)."""
    dt = np.result_type(a.dtype, b.dtype)
    return _no_negative_zero(a.astype(dt, copy=False)), _no_negative_zero(b.astype(dt, copy=False))


def _no_negative_zero(a: np.ndarray) -> np.ndarray:
    """``a`` with -0.0 replaced by 0.0 (copied only when it holds any), so the zeros hash alike."""
    if a.dtype.kind not in "fc":
        return a
    negative_zero = (a == 0) & np.signbit(a)
    if not negative_zero.any():
        return a
    a = a.copy()
    a[negative_zero] = 0
    return a


def _duplicates(splits: list[Split], classification: bool) -> list[Finding]:
    out: list[Finding] = []
    tr = splits[0]
    flats = [s.flat for s in splits]
    if len(splits) > 1:
        flats[0], flats[1] = _common(flats[0], flats[1])
    else:
        flats[0] = _no_negative_zero(flats[0])
    hashes = [_dedup.row_hashes(f) for f in flats]
    for s, f, h in zip(splits, flats, hashes):
        groups = _dedup.duplicate_groups(f, h)
        if not groups:
            continue
        extra = sum(len(g) - 1 for g in groups)
        share = extra / s.n
        examples = [g[:5] for g in groups[:EXAMPLES]]
        out.append(finding(
            "duplicate_samples", "warning" if share > DUPLICATE_WARN else "info",
            f"{s.name}: {extra:,} duplicate samples ({share:.1%}) in {len(groups):,} groups of identical inputs",
            "Remove the copies (keep one per group): duplicates weight some samples more than others and, "
            "across a train/validation split, inflate the metrics.",
            split=s.name, duplicates=extra, groups=len(groups), share=share, examples=examples))
        if s.y is not None:
            conflicts = [g for g in groups if not _all_equal(s.y[g])]
            if conflicts:
                out.append(finding(
                    "conflicting_labels", "warning",
                    f"{s.name}: {len(conflicts):,} groups of identical inputs carry different targets",
                    "These are label errors (or inputs that lost the information that tells them apart); "
                    "fix or drop them: no model can fit both.",
                    split=s.name, groups=len(conflicts), examples=[g[:5] for g in conflicts[:EXAMPLES]]))
    if len(splits) > 1:
        te = splits[1]
        pairs = _dedup.cross_duplicates(flats[0], flats[1], hashes[0], hashes[1])
        if pairs:
            out.append(finding(
                "leaked_duplicates", "error",
                f"{len(pairs):,} {te.name} samples ({len(pairs) / te.n:.1%}) also appear in {tr.name}: data leakage",
                f"Remove these samples from {te.name} (or from {tr.name}): the model is evaluated on data it "
                f"trained on, so {te.name} metrics overstate how it generalises. Split after de-duplicating.",
                split=te.name, count=len(pairs), share=len(pairs) / te.n,
                examples=[{te.name: i, tr.name: j} for i, j in pairs[:EXAMPLES]]))
    return out


def _all_equal(a: np.ndarray) -> bool:
    """All targets of a group equal (NaN equal to NaN)."""
    same = a == a[0]
    if _float_view(a) is not None:
        same |= np.isnan(a) & np.isnan(a[0])
    return bool(np.all(same))


def column_stats(data: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-column mean and std in float64, ignoring NaN/Inf (a column with none finite: NaN)."""
    if data.dtype.kind not in "fc" or np.isfinite(data).all():
        # Two passes over row blocks in float64: no full-size float64 temporaries.
        n = data.shape[0]
        step = max(1, (1 << 21) // max(data.shape[1], 1))
        total = np.zeros(data.shape[1])
        for i in range(0, n, step):
            total += data[i:i + step].sum(axis=0, dtype=np.float64)
        mean = total / n
        sq = np.zeros(data.shape[1])
        for i in range(0, n, step):
            block = data[i:i + step].astype(np.float64) - mean
            sq += np.einsum("ij,ij->j", block, block)
        return mean, np.sqrt(sq / n)
    data = np.where(np.isfinite(data), data.astype(np.float64), np.nan)
    with np.errstate(invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN columns: their mean is NaN, as wanted
        return np.nanmean(data, axis=0), np.nanstd(data, axis=0)


def _standardise(flat: np.ndarray, mean: np.ndarray, std: np.ndarray) -> np.ndarray:
    z = (flat.astype(np.float32, copy=False) - mean.astype(np.float32)) / std.astype(np.float32)
    return np.nan_to_num(z, nan=0.0, posinf=0.0, neginf=0.0)


# Rows a column's bulk spread is read on: enough for a median, cheap on any dataset.
BULK_ROWS = 20_000


def _bulk_scale(flat: np.ndarray, std: np.ndarray) -> np.ndarray:
    """Per column, the spread of its bulk: 1.4826 x the median absolute deviation (the std of a
    normal column), where it is below the std; the std where the MAD is 0 (a column mostly of one
    value, as one-hot features) or not finite. Rare huge values (a series' 40-sigma spikes)
    inflate the std, and against it every ordinary row looks like a near copy of every other."""
    if flat.dtype.kind not in "biuf":
        return std
    rows = flat[:: max(1, flat.shape[0] // BULK_ROWS)].astype(np.float64)
    with np.errstate(invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN columns
        med = np.nanmedian(rows, axis=0)
        mad = 1.4826 * np.nanmedian(np.abs(rows - med), axis=0)
    ok = np.isfinite(mad) & (mad > 0)
    return np.where(ok, np.minimum(std, np.where(ok, mad, np.inf)), std)


def _near_duplicates(splits: list[Split]) -> list[Finding]:
    tr = splits[0]
    if tr.flat.shape[1] < NEAR_MIN_FEATURES or tr.flat.dtype.kind not in "biuf":
        return []
    mean, std = column_stats(tr.flat)
    mean = np.nan_to_num(mean)
    std = np.where(np.isfinite(std) & (std > 0), std, 1.0)
    std = _bulk_scale(tr.flat, std)
    zs = [_standardise(s.flat, mean, std) for s in splits]
    z = np.concatenate(zs) if len(zs) > 1 else zs[0]
    owner = np.concatenate([np.full(s.n, i) for i, s in enumerate(splits)])
    offsets = np.cumsum([0] + [s.n for s in splits])
    pairs = [(i, j, d) for i, j, d in _dedup.near_pairs(z, owner) if d > 0]
    if not pairs:
        return []
    out = []
    for a in range(len(splits)):
        for b in range(a, len(splits)):
            sel = [(i - offsets[a], j - offsets[b], d) for i, j, d in pairs if owner[i] == a and owner[j] == b]
            if not sel:
                continue
            if a == b:
                name = splits[a].name
                out.append(finding(
                    "near_duplicates", "info",
                    f"{name}: at least {len(sel):,} pairs of near-identical samples (RMS difference <= "
                    f"{_dedup.NEAR_TOL} std)",
                    "Near copies (re-encoded, slightly shifted or noisy versions) count like duplicates; "
                    "de-duplicate if they are not intended augmentation.",
                    split=name, pairs=len(sel), examples=[[i, j] for i, j, _ in sel[:EXAMPLES]]))
            else:
                sa, sb = splits[a].name, splits[b].name
                out.append(finding(
                    "leaked_near_duplicates", "warning",
                    f"at least {len(sel):,} {sb} samples are near copies of {sa} samples (RMS difference <= "
                    f"{_dedup.NEAR_TOL} std)",
                    f"Near copies across splits leak like exact ones: drop them from {sb} or split by source "
                    "(patient, user, document) rather than by sample.",
                    split=sb, pairs=len(sel), examples=[{sa: i, sb: j} for i, j, _ in sel[:EXAMPLES]]))
    return out


def _labels(splits: list[Split], info: dict[str, dict]) -> list[Finding]:
    out = []
    counts = {}
    for s in splits:
        values, n = np.unique(s.y, return_counts=True)
        counts[s.name] = dict(zip(values.tolist(), n.tolist()))
        info[s.name] = {str(k): v for k, v in counts[s.name].items()}
    tr = counts[splits[0].name]
    if len(tr) == 1:
        out.append(finding("single_class", "error", f"{splits[0].name}: every target is the same class "
                           f"({next(iter(tr))})", "A classifier needs at least two classes; check the labels.",
                           counts=info[splits[0].name]))
        return out
    big = max(tr, key=tr.get)
    small = min(tr, key=tr.get)
    ratio = tr[big] / tr[small]
    if ratio > IMBALANCE:
        total = sum(tr.values())
        weights = {str(k): round(total / (len(tr) * v), 4) for k, v in tr.items()}
        out.append(finding(
            "label_imbalance", "warning",
            f"{splits[0].name}: labels imbalanced {ratio:.0f}:1 (class {big}: {tr[big]:,}, class {small}: {tr[small]:,})",
            "Weight the loss by class (weights N / (C * count): "
            + ", ".join(f"{k}: {v}" for k, v in list(weights.items())[:10])
            + "), resample with a WeightedRandomSampler, and judge with per-class metrics rather than accuracy.",
            ratio=ratio, counts=info[splits[0].name], class_weights=weights))
    for s in splits[1:]:
        unseen = sorted(set(counts[s.name]) - set(tr))
        if unseen:
            out.append(finding(
                "unseen_labels", "warning", f"{s.name} has labels never seen in training: {unseen[:EXAMPLES]}",
                "The model cannot predict a class it never saw; re-split so every class is in training.",
                split=s.name, labels=unseen))
    return out


def _channel_axis(x: np.ndarray) -> bool:
    """Images and sequences (N, C, ...) are normalised per channel; tables per feature."""
    return x.ndim >= 3


def _normalisation(tr: Split) -> tuple[list[Finding], dict[str, Any]]:
    x = tr.x
    if np.issubdtype(x.dtype, np.complexfloating) or x.dtype == np.bool_:
        return [], {}
    if np.issubdtype(x.dtype, np.integer) and x.dtype != np.uint8:
        return [], {}  # integer inputs are ids or categories (tokens, indices): nothing to normalise
    per_channel = _channel_axis(x)
    mean, std = column_stats(np.moveaxis(x, 1, -1).reshape(-1, x.shape[1]) if per_channel else tr.flat)
    unit = "channel" if per_channel else "feature"
    stats = {"per": unit, "mean": mean[:MAX_VECTOR], "std": std[:MAX_VECTOR], "count": int(mean.size)}
    live = np.isfinite(std) & (std > 0)
    if not live.any():
        return [], stats
    m, sd = mean[live], std[live]
    reasons = []
    if np.abs(m).max() > MEAN_LIMIT:
        reasons.append(f"|mean| up to {fmt(np.abs(m).max())}")
    if sd.max() > STD_HIGH:
        reasons.append(f"std up to {fmt(sd.max())}")
    if sd.min() < STD_LOW:
        reasons.append(f"std down to {fmt(sd.min())}")
    if sd.max() / sd.min() > SCALE_SPREAD:
        reasons.append(f"{unit} scales differ {sd.max() / sd.min():.0f}x")
    if not reasons:
        return [], stats
    shown = min(mean.size, 8)
    values = (f"mean={[float(f'{v:.4g}') for v in mean[:shown]]}, std={[float(f'{v:.4g}') for v in std[:shown]]}"
              + (" ..." if mean.size > shown else ""))
    how = (f"torchvision.transforms.Normalize({values})" if per_channel else f"(x - mean) / std per feature, with {values} (all values in the evidence)")
    return [finding(
        "inputs_not_normalised", "warning",
        f"{tr.name} inputs are far from normalised ({'; '.join(reasons)})",
        f"Standardise the inputs: {how}; compute the values on the training split only.",
        per=unit, mean=mean[:MAX_VECTOR], std=std[:MAX_VECTOR], reasons=reasons)], stats


def _constant(tr: Split) -> list[Finding]:
    flat = tr.flat
    if flat.shape[0] < 2:
        return []
    same = np.all(flat == flat[0], axis=0)
    if flat.dtype.kind in "fc":
        same |= np.all(np.isnan(flat), axis=0)
    k = int(same.sum())
    if k == 0:
        return []
    idx = np.flatnonzero(same)
    every = k == flat.shape[1]
    return [finding(
        "constant_features", "error" if every else "info",
        f"{tr.name}: {'every input feature is constant' if every else f'{k:,} of {flat.shape[1]:,} input features are constant'}"
        + ("" if every else f" (e.g. {idx[:EXAMPLES].tolist()})"),
        "Constant inputs carry no information; drop them (per-feature standardisation divides by their zero std)."
        if not every else "The inputs hold no information at all: check the loading code.",
        count=k, features=idx[:MAX_VECTOR], total=int(flat.shape[1]))]
