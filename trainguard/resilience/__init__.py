"""Survive crashes, preemption and damaged files: checkpoint the whole training state and resume exactly.

* :class:`TrainState` gathers the model, optimizer, scheduler, scaler, loaders, generators and
  every process-wide RNG.
* :class:`CheckpointManager` writes atomic, verified checkpoints, keeps N, restores the newest
  valid one, and runs the resumable loop (:meth:`CheckpointManager.resume`).
* :func:`list_checkpoints` is the light listing the CLI and the UI use.

A checkpoint directory holds ``step-<N>/`` folders; a run directory may keep them in a
``checkpoints/`` subfolder, where ``trainguard ckpt`` and the UI look. See docs/checkpointing.md.
"""

from __future__ import annotations

from trainguard.resilience._format import CheckpointInfo, list_checkpoints
from trainguard.resilience._loader import ResumableLoader
from trainguard.resilience._loop import Preempted, ResumeLoop
from trainguard.resilience._manager import CheckpointFallbackWarning, CheckpointManager, CheckpointPolicy
from trainguard.resilience._state import TrainState

__all__ = [
    "CheckpointFallbackWarning",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointPolicy",
    "Preempted",
    "ResumableLoader",
    "ResumeLoop",
    "TrainState",
    "list_checkpoints",
]
