"""Mixed precision as the monitor and the step clock see it: ``torch.amp.GradScaler``'s ``scale`` and ``step``.

- ``scale(loss)`` multiplies the loss by the current scale before ``backward``. The wrapper
  remembers the unscaled loss of each scaled output (a detached 0-d tensor, no host sync), so the
  monitor stores the loss the user computed, not ``loss * 65536``.
- ``step(optimizer)`` skips ``optimizer.step()`` when the unscaled gradients hold an Inf or NaN
  (it has already read that flag to the host). The wrapper tells whether the optimizer ran (the
  clock's counter of ``optimizer.step()`` calls moved) and announces ``(optimizer, step, scale,
  ran)`` (the step it belonged to, which a successful update has already ended): a skipped iteration still counts as a step, as it does for Lightning and the HF
  ``Trainer``, and the monitor records the scale and the skip.

The methods are patched on the class while the step clock is held (subclasses that do not
override them, such as ``torch.cuda.amp.GradScaler``, follow) and restored after.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable

import torch

log = logging.getLogger("trainguard.monitor")

_originals: dict[str, Callable] = {}
step_listeners: list[Callable] = []
# id(scaled output) -> (weakref to it, the unscaled loss). Only the last few: a loss is scaled
# right before its backward.
_scaled: dict[int, tuple[weakref.ref, torch.Tensor]] = {}
_KEEP = 8


def _scaler_class():
    amp = getattr(torch, "amp", None)
    return getattr(amp, "GradScaler", None)


def _scale(self, outputs):
    out = _originals["scale"](self, outputs)
    try:
        if isinstance(outputs, torch.Tensor) and isinstance(out, torch.Tensor) and outputs.numel() == 1:
            if len(_scaled) >= _KEEP:
                _scaled.clear()
            _scaled[id(out)] = (weakref.ref(out), outputs.detach())
    except Exception:  # observing training never kills training
        log.exception("trainguard: GradScaler.scale wrapper failed")
    return out


def unscaled(t: torch.Tensor) -> torch.Tensor | None:
    """The loss before ``GradScaler.scale`` when ``t`` is its output, else None."""
    entry = _scaled.get(id(t))
    if entry is not None and entry[0]() is t:
        return entry[1]
    return None


def scaling() -> bool:
    """Whether a ``GradScaler`` scaled a loss lately (its gradients are unscaled in place before the update)."""
    return bool(_scaled)


def _step(self, optimizer, *args, **kwargs):
    from trainguard.capture import _steps

    if not self.is_enabled():  # a disabled scaler (nanoGPT's float32 recipe) has no scale: it just steps
        return _originals["step"](self, optimizer, *args, **kwargs)
    before, step = _steps.clock.optimizer_calls, _steps.clock.step
    scale = getattr(self, "_scale", None)  # None before the first scale() (lazily made)
    if isinstance(scale, torch.Tensor):
        scale = scale.detach().reshape(-1)[0].clone()  # update() halves or doubles it in place; no sync
    out = _originals["step"](self, optimizer, *args, **kwargs)
    ran = _steps.clock.optimizer_calls != before
    for fn in list(step_listeners):
        try:
            fn(optimizer, step, scale, ran)
        except Exception:
            log.exception("trainguard: GradScaler step listener failed")
    if not ran:
        _steps.skipped(optimizer)
    return out


def install() -> None:
    cls = _scaler_class()
    if cls is None or _originals:
        return
    _originals["scale"] = cls.scale
    _originals["step"] = cls.step
    cls.scale = _scale
    cls.step = _step


def uninstall() -> None:
    cls = _scaler_class()
    if cls is None or not _originals:
        return
    if cls.scale is _scale:
        cls.scale = _originals["scale"]
    if cls.step is _step:
        cls.step = _originals["step"]
    _originals.clear()
    _scaled.clear()
