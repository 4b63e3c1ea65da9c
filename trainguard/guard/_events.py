"""What the guard tells: one line per event on the ``trainguard.guard`` logger, and the run.

Library code never prints. Each rewind is logged at WARNING on ``logging.getLogger(
"trainguard.guard")``; a program that configured no logging still sees it on stderr (Python's
last-resort handler prints warnings there), one that did gets it through its own handlers.

Each event is stored in the guard's run as a finding with ``source="guard"`` (kind
``guard_rewind``, or ``guard_stop`` when training stopped), its full record under ``event``,
once it is complete (a skip event once the loop has drawn the batches it skips);
the guard's settings and counters are the run's ``guard`` metadata. ``trainguard report`` and
the UI's training view list them.
"""

from __future__ import annotations

import logging
import math
import shutil
import time
from pathlib import Path
from typing import Any

from trainguard._errors import TrainguardError
from trainguard.analysis._origin import op_base
from trainguard.store import REPLAYS_DIR, acquire_writer, open_run, release_writer

log = logging.getLogger("trainguard.guard")

SOURCE = "guard"
# Event actions after which training does not go on.
STOPPED = ("stop", "code_bug", "max_rewinds")


def _num(v: float | None) -> str:
    if v is None:
        return "?"
    return "nan" if math.isnan(v) else ("inf" if v == math.inf else ("-inf" if v == -math.inf else f"{v:.4g}"))


def reason(trigger: str, loss: float | None, grad_norm: float | None, median: float | None,
           factor: float | None, ranks: list[int]) -> str:
    """``loss is nan``, ``gradient norm is inf``, ``loss 84.2 is 12x the median 6.8 of the last 100 steps``."""
    on = f" on rank {ranks[0]}" if ranks and (loss is None or math.isfinite(loss)) else ""
    if trigger == "nonfinite_loss":
        return f"loss is {_num(loss)}" if loss is not None and not math.isfinite(loss) else f"loss is non-finite{on}"
    if trigger == "nonfinite_grad":
        if grad_norm is not None and not math.isfinite(grad_norm):
            return f"gradient norm is {_num(grad_norm)}"
        return f"gradient norm is non-finite{on}"
    if loss is not None and median:
        return (f"loss {_num(loss)} is a spike ({loss / median:.3g}x the median {_num(median)} of the last steps, "
                f"above spike_factor {factor:g})")
    return f"loss spike{on}"


def batch_label(item: dict) -> str | None:
    """``60``, ``3 of epoch 1``, or None when the loader cannot say where the batch was (a user's
    iterable without ``batches_yielded``)."""
    if item.get("batch") is not None:
        return f"{item['batch']:,}"
    if item.get("index") is not None:
        return f"{item['index']} of epoch {item['epoch']}"
    return None


def _other_batch(event: dict) -> str:
    """`` (batch 61)`` when the failing step's batch number is not the step's (after a skip)."""
    b = event.get("batch") or {}
    return f" (batch {batch_label(b)})" if b and b.get("batch") is not None and b["batch"] != event["step"] else ""


def message(event: dict) -> str:
    """The one line of an event: what failed, where the guard went, what it found and did."""
    parts = [f"step {event['step']:,}{_other_batch(event)}: {event['reason']}"]
    if event.get("rewound_to") is not None:
        parts.append(f"rewound to step {event['rewound_to']:,}"
                     + (" (checkpoint)" if event.get("rewound_from") == "checkpoint" else ""))
    rp = event.get("replay") or {}
    if rp:
        text = "replayed"
        if rp.get("steps"):
            text += f" {rp['steps']} step{'s' if rp['steps'] != 1 else ''}"
            if rp.get("bitwise_equal") is True:
                text += " (losses bitwise equal)"
            elif rp.get("bitwise_equal") is False:
                text += f" (losses differ from step {rp['mismatch']['step']:,})"
        else:  # rewound to a checkpoint at the failing step: nothing ran again before it
            text += f" step {event['step']:,} alone, under recording"
        parts.append(text)
    if event.get("origin") is not None:
        from trainguard.guard._replay import origin_line

        parts.append(f"origin: {origin_line(event['origin'])}")
    parts.append(event["outcome"])
    return "; ".join(parts)


def _listed(word: str, items: list, limit: int = 8) -> str:
    """``sample 21`` / ``samples 13, 14`` (the first ``limit`` of them, then how many in all)."""
    shown = ", ".join(str(i) for i in items[:limit]) + (f" ... ({len(items)} in all)" if len(items) > limit else "")
    return f"{word}{'s' if len(items) > 1 else ''} {shown}"


def _bad_rows(b: dict) -> tuple[str, str]:
    """(``sample 192`` or ``row 1``, ``inf`` / ``nan and inf``) of a ``batch_nonfinite`` entry."""
    which = _listed("sample", b["samples"]) if b.get("samples") else _listed("row", b.get("rows") or [])
    return which, " and ".join(b.get("kinds") or ["non-finite values"])


def batch_text(event: dict) -> str:
    """`` (its sample 21 holds inf in the batch itself)``: the failing batch held NaN/Inf before
    any op ran (``Guard`` events' ``batch_nonfinite``), or nothing."""
    b = event.get("batch_nonfinite")
    if not b:
        return ""
    which, kinds = _bad_rows(b)
    items = b.get("samples") or b.get("rows")
    rank = f"rank {b['rank']}'s " if b.get("rank") is not None else ""  # another rank's batch
    if not items:  # a 0-d tensor
        return f" ({rank}batch{b['where']} holds {kinds} itself)"
    whose = rank or ("its " if b.get("samples") else "")
    of = "" if b.get("samples") else f" of batch{b['where']}"
    return f" ({whose}{which}{of} hold{'' if len(items) > 1 else 's'} {kinds} in the batch itself)"


def passed_on(link: dict, b: dict) -> str:
    """The origin's explanation when it read the batch and the batch itself held NaN/Inf (see
    :func:`batch_text`): the op passed the value on; no overflow or division made it."""
    which, kinds = _bad_rows(b)
    whose = "its " if b.get("samples") else ""
    of = "" if b.get("samples") else f" of batch{b['where']}"
    base = op_base(link["op"])
    return f"{base} received {kinds} from the batch itself ({whose}{which}{of} held {kinds} before any op ran) and passed it on"


def data_fix(b: dict) -> str:
    """The fix when the failing batch itself held NaN/Inf (see :func:`batch_text`)."""
    which, kinds = _bad_rows(b)
    on = f" on rank {b['rank']}" if b.get("rank") is not None else ""
    return (f"the batch itself held {kinds} before any op ran (batch{b['where']}, {which}{on}): the data is "
            "corrupt, not the training; repair or drop that sample (`trainguard doctor` validates a dataset's values), "
            "or filter non-finite samples out in the dataset or collate_fn; the guard skips such a batch each time")


# What an index out of range indexes, by the op that raised on it (see guard/_raising.py).
_INDEXES = {"F.cross_entropy": "classes", "F.nll_loss": "classes", "F.embedding": "embedding rows",
            "F.one_hot": "classes (num_classes)"}


def _index_values(ix: dict) -> str:
    values = ", ".join(str(v) for v in ix["values"]) + (" ..." if ix.get("distinct", 0) > len(ix["values"]) else "")
    return f"{ix.get('argument', 'index')} {values}"


def _index_range(op: str, ix: dict) -> str:
    """``out of range for 4 classes (0 to 3)``."""
    high = ix["range"][1]
    what = _INDEXES.get(op, "entries in that dimension")
    return f"out of range for {high} {what} (0 to {high - 1})"


def _index_samples(ix: dict, rank: int | None = None) -> str:
    """``its sample 70`` / ``row 9 of batch[1]`` / ``row 9 of the index``: where the bad entries are
    (``rank 1's sample 70``: another rank's batch)."""
    b = ix.get("in_batch") or {}
    whose = f"rank {rank}'s " if rank is not None else ""
    if b.get("samples"):
        return f"{whose or 'its '}{_listed('sample', b['samples'])}"
    if b.get("rows"):
        return f"{whose}{_listed('row', b['rows'])} of batch{b['where']}"
    return f"{whose}{_listed('row', ix['rows'])} of the {ix.get('argument', 'index')}" if ix.get("rows") else ""


def index_reason(raised: dict) -> str:
    """The reason of an event whose step raised on an index out of range: the error as torch said it."""
    where = f" at {_short(raised['file'])}:{raised['line']}" if raised.get("file") else ""
    return f"{raised['op']}{where} raised {raised['error'].rstrip('.')}"


def index_held(raised: dict) -> str:
    """``its sample 70 holds target 4``: which samples (or rows) hold the index out of range."""
    ix = raised["index"]
    which = _index_samples(ix, raised.get("rank"))
    many = len((ix.get("in_batch") or {}).get("samples") or (ix.get("in_batch") or {}).get("rows") or ix.get("rows") or []) > 1
    return f"{which} hold{'' if many else 's'} {_index_values(ix)}" if which else _index_values(ix)


def index_batch_text(event: dict) -> str:
    """`` (its sample 70 holds target 4)``, or nothing."""
    raised = event.get("raised") or {}
    return f" ({index_held(raised)})" if raised.get("index") else ""


def index_origin(raised: dict, step: int) -> dict:
    """The origin of an event whose step raised on an index out of range: the op that raised, at
    the user's line, as ``Origin.to_dict()`` holds it. The replay's recording has nothing to trace:
    no op made a NaN (the guard's stand-in for the result is not recorded), the index came in
    with the batch or was computed out of range."""
    from trainguard.analysis import Link, Origin

    ix, op = raised["index"], raised["op"]
    explanation = f"{_index_values(ix)} is {_index_range(op, ix)}"
    b = ix.get("in_batch") or {}
    what = ix.get("argument", "index")
    if op == "F.embedding":
        cover = "give the embedding as many rows as the data's ids need (the tokenizer's vocabulary size)"
    elif op in ("F.cross_entropy", "F.nll_loss", "F.one_hot"):
        cover = ("give the model as many classes as the labels need (`trainguard doctor`'s init checks report "
                 "labels_out_of_range)")
    else:
        cover = "make the indexed dimension cover every value"
    if b:
        which = f", {_listed('sample', b['samples'])}" if b.get("samples") else ""
        which += f" on rank {raised['rank']}" if raised.get("rank") is not None else ""
        one = len(b.get("samples") or b["rows"]) == 1
        fix = (f"the batch itself holds the {what} out of range (batch{b['where']}{which}): repair or drop "
               f"{'that sample' if one else 'those samples'}, or {cover}")
    else:
        fix = f"the step computed the {what} out of range from its batch: check how it is made, or {cover}"
    if op in ("F.cross_entropy", "F.nll_loss") and any(v % 255 == 0 and v for v in ix["values"]):
        fix += ("; a mask stored as 0/255 (an 8-bit PNG) holds 255 where class 1 is meant: map its values to class "
                "indices (`mask // 255`)")
    link = Link(seq=-1, op=op, step=step, phase="forward", module=None, health=[], file=raised.get("file"),
                line=raised.get("line"), function=None, explanation=explanation, taint="raised")
    summary = (f"{op} at {_short(raised.get('file'))}:{raised.get('line')} raised {raised['error']}: "
               f"{index_held(raised)}, {_index_range(op, ix)}")
    return Origin(chain=[link], summary=summary, suggestion=fix).to_dict()


def _short(path: str | None) -> str:
    from trainguard.guard._replay import short_path

    return short_path(path)


def culprits_text(event: dict) -> str:
    """`` (the first inf is in its sample 77)``: the samples whose rows of the origin's output
    the replay found its non-finite values in (``Guard`` events' ``culprits``), or nothing. Where,
    not why: the sample may hold bad data, or the code may fail on it (a random mask that left
    nothing in its row)."""
    c = event.get("culprits")
    if not c or not c.get("samples"):
        return ""
    health = ((event.get("origin") or {}).get("origin") or {}).get("health") or []
    kind = "nan" if "nan" in health else "inf"
    return f" (the first {kind} is in its {_listed('sample', c['samples'])}{_again(event)})"


def _again(event: dict) -> str:
    """``, as in event 1: ...``: the event blames a sample an earlier one blamed for the same fault."""
    r = event.get("repeat")
    return f", as in event {r['of']}: later batches holding it are skipped unread" if r else ""


def suspects_text(event: dict) -> str:
    """`` (its sample 29 spiked the loss, as in event 1: ...)``: an event with no culprit rows whose
    batch holds a sample an earlier event of the same fault had in its batch too (see
    ``Guard._note_suspects``), or nothing."""
    r = event.get("repeat")
    if not r:
        return ""
    did = "spiked the loss" if event.get("trigger") == "spike" else "failed the step"
    return f" (its {_listed('sample', r['samples'])} {did}{_again(event)})"


def outcome(event: dict) -> str:
    action = event["action"]
    if action == "skip":
        skipped = event.get("skipped") or []
        n = event.get("skip_count", len(skipped)) or 1
        first = batch_label(skipped[0]) if skipped else None
        if first is None:
            text = (f"skipped the batch of step {event['step']:,}" if n == 1
                    else f"skipped {n} batches from the batch of step {event['step']:,}")
        else:
            text = f"skipped batch {first}" if n == 1 else f"skipped {n} batches from batch {first}"
            text += batch_text(event) or index_batch_text(event) or culprits_text(event) or suspects_text(event)
        return text + (f"; {event['policy_note']}" if event.get("policy_note") else "")
    if action == "lower_lr":
        lrs = ", ".join(f"{v:.3g}" for v in event.get("lr") or [])
        text = f"lowered the learning rate x{event.get('lr_factor', 0.5)} (now {lrs})"
        start = event.get("retried_from")
        return text + (f" and retried from step {start:,}" if start is not None and start < event["step"] else "")
    if action == "continue":
        return "it did not reproduce in the replay (a transient fault?); training goes on"
    if action == "code_bug":
        if (event.get("raised") or {}).get("index"):
            return (f"stopped: the next batch raised the same way{index_batch_text(event)}, so the fault is the code's "
                    "or the whole data set's, not one sample's: check that the model's outputs cover the labels' "
                    "range (`trainguard doctor` checks a dataset's labels) (trainguard.Diverged)")
        return ("stopped: the next batch fails the same way, so the fault follows the code, not the data "
                "(trainguard.Diverged)")
    if action == "max_rewinds":
        spent = f"stopped: max_rewinds={event.get('max_rewinds')} spent"
        if event.get("data_samples") is not None:
            which = f" ({_listed('sample', event['data_samples'])})" if event["data_samples"] else ""
            spent += (f", and every rewind went to a batch holding NaN/Inf itself{which}: the data set holds "
                      "non-finite values in many samples, not one; find and repair them (`trainguard doctor` "
                      "validates a dataset's values) or filter them out in the dataset or collate_fn")
        elif event.get("index_samples") is not None:
            which = f" ({_listed('sample', event['index_samples'])})" if event["index_samples"] else ""
            spent += (f", and every rewind went to a batch holding an index out of range{which}: the data set holds "
                      "such labels (or ids) in many samples, not one; check their range against the model's classes "
                      "(or embedding rows) and repair or filter them in the dataset")
        return spent + " (trainguard.Diverged)"
    return "stopped (policy 'stop', trainguard.Diverged)"


def stored_meta(path: Path) -> dict[str, Any]:
    """The ``guard`` metadata of the run in ``path`` (an earlier process's); {} without one."""
    if not (path / "run.sqlite").exists():
        return {}
    try:
        with open_run(path) as run:
            meta = run.meta.get("guard")
    except TrainguardError:  # damaged or unreadable: it is replaced or appended to as before
        return {}
    return meta if isinstance(meta, dict) else {}


def stored_counts(path: Path) -> tuple[int, int]:
    """(events, rewinds) the guard's run in ``path`` holds already (an earlier process's); (0, 0) without one."""
    meta = stored_meta(path)
    counts = [meta.get("events"), meta.get("rewinds")]
    return tuple(c if isinstance(c, int) and c > 0 else 0 for c in counts)  # type: ignore[return-value]


def stored_bad_samples(path: Path) -> dict[Any, int]:
    """The samples earlier events of the guard's run in ``path`` found holding NaN/Inf in the batch
    itself, or an index out of range, each with the number of the event that found it (see ``Guard._known_bad``)."""
    if not (path / "run.sqlite").exists():
        return {}
    try:
        with open_run(path) as run:
            found = run.findings(source=SOURCE)
    except TrainguardError:
        return {}
    out: dict[Any, int] = {}
    for f in found:
        e = f.get("event") or {}
        bad = e.get("batch_nonfinite") or {}
        index = (((e.get("raised") or {}).get("index") or {}).get("in_batch") or {}).get("samples") or []
        if e.get("action") == "skip" and "rank" not in bad:
            for sample in [*(bad.get("samples") or ()), *index]:
                out.setdefault(sample, e.get("n"))
    return out


def fault_key(origin: dict | None, trigger: str) -> tuple:
    """What makes two events the same fault, for the samples they blame: the origin's op and line
    (``origin_key``), or with no origin (a loss spike) the trigger."""
    link = (origin or {}).get("origin") or {}
    return (link["op"], link.get("file"), link.get("line")) if link.get("op") else (trigger, None, None)


SPIKE_KEY = fault_key(None, "spike")


def stored_culprits(path: Path) -> dict[tuple, tuple[list[int], bool]]:
    """``(fault key, sample) -> ([event numbers], by rows)``: the samples earlier skip events of
    the guard's run in ``path`` blamed, by the rows their fault's first NaN/Inf was in or else by
    their batch (see ``Guard._note_suspects``)."""
    if not (path / "run.sqlite").exists():
        return {}
    try:
        with open_run(path) as run:
            found = run.findings(source=SOURCE)
    except TrainguardError:
        return {}
    out: dict[tuple, tuple[list[int], bool]] = {}
    for f in found:
        e = f.get("event") or {}
        if e.get("action") != "skip" or not isinstance(e.get("n"), int):
            continue
        rows = (e.get("culprits") or {}).get("samples")
        samples = rows or (e["skipped"][0] or {}).get("samples") if rows or e.get("skipped") else None
        key = fault_key(e.get("origin"), str(e.get("trigger")))
        for sample in samples or ():
            if isinstance(sample, (int, str)):
                ns, by_rows = out.get((key, sample), ([], False))
                out[(key, sample)] = (ns + [e["n"]], by_rows or bool(rows))
    return out


class GuardRun:
    """The guard's own run directory: its metadata and its events (one writer, shared).

    A run already in the directory is appended to: rerunning the same command after a crash or
    a preemption resumes the checkpoints and keeps the events of the earlier process. With
    ``overwrite`` it is replaced instead, its replays included.
    """

    def __init__(self, path: Path, config: dict[str, Any], *, overwrite: bool = False):
        self.path = path
        if overwrite:
            shutil.rmtree(path / REPLAYS_DIR, ignore_errors=True)
        self._writer = acquire_writer(path, append=not overwrite, overwrite=overwrite,
                                      meta={"guard": dict(config, status="running")})
        if not self._writer.owner:  # a rerun continues the run: its status is this process's, not the last one's
            self._writer.set_meta(status="running", error=None, crash_step=None, crash_at=None, exit_code=None)
        self._meta = dict(config, status="running")

    def update(self, **values: Any) -> None:
        self._meta.update(values)
        self._writer.set_meta(guard=dict(self._meta))

    def add_event(self, e: dict) -> None:
        stopped = e["action"] in STOPPED
        self._writer.add_findings(SOURCE, [{
            "kind": "guard_stop" if stopped else "guard_rewind",
            "severity": "error" if stopped else "warning",
            "title": e["message"],
            "steps": [e["step"], e["step"]],
            "suggestion": (e.get("origin") or {}).get("suggestion", ""),
            "event": e,
        }])

    def commit(self) -> None:
        """Wait until what was handed to the writer is committed (it commits every second)."""
        self._writer.flush(timeout=10.0)

    def close(self, status: str, ending: dict[str, Any] | None = None) -> None:
        """``status`` is the guard's; ``ending`` the run's own (``status``, ``error``, ...), as a recording stores it."""
        now = time.time()
        self.update(status=status, ended=now)
        release_writer(self._writer, **{"status": "finished", "ended": now, **(ending or {})})
