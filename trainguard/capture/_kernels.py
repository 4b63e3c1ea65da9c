"""One-pass health counts for CPU tensors, compiled with numba (the ``fast`` extra).

NumPy and torch have no single kernel that counts negatives and positives and proves a tensor
finite: composed from them the summary takes three passes over the data (a sum, two
comparisons with their boolean temporaries), which on an optimizer's elementwise updates is
several times the cost of the op being recorded. The loop below does it in one vectorised
pass. Without numba, ``counts`` is None and ``_summary`` composes NumPy and torch kernels.

Counts accumulate in float32 lanes (vectorisable under ``reassoc``), exact while each partial
sum stays below 2**24: the caller feeds at most ``CHUNK`` elements per call. No ``nnan`` or
``ninf`` flag is given, so ``x * 0`` is evaluated: it is 0 for finite x and NaN for NaN or
+-Inf, which makes the probe sum NaN exactly when the tensor is not finite.
"""

from __future__ import annotations

import gc
import logging
import os

import numpy as np

log = logging.getLogger("trainguard.capture")

CHUNK = 1 << 22
# NumPy dtypes the kernel is compiled for (lazily, once per dtype; cached on disk).
# (Integer loops do not vectorise this way; NumPy's comparisons serve them as well.)
DTYPES = frozenset({np.dtype("float32"), np.dtype("float64")})


def _build():
    if os.environ.get("TRAINGUARD_NO_NUMBA"):
        return None
    try:
        from numba import njit
    except ImportError:
        return None

    def probe_neg_pos(a):  # pragma: no cover - compiled
        probe = a.dtype.type(0)
        neg = np.float32(0)
        pos = np.float32(0)
        for i in range(a.size):
            x = a[i]
            probe += x * np.float32(0)
            neg += np.float32(1) if x < 0 else np.float32(0)
            pos += np.float32(1) if x > 0 else np.float32(0)
        return probe, neg, pos

    def all_counts(a):  # pragma: no cover - compiled
        # For a tensor that holds NaN or Inf: every count in one pass (NaN fails each
        # comparison; neg and pos here include the infinities).
        inf = a.dtype.type(np.inf)
        neg = np.float32(0)
        pos = np.float32(0)
        ninf = np.float32(0)
        pinf = np.float32(0)
        nan = np.float32(0)
        for i in range(a.size):
            x = a[i]
            neg += np.float32(1) if x < 0 else np.float32(0)
            pos += np.float32(1) if x > 0 else np.float32(0)
            ninf += np.float32(1) if x == -inf else np.float32(0)
            pinf += np.float32(1) if x == inf else np.float32(0)
            nan += np.float32(1) if x != x else np.float32(0)
        return neg, pos, ninf, pinf, nan

    def shifted_sums(a):  # pragma: no cover - compiled
        # Sums of x - a[0] in float64: shifted by one of its own values, the variance keeps its
        # precision however far the values lie from zero (a[0] is within sqrt(n) std of the mean).
        shift = np.float64(a[0])
        s1 = 0.0
        s2 = 0.0
        for i in range(a.size):
            d = np.float64(a[i]) - shift
            s1 += d
            s2 += d * d
        return s1, s2

    for cache in (True, False):  # no writable cache directory: compile in memory each run
        try:
            kernel = njit(nogil=True, cache=cache, fastmath={"reassoc", "nsz"})(probe_neg_pos)
            # No nnan/ninf: the comparisons with NaN and inf must be evaluated as written.
            full_kernel = njit(nogil=True, cache=cache, fastmath={"reassoc", "nsz"})(all_counts)
            # Only ever called on arrays the probe proved finite: every fast-math flag is safe.
            moments_kernel = njit(nogil=True, cache=cache, fastmath=True)(shifted_sums)
            for dtype in DTYPES:  # compile (or load from the cache) now, not at the first op
                kernel(np.zeros(3, dtype))
                full_kernel(np.zeros(3, dtype))
                moments_kernel(np.ones(3, dtype))
            return kernel, moments_kernel, full_kernel
        except Exception as exc:  # a broken numba must not break recording
            log.debug("trainguard: numba kernel (cache=%s) unavailable: %s", cache, exc)
    log.warning("trainguard: the numba summary kernel failed to build; using NumPy summaries")
    return None


_kernel = None
_moments_kernel = None
_full_kernel = None
_built = False


def _load():
    """Build on first use: importing numba and loading the kernel take a quarter of a second,
    paid only when a recording needs counts."""
    global _kernel, _moments_kernel, _full_kernel, _built
    if not _built:
        _kernel, _moments_kernel, _full_kernel = _build() or (None, None, None)
        _built = True
        # numba adds tens of thousands of objects; collect now, at the start of a recording,
        # rather than in a full collection that their number would trigger during training.
        gc.collect()
    return _kernel


def counts(a: np.ndarray) -> tuple[bool, int, int] | None:
    """(finite, neg, pos) of a 1-D contiguous array, or None when the kernel is unavailable.

    ``neg``/``pos`` are exact for a finite array; for one holding NaN or Inf only ``finite``
    (False) is meaningful.
    """
    if (_kernel if _built else _load()) is None:
        return None
    n = a.size
    if n <= CHUNK:
        probe, neg, pos = _kernel(a)
        return bool(probe == 0), int(neg), int(pos)
    finite, neg, pos = True, 0, 0
    for start in range(0, n, CHUNK):
        probe, k_neg, k_pos = _kernel(a[start:start + CHUNK])
        finite = finite and bool(probe == 0)
        neg += int(k_neg)
        pos += int(k_pos)
    return finite, neg, pos


def all_counts(a: np.ndarray) -> tuple[int, int, int, int, int, int]:
    """(neg, zero, pos, neg_inf, pos_inf, nan) of a 1-D contiguous array in one compiled pass,
    neg and pos counting finite values only (only when :func:`available`). Meant for arrays
    known or expected to hold NaN or Inf: a finite one is proven faster by :func:`counts`."""
    n = a.size
    if n <= CHUNK:  # the common case: one call, no slicing (a run that keeps making NaN calls this per op)
        neg, pos, ninf, pinf, nan = map(int, _full_kernel(a))
    else:
        neg = pos = ninf = pinf = nan = 0
        for start in range(0, n, CHUNK):
            k = _full_kernel(a[start:start + CHUNK])
            neg += int(k[0])
            pos += int(k[1])
            ninf += int(k[2])
            pinf += int(k[3])
            nan += int(k[4])
    return neg - ninf, n - neg - pos - nan, pos - pinf, ninf, pinf, nan


def mean_std(a: np.ndarray) -> tuple[float, float]:
    """(mean, population std) of a finite, non-empty 1-D contiguous array, in one compiled
    pass (only when :func:`available`)."""
    s1, s2 = _moments_kernel(a)
    n = a.size
    mean_shift = s1 / n
    var = max(s2 / n - mean_shift * mean_shift, 0.0)
    return float(a[0]) + mean_shift, var ** 0.5


def available() -> bool:
    return (_kernel if _built else _load()) is not None


def warm() -> None:
    """Load the kernel before the first op (at the start of a recording)."""
    _load()
