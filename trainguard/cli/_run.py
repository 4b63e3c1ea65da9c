"""``trainguard run script.py ARGS``: record an unmodified script.

The script runs as ``__main__`` in this process under the recorder. Its own exit code and
traceback are kept; the run directory is complete (closed and marked) even when it raises.
With ``--guard`` nothing is recorded up front: a :class:`trainguard.Guard` watches every
``ckpt.resume(...)`` loop the script iterates with ``loop.batches()``.
With ``--nproc-per-node`` this process becomes torchrun's agent instead (see ``_launch``);
under torchrun each rank records into ``LOGDIR/rank-K``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from trainguard._errors import Diverged, NonFiniteError, TrainguardError
from trainguard.cli import _launch
from trainguard.cli._children import ChildWatch
from trainguard.cli._preempt import Preemption, resume_point
from trainguard.cli._render import err_console
from trainguard.cli._spawned import Follow, Options, SpawnRefused, ended_with_nonfinite, move_launcher_run
from trainguard.cli._target import (
    add_module_argument,
    execute,
    module_file,
    module_script_args,
    print_traceback,
    syntax_error,
)
from trainguard.store import MODES, default_name


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run",
        help="record an unmodified training script",
        description="Run a Python script (or -m module) with every op recorded into a run directory.",
        # Everything after the script's name is the script's: its `--n 512` is no abbreviation of
        # trainguard's options (ambiguous between four, argparse stopped before reaching the script).
        allow_abbrev=False,
    )
    p.add_argument("--logdir", help="run directory to write (default: runs/<script>-<time>)")
    p.add_argument("--mode", default="full_health", choices=MODES, help="tensor summary mode (default: full_health)")
    p.add_argument("--buffer", type=int, default=1000,
                   help="keep the last N executions, -1 for all; the first harmful NaN/Inf and its chain are "
                   "always kept (default: 1000)")
    p.add_argument("--ops", help="record only ops whose name matches this regular expression")
    p.add_argument("--dtypes", help="record only executions with an output of these dtypes (comma separated)")
    p.add_argument("--check-numerics", action="store_true",
                   help="stop with an error at the first harmful NaN or Inf, naming where it was made")
    p.add_argument("--strict", action="store_true",
                   help="with --check-numerics: stop at any non-finite output, intended -inf masks included")
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
    p.add_argument("--no-gradcheck", action="store_true",
                   help="with --monitor: do not check custom autograd Functions' gradients")
    p.add_argument("--overwrite", action="store_true", help="replace a run already in --logdir")
    p.add_argument("--resume", action="store_true", help="continue the run already in --logdir (the same command run again after a preemption or a kill): its data stays, this process's steps and executions go after it")
    add_module_argument(p)
    _launch.add_launch_arguments(p)
    p.add_argument("script", nargs="?", help="the script to run")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    p.set_defaults(func=_cmd, parser=p)


_GUARD_DEFAULTS = {"policy": "skip", "spike_factor": None, "snapshot_every": 50, "max_rewinds": 5}


def _default_logdir(name: str) -> Path:
    # Under torchrun every rank must pick the same name: the agent's start time, not this process's.
    return Path("runs") / default_name(Path(name).stem or "run")


def _cmd(args: argparse.Namespace) -> int:
    if args.module:
        target = args.module
        script_args = module_script_args(args)
    else:
        if not args.script:
            raise TrainguardError("give a script to run (trainguard run script.py ARGS) or -m module")
        if not os.path.isfile(args.script):
            raise TrainguardError(f"no such script: {args.script!r}")
        target = args.script
        script_args = list(args.args)
    logdir = Path(args.logdir) if args.logdir else _default_logdir(target.split(".")[-1])
    if _launch.wants_launch(args):
        if args.resume and args.overwrite:
            raise TrainguardError("choose one of --resume and --overwrite")
        return _launch.launch(args.parser, args, logdir.absolute())  # each rank continues its rank-K run
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()] if args.dtypes else None
    if args.every < 1:
        raise TrainguardError(f"--every must be an int >= 1, got {args.every}")
    # What cannot run is refused before the run directory exists: no empty run is left behind.
    source = module_file(target) if args.module else target
    if source is not None and syntax_error(source):
        return 1

    import trainguard as tg
    from trainguard.capture._ending import ending as run_ending

    if not args.guard and any(getattr(args, k) != v for k, v in _GUARD_DEFAULTS.items()):
        raise TrainguardError("--policy, --spike-factor, --snapshot-every and --max-rewinds need --guard")
    if args.guard and args.check_numerics:
        raise TrainguardError("choose one of --guard and --check-numerics")
    from trainguard.store import rank_dir

    # A rank of a job (torchrun's, or --nproc-per-node's) continues its own rank-K run.
    own_run = rank_dir(logdir)
    resumed = None if args.guard else resume_point(own_run, args.resume, args.overwrite)  # the guard appends anyway
    guard = None
    try:
        if args.guard:
            guard = tg.Guard(logdir, policy=args.policy, spike_factor=args.spike_factor,
                             snapshot_every=args.snapshot_every, max_rewinds=args.max_rewinds,
                             overwrite=args.overwrite)
            recorder = None
        elif args.check_numerics:
            recorder = tg.check_numerics(logdir, mode="full_health", buffer=args.buffer, strict=args.strict,
                                         overwrite=args.overwrite)
        else:
            recorder = tg.record(logdir, mode=args.mode, buffer=args.buffer, ops=args.ops, dtypes=dtypes,
                                 overwrite=args.overwrite)
    except ValueError as exc:
        raise TrainguardError(str(exc)) from None

    monitor = None
    old_argv, old_path0 = sys.argv, sys.path[0] if sys.path else None
    # A preempted job gets SIGTERM: turn it into SystemExit so the run is closed properly.
    preemption = Preemption().__enter__()
    code = 0
    error: BaseException | None = None  # what ended the script, stored in the run when it closes
    script_globals: list[dict] = []  # freed when this returns, after the run is closed
    if guard is not None:
        guard.install()
    # What the user ran after `run` (options, script, its arguments): the command that watches every
    # rank of a script that starts its own (Lightning's launcher) adds --nproc-per-node to it.
    children = ChildWatch(rerun=sys.argv[sys.argv.index("run") + 1:] if "run" in sys.argv else None)
    follow = None
    if guard is None:  # torch.multiprocessing.spawn's processes record as this one does, into rank-K
        follow = Follow(Options(
            logdir=str(logdir.absolute()), overwrite=args.overwrite,
            record=None if args.check_numerics else dict(mode=args.mode, buffer=args.buffer, ops=args.ops,
                                                          dtypes=dtypes),
            check_numerics=dict(buffer=args.buffer, strict=args.strict) if args.check_numerics else None,
            monitor=dict(every=args.every, gradcheck=not args.no_gradcheck) if args.monitor else None))
    held = None  # the writer of a run continued (--resume), held until every part of this one is closed
    try:
        if resumed is not None:
            from trainguard.integrations._session import continue_counts
            from trainguard.store import acquire_writer

            held = acquire_writer(own_run, append=True, resume=True, process=recorder is not None)
            if recorder is not None:  # the earlier process's executions and steps keep their numbers
                continue_counts(recorder, own_run)
                recorder.start_step = resumed
        if recorder is not None:
            recorder.start()
        try:
            children.start()
            if follow is not None:
                follow.start()
            if args.monitor:
                monitor = _start_monitor(logdir, args.every, gradcheck=not args.no_gradcheck, start_step=resumed)
            # The script's globals are kept until the run is closed (python keeps them until exit):
            # freeing a DDP model frees its gloo process group, whose destructor joins gloo's
            # thread with the GIL held, and hangs while that thread still has to let go of the last
            # collective's tensors (accelerate's loop on two ranks, right after its last all-gather).
            script_globals.append(execute(target, script_args, module=bool(args.module)))
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            if exc.code is not None and not isinstance(exc.code, int):
                print(exc.code, file=sys.stderr)
            error = exc
        except NonFiniteError as exc:
            err_console.print(f"trainguard: NonFiniteError: {exc}", markup=False, highlight=False, soft_wrap=True)
            code = exc.exit_code
            error = exc
        except Diverged as exc:  # its line was logged at the rewind (and stored); this says how it ended
            err_console.print(f"trainguard: Diverged at step {exc.step}: training stopped", markup=False,
                              highlight=False, soft_wrap=True)
            code = exc.exit_code
            error = exc
        except KeyboardInterrupt as exc:
            code = 130
            error = exc
        except SpawnRefused as exc:  # the script's mp.spawn, refused before any process started
            err_console.print(f"trainguard: {exc}", markup=False, highlight=False, soft_wrap=True)
            code = exc.exit_code
            error = exc
        except BaseException as exc:
            # The script's own traceback, as Python would print it, and Python's exit code.
            print_traceback(exc)
            code = 1
            error = exc
        finally:
            children.stop()
            if follow is not None:
                follow.stop()
            if not (follow is not None and follow.spawned) and (recorder is not None or monitor is not None):
                children.store(logdir)
            ending = run_ending(error)  # before the monitor lets go of the step clock
            # The launcher orders the ranks of a failed job by it: a NonFiniteError says when it
            # was raised (the script's own finally blocks, destroy_process_group, run after it).
            ending["ended_at"] = getattr(error, "raised_at", None) or time.time()
            # Closing the run is not cut short: a SIGTERM now (torchrun's agent stopping the other
            # ranks of a failed job) waits until the run is closed; SIGKILL stays the agent's backstop.
            preemption.closing()
            if monitor is not None:
                monitor.close(error=error)  # its diagnosis sees the crash
            ending["exit_code"] = code
            if code and "status" not in ending:
                ending["status"] = "exited"
            if recorder is not None:
                recorder.stop(**ending)
            if held is not None:
                from trainguard.store import release_writer

                release_writer(held, **ending)
            if guard is not None:
                guard._store_ending(ending)
    finally:
        if guard is not None:
            guard.uninstall()
        sys.argv = old_argv
        if old_path0 is not None and sys.path:
            sys.path[0] = old_path0
        preemption.__exit__()
    code = preemption.code(code)
    if follow is not None and follow.spawned:
        return _spawned_ending(logdir, follow, recorder, own_training=children.backwards > 0, code=code)
    if note := children.note():
        err_console.print(note, markup=False, highlight=False, soft_wrap=True)
    if guard is not None:
        if not (logdir / "run.sqlite").exists() and not any(logdir.glob("rank-*")):
            trained = (f"; it trained ({children.backwards:,} backward() calls) in a loop the guard does not own, "
                       "unwatched: to guard a loop of its own, hold its model, optimizer, scheduler and loader in a "
                       "TrainState and iterate `ckpt.resume(state, total_steps=N).batches()` (docs/guard.md); a "
                       "Hugging Face or Lightning Trainer hands no batch out again: run it with --check-numerics to "
                       "stop at the first harmful NaN/Inf, or --monitor to diagnose it"
                       if children.backwards else "")
            err_console.print("trainguard: the script iterated no `loop.batches()` of ckpt.resume(); nothing was "
                              f"guarded{trained}", highlight=False, soft_wrap=True)
        else:
            err_console.print(f"trainguard: the guard rewound {guard.rewinds} time(s); see `trainguard report {logdir}`",
                              highlight=False, soft_wrap=True)
        return code
    written = Path(recorder.logdir)  # this rank's directory under torch.distributed
    if isinstance(error, NonFiniteError):
        _print_cause(written)
    err_console.print(f"trainguard: recorded {recorder.recorded:,} executions to {written}{_writer_failure(written)}; "
                      f"see `trainguard report {logdir}` or `trainguard ui {logdir}`", highlight=False, soft_wrap=True)
    return code


def _spawned_ending(logdir: Path, follow: Follow, recorder, *, own_training: bool, code: int) -> int:
    """The closing lines of a script that trained in processes started by torch.multiprocessing.spawn."""
    ranks = follow.ranks()
    for rank in ranks:
        if ended_with_nonfinite(rank):
            err_console.print(f"trainguard: {rank.name} stopped at a non-finite value", markup=False, highlight=False)
            _print_cause(rank)
            if code:  # spawn raised the rank's error in the script: exit as check_numerics does
                code = NonFiniteError.exit_code
    own = f"{recorder.recorded:,} executions"
    if own_training:  # this process trained too: its run stays where readers look first
        where = f"this process's own run ({own}) is {logdir}, which readers open instead of the ranks"
    else:
        where = f"this process's own run ({own}) is in {move_launcher_run(logdir) or logdir}"
    names = f"{ranks[0].name}..{ranks[-1].name}" if len(ranks) > 1 else (ranks[0].name if ranks else "no rank")
    n = follow.spawned
    err_console.print(f"trainguard: recorded {n} spawned process{'es' if n > 1 else ''} into {logdir}/{names}; "
                      f"{where}; see `trainguard report {logdir}` or `trainguard ui {logdir}`",
                      markup=False, highlight=False, soft_wrap=True)
    return code


def _print_cause(run_dir: Path) -> None:
    """Why the op check_numerics stopped at made its value, and the fix: the run's origin, as
    `trainguard report` shows it."""
    from trainguard.analysis import origin
    from trainguard.store import open_run

    try:
        with open_run(run_dir) as run:
            o = origin(run)
    except Exception:  # the error line above stands on its own; the report says the rest
        return
    if o is not None:
        lib = o.origin.library
        inside = (f"  inside {lib['path']}:{lib['line']} in {lib['function']}" + (f": {lib['code']}" if lib.get("code")
                  else "") + "\n") if lib else ""
        err_console.print(f"{inside}  why: {o.origin.explanation}\n  fix: {o.suggestion}", markup=False,
                          highlight=False, soft_wrap=True)


def _writer_failure(logdir: Path) -> str:
    """What the run says went wrong while storing it (a full disk), for the closing line."""
    from trainguard.store import open_run
    from trainguard.store._writer import writer_failure

    try:
        with open_run(logdir) as run:
            error, lost = run.meta.get("writer_error"), run.meta.get("lost")
    except TrainguardError as exc:
        error, lost = f"the run cannot be read back: {exc}", None
    if not error:  # the disk may have been too full for the run to say it
        error, lost = writer_failure(logdir) or (None, None)
    if not error:
        return ""
    return f", but {error}" + (f"; {lost:,} executions were not stored" if lost else "")


def _start_monitor(logdir: Path, every: int, gradcheck: bool = True, start_step: int | None = None):
    try:
        from trainguard._wiring import Monitor
    except ImportError:
        raise TrainguardError("--monitor needs the monitor, which this installation lacks") from None
    from trainguard.integrations import watch_frameworks

    monitor = Monitor(None, logdir=logdir, every=every, gradcheck=gradcheck, append=start_step is not None,
                      start_step=start_step)
    watch_frameworks(monitor)  # Lightning / HF Trainer scripts: the framework's steps
    return monitor
