"""``trainguard run script.py ARGS``: record an unmodified script.

The script runs as ``__main__`` in this process under the recorder. Its own exit code and
traceback are kept; the run directory is complete (closed and marked) even when it raises.
With ``--guard`` nothing is recorded up front: a :class:`trainguard.Guard` watches every
``ckpt.resume(...)`` loop the script iterates with ``loop.batches()``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import runpy
import signal
import sys
import time
import traceback
from pathlib import Path

from trainguard._errors import Diverged, NonFiniteError, TrainguardError
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
    p.add_argument("--guard", action="store_true",
                   help="instead of recording every op, guard the script's ckpt.resume() loops: rewind, replay "
                   "and record a step whose loss or gradients go NaN/Inf (or spike), then go on by --policy")
    p.add_argument("--policy", choices=("skip", "lower_lr", "stop"), default="skip",
                   help="with --guard: skip the batch, halve the learning rate, or stop (default: skip)")
    p.add_argument("--spike-factor", type=float, default=None,
                   help="with --guard: also treat a loss above this multiple of the recent median as a fault")
    p.add_argument("--snapshot-every", type=int, default=50, help="with --guard: steps between snapshots (default: 50)")
    p.add_argument("--max-rewinds", type=int, default=5, help="with --guard: rewinds allowed in all (default: 5)")
    p.add_argument("--overwrite", action="store_true", help="replace a run already in --logdir")
    p.add_argument("-m", dest="module", help="run a module as a script (like python -m)")
    p.add_argument("script", nargs="?", help="the script to run")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    p.set_defaults(func=_cmd)


_GUARD_DEFAULTS = {"policy": "skip", "spike_factor": None, "snapshot_every": 50, "max_rewinds": 5}


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

    if not args.guard and any(getattr(args, k) != v for k, v in _GUARD_DEFAULTS.items()):
        raise TrainguardError("--policy, --spike-factor, --snapshot-every and --max-rewinds need --guard")
    if args.guard and args.check_numerics:
        raise TrainguardError("choose one of --guard and --check-numerics")
    guard = None
    try:
        if args.guard:
            guard = tg.Guard(logdir, policy=args.policy, spike_factor=args.spike_factor,
                             snapshot_every=args.snapshot_every, max_rewinds=args.max_rewinds)
            recorder = None
        elif args.check_numerics:
            recorder = tg.check_numerics(logdir, mode="full_health", buffer=args.buffer)
        else:
            recorder = tg.record(logdir, mode=args.mode, buffer=args.buffer, ops=args.ops, dtypes=dtypes,
                                 overwrite=args.overwrite)
    except ValueError as exc:
        raise TrainguardError(str(exc)) from None

    monitor = None
    old_argv, old_path0 = sys.argv, sys.path[0] if sys.path else None
    # A preempted job gets SIGTERM: turn it into SystemExit so the run is closed properly.
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    code = 0
    if guard is not None:
        guard.install()
    try:
        with recorder if recorder is not None else contextlib.nullcontext():
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
            except NonFiniteError as exc:
                err_console.print(f"trainguard: NonFiniteError: {exc}", markup=False, highlight=False, soft_wrap=True)
                code = exc.exit_code
            except Diverged as exc:  # its line was logged at the rewind; this says how it ended
                err_console.print(f"trainguard: Diverged at step {exc.step}: training stopped", markup=False,
                                  highlight=False, soft_wrap=True)
                code = exc.exit_code
            except KeyboardInterrupt:
                code = 130
            except BaseException:
                # The script's own traceback, as Python would print it, and Python's exit code.
                traceback.print_exc()
                code = 1
            finally:
                if monitor is not None:
                    monitor.close()
    finally:
        if guard is not None:
            guard.uninstall()
        sys.argv = old_argv
        if old_path0 is not None and sys.path:
            sys.path[0] = old_path0
        signal.signal(signal.SIGTERM, previous)
    if guard is not None:
        if not (logdir / "run.sqlite").exists() and not any(logdir.glob("rank-*")):
            err_console.print("trainguard: the script iterated no `loop.batches()` of ckpt.resume(); nothing was "
                              "guarded", highlight=False, soft_wrap=True)
        else:
            err_console.print(f"trainguard: the guard rewound {guard.rewinds} time(s); see `trainguard report {logdir}`",
                              highlight=False, soft_wrap=True)
        return code
    err_console.print(f"trainguard: recorded {recorder.recorded:,} executions to {logdir}; "
                      f"see `trainguard report {logdir}` or `trainguard ui {logdir}`", highlight=False, soft_wrap=True)
    return code


def _start_monitor(logdir: Path, every: int):
    try:
        from trainguard._wiring import Monitor
    except ImportError:
        raise TrainguardError("--monitor needs the monitor, which this installation lacks") from None
    return Monitor(None, logdir=logdir, every=every)
