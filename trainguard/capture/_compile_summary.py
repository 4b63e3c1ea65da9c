"""Tensor summaries as FX nodes: the reductions a recorded graph computes beside its own kernels.

Each summarised tensor gets the raw counts of the mode (and, for ``stats``, its moments), each
a reduction of a comparison over the tensor that Inductor fuses into a pass over it (usually
into the kernel that produced it). The reductions' 0-d results are the graph's extra outputs as
they are, with no stacking inside the graph (a concatenation there is one aliasing view and one
copy per count in the generated code): the call's outputs are stacked into one vector off the
graph, and the mode's fields of every row are derived from that vector by a function generated
once per graph (:class:`Decoder`), on the writer's thread. Each raw count of a row is a linear
form over the outputs (:class:`Lin`): a count a tensor's size determines (the NaN count of a
static size, a constant fill's counts) takes no reduction at all. Counts are exact integers;
``neg`` and ``pos`` count finite values only, as the eager summaries do. A one-element value
(an optimizer's step and bias corrections, a loss) is an output itself, its row derived from
the value (:class:`One`). The last extra output is the graph's "anything non-finite" flag (a
0-d bool, read without a sync on CPU).
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


# Marks the nodes the summaries add to a graph: Inductor must not let them change how it compiles
# the program's own nodes (see _compile._as_plain).
SUMMARY_NODE = "trainguard_summary"
# How _compile._as_plain compiles an instrumented graph, in its summary nodes' names and so in
# Inductor's cache key: raised when that changes, so that no graph compiled the older way is
# served from the on-disk cache (a Newton-Schulz step cached before the pattern matcher counted
# the program's users only kept computing what the plain graph does not).
AS_PLAIN_VERSION = 2


class Builder:
    """Appends nodes to a graph after a cursor, with ``meta["val"]`` computed on the fake values
    (Inductor's passes read it)."""

    def __init__(self, graph: fx.Graph, fake_mode):
        self.graph = graph
        self.fake_mode = fake_mode
        self.cursor: fx.Node | None = None

    def call(self, target, *args, **kwargs) -> fx.Node:
        with self.graph.inserting_after(self.cursor):
            # Named apart: the graph's code (Inductor's cache key) then says it is lowered as
            # _compile._as_plain does, never served as compiled before that.
            node = self.graph.call_function(target, args, kwargs, name=f"tg_summary_v{AS_PLAIN_VERSION}")
        self.cursor = node
        fake_args = fx.node.map_arg(args, lambda n: n.meta["val"])
        fake_kwargs = fx.node.map_arg(kwargs, lambda n: n.meta["val"])
        with self.fake_mode:
            node.meta["val"] = target(*fake_args, **fake_kwargs)
        node.meta[SUMMARY_NODE] = True
        return node

    def to(self, node: fx.Node, dtype: torch.dtype) -> fx.Node:
        return self.call(_convert, node, dtype)


class Lin:
    """``const + sum(coef * v[ref])``: one raw count (or moment) of a row, over the values of the
    graph's summary outputs (``ref``: a 0-d output's index, or (vector output, index))."""

    __slots__ = ("const", "terms")

    def __init__(self, const=0, terms: dict | None = None):
        self.const = const
        self.terms = terms or {}

    def __add__(self, other: Lin) -> Lin:
        terms = dict(self.terms)
        for ref, c in other.terms.items():
            c = terms.get(ref, 0) + c
            if c:
                terms[ref] = c
            else:
                terms.pop(ref, None)
        return Lin(self.const + other.const, terms)

    def __neg__(self) -> Lin:
        return Lin(-self.const, {ref: -c for ref, c in self.terms.items()})

    def __sub__(self, other: Lin) -> Lin:
        return self + (-other)

    def source(self, index) -> str:
        """Python source of the value, ``index(ref)`` being the value's position in ``v``."""
        parts = [] if not self.const and self.terms else [_literal(self.const)]
        for ref, c in self.terms.items():
            term = f"v[{index(ref)}]"
            parts.append(("+ " if parts else "") + term if c == 1 else ("- " if parts else "-") + term if c == -1
                         else f"{'+ ' if parts else ''}{c} * {term}")
        return parts[0] if len(parts) == 1 else f"({' '.join(parts)})"


def _literal(c) -> str:
    c = float(c)
    if c != c:
        return "NAN"
    if math.isinf(c):
        return "INF" if c > 0 else "-INF"
    return repr(c)


class Parts:
    """The graph's summary outputs: 0-d reductions, and per-index count vectors (segmented passes)."""

    def __init__(self, builder: Builder):
        self.b = builder
        self.scalars: list[fx.Node] = []
        self.vectors: list[fx.Node] = []
        # sum(x * 0) of summarised float tensors (NaN for a NaN or an infinity in x, else 0) and
        # the ids of their rows: the flag reads them, not the rows' counts
        self.probes: list[fx.Node] = []
        self.probed: set[int] = set()

    def scalar(self, node: fx.Node) -> Lin:
        self.scalars.append(node)
        return Lin(0, {len(self.scalars) - 1: 1})

    def count(self, mask: fx.Node, acc: torch.dtype) -> Lin:
        return self.scalar(self.b.call(aten.sum.default, mask, dtype=acc))

    def vector(self, node: fx.Node) -> int:
        self.vectors.append(node)
        return len(self.vectors) - 1


class One:
    """The row of a one-element value: the value itself is an output (one node, no pass), its
    fields derived from it off the graph."""

    __slots__ = ("ref",)

    def __init__(self, ref: int):
        self.ref = ref


def _one_fields(x: float, mode: str) -> tuple:
    """The mode's fields of a one-element tensor holding ``x`` (what eager's summary says)."""
    nan, ninf, pinf = x != x, x == -math.inf, x == math.inf
    if mode == "curt_health":
        return (float(nan + 2 * pinf + 4 * ninf),)
    if mode == "concise_health":
        return (1.0, float(ninf), float(pinf), float(nan))
    fields = (1.0, float(x < 0 and not ninf), float(x == 0), float(x > 0 and not pinf), float(ninf), float(pinf),
              float(nan))
    if mode == "stats":
        fields += (x, x, x, 0.0 if math.isfinite(x) else math.nan)
    return fields


# The raw counts of one tensor, in this order (health modes); ``curt_health`` has [NaN, +inf,
# -inf]; ``stats`` adds [min, max, mean, std]. The mode's fields are derived from them off the graph.
RAW = ("lt", "eq", "gt", "nan", "neg_inf", "pos_inf")
_ZERO = Lin(0)


def _acc(val) -> torch.dtype:
    # Counts accumulate in int32 below 2**31 elements (one vector lane per element, as the
    # float compare); the stacked vector is float64.
    n = val.numel()
    return torch.int32 if isinstance(n, int) and n < 2**31 else torch.int64


def _raw_counts(b: Builder, parts: Parts, x: fx.Node) -> tuple[Lin, ...]:
    """[< 0, == 0, > 0, NaN, -inf, +inf] counts of ``x``.

    Each count is a full reduction of a mask over ``x``'s own shape, which Inductor fuses with
    the other counts and with the kernel that makes ``x`` (stacking the masks first would make it
    materialise them). A count the others and a static size determine takes no reduction: NaN
    compares false with 0, so the NaN count is what the three sign classes leave.
    """
    val = x.meta["val"]
    n = val.numel()
    static = isinstance(n, int)
    acc = _acc(val)
    count = parts.count
    if val.dtype == torch.bool:
        gt = count(x, acc)
        eq = Lin(n) - gt if static else count(b.call(aten.logical_not.default, x), acc)
        return (_ZERO, eq, gt, _ZERO, _ZERO, _ZERO)
    lt = count(b.call(aten.lt.Scalar, x, 0), acc)
    eq = count(b.call(aten.eq.Scalar, x, 0), acc)
    if not val.is_floating_point():
        gt = Lin(n) - lt - eq if static else count(b.call(aten.gt.Scalar, x, 0), acc)
        return (lt, eq, gt, _ZERO, _ZERO, _ZERO)
    gt = count(b.call(aten.gt.Scalar, x, 0), acc)
    # ne(x, x) vectorises; isnan does not on CPU
    nan = Lin(n) - lt - eq - gt if static else count(b.call(aten.ne.Tensor, x, x), acc)
    return (lt, eq, gt, nan, count(b.call(aten.eq.Scalar, x, -math.inf), acc),
            count(b.call(aten.eq.Scalar, x, math.inf), acc))


def segment_counts(b: Builder, parts: Parts, x: fx.Node, dim: int, mode: str) -> list[tuple[Lin, ...]]:
    """The raw counts (curt_health's three for that mode) of every index of ``x`` along ``dim``:
    one pass over ``x`` for all its selects (q, k and v of an attention's packed projection),
    instead of one pass per select. Static shapes only."""
    val = x.meta["val"]
    dims = [d for d in range(val.dim()) if d != dim]
    size = val.shape[dim]
    n = val.numel() // size
    acc = torch.int32 if n < 2**31 else torch.int64

    def count(mask: fx.Node) -> list[Lin]:
        j = parts.vector(b.call(aten.sum.dim_IntList, mask, dims, dtype=acc) if dims else b.to(mask, acc))
        return [Lin(0, {(j, i): 1}) for i in range(size)]

    if mode == "curt_health":
        cols = [count(b.call(aten.ne.Tensor, x, x)), count(b.call(aten.eq.Scalar, x, math.inf)),
                count(b.call(aten.eq.Scalar, x, -math.inf))]
        return [tuple(c[i] for c in cols) for i in range(size)]
    lt, eq, gt = (count(b.call(aten.lt.Scalar, x, 0)), count(b.call(aten.eq.Scalar, x, 0)),
                  count(b.call(aten.gt.Scalar, x, 0)))
    ninf, pinf = count(b.call(aten.eq.Scalar, x, -math.inf)), count(b.call(aten.eq.Scalar, x, math.inf))
    return [(lt[i], eq[i], gt[i], Lin(n) - lt[i] - eq[i] - gt[i], ninf[i], pinf[i]) for i in range(size)]


def _moments(b: Builder, parts: Parts, x: fx.Node) -> tuple[Lin, ...]:
    """[min, max, mean, std] in float64 (population std, two passes like the deferred summary)."""
    val = x.meta["val"]
    if val.numel() == 0:
        return (Lin(math.nan),) * 4
    f = b.to(x, torch.float64)
    mn = b.call(aten.amin.default, f)
    mx = b.call(aten.amax.default, f)
    mean = b.call(aten.mean.default, f)
    dev = b.call(aten.sub.Tensor, f, mean)
    std = b.call(aten.sqrt.default, b.call(aten.mean.default, b.call(aten.mul.Tensor, dev, dev)))
    return tuple(parts.scalar(m) for m in (mn, mx, mean, std))


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


def scatter_row(x: fx.Node, src_row: tuple[Lin, ...], mode: str) -> tuple[Lin, ...] | None:
    """The raw counts of ``select_scatter(full(v), src, ...)`` (select_backward decomposed) as
    ``src``'s counts plus those of the fill around it: no pass. None where that does not hold."""
    if mode == "stats" or x.target is not aten.select_scatter.default:
        return None
    base, src = x.args[0], x.args[1]
    if isinstance(src_row, One):
        return None
    v = _fill_value(base) if isinstance(base, fx.Node) else None
    if v is None or not isinstance(src.meta["val"].numel(), int) or src.meta["val"].dtype != x.meta["val"].dtype:
        return None
    fill = _constant_row(x, v, mode, n=x.meta["val"].numel() - src.meta["val"].numel())
    return tuple(a + c for a, c in zip(src_row, fill))


def _constant_row(x: fx.Node, v, mode: str, n: int | None = None) -> tuple[Lin, ...]:
    """The summary row of a tensor filled with ``v`` (``n`` of its elements where given),
    known at compile time: no pass over the tensor (select_backward's zeros, a masked_fill's
    -inf are as big as the tensors they fill)."""
    val = x.meta["val"]
    n = val.numel() if n is None else n
    nan, pinf, ninf = (n, 0, 0) if v != v else (0, n, 0) if v == math.inf else (0, 0, n) if v == -math.inf \
        else (0, 0, 0)
    if mode == "curt_health":
        counts = [nan, pinf, ninf] if val.is_floating_point() else [0, 0, 0]
    else:
        sign = (0, 0, 0) if v != v else (n, 0, 0) if v < 0 else (0, n, 0) if v == 0 else (0, 0, n)
        counts = [*sign, nan, ninf, pinf]
    if mode == "stats":
        f = float(v)
        counts += [math.nan] * 4 if n == 0 else [f, f, f, 0.0 if math.isfinite(f) else math.nan]
    return tuple(Lin(c) for c in counts)


def summary_row(b: Builder, parts: Parts, x: fx.Node, mode: str) -> tuple[Lin, ...] | One:
    """The raw counts of tensor node ``x`` ([NaN, +inf, -inf] for curt_health) and, for
    ``stats``, its moments; their reductions inserted after ``b.cursor``. A one-element value's
    row is the value (as float64: a sum over its one element)."""
    val = x.meta["val"]
    fill = _fill_value(x)
    if fill is not None:
        return _constant_row(x, fill, mode)
    n = val.numel()
    if isinstance(n, int) and n == 1:
        parts.scalars.append(b.call(aten.sum.default, x, dtype=torch.float64))
        return One(len(parts.scalars) - 1)
    if mode == "curt_health":
        # [NaN, +inf, -inf] counts: the stored value is the health bits (1 NaN, 2 +inf, 4 -inf),
        # which tell a NaN from a masked -inf (docs/recorder.md, "Harmful, intended, unknown").
        if not val.is_floating_point():
            return (_ZERO,) * 3
        acc = _acc(val)
        return (parts.count(b.call(aten.ne.Tensor, x, x), acc),  # vectorises; isnan does not
                parts.count(b.call(aten.eq.Scalar, x, math.inf), acc),
                parts.count(b.call(aten.eq.Scalar, x, -math.inf), acc))
    row = _raw_counts(b, parts, x)
    row = row + _moments(b, parts, x) if mode == "stats" else row
    if val.is_floating_point():
        # one more accumulator in the same pass: 3 nodes of the flag instead of ~6 over the counts
        parts.probes.append(b.call(aten.sum.default, b.call(aten.mul.Tensor, x, 0.0)))
        parts.probed.add(id(row))
    return row


def _fields(raw: tuple[Lin, ...], mode: str) -> list[Lin] | None:
    """The mode's fields of one row as linear forms (None: curt_health's bits, not linear)."""
    if mode == "curt_health":
        return None
    lt, eq, gt, nan, ninf, pinf = raw[:6]
    size = lt + eq + gt + nan  # every element is < 0, == 0, > 0 or NaN; neg and pos count finite values only
    if mode == "concise_health":
        return [size, ninf, pinf, nan]
    return [size, lt - ninf, eq, gt - pinf, ninf, pinf, nan, *raw[6:]]


class Decoder:
    """The rows of one graph call's summaries from its stacked outputs: ``decode(values)`` ->
    one tuple of the mode's fields per row, as floats (the eager summaries' values)."""

    def __init__(self, rows: list, mode: str, position: list[int], runs: list[tuple[int, int]],
                 vector_sizes: list[int]):
        offsets, at = [], len(position)
        for s in vector_sizes:
            offsets.append(at)
            at += s
        self.n_values = at
        self.runs = runs  # the 0-d outputs' runs of one dtype (stacked apart: mixed, stack is slow)

        def index(ref) -> int:
            return position[ref] if isinstance(ref, int) else offsets[ref[0]] + ref[1]

        lines = []
        for raw in rows:
            if isinstance(raw, One):
                lines.append(f"    ONE(v[{index(raw.ref)}], {mode!r}),")
                continue
            fields = _fields(raw, mode)
            if fields is None:
                nan, pinf, ninf = (f.source(index) for f in raw)
                lines.append(f"    (float(({nan} > 0) + 2 * ({pinf} > 0) + 4 * ({ninf} > 0)),),")
            else:
                lines.append("    (" + ", ".join(f.source(index) for f in fields) + ",),")
        self.source = "def decode(v):\n  return [\n" + "\n".join(lines) + "\n  ]\n"
        self.decode = self._compiled()

    def _compiled(self):
        namespace = {"NAN": math.nan, "INF": math.inf, "ONE": _one_fields}
        exec(compile(self.source, "<trainguard compiled-graph summaries>", "exec"), namespace)  # noqa: S102
        return namespace["decode"]

    # Pickled with the graph (Inductor's FX graph cache pickles it to key it): as its source.
    def __getstate__(self) -> dict:
        return {"source": self.source, "n_values": self.n_values, "runs": self.runs}

    def __setstate__(self, state: dict) -> None:
        self.source, self.n_values, self.runs = state["source"], state["n_values"], state["runs"]
        self.decode = self._compiled()


def _flag(b: Builder, parts: Parts, rows: list, mode: str) -> fx.Node:
    """Whether anything summarised is NaN or infinite, as one 0-d bool: a one-element value by
    ``0 * v`` and a float tensor's row by its probe, ``sum(x * 0)`` (NaN for a NaN or an
    infinity, else 0), summed; other rows (derived from counts: segmented passes, scatters into
    fills) by their non-finite count, a linear form over their counts in their own dtype,
    compared with 0; or-ed. Three nodes a tensor: summed in int64 over the whole graph, the
    counts took about fifteen, more than the counts themselves."""
    flag = None
    zeros = None
    for z in parts.probes:
        zeros = z if zeros is None else b.call(aten.add.Tensor, zeros, z)
    const_bad = False

    def node_of(ref) -> fx.Node:
        return parts.scalars[ref] if isinstance(ref, int) else b.call(aten.select.int, parts.vectors[ref[0]], 0, ref[1])

    def either(a, c):
        return c if a is None else b.call(aten.logical_or.default, a, c)

    for raw in rows:
        if isinstance(raw, One):
            z = b.call(aten.mul.Tensor, parts.scalars[raw.ref], 0.0)
            zeros = z if zeros is None else b.call(aten.add.Tensor, zeros, z)
            continue
        if id(raw) in parts.probed:
            continue
        lin = Lin(0)
        for f in (raw if mode == "curt_health" else raw[3:6]):
            lin = lin + f
        if not lin.terms:
            const_bad = const_bad or lin.const > 0
            continue
        expr = None
        for ref, c in sorted(lin.terms.items(), key=lambda t: -t[1]):  # the positive terms first
            node = node_of(ref)
            if expr is None:
                expr = node if c == 1 else b.call(aten.mul.Tensor, node, c)
            elif abs(c) == 1:
                expr = b.call(aten.add.Tensor if c > 0 else aten.sub.Tensor, expr, node)
            else:
                expr = b.call(aten.add.Tensor, expr, b.call(aten.mul.Tensor, node, c))
        flag = either(flag, b.call(aten.gt.Scalar, expr, -lin.const))
    if zeros is not None:
        flag = either(flag, b.call(aten.ne.Scalar, zeros, 0))
    if const_bad or flag is None:
        device = next((p.meta["val"].device for p in (*parts.scalars, *parts.vectors)), "cpu")
        const = b.call(aten.full.default, [], const_bad, dtype=torch.bool, device=device)
        flag = const if flag is None else either(flag, const)
    return flag


def finish(b: Builder, parts: Parts, rows: list, mode: str) -> tuple[list[fx.Node], Decoder]:
    """The graph's extra outputs (its 0-d reductions and values, its count vectors, then the
    "anything non-finite" flag) and the decoder of their values."""
    flag = _flag(b, parts, rows, mode)
    # The 0-d outputs grouped by dtype (int32 counts, float64 values and moments): torch.stack of
    # mixed dtypes takes a slow path (870 us for 256 outputs, 160 us for one dtype).
    order = sorted(range(len(parts.scalars)), key=lambda i: str(parts.scalars[i].meta["val"].dtype))
    position = [0] * len(order)
    runs: list[tuple[int, int]] = []
    for at, i in enumerate(order):
        position[i] = at
        dtype = parts.scalars[i].meta["val"].dtype
        if runs and parts.scalars[order[runs[-1][0]]].meta["val"].dtype == dtype:
            runs[-1] = (runs[-1][0], at + 1)
        else:
            runs.append((at, at + 1))
    decoder = Decoder(rows, mode, position, runs, [v.meta["val"].shape[0] for v in parts.vectors])
    return [*(parts.scalars[i] for i in order), *parts.vectors, flag], decoder
