"""Connects layers that must not import each other; the root package sits above them all.

The monitor (capture layer) diagnoses the run when it closes, with the analysis layer's rules.
Rather than capture importing analysis, this module hands ``analysis.diagnose`` down.
"""

from trainguard.analysis import diagnose
from trainguard.capture import _monitor

_monitor.DEFAULT_DIAGNOSE = diagnose
Monitor = _monitor.Monitor

__all__ = ["Monitor"]
