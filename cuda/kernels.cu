// The CUDA backend's row and elementwise kernels: embedding, norms, RoPE, activations,
// routing, the MoE combine, and the sampler's fused row pass.
#include <algorithm>
#include <climits>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "activation_quant.h"
#include "block_reduce.cuh"
#include "fast_math.cuh"
#include "gemm_tile.cuh"
#include "kernels.h"
#include "mma.cuh"
#include "packed_decode.cuh"
#include "sampler.h"

namespace diffuserve::cuda {
namespace {

constexpr int kThreads = 256;
// A block per vocab-wide row (softmax): 256 rows of 262,144 logits need every thread the
// multiprocessors hold to keep the memory system busy.
constexpr int kRowThreads = 1024;
// The sampler's blocks: 512 threads, two a multiprocessor at its 64 registers, so a batch-1
// canvas (256 rows) runs in one wave on 132 multiprocessors. Each thread has two float4
// loads of its row in flight (batch 1 on the H200: 594 us, against 605 us with one; 256
// threads with eight each, at 100 registers, took 821 us). After the sixty-fourth session's
// rewrite (sample_kernel), on an H100 (sampler_bench, us a batch-1 / batch-16 call on
// near-uniform rows): 512 x 2 380.4-380.7 / 5818-5821, 512 x 3 382.5-383.0 / 6061-6070,
// 512 x 4 (spilling 12 bytes) 380.7-382.1 / 5770-5772, 256 x 4 434.1-434.8 / 6099-6105.
constexpr int kSampleThreads = 512, kSampleLoads = 2;

unsigned blocks_for(int64_t n) { return unsigned((n + kThreads - 1) / kThreads); }

// f(j, x[j]) for j = first, first + stride, ... below n, in that order, with kUnroll loads
// issued before any value is used: a plain strided loop waits out the memory latency once
// per value (a 2,816-wide row at 256 threads: 11 round trips; a vocab row at 1,024: 256).
constexpr int kUnroll = 8;
template <class F>
__device__ __forceinline__ void for_each_strided(const float* x, int64_t n, int64_t first, int64_t stride, F f) {
  for (int64_t base = first; base < n; base += kUnroll * stride) {
    float v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = base + u * stride < n ? x[base + u * stride] : 0.0f;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (base + u * stride < n) f(base + u * stride, v[u]);
  }
}

// Sum over the block (all threads get the result).
__device__ float block_sum(float v) {
  return block_reduce(v, [](float a, float b) { return a + b; });
}

// The larger value, the lower index on ties, over the block (all threads get the result).
__device__ void block_argmax(float& value, int& index) {
  __shared__ float values[32];
  __shared__ int indices[32];
  for (int o = 16; o > 0; o >>= 1) {
    const float v = __shfl_xor_sync(0xffffffffu, value, o);
    const int i = __shfl_xor_sync(0xffffffffu, index, o);
    if (v > value || (v == value && i < index)) value = v, index = i;
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
  __syncthreads();
  if (lane == 0) values[warp] = value, indices[warp] = index;
  __syncthreads();
  value = values[0], index = indices[0];
  for (int w = 1; w < warps; ++w)
    if (values[w] > value || (values[w] == value && indices[w] < index)) value = values[w], index = indices[w];
}

__global__ void embed_kernel(const __nv_bfloat16* table, int64_t hidden, const int32_t* ids, int64_t n, float scale,
                             float* out) {
  wait_for_earlier_kernels();
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n * hidden) return;
  out[i] = __bfloat162float(table[int64_t(ids[i / hidden]) * hidden + i % hidden]) * scale;
}

// One element of a norm's output: v * inv * w, or with `accumulate` (old + that) * scale.
// __fadd_rn keeps nvcc from fusing the add with the multiply into one FMA (rounded once),
// so old + norm rounds as a norm kernel followed by the add kernel would.
__device__ __forceinline__ float norm_output(float v, float inv, float w, bool accumulate, float old, float scale) {
  const float normed = v * inv * w;
  return accumulate ? __fmul_rn(__fadd_rn(old, normed), scale) : normed;
}

// The write pass of the streaming norm kernels below: this thread's elements j of a group
// get norm_output of x[j] * inv [* weight[j]], stored in y[j] or (kAccumulate) added to it,
// and rounded to bf16 in rounded[j] where that is given. x, the weights and y are all
// loaded kUnroll at a time before any is used (as for_each_strided does). x may be y: each
// element is read and written by one thread, loads first.
template <bool kAccumulate>
__device__ __forceinline__ void write_norm(const float* x, const float* weight, float inv, int64_t group, int64_t first,
                                           int64_t stride, float scale, float* y, __nv_bfloat16* rounded = nullptr) {
  for (int64_t base = first; base < group; base += kUnroll * stride) {
    float v[kUnroll], w[kUnroll], old[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t j = base + u * stride;
      const bool inside = j < group;
      v[u] = inside ? x[j] : 0.0f;
      w[u] = inside && weight ? weight[j] : 1.0f;
      if (kAccumulate) old[u] = inside ? y[j] : 0.0f;
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t j = base + u * stride;
      if (j >= group) continue;
      const float out = norm_output(v[u], inv, w[u], kAccumulate, old[u], scale);
      y[j] = out;
      if (rounded) rounded[j] = __float2bfloat16(out);
    }
  }
}

// A norm's write pass into each of its outputs, this thread's elements of group `g`.
__device__ __forceinline__ void write_norms(const float* x, const NormOutputs& outs, int64_t g, float inv,
                                            int64_t group, int64_t first, int64_t stride) {
  for (int o = 0; o < outs.count; ++o) {
    float* y = outs.y[o] + g * group;
    if (outs.accumulate) write_norm<true>(x, outs.weight[o], inv, group, first, stride, outs.scale, y);
    else write_norm<false>(x, outs.weight[o], inv, group, first, stride, 1.0f, y);
  }
}

// A hidden state's norms: a block per group. `then`'s pass reads outs.y[0] back, each
// element in the thread that wrote it (the same stride), so it needs no barrier.
__global__ void rms_norm_kernel(const float* x, NormOutputs outs, NormOutputs then, int64_t group, float eps) {
  wait_for_earlier_kernels();
  const int64_t g = blockIdx.x;
  auto inv_rms = [&](const float* v) {
    float ss = 0.0f;
    for_each_strided(v, group, threadIdx.x, blockDim.x, [&](int64_t, float e) { ss += e * e; });
    return powf(block_sum(ss) / float(group) + eps, -0.5f);
  };
  const float* xi = x + g * group;
  write_norms(xi, outs, g, inv_rms(xi), group, threadIdx.x, blockDim.x);
  if (!then.count) return;
  const float* yi = outs.y[0] + g * group;
  write_norms(yi, then, g, inv_rms(yi), group, threadIdx.x, blockDim.x);
}

// rms_norm_kernel for a group that fits in registers, kRowValues values a thread: kWidth
// consecutive ones (a float4, or one float where rows are not whole aligned float4s) at
// (threadIdx.x + i * blockDim.x) * kWidth. A block is a row, and a canvas is only a few
// hundred rows, so each round trip to memory is paid in full: the row and the old values
// the outputs accumulate onto are loaded together before the first sum, and each norm's
// weights before its sum, so the kernel waits on one round trip a norm, not one an output.
// `then` normalises the first output's values as they stay in registers. With `sums` a row
// is the MoE's weighted sum of its experts' rows, added up as they are loaded
// (load_expert_sum): a layer's combine pass and launch fold into its last norm.
// Rows of up to 3,072 float4-aligned values (26B's 2,816: 352 threads) take blocks of at
// most 384 threads with registers for two a multiprocessor, so that a canvas's 256 rows run
// as one wave on the H200's 132 (unbounded, the kernel takes ~100 registers and one block
// fits; bounded, it spills 16 bytes); wider rows take up to 512, and rows of single values
// (which would spill 340 bytes) one block.
constexpr int kRowKernelThreads = 512, kRowKernelPairThreads = 384;
constexpr int kRowValues = 8;
// The first column of this thread's chunk c (kWidth values) of a row.
template <int kWidth>
__device__ __forceinline__ int64_t row_column(int c) {
  return (threadIdx.x + int64_t(c) * blockDim.x) * kWidth;
}
// Values c .. c + 3 (16 bytes of fp32, 8 of bf16: one load) and value c of a row, as floats.
__device__ __forceinline__ float4 load4(const float* row, int64_t c) { return *reinterpret_cast<const float4*>(row + c); }
__device__ __forceinline__ float4 load4(const __nv_bfloat16* row, int64_t c) {
  const uint2 q = *reinterpret_cast<const uint2*>(row + c);  // the lower index in the low half
  return {__uint_as_float(q.x << 16), __uint_as_float(q.x & 0xffff0000u), __uint_as_float(q.y << 16),
          __uint_as_float(q.y & 0xffff0000u)};
}
__device__ __forceinline__ float load1(const float* row, int64_t c) { return row[c]; }
__device__ __forceinline__ float load1(const __nv_bfloat16* row, int64_t c) { return __bfloat162float(row[c]); }
// This thread's values of an fp32 or bf16 row (kWidth 4: load4s).
template <int kWidth, class T>
__device__ __forceinline__ void load_row(const T* row, int64_t group, float (&v)[kRowValues]) {
#pragma unroll
  for (int i = 0; i < kRowValues / kWidth; ++i) {
    const int64_t j = row_column<kWidth>(i);
    if constexpr (kWidth == 4) {
      const float4 q = j < group ? load4(row, j) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      v[4 * i] = q.x, v[4 * i + 1] = q.y, v[4 * i + 2] = q.z, v[4 * i + 3] = q.w;
    } else {
      v[i] = j < group ? load1(row, j) : 0.0f;
    }
  }
}
template <int kWidth>
__device__ __forceinline__ void store_row(float* row, int64_t group, const float (&v)[kRowValues]) {
#pragma unroll
  for (int i = 0; i < kRowValues / kWidth; ++i) {
    const int64_t j = row_column<kWidth>(i);
    if (j >= group) continue;
    if constexpr (kWidth == 4) *reinterpret_cast<float4*>(row + j) = {v[4 * i], v[4 * i + 1], v[4 * i + 2], v[4 * i + 3]};
    else row[j] = v[i];
  }
}

// acc += w x as one fused multiply-add: combine_experts and the norms that add up expert
// rows (ExpertSums) round alike.
__device__ __forceinline__ void add_weighted(float& acc, float w, float x) { acc = fmaf(w, x, acc); }

// Row t of `sums` in load_row's layout: its experts' rows, each times its weight, added in k
// order (combine_experts_kernel's sum), four rows' loads in flight at a time.
template <int kWidth>
__device__ __forceinline__ void load_expert_sum(const ExpertSums& sums, int64_t t, int64_t group,
                                                float (&v)[kRowValues]) {
  const int64_t* rows = sums.inverse + t * sums.top_k;
  const float* w = sums.weights + t * sums.top_k;
#pragma unroll
  for (int i = 0; i < kRowValues; ++i) v[i] = 0.0f;
#pragma unroll 4
  for (int k = 0; k < sums.top_k; ++k) {
    float u[kRowValues];
    if (sums.y_bf16) load_row<kWidth>(sums.y_bf16 + rows[k] * group, group, u);
    else load_row<kWidth>(sums.y + rows[k] * group, group, u);
#pragma unroll
    for (int i = 0; i < kRowValues; ++i) add_weighted(v[i], w[k], u[i]);
  }
}

// A norm's output row g (this thread's values v, laid out as load_row's) as products take
// it (PreparedX), K zero-padded: the bits of gemm()'s pre-pass, from the same roundings
// (round_bf16x2, split_bf16; the FP8 token scale of the row's absolute maximum, e4m3x2_codes).
// Every thread of the block calls it (FP8's maximum is a block reduction).
template <int kWidth>
__device__ __forceinline__ void write_prepared(const PreparedX& p, int64_t g, int64_t group,
                                               const float (&v)[kRowValues]) {
  constexpr int kChunks = kRowValues / kWidth;
  // Value i of chunk c, zero past the row (its padding up to kp).
  auto value = [&](int c, int i) { return row_column<kWidth>(c) + i < group ? v[c * kWidth + i] : 0.0f; };
  uint8_t* const row = p.rows + g * p.row_bytes();
  if (p.input == GemmInput::Fp8Token) {
    float amax = 0.0f;
#pragma unroll
    for (int c = 0; c < kChunks; ++c)
#pragma unroll
      for (int i = 0; i < kWidth; ++i) amax = fmaxf(amax, fabsf(value(c, i)));
    const float scale = fp8_token_scale(block_reduce(amax, [](float a, float b) { return fmaxf(a, b); }));
    if (threadIdx.x == 0) p.scales[g] = scale;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const int64_t j = row_column<kWidth>(c);
      if (j >= p.kp) continue;
      if constexpr (kWidth == 4)
        *reinterpret_cast<uint32_t*>(row + j) =
            e4m3x2_codes(value(c, 0), value(c, 1), scale) | e4m3x2_codes(value(c, 2), value(c, 3), scale) << 16;
      else row[j] = uint8_t(e4m3x2_codes(value(c, 0), 0.0f, scale));
    }
    return;
  }
  auto* const hi = reinterpret_cast<__nv_bfloat16*>(row);
  __nv_bfloat16* const lo = hi + p.kp;  // Split's
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    const int64_t j = row_column<kWidth>(c);
    if (j >= p.kp) continue;
    uint32_t h[2], l[2];
#pragma unroll
    for (int u = 0; u < (kWidth + 1) / 2; ++u)
      split_bf16(value(c, 2 * u), kWidth > 1 ? value(c, 2 * u + 1) : 0.0f, h[u], l[u]);
    if constexpr (kWidth == 4) {
      *reinterpret_cast<uint2*>(hi + j) = make_uint2(h[0], h[1]);
      if (p.input == GemmInput::Split) *reinterpret_cast<uint2*>(lo + j) = make_uint2(l[0], l[1]);
    } else {
      *reinterpret_cast<uint16_t*>(hi + j) = uint16_t(h[0]);
      if (p.input == GemmInput::Split) *reinterpret_cast<uint16_t*>(lo + j) = uint16_t(l[0]);
    }
  }
}

// A norm's weights for this thread's values (load_row's layout), or ones where it has none.
template <int kWidth>
__device__ __forceinline__ void load_weights(const float* weight, int64_t group, float (&w)[kRowValues]) {
  if (weight) load_row<kWidth>(weight, group, w);
  else
#pragma unroll
    for (int i = 0; i < kRowValues; ++i) w[i] = 1.0f;
}

// (mean(v^2) + eps)^-0.5 of a row of the row kernel (every thread of the block, its values v).
__device__ __forceinline__ float row_inv_rms(const float (&v)[kRowValues], int64_t group, float eps) {
  float ss = 0.0f;
#pragma unroll
  for (int i = 0; i < kRowValues; ++i) ss += v[i] * v[i];
  return powf(block_sum(ss) / float(group) + eps, -0.5f);
}

// v = rms_norm(v) by weight, in place: a row of the row kernel (every thread of the block).
template <int kWidth>
__device__ __forceinline__ void rms_norm_row(float (&v)[kRowValues], const float* weight, int64_t group, float eps) {
  float w[kRowValues];
  load_weights<kWidth>(weight, group, w);
  const float inv = row_inv_rms(v, group, eps);
#pragma unroll
  for (int i = 0; i < kRowValues; ++i) v[i] = norm_output(v[i], inv, w[i], false, 0.0f, 1.0f);
}

// rms_norms' three norms (outs, then, after) as one parameter, so that one loop body serves
// all three: with each norm and each of its outputs unrolled the kernel was 7,400 SASS
// instructions, and ncu found a third of its warps' stalls waiting on instruction fetch.
struct NormStages {
  NormOutputs stage[3];
};

template <int kWidth, int kMaxThreads>
__global__ void __launch_bounds__(kMaxThreads, kMaxThreads == kRowKernelPairThreads ? 2 : 1)
    rms_norm_row_kernel(const float* x, const __grid_constant__ NormStages norms, int64_t group, float eps,
                        const ExpertSums sums) {
  wait_for_earlier_kernels();
  const int64_t g = blockIdx.x;
  const NormOutputs &outs = norms.stage[0], &then = norms.stage[1];
  // `then`'s output may be the first output itself (accumulating into it in place): its
  // old values are then the first norm's, known only after it.
  const bool then_in_place = then.count && then.y[0] == outs.y[0];
  float v[kRowValues], old[kRowValues], then_old[kRowValues];
  if (sums.any()) load_expert_sum<kWidth>(sums, g, group, v);
  else load_row<kWidth>(x + g * group, group, v);
  if (outs.accumulate) load_row<kWidth>(outs.y[0] + g * group, group, old);
  if (outs.norm_old) rms_norm_row<kWidth>(old, outs.old_weight, group, eps);
  if (then.count && then.accumulate && !then_in_place) load_row<kWidth>(then.y[0] + g * group, group, then_old);
  // Each norm of v into its outputs, the first one last; v becomes its values. The weights
  // of the output written first are loaded before the sum, so that their round trip
  // overlaps its barriers, and each next output's as the one before is written.
#pragma unroll 1
  for (int s = 0; s < 3; ++s) {
    const NormOutputs& o = norms.stage[s];
    if (!o.count) break;
    if (s == 1)
#pragma unroll
      for (int i = 0; i < kRowValues; ++i) old[i] = then_in_place ? v[i] : then_old[i];
    float w[kRowValues], w_next[kRowValues];
    load_weights<kWidth>(o.weight[o.count - 1], group, w);
    const float inv = row_inv_rms(v, group, eps);
#pragma unroll 1
    for (int k = o.count - 1; k >= 0; --k) {
      if (k > 0) load_weights<kWidth>(o.weight[k - 1], group, w_next);
      float out[kRowValues];
#pragma unroll
      for (int i = 0; i < kRowValues; ++i) out[i] = norm_output(v[i], inv, w[i], o.accumulate, old[i], o.scale);
      store_row<kWidth>(o.y[k] + g * group, group, out);
      if (o.prepared[k].rows) write_prepared<kWidth>(o.prepared[k], g, group, out);
#pragma unroll
      for (int i = 0; i < kRowValues; ++i) {
        if (k == 0) v[i] = out[i];
        else w[i] = w_next[i];
      }
    }
  }
}

// (mean(x^2) + eps)^-0.5 of a group of x, summed by the warp (every lane gets it).
__device__ float warp_inv_rms(const float* x, int64_t group, float eps, int lane) {
  float ss = 0.0f;
  for_each_strided(x, group, lane, 32, [&](int64_t, float v) { ss += v * v; });
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  return powf(ss / float(group) + eps, -0.5f);
}

// A head's norms (thousands of short groups): a warp per group, no block-wide barrier.
__global__ void rms_norm_warp_kernel(const float* x, NormOutputs outs, NormOutputs then, int64_t groups, int64_t group,
                                     float eps) {
  wait_for_earlier_kernels();
  const int64_t g = int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (g >= groups) return;  // whole warps: blocks are whole warps
  const int lane = threadIdx.x & 31;
  const float* xi = x + g * group;
  write_norms(xi, outs, g, warp_inv_rms(xi, group, eps, lane), group, lane, 32);
  if (!then.count) return;
  const float* yi = outs.y[0] + g * group;
  write_norms(yi, then, g, warp_inv_rms(yi, group, eps, lane), group, lane, 32);
}

// A warp per (row, head) of the parts in turn: the head's norm as rms_norm_warp_kernel
// computes it, then rotate_half RoPE on each lane's pairs (f, f + half), or the unscaled
// norm alone for a part without a weight.
__global__ void rms_norm_rope_kernel(const __grid_constant__ HeadNormParts parts, int64_t head_dim, float eps,
                                     const float* __restrict__ inv_freq) {
  wait_for_earlier_kernels();
  int64_t g = int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  int p = 0;
  for (; p < parts.count && g >= parts.part[p].rows * parts.part[p].heads; ++p)
    g -= parts.part[p].rows * parts.part[p].heads;
  if (p == parts.count) return;  // whole warps: blocks are whole warps
  const HeadNorms& part = parts.part[p];
  const int lane = threadIdx.x & 31;
  const int64_t r = g / part.heads;
  // Each lane reads its values before it writes them, so that dst may be src.
  const float* in = part.src + r * part.src_stride + (g % part.heads) * head_dim;
  float* out = part.dst + g * head_dim;
  __nv_bfloat16* rounded = part.rounded ? part.rounded + g * head_dim : nullptr;
  const float inv = warp_inv_rms(in, head_dim, eps, lane);
  if (!part.weight) return write_norm<false>(in, nullptr, inv, head_dim, lane, 32, 1.0f, out, rounded);
  const float* weight = part.weight;
  const float position = float(part.positions[r]);
  const int64_t half = head_dim / 2;
  // Tried and not kept (thirty-first session, H200, batch 1, 1K): the position and the
  // first pairs' values, weights and frequencies loaded before the sum, with its loads (one
  // round trip where this takes three): 7.9 -> 8.4 us a layer in the step's trace. With
  // 8,192 warps of short chains, the load round trips are not what this kernel waits on.
  // A lane's pairs (f, f + half) kPairs at a time, every load before any store: one round
  // trip a group, not one a pair (sincosf's branches keep the compiler from moving loads
  // past the stores itself).
  constexpr int kPairs = 4;
  for (int64_t f0 = lane; f0 < half; f0 += 32 * kPairs) {
    float x1[kPairs], x2[kPairs], w1[kPairs], w2[kPairs], freq[kPairs];
#pragma unroll
    for (int i = 0; i < kPairs; ++i) {
      const int64_t f = f0 + 32 * i;
      const bool inside = f < half;
      x1[i] = inside ? in[f] : 0.0f, x2[i] = inside ? in[f + half] : 0.0f;
      w1[i] = inside ? weight[f] : 0.0f, w2[i] = inside ? weight[f + half] : 0.0f;
      freq[i] = inside ? inv_freq[f] : 0.0f;
    }
#pragma unroll
    for (int i = 0; i < kPairs; ++i) {
      const int64_t f = f0 + 32 * i;
      if (f >= half) continue;
      const float a = x1[i] * inv * w1[i], b = x2[i] * inv * w2[i];
      float sn, cs;
      sincosf(position * freq[i], &sn, &cs);
      const float y1 = a * cs - b * sn, y2 = b * cs + a * sn;
      out[f] = y1, out[f + half] = y2;
      if (rounded) rounded[f] = __float2bfloat16(y1), rounded[f + half] = __float2bfloat16(y2);
    }
  }
}

__global__ void gelu_glu_kernel(const float* x, int64_t rows, int64_t inter, float* out) {
  wait_for_earlier_kernels();
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * inter) return;
  const int64_t r = i / inter, j = i % inter;
  out[i] = gelu_glu_value(x[r * 2 * inter + j], x[r * 2 * inter + inter + j]);
}

__global__ void add_kernel(const float* a, const float* b, float* y, int64_t n) {
  wait_for_earlier_kernels();
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) y[i] = a[i] + b[i];
}

__global__ void scale_kernel(float* x, float s, int64_t n) {
  wait_for_earlier_kernels();
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) x[i] *= s;
}

// cap * tanh(x / cap): the softcap op's and the sampler's, one expression (the sampler
// divides by the cap four values at a time, Divisor, and passes the quotient q = x / cap).
// An infinite logit (from weights that are not finite) becomes NaN, which the checks after
// the softcap refuse, not the cap that tanh would make of it (the CPU backend's alike).
__device__ __forceinline__ float softcap_of_quotient(float x, float q, float cap) {
  return isinf(x) ? __int_as_float(0x7fffffff) : cap * tanhf(q);
}
__device__ __forceinline__ float capped(float x, float cap) { return softcap_of_quotient(x, x / cap, cap); }

__global__ void softcap_kernel(float* x, float cap, int64_t n) {
  wait_for_earlier_kernels();
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) x[i] = capped(x[i], cap);
}

__global__ void softmax_kernel(float* x, int64_t cols) {
  wait_for_earlier_kernels();
  float* r = x + int64_t(blockIdx.x) * cols;
  float m = -INFINITY;
  int unused = 0;
  for_each_strided(r, cols, threadIdx.x, blockDim.x, [&](int64_t, float v) { m = fmaxf(m, v); });
  block_argmax(m, unused);
  float sum = 0.0f;
  for_each_strided(r, cols, threadIdx.x, blockDim.x, [&](int64_t, float v) { sum += exp_ftz(v - m); });
  const float inv = 1.0f / block_sum(sum);
  for_each_strided(r, cols, threadIdx.x, blockDim.x, [&](int64_t j, float v) { r[j] = exp_ftz(v - m) * inv; });
}

// dst (fp32, or bf16: rounded) row dst_rows[r] = src row r.
template <class T>
__global__ void scatter_rows_kernel(const float* src, int64_t cols, const int64_t* dst_rows, int64_t n, T* dst) {
  wait_for_earlier_kernels();
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n * cols) return;
  T& out = dst[dst_rows[i / cols] * cols + i % cols];
  if constexpr (std::is_same_v<T, float>) out = src[i];
  else out = __float2bfloat16(src[i]);
}

// A thread per 16-byte chunk of the rows, copied to its place in the tiled layout.
__global__ void tile_matrices_kernel(const uint8_t* in, int64_t n, int64_t row_bytes, bool paired, int64_t chunks,
                                     uint8_t* out) {
  wait_for_earlier_kernels();
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= chunks) return;
  const int64_t per_row = row_bytes / 16, matrix = i / (n * per_row), row = i / per_row % n, c = i % per_row;
  const int64_t at = matrix * n * row_bytes +
                     tiled_offset(paired ? paired_row(row, n) : row, c / 8, int(c % 8), row_bytes / kRowBytes);
  *reinterpret_cast<uint4*>(out + at) = reinterpret_cast<const uint4*>(in)[i];
}

// Thread i decodes group i (16 values: rows of cols / 16 groups, 8 bytes each) through the
// GEMM's decode (packed_decode.cuh), whose products are 2^-8 of the values: times 256, exact.
__global__ void decode_nvfp4_kernel(const uint2* packed, const uint8_t* group_scales, int64_t groups, uint4* out) {
  wait_for_earlier_kernels();
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= groups) return;
  uint32_t words[2] = {packed[i].x, packed[i].y}, v[8];
  uint8_t scale = group_scales[i];
  nvfp4_gemm_group(words, scale);
  const uint32_t scale_pair = nvfp4_scale_pair(scale);
  for (int half = 0; half < 4; ++half)
    nvfp4x4_to_bf16(words[half / 2], half % 2, scale_pair, v[2 * half], v[2 * half + 1]);
  const __nv_bfloat162 unscale = __float2bfloat162_rn(kNvfp4Unscale);
  for (uint32_t& pair : v) {
    const __nv_bfloat162 value = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&pair), unscale);
    pair = *reinterpret_cast<const uint32_t*>(&value);
  }
  out[2 * i] = make_uint4(v[0], v[1], v[2], v[3]);
  out[2 * i + 1] = make_uint4(v[4], v[5], v[6], v[7]);
}

// Thread i rewrites group i (8 bytes of values, one scale) into the GEMM layout, in place.
__global__ void lay_out_nvfp4_kernel(uint2* packed, uint8_t* group_scales, int64_t groups) {
  wait_for_earlier_kernels();
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= groups) return;
  uint32_t words[2] = {packed[i].x, packed[i].y};
  nvfp4_gemm_group(words, group_scales[i]);
  packed[i] = make_uint2(words[0], words[1]);
}

__global__ void transpose_bf16_kernel(const __nv_bfloat16* in, int64_t k, int64_t n, __nv_bfloat16* out) {
  wait_for_earlier_kernels();
  __shared__ __nv_bfloat16 tile[32][33];
  const int64_t n0 = int64_t(blockIdx.x) * 32;
  // K's tiles go round gridDim.y (at most 65,535: a vocabulary past 2 M rows has more tiles).
  for (int64_t k0 = int64_t(blockIdx.y) * 32; k0 < k; k0 += int64_t(gridDim.y) * 32) {
    for (int i = threadIdx.y; i < 32; i += blockDim.y)
      if (k0 + i < k && n0 + threadIdx.x < n) tile[i][threadIdx.x] = in[(k0 + i) * n + n0 + threadIdx.x];
    __syncthreads();
    for (int i = threadIdx.y; i < 32; i += blockDim.y)
      if (n0 + i < n && k0 + threadIdx.x < k) out[(n0 + i) * k + k0 + threadIdx.x] = tile[threadIdx.x][i];
    __syncthreads();  // the tile is read before the next one overwrites it
  }
}

// Over the block, for two counts at once: the sums of v over the threads before this one,
// and (total) over all. Each warp scans its lanes, then the first warp scans the warps'
// totals, so that no thread walks the warps one by one (32 of them in moe_plan's block).
__device__ int2 block_exclusive_sum(int2 v, int2& total) {
  __shared__ int2 warp_before[32];  // each warp's total, then the totals of the warps before it
  __shared__ int2 block_total;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
  auto warp_inclusive_sum = [&](int2 x) {
    for (int o = 1; o < 32; o <<= 1) {
      const int a = __shfl_up_sync(0xffffffffu, x.x, o), b = __shfl_up_sync(0xffffffffu, x.y, o);
      if (lane >= o) x.x += a, x.y += b;
    }
    return x;
  };
  const int2 inclusive = warp_inclusive_sum(v);
  __syncthreads();  // a previous call's readers are done with warp_before
  if (lane == 31) warp_before[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    const int2 own = lane < warps ? warp_before[lane] : make_int2(0, 0), upto = warp_inclusive_sum(own);
    if (lane < warps) warp_before[lane] = make_int2(upto.x - own.x, upto.y - own.y);
    if (lane == 31) block_total = upto;
  }
  __syncthreads();
  total = block_total;
  const int2 before = warp_before[warp];
  return make_int2(before.x + inclusive.x - v.x, before.y + inclusive.y - v.y);
}

// One block (whole warps): count the pairs per expert; lay out segments and tiles, each
// thread a run of consecutive experts placed after the runs before it (prefix sums of rows
// and of tiles); then place each pair at its expert's next row. The order of rows within
// an expert does not matter: every row's product is computed on its own. The counters are
// 32-bit (moe_plan checks that the pairs fit): shared memory adds those natively, 64-bit
// ones in compare-and-swap loops that the experts' pairs contend for. (Keeping a thread's
// first ids in registers for the placing pass, one round trip less, measured 7.9 -> 7.8 us
// a launch at batch 1 on the H200, the steps no faster: not kept, thirtieth session.)
__global__ void moe_plan_kernel(const int32_t* ids, int64_t pairs, int top_k, int experts, int tile_rows,
                                const ExpertStack gate_up, const ExpertStack down, int64_t* row_map,
                                int64_t* inverse, GemmSegment* up_segments, GemmSegment* down_segments,
                                GemmTile* tiles, int max_tiles) {
  wait_for_earlier_kernels();
  extern __shared__ uint32_t counts[];  // [experts] counts, then [experts] next free row
  uint32_t* cursor = counts + experts;
  for (int e = threadIdx.x; e < experts; e += blockDim.x) counts[e] = 0;
  __syncthreads();
  const int n_pairs = int(pairs);  // moe_plan checks that they fit: 32-bit indices and divisions
  for (int a = threadIdx.x; a < n_pairs; a += blockDim.x) atomicAdd(&counts[ids[a]], 1u);
  __syncthreads();
  const int per_thread = (experts + blockDim.x - 1) / blockDim.x;
  const int first = min(experts, int(threadIdx.x) * per_thread), last = min(experts, first + per_thread);
  int2 run = make_int2(0, 0), total;  // rows, tiles
  for (int e = first; e < last; ++e) run.x += int(counts[e]), run.y += int((counts[e] + tile_rows - 1) / tile_rows);
  const int2 before = block_exclusive_sum(run, total);
  int64_t row = before.x, tile = before.y;
  const int64_t total_tiles = total.y;
  for (int e = first; e < last; ++e) {
    const int64_t n = counts[e];
    up_segments[e] = {row, row, int(n), gate_up.expert(e)};
    down_segments[e] = {row, row, int(n), down.expert(e)};
    for (int64_t m0 = 0; m0 < n; m0 += tile_rows) tiles[tile++] = {e, int(m0)};
    cursor[e] = uint32_t(row);
    row += n;
  }
  for (int64_t t = total_tiles + threadIdx.x; t < max_tiles; t += blockDim.x) tiles[t] = {-1, 0};
  __syncthreads();
  for (int a = threadIdx.x; a < n_pairs; a += blockDim.x) {
    const int64_t at = atomicAdd(&cursor[ids[a]], 1u);
    row_map[at] = a / top_k;
    inverse[a] = at;
  }
}

// A thread per (token, 4 columns) where rows are whole aligned float4s, else per column:
// blockIdx.x is the token (the grid's long side), whose pairs' rows and weights every
// thread of it reads (from cache after the first).
// Tried and not kept (thirty-first session, H200, batch 1, 1K): eight pairs' row indices
// and weights loaded together, then their eight rows' values (two round trips at top-k 8,
// where unroll 4 takes four): 8.1 -> 8.7 us a layer in the step's trace.
template <class T>
__global__ void combine_experts_kernel(const T* y, const int64_t* inverse, const float* weights, int top_k,
                                       int64_t hidden, bool vector, float* out) {
  wait_for_earlier_kernels();
  const int64_t t = blockIdx.x, width = vector ? 4 : 1;
  const int64_t c = (int64_t(blockIdx.y) * blockDim.x + threadIdx.x) * width;
  if (c >= hidden) return;
  const int64_t* rows = inverse + t * top_k;
  const float* w = weights + t * top_k;
  if (vector) {
    float4 acc = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll 4
    for (int k = 0; k < top_k; ++k) {
      const float4 v = load4(y + rows[k] * hidden, c);
      add_weighted(acc.x, w[k], v.x), add_weighted(acc.y, w[k], v.y), add_weighted(acc.z, w[k], v.z),
          add_weighted(acc.w, w[k], v.w);
    }
    *reinterpret_cast<float4*>(out + t * hidden + c) = acc;
  } else {
    float acc = 0.0f;
    for (int k = 0; k < top_k; ++k) add_weighted(acc, w[k], load1(y + rows[k] * hidden, c));
    out[t * hidden + c] = acc;
  }
}

__global__ void random_bf16_kernel(__nv_bfloat16* out, int64_t n, uint64_t seed, float scale) {
  wait_for_earlier_kernels();
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = __float2bfloat16(random_weight_value(seed, uint64_t(i), scale));
}

// Softmax statistics kept online over a stream of values: the running max m, s = the sum
// of e^(x - m) and t = the sum of e^(x - m) (x - m), for the entropy; -inf values (masked
// ids) count for nothing. e^x by exp_ftz, as the softmax op.
// Values come four at a time: one max and at most one rescale a group, the four terms
// summed as a tree before they join the running sums (fewer branches and a shorter chain of
// dependent operations than value by value: the batch-1 sampler took 604 us on the H200,
// against 614-617 us in three earlier traces).
struct OnlineSoftmax {
  float m, s, t;

  __device__ void add(const float (&x)[4]) {
    const float top = fmaxf(fmaxf(x[0], x[1]), fmaxf(x[2], x[3]));
    if (top == -INFINITY) return;
    if (top > m) {  // a new max: what came before (nothing, the first time) is rescaled to it
      if (s > 0.0f) {
        const float c = exp_ftz(m - top);
        t = c * (t + (m - top) * s);
        s *= c;
      }
      m = top;
    }
    float e[4], et[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const bool counts = x[j] != -INFINITY;
      const float d = counts ? x[j] - m : 0.0f;
      e[j] = counts ? exp_ftz(d) : 0.0f;
      et[j] = e[j] * d;
    }
    s += (e[0] + e[1]) + (e[2] + e[3]);
    t += (et[0] + et[1]) + (et[2] + et[3]);
  }
  __device__ void merge(const OnlineSoftmax& o) {
    if (o.s == 0.0f) return;
    if (s == 0.0f) {
      *this = o;
      return;
    }
    const float top = fmaxf(m, o.m), a = exp_ftz(m - top), b = exp_ftz(o.m - top);
    t = a * (t + (m - top) * s) + b * (o.t + (o.m - top) * o.s);
    s = a * s + b * o.s;
    m = top;
  }
  // -sum p log p of the softmax (torch's Categorical entropy): log s - t / s.
  __device__ float entropy() const { return logf(s) - t / s; }
};

// The statistics merged over the block: every thread gets the same, merged in one order.
__device__ OnlineSoftmax block_merge(OnlineSoftmax v) {
  __shared__ float m[32], s[32], t[32];
  for (int o = 16; o > 0; o >>= 1)
    v.merge({__shfl_xor_sync(0xffffffffu, v.m, o), __shfl_xor_sync(0xffffffffu, v.s, o),
             __shfl_xor_sync(0xffffffffu, v.t, o)});
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
  __syncthreads();
  if (lane == 0) m[warp] = v.m, s[warp] = v.s, t[warp] = v.t;
  __syncthreads();
  OnlineSoftmax total{m[0], s[0], t[0]};
  for (int w = 1; w < warps; ++w) total.merge({m[w], s[w], t[w]});
  return total;
}

// Whether gumbel(bits) is certainly below `bound`, from the special function unit's fast
// logarithms (a few instructions, where gumbel's two accurate logf take dozens). __logf's
// error is within 2^-21.4 on [0.5, 2] and 3 ulp elsewhere, so where -log(u) >= 1e-3 the
// estimate is within 4e-4 of the noise, and the 0.01 margin leaves every value that could
// reach the bound (and ties) to the exact noise. Both logarithms' inputs are normal floats
// (u >= 2^-24, and -log(u) >= 6e-8), so log_ftz gives __logf's values; both are taken
// whatever the first gives, without a branch.
__device__ __forceinline__ bool gumbel_certainly_below(uint32_t bits, float bound) {
  const float y = -log_ftz(uniform_open(bits));
  return (y >= 1e-3f) & (-log_ftz(y) < bound - 0.01f);
}

// How a row's feedback (the second pass's output) is written: the processed values f
// themselves or their softmax, fp32 over the logits; or their softmax rounded to bf16 into
// the soft embedding product's input rows (the form that product takes).
enum class Feedback { Processed, Softmax, SoftmaxBf16 };

// One block per canvas row, two passes over it. The first computes the processed logits p
// ((softcap(logits) + bias) / temperature; -inf where the bias is), writes them over the logits, and
// gathers what the rest needs of them: the argmax, the entropy (from online softmax
// statistics) and the softmax statistics of the feedback f (p rounded to bf16 when
// round_bf16). (Writing p and reading it back costs less than computing the softcap's tanh
// and the two divisions again. Tried and not kept, sixty-fifth session, sampler_bench on an
// H100, 256 / 4,096 rows: the second pass recomputing p from the logits, the first storing
// nothing, a third less traffic: near-uniform rows 384 -> 425 / 5881 -> 6453 us, peaked ones
// 333 -> 314 / 5226 -> 4607; the step's random-weight rows are the near-uniform kind, and
// the H200's faster memory leaves the peaked rows' saving smaller.) The
// second reads p back and writes the feedback (kFeedback), and draws the Gumbel-max
// candidate: only for ids whose p is within the noise's range of the row's max, since
// the winner's noisy value is at least max + the least noise and no other id can reach
// it. With a peaked distribution that skips the Philox draws and the two logarithms of
// nearly the whole vocabulary; the candidate is the same id. Of the ids drawn, those whose
// noise certainly leaves them below the thread's best noisy value so far skip the exact
// noise (gumbel_certainly_below): with near-uniform rows (the random-weight benchmark's)
// that is nearly all of them.
// Bound by instruction issue, the passes keep per-value work to the arithmetic: the
// softcap, the bias and the feedback's form are template parameters, not tests a
// value; each thread's ids come in tiles of kSampleLoads float4s, and where the row is whole,
// aligned float4s every whole tile (all but a partial last one) is read without a bound check;
// the divisions by the cap and the temperature refine their reciprocals once (Divisor).
// Each thread still sees its ids in the same order, so the statistics are those of a plain
// loop. (A batch-1 call on an H100, sixty-fourth session: 580 -> 381 us, which moves its
// 938 MB at 2.5 TB/s, near that machine's copy bandwidth.)
template <bool kSoftcap, bool kBiased, Feedback kFeedback>
__global__ void __launch_bounds__(kSampleThreads, 2)
    sample_kernel(float* logits, int vocab, float cap, float temperature, const float* bias, RandomKey key,
                  DeviceSchedule schedule, bool round_bf16, __nv_bfloat16* feedback_rows, bool vector,
                  DeviceRowSample* out) {
  wait_for_earlier_kernels();
  const int row = blockIdx.x;
  if (schedule.steps_done) {
    const int step = *schedule.steps_done;
    temperature = schedule_temperature(schedule.t_min, schedule.t_max, schedule.max_steps - step, schedule.max_steps);
    key.step = uint32_t(step);
  }
  float* l = logits + int64_t(row) * vocab;
  const Divisor by_cap(cap), by_temperature(temperature);
  auto fed_back = [&](float p) { return round_bf16 ? __bfloat162float(__float2bfloat16(p)) : p; };
  // The row's values v4 .. v4 + 3 (kWhole: all inside the row and the row whole float4s).
  auto load4 = [&]<bool kWhole>(int v4, float (&x)[4]) {
    if (kWhole || vector) {
      const float4 q = *reinterpret_cast<const float4*>(l + v4);
      x[0] = q.x, x[1] = q.y, x[2] = q.z, x[3] = q.w;
    } else {
      for (int j = 0; j < 4; ++j) x[j] = v4 + j < vocab ? l[v4 + j] : 0.0f;
    }
  };
  auto store4 = [&]<bool kWhole>(int v4, const float (&x)[4]) {
    if (kWhole || vector) *reinterpret_cast<float4*>(l + v4) = {x[0], x[1], x[2], x[3]};
    else
      for (int j = 0; j < 4 && v4 + j < vocab; ++j) l[v4 + j] = x[j];
  };
  // f(v4, x, n) on this thread's ids four at a time (x: the row's values from v4; n: how many
  // of the four ids lie in the row, 4 in a whole tile), in the same order in both passes,
  // kSampleLoads loads issued before any value is used.
  const int first4 = int(threadIdx.x) * 4, stride4 = int(blockDim.x) * 4, tile = kSampleLoads * stride4;
  const int whole_tiles = vector ? vocab / tile : 0;
  auto for_each4 = [&](auto f) {
    int base = first4;
    for (int t = 0; t < whole_tiles; ++t, base += tile) {
      float x[kSampleLoads][4];
#pragma unroll
      for (int u = 0; u < kSampleLoads; ++u) load4.template operator()<true>(base + u * stride4, x[u]);
#pragma unroll
      for (int u = 0; u < kSampleLoads; ++u) f.template operator()<true>(base + u * stride4, x[u], 4);
    }
    for (; base < vocab; base += tile) {
      float x[kSampleLoads][4];
#pragma unroll
      for (int u = 0; u < kSampleLoads; ++u)
        if (base + u * stride4 < vocab) load4.template operator()<false>(base + u * stride4, x[u]);
#pragma unroll
      for (int u = 0; u < kSampleLoads; ++u) {
        const int v4 = base + u * stride4;
        if (v4 < vocab) f.template operator()<false>(v4, x[u], min(4, vocab - v4));
      }
    }
  };
  float best = -INFINITY;
  int best_i = INT_MAX;
  OnlineSoftmax dist{-INFINITY, 0.0f, 0.0f}, feedback = dist;
  for_each4([&]<bool kWhole>(int v4, float (&x)[4], int n) {
    // p: (softcap(x) + bias) / temperature; ids biased by -inf and ids past the row -inf
    // (set after the division, which could make NaN of an infinity).
    if constexpr (kSoftcap) {
      const float logit[4] = {x[0], x[1], x[2], x[3]};
      by_cap.divide(x);
#pragma unroll
      for (int j = 0; j < 4; ++j) x[j] = softcap_of_quotient(logit[j], x[j], cap);
    }
    [[maybe_unused]] float b[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // (the bias, read once for both uses)
    if constexpr (kBiased) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        b[j] = j < n ? bias[v4 + j] : 0.0f;
        x[j] += b[j];
      }
    }
    by_temperature.divide(x);
    float f[4];
    // A thread's ids rise, so its running argmax keeps the first of equal values by `>`
    // (and takes the first id at all, even where every value is -inf).
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      bool counts = j < n;
      if constexpr (kBiased) counts = counts && b[j] != -INFINITY;
      const float p = x[j] = counts ? x[j] : -INFINITY;
      f[j] = fed_back(p);
      if (j < n && (p > best || (p == best && best_i == INT_MAX))) best = p, best_i = v4 + j;
    }
    dist.add(x);
    feedback.add(f);
    store4.template operator()<kWhole>(v4, x);
  });
  block_argmax(best, best_i);
  dist = block_merge(dist);
  feedback = block_merge(feedback);
  const float inv_sum = 1.0f / feedback.s, reach = best + kGumbelMin;
  float best_noisy = -INFINITY;
  int noisy_i = INT_MAX;
  for_each4([&]<bool kWhole>(int v4, float (&p)[4], int n) {
    float x[4];
    bool draw = false;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float f = fed_back(p[j]);
      x[j] = kFeedback == Feedback::Processed ? f : exp_ftz(f - feedback.m) * inv_sum;
      draw |= j < n && !(p[j] + kGumbelMax < reach);
    }
    if constexpr (kFeedback != Feedback::SoftmaxBf16) {
      store4.template operator()<kWhole>(v4, x);
    } else {
      __nv_bfloat16* to = feedback_rows + int64_t(row) * vocab + v4;
      if (kWhole || vector)
        *reinterpret_cast<uint2*>(to) = make_uint2(round_bf16x2(x[0], x[1]), round_bf16x2(x[2], x[3]));
      else
        for (int j = 0; j < n; ++j) to[j] = __float2bfloat16(x[j]);
    }
    if (!draw) return;
    const Philox4 bits = key.draw(uint32_t(row), uint32_t(v4));
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if (j >= n || p[j] + kGumbelMax < reach || gumbel_certainly_below(bits[j], best_noisy - p[j])) continue;
      const float noisy = p[j] + gumbel(bits[j]);
      if (noisy > best_noisy || (noisy == best_noisy && v4 + j < noisy_i)) best_noisy = noisy, noisy_i = v4 + j;
    }
  });
  block_argmax(best_noisy, noisy_i);
  if (threadIdx.x == 0) out[row] = {best_i, noisy_i, dist.entropy()};
}

// update_canvas_kernel's threads: one block for the whole canvas.
constexpr int kCanvasThreads = 512;

// sampler.h's update_canvas for one block, bit for bit. The stable sort by entropy is a
// rank per position (entropies below it, or equal at a lower position: O(canvas^2)
// compares), the acceptance's running sum and the mean entropy one thread's double sums in
// the reference's order. Their operands pass through shared memory a chunk of
// kCanvasThreads positions at a time: read from global memory, each compare loaded its
// entropy, and the running sum's loads were a chain (an order entry, then its entropy),
// which took 46 us a step at canvas 256 on the H200 (kernel_trace.py, fiftieth session).
__global__ void __launch_bounds__(kCanvasThreads)
    update_canvas_kernel(DeviceCanvas s, const DeviceRowSample* rows, int32_t* order, uint8_t* accepted) {
  wait_for_earlier_kernels();
  if (s.counters[kCanvasStopped]) return;  // as update_canvas: a stopped canvas takes no more steps
  const CanvasParams& p = s.params;
  const int canvas = p.canvas, step = s.counters[kCanvasSteps], t = threadIdx.x;
  // A chunk: each position's entropy and whether it is free, and its sort key (NaN entropies
  // last, a total order, so that the ranks stay a permutation; positions not free NaN, which
  // no compare counts); in the running sum's pass, positions in rank order and their entropies.
  __shared__ float entropies[kCanvasThreads], keys[kCanvasThreads];
  __shared__ bool frees[kCanvasThreads];
  __shared__ int32_t ranked[kCanvasThreads];
  auto key = [](float e) { return e == e ? e : INFINITY; };
  auto stage = [&](int base) {  // positions [base, base + kCanvasThreads), every thread
    __syncthreads();  // the chunk before is read
    const int i = base + t;
    const bool free = i < canvas && s.free_position[i];
    const float e = i < canvas ? rows[i].entropy : 0.0f;
    entropies[t] = e, frees[t] = free, keys[t] = free ? key(e) : NAN;
    __syncthreads();
  };
  int free = 0;  // thread 0's: the free positions, their entropies' sum, whether any row's is NaN
  double sum = 0;
  bool non_finite = false;  // from logits that held NaN or infinity
  for (int base_i = 0; base_i < canvas; base_i += kCanvasThreads) {
    const int i = base_i + t;
    const bool ranks = i < canvas && s.free_position[i];
    const float e = i < canvas ? key(rows[i].entropy) : 0.0f;
    int rank = 0;
    for (int base_j = 0; base_j < canvas; base_j += kCanvasThreads) {
      stage(base_j);
      const int n = min(kCanvasThreads, canvas - base_j);
      if (ranks)
        for (int j = 0; j < n; ++j) {
          const float f = keys[j];
          rank += f < e || (f == e && base_j + j < i);
        }
      if (base_i == 0 && t == 0)
        for (int j = 0; j < n; ++j) {
          if (frees[j]) sum += entropies[j], ++free;
          non_finite |= entropies[j] != entropies[j];  // every row's, pinned too (as the CPU's update)
        }
    }
    if (ranks) order[rank] = i;
  }
  __shared__ float mean_entropy;
  __shared__ int free_count;
  if (t == 0) mean_entropy = free ? float(sum / free) : 0.0f, free_count = free;
  __syncthreads();  // (the order entries written, too)
  double running = 0;  // thread 0's
  for (int base = 0; base < free_count; base += kCanvasThreads) {
    __syncthreads();  // the chunk before is read
    if (base + t < free_count) {
      const int i = order[base + t];
      ranked[t] = i, entropies[t] = rows[i].entropy;
    }
    __syncthreads();
    if (t == 0)
      for (int r = 0; r < min(kCanvasThreads, free_count - base); ++r) {
        running += entropies[r];
        accepted[ranked[r]] = float(running) - entropies[r] <= p.entropy_bound;
      }
  }
  __syncthreads();
  const RandomKey renoise{p.seed, p.block, uint32_t(step), RandomStream::Renoise};
  bool same = p.stability <= 0 || step >= p.stability;
  for (int i = threadIdx.x; i < canvas; i += blockDim.x) {
    if (s.free_position[i]) {
      s.argmax[i] = rows[i].argmax;
      s.tokens[i] = accepted[i] ? rows[i].candidate
                                : random_allowed_token(renoise, uint32_t(i), p.vocab, s.allowed_ids, p.allowed_count);
    }
    for (int h = 0; h < p.stability && same; ++h) same = s.history[int64_t(h) * canvas + i] == s.argmax[i];
  }
  const bool stable = __syncthreads_and(same);
  if (p.stability > 0)
    for (int i = threadIdx.x; i < canvas; i += blockDim.x)
      s.history[int64_t(step % p.stability) * canvas + i] = s.argmax[i];
  if (threadIdx.x == 0) {
    s.counters[kCanvasSteps] = step + 1;
    s.counters[kCanvasStopped] = (stable && mean_entropy < p.confidence) || step + 1 == p.max_steps || non_finite;
    s.counters[kCanvasNonFinite] |= non_finite;
  }
}

__global__ void continue_while_kernel(cudaGraphConditionalHandle condition, const int32_t* const* stopped, int count,
                                      int32_t* runs, int max_runs) {
  wait_for_earlier_kernels();
  bool go = ++*runs < max_runs;
  for (int i = 0; i < count; ++i) go = go && !*stopped[i];
  cudaGraphSetConditional(condition, go ? 1u : 0u);
}

__global__ void round_bf16_kernel(float* x, int64_t n) {
  wait_for_earlier_kernels();
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) x[i] = __bfloat162float(__float2bfloat16(x[i]));
}

// FP8 per token: one warp per row finds the row's absolute maximum, then quantizes it.
__global__ void quantize_fp8_rows_kernel(float* x, int64_t rows, int64_t cols) {
  wait_for_earlier_kernels();
  const int64_t row = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  if (row >= rows) return;  // whole warps: blocks are whole warps
  const int lane = threadIdx.x & 31;
  float* v = x + row * cols;
  const float scale = warp_fp8_token_scale(v, cols);
  for (int64_t j = lane; j < cols; j += 32) v[j] = fake_quantize_e4m3(v[j], scale);
}

// NVFP4: one thread per group of 16 values, under its row's global scale.
__global__ void quantize_nvfp4_groups_kernel(float* x, int64_t rows, int64_t cols, int64_t encoder_rows,
                                             float encoder_global, float decoder_global) {
  wait_for_earlier_kernels();
  const int64_t groups = cols / kNvfp4Group, i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * groups) return;
  const int64_t row = i / groups;
  fake_quantize_nvfp4_group(x + row * cols + (i % groups) * kNvfp4Group,
                            row < encoder_rows ? encoder_global : decoder_global);
}

// A thread per 16-value group of an expert-ordered row (quantize_nvfp4_expert_rows). The
// row's expert: the last segment starting at or before it (segments start in expert order
// and an empty one starts where the next begins, so the last is the one holding the row).
__global__ void quantize_nvfp4_expert_rows_kernel(const float* x, bool gather, const int64_t* row_map,
                                                  const GemmSegment* segments, int experts, int64_t rows,
                                                  int64_t cols, int64_t encoder_tokens, const float* encoder_global,
                                                  const float* decoder_global, float* out) {
  wait_for_earlier_kernels();
  const int64_t groups = cols / kNvfp4Group, i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * groups) return;
  const int64_t row = i / groups, column = (i % groups) * kNvfp4Group, token = row_map[row];
  int lo = 0, hi = experts - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (segments[mid].x_row <= row) lo = mid;
    else hi = mid - 1;
  }
  float v[kNvfp4Group];
  const float* src = x + (gather ? token : row) * cols + column;
  for (int j = 0; j < kNvfp4Group; ++j) v[j] = src[j];
  fake_quantize_nvfp4_group(v, token < encoder_tokens ? encoder_global[lo] : decoder_global[lo]);
  for (int j = 0; j < kNvfp4Group; ++j) out[row * cols + column + j] = v[j];
}

}  // namespace

void embed(const __nv_bfloat16* table, int64_t hidden, const int32_t* ids, int64_t n, float scale, float* out,
           cudaStream_t stream) {
  if (n) launch(embed_kernel, blocks_for(n * hidden), kThreads, 0, stream, table, hidden, ids, n, scale, out);
}

bool rms_norms_take_sums(int64_t group) { return group >= 1024 && group <= kRowValues * kRowKernelThreads; }

void rms_norms(const float* x, const NormOutputs& outs, const NormOutputs& then, const NormOutputs& after,
               int64_t groups, int64_t group, float eps, cudaStream_t stream, const ExpertSums& sums) {
  if (!groups || !outs.count) return;
  if (sums.any() && !rms_norms_take_sums(group)) throw std::invalid_argument("rms_norms: expert sums of rows this wide");
  for (const NormOutputs* o : {&outs, &then, &after})
    if (o->count > kMaxNormOutputs || (o->accumulate && o->count > 1))
      throw std::invalid_argument("rms_norms: at most 4 outputs, one when accumulating");
  if (then.count && outs.count > 1) throw std::invalid_argument("rms_norms: `then` normalises one output");
  if (after.count && (then.count != 1 || after.accumulate))
    throw std::invalid_argument("rms_norms: `after` writes the norm of `then`'s one output");
  if (then.norm_old || after.norm_old || (outs.norm_old && !(outs.accumulate && rms_norms_take_sums(group))))
    throw std::invalid_argument("rms_norms: only the first norm, accumulating into rows the row kernel takes, norms "
                                "its old rows");
  if (rms_norms_take_sums(group)) {  // rows that fit the row kernel's registers
    // float4s where every row the kernel touches is whole aligned ones
    bool vector = group % 4 == 0 && (sums.y_bf16 ? reinterpret_cast<uintptr_t>(sums.y_bf16) % 8 == 0
                                                 : reinterpret_cast<uintptr_t>(sums.y ? sums.y : x) % 16 == 0);
    for (const NormOutputs* o : {&outs, &then, &after})
      for (int k = 0; k < o->count; ++k)
        vector = vector && reinterpret_cast<uintptr_t>(o->y[k]) % 16 == 0 &&
                 reinterpret_cast<uintptr_t>(o->weight[k]) % 16 == 0;
    vector = vector && reinterpret_cast<uintptr_t>(outs.old_weight) % 16 == 0;
    const int threads = int(((group + kRowValues - 1) / kRowValues + 31) / 32 * 32);
    const auto kernel = !vector                            ? rms_norm_row_kernel<1, kRowKernelThreads>
                        : threads <= kRowKernelPairThreads ? rms_norm_row_kernel<4, kRowKernelPairThreads>
                                                           : rms_norm_row_kernel<4, kRowKernelThreads>;
    launch(kernel, unsigned(groups), threads, 0, stream, x, NormStages{{outs, then, after}}, group, eps, sums);
    return;
  }
  if (group >= 1024) {
    launch(rms_norm_kernel, unsigned(groups), kThreads, 0, stream, x, outs, then, group, eps);
  } else {
    constexpr int kWarps = kThreads / 32;
    launch(rms_norm_warp_kernel, unsigned((groups + kWarps - 1) / kWarps), kThreads, 0, stream, x, outs, then, groups,
           group, eps);
  }
  for (const NormOutputs* o : {&outs, &then})
    for (int k = 0; k < o->count; ++k)
      if (o->prepared[k].rows) write_gemm_input(o->y[k], groups, group, false, group, false, o->prepared[k], stream);
  if (after.count) rms_norms(then.y[0], after, {}, {}, groups, group, eps, stream);
}

void rms_norm_rope(const HeadNormParts& parts, int64_t head_dim, float eps, const float* inv_freq,
                   cudaStream_t stream) {
  constexpr int kWarps = kThreads / 32;
  int64_t groups = 0;
  for (int p = 0; p < parts.count; ++p) groups += parts.part[p].rows * parts.part[p].heads;
  if (groups)
    launch(rms_norm_rope_kernel, unsigned((groups + kWarps - 1) / kWarps), kThreads, 0, stream, parts, head_dim, eps,
           inv_freq);
}

void gelu_glu(const float* x, int64_t rows, int64_t inter, float* out, cudaStream_t stream) {
  if (rows * inter) launch(gelu_glu_kernel, blocks_for(rows * inter), kThreads, 0, stream, x, rows, inter, out);
}

void add(const float* a, const float* b, float* y, int64_t n, cudaStream_t stream) {
  if (n) launch(add_kernel, blocks_for(n), kThreads, 0, stream, a, b, y, n);
}

void scale(float* x, float s, int64_t n, cudaStream_t stream) {
  if (n) launch(scale_kernel, blocks_for(n), kThreads, 0, stream, x, s, n);
}

void softcap(float* x, float cap, int64_t n, cudaStream_t stream) {
  if (n) launch(softcap_kernel, blocks_for(n), kThreads, 0, stream, x, cap, n);
}

void softmax_rows(float* x, int64_t rows, int64_t cols, cudaStream_t stream) {
  if (rows) launch(softmax_kernel, unsigned(rows), kRowThreads, 0, stream, x, cols);
}

template <class T>
void scatter_rows(const float* src, int64_t cols, const int64_t* dst_rows, int64_t n, T* dst, cudaStream_t stream) {
  if (n) launch(scatter_rows_kernel<T>, blocks_for(n * cols), kThreads, 0, stream, src, cols, dst_rows, n, dst);
}
template void scatter_rows(const float*, int64_t, const int64_t*, int64_t, float*, cudaStream_t);
template void scatter_rows(const float*, int64_t, const int64_t*, int64_t, __nv_bfloat16*, cudaStream_t);

void transpose_bf16(const __nv_bfloat16* in, int64_t k, int64_t n, __nv_bfloat16* out, cudaStream_t stream) {
  const dim3 grid(unsigned((n + 31) / 32), unsigned(std::min<int64_t>((k + 31) / 32, 65535))), block(32, 8);
  launch(transpose_bf16_kernel, grid, block, 0, stream, in, k, n, out);
}

void moe_plan(const int32_t* expert_ids, int64_t pairs, int top_k, int experts, int tile_rows,
              const ExpertStack& gate_up, const ExpertStack& down, int64_t* row_map, int64_t* inverse,
              GemmSegment* up_segments, GemmSegment* down_segments, GemmTile* tiles, int max_tiles,
              cudaStream_t stream) {
  if (pairs > int64_t(INT32_MAX)) throw std::invalid_argument("moe_plan: more than 2^31 token-expert pairs");
  const size_t bytes = sizeof(uint32_t) * 2 * size_t(experts);
  cudaFuncSetAttribute(moe_plan_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
  launch(moe_plan_kernel, 1, 1024, bytes, stream, expert_ids, pairs, top_k, experts, tile_rows, gate_up, down, row_map,
         inverse, up_segments, down_segments, tiles, max_tiles);
}

void combine_experts(const float* y, const __nv_bfloat16* y_bf16, const int64_t* inverse, const float* weights,
                     int64_t tokens, int top_k, int64_t hidden, float* out, cudaStream_t stream) {
  // Vector loads: 16 bytes of fp32 rows, 8 of bf16 ones.
  const bool vector = hidden % 4 == 0 && (y_bf16 ? reinterpret_cast<uintptr_t>(y_bf16) % 8 == 0
                                                 : reinterpret_cast<uintptr_t>(y) % 16 == 0) &&
                      reinterpret_cast<uintptr_t>(out) % 16 == 0;
  const dim3 grid(unsigned(tokens), blocks_for(vector ? hidden / 4 : hidden));
  if (!tokens || !hidden) return;
  if (y_bf16) launch(combine_experts_kernel<__nv_bfloat16>, grid, kThreads, 0, stream, y_bf16, inverse, weights, top_k,
                     hidden, vector, out);
  else launch(combine_experts_kernel<float>, grid, kThreads, 0, stream, y, inverse, weights, top_k, hidden, vector, out);
}

void quantize_nvfp4_expert_rows(const float* x, bool gather, const int64_t* row_map, const GemmSegment* segments,
                                int experts, int64_t rows, int64_t cols, int64_t encoder_tokens,
                                const float* encoder_global, const float* decoder_global, float* out,
                                cudaStream_t stream) {
  if (rows && cols >= kNvfp4Group)
    launch(quantize_nvfp4_expert_rows_kernel, blocks_for(rows * (cols / kNvfp4Group)), kThreads, 0, stream, x, gather,
           row_map, segments, experts, rows, cols, encoder_tokens, encoder_global, decoder_global, out);
}

void tile_matrices(const uint8_t* in, int64_t matrices, int64_t n, int64_t row_bytes, bool paired, uint8_t* out,
                   cudaStream_t stream) {
  if (n % 128 || row_bytes % kRowBytes) throw std::invalid_argument("tile_matrices: 128-row blocks of 128-byte slices");
  const int64_t chunks = matrices * n * row_bytes / 16;
  if (chunks)
    launch(tile_matrices_kernel, blocks_for(chunks), kThreads, 0, stream, in, n, row_bytes, paired, chunks, out);
}

void decode_nvfp4(const uint8_t* packed, const uint8_t* group_scales, int64_t rows, int64_t cols, __nv_bfloat16* out,
                  cudaStream_t stream) {
  if (cols % 16 || reinterpret_cast<uintptr_t>(packed) % 8 || reinterpret_cast<uintptr_t>(out) % 16)
    throw std::invalid_argument("decode_nvfp4: 16-value groups, packed rows 8-byte and out 16-byte aligned");
  const int64_t groups = rows * (cols / 16);
  if (groups)
    launch(decode_nvfp4_kernel, blocks_for(groups), kThreads, 0, stream, reinterpret_cast<const uint2*>(packed),
           group_scales, groups, reinterpret_cast<uint4*>(out));
}

void lay_out_nvfp4(uint8_t* packed, uint8_t* group_scales, int64_t groups, cudaStream_t stream) {
  if (reinterpret_cast<uintptr_t>(packed) % 8)
    throw std::invalid_argument("lay_out_nvfp4: packed values 8-byte aligned");
  if (groups)
    launch(lay_out_nvfp4_kernel, blocks_for(groups), kThreads, 0, stream, reinterpret_cast<uint2*>(packed),
           group_scales, groups);
}

void random_bf16(__nv_bfloat16* out, int64_t n, uint64_t seed, float scale, cudaStream_t stream) {
  if (n)
    launch(random_bf16_kernel, unsigned(std::min<int64_t>(blocks_for(n), 65536)), kThreads, 0, stream, out, n, seed,
           scale);
}

// sample_kernel's variant for a call: softcap or none, a bias or none, and the feedback's form.
template <bool kSoftcap, bool kBiased>
auto sample_kernel_for(Feedback feedback) {
  return feedback == Feedback::Processed ? sample_kernel<kSoftcap, kBiased, Feedback::Processed>
         : feedback == Feedback::Softmax ? sample_kernel<kSoftcap, kBiased, Feedback::Softmax>
                                         : sample_kernel<kSoftcap, kBiased, Feedback::SoftmaxBf16>;
}

void sample_rows(float* logits, int64_t rows, int64_t vocab, float cap, float temperature, const float* bias,
                 RandomKey key, const DeviceSchedule& schedule, bool round_bf16, bool softmax_feedback,
                 __nv_bfloat16* feedback_rows, DeviceRowSample* out, cudaStream_t stream) {
  // Ids are ints in the kernel, and a thread's last tile may start a tile past the row.
  if (vocab > INT_MAX - 4 * kSampleThreads * kSampleLoads)
    throw std::invalid_argument("sample_rows: a vocabulary of at most " +
                                std::to_string(INT_MAX - 4 * kSampleThreads * kSampleLoads) + " ids, got " +
                                std::to_string(vocab));
  const bool vector = vocab % 4 == 0 && reinterpret_cast<uintptr_t>(logits) % 16 == 0 &&
                      reinterpret_cast<uintptr_t>(feedback_rows) % 8 == 0;
  const Feedback feedback = !softmax_feedback ? Feedback::Processed
                            : feedback_rows   ? Feedback::SoftmaxBf16
                                              : Feedback::Softmax;
  const bool softcap = cap > 0.0f;
  auto kernel = softcap ? (bias ? sample_kernel_for<true, true>(feedback)
                                 : sample_kernel_for<true, false>(feedback))
                        : (bias ? sample_kernel_for<false, true>(feedback)
                                : sample_kernel_for<false, false>(feedback));
  if (rows)
    launch(kernel, unsigned(rows), kSampleThreads, 0, stream, logits, int(vocab), cap, temperature, bias, key,
           schedule, round_bf16, feedback_rows, vector, out);
}

void update_canvas(const DeviceCanvas& canvas, const DeviceRowSample* rows, void* scratch, cudaStream_t stream) {
  auto* order = static_cast<int32_t*>(scratch);
  launch(update_canvas_kernel, 1, kCanvasThreads, 0, stream, canvas, rows, order,
         reinterpret_cast<uint8_t*>(order + canvas.params.canvas));
}

void continue_while(cudaGraphConditionalHandle condition, const int32_t* const* stopped, int count, int32_t* runs,
                    int max_runs, cudaStream_t stream) {
  launch(continue_while_kernel, 1, 1, 0, stream, condition, stopped, count, runs, max_runs);
}

void quantize_input(float* x, int64_t rows, int64_t cols, ActivationScheme scheme, int64_t encoder_rows,
                    float encoder_global, float decoder_global, cudaStream_t stream) {
  if (scheme == ActivationScheme::Bf16 && rows)
    launch(round_bf16_kernel, blocks_for(rows * cols), kThreads, 0, stream, x, rows * cols);
  if (scheme == ActivationScheme::Fp8Token && rows)
    launch(quantize_fp8_rows_kernel, blocks_for(rows * 32), kThreads, 0, stream, x, rows, cols);
  if (scheme == ActivationScheme::Nvfp4 && rows)
    launch(quantize_nvfp4_groups_kernel, blocks_for(rows * (cols / kNvfp4Group)), kThreads, 0, stream, x, rows, cols,
           encoder_rows, encoder_global, decoder_global);
}

}  // namespace diffuserve::cuda
