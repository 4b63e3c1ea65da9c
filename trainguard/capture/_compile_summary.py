"""Tensor summaries as FX nodes: the reductions a recorded graph computes beside its own kernels.

Each summarised tensor gets one row of the mode's fields (``store.MODE_FIELDS``), built from
comparisons and sums that Inductor fuses into a pass over the tensor (usually into the kernel
that produced it). Rows are stacked into one float64 matrix, an extra output of the graph, so a
graph call ships all its summaries as one tensor. Counts are int64 sums (exact); ``neg`` and
``pos`` count finite values only, as the eager summaries do.
"""

from __future__ import annotations

import math

import torch
from torch import fx

aten = torch.ops.aten
_convert = torch.ops.prims.convert_element_type.default

# Dtypes summarised inside the graph; others (complex, quantized, float8) get an unknown summary.
_REAL = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.int16, torch.int32,
                   torch.int64, torch.uint8, torch.bool})


def summarisable(val) -> bool:
    return isinstance(val, torch.Tensor) and val.dtype in _REAL and val.layout is torch.strided


class Builder:
    """Appends nodes to a graph after a cursor, with ``meta["val"]`` computed on the fake values
    (Inductor's passes read it)."""

    def __init__(self, graph: fx.Graph, fake_mode):
        self.graph = graph
        self.fake_mode = fake_mode
        self.cursor: fx.Node | None = None

    def call(self, target, *args, **kwargs) -> fx.Node:
        with self.graph.inserting_after(self.cursor):
            node = self.graph.call_function(target, args, kwargs)
        self.cursor = node
        fake_args = fx.node.map_arg(args, lambda n: n.meta["val"])
        fake_kwargs = fx.node.map_arg(kwargs, lambda n: n.meta["val"])
        with self.fake_mode:
            node.meta["val"] = target(*fake_args, **fake_kwargs)
        return node

    # A 0-d int64 zero on the tensor's device, for the counts an integer tensor cannot have.
    def zero(self, like: fx.Node) -> fx.Node:
        return self.call(aten.full.default, [], 0, dtype=torch.int64, device=like.meta["val"].device)

    def count(self, mask: fx.Node) -> fx.Node:
        return self.call(aten.sum.default, mask)

    # Only ops Inductor lowers directly: the graph it receives is already decomposed, and an op
    # with a decomposition but no lowering (stack, _to_copy, isfinite) is refused there.
    def stack(self, nodes: list[fx.Node]) -> fx.Node:
        return self.call(aten.cat.default, [self.call(aten.unsqueeze.default, n, 0) for n in nodes])

    def to(self, node: fx.Node, dtype: torch.dtype) -> fx.Node:
        return self.call(_convert, node, dtype)


def _full_counts(b: Builder, x: fx.Node) -> list[fx.Node]:
    """[size, neg, zero, pos, neg_inf, pos_inf, nan] as 0-d int64 nodes."""
    val = x.meta["val"]
    if val.dtype == torch.bool:
        pos = b.count(x)
        zero = b.count(b.call(aten.logical_not.default, x))
        size = b.call(aten.add.Tensor, pos, zero)
        z = b.zero(x)
        return [size, z, zero, pos, z, z, z]
    lt = b.count(b.call(aten.lt.Scalar, x, 0))
    eq = b.count(b.call(aten.eq.Scalar, x, 0))
    gt = b.count(b.call(aten.gt.Scalar, x, 0))
    if not val.is_floating_point():
        size = b.call(aten.add.Tensor, b.call(aten.add.Tensor, lt, eq), gt)
        z = b.zero(x)
        return [size, lt, eq, gt, z, z, z]
    nan = b.count(b.call(aten.isnan.default, x))
    ninf = b.count(b.call(aten.eq.Scalar, x, -math.inf))
    pinf = b.count(b.call(aten.eq.Scalar, x, math.inf))
    # Every element is < 0, == 0, > 0 or NaN: the size needs no pass of its own.
    size = b.call(aten.add.Tensor, b.call(aten.add.Tensor, lt, eq), b.call(aten.add.Tensor, gt, nan))
    neg = b.call(aten.sub.Tensor, lt, ninf)
    pos = b.call(aten.sub.Tensor, gt, pinf)
    return [size, neg, eq, pos, ninf, pinf, nan]


def _concise_counts(b: Builder, x: fx.Node) -> list[fx.Node]:
    """[size, neg_inf, pos_inf, nan]."""
    val = x.meta["val"]
    same = b.count(b.call(aten.eq.Tensor, x, x))  # False only for NaN
    if not val.is_floating_point():
        z = b.zero(x)
        return [same, z, z, z]
    nan = b.count(b.call(aten.isnan.default, x))
    ninf = b.count(b.call(aten.eq.Scalar, x, -math.inf))
    pinf = b.count(b.call(aten.eq.Scalar, x, math.inf))
    return [b.call(aten.add.Tensor, same, nan), ninf, pinf, nan]


def _moments(b: Builder, x: fx.Node) -> fx.Node:
    """[min, max, mean, std] in float64 (population std, two passes like the deferred summary)."""
    val = x.meta["val"]
    if val.numel() == 0:
        return b.call(aten.full.default, [4], math.nan, dtype=torch.float64, device=val.device)
    f = b.to(x, torch.float64)
    mn = b.call(aten.amin.default, f)
    mx = b.call(aten.amax.default, f)
    mean = b.call(aten.mean.default, f)
    dev = b.call(aten.sub.Tensor, f, mean)
    std = b.call(aten.sqrt.default, b.call(aten.mean.default, b.call(aten.mul.Tensor, dev, dev)))
    return b.stack([mn, mx, mean, std])


def summary_row(b: Builder, x: fx.Node, mode: str) -> fx.Node:
    """The float64 row of ``mode``'s fields for tensor node ``x`` (inserted after ``b.cursor``)."""
    val = x.meta["val"]
    if mode == "curt_health":
        if val.is_floating_point():
            bad = b.count(b.call(aten.logical_or.default, b.call(aten.isnan.default, x), b.call(aten.isinf.default, x)))
            flag = b.call(aten.gt.Scalar, bad, 0)
        else:
            flag = b.call(aten.full.default, [], False, dtype=torch.bool, device=val.device)
        return b.to(b.call(aten.unsqueeze.default, flag, 0), torch.float64)
    counts = _concise_counts(b, x) if mode == "concise_health" else _full_counts(b, x)
    row = b.to(b.stack(counts), torch.float64)
    if mode == "stats":
        row = b.call(aten.cat.default, [row, _moments(b, x)])
    return row


def bad_flag(b: Builder, matrix: fx.Node, fields: tuple[str, ...]) -> fx.Node:
    """A 0-d bool: does any summarised tensor hold NaN or Inf (read without a sync on CPU)."""
    if fields[0] == "nonfinite":
        cols = matrix
    else:
        idx = [fields.index(f) for f in ("neg_inf", "pos_inf", "nan")]
        cols = b.call(aten.slice.Tensor, matrix, 1, idx[0], idx[-1] + 1)
    return b.call(aten.gt.Scalar, b.call(aten.sum.default, cols), 0)
