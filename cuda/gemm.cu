// Segmented bf16 GEMM on tensor cores (mma.sync m16n8k16, fp32 accumulation).
//
// One launch computes a product per segment (one for a dense layer, one per expert for
// the MoE), each over its own rows of X and its own weight matrix. Block tile BM x 128 x
// 32 with four warps: BM = 64 (warps of 32 x 64) for tall inputs, BM = 16 (warps of 16 x
// 32) for the MoE at small batch, where each expert sees a dozen rows and the kernel's
// job is streaming weights: the small tile keeps few registers, so many blocks are in
// flight. The next K-slice is loaded into registers while the current one is multiplied
// from shared memory.
//
// X is fp32 and enters the tensor cores as two bf16 parts, hi = bf16(x) and lo =
// bf16(x - hi), each multiplied by the bf16 weights: 16 bits of mantissa instead of 8, so
// the product matches the fp32 reference (whose weights are the same bf16 values) to
// fp32-like precision. It doubles the tensor-core work, which costs nothing where the
// kernel waits on weight bytes (the MoE at small batch) and little elsewhere.
#include <algorithm>
#include <memory>

#include "kernels.h"
#include "mma.cuh"

namespace diffuserve::cuda {
namespace {

constexpr int kN = 128, kK = 32, kPad = 8, kThreads = 128;

template <int kM>
struct __align__(16) Staged {  // one K-slice of this thread's share of the tiles, in registers
  float x[kM / 4];
  __nv_bfloat16 w[32];
};

template <int kM>
__global__ void __launch_bounds__(kThreads) gemm_kernel(const float* __restrict__ x, int64_t ldx,
                                                        const int64_t* __restrict__ row_map,
                                                        const GemmSegment* __restrict__ segments,
                                                        const GemmTile* __restrict__ tiles, GemmSegment single,
                                                        int64_t n, int64_t k, int64_t k_slice, float* __restrict__ y,
                                                        int64_t ldy, int64_t y_copy_stride) {
  __shared__ __align__(16) __nv_bfloat16 As[2][kM][kK + kPad];  // hi and lo parts of X
  __shared__ __align__(16) __nv_bfloat16 Bs[kN][kK + kPad];

  GemmSegment seg = single;
  int m0 = blockIdx.y * kM;  // dense: tiles follow blockIdx.y
  if (tiles) {
    const GemmTile tile = tiles[blockIdx.y];
    if (tile.segment < 0) return;  // an unused slot of a device-planned tile list
    seg = segments[tile.segment];
    m0 = tile.m0;
  }
  const int rows = min(kM, seg.rows - m0);
  const int64_t n0 = int64_t(blockIdx.x) * kN;
  constexpr int kWarpsM = kM == 64 ? 2 : 1, kWarpsN = 4 / kWarpsM;
  constexpr int kTilesM = kM / kWarpsM / 16, kTilesN = kN / kWarpsN / 8;  // m16 / n8 tiles per warp
  constexpr int kRuns = kM / 16;                                            // X runs of 4 floats per thread
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int warp_m = warp / kWarpsN, warp_n = warp % kWarpsN, group = lane >> 2, tig = lane & 3;

  // X: kM x 32 floats, kM / 4 per thread. W: 128 x 32 bf16, 32 per thread.
  auto stage = [&](int64_t k0, Staged<kM>& s) {
    for (int i = 0; i < kRuns; ++i) {
      const int linear = tid + i * kThreads, r = linear / 8, c = (linear % 8) * 4;
      const float* src = nullptr;
      if (r < rows) {
        const int64_t xr = row_map ? row_map[seg.x_row + m0 + r] : seg.x_row + m0 + r;
        src = x + xr * ldx;
      }
      if (src && k0 + c + 4 <= k && (ldx % 4) == 0) {
        *reinterpret_cast<float4*>(&s.x[i * 4]) = *reinterpret_cast<const float4*>(src + k0 + c);
      } else {
        for (int j = 0; j < 4; ++j) s.x[i * 4 + j] = (src && k0 + c + j < k) ? src[k0 + c + j] : 0.0f;
      }
    }
    for (int i = 0; i < 4; ++i) {  // W [N, K]: row n, 8 consecutive k
      const int linear = tid + i * kThreads, r = linear / 4, c = (linear % 4) * 8;
      const int64_t nn = n0 + r, kk = k0 + c;
      const __nv_bfloat16* src = seg.w + nn * k + kk;
      if (nn < n && kk + 8 <= k && (k % 8) == 0) {
        *reinterpret_cast<uint4*>(&s.w[i * 8]) = *reinterpret_cast<const uint4*>(src);
      } else {
        for (int j = 0; j < 8; ++j) s.w[i * 8 + j] = (nn < n && kk + j < k) ? src[j] : __float2bfloat16(0.0f);
      }
    }
  };
  auto store = [&](const Staged<kM>& s) {
    for (int i = 0; i < kRuns; ++i) {
      const int linear = tid + i * kThreads, r = linear / 8, c = (linear % 8) * 4;
      for (int j = 0; j < 4; j += 2)
        split_bf16(s.x[i * 4 + j], s.x[i * 4 + j + 1], *reinterpret_cast<uint32_t*>(&As[0][r][c + j]),
                   *reinterpret_cast<uint32_t*>(&As[1][r][c + j]));
    }
    for (int i = 0; i < 4; ++i) {
      const int linear = tid + i * kThreads, r = linear / 4, c = (linear % 4) * 8;
      *reinterpret_cast<uint4*>(&Bs[r][c]) = *reinterpret_cast<const uint4*>(&s.w[i * 8]);
    }
  };

  // Split-K: blockIdx.z takes K-slice z of k_slice columns and writes its partial
  // product into its own copy of Y (gemm() sums the copies in a fixed order).
  const int64_t k_begin = int64_t(blockIdx.z) * k_slice, k_end = min(k, k_begin + k_slice);
  y += int64_t(blockIdx.z) * y_copy_stride;
  float acc[kTilesM][kTilesN][4] = {};
  Staged<kM> next;
  stage(k_begin, next);
  for (int64_t k0 = k_begin; k0 < k_end; k0 += kK) {
    __syncthreads();
    store(next);
    __syncthreads();
    if (k0 + kK < k_end) stage(k0 + kK, next);  // in flight while the tensor cores work
#pragma unroll
    for (int kk = 0; kk < kK; kk += 16) {
      uint32_t a[2][kTilesM][4], b[kTilesN][2];
#pragma unroll
      for (int part = 0; part < 2; ++part)
#pragma unroll
        for (int mt = 0; mt < kTilesM; ++mt) {
          const int r = warp_m * kTilesM * 16 + mt * 16 + group;
          a[part][mt][0] = *reinterpret_cast<const uint32_t*>(&As[part][r][kk + tig * 2]);
          a[part][mt][1] = *reinterpret_cast<const uint32_t*>(&As[part][r + 8][kk + tig * 2]);
          a[part][mt][2] = *reinterpret_cast<const uint32_t*>(&As[part][r][kk + tig * 2 + 8]);
          a[part][mt][3] = *reinterpret_cast<const uint32_t*>(&As[part][r + 8][kk + tig * 2 + 8]);
        }
#pragma unroll
      for (int nt = 0; nt < kTilesN; ++nt) {
        const int c = warp_n * kTilesN * 8 + nt * 8 + group;
        b[nt][0] = *reinterpret_cast<const uint32_t*>(&Bs[c][kk + tig * 2]);
        b[nt][1] = *reinterpret_cast<const uint32_t*>(&Bs[c][kk + tig * 2 + 8]);
      }
#pragma unroll
      for (int mt = 0; mt < kTilesM; ++mt)
#pragma unroll
        for (int nt = 0; nt < kTilesN; ++nt) {
          mma_bf16(acc[mt][nt], a[0][mt], b[nt]);
          mma_bf16(acc[mt][nt], a[1][mt], b[nt]);
        }
    }
  }

#pragma unroll
  for (int mt = 0; mt < kTilesM; ++mt)
#pragma unroll
    for (int nt = 0; nt < kTilesN; ++nt)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = warp_m * kTilesM * 16 + mt * 16 + group + half * 8;
        const int64_t c = n0 + warp_n * kTilesN * 8 + nt * 8 + tig * 2;
        if (r >= rows) continue;
        float* dst = y + (seg.y_row + m0 + r) * ldy;
        if (c < n) dst[c] = acc[mt][nt][half * 2];
        if (c + 1 < n) dst[c + 1] = acc[mt][nt][half * 2 + 1];
      }
}

// y[i] = sum over copies c of partial[c][i], in copy order.
__global__ void sum_copies_kernel(const float* partial, int copies, int64_t n, float* y) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float acc = 0.0f;
  for (int c = 0; c < copies; ++c) acc += partial[c * n + i];
  y[i] = acc;
}

}  // namespace

int gemm_tile_rows(int64_t rows_per_segment) { return rows_per_segment <= 24 ? 16 : 64; }

void gemm(const float* x, int64_t ldx, const int64_t* row_map, const GemmSegment* segments, const GemmTile* tiles,
          int num_tiles, int tile_rows, int64_t n, int64_t k, float* y, int64_t ldy, cudaStream_t stream) {
  // With `tiles` null, `segments` is a host pointer to the single segment, passed by value.
  const GemmSegment single = tiles ? GemmSegment{} : *segments;
  const GemmSegment* device_segments = tiles ? segments : nullptr;
  const int64_t n_tiles = (n + kN - 1) / kN;
  // Too few blocks to fill the GPU and a long K (the soft embedding: K = vocab): split K
  // so that about 4 blocks per multiprocessor run, each on its own slice.
  int splits = 1;
  if (!tiles && ldy == n && n_tiles * num_tiles < 528 && k >= 8192)
    splits = int(std::min<int64_t>({528 / (n_tiles * num_tiles), k / 2048, 64}));
  const int64_t k_slice = (k / splits + kK - 1) / kK * kK;
  splits = int((k + k_slice - 1) / k_slice);
  float* out = y;
  std::shared_ptr<void> partial;
  const int64_t copy_stride = int64_t(single.rows) * ldy;
  if (splits > 1) {  // single segment, y_row 0: copy c of Y lives at partial + c * rows * ldy
    void* p = nullptr;
    cudaMallocAsync(&p, sizeof(float) * size_t(splits * copy_stride), stream);
    cudaMemsetAsync(p, 0, sizeof(float) * size_t(splits * copy_stride), stream);  // columns past n stay 0
    partial = std::shared_ptr<void>(p, [stream](void* q) { cudaFreeAsync(q, stream); });
    out = static_cast<float*>(p);
  }
  const dim3 grid{unsigned(n_tiles), unsigned(num_tiles), unsigned(splits)};
  auto launch = [&](auto kernel) {
    kernel<<<grid, kThreads, 0, stream>>>(x, ldx, row_map, device_segments, tiles, single, n, k, k_slice, out, ldy,
                                          copy_stride);
  };
  if (tile_rows == 16) launch(gemm_kernel<16>);
  else launch(gemm_kernel<64>);
  if (splits > 1)
    sum_copies_kernel<<<unsigned((copy_stride + 255) / 256), 256, 0, stream>>>(out, splits, copy_stride, y);
}

}  // namespace diffuserve::cuda
