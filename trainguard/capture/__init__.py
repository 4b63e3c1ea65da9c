"""The hot path: the dispatch-mode recorder, module attribution, stacks, summaries."""

from trainguard.capture._recorder import Recorder, check_numerics, disable, enable, record
from trainguard.capture._steps import align as align_step
from trainguard.capture._steps import current_step, step
from trainguard.capture._watch import StepWatch, unrecorded

__all__ = ["Recorder", "StepWatch", "align_step", "check_numerics", "current_step", "disable", "enable", "record",
           "step", "unrecorded"]
