// Packed weights (cpp/src/packed_weight.h) to bf16 inside the GEMM, 4 values at a time into
// an MMA fragment's registers, exactly: the bf16 values equal the packed ones (NVFP4: times
// a power of two), so that with the per-row fp32 scale applied after the K sum the product
// is the dequantized weight's to fp32 rounding.
//   FP8: every E4M3 value is an fp16 normal and a bf16 value, so e4m3 -> f16 (one cvt per
//        pair on sm_89+) -> bf16 is exact.
//   NVFP4: e2m1 * e4m3 group scale has at most 2 + 4 significant bits and lies in
//        [2^-10, 2688] (0.5 * 2^-9 up to 6 * 448), so its bf16 product (8 bits, fp32's
//        exponent range) is exact; the global scale stays out, divided by per row at the end.
// NVFP4 is decoded from a layout of its own (the "GEMM layout", below), which the CUDA backend
// writes at upload (lay_out_nvfp4): the decode is the GEMM's main cost at batch 1, where each
// weight value meets a few rows of X, so the layout is what makes it short. Everything here is
// written for the host too, where the bench checks it against dtype.h's values.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "philox.h"  // DS_HOST_DEVICE

namespace diffuserve::cuda {

// NVFP4's GEMM layout, one 32-bit word of 8 consecutive K values (its group's half) at a
// time. Each bf16 pair of the decode is the word's bits where a bf16 keeps them: an E2M1
// value's sign, exponent (2 bits) and mantissa (1 bit) as a bf16's sign, lowest exponent bits
// and highest mantissa bit. That bf16 is the value times 2^-126 (the E2M1 exponent bias is 1,
// bf16's 127; E2M1's subnormal 0.5 lands on bf16's subnormal 2^-127). Pair j (values 2j and
// 2j + 1, the lower in the low half) is the word rotated right by nvfp4_rotation(j) under the
// mask kNvfp4Bits: pairs 0-2 in one rotation each, pair 3 in two pieces (its exponents' high
// bits under kNvfp4Piece, rotated by kNvfp4PieceRotation), as four bit sets of this shape
// cannot tile 32 bits. So a pair costs a rotation and a mask, not table look-ups.
constexpr uint32_t kNvfp4Bits = 0x81c081c0;  // per half: sign (15), exponent (8, 7), mantissa (6)
DS_HOST_DEVICE constexpr int nvfp4_rotation(int pair) { return pair == 3 ? 26 : 6 * pair; }
constexpr uint32_t kNvfp4Piece = 0x01000100;  // pair 3's high exponent bits
constexpr int kNvfp4PieceRotation = 2;
// Bit b (0 mantissa, 1-2 exponent, 3 sign: E2M1's nibble order) of a bf16 half's value.
DS_HOST_DEVICE constexpr int bf16_bit(int b) { return b == 3 ? 15 : 6 + b; }

DS_HOST_DEVICE inline uint32_t rotate_right(uint32_t x, int n) {
#ifdef __CUDA_ARCH__
  return __funnelshift_r(x, x, n);
#else
  return n ? x >> n | x << (32 - n) : x;
#endif
}

// Where bit b of value i (0-7) of a word is in the GEMM layout: where pair i / 2's rotation
// takes it from to its bf16 bit (pair 3's high exponent bit: its piece's rotation).
DS_HOST_DEVICE inline int nvfp4_layout_bit(int i, int b) {
  const int bit = bf16_bit(b) + 16 * (i % 2);
  const int rotation = i / 2 == 3 && b == 2 ? kNvfp4PieceRotation : nvfp4_rotation(i / 2);
  return (bit + rotation) % 32;
}

// A group's E4M3 scale in the GEMM layout: one byte, which nvfp4_scale_pair makes into the
// scale times 2^118 as a bf16 pair with a single multiply-add (the decoded values are 2^-126
// times theirs, so the products are value x scale x 2^-8, all bf16 normals; the GEMM
// multiplies its sums by kNvfp4Unscale). Scales are 2^-9 .. 448 with 4 significant bits
// at most, so the byte is a bf16's 3 high mantissa bits under 5 bits of exponent, 2^-9 as 0.
// A zero scale, a negative one and a NaN are not encoded here: nvfp4_gemm_group handles the
// first two, and loading refuses NaN.
constexpr float kNvfp4Unscale = 256.0f;
constexpr uint32_t kNvfp4ScaleBias = 236;  // the bf16 exponent field of 2^-9 x 2^118
DS_HOST_DEVICE inline uint8_t nvfp4_gemm_scale(uint8_t code) {
  int exponent = code >> 3 & 0xf, mantissa = code & 7;  // E4M3: value 2^(exponent - 7) x 1.mantissa
  if (!exponent && !mantissa) return 0;
  if (!exponent) {  // subnormal: mantissa x 2^-9, normalised
    exponent = 1;
    while (mantissa < 8) mantissa <<= 1, --exponent;
    mantissa &= 7;
  }
  return uint8_t((exponent + 2) << 3 | mantissa);  // 2^-9 -> exponent -2 -> 0
}

// A group's 16 values (two words: nibble i of words[w] is value 8 w + i, as stored) and its
// E4M3 scale code, into the GEMM layout. A negative scale's sign moves to the values, and a
// zero scale zeroes them (nvfp4_gemm_scale encodes neither).
DS_HOST_DEVICE inline void nvfp4_gemm_group(uint32_t (&words)[2], uint8_t& scale) {
  for (uint32_t& word : words) {
    if (scale & 0x80) word ^= 0x88888888u;
    if (!(scale & 0x7f)) word = 0;
    uint32_t laid_out = 0;
    for (int i = 0; i < 8; ++i)
      for (int b = 0; b < 4; ++b) laid_out |= (word >> (4 * i + b) & 1u) << nvfp4_layout_bit(i, b);
    word = laid_out;
  }
  scale = nvfp4_gemm_scale(scale & 0x7f);
}

// Pairs 2 half and 2 half + 1 of a GEMM-layout word as bf16 bits (values 2^-126 times the
// E2M1 ones): first = values 4 half, 4 half + 1, second = the next two.
DS_HOST_DEVICE inline void e2m1_pairs(uint32_t word, int half, uint32_t& first, uint32_t& second) {
  if (half == 0) {
    first = word & kNvfp4Bits;
    second = rotate_right(word, nvfp4_rotation(1)) & kNvfp4Bits;
  } else {
    first = rotate_right(word, nvfp4_rotation(2)) & kNvfp4Bits;
    second = (rotate_right(word, nvfp4_rotation(3)) & kNvfp4Bits & ~kNvfp4Piece) |
             (rotate_right(word, kNvfp4PieceRotation) & kNvfp4Piece);
  }
}

// A GEMM-layout scale byte as the scale x 2^118, a bf16 pair (both halves).
DS_HOST_DEVICE inline uint32_t nvfp4_scale_pair(uint8_t gemm_scale) {
  return uint32_t(gemm_scale) * 0x00100010u + (kNvfp4ScaleBias << 7) * 0x00010001u;
}

#ifdef __CUDACC__
// Two E4M3 codes (the lower value in the low byte) as a bf16 pair.
__device__ __forceinline__ uint32_t e4m3x2_to_bf16x2(uint16_t codes) {
  const __half2 h(__nv_cvt_fp8x2_to_halfraw2(codes, __NV_E4M3));
  const float2 f = __half22float2(h);
  const __nv_bfloat162 b = __floats2bfloat162_rn(f.x, f.y);
  return *reinterpret_cast<const uint32_t*>(&b);
}

// Four E4M3 codes (K order, the first in the low byte) as bf16 pairs: first = values 0, 1
// and second = values 2, 3.
__device__ __forceinline__ void fp8x4_to_bf16(uint32_t codes, uint32_t& first, uint32_t& second) {
  first = e4m3x2_to_bf16x2(uint16_t(codes));
  second = e4m3x2_to_bf16x2(uint16_t(codes >> 16));
}

// Four values of a GEMM-layout word (values 4 half .. 4 half + 3) times their group's scale
// pair (nvfp4_scale_pair), as bf16 pairs: first = values 4 half, 4 half + 1, second = the
// next two; each the value x scale x 2^-8, exactly (see above).
__device__ __forceinline__ void nvfp4x4_to_bf16(uint32_t word, int half, uint32_t scale_pair, uint32_t& first,
                                                uint32_t& second) {
  e2m1_pairs(word, half, first, second);
  const __nv_bfloat162 scale = *reinterpret_cast<const __nv_bfloat162*>(&scale_pair);
  const __nv_bfloat162 a = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&first), scale);
  const __nv_bfloat162 b = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&second), scale);
  first = *reinterpret_cast<const uint32_t*>(&a);
  second = *reinterpret_cast<const uint32_t*>(&b);
}
#endif

}  // namespace diffuserve::cuda
