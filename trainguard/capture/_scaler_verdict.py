"""A GradScaler's verdict on each step, stored in the run for the analysis of harmful values.

Under ``torch.amp.GradScaler`` (fp16) an overflowing backward is routine: the scaler finds the
Inf/NaN gradients, skips ``optimizer.step()`` and lowers its scale. By the recorder's rule those
values are harmful (they reached a gradient), and they are recorded so; but they never reached
the weights. The recorder keeps the steps the scaler skipped in the run's metadata
(``scaler_skipped``: ``[first, last]`` step ranges), and the reader sets the harmful values of
those steps apart (``store._reader_harm``): an origin, an alert and a finding speak of the values
that were not discarded, and the scaler's rule looks into the skipped steps for its cause.
"""

from __future__ import annotations

from trainguard.capture import _amp_tap


class ScalerVerdicts:
    """Listens to the GradScaler tap while a recording writes to ``writer``."""

    def __init__(self, writer) -> None:
        self.writer = writer
        self.ranges: list[list[int]] = []
        _amp_tap.step_listeners.append(self.on_step)

    def on_step(self, optimizer, step: int, scale, ran: bool) -> None:
        if ran or self.writer is None:
            return
        r = self.ranges
        if r and r[-1][0] <= step <= r[-1][1]:
            return  # a second optimizer of the same step
        if r and step == r[-1][1] + 1:
            r[-1][1] = step
        else:
            r.append([step, step])
        self.writer.set_meta(scaler_skipped=[list(x) for x in r])

    def close(self) -> None:
        if self.on_step in _amp_tap.step_listeners:
            _amp_tap.step_listeners.remove(self.on_step)
        self.writer = None
