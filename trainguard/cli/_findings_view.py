"""Terminal and JSON rendering of findings: most severe first, with evidence and the fix.

``render_findings(console, findings)`` is what ``trainguard monitor`` and ``trainguard diagnose``
print, ``render_findings_table(findings)`` the panel ``trainguard report`` shows, and
``findings_json(findings)`` the ``--json`` form. A finding another one explains is shown under
its cause (``explains:`` in the terminal, ``symptoms`` in JSON; see ``analysis._causes``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from trainguard.analysis._causes import fold, unfold
from trainguard.store import SEVERITIES, Finding, sort_findings, to_plain_json

_STYLE = {"critical": "bold white on red", "error": "bold red", "warning": "bold yellow", "info": "cyan"}
_MAX_ITEMS = 6  # list/dict entries shown per evidence line before "... and N more"


def as_findings(items: Iterable[Finding | dict]) -> list[Finding]:
    """Findings from Finding objects or stored dicts (``run.findings()``, or a report's, with
    symptoms folded under their cause), most severe first."""
    out = []
    for item in unfold([i.to_dict() if isinstance(i, Finding) else i for i in items]):
        out.append(Finding.from_dict(item))
    return sort_findings(out)


def _num(x: Any) -> str:
    if isinstance(x, bool):
        return str(x).lower()
    if isinstance(x, int):
        return str(x)
    if isinstance(x, float):
        if not math.isfinite(x):
            return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
        if x.is_integer() and abs(x) < 1e6:
            return str(int(x))
        if x != 0 and (abs(x) < 1e-3 or abs(x) >= 1e5):
            return f"{x:.2e}"
        return f"{x:.3g}"
    return str(x)


def _value(v: Any, depth: int = 0) -> str:
    if isinstance(v, dict):
        items = list(v.items())
        shown = ", ".join(f"{k}: {_value(x, depth + 1)}" for k, x in items[:_MAX_ITEMS])
        more = f", ... and {len(items) - _MAX_ITEMS} more" if len(items) > _MAX_ITEMS else ""
        return ("{" + shown + more + "}") if depth else shown + more
    if isinstance(v, (list, tuple)):
        shown = ", ".join(_value(x, depth + 1) for x in v[:_MAX_ITEMS])
        more = f", ... and {len(v) - _MAX_ITEMS} more" if len(v) > _MAX_ITEMS else ""
        return "[" + shown + more + "]"
    return _num(v)


def findings_renderable(findings: Iterable[Finding | dict], *, evidence: bool = True) -> Group:
    """Findings most severe first: severity, kind, title, steps and layers, evidence, fix."""
    items = as_findings(findings)
    if not items:
        return Group(Text("no findings", style="dim"))
    counts = {s: sum(f.severity == s for f in items) for s in reversed(SEVERITIES)}
    summary = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
    lines: list[Text] = [Text.assemble((f"{len(items)} finding(s)", "bold"), f": {summary}")]
    for d in fold([f.to_dict() for f in items]):
        f = Finding.from_dict(d)
        lines.append(Text())
        lines.append(Text.assemble((f" {f.severity.upper()} ", _STYLE[f.severity]), " ", (f.kind, "bold"), "  ", f.title))
        where = []
        if f.steps:
            where.append(f"steps {f.steps[0]}-{f.steps[1]}" if f.steps[0] != f.steps[1] else f"step {f.steps[0]}")
        if f.layers:
            where.append("layers " + ", ".join(f.layers[:_MAX_ITEMS]) + (" ..." if len(f.layers) > _MAX_ITEMS else ""))
        if where:
            lines.append(Text("    " + " · ".join(where), style="dim"))
        if evidence and f.evidence:
            for key, val in f.evidence.items():
                lines.append(Text.assemble("    ", (f"{key}:", "dim"), " ", _value(val)))
        if f.suggestion:
            lines.append(Text.assemble("    ", ("fix:", "green"), " ", f.suggestion))
        symptoms = unfold(d.get("symptoms") or [])
        if symptoms:  # the findings this cause explains, folded under it
            lines.append(Text("    explains:", style="dim"))
            for s in symptoms:
                lines.append(Text.assemble("      ", ("↳ ", "dim"), (s["kind"], "bold"), "  ", s.get("title", "")))
    return Group(*lines)


def render_findings(console: Console, findings: Iterable[Finding | dict], *, evidence: bool = True) -> None:
    """Print findings most severe first (what ``trainguard monitor`` and ``diagnose`` show)."""
    console.print(findings_renderable(findings, evidence=evidence))


def render_findings_table(findings: Iterable[Finding | dict]) -> Panel:
    """The findings as one panel for ``trainguard report``."""
    return Panel(findings_renderable(findings), title="findings", title_align="left", border_style="yellow")


def findings_json(findings: Iterable[Finding | dict]) -> dict:
    """The ``--json`` form: findings most severe first, counts per severity, and the verdict."""
    items = as_findings(findings)
    problems = [f for f in items if f.is_problem]
    if problems:
        verdict = problems[0].severity
    elif any(f.kind == "healthy" for f in items):
        verdict = "healthy"
    else:
        verdict = "unknown"
    return {
        "verdict": verdict,
        "counts": {s: sum(f.severity == s for f in items) for s in SEVERITIES},
        "findings": [to_plain_json(f) for f in fold([f.to_dict() for f in items])],
    }


def render_thresholds(console: Console, thresholds: Any) -> None:
    """The diagnosis thresholds in use, each with its reason."""
    table = Table(show_header=True, header_style="bold", box=None, pad_edge=False)
    table.add_column("threshold")
    table.add_column("value", justify="right")
    table.add_column("why")
    defaults = type(thresholds).reasons()
    for name, (default, reason) in defaults.items():
        value = getattr(thresholds, name)
        shown = _num(float(value))
        if value != default:
            shown += f" (default {_num(float(default))})"
        table.add_row(name, shown, reason)
    console.print(table)
