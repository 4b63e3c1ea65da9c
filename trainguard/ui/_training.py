"""The data behind the training view: scalars, layer statistics, findings, doctor, checkpoints."""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path
from typing import Any

from trainguard.store import REPLAYS_DIR, to_plain_json
from trainguard.ui._optional import call, jsonable, lookup
from trainguard.ui._provider import CHECKPOINT_DIR, DOCTOR_DIR, cached, refresh
from trainguard.ui._registry import Registry, RunHandle, safe_file

# The source of the findings the guard stores, one per event (see trainguard.guard).
GUARD_SOURCE = "guard"

# A scalar series longer than this is reduced to per-bucket min and max: a chart is a few
# thousand pixels wide, and a 100k-step run must still draw at once.
MAX_POINTS = 4000


def scalars(reg: Registry, rid: str, rank: int | None = None, max_points: int = MAX_POINTS) -> dict[str, Any]:
    h = reg.handle(rid, rank)
    with h.lock:
        refresh(h)
        series = h.run.scalars()
    out = {}
    for name, points in series.items():
        out[name] = {
            "points": _reduce(points, max_points),
            "count": len(points),
            "nonfinite": sum(1 for _, v in points if not math.isfinite(v)),
        }
    return to_plain_json({"names": sorted(series), "series": out})


def _reduce(points: list[tuple[int, float]], max_points: int) -> list[list]:
    """Keep a long series drawable: per bucket its min and max, and every non-finite point."""
    if len(points) <= max_points:
        return [[s, v] for s, v in points]
    size = math.ceil(len(points) / (max_points // 2))
    out: list[list] = []
    for i in range(0, len(points), size):
        bucket = points[i : i + size]
        finite = [p for p in bucket if math.isfinite(p[1])]
        keep = {id(p): p for p in bucket if not math.isfinite(p[1])}
        if finite:
            lo = min(finite, key=lambda p: p[1])
            hi = max(finite, key=lambda p: p[1])
            keep[id(lo)] = lo
            keep[id(hi)] = hi
        out.extend([s, v] for s, v in sorted(keep.values(), key=lambda p: p[0]))
    return out


def layer_stats(
    reg: Registry, rid: str, kind: str | None = None, stat: str | None = None, rank: int | None = None
) -> dict[str, Any]:
    """A layer-by-step matrix of one statistic, and which statistics the run has."""
    h = reg.handle(rid, rank)
    with h.lock:
        refresh(h)
        layers = cached(h, "layers", h.run.layers)
        available = _layer_kinds(h, layers)
        if not available:
            return {"available": [], "kind": None, "stat": None, "layers": [], "steps": [], "values": []}
        if kind is None or stat is None:
            kind, stat = _default_stat(available)
        if [kind, stat] not in available:
            raise KeyError(f"no layer statistic {kind}/{stat} in this run; available: {available}")
        rows = h.run.layer_stats(kind=kind, stat=stat)
    steps = sorted({r["step"] for r in rows})
    col = {s: i for i, s in enumerate(steps)}
    names = [la for la in layers if any(r["layer"] == la for r in rows)] if len(layers) < 500 else layers
    row_of = {la: i for i, la in enumerate(names)}
    values: list[list[Any]] = [[None] * len(steps) for _ in names]
    for r in rows:
        i = row_of.get(r["layer"])
        if i is not None:
            values[i][col[r["step"]]] = r["value"]
    return to_plain_json(
        {
            "available": available,
            "kind": kind,
            "stat": stat,
            "layers": names,
            "steps": steps,
            "values": values,
        }
    )


def _layer_kinds(h: RunHandle, layers: list[str]) -> list[list[str]]:
    """(kind, stat) pairs recorded for any layer: inputs, activations and parameters differ.

    Read once per set of layers rather than per revision: a monitor records the same statistics
    at every step, so only a new layer can bring a new pair.
    """
    key = "layer_kinds:" + "\x00".join(layers)
    hit = h.cache.get("layer_kinds")
    if hit is not None and hit[0] == key:
        return hit[1]
    seen: dict[tuple[str, str], None] = {}
    for layer in layers:
        for r in h.run.layer_stats(layer=layer):
            seen.setdefault((r["kind"], r["stat"]), None)
    value = [list(k) for k in seen]
    h.cache["layer_kinds"] = (key, value)
    return value


# The statistic the heatmap opens on: gradient flow is what the lesson reads first.
_PREFERRED_STATS = [
    ("gradient", "mean_abs"),
    ("gradient", "norm"),
    ("activation", "zero_frac"),
    ("activation", "mean"),
    ("activation", "std"),
]


def _default_stat(available: list[list[str]]) -> tuple[str, str]:
    for k, s in _PREFERRED_STATS:
        if [k, s] in available:
            return k, s
    return available[0][0], available[0][1]


def findings(reg: Registry, rid: str, rank: int | None = None) -> dict[str, Any]:
    """Stored findings (monitor, doctor) and the analysis' diagnosis, with a one-line verdict."""
    h = reg.handle(rid, rank)
    with h.lock:
        refresh(h)
        stored = h.run.findings()
        # The diagnosis reads every scalar and layer statistic: once per revision of the run.
        diag = cached(h, "diagnose", lambda: call("trainguard.analysis", "diagnose", h.run))
        has_scalars = bool(h.run.scalar_names())
    items = [dict(f, origin="stored") for f in jsonable(stored)]
    # The guard's events have a card of their own; they still count for the verdict.
    guard_items = [f for f in items if f.get("source") == GUARD_SOURCE]
    items = [f for f in items if f.get("source") != GUARD_SOURCE]
    if diag["available"]:
        result = diag["result"]
        if isinstance(result, dict):
            result = result.get("findings", [])
        seen = {(f.get("kind"), f.get("title")) for f in items}
        for f in result if isinstance(result, list) else []:
            if isinstance(f, dict) and (f.get("kind"), f.get("title")) not in seen:
                items.append(dict(f, origin="diagnosis"))
    if any(f.get("kind") == "script_crashed" for f in items):  # a crashed run is never healthy
        items = [f for f in items if f.get("kind") != "healthy"]
    order = {"critical": 0, "error": 1, "warning": 2, "info": 3}
    items.sort(key=lambda f: (order.get(f.get("severity"), 4), _first_step(f)))
    judged = sorted(items + guard_items, key=lambda f: (order.get(f.get("severity"), 4), _first_step(f)))
    fold = lookup("trainguard.analysis._causes", "fold")
    if fold is not None:
        items = fold(items)  # causes first, the findings they explain nested under "symptoms"
    return to_plain_json(
        {
            "findings": items,
            "verdict": _verdict(judged, has_scalars),
            "diagnosis": {"available": diag["available"], "reason": diag.get("reason")},
        }
    )


def _first_step(f: dict) -> int:
    steps = f.get("steps")
    return steps[0] if isinstance(steps, list) and steps and isinstance(steps[0], int) else -1


def _verdict(items: list[dict], has_scalars: bool) -> dict[str, Any]:
    problems = [f for f in items if f.get("severity") in ("warning", "error", "critical")]
    if problems:
        worst = problems[0]
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        return {
            "state": worst["severity"],
            "text": f"{worst.get('title', worst.get('kind'))}{more}",
            "problems": len(problems),
        }
    healthy = next((f for f in items if f.get("kind") == "healthy"), None)
    if healthy is not None:
        return {"state": "healthy", "text": healthy.get("title") or "no problem found", "problems": 0}
    if items:  # only notes, e.g. too few steps to judge: no verdict either way
        return {"state": "unknown", "text": items[0].get("title") or items[0].get("kind", ""), "problems": 0}
    if has_scalars:
        return {"state": "unknown", "text": "no diagnosis stored in this run", "problems": 0}
    return {"state": "none", "text": "this run holds no training data", "problems": 0}


def artifacts(reg: Registry, rid: str, rank: int | None = None) -> dict[str, Any]:
    h = reg.handle(rid, rank)
    with h.lock:
        items = [dict(a, stored="database") for a in h.run.artifacts()]
    names = {a["name"] for a in items}
    for name, size in _doctor_files(h.path):
        if name not in names:
            items.append(
                {
                    "name": name,
                    "media_type": _media_type(name),
                    "size": size,
                    "created": None,
                    "stored": "file",
                }
            )
    return to_plain_json({"artifacts": items})


def _doctor_files(run_dir: Path) -> list[tuple[str, int]]:
    d = run_dir / DOCTOR_DIR
    if not d.is_dir() or d.is_symlink():
        return []
    out = []
    for p in sorted(d.iterdir()):
        if p.is_file() and not p.is_symlink():
            out.append((f"{DOCTOR_DIR}/{p.name}", p.stat().st_size))
    return out


# Files beside the database: the types the doctor writes (the routes serve anything else as bytes).
_MEDIA = {".png": "image/png", ".json": "application/json", ".csv": "text/csv", ".txt": "text/plain"}


def _media_type(name: str) -> str:
    return _MEDIA.get(Path(name).suffix.lower(), "application/octet-stream")


def artifact(reg: Registry, rid: str, name: str, rank: int | None = None) -> tuple[str, bytes]:
    """An artifact's bytes: from the database, else a plain file inside the run directory."""
    h = reg.handle(rid, rank)
    with h.lock:
        try:
            return h.run.artifact(name)
        except KeyError:
            pass
    path = safe_file(h.path, name)  # PathRefused for traversal and symlinks
    if path.name.startswith("run.sqlite"):
        raise KeyError(f"no artifact {name!r} in this run")
    return _media_type(name), path.read_bytes()


def doctor(reg: Registry, rid: str, rank: int | None = None) -> dict[str, Any]:
    """The doctor's report, LR range test curve and plot, from the database or ``doctor/``."""

    def read(name: str) -> bytes | None:
        try:
            return artifact(reg, rid, name, rank)[1]
        except KeyError:
            return None

    report_raw = read(f"{DOCTOR_DIR}/report.json")
    csv_raw = read(f"{DOCTOR_DIR}/lr_range_test.csv")
    has_png = read(f"{DOCTOR_DIR}/lr_range_test.png") is not None
    report = None
    if report_raw is not None:
        try:
            report = json.loads(report_raw)
        except ValueError:
            report = {"error": "doctor/report.json is not valid JSON"}
    lr = _lr_curve(csv_raw) if csv_raw is not None else None
    suggestion = _find_key(report, "suggestion") if report else None
    return to_plain_json(
        {
            "report": report,
            "lr_range": lr,
            "lr_suggestion": suggestion if isinstance(suggestion, (int, float)) else None,
            "lr_plot": f"{DOCTOR_DIR}/lr_range_test.png" if has_png else None,
        }
    )


def _lr_curve(raw: bytes) -> dict[str, Any] | None:
    rows = list(csv.reader(io.StringIO(raw.decode("utf-8", "replace"))))
    if len(rows) < 2:
        return None
    head = [c.strip().lower() for c in rows[0]]
    lr_col = next((i for i, c in enumerate(head) if c in ("lr", "learning_rate")), 0)
    loss_cols = [i for i, c in enumerate(head) if "loss" in c and i != lr_col]
    out: dict[str, Any] = {"columns": [head[i] for i in loss_cols], "lr": [], "loss": [[] for _ in loss_cols]}
    for r in rows[1:]:
        try:
            out["lr"].append(float(r[lr_col]))
            for j, i in enumerate(loss_cols):
                out["loss"][j].append(float(r[i]))
        except (ValueError, IndexError):
            continue
    return out if out["lr"] else None


def _find_key(obj: Any, key: str, depth: int = 0) -> Any:
    """The first value under ``key`` anywhere in a nested report (its layout is the doctor's)."""
    if depth > 6:
        return None
    if isinstance(obj, dict):
        if key in obj and not isinstance(obj[key], (dict, list)):
            return obj[key]
        for v in obj.values():
            found = _find_key(v, key, depth + 1)
            if found is not None:
                return found
    if isinstance(obj, list):
        for v in obj:
            found = _find_key(v, key, depth + 1)
            if found is not None:
                return found
    return None


def checkpoints(reg: Registry, rid: str, rank: int | None = None) -> dict[str, Any]:
    h = reg.handle(rid, rank)
    d = h.path / CHECKPOINT_DIR
    if not d.is_dir() or d.is_symlink():
        return {"available": False, "reason": "this run has no checkpoints/ folder", "checkpoints": []}
    ans = call("trainguard.resilience", "list_checkpoints", d)
    if not ans["available"]:
        return {"available": False, "reason": ans["reason"], "checkpoints": []}
    items = ans["result"] if isinstance(ans["result"], list) else []
    return to_plain_json({"available": True, "reason": None, "checkpoints": items})


def guard(reg: Registry, rid: str, rank: int | None = None) -> dict[str, Any]:
    """The guard's settings and events, each with the id of the run that recorded its replay."""
    h = reg.handle(rid, rank)
    with h.lock:
        refresh(h)
        meta = h.run.meta.get("guard")
        events = [f["event"] for f in h.run.findings(source=GUARD_SOURCE) if isinstance(f.get("event"), dict)]
    ids = {path.resolve(): i for i, path in reg.scan().items()}
    for e in events:
        rel = (e.get("replay") or {}).get("run")
        e["replay_run_id"] = None
        if isinstance(rel, str) and rel.split("/", 1)[0] == REPLAYS_DIR and ".." not in rel.split("/"):
            e["replay_run_id"] = ids.get((h.path / rel).resolve())
    return to_plain_json({"available": meta is not None or bool(events), "meta": meta, "events": events})
