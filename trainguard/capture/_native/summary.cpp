// The summary kernel: one pass over a tensor's memory proves it finite and counts signs.
//
// Sign, zero and non-finite tests read the IEEE bits, so float32/64, float16 and bfloat16 share
// one loop of integer operations that the compiler vectorises; a tensor that is not finite gets a
// second, exact pass (NaN, +inf, -inf apart). Memory is read in storage order (summaries do not
// depend on element order), dense blocks through the vector loop, other layouts dimension by
// dimension. This replaces the numba kernel: one compiled pass, no LLVM in the process.
#include "native.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/ops/_values.h>
#include <ATen/ops/aminmax.h>
#include <ATen/ops/coalesce.h>
#include <ATen/ops/count_nonzero.h>
#include <ATen/ops/dequantize.h>
#include <ATen/ops/full.h>
#include <ATen/ops/isnan.h>
#include <ATen/ops/isneginf.h>
#include <ATen/ops/isposinf.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/values.h>
#include <ATen/ops/view_as_real.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

namespace tg {

int mode_fields(int mode) {
  switch (mode) {
    case CURT: return 1;
    case CONCISE: return 4;
    case FULL: case FULL_TENSOR: return 7;
    case STATS: return 11;
    default: return 0;
  }
}

namespace {
constexpr double NaN = std::numeric_limits<double>::quiet_NaN();

struct Counts {
  int64_t neg = 0, zero = 0, pos = 0, ninf = 0, pinf = 0, nan = 0;
  bool finite = true;
  double mn = NaN, mx = NaN, sum = 0, shift = 0, s1 = 0, s2 = 0;
  bool have_shift = false;
};

template <typename U> struct Bits;
template <> struct Bits<uint32_t> { static constexpr uint32_t exp = 0x7f800000u, abs = 0x7fffffffu, sign = 0x80000000u; };
template <> struct Bits<uint64_t> { static constexpr uint64_t exp = 0x7ff0000000000000ull, abs = 0x7fffffffffffffffull, sign = 0x8000000000000000ull; };
template <> struct Bits<uint16_t> { static constexpr uint16_t exp = 0x7c00, abs = 0x7fff, sign = 0x8000; };
struct BF16Bits { static constexpr uint16_t exp = 0x7f80, abs = 0x7fff, sign = 0x8000; };

// Fast pass over n floats given as bit patterns U with masks B: (neg, pos) and whether all finite.
// As unsigned bit patterns: negative non-zero is above the sign bit alone, positive non-zero is
// below it; a NaN or infinity has every exponent bit set. Baseline x86-64 (SSE2) code for 32 and
// 64 bits (SSE2 has no 64-bit compares, and no 32-bit max).
template <typename U, typename B>
inline void fast_chunk(const U* p, int64_t m, Counts& c) {
  uint32_t neg = 0, pos = 0, bad = 0;
#pragma omp simd reduction(+ : neg, pos) reduction(| : bad)
  for (int64_t i = 0; i < m; ++i) {
    U b = p[i];
    bad |= (uint32_t)((b & B::exp) == B::exp);
    neg += (uint32_t)(b > B::sign);
    pos += (uint32_t)((U)(b - 1) < (U)(B::sign - 1));
  }
  c.neg += neg;
  c.pos += pos;
  if (bad) c.finite = false;
}

// The same counts in the form vector units have instructions for (signed compares, max): with S
// the signed type of U's width, a negative non-zero value is (S)(b - 1) < -1 (-0.0 wraps to the
// largest positive), a positive non-zero one (S)b > 0, and all are finite when the largest
// magnitude (sign bit clear, so a signed max) is below the exponent mask. The counters have U's
// width, as many lanes as the loads: 16-bit counters widened to 32 bits per element would cost
// more than the compares (float16/bfloat16 ran at a third of float32's bytes per second), so the
// pass runs in blocks of BLOCK elements (no counter can wrap inside one) and adds each block's
// totals to 64-bit ones. For 64 bits only the finite test differs: a signed compare (there is no
// 64-bit max below AVX-512).
template <typename S, typename U, typename B>
__attribute__((always_inline)) inline void fast_chunk_signed(const U* p, int64_t m, Counts& c) {
  constexpr int64_t BLOCK = sizeof(U) == 2 ? int64_t(1) << 15 : int64_t(1) << 30;
  int64_t neg = 0, pos = 0;
  S mx = 0, bad = 0;
  for (int64_t s = 0; s < m; s += BLOCK) {
    const int64_t e = std::min(m, s + BLOCK);
    U bneg = 0, bpos = 0;
    if constexpr (sizeof(U) == 8) {
#pragma omp simd reduction(+ : bneg, bpos) reduction(| : bad)
      for (int64_t i = s; i < e; ++i) {
        U b = p[i];
        bneg += (U)((S)(U)(b - 1) < (S)-1);
        bpos += (U)((S)b > 0);
        bad |= (S)((S)(b & B::abs) >= (S)B::exp);
      }
    } else {
#pragma omp simd reduction(+ : bneg, bpos) reduction(max : mx)
      for (int64_t i = s; i < e; ++i) {
        U b = p[i];
        bneg += (U)((S)(U)(b - 1) < (S)-1);
        bpos += (U)((S)b > 0);
        S a = (S)(b & B::abs);
        mx = a > mx ? a : mx;
      }
    }
    neg += bneg;
    pos += bpos;
  }
  c.neg += neg;
  c.pos += pos;
  if (bad || (U)mx >= B::exp) c.finite = false;
}

// Which vector pass runs: the best this CPU has (0 baseline, 1 AVX2), or lower for the tests.
#if defined(__x86_64__) && defined(__GNUC__)
#define TG_AVX2 1
__attribute__((target("avx2"))) void fast_avx2_64(const uint64_t* p, int64_t m, Counts& c) {
  fast_chunk_signed<int64_t, uint64_t, Bits<uint64_t>>(p, m, c);
}
__attribute__((target("avx2"))) void fast_avx2_32(const uint32_t* p, int64_t m, Counts& c) {
  fast_chunk_signed<int32_t, uint32_t, Bits<uint32_t>>(p, m, c);
}
__attribute__((target("avx2"))) void fast_avx2_16(const uint16_t* p, int64_t m, Counts& c) {
  fast_chunk_signed<int16_t, uint16_t, Bits<uint16_t>>(p, m, c);
}
__attribute__((target("avx2"))) void fast_avx2_bf16(const uint16_t* p, int64_t m, Counts& c) {
  fast_chunk_signed<int16_t, uint16_t, BF16Bits>(p, m, c);
}
int detect_simd() {
  __builtin_cpu_init();  // may run before libgcc's own initialiser (a static initialiser)
  return __builtin_cpu_supports("avx2") ? 1 : 0;
}
#else
int detect_simd() { return 0; }
#endif
const int g_simd_max = detect_simd();
std::atomic<int> g_simd{g_simd_max};

template <typename U, typename B>
inline void fast_dispatch(const U* p, int64_t m, Counts& c) {
#ifdef TG_AVX2
  if (g_simd.load(std::memory_order_relaxed) >= 1) {
    if constexpr (std::is_same_v<U, uint64_t>) return fast_avx2_64(p, m, c);
    if constexpr (std::is_same_v<U, uint32_t>) return fast_avx2_32(p, m, c);
    if constexpr (std::is_same_v<U, uint16_t> && std::is_same_v<B, BF16Bits>) return fast_avx2_bf16(p, m, c);
    if constexpr (std::is_same_v<U, uint16_t>) return fast_avx2_16(p, m, c);
  }
#endif
  // 16-bit signed compares and max are baseline (SSE2, NEON): the blocked form everywhere.
  if constexpr (std::is_same_v<U, uint16_t>) return fast_chunk_signed<int16_t, uint16_t, B>(p, m, c);
  else fast_chunk<U, B>(p, m, c);
}

template <typename U, typename B>
inline void fast_block(const U* p, int64_t n, Counts& c) {
  while (n > 0) {
    // 32-bit lanes stay exact: at most 2**30 elements per chunk.
    int64_t m = std::min<int64_t>(n, int64_t(1) << 30);
    fast_dispatch<U, B>(p, m, c);
    p += m;
    n -= m;
  }
}

template <typename U, typename B>
inline void exact_block(const U* p, int64_t n, Counts& c) {
  for (int64_t i = 0; i < n; ++i) {
    U b = p[i];
    U a = b & B::abs;
    bool s = (b & B::sign) != 0;
    if ((a & B::exp) == B::exp) {
      if (a != B::exp) c.nan++;
      else if (s) c.ninf++;
      else c.pinf++;
    } else if (a == 0) {
      c.zero++;
    } else if (s) {
      c.neg++;
    } else {
      c.pos++;
    }
  }
}

template <typename T> inline double as_double(T x) { return static_cast<double>(static_cast<float>(x)); }
template <> inline double as_double<double>(double x) { return x; }
template <> inline double as_double<float>(float x) { return x; }

// min, max and (for finite data) shifted sums for the mean and std; NaN propagates into min/max.
template <typename T>
inline void moments_block(const T* p, int64_t n, Counts& c) {
  if (n == 0) return;
  if (!c.have_shift) {
    c.shift = as_double(p[0]);
    c.have_shift = true;
    c.mn = c.mx = c.shift;
  }
  double mn = c.mn, mx = c.mx, s1 = 0, s2 = 0, sum = 0, shift = c.shift;
  if (c.finite) {  // the common case: no NaN to propagate, a loop the compiler vectorises
#pragma omp simd reduction(min : mn) reduction(max : mx) reduction(+ : s1, s2)
    for (int64_t i = 0; i < n; ++i) {
      double x = as_double(p[i]);
      mn = std::min(mn, x);
      mx = std::max(mx, x);
      double d = x - shift;
      s1 += d;
      s2 += d * d;
    }
    sum = s1 + shift * n;
  } else {
    bool nan = std::isnan(mn);
    for (int64_t i = 0; i < n; ++i) {
      double x = as_double(p[i]);
      if (x != x) nan = true;
      mn = x < mn ? x : mn;
      mx = x > mx ? x : mx;
      sum += x;
    }
    if (nan) mn = mx = NaN;
  }
  c.mn = mn;
  c.mx = mx;
  c.s1 += s1;
  c.s2 += s2;
  c.sum += sum;
}

template <typename T>
inline void int_block(const T* p, int64_t n, Counts& c) {
  int64_t neg = 0, pos = 0;
#pragma omp simd reduction(+ : neg, pos)
  for (int64_t i = 0; i < n; ++i) {
    neg += p[i] < 0;
    pos += p[i] > 0;
  }
  c.neg += neg;
  c.pos += pos;
  c.zero += n - neg - pos;
}

// Calls f(pointer, count) over the tensor's elements in storage order: one call for a dense
// tensor, one per innermost run otherwise.
template <typename T, typename F>
void for_each_run(const at::Tensor& t, F&& f) {
  const T* base = static_cast<const T*>(t.const_data_ptr());
  int64_t n = t.numel();
  if (n == 0) return;
  if (t.is_non_overlapping_and_dense()) {
    f(base, n);  // non-negative strides: element 0 is the lowest address of the block
    return;
  }
  // Dimensions by decreasing stride; the innermost is read as runs.
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size)
  for (int64_t d = 0; d < t.dim(); ++d)
    if (t.size(d) != 1) dims.push_back({t.stride(d), t.size(d)});
  std::sort(dims.begin(), dims.end(), [](auto& a, auto& b) { return a.first > b.first; });
  if (dims.empty()) { f(base, 1); return; }
  auto inner = dims.back();
  dims.pop_back();
  std::vector<int64_t> idx(dims.size(), 0);
  std::vector<T> buf;
  if (inner.first != 1) buf.resize(inner.second);
  while (true) {
    int64_t off = 0;
    for (size_t k = 0; k < dims.size(); ++k) off += idx[k] * dims[k].first;
    const T* p = base + off;
    if (inner.first == 1) {
      f(p, inner.second);
    } else {
      for (int64_t i = 0; i < inner.second; ++i) buf[i] = p[i * inner.first];
      f(buf.data(), inner.second);
    }
    int64_t k = (int64_t)dims.size() - 1;
    while (k >= 0 && ++idx[k] == dims[k].second) idx[k--] = 0;
    if (k < 0) break;
  }
}

// A dense tensor of at least this many elements is read by torch's intra-op threads, a part
// each (the op that made it used them too; one thread alone would double the pass's share of a
// step on two). Below it, waking the threads costs more than the part they would read.
constexpr int64_t kSplitMin = int64_t(1) << 17;

template <typename U, typename B>
bool fast_split(const U* p, int64_t n, Counts& c) {
  const int threads = at::get_num_threads();
  if (n < kSplitMin || threads < 2 || at::in_parallel_region()) return false;
  std::vector<Counts> parts(threads);
  at::parallel_for(0, n, kSplitMin / 2, [&](int64_t b, int64_t e) {
    fast_block<U, B>(p + b, e - b, parts[at::get_thread_num()]);
  });
  for (const Counts& part : parts) {
    c.neg += part.neg;
    c.pos += part.pos;
    c.finite = c.finite && part.finite;
  }
  return true;
}

template <typename T, typename U, typename B>
Counts float_counts(const at::Tensor& t, bool moments, bool expect_nonfinite) {
  Counts c;
  // Expected not finite (an input is already harmful: a NaN storm's every op): the exact pass only.
  if (expect_nonfinite) c.finite = false;
  else if (!(t.is_non_overlapping_and_dense() &&
             fast_split<U, B>(reinterpret_cast<const U*>(t.const_data_ptr()), t.numel(), c)))
    for_each_run<T>(t, [&](const T* p, int64_t n) { fast_block<U, B>(reinterpret_cast<const U*>(p), n, c); });
  if (!c.finite) {
    Counts e;
    e.finite = false;
    for_each_run<T>(t, [&](const T* p, int64_t n) { exact_block<U, B>(reinterpret_cast<const U*>(p), n, e); });
    e.finite = !(e.nan || e.pinf || e.ninf);
    c = e;
  } else {
    c.zero = t.numel() - c.neg - c.pos;
  }
  if (moments)
    for_each_run<T>(t, [&](const T* p, int64_t n) { moments_block<T>(p, n, c); });
  return c;
}

template <typename T>
Counts integer_counts(const at::Tensor& t, bool moments) {
  Counts c;
  for_each_run<T>(t, [&](const T* p, int64_t n) { int_block<T>(p, n, c); });
  if (moments)
    for_each_run<T>(t, [&](const T* p, int64_t n) { moments_block<T>(p, n, c); });
  return c;
}

bool counts_of(const at::Tensor& t, bool moments, Counts& c, bool expect_nonfinite = false) {
  switch (t.scalar_type()) {
    case at::kFloat: c = float_counts<float, uint32_t, Bits<uint32_t>>(t, moments, expect_nonfinite); return true;
    case at::kDouble: c = float_counts<double, uint64_t, Bits<uint64_t>>(t, moments, expect_nonfinite); return true;
    case at::kHalf: c = float_counts<c10::Half, uint16_t, Bits<uint16_t>>(t, moments, expect_nonfinite); return true;
    case at::kBFloat16: c = float_counts<c10::BFloat16, uint16_t, BF16Bits>(t, moments, expect_nonfinite); return true;
    case at::kByte: c = integer_counts<uint8_t>(t, moments); return true;
    case at::kChar: c = integer_counts<int8_t>(t, moments); return true;
    case at::kShort: c = integer_counts<int16_t>(t, moments); return true;
    case at::kInt: c = integer_counts<int32_t>(t, moments); return true;
    case at::kLong: c = integer_counts<int64_t>(t, moments); return true;
    case at::kUInt16: c = integer_counts<uint16_t>(t, moments); return true;
    case at::kUInt32: c = integer_counts<uint32_t>(t, moments); return true;
    case at::kUInt64: c = integer_counts<uint64_t>(t, moments); return true;
    default: return false;
  }
}

Summary pack(int mode, double n, double neg, double zero, double pos, double ninf, double pinf, double nan,
             double mn, double mx, double mean, double std) {
  Summary s;
  s.n = mode_fields(mode);
  if (mode == CONCISE) {
    s.v = {n, ninf, pinf, nan};
    return s;
  }
  s.v = {n, neg, zero, pos, ninf, pinf, nan, mn, mx, mean, std};
  return s;
}

bool is_float8(at::ScalarType st) {
  return st == at::kFloat8_e5m2 || st == at::kFloat8_e4m3fn || st == at::kFloat8_e5m2fnuz ||
         st == at::kFloat8_e4m3fnuz;
}

// Values torch reads directly: dequantized, float8 as float32, complex as (real, imag) pairs,
// negative views resolved (their memory holds the values before negation).
at::Tensor plain_values(const at::Tensor& t) {
  if (t.is_quantized()) return t.dequantize();
  if (is_float8(t.scalar_type())) return t.to(at::kFloat);
  if (t.is_complex()) return at::view_as_real(t.resolve_conj());
  if (t.is_neg()) return t.resolve_neg();
  return t;
}

Summary sparse_summary(const at::Tensor& t, int mode) {
  at::Tensor values = t.layout() == at::kSparse ? t.coalesce()._values() : t.values();
  Summary s = summarize(values, mode);
  int64_t implicit = t.numel() - values.numel();
  if (!implicit || mode == CURT) return s;
  if (mode == CONCISE) {
    s.v[0] += implicit;
    return s;
  }
  double n_v = values.numel(), n = t.numel();
  s.v[0] += implicit;
  s.v[2] += implicit;
  if (mode != STATS) return s;
  if (n_v == 0) {
    s.v[7] = s.v[8] = s.v[9] = s.v[10] = 0.0;
    return s;
  }
  double mn = s.v[7], mx = s.v[8], mean = s.v[9], sd = s.v[10];
  double mean_all = mean * n_v / n;
  double var_all = n_v * (sd * sd + mean * mean) / n - mean_all * mean_all;
  s.v[7] = std::min(mn, 0.0);
  s.v[8] = std::max(mx, 0.0);
  s.v[9] = mean_all;
  s.v[10] = std::sqrt(std::max(var_all, 0.0));
  return s;
}
}  // namespace

int simd_level(int level) {
  int old = g_simd.load();
  if (level >= 0) g_simd.store(std::min(level, g_simd_max));
  return old;
}
int simd_max() { return g_simd_max; }

Summary unknown_summary(int mode, int64_t n) {
  Summary s;
  s.n = mode_fields(mode);
  if (mode == CURT) { s.v[0] = 0.0; return s; }
  s.v.fill(NaN);
  s.v[0] = (double)n;
  return s;
}

int health_of(int mode, const Summary& s) {
  if (s.n == 0) return 0;
  if (mode == CURT) return s.v[0] > 0 ? ((int)s.v[0] & 7) : 0;  // curt_health holds the health bits
  int nan_i = mode == CONCISE ? 3 : 6, pinf_i = mode == CONCISE ? 2 : 5, ninf_i = mode == CONCISE ? 1 : 4;
  int flags = 0;
  if (s.v[nan_i] > 0) flags |= 1;
  if (s.v[pinf_i] > 0) flags |= 2;
  if (s.v[ninf_i] > 0) flags |= 4;
  return flags;
}

// Whether the tensor's elements are in memory this process can read: a compiler's fake tensor
// (its storage has no data) or a Python wrapper subclass (a functional tensor: its storage is
// the wrapped one's, or none) holds none.
static bool has_values(const at::Tensor& t) {
  if (t.key_set().has(c10::DispatchKey::Python) || !t.has_storage()) return false;
  return t.numel() == 0 || t.storage().data() != nullptr;
}

Summary summarize(const at::Tensor& t0, int mode, bool expect_nonfinite) {
  if (mode_fields(mode) == 0) return Summary{};
  if (t0.layout() != at::kStrided) return sparse_summary(t0, mode);
  if (t0.is_meta() || !has_values(t0)) return unknown_summary(mode, t0.numel());
  at::Tensor t = plain_values(t0);
  // A dimension of stride 0 repeats memory: read the distinct elements once, scale the counts.
  bool broadcast = false;
  for (int64_t d = 0; d < t.dim(); ++d)
    if (t.stride(d) == 0 && t.size(d) > 1) broadcast = true;
  if (broadcast && t.numel()) {
    at::Tensor base = t;
    for (int64_t d = 0; d < t.dim(); ++d)
      if (t.stride(d) == 0) base = base.narrow(d, 0, 1);
    int64_t repeat = t.numel() / base.numel();
    Summary s = summarize(base, mode, expect_nonfinite);
    int k = mode == CONCISE ? 4 : (mode == CURT ? 0 : 7);
    for (int i = 0; i < k; ++i) s.v[i] *= repeat;
    return s;
  }
  int64_t n = t.numel();
  bool isfloat = at::isFloatingType(t.scalar_type());
  if (mode == CURT) {
    Summary s;
    s.n = 1;
    if (n == 0 || !isfloat) return s;
    Counts c;
    counts_of(t, false, c, expect_nonfinite);
    // the health bits: 1 NaN, 2 +inf, 4 -inf
    s.v[0] = c.finite ? 0.0 : (double)((c.nan ? 1 : 0) | (c.pinf ? 2 : 0) | (c.ninf ? 4 : 0));
    return s;
  }
  if (n == 0) return pack(mode, 0, 0, 0, 0, 0, 0, 0, NaN, NaN, NaN, NaN);
  if (t.scalar_type() == at::kBool) {
    int64_t nz = at::count_nonzero(t).item<int64_t>();  // CPU: no device to wait for
    double p = (double)nz / n;
    return pack(mode, n, 0, n - nz, nz, 0, 0, 0, nz == n, nz > 0, p, std::sqrt(p * (1 - p)));
  }
  Counts c;
  if (!counts_of(t.device().is_cpu() ? t : t.cpu(), mode == STATS, c, expect_nonfinite))
    TORCH_CHECK(false, "trainguard: no summary kernel for dtype ", t.scalar_type());
  double mean = NaN, sd = NaN;
  if (mode == STATS) {
    if (c.finite) {
      double ms = c.s1 / n;
      mean = c.shift + ms;
      sd = std::sqrt(std::max(c.s2 / n - ms * ms, 0.0));
    } else {
      mean = c.sum / n;
      sd = NaN;
    }
  }
  return pack(mode, n, c.neg, c.zero, c.pos, c.ninf, c.pinf, c.nan, c.mn, c.mx, mean, sd);
}

at::Tensor summarize_deferred(const at::Tensor& t0, int mode) {
  at::Tensor t = plain_values(t0.detach());
  int64_t n = t.numel();
  auto dev = t.device();
  auto f64 = at::TensorOptions().dtype(at::kDouble).device(dev);
  if (n == 0 || t.layout() != at::kStrided) {
    Summary s = summarize(t.layout() != at::kStrided ? t.cpu() : t, mode);
    return at::tensor(at::ArrayRef<double>(s.v.data(), s.n), f64);
  }
  if (t.scalar_type() == at::kBool) t = t.to(at::kByte);
  bool isfloat = t.is_floating_point();
  at::Tensor nan, pinf, ninf;
  if (isfloat) {
    nan = at::isnan(t).sum();
    pinf = at::isposinf(t).sum();
    ninf = at::isneginf(t).sum();
  } else {
    nan = pinf = ninf = at::zeros({}, at::TensorOptions().dtype(at::kLong).device(dev));
  }
  if (mode == CURT)  // the health bits: 1 NaN, 2 +inf, 4 -inf
    return (nan.gt(0).to(at::kLong) + 2 * pinf.gt(0).to(at::kLong) + 4 * ninf.gt(0).to(at::kLong))
        .to(at::kDouble).reshape({1});
  at::Tensor size = at::full({}, (double)n, f64);
  if (mode == CONCISE) return at::stack({size, ninf.to(at::kDouble), pinf.to(at::kDouble), nan.to(at::kDouble)});
  at::Tensor neg = t.lt(0).sum() - ninf, zero = t.eq(0).sum(), pos = t.gt(0).sum() - pinf;
  std::vector<at::Tensor> parts = {size, neg.to(at::kDouble), zero.to(at::kDouble), pos.to(at::kDouble),
                                   ninf.to(at::kDouble), pinf.to(at::kDouble), nan.to(at::kDouble)};
  if (mode == STATS) {
    at::Tensor f = t.to(at::kDouble);
    auto [mn, mx] = at::aminmax(f);
    at::Tensor mean = f.mean();
    at::Tensor sd = (f - mean).square().mean().sqrt();
    parts.insert(parts.end(), {mn, mx, mean, sd});
  }
  return at::stack(parts);
}

}  // namespace tg
