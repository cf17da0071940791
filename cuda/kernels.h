// Launchers of the CUDA backend's kernels (cuda_backend.cu wires them to the Backend
// interface). Activations are fp32, weights bf16 or packed FP8/NVFP4 (norm weights and
// scales fp32), all in device memory; every launcher runs on the given stream.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "backend.h"
#include "launch.cuh"
#include "philox.h"

namespace diffuserve::cuda {

// ---- GEMM (gemm.cu) -------------------------------------------------------------
// One matrix product per segment, all in one launch:
//   Y[y_row + i] = X[x(i)] @ W_seg^T   (W_seg: [N, K], K contiguous)
// with x(i) = row_map ? row_map[x_row + i] : x_row + i, X: x_rows rows of K values, ldx
// apart, entering the tensor cores as GemmInput says; accumulation is fp32. `gated`: the
// x_rows rows hold [gate | up], 2K values each, and X is their gelu_glu_value, computed
// in the pre-pass (that makes X's bf16 planes, or Fp8Token's codes). W is bf16, or
// packed (`format`, packed_weight.h) and dequantized in the kernel: Y = (X @ Q^T) * scale
// per column for FP8, (X @ (E2M1 * group scale)^T) / global scale for NVFP4 (Split only).
// `scratch` is gemm_scratch_bytes(x_rows, n, k, input) bytes of device memory that the call
// may use until it is done on `stream`. Weight rows whose bytes are a multiple of 16 (and
// NVFP4 scale rows of 4) must start 16 (4)-byte aligned, as they do at multiples of a
// matrix's size from an allocation.
enum class GemmInput {
  Split,      // X as a bf16 hi/lo pair: fp32-like precision
  RoundBf16,  // bf16(X) alone: Y = round_bf16(X) @ W^T (bf16 weights, or FP8 / NVFP4 decoded to bf16)
  // FP8 per token (FP8 weights): Y = (fake-quantized X) @ W^T, the fp32 product of
  // quantize_input's FP8 values, computed from E4M3 codes on the FP8 tensor cores.
  Fp8Token,
};
// The bf16 planes of X a product reads: Split's hi and lo, else one.
DS_HOST_DEVICE constexpr int planes(GemmInput input) { return input == GemmInput::Split ? 2 : 1; }
struct GemmMatrix {
  const void* values;           // bf16 or E4M3 [N, K]; NVFP4 [N, K / 2]
  // packed: FP8's scale, NVFP4's global scale, per row; plain: null, or a factor per row
  // (Weight::row_scales)
  const float* row_scales;
  // NVFP4: [N, K / 16]; values and group scales in the GEMM layout (lay_out_nvfp4)
  const uint8_t* group_scales;
  // bf16, or E4M3 with Fp8Token X: the values stored tiled (gemm_tile.cuh, tiled_offset), N a
  // multiple of 128 and K of 64 (bf16) or 128 (E4M3), the same bytes as [N, K].
  bool tiled = false;
  // Plain weights with row factors: each run of this many rows shares one factor (a linear's,
  // in a stack of linears), which cuBLASLt takes as a scalar; 0 where they vary otherwise.
  int64_t factor_rows = 0;
};
struct GemmSegment {
  int64_t x_row;
  int64_t y_row;
  int rows;
  GemmMatrix w;
};
// Bytes of one W row of K values.
DS_HOST_DEVICE constexpr int64_t weight_row_bytes(WeightFormat format, int64_t k) {
  return format == WeightFormat::Plain ? 2 * k : format == WeightFormat::Fp8 ? k : k / 2;
}
// An [E, N, K] stack of matrices; expert(e) is the e-th.
struct ExpertStack {
  GemmMatrix first;
  WeightFormat format;
  int64_t n, k;
  DS_HOST_DEVICE GemmMatrix expert(int e) const {
    return {static_cast<const uint8_t*>(first.values) + e * n * weight_row_bytes(format, k),
            first.row_scales ? first.row_scales + e * n : nullptr,
            first.group_scales ? first.group_scales + e * n * (k / 16) : nullptr, first.tiled, first.factor_rows};
  }
};
struct GemmTile {
  int segment;
  int m0;  // first row within the segment
};
// The tile height (16, 32, 64 or 128 rows) that suits `segments` segments of about
// `rows_per_segment` rows each (`routed`: rows routed to them, the MoE's experts, whose
// counts vary about that), N = n, X as `input` and weights in `format`; GemmTile::m0 steps
// by it. Results do not depend on it, among the heights it gives for one kind.
int gemm_tile_rows(int64_t rows_per_segment, int64_t segments, int64_t n, GemmInput input, WeightFormat format,
                   bool routed = false);
// Whether X as `input` and weights in `format` reach the tensor cores as they are, both of
// one kind: bf16 weights with bf16 X (split or rounded), or E4M3 weights with E4M3 X
// (Fp8Token). Other packed weights are decoded in the kernel.
DS_HOST_DEVICE constexpr bool gemm_operands_alike(GemmInput input, WeightFormat format) {
  return format == (input == GemmInput::Fp8Token ? WeightFormat::Fp8 : WeightFormat::Plain);
}
// Whether gemm() multiplies X as `input` with weights in `format` on wgmma tiles (32, 64 and
// 128 rows) as they are: operands alike (above) and wgmma_enabled() (launch.cuh;
// DIFFUSERVE_WGMMA=0 keeps every tile on mma.sync, to compare). Such weights may be stored
// tiled (Backend::lay_out_experts). NVFP4 weights, decoded, take wgmma tiles of 64 and 128
// rows as well, bitwise equal to the mma.sync ones (gemm.cu).
bool gemm_has_wgmma_tile(GemmInput input, WeightFormat format);
size_t gemm_scratch_bytes(int64_t x_rows, int64_t n, int64_t k, GemmInput input);
// K as gemm()'s pre-pass pads it for `input`.
int64_t gemm_padded_k(int64_t k, GemmInput input);
// X as the products read it, in the layout of gemm()'s pre-pass: row r's kp = gemm_padded_k
// values (K zero-padded) at rows + r * row_bytes(), bf16 for Split (hi, then lo at + kp)
// and RoundBf16 (the rounding), E4M3 codes for Fp8Token (fp8_token_codes, below), whose rows'
// scales follow. Written by the pre-pass (prepare_gemm_input) or by the norm that computed X
// (NormOutputs::prepared), so that several products of one X convert it once, or never.
struct PreparedX {
  uint8_t* rows = nullptr;  // null: none
  float* scales = nullptr;  // Fp8Token
  int64_t kp = 0;
  GemmInput input = GemmInput::Split;
  DS_HOST_DEVICE int64_t row_bytes() const { return planes(input) * kp * (input == GemmInput::Fp8Token ? 1 : 2); }
};
// Bytes of `rows` rows of K values of X as `input` (a multiple of 256), and their layout at `data`.
size_t prepared_x_bytes(int64_t rows, int64_t k, GemmInput input);
PreparedX prepared_x(void* data, int64_t rows, int64_t k, GemmInput input);
// gemm()'s pre-pass alone: X's rows (gated as gemm() says) into `to` as the product takes
// them (`permuted`, bf16 planes only: each 64-value slice of K in the order decoded packed
// weights take, gemm_tile.cuh).
void write_gemm_input(const float* x, int64_t rows, int64_t ldx, bool gated, int64_t k, bool permuted,
                      const PreparedX& to, cudaStream_t stream);
// ... into `scratch` (for products computed elsewhere: cuBLASLt), laid out as prepared_x says.
PreparedX prepare_gemm_input(const float* x, int64_t rows, int64_t ldx, bool gated, int64_t k, GemmInput input,
                             bool permuted, void* scratch, cudaStream_t stream);
// `prepared`: X already as the pre-pass would write it (not gated, not permuted: weights the
// kernel does not decode), or none (rows null) for the pre-pass into `scratch`.
// `w_tiled`: every segment's weights are stored tiled (GemmMatrix::tiled; the wgmma tiles
// alone read them).
// `act` (rows not null): instead of Y, the MLP's activation of each (gate, up) pair of
// outputs, gelu_glu_value, as the next product takes it (its bf16 planes, act.kp = n / 2,
// row r of Y its row r): the weights are tiled [gate; up] stacks paired (tile_matrices), plain
// bf16 on the wgmma tiles.
// `y_bf16` (not null, y null): Y's values rounded to bf16 there instead of y, ldy apart (the
// MoE's expert rows with bf16 activations, as the reference in bf16 keeps them).
void gemm(const float* x, int64_t x_rows, int64_t ldx, bool gated, const int64_t* row_map, const GemmSegment* segments,
          const GemmTile* tiles, int num_tiles, int tile_rows, WeightFormat format, bool w_tiled, int64_t n, int64_t k,
          GemmInput input, float* y, __nv_bfloat16* y_bf16, int64_t ldy, const PreparedX& prepared,
          const PreparedX& act, void* scratch, cudaStream_t stream);
// Fp8Token's codes and scales, for gemm() and its tests: per row of X (rows x k, ldx apart; gated
// as gemm() says), the FP8 token scale into scales[row] and the E4M3 codes of x / scale
// (activation_quant.h's quantize_e4m3) into codes + row * ld_codes, zero from k to ld_codes
// (a multiple of 128).
void fp8_token_codes(const float* x, int64_t rows, int64_t ldx, bool gated, int64_t k, int64_t ld_codes,
                     uint8_t* codes, float* scales, cudaStream_t stream);
// out[N, K] = in[K, N]^T (bf16).
void transpose_bf16(const __nv_bfloat16* in, int64_t k, int64_t n, __nv_bfloat16* out, cudaStream_t stream);
// The MoE router, one launch (route.cu): per token, scores = x @ W^T (x: tokens rows of
// `hidden` fp32 values, as bf16 hi/lo parts: fp32-like, as the reference ranks near-tied
// experts; W: bf16 [experts, hidden]), then the softmax of scores * scale, its top k (the
// lower expert id wins a tie), renormalised, times each expert's scale. At most
// route_max_experts() experts.
int route_max_experts();
void route(const float* x, int64_t tokens, int64_t hidden, const __nv_bfloat16* w, int experts, float scale, int top_k,
           const float* per_expert_scale, int32_t* expert_ids, float* weights, cudaStream_t stream);

// ---- attention (attention.cu, attention_mma.cu) -----------------------------------
// Attention over the paged KV cache for a mixed-phase batch (Backend::attention): the host
// plans the launch (plan_attention), uploads the plan's tables, and `attention` runs it.
//
// Split-KV: where a segment's rows alone would leave multiprocessors idle, each row group's
// keys are cut into pieces that separate blocks take; each piece's output (normalised by
// its own softmax sum) and its running max and sum go to scratch, and a merge kernel
// combines the pieces in key order. How a segment is cut depends only on that segment (its
// rows, its keys) and the GPU, never on the other segments of the launch, so a request
// gets the same bits alone or batched.
struct DeviceKeySpan {
  const float* keys;  // fp32 rows; null where they are bf16 (pool_row)
  const float* values;
  int64_t count;
  int64_t first_position;
  // The rows as the wgmma kernel reads them, bf16: rows packed.. of the copies its pre-pass
  // writes (or of the plan's rounded rows), or, where pool_row >= 0, rows pool_row.. of the
  // plan's bf16 pool (a bf16 KV cache's pages). A span in the pool owns no copies: its
  // `packed` is the next span's.
  int64_t packed;
  int64_t pool_row;
};
struct DeviceAttentionSegment {
  int64_t first_row;
  int64_t first_position;
  int64_t window;
  int causal;
  int span_begin;  // into the span array
  int span_count;
};
// An item's work (a block's, or a cluster's): `rows` query rows from row `row0` of segment
// `segment`, all query heads of kv head `kv_head`, over one piece of the segment's keys (its
// spans one after the other): from key `key` of span `span` to key `last_end` - 1 of span
// `last_span` (span indices into the span array; last_span < span: no key). slot < 0: the
// piece is all the rows see and the item writes the output; else it writes partial slot
// `slot`. grid >= 0: the kernels' chunks of keys lie on a grid of key positions, a chunk's
// first slot at a position p with p % kGridKeys == grid (mod the chunk's keys), so that a row's
// chunks do not depend on where its segment starts (a causal segment's); grid < 0: chunks
// from the piece's first key on.
constexpr int kGridKeys = 64;  // every kernel's chunk of keys divides it
struct AttentionItem {
  int segment;
  int row0;
  int rows;
  int kv_head;
  int span;
  int key;
  int last_span;
  int last_end;
  int slot;
  int grid;
};
// Rows whose keys were cut into `pieces` pieces, written to partial slots [slot, slot +
// pieces) in key order: attention_merge combines them into the output.
struct AttentionMerge {
  int segment;
  int row0;
  int rows;
  int kv_head;
  int slot;
  int pieces;
};
struct AttentionPlan {
  std::vector<DeviceAttentionSegment> segments;
  std::vector<DeviceKeySpan> spans;
  std::vector<AttentionItem> items;    // one block (or cluster) each
  std::vector<AttentionMerge> merges;  // empty when no row group was cut
  int64_t slots = 0;                   // partial results the pieces write
  int queries_per_slot = 0;            // query vectors per item (and per slot)
  int head_dim = 0;
  bool round_bf16 = false;
  // The wgmma kernel's keys and values as bf16 (attention_wgmma_serves): every fp32 span's
  // rows one after the other, `packed_cols` values a row, converted by a pre-pass so that
  // the kernel stages them with cp.async. 0 rows for the other kernels, and where every fp32
  // span has its rows rounded already (KeySpan::rounded_keys), in one buffer of keys and
  // one of values, a span's keys and values at the same rows of each: the kernel then reads
  // those (rounded_keys, rounded_values), the spans' `packed` rows of them.
  int64_t packed_rows = 0;
  int64_t packed_cols = 0;
  const __nv_bfloat16* rounded_keys = nullptr;
  const __nv_bfloat16* rounded_values = nullptr;
  // The bf16 spans' rows (of packed_cols values): all in one pool of keys and one of values,
  // a span's keys and values at the same rows of each (a layer of a bf16 KV cache).
  const __nv_bfloat16* pool_keys = nullptr;
  const __nv_bfloat16* pool_values = nullptr;
  // Device memory `attention` may use for the partial results and the bf16 copies until it
  // is done on its stream.
  size_t scratch_bytes() const;
};
// The plan of one Backend::attention call (num_heads / num_kv_heads <= 16) for a GPU that
// runs `resident_items` items of the kernel at once (attention_mma_resident_items).
// round_bf16: Q, K, V and the softmax's probabilities rounded to bf16 before their
// products (activations "bfloat16"), one tensor-core product instead of three.
AttentionPlan plan_attention(const std::vector<AttentionSegment>& segments, int num_heads, int num_kv_heads,
                             int head_dim, int resident_items, bool round_bf16);
// The plan's tables in device memory.
struct AttentionTables {
  const DeviceAttentionSegment* segments;
  const DeviceKeySpan* spans;
  const AttentionItem* items;
  const AttentionMerge* merges;
};
// The attention's queries: fp32 rows of num_heads x head_dim values and, where `bf16` is not
// null, the same values rounded to bf16 at the same places (as the query norms write them
// beside their outputs, Backend::alloc_attention_rows), which the wgmma kernel copies as
// they are where it would round the fp32 ones itself; the other kernels read the fp32 rows.
struct AttentionQueries {
  const float* values;
  const __nv_bfloat16* bf16;
};
// Where the attention writes its output: fp32 rows of num_heads x head_dim values, and,
// where `bf16` is not null, the same values rounded to bf16 at the same places (the o
// projection's input as gemm.cu's RoundBf16 pre-pass would write it, when no column is
// padded), so that no pre-pass rounds them again.
struct AttentionOutput {
  float* values;
  __nv_bfloat16* bf16;
};
void attention(const AttentionQueries& q, const AttentionOutput& out, const AttentionPlan& plan,
               const AttentionTables& tables, void* scratch, int num_heads, int num_kv_heads, cudaStream_t stream);
// Why the attention cannot run layers of `head_dim` with `group` query heads per KV head on the
// current device, or "" where it can.
std::string attention_unsupported(int head_dim, int group, bool round_bf16);

// The tensor-core kernels for head dims 64, 128, 256 and 512 (attention_mma.cu on mma.sync;
// attention_wgmma.cu on Hopper's wgmma for head dims 256 and 512 with inputs rounded to
// bf16, where attention_wgmma_serves); attention.cu has the generic one for every other
// head dim, which takes its items whole (no pieces). Query vectors one item covers (a
// block, or at head dim 512 on wgmma a cluster of two); 0 where none serves.
int attention_mma_queries(int head_dim, bool round_bf16);
// Their items that run at once on the current device (multiprocessors x blocks per one, or
// the clusters that fit); 1 where none serves the head dim.
int attention_mma_resident_items(int head_dim, bool round_bf16);
void attention_mma(const AttentionQueries& q, const AttentionOutput& out, const AttentionPlan& plan,
                   const AttentionTables& tables, void* scratch, int num_heads, int num_kv_heads, cudaStream_t stream);
bool attention_wgmma_serves(int head_dim, bool round_bf16);
int attention_wgmma_queries(int head_dim);
int attention_wgmma_resident_items(int head_dim);
// The blocks of attention_mma's plan (pieces to partial_out / partial_ml, as attention_mma
// lays out its scratch; attention_mma merges them), after a pre-pass that writes the spans'
// keys and values as bf16 into `packed_keys` and `packed_values` (plan.packed_rows x
// plan.packed_cols each; none where the plan found them rounded already, rounded_keys).
void attention_wgmma(const AttentionQueries& q, const AttentionOutput& out, float* partial_out, float2* partial_ml,
                     __nv_bfloat16* packed_keys, __nv_bfloat16* packed_values, const AttentionPlan& plan,
                     const AttentionTables& tables, int num_heads, int num_kv_heads, cudaStream_t stream);
// attention's scratch: the partial results, then from this offset (256-byte aligned) the
// bf16 keys, then the bf16 values, each of this many bytes.
inline size_t attention_packed_offset(size_t partial_bytes) { return (partial_bytes + 255) / 256 * 256; }
inline size_t attention_packed_bytes(int64_t rows, int64_t cols) {
  return (sizeof(__nv_bfloat16) * size_t(rows) * size_t(cols) + 255) / 256 * 256;
}

// ---- elementwise, rows, sampling (kernels.cu) -------------------------------------
void embed(const __nv_bfloat16* table, int64_t hidden, const int32_t* ids, int64_t n, float scale, float* out,
           cudaStream_t stream);
// The outputs of a norm of groups of x, n = x * (mean(x^2) + eps)^-0.5: each output
// y = n * its weight (null: none), or with `accumulate` (one output) y = (y + n * weight) * scale.
// Where prepared[i].rows is set (whole rows as the groups), output i is also written there
// as products take it (PreparedX, for K = the group): the bits gemm()'s pre-pass would write.
constexpr int kMaxNormOutputs = 4;
struct NormOutputs {
  const float* weight[kMaxNormOutputs];
  float* y[kMaxNormOutputs];
  PreparedX prepared[kMaxNormOutputs];
  int count;
  bool accumulate;
  float scale;  // accumulate's
  // With `accumulate` (rms_norms' first norm, rows that fit the row kernel): y's old rows
  // normed first by old_weight (null: none), as an rms_norm of y in place would, a launch
  // fewer (the dense MLP's output norm, folded into the layer's last norm).
  bool norm_old;
  const float* old_weight;
};
// A MoE layer's rows before the experts' weighted sum: row t is sum_k weights[t, k] *
// y[inverse[t, k]], in k order (combine_experts' sum, bit for bit).
struct ExpertSums {
  const float* y = nullptr;  // null: none (unless y_bf16)
  const __nv_bfloat16* y_bf16 = nullptr;  // y's rows as bf16 instead (y null)
  DS_HOST_DEVICE bool any() const { return y || y_bf16; }
  const int64_t* inverse = nullptr;
  const float* weights = nullptr;
  int top_k = 0;
};
// The norm of x into `outs`, from one pass over x; then, where then.count > 0 (`outs` one
// output), the norm of that output as it now is into `then`; then, where after.count > 0
// (`then` one output, `after` not accumulating), the norm of that into `after`: up to three
// norms in one launch, bitwise as separate calls. The prepared outputs come from the same
// pass where a row fits the block's registers (the hidden states' norms), else from
// gemm()'s pre-pass after it. Where `sums` has rows (rms_norms_take_sums), x is their sums
// (x itself unused), added up as the pass reads them.
void rms_norms(const float* x, const NormOutputs& outs, const NormOutputs& then, const NormOutputs& after,
               int64_t groups, int64_t group, float eps, cudaStream_t stream, const ExpertSums& sums = {});
// Whether rms_norms takes ExpertSums for rows of `group` values: rows that fit a block's
// registers (the hidden states' norms).
bool rms_norms_take_sums(int64_t group);
// Heads that rms_norm_rope normalises: `rows` rows of `heads` heads, row r's at src + r *
// src_stride (a column block of a wider matrix, such as one product's [Q K V]), written to
// dst as whole rows of heads (dst may be src, where src_stride is heads * head_dim). With a
// weight ([head_dim]): each head's rms_norm by it, then rotate_half RoPE at positions[r];
// without: the unscaled norm alone (a layer's values). Where `rounded` is given, dst's rows
// are written there too, rounded to bf16 (the attention's copy of a layer's keys or values).
struct HeadNorms {
  const float* src;
  int64_t src_stride;
  float* dst;
  int64_t rows, heads;
  const float* weight;
  const int64_t* positions;
  __nv_bfloat16* rounded = nullptr;
};
constexpr int kMaxHeadNorms = 3;  // a layer's queries, keys and values
struct HeadNormParts {
  HeadNorms part[kMaxHeadNorms];
  int count;
};
// Every part's heads in one launch, a warp per (row, head); inv_freq [head_dim / 2].
void rms_norm_rope(const HeadNormParts& parts, int64_t head_dim, float eps, const float* inv_freq, cudaStream_t stream);
// The MLP's activation of one (gate, up) pair: gelu (tanh approximation) of the gate, times up.
DS_HOST_DEVICE inline float gelu_glu_value(float gate, float up) {
  return 0.5f * gate * (1.0f + tanhf(0.7978845608028654f * (gate + 0.044715f * gate * gate * gate))) * up;
}
// out[r, j] = gelu_glu_value(x[r, j], x[r, inter + j]) for x [rows, 2 * inter].
void gelu_glu(const float* x, int64_t rows, int64_t inter, float* out, cudaStream_t stream);
void add(const float* a, const float* b, float* y, int64_t n, cudaStream_t stream);
void scale(float* x, float s, int64_t n, cudaStream_t stream);
void softcap(float* x, float cap, int64_t n, cudaStream_t stream);
void softmax_rows(float* x, int64_t rows, int64_t cols, cudaStream_t stream);
// dst row dst_rows[r] = src row r for r < n (T float, or __nv_bfloat16: rounded).
template <class T>
void scatter_rows(const float* src, int64_t cols, const int64_t* dst_rows, int64_t n, T* dst, cudaStream_t stream);
// Lays the MoE's (token, slot) pairs out by expert, on the device: row_map[row] = token
// of each expert-ordered row, inverse[pair] = its row; one GEMM segment per expert for the
// gate_up and the down weights (expert e's matrices of each stack); tiles of tile_rows
// rows, the unused ones of the max_tiles slots marked with segment -1.
void moe_plan(const int32_t* expert_ids, int64_t pairs, int top_k, int experts, int tile_rows,
              const ExpertStack& gate_up, const ExpertStack& down, int64_t* row_map, int64_t* inverse,
              GemmSegment* up_segments, GemmSegment* down_segments, GemmTile* tiles, int max_tiles,
              cudaStream_t stream);
// out[t] = sum_k weights[t, k] * y[inverse[t, k]] in k order (deterministic); y's rows
// fp32, or bf16 where `y_bf16` is not null (y then null).
void combine_experts(const float* y, const __nv_bfloat16* y_bf16, const int64_t* inverse, const float* weights,
                     int64_t tokens, int top_k, int64_t hidden, float* out, cudaStream_t stream);

// In place on x [rows, cols], a linear's input quantized and dequantized as
// activation_quant.h computes it: FP8 with one scale per row, or NVFP4 per 16 values with
// rows below encoder_rows under encoder_global and the rest under decoder_global; or each
// value rounded to bf16.
void quantize_input(float* x, int64_t rows, int64_t cols, ActivationScheme scheme, int64_t encoder_rows,
                    float encoder_global, float decoder_global, cudaStream_t stream);

// NVFP4 inputs of an MoE layer's experts: expert-ordered row i (moe_plan's layout; its
// expert is the segment holding it) quantized and dequantized under its expert's global
// scale, encoder_global[e] or decoder_global[e] as its token (row_map[i]) is below
// encoder_tokens or not. `gather`: row i comes from x row row_map[i] (the gate/up input,
// token rows); else from x row i (the down input, already one row per pair). Into out
// [rows, cols]; x == out in place without gather.
void quantize_nvfp4_expert_rows(const float* x, bool gather, const int64_t* row_map, const GemmSegment* segments,
                                int experts, int64_t rows, int64_t cols, int64_t encoder_tokens,
                                const float* encoder_global, const float* decoder_global, float* out,
                                cudaStream_t stream);

// An NVFP4 matrix's values times their group scales, without the global scale, as bf16:
// exact (packed_decode.cuh). packed [rows, cols / 2] (8-byte aligned), group_scales E4M3
// [rows, cols / 16], both as stored; out [rows, cols] (16-byte aligned); cols a multiple of 16.
void decode_nvfp4(const uint8_t* packed, const uint8_t* group_scales, int64_t rows, int64_t cols, __nv_bfloat16* out,
                  cudaStream_t stream);
// NVFP4 values and group scales as stored (`groups` groups of 16 values, 8 bytes each, 8-byte
// aligned, and their E4M3 scales) into the GEMM layout the main loop decodes (packed_decode.cuh,
// nvfp4_gemm_group), in place. No scale may be NaN.
void lay_out_nvfp4(uint8_t* packed, uint8_t* group_scales, int64_t groups, cudaStream_t stream);
// Fills n bf16 values with random_weight_value (backend.h's dummy weights).
void random_bf16(__nv_bfloat16* out, int64_t n, uint64_t seed, float scale, cudaStream_t stream);
// `matrices` [n, row_bytes] matrices one after the other (in), each stored tiled into out
// (GemmMatrix::tiled: n a multiple of 128, row_bytes of 128); `paired`: [gate; up] stacks
// whose rows go to gemm_tile.cuh's paired_row (gemm()'s `act`).
void tile_matrices(const uint8_t* in, int64_t matrices, int64_t n, int64_t row_bytes, bool paired, uint8_t* out,
                   cudaStream_t stream);

struct DeviceRowSample {
  int32_t argmax;
  int32_t candidate;
  float entropy;
};
// Where a sample call's temperature and Candidate key step come from: as given, or with
// `steps_done` (a block's step counter in device memory) from the schedule at that step,
// as sampler.h's schedule_temperature computes it.
struct DeviceSchedule {
  const int32_t* steps_done = nullptr;
  float t_min = 0, t_max = 0;
  int max_steps = 0;
};
// The sampler's passes over each row (Backend::sample), one block per row. With
// softmax_feedback and `feedback_rows` (rows of vocab bf16 values), the feedback goes there
// rounded to bf16, as the soft embedding's product takes it, instead of over the logits.
void sample_rows(float* logits, int64_t rows, int64_t vocab, float cap, float temperature, const float* bias,
                 RandomKey key, const DeviceSchedule& schedule, bool round_bf16, bool softmax_feedback,
                 __nv_bfloat16* feedback_rows, DeviceRowSample* out, cudaStream_t stream);
// A block's state as kernels take it (CanvasState less its storage).
struct DeviceCanvas {
  CanvasParams params;
  int32_t* tokens;
  int32_t* argmax;
  int32_t* history;
  int32_t* counters;
  const int32_t* allowed_ids;
  const uint8_t* free_position;
};
// sampler.h's update_canvas on the device, one block: acceptance, renoising, argmax
// history, stop flag and step count from the step's rows. `scratch`: canvas ints and bytes.
void update_canvas(const DeviceCanvas& canvas, const DeviceRowSample* rows, void* scratch, cudaStream_t stream);
// The last node of a repeat body (Backend::repeat): counts the run and sets the while
// node's condition: go on while fewer than max_runs runs and no block's stopped flag set.
void continue_while(cudaGraphConditionalHandle condition, const int32_t* const* stopped, int count, int32_t* runs,
                    int max_runs, cudaStream_t stream);

}  // namespace diffuserve::cuda
