// Packed weights (cpp/src/packed_weight.h) to bf16 inside the GEMM, 4 values at a time into
// an MMA fragment's registers, exactly: the bf16 values equal the packed ones, so that with
// the per-row fp32 scale applied after the K sum the product is the dequantized weight's to
// fp32 rounding.
//   FP8: every E4M3 value is an fp16 normal and a bf16 value, so e4m3 -> f16 (one cvt per
//        pair on sm_89+) -> bf16 is exact.
//   NVFP4: e2m1 * e4m3 group scale has at most 2 + 4 significant bits and lies in
//        [2^-10, 2688] (0.5 * 2^-9 up to 6 * 448), so its bf16 product (8 bits, fp32's
//        exponent range) is exact; the global scale stays out, divided by per row at the end.
// The e2m1 decode picks bf16 bytes from constant tables with prmt (byte permute); it is
// written for the host too, where the bench checks it against dtype.h's fp4_e2m1_to_f32.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "philox.h"  // DS_HOST_DEVICE

namespace diffuserve::cuda {

// PTX prmt.b32 (default mode): byte i of the result is byte (s & 7) of {b, a} (a is bytes
// 0-3), or, where bit 3 of selector nibble i is set, that byte's sign bit replicated.
DS_HOST_DEVICE inline uint32_t byte_perm(uint32_t a, uint32_t b, uint32_t selector) {
#ifdef __CUDA_ARCH__
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(selector));
  return d;
#else
  const uint64_t bytes = uint64_t(b) << 32 | a;
  uint32_t d = 0;
  for (int i = 0; i < 4; ++i) {
    const uint32_t s = (selector >> (4 * i)) & 0xf;
    uint32_t v = uint32_t(bytes >> (8 * (s & 7))) & 0xff;
    if (s & 8) v = v & 0x80 ? 0xff : 0;
    d |= v << (8 * i);
  }
  return d;
#endif
}

// Four E2M1 values (nibble i of `nibbles` is value i) as bf16 pairs: first = values 0, 1
// and second = values 2, 3, the lower value in the low half.
DS_HOST_DEVICE inline void e2m1x4_to_bf16(uint32_t nibbles, uint32_t& first, uint32_t& second) {
  // The bf16 bytes of the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 (0x0000, 0x3f00, 0x3f80,
  // 0x3fc0, 0x4000, 0x4040, 0x4080, 0x40c0), low bytes and high bytes, magnitude 0 first.
  constexpr uint32_t kLow0 = 0xc0800000, kLow1 = 0xc0804000, kHigh0 = 0x3f3f3f00, kHigh1 = 0x40404040;
  const uint32_t magnitudes = nibbles & 0x7777;  // selector nibbles without bit 3 (no sign mode)
  const uint32_t low = byte_perm(kLow0, kLow1, magnitudes);
  uint32_t high = byte_perm(kHigh0, kHigh1, magnitudes);
  // Each value's sign bit (nibble bit 3) as the top bit of a byte: values 1 and 3 have it at
  // bit 7 of bytes 0 and 1 of `nibbles`, values 0 and 2 at bit 7 of bytes 0 and 1 of
  // nibbles << 4; sign mode replicates it into 0xff or 0x00, one byte per value.
  const uint32_t negative = byte_perm(nibbles, nibbles << 4, 0x9d8c);
  high |= negative & 0x80808080;
  first = byte_perm(low, high, 0x5140);  // low 0, high 0, low 1, high 1
  second = byte_perm(low, high, 0x7362);
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

// An NVFP4 group's E4M3 scale as a bf16 pair (both halves the scale), for nvfp4x4_to_bf16.
__device__ __forceinline__ uint32_t nvfp4_scale_pair(uint8_t scale_code) {
  return e4m3x2_to_bf16x2(uint16_t(scale_code) * 0x0101);
}

// Four E2M1 values of one NVFP4 group (nibble i of `nibbles` is value i) times the group's
// scale (nvfp4_scale_pair), as bf16 pairs: first = values 0, 1, second = values 2, 3
// (exact, see above).
__device__ __forceinline__ void nvfp4x4_to_bf16(uint32_t nibbles, uint32_t scale_pair, uint32_t& first,
                                                uint32_t& second) {
  e2m1x4_to_bf16(nibbles, first, second);
  const __nv_bfloat162 scale = *reinterpret_cast<const __nv_bfloat162*>(&scale_pair);
  const __nv_bfloat162 a = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&first), scale);
  const __nv_bfloat162 b = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&second), scale);
  first = *reinterpret_cast<const uint32_t*>(&a);
  second = *reinterpret_cast<const uint32_t*>(&b);
}
#endif

}  // namespace diffuserve::cuda
