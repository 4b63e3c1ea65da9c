"""See the loss of an unmodified training loop: the scalar that ``backward()`` is called on.

``torch.Tensor.backward`` calls ``torch.autograd.backward`` through the module attribute, so one
wrapper there sees both spellings. The wrapper is installed while at least one monitor listens
and restores the original when the last one leaves. It keeps nothing but a detached view of the
0-d loss (no graph, no host sync).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

import torch

_lock = threading.Lock()
_listeners: list[Callable[[torch.Tensor | None], None]] = []
_original: Callable | None = None


def _backward(tensors, grad_tensors=None, *args, **kwargs):
    loss = None
    if isinstance(tensors, torch.Tensor) and grad_tensors is None and tensors.numel() == 1:
        if tensors.is_floating_point():
            with quiet():
                loss = tensors.detach().reshape(())
    for fn in list(_listeners):
        try:
            fn(loss)
        except Exception:  # observing training never kills training
            pass
    return _original(tensors, grad_tensors, *args, **kwargs)


def quiet():
    """Keep ``trainguard.record`` (either backend) from recording the monitor's own tensor ops."""
    from trainguard.capture._native._backend import paused

    if torch._C._len_torch_dispatch_stack() > 0:
        stack = contextlib.ExitStack()
        stack.enter_context(torch._C._DisableTorchDispatch())
        stack.enter_context(paused())
        return stack
    return paused()


def add_listener(fn: Callable[[torch.Tensor | None], None]) -> None:
    """Call ``fn(loss_or_None)`` before every ``backward``; ``loss`` is a detached 0-d tensor."""
    global _original
    with _lock:
        if not _listeners:
            _original = torch.autograd.backward
            torch.autograd.backward = _backward
        _listeners.append(fn)


def remove_listener(fn: Callable) -> None:
    global _original
    with _lock:
        if fn in _listeners:
            _listeners.remove(fn)
        if not _listeners and _original is not None:
            if torch.autograd.backward is _backward:
                torch.autograd.backward = _original
            _original = None
