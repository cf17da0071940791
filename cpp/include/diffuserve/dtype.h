// Element types of stored tensors, and conversion of the float ones to fp32.
#pragma once

#include "diffuserve/abi.h"

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace diffuserve {

enum class DType { F32, F16, BF16, F64, I64, I32, I16, I8, U8, U16, U32, U64, BOOL, F8_E4M3, F8_E5M2 };

size_t dtype_size(DType t);
const char* dtype_name(DType t);  // the safetensors spelling: "F32", "BF16", ...
// The float types weights are stored (and widened from) as they are: F32, BF16, F16.
inline bool is_float(DType t) { return t == DType::F32 || t == DType::BF16 || t == DType::F16; }
// Parses a safetensors dtype string; returns false when it is not one we know.
bool dtype_from_name(const std::string& name, DType* out);

inline float bf16_to_f32(uint16_t h) {
  uint32_t bits = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Round to nearest even, as torch does when casting fp32 to bf16.
inline uint16_t f32_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return uint16_t((bits >> 16) | 0x40);  // NaN stays NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return uint16_t(bits >> 16);
}

float f16_to_f32(uint16_t h);
uint16_t f32_to_f16(float f);

// FP8 E4M3 (the "fn" variant: no infinities, 0x7f/0xff are NaN) and FP4 E2M1 (a 4-bit
// nibble: sign, 2 exponent bits, 1 mantissa bit) to fp32.
float fp8_e4m3_to_f32(uint8_t v);
float fp4_e2m1_to_f32(uint8_t nibble);
// Whether an E4M3 code is a number (0x7f and 0xff are its NaNs).
inline bool fp8_is_number(uint8_t code) { return (code & 0x7f) != 0x7f; }

// n F32, BF16 or F16 values at `src` written at `dst` as F32, BF16 or F16 (rounded to nearest
// even); neither need be aligned. A negative n, or another dtype, is an InvalidArgument.
void convert_floats(const void* src, DType from, int64_t n, void* dst, DType to);
// n F32, BF16 or F16 values from `src` (which need not be aligned) as fp32.
std::vector<float> read_floats(const void* src, DType dtype, int64_t n);
// fp32 values as the bytes of F32, BF16 or F16 (rounded to nearest even).
std::vector<uint8_t> store_floats(const std::vector<float>& values, DType to);

// Rounds an fp32 value through `t` and back (identity for F32): what a cast to the weight
// dtype does to a value in the reference implementation. Inline, so that the loops rounding
// every input of a product or an attention take a few instructions a value (a call each had
// been half of a CPU step with bf16 activations).
[[noreturn]] void refuse_rounding_to(DType t);
inline float round_to_dtype(float x, DType t) {
  switch (t) {
    case DType::F32:
      return x;
    case DType::BF16:
      return bf16_to_f32(f32_to_bf16(x));
    case DType::F16:
      return f16_to_f32(f32_to_f16(x));
    default:
      refuse_rounding_to(t);
  }
}

}  // namespace diffuserve
