"""The always-on guard: a cheap sentry, host-memory snapshots, rewind, replay under full
recording, and the skip / lower-LR / stop policies. It composes ``resilience/`` (state,
snapshots, the loop), ``capture/`` (the step taps, the recorder) and ``analysis/`` (the origin).
See docs/guard.md.
"""

from trainguard._errors import Diverged
from trainguard.guard._config import GuardConfig
from trainguard.guard._guard import Guard

__all__ = ["Diverged", "Guard", "GuardConfig"]
