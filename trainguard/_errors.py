"""The error hierarchy. The CLI maps these to exit codes and the UI to HTTP status codes."""

from __future__ import annotations


class TrainguardError(Exception):
    """Base class of every error trainguard raises on purpose.

    ``exit_code`` is what the command line exits with; ``http_status`` what the UI answers.
    """

    exit_code = 2
    http_status = 400


class RunNotFound(TrainguardError):
    """The path is missing, empty, or holds no trainguard run."""

    http_status = 404


class CorruptRun(TrainguardError):
    """The run exists but its database cannot be read (truncated, damaged, not SQLite)."""

    http_status = 422


class SchemaTooNew(CorruptRun):
    """The run was written by a newer trainguard whose format this version cannot read."""


class CheckpointError(TrainguardError):
    """A checkpoint cannot be written, verified or restored into the given state."""


class NonFiniteError(TrainguardError, FloatingPointError):
    """Raised by ``check_numerics`` at the first harmful NaN or Inf (``strict=True``: any)."""

    exit_code = 3

    def __init__(self, message: str, *, execution: dict | None = None):
        super().__init__(message)
        self.execution = execution or {}
