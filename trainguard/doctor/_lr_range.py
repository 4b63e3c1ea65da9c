"""The learning-rate range test (Smith, 2017): one short run with an exponentially rising rate.

Each step trains on the next batch at a rate ``start * (end / start) ** (i / (steps - 1))``. A
bias-corrected exponential moving average of the loss, computed on the fly, stops the sweep when
it diverges. Afterwards the curve is smoothed with a Gaussian kernel over neighbouring steps (a
centred filter: it does not shift the curve toward larger rates the way a running average does)
and the suggestion is the rate where that curve falls fastest per decade of learning rate: the
steepest descent of the smoothed loss with respect to log(lr), searched between the first points
and the curve's minimum.

Why that point: to its left the rate is too small to make progress in a step; at the minimum and
beyond, updates are already overshooting, and the minimum of a sweep is where the accumulated
progress of all earlier steps meets the onset of divergence, so training at that rate for long is
unstable. The steepest point is the largest rate that is still clearly in the learning regime;
with the default sweep it typically sits about an order of magnitude below the divergence point.
"""

from __future__ import annotations

import csv
import io
import math
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from rich.table import Table
from torch import nn

from trainguard.doctor._results import CheckResult, finding, fmt
from trainguard.doctor._state import (
    DoctorInputError,
    as_float,
    check_loss_fn,
    check_model,
    check_positive,
    make_optimizer,
    map_tensors,
    model_device,
    optimizer_step,
    preserved,
    split_batch,
    to_device,
    trainable,
)
from trainguard.store import Finding

# Weight of a new loss in the on-the-fly moving average that detects divergence (about 20 steps).
DIVERGE_EMA = 0.05
# Standard deviation, in steps, of the Gaussian that smooths the curve for the suggestion and the
# plot: 3 steps (a quarter of a decade with the default sweep) removes batch-to-batch noise but
# keeps the drop's shape; a running average wide enough to be as quiet blurs it over decades.
SMOOTH_STEPS = 3.0
# Stop when the smoothed loss exceeds this multiple of the best smoothed loss so far.
DIVERGE = 4.0
# The first steps are not judged for divergence: the average has not settled yet.
WARMUP_STEPS = 5
# The suggestion ignores this share of the first points (the smoothed curve's edge).
SKIP_START = 0.05
# The sweep "found a descent" when the smoothed loss fell by at least this share.
MIN_DROP = 0.05


@dataclass(kw_only=True, repr=False)
class LRRangeResult(CheckResult):
    """The sweep: rates, raw and smoothed losses, where it stopped and the suggested rate."""

    check = "lr_range_test"
    lrs: list[float]
    losses: list[float]
    smoothed: list[float]
    suggestion: float | None
    min_loss_lr: float | None
    diverged: bool
    stop_reason: str
    start: float
    end: float
    optimizer: str
    why_none: str = ""
    bad_batch: int | None = None  # the step whose batch held NaN/Inf (the data stopped the sweep, not the rate)
    group_scales: list[float] = field(default_factory=list)  # each group's rate over the first's, kept in the sweep
    passed: bool | None = None

    def __post_init__(self) -> None:
        if self.passed is None:
            self.passed = self.suggestion is not None

    @property
    def summary(self) -> str:
        if self.bad_batch is not None:
            where = f"stopped at lr {fmt(self.lrs[-1])}: {self.stop_reason}"
        elif self.diverged:
            where = f"diverged at lr {fmt(self.lrs[-1])}"
        else:
            where = f"ran to lr {fmt(self.lrs[-1])}"
        if self.suggestion is None:
            return f"no learning rate to suggest: {self.why_none}; {where}"
        return f"suggested lr {fmt(self.suggestion)} (steepest descent), loss minimum at {fmt(self.min_loss_lr)}; {where}"

    def _fields(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in (
            "suggestion", "min_loss_lr", "diverged", "stop_reason", "start", "end", "optimizer", "lrs", "losses",
            "smoothed", "why_none", "bad_batch", "group_scales")}

    def _detail(self) -> Table:
        t = Table(show_header=False, box=None, padding=(0, 2))
        t.add_row("suggested lr", fmt(self.suggestion))
        t.add_row("lr at loss minimum", fmt(self.min_loss_lr))
        t.add_row("sweep", f"{fmt(self.start)} -> {fmt(self.lrs[-1])} in {len(self.lrs)} steps, {self.optimizer}")
        t.add_row("stopped", self.stop_reason)
        return t

    def findings(self) -> list[Finding]:
        ev = {"suggestion": self.suggestion, "min_loss_lr": self.min_loss_lr, "diverged": self.diverged,
              "stop_reason": self.stop_reason, "why_none": self.why_none, "last_lr": self.lrs[-1], "optimizer": self.optimizer}
        if self.suggestion is None and self.bad_batch is not None:
            return [finding("lr_range_no_suggestion", "warning", f"LR range test: {self.summary}",
                            "Drop or fix the samples that hold NaN/Inf (validate_data lists them), then run the "
                            "sweep again: the learning rate did not make this loss.", **ev)]
        if self.suggestion is None:
            return [finding("lr_range_no_suggestion", "warning", f"LR range test: {self.summary}",
                            "Check that the model learns at all (overfit_one_batch) and widen the sweep "
                            "(start lower, end higher, more steps).", **ev)]
        groups = ""
        if any(s != 1 for s in self.group_scales):
            ev["group_scales"] = self.group_scales
            groups = (" for its first parameter group, " + ", ".join(
                f"group {i} at lr={self.suggestion * s:.3g}" for i, s in enumerate(self.group_scales) if i)
                + " (the sweep kept the ratios of the groups' rates)")
        return [finding("lr_suggestion", "info", f"LR range test suggests lr={fmt(self.suggestion)}",
                        f"Train with {self.optimizer} at lr={fmt(self.suggestion)}{groups}; rates above "
                        f"{fmt(self.min_loss_lr)} are at the edge of divergence.", **ev)]

    # ------------------------------------------------------------------ outputs
    def to_csv(self, path: str | os.PathLike | None = None) -> str:
        """The sweep as CSV (step, lr, loss, smoothed_loss); written to ``path`` when given."""
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(["step", "lr", "loss", "smoothed_loss"])
        for i, (lr, loss, sm) in enumerate(zip(self.lrs, self.losses, self.smoothed)):
            w.writerow([i, repr(lr), repr(loss), repr(sm)])
        text = buf.getvalue()
        if path is not None:
            with open(path, "w", encoding="utf-8", newline="") as fh:
                fh.write(text)
        return text

    def plot_png(self, *, width: float = 7.0, height: float = 4.2, dpi: int = 120) -> bytes:
        """The PNG bytes of the plot: loss against a log-scaled rate, the suggestion marked."""
        fig = self.figure(width=width, height=height, dpi=dpi)
        buf = io.BytesIO()
        fig.savefig(buf, format="png")
        return buf.getvalue()

    def figure(self, *, width: float = 7.0, height: float = 4.2, dpi: int = 120) -> Any:
        """The plot as a matplotlib ``Figure`` (needs matplotlib, the ``plot`` extra)."""
        try:
            from matplotlib.backends.backend_agg import FigureCanvasAgg
            from matplotlib.figure import Figure
        except ImportError:  # pragma: no cover - matplotlib is in the plot extra
            raise DoctorInputError(
                "plotting needs matplotlib: install trainguard with the 'plot' extra (pip install 'trainguard[plot]')"
            ) from None
        # A bare Figure: no pyplot, no global backend or state touched.
        fig = Figure(figsize=(width, height), dpi=dpi)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot(1, 1, 1)
        lrs = np.asarray(self.lrs, dtype=float)
        raw = np.asarray(self.losses, dtype=float)
        sm = np.asarray(self.smoothed, dtype=float)
        ax.plot(lrs, raw, color="#9bb7d4", linewidth=1, label="loss")
        ax.plot(lrs, sm, color="#1f4e79", linewidth=2, label="smoothed loss")
        ax.set_xscale("log")
        ax.set_xlabel("learning rate (log scale)")
        ax.set_ylabel("loss")
        finite = sm[np.isfinite(sm)]
        if finite.size:
            # Show the whole descent; cut the diverging tail, which would squash everything else.
            head = np.concatenate([finite[: max(1, finite.size // 10)], raw[: max(1, raw.size // 10)]])
            head = head[np.isfinite(head)]
            ok = raw[np.isfinite(raw)]
            lo = float(min(finite.min(), ok.min() if ok.size else finite.min()))
            hi = float(max(head.max(), finite.max() if finite.size < 3 else head.max()))
            pad = 0.08 * max(hi - lo, 1e-12)
            ax.set_ylim(lo - pad, hi + pad)
        if self.min_loss_lr is not None:
            ax.axvline(self.min_loss_lr, color="#999999", linestyle=":", linewidth=1,
                       label=f"loss minimum {fmt(self.min_loss_lr)}")
        if self.suggestion is not None:
            i = int(np.argmin(np.abs(np.log(lrs) - math.log(self.suggestion))))
            ax.axvline(self.suggestion, color="#c0392b", linestyle="--", linewidth=1.2)
            ax.plot([self.suggestion], [sm[i]], "o", color="#c0392b", markersize=8,
                    label=f"suggested lr {fmt(self.suggestion)}")
        title = "Learning-rate range test"
        if self.diverged:
            title += f" (stopped: diverged at {fmt(self.lrs[-1])})"
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.25)
        ax.legend(loc="upper left", fontsize=8)
        fig.tight_layout()
        return fig

    def plot(self, path: str | os.PathLike, **kwargs: Any) -> str:
        """Write the plot as a PNG to ``path`` (needs matplotlib, the ``plot`` extra)."""
        data = self.plot_png(**kwargs)
        with open(path, "wb") as fh:
            fh.write(data)
        return os.fspath(path)


def _cycle(data: Any) -> Iterator[Any]:
    """Batches from ``data`` forever, restarting it when it runs out (or a lone batch, repeated)."""
    if isinstance(data, (tuple, list)) and len(data) == 2 and isinstance(data[0], torch.Tensor):
        while True:
            yield data
    if isinstance(data, Iterator):
        raise DoctorInputError("data must be re-iterable (a DataLoader or a list of batches), not a one-shot iterator")
    if not isinstance(data, Iterable):
        raise DoctorInputError(f"data must be an iterable of (inputs, targets) batches, got {type(data).__name__}")
    while True:
        empty = True
        for batch in data:
            empty = False
            yield batch
        if empty:
            raise DoctorInputError("data yielded no batches")


def gaussian_smooth(values: np.ndarray, sigma: float) -> np.ndarray:
    """Centred Gaussian smoothing over ``sigma`` steps; the ends are padded with the end values."""
    values = np.asarray(values, dtype=float)
    if sigma <= 0 or values.size < 2:
        return values.copy()
    half = int(math.ceil(3 * sigma))
    kernel = np.exp(-0.5 * (np.arange(-half, half + 1) / sigma) ** 2)
    kernel /= kernel.sum()
    padded = np.pad(values, half, mode="edge")
    return np.convolve(padded, kernel, mode="valid")


def suggest(lrs: np.ndarray, smoothed: np.ndarray, skip_start: float = SKIP_START) -> tuple[int | None, int | None, str]:
    """``(index of suggestion, index of minimum, why none)`` from a smoothed curve.

    The suggestion is the point of most negative slope d(loss)/d(log10 lr), between the first
    ``skip_start`` share of the points and the minimum of the curve.
    """
    n = len(smoothed)
    if n < 5:
        return None, None, "too few steps before the sweep stopped"
    i_min = int(np.argmin(smoothed))
    lo = max(1, int(skip_start * n))
    if smoothed[i_min] > (1 - MIN_DROP) * smoothed[:lo + 1].max():
        return None, i_min, "the smoothed loss never fell"
    if i_min - lo < 2:
        return None, i_min, "the loss was lowest at the start of the sweep: start lower"
    slope = np.gradient(smoothed, np.log10(lrs))
    i = lo + int(np.argmin(slope[lo:i_min + 1]))
    if slope[i] >= 0:
        return None, i_min, "the smoothed loss never fell"
    return i, i_min, ""


def lr_range_test(
    model: nn.Module,
    data: Any,
    loss_fn: Any,
    optimizer_factory: Any = None,
    start: float = 1e-7,
    end: float = 10.0,
    steps: int = 100,
    *,
    smooth: float = SMOOTH_STEPS,
    diverge: float = DIVERGE,
    console: Any = None,
) -> LRRangeResult:
    """Sweep the learning rate exponentially from ``start`` to ``end`` over ``steps`` batches.

    ``data`` is an iterable of ``(inputs, targets)`` batches (restarted when it runs out) or a
    single batch. ``optimizer_factory`` builds the optimizer from the trainable parameters
    (default Adam); an optimizer instance is also accepted and its state restored afterwards.
    The sweep stops when the loss is NaN/Inf or its moving average passes ``diverge`` times its
    best. ``smooth`` is the standard deviation, in steps, of the Gaussian that smooths the curve.
    Pass a rich ``console`` to see a progress bar; otherwise nothing is printed. The model,
    optimizer and RNG states are restored afterwards.

    >>> result = lr_range_test(model, loader, nn.CrossEntropyLoss())
    >>> result.suggestion; result.plot("lr.png"); result.to_csv("lr.csv")
    """
    check_model(model)
    check_loss_fn(loss_fn)
    check_positive("start", start)
    check_positive("end", end)
    check_positive("steps", steps, integer=True)
    if not end > start:
        raise DoctorInputError(f"end must be greater than start, got start={start!r}, end={end!r}")
    if steps < 5:
        raise DoctorInputError(f"steps must be at least 5, got {steps}")
    if isinstance(smooth, bool) or not isinstance(smooth, (int, float)) or not smooth >= 0:
        raise DoctorInputError(f"smooth must be a number of steps >= 0, got {smooth!r}")
    if not diverge > 1:
        raise DoctorInputError(f"diverge must be > 1, got {diverge!r}")
    named = trainable(model)
    if not named:
        raise DoctorInputError("the model has no trainable parameters (all have requires_grad=False)")
    given = optimizer_factory if isinstance(optimizer_factory, torch.optim.Optimizer) else None
    schedule = start * (end / start) ** (np.arange(steps) / (steps - 1))
    device = model_device(model)

    lrs: list[float] = []
    losses: list[float] = []
    stop_reason = f"reached end={fmt(end)}"
    diverged = False
    bad_batch = None
    progress = _progress(console, steps)
    with preserved(model, optimizer=given, data=data), torch.enable_grad(), progress as bar:
        model.train()
        opt, _ = make_optimizer(optimizer_factory, [p for _, p in named],
                                lambda params: torch.optim.Adam(params, lr=start), model)
        task = bar.add_task("LR range test", total=steps) if bar is not None else None
        batches = _cycle(data)
        avg, best = 0.0, math.inf
        scales = group_scales(opt)
        for i, lr in enumerate(schedule):
            for group, scale in zip(opt.param_groups, scales):
                group["lr"] = float(lr) * scale
            inputs, targets = split_batch(next(batches))
            inputs, targets = to_device(inputs, device), to_device(targets, device)
            opt.zero_grad(set_to_none=True)
            loss = as_float(loss_fn(model(inputs), targets))
            value = float(loss.detach())  # one host sync per step: the sweep must see the loss
            lrs.append(float(lr))
            losses.append(value)
            if bar is not None:
                bar.update(task, advance=1, description=f"LR range test  lr {lr:.2e}  loss {value:.4g}")
            if not math.isfinite(value):
                held = _nonfinite_parts(inputs, targets)
                if held:  # the data made it, at any rate (a NaN label, an inf margin)
                    bad_batch, stop_reason = i, f"the loss was {value} on the sweep's batch {i} (from 0), whose {held} hold NaN/Inf"
                else:
                    diverged, stop_reason = True, f"the loss became non-finite at lr {fmt(lr)}"
                break
            if not loss.requires_grad:
                raise DoctorInputError("the loss does not depend on any trainable parameter (no gradient path)")
            avg = (1 - DIVERGE_EMA) * avg + DIVERGE_EMA * value
            level = avg / (1 - (1 - DIVERGE_EMA) ** (i + 1))
            best = min(best, level)
            if i >= WARMUP_STEPS and level > best + (diverge - 1) * abs(best):
                diverged, stop_reason = True, f"the smoothed loss passed {diverge:g}x its best at lr {fmt(lr)}"
                break
            loss.backward()
            optimizer_step(opt, loss, lambda inputs=inputs, targets=targets: loss_fn(model(inputs), targets))

    raw = np.asarray(losses, dtype=float)
    finite = np.isfinite(raw)
    n_ok = int(finite.argmin()) if not finite.all() else len(raw)  # points before the first non-finite one
    # Cap the diverging tail at `diverge` times the starting level before smoothing, or its huge
    # values leak backwards into the whole curve.
    level = float(np.median(raw[:max(1, n_ok // 10)])) if n_ok else 0.0
    cap = level + (diverge - 1) * abs(level) if n_ok else math.inf
    curve = gaussian_smooth(np.minimum(raw[:n_ok], cap), smooth) if n_ok else np.empty(0)
    smoothed = list(curve) + [math.nan] * (len(raw) - n_ok)
    i_s, i_min, why = suggest(np.asarray(lrs[:n_ok]), curve)
    return LRRangeResult(
        lrs=lrs, losses=losses, smoothed=[float(v) for v in smoothed],
        suggestion=lrs[i_s] if i_s is not None else None,
        min_loss_lr=lrs[i_min] if i_min is not None else None,
        diverged=diverged, stop_reason=stop_reason, why_none=why, start=float(start), end=float(end),
        optimizer=type(opt).__name__, bad_batch=bad_batch, group_scales=scales,
    )


def group_scales(opt: torch.optim.Optimizer) -> list[float]:
    """Each parameter group's rate over the first group's, as the optimizer was built: groups at
    rates of their own (nanochat's embedding, lm_head, matrices and scalars) keep their ratios
    during the sweep. All 1 when every group has the same rate, or any has none above 0."""
    rates = [g.get("lr") for g in opt.param_groups]
    if len(rates) < 2 or not all(isinstance(r, (int, float)) and r > 0 for r in rates) or len(set(rates)) == 1:
        return [1.0] * len(rates)
    return [float(r) / float(rates[0]) for r in rates]


def _nonfinite_parts(inputs: Any, targets: Any) -> str:
    """'inputs', 'targets' or 'inputs and targets': which of a batch's parts hold NaN/Inf ('' if none)."""
    def bad(obj: Any) -> bool:
        found: list[bool] = []
        map_tensors(obj, lambda t: found.append(t.is_floating_point() and not bool(torch.isfinite(t).all())) or t)
        return any(found)

    return " and ".join(name for name, part in (("inputs", inputs), ("targets", targets)) if bad(part))


class _NoProgress:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _progress(console: Any, steps: int) -> Any:
    if console is None:
        return _NoProgress()
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, transient=False)
