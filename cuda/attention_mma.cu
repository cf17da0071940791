// Attention on tensor cores (mma.sync m16n8k16) for head dims 64, 128, 256 and 512
// (DiffusionGemma's 256 and 512); attention.cu's kernel serves every other head dim.
//
// A block takes up to 64 query vectors (32 at head_dim 512): rows x the query heads of one
// KV head, so every key it stages serves the whole GQA group and many rows at once, over
// one piece of the segment's keys (attention.cu's plan cuts a segment's keys into pieces
// where its rows alone would leave multiprocessors idle; a piece's result is normalised by
// its own softmax sum and goes, with its running max and sum, to a partial slot that the
// merge kernel below combines with the other pieces'). It walks the piece in chunks of 32
// keys (16 at head dims 64 and 512) that run across span boundaries (a KV cache block
// holds only 16 keys), and skips the keys that no query of the block can see (causal and
// sliding-window bounds), which changes nothing in the result; a causal segment's chunks lie
// on a grid of key positions (AttentionItem::grid), so that a row's bits do not depend on
// where its segment starts. Chunks are copied as fp32
// into shared memory with cp.async, keys and values in separate buffers, each double-
// buffered: chunk n + 1's values and chunk n + 2's keys are in flight while chunk n's values
// and chunk n + 1's keys are multiplied.
//
// The warps form a grid: a warp owns two 16-row query tiles and a 64-wide slice of the head.
// Q's fragments for its slice stay in registers. A warp computes its slice's share of the
// scores of its 32 queries; the shares meet in shared memory, where threads split the rows,
// add the shares, mask, run the online softmax in fp32 and leave P (bf16 hi/lo) and each
// row's rescale factor; then every warp accumulates P V for its tiles and its slice. The
// output accumulators thus fit in registers even at head_dim 512, and each K or V fragment
// a warp builds serves both its query tiles. A chunk costs two block-wide barriers: the
// softmax of chunk n runs alone between them, then P V of chunk n and the score shares of
// chunk n + 1 run together (the tensor cores see one stream of MMAs).
// Q, K, V and P enter the tensor cores as bf16 hi/lo pairs (three products: hi*hi + hi*lo +
// lo*hi), which keeps fp32-like precision; K and V are split as their fragments are read.
// With activations "bfloat16" (kRound) they enter rounded to bf16: the hi parts alone, one
// product (the softmax's sums stay fp32).
//
// Fragments: within a 16-wide k step of Q K^T, lane t's k pairs (2t, 2t + 1) and (2t + 8,
// 2t + 9) stand for head dims 4t..4t + 3 of both Q and K (the sum over the head does not
// care about the order), so a lane reads one float4. Likewise in a 32-wide group of P V's
// output, column n of tile e is head dim 4n + e: V's fragments come from float4 reads and
// the output leaves as float4s.
#include <cmath>
#include <type_traits>

#include "attention_keys.cuh"
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
  // ([slice][query][key], fp32), P ([hi/lo][query][key], bf16), the key positions of three
  // chunks (staged two chunks ahead of their softmax), and per query the rescale factor of
  // the chunk and the final softmax denominator.
  static constexpr size_t kV = sizeof(float) * 2 * kKeys * kKStride;
  static constexpr size_t kS = kV + sizeof(float) * 2 * kKeys * kVStride;
  static constexpr size_t kP = kS + sizeof(float) * kSlices * kQueries * kSStride;
  static constexpr size_t kPos = kP + sizeof(__nv_bfloat16) * 2 * kQueries * kPStride;
  static constexpr size_t kAlpha = kPos + sizeof(int) * 3 * kKeys;
  static constexpr size_t kL = kAlpha + sizeof(float) * kQueries;
  static constexpr size_t kBytes = kL + sizeof(float) * kQueries;
};

// Calls f(std::integral_constant<int, kDim>) for the head dims served here; false for others.
template <typename F>
bool with_head_dim(int head_dim, F&& f) {
  switch (head_dim) {
    case 64: f(std::integral_constant<int, 64>{}); return true;
    case 128: f(std::integral_constant<int, 128>{}); return true;
    case 256: f(std::integral_constant<int, 256>{}); return true;
    case 512: f(std::integral_constant<int, 512>{}); return true;
    default: return false;
  }
}

// c += a * b with both split into bf16 hi/lo parts: three products (fp32-like); with
// kRound (inputs rounded to bf16, activations "bfloat16") the hi parts' alone.
template <bool kRound>
__device__ __forceinline__ void mma_parts(float* c, const uint32_t (&a)[2][4], const uint32_t (&b)[2][2]) {
  mma_bf16(c, a[0], b[0]);
  if constexpr (!kRound) {
    mma_bf16(c, a[0], b[1]);
    mma_bf16(c, a[1], b[0]);
  }
}

// The four 8x8 bf16 matrices at rows `row` (lanes 0-15: rows 0-15 of a 16x16 tile, lanes
// 16-31: the same rows 8 columns on) as an mma A fragment.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* row) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}

template <int kDim, bool kRound>
__global__ void __launch_bounds__(Shape<kDim>::kThreads, 1)
    attention_mma_kernel(const float* __restrict__ q, const AttentionOutput out, float* __restrict__ partial_out,
                         float2* __restrict__ partial_ml, const DeviceAttentionSegment* __restrict__ segments,
                         const DeviceKeySpan* __restrict__ spans, const AttentionItem* __restrict__ items,
                         int num_heads, int num_kv_heads) {
  wait_for_earlier_kernels();
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
  auto key_pos = reinterpret_cast<int(*)[kKeys]>(smem + S::kPos);  // relative_position, or kNoKey
  auto alpha = reinterpret_cast<float*>(smem + S::kAlpha);
  auto denom = reinterpret_cast<float*>(smem + S::kL);

  const AttentionItem item = items[blockIdx.x];
  const DeviceAttentionSegment seg = segments[item.segment];
  const ItemQueries queries(seg, item, num_heads, num_kv_heads, kDim);
  const int nq = queries.count;
  const int64_t kv_stride = int64_t(num_kv_heads) * kDim;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  const int d0 = (warp % kSlices) * 64, row0 = (warp / kSlices) * 32;  // this warp's head slice and query tiles
  // The softmax thread's query vector, the keys it sees, and its running max and sum.
  const int srow = tid / kLanes, spart = tid % kLanes;
  const VisibleKeys visible = queries.visible(srow);
  float m_run = -INFINITY, l_run = 0.0f;

  // Staging: this thread copies part of the key in slot `copy_key` of each chunk; `slot` is
  // where that key is in the spans for the next chunk to stage. A chunk's values are staged
  // one chunk after its keys, from the address its key staging kept.
  const KeyWalk walk = queries.keys(spans);
  const int copy_key = tid / kCopiers, copy_part = tid % kCopiers;
  KeyWalk::Slot slot = walk.slot<kKeys>({item.span, item.key}, copy_key);
  const float* v_src = q;  // any readable address: a missing key is zero-filled
  bool v_copy = false;
  // Keys of the chunk at `slot` into K[buf], their positions into key_pos[pos]; whether
  // this thread's key exists.
  auto stage_keys = [&](int buf, int pos) {
    const bool valid = walk.holds(slot);
    const float* k_src = q;
    int position = kNoKey;
    v_src = q;
    if (valid) {
      const DeviceKeySpan s = spans[slot.at.span];
      const int64_t off = int64_t(slot.at.key) * kv_stride + int64_t(item.kv_head) * kDim;
      k_src = s.keys + off, v_src = s.values + off;
      position = relative_position(s.first_position + slot.at.key, seg.first_position);
    }
    v_copy = valid;
    if (copy_part == 0) key_pos[pos][copy_key] = position;
#pragma unroll
    for (int i = 0; i < kDim / 4 / kCopiers; ++i) {
      const int d = 4 * (copy_part + kCopiers * i);
      cp_async16(&K[buf][copy_key][d], k_src + d, valid);
    }
    return valid;
  };
  // Values of the chunk whose keys were staged last, into V[buf].
  auto stage_values = [&](int buf) {
#pragma unroll
    for (int i = 0; i < kDim / 4 / kCopiers; ++i) {
      const int d = 4 * (copy_part + kCopiers * i);
      cp_async16(&V[buf][copy_key][d], v_src + d, v_copy);
    }
  };

  // This warp's share of the scores of the chunk in K[buf]: its query tiles x the chunk's
  // keys, over its slice, with Q's fragments (hi/lo).
  uint32_t qa[2][4][2][4];
  auto score_shares = [&](int buf) {
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
        for (int mt = 0; mt < 2; ++mt) mma_parts<kRound>(s[mt][nt], qa[mt][st], b);
      }
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int nt = 0; nt < kKeys / 8; ++nt) {
        float* row = &Sh[warp % kSlices][row0 + mt * 16 + g][nt * 8 + 2 * t];
        *reinterpret_cast<float2*>(row) = {s[mt][nt][0], s[mt][nt][1]};
        *reinterpret_cast<float2*>(row + 8 * S::kSStride) = {s[mt][nt][2], s[mt][nt][3]};
      }
  };

  // Whole scores, mask and online softmax of the chunk whose positions are in key_pos[pos]:
  // row srow, key pairs spart + kLanes * i. Leaves P and the row's rescale factor.
  auto softmax = [&](int pos) {
    float p[kPairs][2];
    float row_max = -INFINITY;
#pragma unroll
    for (int i = 0; i < kPairs; ++i) {
      const int key = 2 * (spart + kLanes * i);
      float2 v = *reinterpret_cast<const float2*>(&Sh[0][srow][key]);
#pragma unroll
      for (int w = 1; w < kSlices; ++w) {
        const float2 share = *reinterpret_cast<const float2*>(&Sh[w][srow][key]);
        v.x += share.x, v.y += share.y;
      }
      const int2 kp = *reinterpret_cast<const int2*>(&key_pos[pos][key]);
      p[i][0] = visible.sees(kp.x) ? v.x : -INFINITY;
      p[i][1] = visible.sees(kp.y) ? v.y : -INFINITY;
      row_max = max_nan(row_max, max_nan(p[i][0], p[i][1]));
    }
#pragma unroll
    for (int m = 1; m < kLanes; m <<= 1) row_max = max_nan(row_max, __shfl_xor_sync(0xffffffffu, row_max, m));
    const float a = raise_max(m_run, row_max);
    float row_sum = 0.0f;
#pragma unroll
    for (int i = 0; i < kPairs; ++i) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        p[i][e] = softmax_weight(p[i][e], m_run);
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
  };

  // P V of the chunk in V[buf] for this warp's query tiles and slice.
  float o[2][8][4] = {};
  auto accumulate = [&](int buf) {
    float a[2][2];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) a[mt][0] = alpha[row0 + mt * 16 + g], a[mt][1] = alpha[row0 + mt * 16 + g + 8];
    // Rescaling by 1 changes nothing: skipped while no row of the warp has a new max.
    if (__any_sync(0xffffffffu, a[0][0] != 1.0f || a[0][1] != 1.0f || a[1][0] != 1.0f || a[1][1] != 1.0f)) {
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
          o[mt][nt][0] *= a[mt][0], o[mt][nt][1] *= a[mt][0], o[mt][nt][2] *= a[mt][1], o[mt][nt][3] *= a[mt][1];
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
          for (int mt = 0; mt < 2; ++mt) mma_parts<kRound>(o[mt][half * 4 + e], pa[mt], b);
        }
      }
    }
  };

  // Chunk n uses K[n % 2], V[n % 2] and key_pos[n % 3]. Before the loop: chunk 0's keys and
  // values, chunk 1's keys, chunk 0's score shares.
  const bool have_first = stage_keys(0, 0);
  stage_values(0);
  cp_async_commit();
  walk.next<kKeys>(slot);
  bool have_next = stage_keys(1, 1);  // this thread's key of the chunk after the current one exists
  cp_async_commit();
  // Q fragments (hi/lo) of this warp's tiles and slice, loaded while the first chunk is
  // on its way.
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int j = row0 + mt * 16 + g + 8 * h;
      const float* src = q + queries.offset(j < nq ? j : 0) + d0 + 4 * t;
#pragma unroll
      for (int st = 0; st < 4; ++st) {
        const float4 x = j < nq ? *reinterpret_cast<const float4*>(src + st * 16) : float4{0.0f, 0.0f, 0.0f, 0.0f};
        split_bf16(x.x, x.y, qa[mt][st][0][h], qa[mt][st][1][h]);
        split_bf16(x.z, x.w, qa[mt][st][0][2 + h], qa[mt][st][1][2 + h]);
      }
    }
  cp_async_wait<1>();
  bool more = __syncthreads_or(have_first);  // any key to see at all
  if (more) {
    score_shares(0);
    __syncthreads();
  }
  for (int n = 0; more; ++n) {
    const int buf = n & 1;
    softmax(n % 3);
    cp_async_wait<0>();  // chunk n's values, chunk n + 1's keys
    more = __syncthreads_or(have_next);  // P and alpha are complete; whether chunk n + 1 exists
    // The buffers of chunk n - 1's values and chunk n's keys were read before the last
    // barrier: chunk n + 1's values and chunk n + 2's keys go there, staged here, between
    // the MMAs, rather than in the softmax that the tensor cores wait for.
    if (more) {
      stage_values(buf ^ 1);
      walk.next<kKeys>(slot);
      have_next = stage_keys(buf, (n + 2) % 3);
      cp_async_commit();
    }
    accumulate(buf);
    if (more) score_shares(buf ^ 1);
    __syncthreads();  // P, alpha, the shares and the buffers read are free again
  }
  cp_async_wait<0>();  // a block without keys left its zero fills in flight

  // The output, normalised by this piece's softmax sum (zero where no key was visible): to
  // `out` when the piece is all the rows see, else to partial slot item.slot with the
  // rows' max and sum, for the merge.
  if (spart == 0) {
    denom[srow] = l_run;
    if (item.slot >= 0 && srow < nq) partial_ml[int64_t(item.slot) * kQueries + srow] = {m_run, l_run};
  }
  __syncthreads();
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int j = row0 + mt * 16 + g + 8 * h;
      if (j >= nq) continue;
      const float inv = denom[j] != 0.0f ? 1.0f / denom[j] : 0.0f;  // 0: no key seen; NaN stays NaN
      const auto scaled = [inv](float x) { return x * inv; };
#pragma unroll
      for (int half = 0; half < 2; ++half)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int r = 2 * h + c, tile = half * 4, dim = d0 + 8 * t + half * 32 + 4 * c;
          const float y[4] = {scaled(o[mt][tile][r]), scaled(o[mt][tile + 1][r]), scaled(o[mt][tile + 2][r]),
                              scaled(o[mt][tile + 3][r])};
          if (item.slot < 0) store_output(out, queries.offset(j) + dim, y);
          else *reinterpret_cast<float4*>(queries.partial(partial_out, kQueries, j) + dim) = {y[0], y[1], y[2], y[3]};
        }
    }
}

// The pieces of each merge into the output, one warp per query vector (blockIdx.y picks
// the block's warps' vectors, so that the short chains of loads of every vector run at
// once): piece p weighs l_p e^(m_p - M) / sum over the pieces (M: their largest max; a
// piece that saw no key weighs 0), and the weighted outputs are added in piece order.
// Tried and not kept (thirty-first session, H200, batch 1, 1K): every piece's columns of a
// lane (up to 512 dims, 4 pieces a batch) loaded before the maxima and sums were read, one
// round trip where this loop takes three: 6.7 -> 6.9 us a merge in the step's trace, the
// step no faster. With 8 warps a block and a few hundred blocks, the round trips overlap.
constexpr int kMergeWarps = 8;
__global__ void attention_merge_kernel(const AttentionOutput out, const float* __restrict__ partial_out,
                                       const float2* __restrict__ partial_ml,
                                       const DeviceAttentionSegment* __restrict__ segments,
                                       const AttentionMerge* __restrict__ merges, int num_heads, int num_kv_heads,
                                       int head_dim, int queries_per_slot) {
  // The merge's place from the plan's tables (no kernel writes them), read before the wait
  // for the kernels before, while their last blocks run.
  const AttentionMerge merge = merges[blockIdx.x];
  const int64_t first_row = segments[merge.segment].first_row;
  wait_for_earlier_kernels();
  const int group = num_heads / num_kv_heads, lane = threadIdx.x & 31;
  const int j = blockIdx.y * kMergeWarps + (threadIdx.x >> 5);
  if (j >= merge.rows * group) return;
  const float2* ml = partial_ml + int64_t(merge.slot) * queries_per_slot + j;  // piece p: ml[p * queries_per_slot]
  float m = -INFINITY;
  for (int p = lane; p < merge.pieces; p += 32) m = max_nan(m, ml[p * queries_per_slot].x);
  for (int s = 16; s > 0; s >>= 1) m = max_nan(m, __shfl_xor_sync(0xffffffffu, m, s));
  // (A piece's sum is 0 where it saw no key, NaN where a score was: that one weighs NaN.)
  const auto weight = [m](float2 piece) { return piece.y != 0.0f ? piece.y * __expf(piece.x - m) : 0.0f; };
  float sum = 0.0f;
  for (int p = lane; p < merge.pieces; p += 32) sum += weight(ml[p * queries_per_slot]);
  for (int s = 16; s > 0; s >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, s);
  const float inv = sum != 0.0f ? 1.0f / sum : 0.0f;
  const int64_t row = first_row + merge.row0 + j / group;
  const int64_t at = row * num_heads * int64_t(head_dim) + int64_t(merge.kv_head * group + j % group) * head_dim;
  for (int d = 4 * lane; d < head_dim; d += 128) {
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int p = 0; p < merge.pieces; ++p) {
      const float w = weight(ml[p * queries_per_slot]) * inv;
      const float4 x = *reinterpret_cast<const float4*>(
          partial_out + ((int64_t(merge.slot) + p) * queries_per_slot + j) * head_dim + d);
      acc[0] += w * x.x, acc[1] += w * x.y, acc[2] += w * x.z, acc[3] += w * x.w;
    }
    store_output(out, at + d, acc);
  }
}

}  // namespace

int attention_mma_queries(int head_dim, bool round_bf16) {
  if (attention_wgmma_serves(head_dim, round_bf16)) return attention_wgmma_queries(head_dim);
  int queries = 0;
  with_head_dim(head_dim, [&](auto dim) { queries = Shape<decltype(dim)::value>::kQueries; });
  return queries;
}

int attention_mma_resident_items(int head_dim, bool round_bf16) {
  if (attention_wgmma_serves(head_dim, round_bf16)) return attention_wgmma_resident_items(head_dim);
  int blocks = 1;
  with_head_dim(head_dim, [&](auto dim) {
    using S = Shape<decltype(dim)::value>;
    // the rounding kernel's twin: the same resources
    blocks = resident_blocks(attention_mma_kernel<decltype(dim)::value, false>, S::kThreads, int(S::kBytes));
  });
  return blocks;
}

void attention_mma(const AttentionQueries& q, const AttentionOutput& out, const AttentionPlan& plan,
                   const AttentionTables& tables, void* scratch, int num_heads, int num_kv_heads, cudaStream_t stream) {
  // Scratch: the slots' outputs ([slot][query][head_dim]), then their (max, sum) pairs, then
  // the wgmma kernel's bf16 keys and values.
  float* partial_out = static_cast<float*>(scratch);
  auto* partial_ml = reinterpret_cast<float2*>(partial_out + plan.slots * plan.queries_per_slot * plan.head_dim);
  if (attention_wgmma_serves(plan.head_dim, plan.round_bf16)) {
    const size_t partial_bytes =
        reinterpret_cast<uint8_t*>(partial_ml + plan.slots * plan.queries_per_slot) - static_cast<uint8_t*>(scratch);
    auto* packed_keys =
        reinterpret_cast<__nv_bfloat16*>(static_cast<uint8_t*>(scratch) + attention_packed_offset(partial_bytes));
    auto* packed_values = reinterpret_cast<__nv_bfloat16*>(reinterpret_cast<uint8_t*>(packed_keys) +
                                                           attention_packed_bytes(plan.packed_rows, plan.packed_cols));
    attention_wgmma(q, out, partial_out, partial_ml, packed_keys, packed_values, plan, tables, num_heads, num_kv_heads,
                    stream);
  } else {
    with_head_dim(plan.head_dim, [&](auto dim) {
      constexpr int kDim = decltype(dim)::value;
      using S = Shape<kDim>;
      const auto kernel = plan.round_bf16 ? attention_mma_kernel<kDim, true> : attention_mma_kernel<kDim, false>;
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(S::kBytes));
      launch(kernel, unsigned(plan.items.size()), S::kThreads, S::kBytes, stream, q.values, out, partial_out,
             partial_ml, tables.segments, tables.spans, tables.items, num_heads, num_kv_heads);
    });
  }
  if (!plan.merges.empty())
    launch(attention_merge_kernel, dim3(unsigned(plan.merges.size()), unsigned(plan.queries_per_slot / kMergeWarps)),
           32 * kMergeWarps, 0, stream, out, partial_out, partial_ml, tables.segments, tables.merges, num_heads,
           num_kv_heads, plan.head_dim, plan.queries_per_slot);
}

}  // namespace diffuserve::cuda
