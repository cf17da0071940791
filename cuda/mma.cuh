// The tensor-core building blocks the GEMM and the attention share: bf16 and fp16
// m16n8k16 MMAs with fp32 accumulation, E4M3 -> fp16 unpacking, and rounding fp32 pairs to
// bf16 or splitting them into bf16 hi/lo parts.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>

namespace diffuserve::cuda {

// c[16x8] += a[16x16] * b[16x8] (bf16 in, fp32 accumulate), register fragments as PTX lays them out.
__device__ __forceinline__ void mma_bf16(float* c, const uint32_t* a, const uint32_t* b) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// c[16x8] += a[16x16] * b[16x8] (fp16 in, fp32 accumulate), register fragments as PTX lays them out.
__device__ __forceinline__ void mma_f16(float* c, const uint32_t* a, const uint32_t* b) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Four E4M3 values (the first in the low byte) as two fp16 pairs, exactly (every E4M3
// value is an fp16 one): lo = values 0, 1 and hi = values 2, 3. One cvt per pair, reading
// its half of the register in place.
__device__ __forceinline__ void e4m3x4_to_f16(uint32_t codes, uint32_t& lo, uint32_t& hi) {
  asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.rn.f16x2.e4m3x2 %0, l;\n cvt.rn.f16x2.e4m3x2 %1, h;\n}\n"
      : "=r"(lo), "=r"(hi)
      : "r"(codes));
}

// Two floats rounded to a packed bf16 pair, x0 in the low half: one instruction.
__device__ __forceinline__ uint32_t round_bf16x2(float x0, float x1) {
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(x1), "f"(x0));  // x1 to the high half
  return r;
}

// The E4M3 codes of a / scale and b / scale (a in the low byte), by the hardware's
// conversion: round to nearest even, saturating at +-448, which is activation_quant.h's
// e4m3_code(quantize_e4m3(x, scale)) bit for bit (gemm_bench checks every code).
__device__ __forceinline__ uint32_t e4m3x2_codes(float a, float b, float scale) {
  return uint32_t(__nv_cvt_float2_to_fp8x2(make_float2(a / scale, b / scale), __NV_SATFINITE, __NV_E4M3));
}

// Two floats as packed bf16 hi parts and lo parts (x - hi), the lower column in the low half.
// The hi parts come back to fp32 by shifting their bits into place (a bf16 is the top half of
// an fp32): six instructions a pair.
__device__ __forceinline__ void split_bf16(float x0, float x1, uint32_t& hi, uint32_t& lo) {
  hi = round_bf16x2(x0, x1);
  const float hi0 = __uint_as_float(hi << 16), hi1 = __uint_as_float(hi & 0xffff0000u);
  lo = round_bf16x2(x0 - hi0, x1 - hi1);
}

}  // namespace diffuserve::cuda
