"""A per-sample vector broadcast along the wrong axis, read off the recorded ops.

A diffusion loop reads one schedule value per sample (``a.gather(-1, t)``, ``arr[timesteps]``), a
``[B]`` vector, and must reshape it to ``[B, 1, 1, 1]`` before it scales a ``[B, C, H, W]`` batch.
Left 1-D it broadcasts against the last axis; when the batch size equals the width (DiT's latents,
8 per rank against 8x8; lucidrains' 16 against 16x16) nothing raises, and each sample is scaled
across its width by the other samples' values. Training runs, the loss falls, the samples are noise.
"""

from __future__ import annotations

from trainguard._errors import TrainguardError
from trainguard.analysis._context import Context
from trainguard.analysis._rules import register_rule
from trainguard.store import Finding

SOURCE = "graph"

# Elementwise ops that broadcast their operands (the forward pass's schedule arithmetic).
_ELEMENTWISE = ("mul", "add", "sub", "div")
# Ops that read one entry per index: a table looked up per sample.
_LOOKUPS = frozenset({"index", "gather", "index_select", "take"})
# Ops a looked-up vector may pass through on its way to the arithmetic (a cast, a copy).
_THROUGH = frozenset({"_to_copy", "clone", "view", "_unsafe_view", "reshape", "alias", "detach", "contiguous"})
# Recorded elementwise executions read per op (the ops of a step repeat every step).
MAX_READ = 400


def _base(op: str | None) -> str:
    return (op or "").removeprefix("aten.").split(".")[0].rstrip("_")


def _shape(digest: dict | None) -> list[int] | None:
    outs = (digest or {}).get("outputs") or []
    return list(outs[0].get("shape") or []) if outs and outs[0].get("shape") is not None else None


def _lookup_behind(run, digest: dict) -> dict | None:
    """The lookup op that made ``digest``'s 1-D output (through casts and copies), if any."""
    for _ in range(4):
        base = _base(digest.get("op"))
        if base in _LOOKUPS:
            return digest
        if base not in _THROUGH:
            return None
        try:
            ins = run.execution(digest["seq"])["inputs"]
        except (KeyError, TrainguardError):  # evicted by the circular buffer
            return None
        digest = next((i.get("producer_digest") for i in ins if i.get("producer_digest")), None)
        if digest is None:
            return None
    return None


def _where(run, digest: dict) -> str:
    frame = run.user_frame(digest.get("stack_id")) if digest.get("stack_id") is not None else None
    return f"{frame['filename']}:{frame['lineno']}" if frame else "an unknown line"


def _misaligned(run, seq: int) -> dict | None:
    """Evidence when execution ``seq`` broadcast a looked-up ``[N]`` vector into an output whose
    first and last axes are both N (the batch and, by coincidence, the width)."""
    ex = run.execution(seq)
    big = _shape(ex)  # a 1-D operand lines up with the output's last axis (the other operand may be evicted)
    for i in ex["inputs"]:
        vec = _shape(i.get("producer_digest"))
        if vec is None or len(vec) != 1 or vec[0] < 2 or not big or len(big) < 2:
            continue
        n = vec[0]
        if big[0] != n or big[-1] != n:
            continue
        lookup = _lookup_behind(run, i["producer_digest"])
        if lookup is None:
            continue
        return {"op": ex["op"], "at": _where(run, ex), "step": ex.get("step"), "vector_shape": vec,
                "tensor_shape": big, "lookup": lookup["op"], "lookup_at": _where(run, lookup)}
    return None


@register_rule("per_sample_broadcast")
def per_sample_broadcast(ctx: Context) -> list[Finding]:
    """A ``[N]`` vector looked up per sample, broadcast against ``[N, ..., N]`` along the last axis."""
    run = ctx.run
    if not hasattr(run, "executions"):
        return []
    for op in _ELEMENTWISE:
        try:
            digests = run.executions(0, MAX_READ, op=op)
        except (TrainguardError, ValueError):
            return []
        for d in digests:
            out = _shape(d)
            if d.get("phase") != "forward" or out is None or len(out) < 2 or out[0] != out[-1]:
                continue  # only a batch axis as long as the last one hides such a broadcast
            try:
                ev = _misaligned(run, d["seq"])
            except (KeyError, TrainguardError):
                continue
            if ev is None:
                continue
            n, big = ev["vector_shape"][0], ev["tensor_shape"]
            shape = ", ".join(str(s) for s in big)
            ones = ", ".join(["1"] * (len(big) - 1))
            return [Finding(
                kind="per_sample_broadcast",
                severity="warning",
                title=(f"a vector of {n} values read one per sample ({ev['lookup']} at {ev['lookup_at']}) is broadcast "
                       f"against a [{shape}] tensor by {ev['op']} at {ev['at']} along its last axis, not its batch "
                       f"axis: with {n} samples and a last axis of {n} nothing raises, and each sample is combined, "
                       "across that axis, with every sample's value"),
                evidence=ev,
                suggestion=(f"reshape the vector to [{n}, {ones}] before the op, e.g. `out.reshape(b, *((1,) * "
                            f"(len(x_shape) - 1)))` as lucidrains' `extract()` does, or `a[t][:, None, None, None]`; "
                            "a batch size that differs from the last axis makes such a broadcast raise"),
                steps=(ev["step"], ev["step"]) if isinstance(ev.get("step"), int) else None,
                source=SOURCE,
            )]
    return []


__all__ = ["per_sample_broadcast"]
