"""The part of a distributed tensor this rank holds: what capture/ reads, never the whole.

A DTensor (FSDP2's parameters, their gradients and optimizer state) answers its own ops through
collectives: the norm of a sharded gradient is a partial value that an all-reduce completes, a
``cat`` with a plain tensor is refused. The recorder and the monitor must issue no collective of
their own (every rank would have to run it, in the same order as the program's), so they read
``t._local_tensor``: per rank, statistics of its own shard.
"""

from __future__ import annotations

import torch

_Tensor = torch.Tensor


def local(t: _Tensor) -> _Tensor:
    """``t``'s local shard if it is a DTensor, else ``t``."""
    if type(t) is _Tensor:
        return t
    inner = getattr(t, "_local_tensor", None)
    return inner if isinstance(inner, _Tensor) else t
