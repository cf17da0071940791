// What the two tensor-core attention kernels (attention_mma.cu on mma.sync, attention_wgmma.cu
// on Hopper's wgmma) share: a block's query vectors (where they are, which keys they see),
// walking its piece of a segment's keys across the KV cache's spans, keys' positions
// relative to the segment, the online softmax's steps, and the output's stores (the merge
// kernel's too).
#pragma once

#include <climits>
#include <cmath>
#include <cstdint>

#include "cp_async.cuh"  // their staging
#include "fast_math.cuh"
#include "kernels.h"
#include "mma.cuh"

namespace diffuserve::cuda {

// A place in a segment's keys: key `key` of span `span`.
struct Cursor {
  int span;
  int key;
};

// The keys of a block's piece that its queries (positions first..last) may see, one after
// the other across the spans, and where its chunks of keys lie (AttentionItem::grid).
struct KeyWalk {
  const DeviceKeySpan* spans;
  int last_span, last_end;  // the piece ends after key last_end - 1 of span last_span
  bool causal;
  int64_t window, first, last;
  int grid;

  // The slots of a chunk of kKeys before its first key, at `position`, where that is the
  // walk's first key: its place on the grid (none off it). The chunks after follow on the
  // grid where the keys are contiguous in position (a causal segment's are), so a row's keys
  // meet the same chunks and slots whichever key its group's walk starts from.
  template <int kKeys>
  __host__ __device__ int first_slot(int64_t position) const {
    static_assert(kGridKeys % kKeys == 0, "chunks on the grid");
    return grid < 0 ? 0 : int((position % kGridKeys - grid + kGridKeys) % kKeys);
  }
  __device__ int64_t position(Cursor c) const { return spans[c.span].first_position + c.key; }

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

  // A thread's slot of the walk's chunks of kKeys (it stages that slot of every chunk): the
  // key there, and whether there is none yet (`held`: the slot lies before the walk's first
  // key, which sits first_slot() slots into the first chunk; `at` is then the second
  // chunk's key).
  struct Slot {
    Cursor at;
    bool held;
  };
  // Slot s of the first chunk of the piece that starts at `start`.
  template <int kKeys>
  __device__ Slot slot(Cursor start, int s) const {
    start = advance(start, 0);
    const int skip = has(start) ? first_slot<kKeys>(position(start)) : 0;
    const bool held = s < skip;
    return {advance(start, s - skip + (held ? kKeys : 0)), held};
  }
  // The same slot of the next chunk.
  template <int kKeys>
  __device__ void next(Slot& slot) const {
    if (slot.held) slot.held = false;
    else slot.at = advance(slot.at, kKeys);
  }
  __device__ bool holds(const Slot& slot) const { return !slot.held && has(slot.at); }

  // The next chunk of kKeys slots from cursor c on: its visible keys, found by kKeys / 32
  // warps together (every lane calls it with the same c, `warp` its warp's place among
  // them). The chunk's keys fill its slots in order, from slot 0, or for the walk's first
  // chunk (`first_chunk`) from first_slot(); found(i, span, key) is called for slot i's key
  // (key `key` of span `span`) by lane i % 32 of warp i / 32, where slot i has one (the
  // caller marks the others empty). Returns how many keys the chunk has and moves c past
  // them. The lanes read 32 spans at once and add up their visible keys (every warp alike,
  // and each works out the same c), so that a chunk's keys cost one round trip to the span
  // table, where advance() walks it a span after the other (pages of 16 keys: a round trip
  // for every 16 keys).
  template <int kKeys, class Found>
  __device__ int gather(Cursor& c, int warp, int lane, bool first_chunk, Found&& found) const {
    static_assert(kKeys % 32 == 0, "whole warps");
    constexpr unsigned kAll = 0xffffffffu;
    int filled = first_chunk ? -1 : 0, skipped = 0;  // slots taken; -1: the first key's slot not yet known
    while (filled < kKeys && c.span <= last_span) {
      const int span = c.span + lane;
      int64_t lo = 0, hi = 0;
      if (span <= last_span) range(span, lo, hi);
      if (lane == 0 && c.key > lo) lo = c.key;
      // This lane's visible keys (no more than a chunk takes) and the sum up to its own.
      const int count = int(hi > lo ? (hi - lo < kKeys ? hi - lo : kKeys) : 0);
      int upto = count;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int v = __shfl_up_sync(kAll, upto, o);
        if (lane >= o) upto += v;
      }
      const int total = __shfl_sync(kAll, upto, 31);
      if (filled < 0 && total > 0) {  // the walk's first key, in the first lane with a visible key
        const int holder = __ffs(__ballot_sync(kAll, count > 0)) - 1;
        filled = skipped = first_slot<kKeys>(spans[c.span + holder].first_position + __shfl_sync(kAll, int(lo), holder));
      }
      if (filled < 0) {  // none in these 32 spans
        c = {c.span + 32, 0};
        continue;
      }
      // The warp's 32 keys of the chunk (one pass; a single warp's start is known at compile
      // time, which made the full layers' kernel faster on the H200).
#pragma unroll
      for (int base = kKeys > 32 ? 32 * warp : 0; base < kKeys; base += kKeys) {
        const int wanted = base + lane - filled;  // this lane's key, counted in this round
        // The lane whose span holds it: the first whose running sum passes it.
        int holder = 0;
#pragma unroll
        for (int step = 16; step > 0; step >>= 1)
          if (__shfl_sync(kAll, upto, holder + step - 1) <= wanted) holder += step;
        const int before = __shfl_sync(kAll, upto - count, holder), first = __shfl_sync(kAll, int(lo), holder);
        if (wanted >= 0 && wanted < total && base + lane < kKeys)
          found(base + lane, c.span + holder, first + wanted - before);
      }
      if (filled + total >= kKeys) {  // the chunk ends in this round's spans
        const int holder = __ffs(__ballot_sync(kAll, filled + upto >= kKeys)) - 1;
        const int before = __shfl_sync(kAll, upto - count, holder), first = __shfl_sync(kAll, int(lo), holder);
        c = {c.span + holder, first + kKeys - filled - before};
        return kKeys - skipped;
      }
      filled += total;
      c = {c.span + 32, 0};
    }
    return filled > skipped ? filled - skipped : 0;
  }
};

// An item's piece of its segment's keys, as its rows may see them.
__device__ __forceinline__ KeyWalk item_keys(const DeviceKeySpan* spans, const DeviceAttentionSegment& seg,
                                             const AttentionItem& item) {
  const int64_t first = seg.first_position + item.row0;
  return {spans, item.last_span, item.last_end, seg.causal != 0, seg.window, first, first + item.rows - 1, item.grid};
}

// Output values `at` .. at + kCount - 1 (an offset into the output's rows; kCount 2 or 4, `at`
// a multiple of it), and their bf16 copies where the output has them.
template <int kCount>
__device__ __forceinline__ void store_output(const AttentionOutput& out, int64_t at, const float (&v)[kCount]) {
  static_assert(kCount == 2 || kCount == 4, "float2 or float4 stores");
  if constexpr (kCount == 2) {
    *reinterpret_cast<float2*>(out.values + at) = {v[0], v[1]};
    if (out.bf16) *reinterpret_cast<uint32_t*>(out.bf16 + at) = round_bf16x2(v[0], v[1]);
  } else {
    *reinterpret_cast<float4*>(out.values + at) = {v[0], v[1], v[2], v[3]};
    if (out.bf16) *reinterpret_cast<uint2*>(out.bf16 + at) = {round_bf16x2(v[0], v[1]), round_bf16x2(v[2], v[3])};
  }
}

// A key's position relative to the segment's first query, clamped into int (where a key
// that far away is seen or not as at the clamp); kNoKey, below every bound, for no key.
constexpr int kNoKey = INT_MIN;
__device__ __forceinline__ int relative_position(int64_t position, int64_t origin) {
  const int64_t r = position - origin;
  return r < int64_t(INT_MIN) + 1 ? INT_MIN + 1 : r > INT_MAX ? INT_MAX : int(r);
}

// The keys a query vector sees, by relative_position: [lo, hi] (none for a padding vector).
struct VisibleKeys {
  int lo = 1, hi = 0;
  __device__ bool sees(int position) const { return position >= lo && position <= hi; }
};

// A block's query vectors: an item's rows x the query heads of its KV head, vector j being
// row j / group of the item, head kv_head * group + j % group; j < count exist.
struct ItemQueries {
  DeviceAttentionSegment seg;
  AttentionItem item;
  int group;      // query heads per KV head
  int num_heads;  // query heads a row (Q and the output: num_heads * head_dim floats a row)
  int head_dim;
  int count;
  __device__ ItemQueries(const DeviceAttentionSegment& s, const AttentionItem& i, int heads, int kv_heads, int dim)
      : seg(s), item(i), group(heads / kv_heads), num_heads(heads), head_dim(dim), count(i.rows * group) {}

  // Where vector j is in Q (and in the output).
  __device__ int64_t offset(int j) const {
    return (seg.first_row + item.row0 + j / group) * int64_t(num_heads) * head_dim +
           int64_t(item.kv_head * group + j % group) * head_dim;
  }
  // Vector j's output goes to the output (at offset(j)) when the item's piece is all its rows
  // see (item.slot < 0), else to its row of the item's partial slot (queries_per_slot rows),
  // for the merge: there.
  __device__ float* partial(float* partial_out, int queries_per_slot, int j) const {
    return partial_out + (int64_t(item.slot) * queries_per_slot + j) * head_dim;
  }
  __device__ KeyWalk keys(const DeviceKeySpan* spans) const { return item_keys(spans, seg, item); }
  __device__ VisibleKeys visible(int j) const {
    VisibleKeys v;
    if (j < count) {
      const int64_t p = item.row0 + j / group;
      v.hi = seg.causal ? int(p) : INT_MAX;
      v.lo = seg.causal && seg.window > 0 ? relative_position(p - seg.window + 1, 0) : INT_MIN + 1;
    }
    return v;
  }
};

// The larger of a and b, NaN where either is NaN (fmaxf keeps the other): the row maxima use
// it, so that a NaN score (a NaN weight upstream) makes its row's output NaN, as the
// reference's softmax does, for the model's check of the logits to refuse, rather than a row
// of zeros where every score is NaN.
__device__ __forceinline__ float max_nan(float a, float b) {
#if __CUDA_ARCH__ >= 800
  float m;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(m) : "f"(a), "f"(b));
  return m;
#else
  return a != a || b != b ? a + b : fmaxf(a, b);
#endif
}

// The online softmax, given a chunk's largest visible score of a row (-inf: none): the row's
// new running max, and the factor its sum and output so far are rescaled by, exactly 1
// while the max holds.
__device__ __forceinline__ float raise_max(float& m_run, float row_max) {
  const float m_new = max_nan(m_run, row_max);
  const float alpha = m_new == m_run ? 1.0f : exp_ftz(m_run - m_new);
  m_run = m_new;
  return alpha;
}
// A score's weight against the row's running max: 0 for a masked (-inf) one.
__device__ __forceinline__ float softmax_weight(float score, float m_run) {
  return score == -INFINITY ? 0.0f : exp_ftz(score - m_run);
}

}  // namespace diffuserve::cuda
