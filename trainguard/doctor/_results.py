"""What every doctor check returns: a verdict, evidence, findings, a terminal view and JSON."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from rich.console import Group
from rich.table import Table
from rich.text import Text

from trainguard.store import SEVERITIES, Finding, sort_findings

SOURCE = "doctor"

# Verdict words and their colours in the terminal.
VERDICT_STYLE = {"pass": "bold green", "warn": "bold yellow", "fail": "bold red", "error": "bold magenta"}


def plain(obj: Any) -> Any:
    """A JSON-able copy: tensors and arrays become lists, numpy scalars Python numbers.

    Non-finite floats stay floats; the store's codec spells them explicitly.
    """
    if isinstance(obj, torch.Tensor):
        obj = obj.detach().cpu()
        return obj.item() if obj.dim() == 0 else obj.tolist()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, Finding):
        return obj.to_dict()
    if isinstance(obj, dict):
        return {str(k): plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    return obj


def fmt(x: Any, digits: int = 3) -> str:
    """A short number for the terminal: 3 significant digits, NaN/Inf spelled out."""
    if x is None:
        return "-"
    if isinstance(x, (int, np.integer)) and not isinstance(x, bool):
        return f"{int(x):,}"
    x = float(x)
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "Inf" if x > 0 else "-Inf"
    return f"{x:.{digits}g}"


class CheckResult:
    """Base of the result objects. Subclasses set ``check`` and implement ``summary``,
    ``findings`` and ``_fields``; ``passed`` is True/False where a verdict applies."""

    check: str = "check"
    passed: bool | None = None

    @property
    def verdict(self) -> str:
        """``fail`` (an error-level problem, or not passed without one), ``warn`` (warnings only)
        or ``pass``."""
        worst = max((f.rank for f in self.findings()), default=-1)
        if worst >= SEVERITIES.index("error") or (self.passed is False and worst < SEVERITIES.index("warning")):
            return "fail"
        if worst >= SEVERITIES.index("warning"):
            return "warn"
        return "pass"

    @property
    def summary(self) -> str:  # pragma: no cover - every subclass overrides
        raise NotImplementedError

    def findings(self) -> list[Finding]:  # pragma: no cover - every subclass overrides
        raise NotImplementedError

    def _fields(self) -> dict[str, Any]:  # pragma: no cover - every subclass overrides
        raise NotImplementedError

    def to_dict(self) -> dict[str, Any]:
        d = {"check": self.check, "passed": self.passed, "verdict": self.verdict, "summary": self.summary}
        d.update(plain(self._fields()))
        d["findings"] = [f.to_dict() for f in sort_findings(self.findings())]
        return d

    def _detail(self) -> Any:
        """Extra rich renderable shown under the headline (a table of numbers)."""
        return None

    def __rich__(self) -> Group:
        head = Text.assemble(
            (f"{self.verdict.upper():5} ", VERDICT_STYLE[self.verdict]), (self.check, "bold"), "  ", self.summary
        )
        parts: list[Any] = [head]
        detail = self._detail()
        if detail is not None:
            parts.append(detail)
        problems = [f for f in sort_findings(self.findings()) if f.is_problem]
        if problems:
            parts.append(findings_table(problems))
        return Group(*parts)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.verdict}: {self.summary}>"


def findings_table(findings: list[Finding], title: str | None = None) -> Table:
    table = Table(title=title, show_lines=False, expand=False, title_justify="left")
    table.add_column("severity")
    table.add_column("finding", overflow="fold")
    table.add_column("suggestion", overflow="fold")
    style = {"info": "dim", "warning": "yellow", "error": "red", "critical": "bold red"}
    for f in findings:
        table.add_row(Text(f.severity, style=style[f.severity]), f.title, f.suggestion)
    return table


def finding(kind: str, severity: str, title: str, fix: str = "", /, *, layers: list[str] | None = None,
            **evidence: Any) -> Finding:
    """A doctor finding (``fix`` is its suggestion); evidence values are made JSON-able."""
    return Finding(kind=kind, severity=severity, title=title, evidence=plain(evidence), suggestion=fix,
                   layers=list(layers or []), source=SOURCE)
