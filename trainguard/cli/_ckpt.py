"""``trainguard ckpt list|verify DIR``: what a checkpoint directory holds, and whether it can be trusted.

Exit codes: ``list`` 0; ``verify`` 0 when the newest checkpoint is valid, 1 when it is damaged
(the reasons are printed); both 2 for bad input (no such directory, no checkpoints in it).
"""

from __future__ import annotations

import argparse
import json
import time

from trainguard._errors import CheckpointError

EXIT_DAMAGED = 1


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "ckpt",
        help="list and verify checkpoints",
        description="Inspect a checkpoint directory (or a run directory with a checkpoints/ folder).",
    )
    sub = p.add_subparsers(dest="ckpt_command", metavar="ACTION", required=True)
    ls = sub.add_parser("list", help="step, time, size and validity of each checkpoint",
                        description="List checkpoints, oldest first. Validity is the quick check "
                        "(manifest and file sizes) unless --verify recomputes every checksum.")
    ls.add_argument("directory", metavar="DIR")
    ls.add_argument("--verify", action="store_true", help="also recompute every file's SHA-256")
    ls.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ls.set_defaults(func=run_list)
    ver = sub.add_parser("verify", help="check every checksum; exit 0 only if the newest checkpoint is valid",
                         description="Fully verify every checkpoint. Exit 0 when the newest one is valid, "
                         f"{EXIT_DAMAGED} when it is damaged, 2 when DIR is missing or holds no checkpoints.")
    ver.add_argument("directory", metavar="DIR")
    ver.set_defaults(func=run_verify)


def _infos(directory: str, *, verify: bool):
    from trainguard.resilience import list_checkpoints

    infos = list_checkpoints(directory, verify=verify)
    if not infos:
        raise CheckpointError(f"{directory}: no checkpoints here (expected step-<N> folders or a checkpoints/ folder)")
    return infos


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _when(t: float | None) -> str:
    return "-" if t is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _short(value) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def _status(info) -> str:
    if not info.complete:
        return "incomplete"
    return "valid" if info.valid else "DAMAGED"


def _render(infos, title: str) -> None:
    from rich.table import Table

    from trainguard.cli._render import console

    table = Table(title=title, title_justify="left")
    for col, justify in (("step", "right"), ("epoch", "right"), ("saved at", "left"), ("size", "right"),
                         ("status", "left")):
        table.add_column(col, justify=justify, no_wrap=True)
    table.add_column("note", overflow="fold")
    for i in infos:
        style = None if i.valid else ("yellow" if not i.complete else "red")
        note = ", ".join((["pinned"] if i.pinned else []) + [f"{k}={_short(v)}" for k, v in i.metadata.items()])
        table.add_row(str(i.step), "-" if i.epoch is None else str(i.epoch), _when(i.time), _size(i.size),
                      _status(i), note, style=style)
    console.print(table)
    # Reasons go on their own lines, unwrapped, so they stay greppable.
    for i in infos:
        if not i.valid:
            console.print(f"{i.path.name}: {i.reason}", markup=False, highlight=False, soft_wrap=True)


def run_list(args: argparse.Namespace) -> int:
    infos = _infos(args.directory, verify=args.verify)
    if args.json:
        from trainguard.cli._render import console

        console.print_json(json.dumps([i.to_dict() for i in infos]))
        return 0
    _render(infos, f"checkpoints in {infos[0].path.parent}")
    return 0


def run_verify(args: argparse.Namespace) -> int:
    from trainguard.cli._render import console

    infos = _infos(args.directory, verify=True)
    _render(infos, f"verified checkpoints in {infos[0].path.parent}")
    committed = [i for i in infos if i.complete]
    if not committed:
        raise CheckpointError(f"{args.directory}: only incomplete saves, no checkpoint")
    newest = committed[-1]
    valid = [i for i in committed if i.valid]
    if newest.valid:
        console.print(f"newest checkpoint {newest.name} is valid", markup=False, highlight=False, soft_wrap=True)
        return 0
    fallback = f"; restore would use {valid[-1].name}" if valid else "; no valid checkpoint remains"
    console.print(f"newest checkpoint {newest.name} is damaged: {newest.reason}{fallback}",
                  markup=False, highlight=False, soft_wrap=True)
    return EXIT_DAMAGED
