"""Ops that raise on a NaN/Inf instead of passing it on, made to pass it on inside a guarded step.

``nn.BCELoss`` raises ``all elements of input should be between 0 and 1`` on a NaN probability
(eriklindernoren/PyTorch-GAN's dcgan.py: Sigmoid, then BCELoss), ``torch.multinomial`` raises
``probability tensor contains either inf, nan or element < 0``, ``torch.distributions`` with
argument validation raises ``Expected parameter ... found invalid values``, and
``torch.linalg.cholesky`` raises ``not positive-definite``. The error ends the loop body before
the sentry sees a loss, so the guard could not rewind. While a guarded step runs, such an error
on inputs that hold NaN/Inf gives NaN instead (an index 0 for ``multinomial``; the distribution
is built unvalidated), and the step is marked bad (:meth:`Raised.take`): the guard rewinds,
replays it under recording (the origin names the op that made the NaN) and applies its policy.
On finite inputs the error is a bug in the code and is raised unchanged.

Only the eager entry points are wrapped (``torch.nn.functional.binary_cross_entropy``,
``torch.multinomial``, ``Tensor.multinomial``, ``torch.linalg.cholesky``,
``Distribution.__init__``), while at least one guard watches a loop. On CUDA, BCELoss and
multinomial check on the device (a device-side assert ends the process): nothing to catch there.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import torch

from trainguard.capture import unrecorded

_MISSING = object()
_lock = threading.Lock()
_users = 0
_saved: list[tuple[Any, str, Any]] = []
_state = threading.local()  # .step: the Raised of the guarded step running on this thread, or None


class Raised:
    """What a guarded step's ops raised on NaN/Inf (the first), as the guard's event keeps it."""

    def __init__(self) -> None:
        self.first: dict | None = None

    def note(self, op: str, error: BaseException) -> None:
        if self.first is None:
            self.first = {"op": op, "error": f"{type(error).__name__}: {error}".splitlines()[0][:300].rstrip(":")}

    def take(self) -> dict | None:
        first, self.first = self.first, None
        return first


def begin(raised: Raised) -> None:
    _state.step = raised


def end() -> None:
    _state.step = None


def _nonfinite(*values: Any) -> bool:
    with torch.no_grad(), unrecorded():
        for v in values:
            if isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex()) and v.numel():
                if not bool(torch.isfinite(v).all()):
                    return True
    return False


def _guarded(op: str, matches: tuple[str, ...], substitute, inputs=lambda *a, **k: a):
    """Wrap ``fn``: inside a guarded step, an error whose message holds one of ``matches`` on
    inputs with NaN/Inf returns ``substitute(*args, **kwargs)`` and is noted for the guard."""

    def wrap(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except (RuntimeError, ValueError) as error:
                raised = getattr(_state, "step", None)
                if (raised is None or not any(m in str(error) for m in matches)
                        or not _nonfinite(*inputs(*args, **kwargs))):
                    raise
                raised.note(op, error)
                return substitute(*args, **kwargs)

        wrapper.__trainguard_wrapped__ = fn
        return wrapper

    return wrap


def _bce_nan(input, target, weight=None, size_average=None, reduce=None, reduction="mean"):
    if size_average is not None or reduce is not None:
        reduction = torch.nn._reduction.legacy_get_string(size_average, reduce)
    out = input * float("nan")  # in the graph: backward() runs and gives NaN gradients
    return out if reduction == "none" else out.sum() if reduction == "sum" else out.mean()


def _multinomial_zeros(input, num_samples, *args, **kwargs):
    return torch.zeros((*input.shape[:-1], num_samples), dtype=torch.long, device=input.device)


def _cholesky_nan(A, *args, **kwargs):
    return A * float("nan")


def _wrap_distribution_init(init):
    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        try:
            return init(self, *args, **kwargs)
        except ValueError as error:
            raised = getattr(_state, "step", None)
            if (raised is None or "found invalid values" not in str(error)
                    or not _nonfinite(*vars(self).values())):
                raise
            raised.note(f"{type(self).__name__}(validate_args=True)", error)
            if len(args) >= 3:
                args = (*args[:2], False, *args[3:])
            else:
                kwargs["validate_args"] = False
            return init(self, *args, **kwargs)

    __init__.__trainguard_wrapped__ = init
    return __init__


def _targets() -> list[tuple[Any, str, Any]]:
    dist = torch.distributions.Distribution
    return [
        (torch.nn.functional, "binary_cross_entropy",
         _guarded("aten.binary_cross_entropy", ("between 0 and 1",), _bce_nan)),
        (torch, "multinomial", _guarded("aten.multinomial", ("or element < 0",), _multinomial_zeros)),
        (torch.Tensor, "multinomial",
         _guarded("aten.multinomial", ("or element < 0",), _multinomial_zeros)),
        (torch.linalg, "cholesky", _guarded("aten.linalg_cholesky", ("positive-definite",), _cholesky_nan)),
        (dist, "__init__", _wrap_distribution_init),
    ]


def install() -> None:
    """Wrap the ops (once, however many guards watch a loop)."""
    global _users
    with _lock:
        _users += 1
        if _users > 1:
            return
        for owner, name, wrap in _targets():
            _saved.append((owner, name, owner.__dict__.get(name, _MISSING)))
            setattr(owner, name, wrap(getattr(owner, name)))


def remove() -> None:
    global _users
    with _lock:
        _users = max(_users - 1, 0)
        if _users:
            return
        while _saved:
            owner, name, original = _saved.pop()
            if original is _MISSING:  # Tensor.multinomial: inherited from torch._C.TensorBase
                delattr(owner, name)
            else:
                setattr(owner, name, original)
