"""The resilience names are part of trainguard's public face."""

from __future__ import annotations

import trainguard
import trainguard.resilience as resilience

NAMES = ["CheckpointFallbackWarning", "CheckpointInfo", "CheckpointManager", "CheckpointPolicy", "Preempted",
         "ResumableLoader", "ResumeLoop", "TrainState", "list_checkpoints"]
# Public in trainguard.resilience for the guard and the CLI, not at the top level.
LAYER_ONLY = ["MemorySnapshot", "set_default_guard"]


def test_resilience_exports_are_pinned_and_reexported():
    assert sorted(resilience.__all__) == sorted(NAMES + LAYER_ONLY)
    for name in LAYER_ONLY:
        assert getattr(resilience, name) is not None and name not in trainguard.__all__
    for name in NAMES:
        assert name in trainguard.__all__
        assert getattr(trainguard, name) is getattr(resilience, name)
    assert issubclass(trainguard.Preempted, SystemExit)
    assert trainguard.CheckpointError.exit_code == 2
