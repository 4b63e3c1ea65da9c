"""The error hierarchy. The CLI maps these to exit codes and the UI to HTTP status codes."""

from __future__ import annotations

import time


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
        # When it was raised (time.time()): under torch.distributed the other ranks fail soon
        # after, in collectives this rank left, and ``trainguard run --nproc-per-node`` names
        # the rank that ended first by this.
        self.raised_at = time.time()


class Diverged(TrainguardError):
    """Raised by :class:`trainguard.Guard` when training cannot go on: the policy is ``"stop"``, a
    fault follows the code rather than the data, or ``max_rewinds`` is spent.

    ``step`` is the failing step, ``origin`` the :class:`trainguard.analysis.Origin` of its first
    harmful value (None for a loss spike or when the replay did not reproduce it), ``event`` the
    guard event as stored in the run. The train state is left at the last verified snapshot.
    """

    exit_code = 3

    def __init__(self, message: str, *, step: int | None = None, origin: object = None, event: dict | None = None):
        super().__init__(message)
        self.step = step
        self.origin = origin
        self.event = event or {}
        self.raised_at = time.time()  # as NonFiniteError's: the launcher orders failed ranks by it
