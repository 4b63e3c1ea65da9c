"""``trainguard demo``: the reference NaN scenario, recorded and reported end to end."""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

from rich.table import Table

from trainguard.cli._render import console


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="run the reference NaN scenario and print its report",
        description="Train an MLP on 8x8 digits with a hand-written cross-entropy whose log(0) turns the "
        "loss NaN, record every op, and print where the first NaN/Inf came from.",
    )
    p.add_argument("--logdir", help="run directory (default: runs/demo-<time>)")
    p.add_argument("--fixed", action="store_true", help="clamp the probabilities first: the report is clean")
    p.add_argument("--steps", type=int, default=30, help="training steps (default: 30)")
    p.add_argument("--quiet", action="store_true", help="print only the report")
    p.set_defaults(func=_cmd)


def run_demo(logdir: Path, *, fixed: bool = False, steps: int = 30) -> list[dict]:
    """Record and monitor the reference scenario into ``logdir``; return its per-step history."""
    import trainguard as tg
    from trainguard.examples.nan_digits import train

    # The recorder traces every op; the monitor adds the loss curve, layer statistics and findings.
    with tg.record(logdir, mode="full_health", buffer=-1), tg.Monitor(None, logdir=logdir, every=1):
        return train(steps=steps, fixed=fixed)


def _cmd(args: argparse.Namespace) -> int:
    from trainguard.cli._report import load_report, render_report

    logdir = Path(args.logdir) if args.logdir else Path("runs") / f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    if not args.quiet:
        console.print(f"[bold]trainguard demo[/]: training the digits MLP {'with the fix ' if args.fixed else ''}"
                      f"under trainguard.record -> {logdir}")
    history = run_demo(logdir, fixed=args.fixed, steps=args.steps)
    if not args.quiet:
        t = Table(title="training (the script's own view)", title_justify="left")
        t.add_column("step", justify="right")
        t.add_column("loss", justify="right")
        t.add_column("test accuracy", justify="right")
        shown = history if len(history) <= 8 else history[:5] + history[-3:]
        for h in shown:
            loss = "[red]nan[/]" if math.isnan(h["loss"]) else f"{h['loss']:.4f}"
            t.add_row(str(h["step"]), loss, f"{h['accuracy']:.3f}")
        console.print(t)
    render_report(console, load_report(str(logdir)))
    if not args.quiet:
        console.print(f"Explore it in the browser: [bold]trainguard ui {logdir}[/]")
    return 0
