"""The hot path: the dispatch-mode recorder, module attribution, stacks, summaries."""

from trainguard.capture._compile import compile_backend
from trainguard.capture._recorder import Recorder, check_numerics, disable, enable, record
from trainguard.capture._steps import align as align_step
from trainguard.capture._steps import before_next_optimizer_step, current_step, step
from trainguard.capture._steps import drive as drive_step
from trainguard.capture._steps import release_drive as release_step
from trainguard.capture._steps import restored as restored_step
from trainguard.capture._watch import StepWatch, unrecorded

__all__ = [
    "Recorder",
    "StepWatch",
    "align_step",
    "before_next_optimizer_step",
    "check_numerics",
    "compile_backend",
    "current_step",
    "disable",
    "drive_step",
    "enable",
    "record",
    "release_step",
    "restored_step",
    "step",
    "unrecorded",
]
