// Eight consecutive floats of a row into registers, as the row-wise pre-passes and the
// router read them.
#pragma once

#include <cstdint>

namespace diffuserve::cuda {

// Values k .. k + 7 of a row of n: two float4s (kWhole: all inside, 16-byte aligned), or
// one at a time, zero past n.
template <bool kWhole>
__device__ __forceinline__ void load8(const float* row, int64_t k, int64_t n, float (&v)[8]) {
  if constexpr (kWhole) {
    const float4 a = *reinterpret_cast<const float4*>(row + k), b = *reinterpret_cast<const float4*>(row + k + 4);
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = k + j < n ? row[k + j] : 0.0f;
  }
}

}  // namespace diffuserve::cuda
