"""Custom autograd Functions whose backward disagrees with their forward (the live gradient check).

The monitor checks each custom ``torch.autograd.Function`` once, in float64, against central
differences (``capture/_gradcheck.py``) and stores the results in the run (meta ``gradcheck``).
A wrong gradient is the cause of what follows it: activations and losses that explode, a
"learning rate too high", spikes; so it is an ``error``.
"""

from __future__ import annotations

from trainguard.analysis._context import Context, fmt
from trainguard.analysis._rules import register_rule
from trainguard.store import Finding

SOURCE = "gradcheck"


def _where(rec: dict) -> str:
    return f" ({rec['file']}:{rec['line']})" if rec.get("file") else ""


@register_rule("custom_gradient_wrong")
def custom_gradient_wrong(ctx: Context) -> list[Finding]:
    out = []
    for rec in ctx.run.meta.get("gradcheck") or []:
        status = rec.get("status")
        if status not in ("wrong", "suspicious"):
            continue
        bad = [i for i in rec.get("inputs") or [] if i.get("status") == status]
        if not bad:
            continue
        worst = max(bad, key=lambda i: i.get("max_rel") or 0.0)
        name = rec.get("name") or rec.get("function")
        ev = {
            "function": rec.get("function"), "file": rec.get("file"), "line": rec.get("line"),
            "input": worst.get("name"), "input_index": worst.get("index"), "relative_error": worst.get("max_rel"),
            "analytic": worst.get("analytic"), "numeric": worst.get("numeric"), "entry": worst.get("worst_index"),
            "input_shape_checked": worst.get("shape"), "entries_checked": worst.get("checked"),
            "inputs_wrong": [i.get("name") for i in bad], "dtype": "float64", "seconds": rec.get("seconds"),
        }
        check = (f"`torch.autograd.gradcheck({name}.apply, inputs)` with float64 inputs that require grad "
                 "(`trainguard.doctor.gradient_check` checks a whole model the same way)")
        if status == "wrong":
            out.append(Finding(
                kind="custom_gradient_wrong", severity="error",
                title=f"Custom autograd Function {name} has a wrong backward: the gradient of input "
                      f"{worst.get('index')} (`{worst.get('name')}`) is off by a relative error of "
                      f"{fmt(worst.get('max_rel'))} against central differences in float64",
                evidence=ev,
                suggestion=f"fix `{name}.backward`{_where(rec)}: at entry {worst.get('worst_index')} it returns "
                           f"{fmt(worst.get('analytic'))} where the forward's slope is {fmt(worst.get('numeric'))}; "
                           f"verify the fix with {check}",
                source=SOURCE,
            ))
        else:
            out.append(Finding(
                kind="custom_gradient_wrong", severity="info",
                title=f"Custom autograd Function {name}: the gradient of `{worst.get('name')}` differs from central "
                      f"differences by {fmt(worst.get('max_rel'))} (between the bands 1e-5 and 1e-3: a kink, "
                      "round-off, or a small error)",
                evidence=ev, suggestion=f"look at `{name}.backward`{_where(rec)}; {check}", source=SOURCE,
            ))
    return out
