// Attention on tensor cores (mma.sync m16n8k16) for head dims that are multiples of 64
// (DiffusionGemma's 256 and 512); attention.cu's kernel serves every other head dim.
//
// A block of four warps takes the same 16 query vectors (rows x the query heads of one KV
// head) and walks the keys in chunks of 16. Each warp owns a quarter of the head
// dimension: it computes that quarter's share of the scores Q K^T, the four shares are
// summed through shared memory, and every warp then runs the online softmax and
// accumulates P V for its quarter of the output, so the accumulators fit in registers
// even at head_dim 512. Q, K, V and P enter the tensor cores as bf16 hi/lo pairs (three
// products: hi*hi + hi*lo + lo*hi), which keeps fp32-like precision.
#include <cfloat>

#include "kernels.h"
#include "mma.cuh"

namespace diffuserve::cuda {
namespace {

constexpr int kWarps = 4, kThreads = 32 * kWarps, kQueries = 16, kKeys = 16, kPad = 8;

// c += a * b with both split into bf16 hi/lo parts.
__device__ __forceinline__ void mma3(float* c, const uint32_t (&a)[2][4], const uint32_t (&b)[2][2]) {
  mma_bf16(c, a[0], b[0]);
  mma_bf16(c, a[0], b[1]);
  mma_bf16(c, a[1], b[0]);
}

// Shared memory: K and V (transposed) of one chunk as hi/lo bf16, and the partial scores.
template <int kDim>
struct Layout {
  static constexpr size_t kVt = sizeof(__nv_bfloat16) * 2 * kKeys * (kDim + kPad);
  static constexpr size_t kS = kVt + sizeof(__nv_bfloat16) * 2 * kDim * (kKeys + kPad);
  static constexpr size_t kBytes = kS + sizeof(float) * kWarps * kQueries * kKeys;
};

template <int kDim>
__global__ void __launch_bounds__(kThreads) attention_mma_kernel(const float* __restrict__ q, float* __restrict__ out,
                                                                 const DeviceAttentionSegment* __restrict__ segments,
                                                                 const DeviceKeySpan* __restrict__ spans,
                                                                 const AttentionItem* __restrict__ items,
                                                                 int num_heads, int num_kv_heads) {
  constexpr int kSlice = kDim / kWarps, kSteps = kSlice / 16, kTilesN = kSlice / 8;
  extern __shared__ __align__(16) uint8_t smem[];
  auto K = reinterpret_cast<__nv_bfloat16(*)[kKeys][kDim + kPad]>(smem);  // [part][key][d]
  auto Vt = reinterpret_cast<__nv_bfloat16(*)[kDim][kKeys + kPad]>(smem + Layout<kDim>::kVt);  // [part][d][key]
  auto S = reinterpret_cast<float(*)[kQueries][kKeys]>(smem + Layout<kDim>::kS);  // per-warp partial scores

  const AttentionItem item = items[blockIdx.x];
  const DeviceAttentionSegment seg = segments[item.segment];
  const int group = num_heads / num_kv_heads, heads = min(group, kQueries), nq = item.rows * heads;
  const int64_t q_stride = int64_t(num_heads) * kDim, kv_stride = int64_t(num_kv_heads) * kDim;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  const int d_begin = warp * kSlice;

  // This thread's two query vectors (fragment rows g and g + 8): where they are.
  int64_t q_row[2], q_pos[2];
  int q_head[2];
  bool q_valid[2];
  for (int h = 0; h < 2; ++h) {
    const int j = g + 8 * h;
    q_valid[h] = j < nq;
    const int jj = q_valid[h] ? j : 0;
    q_row[h] = seg.first_row + item.row0 + jj / heads;
    q_pos[h] = seg.first_position + item.row0 + jj / heads;
    q_head[h] = item.kv_head * group + jj % heads;
  }
  // Q fragments for this warp's slice of the head, hi/lo, kept in registers.
  uint32_t qa[kSteps][2][4];
  for (int s = 0; s < kSteps; ++s)
    for (int r = 0; r < 4; ++r) {
      const int h = r & 1, d = d_begin + s * 16 + t * 2 + (r >> 1) * 8;
      const float* src = q + q_row[h] * q_stride + int64_t(q_head[h]) * kDim + d;
      split_bf16(q_valid[h] ? src[0] : 0.0f, q_valid[h] ? src[1] : 0.0f, qa[s][0][r], qa[s][1][r]);
    }

  float o[kTilesN][4] = {};
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f};

  for (int sp = seg.span_begin; sp < seg.span_begin + seg.span_count; ++sp) {
    const DeviceKeySpan span = spans[sp];
    for (int64_t c0 = 0; c0 < span.count; c0 += kKeys) {
      const int count = int(span.count - c0 < kKeys ? span.count - c0 : kKeys);
      __syncthreads();  // the previous chunk's K, V and S are no longer read
      for (int i = tid; i < kKeys * kDim / 2; i += kThreads) {
        const int key = i / (kDim / 2), d = (i % (kDim / 2)) * 2;
        float2 kv = {0.0f, 0.0f}, vv = {0.0f, 0.0f};
        if (key < count) {
          const int64_t off = (c0 + key) * kv_stride + int64_t(item.kv_head) * kDim + d;
          kv = *reinterpret_cast<const float2*>(span.keys + off);
          vv = *reinterpret_cast<const float2*>(span.values + off);
        }
        uint32_t hi, lo;
        split_bf16(kv.x, kv.y, hi, lo);
        *reinterpret_cast<uint32_t*>(&K[0][key][d]) = hi;
        *reinterpret_cast<uint32_t*>(&K[1][key][d]) = lo;
        split_bf16(vv.x, vv.y, hi, lo);
        const __nv_bfloat162 h2 = *reinterpret_cast<__nv_bfloat162*>(&hi), l2 = *reinterpret_cast<__nv_bfloat162*>(&lo);
        Vt[0][d][key] = h2.x, Vt[0][d + 1][key] = h2.y;
        Vt[1][d][key] = l2.x, Vt[1][d + 1][key] = l2.y;
      }
      __syncthreads();

      // This warp's share of the scores, over its slice of the head.
      float s[2][4] = {};
      for (int st = 0; st < kSteps; ++st)
        for (int nt = 0; nt < 2; ++nt) {
          const int key = nt * 8 + g, d = d_begin + st * 16 + t * 2;
          uint32_t b[2][2];
          for (int p = 0; p < 2; ++p) {
            b[p][0] = *reinterpret_cast<const uint32_t*>(&K[p][key][d]);
            b[p][1] = *reinterpret_cast<const uint32_t*>(&K[p][key][d + 8]);
          }
          mma3(s[nt], qa[st], b);
        }
      for (int nt = 0; nt < 2; ++nt)
        for (int r = 0; r < 4; ++r) S[warp][g + (r >> 1) * 8][nt * 8 + t * 2 + (r & 1)] = s[nt][r];
      __syncthreads();

      // Whole scores, mask, online softmax (rows g and g + 8; the four lanes of a quad share a row).
      float row_max[2] = {-INFINITY, -INFINITY};
      for (int nt = 0; nt < 2; ++nt)
        for (int r = 0; r < 4; ++r) {
          const int h = r >> 1, qi = g + h * 8, key = nt * 8 + t * 2 + (r & 1);
          float v = S[0][qi][key] + S[1][qi][key] + S[2][qi][key] + S[3][qi][key];
          const int64_t kp = span.first_position + c0 + key;
          const bool visible = key < count && q_valid[h] &&
                               (!seg.causal || (kp <= q_pos[h] && (seg.window == 0 || kp > q_pos[h] - seg.window)));
          s[nt][r] = visible ? v : -INFINITY;
          row_max[h] = fmaxf(row_max[h], s[nt][r]);
        }
      float alpha[2], row_sum[2] = {0.0f, 0.0f};
      for (int h = 0; h < 2; ++h) {
        row_max[h] = fmaxf(row_max[h], __shfl_xor_sync(0xffffffffu, row_max[h], 1));
        row_max[h] = fmaxf(row_max[h], __shfl_xor_sync(0xffffffffu, row_max[h], 2));
        const float m_new = fmaxf(m_run[h], row_max[h]);
        alpha[h] = m_new == -INFINITY ? 1.0f : __expf(m_run[h] - m_new);
        m_run[h] = m_new;
      }
      for (int nt = 0; nt < 2; ++nt)
        for (int r = 0; r < 4; ++r) {
          const int h = r >> 1;
          s[nt][r] = s[nt][r] == -INFINITY ? 0.0f : __expf(s[nt][r] - m_run[h]);
          row_sum[h] += s[nt][r];
        }
      for (int h = 0; h < 2; ++h) {
        row_sum[h] += __shfl_xor_sync(0xffffffffu, row_sum[h], 1);
        row_sum[h] += __shfl_xor_sync(0xffffffffu, row_sum[h], 2);
        l_run[h] = l_run[h] * alpha[h] + row_sum[h];
      }
      for (int nt = 0; nt < kTilesN; ++nt)
        for (int r = 0; r < 4; ++r) o[nt][r] *= alpha[r >> 1];

      // P as the A operand (the score fragments' layout is the A layout), then P V.
      uint32_t pa[2][4];
      split_bf16(s[0][0], s[0][1], pa[0][0], pa[1][0]);
      split_bf16(s[0][2], s[0][3], pa[0][1], pa[1][1]);
      split_bf16(s[1][0], s[1][1], pa[0][2], pa[1][2]);
      split_bf16(s[1][2], s[1][3], pa[0][3], pa[1][3]);
      for (int nt = 0; nt < kTilesN; ++nt) {
        const int d = d_begin + nt * 8 + g;
        uint32_t b[2][2];
        for (int p = 0; p < 2; ++p) {
          b[p][0] = *reinterpret_cast<const uint32_t*>(&Vt[p][d][t * 2]);
          b[p][1] = *reinterpret_cast<const uint32_t*>(&Vt[p][d][t * 2 + 8]);
        }
        mma3(o[nt], pa, b);
      }
    }
  }

  for (int nt = 0; nt < kTilesN; ++nt)
    for (int r = 0; r < 4; ++r) {
      const int h = r >> 1;
      if (!q_valid[h]) continue;
      const int d = d_begin + nt * 8 + t * 2 + (r & 1);
      out[q_row[h] * q_stride + int64_t(q_head[h]) * kDim + d] = l_run[h] > 0.0f ? o[nt][r] / l_run[h] : 0.0f;
    }
}

}  // namespace

bool attention_mma(const float* q, float* out, const DeviceAttentionSegment* segments, const DeviceKeySpan* spans,
                   const AttentionItem* items, int num_items, int num_heads, int num_kv_heads, int head_dim,
                   cudaStream_t stream) {
  auto launch = [&](auto kernel, size_t bytes) {
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
    kernel<<<num_items, kThreads, bytes, stream>>>(q, out, segments, spans, items, num_heads, num_kv_heads);
    return true;
  };
  switch (head_dim) {
    case 64: return launch(attention_mma_kernel<64>, Layout<64>::kBytes);
    case 128: return launch(attention_mma_kernel<128>, Layout<128>::kBytes);
    case 256: return launch(attention_mma_kernel<256>, Layout<256>::kBytes);
    case 512: return launch(attention_mma_kernel<512>, Layout<512>::kBytes);
    default: return false;
  }
}

}  // namespace diffuserve::cuda
