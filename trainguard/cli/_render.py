"""Shared terminal rendering helpers (rich)."""

from __future__ import annotations

import sys

from rich.console import Console

console = Console()
err_console = Console(stderr=True)


def error(message: str) -> None:
    """Print one clear line to stderr: no traceback for a bad input."""
    # The message is plain text; keep rich from interpreting square brackets.
    err_console.print(f"trainguard: error: {message}", markup=False, highlight=False, soft_wrap=True)


def is_tty() -> bool:
    return sys.stdout.isatty()
