"""The few collectives checkpointing needs, as no-ops in a single process.

Checkpoint traffic runs on gloo groups of its own: an asynchronous save talks from a background
thread, and collectives from two threads on one group would interleave differently per rank.
Payloads travel as byte tensors, never as pickled objects. Checkpoint work runs
:func:`unobserved`: outside any ``TorchDispatchMode`` such as the recorder's, and with
RecordFunction's callbacks (the native recorder core) off.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import _disable_current_modes

_F = TypeVar("_F", bound=Callable[..., Any])


def unobserved(fn: _F) -> _F:
    """Run ``fn`` with every ``TorchDispatchMode`` of this thread set aside and RecordFunction off.

    Saving and restoring are trainguard's own work, not the program's: a recording must not
    show them, and nothing a mode does to an op may make one rank's collectives differ from
    another's (a recorder that changed a tensor once made DCP fail on one rank and hang the rest).
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        # RecordFunction's callbacks too (the native recorder core, which is not a mode), on
        # this thread, outermost call only; it is on unless someone turned it off, as torch has it.
        depth = getattr(_unobserved, "depth", 0)
        _unobserved.depth = depth + 1
        try:
            with _disable_current_modes():
                if depth == 0:
                    torch.autograd._enable_record_function(False)
                try:
                    return fn(*args, **kwargs)
                finally:
                    if depth == 0:
                        torch.autograd._enable_record_function(True)
        finally:
            _unobserved.depth = depth

    return wrapper  # type: ignore[return-value]


_unobserved = threading.local()


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class Groups:
    """Two gloo groups, made lazily and collectively: one for saves and loads, one for the loop."""

    def __init__(self) -> None:
        self._io: Any = None
        self._ctl: Any = None
        self._lock = threading.Lock()

    def _make(self) -> None:
        with self._lock:
            if self._io is None and is_distributed():
                self._io = dist.new_group(backend="gloo")
                self._ctl = dist.new_group(backend="gloo")

    def io(self) -> Any:
        self._make()
        return self._io

    def ctl(self) -> Any:
        self._make()
        return self._ctl


def broadcast_bytes(data: bytes | None, group: Any) -> bytes:
    """Rank 0's ``data`` on every rank."""
    if group is None:
        assert data is not None
        return data
    size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
    dist.broadcast(size, src=0, group=group)
    buf = torch.empty(int(size.item()), dtype=torch.uint8)
    if dist.get_rank() == 0:
        assert data is not None
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else buf
    dist.broadcast(buf, src=0, group=group)
    return buf.numpy().tobytes()


def all_gather_bytes(data: bytes, group: Any) -> list[bytes]:
    """Every rank's ``data``, in rank order, on every rank."""
    if group is None:
        return [data]
    world = dist.get_world_size(group)
    size = torch.tensor([len(data)], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    longest = max(int(s.item()) for s in sizes)
    buf = torch.zeros(longest, dtype=torch.uint8)
    if data:
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    bufs = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(bufs, buf, group=group)
    return [b[: int(s.item())].numpy().tobytes() for b, s in zip(bufs, sizes, strict=True)]


@unobserved
def all_max(values: list[int], group: Any) -> list[int]:
    """Element-wise maximum over ranks (used for 'any rank got a signal' and 'any rank failed')."""
    if group is None:
        return list(values)
    t = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return [int(v) for v in t.tolist()]
