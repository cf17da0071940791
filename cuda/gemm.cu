// Segmented bf16 GEMM on tensor cores (mma.sync m16n8k16, fp32 accumulation).
//
// One launch computes a product per segment (one for a dense layer, one per expert for
// the MoE), each over its own rows of X and its own weight matrix. Block tile 64 x 128 x
// 32, four warps of 32 x 64; the next K-slice is loaded into registers while the current
// one is multiplied from shared memory. X is fp32 in memory and rounded to bf16 as it is
// staged, so the layers around the GEMM keep fp32 activations.
#include "kernels.h"

namespace diffuserve::cuda {
namespace {

constexpr int kM = kGemmTileM, kN = 128, kK = 32, kPad = 8, kThreads = 128;

__device__ __forceinline__ void mma_bf16(float* c, const uint32_t* a, const uint32_t* b) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

struct Staged {  // one K-slice of this thread's share of the tiles, in registers
  float x[16];
  __nv_bfloat16 w[32];
};

template <bool kWkn>
__global__ void __launch_bounds__(kThreads) gemm_kernel(const float* __restrict__ x, int64_t ldx,
                                                        const int64_t* __restrict__ row_map,
                                                        const GemmSegment* __restrict__ segments,
                                                        const GemmTile* __restrict__ tiles, GemmSegment single,
                                                        int64_t n, int64_t k, float* __restrict__ y, int64_t ldy) {
  __shared__ __align__(16) __nv_bfloat16 As[kM][kK + kPad];
  __shared__ __align__(16) __nv_bfloat16 Bs[kN][kK + kPad];

  GemmSegment seg = single;
  int m0 = blockIdx.y * kM;
  if (tiles) {
    const GemmTile tile = tiles[blockIdx.y];
    seg = segments[tile.segment];
    m0 = tile.m0;
  }
  const int rows = min(kM, seg.rows - m0);
  const int64_t n0 = int64_t(blockIdx.x) * kN;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int warp_m = warp >> 1, warp_n = warp & 1, group = lane >> 2, tig = lane & 3;

  // X: 64 x 32 floats, 16 per thread (4 runs of 4). W: 128 x 32 (or 32 x 128) bf16, 32 per thread.
  auto stage = [&](int64_t k0, Staged& s) {
    for (int i = 0; i < 4; ++i) {
      const int linear = tid + i * kThreads, r = linear / 8, c = (linear % 8) * 4;
      const float* src = nullptr;
      if (r < rows) {
        const int64_t xr = row_map ? row_map[seg.x_row + m0 + r] : seg.x_row + m0 + r;
        src = x + xr * ldx;
      }
      for (int j = 0; j < 4; ++j) s.x[i * 4 + j] = (src && k0 + c + j < k) ? src[k0 + c + j] : 0.0f;
    }
    for (int i = 0; i < 4; ++i) {
      const int linear = tid + i * kThreads;
      if (!kWkn) {  // W [N, K]: row n, 8 consecutive k
        const int r = linear / 4, c = (linear % 4) * 8;
        const int64_t nn = n0 + r, kk = k0 + c;
        const __nv_bfloat16* src = seg.w + nn * k + kk;
        if (nn < n && kk + 8 <= k && (k % 8) == 0) {
          *reinterpret_cast<uint4*>(&s.w[i * 8]) = *reinterpret_cast<const uint4*>(src);
        } else {
          for (int j = 0; j < 8; ++j) s.w[i * 8 + j] = (nn < n && kk + j < k) ? src[j] : __float2bfloat16(0.0f);
        }
      } else {  // W [K, N]: row k, 8 consecutive n
        const int r = linear / 16, c = (linear % 16) * 8;
        const int64_t kk = k0 + r, nn = n0 + c;
        const __nv_bfloat16* src = seg.w + kk * n + nn;
        if (kk < k && nn + 8 <= n && (n % 8) == 0) {
          *reinterpret_cast<uint4*>(&s.w[i * 8]) = *reinterpret_cast<const uint4*>(src);
        } else {
          for (int j = 0; j < 8; ++j) s.w[i * 8 + j] = (kk < k && nn + j < n) ? src[j] : __float2bfloat16(0.0f);
        }
      }
    }
  };
  auto store = [&](const Staged& s) {
    for (int i = 0; i < 4; ++i) {
      const int linear = tid + i * kThreads, r = linear / 8, c = (linear % 8) * 4;
      for (int j = 0; j < 4; ++j) As[r][c + j] = __float2bfloat16(s.x[i * 4 + j]);
    }
    for (int i = 0; i < 4; ++i) {
      const int linear = tid + i * kThreads;
      if (!kWkn) {
        const int r = linear / 4, c = (linear % 4) * 8;
        *reinterpret_cast<uint4*>(&Bs[r][c]) = *reinterpret_cast<const uint4*>(&s.w[i * 8]);
      } else {
        const int r = linear / 16, c = (linear % 16) * 8;
        for (int j = 0; j < 8; ++j) Bs[c + j][r] = s.w[i * 8 + j];
      }
    }
  };

  float acc[2][8][4] = {};
  Staged next;
  stage(0, next);
  for (int64_t k0 = 0; k0 < k; k0 += kK) {
    __syncthreads();
    store(next);
    __syncthreads();
    if (k0 + kK < k) stage(k0 + kK, next);  // in flight while the tensor cores work
#pragma unroll
    for (int kk = 0; kk < kK; kk += 16) {
      uint32_t a[2][4], b[8][2];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        const int r = warp_m * 32 + mt * 16 + group;
        a[mt][0] = *reinterpret_cast<const uint32_t*>(&As[r][kk + tig * 2]);
        a[mt][1] = *reinterpret_cast<const uint32_t*>(&As[r + 8][kk + tig * 2]);
        a[mt][2] = *reinterpret_cast<const uint32_t*>(&As[r][kk + tig * 2 + 8]);
        a[mt][3] = *reinterpret_cast<const uint32_t*>(&As[r + 8][kk + tig * 2 + 8]);
      }
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        const int c = warp_n * 64 + nt * 8 + group;
        b[nt][0] = *reinterpret_cast<const uint32_t*>(&Bs[c][kk + tig * 2]);
        b[nt][1] = *reinterpret_cast<const uint32_t*>(&Bs[c][kk + tig * 2 + 8]);
      }
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) mma_bf16(acc[mt][nt], a[mt], b[nt]);
    }
  }

#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = warp_m * 32 + mt * 16 + group + half * 8;
        const int64_t c = n0 + warp_n * 64 + nt * 8 + tig * 2;
        if (r >= rows) continue;
        float* dst = y + (seg.y_row + m0 + r) * ldy;
        if (c < n) dst[c] = acc[mt][nt][half * 2];
        if (c + 1 < n) dst[c + 1] = acc[mt][nt][half * 2 + 1];
      }
}

}  // namespace

void gemm(const float* x, int64_t ldx, const int64_t* row_map, const GemmSegment* segments, const GemmTile* tiles,
          int num_tiles, int64_t n, int64_t k, bool w_kn, float* y, int64_t ldy, cudaStream_t stream) {
  // With `tiles` null, `segments` is a host pointer to the single segment, passed by value.
  const GemmSegment single = tiles ? GemmSegment{} : *segments;
  const dim3 grid(unsigned((n + kN - 1) / kN), unsigned(num_tiles));
  if (w_kn)
    gemm_kernel<true><<<grid, kThreads, 0, stream>>>(x, ldx, row_map, tiles ? segments : nullptr, tiles, single, n,
                                                     k, y, ldy);
  else
    gemm_kernel<false><<<grid, kThreads, 0, stream>>>(x, ldx, row_map, tiles ? segments : nullptr, tiles, single, n,
                                                      k, y, ldy);
}

}  // namespace diffuserve::cuda
