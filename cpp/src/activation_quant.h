// The arithmetic of activation quantization (config.h's ActivationScheme) as
// compressed-tensors computes it (quantization/lifecycle/forward.py, utils/helpers.py): a
// scale from the values' absolute maximum, then each value divided by it, clamped, rounded
// to the narrow type and multiplied back. The same fp32 operations in the same order as
// the library's torch code, so that the values come out bit for bit as its fake
// quantization gives them; written once for the CPU backend and the CUDA kernels.
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "philox.h"  // DS_HOST_DEVICE

namespace diffuserve {

constexpr int kNvfp4Group = 16;  // NVFP4 activation values per scale, along K

// The nearest E4M3 value to x (|x| <= 448), ties to even, as a cast to float8_e4m3fn.
DS_HOST_DEVICE inline float round_e4m3(float x) {
  int exponent;
  frexpf(x, &exponent);  // |x| = m * 2^exponent, m in [0.5, 1)
  // 3 mantissa bits: values in [2^e, 2^(e+1)) are 2^(e-3) apart; below 2^-6 (subnormals)
  // the spacing stays 2^-9.
  const float step = ldexpf(1.0f, (exponent - 1 > -6 ? exponent - 1 : -6) - 3);
  return rintf(x / step) * step;
}

// compressed-tensors' E2M1 rounding of x (|x| <= 6): fixed thresholds, the ties going to
// the value with the even mantissa.
DS_HOST_DEVICE inline float round_e2m1(float x) {
  const float a = fabsf(x);
  const float r = a <= 0.25f  ? 0.0f
                  : a < 0.75f ? 0.5f
                  : a <= 1.25f ? 1.0f
                  : a < 1.75f ? 1.5f
                  : a <= 2.5f ? 2.0f
                  : a < 3.5f  ? 3.0f
                  : a <= 5.0f ? 4.0f
                              : 6.0f;
  return copysignf(r, x);
}

// FP8 per token: the row's scale, amax / 448; an all-zero row gets the fp32 eps instead
// (the library keeps the division defined).
DS_HOST_DEVICE inline float fp8_token_scale(float amax) {
  const float scale = amax / 448.0f;
  return scale == 0.0f ? FLT_EPSILON : scale;
}

#ifdef __CUDACC__
// The FP8 token scale of a row of `cols` values, by one warp (every lane gets it).
__device__ inline float warp_fp8_token_scale(const float* row, int64_t cols) {
  const int lane = threadIdx.x & 31;
  float amax = 0.0f;
  for (int64_t j = lane; j < cols; j += 32) amax = fmaxf(amax, fabsf(row[j]));
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  return fp8_token_scale(amax);
}
#endif

// NVFP4: the scale a group of 16 values is divided by: amax / 6 under the linear's global
// scale, rounded to E4M3 (an all-zero group gets E4M3's eps, 0.125), over the global scale.
DS_HOST_DEVICE inline float nvfp4_group_scale(float amax, float global_scale) {
  float scale = round_e4m3(fminf(global_scale * (amax / 6.0f), 448.0f));
  if (scale == 0.0f) scale = 0.125f;
  return scale / global_scale;
}

// x quantized with `scale` to E4M3: the E4M3 value (what an FP8 kernel multiplies).
DS_HOST_DEVICE inline float quantize_e4m3(float x, float scale) {
  return round_e4m3(fminf(fmaxf(x / scale, -448.0f), 448.0f));
}

// The float8_e4m3fn byte of v, an E4M3 value (as quantize_e4m3 returns): sign, 4 exponent
// bits (bias 7), 3 mantissa bits; below 2^-6 the subnormals, multiples of 2^-9.
DS_HOST_DEVICE inline uint8_t e4m3_code(float v) {
  uint32_t bits;
  memcpy(&bits, &v, 4);
  const uint32_t sign = (bits >> 24) & 0x80;
  const float a = fabsf(v);
  if (a < 0.015625f) return uint8_t(sign | uint32_t(a * 512.0f));
  const uint32_t exponent = ((bits >> 23) & 0xff) - 127 + 7, mantissa = (bits >> 20) & 7;
  return uint8_t(sign | exponent << 3 | mantissa);
}

// x quantized with `scale` to E4M3 or to E2M1, and dequantized.
DS_HOST_DEVICE inline float fake_quantize_e4m3(float x, float scale) { return quantize_e4m3(x, scale) * scale; }
DS_HOST_DEVICE inline float fake_quantize_e2m1(float x, float scale) {
  return round_e2m1(fminf(fmaxf(x / scale, -6.0f), 6.0f)) * scale;
}

// One NVFP4 group of kNvfp4Group values, in place, under the linear's global scale.
DS_HOST_DEVICE inline void fake_quantize_nvfp4_group(float* v, float global_scale) {
  float amax = 0.0f;
  for (int j = 0; j < kNvfp4Group; ++j) amax = fmaxf(amax, fabsf(v[j]));
  const float scale = nvfp4_group_scale(amax, global_scale);
  for (int j = 0; j < kNvfp4Group; ++j) v[j] = fake_quantize_e2m1(v[j], scale);
}

}  // namespace diffuserve
