"""trainguard: make PyTorch training observable, diagnosable and crash-proof.

Record every op and trace the first NaN (``record``, ``check_numerics``), read a run back
(``open``), diagnose training health (``Monitor``, ``doctor``), and checkpoint and resume
exactly (``TrainState``, ``CheckpointManager``), and guard a run against NaNs and loss spikes
(``Guard``).

Names that need torch are imported on first use, so ``import trainguard`` (and the reader,
the report and the web UI) stay fast.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

from trainguard._errors import (
    CheckpointError,
    CorruptRun,
    Diverged,
    NonFiniteError,
    RunNotFound,
    SchemaTooNew,
    TrainguardError,
)
from trainguard.store import open_run as open  # noqa: A001 - ``trainguard.open(logdir)`` is the API

# public name -> (module, attribute); attribute None means the module itself.
_LAZY: dict[str, tuple[str, str | None]] = {
    "record": ("trainguard.capture", "record"),
    "enable": ("trainguard.capture", "enable"),
    "disable": ("trainguard.capture", "disable"),
    "step": ("trainguard.capture", "step"),
    "check_numerics": ("trainguard.capture", "check_numerics"),
    "compile_backend": ("trainguard.capture", "compile_backend"),
    "CheckpointFallbackWarning": ("trainguard.resilience", "CheckpointFallbackWarning"),
    "CheckpointInfo": ("trainguard.resilience", "CheckpointInfo"),
    "CheckpointManager": ("trainguard.resilience", "CheckpointManager"),
    "CheckpointPolicy": ("trainguard.resilience", "CheckpointPolicy"),
    "Preempted": ("trainguard.resilience", "Preempted"),
    "ResumableLoader": ("trainguard.resilience", "ResumableLoader"),
    "ResumeLoop": ("trainguard.resilience", "ResumeLoop"),
    "TrainState": ("trainguard.resilience", "TrainState"),
    "list_checkpoints": ("trainguard.resilience", "list_checkpoints"),
    "doctor": ("trainguard.doctor", None),
    "Monitor": ("trainguard._wiring", "Monitor"),
    "Guard": ("trainguard.guard", "Guard"),
    "fix": ("trainguard.fix", None),
}

__all__ = [
    "CheckpointError",
    "CheckpointFallbackWarning",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointPolicy",
    "CorruptRun",
    "Diverged",
    "Guard",
    "Monitor",
    "NonFiniteError",
    "Preempted",
    "ResumableLoader",
    "ResumeLoop",
    "RunNotFound",
    "SchemaTooNew",
    "TrainState",
    "TrainguardError",
    "__version__",
    "check_numerics",
    "compile_backend",
    "disable",
    "doctor",
    "enable",
    "fix",
    "list_checkpoints",
    "open",
    "record",
    "step",
]


def __getattr__(name: str) -> Any:
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'trainguard' has no attribute {name!r}")
    module = importlib.import_module(target[0])
    value = module if target[1] is None else getattr(module, target[1])
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
