// Attention on tensor cores (mma.sync m16n8k16) for head dims 64, 128, 256 and 512
// (DiffusionGemma's 256 and 512); attention.cu's kernel serves every other head dim.
//
// A block takes up to 64 query vectors (32 at head_dim 512): rows x the query heads of one
// KV head, so every key it stages serves the whole GQA group and many rows at once. It
// walks the keys of its segment's spans in chunks of 32 (16 at head dims 64 and 512) that
// run across span boundaries (a KV cache block holds only 16 keys), and skips the keys that
// no query of the block can see (causal and sliding-window bounds), which changes nothing
// in the result. Each chunk is copied as fp32 into shared memory with cp.async,
// double-buffered: chunk n + 1 arrives while chunk n is computed.
//
// The warps form a grid: a warp owns two 16-row query tiles and a 64-wide slice of the head.
// Q's fragments for its slice stay in registers. Per chunk a warp computes its slice's share
// of the scores of its 32 queries; the shares meet in shared memory, where threads split the
// rows, add the shares, mask, run the online softmax in fp32 and leave P (bf16 hi/lo) and
// each row's rescale factor; then every warp accumulates P V for its tiles and its slice.
// The output accumulators thus fit in registers even at head_dim 512, each K or V fragment a
// warp builds serves both its query tiles, and a chunk costs three block-wide barriers.
// Q, K, V and P enter the tensor cores as bf16 hi/lo pairs (three products: hi*hi + hi*lo +
// lo*hi), which keeps fp32-like precision; K and V are split as their fragments are read.
//
// Fragments: within a 16-wide k step of Q K^T, lane t's k pairs (2t, 2t + 1) and (2t + 8,
// 2t + 9) stand for head dims 4t..4t + 3 of both Q and K (the sum over the head does not
// care about the order), so a lane reads one float4. Likewise in a 32-wide group of P V's
// output, column n of tile e is head dim 4n + e: V's fragments come from float4 reads and
// the output leaves as float4s.
#include <cmath>

#include "kernels.h"
#include "mma.cuh"

namespace diffuserve::cuda {
namespace {

// A block's shape for head dim kDim.
template <int kDim>
struct Shape {
  static constexpr int kSlices = kDim / 64;                        // warps across the head
  static constexpr int kRowGroups = kSlices < 8 ? 2 : 1;           // warps across the queries (8 warps at most)
  static constexpr int kWarps = kSlices * kRowGroups, kThreads = 32 * kWarps;
  static constexpr int kQueries = 32 * kRowGroups;                 // query vectors per block
  // Keys per chunk: 32, but 16 at head_dim 512 (two chunks of 32 keys' K and V would take
  // 267 KB of shared memory) and at 64 (where a softmax thread, alone on its row, holds
  // kKeys scores in registers).
  static constexpr int kKeys = kDim == 128 || kDim == 256 ? 32 : 16;
  static constexpr int kKStride = kDim + 16, kVStride = kDim + 4;  // floats per staged key / value
  static constexpr int kSStride = kKeys + 8, kPStride = kKeys + 8;  // (the paddings avoid bank conflicts)
  // Shared memory: K and V chunks ([buffer][key][d], fp32), the score shares of the slices
  // ([slice][query][key], fp32), P ([hi/lo][query][key], bf16), the chunks' key positions,
  // and per query the rescale factor of the chunk and the final softmax denominator.
  static constexpr size_t kV = sizeof(float) * 2 * kKeys * kKStride;
  static constexpr size_t kS = kV + sizeof(float) * 2 * kKeys * kVStride;
  static constexpr size_t kP = kS + sizeof(float) * kSlices * kQueries * kSStride;
  static constexpr size_t kPos = kP + sizeof(__nv_bfloat16) * 2 * kQueries * kPStride;
  static constexpr size_t kAlpha = kPos + sizeof(int64_t) * 2 * kKeys;
  static constexpr size_t kL = kAlpha + sizeof(float) * kQueries;
  static constexpr size_t kBytes = kL + sizeof(float) * kQueries;
};

// c += a * b with both split into bf16 hi/lo parts.
__device__ __forceinline__ void mma3(float* c, const uint32_t (&a)[2][4], const uint32_t (&b)[2][2]) {
  mma_bf16(c, a[0], b[0]);
  mma_bf16(c, a[0], b[1]);
  mma_bf16(c, a[1], b[0]);
}

// 16 bytes global -> shared, asynchronously; zeros instead when !copy (src is then not read).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool copy) {
  const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(copy ? 16 : 0));
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

// The four 8x8 bf16 matrices at rows `row` (lanes 0-15: rows 0-15 of a 16x16 tile, lanes
// 16-31: the same rows 8 columns on) as an mma A fragment.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* row) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}

// A place in a segment's keys: key `key` of span `span`, or span == end past the last one.
struct Cursor {
  int span;
  int64_t key;
};

// The keys of a segment that the block's queries (positions first..last) may see, one
// after the other across the spans.
struct KeyWalk {
  const DeviceKeySpan* spans;
  int end;
  bool causal;
  int64_t window, first, last;

  // Of span s, keys [lo, hi) may be visible: the union of the queries' causal windows.
  __device__ void range(const DeviceKeySpan& s, int64_t& lo, int64_t& hi) const {
    lo = 0, hi = s.count;
    if (!causal) return;
    if (last + 1 - s.first_position < hi) hi = last + 1 - s.first_position;
    if (window > 0 && first - window + 1 - s.first_position > lo) lo = first - window + 1 - s.first_position;
  }
  // The cursor n visible keys further on; n = 0 moves a cursor onto the next visible key.
  __device__ Cursor advance(Cursor c, int64_t n) const {
    for (; c.span < end; ++c.span, c.key = 0) {
      int64_t lo, hi;
      range(spans[c.span], lo, hi);
      if (c.key < lo) c.key = lo;
      if (c.key + n < hi) return {c.span, c.key + n};
      if (hi > c.key) n -= hi - c.key;
    }
    return {end, 0};
  }
};

template <int kDim>
__global__ void __launch_bounds__(Shape<kDim>::kThreads, 1)
    attention_mma_kernel(const float* __restrict__ q, float* __restrict__ out,
                         const DeviceAttentionSegment* __restrict__ segments, const DeviceKeySpan* __restrict__ spans,
                         const AttentionItem* __restrict__ items, int num_heads, int num_kv_heads) {
  using S = Shape<kDim>;
  constexpr int kKeys = S::kKeys, kSlices = S::kSlices, kQueries = S::kQueries, kThreads = S::kThreads;
  constexpr int kLanes = kThreads / kQueries;      // softmax threads per query row (1 to 8, within a warp)
  constexpr int kPairs = kKeys / (2 * kLanes);     // key pairs per softmax thread
  constexpr int kCopiers = kThreads / kKeys;       // threads staging one key
  static_assert(kPairs >= 1 && 32 % kLanes == 0 && (kDim / 4) % kCopiers == 0);
  extern __shared__ __align__(16) uint8_t smem[];
  auto K = reinterpret_cast<float(*)[kKeys][S::kKStride]>(smem);
  auto V = reinterpret_cast<float(*)[kKeys][S::kVStride]>(smem + S::kV);
  auto Sh = reinterpret_cast<float(*)[kQueries][S::kSStride]>(smem + S::kS);
  auto P = reinterpret_cast<__nv_bfloat16(*)[kQueries][S::kPStride]>(smem + S::kP);
  auto key_pos = reinterpret_cast<int64_t(*)[kKeys]>(smem + S::kPos);  // -1: no key (past the last one)
  auto alpha = reinterpret_cast<float*>(smem + S::kAlpha);
  auto denom = reinterpret_cast<float*>(smem + S::kL);

  const AttentionItem item = items[blockIdx.x];
  const DeviceAttentionSegment seg = segments[item.segment];
  const int group = num_heads / num_kv_heads, nq = item.rows * group;
  const int64_t q_stride = int64_t(num_heads) * kDim, kv_stride = int64_t(num_kv_heads) * kDim;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  const int d0 = (warp % kSlices) * 64, row0 = (warp / kSlices) * 32;  // this warp's head slice and query tiles
  const int64_t first_pos = seg.first_position + item.row0;
  // Query vector j: row j / group of the item, head kv_head * group + j % group.
  auto q_offset = [&](int j) {
    return (seg.first_row + item.row0 + j / group) * q_stride + int64_t(item.kv_head * group + j % group) * kDim;
  };

  // Q fragments (hi/lo) of this warp's tiles and slice.
  uint32_t qa[2][4][2][4];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int j = row0 + mt * 16 + g + 8 * h;
      const float* src = q + q_offset(j < nq ? j : 0) + d0 + 4 * t;
#pragma unroll
      for (int st = 0; st < 4; ++st) {
        const float4 x = j < nq ? *reinterpret_cast<const float4*>(src + st * 16) : float4{0.0f, 0.0f, 0.0f, 0.0f};
        split_bf16(x.x, x.y, qa[mt][st][0][h], qa[mt][st][1][h]);
        split_bf16(x.z, x.w, qa[mt][st][0][2 + h], qa[mt][st][1][2 + h]);
      }
    }

  // The softmax thread's query row and its running max and sum.
  const int srow = tid / kLanes, spart = tid % kLanes;
  const bool s_valid = srow < nq;
  const int64_t s_pos = first_pos + srow / group;
  float m_run = -INFINITY, l_run = 0.0f;

  // Staging: this thread copies part of key `copy_key` of each chunk; `slot` is where that
  // key is in the spans for the next chunk to stage.
  const KeyWalk walk{spans + seg.span_begin, seg.span_count, seg.causal != 0, seg.window, first_pos,
                     first_pos + item.rows - 1};
  const int copy_key = tid / kCopiers, copy_part = tid % kCopiers;
  Cursor slot = walk.advance({0, 0}, copy_key);
  auto stage = [&](int buf) {
    const bool valid = slot.span < walk.end;
    const float *k_src = q, *v_src = q;  // any readable address: a missing key is zero-filled
    if (valid) {
      const DeviceKeySpan s = walk.spans[slot.span];
      const int64_t off = slot.key * kv_stride + int64_t(item.kv_head) * kDim;
      k_src = s.keys + off, v_src = s.values + off;
      if (copy_part == 0) key_pos[buf][copy_key] = s.first_position + slot.key;
    } else if (copy_part == 0) {
      key_pos[buf][copy_key] = -1;
    }
#pragma unroll
    for (int i = 0; i < kDim / 4 / kCopiers; ++i) {
      const int d = 4 * (copy_part + kCopiers * i);
      cp_async16(&K[buf][copy_key][d], k_src + d, valid);
      cp_async16(&V[buf][copy_key][d], v_src + d, valid);
    }
  };

  float o[2][8][4] = {};
  bool more = __syncthreads_or(slot.span < walk.end);  // any key to see at all
  if (more) {
    stage(0);
    slot = walk.advance(slot, kKeys);
  }
  for (int buf = 0; more; buf ^= 1) {
    cp_async_wait_all();
    // Chunk `buf` is staged; the other buffer, the score shares and P are free again.
    more = __syncthreads_or(slot.span < walk.end);
    if (more) stage(buf ^ 1);

    // This warp's share of the scores: its query tiles x the chunk's keys, over its slice.
    float s[2][kKeys / 8][4] = {};
#pragma unroll
    for (int st = 0; st < 4; ++st)
#pragma unroll
      for (int nt = 0; nt < kKeys / 8; ++nt) {
        const float4 k = *reinterpret_cast<const float4*>(&K[buf][nt * 8 + g][d0 + st * 16 + 4 * t]);
        uint32_t b[2][2];
        split_bf16(k.x, k.y, b[0][0], b[1][0]);
        split_bf16(k.z, k.w, b[0][1], b[1][1]);
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) mma3(s[mt][nt], qa[mt][st], b);
      }
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int nt = 0; nt < kKeys / 8; ++nt) {
        float* row = &Sh[warp % kSlices][row0 + mt * 16 + g][nt * 8 + 2 * t];
        *reinterpret_cast<float2*>(row) = {s[mt][nt][0], s[mt][nt][1]};
        *reinterpret_cast<float2*>(row + 8 * S::kSStride) = {s[mt][nt][2], s[mt][nt][3]};
      }
    if (more) slot = walk.advance(slot, kKeys);
    __syncthreads();

    // Whole scores, mask and online softmax: row srow, key pairs spart + kLanes * i.
    float p[kPairs][2];
    float row_max = -INFINITY;
#pragma unroll
    for (int i = 0; i < kPairs; ++i) {
      const int key = 2 * (spart + kLanes * i);
      float2 v = {0.0f, 0.0f};
#pragma unroll
      for (int w = 0; w < kSlices; ++w) {
        const float2 share = *reinterpret_cast<const float2*>(&Sh[w][srow][key]);
        v.x += share.x, v.y += share.y;
      }
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int64_t kp = key_pos[buf][key + e];
        const bool visible = kp >= 0 && s_valid &&
                             (!seg.causal || (kp <= s_pos && (seg.window == 0 || kp > s_pos - seg.window)));
        p[i][e] = visible ? (e ? v.y : v.x) : -INFINITY;
        row_max = fmaxf(row_max, p[i][e]);
      }
    }
#pragma unroll
    for (int m = 1; m < kLanes; m <<= 1) row_max = fmaxf(row_max, __shfl_xor_sync(0xffffffffu, row_max, m));
    const float m_new = fmaxf(m_run, row_max);
    const float a = m_new == -INFINITY ? 1.0f : __expf(m_run - m_new);
    m_run = m_new;
    float row_sum = 0.0f;
#pragma unroll
    for (int i = 0; i < kPairs; ++i) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        p[i][e] = p[i][e] == -INFINITY ? 0.0f : __expf(p[i][e] - m_new);
        row_sum += p[i][e];
      }
      const int key = 2 * (spart + kLanes * i);
      split_bf16(p[i][0], p[i][1], *reinterpret_cast<uint32_t*>(&P[0][srow][key]),
                 *reinterpret_cast<uint32_t*>(&P[1][srow][key]));
    }
#pragma unroll
    for (int m = 1; m < kLanes; m <<= 1) row_sum += __shfl_xor_sync(0xffffffffu, row_sum, m);
    l_run = l_run * a + row_sum;
    if (spart == 0) alpha[srow] = a;
    __syncthreads();

    // P V for this warp's query tiles and slice.
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
      const float a0 = alpha[row0 + mt * 16 + g], a1 = alpha[row0 + mt * 16 + g + 8];
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) o[mt][nt][0] *= a0, o[mt][nt][1] *= a0, o[mt][nt][2] *= a1, o[mt][nt][3] *= a1;
    }
#pragma unroll
    for (int ks = 0; ks < kKeys / 16; ++ks) {
      uint32_t pa[2][2][4];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int part = 0; part < 2; ++part)
          ldmatrix_x4(pa[mt][part], &P[part][row0 + mt * 16 + (lane & 15)][ks * 16 + (lane >> 4) * 8]);
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        // Keys 2t, 2t + 1, 2t + 8, 2t + 9 of the step at head dims 4g..4g + 3 of the group: one
        // fragment column for each of the group's four output tiles.
        float v[4][4];
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int key = ks * 16 + 2 * t + (r & 1) + (r >> 1) * 8;
          *reinterpret_cast<float4*>(v[r]) = *reinterpret_cast<const float4*>(&V[buf][key][d0 + half * 32 + 4 * g]);
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          uint32_t b[2][2];
          split_bf16(v[0][e], v[1][e], b[0][0], b[1][0]);
          split_bf16(v[2][e], v[3][e], b[0][1], b[1][1]);
#pragma unroll
          for (int mt = 0; mt < 2; ++mt) mma3(o[mt][half * 4 + e], pa[mt], b);
        }
      }
    }
  }

  if (spart == 0) denom[srow] = l_run;
  __syncthreads();
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int j = row0 + mt * 16 + g + 8 * h;
      if (j >= nq) continue;
      const float l = denom[j];
      const auto scaled = [l](float x) { return l > 0.0f ? x / l : 0.0f; };
      float* dst = out + q_offset(j) + d0 + 8 * t;
#pragma unroll
      for (int half = 0; half < 2; ++half)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int r = 2 * h + c, tile = half * 4;
          const float4 y = {scaled(o[mt][tile][r]), scaled(o[mt][tile + 1][r]), scaled(o[mt][tile + 2][r]),
                            scaled(o[mt][tile + 3][r])};
          *reinterpret_cast<float4*>(dst + half * 32 + 4 * c) = y;
        }
    }
}

template <int kDim>
void launch(const float* q, float* out, const DeviceAttentionSegment* segments, const DeviceKeySpan* spans,
            const AttentionItem* items, int num_items, int num_heads, int num_kv_heads, cudaStream_t stream) {
  using S = Shape<kDim>;
  cudaFuncSetAttribute(attention_mma_kernel<kDim>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(S::kBytes));
  attention_mma_kernel<kDim><<<num_items, S::kThreads, S::kBytes, stream>>>(q, out, segments, spans, items, num_heads,
                                                                            num_kv_heads);
}

}  // namespace

int attention_mma_queries(int head_dim) {
  switch (head_dim) {
    case 64: return Shape<64>::kQueries;
    case 128: return Shape<128>::kQueries;
    case 256: return Shape<256>::kQueries;
    case 512: return Shape<512>::kQueries;
    default: return 0;
  }
}

bool attention_mma(const float* q, float* out, const DeviceAttentionSegment* segments, const DeviceKeySpan* spans,
                   const AttentionItem* items, int num_items, int num_heads, int num_kv_heads, int head_dim,
                   cudaStream_t stream) {
  switch (head_dim) {
    case 64: launch<64>(q, out, segments, spans, items, num_items, num_heads, num_kv_heads, stream); return true;
    case 128: launch<128>(q, out, segments, spans, items, num_items, num_heads, num_kv_heads, stream); return true;
    case 256: launch<256>(q, out, segments, spans, items, num_items, num_heads, num_kv_heads, stream); return true;
    case 512: launch<512>(q, out, segments, spans, items, num_items, num_heads, num_kv_heads, stream); return true;
    default: return false;
  }
}

}  // namespace diffuserve::cuda
