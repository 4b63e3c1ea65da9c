"""What this rank holds of distributed values: a DTensor's shard, a collective's outputs.

A DTensor (FSDP2's parameters, their gradients and optimizer state) answers its own ops through
collectives: the norm of a sharded gradient is a partial value that an all-reduce completes, a
``cat`` with a plain tensor is refused. The recorder and the monitor must issue no collective of
their own (every rank would have to run it, in the same order as the program's), so they read
``t._local_tensor``: per rank, statistics of its own shard.

A collective (``c10d.allreduce_``, ...) writes tensors that it may return or only take: the
recorder makes it the producer of what it wrote (:func:`written`). So does an op that returns
nothing and writes its arguments (:func:`written_args`).
"""

from __future__ import annotations

from typing import Any

import torch

from trainguard.capture._taint import STATS_ARGS, STATS_WRITES

_Tensor = torch.Tensor


def local(t: _Tensor) -> _Tensor:
    """``t``'s local shard if it is a DTensor, else ``t``."""
    if type(t) is _Tensor:
        return t
    inner = getattr(t, "_local_tensor", None)
    return inner if isinstance(inner, _Tensor) else t


def holders(t: _Tensor) -> int | None:
    """How many ranks hold each value of DTensor ``t``'s local shard: the sizes of its mesh's
    dimensions along which it is replicated (1 for FSDP2's ``Shard(0)``). ``None`` for a plain
    tensor, 0 when the shard holds partial sums (``Partial``), whose squares add up to nothing.
    Read from its spec: no op, no collective."""
    if type(t) is _Tensor:
        return None
    spec = getattr(t, "_spec", None)
    placements = getattr(spec, "placements", None)
    if placements is None:
        return None
    n = 1
    for dim, placement in enumerate(placements):
        if placement.is_partial():
            return 0
        if placement.is_replicate():
            n *= spec.mesh.size(dim)
    return n


def written(name: str, args: tuple, out: Any) -> list:
    """The tensors a collective writes: what it returns (``allreduce_`` returns the tensors it
    reduced in place, ``allgather_`` its output lists), or for ``recv_`` its buffers."""
    outs = _tensors_in(out, [])
    if not outs and ".recv" in name and args:
        outs = _tensors_in(args[0], [])
    return outs


def written_args(func) -> tuple:
    """``(position, name)`` of the arguments an op that returns nothing writes (``_foreach_add_``,
    ``_fused_adam_``): what it made are those tensors, its records' outputs. Not AMP's own
    (``_amp_foreach_non_finite_check_and_unscale_``): its flag says whether the gradients it unscaled
    hold an inf, a check and not a value, and a skipped step's infs are the scaler's business
    (capture/_scaler_verdict); the native core keeps the same exception (ops.cpp)."""
    try:
        schema = func._schema
    except AttributeError:  # not an OpOverload with a schema
        return ()
    if schema.returns or schema.name.startswith("aten::_amp_"):
        return ()
    return tuple((i, a.name) for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write)


def written_by(where: tuple, args: tuple, kwargs: dict | None) -> list:
    """The tensors in the arguments at ``where`` (see :func:`written_args`)."""
    outs: list = []
    for i, name in where:
        _tensors_in(args[i] if i < len(args) else (kwargs or {}).get(name), outs)
    return outs


def stats_written(name: str) -> tuple:
    """``(where, training flag position)`` for batch norm's kernels (``_taint.STATS_WRITES``)."""
    spec = STATS_WRITES.get(name)
    return () if spec is None else (STATS_ARGS, spec[0])


def with_stats(spec: tuple, args: tuple, kwargs: dict | None, out: Any) -> list:
    """What batch norm returned, then the running statistics it wrote (in training)."""
    outs = _tensors_in(out, [])
    where, flag = spec
    training = True if flag < 0 else (args[flag] if flag < len(args) else (kwargs or {}).get("training"))
    if training:
        outs.extend(written_by(where, args, kwargs))
    return outs


def _tensors_in(x: Any, out: list) -> list:
    if isinstance(x, _Tensor):
        out.append(x)
    elif type(x) in (list, tuple):
        for y in x:
            _tensors_in(y, out)
    return out
