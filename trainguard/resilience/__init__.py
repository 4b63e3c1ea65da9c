"""Survive crashes, preemption and damaged files: checkpoint the whole training state and resume exactly.

* :class:`TrainState` gathers the model, optimizer, scheduler, scaler, loaders, generators and
  every process-wide RNG.
* :class:`CheckpointManager` writes atomic, verified checkpoints, keeps N, restores the newest
  valid one, and runs the resumable loop (:meth:`CheckpointManager.resume`).
* :class:`MemorySnapshot` keeps the same state in host memory (what the guard rewinds to).
* :func:`list_checkpoints` is the light listing the CLI and the UI use; it needs no torch, and
  the names that do are imported on first use.

A checkpoint directory holds ``step-<N>/`` folders; a run directory may keep them in a
``checkpoints/`` subfolder, where ``trainguard ckpt`` and the UI look. See docs/checkpointing.md.
"""

from __future__ import annotations

import importlib
from typing import Any

from trainguard.resilience._format import CheckpointInfo, list_checkpoints

# public name -> private module that defines it (these import torch)
_LAZY = {
    "CheckpointFallbackWarning": "_manager",
    "CheckpointManager": "_manager",
    "CheckpointPolicy": "_manager",
    "MemorySnapshot": "_memory",
    "Preempted": "_loop",
    "ResumableLoader": "_loader",
    "ResumeLoop": "_loop",
    "TrainState": "_state",
    "set_default_guard": "_loop",
}

__all__ = [
    "CheckpointFallbackWarning",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointPolicy",
    "MemorySnapshot",
    "Preempted",
    "ResumableLoader",
    "ResumeLoop",
    "TrainState",
    "list_checkpoints",
    "set_default_guard",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'trainguard.resilience' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"trainguard.resilience.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
