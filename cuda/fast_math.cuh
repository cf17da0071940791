// Arithmetic in fewer instructions than the compiler's own forms, for kernels bound by
// instruction issue (the sampler, attention's softmax): e^x and ln x without the care for
// subnormals, and division by one value many times over.
#pragma once

#include <cuda_runtime.h>

namespace diffuserve::cuda {

// e^x on the special function unit, as __expf, with results below the least normal float
// (x < -87.3) flushed to zero, where __expf scales them into the subnormals (three to five
// instructions more a value). The softmaxes that use it add such terms to a sum of at least
// 1 (the max's own term), which they cannot change; what they do change: a term that small
// comes out 0 in a softmax's output, and the entropy's sum of e (x - max), to which the max
// adds nothing, loses them, so a row whose every other value lies 87 or more below its max
// has entropy 0 where __expf gave about 1e-40.
__device__ __forceinline__ float exp_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x * 1.4426950408889634f));
  return y;
}

// ln x on the special function unit, as __logf, for normal x only: __logf's scaling of
// subnormal inputs (four instructions more) left out.
__device__ __forceinline__ float log_ftz(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y * 0.6931471805599453f;
}

// x / d correctly rounded (IEEE division, as the CPU divides) for many x over one d. The
// compiler's division refines d's reciprocal again for every quotient and checks both
// operands (FCHK) before it: a reciprocal on the special function unit, five fused
// multiply-adds, the check and a branch a quotient. Divisor refines the reciprocal once, by
// the same steps (the approximation, one Newton step), and each quotient then takes the
// same product and correction as that fast path, which is exact while the operands are far
// from the exponent range's ends. Four quotients share one check of their operands: where
// any is outside 2^-40..2^40 (zeros, infinities, NaNs, tiny or huge values) all four are
// divided by __fdiv_rn instead. Its exactness is that of the fast path's, which rests on the
// hardware's reciprocal approximation (with a reciprocal 1-2 ulp off, one correction is not
// always enough): benchmarks/sampler_bench.cu --check compares every float x against
// __fdiv_rn for a set of divisors, on the GPU at hand.
struct Divisor {
  float d, r;  // the divisor and its refined reciprocal
  bool fast;   // d itself in range: the fast path is open

  __device__ explicit Divisor(float divisor) : d(divisor), fast(in_range(divisor)) {
    float r0;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r0) : "f"(divisor));
    r = __fmaf_rn(r0, __fmaf_rn(r0, -divisor, 1.0f), r0);
  }

  // Operands whose quotients, their products with d and their corrections (about 2^-24 of
  // the quotient) are all normal numbers.
  __device__ static bool in_range(float v) { return fabsf(v) >= 0x1p-40f && fabsf(v) <= 0x1p40f; }

  // x[j] / d for each j, in place.
  __device__ __forceinline__ void divide(float (&x)[4]) const {
    float q[4];
    bool ok = fast;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float q0 = __fmul_rn(x[j], r);
      q[j] = __fmaf_rn(r, __fmaf_rn(q0, -d, x[j]), q0);
      ok &= in_range(x[j]);
    }
    if (ok) {
#pragma unroll
      for (int j = 0; j < 4; ++j) x[j] = q[j];
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j) x[j] = __fdiv_rn(x[j], d);
    }
  }
};

}  // namespace diffuserve::cuda
