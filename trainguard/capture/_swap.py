"""Let torch swap tensors that the recorder and the monitor hold weakly.

``torch.utils.swap_tensors`` refuses a tensor that has any weak reference. torch swaps tensors
where a parameter must keep its identity: ``module.to_empty()`` and ``module.to()`` on DTensor
parameters (FSDP2's recipe: build on the meta device, ``fully_shard``, ``to_empty``), every
parameter under ``torch.__future__.set_swap_module_params_on_conversion(True)``, and
``load_state_dict(assign=True)`` then. The recorder and the monitor hold tensors weakly so as
never to keep one alive. While either is active, ``torch.utils.swap_tensors`` is wrapped: every
holder lets go of the two tensors for the swap, and takes the tensor back afterwards where it
still means the same thing (a parameter keeps its identity, so it stays named and watched).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

# A holder's release: drop every weak reference to this tensor; return how to take it back, or None.
Release = Callable[[torch.Tensor], Callable[[], None] | None]

_lock = threading.Lock()
_holders: list[Release] = []
_original: Callable = torch.utils.swap_tensors  # what the wrapper calls (taken again at each install)


def hold(release: Release) -> None:
    """Register a holder (installs the wrapper with the first one)."""
    global _original
    with _lock:
        if not _holders:
            _original = torch.utils.swap_tensors
            torch.utils.swap_tensors = _swap
        _holders.append(release)


def unhold(release: Release) -> None:
    """Unregister a holder (puts torch's own function back with the last one)."""
    with _lock:
        if release in _holders:
            _holders.remove(release)
        if not _holders and torch.utils.swap_tensors is _swap:  # unless someone wrapped it after us
            torch.utils.swap_tensors = _original


def _swap(t1: torch.Tensor, t2: torch.Tensor) -> None:
    restores = [r for release in list(_holders) for t in (t1, t2) if (r := release(t)) is not None]
    try:
        return _original(t1, t2)
    finally:
        for restore in restores:
            restore()
