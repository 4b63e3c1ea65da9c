"""The ``trainguard`` command line. Each subcommand lives in its own private module.

Every subcommand module exposes ``add_parser(subparsers)``, which registers the command and
sets ``func`` (called with the parsed namespace, returns the exit code).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from trainguard._errors import TrainguardError

# Subcommand modules, in the order ``trainguard --help`` lists them.
_COMMANDS = ["_run", "_report", "_demo", "_ckpt", "_doctor", "_monitor", "_export", "_ui"]


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trainguard",
        description="Record, diagnose and checkpoint PyTorch training.",
    )
    from trainguard import __version__

    parser.add_argument("--version", action="version", version=f"trainguard {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMANDS:
        try:
            module = importlib.import_module(f"trainguard.cli.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"trainguard.cli.{name}":
                continue  # not built yet
            raise
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except TrainguardError as exc:
        from trainguard.cli._render import error

        error(str(exc))
        return exc.exit_code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
