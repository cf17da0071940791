// Attention over the paged KV cache for a mixed-phase batch, in one launch: the generic
// kernel for any head dim (attention_mma.cu has the tensor-core one for multiples of 64).
//
// A block takes up to 16 query vectors (several rows x the query heads of one KV head,
// so each key is read once for its whole GQA group) and walks the segment's key spans in
// chunks of 32 keys with an online softmax. Keys, values, queries and the output
// accumulator sit in shared memory, so any head_dim works (256 and 512 for
// DiffusionGemma). Each segment brings its own positions, causal flag and window.
#include <cfloat>

#include "kernels.h"

namespace diffuserve::cuda {
namespace {

constexpr int kQueries = 16, kChunk = 32, kThreads = 256;

__global__ void __launch_bounds__(kThreads) attention_kernel(const float* __restrict__ q, float* __restrict__ out,
                                                             const DeviceAttentionSegment* __restrict__ segments,
                                                             const DeviceKeySpan* __restrict__ spans,
                                                             const AttentionItem* __restrict__ items, int num_heads,
                                                             int num_kv_heads, int head_dim) {
  extern __shared__ float smem[];
  const int d = head_dim, dp = head_dim + 1;  // padded rows: a warp reading 32 keys hits 32 banks
  float* Q = smem;                            // [kQueries][dp]
  float* K = Q + kQueries * dp;               // [kChunk][dp]
  float* V = K + kChunk * dp;                 // [kChunk][d]
  float* O = V + kChunk * d;                  // [kQueries][d]
  float* P = O + kQueries * d;                // [kQueries][kChunk]
  float* m_run = P + kQueries * kChunk;       // running max, sum and rescale factor per query
  float* l_run = m_run + kQueries;
  float* alpha = l_run + kQueries;

  const AttentionItem item = items[blockIdx.x];
  const DeviceAttentionSegment seg = segments[item.segment];
  const int group = num_heads / num_kv_heads;
  const int heads = min(group, kQueries);  // query heads of this kv head per row
  const int nq = item.rows * heads;
  const int64_t q_stride = int64_t(num_heads) * d;
  const int tid = threadIdx.x;

  // Query vector j: row j / heads of the item, head kv_head * group + j % heads.
  for (int i = tid; i < nq * d; i += kThreads) {
    const int j = i / d, c = i % d;
    const int64_t row = seg.first_row + item.row0 + j / heads;
    Q[j * dp + c] = q[row * q_stride + int64_t(item.kv_head * group + j % heads) * d + c];
    O[j * d + c] = 0.0f;
  }
  if (tid < kQueries) m_run[tid] = -FLT_MAX, l_run[tid] = 0.0f;

  const int64_t kv_stride = int64_t(num_kv_heads) * d;
  for (int s = seg.span_begin; s < seg.span_begin + seg.span_count; ++s) {
    const DeviceKeySpan span = spans[s];
    for (int64_t c0 = 0; c0 < span.count; c0 += kChunk) {
      const int count = int(span.count - c0 < kChunk ? span.count - c0 : kChunk);
      __syncthreads();
      for (int i = tid; i < count * d; i += kThreads) {
        const int r = i / d, c = i % d;
        const int64_t off = (c0 + r) * kv_stride + int64_t(item.kv_head) * d + c;
        K[r * dp + c] = span.keys[off];
        V[r * d + c] = span.values[off];
      }
      __syncthreads();
      // Scores: (query, key) pairs spread over the threads.
      for (int pair = tid; pair < kQueries * kChunk; pair += kThreads) {
        const int j = pair / kChunk, r = pair % kChunk;
        float score = -INFINITY;
        if (j < nq && r < count) {
          const int64_t p = seg.first_position + item.row0 + j / heads, key = span.first_position + c0 + r;
          const bool visible = !seg.causal || (key <= p && (seg.window == 0 || key > p - seg.window));
          if (visible) {
            float acc = 0.0f;
            for (int c = 0; c < d; ++c) acc += Q[j * dp + c] * K[r * dp + c];
            score = acc;
          }
        }
        P[j * kChunk + r] = score;
      }
      __syncthreads();
      // Online softmax bookkeeping, one thread per query.
      if (tid < nq) {
        float* row = P + tid * kChunk;
        float chunk_max = -INFINITY;
        for (int r = 0; r < kChunk; ++r) chunk_max = fmaxf(chunk_max, row[r]);
        const float m_new = fmaxf(m_run[tid], chunk_max);
        float sum = 0.0f;
        for (int r = 0; r < kChunk; ++r) sum += (row[r] = row[r] == -INFINITY ? 0.0f : __expf(row[r] - m_new));
        alpha[tid] = __expf(m_run[tid] - m_new);
        l_run[tid] = l_run[tid] * alpha[tid] + sum;
        m_run[tid] = m_new;
      }
      __syncthreads();
      for (int i = tid; i < nq * d; i += kThreads) {
        const int j = i / d, c = i % d;
        float acc = O[i] * alpha[j];
        for (int r = 0; r < count; ++r) acc += P[j * kChunk + r] * V[r * d + c];
        O[i] = acc;
      }
    }
  }
  __syncthreads();
  for (int i = tid; i < nq * d; i += kThreads) {
    const int j = i / d, c = i % d;
    const int64_t row = seg.first_row + item.row0 + j / heads;
    const float l = l_run[j];
    out[row * q_stride + int64_t(item.kv_head * group + j % heads) * d + c] = l > 0.0f ? O[i] / l : 0.0f;
  }
}

size_t shared_bytes(int head_dim) {
  const int dp = head_dim + 1;
  return sizeof(float) * (size_t(kQueries) * dp + size_t(kChunk) * dp + size_t(kChunk) * head_dim +
                          size_t(kQueries) * head_dim + kQueries * kChunk + 3 * kQueries);
}

}  // namespace

int attention_rows_per_item(int group, int head_dim) {
  const int mma_queries = attention_mma_queries(head_dim);  // nonzero where attention_mma serves
  const int queries = mma_queries ? mma_queries : kQueries;
  return group >= queries ? 1 : queries / group;
}

void attention(const float* q, float* out, const DeviceAttentionSegment* segments, const DeviceKeySpan* spans,
               const AttentionItem* items, int num_items, int num_heads, int num_kv_heads, int head_dim,
               cudaStream_t stream) {
  const size_t bytes = shared_bytes(head_dim);
  cudaFuncSetAttribute(attention_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
  attention_kernel<<<num_items, kThreads, bytes, stream>>>(q, out, segments, spans, items, num_heads, num_kv_heads,
                                                           head_dim);
}

}  // namespace diffuserve::cuda
