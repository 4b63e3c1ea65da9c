"""``trainguard monitor script.py ARGS`` and ``trainguard diagnose RUN``.

``monitor`` runs an unmodified training script (or ``-m module``) under :class:`trainguard.Monitor` (attached to
every top-level model the script calls), then diagnoses the run, stores the findings in it and
prints them. ``diagnose`` judges an existing run again, optionally with other thresholds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from trainguard._errors import TrainguardError
from trainguard.cli import _launch
from trainguard.cli._children import ChildWatch
from trainguard.cli._preempt import Preemption, resume_point
from trainguard.cli._render import err_console
from trainguard.cli._spawned import Follow, Options, SpawnRefused, move_launcher_run
from trainguard.cli._target import (
    add_module_argument,
    execute,
    module_file,
    module_script_args,
    print_traceback,
    syntax_error,
)
from trainguard.store import default_name


def add_parser(sub) -> None:
    p = sub.add_parser(
        "monitor",
        help="run a training script under the health monitor and print the diagnosis",
        description="Run SCRIPT with ARGS (or -m MODULE ARGS) under trainguard.Monitor, then diagnose the run and "
        "print the findings.",
        allow_abbrev=False,  # the script's options are its own (see _run)
    )
    p.add_argument("--logdir", default=None, help="run directory (default: runs/monitor-<date>-<time>)")
    p.add_argument("--every", type=int, default=10, help="record layer statistics every N steps (default 10)")
    p.add_argument("--histograms", action="store_true", help="also record histograms of every layer")
    p.add_argument("--overwrite", action="store_true", help="replace a run already in --logdir")
    p.add_argument("--resume", action="store_true", help="continue the run already in --logdir (the same command run again after a preemption or a kill): its data stays, this process's steps and executions go after it")
    p.add_argument("--json", action="store_true", help="print the findings as JSON")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="override a threshold")
    p.add_argument("--no-gradcheck", action="store_true",
                   help="do not check custom autograd Functions' gradients against finite differences")
    add_module_argument(p)
    _launch.add_launch_arguments(p)
    p.add_argument("script", nargs="?", help="the training script")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    p.set_defaults(func=_cmd_monitor, parser=p)

    d = sub.add_parser(
        "diagnose",
        help="judge a run's training health and print the findings",
        description="Run the diagnosis rules over RUN (per-step scalars and layer statistics).",
    )
    d.add_argument("run", help="run directory")
    d.add_argument("--json", action="store_true", help="print the findings as JSON")
    d.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="override a threshold")
    d.add_argument("--write", action="store_true", help="store the findings in the run (replacing the monitor's)")
    d.add_argument("--list-thresholds", action="store_true", help="print the thresholds and their reasons")
    d.set_defaults(func=_cmd_diagnose)


def parse_overrides(items: list[str]) -> dict[str, float]:
    """``["loss_spike_ratio=4", ...]`` -> ``{"loss_spike_ratio": 4.0}``, names checked against the thresholds."""
    from trainguard.analysis import Thresholds

    out: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep:
            raise TrainguardError(f"--set needs NAME=VALUE, got {item!r}")
        try:
            out[name.strip()] = float(value)
        except ValueError:
            raise TrainguardError(f"--set {name.strip()}: value must be a number, got {value!r}") from None
    try:
        Thresholds.from_overrides(out)
    except ValueError as exc:
        raise TrainguardError(str(exc)) from None
    return out


def run_script(script: str, args: list[str], module: bool = False) -> tuple[int, BaseException | None]:
    """Run a Python script (``module``: the module named ``script``) as ``__main__`` with ``sys.argv``
    and ``sys.path`` as Python would.

    Returns (exit code, the exception that ended it or None); the script's exceptions are
    reported, not raised.
    """
    path = Path(script)
    if not module and not path.is_file():
        raise TrainguardError(f"no such script: {script!r}")
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    try:
        execute(script, args, module=module)
        return 0, None
    except SystemExit as exc:
        code = exc.code
        if code is None:
            return 0, None
        return (code if isinstance(code, int) else 1), exc
    except (KeyboardInterrupt, SpawnRefused):  # SpawnRefused: one line, from the CLI
        raise
    except BaseException as exc:  # the script's own error: keep its traceback, still diagnose
        print_traceback(exc)
        return 1, exc
    finally:
        sys.argv = saved_argv
        sys.path[:] = saved_path


def monitor_script(
    script: str,
    args: list[str],
    *,
    logdir: str | os.PathLike | None = None,
    every: int = 10,
    histograms: bool = False,
    thresholds: dict | None = None,
    overwrite: bool = False,
    gradcheck: bool = True,
    resume: bool = False,
    module: bool = False,
):
    """Run ``script`` (``module``: the module named ``script``, as ``python -m``) under a Monitor attached to whatever models it trains; return (exit code, the
    run directory, the findings). Processes the script starts with torch.multiprocessing.spawn are
    monitored too, each into ``rank-K``, and the findings are then the ranks' (see ``_spawned``).
    ``resume``: continue the run already in ``logdir`` (see :func:`_preempt.resume_point`)."""
    from trainguard._wiring import Monitor
    from trainguard.capture._ending import ending
    from trainguard.integrations import watch_frameworks
    from trainguard.store import acquire_writer, rank_dir, release_writer

    # A rank of a job (torchrun's, or --nproc-per-node's) continues its own rank-K run.
    own_run = rank_dir(logdir) if logdir is not None else None
    resumed = resume_point(own_run, resume, overwrite) if own_run is not None else None
    # A run continued: its writer takes the run over (status running again), held until the end.
    held = acquire_writer(own_run, append=True, resume=True) if resumed is not None else None
    try:
        mon = Monitor(None, logdir, every, histograms=True if histograms else None, thresholds=thresholds,
                      overwrite=overwrite, gradcheck=gradcheck, append=resumed is not None, start_step=resumed)
    except BaseException:
        if held is not None:
            release_writer(held)
        raise
    watch_frameworks(mon)  # Lightning / HF Trainer scripts: the framework's steps
    follow = Follow(Options(logdir=str(Path(mon.logdir).absolute()), overwrite=overwrite, monitor=dict(
        every=every, histograms=True if histograms else None, thresholds=thresholds, gradcheck=gradcheck)))
    error = None
    # A preempted job's SIGTERM ends the script (exit code 143), not the process: the diagnosis
    # is still made and stored, and the run says how it ended.
    with Preemption() as preemption:
        try:
            target = ["-m", script] if module else [script]
            with ChildWatch(rerun=["--monitor", "--logdir", str(mon.logdir), *target, *args]) as children:
                follow.start()
                try:
                    code, error = run_script(script, args, module)
                finally:
                    follow.stop()
            if not follow.spawned:
                children.store(mon.logdir)
        finally:
            preemption.closing()
            mon.close(error=error)
            if held is not None:
                release_writer(held, **ending(error))
    code = preemption.code(code)
    findings = mon.findings if mon.findings is not None else []
    if follow.spawned and not children.backwards:
        from trainguard.analysis import diagnose
        from trainguard.store import open_run

        move_launcher_run(Path(mon.logdir))
        n = follow.spawned
        err_console.print(f"trainguard: monitored {n} spawned process{'es' if n > 1 else ''} into "
                          f"{mon.logdir}/rank-K; the findings below are theirs", markup=False, highlight=False,
                          soft_wrap=True)
        try:
            with open_run(mon.logdir) as run:
                findings = diagnose(run)
        except TrainguardError as exc:  # no rank wrote a run (every process died at its start)
            err_console.print(f"trainguard: {exc}", markup=False, highlight=False, soft_wrap=True)
    elif note := children.note():
        err_console.print(note, markup=False, highlight=False, soft_wrap=True)
    return code, mon.logdir, findings


def _print_findings(findings, as_json: bool, header: str | None = None) -> None:
    from trainguard.cli._findings_view import findings_json, render_findings
    from trainguard.cli._render import console

    if as_json:
        sys.stdout.write(json.dumps(findings_json(findings), indent=2) + "\n")
        return
    if header:
        console.print(header, highlight=False)
    render_findings(console, findings)


def _cmd_monitor(args) -> int:
    thresholds = parse_overrides(args.set) or None  # a bad name fails before the script runs
    if args.module:
        target, script_args = args.module, module_script_args(args)
    elif not args.script:
        raise TrainguardError("give a script to run (trainguard monitor script.py ARGS) or -m module")
    else:
        target, script_args = args.script, list(args.args)
        if not os.path.isfile(target):
            raise TrainguardError(f"no such script: {target!r}")
    # What cannot run is refused before the run directory exists, as `trainguard run` does.
    source = module_file(target) if args.module else target
    if source is not None and syntax_error(source):
        return 1
    if _launch.wants_launch(args):  # torchrun's agent here: each rank monitors into LOGDIR/rank-K
        if args.resume and args.overwrite:
            raise TrainguardError("choose one of --resume and --overwrite")
        logdir = Path(args.logdir) if args.logdir else Path("runs") / default_name("monitor")
        return _launch.launch(args.parser, args, logdir.absolute(), command="monitor")
    code, logdir, findings = monitor_script(
        target,
        script_args,
        logdir=args.logdir,
        every=args.every,
        histograms=args.histograms,
        thresholds=thresholds,
        overwrite=args.overwrite,
        gradcheck=not args.no_gradcheck,
        resume=args.resume,
        module=bool(args.module),
    )
    _print_findings(findings, args.json, header=None if args.json else f"[bold]run[/] {logdir}")
    return code


def _cmd_diagnose(args) -> int:
    from trainguard.analysis import Thresholds, diagnose
    from trainguard.store import open_run

    overrides = parse_overrides(args.set)
    if args.list_thresholds:
        from trainguard.cli._findings_view import render_thresholds
        from trainguard.cli._render import console

        render_thresholds(console, Thresholds.from_overrides(overrides))
        return 0
    with open_run(args.run) as run:
        findings = diagnose(run, thresholds=overrides or None)
        path = run.path
    if args.write:
        from trainguard.store import acquire_writer, release_writer

        writer = acquire_writer(path, append=True)
        try:
            writer.add_findings("monitor", [f.to_dict() for f in findings], replace=True)
        finally:
            release_writer(writer)
    _print_findings(findings, args.json)
    return 0
