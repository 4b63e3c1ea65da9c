"""The report of a run as data: what the terminal report and ``--json`` show."""

from __future__ import annotations

from typing import Any

from trainguard.analysis._origin import origin
from trainguard.store import Run

# Lines of source shown around each frame of the origin.
CONTEXT_LINES = 2


def source_excerpt(run: Run, file: str | None, line: int | None, context: int = CONTEXT_LINES) -> list[dict]:
    """Numbered source lines around ``line`` from the copy stored in the run."""
    if not file or not line:
        return []
    try:
        text = run.source(file)
    except KeyError:
        return []
    lines = text.splitlines()
    lo, hi = max(1, line - context), min(len(lines), line + context)
    return [{"line": n, "text": lines[n - 1], "current": n == line} for n in range(lo, hi + 1)]


def build_report(run: Run, findings: list | None = None) -> dict[str, Any]:
    """Everything ``trainguard report`` says about a run, as JSON-able data."""
    meta = run.meta
    alerts = run.alerts()
    o = origin(run)
    origin_data = None
    if o is not None:
        origin_data = o.to_dict()
        for link in origin_data["chain"]:
            link["source"] = source_excerpt(run, link["file"], link["line"])
            for inp in link["inputs"]:
                if inp.get("file"):
                    inp["source"] = source_excerpt(run, inp["file"], inp["line"], context=0)
        origin_data["origin"] = origin_data["chain"][-1]
    steps = run.steps()
    return {
        "run": str(run.path),
        "status": run.status,
        "meta": {k: meta.get(k) for k in ("mode", "buffer", "created", "ended", "argv", "torch", "trainguard",
                                           "exit_code", "error", "dropped", "writer_error", "record_errors", "ops_filter",
                                           "dtypes_filter", "executions", "recorded", "backend",
                                           "native_unsure")},
        "counts": {
            "stored": run.count(),
            "steps": len(steps),
            "first_step": steps[0]["step"] if steps else None,
            "last_step": steps[-1]["step"] if steps else None,
            "nonfinite": alerts["total"],
            "by_phase": {ph: run.count(phase=ph) for ph in ("forward", "backward", "optimizer", "other")},
            "top_ops": run.op_counts()[:10],
        },
        "alerts": alerts,
        "origin": origin_data,
        "scalars": {name: series[-1] for name, series in run.scalars().items()},
        "findings": [f if isinstance(f, dict) else f.to_dict() for f in (findings or [])],
    }
