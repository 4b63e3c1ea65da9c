"""Instrument one AOT autograd graph (forward, backward or inference) for recording.

At compile time every aten op node becomes a record template: its op name, its outputs'
dtype/shape/device, where its inputs come from (another op of the graph, or graph input ``i``),
the module path from ``nn_module_stack`` and the user's frames from ``stack_trace``. Summary
rows for its tensor outputs are added to the graph (``_compile_summary``) and returned as extra
outputs (the summaries' 0-d reductions, one-element values and count vectors, then a "something
is non-finite" flag), which the runtime wrapper (``_compile_run``) strips before the caller sees the outputs; the plan's decoder makes
the rows of the mode's fields from them.
"""

from __future__ import annotations

import dataclasses
import operator
import re
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from trainguard.capture import _steps
from trainguard.capture._compile_summary import (
    Builder,
    Decoder,
    Parts,
    finish,
    scatter_row,
    segment_counts,
    summarisable,
    summary_row,
)
from trainguard.capture._summary import ALLOCATION_OPS
from trainguard.capture._taint import DEFAULT, OVERWRITE_OPS, RENORM, RENORM_OPS, classify
from trainguard.store import ALIAS_OPS, MODE_FIELDS

# An alias op's output holds the values of this argument (0 unless listed).
_ALIAS_ARG = {"aten.copy_.default": 1, "aten.copy.default": 1}
_ALIASES = ALIAS_OPS | set(_ALIAS_ARG)

_FRAME = re.compile(r'^\s*File "(?P<file>.+)", line (?P<line>\d+), in (?P<name>.+)$')
_ROOT = re.compile(r"^(?:[LG]\[['\"][^'\"]+['\"]\])")
_GETATTR = re.compile(r"getattr\(([^()]+?), ['\"]([^'\"]+)['\"]\)")
_PART = re.compile(r"\.(\w+)|\[['\"]([^'\"]*)['\"]\]|\[(\d+)\]")


def parse_stack_trace(text: str | None) -> tuple[tuple[str, int, str], ...]:
    """``File "x.py", line 3, in f`` lines of a node's ``stack_trace`` as frames, outermost first."""
    if not text:
        return ()
    out = []
    for line in text.splitlines():
        m = _FRAME.match(line)
        if m:
            out.append((m["file"], int(m["line"]), m["name"].strip()))
    return tuple(out)


def module_path(fqn: str) -> str:
    """``L['self'].layers.0.fc`` -> ``layers.0.fc``; ``G['model']`` -> ``""`` (relative to the
    module the compiled code was called on, as the eager recorder names modules)."""
    while "getattr(" in fqn:  # getattr(L['self'].layers, '0') -> L['self'].layers.0
        new = _GETATTR.sub(r"\1.\2", fqn)
        if new == fqn:
            break
        fqn = new
    m = _ROOT.match(fqn)
    rest = fqn[m.end():] if m else fqn
    parts = []
    for attr, key, index in _PART.findall(rest):
        name = attr or key or index
        if name not in ("_modules", "_parameters", "_buffers"):
            parts.append(name)
    return ".".join(parts)


def input_names(dynamo_gm: fx.GraphModule) -> list[tuple[str, str] | None]:
    """(kind, name) of each input of a Dynamo graph that is a parameter or buffer, from its source
    (``L['self']._modules['fc']._parameters['weight']`` -> ``("param", "fc.weight")``)."""
    out: list[tuple[str, str] | None] = []
    for node in dynamo_gm.graph.nodes:
        if node.op != "placeholder":
            continue
        arg = node.meta.get("grapharg")
        source = getattr(getattr(arg, "source", None), "name", None)
        if callable(source):
            source = source()
        if not isinstance(source, str):
            out.append(None)
        elif "._parameters[" in source:
            out.append(("param", module_path(source)))
        elif "._buffers[" in source:
            out.append(("buffer", module_path(source)))
        else:
            out.append(None)
    return out


@dataclass
class OpTemplate:
    """What stays the same for one op node across calls of its graph."""

    name: str  # the overload, as the eager recorder names it: aten.addmm.default
    wanted: bool  # passes the recording's op and dtype filters
    inputs: tuple  # per tensor input: ("n", op index) | ("p", graph input index) | ("input", None)
    outputs: tuple  # per tensor output: (dtype name, shape (ints or sympy expressions), device)
    rows: tuple  # per tensor output: row of the summary matrix, or None (no values: unknown)
    module: tuple[str, str | None] | None  # (path relative to the graph's root, type name)
    frames: tuple[tuple[str, int, str], ...]
    seq_nr: int | None  # autograd sequence number (pairs backward nodes with forward ones)
    # How its outputs' taint follows from its inputs' (capture/_taint): its class, whether it
    # overwrites its first input, whether it writes into it.
    cls: int = DEFAULT
    overwrite: bool = False
    inplace: bool = False
    # The op it was decomposed from (``original_aten``: Inductor's graphs hold softmax as amax,
    # sub, exp, sum, div), which names it in origins and intended counts; None when not decomposed.
    shown: str | None = None
    renorm_part: bool = False  # part of a decomposed softmax-like op: a NaN it makes is its own
    const: bool = False  # a decomposition's constant (masked_fill's -inf as full): the op's scalar argument
    recompute: bool = False  # a forward op the partitioner recomputes in the backward graph
    # Where it lies against an optimizer step traced into the graph (torch.compile(opt.step), see
    # _steps.step_tap): 0 before it (or none in the graph), 1 inside it, 2 after it.
    stage: int = 0


@dataclass
class GraphPlan:
    kind: str  # forward, backward, inference
    mode: str
    ops: list[OpTemplate] = field(default_factory=list)
    n_outputs: int = 0  # outputs the caller sees
    extra: int = 0  # summary outputs appended after them (the last is the non-finite flag)
    out_ops: tuple = ()  # per caller-visible output: (op index, output slot) or None
    n_rows: int = 0
    symbols: tuple = ()  # how to bind shape symbols from the inputs: ("arg", i, sym) | ("dim", i, d, sym)
    dynamic: bool = False
    fwd_index: dict[int, int] = field(default_factory=dict)  # seq_nr -> op index (forward graphs)
    input_names: tuple = ()  # per graph input: (kind, name) of a parameter or buffer, else None
    decoder: Decoder | None = None  # the summary rows from the extra outputs' values
    # node name -> (row, op name; None for a graph input): the values a forward graph summarised
    value_rows: dict[str, tuple] = field(default_factory=dict)
    fw_rows: tuple = ()  # a backward graph's rows n_rows + i: the forward call's row fw_rows[i]
    # A saved tensor that tells a forward call's backward: (forward output index, its node's name)
    # in a forward plan, (backward input index, None) in a backward plan; None when there is none.
    check: tuple | None = None


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


def _shape(val: torch.Tensor) -> tuple[tuple, bool]:
    out, dynamic = [], False
    for s in val.shape:
        if isinstance(s, torch.SymInt):
            expr = s.node.expr
            if expr.is_number:
                out.append(int(expr))
            else:
                out.append(expr)
                dynamic = True
        else:
            out.append(int(s))
    return tuple(out), dynamic


def _tensors(val) -> list[tuple[int, Any]]:
    if isinstance(val, torch.Tensor):
        return [(-1, val)]
    if isinstance(val, (tuple, list)):
        return [(i, v) for i, v in enumerate(val) if isinstance(v, torch.Tensor)]
    return []


def _module(node: fx.Node, key: str) -> tuple[str, str | None] | None:
    stack = node.meta.get(key)
    if not stack:
        return None
    fqn, cls = list(stack.values())[-1]
    name = cls.__name__ if isinstance(cls, type) else str(cls).rsplit(".", 1)[-1].rstrip("'>")
    return module_path(fqn), name


def _fake_mode(graph: fx.Graph):
    from torch._guards import detect_fake_mode

    vals = [n.meta.get("val") for n in graph.nodes if n.op == "placeholder"]
    return detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])


def _bind_symbols(placeholders: list[fx.Node]) -> tuple:
    out, seen = [], set()
    for i, ph in enumerate(placeholders):
        val = ph.meta.get("val")
        if isinstance(val, torch.SymInt) and val.node.expr.is_symbol and val.node.expr not in seen:
            seen.add(val.node.expr)
            out.append(("arg", i, val.node.expr))
        elif isinstance(val, torch.Tensor):
            for d, s in enumerate(val.shape):
                if isinstance(s, torch.SymInt) and s.node.expr.is_symbol and s.node.expr not in seen:
                    seen.add(s.node.expr)
                    out.append(("dim", i, d, s.node.expr))
    return tuple(out)


def instrument(gm: fx.GraphModule, kind: str, mode: str, ops_pattern=None, dtypes=None,
               names: list | None = None, fw: GraphPlan | None = None) -> GraphPlan:
    """Build the plan of ``gm`` and, unless the mode has no fields, add its summary outputs.

    ``names``: the parameters and buffers among the Dynamo graph's inputs (:func:`input_names`),
    which AOT autograd's inputs refer to by index. ``fw``: a backward graph's forward plan, whose
    rows give the backward's rows of the same values (see :func:`_forward_row`)."""
    graph = gm.graph
    plan = GraphPlan(kind=kind, mode=mode)
    fields = MODE_FIELDS[mode]
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    ph_index = {n: i for i, n in enumerate(placeholders)}
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    producer: dict[fx.Node, tuple[int, int]] = {}  # node -> (op index, output slot)
    row_of: dict[fx.Node, int] = {}  # tensor node -> summary row
    rows: list[tuple] = []  # per summary row: its raw counts (and moments), as _compile_summary.Lin
    builder = Builder(graph, _fake_mode(graph)) if fields else None
    parts = Parts(builder) if fields else None
    plan.input_names = tuple(_input_name(ph, names) for ph in placeholders)
    mod_key = "fwd_nn_module_stack" if kind == "backward" else "nn_module_stack"
    segmented = _full_selects(graph, mode) if fields else set()
    internal = _internal(graph, output) if fields else set()
    segments: dict[tuple[fx.Node, int], list] = {}  # (tensor, dim) -> its raw counts per index
    fw_values = fw.value_rows if fw is not None and fw.mode == mode and kind == "backward" else {}
    fw_rows: list[int] = []  # the forward call's rows this graph's rows n_rows.. are
    written = {n.args[0] for n in graph.nodes if n.target is torch.ops.aten.copy_.default and n.args}
    stage = 0
    stage_of: dict[fx.Node, int] = {}

    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        if node.target is _steps.step_tap:  # the optimizer hooks' taps: between them, its update
            which = node.args[2] if len(node.args) > 2 else node.kwargs["which"]
            stage = 1 if which == _steps.PRE else 2
            continue
        outs = _tensors(node.meta.get("val"))
        if not outs:
            continue  # symbolic-size arithmetic, asserts: not tensor ops
        name = str(node.target)
        k = len(plan.ops)
        wanted = not name.startswith("profiler.") and (ops_pattern is None or ops_pattern.search(name) is not None)
        if dtypes is not None and not any(v.dtype in dtypes for _, v in outs):
            wanted = False
        # Each tensor output as a node: the node itself, or its getitem (made when missing).
        out_nodes = []
        getitems = {u.args[1]: u for u in node.users if u.target is operator.getitem}
        for slot, (index, val) in enumerate(outs):
            if index < 0:
                tnode = node
            else:
                tnode = getitems.get(index)
                if tnode is None and builder is not None and wanted:
                    builder.cursor = node
                    tnode = builder.call(operator.getitem, node, index)
            if tnode is not None:
                producer[tnode] = (k, slot)
            out_nodes.append((tnode, val))
        inputs = []
        for a in _flat_nodes((*node.args, *node.kwargs.values())):
            if not isinstance(a.meta.get("val"), torch.Tensor):
                continue
            if a in ph_index:
                inputs.append(("p", ph_index[a]))
            elif a in producer:
                inputs.append(("n", producer[a][0]))
            else:
                inputs.append(("input", None))
        metas, dyn = [], False
        for _, val in out_nodes:
            shape, d = _shape(val)
            dyn = dyn or d
            metas.append((_dtype_name(val.dtype), shape, str(val.device)))
        plan.dynamic = plan.dynamic or dyn
        out_rows = []
        for tnode, val in out_nodes:
            r = None
            if builder is not None and wanted and tnode is not None and name not in ALLOCATION_OPS:
                src = _alias_source(node, name)
                same = src is not None and src.meta["val"].dtype == val.dtype
                if same and src not in row_of and src in ph_index:
                    r = _forward_row(fw_values, src.name, _ANY, fw_rows)
                    if r is not None:
                        row_of[src] = r  # a saved tensor the forward call summarised (a parameter)
                if same and src in row_of:
                    r = row_of[src]  # an alias holds its input's values: no second pass
                elif (fw_values and node.meta.get("partitioner_tag") == "is_forward" and node not in internal
                      and (r := _forward_row(fw_values, tnode.name, name, fw_rows)) is not None):
                    pass  # a forward value the backward recomputes: the forward call's row
                elif node in segmented:
                    key = (node.args[0], _norm_dim(node))
                    builder.cursor = tnode  # the first select of the tensor: its segmented pass here
                    if key not in segments:
                        segments[key] = segment_counts(builder, parts, key[0], key[1], mode)
                    rows.append(segments[key][node.args[2] % key[0].meta["val"].shape[key[1]]])
                    r = len(rows) - 1
                elif summarisable(val) and node not in internal:
                    builder.cursor = tnode  # right after it is made, where Inductor can fuse the pass
                    src = node.args[1] if name == "aten.select_scatter.default" else None
                    derived = scatter_row(node, rows[row_of[src]], mode) if src in row_of else None
                    rows.append(derived if derived is not None else summary_row(builder, parts, tnode, mode))
                    r = len(rows) - 1
                    alias_of = _alias_source(node, name)
                    if (kind != "backward" and alias_of in ph_index and alias_of not in written
                            and alias_of.meta["val"].dtype == val.dtype):
                        # a view of a graph input (t of a weight): the row of the input's values,
                        # for another view of it here and for the backward graph's
                        row_of[alias_of] = r
                        plan.value_rows[alias_of.name] = (r, None)
                if r is not None:
                    row_of[tnode] = r
                    if kind != "backward" and r >= 0:
                        plan.value_rows.setdefault(tnode.name, (r, name))
            out_rows.append(r)
        seq_nr = node.meta.get("seq_nr")
        is_view, inplace = _aliasing(node.target)
        original = node.meta.get("original_aten")
        shown = str(original) if original is not None and str(original) != name else None
        cls = classify(name, is_view)
        plan.ops.append(OpTemplate(
            name=name, wanted=wanted, inputs=tuple(inputs), outputs=tuple(metas), rows=tuple(out_rows),
            module=_module(node, mod_key), frames=parse_stack_trace(node.meta.get("stack_trace")),
            seq_nr=seq_nr if isinstance(seq_nr, int) else None,
            cls=cls, overwrite=name in OVERWRITE_OPS, inplace=inplace, shown=shown,
            renorm_part=shown is not None and cls != RENORM and shown in RENORM_OPS,
            const=shown is not None and not inputs,
            recompute=kind == "backward" and node.meta.get("partitioner_tag") == "is_forward",
            stage=_stage(node, stage, ph_index, stage_of),
        ))
        stage_of[node] = plan.ops[-1].stage
        if kind != "backward" and isinstance(seq_nr, int) and seq_nr not in plan.fwd_index:
            plan.fwd_index[seq_nr] = k  # the first op of a sequence number made its autograd node

    results = list(output.args[0]) if isinstance(output.args[0], (tuple, list)) else [output.args[0]]
    plan.n_outputs = len(results)
    plan.out_ops = tuple(producer.get(r) if isinstance(r, fx.Node) else None for r in results)
    plan.symbols = _bind_symbols(placeholders) if plan.dynamic else ()
    plan.n_rows = len(rows)
    if fw_rows:  # rows taken from the forward call: numbered after this graph's own
        plan.fw_rows = tuple(fw_rows)
        plan.ops = [_renumber(t, len(rows)) for t in plan.ops]
        name = fw.check[1] if fw.check is not None else None
        plan.check = next(((i, None) for i, ph in enumerate(placeholders) if ph.name == name), None)
    elif kind == "forward" and fields:
        plan.check = _check_output(output, results, ph_index, plan.input_names)
    if rows or fw_rows:
        builder.cursor = output.prev
        extra, plan.decoder = finish(builder, parts, rows, mode)
        output.args = (tuple(results) + tuple(extra),)
        plan.extra = len(extra)
        graph.lint()
        gm.recompile()
    return plan


_ANY = object()


def _forward_row(fw_values: dict, name: str, op: str | None, fw_rows: list) -> int | None:
    """A backward graph's row for the value the forward graph's node ``name`` holds (the forward
    call's row; numbered -1, -2, ... until the graph's own rows are counted), or None.

    AOT autograd names a backward graph's saved-tensor inputs and recomputed nodes as the
    forward nodes they are. A saved parameter (``t(W)`` in the backward of a linear layer) holds
    the values its forward view was summarised from: autograd refuses a backward whose saved
    tensors changed since the forward. A recomputed node (``op`` its op) recomputes the forward
    node from the same inputs. Which forward call a backward call belongs to is told by a saved
    tensor's address (``GraphPlan.check``)."""
    got = fw_values.get(name)
    if got is None or (op is not _ANY and got[1] != op):
        return None
    if got[0] not in fw_rows:
        fw_rows.append(got[0])
    return -1 - fw_rows.index(got[0])


def _check_output(output: fx.Node, results: list, ph_index: dict, input_names: tuple) -> tuple | None:
    """A tensor the forward graph returns only to save it for the backward, made by this call
    (not a parameter): its address tells which forward call a backward call belongs to."""
    descs = output.meta.get("desc")
    if not isinstance(descs, (tuple, list)) or len(descs) != len(results):
        return None
    saved = [(j, res) for j, (res, d) in enumerate(zip(results, descs))
             if type(d).__name__ == "SavedForBackwardsAOTOutput" and isinstance(res, fx.Node)
             and isinstance(res.meta.get("val"), torch.Tensor)]
    # An op's output first: a new tensor per call (one input may be passed to two calls).
    for j, res in saved:
        if res not in ph_index:
            return (j, res.name)
    return next(((j, res.name) for j, res in saved if input_names[ph_index[res]] is None), None)


def _renumber(t: OpTemplate, n_rows: int) -> OpTemplate:
    if not any(r is not None and r < 0 for r in t.rows):
        return t
    return dataclasses.replace(t, rows=tuple(n_rows - 1 - r if r is not None and r < 0 else r for r in t.rows))


def _stage(node: fx.Node, stage: int, ph_index: dict, stage_of: dict) -> int:
    """An op's stage against an optimizer step in the graph; the copy of a mutated graph input's
    new values into it (functionalization's write-back, at the graph's end, after the post tap)
    belongs where its values were made: the update's write-back into the parameters is the
    optimizer's."""
    if (node.target is torch.ops.aten.copy_.default and node.args and node.args[0] in ph_index
            and len(node.args) > 1 and node.args[1] in stage_of):
        return stage_of[node.args[1]]
    return stage


def _decomposition(node: fx.Node) -> tuple | None:
    """Which decomposed eager op ``node`` is part of: (the op, its autograd sequence number), or
    None for a node that is an op of its own (or whose op cannot be told from a neighbour's)."""
    original = node.meta.get("original_aten")
    seq_nr = node.meta.get("seq_nr")
    if node.op != "call_function" or original is None or not isinstance(seq_nr, int):
        return None
    name = str(original)
    return None if name == str(node.target) else (name, seq_nr)


def _internal(graph: fx.Graph, output: fx.Node) -> set[fx.Node]:
    """Nodes inside one eager op's decomposition whose values only that decomposition reads:
    LayerNorm's centred input and its scaled copy, a softmax's row maxima and exponentials.
    No eager op returns them (eager recording never sees them), so they need no summary of their
    own; the decomposition's results (what the eager op returns: its value read by another op
    or returned by the graph) keep theirs, and a NaN or inf made inside reaches them."""
    saved = _saved_only(output)
    out: set[fx.Node] = set()
    for node in graph.nodes:
        key = _decomposition(node)
        if key is None or not node.users:
            continue
        # Saved for the backward only: internal unless the eager op returns more than its
        # result (LayerNorm's mean and rstd are outputs of native_layer_norm, recorded eagerly).
        if all((node in saved and _returns(node) == 1) if u is output
               else (u.target is not operator.getitem and _decomposition(u) == key) for u in node.users):
            out.add(node)
    return out


def _returns(node: fx.Node) -> int:
    """How many values the eager op ``node`` was decomposed from returns (0: unknown)."""
    try:
        return len(node.meta["original_aten"]._schema.returns)
    except Exception:  # not an OpOverload with a schema
        return 0


def _saved_only(output: fx.Node) -> set[fx.Node]:
    """Nodes a forward graph returns only to save them for its backward (AOT autograd's output
    descriptors say which): not values the program sees. A softmax's row maxima and sums are
    saved so that the backward graph recomputes its exponentials."""
    descs = output.meta.get("desc")
    results = output.args[0] if isinstance(output.args[0], (tuple, list)) else [output.args[0]]
    if not isinstance(descs, (tuple, list)) or len(descs) != len(results):
        return set()
    saved, seen = set(), set()
    for r, d in zip(results, descs):
        if isinstance(r, fx.Node):
            (saved if type(d).__name__ == "SavedForBackwardsAOTOutput" else seen).add(r)
    return saved - seen


def _norm_dim(node: fx.Node) -> int:
    return node.args[1] % node.args[0].meta["val"].dim()


def _full_selects(graph: fx.Graph, mode: str) -> set[fx.Node]:
    """``select.int`` nodes whose selects of one tensor along one dim cover every index (q, k and v
    of a packed projection): their rows come from one segmented pass over that tensor. Floating
    tensors of static shape; not for ``stats`` (its moments stay one pass per select)."""
    if mode == "stats":
        return set()
    groups: dict[tuple[fx.Node, int], list[fx.Node]] = {}
    for node in graph.nodes:
        if node.op != "call_function" or node.target is not torch.ops.aten.select.int:
            continue
        src = node.args[0]
        val = src.meta.get("val") if isinstance(src, fx.Node) else None
        if (not isinstance(val, torch.Tensor) or not val.is_floating_point() or not summarisable(val)
                or not all(isinstance(d, int) for d in val.shape) or not isinstance(node.args[2], int)
                or node.meta["val"].dtype != val.dtype):
            continue
        groups.setdefault((src, _norm_dim(node)), []).append(node)
    out: set[fx.Node] = set()
    for (src, dim), nodes in groups.items():
        size = src.meta["val"].shape[dim]
        if size > 1 and {n.args[2] % size for n in nodes} == set(range(size)):
            out.update(nodes)
    return out


def _aliasing(target) -> tuple[bool, bool]:
    """(is a view, writes into its first input) from an op's schema, as the eager recorder reads it."""
    try:
        schema = target._schema
        first = schema.arguments[0].alias_info if schema.arguments else None
        return bool(target.is_view), first is not None and first.is_write
    except Exception:  # not an OpOverload with a schema
        return False, False


def _input_name(ph: fx.Node, names: list | None):
    desc = ph.meta.get("desc")
    idx = getattr(desc, "idx", None) if type(desc).__name__ == "PlainAOTInput" else None
    if names is None or not isinstance(idx, int) or not 0 <= idx < len(names):
        return None
    return names[idx]


def _flat_nodes(args) -> list[fx.Node]:
    out: list[fx.Node] = []
    fx.node.map_arg(args, out.append)
    return out


def _alias_source(node: fx.Node, name: str) -> fx.Node | None:
    if name not in _ALIASES:
        return None
    i = _ALIAS_ARG.get(name, 0)
    src = node.args[i] if len(node.args) > i else None
    return src if isinstance(src, fx.Node) else None
