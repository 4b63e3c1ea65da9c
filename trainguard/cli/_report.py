"""``trainguard report RUN``: what went wrong, in the terminal (rich) or as JSON."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from trainguard._errors import RunNotFound
from trainguard.cli._render import console


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "report",
        help="print what went wrong in a recorded run",
        description="Print the alerts, the origin of the first NaN/Inf with its source lines, the "
        "monitor's findings and counts of a run directory.",
    )
    p.add_argument("run", help="the run directory (the --logdir of `trainguard run` or `record`)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--rank", type=int, default=None,
                   help="which rank of a torchrun run to detail (default: the one that made the first NaN/Inf, "
                        "else the first)")
    p.set_defaults(func=_cmd)


def load_report(path: str, rank: int | None = None) -> dict[str, Any]:
    """Open a run and build its report; a folder holding several runs is a clear error."""
    from trainguard.analysis import build_report
    from trainguard.store import find_runs, open_run

    try:
        run = open_run(path, rank=rank)
    except RunNotFound:
        runs = find_runs(path) if Path(path).is_dir() else []
        if len(runs) == 1:
            run = open_run(runs[0], rank=rank)
        elif len(runs) > 1:
            names = ", ".join(str(r) for r in runs[:5]) + (" ..." if len(runs) > 5 else "")
            raise RunNotFound(f"{path!r} holds {len(runs)} runs; name one: {names}") from None
        else:
            raise
    from trainguard.analysis import ranks_report

    ranks = ranks_report(run)
    if ranks is not None and rank is None and ranks["first_rank"] not in (None, run.rank):
        run.close()  # detail the rank where it started
        run = open_run(run.root, rank=ranks["first_rank"])
    with run:
        return build_report(run, findings=run.findings(), ranks=ranks)


def _cmd(args: argparse.Namespace) -> int:
    report = load_report(args.run, args.rank)
    if args.json:
        from trainguard.store import to_plain_json

        print(json.dumps(to_plain_json(report), indent=2))
    else:
        render_report(console, report)
    return 0


# ---------------------------------------------------------------------- rendering
def _row(t: Table, *cells) -> None:
    """A table row whose strings are shown as they are: never read as rich markup (a gloo error's
    ``[/__w/.../pair.cc:553]`` stopped the report; ``x[mask]`` in a title lost ``[mask]``)."""
    t.add_row(*(Text(c) if isinstance(c, str) else c for c in cells))


def _short(path: str | None) -> str:
    if not path:
        return "?"
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return rel if not rel.startswith("..") else path


def _nonfinite(value: Any, unknown: str) -> str:
    """``nan``, ``inf`` or ``-inf`` for a stored non-finite loss; ``unknown`` when none was stored."""
    if not isinstance(value, float):
        return unknown
    return "nan" if value != value else ("inf" if value > 0 else "-inf")


def _where(link: dict) -> str:
    return f"{_short(link.get('file'))}:{link.get('line')}" if link.get("file") else "(no user frame)"


def _source_block(lines: list[dict]) -> Text:
    out = Text()
    for item in lines:
        mark = ">" if item["current"] else " "
        style = "bold yellow" if item["current"] else "dim"
        out.append(f"  {mark} {item['line']:4d} | ", style="dim")
        out.append(item["text"] + "\n", style=style)
    return out


def _header(report: dict) -> Panel:
    meta = report["meta"]
    counts = report["counts"]
    created = meta.get("created")
    when = dt.datetime.fromtimestamp(created).strftime("%Y-%m-%d %H:%M:%S") if created else "?"
    t = Table.grid(padding=(0, 2))
    t.add_column(style="bold")
    t.add_column()
    _row(t, "run", report["run"] + (f" (rank {report['rank']} of {len(report['ranks']['ranks'])})"
                                      if report.get("ranks") else ""))
    status = report["status"]
    if status == "running" and meta.get("lost"):
        status = "incomplete: its writer stopped storing it (see the writer error)"
    elif status == "running":
        status += " (still being written, or its process was killed: shows everything up to the last flush)"
    _row(t, "status", status + (f" — {meta['error']}" if meta.get("error") else ""))
    if n := meta.get("untraced_children"):
        _row(t, "not watched", f"the training ran in {n:,} child process{'es' if n > 1 else ''} the script started "
                  "(multiprocessing.Process); this run holds this process's ops only")
    backend = {"native": "the native core", "python": "the Python dispatch mode"}.get(meta.get("backend"))
    _row(t, "recorded", f"{when}, mode {meta.get('mode')}, buffer {meta.get('buffer')}"
              + (f", by {backend}" if backend else ""))
    if meta.get("native_unsure"):
        _row(t, "not recorded", f"{meta['native_unsure']:,} ops on tensor subclasses or under another dispatch "
                  "mode (record with backend='python' to see them)")
    phases = counts["by_phase"]
    if not counts["stored"] and meta.get("backend") is None and meta.get("executions") is None:
        _row(t, "executions", "not recorded: no recorder ran (a monitor's run holds losses and statistics, "
                  "below; `trainguard run` records the ops)")
    else:
        _row(t, "executions", f"{counts['stored']:,} stored over {counts['steps']} steps "
                  f"(forward {phases['forward']:,}, backward {phases['backward']:,}, "
                  f"optimizer {phases['optimizer']:,}, other {phases['other']:,})")
    if counts["steps"] <= 1 and phases["backward"] and not phases["optimizer"] and not meta.get("guard_replay"):
        # (a guard's replay records the one failing step, whose update it may never run)
        _row(t, "steps", Text("not counted: no torch.optim optimizer step() was seen, so every op is in step 0 "
                              "(a loop that writes the weights itself, as Keras' fit; `trainguard.step()` after "
                              "each update, or `--monitor`, counts them)", style="yellow"))
    if meta.get("executions") is not None and meta.get("recorded") is not None:
        _row(t, "ops seen", f"{meta['executions']:,} ran, {meta['recorded']:,} matched the filters")
    dropped = meta.get("dropped") or 0
    _row(t, "dropped", Text(f"{dropped:,} records dropped under back-pressure", style="bold red") if dropped
              else Text("none", style="green"))
    if report.get("damaged"):
        _row(t, "damaged", Text("rows that cannot be decoded were skipped: " + ", ".join(
            f"{n:,} in {table}" for table, n in report["damaged"].items()), style="red"))
    if meta.get("writer_error"):
        lost = f"; {meta['lost']:,} executions were not stored" if meta.get("lost") else ""
        _row(t, "writer error", Text(str(meta["writer_error"]) + lost, style="bold red"))
    compiled = report.get("compiled")
    if compiled:
        inside = compiled["recorded_inside"]
        if inside:
            names = ", ".join(g["graph"] for g in inside[:6]) + (" ..." if len(inside) > 6 else "")
            _row(t, "compiled", f"{len(inside)} torch.compile graph{'s' if len(inside) != 1 else ''} recorded "
                      f"op by op ({names})")
        opaque = compiled["opaque"]
        if opaque:
            graphs = "; ".join(f"graph {g['graph']} ({g['calls']:,} calls" +
                               (f", called at {_short(g['file'])}:{g['line']})" if g.get("file") else ")")
                               for g in opaque)
            n = len(opaque)
            _row(t, "not seen inside", Text(
                f"{n} torch.compile graph{'s' if n != 1 else ''} compiled before the recording started "
                f"{'are' if n != 1 else 'is'} recorded whole (inputs and outputs), not op by op: {graphs}. "
                + compiled["opaque_note"], style="yellow"))
        if compiled.get("full_tensor"):
            _row(t, "full_tensor", Text("inside compiled graphs only the graphs' outputs have their values stored; "
                                          "every op has its summary", style="yellow"))
    if meta.get("record_errors"):
        _row(t, "not recorded", Text(f"{meta['record_errors']:,} op outputs could not be recorded "
                                       "(see the warnings the run printed)", style="red"))
    return Panel(t, title="trainguard report", border_style="cyan")


def _alerts(report: dict) -> Any:
    alerts = report["alerts"]
    quiet = [Text(line, style="dim") for line in report.get("intended") or []]
    if report.get("scaler"):
        quiet.append(Text(report["scaler"], style="dim"))
    stop = (report["meta"].get("check_numerics_stop") or {}) if report.get("meta") else {}
    if stop:
        first = str(stop.get("message", "")).splitlines()[:1]
        quiet.insert(0, Text(f"check_numerics stopped the run at #{stop.get('seq')} {stop.get('op')}"
                             + (f": {first[0]}" if first else ""), style="bold"))
    if not alerts["total"] and not report["counts"]["stored"] and report.get("guard"):
        return Panel(Text("No op is recorded in this run itself: the guard records each replayed step in a "
                          "run of its own (below)."), title="alerts", border_style="cyan")
    if not alerts["total"]:
        return Panel(Group(Text("No harmful NaN or Inf.", style="bold green"), *quiet), title="alerts",
                     border_style="green")
    t = Table(title=f"{alerts['total']:,} harmful NaN/Inf events", title_justify="left")
    t.add_column("op")
    t.add_column("events", justify="right")
    t.add_column("first at #", justify="right")
    for row in alerts["by_op"][:15]:
        _row(t, row["op"], f"{row['count']:,}", str(row["first_seq"]))
    if len(alerts["by_op"]) > 15:
        _row(t, f"... {len(alerts['by_op']) - 15} more op types", "", "")
    return Group(t, *quiet) if quiet else t


def _origin(report: dict) -> Any:
    o = report["origin"]
    if not o:
        return None
    link = o["origin"]
    parts: list[Any] = []
    head = Text()
    earlier = o.get("earlier")
    head.append("Harmful value that reached training: " if earlier else "First harmful value: ", style="bold")
    head.append(f"{link['op']}", style="bold red")
    head.append(f" at {_where(link)}", style="bold")
    head.append(f" in step {link['step']} ({link['phase']} pass, #{link['seq']})")
    if link.get("module") is not None:
        head.append(f", module {link['module'] or '(root)'}"
                    + (f" ({link['module_type']})" if link.get("module_type") else ""))
    parts.append(head)
    if earlier:  # the first harmful value reached no loss, gradient or parameter before this one
        at = f" at {_where(earlier)}" if earlier.get("file") else ""
        parts.append(Text(f"  not the run's first harmful value: {earlier['op']}{at} in step {earlier['step']} (#"
                          f"{earlier['seq']}) made one earlier, which had reached no loss, gradient or parameter "
                          "when this one did", style="dim"))
    lib = link.get("library")
    if lib:  # the op ran inside an installed package, called from the line above
        parts.append(Text(f"  inside {lib['path']}:{lib['line']} in {lib['function']}"
                          + (f": {lib['code']}" if lib.get("code") else "")))
    for out in link["outputs"]:
        parts.append(Text(f"  output: {out['dtype']} {out['shape']}: {out['description']}"))
    parts.append(Text(f"  why: {link['explanation']}", style="yellow"))
    if o.get("harm"):
        parts.append(Text(f"  then: {_short_harm(o['harm'])}", style="yellow"))
    elif o.get("skipped"):  # the loss it made non-finite was checked and its iteration skipped
        sk = o["skipped"]
        at = f" (`{sk.get('check')}` at {_short(sk['file'])}:{sk['line']})" if sk.get("file") else ""
        value = _nonfinite(sk.get("loss"), "non-finite")
        parts.append(Text(f"  then: it made the loss {value} in step {sk['step']}; the program checked it{at} and "
                          "skipped that iteration: no backward(), no update (the monitor counts such iterations: "
                          "iterations_skipped)", style="yellow"))
    elif o.get("scheduler"):  # a NaN validation metric that ReduceLROnPlateau read
        sc = o["scheduler"]
        at = f" at {_short(sc['file'])}:{sc['line']}" if sc.get("file") else ""
        parts.append(Text(f"  then: ReduceLROnPlateau.step read it{at} in {sc['steps']} step(s) from step "
                          f"{sc['first_step']}; it reached no loss, gradient or parameter, but the scheduler counts a "
                          "NaN metric as no improvement and lowers the learning rate after `patience` of them",
                          style="yellow"))
    elif o.get("read"):  # read by the program and no further: MAE's `if not math.isfinite(loss.item()): sys.exit(1)`
        rd = o["read"]
        at = f" ({_short(rd['file'])}:{rd['line']})" if rd.get("file") else ""
        parts.append(Text(f"  then: the program read it{at} in step {rd['step']}"
                          + (f" and exited with code {rd['exit_code']}: no backward(), no update" if rd.get("exit_code")
                             else "; it reached no loss, gradient or parameter by the end of the recording"),
                          style="yellow"))
    elif o.get("crashed"):  # into a check that raised on it: detr's NaN image into generalized_box_iou's assert
        cr = o["crashed"]
        at = f" at {_short(cr['file'])}:{cr['line']}" if cr.get("file") else ""
        parts.append(Text(f"  then: it went on into step {cr['step']}'s ops ({cr['nonfinite']} harmful) and reached no "
                          f"loss, gradient or parameter: the script crashed in step {cr['step']} ({cr['error']}){at}, "
                          "most likely on it", style="yellow"))
    elif o.get("reached_training") is False:  # nerf's disparity of an empty ray: made, then unused
        parts.append(Text("  it reached no loss, gradient or parameter by the end of the recording: training "
                          "never used it (the value itself holds it where the program reads it)", style="yellow"))
    if link.get("forward_op") and link["forward_op"].get("file"):
        f = link["forward_op"]
        parts.append(Text(f"  backward of {f['op']} created at {_short(f['file'])}:{f['line']}"))
    if link.get("source"):
        parts.append(_source_block(link["source"]))
    for inp in link["inputs"]:
        line = Text(f"  input {inp['slot']}: ")
        if inp.get("producer_op"):
            line.append(f"{inp['producer_op']} output (#{inp['producer']})", style="bold")
            if inp.get("file"):
                line.append(f" from {_short(inp['file'])}:{inp['line']}")
            line.append(": ")
        line.append(inp["description"])  # a parameter or buffer by name, when no op produced it
        parts.append(line)
        if inp.get("source"):
            parts.append(_source_block(inp["source"]))
    for src in link.get("sources") or []:  # behind inputs a compiled graph computed without summaries
        line = Text(f"  computed (through {', '.join(link['through'])}) from: ")
        line.append(f"{src.get('producer_op')} output (#{src.get('producer')})", style="bold")
        if src.get("file"):
            line.append(f" from {_short(src['file'])}:{src['line']}")
        line.append(f": {src.get('description')}")
        parts.append(line)
    if len(o["chain"]) > 1:
        parts.append(Text("How it spread, from where it became harmful back to the origin:", style="bold"))
        for c in o["chain"]:
            parts.append(Text(f"  #{c['seq']} {c['op']} at {_where(c)}: {c['explanation']}"))
    parts.append(Text(f"Fix: {o['suggestion']}", style="bold green"))
    return Panel(Group(*parts), title="origin", border_style="red")


def _samples(samples: list | None, limit: int = 12) -> str:
    if not samples:
        return ""
    head = ", ".join(str(i) for i in samples[:limit])
    return f", samples {head}" + (f" ... ({len(samples)} in all)" if len(samples) > limit else "")


def _size(n: int) -> str:
    for unit, scale in (("GB", 2**30), ("MB", 2**20), ("KB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def _guard(report: dict) -> Any:
    g = report.get("guard")
    if not g:
        return None
    meta = g.get("meta") or {}
    events = g.get("events") or []
    parts: list[Any] = []
    head = Text()
    head.append("guard: ", style="bold")
    size = meta.get("snapshot_bytes")
    head.append(f"policy {meta.get('policy', '?')}, a snapshot every {meta.get('snapshot_every', '?')} steps"
                + (f" ({_size(size)} of host memory)" if size else "")
                + (f", spike factor {meta['spike_factor']:g}" if meta.get("spike_factor") else "")
                + f", {len(events)} event{'s' if len(events) != 1 else ''}, status {meta.get('status', '?')}")
    parts.append(head)
    known = meta.get("skipped_known")
    if isinstance(known, int) and known:
        last = meta.get("last_skipped_known") or {}
        repeat = meta.get("skipped_repeat") if isinstance(meta.get("skipped_repeat"), int) else 0
        for n, why, what in ((known - repeat, "data", "an event found corrupt in the batch itself"),
                             (repeat, "repeat", "two events blamed for the same fault")):
            if n <= 0:
                continue
            at = (f"; the last at step {last['step']:,} (epoch {last.get('epoch')}{_samples(last.get('samples'))})"
                  if isinstance(last.get("step"), int) and last.get("why", "data") == why else "")
            parts.append(Text(f"{n} later batch{'es' if n != 1 else ''} held a sample {what}, and "
                              f"{'were' if n != 1 else 'was'} skipped unread (no rewind){at}", style="yellow"))
    loop = meta.get("loop_skipped")
    if isinstance(loop, dict) and loop.get("count"):
        first = loop.get("first") or {}
        n = loop["count"]
        value = _nonfinite(first.get("loss"), "?")
        at = f" (checked at {_short(first['file'])}:{first['line']})" if first.get("file") else ""
        parts.append(Text(f"the loop skipped {n} step{'s' if n != 1 else ''} itself, the first at step {first.get('step')}: "
                          f"its loss was {value}{at} and it called no backward(), so nothing was updated and the guard "
                          "did not rewind; find where the NaN/Inf comes from with `trainguard run --check-numerics`",
                          style="yellow"))
    faults = meta.get("eval_faults")
    if isinstance(faults, dict) and faults.get("count"):
        n = faults["count"]
        parts.append(Text(f"{n} op{'s' if n != 1 else ''} raised under torch.no_grad() in the loop body (an evaluation), "
                          f"not rewound; the first: {(faults.get('first') or {}).get('message', '?')}", style="yellow"))
    for e in events:
        style = "bold red" if e.get("action") in ("stop", "code_bug", "max_rewinds") else "bold yellow"
        b = e.get("batch") or {}
        batch = f" (batch {b['batch']:,})" if b.get("batch") is not None and b["batch"] != e["step"] else ""
        parts.append(Text(f"#{e.get('n', '?')} step {e['step']:,}{batch}: {e.get('reason', '')}", style=style))
        rp = e.get("replay") or {}
        if e.get("rewound_to") is not None:
            line = f"  rewound to step {e['rewound_to']:,} ({e.get('rewound_from', 'memory')})"
            if rp and rp.get("steps"):
                line += f", replayed {rp['steps']} step{'s' if rp['steps'] != 1 else ''}"
                if rp.get("bitwise_equal") is not None:
                    line += ", losses bitwise equal" if rp["bitwise_equal"] else \
                        f", losses differ from step {rp['mismatch']['step']}"
                if not rp.get("reproduced", True):
                    line += ", the fault did not reproduce"
            parts.append(Text(line))
        o = e.get("origin")
        if o:
            link = o["origin"]
            parts.append(Text(f"  origin: {link['op']} at {_where(link)} in step {link['step']} "
                              f"({link['phase']} pass): {link['explanation']}"))
            for c in o.get("chain", [])[:-1]:
                parts.append(Text(f"    spread by #{c['seq']} {c['op']} at {_where(c)}: {c['explanation']}", style="dim"))
            if o.get("suggestion"):
                parts.append(Text(f"  fix: {o['suggestion']}", style="green"))
        for b in e.get("skipped") or []:
            where = f"epoch {b.get('epoch')}, index {b.get('index')}" if b.get("index") is not None else \
                f"epoch {b.get('epoch')}"
            which = f"batch {b['batch']:,}" if b.get("batch") is not None else (
                f"batch {b['index']}" if b.get("index") is not None else f"the batch of step {e['step']:,}")
            parts.append(Text(f"  skipped {which} ({where}{_samples(b.get('samples'))})"))
        c = e.get("culprits")
        if c and c.get("samples"):
            rows = ", ".join(str(r) for r in c["rows"][:12])
            many = len(c["samples"]) > 1
            parts.append(Text(f"  the first non-finite values are in the row{'s' if many else ''} of sample{'s' if many else ''} "
                              f"{', '.join(str(i) for i in c['samples'][:12])} (row{'s' if many else ''} {rows} of "
                              f"{c['size']} in the batch)", style="bold"))
        parts.append(Text(f"  -> {e.get('outcome', e.get('action', ''))}"))
        if rp.get("run"):
            path = Path(report["run"]).parent if Path(report["run"]).name.startswith("rank-") else Path(report["run"])
            parts.append(Text(f"  the replayed step, recorded in full: trainguard report {path / rp['run']}", style="dim"))
    worst = "red" if any(e.get("action") in ("stop", "code_bug", "max_rewinds") for e in events) else (
        "yellow" if events else "green")
    return Panel(Group(*parts), title="guard", border_style=worst)


def _short_harm(text: str) -> str:
    """The harm sentence with its paths made relative, like every other path shown."""
    words = text.split(" ")
    for i, w in enumerate(words):
        if ":" in w and os.sep in w:
            path, _, line = w.rpartition(":")
            words[i] = f"{_short(path)}:{line}"
    return " ".join(words)


def _findings(report: dict) -> Any:
    findings = report.get("findings") or []
    if not findings:
        return None
    try:
        from trainguard.cli._findings_view import render_findings_table

        return render_findings_table(findings)
    except ImportError:
        t = Table(title="findings", title_justify="left")
        for col in ("severity", "kind", "title", "suggestion"):
            t.add_column(col)
        rank = {"critical": 3, "error": 2, "warning": 1, "info": 0}
        for f in sorted(findings, key=lambda f: -rank.get(f.get("severity"), 0)):
            _row(t, f.get("severity", ""), f.get("kind", ""), f.get("title", ""), f.get("suggestion", ""))
        return t


def _ranks(report: dict) -> tuple[Text, Table] | None:
    """The first line (which rank went non-finite first) and every rank's alerts side by side."""
    ranks = report.get("ranks")
    if not ranks:
        return None
    headline = _short_harm(ranks["headline"]) if ranks["headline"] else None
    head = Text(f"{headline}.", style="bold red") if headline else Text(
        f"No harmful NaN or Inf on any of the {len(ranks['ranks'])} ranks.", style="bold green")
    t = Table(title="alerts per rank", title_justify="left")
    t.add_column("rank", justify="right")
    t.add_column("status")
    t.add_column("NaN/Inf", justify="right")
    t.add_column("step", justify="right")
    t.add_column("first non-finite value")
    t.add_column("how", no_wrap=True)
    for p in ranks["per_rank"]:
        f = p["first"]
        step, first, how = "", "", ""
        if f:
            step = str(f["step"])
            first = f"{f['op']} at {_short(f['file'])}:{f['line']}" if f.get("file") else f["op"]
            via = f["received_via"]
            how = f"received: {via['op']}" if via else ("made (first)" if p["rank"] == ranks["first_rank"] else "made")
        _row(t, str(p["rank"]), p["status"], f"{p['alerts']['total']:,}", step, first,
                  Text(how, style="bold red" if how.startswith("made") else ""))
    return head, t


def render_report(con: Console, report: dict) -> None:
    if report.get("crash"):  # first, before anything that could read as a finished run
        con.print(Text(report["crash"]["text"], style="bold red"), soft_wrap=True)
    ranks = _ranks(report)
    if ranks is not None:
        con.print(ranks[0], soft_wrap=True)
    con.print(_header(report))
    if ranks is not None:
        con.print(ranks[1])
    con.print(_alerts(report))
    o = _origin(report)
    if o is not None:
        con.print(o)
    g = _guard(report)
    if g is not None:
        con.print(g)
    f = _findings(report)
    if f is not None:
        con.print(f)
    top = report["counts"]["top_ops"]
    if top:
        con.print(Text("most frequent ops: ", style="bold") + Text(
            ", ".join(f"{r['op']} ({r['count']:,})" for r in top[:6])))
