"""Tensor summaries against a NumPy reference, for both strategies and every mode."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from trainguard.capture import _native
from trainguard.capture._summary import _MODE_CODE, summarize_deferred, summarize_immediate, summarize_numpy
from trainguard.store import MODE_FIELDS

MODES = ["curt_health", "concise_health", "full_health", "full_tensor", "stats"]


def reference(a: np.ndarray, mode: str) -> dict:
    """What each field must be, computed the obvious way in float64."""
    f = np.asarray(a).astype(np.float64)
    n = f.size
    nan = int(np.isnan(f).sum())
    pinf = int(np.isposinf(f).sum())
    ninf = int(np.isneginf(f).sum())
    fin = f[np.isfinite(f)]
    out = {
        "size": n, "nan": nan, "pos_inf": pinf, "neg_inf": ninf,
        "neg": int((fin < 0).sum()), "zero": int((fin == 0).sum()), "pos": int((fin > 0).sum()),
        # curt_health holds the health bits: 1 NaN, 2 +inf, 4 -inf
        "nonfinite": (1 if nan else 0) | (2 if pinf else 0) | (4 if ninf else 0),
    }
    if n:
        with np.errstate(all="ignore"):
            out["min"], out["max"] = float(np.min(f)), float(np.max(f))
            out["mean"] = float(np.mean(f))
            out["std"] = float(np.sqrt(np.mean((f - np.mean(f)) ** 2)))
    return out


def both_paths(t: torch.Tensor, mode: str) -> list[tuple]:
    """The immediate summary with the native kernel and without it (torch and NumPy)."""
    return [_native.load().summarize(t, _MODE_CODE[mode]), summarize_numpy(t, mode)]


def check(t: torch.Tensor, a: np.ndarray, mode: str, values: tuple) -> None:
    ref = reference(a, mode)
    assert len(values) == len(MODE_FIELDS[mode]), (mode, values)
    for name, v in zip(MODE_FIELDS[mode], values):
        want = ref.get(name)
        if name in ("min", "max", "mean", "std"):
            if t.numel() == 0:
                assert math.isnan(v)
                continue
            if not np.isfinite(a.astype(np.float64)).all():
                continue  # NaN-propagating statistics: only their presence matters
            tol = 1e-2 * max(1.0, abs(want)) if t.dtype in (torch.float16, torch.bfloat16) else 1e-4 * max(1.0, abs(want))
            assert v == pytest.approx(want, abs=tol), (name, v, want)
        else:
            assert v == want, (mode, name, v, want, a)


floats = st.floats(allow_nan=True, allow_infinity=True, width=32)
arrays = hnp.arrays(
    dtype=st.sampled_from([np.float32, np.float64, np.float16]),
    shape=hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=6),
    elements=st.one_of(floats, st.sampled_from([0.0, -0.0, 1.0, -1.0])),
)


@settings(max_examples=150, deadline=None)
@given(arrays, st.sampled_from(MODES), st.booleans())
def test_float_summaries_match_numpy(a, mode, transpose):
    t = torch.from_numpy(a.copy())
    if transpose and t.dim() >= 2:
        t = t.transpose(0, 1)  # non-contiguous view
        a = np.ascontiguousarray(np.swapaxes(a, 0, 1))
    for values in both_paths(t, mode):
        check(t, a, mode, values)
    check(t, a, mode, tuple(summarize_deferred(t, mode).tolist()))


@settings(max_examples=60, deadline=None)
@given(hnp.arrays(dtype=st.sampled_from([np.int64, np.int32, np.int8, np.uint8, np.bool_]),
                  shape=hnp.array_shapes(min_dims=1, max_dims=2, min_side=0, max_side=7)),
       st.sampled_from(MODES))
def test_integer_and_bool_summaries(a, mode):
    t = torch.from_numpy(a.copy())
    for values in both_paths(t, mode):
        check(t, a, mode, values)
    check(t, a, mode, tuple(summarize_deferred(t, mode).tolist()))


@settings(max_examples=120, deadline=None)
@given(hnp.arrays(dtype=st.sampled_from([np.float32, np.float64]),
                  shape=hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=4),
                  elements=st.one_of(floats, st.sampled_from([0.0, -0.0, 1.0, -1.0]))),
       st.lists(st.integers(1, 5), min_size=3, max_size=3), st.sampled_from(MODES))
def test_broadcast_views_match_numpy(a, sizes, mode):
    """Stride-0 dimensions (expand, a broadcast scalar) are summarised once and counted again."""
    t = torch.from_numpy(a.copy())
    # Broadcast every dimension of size 1, and one new leading dimension, to a drawn size.
    shape = [sizes[0]] + [sizes[1 + i % 2] if d == 1 else d for i, d in enumerate(t.shape)]
    e = t.expand(*shape)
    ref = np.broadcast_to(a, shape)
    for values in both_paths(e, mode):
        check(e, ref, mode, values)


def test_broadcast_counts_scale_but_statistics_do_not():
    e = torch.tensor([-1.0, 0.0, 3.0]).expand(1000, 3)
    size, neg, zero, pos, ninf, pinf, nan, mn, mx, mean, std = summarize_immediate(e, "stats")
    assert (size, neg, zero, pos, ninf, pinf, nan) == (3000, 1000, 1000, 1000, 0, 0, 0)
    assert (mn, mx) == (-1.0, 3.0)
    assert mean == pytest.approx(2 / 3) and std == pytest.approx(np.std([-1.0, 0.0, 3.0]))
    assert summarize_immediate(torch.tensor(float("nan")).expand(4, 4), "concise_health") == (16, 0, 0, 16)
    for t in (torch.tensor([[-2, 0, 5]]).expand(4, 3), torch.tensor([True, False]).expand(3, 2)):
        for mode in MODES:
            for values in both_paths(t, mode):
                check(t, t.contiguous().numpy(), mode, values)


@pytest.mark.parametrize("mode", MODES)
def test_bfloat16_and_strided_views(mode):
    base = torch.tensor([[0.0, -1.5, float("inf")], [2.0, float("nan"), 0.0], [-float("inf"), 3.0, -2.0]])
    for t in (base.bfloat16(), base[:, ::2], base.t(), base.expand(2, 3, 3)):
        a = t.float().numpy()
        for values in both_paths(t, mode):
            check(t, a, mode, values)
        check(t, a, mode, tuple(summarize_deferred(t, mode).tolist()))


def test_large_finite_tensor_takes_the_fast_path_exactly():
    t = torch.randn(300, 700)
    t[t.abs() < 0.01] = 0.0
    s = summarize_immediate(t, "full_health")
    a = t.numpy()
    assert s == (a.size, (a < 0).sum(), (a == 0).sum(), (a > 0).sum(), 0, 0, 0)


def test_overflowing_sum_is_not_reported_as_nonfinite():
    t = torch.full((10,), 3e38)  # finite values whose float32 sum overflows
    assert summarize_immediate(t, "curt_health") == (0.0,)
    assert summarize_immediate(t, "full_health") == (10, 0, 0, 10, 0, 0, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_edge_bit_patterns_in_every_lane(dtype):
    # The vector pass tests IEEE bits (signed compares, the largest magnitude): -0.0, subnormals,
    # the largest finite values, and one non-finite value in each lane of the vector and the tail.
    info = torch.finfo(dtype)
    edge = [0.0, -0.0, info.tiny, -info.tiny, info.smallest_normal / 4, -info.smallest_normal / 4,
            info.max, -info.max, 1.0, -1.0]
    base = torch.tensor(edge * 53, dtype=torch.float64).to(dtype)  # 530: vectors and a tail
    for values in both_paths(base, "full_health"):
        check(base, base.double().numpy(), "full_health", values)
    for i in list(range(40)) + [base.numel() - 1]:
        for bad in (float("inf"), -float("inf"), float("nan")):
            t = base.clone()
            t[i] = bad
            for values in both_paths(t, "full_health"):
                check(t, t.double().numpy(), "full_health", values)


def _large_cases():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 300, generator=g)
    x[x.abs() < 0.05] = 0.0
    nan_inf = x.clone()
    nan_inf[3, 4], nan_inf[5, 6], nan_inf[7, 8] = float("nan"), float("inf"), -float("inf")
    only_inf = x.clone()
    only_inf[0, 0] = float("inf")
    return {
        "mixed": x, "nonneg": x.relu(), "nonpos": -x.relu(), "positive": x.abs() + 1, "negative": -x.abs() - 1,
        "zeros": torch.zeros(100, 100), "transposed": x.t(), "expanded": x[:1].expand(50, 300),
        "bfloat16": x.bfloat16(), "float16": x.half(), "float64": x.double(), "nan_inf": nan_inf,
        "only_inf": only_inf, "negative_zero": torch.full((80, 80), -0.0),
        "far_from_zero": x * 1e-3 + 1e5,  # a small spread far from zero: the variance's precision
    }


@pytest.mark.parametrize("case", list(_large_cases()))
@pytest.mark.parametrize("mode", ["curt_health", "full_health", "stats"])
def test_large_tensors_and_views_are_exact(case, mode):
    t = _large_cases()[case]
    for values in both_paths(t, mode):
        check(t, t.float().numpy(), mode, values)


def test_the_native_kernel_is_built_for_the_suite():
    # Without it the kernel path above would go untested (make test builds it first).
    assert _native.load() is not None, _native.error()
    assert summarize_immediate(torch.tensor([-1.0, 0.0, 2.0]), "full_health") == (3, 1, 1, 1, 0, 0, 0)


def test_native_kernel_reads_gapped_views_and_negative_views():
    x = torch.arange(-12.0, 12.0).reshape(4, 6)
    for t in (x[:, 1:5:2], x[1:3, ::3].t(), x.neg().conj(), torch.view_as_real(torch.randn(3, 2, dtype=torch.complex64)),
              torch._neg_view(x)):
        for mode in MODES:
            check(t, t.resolve_neg().contiguous().numpy(), mode, _native.load().summarize(t, _MODE_CODE[mode]))


def test_native_kernel_counts_past_the_32_bit_lanes_of_a_chunk():
    # Chunks of 2**30 elements keep the vector counters exact; a view read in runs takes the other loop.
    t = torch.zeros(3, 5000)
    t[0] = -1.0
    t[2, ::3] = 2.0
    assert _native.load().summarize(t[:, ::2], _MODE_CODE["full_health"]) == (7500, 2500, 4166, 834, 0, 0, 0)


def test_expected_nonfinite_summary_is_the_same_summary():
    # The hint skips the finite proof; the summary must not change, on either kernel.
    t = torch.randn(50, 40)
    bad = t.clone()
    bad[1, 2], bad[3, 4] = float("nan"), -float("inf")
    for x in (t, bad, t.t(), bad[:1].expand(7, 40), bad.half()):
        for mode in ("curt_health", "concise_health", "full_health", "stats"):
            assert repr(summarize_numpy(x, mode, expect_nonfinite=True)) == repr(summarize_numpy(x, mode))
            assert repr(summarize_immediate(x, mode, expect_nonfinite=True)) == repr(summarize_immediate(x, mode))


@pytest.fixture(params=[0, 1], ids=["baseline", "avx2"])
def simd(request):
    """Each vector pass of the summary kernel this CPU has (the baseline one always)."""
    mod = _native.load()
    old, best = mod._simd()
    if request.param > best:
        pytest.skip(f"this CPU has no vector pass {request.param}")  # the baseline pass runs everywhere
    mod._simd(request.param)
    assert mod._simd()[0] == request.param
    yield request.param
    mod._simd(old)


_KERNEL_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def _edge_mix(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """n values of dtype mixing randoms, zeros of both signs, subnormals and the largest finite."""
    info = torch.finfo(dtype)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64)
    pick = torch.randint(0, 8, (n,), generator=g)
    edge = torch.tensor([0.0, -0.0, info.smallest_normal / 4, -info.smallest_normal / 4, info.max, -info.max],
                        dtype=torch.float64)
    x = torch.where(pick < 6, edge[pick.clamp(max=5)], x)
    return x.to(dtype)


@pytest.mark.parametrize("dtype", _KERNEL_DTYPES)
def test_every_vector_pass_reads_odd_lengths_misaligned_starts_and_strides(simd, dtype):
    # Lengths around the vector widths (16-64 bytes) and the 16-bit passes' blocks of 32768
    # elements; starts 1-3 elements past the allocation's alignment; every other element; a
    # transposed matrix (read in runs); each with and without a non-finite value in its tail.
    mod = _native.load()
    lengths = [1, 3, 7, 9, 15, 17, 31, 33, 65, 129, 32767, 32769, 65549]
    for n in lengths:
        base = _edge_mix(n + 8, dtype, seed=n)
        views = [base[:n]] + [base[k:k + n] for k in (1, 2, 3)] + [base[::2][: max(1, n // 2)]]
        if n >= 64:
            views.append(base[: (n // 8) * 8].reshape(8, -1).t())
        for t in views:
            for bad in (None, float("nan"), float("inf"), -float("inf")):
                x = t
                if bad is not None:
                    x = t.clone()
                    x[(-1,) * x.dim()] = bad
                check(x, x.double().numpy(), "full_health", mod.summarize(x, _MODE_CODE["full_health"]))


@pytest.mark.parametrize("dtype", _KERNEL_DTYPES)
def test_every_vector_pass_counts_past_narrow_counters(simd, dtype):
    # 200,000 elements of one sign: more than a 16-bit counter holds, in one lane or all together.
    mod = _native.load()
    n = 200_000
    for fill, want in ((-1.5, (n, n, 0, 0, 0, 0, 0)), (2.0, (n, 0, 0, n, 0, 0, 0)), (-0.0, (n, 0, n, 0, 0, 0, 0))):
        t = torch.full((n,), fill, dtype=dtype)
        assert mod.summarize(t, _MODE_CODE["full_health"]) == want, (fill, dtype)
        assert mod.summarize(t[1:], _MODE_CODE["full_health"])[0] == n - 1


def test_the_vector_pass_level_is_bounded_by_the_cpu():
    mod = _native.load()
    old, best = mod._simd()
    try:
        assert mod._simd(99)[0] == old
        assert mod._simd()[0] == best  # never above what the CPU has
    finally:
        mod._simd(old)


def test_host_copy_of_cpu_summaries_gives_the_values_and_no_event():
    from trainguard.capture._summary import host_copy

    values = torch.tensor([4.0, 0.0, 1.0, 3.0], dtype=torch.float64)
    host, event = host_copy(values)
    assert event is None and host.device.type == "cpu"
    assert torch.equal(host, values)


@pytest.mark.parametrize("dtype", _KERNEL_DTYPES)
def test_a_large_dense_tensor_split_across_threads_counts_exactly(simd, dtype):
    # Large dense outputs are summarised by torch's intra-op threads, a part each: every part's
    # counts add up, and one part's NaN or inf makes the whole summary exact.
    mod = _native.load()
    n = (1 << 20) + 13  # above the split's threshold, not a multiple of the parts
    old = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            t = torch.linspace(-1, 1, n, dtype=torch.float64).to(dtype)
            t[::7] = 0
            check(t, t.double().numpy(), "full_health", mod.summarize(t, _MODE_CODE["full_health"]))
            for at in (0, n // 2 + 1, n - 1):  # in the first, a middle and the last part
                bad = t.clone()
                bad[at] = float("nan")
                bad[at // 2] = float("-inf")
                check(bad, bad.double().numpy(), "full_health", mod.summarize(bad, _MODE_CODE["full_health"]))
    finally:
        torch.set_num_threads(old)
