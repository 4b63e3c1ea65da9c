"""The data behind every view: plain JSON-able dicts read from a run, nothing about HTTP.

Each function takes the registry and a run id and answers one question the web app asks.
Expensive aggregates (the per-step timeline, op counts) are cached per run and recomputed when
the run's ``last_flush`` changes, so a run that is still being written stays current.
"""

from __future__ import annotations

import bisect
import itertools
import json
from pathlib import Path
from typing import Any

from trainguard.store import to_plain_json
from trainguard.ui._optional import call
from trainguard.ui._registry import BadRequest, Registry, RunHandle

# The largest page of digests one request may ask for: a list pane shows a few dozen rows.
MAX_PAGE = 1000
# Consumers listed in the graph pane; an op feeding more is rare and the rest are counted.
MAX_CONSUMERS = 50
# Doctor results stored beside the database rather than inside it, and the checkpoint folder.
DOCTOR_DIR = "doctor"
CHECKPOINT_DIR = "checkpoints"
_FILTERS = ("step", "op", "module", "phase", "health")


def revision(h: RunHandle) -> str:
    m = h.run.meta
    return f"{m.get('status', 'unknown')}@{m.get('last_flush', m.get('created', 0))}"


def cached(h: RunHandle, key: str, compute):
    """``compute()`` once per revision of the run."""
    rev = revision(h)
    hit = h.cache.get(key)
    if hit is not None and hit[0] == rev:
        return hit[1]
    value = compute()
    h.cache[key] = (rev, value)
    return value


def refresh(h: RunHandle) -> None:
    # meta is re-read at most once per request batch; a finished run never changes.
    if h.run.meta.get("status") != "finished":
        h.run.refresh()


# ---------------------------------------------------------------------- runs
def list_runs(reg: Registry) -> dict[str, Any]:
    out = []
    for rid, path in reg.scan().items():
        item: dict[str, Any] = {"id": rid, "name": path.name, "path": _rel(reg.root, path)}
        try:
            h = reg.handle(rid)
            with h.lock:
                refresh(h)
                m = h.run.meta
                item.update(
                    ok=True,
                    status=h.run.status,
                    mode=h.run.mode,
                    created=m.get("created"),
                    ended=m.get("ended"),
                    ranks=h.run.ranks,
                    executions=h.run.count(),
                    nonfinite=h.run.alerts()["total"],
                    scalars=len(h.run.scalar_names()),
                )
        except Exception as exc:  # one damaged run must not hide the others
            item.update(ok=False, status="damaged", error=_message(exc))
        out.append(item)
    return {"logdir": str(reg.root), "runs": to_plain_json(out)}


def _rel(root: Path, path: Path) -> str:
    rel = path.relative_to(root).as_posix()
    return "" if rel == "." else rel


def _message(exc: Exception) -> str:
    return str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)


def summary(reg: Registry, rid: str, rank: int | None = None) -> dict[str, Any]:
    h = reg.handle(rid, rank)
    with h.lock:
        refresh(h)
        run = h.run
        timeline = _steps(h)
        has = cached(h, "has", lambda: _has(h))
        total = run.count()
        first = timeline[0]["first"] if timeline else None
        last = timeline[-1]["last"] if timeline else None
        meta = {k: v for k, v in run.meta.items() if k not in ("argv",)}
        meta["argv"] = run.meta.get("argv")
        return to_plain_json(
            {
                "id": rid,
                "name": h.path.name,
                "path": _rel(reg.root, h.path),
                "status": run.status,
                "mode": run.mode,
                "rank": rank,
                "ranks": run.ranks,
                "revision": revision(h),
                "executions": total,
                "first_seq": first,
                "last_seq": last,
                "steps": len(timeline),
                "nonfinite": sum(s["nonfinite"] for s in timeline),
                "dropped": run.meta.get("dropped", 0),
                "has": has,
                "meta": meta,
            }
        )


def _has(h: RunHandle) -> dict[str, bool]:
    run = h.run
    ckpt = h.path / CHECKPOINT_DIR
    return {
        "executions": run.count() > 0,
        "scalars": bool(run.scalar_names()),
        "layer_stats": bool(run.layers()),
        "findings": bool(run.findings()),
        "artifacts": bool(run.artifacts()) or (h.path / DOCTOR_DIR).is_dir(),
        "checkpoints": ckpt.is_dir() and not ckpt.is_symlink(),
        "sources": bool(run.source_files()),
    }


def _steps(h: RunHandle) -> list[dict]:
    return cached(h, "steps", h.run.steps)


# ---------------------------------------------------------------------- debugger
def alerts(reg: Registry, rid: str, rank: int | None = None) -> dict[str, Any]:
    h = reg.handle(rid, rank)
    with h.lock:
        refresh(h)
        return to_plain_json(cached(h, "alerts", h.run.alerts))


def ranks(reg: Registry, rid: str) -> dict[str, Any]:
    """Every rank's alerts side by side and which rank made the first non-finite value (from the
    analysis); unavailable, saying why, for a run of one process."""
    h = reg.handle(rid)
    with h.lock:
        refresh(h)
        if len(h.run.ranks) < 2:
            return {"available": False, "reason": "this run was written by one process", "result": None}
        return cached(h, "ranks", lambda: call("trainguard.analysis", "ranks_report", h.run))


def origin(reg: Registry, rid: str, seq: int | None = None, rank: int | None = None) -> dict[str, Any]:
    """The walk back from where the first harmful value became harmful (or from ``seq``) to
    where it was made (from the analysis)."""
    h = reg.handle(rid, rank)
    with h.lock:
        refresh(h)
        first = h.run.first_harm() if seq is None else None
        if seq is None and first is None:
            return {"available": False, "reason": "no execution in this run holds a harmful NaN or Inf",
                    "result": None}
        target = seq if seq is not None else first["seq"]
        # seq None: the analysis starts where the first harmful value became harmful, and says how
        ans = call("trainguard.analysis", "origin", h.run, seq)
        ans.setdefault("result", None)
        chain = (ans["result"] or {}).get("chain") if isinstance(ans["result"], dict) else None
        if seq is None and chain:
            target = chain[0]["seq"]  # where harm reached training, when the first NaN reached nothing
        ans["seq"] = target
        return ans


def timeline(reg: Registry, rid: str, rank: int | None = None) -> dict[str, Any]:
    h = reg.handle(rid, rank)
    with h.lock:
        refresh(h)
        steps = _steps(h)
        return {
            "total": sum(s["count"] for s in steps),
            "steps": [[s["step"], s["first"], s["last"], s["count"], s["nonfinite"]] for s in steps],
            "columns": ["step", "first", "last", "count", "nonfinite"],
        }


def _filters(params: dict[str, Any]) -> dict[str, Any]:
    f = {k: params[k] for k in _FILTERS if params.get(k) not in (None, "")}
    if "step" in f:
        f["step"] = _step_filter(f["step"])
    return f


def _step_filter(value: Any) -> Any:
    text = str(value)
    try:
        parts = [int(x) for x in text.split(":", 1)]
    except ValueError:
        raise BadRequest(f"step must be an integer or a range A:B, got {text!r}") from None
    if not all(0 <= x < 2**63 for x in parts):
        raise BadRequest(f"step must be between 0 and {2**63 - 1}, got {text!r}")
    return tuple(parts) if len(parts) == 2 else parts[0]


def executions(
    reg: Registry, rid: str, begin: int, end: int, rank: int | None = None, **params: Any
) -> dict[str, Any]:
    if begin < 0 or end < begin:
        raise BadRequest(f"need 0 <= begin <= end, got begin={begin}, end={end}")
    if end - begin > MAX_PAGE:
        raise BadRequest(f"a page holds at most {MAX_PAGE} executions, asked for {end - begin}")
    f = _filters(params)
    h = reg.handle(rid, rank)
    with h.lock:
        refresh(h)
        try:
            total = cached(h, "count:" + json.dumps(f, sort_keys=True), lambda: h.run.count(**f))
            end = min(end, total)
            if begin >= total:
                items = []
            elif not f and _in_step_order(h):
                items = _page_by_steps(h, begin, end)
            else:
                items = h.run.executions(begin, end, **f)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        return to_plain_json({"begin": begin, "end": begin + len(items), "total": total, "items": items})


def _in_step_order(h: RunHandle) -> bool:
    """Whether each step's executions are contiguous in sequence order (steps never go back)."""
    steps = _steps(h)
    return cached(h, "step_order", lambda: all(a["last"] < b["first"] for a, b in zip(steps, steps[1:])))


def _page_by_steps(h: RunHandle, begin: int, end: int) -> list[dict]:
    """Rows ``begin:end`` through the step index instead of an OFFSET walk over every row.

    SQLite answers ``LIMIT n OFFSET k`` by stepping over k rows: ~40 ms at a million. The cached
    per-step counts say which steps hold those rows, and the step index finds them directly.
    """
    steps = _steps(h)
    starts = cached(h, "step_starts", lambda: list(itertools.accumulate((s["count"] for s in steps), initial=0)))
    i = bisect.bisect_right(starts, begin) - 1
    j = bisect.bisect_right(starts, end - 1) - 1
    if i < 0 or j >= len(steps):
        return h.run.executions(begin, end)
    offset = begin - starts[i]
    return h.run.executions(offset, offset + (end - begin), step=(steps[i]["step"], steps[j]["step"]))


def position(reg: Registry, rid: str, seq: int, rank: int | None = None, **params: Any) -> dict[str, Any]:
    """Where execution ``seq`` sits in the (filtered) list: the row to scroll to."""
    f = _filters(params)
    h = reg.handle(rid, rank)
    with h.lock:
        refresh(h)
        try:
            return {"seq": seq, "index": _position(h, seq, f)}
        except ValueError as exc:
            raise BadRequest(str(exc)) from None


def _position(h: RunHandle, seq: int, f: dict[str, Any]) -> int:
    if not f:
        steps = _steps(h)
        if steps:
            first, last = steps[0]["first"], steps[-1]["last"]
            if last - first + 1 == sum(s["count"] for s in steps):
                # Dense sequence numbers (nothing evicted): the row is an offset, no count needed.
                return min(max(seq - first, 0), last - first + 1)
    return h.run.index_of(seq, **f)


def execution(reg: Registry, rid: str, seq: int, rank: int | None = None) -> dict[str, Any]:
    """One execution in full, with what the graph, stack and source panes need."""
    h = reg.handle(rid, rank)
    with h.lock:
        refresh(h)
        run = h.run
        d = run.execution(seq)  # KeyError -> 404
        consumers = run.consumers(seq, limit=MAX_CONSUMERS + 1)
        d["consumers"] = consumers[:MAX_CONSUMERS]
        d["more_consumers"] = len(consumers) > MAX_CONSUMERS
        d["user_frame"] = run.user_frame(d["stack_id"])
        d["index"] = _position(h, seq, {})
        if d.get("fwd_seq") is not None:
            try:
                fwd = run.execution(d["fwd_seq"])
                d["forward"] = {k: fwd[k] for k in ("seq", "op", "module", "step", "phase")}
            except KeyError:
                d["forward"] = None
        return to_plain_json(d)


def stack(reg: Registry, rid: str, stack_id: int, rank: int | None = None) -> dict[str, Any]:
    h = reg.handle(rid, rank)
    with h.lock:
        frames = h.run.stack(stack_id)
        if not frames:
            raise KeyError(f"no stack {stack_id} in this run")
        return {"stack_id": stack_id, "frames": frames}


def sources(reg: Registry, rid: str, rank: int | None = None) -> dict[str, Any]:
    h = reg.handle(rid, rank)
    with h.lock:
        return {"files": h.run.source_files()}


def source(reg: Registry, rid: str, file_id: int, rank: int | None = None) -> dict[str, Any]:
    """A source file as stored in the run when it was recorded; never read from disk."""
    h = reg.handle(rid, rank)
    with h.lock:
        info = next((f for f in h.run.source_files() if f["file_id"] == file_id), None)
        if info is None:
            raise KeyError(f"no source file {file_id} stored in this run")
        text = h.run.source(file_id)  # KeyError when it was unreadable at record time
        return {
            "file_id": file_id,
            "path": info["path"],
            "user": info["user"],
            "text": text,
            "lines": text.count("\n") + (0 if text.endswith("\n") else 1),
        }


def ops(reg: Registry, rid: str, rank: int | None = None) -> dict[str, Any]:
    h = reg.handle(rid, rank)
    with h.lock:
        refresh(h)
        return {"ops": cached(h, "ops", h.run.op_counts)}
