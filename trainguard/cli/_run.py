"""``trainguard run script.py ARGS``: record an unmodified script.

The script runs as ``__main__`` in this process under the recorder. Its own exit code and
traceback are kept; the run directory is complete (closed and marked) even when it raises.
"""

from __future__ import annotations

import argparse
import os
import runpy
import signal
import sys
import time
import traceback
from pathlib import Path

from trainguard._errors import NonFiniteError, TrainguardError
from trainguard.cli._render import err_console
from trainguard.store import MODES


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run",
        help="record an unmodified training script",
        description="Run a Python script (or -m module) with every op recorded into a run directory.",
    )
    p.add_argument("--logdir", help="run directory to write (default: runs/<script>-<time>)")
    p.add_argument("--mode", default="full_health", choices=MODES, help="tensor summary mode (default: full_health)")
    p.add_argument("--buffer", type=int, default=1000,
                   help="keep the last N executions, -1 for all; NaN/Inf ones are always kept (default: 1000)")
    p.add_argument("--ops", help="record only ops whose name matches this regular expression")
    p.add_argument("--dtypes", help="record only executions with an output of these dtypes (comma separated)")
    p.add_argument("--check-numerics", action="store_true",
                   help="stop with an error at the first op that produces NaN or Inf")
    p.add_argument("--monitor", action="store_true",
                   help="also record per-layer statistics and diagnose training health")
    p.add_argument("--every", type=int, default=10, help="with --monitor: layer statistics every N steps")
    p.add_argument("--overwrite", action="store_true", help="replace a run already in --logdir")
    p.add_argument("-m", dest="module", help="run a module as a script (like python -m)")
    p.add_argument("script", nargs="?", help="the script to run")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    p.set_defaults(func=_cmd)


def _default_logdir(name: str) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{Path(name).stem or 'run'}-{stamp}"


def _cmd(args: argparse.Namespace) -> int:
    if args.module:
        target = args.module
        script_args = ([args.script] if args.script else []) + list(args.args)
    else:
        if not args.script:
            raise TrainguardError("give a script to run (trainguard run script.py ARGS) or -m module")
        if not os.path.isfile(args.script):
            raise TrainguardError(f"no such script: {args.script!r}")
        target = args.script
        script_args = list(args.args)
    logdir = Path(args.logdir) if args.logdir else _default_logdir(target.split(".")[-1])
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()] if args.dtypes else None

    import trainguard as tg

    try:
        if args.check_numerics:
            recorder = tg.check_numerics(logdir, mode="full_health", buffer=args.buffer)
        else:
            recorder = tg.record(logdir, mode=args.mode, buffer=args.buffer, ops=args.ops, dtypes=dtypes,
                                 overwrite=args.overwrite)
    except ValueError as exc:
        raise TrainguardError(str(exc)) from None

    monitor = None
    error: BaseException | None = None
    old_argv, old_path0 = sys.argv, sys.path[0] if sys.path else None
    # A preempted job gets SIGTERM: turn it into SystemExit so the run is closed properly.
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    code = 0
    try:
        with recorder:
            if args.monitor:
                monitor = _start_monitor(logdir, args.every)
            try:
                if args.module:
                    sys.argv = [target] + script_args
                    runpy.run_module(target, run_name="__main__", alter_sys=True)
                else:
                    sys.argv = [target] + script_args
                    sys.path[0:1] = [os.path.dirname(os.path.abspath(target))]
                    runpy.run_path(target, run_name="__main__")
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
                if exc.code is not None and not isinstance(exc.code, int):
                    print(exc.code, file=sys.stderr)
                if code:
                    error = exc
            except NonFiniteError as exc:
                err_console.print(f"trainguard: NonFiniteError: {exc}", markup=False, highlight=False, soft_wrap=True)
                code = exc.exit_code
                error = exc
            except KeyboardInterrupt as exc:
                code = 130
                error = exc
            except BaseException as exc:
                # The script's own traceback, as Python would print it, and Python's exit code.
                traceback.print_exc()
                code = 1
                error = exc
            finally:
                if monitor is not None:
                    monitor.close(error=error)
    finally:
        sys.argv = old_argv
        if old_path0 is not None and sys.path:
            sys.path[0] = old_path0
        signal.signal(signal.SIGTERM, previous)
    err_console.print(f"trainguard: recorded {recorder.recorded:,} executions to {logdir}; "
                      f"see `trainguard report {logdir}` or `trainguard ui {logdir}`", highlight=False, soft_wrap=True)
    return code


def _start_monitor(logdir: Path, every: int):
    try:
        from trainguard._wiring import Monitor
    except ImportError:
        raise TrainguardError("--monitor needs the monitor, which this installation lacks") from None
    from trainguard.integrations import watch_frameworks

    monitor = Monitor(None, logdir=logdir, every=every)
    watch_frameworks(monitor)  # Lightning / HF Trainer scripts: the framework's steps
    return monitor
