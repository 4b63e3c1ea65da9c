"""Buffers that should move as the model trains but never do (from the monitor's per-buffer
``changed`` fact, capture/_monitor_buffers.py)."""

from __future__ import annotations

import math

from trainguard.analysis._context import Context
from trainguard.analysis._param_rules import _names
from trainguard.analysis._rules import register_rule
from trainguard.store import Finding

SOURCE = "monitor"
# Comparisons between recordings (in training mode) before a counter that never moved says anything:
# an update every few steps may fall between two recordings once, not three times.
MIN_COMPARISONS = 3
_INTEGER = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")


def _changed(ctx: Context, name: str) -> list[float]:
    return [v for v in ctx.stat(name, "buffer", "changed").values.tolist() if math.isfinite(v)]


def _counter(info: dict) -> bool:
    """A one-element integer buffer of a module of the user's own: a pointer or a step counter (MoCo's
    ``queue_ptr``), which exists to move. torch's own modules' buffers (a batch norm's
    ``num_batches_tracked``, a fake-quantizer's flags) are torch's business."""
    shape = info.get("shape")
    return (not info.get("torch_module") and info.get("dtype") in _INTEGER and shape is not None
            and math.prod(shape) == 1)


@register_rule("buffer_not_updated")
def buffer_not_updated(ctx: Context) -> list[Finding]:
    """A module's pointer or counter (a one-element integer buffer) that never changed between
    recordings while its module trained: the code that advances it never runs. MoCo's queue with
    ``_dequeue_and_enqueue`` never called keeps its random negatives, and a queue whose pointer never
    advances overwrites the same slots; both trained on with a falling loss, called healthy."""
    buffers: dict[str, dict] = ctx.meta.get("buffers") or {}
    if not len(ctx.loss):
        return []
    out = []
    for name, info in buffers.items():
        seen = _changed(ctx, name)
        if not _counter(info) or len(seen) < MIN_COMPARISONS or any(seen):
            continue
        steps = ctx.stat(name, "buffer", "changed").steps.tolist()
        module = info.get("module") or ""
        siblings = [b for b, i in buffers.items() if b != name and (i.get("module") or "") == module
                    and i.get("dtype") != "bool" and not i.get("fixed") and _changed(ctx, b)]
        still = [b for b in siblings if not any(_changed(ctx, b))]
        moving = [b for b in siblings if b not in still]
        owner = f"{module} ({info.get('module_type')})" if module else info.get("module_type")
        ev = {"buffer": name, "module": module, "module_type": info.get("module_type"), "dtype": info.get("dtype"),
              "recordings": len(seen), "first_step": int(steps[0]), "last_step": int(steps[-1]),
              "unchanged_too": still, "changing": moving}
        attr = name.rsplit(".", 1)[-1]
        if moving:
            fix = (f"{_names(moving)} changed at every recording while {attr} stayed put: each write goes to the "
                   f"same place (a ring buffer whose pointer never advances refreshes only its first slots, the "
                   f"rest keep their initial values). Advance it where the buffer is written, in place "
                   f"(MoCo's _dequeue_and_enqueue: self.queue_ptr[0] = (ptr + batch_size) % self.K)")
        elif still:
            fix = (f"{_names(still)} never changed either: the module's state is never written, so the "
                   f"update that fills it is never called (MoCo: self._dequeue_and_enqueue(k) at the end of "
                   f"forward, after the keys are computed; its negatives stay the random vectors the queue "
                   f"started with, which the encoder learns to tell apart at once: the loss falls and nothing "
                   f"useful is learned). Call it in every training forward and advance {attr} there")
        else:
            fix = (f"{attr} exists to move (a pointer or step counter) but nothing advances it: write it in place "
                   f"(self.{attr}[0] = ..., or self.{attr} += 1) where the module's state is updated")
        out.append(Finding(
            kind="buffer_not_updated",
            severity="warning",
            title=f"Buffer {name}, a one-element {info.get('dtype')} pointer or counter of {owner}, never changed in "
            f"{len(seen)} recordings (steps {steps[0]}-{steps[-1]}) while the module trained"
            + (f"; nor did {_names(still, 3)}" if still and not moving else ""),
            evidence=ev,
            suggestion=fix,
            steps=(int(steps[0]), int(steps[-1])),
            layers=[module] if module else [],
            source=SOURCE,
        ))
    return out
