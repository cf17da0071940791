// Attention over the paged KV cache for a mixed-phase batch, in one launch: the plan of a
// call (which block takes which rows, heads and keys), the entry point, and the generic
// kernel for any head dim (attention_mma.cu has the tensor-core one for 64, 128, 256 and
// 512, which also takes pieces of the keys: split-KV).
//
// The generic kernel: a block takes up to 16 query vectors (several rows x the query heads
// of one KV head, so each key is read once for its whole GQA group) and walks the keys its
// rows may see across the segment's spans (KeyWalk, as the tensor-core kernels do) in
// chunks of 32 keys with an online softmax. Keys, values, queries and the output
// accumulator sit in shared memory, so any head_dim works. Each segment brings its own
// positions, causal flag and window. The plan gives it each row group's keys whole, as one
// piece.
#include <algorithm>
#include <bit>
#include <cfloat>
#include <climits>
#include <cstdint>
#include <map>
#include <optional>
#include <stdexcept>

#include "attention_keys.cuh"
#include "kernels.h"

namespace diffuserve::cuda {
namespace {

constexpr int kQueries = 16, kChunk = 32, kThreads = 256;

__global__ void __launch_bounds__(kThreads)
    attention_kernel(const float* __restrict__ q, const AttentionOutput out,
                     const DeviceAttentionSegment* __restrict__ segments, const DeviceKeySpan* __restrict__ spans,
                     const AttentionItem* __restrict__ items, int num_heads, int num_kv_heads, int head_dim,
                     bool round_bf16) {
  wait_for_earlier_kernels();
  // With activations "bfloat16", Q, K, V and P rounded to bf16 before their products.
  auto input = [round_bf16](float x) { return round_bf16 ? __bfloat162float(__float2bfloat16(x)) : x; };
  extern __shared__ __align__(16) uint8_t smem_bytes[];
  // A chunk's slots: each one's key and value rows (this KV head's) and position, or none.
  const float** key_src = reinterpret_cast<const float**>(smem_bytes);  // [kChunk]
  const float** value_src = key_src + kChunk;                           // [kChunk]
  int64_t* key_position = reinterpret_cast<int64_t*>(value_src + kChunk);  // [kChunk]
  const int d = head_dim, dp = head_dim + 1;  // padded rows: a warp reading 32 keys hits 32 banks
  float* Q = reinterpret_cast<float*>(key_position + kChunk);  // [kQueries][dp]
  float* K = Q + kQueries * dp;                                // [kChunk][dp]
  float* V = K + kChunk * dp;                                  // [kChunk][d]
  float* O = V + kChunk * d;                                   // [kQueries][d]
  float* P = O + kQueries * d;                                 // [kQueries][kChunk]
  float* m_run = P + kQueries * kChunk;                        // running max, sum and rescale factor per query
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
    Q[j * dp + c] = input(q[row * q_stride + int64_t(item.kv_head * group + j % heads) * d + c]);
    O[j * d + c] = 0.0f;
  }
  if (tid < kQueries) m_run[tid] = -FLT_MAX, l_run[tid] = 0.0f;

  // Thread r < kChunk finds the key in slot r of each chunk (the walk skips the keys no row
  // of the block sees, and lays a causal segment's chunks on its grid: attention_keys.cuh).
  const KeyWalk walk = item_keys(spans, seg, item);
  KeyWalk::Slot slot{};
  if (tid < kChunk) slot = walk.slot<kChunk>({item.span, item.key}, tid);
  const int64_t kv_stride = int64_t(num_kv_heads) * d;
  for (;;) {
    bool found = false;
    if (tid < kChunk) {
      key_src[tid] = value_src[tid] = nullptr;
      if ((found = walk.holds(slot))) {
        const DeviceKeySpan& span = spans[slot.at.span];
        const int64_t off = int64_t(slot.at.key) * kv_stride + int64_t(item.kv_head) * d;
        key_src[tid] = span.keys + off, value_src[tid] = span.values + off;
        key_position[tid] = span.first_position + slot.at.key;
      }
      walk.next<kChunk>(slot);
    }
    if (!__syncthreads_or(found)) break;  // also: the last chunk's K, V and P are read
    for (int i = tid; i < kChunk * d; i += kThreads) {
      const int r = i / d, c = i % d;
      K[r * dp + c] = key_src[r] ? input(key_src[r][c]) : 0.0f;
      V[r * d + c] = value_src[r] ? input(value_src[r][c]) : 0.0f;
    }
    __syncthreads();
    // Scores: (query, key) pairs spread over the threads.
    for (int pair = tid; pair < kQueries * kChunk; pair += kThreads) {
      const int j = pair / kChunk, r = pair % kChunk;
      float score = -INFINITY;
      if (j < nq && key_src[r]) {
        const int64_t p = seg.first_position + item.row0 + j / heads, key = key_position[r];
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
      for (int r = 0; r < kChunk; ++r) chunk_max = max_nan(chunk_max, row[r]);
      const float m_new = max_nan(m_run[tid], chunk_max);
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
      for (int r = 0; r < kChunk; ++r) acc += input(P[j * kChunk + r]) * V[r * d + c];
      O[i] = acc;
    }
  }
  for (int i = tid; i < nq * d; i += kThreads) {
    const int j = i / d, c = i % d;
    const int64_t row = seg.first_row + item.row0 + j / heads;
    const float l = l_run[j], v = l != 0.0f ? O[i] / l : 0.0f;  // 0: no key seen; NaN stays NaN
    const int64_t at = row * q_stride + int64_t(item.kv_head * group + j % heads) * d + c;
    out.values[at] = v;
    if (out.bf16) out.bf16[at] = __float2bfloat16(v);
  }
}

size_t shared_bytes(int head_dim) {
  const int dp = head_dim + 1;
  return kChunk * (2 * sizeof(const float*) + sizeof(int64_t)) +
         sizeof(float) * (size_t(kQueries) * dp + size_t(kChunk) * dp + size_t(kChunk) * head_dim +
                          size_t(kQueries) * head_dim + kQueries * kChunk + 3 * kQueries);
}

// Query rows one block takes: its query vectors over the GQA group.
int rows_per_item(int group, int head_dim, bool round_bf16) {
  const int mma_queries = attention_mma_queries(head_dim, round_bf16);  // nonzero where attention_mma serves
  const int queries = mma_queries ? mma_queries : kQueries;
  return group >= queries ? 1 : queries / group;
}

// Split-KV: the size of a canvas segment's pieces, in keys, is the one that would finish the
// segment soonest if it ran alone on a GPU that runs `resident` items (blocks, or
// clusters) at once, counting waves of items each costing its piece plus kBlockCostKeys
// (loading Q, filling the pipeline, writing the output and merging). It depends on the
// segment and the GPU only. (A causal segment's are cut by causal_piece_keys instead.)
constexpr int64_t kBlockCostKeys = 64;
constexpr int64_t kMinPieceKeys = 128;  // a partial result (as large as 16 to 32 keys) stays small next to its piece
constexpr int64_t kPieceAlign = 32;     // a piece of whole chunks

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// A causal segment without a window (a full-attention layer's prompt or commit): the keys of
// a row group whose first row is at `group_first` are cut at multiples of this many
// positions, about a quarter of the keys the group sees. It depends on the group's position
// alone, not on the rows of the pass, so a row is walked in the same pieces, with the same
// merge, whatever pass it runs in (plan_attention says why that matters). A power of two of
// at least kMinCausalPieceKeys: a multiple of any group's rows (a power of two, at most
// 128), so that a group's rows lie in one piece, and of kGridKeys. A commit of 256 rows had
// walked its keys in one piece an item, 32 items of a full layer on a GPU that runs 66 of
// them: on the H200 (attention_bench, bf16 rows) its full layer after 1K / 8K / 32K keys took
// 112.9 / 695.3 / 2648.1 us so, 87.6 / 352.8 / 1324.2 in 96 items of up to 4 pieces; a
// commit pass (step_latency.py, batch 1, twice each in one call) 16.1-16.2 / 18.5-18.6 /
// 26.4-26.6 -> 15.9-16.1 / 17.1 / 20.8 ms at 1K / 8K / 32K, the denoise steps alike. The cost:
// a long prompt's rows write a partial result for each of their (at most 5) pieces, which
// the merge reads back. (Windowed segments stay one piece, plan_attention says why: the
// sliding layer's commit, 32 items of about 1,300 keys, takes 56 us at every context.)
constexpr int64_t kMinCausalPieceKeys = 512;
constexpr int64_t kCausalPieces = 4;
int64_t causal_piece_keys(int64_t group_first) {
  return std::max<int64_t>(kMinCausalPieceKeys, int64_t(std::bit_ceil(uint64_t(ceil_div(group_first + 1, kCausalPieces)))));
}

// The row at which `count` rows of keys and values start in two buffers of bf16 rows of
// `row_bytes`, keys at keys_base and values at values_base: none unless both lie whole rows
// past their buffer's start, at the same row, the buffers 16-byte aligned, and the rows
// ints for the kernel.
std::optional<int64_t> common_row(const void* keys_base, const void* values_base, int64_t row_bytes, const void* keys,
                                  const void* values, int64_t count) {
  const int64_t key_bytes = static_cast<const uint8_t*>(keys) - static_cast<const uint8_t*>(keys_base);
  const int64_t value_bytes = static_cast<const uint8_t*>(values) - static_cast<const uint8_t*>(values_base);
  if (key_bytes < 0 || key_bytes % row_bytes || value_bytes != key_bytes ||
      reinterpret_cast<uintptr_t>(keys_base) % 16 || reinterpret_cast<uintptr_t>(values_base) % 16 ||
      key_bytes / row_bytes + count > INT32_MAX - 2)
    return std::nullopt;
  return key_bytes / row_bytes;
}

// The first row of the bf16 span `k` in the plan's pool (pool_keys, pool_values set).
int64_t pool_row_of(const AttentionPlan& plan, const KeySpan& k) {
  const std::optional<int64_t> row = common_row(
      plan.pool_keys, plan.pool_values, plan.packed_cols * int64_t(sizeof(__nv_bfloat16)), k.keys, k.values, k.count);
  if (!row)
    throw std::invalid_argument(
        "attention: bf16 keys and values must be 16-byte aligned rows of one pool each (fewer than 2^31), a "
        "span's keys and values at the same rows");
  return *row;
}

// Where every fp32 span of the segments has its rows rounded already (KeySpan::rounded_keys)
// in one buffer of keys and one of values, sets the plan's rounded_keys and rounded_values
// to them (the lowest of the spans' rows; common_row checks the rest): the kernel reads those
// rows, and no pre-pass runs.
void find_rounded_rows(const std::vector<AttentionSegment>& segments, AttentionPlan& plan) {
  const __nv_bfloat16 *keys = nullptr, *values = nullptr;
  for (const AttentionSegment& s : segments)
    for (const KeySpan& k : s.spans) {
      if (k.dtype != DType::F32) continue;
      if (!k.rounded_keys || !k.rounded_values) return;
      const auto* span_keys = static_cast<const __nv_bfloat16*>(k.rounded_keys);
      const auto* span_values = static_cast<const __nv_bfloat16*>(k.rounded_values);
      if (!keys || span_keys < keys) keys = span_keys;
      if (!values || span_values < values) values = span_values;
    }
  const int64_t row_bytes = plan.packed_cols * int64_t(sizeof(__nv_bfloat16));
  for (const AttentionSegment& s : segments)
    for (const KeySpan& k : s.spans)
      if (k.dtype == DType::F32 && !common_row(keys, values, row_bytes, k.rounded_keys, k.rounded_values, k.count))
        return;
  plan.rounded_keys = keys, plan.rounded_values = values;
}

int64_t piece_keys(int64_t items, int64_t keys, int64_t resident) {
  int64_t best = keys, best_cost = ceil_div(items, resident) * (keys + kBlockCostKeys);
  for (int64_t pieces = 2;; ++pieces) {
    const int64_t size = ceil_div(ceil_div(keys, pieces), kPieceAlign) * kPieceAlign;
    if (size < kMinPieceKeys) break;
    const int64_t cost = ceil_div(items * ceil_div(keys, size), resident) * (size + kBlockCostKeys);
    if (cost < best_cost) best = size, best_cost = cost;
  }
  return best;
}

// A piece of a segment's keys (AttentionItem's span fields) and its keys' lowest and
// highest positions.
struct Piece {
  int span, key, last_span, last_end;
  int64_t min_position, max_position;
};

// The segment's keys (its spans one after the other, the first at span_begin in the span
// array) cut into pieces of `size` keys, the last one shorter; or, `at_positions`, at the
// key positions that are multiples of `size`.
std::vector<Piece> cut(const std::vector<KeySpan>& spans, int span_begin, int64_t size, bool at_positions) {
  std::vector<Piece> pieces;
  int64_t before = 0, current = -1;  // keys of the spans before span i; the last piece's index
  for (size_t i = 0; i < spans.size(); ++i) {
    const KeySpan& s = spans[i];
    const int span = span_begin + int(i);
    for (int64_t a = 0; a < s.count;) {  // keys [a, b) of the span lie in piece k
      const int64_t at = (at_positions ? s.first_position : before) + a;
      const int64_t k = at / size, b = std::min(s.count, a + (k + 1) * size - at);
      if (k != current) pieces.push_back({span, int(a), span, 0, INT64_MAX, INT64_MIN}), current = k;
      Piece& p = pieces.back();
      p.last_span = span, p.last_end = int(b);
      p.min_position = std::min(p.min_position, s.first_position + a);
      p.max_position = std::max(p.max_position, s.first_position + b - 1);
      a = b;
    }
    before += s.count;
  }
  return pieces;
}

}  // namespace

size_t AttentionPlan::scratch_bytes() const {
  const size_t partial = sizeof(float) * size_t(slots) * size_t(queries_per_slot) * size_t(head_dim + 2);
  return attention_packed_offset(partial) + 2 * attention_packed_bytes(packed_rows, packed_cols);
}

AttentionPlan plan_attention(const std::vector<AttentionSegment>& segments, int num_heads, int num_kv_heads,
                             int head_dim, int resident_items, bool round_bf16) {
  AttentionPlan plan;
  plan.head_dim = head_dim;
  plan.round_bf16 = round_bf16;
  plan.queries_per_slot = attention_mma_queries(head_dim, round_bf16);
  const bool split = plan.queries_per_slot > 0;  // only the tensor-core kernel takes pieces
  const bool packed = attention_wgmma_serves(head_dim, round_bf16);
  plan.packed_cols = packed ? int64_t(num_kv_heads) * head_dim : 0;
  const int rows_per_block = rows_per_item(num_heads / num_kv_heads, head_dim, round_bf16);
  // The bf16 pool: where the lowest bf16 keys and values lie (pool_row_of checks the rest).
  for (const AttentionSegment& s : segments)
    for (const KeySpan& k : s.spans)
      if (k.dtype == DType::BF16 && packed) {
        const auto* keys = static_cast<const __nv_bfloat16*>(k.keys);
        const auto* values = static_cast<const __nv_bfloat16*>(k.values);
        if (!plan.pool_keys || keys < plan.pool_keys) plan.pool_keys = keys;
        if (!plan.pool_values || values < plan.pool_values) plan.pool_values = values;
      }
  if (packed) find_rounded_rows(segments, plan);
  const int64_t row_bytes = plan.packed_cols * int64_t(sizeof(__nv_bfloat16));
  for (const AttentionSegment& s : segments) {
    const int index = int(plan.segments.size()), span_begin = int(plan.spans.size());
    plan.segments.push_back({s.first_row, s.first_position, s.window, s.causal ? 1 : 0, span_begin, int(s.spans.size())});
    int64_t keys = 0;
    for (const KeySpan& k : s.spans) {
      DeviceKeySpan d{nullptr, nullptr, k.count, k.first_position, plan.packed_rows, -1};
      if (k.dtype == DType::BF16 && packed) {
        d.pool_row = pool_row_of(plan, k);
      } else if (k.dtype == DType::F32) {
        d.keys = static_cast<const float*>(k.keys), d.values = static_cast<const float*>(k.values);
        if (plan.rounded_keys)
          d.packed =
              *common_row(plan.rounded_keys, plan.rounded_values, row_bytes, k.rounded_keys, k.rounded_values, k.count);
        else if (packed) plan.packed_rows += k.count;
      } else {
        throw std::invalid_argument(k.dtype == DType::BF16 ? "attention: bf16 keys need the wgmma kernel (head dims "
                                                             "256 and 512 with inputs rounded to bf16, on Hopper)"
                                                           : "attention: keys and values are fp32 or bf16");
      }
      plan.spans.push_back(d);
      keys += k.count;
    }
    // A row's result must not depend on how its sequence's tokens were split into passes
    // (a prefix-cache hit, a prompt in chunks, a continued prefill, a commit, a batch's
    // budget): its output depends on the chunks its keys are walked in and on the pieces
    // (a row merged from several pieces, or from one, rounds otherwise than one walk). So a
    // causal segment's (a prompt's or a commit's) row groups lie at positions that are
    // multiples of its rows a block (group_rows, a power of two: fewer than rows_per_block
    // where a GQA group of 3, 5, 6, ... makes that none), its chunks on a grid of key positions
    // that starts where the walk of the whole group's keys would (its first row's window),
    // even where the segment starts within the group (lead rows in an earlier pass) and so
    // walks from a later key, and its keys are cut into pieces by the group's position alone
    // (causal_piece_keys), never by its row count. With a window they stay one piece: a group
    // whose earlier rows ran in another pass could miss a piece only those saw, and then be
    // merged from fewer. A canvas's segment is the same rows whatever the batch: split as it
    // suits.
    const int group_rows = s.causal ? int(std::bit_floor(unsigned(rows_per_block))) : rows_per_block;
    const int64_t lead = s.causal ? s.first_position % group_rows : 0;  // rows its first group lacks
    auto group_first = [&](int g) { return s.first_position - lead + int64_t(g) * group_rows; };
    auto grid = [&](int g) {
      if (!s.causal) return -1;
      return int((s.window > 0 ? std::max<int64_t>(0, group_first(g) - s.window + 1) : 0) % kGridKeys);
    };
    const int groups = s.rows ? int((lead + s.rows + group_rows - 1) / group_rows) : 0;
    const bool causal_pieces = split && s.causal && s.window == 0;
    const int64_t segment_piece = split && !s.causal ? piece_keys(int64_t(groups) * num_kv_heads, keys, resident_items) : keys;
    std::map<int64_t, std::vector<Piece>> cuts;  // by piece size
    std::vector<const std::vector<Piece>*> pieces(groups);  // each row group's
    size_t most_pieces = 0;
    for (int g = 0; g < groups; ++g) {
      const int64_t size = causal_pieces ? causal_piece_keys(group_first(g)) : segment_piece;
      auto it = cuts.find(size);
      if (it == cuts.end()) it = cuts.emplace(size, cut(s.spans, span_begin, size, causal_pieces)).first;
      pieces[g] = &it->second;
      most_pieces = std::max(most_pieces, it->second.size());
    }
    auto row0 = [&](int g) { return int(std::max<int64_t>(0, int64_t(g) * group_rows - lead)); };
    auto rows = [&](int g) { return int(std::min<int64_t>(int64_t(g + 1) * group_rows - lead, s.rows) - row0(g)); };
    // Which of its pieces each row group sees (any key within the union of its rows' causal
    // windows), and the rank of each among them; the row groups that see several get
    // consecutive partial slots for each kv head, and a merge.
    std::vector<std::vector<int>> rank(groups);
    std::vector<int> seen(groups, 0);
    std::vector<int64_t> first_slot(size_t(groups) * num_kv_heads, -1);
    for (int g = 0; g < groups; ++g) {
      const int64_t first = s.first_position + row0(g), last = first + rows(g) - 1;
      rank[g].assign(pieces[g]->size(), -1);
      for (size_t k = 0; k < pieces[g]->size(); ++k) {
        const Piece& p = (*pieces[g])[k];
        if (!s.causal || (p.min_position <= last && (s.window == 0 || p.max_position > first - s.window)))
          rank[g][k] = seen[g]++;
      }
      if (seen[g] < 2) continue;
      for (int h = 0; h < num_kv_heads; ++h) {
        first_slot[size_t(g) * num_kv_heads + h] = plan.slots;
        plan.merges.push_back({index, row0(g), rows(g), h, int(plan.slots), seen[g]});
        plan.slots += seen[g];
      }
    }
    // One item per (piece, kv head, row group), the row groups innermost: the items that
    // read the same keys run together, and the keys come from L2 after the first.
    for (size_t k = 0; k < most_pieces; ++k)
      for (int h = 0; h < num_kv_heads; ++h)
        for (int g = 0; g < groups; ++g) {
          if (k >= rank[g].size() || rank[g][k] < 0) continue;
          const Piece& p = (*pieces[g])[k];
          const int64_t slot = seen[g] > 1 ? first_slot[size_t(g) * num_kv_heads + h] + rank[g][k] : -1;
          plan.items.push_back({index, row0(g), rows(g), h, p.span, p.key, p.last_span, p.last_end, int(slot), grid(g)});
        }
    // A row group that sees no key (only in a malformed batch) still gets its output: zeros.
    for (int g = 0; g < groups; ++g)
      for (int h = 0; seen[g] == 0 && h < num_kv_heads; ++h)
        plan.items.push_back({index, row0(g), rows(g), h, 0, 0, -1, 0, -1, -1});
  }
  return plan;
}

std::string attention_unsupported(int head_dim, int group, bool round_bf16) {
  // An item's query vectors are a row's heads of one KV head, up to 16 (the generic kernel's).
  if (group > kQueries)
    return "the CUDA attention takes up to " + std::to_string(kQueries) + " query heads per KV head, not " +
           std::to_string(group);
  if (attention_mma_queries(head_dim, round_bf16)) return "";
  int device = 0, most = 0;  // the generic kernel's tiles grow with the head dim
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&most, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess) {
    cudaGetLastError();
    return "the CUDA device's shared memory size is unknown";
  }
  if (shared_bytes(head_dim) > size_t(most))
    return "head dim " + std::to_string(head_dim) + " needs " + std::to_string(shared_bytes(head_dim)) +
           " bytes of shared memory a block in the CUDA attention, past this GPU's " + std::to_string(most) +
           " (head dims 64, 128, 256 and 512 take kernels of their own)";
  return "";
}

void attention(const AttentionQueries& q, const AttentionOutput& out, const AttentionPlan& plan,
               const AttentionTables& tables, void* scratch, int num_heads, int num_kv_heads, cudaStream_t stream) {
  if (plan.items.empty()) return;
  if (plan.queries_per_slot)
    return attention_mma(q, out, plan, tables, scratch, num_heads, num_kv_heads, stream);
  const size_t bytes = shared_bytes(plan.head_dim);
  cudaFuncSetAttribute(attention_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
  launch(attention_kernel, unsigned(plan.items.size()), kThreads, bytes, stream, q.values, out, tables.segments,
         tables.spans, tables.items, num_heads, num_kv_heads, plan.head_dim, plan.round_bf16);
}

}  // namespace diffuserve::cuda
