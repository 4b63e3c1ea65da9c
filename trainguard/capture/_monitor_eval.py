"""The validation pass, seen by the monitor: the loss and accuracy a script computes in evaluation.

A forward pass of a watched model under ``torch.no_grad()`` / ``torch.inference_mode()``, or in
eval mode with no ``backward`` after it, is an evaluation forward. While one has run since the last training forward, the losses the script
computes (``torch.nn`` loss modules call ``torch.nn.functional``, so wrapping the functional
losses sees both spellings; ``from torch.nn.functional import cross_entropy`` done before the
monitor starts keeps the unwrapped function and is not seen) are summed on the device, with the argmax accuracy when the loss
compares class scores with integer targets. At the end of the step they become the per-step
scalars ``val_loss`` and ``val_accuracy`` (the mean over every evaluation batch of that step),
shipped with the other scalars: no host sync.

The wrappers are installed while at least one monitor listens, as ``_monitor_tap`` does for
``backward``; a training loss costs one Python call and a flag test.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from trainguard.capture._monitor_tap import quiet

# The functional losses a validation pass computes, whose first two arguments are the
# prediction and the target. Classification losses among them get an argmax accuracy.
LOSSES = (
    "cross_entropy", "nll_loss", "binary_cross_entropy", "binary_cross_entropy_with_logits",
    "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "kl_div", "poisson_nll_loss",
    "soft_margin_loss", "multi_margin_loss", "multilabel_soft_margin_loss",
)
_CLASS_LOSSES = ("cross_entropy", "nll_loss", "multi_margin_loss")

_lock = threading.Lock()
_listeners: list[Callable[[str, tuple, dict, Any], None]] = []
_originals: dict[str, Callable] = {}


def _wrap(name: str, fn: Callable) -> Callable:
    def loss(*args, **kwargs):
        out = fn(*args, **kwargs)
        if _listeners:
            for listener in list(_listeners):
                try:
                    listener(name, args, kwargs, out)
                except Exception:  # observing training never kills training
                    pass
        return out

    loss.__wrapped__ = fn  # type: ignore[attr-defined]
    loss.__name__ = fn.__name__
    loss.__doc__ = fn.__doc__
    loss._trainguard_eval = True  # type: ignore[attr-defined]
    return loss


def add_listener(fn: Callable[[str, tuple, dict, Any], None]) -> None:
    """Call ``fn(loss_name, args, kwargs, result)`` for every functional loss computed without grad."""
    with _lock:
        if not _listeners:
            for name in LOSSES:
                orig = getattr(F, name, None)
                if orig is None or getattr(orig, "_trainguard_eval", False):
                    continue
                _originals[name] = orig
                setattr(F, name, _wrap(name, orig))
        _listeners.append(fn)


def remove_listener(fn: Callable) -> None:
    with _lock:
        if fn in _listeners:
            _listeners.remove(fn)
        if not _listeners:
            for name, orig in _originals.items():
                if getattr(getattr(F, name, None), "__wrapped__", None) is orig:
                    setattr(F, name, orig)
            _originals.clear()


def _arg(args: tuple, kwargs: dict, i: int, name: str) -> Any:
    return args[i] if len(args) > i else kwargs.get(name)


class EvalWatch:
    """Sums the losses and correct predictions of the evaluation forwards of one step, on the device."""

    def __init__(self) -> None:
        self.active = False  # an evaluation forward ran since the last training forward
        self.loss_fn: str | None = None  # the first loss seen in evaluation: the one recorded
        self.classes: int | None = None
        self.batches = 0
        self._by_mode = False
        # Validation labels per class, for the chance level (the loss and accuracy of always
        # guessing the class priors); summed on the device over the whole run.
        self._label_counts: torch.Tensor | None = None
        self._reset()
        add_listener(self.on_loss)

    def _reset(self) -> None:
        self._loss_sum: torch.Tensor | None = None
        self._loss_n = 0
        self._correct: torch.Tensor | None = None
        self._acc_n: torch.Tensor | None = None

    def close(self) -> None:
        remove_listener(self.on_loss)

    def on_forward(self, grad_on: bool, training: bool) -> None:
        """A watched model's forward began: evaluation when gradients are off or the model is in
        eval mode (then only until a ``backward`` shows it was a training step in eval mode)."""
        self.active = not grad_on or not training
        self._by_mode = grad_on and not training

    def on_backward(self) -> None:
        if self._by_mode:  # eval mode with gradients, then backward: training, not validation
            self._reset()
            self.active = self._by_mode = False

    def on_loss(self, name: str, args: tuple, kwargs: dict, out: Any) -> None:
        if not self.active or not isinstance(out, torch.Tensor) or not out.is_floating_point():
            return
        if out.requires_grad and not self._by_mode:
            return  # a training loss after a no-grad forward (a target network's output as the target)
        if self.loss_fn is None:
            self.loss_fn = name
        elif name != self.loss_fn:
            return  # a second loss in the same pass (an auxiliary term): the first one is the metric
        pred = _arg(args, kwargs, 0, "input")
        target = _arg(args, kwargs, 1, "target")
        if not isinstance(pred, torch.Tensor) or not isinstance(target, torch.Tensor) or pred.dim() == 0:
            return
        reduction = kwargs.get("reduction", "mean")
        rows = int(pred.shape[0]) if pred.dim() > 1 or name not in _CLASS_LOSSES else 1
        with quiet(), torch.no_grad():
            value = out.detach().float()
            if reduction == "none" or value.numel() != 1:
                total, n = value.sum(), value.numel()
            elif reduction == "sum":
                total, n = value.reshape(()), rows
            else:
                total, n = value.reshape(()) * rows, rows
            self._loss_sum = total if self._loss_sum is None else self._loss_sum + total.to(self._loss_sum.device)
            self._loss_n += n
            self.batches += 1
            if name in _CLASS_LOSSES and pred.dim() >= 2 and not target.is_floating_point():
                if target.shape == pred.shape[:1] + pred.shape[2:]:
                    self.classes = int(pred.shape[1])
                    ignore = kwargs.get("ignore_index", -100)
                    valid = target != ignore
                    self._count_labels(target, valid)
                    hit = ((pred.argmax(1) == target) & valid).sum()
                    cnt = valid.sum()
                    if self._correct is None:
                        self._correct, self._acc_n = hit, cnt
                    else:
                        self._correct = self._correct + hit
                        self._acc_n = self._acc_n + cnt

    def _count_labels(self, target: torch.Tensor, valid: torch.Tensor) -> None:
        c = self.classes
        if self._label_counts is None or self._label_counts.numel() != c:
            self._label_counts = torch.zeros(c, device=target.device)
        # scatter_add, not bincount: bincount reads the largest label back to the host
        idx = target.reshape(-1).clamp(0, c - 1).to(self._label_counts.device)
        self._label_counts.scatter_add_(0, idx, valid.reshape(-1).float().to(self._label_counts.device))

    def take(self) -> dict[str, torch.Tensor]:
        """The step's ``val_loss`` and ``val_accuracy`` as 0-d device tensors (empty if none)."""
        out: dict[str, torch.Tensor] = {}
        if self._loss_sum is not None and self._loss_n:
            with quiet(), torch.no_grad():
                out["val_loss"] = self._loss_sum / self._loss_n
                if self._correct is not None:
                    out["val_accuracy"] = self._correct.float() / self._acc_n.clamp(min=1).float()
        self._reset()
        return out

    def summary(self) -> dict[str, Any]:
        """What the run's metadata says about the validation pass."""
        counts = None
        if self._label_counts is not None:
            with quiet():
                counts = [int(v) for v in self._label_counts.cpu().tolist()]  # once, when the monitor closes
        return {"loss_fn": self.loss_fn, "classes": self.classes, "batches": self.batches, "label_counts": counts}
