"""Which rank made the first harmful non-finite value, and which ranks only received it.

Under data-parallel training a NaN that one rank's batch makes reaches every other rank through
the gradient all-reduce, within the same step. Each rank's own walk back (:func:`origin`) ends
at the origin of its first harmful value: on the rank that made it, at the op that made it; on a
rank that received it, at the first op that read what a collective wrote (the collective's own
output is never read when it returns: its values arrive later). So a rank *received* its first
harmful value when that op's input was written by a collective, and *made* it otherwise. The
first rank is the one that made it earliest: by step, then rank (ranks share no clock, the
steps are the order they agree on). Pure functions over a reader.
"""

from __future__ import annotations

from typing import Any

from trainguard.analysis._origin import origin, received_input
from trainguard.store import RankedRun, Run
from trainguard.store._ranks import is_collective

# What users call a collective, by the op's base name (``c10d.allreduce_`` -> ``allreduce_``).
_COLLECTIVE_WORDS = {
    "allreduce": "all-reduce", "all_reduce": "all-reduce", "broadcast": "broadcast",
    "allgather": "all-gather", "all_gather": "all-gather", "reduce_scatter": "reduce-scatter",
    "alltoall": "all-to-all", "all_to_all": "all-to-all", "recv": "receive", "scatter": "scatter",
    "gather": "gather", "reduce": "reduce",
}


def collective_words(op: str, phase: str | None) -> str:
    """``c10d.allreduce_`` in the backward pass -> ``the gradient all-reduce``."""
    base = op.split(".")[1] if "." in op else op
    base = base.strip("_").replace("_into_tensor", "").replace("_coalesced", "").replace("_base", "")
    word = next((w for key, w in _COLLECTIVE_WORDS.items() if base.startswith(key)), base)
    if phase == "backward" and word in ("all-reduce", "reduce-scatter"):
        return f"the gradient {word}"
    return f"an {word}" if word[0] in "aeiou" else f"a {word}"


def _received_via(run: Run, link: Any) -> dict | None:
    """The collective that wrote an input of ``link``, the op where a rank's first harmful value
    appeared; None when the rank made the value itself."""
    inp = received_input(link)
    if inp is None:
        return None
    try:
        d = run.execution(inp["producer"])
    except KeyError:  # evicted by the circular buffer
        d = {"seq": inp["producer"], "op": inp["producer_op"], "step": None, "phase": None}
    return {"op": d["op"], "seq": d["seq"], "step": d["step"], "phase": d["phase"],
            "words": collective_words(d["op"], d["phase"])}


# How many harmful executions after a rank's first one to look through for a received value.
_SCAN = 256


def _received_before_use(run: Run, made: int) -> int | None:
    """The first harmful value this rank received through a collective while the one it made
    itself (execution ``made``) was still unread, if any. Every rank of a DDP job loads the whole
    data set, a corrupt row included, but only the rank whose batch holds the row reads it; the
    others' copies do nothing, and their first harmful value that mattered came from that rank."""
    used = [c["seq"] for c in run.consumers(made, limit=1)]
    for d in run.executions(0, _SCAN, health="harmful"):
        if d["seq"] <= made:
            continue
        if d["origin"] == made or (used and d["seq"] >= used[0]):
            return None  # this rank read what it made first
        if d["origin"] in (None, d["seq"]):  # a new harmful value: received, or made again
            o = origin(run, seq=d["seq"])
            return d["seq"] if o is not None and received_input(o.origin) is not None else None
    return None


def _first(run: Run) -> dict | None:
    """Where this rank's first harmful value was made (the origin :func:`origin` walks back to,
    and the collective it came through). Uninitialised memory, DDP's gradient buckets before
    their first all-reduce, is unknown, never harmful: it can be no rank's first."""
    o = origin(run)
    if o is None:
        return None
    link = o.origin
    via = _received_via(run, link)
    if via is None and (seq := _received_before_use(run, link.seq)) is not None:
        o = origin(run, seq=seq) or o
        link = o.origin
        via = _received_via(run, link)
    return {"seq": link.seq, "step": link.step, "phase": link.phase, "op": link.op, "module": link.module,
            "file": link.file, "line": link.line, "health": list(link.health),
            "received_via": via, "summary": o.summary}


def _what(health: list[str]) -> str:
    names = {"nan": "NaN", "+inf": "+inf", "-inf": "-inf", "inf": "inf"}
    return "/".join(names.get(h, h) for h in health) or "non-finite value"


def ranks_report(run: Run) -> dict | None:
    """Per-rank alerts side by side and which rank went non-finite first; None for one rank.

    ``first_rank`` made the first harmful value (``made``: every rank that made one itself),
    ``received``: the ranks whose first harmful value came to them through a collective;
    ``headline`` says it in one sentence. When no rank recorded a harmful value but the ranks ran
    the guard (whose replays are runs of their own), ``first_rank`` and ``headline`` are the guard's
    first event's; without either, when ranks crashed,
    those of the rank that stopped the job.
    """
    if not isinstance(run, RankedRun) or len(run.ranks) < 2:
        return None
    per_rank = []
    for k, r in run.rank_runs().items():
        alerts = r.alerts()
        per_rank.append({"rank": k, "status": r.status, "executions": r.count(), "alerts": alerts,
                         "first": _first(r) if alerts["total"] else None})
    made = sorted((p for p in per_rank if p["first"] and not p["first"]["received_via"]),
                  key=lambda p: (p["first"]["step"], p["rank"]))
    received = [p for p in per_rank if p["first"] and p["first"]["received_via"]]
    first_rank, headline = (made[0]["rank"] if made else None), _headline(made, received)
    if headline is None:  # nothing recorded went non-finite: the guard's runs record no op
        first_rank, headline = _guarded(run)
    if headline is None:
        first_rank, headline = _stopped(run)
    return {
        "ranks": list(run.ranks),
        "per_rank": per_rank,
        "first_rank": first_rank,
        "made": [p["rank"] for p in made],
        "received": [p["rank"] for p in received],
        "headline": headline,
    }


def _stopped(run: RankedRun) -> tuple[int | None, str | None]:
    """(the rank, the sentence) of the rank that stopped a failed job: the one whose run never
    ended (killed: ``kill -9``, the OOM killer) when another rank's did, else the one whose script
    crashed first (``ended_at``, as the launcher reads it). The others' errors are mostly their
    collectives losing that rank (gloo's "Connection closed by peer")."""
    runs = run.rank_runs()
    crashed = {k: r.meta for k, r in runs.items() if r.status == "crashed"}
    gone = [k for k, r in runs.items() if r.status == "running"]
    if not crashed:
        return _hung(runs) if len(gone) == len(runs) else (None, None)
    first = min(crashed, key=lambda k: (crashed[k].get("ended_at") or float("inf"), k))

    def crash(k: int) -> str:
        step = crashed[k].get("crash_step")
        return (f" in step {step}" if isinstance(step, int) else "") + f": {crashed[k].get('error') or 'an error'}"

    if gone:
        whose = ", ".join(str(k) for k in gone)
        return gone[0], (f"rank{'s' if len(gone) > 1 else ''} {whose}'s run never ended (its process was killed, "
                         f"or is still running); rank {first} crashed{crash(first)}")
    text = f"rank {first} crashed first,{crash(first)}"
    if len(crashed) > 1:
        others = [k for k in crashed if k != first]
        text += f"; rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))} crashed after it"
    return first, text


def _last_op(r: Run) -> dict | None:
    n = r.count()
    last = r.executions(n - 1, n) if n else []
    return last[0] if last else None


def _hung(runs: dict[int, Run]) -> tuple[int | None, str | None]:
    """(the rank, the sentence) when no rank's run ended: the ranks whose last recorded op is a
    collective wait in it for the ranks whose last op is not, which never reached it (a hang
    before the step's all-reduce; or the job is still running, and this is where it is now)."""
    last = {k: _last_op(r) for k, r in runs.items()}
    waiting = [k for k, d in last.items() if d and is_collective(d["op"])]
    stuck = [k for k, d in last.items() if d and not is_collective(d["op"])]
    if not waiting or not stuck:
        return None, None
    w, k = last[waiting[0]], last[stuck[0]]
    frame = runs[stuck[0]].user_frame(k.get("stack_id")) or {}
    where = f" at {frame['filename']}:{frame['lineno']}" if frame.get("filename") else ""
    who = f"rank{'s' if len(waiting) > 1 else ''} {', '.join(map(str, waiting))} wait{'' if len(waiting) > 1 else 's'}"
    never = f"rank{'s' if len(stuck) > 1 else ''} {', '.join(map(str, stuck))} never reached"
    return stuck[0], (f"no rank's run ended (the job was killed, or is still running): {who} in {w['op']} "
                      f"(step {w['step']}), which {never}: its last op was {k['op']}{where} (step {k['step']})")


_TRIGGERS = {"nonfinite_loss": "a non-finite loss", "nonfinite_grad": "non-finite gradients", "spike": "a loss spike"}


def _guarded(run: RankedRun) -> tuple[int | None, str | None]:
    """(the rank, the sentence) of the guard's first event in a job whose ranks ran it: every rank
    stores the same event, with the rank whose fault its replay traced (``origin_rank``)."""
    from trainguard.analysis._report import guard_report  # _report imports this module

    g = guard_report(run)
    events = [e for e in (g or {}).get("events", []) if isinstance(e.get("step"), int)]
    if not events:
        return None, None
    e = min(events, key=lambda e: e["step"])
    rank = e.get("origin_rank") if e.get("origin_rank") in run.ranks else None
    on = f" on rank {rank}" if rank is not None else ""
    text = f"the guard caught {_TRIGGERS.get(e.get('trigger'), 'a fault')}{on} in step {e['step']}"
    o = (e.get("origin") or {}).get("origin") or {}
    if o.get("op"):
        where = f" at {o['file']}:{o['line']}" if o.get("file") else ""
        text += f": {o['op']}{where} ({o.get('phase')} pass)"
    return rank, text


def _headline(made: list[dict], received: list[dict]) -> str | None:
    if not made and not received:
        return None
    parts = []
    if made:
        f = made[0]["first"]
        where = f" at {f['file']}:{f['line']}" if f.get("file") else ""
        parts.append(f"rank {made[0]['rank']} first made a {_what(f['health'])} in step {f['step']}: "
                     f"{f['op']}{where} ({f['phase']} pass)")
        for p in made[1:]:
            parts.append(f"rank {p['rank']} also made one, in step {p['first']['step']}")
    else:
        parts.append("no recorded rank made the first non-finite value (it came from outside the recording)")
    if received:
        vias = {(p["first"]["received_via"]["words"], p["first"]["received_via"]["op"]) for p in received}
        how = "; ".join(f"{w} ({op})" for w, op in sorted(vias))
        ranks = ", ".join(str(p["rank"]) for p in received)
        steps = sorted({p["first"]["received_via"]["step"] for p in received if p["first"]["received_via"]["step"]
                        is not None})
        when = f" in step {steps[0]}" if len(steps) == 1 else ""
        parts.append(f"rank{'s' if len(received) > 1 else ''} {ranks} only received it, through {how}{when}")
    return "; ".join(parts)
