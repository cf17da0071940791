#include "diffuserve/dtype.h"

#include <cmath>
#include <cstring>
#include <iterator>
#include <limits>
#include <string>
#include <type_traits>

#include "diffuserve/errors.h"

namespace diffuserve {

namespace {

struct DTypeInfo {
  DType dtype;
  const char* name;
  size_t size;
};

// In enum order, so a DType indexes its own entry.
constexpr DTypeInfo kDTypes[] = {
    {DType::F32, "F32", 4},         {DType::F16, "F16", 2},         {DType::BF16, "BF16", 2},
    {DType::F64, "F64", 8},         {DType::I64, "I64", 8},         {DType::I32, "I32", 4},
    {DType::I16, "I16", 2},         {DType::I8, "I8", 1},           {DType::U8, "U8", 1},
    {DType::U16, "U16", 2},         {DType::U32, "U32", 4},         {DType::U64, "U64", 8},
    {DType::BOOL, "BOOL", 1},       {DType::F8_E4M3, "F8_E4M3", 1}, {DType::F8_E5M2, "F8_E5M2", 1},
};

constexpr bool table_matches_enum() {
  for (size_t i = 0; i < std::size(kDTypes); ++i) {
    if (size_t(kDTypes[i].dtype) != i) return false;
  }
  return true;
}
static_assert(table_matches_enum(), "kDTypes must list every DType in enum order");

const DTypeInfo& info(DType t) {
  auto i = size_t(t);
  // Only reachable through a cast of an out-of-range integer to DType.
  if (i >= std::size(kDTypes)) throw InvalidArgument("invalid DType value " + std::to_string(i));
  return kDTypes[i];
}

}  // namespace

size_t dtype_size(DType t) { return info(t).size; }

const char* dtype_name(DType t) { return info(t).name; }

bool dtype_from_name(const std::string& name, DType* out) {
  for (const DTypeInfo& d : kDTypes) {
    if (name == d.name) {
      *out = d.dtype;
      return true;
    }
  }
  return false;
}

float f16_to_f32(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exponent = (h >> 10) & 0x1fu;
  uint32_t mantissa = h & 0x3ffu;
  uint32_t bits;
  if (exponent == 0x1f) {
    bits = sign | 0x7f800000u | (mantissa << 13);  // inf, or NaN keeping its payload
  } else if (exponent == 0) {
    // Zero or subnormal: mantissa * 2^-24, exact in fp32.
    float magnitude = std::ldexp(float(mantissa), -24);
    return sign ? -magnitude : magnitude;
  } else {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);  // rebias 15 -> 127
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Round to nearest even, like a CUDA or torch cast.
uint16_t f32_to_f16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  auto sign = uint16_t((bits >> 16) & 0x8000u);
  uint32_t abs = bits & 0x7fffffffu;

  if (abs > 0x7f800000u) return uint16_t(sign | 0x7e00u | ((abs >> 13) & 0x3ffu));  // NaN stays NaN
  if (abs >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // >= 65520 rounds to inf
  if (abs >= 0x38800000u) {
    // Normal half (>= 2^-14): rebias the exponent, then round away the low 13 mantissa bits.
    // A carry out of the mantissa correctly bumps the exponent.
    uint32_t r = abs - (112u << 23);
    r += 0xfffu + ((r >> 13) & 1u);
    return uint16_t(sign | (r >> 13));
  }
  uint32_t exponent = abs >> 23;
  if (exponent < 102) return sign;  // below 2^-25: rounds to zero
  // Subnormal half: the value in units of 2^-24 is mantissa >> shift, rounded to even.
  // Rounding up to 0x400 gives the smallest normal, which is the right encoding.
  uint32_t mantissa = (abs & 0x7fffffu) | 0x800000u;
  uint32_t shift = 126 - exponent;  // 14..24
  uint32_t q = mantissa >> shift;
  uint32_t rem = mantissa & ((1u << shift) - 1);
  uint32_t half = 1u << (shift - 1);
  if (rem > half || (rem == half && (q & 1u))) ++q;
  return uint16_t(sign | q);
}

float fp8_e4m3_to_f32(uint8_t v) {
  const float sign = (v & 0x80) ? -1.0f : 1.0f;
  const int exponent = (v >> 3) & 0xf, mantissa = v & 0x7;
  if (exponent == 0xf && mantissa == 0x7) return std::numeric_limits<float>::quiet_NaN();
  if (exponent == 0) return sign * std::ldexp(float(mantissa) / 8.0f, -6);  // subnormal
  return sign * std::ldexp(1.0f + float(mantissa) / 8.0f, exponent - 7);
}

float fp4_e2m1_to_f32(uint8_t nibble) {
  static constexpr float kMagnitude[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  return (nibble & 0x8 ? -1.0f : 1.0f) * kMagnitude[nibble & 0x7];
}

namespace {

template <DType kType>
float load_float(const uint8_t* p) {
  if constexpr (kType == DType::F32) {
    float v;
    std::memcpy(&v, p, 4);
    return v;
  } else {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return kType == DType::BF16 ? bf16_to_f32(h) : f16_to_f32(h);
  }
}

template <DType kType>
void store_float(float v, uint8_t* p) {
  if constexpr (kType == DType::F32) {
    std::memcpy(p, &v, 4);
  } else {
    const uint16_t h = kType == DType::BF16 ? f32_to_bf16(v) : f32_to_f16(v);
    std::memcpy(p, &h, 2);
  }
}

// f(std::integral_constant<DType, t>{}) for t = `dtype`, one of the three float types.
template <class F>
void with_float_type(DType dtype, F f, const char* refusal) {
  switch (dtype) {
    case DType::F32: return f(std::integral_constant<DType, DType::F32>{});
    case DType::BF16: return f(std::integral_constant<DType, DType::BF16>{});
    case DType::F16: return f(std::integral_constant<DType, DType::F16>{});
    default: throw InvalidArgument(std::string(refusal) + dtype_name(dtype));
  }
}

}  // namespace

void convert_floats(const void* src, DType from, int64_t n, void* dst, DType to) {
  if (n < 0) throw InvalidArgument("convert_floats: n must be >= 0, got " + std::to_string(n));
  const auto* in = static_cast<const uint8_t*>(src);
  auto* out = static_cast<uint8_t*>(dst);
  with_float_type(from, [&](auto f) {
    with_float_type(to, [&](auto t) {
      constexpr DType kFrom = decltype(f)::value, kTo = decltype(t)::value;
      const size_t in_size = dtype_size(kFrom), out_size = dtype_size(kTo);
      for (int64_t i = 0; i < n; ++i) store_float<kTo>(load_float<kFrom>(in + i * in_size), out + i * out_size);
    }, "cannot store weights as ");
  }, "expected F32, BF16 or F16 values, got ");
}

std::vector<float> read_floats(const void* src, DType dtype, int64_t n) {
  if (n < 0) throw InvalidArgument("read_floats: n must be >= 0, got " + std::to_string(n));
  std::vector<float> out(n);
  convert_floats(src, dtype, n, out.data(), DType::F32);
  return out;
}

std::vector<uint8_t> store_floats(const std::vector<float>& values, DType to) {
  std::vector<uint8_t> out(values.size() * dtype_size(to));
  convert_floats(values.data(), DType::F32, int64_t(values.size()), out.data(), to);
  return out;
}

void refuse_rounding_to(DType t) {
  throw InvalidArgument(std::string("round_to_dtype: ") + dtype_name(t) + " is not a floating-point weight dtype");
}

}  // namespace diffuserve
