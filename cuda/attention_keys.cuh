// What the two tensor-core attention kernels (attention_mma.cu on mma.sync, attention_wgmma.cu
// on Hopper's wgmma) share: walking a block's piece of a segment's keys across the KV cache's
// spans, keys' positions relative to the segment, and the softmax's exponential.
#pragma once

#include <climits>
#include <cstdint>

#include "kernels.h"

namespace diffuserve::cuda {

// e^x on the special function unit, results below 2^-126 flushed to zero (__expf's care
// for them costs three instructions, for weights no sum would notice).
__device__ __forceinline__ float exp_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x * 1.4426950408889634f));
  return y;
}

// A place in a segment's keys: key `key` of span `span`.
struct Cursor {
  int span;
  int key;
};

// The keys of a block's piece that its queries (positions first..last) may see, one after
// the other across the spans.
struct KeyWalk {
  const DeviceKeySpan* spans;
  int last_span, last_end;  // the piece ends after key last_end - 1 of span last_span
  bool causal;
  int64_t window, first, last;

  // Of span `span`, keys [lo, hi) may be visible: those of the piece within the union of
  // the queries' causal windows.
  __device__ void range(int span, int64_t& lo, int64_t& hi) const {
    const DeviceKeySpan& s = spans[span];
    lo = 0, hi = span == last_span ? last_end : s.count;
    if (!causal) return;
    if (last + 1 - s.first_position < hi) hi = last + 1 - s.first_position;
    if (window > 0 && first - window + 1 - s.first_position > lo) lo = first - window + 1 - s.first_position;
  }
  // The cursor n visible keys further on; n = 0 moves a cursor onto the next visible key.
  // Past the piece: span last_span + 1.
  __device__ Cursor advance(Cursor c, int n) const {
    for (; c.span <= last_span; ++c.span, c.key = 0) {
      int64_t lo, hi;
      range(c.span, lo, hi);
      if (c.key < lo) c.key = int(lo);
      if (c.key + n < hi) return {c.span, c.key + n};
      if (hi > c.key) n -= int(hi - c.key);
    }
    return {last_span + 1, 0};
  }
  __device__ bool has(Cursor c) const { return c.span <= last_span; }
};

// A key's position relative to the segment's first query, clamped into int (where a key
// that far away is seen or not as at the clamp); kNoKey, below every bound, for no key.
constexpr int kNoKey = INT_MIN;
__device__ __forceinline__ int relative_position(int64_t position, int64_t origin) {
  const int64_t r = position - origin;
  return r < int64_t(INT_MIN) + 1 ? INT_MIN + 1 : r > INT_MAX ? INT_MAX : int(r);
}

}  // namespace diffuserve::cuda
