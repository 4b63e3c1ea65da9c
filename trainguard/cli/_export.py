"""``trainguard export tensorboard RUN OUT``: per-step scalars, layer statistics, histograms and
findings as TensorBoard event files.

Tags: scalars keep their names (``loss``, ``grad_norm``, ``lr/0``); layer statistics are
``<kind>/<layer>/<stat>`` (``activation/fc1/dead_frac``, ``gradient/fc1.weight/norm``);
histograms ``<kind>/<layer>``; the findings one markdown text entry, ``trainguard/findings``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from trainguard._errors import TrainguardError


def add_parser(sub) -> None:
    p = sub.add_parser(
        "export",
        help="export a run to other tools (TensorBoard event files)",
        description="Export a run's per-step scalars, layer statistics, histograms and findings.",
    )
    fmt = p.add_subparsers(dest="format", metavar="FORMAT")
    tb = fmt.add_parser("tensorboard", help="write TensorBoard event files into OUT")
    tb.add_argument("run", help="run directory")
    tb.add_argument("out", help="output directory for the event files (created if missing)")
    tb.set_defaults(func=_cmd_tensorboard)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def export_tensorboard(run: Any, out: str | Path) -> dict[str, int]:
    """Write ``run`` into an event file under ``out``; returns how many of each record went out."""
    try:
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.compat.proto.tensor_pb2 import TensorProto
        from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto
        from tensorboard.summary.writer.event_file_writer import EventFileWriter
    except ImportError:
        raise TrainguardError(
            "exporting to TensorBoard needs the tensorboard package: pip install 'trainguard[tensorboard]'"
        ) from None
    from trainguard.cli._findings_view import as_findings

    out = Path(out)
    if out.exists() and not out.is_dir():
        raise TrainguardError(f"output {str(out)!r} exists and is not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise TrainguardError(f"cannot create the output directory {str(out)!r}: {exc.strerror or exc}") from None
    wall0 = float(run.meta.get("created") or time.time())
    writer = EventFileWriter(str(out))
    counts = {"scalars": 0, "layer_stats": 0, "histograms": 0, "findings": 0}

    def scalar(tag: str, step: int, value: float) -> None:
        summary = summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=tag, simple_value=float(value))])
        writer.add_event(event_pb2.Event(wall_time=wall0 + step * 1e-3, step=int(step), summary=summary))

    try:
        for name, points in run.scalars().items():
            for step, value in points:
                scalar(name, step, value)
                counts["scalars"] += 1
        for row in run.layer_stats():
            scalar(f"{row['kind']}/{row['layer']}/{row['stat']}", row["step"], row["value"])
            counts["layer_stats"] += 1
        for h in run.histograms():
            edges, buckets = h["edges"], h["counts"]
            centers = [(a + b) / 2 for a, b in zip(edges[:-1], edges[1:])]
            proto = summary_pb2.HistogramProto(
                min=float(edges[0]),
                max=float(edges[-1]),
                num=float(sum(buckets)),
                sum=float(sum(c * n for c, n in zip(centers, buckets))),
                sum_squares=float(sum(c * c * n for c, n in zip(centers, buckets))),
                bucket_limit=[float(e) for e in edges[1:]],
                bucket=[float(n) for n in buckets],
            )
            summary = summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=f"{h['kind']}/{h['layer']}", histo=proto)])
            writer.add_event(event_pb2.Event(wall_time=wall0 + h["step"] * 1e-3, step=int(h["step"]), summary=summary))
            counts["histograms"] += 1
        findings = as_findings(run.findings())
        if findings:
            lines = [f"**{f.severity.upper()}** `{f.kind}`: {f.title}  \n{f.suggestion}" for f in findings]
            text = TensorProto(
                dtype="DT_STRING",
                tensor_shape=TensorShapeProto(dim=[TensorShapeProto.Dim(size=1)]),
                string_val=["\n\n".join(lines).encode("utf-8")],
            )
            meta = summary_pb2.SummaryMetadata(plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="text"))
            summary = summary_pb2.Summary(
                value=[summary_pb2.Summary.Value(tag="trainguard/findings", tensor=text, metadata=meta)]
            )
            writer.add_event(event_pb2.Event(wall_time=wall0, step=0, summary=summary))
            counts["findings"] = len(findings)
    finally:
        writer.close()
    return counts


def _cmd_tensorboard(args) -> int:
    from trainguard.cli._render import console
    from trainguard.store import open_run

    with open_run(args.run) as run:
        counts = export_tensorboard(run, args.out)
    console.print(
        f"wrote {counts['scalars']} scalars, {counts['layer_stats']} layer statistics, "
        f"{counts['histograms']} histograms and {counts['findings']} findings to {args.out}",
        highlight=False,
    )
    return 0
