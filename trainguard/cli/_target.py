"""What ``trainguard run`` and ``trainguard monitor`` run: a script, or ``-m module`` as ``python -m``."""

from __future__ import annotations

import argparse
import importlib.util
import os


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
