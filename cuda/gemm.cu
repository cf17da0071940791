// Segmented bf16 GEMM on tensor cores (mma.sync m16n8k16, fp32 accumulation).
//
// One launch computes a product per segment (one for a dense layer, one per expert for
// the MoE), each over its own rows of X and its own weight matrix.
//
// X is fp32 and enters the tensor cores as two bf16 parts, hi = bf16(x) and lo =
// bf16(x - hi), each multiplied by the bf16 weights: 16 bits of mantissa instead of 8, so
// the product matches the fp32 reference (whose weights are the same bf16 values) to
// fp32-like precision. A pre-pass writes X as rows of [hi | lo] bf16 (K zero-padded to a
// multiple of 64) into the caller's scratch, so the main loop is a plain bf16 GEMM of A =
// hi and lo against the same weight tile, with nothing to convert per tile. The pre-pass
// keeps X's row order and the main loop gathers A rows through row_map (the MoE's up
// projection), so a token is converted once however many experts it goes to. With round_x
// (linear_nt's round_bf16(x) @ w) only hi is written and multiplied: lo would be zero.
//
// Main loop: block tiles of BM x BN outputs, K in slices of 64 (128 bytes of bf16 per tile
// row), streamed global -> shared memory by cp.async into a ring of 3-4 stages, so the
// next slices are in flight while the tensor cores work on the current one. Each tile row
// keeps its eight 16-byte chunks XOR-swizzled by (row % 8), which makes both the cp.async
// stores and the ldmatrix reads (8 rows of one chunk column) free of bank conflicts.
// Fragments come from ldmatrix.x4, without .trans: W is [N, K], K contiguous, which is
// already the MMA's "col" B layout. Three tile shapes:
//   128 x 256, 8 warps of 64 x 64: tall inputs (dense at large batch, the lm_head, the MoE
//       at large batch). Per 16-wide K step a warp loads 8 A and 4 B fragments for 64
//       MMAs, which keeps shared-memory traffic below the tensor-core time.
//   64 x 128, 4 warps of 32 x 64: a few hundred rows, where 128 x 256 tiles would leave
//       most multiprocessors idle (batch 1's 256 rows); two blocks fit per multiprocessor.
//   16 x 128, 4 warps of 16 x 32: the MoE at small batch, a dozen rows per expert, where
//       the kernel's job is streaming weights at memory bandwidth: four stages and two
//       blocks per multiprocessor keep ~100 KB of weights in flight on each.
// Every shape accumulates each output in the same order (16-wide K steps in order, hi then
// lo), so a row's result does not depend on the tile shape its batch size picked: batched
// and single-sequence runs agree bitwise.
//
// Packed weights (FP8, NVFP4: packed_weight.h) stream as they are stored, 1 or 1/2 byte
// per value (plus NVFP4's E4M3 scale per 16), into the ring; each iteration first converts
// the slice's weights to the bf16 tile the MMAs read (packed_decode.cuh: exact), so the
// main loop and its summation order are the bf16 path's. The per-row fp32 scale (FP8's
// scale, NVFP4's global scale) is applied to the finished sums.
//
// Weights stream by 16-byte cp.async (4-byte for NVFP4's scales) where their rows allow
// it (whole, aligned chunks); partial chunks are zero-filled past N and K. Otherwise (tiny
// test models) the same bytes are copied one by one.
#include <algorithm>
#include <memory>
#include <stdexcept>

#include "kernels.h"
#include "mma.cuh"
#include "packed_decode.cuh"

namespace diffuserve::cuda {
namespace {

constexpr int kBK = 64;  // K per pipeline stage

int64_t padded_k(int64_t k) { return (k + kBK - 1) / kBK * kBK; }

int multiprocessors() {
  int device = 0, count = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device);
  return std::max(count, 1);
}

__device__ __forceinline__ uint32_t shared_address(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }

// 16 bytes global -> shared, bypassing L1; zero-filled (nothing read) when !valid.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}

// Of `most` bytes, those before an end `remaining` bytes away.
__device__ __forceinline__ int bytes_before(int64_t remaining, int most) {
  return remaining <= 0 ? 0 : remaining >= most ? most : int(remaining);
}

// kBytes (16 or 4) bytes global -> shared, of which the first `valid` are read and the rest
// zero-filled: by cp.async when `async` (src aligned to kBytes), else byte by byte.
template <int kBytes>
__device__ __forceinline__ void copy_bytes(uint8_t* dst, const uint8_t* src, int valid, bool async) {
  if (async) {
    if constexpr (kBytes == 16)
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address(dst)), "l"(src), "r"(valid));
    else
      asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(shared_address(dst)), "l"(src), "r"(valid));
  } else {
#pragma unroll
    for (int e = 0; e < kBytes; ++e) dst[e] = e < valid ? src[e] : 0;
  }
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// Four 8x8 bf16 matrices; lanes 8i..8i+7 give the row addresses of matrix i, and each
// thread gets element (lane / 4, 2 * (lane % 4) + {0, 1}) of matrix i in register i.
__device__ __forceinline__ void ldmatrix_x4(uint32_t* r, uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

// Element offset of (row, 16-byte chunk) in a tile of kBK-wide rows, chunks swizzled.
__device__ __forceinline__ int swizzle(int row, int chunk) { return row * kBK + ((chunk ^ (row & 7)) << 3); }

struct Params {
  const __nv_bfloat16* a;  // X as bf16: row r at a + r * planes * kp, hi then (planes 2) lo
  int64_t kp;              // K padded to kBK
  const int64_t* row_map;
  const GemmSegment* segments;
  const GemmTile* tiles;
  GemmSegment single;  // the segment when tiles is null (dense)
  int64_t n, k;
  bool w_vector;   // weights by cp.async (whole aligned chunks per row, see gemm())
  bool y_pairs;    // Y by float2 stores (ldy even, aligned)
  int64_t k_slice;  // split-K: K columns per blockIdx.z, a multiple of kBK
  float* y;
  int64_t ldy, y_copy_stride;
};

// Bytes of a stage's W: a bf16 tile, or the packed slice (NVFP4: values, then the scales).
__host__ __device__ constexpr int weight_stage_bytes(WeightFormat format, int rows) {
  return format == WeightFormat::Plain ? rows * kBK * 2
         : format == WeightFormat::Fp8 ? rows * kBK
                                       : rows * (kBK / 2 + kBK / 16);
}

// A block tile of kBM x kBN outputs, warps of (kBM / kWarpsM) x (kBN / kWarpsN), a ring of
// kStages K-slices (kPackedStages with packed weights, whose slices are smaller), kBlocks
// resident per multiprocessor (shared memory allows it).
template <int kBM_, int kBN_, int kWarpsM_, int kWarpsN_, int kStages_, int kPackedStages_, int kBlocks_>
struct Shape {
  static constexpr int kBM = kBM_, kBN = kBN_, kWarpsM = kWarpsM_, kWarpsN = kWarpsN_;
  static constexpr int kBlocks = kBlocks_, kThreads = kWarpsM * kWarpsN * 32;
  __host__ __device__ static constexpr int stages(WeightFormat format) { return format == WeightFormat::Plain ? kStages_ : kPackedStages_; }
  // The ring, then for packed weights the bf16 tile they are converted into.
  static constexpr int smem_bytes(int planes, WeightFormat format) {
    const int packed_tile = format == WeightFormat::Plain ? 0 : weight_stage_bytes(WeightFormat::Plain, kBN);
    return stages(format) * (planes * kBM * kBK * 2 + weight_stage_bytes(format, kBN)) + packed_tile;
  }
};
// Shared memory with hi and lo planes, bf16 / FP8 / NVFP4 weights:
using Small = Shape<16, 128, 1, 4, 4, 6, 2>;    // 80 / 88 / 67 KB
using Medium = Shape<64, 128, 2, 2, 3, 3, 2>;   // 96 / 88 / 78 KB
using Large = Shape<128, 256, 2, 4, 3, 3, 1>;   // 192 / 176 / 155 KB

template <class S, int kPlanes, WeightFormat kFormat>
__global__ void __launch_bounds__(S::kThreads, S::kBlocks) gemm_kernel(const Params p) {
  constexpr int kBM = S::kBM, kBN = S::kBN, kStages = S::stages(kFormat), kThreads = S::kThreads;
  constexpr int kWM = kBM / S::kWarpsM, kWN = kBN / S::kWarpsN;
  constexpr int kTilesM = kWM / 16, kTilesN = kWN / 8;  // m16 / n8 MMA tiles per warp
  constexpr int kARows = kPlanes * kBM;                 // A tile rows per stage: hi rows, then lo rows
  constexpr int kABytes = kARows * kBK * 2, kStageBytes = kABytes + weight_stage_bytes(kFormat, kBN);
  constexpr int kRowStep = kThreads / 8;  // tile rows one pass of the block's 16-byte copies covers
  constexpr int kALoads = kBM / kRowStep;
  constexpr bool kPacked = kFormat != WeightFormat::Plain;
  // A stage's W row: 16-byte chunks of the bf16 tile (swizzled) or of the packed slice (in order).
  constexpr int kWRowBytes = weight_stage_bytes(kFormat, 1) - (kFormat == WeightFormat::Nvfp4 ? kBK / 16 : 0);
  constexpr int kWChunks = kBN * kWRowBytes / 16, kWLoads = kWChunks / kThreads;
  constexpr int kGroups = kBN * kBK / 16, kConverts = kGroups / kThreads;  // 16-value groups of a packed slice
  static_assert(kBM % kRowStep == 0 && kWChunks % kThreads == 0 && kGroups % kThreads == 0 && kTilesN % 2 == 0 &&
                    kBN <= kThreads,  // a thread per W row for NVFP4's scales
                "tile shape");
  extern __shared__ __align__(128) uint8_t smem[];
  __nv_bfloat16* const packed_tile = reinterpret_cast<__nv_bfloat16*>(smem + kStages * kStageBytes);

  GemmSegment seg = p.single;
  int m0 = blockIdx.y * kBM;  // dense: tiles follow blockIdx.y
  if (p.tiles) {
    const GemmTile tile = p.tiles[blockIdx.y];
    if (tile.segment < 0) return;  // an unused slot of a device-planned tile list
    seg = p.segments[tile.segment];
    m0 = tile.m0;
  }
  const int rows = min(kBM, seg.rows - m0);
  const int64_t n0 = int64_t(blockIdx.x) * kBN, n = p.n, k = p.k;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int warp_m = warp / S::kWarpsN, warp_n = warp % S::kWarpsN;

  // This thread's copies: chunk tid % 8 of tile rows tid / 8 + j * kRowStep, A and W.
  const int copy_row = tid / 8, copy_chunk = tid % 8;
  const __nv_bfloat16* a_src[kALoads];
#pragma unroll
  for (int j = 0; j < kALoads; ++j) {
    const int r = copy_row + j * kRowStep;
    int64_t xr = 0;  // rows past the tile's end are zero-filled from a valid address
    if (r < rows) {
      const int64_t i = seg.x_row + m0 + r;
      xr = p.row_map ? p.row_map[i] : i;
    }
    a_src[j] = p.a + xr * kPlanes * p.kp + copy_chunk * 8;
  }
  const uint8_t* const w_values = static_cast<const uint8_t*>(seg.w.values);
  const int64_t w_row_bytes = weight_row_bytes(kFormat, k);
  // This thread's W chunks: chunk w_chunk of slice rows w_row + j * kWRowStep.
  constexpr int kPerRow = kWRowBytes / 16, kWRowStep = kThreads / kPerRow;
  static_assert(kThreads % kPerRow == 0, "W chunk mapping");
  const int w_row = tid / kPerRow, w_chunk = tid % kPerRow;
  const uint8_t* const w_src = w_values + (n0 + w_row) * w_row_bytes + 16 * w_chunk;
  const int64_t w_step = int64_t(kWRowStep) * w_row_bytes;

  // Stage `stage` <- K columns [k0, k0 + kBK) of the A rows and the W rows.
  auto load_tile = [&](int stage, int64_t k0) {
    uint8_t* const base = smem + stage * kStageBytes;
    const __nv_bfloat16* tile = reinterpret_cast<const __nv_bfloat16*>(base);
#pragma unroll
    for (int plane = 0; plane < kPlanes; ++plane)
#pragma unroll
      for (int j = 0; j < kALoads; ++j) {
        const int r = copy_row + j * kRowStep;
        cp_async16(shared_address(tile + swizzle(plane * kBM + r, copy_chunk)), a_src[j] + plane * p.kp + k0,
                   r < rows);
      }
    // W: chunk c of the slice is row c / per_row's bytes [16 * (c % per_row), +16) of the slice.
    uint8_t* const w_stage = base + kABytes;
    const int64_t slice_offset = weight_row_bytes(kFormat, k0);
    auto w_dst = [&](int r, int chunk) {
      return kPacked ? w_stage + r * kWRowBytes + 16 * chunk
                     : reinterpret_cast<uint8_t*>(reinterpret_cast<__nv_bfloat16*>(w_stage) + swizzle(r, chunk));
    };
    if (p.w_vector) {  // whole chunks: each is all inside the row or all past it (one uniform branch)
      const bool k_ok = slice_offset + 16 * w_chunk < w_row_bytes;
#pragma unroll
      for (int j = 0; j < kWLoads; ++j) {
        const int r = w_row + j * kWRowStep;
        const bool valid = k_ok && n0 + r < n;
        cp_async16(shared_address(w_dst(r, w_chunk)), valid ? w_src + j * w_step + slice_offset : w_values, valid);
      }
    } else {
#pragma unroll
      for (int j = 0; j < kWLoads; ++j) {
        const int r = w_row + j * kWRowStep;
        const int64_t offset = slice_offset + 16 * w_chunk;
        const int valid = n0 + r < n ? bytes_before(w_row_bytes - offset, 16) : 0;
        copy_bytes<16>(w_dst(r, w_chunk), valid ? w_values + (n0 + r) * w_row_bytes + offset : w_values, valid, false);
      }
    }
    if constexpr (kFormat == WeightFormat::Nvfp4) {  // this slice's 4 E4M3 scales of row tid
      const int64_t groups = k / 16, first = k0 / 16;
      const int valid = n0 + tid < n ? bytes_before(groups - first, kBK / 16) : 0;
      uint8_t* const scales = w_stage + kBN * kWRowBytes;
      if (tid < kBN)
        copy_bytes<kBK / 16>(scales + tid * (kBK / 16),
                             valid ? seg.w.group_scales + (n0 + tid) * groups + first : seg.w.group_scales, valid,
                             p.w_vector);
    }
  };

  // Packed weights: the slice in stage `stage` -> the bf16 tile, 16 values (a 16-wide
  // group) per step: tile row g / 4, chunks 2 (g % 4) and 2 (g % 4) + 1.
  auto convert = [&](int stage) {
    const uint8_t* const w_stage = smem + stage * kStageBytes + kABytes;
#pragma unroll
    for (int j = 0; j < kConverts; ++j) {
      const int g = tid + j * kThreads, r = g / 4, quarter = g % 4;
      uint4 first, second;
      if constexpr (kFormat == WeightFormat::Fp8) {
        fp8x16_to_bf16(*reinterpret_cast<const uint4*>(w_stage + r * kWRowBytes + 16 * quarter), first, second);
      } else {
        const uint8_t scale = w_stage[kBN * kWRowBytes + r * (kBK / 16) + quarter];
        nvfp4x16_to_bf16(*reinterpret_cast<const uint2*>(w_stage + r * kWRowBytes + 8 * quarter), scale, first,
                         second);
      }
      *reinterpret_cast<uint4*>(packed_tile + swizzle(r, 2 * quarter)) = first;
      *reinterpret_cast<uint4*>(packed_tile + swizzle(r, 2 * quarter + 1)) = second;
    }
  };

  // The warp's MMAs over one stage: 4 K steps of 16, each hi then lo per output tile.
  float acc[kTilesM][kTilesN][4] = {};
  auto compute = [&](int stage) {
    const uint8_t* const base = smem + stage * kStageBytes;
    const uint32_t a_base = shared_address(base),
                   w_base = shared_address(kPacked ? reinterpret_cast<const uint8_t*>(packed_tile) : base + kABytes);
#pragma unroll
    for (int ks = 0; ks < kBK / 16; ++ks) {
      // A (m16 x k16): lanes 0-15 give rows 0-15 at k 0-7, lanes 16-31 the same rows at
      // k 8-15: registers a0..a3 = (rows 0-7, k 0-7), (8-15, 0-7), (0-7, 8-15), (8-15, 8-15).
      uint32_t a[kPlanes][kTilesM][4];
#pragma unroll
      for (int plane = 0; plane < kPlanes; ++plane)
#pragma unroll
        for (int mt = 0; mt < kTilesM; ++mt) {
          const int r = plane * kBM + warp_m * kWM + mt * 16 + (lane & 15);
          ldmatrix_x4(a[plane][mt], a_base + 2 * swizzle(r, ks * 2 + (lane >> 4)));
        }
      // W (k16 x n8 pairs): lanes 0-7 give n 0-7 at k 0-7, lanes 8-15 n 0-7 at k 8-15,
      // lanes 16-31 the same for n 8-15: b[nt] = {k 0-7, k 8-15} of each n8 tile.
      uint32_t b[kTilesN][2];
#pragma unroll
      for (int np = 0; np < kTilesN / 2; ++np) {
        const int r = warp_n * kWN + np * 16 + (lane & 7) + ((lane >> 4) << 3);
        uint32_t q[4];
        ldmatrix_x4(q, w_base + 2 * swizzle(r, ks * 2 + ((lane >> 3) & 1)));
        b[2 * np][0] = q[0], b[2 * np][1] = q[1], b[2 * np + 1][0] = q[2], b[2 * np + 1][1] = q[3];
      }
#pragma unroll
      for (int mt = 0; mt < kTilesM; ++mt)
#pragma unroll
        for (int nt = 0; nt < kTilesN; ++nt)
#pragma unroll
          for (int plane = 0; plane < kPlanes; ++plane) mma_bf16(acc[mt][nt], a[plane][mt], b[nt]);
    }
  };

  // Split-K: blockIdx.z takes K-slice z of k_slice columns and writes its partial
  // product into its own copy of Y (gemm() sums the copies in a fixed order).
  const int64_t k_begin = int64_t(blockIdx.z) * p.k_slice, k_end = min(p.kp, k_begin + p.k_slice);
  const int k_tiles = int((k_end - k_begin) / kBK);
  // The ring: slice t lives in stage t % kStages. Each iteration waits for its slice
  // (at most kStages - 2 younger groups pending), syncs (the slice is visible to all
  // warps, and all are done with the stage about to be refilled, read last iteration, and
  // with the converted tile), then queues slice t + kStages - 1 before multiplying slice t
  // (packed weights: converting it, and syncing again so that the tile is complete).
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < k_tiles) load_tile(s, k_begin + s * kBK);
    cp_async_commit();
  }
  for (int t = 0; t < k_tiles; ++t) {
    cp_async_wait<kStages - 2>();
    __syncthreads();
    const int next = t + kStages - 1;
    if (next < k_tiles) load_tile(next % kStages, k_begin + int64_t(next) * kBK);
    cp_async_commit();
    if constexpr (kPacked) {
      convert(t % kStages);
      __syncthreads();
    }
    compute(t % kStages);
  }

  // Accumulator (m16 x n8): registers 0-1 at row lane / 4, 2-3 at row lane / 4 + 8,
  // columns 2 * (lane % 4) + {0, 1}. Packed weights: times FP8's row scale, or over NVFP4's
  // global scale, as packed_weight.h dequantizes.
  auto rescale = [&](float v, int64_t c) {
    if constexpr (kFormat == WeightFormat::Fp8) return v * seg.w.row_scales[c];
    if constexpr (kFormat == WeightFormat::Nvfp4) return v / seg.w.row_scales[c];
    return v;
  };
  float* y = p.y + int64_t(blockIdx.z) * p.y_copy_stride;
#pragma unroll
  for (int mt = 0; mt < kTilesM; ++mt)
#pragma unroll
    for (int nt = 0; nt < kTilesN; ++nt)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = warp_m * kWM + mt * 16 + (lane >> 2) + half * 8;
        const int64_t c = n0 + warp_n * kWN + nt * 8 + (lane & 3) * 2;
        if (r >= rows) continue;
        float* dst = y + (seg.y_row + m0 + r) * p.ldy + c;
        const float v0 = c < n ? rescale(acc[mt][nt][half * 2], c) : 0.0f;
        const float v1 = c + 1 < n ? rescale(acc[mt][nt][half * 2 + 1], c + 1) : 0.0f;
        if (p.y_pairs && c + 1 < n) {
          *reinterpret_cast<float2*>(dst) = make_float2(v0, v1);
        } else {
          if (c < n) dst[0] = v0;
          if (c + 1 < n) dst[1] = v1;
        }
      }
}

// A[r] = [hi | lo] of X row r (or hi alone with kPlanes 1), K zero-padded to kp; one
// thread per 8 columns.
template <int kPlanes>
__global__ void split_kernel(const float* __restrict__ x, int64_t ldx, int64_t rows, int64_t k, int64_t kp,
                             bool vector, __nv_bfloat16* __restrict__ a) {
  const int64_t chunks = kp / 8, i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * chunks) return;
  const int64_t r = i / chunks, c = (i % chunks) * 8;
  const float* src = x + r * ldx + c;
  float v[8];
  if (vector && c + 8 <= k) {
    const float4 v0 = *reinterpret_cast<const float4*>(src), v1 = *reinterpret_cast<const float4*>(src + 4);
    v[0] = v0.x, v[1] = v0.y, v[2] = v0.z, v[3] = v0.w, v[4] = v1.x, v[5] = v1.y, v[6] = v1.z, v[7] = v1.w;
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = c + j < k ? src[j] : 0.0f;
  }
  uint4 hi, lo;
  split_bf16(v[0], v[1], hi.x, lo.x);
  split_bf16(v[2], v[3], hi.y, lo.y);
  split_bf16(v[4], v[5], hi.z, lo.z);
  split_bf16(v[6], v[7], hi.w, lo.w);
  __nv_bfloat16* dst = a + r * kPlanes * kp + c;
  *reinterpret_cast<uint4*>(dst) = hi;
  if (kPlanes == 2) *reinterpret_cast<uint4*>(dst + kp) = lo;
}

// y[i] = sum over copies c of partial[c][i], in copy order.
__global__ void sum_copies_kernel(const float* partial, int copies, int64_t n, float* y) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float acc = 0.0f;
  for (int c = 0; c < copies; ++c) acc += partial[c * n + i];
  y[i] = acc;
}

template <class S, int kPlanes, WeightFormat kFormat>
void launch(const Params& p, dim3 grid, cudaStream_t stream) {
  constexpr int bytes = S::smem_bytes(kPlanes, kFormat);
  cudaFuncSetAttribute(gemm_kernel<S, kPlanes, kFormat>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  gemm_kernel<S, kPlanes, kFormat><<<grid, S::kThreads, bytes, stream>>>(p);
}

// round_x (linear_nt's soft embedding) only ever multiplies plain weights.
template <class S>
void launch_shape(const Params& p, bool round_x, WeightFormat format, int64_t num_tiles, int splits,
                  cudaStream_t stream) {
  const dim3 grid{unsigned((p.n + S::kBN - 1) / S::kBN), unsigned(num_tiles), unsigned(splits)};
  if (round_x) launch<S, 1, WeightFormat::Plain>(p, grid, stream);
  else if (format == WeightFormat::Fp8) launch<S, 2, WeightFormat::Fp8>(p, grid, stream);
  else if (format == WeightFormat::Nvfp4) launch<S, 2, WeightFormat::Nvfp4>(p, grid, stream);
  else launch<S, 2, WeightFormat::Plain>(p, grid, stream);
}

}  // namespace

int gemm_tile_rows(int64_t rows_per_segment, int64_t segments, int64_t n) {
  if (rows_per_segment <= 24) return 16;
  // 128 x 256 tiles where they are mostly full and still give two waves of blocks.
  const int64_t large_tiles = segments * ((rows_per_segment + 127) / 128) * ((n + 255) / 256);
  return rows_per_segment >= 192 && large_tiles >= 2 * multiprocessors() ? 128 : 64;
}

size_t gemm_scratch_bytes(int64_t x_rows, int64_t k, bool round_x) {
  return sizeof(__nv_bfloat16) * size_t(x_rows) * (round_x ? 1 : 2) * size_t(padded_k(k));
}

void gemm(const float* x, int64_t x_rows, int64_t ldx, const int64_t* row_map, const GemmSegment* segments,
          const GemmTile* tiles, int num_tiles, int tile_rows, WeightFormat format, int64_t n, int64_t k, bool round_x,
          float* y, int64_t ldy, void* scratch, cudaStream_t stream) {
  if (round_x && format != WeightFormat::Plain) throw std::invalid_argument("gemm: round_x takes bf16 weights");
  if (format == WeightFormat::Nvfp4 && k % 16) throw std::invalid_argument("gemm: NVFP4 weights need K % 16 == 0");
  if (num_tiles <= 0 || n <= 0) return;
  const int64_t kp = padded_k(k);
  auto* a = static_cast<__nv_bfloat16*>(scratch);
  if (x_rows > 0 && kp > 0) {
    const int64_t threads = x_rows * (kp / 8);
    const bool vector = ldx % 4 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0;
    const unsigned blocks = unsigned((threads + 255) / 256);
    if (round_x) split_kernel<1><<<blocks, 256, 0, stream>>>(x, ldx, x_rows, k, kp, vector, a);
    else split_kernel<2><<<blocks, 256, 0, stream>>>(x, ldx, x_rows, k, kp, vector, a);
  }

  // With `tiles` null, `segments` is a host pointer to the single segment, passed by value.
  const GemmSegment single = tiles ? GemmSegment{} : *segments;
  static_assert(Small::kBN == Medium::kBN, "one block width below 128 rows");
  const int block_n = tile_rows == 128 ? Large::kBN : Medium::kBN;
  const int64_t n_tiles = (n + block_n - 1) / block_n;
  // Too few blocks to fill the GPU and a long K (the soft embedding: K = vocab): split K
  // so that about 4 blocks per multiprocessor run, each on its own slice.
  const int64_t target = 4 * multiprocessors();
  int splits = 1;
  int64_t k_slice = kp;
  if (!tiles && ldy == n && n_tiles * num_tiles < target && k >= 8192) {
    splits = int(std::min<int64_t>({target / (n_tiles * num_tiles), k / 2048, 64}));
    k_slice = (kp / splits + kBK - 1) / kBK * kBK;
    splits = int((kp + k_slice - 1) / k_slice);
  }
  float* out = y;
  std::shared_ptr<void> partial;
  const int64_t copy_stride = int64_t(single.rows) * ldy;
  if (splits > 1) {  // single segment, y_row 0: copy c of Y lives at partial + c * rows * ldy
    void* q = nullptr;
    cudaMallocAsync(&q, sizeof(float) * size_t(splits * copy_stride), stream);
    cudaMemsetAsync(q, 0, sizeof(float) * size_t(splits * copy_stride), stream);  // columns past n stay 0
    partial = std::shared_ptr<void>(q, [stream](void* r) { cudaFreeAsync(r, stream); });
    out = static_cast<float*>(q);
  }

  Params p{};
  p.a = a;
  p.kp = kp;
  p.row_map = row_map;
  p.segments = tiles ? segments : nullptr;
  p.tiles = tiles;
  p.single = single;
  p.n = n;
  p.k = k;
  // Weight rows of whole 16-byte chunks, and NVFP4 scale rows of whole 4-byte words (the
  // segments' matrices lie at multiples of a matrix's bytes from 256-byte-aligned
  // allocations, so that aligns them all).
  const bool whole_chunks = weight_row_bytes(format, k) % 16 == 0 && (format != WeightFormat::Nvfp4 || k % 64 == 0);
  p.w_vector = whole_chunks && (tiles || reinterpret_cast<uintptr_t>(single.w.values) % 16 == 0);
  p.y_pairs = ldy % 2 == 0 && reinterpret_cast<uintptr_t>(out) % 8 == 0;
  p.k_slice = k_slice;
  p.y = out;
  p.ldy = ldy;
  p.y_copy_stride = copy_stride;
  if (tile_rows == 16) launch_shape<Small>(p, round_x, format, num_tiles, splits, stream);
  else if (tile_rows == 128) launch_shape<Large>(p, round_x, format, num_tiles, splits, stream);
  else launch_shape<Medium>(p, round_x, format, num_tiles, splits, stream);
  if (splits > 1)
    sum_copies_kernel<<<unsigned((copy_stride + 255) / 256), 256, 0, stream>>>(out, splits, copy_stride, y);
}

}  // namespace diffuserve::cuda
