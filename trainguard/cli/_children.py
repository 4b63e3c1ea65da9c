"""Processes a script starts to train in: trainguard watches the process it runs, not those.

pytorch/examples' mnist_hogwild trains in ``multiprocessing`` children only: under ``trainguard run`` or
``trainguard monitor`` the parent then records no step, and without a word the run would look
like one that trained too little. (``torch.multiprocessing.spawn``'s processes are followed, see
``_spawned``; these are the others.) :class:`ChildWatch` counts the processes the script starts
(DataLoader workers aside) and the ``backward()`` passes of its own process, and says so when
every backward ran elsewhere. PyTorch Lightning's DDP launcher on a script starts each further rank
as ``python script.py ...`` with its LOCAL_RANK (``subprocess.Popen``) and trains rank 0 itself:
ChildWatch counts those ranks too, and says that only this process was watched.
"""

from __future__ import annotations

import multiprocessing.process
import os
import shlex
import subprocess
import sys

# Targets of child processes that never train: DataLoader workers.
_NOT_TRAINING = ("torch.utils.data._utils.worker",)


class ChildWatch:
    """Counts, from ``start()`` to ``stop()``, the child processes started and this process's
    outermost ``backward()`` calls. ``rerun``: the ``trainguard run`` arguments (options, script and
    its arguments) that would watch every rank with ``--nproc-per-node`` added."""

    def __init__(self, rerun: list[str] | None = None) -> None:
        self.rerun = rerun
        self.started = 0
        self.backwards = 0
        self.ranks = 0  # copies of the script started as further ranks (Lightning's DDP launcher)
        self.world: str | None = None
        self.script = "script.py"
        self._original = None
        self._popen = None

    def __enter__(self) -> ChildWatch:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        self._original = original = multiprocessing.process.BaseProcess.start
        watch = self

        def start(process, *args, **kwargs):
            target = getattr(process, "_target", None)
            if getattr(target, "__module__", None) not in _NOT_TRAINING:
                watch.started += 1
            return original(process, *args, **kwargs)

        multiprocessing.process.BaseProcess.start = start
        self._popen = popen_init = subprocess.Popen.__init__

        def init(popen, *args, **kwargs):
            env = kwargs.get("env")
            command = args[0] if args else kwargs.get("args")
            if _is_rank_of_this_script(command, os.environ if env is None else env):
                watch.ranks += 1
                watch.world = (env or os.environ).get("WORLD_SIZE")
                watch.script = os.path.basename(sys.argv[0]) or watch.script
            return popen_init(popen, *args, **kwargs)

        subprocess.Popen.__init__ = init
        from trainguard.capture import _monitor_tap  # imports torch: not before a script runs

        _monitor_tap.add_listener("after_backward", self._on_backward)

    def stop(self) -> None:
        if self._original is None:
            return
        multiprocessing.process.BaseProcess.start, self._original = self._original, None
        subprocess.Popen.__init__, self._popen = self._popen, None
        from trainguard.capture import _monitor_tap

        _monitor_tap.remove_listener("after_backward", self._on_backward)

    def _on_backward(self, *args) -> None:
        self.backwards += 1

    def untraced(self) -> int:
        """How many child processes trained unwatched: those started, when this process ran no
        ``backward()`` itself (0 otherwise)."""
        return 0 if self.ranks or self.backwards else self.started

    def store(self, logdir) -> None:
        """Say in the run (before the monitor's diagnosis reads it) that the training ran in
        child processes, so that ``trainguard report`` says so later too."""
        n = self.untraced()
        if not n:
            return
        from trainguard.store import acquire_writer, release_writer

        writer = acquire_writer(logdir)
        try:
            writer.set_meta(untraced_children=n)
        finally:
            release_writer(writer)

    def note(self) -> str | None:
        """The line to print when the script's training ran in its children, else None."""
        if self.ranks:
            n = self.ranks
            world = self.world if self.world and self.world.isdigit() else str(n + 1)
            return (f"trainguard: the script started {n} more rank{'s' if n > 1 else ''} as new processes running "
                    "itself (as PyTorch Lightning's DDP launcher does): trainguard watched this process, rank 0, "
                    f"only. Watch every rank with `{self._rerun(world)}` "
                    "(torchrun starts the ranks, and Lightning uses them)")
        if not self.started or self.backwards:
            return None
        n = self.started
        return (f"trainguard: the script started {n} child process{'es' if n > 1 else ''} and ran no backward() "
                "itself: trainguard watched this process only (it follows torch.multiprocessing.spawn's "
                "processes, not these). Start DDP ranks with `trainguard run --nproc-per-node N script.py` "
                "(torchrun) or torch.multiprocessing.spawn, or open trainguard.record / trainguard.Monitor "
                "inside the function each process runs")


    def _rerun(self, world: str) -> str:
        rest = self.rerun if self.rerun is not None else [self.script]
        return shlex.join(["trainguard", "run", "--nproc-per-node", world, *rest])


def _is_rank_of_this_script(args, env) -> bool:
    """A command that runs this Python again as another local rank: ``[python, ...]`` with a
    LOCAL_RANK of its own in its environment."""
    if not isinstance(args, (list, tuple)) or not args:
        return False
    rank = env.get("LOCAL_RANK")
    if rank is None or rank == os.environ.get("LOCAL_RANK"):
        return False
    exe = os.fspath(args[0])
    return exe == sys.executable or os.path.basename(exe).startswith("python")
