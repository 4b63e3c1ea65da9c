"""check_numerics on a compiled graph: which op of the graph went non-finite, in words.

The graph has run to its end when its summary matrix is read (one synchronisation per graph
call, not per op); the first op in graph order whose output is harmful (``capture/_taint``; with
``strict``, not finite) is the one named, with its module, the user's line and its inputs'
summaries (intermediate tensors of a compiled graph do not exist outside it: their summary rows
describe them), and, when the value was made earlier (an inf), the op that made it.
"""

from __future__ import annotations

from trainguard.capture import _steps
from trainguard.capture._compile_graph import GraphPlan
from trainguard.capture._numerics import op_display, short_path, source_line, user_frame
from trainguard.store import MODE_FIELDS
from trainguard.store._codec import health_names, health_of


def describe_row(fields: tuple[str, ...], row: list[float]) -> str:
    """``1280 values, 46 -inf, 1234 negative``: a summary row as check_numerics words it."""
    if not fields:
        return "no summary"
    v = dict(zip(fields, row))
    if "size" not in v:
        return "holds NaN or Inf" if v.get("nonfinite") else "finite"
    n = int(v["size"])
    parts = [f"{n} value{'s' if n != 1 else ''}"]
    for key, word in (("nan", "NaN"), ("pos_inf", "+inf"), ("neg_inf", "-inf"), ("zero", "zero"), ("neg", "negative"),
                      ("pos", "positive")):
        c = v.get(key)
        if c is not None and c == c and c:
            c = int(c)
            parts.append(f"{c} {word}{'s' if word == 'zero' and c != 1 else ''}")
    return ", ".join(parts)


def _input_texts(r, plan: GraphPlan, k: int, rows: list | None, refs) -> list[str]:
    """Who made each input of op ``k`` and what it holds: an op of the graph by its summary
    row (its tensor does not exist outside the compiled code), a graph input by name."""
    fields = MODE_FIELDS[plan.mode]
    out = []
    for kind, j in plan.ops[k].inputs:
        if kind == "n":
            src_op = plan.ops[j]
            row = next((x for x in src_op.rows if x is not None), None)
            where = user_frame(list(src_op.frames))
            at = f" from {short_path(where[0])}:{where[1]}" if where else ""
            vals = describe_row(fields, rows[row]) if row is not None and rows is not None else "no summary"
            out.append(f"{op_display(src_op.name)} output{at}: {vals}")
        elif kind == "p" and refs[j] is not None:
            ref = refs[j]
            who = f"{ref[0]} {ref[1]!r}" if ref[0] in ("param", "buffer") else (
                f"output of execution #{ref[1]}" if ref[0] == "op" else "user input")
            out.append(f"{who} (a graph input)")
    return out


def origin_detail(g, r, k: int, rows: list | None, refs) -> tuple[str, tuple[str, ...]]:
    """What op ``k`` of the graph held when it made an inf, for the check_numerics message that
    names it if the inf becomes harmful later (as ``_numerics.origin_detail`` for eager ops)."""
    plan = g.plan
    first = next((row for row in plan.ops[k].rows if row is not None), None)
    out = describe_row(MODE_FIELDS[plan.mode], rows[first]) if first is not None and rows is not None else ""
    return out, tuple(_input_texts(r, plan, k, rows, refs))


def numerics_message(g, r, k: int, rows: list | None, mid, sid, refs, fw) -> str:
    """The NonFiniteError text for op ``k`` of a compiled graph that made the harmful value itself."""
    plan = g.plan
    t = plan.ops[k]
    fields = MODE_FIELDS[plan.mode]
    health = 0
    for row in t.rows:
        if row is not None and rows is not None:
            health |= health_of(fields, rows[row])
    what = "/".join(health_names(health))
    op = t.name.replace(".default", "")
    if t.shown is not None:
        op += f" (from {op_display(t.shown)})"
    backward = plan.kind == "backward"
    j = g.fwd_of[k] if backward and g.fwd_of else None
    fwd_op = g.pair.fw.ops[j].name if j is not None and g.pair.fw is not None else None
    if fwd_op is not None:
        op += f" (in the backward of {op_display(fwd_op)})"
    first = next((row for row in t.rows if row is not None), None)
    detail = f" ({describe_row(fields, rows[first])})" if first is not None and rows is not None else ""
    lines = [f"{op} produced {what} in step {_steps.clock.step}, {'backward' if backward else 'forward'} pass, "
             f"inside the compiled graph {g.label}{detail}"]
    mod = r.modules.module_of_id().get(mid) if mid is not None else None
    lines.append(f"  module: {mod[0] or '(root)'} ({mod[1]})" if mod else "  module: outside any nn.Module")
    fr = user_frame(r.stacks.frames(sid))
    if fr is not None:
        src = source_line(fr[0], fr[1])
        lead = "  created by the forward op at" if fwd_op is not None else "  at"
        lines.append(f"{lead} {short_path(fr[0])}:{fr[1]} in {fr[2]}" + (f": {src}" if src else ""))
    lines += [f"  input {i} = {text}" for i, text in enumerate(_input_texts(r, plan, k, rows, refs))]
    return "\n".join(lines)
