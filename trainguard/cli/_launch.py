"""``trainguard run|monitor --nproc-per-node N [options] script.py``: torchrun's elastic agent, started here.

The agent (``torch.distributed.run``, the code behind ``torchrun``) starts one worker per rank;
each worker runs ``python -m trainguard run`` (or ``monitor``) with the same trainguard options and
writes its own ``logdir/rank-K``. The launch options are torchrun's own, parsed by torchrun's parser; the
worker's command line is passed to the agent as it is, never through that parser (which reads
``--monitor`` as an ambiguous abbreviation of its ``--monitor-interval``).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from trainguard._errors import TrainguardError

# trainguard run option dest -> torchrun option. Values pass through unchanged.
LAUNCH_OPTIONS = {
    "nproc_per_node": "--nproc-per-node",
    "nnodes": "--nnodes",
    "node_rank": "--node-rank",
    "master_addr": "--master-addr",
    "master_port": "--master-port",
    "rdzv_backend": "--rdzv-backend",
    "rdzv_endpoint": "--rdzv-endpoint",
    "rdzv_id": "--rdzv-id",
    "max_restarts": "--max-restarts",
    "shutdown_timeout": "--shutdown-timeout",
}


def add_launch_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "distributed launch",
        "start torchrun's elastic agent here: one worker per rank, each recording into LOGDIR/rank-K",
    )
    g.add_argument("--nproc-per-node", metavar="N",
                   help="workers (ranks) per node, as torchrun's --nproc-per-node (an int, gpu, cpu or auto)")
    g.add_argument("--nnodes", metavar="N[:M]", help="number of nodes (default 1: a standalone rendezvous)")
    g.add_argument("--node-rank", type=int, help="this node's rank (static rendezvous)")
    g.add_argument("--master-addr", help="rank 0's address (static rendezvous)")
    g.add_argument("--master-port", type=int, help="rank 0's port (static rendezvous)")
    g.add_argument("--rdzv-backend", help="rendezvous backend (e.g. c10d)")
    g.add_argument("--rdzv-endpoint", help="rendezvous endpoint host:port")
    g.add_argument("--rdzv-id", help="rendezvous (job) id")
    g.add_argument("--max-restarts", type=int, help="restarts of the worker group after a failure (default 0)")
    g.add_argument("--shutdown-timeout", type=int,
                   help="seconds workers get to save and exit after SIGTERM before SIGKILL (torchrun's default 30)")


def wants_launch(args: argparse.Namespace) -> bool:
    return any(getattr(args, dest, None) is not None for dest in LAUNCH_OPTIONS)


def worker_argv(parser: argparse.ArgumentParser, args: argparse.Namespace, logdir: Path) -> list[str]:
    """The ``trainguard run`` command line each worker gets: every option the user gave, except
    the launch options, with the logdir fixed here so that every rank (and node) agrees on it."""
    out = [f"--logdir={logdir}"]
    for action in parser._actions:
        if not action.option_strings or action.dest in LAUNCH_OPTIONS or action.dest in ("help", "logdir", "module"):
            continue
        value = getattr(args, action.dest, action.default)
        if value == action.default:
            continue
        flag = max(action.option_strings, key=len)
        if action.nargs == 0:  # store_true / store_false / store_const
            out.append(flag)
        elif isinstance(value, list):
            for item in value:
                out.append(f"{flag}={item}")
        else:
            out.append(f"{flag}={value}")
    if getattr(args, "module", None):
        out += ["-m", args.module, *(getattr(args, "module_args", None) or [])]
    if args.script:
        out.append(args.script)
    return out + list(args.args)


def launch(parser: argparse.ArgumentParser, args: argparse.Namespace, logdir: Path, command: str = "run") -> int:
    """Run the elastic agent in this process until every worker ends, each running ``trainguard
    COMMAND``; return the job's exit code."""
    if "LOCAL_RANK" in os.environ:
        raise TrainguardError("--nproc-per-node starts torchrun's agent: do not give it under torchrun "
                              "(each rank is already a worker)")
    try:
        from torch.distributed import run as torchrun
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    except ImportError as exc:  # a torch built without distributed support
        raise TrainguardError(f"--nproc-per-node needs torch.distributed: {exc}") from None
    launch_argv: list[str] = []
    for dest, flag in LAUNCH_OPTIONS.items():
        value = getattr(args, dest, None)
        if value is not None:
            launch_argv += [flag, str(value)]
    if args.nnodes in (None, "1", "1:1") and not (args.rdzv_endpoint or args.master_addr or args.master_port):
        launch_argv.append("--standalone")  # one node: a free port, a fresh job id
    try:
        targs = torchrun.parse_args(launch_argv + ["-m", "trainguard"])
    except SystemExit as exc:  # torchrun's parser already printed why
        raise TrainguardError(f"torchrun refused the launch options {' '.join(launch_argv)}") from exc
    targs.training_script_args = [command, *worker_argv(parser, args, logdir)]
    try:
        torchrun.run(targs)
    except ChildFailedError as exc:
        first, _ = exc.get_first_failure()
        rank, code = first_to_end(_attempt_dir(logdir, args.max_restarts or 0), {
            r: f.exitcode for r, f in exc.failures.items()}, fallback=first)
        from trainguard.cli._render import err_console

        err_console.print(f"trainguard: rank {rank} ended first, with exit code {code}; the job's run is {logdir}",
                          highlight=False, soft_wrap=True)
        return 128 - code if code < 0 else code  # a worker killed by signal N reports -N
    except SignalException as exc:  # the agent was told to stop: workers got the signal and saved
        return 128 + int(exc.sigval)
    except (ValueError, RuntimeError, AssertionError) as exc:  # e.g. an unusable rendezvous endpoint
        raise TrainguardError(f"cannot launch the workers: {exc}") from None
    return 0


def _attempt_dir(logdir: Path, max_restarts: int) -> Path:
    """The run directory of the worker group's last attempt (see store.rank_dir)."""
    for n in range(max_restarts, 0, -1):
        d = logdir.with_name(f"{logdir.name}-restart{n}")
        if d.is_dir():
            return d
    return logdir


def first_to_end(logdir: Path, failed: dict[int, int], fallback: int) -> tuple[int, int]:
    """Of the ranks that failed (rank -> exit code as the agent saw it), the one whose script
    ended first, and the exit code it ended with.

    torch's agent times a failure in whole seconds, when it polls, so a rank that stopped at a
    NaN and the rank whose all-reduce then broke because the first one left fall in the same
    second. Each worker's run stores when its script ended (``ended_at``, its own clock: one
    node, one clock) and with which code: the agent may have sent SIGTERM to a rank that was
    still closing its run after its script ended. ``fallback`` (torch's pick) and the agent's
    codes stand when a failed rank's run does not say.
    """
    from trainguard.store import open_run

    ended: dict[int, tuple[float, int]] = {}
    for rank, agent_code in failed.items():
        try:
            with open_run(logdir / f"rank-{rank}") as run:
                when, code = run.meta.get("ended_at"), run.meta.get("exit_code")
        except TrainguardError:
            break
        if not isinstance(when, (int, float)):
            break
        ended[rank] = (float(when), code if isinstance(code, int) and code else agent_code)
    else:
        if ended:
            rank = min(ended, key=lambda r: (ended[r][0], r))
            return rank, ended[rank][1]
    return fallback, failed[fallback]
