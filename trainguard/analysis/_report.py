"""The report of a run as data: what the terminal report and ``--json`` show."""

from __future__ import annotations

from typing import Any

from trainguard.analysis._axis_rules import per_sample_broadcast
from trainguard.analysis._causes import fold
from trainguard.analysis._context import Context
from trainguard.analysis._graph_rules import recording_findings
from trainguard.analysis._origin import op_base, origin
from trainguard.analysis._outcome import script_outcome, with_outcome
from trainguard.analysis._ranks import ranks_report
from trainguard.analysis._run_rules import replicas_not_synchronized
from trainguard.analysis._thresholds import Thresholds
from trainguard.store import RankedRun, Run

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


def compiled_summary(run: Run) -> dict[str, Any] | None:
    """torch.compile graphs in the run: recorded op by op, or whole (compiled before the
    recording started: trainguard could not instrument them), with where they were called."""
    meta = run.meta
    inside = meta.get("compiled_graphs") or []
    opaque = []
    for g in meta.get("compiled_opaque") or []:
        item = dict(g)
        first = run.executions(0, 1, op=g.get("op")) if g.get("op") else []
        fr = run.user_frame(first[0]["stack_id"]) if first else None
        item["file"], item["line"] = (fr["filename"], fr["lineno"]) if fr else (None, None)
        opaque.append(item)
    if not inside and not opaque:
        return None
    return {"recorded_inside": inside, "opaque": opaque, "full_tensor": meta.get("full_tensor_compiled"),
            "opaque_note": OPAQUE_NOTE if opaque else None}


# What a run holds of a graph compiled before the recording started (said by the report, --json
# and the UI alike).
OPAQUE_NOTE = ("Seen: each call as one execution (compiled_graph.<graph>) with the graph's inputs, where they came "
               "from, and the summaries of the outputs it made, so a NaN or Inf it returns is found at the compiled function "
               "that returned it. Not seen: the ops inside, their modules and lines, and infinities made and absorbed "
               "inside (a mask). Compile after the recording starts (or call torch._dynamo.reset() first) to "
               "record them op by op.")


def _op_short(name: str | None) -> str:
    """``aten._softmax.default`` -> ``softmax``: an op as a user knows it."""
    base = op_base(name or "?")
    return base.lstrip("_") or base


def intended_lines(groups: list[dict]) -> list[str]:
    """One quiet line per group of infinities that were never harmful: ``3,840 intended -inf
    from masked_fill, absorbed by softmax`` (``intended`` only for an inf the program wrote: the
    group's ``chosen``, from the reader); never alerts, origins or findings. Groups that read
    the same are one line: a softmax is ``aten._softmax`` under autograd and ``aten.softmax.int``
    under ``inference_mode`` (makemore evaluates so), the same softmax to a user."""
    merged: dict[tuple, list[int]] = {}
    for g in groups:
        absorbed = _op_short(g["absorbed_by"]) if g.get("absorbed_by") else None
        n = merged.setdefault((g.get("kind"), _op_short(g.get("made_by")), absorbed, bool(g.get("chosen"))), [0, 0])
        n[0] += g.get("values") or 0
        n[1] += g.get("executions") or 0
    out = []
    for (kind, made, absorbed, chosen), (values, executions) in merged.items():
        n = f"{values:,}" if values else f"{executions:,} tensors of"
        if absorbed and chosen:
            out.append(f"{n} intended {kind} from {made}, absorbed by {absorbed}")
        elif absorbed:
            out.append(f"{n} {kind} from {made}, absorbed by {absorbed} (no NaN or Inf came of it; "
                       f"check what {absorbed} made of it)")
        else:
            out.append(f"{n} {kind} from {made} never reached the loss, a gradient, a parameter or a value "
                       "the program read (not harmful)")
    return out


def _steps_text(ranges: list) -> str:
    parts = [f"{a}" if a == b else f"{a}-{b}" for a, b in ranges[:6]]
    return ", ".join(parts) + (f" and {len(ranges) - 6} more ranges" if len(ranges) > 6 else "")


def scaler_line(scaler: dict | None) -> str | None:
    """One quiet line for the Inf/NaN gradients of steps a GradScaler skipped: routine overflow,
    never alerts (the monitor's ``grad_scaler_skips`` rule says when skipping is not routine)."""
    if not scaler or not scaler.get("events"):
        return None
    n = scaler["skipped_steps"]
    ops = ", ".join(_op_short(r["op"]) for r in scaler["by_op"][:3])
    return (f"{scaler['events']:,} Inf/NaN events in the gradients of {n:,} step{'s' if n != 1 else ''} a GradScaler "
            f"skipped (steps {_steps_text(scaler['ranges'])}; first #{scaler['first_seq']}, {ops}): discarded "
            "with the update, never reached the weights")


def build_report(run: Run, findings: list | None = None, ranks: dict | None = None) -> dict[str, Any]:
    """Everything ``trainguard report`` says about a run, as JSON-able data.

    For a run of several ranks the body is about ``run.rank``, and ``ranks`` (computed here
    unless given: :func:`ranks_report`) puts every rank's alerts side by side."""
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
    findings = [f if isinstance(f, dict) else f.to_dict() for f in (findings or [])]
    return {
        "run": str(run.path),
        "status": run.status,
        "meta": {k: meta.get(k) for k in ("mode", "buffer", "created", "ended", "argv", "torch", "trainguard",
                                           "exit_code", "error", "crash_step", "dropped", "writer_error", "lost",
                                           "record_errors", "ops_filter", "dtypes_filter", "executions", "recorded",
                                           "check_numerics", "check_numerics_stop", "compiled_graphs",
                                           "full_tensor_compiled", "backend", "native_unsure",
                                           "untraced_children", "guard_replay")},
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
        "damaged": run.damaged,
        "origin": origin_data,
        "compiled": compiled_summary(run),
        "intended": intended_lines(alerts.get("intended") or []),
        "scaler": scaler_line(alerts.get("scaler")),
        "scalars": {name: series[-1] for name, series in run.scalars().items()},
        "crash": script_outcome(meta),
        # causes first, each with the findings it explains folded under it ("symptoms")
        "findings": fold(with_outcome(meta, _with_graph(run, [f for f in findings if f.get("source") != GUARD_SOURCE]))),
        "guard": guard_report(run),
        "rank": getattr(run, "rank", None),
        "ranks": ranks if ranks is not None else ranks_report(run),
    }


# The source of the findings the guard stores, one per event (see trainguard.guard).
GUARD_SOURCE = "guard"


def guard_report(run: Run) -> dict[str, Any] | None:
    """The guard's settings and counters and its events, oldest first; None without a guard."""
    meta = run.meta.get("guard")
    events = [f["event"] for f in run.findings(source=GUARD_SOURCE) if isinstance(f.get("event"), dict)]
    if meta is None and not events:
        return None
    return {"meta": meta, "events": events}


def _with_graph(run: Run, findings: list[dict]) -> list[dict]:
    """The stored findings, the loss misuse a recording shows when none of them says it, and what
    only the job's ranks read together show (each rank's own diagnosis sees one rank)."""
    try:
        findings = findings + recording_findings(run, findings)
        if not any(f.get("kind") == "per_sample_broadcast" for f in findings):
            findings = findings + [f.to_dict() for f in per_sample_broadcast(Context(run, Thresholds()))]
    except Exception:  # a damaged recording must not hide the report
        pass
    if isinstance(run, RankedRun):
        findings = findings + [f.to_dict() for f in replicas_not_synchronized(Context(run, Thresholds()))]
    return findings
