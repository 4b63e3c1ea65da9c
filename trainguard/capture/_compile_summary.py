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

    # Only ops Inductor lowers directly: the graph it receives is already decomposed, and an op
    # with a decomposition but no lowering (stack, _to_copy, isfinite) is refused there.
    def stack(self, nodes: list[fx.Node]) -> fx.Node:
        return self.call(aten.cat.default, [self.call(aten.unsqueeze.default, n, 0) for n in nodes])

    def to(self, node: fx.Node, dtype: torch.dtype) -> fx.Node:
        return self.call(_convert, node, dtype)


# The raw counts of one tensor, in this order; the mode's fields are derived from the stacked
# rows once per graph (see finish), not per tensor.
RAW = ("lt", "eq", "gt", "nan", "neg_inf", "pos_inf")


def _raw_counts(b: Builder, x: fx.Node) -> fx.Node:
    """[< 0, == 0, > 0, NaN, -inf, +inf] counts of ``x`` as one int64 [6] node.

    Each count is a full reduction of a mask over ``x``'s own shape, which Inductor fuses with
    the other counts and with the kernel that makes ``x`` (stacking the masks first would make it
    materialise them). Counts accumulate in int32 below 2**31 elements (one vector lane per
    element, as the float compare), and the NaN count of a static size is what the other three
    sign classes leave (NaN compares false with 0), which saves a pass.
    """
    val = x.meta["val"]
    n = val.numel()
    static = isinstance(n, int)
    acc = torch.int32 if static and n < 2**31 else torch.int64

    def count(mask: fx.Node) -> fx.Node:
        return b.call(aten.sum.default, mask, dtype=acc)

    zero = None
    if val.dtype == torch.bool:
        zero = b.call(aten.full.default, [], 0, dtype=acc, device=val.device)
        counts = [zero, count(b.call(aten.logical_not.default, x)), count(x)]
    else:
        counts = [count(b.call(aten.lt.Scalar, x, 0)), count(b.call(aten.eq.Scalar, x, 0)),
                  count(b.call(aten.gt.Scalar, x, 0))]
    if val.is_floating_point():
        if static:
            signed = b.call(aten.add.Tensor, b.call(aten.add.Tensor, counts[0], counts[1]), counts[2])
            nan = b.call(aten.add.Tensor, b.call(aten.mul.Tensor, signed, -1), n)
        else:
            nan = count(b.call(aten.ne.Tensor, x, x))  # vectorises; isnan does not on CPU
        counts += [nan, count(b.call(aten.eq.Scalar, x, -math.inf)), count(b.call(aten.eq.Scalar, x, math.inf))]
    else:
        zero = zero or b.call(aten.full.default, [], 0, dtype=acc, device=val.device)
        counts += [zero, zero, zero]
    row = b.stack(counts)
    return row if acc is torch.int64 else b.to(row, torch.int64)


def segment_counts(b: Builder, x: fx.Node, dim: int, mode: str) -> fx.Node:
    """The raw counts (curt_health's three for that mode) of every index of ``x`` along ``dim``,
    as one int64 [size, fields] node: one pass over ``x`` for all its selects (q, k and v of an
    attention's packed projection), instead of one pass per select. Static shapes only."""
    val = x.meta["val"]
    dims = [d for d in range(val.dim()) if d != dim]
    n = val.numel() // val.shape[dim]
    acc = torch.int32 if n < 2**31 else torch.int64

    def count(mask: fx.Node) -> fx.Node:
        return b.call(aten.sum.dim_IntList, mask, dims, dtype=acc) if dims else b.to(mask, acc)

    if mode == "curt_health":
        counts = [count(b.call(aten.ne.Tensor, x, x)), count(b.call(aten.eq.Scalar, x, math.inf)),
                  count(b.call(aten.eq.Scalar, x, -math.inf))]
    else:
        counts = [count(b.call(aten.lt.Scalar, x, 0)), count(b.call(aten.eq.Scalar, x, 0)),
                  count(b.call(aten.gt.Scalar, x, 0))]
        add = aten.add.Tensor
        signed = b.call(add, b.call(add, counts[0], counts[1]), counts[2])
        counts += [b.call(aten.add.Tensor, b.call(aten.mul.Tensor, signed, -1), n),
                   count(b.call(aten.eq.Scalar, x, -math.inf)), count(b.call(aten.eq.Scalar, x, math.inf))]
    seg = b.call(aten.cat.default, [b.call(aten.unsqueeze.default, c, 1) for c in counts], 1)
    return seg if acc is torch.int64 else b.to(seg, torch.int64)


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


# Ops whose output is one constant everywhere -> the fill value's positional index (else the
# keyword fill_value / s). Inductor's decompositions make zeros/ones/new_zeros/zeros_like these.
_FILLS = {aten.full.default: 1, aten.full_like.default: 1, aten.new_full.default: 2,
          aten.scalar_tensor.default: 0}


def _fill_value(x: fx.Node):
    """The value every element of ``x`` holds, known at compile time, or None."""
    at = _FILLS.get(x.target)
    if at is None or x.op != "call_function":
        return None
    v = x.args[at] if len(x.args) > at else x.kwargs.get("fill_value", x.kwargs.get("s"))
    val = x.meta["val"]
    if not isinstance(v, (bool, int, float)) or not isinstance(val.numel(), int):
        return None
    return torch.tensor(v).to(val.dtype).item()  # the value as the dtype holds it (0.1 in float32)


def scatter_row(b: Builder, x: fx.Node, src_row: fx.Node, mode: str) -> fx.Node | None:
    """The raw counts of ``select_scatter(full(v), src, ...)`` (select_backward decomposed) as
    ``src``'s counts plus those of the fill around it: no pass. None where that does not hold."""
    if mode == "stats" or x.target is not aten.select_scatter.default:
        return None
    base, src = x.args[0], x.args[1]
    v = _fill_value(base) if isinstance(base, fx.Node) else None
    if v is None or not isinstance(src.meta["val"].numel(), int) or src.meta["val"].dtype != x.meta["val"].dtype:
        return None
    fill, _ = _constant_row(b, x, v, mode, n=x.meta["val"].numel() - src.meta["val"].numel())
    return b.call(aten.add.Tensor, src_row, fill)


def _constant_row(b: Builder, x: fx.Node, v, mode: str, n: int | None = None) -> tuple[fx.Node, fx.Node | None]:
    """The summary row of a tensor filled with ``v`` (``n`` of its elements where given),
    computed here: no pass over the tensor (select_backward's zeros, a masked_fill's -inf are as
    big as the tensors they fill)."""
    val = x.meta["val"]
    n = val.numel() if n is None else n
    nan, pinf, ninf = (n, 0, 0) if v != v else (0, n, 0) if v == math.inf else (0, 0, n) if v == -math.inf \
        else (0, 0, 0)
    if mode == "curt_health":
        counts = [nan, pinf, ninf] if val.is_floating_point() else [0, 0, 0]
    else:
        sign = (0, 0, 0) if v != v else (n, 0, 0) if v < 0 else (0, n, 0) if v == 0 else (0, 0, n)
        counts = [*sign, nan, ninf, pinf]

    def const(c, dtype):
        return b.call(aten.full.default, [], c, dtype=dtype, device=val.device)

    row = b.stack([const(c, torch.int64) for c in counts])
    if mode != "stats":
        return row, None
    f = float(v)
    moments = [math.nan] * 4 if n == 0 else [f, f, f, 0.0 if math.isfinite(f) else math.nan]
    return row, b.stack([const(m, torch.float64) for m in moments])


def summary_row(b: Builder, x: fx.Node, mode: str) -> tuple[fx.Node, fx.Node | None]:
    """The raw counts of tensor node ``x`` ([NaN, +inf, -inf] for curt_health) and, for
    ``stats``, its moments; inserted after ``b.cursor``."""
    val = x.meta["val"]
    fill = _fill_value(x)
    if fill is not None:
        return _constant_row(b, x, fill, mode)
    if mode == "curt_health":
        # [NaN, +inf, -inf] counts: the stored value is the health bits (1 NaN, 2 +inf, 4 -inf),
        # which tell a NaN from a masked -inf (docs/recorder.md, "Harmful, intended, unknown").
        if val.is_floating_point():
            counts = [b.call(aten.sum.default, b.call(aten.ne.Tensor, x, x)),  # vectorises; isnan does not
                      b.call(aten.sum.default, b.call(aten.eq.Scalar, x, math.inf)),
                      b.call(aten.sum.default, b.call(aten.eq.Scalar, x, -math.inf))]
        else:
            counts = [b.call(aten.full.default, [], 0, dtype=torch.int64, device=val.device)] * 3
        return b.stack(counts), None
    return _raw_counts(b, x), (_moments(b, x) if mode == "stats" else None)


def finish(b: Builder, rows: list[tuple[fx.Node, fx.Node | None]], mode: str) -> tuple[fx.Node, fx.Node]:
    """Stack the rows into the float64 [rows, fields] matrix of ``mode`` and the graph's
    "anything non-finite" flag (a 0-d bool: read without a sync on CPU)."""
    raw = b.stack([r for r, _ in rows])  # int64 [R, 6], or [R, 3] (NaN, +inf, -inf) for curt_health
    flag = b.call(aten.gt.Scalar, b.call(aten.sum.default, b.call(aten.slice.Tensor, raw, 1, 3, 6)
                                          if mode != "curt_health" else raw), 0)
    if mode == "curt_health":
        bits = b.call(aten.gt.Scalar, raw, 0)  # [R, 3] bool -> 1 NaN + 2 +inf + 4 -inf
        value = b.call(aten.add.Tensor,
                       b.call(aten.add.Tensor, b.to(b.call(aten.select.int, bits, 1, 0), torch.float64),
                              b.call(aten.mul.Tensor, b.to(b.call(aten.select.int, bits, 1, 1), torch.float64), 2.0)),
                       b.call(aten.mul.Tensor, b.to(b.call(aten.select.int, bits, 1, 2), torch.float64), 4.0))
        return b.call(aten.unsqueeze.default, value, 1), flag
    col = {name: b.call(aten.select.int, raw, 1, i) for i, name in enumerate(RAW)}
    add, sub = aten.add.Tensor, aten.sub.Tensor
    # Every element is < 0, == 0, > 0 or NaN; neg and pos count finite values only.
    size = b.call(add, b.call(add, col["lt"], col["eq"]), b.call(add, col["gt"], col["nan"]))
    if mode == "concise_health":
        cols = [size, col["neg_inf"], col["pos_inf"], col["nan"]]
    else:
        cols = [size, b.call(sub, col["lt"], col["neg_inf"]), col["eq"], b.call(sub, col["gt"], col["pos_inf"]),
                col["neg_inf"], col["pos_inf"], col["nan"]]
    matrix = b.to(b.call(aten.cat.default, [b.call(aten.unsqueeze.default, c, 1) for c in cols], 1), torch.float64)
    if mode == "stats":
        matrix = b.call(aten.cat.default, [matrix, b.stack([m for _, m in rows])], 1)
    return matrix, flag
