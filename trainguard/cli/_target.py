"""What ``trainguard run`` and ``trainguard monitor`` run: a script, or ``-m module`` as ``python -m``."""

from __future__ import annotations

import argparse
import importlib.util
import os
import runpy
import sys
import traceback
from typing import Any


class ModuleAction(argparse.Action):
    """``-m MODULE ARGS``: as ``python -m``, everything after the module's name is the module's
    (``--depth=2`` included); a ``--`` there still ends trainguard's options, as it did."""

    def __call__(self, parser, namespace, values, option_string=None):
        values = list(values or [])
        namespace.module = values[0] if values else None
        namespace.module_args = values[1:]


def add_module_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", dest="module", nargs=argparse.REMAINDER, action=ModuleAction, metavar="MODULE ...",
                   help="run a module as a script (like python -m); what follows its name is the module's arguments")


def module_args(args: argparse.Namespace) -> list[str]:
    """The arguments given right after ``-m MODULE``, before any ``--``."""
    return list(getattr(args, "module_args", None) or [])


def module_script_args(args: argparse.Namespace) -> list[str]:
    """A module's arguments: those after its name, then any the parser took as a script and its arguments."""
    return module_args(args) + ([args.script] if args.script else []) + list(args.args)


def module_file(name: str) -> str | None:
    """The source file ``-m name`` would run (None when it has none); TrainguardError if there is no such module."""
    from trainguard._errors import TrainguardError

    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        raise TrainguardError(f"no module named {name!r}")
    if spec.submodule_search_locations is not None:  # a package runs its __main__
        try:
            spec = importlib.util.find_spec(f"{name}.__main__")
        except ImportError:
            spec = None
        if spec is None:
            raise TrainguardError(f"{name!r} is a package and cannot be run directly (it has no __main__)")
    origin = spec.origin
    return origin if origin and origin.endswith(".py") and os.path.isfile(origin) else None


def execute(target: str, args: list[str], *, module: bool) -> dict[str, Any]:
    """Run ``target`` as ``__main__`` with ``sys.argv`` and ``sys.path[0]`` as ``python target args``
    (``module``: ``python -m target args``) sets them; return the globals it ended with. Its
    exceptions, ``SystemExit`` included, reach the caller, which restores ``sys.argv`` and ``sys.path``."""
    sys.argv = [target] + list(args)
    if module:
        return runpy.run_module(target, run_name="__main__", alter_sys=True)
    path = os.path.abspath(target)  # python names the script absolutely too
    sys.path[0:1] = [os.path.dirname(path)]
    return runpy.run_path(path, run_name="__main__")


# Frames of the runners (cli/_run.py, cli/_monitor.py, this module, runpy) before the script's own.
_HERE = os.path.dirname(os.path.abspath(__file__))
_RUNNER_FILES = frozenset({os.path.join(_HERE, name) for name in ("_run.py", "_monitor.py", "_target.py")}
                          | {"<frozen runpy>", os.path.abspath(runpy.__file__)})


def print_traceback(exc: BaseException) -> None:
    """The script's traceback as ``python script.py`` prints it: its own frames, not the runner's."""
    tb = exc.__traceback__
    while tb is not None and (tb.tb_frame.f_code.co_filename in _RUNNER_FILES
                              or os.path.abspath(tb.tb_frame.f_code.co_filename) in _RUNNER_FILES):
        tb = tb.tb_next
    traceback.print_exception(type(exc), exc, tb if tb is not None else exc.__traceback__)


def syntax_error(path: str) -> bool:
    """Print a syntax error in ``path`` as ``python path`` would, and say whether there was one."""
    try:
        with open(path, "rb") as fh:
            compile(fh.read(), os.path.abspath(path), "exec", dont_inherit=True)
    except SyntaxError as exc:
        sys.stderr.write("".join(traceback.format_exception_only(type(exc), exc)))
        return True
    except (OSError, ValueError):
        return False  # runpy reports it, as python would
    return False
