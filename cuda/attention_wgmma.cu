// Attention on Hopper's warpgroup MMAs (wgmma.cuh) for head dims 256 and 512 with Q, K, V
// and the probabilities rounded to bf16 (activations "bfloat16"): DiffusionGemma's sliding
// and full layers. attention_mma.cu's mma.sync kernel serves every other case, and this one
// takes the same plan (items, pieces, partial slots and merges; attention.cu), only with
// more query vectors a block.
//
// A producer warpgroup stages each chunk's keys and values from bf16 rows with cp.async, no
// registers and no conversion in their way, into a ring of buffers that two consumer
// warpgroups read, running ahead of them as far as the ring lets it. A bf16 KV cache's
// pages (Backend::kv_cache_dtype) it reads where they are, rows of the plan's bf16 pool.
// The batch's own rows (fp32 spans) the key and value norms write as bf16 rows too, beside
// their fp32 (KeySpan::rounded_keys, AttentionPlan::rounded_keys), and the kernel reads
// those; fp32 spans without them (an fp32 cache's pages) a pre-pass writes as bf16 rows, one
// span after the other, into the attention's scratch.
// (Thirty-first session, H200, batch 1, 1K: the pre-pass's 3.4 us a layer gone, the norms
// 7.0 -> 7.9 us, attention_bench's sliding layer 35.1 -> 31.9 us and full 74.4 -> 71.9 us
// with pre-pass and merge; the steps 16.9-17.0 / 36.3-36.5 / 118.9-119.2 -> 16.9 / 36.5 /
// 118.7-119.4 ms at 1x1K / 4x1K / 16x1K, A/B twice in one call.)
// So do the query norms for Q (Backend::alloc_attention_rows, AttentionQueries::bf16), which
// the kernel then copies as it copies K and V, half the bytes of the fp32 rows it had loaded
// and rounded (thirty-third session, H200, attention_bench twice: sliding 31.3-33.1 ->
// 29.9-30.1 us at 1x1K, 134 -> 127 at 4x1K, 511 -> 486 at 16x1K; full 70-71 -> 69-70,
// 283 -> 281-282, 1084-1093 -> 1074-1076; the steps 17.1 / 37.0-37.2 / 119.6-119.7 -> 17.1 /
// 36.7-36.9 / 118.9-119.4 ms).
//
// An item's 128 query vectors (rows x the query heads of one KV head, as in attention_mma.cu)
// are two warpgroups' 64, each holding their outputs for 256 dims in registers (128 a
// thread). At head dim 256 one block of two warpgroups takes the item. At 512 a cluster of
// two blocks does, each block its half of every vector's dims: it stages only that half of
// Q, K and V, so a chunk of keys costs each block half the copies and serves 128 vectors
// (one block of 64 vectors over all 512 dims read all of every key for 64, and its two
// warpgroups both computed the same scores). That gained only 3% (attention_bench, H200,
// the full layer at batch 1, 32K: 1,618 -> 1,575 us): what bounds the kernel is each
// chunk's chain of latencies, not L2 (ncu: 6% busy). The blocks walk the item's piece of
// the keys in chunks (64 keys at 256, 32 at 512; a causal segment's on the grid of key
// positions that KeyWalk::first_slot says) that the producer looks up and stages into
// shared memory: K and V alike as rows of keys ([key][dim], K-major for the score
// product's B, N-major for P V's). A chunk's scores S = Q K^T are one wgmma chain per
// warpgroup (Q and K from shared memory); at 512 that is a half of each score, which the
// two blocks swap through distributed shared memory and add (fp32 addition commutes, so
// both hold the same scores bit for bit), then read back into registers for the online
// softmax (masking, running max and sum in fp32), the same in both blocks; the
// probabilities, rounded to bf16, are already laid out as the A fragments of the next
// product, O += P V, which takes them straight from registers, in the next chunk: its
// scores and this chunk's P V go to the tensor cores together, and its softmax runs while P V
// does (each chunk's products waiting on their own left the tensor cores idle through every
// softmax). Producer and consumers meet on mbarriers (Ring), each consumer warpgroup on its
// own: where all 256 threads had staged each chunk and met at a barrier to end it, the
// warpgroups ran in step, the look-ups and the copies' issue on their path (sixty-seventh
// session, H100, attention_bench bf16 rows, us at 1x1K / 4x1K / 16x1K / 1x32K, two runs each:
// the full layer 69.9-70.0 / 284 / 1090-1094 / 1291 -> 64.3-64.7 / 261 / 992-1003 /
// 1185-1200, the sliding layer unchanged, 30.1 / 133-134 / 502-505 / 29.8; the steps,
// ab_steps.sh --kv-gb 8, 22.26-22.28 / 39.85-39.96 / 120.9-121.1 -> 22.10 / 39.43-39.53 /
// 120.2-120.8 ms). The swap is st.async stores into the other block, which count their
// bytes on its mbarrier: waiting on a cluster barrier a chunk instead (barrier.cluster, its
// release fence) made the layer no faster than one block of 64 vectors (ncu, 1x32K: 2.10
// against 2.04 ms, the warps stalled on the barrier and its fence 4 cycles an instruction).
//
// Shared memory tiles are rows of 128 bytes (64 bf16 values) in 8-row, 1,024-byte swizzle
// atoms (gemm_tile.cuh's swizzle, the layout wgmma_descriptor names), wider rows cut into
// 64-value column blocks ("subtiles") one after the other.
//
// On the H200 (attention_bench, the 26B layers at batch 1, 1K, pre-pass included): sliding
// 48.4 us, full 96.7 us, against 69.6 and 156.8 us on mma.sync (DIFFUSERVE_WGMMA=0), in the
// twelfth session; with the bf16 cache read in place, the softmax overlapping P V and the
// output staged (twenty-seventh session) 34.9 and 72.7 us, still bound by each chunk's chain
// of latencies and each item's fixed costs (ncu: the tensor pipe 20% busy). Staged
// from fp32 by synchronous loads in the kernel (eleventh session) the sliding layer took
// 57.8 us, bound by latency (ncu: 7 cycles between a warp's instructions, the tensor cores
// 25% busy), and head dim 512 167.5 us. Tried and not kept: the look-ups walking a
// shared-memory copy of the piece's spans (60.9 us, fp32 staging). Thirty-third session
// (attention_bench, H200, sliding layer at 1x1K / 16x1K, base 31.5-32.1 / 511-513 us): the
// keys and the values of a chunk as two commit groups, the chunk's end waiting for the keys
// alone (the values get a chunk more): 32.5-33.7 / 533 us; and blocks of one warpgroup (64
// vectors, chunks of 32 keys, two blocks a multiprocessor, so that one block's softmax and
// barrier would overlap the other's products): 36.3-37.3 / 577-578 us, every key read for
// half the vectors. At 16x1K (ncu) the sliding layer keeps L2 33% and DRAM 20% busy (its
// DRAM reads are the keys', values' and queries' own bytes), the SM 35%: each item's ~32 us
// is latency, at every batch (one wave of 128 items at 1x1K, 15.5 waves at 16x1K).
// Thirty-fifth session: ncu's samples (sliding layer, 1x1K, caches flushed) fell 30% before
// the chunk loop, much of it on the first barrier, waiting for the look-ups of chunks 0 and
// 1, which each thread made by walking the span table a page of 16 keys at a time; they are
// a warp's together now (KeyWalk::gather, one round trip a chunk): attention_bench, full
// layer 69 -> 67.5 us at 1x1K, 279 -> 269 at 4x1K, 390 -> 361 at 1x8K (chunks of 32 keys),
// sliding layer 30.0 -> 29.8-30.1 and 127 -> 125 at 4x1K.
#include <cooperative_groups.h>

#include <cmath>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "attention_keys.cuh"
#include "gemm_tile.cuh"
#include "kernels.h"
#include "launch.cuh"
#include "load8.cuh"
#include "mma.cuh"
#include "wgmma.cuh"

namespace diffuserve::cuda {
namespace {

// Two consumer warpgroups multiply and softmax; a producer warpgroup looks up and stages the
// keys and values. The registers go where the work is (setmaxnreg): each consumer thread holds
// 128 output accumulators, the producer's copies need few. The launch gives every thread
// kLaunchRegisters, and the consumers can take only what the producer gives up (the block's
// pool: asking for more waits forever).
constexpr int kConsumers = 256, kProducers = 128, kThreads = kConsumers + kProducers;
constexpr int kLaunchRegisters = 64 * 1024 / kThreads / 8 * 8;  // 168
constexpr int kConsumerRegisters = 232, kProducerRegisters = 40;
static_assert(kConsumers * (kConsumerRegisters - kLaunchRegisters) <=
                  kProducers * (kLaunchRegisters - kProducerRegisters),
              "the consumers' registers come from the producer's");

// The ring of chunks between the producer and the consumers: mbarriers, one phase a use.
// full[c % 3] completes once chunk c's table (its keys' positions, and whether it has any),
// keys and values are in; k_free[c % 2] once every consumer warp has read chunk c's keys
// (its scores are done); v_free[c % 3] once every consumer warp's P V of chunk c is done
// (chunk -1's, the empty product before the first, in buffer 2).
struct Ring {
  uint64_t full[3], k_free[2], v_free[3];
};
// Where a key's bf16 K and V values of the block's dims start, as the look-ups write them for
// the staging (a row of the plan's bf16 pool or of the pre-pass's copies); null: no key (its
// K and V staged as zeros).
struct KeySource {
  const __nv_bfloat16* keys;
  const __nv_bfloat16* values;
};

// The shape of an item's blocks for head dim kDim (256 or 512): kSplit blocks (a cluster),
// each staging and multiplying 256 of the dims (kSubtiles column blocks of 64) of the same
// 128 query vectors, in chunks of kKeys keys.
template <int kDim>
struct Shape {
  static constexpr int kSplit = kDim / 256;
  static constexpr int kQueries = 128;
  static constexpr int kKeys = kDim == 256 ? 64 : 32;
  static constexpr int kSubtiles = 4;
  // Shared memory: Q [subtile][query][64], K (two buffers) and V (three: a chunk's values
  // are read a chunk after its keys) [buffer][subtile][key][64] (bf16), then the chunk being
  // staged's keys' sources (KeySource), and for three chunks (one softmaxed, one staged, one
  // waiting) each key's relative position; with kSplit 2, two buffers of the other block's
  // shares of the scores ([buffer][float4 i][thread], a thread's kKeys / 2) and an mbarrier
  // for each, which counts their bytes in; the ring's mbarriers, whether each of its chunks
  // has keys; then each query vector's offset in Q.
  static constexpr int kQTile = kSubtiles * kQueries * kRowBytes;  // 64 KB
  static constexpr int kKVTile = kSubtiles * kKeys * kRowBytes;    // 32 KB at 256, 16 KB at 512
  static constexpr int kKOffset = kQTile, kVOffset = kKOffset + 2 * kKVTile, kSourcesOffset = kVOffset + 3 * kKVTile;
  static constexpr int kPositionOffset = kSourcesOffset + kKeys * int(sizeof(KeySource));
  static constexpr int kSharesOffset = kPositionOffset + 3 * kKeys * int(sizeof(int));
  static constexpr int kShareBytes = kConsumers * (kKeys / 2) * int(sizeof(float));  // a buffer
  static constexpr int kBarrierOffset = kSharesOffset + (kSplit > 1 ? 2 * kShareBytes : 0);
  static constexpr int kRingOffset = kBarrierOffset + (kSplit > 1 ? 2 * int(sizeof(uint64_t)) : 0);
  static constexpr int kHasKeysOffset = kRingOffset + int(sizeof(Ring));
  // has_keys[3], its end rounded up to the offsets' 8-byte alignment
  static constexpr int kOffsetsOffset = kHasKeysOffset + (3 * int(sizeof(int)) + 7) / 8 * 8;
  static constexpr int kSharedBytes = kOffsetsOffset + kQueries * int(sizeof(int64_t));
  // The output's staging (the block's 256 dims of every vector, fp32) reuses Q, K and V.
  static constexpr int kOutRowBytes = 256 * int(sizeof(float));
  static_assert(kSplit * kSubtiles * 64 == kDim && kSharesOffset % 16 == 0 && kOffsetsOffset % 8 == 0);
  static_assert(kQueries * kOutRowBytes <= kSourcesOffset && kSharedBytes <= 227 * 1024);
};

// The pre-pass: row r of the bf16 copies is row r - spans[s].packed of span s (the last
// span whose packed row is at most r: an fp32 span, as a bf16 one shares its packed row
// with the span after it), 8 values a thread, keys and values alike. The spans' first rows
// are read into shared memory together (up to kPackSpans of them), so that the search for
// a row's span is not a chain of dependent global loads.
constexpr int kPackThreads = 256, kPackSpans = 2048;
__global__ void pack_bf16_kernel(const DeviceKeySpan* __restrict__ spans, int span_count, int64_t rows, int64_t cols,
                                 bool vector, __nv_bfloat16* __restrict__ keys, __nv_bfloat16* __restrict__ values) {
  // Where this thread's values are comes from the plan's spans alone (no kernel writes
  // them): found before the wait for the kernels before, while their last blocks run.
  __shared__ int64_t first_row[kPackSpans];
  const bool cached = span_count <= kPackSpans;
  if (cached)
    for (int s = threadIdx.x; s < span_count; s += blockDim.x) first_row[s] = spans[s].packed;
  __syncthreads();
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x, per_row = cols / 8;
  const int64_t r = i / per_row, c = (i % per_row) * 8;
  int lo = 0, hi = span_count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if ((cached ? first_row[mid] : spans[mid].packed) <= r) lo = mid;
    else hi = mid - 1;
  }
  const DeviceKeySpan span = spans[lo];
  wait_for_earlier_kernels();
  if (i >= rows * per_row) return;
  const int64_t offset = (r - span.packed) * cols + c;
  auto convert = [&](const float* src, __nv_bfloat16* dst) {
    float v[8];
    if (vector) load8<true>(src, 0, 8, v);
    else load8<false>(src, 0, 8, v);
    *reinterpret_cast<uint4*>(dst) = {round_bf16x2(v[0], v[1]), round_bf16x2(v[2], v[3]), round_bf16x2(v[4], v[5]),
                                      round_bf16x2(v[6], v[7])};
  };
  convert(span.keys + offset, keys + r * cols + c);
  convert(span.values + offset, values + r * cols + c);
}

#ifdef DIFFUSERVE_WGMMA_DEVICE

// Four fp32 values as bf16 into a tile row at `dst` (8 bytes, aligned).
__device__ __forceinline__ void store_bf16x4(uint8_t* dst, float4 x) {
  *reinterpret_cast<uint2*>(dst) = {round_bf16x2(x.x, x.y), round_bf16x2(x.z, x.w)};
}

__device__ __forceinline__ float4 load_or_zero(const float* src) {
  return src ? *reinterpret_cast<const float4*>(src) : float4{0.0f, 0.0f, 0.0f, 0.0f};
}

// The two blocks' swap of score shares: block-local mbarriers that count the bytes the other
// block's st.async stores write, one phase a chunk (addresses: cp_async.cuh's shared_address).
// The same place in shared memory of the cluster's block `rank`.
__device__ __forceinline__ uint32_t cluster_address(uint32_t address, int rank) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(address), "r"(rank));
  return remote;
}
// The barrier's current phase completes once `bytes` have come in (its one arrival).
__device__ __forceinline__ void expect_bytes(uint32_t barrier, int bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(barrier), "r"(bytes) : "memory");
}
// The wait acquires at the block's scope, as for bulk copies' bytes: the shares land in this
// block's shared memory, counted on its own mbarrier. (At the cluster's scope the wait also
// invalidated L1 each chunk, CCTL.IVALL in the SASS.)
__device__ __forceinline__ void wait_phase(uint32_t barrier, int parity) {
  asm volatile(
      "{\n.reg .pred done;\nwait_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait_%=;\n}\n" ::"r"(barrier),
      "r"(parity)
      : "memory");
}
// An mbarrier whose phases each complete after `arrivals` arrivals.
__device__ __forceinline__ void init_barrier(uint32_t barrier, int arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(barrier), "r"(arrivals) : "memory");
}
// One arrival on the mbarrier, releasing this thread's writes before it (the block's scope).
__device__ __forceinline__ void arrive(uint32_t barrier) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(barrier) : "memory");
}
// The warp's one arrival (k_free and v_free count the consumers' warps), once all its lanes
// are done with what the barrier hands back.
__device__ __forceinline__ void arrive_as_warp(uint32_t barrier) {
  __syncwarp();
  if ((threadIdx.x & 31) == 0) arrive(barrier);
}
// One arrival on the mbarrier once this thread's cp.async copies so far have landed (counted
// in the barrier's expected arrivals: .noinc).
__device__ __forceinline__ void arrive_when_copied(uint32_t barrier) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(barrier) : "memory");
}
// Barriers among the consumers alone (named barrier 1) and the producer alone (2, with the
// OR of a predicate or without), once the warpgroups have parted.
__device__ __forceinline__ void consumers_sync() { asm volatile("bar.sync 1, %0;" ::"n"(kConsumers) : "memory"); }
__device__ __forceinline__ void producer_sync() { asm volatile("bar.sync 2, %0;" ::"n"(kProducers) : "memory"); }
__device__ __forceinline__ bool producer_sync_or(bool p) {
  int any;
  asm volatile(
      "{\n.reg .pred p, q;\nsetp.ne.s32 p, %1, 0;\nbar.red.or.pred q, 2, %2, p;\nselp.s32 %0, 1, 0, q;\n}\n"
      : "=r"(any)
      : "r"(int(p)), "n"(kProducers)
      : "memory");
  return any != 0;
}
// This warpgroup's registers a thread from here on, fewer or more than the launch gave (all
// its threads call it alike; more waits until the other warpgroups have given theirs up).
template <int kRegisters>
__device__ __forceinline__ void give_up_registers() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegisters));
}
template <int kRegisters>
__device__ __forceinline__ void take_registers() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegisters));
}
// v to `remote` (a cluster address), its 16 bytes counted on the mbarrier at `remote_barrier`.
__device__ __forceinline__ void store_counted(uint32_t remote, float4 v, uint32_t remote_barrier) {
  asm volatile(
      "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];" ::"r"(remote),
      "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w), "r"(remote_barrier)
      : "memory");
}
#endif

template <int kDim>
__global__ void __launch_bounds__(kThreads, 1)
    attention_wgmma_kernel(const float* __restrict__ q, const __nv_bfloat16* __restrict__ q_bf16,
                           const AttentionOutput out, float* __restrict__ partial_out, float2* __restrict__ partial_ml,
                           const __nv_bfloat16* __restrict__ packed_keys,
                           const __nv_bfloat16* __restrict__ packed_values, const __nv_bfloat16* __restrict__ pool_keys,
                           const __nv_bfloat16* __restrict__ pool_values,
                           const DeviceAttentionSegment* __restrict__ segments, const DeviceKeySpan* __restrict__ spans,
                           const AttentionItem* __restrict__ items, int num_heads, int num_kv_heads) {
#ifdef DIFFUSERVE_WGMMA_DEVICE
  using S = Shape<kDim>;
  constexpr int kQueries = S::kQueries, kKeys = S::kKeys, kKVTile = S::kKVTile;
  constexpr int kPieces = 256 / 8;  // 16-byte pieces of a key's row in the block's dims
  extern __shared__ __align__(1024) uint8_t smem[];
  auto key_pos = reinterpret_cast<int (*)[kKeys]>(smem + S::kPositionOffset);  // relative_position, or kNoKey
  int* const has_keys = reinterpret_cast<int*>(smem + S::kHasKeysOffset);      // a chunk's, by table slot
  Ring* const ring = reinterpret_cast<Ring*>(smem + S::kRingOffset);
  const uint32_t q_base = shared_address(smem);
  const uint32_t k_base = q_base + S::kKOffset, v_base = q_base + S::kVOffset;

  // This block's dims of the head: 256 rank .. 256 rank + 255 (rank in the item's cluster).
  const cooperative_groups::cluster_group cluster = cooperative_groups::this_cluster();
  const int rank = S::kSplit > 1 ? int(cluster.block_rank()) : 0;
  const AttentionItem item = items[blockIdx.x / S::kSplit];
  const DeviceAttentionSegment seg = segments[item.segment];
  const ItemQueries queries(seg, item, num_heads, num_kv_heads, kDim);
  const int nq = queries.count;
  const int64_t dims = 256 * rank;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  // Where each vector is in Q and the output (-1: none), worked out once (the division by
  // the GQA group is dozens of instructions, and each thread reads 32 rows of Q).
  int64_t* const at = reinterpret_cast<int64_t*>(smem + S::kOffsetsOffset);
  if (tid < kQueries) at[tid] = tid < nq ? queries.offset(tid) : -1;
  // The ring's mbarriers: full expects the producer's threads (their copies) and its thread
  // 0 (the table); the others, a consumer warp each. With kSplit 2, the swap's too, each
  // expecting the first chunk it takes (0 and 1).
  const uint32_t shares = shared_address(smem + S::kSharesOffset), barriers = shared_address(smem + S::kBarrierOffset);
  if (tid == 0) {
    for (int b = 0; b < 3; ++b) {
      init_barrier(shared_address(&ring->full[b]), kProducers + 1);
      init_barrier(shared_address(&ring->v_free[b]), kConsumers / 32);
    }
    for (int b = 0; b < 2; ++b) init_barrier(shared_address(&ring->k_free[b]), kConsumers / 32);
    if constexpr (S::kSplit > 1)
      for (int b = 0; b < 2; ++b) {
        init_barrier(barriers + 8 * b, 1);
        expect_bytes(barriers + 8 * b, S::kShareBytes);
      }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  // The vectors' offsets and the mbarriers are ready; with kSplit 2, every block of the
  // cluster has started, its mbarriers ready for the other's stores.
  if constexpr (S::kSplit > 1) cluster.sync();
  else __syncthreads();

  if (tid >= kConsumers) {
    // The producer: each chunk's table (KeyWalk::gather, threads 0..kKeys-1 of the warpgroup,
    // thread i the chunk's slot i: its key's source and position), then its keys and values
    // by cp.async into K's buffer c % 2 and V's c % 3: 16-byte piece p of a key's row (this KV
    // head's values in the block's dims) to subtile p / 8, chunk p % 8 of the key's tile row;
    // consecutive threads copy a key's contiguous bytes (a missing key's zeros read nothing).
    // It runs ahead of the consumers as far as the buffers let it.
    give_up_registers<kProducerRegisters>();
    const unsigned ptid = tid - kConsumers;
    KeySource* const sources = reinterpret_cast<KeySource*>(smem + S::kSourcesOffset);
    const int64_t kv_stride = int64_t(num_kv_heads) * kDim, head = int64_t(item.kv_head) * kDim + dims;
    // This thread copies 16-byte piece `piece` of the rows of keys first_key, first_key +
    // kKeysAtOnce, ...: to subtile piece / 8, chunk piece % 8 of each key's tile row.
    constexpr int kKeysAtOnce = kProducers / kPieces;
    const unsigned piece = ptid % kPieces, first_key = ptid / kPieces;
    const uint32_t piece_column = (piece / 8) * kKeys * kRowBytes;
    const KeyWalk walk = queries.keys(spans);
    Cursor cursor{item.span, item.key};
    for (int c = 0;; ++c) {
      const int slot = c % 3;
      // The positions' slot was chunk c - 3's and K's buffer chunk c - 2's: free once chunk
      // c - 2's scores are done.
      wait_phase(shared_address(&ring->k_free[c % 2]), (c / 2 + 1) & 1);
      bool mine = false;
      if (ptid < kKeys) {
        sources[ptid] = {nullptr, nullptr}, key_pos[slot][ptid] = kNoKey;  // unless a key is found for it
        mine = walk.gather<kKeys>(cursor, ptid / 32, lane, c == 0, [&](int i, int span, int key) {
          const DeviceKeySpan s = spans[span];
          const bool pooled = s.pool_row >= 0;
          const int64_t at = (pooled ? s.pool_row + key : s.packed + key) * kv_stride + head;
          sources[i] = {(pooled ? pool_keys : packed_keys) + at, (pooled ? pool_values : packed_values) + at};
          key_pos[slot][i] = relative_position(s.first_position + key, seg.first_position);
        }) > 0;
      }
      // The plan's tables, which no kernel writes, were read before the wait for the kernels
      // before (chunk 0's look-ups overlap their last blocks); the keys and values after it.
      if (c == 0) wait_for_earlier_kernels();
      const bool have = producer_sync_or(mine);  // and the sources are the producer's to read
      if (have) {
        // V's buffer was chunk c - 3's (chunk -1's for buffer 2): free once its P V is done.
        wait_phase(shared_address(&ring->v_free[slot]), ((c / 3 + (slot == 2)) & 1) ^ 1);
        const uint32_t k_tile = shared_address(smem + S::kKOffset + (c % 2) * kKVTile) + piece_column;
        const uint32_t v_tile = shared_address(smem + S::kVOffset + slot * kKVTile) + piece_column;
#pragma unroll 4
        for (int i = 0; i < kKeys / kKeysAtOnce; ++i) {
          const int key = first_key + kKeysAtOnce * i;
          const KeySource src = sources[key];
          const uint32_t dst = swizzle(key, piece % 8);
          const bool present = src.keys != nullptr;  // else zeros, the source (a valid address) not read
          cp_async16(k_tile + dst, present ? src.keys + 8 * piece : static_cast<const void*>(spans), present);
          cp_async16(v_tile + dst, present ? src.values + 8 * piece : static_cast<const void*>(spans), present);
        }
      }
      if (ptid == 0) has_keys[slot] = have;
      producer_sync();  // every thread has read the sources: the next chunk's look-ups may write them
      arrive_when_copied(shared_address(&ring->full[slot]));
      if (ptid == 0) arrive(shared_address(&ring->full[slot]));  // the table and has_keys
      if (!have) return;
    }
  }

  // The consumers: two warpgroups of 64 query vectors each.
  take_registers<kConsumerRegisters>();
  const int g = lane >> 2, t = lane & 3;
  const int wg = warp / 4;  // this thread's warpgroup: query vectors 64 wg .. 64 wg + 63
  // The two query vectors whose scores and outputs this thread holds (accumulator rows g
  // and g + 8 of its warp's 16), the keys each sees, and their running max and this
  // thread's share of their sums.
  int row[2];
  VisibleKeys visible[2];
  float m_run[2], l_run[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    row[h] = 64 * wg + 16 * (warp % 4) + g + 8 * h;
    visible[h] = queries.visible(row[h]);
    m_run[h] = -INFINITY, l_run[h] = 0.0f;
  }

  wait_for_earlier_kernels();
  // Q's rows (the block's dims) as bf16 into its [subtile][row][64] tile, zeros past the
  // item's vectors. Where the query norms wrote them rounded already (q_bf16), by cp.async
  // as K and V are staged: 16-byte piece p of row r to subtile p / 8, chunk p % 8 of the
  // row. Else from the fp32 rows: row r, float4 column c from q, every load of the thread
  // issued before the first store (one round trip to memory, not one per few rows).
  // Consecutive threads take a row's contiguous bytes.
  if (q_bf16) {
#pragma unroll
    for (int i = 0; i < kQueries * kPieces / kConsumers; ++i) {
      const int r = (tid + kConsumers * i) / kPieces, p = (tid + kConsumers * i) % kPieces;
      cp_async16(q_base + (p / 8) * kQueries * kRowBytes + swizzle(r, p % 8),
                 q_bf16 + (r < nq ? at[r] : 0) + dims + 8 * p, r < nq);
    }
    cp_async_commit();
  } else {
    constexpr int kRowThreads = 256 / 4, kRowsAtOnce = kConsumers / kRowThreads, kLoads = kQueries / kRowsAtOnce;
    const int c = tid % kRowThreads;
    float4 x[kLoads];
#pragma unroll
    for (int i = 0; i < kLoads; ++i) {
      const int j = tid / kRowThreads + kRowsAtOnce * i;
      x[i] = load_or_zero(j < nq ? q + at[j] + dims + 4 * c : nullptr);
    }
#pragma unroll
    for (int i = 0; i < kLoads; ++i) {
      const int r = tid / kRowThreads + kRowsAtOnce * i;
      store_bf16x4(smem + (c / 16) * kQueries * kRowBytes + swizzle(r, (c % 16) / 2) + 8 * (c % 2), x[i]);
    }
  }
  // V's buffer 2, which chunk 0's empty P V reads, as zeros (not NaNs that 0 x NaN would keep):
  // the producer fills it with chunk 2's values only after that product.
  for (int i = tid; i < kKVTile / 16; i += kConsumers)
    reinterpret_cast<uint4*>(smem + S::kVOffset + 2 * kKVTile)[i] = uint4{0, 0, 0, 0};
  cp_async_wait<0>();
  fence_proxy_async();  // Q's stores or copies and the zeros, for the tensor cores
  consumers_sync();

  // The loop overlaps each chunk's softmax with the previous chunk's P V product: chunk n's
  // scores and chunk n - 1's P V go to the tensor cores together, the softmax of chunk n
  // runs once its scores are in while P V still runs, and only then is the output rescaled
  // to the new max (the tensor cores idled through the softmax when each chunk's products
  // waited on its own). A chunk's V is read one chunk later than its K, so V has three
  // buffers to K's two. The warpgroups wait for the producer's chunks and hand back their
  // buffers each on its own, with no barrier between them.
  float o[128] = {};
  // The previous chunk's probabilities, P V's A fragments; before chunk 0, zeros, whose
  // product with V's buffer 2 (zeros too, for this) adds nothing. (Leaving that product out
  // of chunk 0 with a branch made ptxas serialize every wgmma of the loop.)
  uint32_t p[kKeys / 16][4] = {};
  // P V of the previous chunk (its V in buffer (n + 2) % 3).
  const uint64_t v_desc = wgmma_descriptor(v_base, kKeys * kRowBytes);
  auto multiply_values = [&](int n) {
#pragma unroll
    for (int ks = 0; ks < kKeys / 16; ++ks)
      wgmma_bf16_rs256(o, p[ks], wgmma_advance(v_desc, ((n + 2) % 3) * kKVTile + 16 * ks * kRowBytes));
  };
  // This warpgroup's Q rows in subtile 0, K's first buffer and V's (N-major: the next 64 dims
  // a subtile on).
  const uint64_t q_desc = wgmma_descriptor(q_base + wg * 64 * kRowBytes), k_desc = wgmma_descriptor(k_base);
  int n = 0;
  for (;; ++n) {
    const int slot = n % 3;
    wait_phase(shared_address(&ring->full[slot]), (n / 3) & 1);
    if (!has_keys[slot]) break;
    fence_proxy_async();  // the producer's copies, for the tensor cores
    // S = Q K^T over the block's dims: K steps of 16 (32 bytes of a subtile row); then the
    // previous chunk's P V, a commit group of its own.
    float s[kKeys / 2];
    wgmma_fence();
#pragma unroll
    for (int step = 0; step < 256 / 16; ++step) {
      const uint32_t column = 32 * (step % 4);
      wgmma_bf16<kKeys>(s, wgmma_advance(q_desc, (step / 4) * kQueries * kRowBytes + column),
                        wgmma_advance(k_desc, (n % 2) * kKVTile + (step / 4) * kKeys * kRowBytes + column), step > 0);
    }
    wgmma_commit();
    multiply_values(n);
    wgmma_commit();
    wgmma_wait<1>();  // the scores (P V may still run)
    wgmma_hold(s);
    // K's buffer is read: the producer may stage chunk n + 2 there.
    arrive_as_warp(shared_address(&ring->k_free[n % 2]));
    if constexpr (S::kSplit > 1) {
      // The scores over the other block's dims: this thread's share to its twin thread's place
      // in buffer n % 2 there, the twin's from this block's, added (both blocks then hold the
      // same sums). Chunk n + 2 reuses the buffer: this block's thread 0 expects it once
      // chunk n's shares are in, and the other block sends it only after this block's shares
      // of chunk n + 1, which leave after every thread here has read chunk n's (the
      // consumers' barrier below).
      const int b = n & 1;
      const uint32_t mine = shares + b * S::kShareBytes + 16 * tid, barrier = barriers + 8 * b;
      const uint32_t theirs = cluster_address(mine, rank ^ 1), their_barrier = cluster_address(barrier, rank ^ 1);
#pragma unroll
      for (int i = 0; i < kKeys / 8; ++i)
        store_counted(theirs + 16 * kConsumers * i, {s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]},
                      their_barrier);
      wait_phase(barrier, (n >> 1) & 1);
      if (tid == 0) expect_bytes(barrier, S::kShareBytes);
      const auto* in = reinterpret_cast<const float4*>(smem + S::kSharesOffset + b * S::kShareBytes) + tid;
#pragma unroll
      for (int i = 0; i < kKeys / 8; ++i) {
        const float4 x = in[i * kConsumers];
        s[4 * i] += x.x, s[4 * i + 1] += x.y, s[4 * i + 2] += x.z, s[4 * i + 3] += x.w;
      }
      consumers_sync();  // every thread here has read chunk n's shares
    }

    // Mask and online softmax: s[4 j + 2 h + e] is row h's score of key 8 j + 2 t + e.
    const int* pos = key_pos[slot];
    float row_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < kKeys / 8; ++j) {
      const int2 kp = *reinterpret_cast<const int2*>(pos + 8 * j + 2 * t);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float& s0 = s[4 * j + 2 * h];
        float& s1 = s[4 * j + 2 * h + 1];
        s0 = visible[h].sees(kp.x) ? s0 : -INFINITY;
        s1 = visible[h].sees(kp.y) ? s1 : -INFINITY;
        row_max[h] = max_nan(row_max[h], max_nan(s0, s1));
      }
    }
    float alpha[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      row_max[h] = max_nan(row_max[h], __shfl_xor_sync(0xffffffffu, row_max[h], 1));
      row_max[h] = max_nan(row_max[h], __shfl_xor_sync(0xffffffffu, row_max[h], 2));
      alpha[h] = raise_max(m_run[h], row_max[h]);
      float sum = 0.0f;
#pragma unroll
      for (int j = 0; j < kKeys / 8; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& x = s[4 * j + 2 * h + e];
          x = softmax_weight(x, m_run[h]);
          sum += x;
        }
      l_run[h] = l_run[h] * alpha[h] + sum;
    }
    // P as A fragments: K step ks (keys 16 ks..16 ks + 15) is s[8 ks..8 ks + 7], register r
    // the pair s[8 ks + 2 r], s[8 ks + 2 r + 1] (rows g, g + 8, g, g + 8; keys 2t, 2t, 2t + 8,
    // 2t + 8). The previous chunk's P V reads the old ones until it is done.
    uint32_t p_next[kKeys / 16][4];
#pragma unroll
    for (int ks = 0; ks < kKeys / 16; ++ks)
#pragma unroll
      for (int r = 0; r < 4; ++r) p_next[ks][r] = round_bf16x2(s[8 * ks + 2 * r], s[8 * ks + 2 * r + 1]);
    // p is live until P V is done, so p_next's conversions do not write its registers (where
    // they could, ptxas serialized every wgmma of the loop).
    wgmma_hold(p);
    wgmma_wait<0>();
    wgmma_hold(o);
    // The previous chunk's values are read: the producer may stage chunk n + 2 there.
    arrive_as_warp(shared_address(&ring->v_free[(n + 2) % 3]));
    // Rescaling by 1 changes nothing: skipped while no row of the warp has a new max.
    if (__any_sync(0xffffffffu, alpha[0] != 1.0f || alpha[1] != 1.0f)) {
#pragma unroll
      for (int i = 0; i < 128; ++i) o[i] *= alpha[(i / 2) % 2];
    }
#pragma unroll
    for (int ks = 0; ks < kKeys / 16; ++ks)
#pragma unroll
      for (int r = 0; r < 4; ++r) p[ks][r] = p_next[ks][r];
  }
  // The last chunk's P V (none without keys: a branch the whole block takes alike).
  if (n > 0) {
    wgmma_fence();
    multiply_values(n);
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_hold(o);
  }

  // The output, normalised by this piece's softmax sum (zero where no key was visible): to
  // `out` when the piece is all the rows see, else to partial slot item.slot with the
  // rows' max and sum (the cluster's first block: both have the same), for the merge.
  // o[4 j + 2 h + e] is row h's dim dims + 8 j + 2 t + e. The rows go through shared memory
  // (Q's, K's and V's tiles, read by no one now: the last products are done, the producer
  // stopped at the empty chunk, and the consumers meet at a barrier first), so that a warp's
  // stores are 512 contiguous bytes of one row, not 32 bytes of each of 8 rows: in the
  // fragments' order the stores took an eighth of the kernel's time (ncu, the sliding layer
  // at batch 1, 1K), throttled by the memory pipeline's queue. A row is kOutRowBytes, its
  // 16-byte chunk u at u ^ 2 (row % 8) (a warp's fragment stores, 8 rows of 32 bytes, then
  // fill every bank twice, the least for 256 bytes). Tried and not kept (sixty-seventh
  // session, H100, attention_bench, sliding / full layer at 1x1K, 30.1-30.9 / 64.5-64.9 us):
  // a batch of 16 rows' loads before their stores, each in its own registers (ptxas reused one
  // float4's for every load of the rolled loop), 30.5-30.7 / 64.5-65.1; the partial slots' rows
  // written by bulk copies (cp.async.bulk, a row a thread, from rows padded by 16 bytes),
  // 32.9-33.3 / 66.7-67.2. Nor kept (sixty-eighth session, the performance log says more):
  // each merge's pieces as one cluster that adds them up in distributed shared memory (an
  // H100 holds 30 clusters of 4 of these blocks at once, fewer than the batch-1 layers' 32
  // merges), and one block walking all of a row group's pieces and merging them (a piece
  // cost as much after another as in a block of its own: the batch-1 sliding layer's items
  // walked 4 a block took 121.6 us against 33.2).
  consumers_sync();
  auto staged = [&](int r, int u) { return smem + r * S::kOutRowBytes + 16 * (u ^ ((r & 7) << 1)); };
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float l = l_run[h];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const int j = row[h];
    const float inv = l != 0.0f ? 1.0f / l : 0.0f;  // 0: no key seen; NaN stays NaN
#pragma unroll
    for (int c = 0; c < 256 / 8; ++c)  // dims 8 c + 2 t, + 1: chunk 2 c + t / 2, its half t % 2
      *reinterpret_cast<float2*>(staged(j, 2 * c + t / 2) + 8 * (t % 2)) = {o[4 * c + 2 * h] * inv,
                                                                            o[4 * c + 2 * h + 1] * inv};
    if (item.slot >= 0 && t == 0 && rank == 0 && j < nq) partial_ml[int64_t(item.slot) * kQueries + j] = {m_run[h], l};
  }
  consumers_sync();
  constexpr int kChunks = S::kOutRowBytes / 16;
  for (int i = tid; i < nq * kChunks; i += kConsumers) {
    const int j = i / kChunks, u = i % kChunks;
    const float4 x = *reinterpret_cast<const float4*>(staged(j, u));
    const float v[4] = {x.x, x.y, x.z, x.w};
    const int64_t dim = dims + 4 * u;
    if (item.slot < 0) store_output(out, at[j] + dim, v);
    else __stcg(reinterpret_cast<float4*>(queries.partial(partial_out, kQueries, j) + dim), x);  // one v4 store
  }
#else
  __trap();  // attention_wgmma_serves is false where the build has no sm_90a code
#endif
}

}  // namespace

bool attention_wgmma_serves(int head_dim, bool round_bf16) {
  return (head_dim == 256 || head_dim == 512) && round_bf16 && wgmma_enabled();
}

// f(std::integral_constant<int, kDim>) for the head dims served here.
template <class F>
void with_wgmma_head_dim(int head_dim, F&& f) {
  if (head_dim == 256) f(std::integral_constant<int, 256>{});
  else if (head_dim == 512) f(std::integral_constant<int, 512>{});
  else throw std::invalid_argument("attention_wgmma: head dim " + std::to_string(head_dim) + " (256 or 512)");
}

int attention_wgmma_queries(int head_dim) {
  int queries = 0;
  with_wgmma_head_dim(head_dim, [&](auto dim) { queries = Shape<decltype(dim)::value>::kQueries; });
  return queries;
}

int attention_wgmma_resident_items(int head_dim) {
  int items = 0;
  with_wgmma_head_dim(head_dim, [&](auto dim) {
    constexpr int kDim = decltype(dim)::value;
    items = resident_clusters(Shape<kDim>::kSplit, attention_wgmma_kernel<kDim>, kThreads, Shape<kDim>::kSharedBytes);
  });
  return items;
}

void attention_wgmma(const AttentionQueries& q, const AttentionOutput& out, float* partial_out, float2* partial_ml,
                     __nv_bfloat16* packed_keys, __nv_bfloat16* packed_values, const AttentionPlan& plan,
                     const AttentionTables& tables, int num_heads, int num_kv_heads, cudaStream_t stream) {
  if (plan.packed_cols != int64_t(num_kv_heads) * plan.head_dim)
    throw std::invalid_argument("attention_wgmma: the plan's bf16 rows are not num_kv_heads x head_dim values");
  if (plan.packed_rows > INT32_MAX) throw std::invalid_argument("attention_wgmma: more than 2^31 keys");
  if (plan.packed_rows) {
    bool vector = true;  // whole aligned float4s in every span
    for (const DeviceKeySpan& s : plan.spans)
      vector =
          vector && reinterpret_cast<uintptr_t>(s.keys) % 16 == 0 && reinterpret_cast<uintptr_t>(s.values) % 16 == 0;
    const int64_t threads = plan.packed_rows * (plan.packed_cols / 8);
    launch(pack_bf16_kernel, unsigned((threads + kPackThreads - 1) / kPackThreads), kPackThreads, 0, stream,
           tables.spans, int(plan.spans.size()), plan.packed_rows, plan.packed_cols, vector, packed_keys,
           packed_values);
  }
  with_wgmma_head_dim(plan.head_dim, [&](auto dim) {
    constexpr int kDim = decltype(dim)::value;
    constexpr int kBytes = Shape<kDim>::kSharedBytes;
    cudaFuncSetAttribute(attention_wgmma_kernel<kDim>, cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes);
    constexpr int kSplit = Shape<kDim>::kSplit;
    launch_clusters(kSplit, attention_wgmma_kernel<kDim>, unsigned(plan.items.size() * kSplit), kThreads, kBytes,
                    stream, q.values, q.bf16, out, partial_out, partial_ml,
                    plan.rounded_keys ? plan.rounded_keys : packed_keys,
                    plan.rounded_values ? plan.rounded_values : packed_values, plan.pool_keys, plan.pool_values,
                    tables.segments, tables.spans, tables.items, num_heads, num_kv_heads);
  });
}

}  // namespace diffuserve::cuda
