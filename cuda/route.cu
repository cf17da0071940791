// The MoE router in one launch: the scores of 16 tokens against every expert on tensor
// cores, then each token's softmax and top k from shared memory. At batch 1 this replaces
// a pre-pass, two split-K products with their reductions (the scores want fp32-like
// precision: bf16 hi and lo parts) and the top-k kernel: six launches.
//
// A cluster of 4 blocks takes 16 tokens (one m16n8k16 row tile); the experts' 8-wide tiles
// go round the blocks (tile T to block T % 4). A block's 16 warps take 4 of its tiles at a
// time, each warp all 4 over a sixteenth of the hidden size, so that a block reads its
// tokens' rows once (and splits them into hi and lo once) for all its tiles; the sixteen
// parts' sums meet in shared memory and are added in part order, and the tiles' scores go to
// the first block's shared memory, which then routes the tokens, a warp each. At batch 1 on
// the H200: 14.3 us a launch; four warps a tile, each a quarter of the hidden size (the
// token rows read once a tile), took 19.1 us, and clusters of 8 blocks of 2 tiles 17.6 us.
// Nor did splitting the hidden size among the cluster's blocks instead (each block all the
// tiles over its share, a token's parts added from every block's shared memory by the block
// that routes it) gain: 14.3 against 14.8 us with 4 blocks, the steps no faster, and 25.6
// us with 8 (thirtieth session). The bytes a block reads are not what bounds it: ncu's
// warp samples (1x1K, layer 0, 14.3 us) fall 11% on its start, 46% on the loads' first uses
// and the MMAs, 16% on the barrier after them (warps waiting for the slowest one's loads)
// and the parts' sums, 7% on the cluster barrier and its memory fence, 19% on the routing:
// each warp's chain of round trips, two chunks of loads in flight at a time at 126
// registers. Nor did asking each warp's share of the weight rows into L2 at once
// (cp.async.bulk.prefetch.L2, a row a lane) before the programmatic wait, as they come from
// memory each layer: 15.7 us a launch. Nor did the MoE plan in this launch, by the last
// token tile's block to finish routing (a counter of finished blocks, the ids read past L1),
// which saved moe_plan's launch: 17.13 / 17.12 -> 17.15 / 17.14 ms a step at 1x1K,
// 37.11 / 37.30 -> 37.00 / 37.01 at 4x1K (H200, ab_steps.sh, forty-third session): one
// block of 512 threads plans after the routing as long as the plan's own launch took.
// Code for GPUs before Hopper (no clusters) runs with clusters of one block: a block takes
// every tile.
//
// Each lane reads its fragments straight from global memory: the tokens' rows (fp32, split
// into bf16 hi/lo as they are read: two products) and the experts' weight rows (bf16).
// Within a 32-wide chunk of the hidden size, lane t's 8 consecutive values k0 + 8t .. 8t + 7
// stand for its fragment pairs of both 16-wide steps, in A and B alike (the sum over k does
// not care about the order), so a lane reads two float4s of a token row and one 16-byte
// piece of a weight row. A token's scores depend on its row alone: batch-invariant.
#include <cooperative_groups.h>

#include <algorithm>
#include <climits>
#include <stdexcept>
#include <string>

#include "kernels.h"
#include "load8.cuh"
#include "mma.cuh"

namespace diffuserve::cuda {
namespace {

constexpr int kRouteTokens = 16;
constexpr int kClusterBlocks = 4;  // blocks a token tile's experts are spread over
constexpr int kTileSlots = 4;      // a block's tiles at a time
constexpr int kRouteWarps = 16;    // warp w: part w of the hidden size, for every slot
constexpr int kDepth = 2;          // chunks of loads a warp has in flight
// Shared memory: the scores [token][expert] (used in the first block), then each part's
// sums [part][token][slot * 8 + column].
constexpr size_t kPartialBytes = sizeof(float) * kRouteWarps * kRouteTokens * kTileSlots * 8;
constexpr size_t kMaxSharedBytes = 200 * 1024;

// Values k .. k + 7 of a bf16 row of n, as load8 (load8.cuh) reads floats: as four packed
// pairs (the lower k in the low half).
template <bool kWhole>
__device__ __forceinline__ uint4 load8_bf16(const __nv_bfloat16* row, int64_t k, int64_t n) {
  if constexpr (kWhole) {
    return *reinterpret_cast<const uint4*>(row + k);
  } else {
    uint32_t p[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const __nv_bfloat16 lo = k + 2 * j < n ? row[k + 2 * j] : __float2bfloat16(0.0f);
      const __nv_bfloat16 hi = k + 2 * j + 1 < n ? row[k + 2 * j + 1] : __float2bfloat16(0.0f);
      p[j] = uint32_t(__bfloat16_as_ushort(lo)) | uint32_t(__bfloat16_as_ushort(hi)) << 16;
    }
    return {p[0], p[1], p[2], p[3]};
  }
}

// One 32-wide chunk of the hidden size as a lane holds it: its values k .. k + 7 (k = k0 +
// 8t) of its token rows g, g + 8 and of each slot's expert weight row.
struct Chunk {
  float a[2][8];
  uint4 b[kTileSlots];
};
template <bool kWhole>
__device__ __forceinline__ void load_chunk(const float* const (&rows)[2], const __nv_bfloat16* const (&w_rows)[kTileSlots],
                                           int64_t k, int64_t hidden, Chunk& c) {
#pragma unroll
  for (int h = 0; h < 2; ++h) load8<kWhole>(rows[h], k, hidden, c.a[h]);
#pragma unroll
  for (int s = 0; s < kTileSlots; ++s) c.b[s] = load8_bf16<kWhole>(w_rows[s], k, hidden);
}
// acc[s] += the chunk's products with slot s's tile: two 16-wide steps, hi and lo parts each.
__device__ __forceinline__ void multiply_chunk(const Chunk& c, float (&acc)[kTileSlots][4]) {
#pragma unroll
  for (int step = 0; step < 2; ++step) {  // values 4 step .. 4 step + 3 of the lane's 8
    uint32_t parts[2][4];                  // [hi, lo][fragment register]
    const int v = 4 * step;
    split_bf16(c.a[0][v], c.a[0][v + 1], parts[0][0], parts[1][0]);
    split_bf16(c.a[1][v], c.a[1][v + 1], parts[0][1], parts[1][1]);
    split_bf16(c.a[0][v + 2], c.a[0][v + 3], parts[0][2], parts[1][2]);
    split_bf16(c.a[1][v + 2], c.a[1][v + 3], parts[0][3], parts[1][3]);
#pragma unroll
    for (int s = 0; s < kTileSlots; ++s) {
      const uint32_t frag[2] = {step ? c.b[s].z : c.b[s].x, step ? c.b[s].w : c.b[s].y};
      mma_bf16(acc[s], parts[0], frag);
      mma_bf16(acc[s], parts[1], frag);
    }
  }
}

// A score as an unsigned integer in the same order (the larger score the larger integer;
// -0 as +0, so that the two tie as floats do), for the warp's integer reductions.
__device__ __forceinline__ uint32_t ordered_key(float v) {
  const uint32_t u = __float_as_uint(v == 0.0f ? 0.0f : v);
  return u >> 31 ? ~u : u | 0x80000000u;
}

// Experts a warp routes among: a lane keeps which of its experts (e = lane + 32 j) are taken
// in one 64-bit mask.
constexpr int kMaxRouteExperts = 32 * 64;

// One token's routing from its scores s (in place): softmax of s * scale, the top k (the
// lower expert id wins a tie), renormalised, times each expert's scale. A lane keeps the
// best of its experts not yet taken; a pick is the warp's best of those, found by two
// single-instruction reductions (the largest key, then the lowest id holding it), and only
// the lane whose expert was picked looks again among its own. Every score is a candidate
// (infinities and NaNs have keys too), so every pick is an expert. The weights are
// finished by the lanes together, each loading its picks' expert scales at once.
__device__ void route_token(float* s, int experts, float scale, int top_k, const float* per_expert_scale,
                            int32_t* ids, float* wt, int lane) {
  float m = -INFINITY;
  for (int e = lane; e < experts; e += 32) m = fmaxf(m, s[e] *= scale);
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  float z = 0.0f;
  for (int e = lane; e < experts; e += 32) z += expf(s[e] - m);
  for (int o = 16; o > 0; o >>= 1) z += __shfl_xor_sync(0xffffffffu, z, o);
  uint64_t taken = 0;
  uint32_t best_key = 0;
  int best = INT_MAX;  // this lane's best expert not taken (none: INT_MAX)
  auto find_best = [&] {
    best_key = 0, best = INT_MAX;
    for (int e = lane, j = 0; e < experts; e += 32, ++j) {
      const uint32_t key = ordered_key(s[e]);
      if (!(taken >> j & 1) && (best == INT_MAX || key > best_key)) best_key = key, best = e;
    }
  };
  find_best();
  float picked = 0.0f;
  for (int k = 0; k < top_k; ++k) {
    const uint32_t top = __reduce_max_sync(0xffffffffu, best == INT_MAX ? 0u : best_key);
    const int index = __reduce_min_sync(0xffffffffu, best != INT_MAX && best_key == top ? best : INT_MAX);
    const float p = expf(s[index] - m) / z;
    picked += p;
    if (lane == 0) ids[k] = index, wt[k] = p;
    if (index == best) {
      taken |= uint64_t(1) << (index >> 5);
      find_best();
    }
  }
  __syncwarp();  // lane 0's picks are visible to the warp
  for (int k = lane; k < top_k; k += 32) wt[k] = wt[k] / picked * per_expert_scale[ids[k]];
}

__global__ void __launch_bounds__(kRouteWarps * 32, 1)
    route_kernel(const float* __restrict__ x, int64_t tokens, int64_t hidden, const __nv_bfloat16* __restrict__ w,
                 int experts, bool vector, float scale, int top_k, const float* __restrict__ per_expert_scale,
                 int32_t* __restrict__ expert_ids, float* __restrict__ weights) {
  wait_for_earlier_kernels();
  extern __shared__ float shared[];
  float* scores = shared;  // [kRouteTokens][experts]
  auto partial = reinterpret_cast<float(*)[kRouteTokens][kTileSlots * 8]>(shared + kRouteTokens * experts);
#if __CUDA_ARCH__ >= 900
  const cooperative_groups::cluster_group cluster = cooperative_groups::this_cluster();
  const int blocks = int(cluster.num_blocks()), rank = int(cluster.block_rank());
  float* first_scores = cluster.map_shared_rank(scores, 0);
  // A block may write another's shared memory only once that block has started: every block
  // arrives here and waits before its first write, after its first tile's products, so the
  // wait finds the barrier passed.
  cluster.barrier_arrive();
#else
  const int blocks = 1, rank = 0;
  float* first_scores = scores;
#endif
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int64_t first = int64_t(blockIdx.x / blocks) * kRouteTokens;
  // This lane's token rows g and g + 8 (a row past the tokens reads as the last one's,
  // and its scores are never used).
  const float* rows[2];
  for (int h = 0; h < 2; ++h) {
    const int64_t token = first + g + 8 * h;
    rows[h] = x + (token < tokens ? token : tokens - 1) * hidden;
  }
  // This warp's part of the hidden size: chunks [begin, end) of 32, those below whole_end
  // read as whole vectors.
  const int64_t chunks = (hidden + 31) / 32, per_part = (chunks + kRouteWarps - 1) / kRouteWarps;
  const int64_t begin = (warp * per_part < chunks ? warp * per_part : chunks) * 32;
  const int64_t end = ((warp + 1) * per_part < chunks ? (warp + 1) * per_part : chunks) * 32;
  const int64_t whole_end = vector ? (hidden / 32 * 32 < end ? hidden / 32 * 32 : end) : begin;

  // Pass p: this block's tiles rank + blocks (4p + slot), one a slot.
  const int tiles = (experts + 7) / 8;
  for (int pass_tile = rank; pass_tile < tiles; pass_tile += blocks * kTileSlots) {
    const __nv_bfloat16* w_rows[kTileSlots];
    for (int s = 0; s < kTileSlots; ++s) {  // past the last expert: the last, whose scores are not kept
      const int expert = (pass_tile + blocks * s) * 8 + g;
      w_rows[s] = w + int64_t(expert < experts ? expert : experts - 1) * hidden;
    }
    float acc[kTileSlots][4] = {};
    // kDepth chunks' loads in flight at a time (the loop is latency-bound otherwise).
    int64_t k0 = begin;
    for (; k0 + kDepth * 32 <= whole_end; k0 += kDepth * 32) {
      Chunk c[kDepth];
#pragma unroll
      for (int d = 0; d < kDepth; ++d) load_chunk<true>(rows, w_rows, k0 + 32 * d + 8 * t, hidden, c[d]);
#pragma unroll
      for (int d = 0; d < kDepth; ++d) multiply_chunk(c[d], acc);
    }
    for (; k0 < end; k0 += 32) {
      Chunk c;
      if (k0 < whole_end) load_chunk<true>(rows, w_rows, k0 + 8 * t, hidden, c);
      else load_chunk<false>(rows, w_rows, k0 + 8 * t, hidden, c);
      multiply_chunk(c, acc);
    }
    // acc[s]: rows g, g + 8 x columns 2t, 2t + 1 of slot s's tile. Every part's sums to shared
    // memory, then a thread an output adds them in part order and sends the score to the
    // first block.
    for (int s = 0; s < kTileSlots; ++s)
      for (int r = 0; r < 4; ++r) partial[warp][g + 8 * (r >> 1)][s * 8 + 2 * t + (r & 1)] = acc[s][r];
    __syncthreads();
#if __CUDA_ARCH__ >= 900
    if (pass_tile == rank) cluster.barrier_wait();
#endif
    for (int o = threadIdx.x; o < kRouteTokens * kTileSlots * 8; o += blockDim.x) {
      const int row = o / (kTileSlots * 8), column = o % (kTileSlots * 8);
      const int tile = pass_tile + blocks * (column / 8), e = tile * 8 + column % 8;
      float sum = 0.0f;
      for (int q = 0; q < kRouteWarps; ++q) sum += partial[q][row][column];
      if (tile < tiles && e < experts) first_scores[row * experts + e] = sum;
    }
    __syncthreads();
  }
#if __CUDA_ARCH__ >= 900
  if (rank >= tiles) cluster.barrier_wait();  // (a block with no tile)
  cluster.sync();  // every block's scores are in the first block's shared memory
#endif
  if (rank != 0) return;
  for (int r = warp; r < kRouteTokens && first + r < tokens; r += kRouteWarps)
    route_token(scores + r * experts, experts, scale, top_k, per_expert_scale, expert_ids + (first + r) * top_k,
                weights + (first + r) * top_k, lane);
}

}  // namespace

int route_max_experts() {
  return std::min(kMaxRouteExperts, int((kMaxSharedBytes - kPartialBytes) / (sizeof(float) * kRouteTokens)));
}

void route(const float* x, int64_t tokens, int64_t hidden, const __nv_bfloat16* w, int experts, float scale,
           int top_k, const float* per_expert_scale, int32_t* expert_ids, float* weights, cudaStream_t stream) {
  if (experts < 1 || experts > route_max_experts() || top_k < 1 || top_k > experts)
    throw std::invalid_argument("route: 1 to " + std::to_string(route_max_experts()) +
                                " experts and 1 <= top_k <= experts");
  if (!tokens) return;
  // Whole aligned vectors: 16-byte rows of x (float4s) and of w (8 bf16s).
  const bool vector = hidden % 8 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
                      reinterpret_cast<uintptr_t>(w) % 16 == 0;
  const size_t bytes = sizeof(float) * kRouteTokens * size_t(experts) + kPartialBytes;
  cudaFuncSetAttribute(route_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
  // Clusters where the kernel's code is Hopper's (sm_90 and newer); one block a token tile before.
  static const int cluster_blocks = [] {
    cudaFuncAttributes attributes{};
    return cudaFuncGetAttributes(&attributes, route_kernel) == cudaSuccess && attributes.binaryVersion >= 90
               ? kClusterBlocks
               : 1;
  }();
  launch_clusters(cluster_blocks, route_kernel, unsigned((tokens + kRouteTokens - 1) / kRouteTokens * cluster_blocks),
                  kRouteWarps * 32, bytes, stream, x, tokens, hidden, w, experts, vector, scale, top_k,
                  per_expert_scale, expert_ids, weights);
}

}  // namespace diffuserve::cuda
