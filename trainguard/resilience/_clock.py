"""trainguard's own step count, as checkpoints keep it.

The capture layer counts training steps for the monitor, the recorder and the guard; it sits
above this one, so it hands its clock down here when it is imported (``capture/_steps.py``).
A checkpoint saved while the clock counts stores its value (``clock_step`` in the manifest), and
a restore puts it back, so that a process resumed from the checkpoint numbers its steps as the
saving process did, and the run drops what it stored of the steps the restore undid. Without the capture layer nothing counts, and both do nothing.
"""

from __future__ import annotations

from collections.abc import Callable


def _nothing_counts() -> int | None:
    return None


def _ignore(step: int) -> None:
    return None


# The step while trainguard counts steps itself, else None (capture._steps.counted_step).
counted: Callable[[], int | None] = _nothing_counts
# Set the count to a step without taking it over (capture._steps.align).
align: Callable[[int], None] = _ignore
# A checkpoint of this step was restored: count from it again (capture._steps.restored).
restored: Callable[[int], None] = _ignore
# A checkpoint of this step is about to be saved: what the run buffered of the steps before it must
# be written first, so that it outlives a SIGKILL as the checkpoint does (capture._steps.saving).
saving: Callable[[int], None] = _ignore
