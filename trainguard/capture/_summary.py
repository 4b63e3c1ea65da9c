"""Tensor summaries per recording mode, computed where the tensor lives.

Two strategies, both exact:

* ``immediate`` (CPU tensors): reading a CPU scalar is no host-device sync, so the summary
  branches. Where the native core is built (``capture/_native``), its C++ kernel makes one
  pass over the tensor's memory that proves a float tensor finite and counts its signs, for
  both recorder backends. Without it, one summation proves the tensor finite, then NumPy
  comparisons count signs, stopping after one pass when all values are positive. The
  boolean-mask counts that also split NaN from +-Inf run only for a tensor that is not finite.
* ``deferred`` (accelerators): every count is computed with device ops into one small float64
  vector per output; vectors are stacked and copied to the host asynchronously in batches, and
  the writer thread waits for them. The training thread never synchronises.

Fields follow ``store.MODE_FIELDS``; ``neg``/``pos`` count finite values only (tfdbg2's FULL_HEALTH).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from trainguard.capture import _native
from trainguard.store import MODE_FIELDS

# torch's own checks, bound here: while trainguard is open torch.isnan & co. are capture/_skips'
# wrappers (a loop's test of its loss), which the recorder's per-op summaries must not pay for.
raw_isnan = torch._C._VariableFunctions.isnan
raw_isfinite = torch._C._VariableFunctions.isfinite

_INF = math.inf
# float32 sums of +-1 are exact while every partial sum stays below 2**24.
_EXACT_F32 = 1 << 24

# Ops whose outputs are uninitialised memory: a NaN there is not evidence of anything.
ALLOCATION_OPS = frozenset(
    {"aten.empty.memory_format", "aten.empty_like.default", "aten.empty_strided.default",
     "aten.new_empty.default", "aten.new_empty_strided.default", "aten.empty.out"}
)

# Ops that return, after their result, a workspace their own backward reads: {op: how many
# leading outputs are the result}. The rest is summarised as unknown, as uninitialised memory is:
# the CPU kernel of CTC loss allocates log_alpha with empty and fills only each sample's input
# frames (with -inf, log 0, where no alignment reaches), so a shorter input leaves whatever the
# allocator handed back there, NaN bit patterns included.
WORKSPACE_OUTPUTS = {"aten._ctc_loss.default": 1, "aten._ctc_loss.Tensor": 1}

# Ops whose output holds exactly the values of their first input: ALIAS_OPS (trainguard.store._ops).


_STRIDED = torch.strided
_TensorBase = torch._C.TensorBase
_FLOAT8 = frozenset(getattr(torch, name) for name in dir(torch) if name.startswith("float8_"))
_QUANTIZED = frozenset(getattr(torch, name) for name in ("qint8", "quint8", "qint32", "quint4x2", "quint2x4")
                       if hasattr(torch, name))
_COMPLEX = frozenset({torch.complex32, torch.complex64, torch.complex128})
# Dtypes whose memory is not a plain array of real values (see _plain_values).
_NOT_PLAIN = _FLOAT8 | _QUANTIZED | _COMPLEX


def _plain_values(t: torch.Tensor) -> torch.Tensor:
    """The values of ``t`` as a real tensor torch and NumPy summarise directly: a quantized
    tensor's dequantized values, float8 in float32 (exact), complex as (real, imaginary) pairs.
    (A negative view reads fine through torch ops.)"""
    if t.is_quantized:
        return t.dequantize()
    if t.dtype in _FLOAT8:
        return t.float()
    if t.is_complex():
        return torch.view_as_real(t.resolve_conj())
    return t


def _exact_counts(t: torch.Tensor) -> tuple[int, int, int, int, int, int]:
    """(neg, zero, pos, neg_inf, pos_inf, nan) with boolean masks: for the rare non-finite tensor."""
    nan = int(raw_isnan(t).sum())
    pinf = int(torch.isposinf(t).sum())
    ninf = int(torch.isneginf(t).sum())
    neg = int((t < 0).sum()) - ninf
    zero = int((t == 0).sum())
    pos = int((t > 0).sum()) - pinf
    return neg, zero, pos, ninf, pinf, nan


# NumPy's type strings for the dtypes it can view (native byte order).
_NUMPY_TYPESTR = {dt: np.dtype(name).str for dt, name in (
    (torch.float16, "float16"), (torch.float32, "float32"), (torch.float64, "float64"), (torch.int8, "int8"),
    (torch.int16, "int16"), (torch.int32, "int32"), (torch.int64, "int64"), (torch.uint8, "uint8"))}


_compiling = torch.compiler.is_compiling
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)  # not wrapper subclasses (DTensor): their memory is not theirs


class _View:
    """Exposes a CPU tensor's memory to NumPy through the array interface, and keeps it alive.

    ``Tensor.numpy()`` would mark the tensor's storage as not resizable for good (NumPy must not
    see memory move), so a later ``resize_`` that grows it fails: ``torch.distributed.gather_object``
    grows the byte tensor of a pickled object that way, and a recorder that summarised it made
    the collective fail on one rank while the others waited for it. This view changes nothing.
    """

    __slots__ = ("__array_interface__", "tensor")


def _np(t: torch.Tensor):
    """A zero-copy NumPy view of a CPU tensor (for reading), or None when NumPy cannot view it."""
    typestr = _NUMPY_TYPESTR.get(t.dtype)
    if typestr is None or t.is_conj() or t.is_neg() or t.layout is not _STRIDED or type(t) not in _PLAIN_TYPES:
        return None
    try:
        if _compiling():  # Dynamo, tracing through this, knows Tensor.numpy() but not the array interface
            # The C method itself: while recording, Tensor.numpy is wrapped to see the program's
            # reads (capture/_reads.py), and trainguard's own reads are not the program's.
            return _TensorBase.numpy(t)
        if not t.numel():
            return np.empty(tuple(t.shape), dtype=typestr)
        view = _View()
        view.tensor = t
        # Writable as far as NumPy knows (nothing writes): numba compiles a slower loop for read-only arrays.
        face = {"version": 3, "typestr": typestr, "data": (t.data_ptr(), False), "shape": t.shape}
        if not t.is_contiguous():
            size = t.element_size()
            face["strides"] = tuple(s * size for s in t.stride())
        view.__array_interface__ = face
        return np.asarray(view)
    except (RuntimeError, TypeError, ValueError):
        return None


def _sign_counts(t: torch.Tensor, n: int) -> tuple[int, int, int]:
    """(neg, zero, pos) of an integer tensor, or a float tensor known to hold no NaN or Inf.

    NumPy's comparisons with ``count_nonzero`` are exact and cheap per call; bfloat16, which
    NumPy lacks, goes through float reductions of ``sign``.
    """
    a = _np(t)
    if a is not None:
        pos = int(np.count_nonzero(a > 0))
        if pos == n:
            return 0, 0, n
        neg = int(np.count_nonzero(a < 0))
        return neg, n - pos - neg, pos
    sg = torch.sign(t).to(torch.float32 if n < _EXACT_F32 else torch.float64)
    diff = int(sg.sum())  # pos - neg
    nonzero = int(sg.abs().sum())  # pos + neg
    pos = (nonzero + diff) // 2
    return nonzero - pos, n - nonzero, pos


_F32 = torch.float32
_F64 = torch.float64


def _float_counts(t: torch.Tensor, n: int) -> tuple[int, int, int] | None:
    """(neg, zero, pos) of a floating tensor, or None when it holds a NaN or an Inf."""
    if not _is_finite(t):
        return None
    return _sign_counts(t, n)


def _is_finite(t: torch.Tensor) -> bool:
    """True when ``t`` holds no NaN/Inf; one summation (an overflowing sum is re-checked exactly)."""
    total = t.sum(dtype=_F64 if t.dtype == _F64 else _F32).item()
    if math.isfinite(total):
        return True
    return bool(raw_isfinite(t).all())


def _moments(t: torch.Tensor) -> tuple[float, float, float, float]:
    mn, mx = torch.aminmax(t)
    f = t if t.dtype == _F64 or t.dtype == _F32 else t.to(_F32)
    std, mean = torch.std_mean(f, correction=0)
    mean, std = float(mean), float(std)
    if not (math.isfinite(mean) and math.isfinite(std)) and math.isfinite(float(mn)) and math.isfinite(float(mx)):
        # float32 squares of values above ~1.8e19 overflow: redo it in float64.
        std, mean = torch.std_mean(t.to(_F64), correction=0)
        mean, std = float(mean), float(std)
    return float(mn), float(mx), mean, std


def _unbroadcast(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(the distinct elements of ``t``, how often each repeats), for a tensor with a stride 0.

    A dimension of stride 0 (``expand``, broadcasting) repeats the same memory: every element of
    the view without those dimensions appears equally often, so its counts times the repeat are
    ``t``'s counts, and its min, max, mean and std are ``t``'s. Reading it avoids gathering the
    expanded copy (a scalar expanded to a full activation is common in backward passes).
    """
    strides = t.stride()
    if not t.numel():
        return t, 1
    base = t[tuple(slice(0, 1) if st == 0 else slice(None) for st in strides)]
    return base, t.numel() // base.numel()


# Positions of the count fields in each mode's summary (the others are unchanged by repetition).
_COUNT_FIELDS = {"concise_health": 4, "full_health": 7, "full_tensor": 7, "stats": 7}


def unknown_summary(mode: str, n: int) -> tuple[float, ...]:
    """The summary of values nobody can read (uninitialised memory, meta tensors): the size and
    NaN for every count, so nothing claims a value was finite or not."""
    fields = MODE_FIELDS[mode]
    if not fields or fields[0] != "size":
        return (0.0,) * len(fields)
    return (float(n),) + (math.nan,) * (len(fields) - 1)


def _sparse_summary(t: torch.Tensor, mode: str) -> tuple[float, ...]:
    """A sparse tensor's summary from its stored values plus the zeros it does not store."""
    values = t.coalesce()._values() if t.layout == torch.sparse_coo else t.values()
    s = summarize_numpy(values, mode)
    implicit = t.numel() - values.numel()
    if not implicit or mode == "curt_health":
        return s
    if mode == "concise_health":
        return (s[0] + implicit,) + s[1:]
    size, neg, zero, pos, ninf, pinf, nan = s[:7]
    base = (size + implicit, neg, zero + implicit, pos, ninf, pinf, nan)
    if mode != "stats":
        return base
    n_v, n = values.numel(), t.numel()
    if n_v == 0:
        return base + (0.0, 0.0, 0.0, 0.0)
    mn, mx, mean, std = s[7:]
    mean_all = mean * n_v / n
    var_all = n_v * (std * std + mean * mean) / n - mean_all * mean_all
    return base + (min(mn, 0.0), max(mx, 0.0), mean_all, math.sqrt(max(var_all, 0.0)))


# Summary modes as the native core numbers them (native.h).
_MODE_CODE = {"no_tensor": 0, "curt_health": 1, "concise_health": 2, "full_health": 3, "shape": 4,
              "full_tensor": 5, "stats": 6}


def _health_bits(t: torch.Tensor) -> float:
    """curt_health's value for a tensor that is not finite: its health bits (1 NaN, 2 +inf, 4 -inf)."""
    _, _, _, ninf, pinf, nan = _exact_counts(t)
    return float((1 if nan else 0) | (2 if pinf else 0) | (4 if ninf else 0))


def summarize_immediate(t: torch.Tensor, mode: str, expect_nonfinite: bool = False) -> tuple[float, ...]:
    """Exact summary of ``t`` as Python floats (for CPU tensors: no device to sync with).

    The native core's kernel when it is built (``_native.load()``, at the start of a
    recording), else torch and NumPy (:func:`summarize_numpy`). ``expect_nonfinite`` (an input
    is already harmful) counts in the one pass that serves a non-finite tensor, without first
    proving it finite.
    """
    native = _native._module
    if native is not None and t.device.type == "cpu":
        return native.summarize(t, _MODE_CODE[mode], expect_nonfinite)
    return summarize_numpy(t, mode, expect_nonfinite)


def summarize_numpy(t: torch.Tensor, mode: str, expect_nonfinite: bool = False) -> tuple[float, ...]:
    """The immediate summary without the native kernel."""
    if t.requires_grad:
        t = t.detach()
    if t.layout is not _STRIDED:
        return _sparse_summary(t, mode)
    if t.is_meta:  # no data at all
        return unknown_summary(mode, t.numel())
    if t.dtype in _NOT_PLAIN:
        t = _plain_values(t)
    if 0 in t.stride():
        base, repeat = _unbroadcast(t)
        if repeat > 1:
            s = summarize_numpy(base, mode, expect_nonfinite)
            k = _COUNT_FIELDS.get(mode, 0)
            return tuple(v * repeat for v in s[:k]) + s[k:]
    n = t.numel()
    if mode == "curt_health":
        if n == 0 or not t.is_floating_point():
            return (0.0,)
        return (0.0 if _is_finite(t) else _health_bits(t),)
    if n == 0:
        return _pack(mode, 0, 0, 0, 0, 0, 0, 0, math.nan, math.nan, math.nan, math.nan)
    if t.dtype == torch.bool:
        nz = int(torch.count_nonzero(t))
        mn, mx = float(nz == n), float(nz > 0)
        return _pack(mode, n, 0, n - nz, nz, 0, 0, 0, mn, mx, nz / n, math.sqrt(nz / n * (1 - nz / n)))
    isfloat = t.is_floating_point()
    if mode == "concise_health":
        if not isfloat or _is_finite(t):
            return (float(n), 0.0, 0.0, 0.0)
        neg, zero, pos, ninf, pinf, nan = _exact_counts(t)
        return (float(n), float(ninf), float(pinf), float(nan))
    if expect_nonfinite and isfloat:
        counts = None
    else:
        counts = _float_counts(t, n) if isfloat else _sign_counts(t, n)
    if counts is not None:
        neg, zero, pos = counts
        ninf = pinf = nan = 0
    else:
        neg, zero, pos, ninf, pinf, nan = _exact_counts(t)
    mn = mx = mean = std = math.nan
    if mode == "stats":
        mn, mx, mean, std = _moments(t)
    return _pack(mode, n, neg, zero, pos, ninf, pinf, nan, mn, mx, mean, std)


def _pack(mode, n, neg, zero, pos, ninf, pinf, nan, mn, mx, mean, std) -> tuple[float, ...]:
    if mode == "concise_health":
        return (float(n), float(ninf), float(pinf), float(nan))
    base = (float(n), float(neg), float(zero), float(pos), float(ninf), float(pinf), float(nan))
    if mode == "stats":
        return base + (float(mn), float(mx), float(mean), float(std))
    return base


def summarize_deferred(t: torch.Tensor, mode: str) -> torch.Tensor:
    """The same summary as a float64 tensor on ``t``'s device, with no host synchronisation."""
    t = _plain_values(t.detach())
    n = t.numel()
    dev = t.device
    if n == 0:
        return torch.tensor(summarize_immediate(t, mode), dtype=torch.float64, device=dev)
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    isfloat = t.is_floating_point()
    if isfloat:
        nan = raw_isnan(t).sum()
        pinf = torch.isposinf(t).sum()
        ninf = torch.isneginf(t).sum()
    else:
        nan = pinf = ninf = torch.zeros((), dtype=torch.int64, device=dev)
    if mode == "curt_health":  # the health bits: 1 NaN, 2 +inf, 4 -inf
        bits = (nan > 0).to(torch.int64) + 2 * (pinf > 0).to(torch.int64) + 4 * (ninf > 0).to(torch.int64)
        return bits.to(torch.float64).reshape(1)
    size = torch.full((), float(n), dtype=torch.float64, device=dev)
    if mode == "concise_health":
        return torch.stack([size, ninf.double(), pinf.double(), nan.double()])
    neg = (t < 0).sum() - ninf
    zero = (t == 0).sum()
    pos = (t > 0).sum() - pinf
    parts = [size, neg.double(), zero.double(), pos.double(), ninf.double(), pinf.double(), nan.double()]
    if mode == "stats":
        f = t.to(torch.float64)
        mn, mx = torch.aminmax(f)
        mean = f.mean()
        std = (f - mean).square().mean().sqrt()
        parts += [mn, mx, mean, std]
    return torch.stack(parts)


def host_copy(values: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """Start copying deferred summaries to the host without waiting for them.

    On CUDA the copy goes into pinned memory behind the work already queued, with an event the
    writer thread waits on before it reads; other devices copy at once (no event).
    """
    if values.device.type != "cuda":
        return values.to("cpu"), None
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    host.copy_(values, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return host, event
