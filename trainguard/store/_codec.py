"""Encoding helpers shared by the writer and the reader.

NaN and Inf are encoded explicitly: SQLite turns a NaN REAL into NULL, and JSON has no
spelling for either, so numbers pass through :func:`encode_float` / :func:`dumps`.
"""

from __future__ import annotations

import json
import math
from typing import Any

# 2: full tensors in segment files (payloads.byte_offset, nbytes, dtype, shape)
# 3: the taint of every execution (executions.taint, .origin) and harmful counts per step and op
SCHEMA_VERSION = 3
# Executions kept beyond ``buffer`` while a recording is live (by the writer and the sink), so
# that the producers of a later non-finite op can still be pinned; the final trim at close
# keeps exactly ``buffer``.
EVICTION_SLACK = 10_000
DB_NAME = "run.sqlite"
# A run may hold runs of its own here: the guard records each replayed step as one.
REPLAYS_DIR = "replays"
# Beside the database, one per sink: where a sink that can no longer write the database says
# why and how much it did not store (reserved when the sink starts, so a full disk has room).
WRITER_STATUS_PREFIX = DB_NAME + "-writer-"

PHASES = ("forward", "backward", "optimizer", "other")
PHASE_ID = {name: i for i, name in enumerate(PHASES)}

# Health bit flags of an execution: which non-finite kinds its outputs hold.
NAN, POS_INF, NEG_INF, UNKNOWN = 1, 2, 4, 8
NONFINITE = NAN | POS_INF | NEG_INF

# The taint of an execution's outputs (docs/recorder.md, "Harmful, intended, unknown"), ordered
# by rank: an op's inputs count by the highest. ``origin`` is the seq of the op that made the
# value (for pending and harmful). Records written without a taint read as harmful when
# non-finite (what format 2 meant).
T_FINITE, T_UNKNOWN, T_PENDING, T_HARMFUL = 0, 1, 2, 3
TAINTS = ("finite", "unknown", "pending", "harmful")
# How a value became harmful (meta first_harm.reason), as the end of a sentence about it; the
# report, the UI and check_numerics say it alike.
REACHED = {
    "nan": "became NaN in {op}",
    "loss": "reached the loss: backward() was called on the output of {op}",
    "gradient": "reached a gradient in {op} (backward pass)",
    "optimizer": "reached the optimizer's update in {op}",
    "parameter": "was written into the model's parameters or buffers by {op}",
    "read": "was read by the program in {op} (.item(), .tolist() or printing)",
}

# Summary fields per tensor-summary mode, in storage order (float64 per field per output).
# neg / pos count finite values only, as in tfdbg2's FULL_HEALTH.
MODE_FIELDS: dict[str, tuple[str, ...]] = {
    "no_tensor": (),
    "shape": (),
    "curt_health": ("nonfinite",),
    "concise_health": ("size", "neg_inf", "pos_inf", "nan"),
    "full_health": ("size", "neg", "zero", "pos", "neg_inf", "pos_inf", "nan"),
    "full_tensor": ("size", "neg", "zero", "pos", "neg_inf", "pos_inf", "nan"),
    "stats": ("size", "neg", "zero", "pos", "neg_inf", "pos_inf", "nan", "min", "max", "mean", "std"),
}
MODES = tuple(MODE_FIELDS)

# Scalar flags: the column ``value`` is NULL unless the flag is FINITE.
FINITE, F_NAN, F_POS_INF, F_NEG_INF = 0, 1, 2, 3


def encode_float(x: float | None) -> tuple[float | None, int]:
    """Split a float into (value, flag) for a SQLite row."""
    if x is None:
        return None, F_NAN
    x = float(x)
    if math.isfinite(x):
        return x, FINITE
    if math.isnan(x):
        return None, F_NAN
    return None, F_POS_INF if x > 0 else F_NEG_INF


def decode_float(value: float | None, flag: int) -> float:
    if flag == FINITE:
        return float(value)
    return {F_NAN: math.nan, F_POS_INF: math.inf, F_NEG_INF: -math.inf}[flag]


def _encode_obj(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return {"$float": "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")}
    if isinstance(obj, dict):
        return {str(k): _encode_obj(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_encode_obj(v) for v in obj]
    if hasattr(obj, "item") and callable(obj.item) and getattr(obj, "ndim", 1) == 0:
        return _encode_obj(obj.item())  # numpy / torch scalars
    return obj


def _decode_hook(d: dict) -> Any:
    if len(d) == 1 and "$float" in d:
        return {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}[d["$float"]]
    return d


def dumps(obj: Any) -> str:
    """JSON with non-finite floats spelled as ``{"$float": "nan" | "inf" | "-inf"}``."""
    return json.dumps(_encode_obj(obj), allow_nan=False, separators=(",", ":"))


def loads(text: str | bytes | None) -> Any:
    if text is None:
        return None
    return json.loads(text, object_hook=_decode_hook)


def to_plain_json(obj: Any) -> Any:
    """A JSON-safe copy for HTTP answers: non-finite floats become the strings "NaN", "Infinity"."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return "NaN" if math.isnan(obj) else ("Infinity" if obj > 0 else "-Infinity")
    if isinstance(obj, dict):
        return {str(k): to_plain_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_plain_json(v) for v in obj]
    return obj


def health_of(fields: tuple[str, ...], values: list[float]) -> int:
    """Health flags of one output's summary (fields of the run's mode)."""
    if not fields:
        return 0
    # Counts are compared with "> 0": a NaN count means "unknown" (uninitialised memory).
    if fields[0] == "nonfinite":
        # Since format 3 the value is the health bits themselves; format 2 wrote 1.0 for any
        # non-finite tensor, which reads as NaN (it could not tell NaN from Inf).
        v = values[0]
        return int(v) & NONFINITE if v > 0 else 0
    flags = 0
    if values[fields.index("nan")] > 0:
        flags |= NAN
    if values[fields.index("pos_inf")] > 0:
        flags |= POS_INF
    if values[fields.index("neg_inf")] > 0:
        flags |= NEG_INF
    return flags


def health_names(flags: int) -> list[str]:
    out = []
    if flags & NAN:
        out.append("nan")
    if flags & POS_INF:
        out.append("+inf")
    if flags & NEG_INF:
        out.append("-inf")
    if flags & UNKNOWN:
        out.append("unknown")
    return out
