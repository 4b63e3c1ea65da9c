"""The guard's settings, validated on creation."""

from __future__ import annotations

import math
from dataclasses import dataclass

POLICIES = ("skip", "lower_lr", "stop")

# The spike test compares a loss with the median of this many earlier steps (the issue's
# "running median of the last 100 steps": long enough to ride over noise, short enough to follow
# a decreasing loss).
SPIKE_WINDOW = 100
# No spike is called before this many finite losses are known: the first steps of a run move
# by orders of magnitude and a median of three says nothing.
SPIKE_MIN_HISTORY = 20
# "lower_lr" multiplies every learning rate by this.
LR_FACTOR = 0.5


def _int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class GuardConfig:
    """What :class:`trainguard.Guard` does; see its docstring."""

    policy: str = "skip"
    snapshot_every: int = 50
    max_rewinds: int = 5
    spike_factor: float | None = None
    skip_batches: int = 1

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {list(POLICIES)}, got {self.policy!r}")
        _int("snapshot_every", self.snapshot_every, 1)
        _int("max_rewinds", self.max_rewinds, 0)
        _int("skip_batches", self.skip_batches, 1)
        f = self.spike_factor
        if f is not None and (isinstance(f, bool) or not isinstance(f, (int, float)) or not math.isfinite(f) or f <= 1):
            raise ValueError(f"spike_factor must be a number > 1 or None, got {f!r}")
