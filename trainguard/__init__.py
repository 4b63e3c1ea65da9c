"""trainguard: make PyTorch training observable, diagnosable and crash-proof.

Record every op and trace the first NaN (``record``, ``check_numerics``), read a run back
(``open``), diagnose training health (``Monitor``, ``doctor``), and checkpoint and resume
exactly (``TrainState``, ``CheckpointManager``).
"""

from __future__ import annotations

__version__ = "0.1.0"

from trainguard._errors import (
    CheckpointError,
    CorruptRun,
    NonFiniteError,
    RunNotFound,
    SchemaTooNew,
    TrainguardError,
)

__all__ = [
    "CheckpointError",
    "CorruptRun",
    "NonFiniteError",
    "RunNotFound",
    "SchemaTooNew",
    "TrainguardError",
    "__version__",
]
