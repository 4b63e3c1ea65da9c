"""What ``check_numerics`` says when it stops: the op, its module and line, its inputs, and the
origin of a value that became harmful later than it was made (the ``exp`` that overflowed, not
the ``sum`` the loss was). Cold code: it runs once, when the error is raised.
"""

from __future__ import annotations

import linecache
import os

import torch

from trainguard.capture import _steps
from trainguard.capture._summary import raw_isnan, summarize_immediate
from trainguard.store._codec import NAN, NEG_INF, POS_INF, REACHED, health_names

_Tensor = torch.Tensor



def op_display(name: str) -> str:
    """``aten._softmax.default`` -> ``softmax``: the op's name as a user knows it."""
    base = name.split(".")[1] if name.startswith(("aten.", "prims.")) else name.split(".")[0]
    return base.lstrip("_") or base


def short_path(path: str) -> str:
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return rel if not rel.startswith("..") else path


def user_frame(frames):
    from trainguard.capture._stacks import user_frame as _uf

    return _uf(frames)


def describe_values(t: _Tensor) -> str:
    """``1000 values, 1 zero, 999 positive`` — a compact full-health description (syncs)."""
    if not isinstance(t, _Tensor):
        return repr(t)
    s = summarize_immediate(t.detach().cpu() if t.device.type != "cpu" else t, "full_health")
    n, neg, zero, pos, ninf, pinf, nan = (int(v) for v in s)
    parts = [f"{n} value{'s' if n != 1 else ''}"]
    for count, word in ((nan, "NaN"), (pinf, "+inf"), (ninf, "-inf"), (zero, "zero"), (neg, "negative"), (pos, "positive")):
        if count:
            plural = "s" if count != 1 and word in ("zero",) else ""
            parts.append(f"{count} {word}{plural}")
    parts.append(f"dtype {str(t.dtype).replace('torch.', '')}, shape {list(t.shape)}")
    return ", ".join(parts)


def flatten(xs, out: list) -> list:
    for x in xs:
        if isinstance(x, _Tensor):
            out.append(x)
        elif isinstance(x, (list, tuple)):
            for y in x:
                if isinstance(y, _Tensor):
                    out.append(y)
    return out


def health_sync(o: _Tensor) -> int:
    """Exactly which non-finite kinds ``o`` holds (check_numerics: synchronises)."""
    flags = 0
    if o.is_floating_point():
        if bool(raw_isnan(o).any()):
            flags |= NAN
        if bool(torch.isposinf(o).any()):
            flags |= POS_INF
        if bool(torch.isneginf(o).any()):
            flags |= NEG_INF
    return flags


def source_line(path: str, lineno: int) -> str:
    return linecache.getline(path, lineno).strip()


def describe_input(r, t: _Tensor, seq: int | None = None) -> str:
    """One line for a NonFiniteError: who made this input and what it holds. ``seq``: the op
    whose input it is; an op that returned its input (``lift_fresh``: the data of
    ``torch.tensor(...)``) or wrote it in place is by now its producer, and did not make it."""
    from trainguard.capture._recorder import _OP, _STACK

    named = r.modules.name_of(t)
    p = r.producers.get(id(t))
    if named is not None:
        who = f"{named[1]} {named[0]!r}"
    elif p is not None and p[0]() is t and seq is not None and p[1] == seq:
        who = "user input" if "lift_fresh" in p[_OP] else "written in place by this op, now"
    elif p is not None and p[0]() is t:
        fr = user_frame(r.stacks.frames(p[_STACK]))
        where = f" from {short_path(fr[0])}:{fr[1]}" if fr else ""
        who = f"{op_display(p[_OP])} output{where}"
    else:
        who = "user input"
    return f"{who}: {describe_values(t)}"


def _where_lines(r, module_id, stack_id, fwd_op) -> list[str]:
    lines = []
    mod = r.modules.module_of_id().get(module_id) if module_id is not None else None
    lines.append(f"  module: {mod[0] or '(root)'} ({mod[1]})" if mod is not None else "  module: outside any nn.Module")
    fr = user_frame(r.stacks.frames(stack_id)) if stack_id is not None else None
    if fr is not None:
        src = source_line(fr[0], fr[1])
        lead = "  created by the forward op at" if fwd_op is not None else "  at"
        lines.append(f"{lead} {short_path(fr[0])}:{fr[1]} in {fr[2]}" + (f": {src}" if src else ""))
    return lines


def _at(r, stack_id) -> str:
    fr = user_frame(r.stacks.frames(stack_id)) if stack_id is not None else None
    return f" at {short_path(fr[0])}:{fr[1]}" if fr else ""


def origin_detail(args, outs, r, seq: int | None = None) -> tuple[str, tuple[str, ...]]:
    """What an op that made an inf held, said while its tensors are at hand (check_numerics
    remembers it for the message it may raise later)."""
    first = next((o for o in outs if isinstance(o, _Tensor) and o.is_floating_point()), None)
    return (describe_values(first) if first is not None else "",
            tuple(describe_input(r, t, seq) for t in flatten(args, [])))


def message(r, name, phase, module_id, stack_id, fwd_op, args, outs, health, origin=None, reason=None,
            harm_at=None, seq=None) -> str:
    """The NonFiniteError text. ``origin`` is the tracker's origin entry when the value was made
    by an earlier op (an inf that became harmful here); ``harm_at`` (op, stack id) names the op
    where it became harmful when that is not the op that raised (the loss)."""
    if origin is None:
        op = name.replace(".default", "")
        what = "/".join(health_names(health))
        first = next((o for o in outs if isinstance(o, _Tensor) and o.is_floating_point()), None)
        detail = f" ({describe_values(first)})" if first is not None else ""
        if fwd_op is not None:
            op += f" (in the backward of {op_display(fwd_op)})"
        lines = [f"{op} produced {what} in step {_steps.clock.step}, {phase} pass{detail}"]
        lines += _where_lines(r, module_id, stack_id, fwd_op)
        for i, t in enumerate(flatten(args, [])):
            lines.append(f"  input {i} = {describe_input(r, t, seq)}")
        return "\n".join(lines)
    # (op, kind, values, absorbed_by, harmful, step, phase, module_id, stack_id, fwd_op, detail)
    o_op, kind, _, _, _, o_step, o_phase, o_module, o_stack, o_fwd, detail = origin
    out_text, in_texts = detail if detail else ("", ())
    h_op, h_stack = harm_at if harm_at is not None else (name, stack_id)
    how = REACHED.get(reason or "nan", "became harmful in {op}").format(op=h_op.replace(".default", ""))
    head = o_op.replace(".default", "")
    if o_fwd is not None:
        head += f" (in the backward of {op_display(o_fwd)})"
    lines = [f"{head} produced {kind} in step {o_step}, {o_phase} pass" + (f" ({out_text})" if out_text else "")
             + f", which {how}{_at(r, h_stack)} in step {_steps.clock.step}"]
    lines += _where_lines(r, o_module, o_stack, o_fwd)
    for i, text in enumerate(in_texts):
        lines.append(f"  input {i} = {text}")
    if harm_at is None:
        lines.append(f"  where it became harmful: {name.replace('.default', '')}, {phase} pass")
        for i, t in enumerate(flatten(args, [])):
            lines.append(f"    input {i} = {describe_input(r, t, seq)}")
    return "\n".join(lines)
