"""The pre-training checklist: every doctor check on one setup, and the results in a run.

:func:`run_checklist` runs, in order: data validation, init and shape checks, overfit one
batch, the gradient check and the learning-rate range test. A check that raises does not stop
the others: it becomes an ``error`` result with the exception's message. :class:`DoctorReport`
renders the verdict table and writes everything to a run directory (findings with source
"doctor", ``doctor/report.json``, ``doctor/lr_range_test.png`` and ``.csv``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from rich.console import Group
from rich.table import Table
from rich.text import Text
from torch import nn

from trainguard.doctor._data import validate_data
from trainguard.doctor._gradcheck import gradient_check
from trainguard.doctor._init_checks import init_checks
from trainguard.doctor._lr_range import LRRangeResult, lr_range_test
from trainguard.doctor._overfit import overfit_one_batch
from trainguard.doctor._results import VERDICT_STYLE, CheckResult, finding, findings_table
from trainguard.doctor._state import DoctorInputError, loss_reads_targets, sparse_embeddings, split_batch
from trainguard.store import Finding, acquire_writer, dumps, rank_dir, release_writer, sort_findings

CHECKS = ("data", "init", "overfit", "gradcheck", "lr")

ARTIFACT_REPORT = "doctor/report.json"
ARTIFACT_PLOT = "doctor/lr_range_test.png"
ARTIFACT_CSV = "doctor/lr_range_test.csv"


@dataclass(kw_only=True, repr=False)
class CheckError(CheckResult):
    """A check that could not run: the exception it raised."""

    check: str  # type: ignore[misc]
    error: str
    passed: bool = False

    @property
    def verdict(self) -> str:
        return "error"

    @property
    def summary(self) -> str:
        return f"could not run: {self.error}"

    def findings(self) -> list[Finding]:
        return [finding("doctor_check_error", "error", f"{self.check} could not run: {self.error}",
                        "Fix the error above (often the forward pass or the loss on this batch) and run again.",
                        check=self.check, error=self.error)]

    def _fields(self) -> dict[str, Any]:
        return {"error": self.error}


@dataclass(kw_only=True)
class DoctorSetup:
    """What a ``module:function`` target returns: the model, the data and the loss, and
    optionally an optimizer factory, a test split and the number of classes."""

    model: nn.Module
    data: Any
    loss_fn: Callable
    optimizer_factory: Any = None
    test: Any = None
    num_classes: int | None = None

    KEYS = ("model", "data", "loss_fn", "optimizer_factory", "test", "num_classes")

    @classmethod
    def from_value(cls, value: Any, where: str = "the setup function") -> DoctorSetup:
        """Accept a dict with those keys, or a tuple ``(model, data, loss_fn[, optimizer_factory[, test]])``."""
        if isinstance(value, DoctorSetup):
            return value
        if isinstance(value, dict):
            unknown = sorted(set(value) - set(cls.KEYS))
            if unknown:
                raise DoctorInputError(f"{where} returned unknown keys {unknown}; known: {list(cls.KEYS)}")
            missing = [k for k in ("model", "data", "loss_fn") if k not in value]
            if missing:
                raise DoctorInputError(f"{where} returned a dict without {missing}")
            kwargs = dict(value)
        elif isinstance(value, (tuple, list)) and 3 <= len(value) <= 5:
            kwargs = dict(zip(cls.KEYS, value))
        else:
            what = type(value).__name__ if not isinstance(value, (tuple, list)) else f"a {len(value)}-tuple"
            raise DoctorInputError(
                f"{where} returned {what}; expected a dict with model, data, loss_fn (and optionally "
                "optimizer_factory, test, num_classes) or a tuple (model, data, loss_fn[, optimizer_factory[, test]])"
            )
        setup = cls(**kwargs)
        if not isinstance(setup.model, nn.Module):
            raise DoctorInputError(f"{where}: model must be a torch.nn.Module, got {type(setup.model).__name__}")
        if not callable(setup.loss_fn):
            raise DoctorInputError(f"{where}: loss_fn must be callable, got {type(setup.loss_fn).__name__}")
        if setup.optimizer_factory is not None and not (
            callable(setup.optimizer_factory) or isinstance(setup.optimizer_factory, torch.optim.Optimizer)
        ):
            raise DoctorInputError(
                f"{where}: optimizer_factory must be callable as factory(params), got "
                f"{type(setup.optimizer_factory).__name__}"
            )
        if not isinstance(setup.data, Iterable) and not hasattr(setup.data, "__getitem__"):
            raise DoctorInputError(f"{where}: data must be an iterable of (inputs, targets) batches, "
                                   f"got {type(setup.data).__name__}")
        return setup


@dataclass(kw_only=True)
class DoctorReport:
    """The checklist's results, in order, with where they were written."""

    results: list[CheckResult]
    seconds: dict[str, float] = field(default_factory=dict)
    logdir: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(r.verdict in ("pass", "warn") for r in self.results)

    def result(self, check: str) -> CheckResult | None:
        for r in self.results:
            if r.check == check:
                return r
        return None

    def findings(self) -> list[Finding]:
        return sort_findings([f for r in self.results for f in r.findings()])

    def to_dict(self) -> dict[str, Any]:
        lr = self.result("lr_range_test")
        head: dict[str, Any] = {"passed": self.passed}
        if isinstance(lr, LRRangeResult):
            # Up front, so a reader finds the suggested rate without walking the results.
            head["lr_range_test"] = {"suggestion": lr.suggestion, "min_loss_lr": lr.min_loss_lr,
                                     "plot": ARTIFACT_PLOT, "csv": ARTIFACT_CSV}
        return {**head, "verdicts": {r.check: r.verdict for r in self.results},
                "results": [r.to_dict() for r in self.results], "seconds": self.seconds,
                "logdir": self.logdir, "notes": self.notes}

    def __rich__(self) -> Group:
        table = Table(title="trainguard doctor", title_justify="left", show_lines=True)
        table.add_column("check", style="bold", no_wrap=True)
        table.add_column("verdict", no_wrap=True)
        table.add_column("evidence", overflow="fold")
        table.add_column("time", justify="right", no_wrap=True)
        for r in self.results:
            t = self.seconds.get(r.check)
            table.add_row(r.check, Text(r.verdict.upper(), style=VERDICT_STYLE[r.verdict]), r.summary,
                          "-" if t is None else f"{t:.1f}s")
        parts: list[Any] = [table]
        problems = [f for f in self.findings() if f.is_problem]
        if problems:
            parts.append(findings_table(problems, title="What to fix"))
        verdict = "all checks passed" if self.passed else "some checks failed"
        if self.passed and problems:
            verdict += ", with warnings"
        parts.append(Text(verdict, style="bold green" if self.passed else "bold red"))
        for note in self.notes:
            parts.append(Text(note, style="dim"))
        return Group(*parts)

    def save(self, logdir: str | os.PathLike, *, overwrite: bool = False) -> str:
        """Write findings (source "doctor", replacing earlier ones), the JSON report and the LR
        range test's plot and CSV into the run directory ``logdir``.

        A run this process is writing to ``logdir`` (a recording) is joined; results are added to a
        run another process left there (``overwrite`` replaces that run instead). Under
        ``torch.distributed`` each rank writes ``logdir/rank-K``."""
        self.logdir = os.fspath(rank_dir(logdir))
        lr = self.result("lr_range_test")
        artifacts: list[tuple[str, str, bytes]] = []
        if isinstance(lr, LRRangeResult):
            artifacts.append((ARTIFACT_CSV, "text/csv", lr.to_csv().encode()))
            try:
                artifacts.append((ARTIFACT_PLOT, "image/png", lr.plot_png()))
            except DoctorInputError as exc:  # matplotlib missing: keep everything else
                self.notes.append(f"no LR plot: {exc}")
        writer = acquire_writer(self.logdir, overwrite=overwrite, append=not overwrite, meta={"doctor": True})
        try:
            writer.add_findings("doctor", [f.to_dict() for f in self.findings()], replace=True)
            writer.put_artifact(ARTIFACT_REPORT, "application/json", dumps(self.to_dict()).encode())
            for name, media, data in artifacts:
                writer.put_artifact(name, media, data)
            writer.set_meta(doctor_passed=self.passed, doctor_time=time.time())
            writer.flush()
        finally:
            release_writer(writer)
        return self.logdir


def _first_batch(data: Any) -> Any:
    if isinstance(data, (tuple, list)) and len(data) == 2 and isinstance(data[0], torch.Tensor):
        return data
    try:
        return next(iter(data))
    except StopIteration:
        raise DoctorInputError("data yielded no batches") from None
    except TypeError:
        raise DoctorInputError(f"data must be an iterable of (inputs, targets) batches, got {type(data).__name__}") from None


def _for_validation(data: Any) -> Any:
    """The form validate_data reads best: a loader's dataset, or a list of batches concatenated."""
    from torch.utils.data import DataLoader

    if isinstance(data, DataLoader):
        return data.dataset if hasattr(data.dataset, "__len__") else data
    if isinstance(data, (tuple, list)) and len(data) == 2 and all(isinstance(d, torch.Tensor) for d in data):
        return data
    if isinstance(data, (tuple, list)) and data and all(isinstance(b, (tuple, list)) and len(b) == 2 for b in data):
        xs = [b[0] for b in data]
        ys = [b[1] for b in data]
        if all(isinstance(x, torch.Tensor) for x in xs + ys):
            return torch.cat([x.detach().cpu() for x in xs]), torch.cat([y.detach().cpu() for y in ys])
        if all(isinstance(x, np.ndarray) for x in xs + ys):
            return np.concatenate(xs), np.concatenate(ys)
    return data


def run_checklist(
    model: nn.Module,
    data: Any,
    loss_fn: Any,
    *,
    optimizer_factory: Any = None,
    test: Any = None,
    num_classes: int | None = None,
    checks: Iterable[str] = CHECKS,
    overfit_steps: int = 200,
    lr_steps: int = 100,
    console: Any = None,
) -> DoctorReport:
    """Run the doctor's checks on one setup and return a :class:`DoctorReport`.

    ``data`` is an iterable of ``(inputs, targets)`` batches (a ``DataLoader``, a list); its first
    batch drives the init, overfit and gradient checks, the whole of it the LR range test and
    the data validation (with ``test`` for leakage). ``checks`` picks from
    ``("data", "init", "overfit", "gradcheck", "lr")``. The overfit test uses Adam (it tests the
    model and loss, not the optimizer), or ``optimizer_factory`` for a model with ``sparse=True``
    embeddings, whose gradients Adam cannot step; the LR range test uses ``optimizer_factory`` (default
    Adam). Pass a rich ``console`` for progress.
    """
    checks = list(checks)
    unknown = sorted(set(checks) - set(CHECKS))
    if unknown:
        raise DoctorInputError(f"unknown checks {unknown}; choose from {list(CHECKS)}")
    setup = DoctorSetup.from_value({"model": model, "data": data, "loss_fn": loss_fn,
                                    "optimizer_factory": optimizer_factory, "test": test,
                                    "num_classes": num_classes}, "run_checklist")
    batch = _first_batch(setup.data)
    split_batch(batch)
    plan: list[tuple[str, str, Callable[[], CheckResult]]] = [
        ("data", "validate_data", lambda: validate_data(
            _for_validation(setup.data), None if test is None else _for_validation(test),
            targets_read=loss_reads_targets(model, batch, loss_fn))),
        ("init", "init_checks", lambda: init_checks(model, batch, loss_fn, num_classes=num_classes)),
        ("overfit", "overfit_one_batch", lambda: overfit_one_batch(
            model, batch, loss_fn, steps=overfit_steps,
            optimizer_factory=optimizer_factory if sparse_embeddings(model) else None)),
        ("gradcheck", "gradient_check", lambda: gradient_check(model, batch, loss_fn)),
        ("lr", "lr_range_test", lambda: lr_range_test(model, setup.data, loss_fn, optimizer_factory,
                                                      steps=lr_steps, console=console)),
    ]
    results: list[CheckResult] = []
    seconds: dict[str, float] = {}
    for key, name, run in plan:
        if key not in checks:
            continue
        t0 = time.perf_counter()
        status = console.status(f"doctor: {name} ...") if console is not None and key != "lr" else None
        try:
            if status is not None:
                with status:
                    results.append(run())
            else:
                results.append(run())
        except Exception as exc:  # one broken check must not hide the others' verdicts
            results.append(CheckError(check=name, error=f"{type(exc).__name__}: {exc}"))
        seconds[name] = round(time.perf_counter() - t0, 3)
    return DoctorReport(results=results, seconds=seconds)
