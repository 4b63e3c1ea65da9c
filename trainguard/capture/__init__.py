"""The hot path: the dispatch-mode recorder, module attribution, stacks, summaries."""

from trainguard.capture._compile import compile_backend
from trainguard.capture._recorder import Recorder, check_numerics, disable, enable, record
from trainguard.capture._steps import current_step, step

__all__ = ["Recorder", "check_numerics", "compile_backend", "current_step", "disable", "enable", "record", "step"]
