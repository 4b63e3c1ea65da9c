"""The resilience names are part of trainguard's public face."""

from __future__ import annotations

import trainguard
import trainguard.resilience as resilience

NAMES = ["CheckpointFallbackWarning", "CheckpointInfo", "CheckpointManager", "CheckpointPolicy", "Preempted",
         "ResumableLoader", "ResumeLoop", "TrainState", "list_checkpoints"]


def test_resilience_exports_are_pinned_and_reexported():
    assert resilience.__all__ == NAMES
    for name in NAMES:
        assert name in trainguard.__all__
        assert getattr(trainguard, name) is getattr(resilience, name)
    assert issubclass(trainguard.Preempted, SystemExit)
    assert trainguard.CheckpointError.exit_code == 2
