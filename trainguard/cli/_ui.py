"""``trainguard ui LOGDIR``: the web debugger on a local port."""

from __future__ import annotations

import argparse
from pathlib import Path

from trainguard._errors import RunNotFound, TrainguardError


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "ui",
        help="browse recorded runs in the web debugger",
        description="Serve the web debugger for the runs under LOGDIR (read-only). "
        "Binds 127.0.0.1 unless --host says otherwise.",
    )
    p.add_argument("logdir", metavar="LOGDIR", help="a run directory, or a folder holding several runs")
    p.add_argument("--port", type=int, default=6007, help="port to listen on (default 6007; 0 picks a free one)")
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default 127.0.0.1; 0.0.0.0 exposes your runs to the network)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from trainguard.cli._render import console

    logdir = Path(args.logdir)
    if not logdir.exists():
        raise RunNotFound(f"no such logdir: {str(logdir)!r}")
    if not logdir.is_dir():
        raise RunNotFound(f"logdir {str(logdir)!r} is a file, not a directory")
    if not 0 <= args.port <= 65535:
        raise TrainguardError(f"--port must be between 0 and 65535, got {args.port}")
    try:
        from trainguard.ui import bind, serve
    except ModuleNotFoundError as exc:
        raise TrainguardError(
            f"the web UI needs the 'ui' extra ({exc.name} is missing): pip install 'trainguard[ui]'"
        ) from None
    from trainguard.store import find_runs

    sock = bind(args.host, args.port)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    n = len(find_runs(logdir))
    say = {"markup": False, "highlight": False, "soft_wrap": True}  # one line, even when piped
    console.print(
        f"trainguard ui: {n} run{'s' if n != 1 else ''} under {logdir} at http://{shown}:{port}/  (Ctrl+C stops)",
        **say,
    )
    if n == 0:
        console.print("trainguard ui: no runs yet; new runs appear in the picker as they are written", **say)
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        console.print(f"trainguard ui: listening on {args.host}: anyone who can reach it can read these runs", **say)
    console.file.flush()
    serve(logdir, host=args.host, port=port, sock=sock)
    return 0
