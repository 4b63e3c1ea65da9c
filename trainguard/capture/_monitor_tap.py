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
# Called with the loss itself, graph attached (the loss-graph watch and the live gradient check
# read its autograd graph before the backward pass frees what it saved).
_graph_listeners: list[Callable[[torch.Tensor], None]] = []
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
    if loss is not None and tensors.grad_fn is not None:
        for fn in list(_graph_listeners):
            try:
                fn(tensors)
            except Exception:  # observing training never kills training
                pass
    return _original(tensors, grad_tensors, *args, **kwargs)


def quiet():
    """Keep ``trainguard.record`` (a dispatch mode) from recording the monitor's own tensor ops."""
    if torch._C._len_torch_dispatch_stack() > 0:
        return torch._C._DisableTorchDispatch()
    return contextlib.nullcontext()


def add_listener(fn: Callable[[torch.Tensor | None], None], *, graph: bool = False) -> None:
    """Call ``fn(loss_or_None)`` before every ``backward``; ``loss`` is a detached 0-d tensor.

    With ``graph=True``, ``fn(loss)`` gets the scalar loss itself with its autograd graph (only
    for a floating 0-d loss with a graph); it must not keep it.
    """
    global _original
    with _lock:
        if not _listeners and not _graph_listeners:
            _original = torch.autograd.backward
            torch.autograd.backward = _backward
        (_graph_listeners if graph else _listeners).append(fn)


def remove_listener(fn: Callable) -> None:
    global _original
    with _lock:
        if fn in _listeners:
            _listeners.remove(fn)
        if fn in _graph_listeners:
            _graph_listeners.remove(fn)
        if not _listeners and not _graph_listeners and _original is not None:
            if torch.autograd.backward is _backward:
                torch.autograd.backward = _original
            _original = None
