// The loops of cpu_simd.h, built once per vector extension (CMakeLists.txt's
// add_cpu_simd_build): DIFFUSERVE_CPU_ISA names the build and its namespace, and the build's
// compiler flags (-mavx512f, -mavx2, none) set the vector width and how many results a
// product's block keeps in registers. The products are written once, on GCC's and Clang's
// vector extension, in an order that does not depend on the width (cpu_simd.h says which);
// -ffp-contract=fast makes each `sum += x * w` one fused multiply-add. The elementwise loops
// (tanh, e^x, squares) are plain loops without branches, which the compiler vectorizes.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#ifndef DIFFUSERVE_CPU_ISA
#error "built by CMakeLists.txt's add_cpu_simd_build, which names the build"
#endif

#define DIFFUSERVE_INLINE inline __attribute__((always_inline))

namespace diffuserve::cpu::DIFFUSERVE_CPU_ISA {
namespace {

// Block sizes, for the extension's vector registers (32 of 16 floats with AVX-512, 16 of 8
// with AVX2, 16 of 4 with SSE or NEON):
// - dot_rows: kDotRows rows of x by kDotCols rows of w, each result sixteen lanes of sums;
// - add_rows_times: kTimesRows rows of x by kTimesVectors registers of columns.
#if defined(__AVX512F__)
constexpr int kWidth = 16, kDotRows = 4, kDotCols = 4, kTimesRows = 4, kTimesVectors = 4;
#elif defined(__AVX2__)
constexpr int kWidth = 8, kDotRows = 2, kDotCols = 3, kTimesRows = 3, kTimesVectors = 4;
#else
constexpr int kWidth = 4, kDotRows = 1, kDotCols = 3, kTimesRows = 4, kTimesVectors = 2;
#endif

using Vector = float __attribute__((vector_size(kWidth * sizeof(float))));

template <typename T>
DIFFUSERVE_INLINE T load(const float* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <typename T>
DIFFUSERVE_INLINE void store(float* p, const T& v) {
  std::memcpy(p, &v, sizeof v);
}

// ---- dot_rows: sixteen lanes of sums a result, as kParts registers (lane l in part l / kWidth).

constexpr int kLanes = 16, kParts = kLanes / kWidth;

// Keeps v in a register from here on. Without it GCC folds the load of a row of w into each
// multiply-add that reads it, loading it again for every row of x: 16 loads to 12 fused
// multiply-adds in AVX2's block, which bound the loop (53 -> 67 GFLOP/s a core with it).
DIFFUSERVE_INLINE void in_register(Vector& v) {
#if defined(__x86_64__) || defined(__i386__)
  asm("" : "+x"(v));
#elif defined(__aarch64__)
  asm("" : "+w"(v));
#endif
}

// sums[i][c] += the products of xs[i] and ws[c] at j .. j + 15, lane by lane.
template <int R, int C>
DIFFUSERVE_INLINE void multiply_add(Vector (&sums)[R][C][kParts], const float* const* xs, const float* const* ws,
                                    int64_t j) {
#pragma GCC unroll 16
  for (int p = 0; p < kParts; ++p) {
    const int64_t at = j + p * kWidth;
    Vector w[C];
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) in_register(w[c] = load<Vector>(ws[c] + at));
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) {
      const Vector x = load<Vector>(xs[i] + at);
#pragma GCC unroll 16
      for (int c = 0; c < C; ++c) sums[i][c][p] += x * w[c];
    }
  }
}

// v's lanes added in halves (lane l plus lane l + n/2, until one is left). The halves are
// copied out rather than shuffled: GCC before 12 has no __builtin_shufflevector.
using Floats4 = float __attribute__((vector_size(4 * sizeof(float))));
using Floats8 = float __attribute__((vector_size(8 * sizeof(float))));
using Floats16 = float __attribute__((vector_size(16 * sizeof(float))));

template <typename Half, typename Whole>
DIFFUSERVE_INLINE Half halves_added(const Whole& v) {
  Half low, high;
  std::memcpy(&low, &v, sizeof low);
  std::memcpy(&high, reinterpret_cast<const char*>(&v) + sizeof low, sizeof high);
  return low + high;
}
DIFFUSERVE_INLINE float sum_halves(const Floats4& v) { return (v[0] + v[2]) + (v[1] + v[3]); }
DIFFUSERVE_INLINE float sum_halves(const Floats8& v) { return sum_halves(halves_added<Floats4>(v)); }
DIFFUSERVE_INLINE float sum_halves(const Floats16& v) { return sum_halves(halves_added<Floats8>(v)); }

// The fixed tree: each lane with the one eight over, then four, two, one (across the parts
// first, then within the register).
template <int P>
DIFFUSERVE_INLINE float sum_lanes(Vector (&parts)[P]) {
  for (int half = P / 2; half >= 1; half /= 2)
    for (int q = 0; q < half; ++q) parts[q] += parts[q + half];
  return sum_halves(parts[0]);
}

// out[i][c] = dot(xs[i], ws[c], k) for a block of R rows of x by C of w.
template <int R, int C>
DIFFUSERVE_INLINE void dot_block(const float* const* xs, const float* const* ws, int64_t k, float (&out)[R][C]) {
  Vector sums[R][C][kParts] = {};
  int64_t j = 0;
  for (; j + kLanes <= k; j += kLanes) multiply_add(sums, xs, ws, j);
  if (j < k) {  // the last k % 16 values, the lanes past them zero (their products add nothing)
    float x_tail[R][kLanes] = {}, w_tail[C][kLanes] = {};
    const float *xt[R], *wt[C];
    for (int i = 0; i < R; ++i) xt[i] = static_cast<float*>(std::memcpy(x_tail[i], xs[i] + j, (k - j) * 4));
    for (int c = 0; c < C; ++c) wt[c] = static_cast<float*>(std::memcpy(w_tail[c], ws[c] + j, (k - j) * 4));
    multiply_add(sums, xt, wt, 0);
  }
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < C; ++c) out[i][c] = sum_lanes(sums[i][c]);
}

// ---- add_rows_times: each result its own running sum, the products added one j after another.

// ys[i][c ..] += sum over j < k of xs[i][j] * w[j][c ..] for a block of R rows, V
// registers of T from column c. T is Vector, or float for the columns past the last whole
// register.
template <int R, typename T, int V>
DIFFUSERVE_INLINE void times_block(const float* const* xs, const float* w, int64_t ldw, int64_t k, float* const* ys,
                                   int64_t c) {
  constexpr int lanes = sizeof(T) / sizeof(float);
  w += c;
  T sums[R][V];
  for (int i = 0; i < R; ++i)
    for (int v = 0; v < V; ++v) sums[i][v] = load<T>(ys[i] + c + v * lanes);
  for (int64_t j = 0; j < k; ++j) {
    float xj[R];
    bool any = false;
    for (int i = 0; i < R; ++i) any |= (xj[i] = xs[i][j]) != 0.0f;
    if (!any) continue;
    T wj[V];
    for (int v = 0; v < V; ++v) wj[v] = load<T>(w + j * ldw + v * lanes);
    for (int i = 0; i < R; ++i)
      for (int v = 0; v < V; ++v) sums[i][v] += xj[i] * wj[v];
  }
  for (int i = 0; i < R; ++i)
    for (int v = 0; v < V; ++v) store(ys[i] + c + v * lanes, sums[i][v]);
}

// ---- Blocks of rows: f.template operator()<R>(i0) over [0, m) in blocks of kMax rows, the
// last one R = the rows left (each R its own code, so no block computes rows it drops).

template <int R, typename F>
DIFFUSERVE_INLINE void last_rows(int64_t i0, int64_t rows, F& f) {
  if constexpr (R > 1)
    if (rows < R) return last_rows<R - 1>(i0, rows, f);
  f.template operator()<R>(i0);
}

template <int kMax, typename F>
DIFFUSERVE_INLINE void in_row_blocks(int64_t m, F&& f) {
  int64_t i0 = 0;
  for (; i0 + kMax <= m; i0 += kMax) f.template operator()<kMax>(i0);
  if (i0 < m) last_rows<kMax>(i0, m - i0, f);
}

// ---- e^x and tanh, as Cephes computes expf and tanhf, without branches.

// e^x for x in [-87.33654, 88.7] (Cephes' expf: x = n ln 2 + r, a polynomial in r, times
// 2^n, n from -126 up). n is rounded by adding and taking away 1.5 * 2^23, which needs no
// rounding instruction; the sum's low bits hold n as an integer, read from them rather than by
// converting n (a NaN or infinite x made that conversion undefined; the result is NaN there,
// as before).
DIFFUSERVE_INLINE float exp_in_range(float x) {
  const float shifted = x * 1.44269504088896341f + 12582912.0f;
  const float n = shifted - 12582912.0f;
  const uint32_t n_bits = std::bit_cast<uint32_t>(shifted) - 0x4B400000u;  // n, two's complement
  const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  return p * std::bit_cast<float>((n_bits + 127u) << 23);
}

DIFFUSERVE_INLINE float tanh_of(float x) {
  const float a = std::fabs(x), z = x * x;
  float s = -5.70498872745e-3f;
  s = s * z + 2.06390887954e-2f;
  s = s * z - 5.37397155531e-2f;
  s = s * z + 1.33314422036e-1f;
  s = s * z - 3.33332819422e-1f;
  const float small = s * z * x + x;
  // From 10 on, 1 - 2 / (e^20 + 1) rounds to 1, as tanh does (from 9.01). `a > 10 ? 10 : a`
  // keeps a NaN (std::fmin would not, nor vectorize).
  const float e = exp_in_range(2.0f * (a > 10.0f ? 10.0f : a));
  const float large = std::copysign(1.0f - 2.0f / (e + 1.0f), x);
  return a < 0.625f ? small : large;
}

// e^x for x <= 88.7: 0 below -87.33654, where e^x is no longer a normal float (and for -inf);
// NaN stays NaN.
DIFFUSERVE_INLINE float exp_of(float x) {
  constexpr float kLowest = -87.33654f;
  const float e = exp_in_range(x < kLowest ? kLowest : x);
  return x < kLowest ? 0.0f : e;
}

// ---- Sums of many values, in dot_rows' order: lane l of sixteen takes the values j = l,
// l + 16, ..., and the lanes are added by the fixed tree. fill(j0, count, values) writes the
// values j0 .. j0 + count - 1 (a plain loop there vectorizes).
template <typename Fill>
DIFFUSERVE_INLINE float sum_in_lanes(int64_t n, Fill fill) {
  constexpr int64_t kChunk = 256;
  float values[kChunk];
  Vector parts[kParts] = {};
  for (int64_t j0 = 0; j0 < n; j0 += kChunk) {
    const int64_t count = std::min(kChunk, n - j0), padded = (count + kLanes - 1) / kLanes * kLanes;
    fill(j0, count, values);
    std::fill(values + count, values + padded, 0.0f);  // (a lane's sum plus 0 is that sum)
    for (int64_t j = 0; j < padded; j += kLanes)
      for (int p = 0; p < kParts; ++p) parts[p] += load<Vector>(values + j + p * kWidth);
  }
  return sum_lanes(parts);
}

// The largest of x[0 .. n) (NaNs may be passed over).
DIFFUSERVE_INLINE float max_of(const float* x, int64_t n) {
  float m = -INFINITY;
  int64_t j = 0;
  if (n >= kWidth) {
    Vector v = load<Vector>(x);
    for (j = kWidth; j + kWidth <= n; j += kWidth) {
      const Vector y = load<Vector>(x + j);
      v = y > v ? y : v;
    }
    for (int l = 0; l < kWidth; ++l) m = v[l] > m ? v[l] : m;
  }
  for (; j < n; ++j) m = x[j] > m ? x[j] : m;
  return m;
}

}  // namespace

void gelu_tanh_times(const float* gate, const float* up, int64_t n, float* out) {
  constexpr float k = 0.7978845608028654f;  // sqrt(2 / pi)
  for (int64_t j = 0; j < n; ++j) {
    const float x = gate[j];
    out[j] = 0.5f * x * (1.0f + tanh_of(k * (x + 0.044715f * x * x * x))) * up[j];
  }
}

// An infinite logit (from weights that are not finite) becomes NaN, which the checks after
// the softcap refuse, not the cap that tanh would make of it (cuda/kernels.cu's alike).
void softcap(float* x, int64_t n, float cap) {
  for (int64_t j = 0; j < n; ++j)
    x[j] = std::fabs(x[j]) == INFINITY ? std::numeric_limits<float>::quiet_NaN() : cap * tanh_of(x[j] / cap);
}

void softmax(float* x, int64_t n) {
  const float m = max_of(x, n);
  const float sum = sum_in_lanes(n, [&](int64_t j0, int64_t count, float* values) {
    for (int64_t j = j0; j < j0 + count; ++j) values[j - j0] = x[j] = exp_of(x[j] - m);
  });
  for (int64_t j = 0; j < n; ++j) x[j] /= sum;
}

float sum_squares(const float* x, int64_t n) {
  return sum_in_lanes(n, [&](int64_t j0, int64_t count, float* values) {
    for (int64_t j = j0; j < j0 + count; ++j) values[j - j0] = x[j] * x[j];
  });
}

float sum_exp(const float* x, int64_t n, float shift) {
  return sum_in_lanes(n, [&](int64_t j0, int64_t count, float* values) {
    for (int64_t j = j0; j < j0 + count; ++j) values[j - j0] = exp_of(x[j] - shift);
  });
}

float entropy(const float* x, int64_t n, float log_z) {
  constexpr float kLowest = -std::numeric_limits<float>::max();
  return -sum_in_lanes(n, [&](int64_t j0, int64_t count, float* values) {
    for (int64_t j = j0; j < j0 + count; ++j) {
      const float log_p = x[j] - log_z;
      values[j - j0] = (log_p < kLowest ? kLowest : log_p) * exp_of(log_p);
    }
  });
}

void dot_rows(const float* x, int64_t ldx, int64_t m, const float* w, int64_t ldw, int64_t n, int64_t k, float* y,
              int64_t ldy) {
  // A block of x's rows against every row of w while they are in cache, kDotCols rows of w
  // at a time; past w's last row a block repeats it, the results dropped (each result
  // comes from the same code whatever block it is in).
  in_row_blocks<kDotRows>(m, [&]<int R>(int64_t i0) {
    const float* xs[R];
    for (int i = 0; i < R; ++i) xs[i] = x + (i0 + i) * ldx;
    for (int64_t c0 = 0; c0 < n; c0 += kDotCols) {
      const float* ws[kDotCols];
      for (int c = 0; c < kDotCols; ++c) ws[c] = w + std::min(c0 + c, n - 1) * ldw;
      float out[R][kDotCols];
      dot_block(xs, ws, k, out);
      for (int i = 0; i < R; ++i)
        for (int c = 0; c < kDotCols && c0 + c < n; ++c) y[(i0 + i) * ldy + c0 + c] = out[i][c];
    }
  });
}

void add_rows_times(const float* x, int64_t ldx, int64_t m, const float* w, int64_t ldw, int64_t k, int64_t n,
                    float* y, int64_t ldy) {
  constexpr int64_t kBlockColumns = kTimesVectors * kWidth;
  in_row_blocks<kTimesRows>(m, [&]<int R>(int64_t i0) {
    const float* xs[R];
    float* ys[R];
    for (int i = 0; i < R; ++i) xs[i] = x + (i0 + i) * ldx, ys[i] = y + (i0 + i) * ldy;
    int64_t c = 0;
    for (; c + kBlockColumns <= n; c += kBlockColumns) times_block<R, Vector, kTimesVectors>(xs, w, ldw, k, ys, c);
    for (; c + kWidth <= n; c += kWidth) times_block<R, Vector, 1>(xs, w, ldw, k, ys, c);
    for (; c < n; ++c) times_block<R, float, 1>(xs, w, ldw, k, ys, c);
  });
}

}  // namespace diffuserve::cpu::DIFFUSERVE_CPU_ISA
