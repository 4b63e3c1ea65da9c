"""Every rank takes the same decision at the same step.

The sentry's verdict on the steps read at a boundary is a short list of integers whose
element-wise maximum over ranks says it all: the earliest bad step (stored as ``BIG - step`` so
that the maximum picks the smallest), which kinds of fault occurred, and which ranks saw one.
The resumable loop adds it to the all-reduce it already makes at every step boundary (signals,
save intervals), so the guard costs no collective of its own; outside that, and to share the
origin found by the rank that saw the fault, it talks on the loop's gloo group. Payloads are
JSON bytes, never pickles.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist

BIG = 1 << 62
KINDS = ("nonfinite_loss", "nonfinite_grad", "spike")


def rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def encode(bad: tuple[int, set[str]] | None) -> list[int]:
    """This rank's verdict: [BIG - step or 0, one flag per kind, one entry per rank].

    A rank's entry is 2 when its own loss went wrong and 1 when only its gradients did: under
    DDP a poisoned batch on one rank makes every rank's averaged gradients non-finite, and the
    rank whose loss it was is the one whose recording shows the origin.
    """
    rank, world = rank_world()
    flags = [0] * (1 + len(KINDS) + world)
    if bad is not None:
        step, kinds = bad
        flags[0] = BIG - step
        for i, k in enumerate(KINDS):
            flags[1 + i] = int(k in kinds)
        flags[1 + len(KINDS) + rank] = 1 if kinds == {"nonfinite_grad"} else 2
    return flags


def decode(flags: list[int]) -> tuple[int, list[str], list[int]] | None:
    """The combined verdict: (earliest bad step, kinds, ranks that saw a fault), or None.

    The ranks whose loss went wrong come first (lowest rank first), then those that saw only
    non-finite gradients."""
    if not flags or not flags[0]:
        return None
    kinds = [k for i, k in enumerate(KINDS) if flags[1 + i]]
    entries = flags[1 + len(KINDS):]
    ranks = [r for r, f in enumerate(entries) if f == 2] + [r for r, f in enumerate(entries) if f == 1]
    return BIG - flags[0], kinds, ranks


def all_max(values: list[int], group: Any) -> list[int]:
    if group is None:
        return list(values)
    t = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return [int(v) for v in t.tolist()]


def broadcast_json(obj: Any, src: int, group: Any) -> Any:
    """``obj`` of rank ``src`` on every rank (JSON; non-finite floats are not expected here)."""
    if group is None:
        return obj
    rank, _ = rank_world()
    data = json.dumps(obj).encode() if rank == src else b""
    size = torch.tensor([len(data)], dtype=torch.int64)
    dist.broadcast(size, src=src, group=group)
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if rank == src else torch.empty(int(size.item()),
                                                                                               dtype=torch.uint8)
    dist.broadcast(buf, src=src, group=group)
    return json.loads(buf.numpy().tobytes().decode())
