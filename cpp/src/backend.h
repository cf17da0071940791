// The op interface between the model graph (model.cpp) and the hardware. The graph is
// written once against these few ops; the CPU backend (cpu_backend.cpp) is the readable
// reference, a CUDA backend implements the same calls on the device.
//
// Activations are fp32 row-major matrices in the backend's memory. Weights keep the
// dtype they were loaded in (F32, BF16 or F16) and are widened inside each op; a backend
// may also keep quantized linears packed (keeps_packed) and dequantize them in linear and
// experts.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "diffuserve/config.h"
#include "diffuserve/dtype.h"
#include "diffuserve/errors.h"
#include "packed_weight.h"
#include "philox.h"

namespace diffuserve {
// memcpy, which may not be given a null pointer even for 0 bytes (an empty vector's data()).
inline void copy_bytes(void* dst, const void* src, size_t bytes) {
  if (bytes) std::memcpy(dst, src, bytes);
}

// The Philox draw random_weight takes element i's bits from: one draw serves each aligned
// group of four elements.
DS_HOST_DEVICE inline Philox4 random_weight_bits(uint64_t seed, uint64_t i) {
  return RandomKey{seed, uint32_t(i >> 32), 0, RandomStream::Candidate}.draw(0, uint32_t(i) & ~3u);
}
DS_HOST_DEVICE inline float random_weight_of(uint32_t bits, float scale) {
  return scale * 1.7320508f * (2.0f * uniform_open(bits) - 1.0f);
}
// The value random_weight draws for element i (the same on every backend).
DS_HOST_DEVICE inline float random_weight_value(uint64_t seed, uint64_t i, float scale) {
  return random_weight_of(random_weight_bits(seed, i)[int(i & 3)], scale);
}
// random_weight_value of elements [first, end) into out[0, end - first), a draw a group of
// four (a draw a value had made loading a dummy model on the CPU four times slower).
inline void random_weight_values(uint64_t seed, uint64_t first, uint64_t end, float scale, float* out) {
  for (uint64_t group = first & ~uint64_t(3); group < end; group += 4) {
    const Philox4 bits = random_weight_bits(seed, group);
    for (uint64_t i = std::max(group, first); i < std::min(group + 4, end); ++i)
      out[i - first] = random_weight_of(bits[int(i & 3)], scale);
  }
}
}  // namespace diffuserve

namespace diffuserve {

// A matrix's values as a backend's products take them (the CUDA backend: rounded to bf16,
// bf16 hi/lo parts, or FP8 codes with a scale per row), kept beside the fp32 values of a
// matrix from Backend::alloc_product_input: row r at data + r * row_bytes, and its scale,
// where the form has one, at row_scales[r]. `kind` (the backend's; 0: none) says the rest.
struct ProductInput {
  int kind = 0;
  uint8_t* data = nullptr;
  int64_t row_bytes = 0;
  float* row_scales = nullptr;
  std::shared_ptr<void> storage;

  // Row r's bytes, null where there is no product input.
  uint8_t* row(int64_t r) const { return data ? data + r * row_bytes : nullptr; }
  ProductInput rows_from(int64_t first) const {
    return {kind, data ? data + first * row_bytes : nullptr, row_bytes, row_scales ? row_scales + first : nullptr,
            storage};
  }
};

// A matrix of fp32 activations owned by a backend: rows x cols, row-major.
struct Activation {
  float* data = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;
  std::shared_ptr<void> storage;
  ProductInput product_input;  // see Backend::alloc_product_input

  int64_t size() const { return rows * cols; }
  float* row(int64_t r) const { return data + r * cols; }
  // Rows [first, first + count) of this matrix, sharing its storage (and product input).
  Activation view(int64_t first, int64_t count) const {
    return {row(first), count, cols, storage, product_input.rows_from(first)};
  }
};

// How a linear quantizes its input, as the checkpoint's quantization_config says. Nvfp4
// needs the linear's calibrated input_global_scale: one per expert of a stack (one for a
// plain linear), for the encoder's rows and for the decoder's, as LLM Compressor
// calibrates the encoder's copy of each linear apart from the decoder's (only the weights
// are shared).
struct ActivationQuant {
  ActivationScheme scheme = ActivationScheme::None;
  std::vector<float> encoder_global_scale, decoder_global_scale;

  float global_scale(bool encoder, int expert) const {
    return (encoder ? encoder_global_scale : decoder_global_scale)[expert < 0 ? 0 : expert];
  }
  bool operator==(const ActivationQuant&) const = default;
};

// A weight in backend memory. Shape: the values' ([out, in] for a linear layer, [experts,
// out, in] for expert stacks), whatever their format.
struct Weight {
  DType dtype = DType::F32;  // Plain: F32, BF16 or F16; Fp8: F8_E4M3; Nvfp4: U8 (two E2M1 a byte)
  WeightFormat format = WeightFormat::Plain;
  std::vector<int64_t> shape;
  const void* data = nullptr;
  // Packed formats, in the backend's layout (upload_packed): the CUDA backend's data is
  // the values, with (every output row of a stack has its own) Fp8's weight_scale per row,
  // multiplied; Nvfp4's weight_global_scale per row, divided by; and Nvfp4's weight_scale
  // per 16 inputs, [.., out, in / 16], values and group scales both in the layout the GEMM
  // decodes (cuda/packed_decode.cuh). The CPU backend's data is the PackedWeight.
  // A plain weight may have row_scales too, a factor per output row that multiplies its
  // products: the CUDA backend's dense NVFP4 linears, decoded to bf16 at load (their
  // global scales' reciprocals).
  const float* row_scales = nullptr;
  int64_t factor_rows = 0;  // plain weights' row_scales: each run of this many rows shares one (0: they vary)
  const uint8_t* group_scales = nullptr;
  bool tiled = false;  // the values stored tiled (Backend::lay_out_experts; cuda/gemm_tile.cuh)
  // A tiled [gate; up] stack's rows paired, each gate row's products beside its up row's
  // (cuda/gemm_tile.cuh, paired_row): its MoE product writes the activation itself.
  bool paired = false;
  std::shared_ptr<const void> storage;
  ActivationQuant input_quant;  // a linear's; scheme None for most weights

  int64_t numel() const;
  bool empty() const { return data == nullptr; }
};

// Where a block of keys sits in the sequence, for the attention mask, and its rows: fp32
// (the batch's own keys), or as the KV cache stores them (Backend::kv_cache_dtype).
struct KeySpan {
  const void* keys = nullptr;    // [count, kv_heads * head_dim]
  const void* values = nullptr;  // [count, kv_heads * head_dim]
  int64_t count = 0;
  int64_t first_position = 0;  // absolute position of row 0
  DType dtype = DType::F32;    // of keys and values: F32 or BF16
  // F32 rows that a backend keeps rounded to bf16 beside them (alloc_attention_rows): the same
  // rows, bf16, which its attention may read instead of rounding them itself; else null.
  const void* rounded_keys = nullptr;
  const void* rounded_values = nullptr;
};

// Rows of the KV cache in backend memory (one layer's keys or values): rows x cols values
// of `dtype`, F32 or BF16.
struct KvRows {
  void* data = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;
  DType dtype = DType::F32;
  std::shared_ptr<void> storage;

  void* row(int64_t r) const { return static_cast<uint8_t*>(data) + r * cols * int64_t(dtype_size(dtype)); }
};

// One sequence's rows of a batched attention call: query rows [first_row, first_row +
// rows) at positions first_position.., attending to `spans`. A query at position p sees
// a key at j when !causal, or when j <= p and (window == 0 or j > p - window).
struct AttentionSegment {
  int64_t first_row = 0;
  int64_t rows = 0;
  int64_t first_position = 0;
  bool causal = false;
  int64_t window = 0;
  std::vector<KeySpan> spans;
};

// Routing of one token batch through the experts, in backend memory (it never needs to
// visit the host): each token's top-k expert ids and their weights.
struct Routing {
  std::shared_ptr<int32_t> experts;  // [tokens, top_k]
  Activation weights;                // [tokens, top_k]
  int top_k = 0;
  int64_t encoder_tokens = 0;  // tokens [0, encoder_tokens) are the encoder's (see experts); set by the caller
};

// A MoE layer's experts' output (Backend::experts_unsummed): `summed`, each token's row as
// experts() writes it; or, where a backend leaves the weighted sum to the op that reads it
// (add_experts_rms_norm_twice, whose pass over the rows then adds them up), token t's k-th
// expert's output as row pair_rows[t * top_k + k] of `rows`, weighted by weights[t, k].
struct ExpertOutput {
  Activation summed;                         // [tokens, hidden]; unused where top_k > 0
  Activation rows;                           // [pairs, hidden], the backend's order
  std::shared_ptr<const int64_t> pair_rows;  // backend memory, from this output's first token
  Activation weights;                        // [tokens, top_k]
  int top_k = 0;                             // 0: summed
  // The rows as bf16 values instead ([pairs, hidden] in backend memory; rows.data null):
  // with bf16 activations, each expert's output rounded as the reference in bf16 keeps it.
  std::shared_ptr<void> rows_bf16;

  static ExpertOutput summed_only(const Activation& summed) {
    ExpertOutput out;
    out.summed = summed;
    return out;
  }
  int64_t tokens() const { return top_k ? weights.rows : summed.rows; }
  // Tokens [first, first + count).
  ExpertOutput view(int64_t first, int64_t count) const {
    if (!top_k) return summed_only(summed.view(first, count));
    return {{}, rows, {pair_rows, pair_rows.get() + first * top_k}, weights.view(first, count), top_k, rows_bf16};
  }
};

// What the sampler needs of one canvas row of processed logits.
struct RowSample {
  int32_t argmax = 0;
  int32_t candidate = 0;  // a draw from softmax(processed logits), by Gumbel-max
  float entropy = 0;      // of softmax(processed logits), in nats
};

// A block's sampler parameters, fixed for the block.
struct CanvasParams {
  int canvas = 0;
  int vocab = 0;
  float softcap = 0;  // the logits' final softcap, applied by the sampler (0: none)
  float t_min = 0, t_max = 0;
  int max_steps = 0;
  float entropy_bound = 0;
  int stability = 0;     // stop once the argmax canvas held for this many steps
  float confidence = 0;  // ... and the mean entropy is below this
  uint64_t seed = 0;
  uint32_t block = 0;
  bool self_conditioning = false;  // the step leaves the softmax feedback in the logits
  DType feedback_dtype = DType::F32;
  int allowed_count = 0;  // allowed ids; 0: every id
  bool biased = false;    // the block has a bias per id (allowed ids or a logit_bias given)
};

// A block's sampler state in backend memory (one allocation, laid out by sampler.h's
// new_canvas): what a denoise step reads and writes, so that the steps of a block need
// nothing from the host in between.
// kCanvasNonFinite: 1 once a step's logits held NaN or infinity (its entropy is NaN); the
// block stops there, and the request fails naming it (engine.cpp, finish_block).
enum CanvasCounter { kCanvasSteps = 0, kCanvasStopped = 1, kCanvasNonFinite = 2, kCanvasCounters = 3 };
struct CanvasState {
  CanvasParams params;
  int32_t* tokens = nullptr;       // [canvas] the next step's input ids
  int32_t* argmax = nullptr;       // [canvas] the argmax canvas of the last step
  int32_t* history = nullptr;      // [stability, canvas] stable_argmax's ring
  int32_t* counters = nullptr;     // [kCanvasCounters]: steps done; 1 once the block stopped; non-finite
  int32_t* allowed_ids = nullptr;  // [allowed_count], sorted
  float* bias = nullptr;           // [vocab] (biased): sampler.h's vocab_bias; null: none
  uint8_t* free_position = nullptr;  // [canvas]; 0: pinned to its seed token
  std::shared_ptr<void> storage;
};

// Backend::split_qkv_norms' shapes checked (InvalidArgument where they disagree): the column
// of qkv where the values begin (the keys' own, where V is K's raw output).
inline int64_t qkv_value_column(const Activation& qkv, int64_t q_first, const Activation& q, const Activation& kv) {
  const bool own_values = qkv.cols == q.cols + 2 * kv.cols;
  if (!(own_values || qkv.cols == q.cols + kv.cols) || kv.rows != 2 * qkv.rows || q_first < 0 ||
      q.rows != qkv.rows - q_first)
    throw InvalidArgument("split_qkv_norms: a [" + std::to_string(qkv.rows) + ", " + std::to_string(qkv.cols) +
                          "] product does not split into queries [" + std::to_string(q.rows) + ", " +
                          std::to_string(q.cols) + "] from row " + std::to_string(q_first) + " and [K; V] [" +
                          std::to_string(kv.rows) + ", " + std::to_string(kv.cols) + "]");
  return q.cols + (own_values ? kv.cols : 0);
}

class Backend {
 public:
  virtual ~Backend() = default;

  // A zero-filled matrix (large ones are committed lazily by the OS as they are touched).
  virtual Activation alloc(int64_t rows, int64_t cols) = 0;
  // A matrix that an op is about to overwrite whole: its values until then are undefined.
  // The CUDA backend skips alloc's zero fill (a kernel launch per matrix, ~500 a denoise
  // step at the 26B shapes); the CPU backend's alloc costs nothing more.
  virtual Activation alloc_output(int64_t rows, int64_t cols) { return alloc(rows, cols); }
  // A matrix that norm ops (outputs of whole rows: rms_norm, rms_norms,
  // add_rms_norm_then_norms, add_rms_norm_twice's `next`) or attention are about to write
  // whole, and whose products are by `readers` (linears, or an expert stack's first product):
  // the backend may keep beside it the form in which those products take their input
  // (Activation::product_input), which those ops then write with the values, so that no
  // product converts them again. The graph writes such a matrix through those ops alone.
  // By default alloc_output.
  virtual Activation alloc_product_input(int64_t rows, int64_t cols, const std::vector<const Weight*>& readers) {
    (void)readers;
    return alloc_output(rows, cols);
  }
  // A denoise pass's logits matrix, which the sampler overwrites with the next step's
  // feedback (sample): where the soft embedding's product (linear_nt) takes its input in a
  // form of its own, the backend may keep that form beside the matrix (as
  // alloc_product_input), which the sampler then writes with a softmax feedback, and
  // copy_rows copies. By default alloc_output.
  virtual Activation alloc_logits(int64_t rows, int64_t cols) { return alloc_output(rows, cols); }
  // Rows the attention reads: a layer's queries, or its new keys and values ([K; V]), which
  // rms_norm_rope, key_value_norms or split_qkv_norms write (round_bf16: as the attention's
  // argument). Where its attention rounds them to bf16 itself, a backend may keep them
  // rounded beside them, as the product input of the bf16-rounded form (alloc_logits), which
  // those norms then write: the attention reads the queries' there, and the model names the
  // keys' and values' in KeySpan::rounded_keys. By default alloc_output.
  virtual Activation alloc_attention_rows(int64_t rows, int64_t cols, int64_t head_dim, bool round_bf16) {
    (void)head_dim, (void)round_bf16;
    return alloc_output(rows, cols);
  }
  // A layer's expert stacks ([E, N, K]) as loaded, their input quantization known: a backend
  // may lay them out again for its MoE products (the CUDA backend stores them tiled,
  // Weight::tiled, and gate_up's rows paired, Weight::paired).
  virtual void lay_out_experts(Weight& gate_up, Weight& down) { (void)gate_up, (void)down; }
  // Linears of one shape that `linears` multiplies by the same input (a layer's K and V): a
  // backend may store them back to back, to multiply them as one batched product.
  virtual void place_together(const std::vector<Weight*>& linears) { (void)linears; }
  // Bytes the KV cache may take by default, asked once the weights are loaded.
  virtual int64_t default_kv_cache_bytes() = 0;
  // The backend's memory in all (the CPU's: physical memory), more than any KV cache can take.
  virtual int64_t memory_bytes() = 0;
  // Bytes it can still allocate (the CPU's: memory_bytes(), the system deciding what fits).
  virtual int64_t free_memory_bytes() { return memory_bytes(); }
  // Why this backend cannot run a model of `config` (its activations rounded to bf16 or not),
  // or "" where it can; asked before the weights load.
  virtual std::string unsupported(const ModelConfig& /*config*/, bool /*round_bf16*/) const { return ""; }
  // How the KV cache stores keys and values for `config`'s layers: F32, or BF16 where every
  // layer's attention rounds them to bf16 as it reads them (activations "bfloat16":
  // round_bf16) and the backend's attention reads bf16 rows, so that the cache takes half
  // the memory and the attention reads the same values.
  virtual DType kv_cache_dtype(const ModelConfig& config, bool round_bf16) const {
    (void)config;
    return round_bf16 ? DType::BF16 : DType::F32;
  }
  // Whether upload_packed takes `w` as it is (format and group size): its linear and
  // experts then dequantize inside the product. Otherwise model.cpp dequantizes at load.
  virtual bool keeps_packed(const PackedWeight&) const { return false; }
  virtual Weight upload_packed(const PackedWeight& w);
  // Weight from host bytes in `dtype`, stored as `as` (a widening/narrowing cast when they
  // differ). The backend may keep pointing at `host`; `keep_alive` owns those bytes.
  virtual Weight upload(const void* host, DType dtype, const std::vector<int64_t>& shape, DType as,
                        std::shared_ptr<const void> keep_alive) = 0;
  // A weight of random values, scale * U(-sqrt(3), sqrt(3)) (unit variance), drawn with
  // Philox from `seed`: load_format="dummy" builds a model at any size without a file.
  virtual Weight random_weight(const std::vector<int64_t>& shape, DType as, uint64_t seed, float scale) = 0;
  virtual void to_host(const Activation& a, float* out) = 0;
  virtual void from_host(const float* in, Activation& a) = 0;
  // Bytes of backend memory, their values undefined until written (small state: token ids,
  // a block's sampler state). Memory taken while a backend records repeat's body stays
  // the body's own until repeat returns.
  virtual std::shared_ptr<void> alloc_bytes(size_t bytes) = 0;
  // Host bytes into backend memory, ordered with the ops (src may go away at once).
  virtual void write_bytes(void* dst, const void* src, size_t bytes) = 0;
  // Backend bytes to the host, after every op queued so far.
  virtual void read_bytes(void* dst, const void* src, size_t bytes) = 0;
  // Returns once every op queued so far is done, raising a failure of theirs (an op on the
  // CPU is done when it returns).
  virtual void synchronize() {}
  // dst rows [dst_row, dst_row + n) = src rows [src_row, src_row + n); the ranges may
  // overlap (memmove). Same column count. Where both matrices keep a product input of the
  // same form (alloc_product_input, alloc_logits), its rows are copied too.
  virtual void copy_rows(const Activation& src, int64_t src_row, Activation& dst, int64_t dst_row, int64_t n) = 0;
  // dst row dst_rows[i] = src row i (rounded to dst's dtype), for every row of src (writing
  // KV into cache slots).
  virtual void scatter_rows(const Activation& src, const std::vector<int64_t>& dst_rows, KvRows& dst) = 0;

  // out[i] = table[ids[i]] * scale for i < out.rows; ids in backend memory.
  virtual void embed(const Weight& table, const int32_t* ids, float scale, Activation& out) = 0;
  // y = x @ w^T; w is [N, K] (or expert `expert` of an [E, N, K] stack).
  virtual void linear(const Activation& x, const Weight& w, Activation& y, int expert = -1) = 0;
  // Rows [i * x.rows, (i + 1) * x.rows) of y = x @ ws[i]^T, x first quantized as each
  // w.input_quant says (rows below `encoder_rows` are the encoder's), for weights of one
  // shape, format and dtype: several linears of one input as one product (a layer's K and
  // V), where a backend can. By default linear_with_input_quant each.
  virtual void linears(const Activation& x, const std::vector<const Weight*>& ws, Activation& y, int64_t encoder_rows) {
    for (size_t i = 0; i < ws.size(); ++i) {
      Activation part = y.view(int64_t(i) * x.rows, x.rows);
      linear_with_input_quant(x, *ws[i], part, encoder_rows);
    }
  }
  // y = q(x) @ w^T, q(x) x quantized as w.input_quant says (not None; rows below
  // `encoder_rows` are the encoder's), x left as it is (it feeds other linears too): by
  // default linear on a copy of x through quantize_input; a backend may quantize inside
  // the product instead.
  virtual void quantized_linear(const Activation& x, const Weight& w, Activation& y, int64_t encoder_rows) {
    Activation quantized = alloc(x.rows, x.cols);
    copy_rows(x, 0, quantized, 0, x.rows);
    quantize_input(quantized, w.input_quant, encoder_rows, -1);
    linear(quantized, w, y);
  }
  // y = x @ w^T with x first quantized as w.input_quant says (when not None): linear, or
  // quantized_linear. Rows of x below `encoder_rows` are the encoder's.
  void linear_with_input_quant(const Activation& x, const Weight& w, Activation& y, int64_t encoder_rows) {
    if (w.input_quant.scheme == ActivationScheme::None) return linear(x, w, y);
    quantized_linear(x, w, y, encoder_rows);
  }
  // y = gelu_glu(x) @ w^T (x: [rows, 2K] of gate and up, w: [N, K]) through
  // linear_with_input_quant: the MLP's activation and down projection as one op, so that a
  // backend may compute the activation in the product's own pass over its input (the CUDA
  // one's bf16 pre-pass). By default gelu_glu into a matrix of its own, then the product.
  virtual void gelu_glu_linear(const Activation& x, const Weight& w, Activation& y, int64_t encoder_rows) {
    Activation act = alloc_output(x.rows, x.cols / 2);
    gelu_glu(x, act);
    linear_with_input_quant(act, w, y, encoder_rows);
  }
  // y = x @ w; w is [K, N]. Rows of x are first rounded to w's dtype, as the reference
  // casts probabilities to the weight dtype before this product.
  virtual void linear_nt(const Activation& x, const Weight& w, Activation& y) = 0;
  // Per `group`-wide slice of each row: y = x * (mean(x^2) + eps)^-0.5 [* weight]
  // (weight: fp32 [group], or null for an unscaled norm). x and y may alias.
  virtual void rms_norm(const Activation& x, const Weight* weight, int64_t group, float eps, Activation& y) = 0;
  // rms_norm of x with whole rows as the groups by each of `weights` into the matching
  // output: several norms of one input from one pass over it (a layer's feed-forward input
  // goes through three). By default one rms_norm each.
  virtual void rms_norms(const Activation& x, const std::vector<const Weight*>& weights, float eps,
                         const std::vector<Activation*>& outputs) {
    for (size_t i = 0; i < weights.size(); ++i) rms_norm(x, weights[i], x.cols, eps, *outputs[i]);
  }
  // y = (y + rms_norm(x)) * scale with whole rows as the groups (group = x.cols); x and y
  // have the same shape. The residual add (and a layer scalar) fused into the norm: bitwise
  // the same as rms_norm into a scratch matrix, add(y, scratch, y), then scale(y, scale),
  // with one pass (one launch) or two fewer.
  virtual void add_rms_norm(const Activation& x, const Weight* weight, float eps, Activation& y,
                            float scale = 1.0f) = 0;
  // add_rms_norm(x, weight, eps, y), then rms_norms(y, weights, eps, outputs): the residual
  // update and the next norms of the stream in one op, so that a backend may do both in
  // one pass. By default the two ops.
  virtual void add_rms_norm_then_norms(const Activation& x, const Weight* weight, float eps, Activation& y,
                                       const std::vector<const Weight*>& weights,
                                       const std::vector<Activation*>& outputs) {
    add_rms_norm(x, weight, eps, y);
    rms_norms(y, weights, eps, outputs);
  }
  // rms_norm(y, y_first_weight) in place with whole rows, add_rms_norm(x, x_weight, eps, y),
  // then add_rms_norm(y, y_weight, eps, h, scale), then, where `next` is given, rms_norm(h,
  // next_weight) into *next: two branches, each through its norm, joined and added to the
  // residual stream, and the stream's next norm (the next layer's input norm), in one op,
  // so that a backend may do all in one pass. By default the ops.
  virtual void add_rms_norm_twice(const Activation& x, const Weight* x_weight, Activation& y,
                                  const Weight* y_first_weight, const Weight* y_weight, float eps, Activation& h,
                                  float scale, const Weight* next_weight = nullptr, Activation* next = nullptr) {
    rms_norm(y, y_first_weight, y.cols, eps, y);
    add_rms_norm(x, x_weight, eps, y);
    add_rms_norm(y, y_weight, eps, h, scale);
    if (next) rms_norm(h, next_weight, h.cols, eps, *next);
  }
  // add_rms_norm_twice with an experts' output as x. By default on experts_unsummed's own
  // (summed) output; a backend whose experts_unsummed leaves the sum takes it here.
  virtual void add_experts_rms_norm_twice(const ExpertOutput& x, const Weight* x_weight, Activation& y,
                                          const Weight* y_first_weight, const Weight* y_weight, float eps,
                                          Activation& h, float scale, const Weight* next_weight = nullptr,
                                          Activation* next = nullptr) {
    if (x.top_k) throw std::logic_error("add_experts_rms_norm_twice: the backend left an expert sum it cannot take");
    add_rms_norm_twice(x.summed, x_weight, y, y_first_weight, y_weight, eps, h, scale, next_weight, next);
  }
  // In place on x viewed as [rows, heads, head_dim] (the query and key heads): rms_norm of
  // each head (weight: fp32 [head_dim]), then rotate_half RoPE at `positions` (inv_freq:
  // fp32 [head_dim / 2]). One op, so that a backend may do both in one pass.
  virtual void rms_norm_rope(Activation& x, const Weight& weight, int64_t head_dim, float eps, const Weight& inv_freq,
                             const std::vector<int64_t>& positions) = 0;
  // A layer's new keys and values, in place on kv = [K; V] (rows of K, then as many of V):
  // rms_norm_rope of K by k_weight, and an unscaled rms_norm of each V head. One op, so
  // that a backend may do both in one pass. By default the two ops.
  virtual void key_value_norms(Activation& kv, const Weight& k_weight, int64_t head_dim, float eps,
                               const Weight& inv_freq, const std::vector<int64_t>& positions) {
    Activation k = kv.view(0, kv.rows / 2), v = kv.view(kv.rows / 2, kv.rows / 2);
    rms_norm_rope(k, k_weight, head_dim, eps, inv_freq, positions);
    rms_norm(v, nullptr, head_dim, eps, v);
  }
  // A layer's queries, keys and values from one product's output qkv = x @ [Wq; Wk; Wv]^T,
  // [rows, q.cols + 2 * kv.cols] ([rows, q.cols + kv.cols] where V is K's raw output, on
  // full-attention layers): q = rms_norm_rope by q_weight of the query columns of rows
  // [q_first, rows) (q.rows of them, at positions[q_first + r]); kv = [K; V] of every row, as
  // key_value_norms makes them from the key and value columns. One op, so that a backend
  // may split and norm in one pass.
  virtual void split_qkv_norms(const Activation& qkv, int64_t q_first, const Weight& q_weight, const Weight& k_weight,
                               int64_t head_dim, float eps, const Weight& inv_freq,
                               const std::vector<int64_t>& positions, Activation& q, Activation& kv) = 0;
  // out = softmax(q k^T) v per head (scale 1), GQA, for every segment of the batch (each
  // with its own keys, positions, causal flag and window) in one call. round_bf16: q, k, v
  // and the probabilities rounded to bf16 before their products (activations "bfloat16";
  // the softmax's sums stay fp32).
  virtual void attention(const Activation& q, const std::vector<AttentionSegment>& segments, int64_t num_heads,
                         int64_t num_kv_heads, int64_t head_dim, Activation& out, bool round_bf16) = 0;
  // out = gelu(x[:, :I]) * x[:, I:], x is [rows, 2I]: GELU's tanh approximation, or by erf
  // after use_exact_gelu (the MLPs' and the experts' activation alike).
  virtual void gelu_glu(const Activation& x, Activation& out) = 0;
  // GELU by erf (config.json's hidden_activation "gelu") in place of its tanh approximation;
  // false where the backend's kernels have only the approximation.
  virtual bool use_exact_gelu() { return false; }
  // Router: softmax(proj(normed * hidden^-0.5)), top-k, renormalise, * per_expert_scale;
  // normed is rms_norm(x) by the router's scale.
  virtual Routing route(const Activation& normed, const Weight& proj, const Weight& per_expert_scale, int top_k) = 0;
  // out = sum_k weight_k * down_e(gelu_glu(gate_up_e(x))) over each token's experts, the
  // inputs of gate_up_e and down_e quantized as those weights' input_quant says (the
  // encoder's tokens with the encoder's scales: Routing::encoder_tokens).
  virtual void experts(const Activation& x, const Routing& routing, const Weight& gate_up, const Weight& down,
                       Activation& out) = 0;
  // experts() into an output of its own, or (a backend's choice) its rows before the weighted
  // sum, which add_experts_rms_norm_twice then adds up as it reads them (one pass fewer over
  // the rows; a launch fewer on a GPU).
  virtual ExpertOutput experts_unsummed(const Activation& x, const Routing& routing, const Weight& gate_up,
                                        const Weight& down) {
    ExpertOutput out = ExpertOutput::summed_only(alloc_output(x.rows, x.cols));
    experts(x, routing, gate_up, down, out.summed);
    return out;
  }
  // In place on x, the input of a linear whose weight carries `quant` (not None):
  // quantized as the checkpoint says and dequantized again (activation_quant.h), so that
  // an fp32 product multiplies exactly what a quantized kernel would. Rows below
  // `encoder_rows` are the encoder's; `expert` picks an expert's scales (-1: a plain linear).
  virtual void quantize_input(Activation& x, const ActivationQuant& quant, int64_t encoder_rows, int expert) = 0;
  // y = a + b (elementwise; y may alias a or b).
  virtual void add(const Activation& a, const Activation& b, Activation& y) = 0;
  virtual void scale(Activation& x, float s) = 0;
  // x = cap * tanh(x / cap) (cap > 0).
  virtual void softcap(Activation& x, float cap) = 0;
  // Row-wise softmax in fp32.
  virtual void softmax(Activation& x) = 0;
  // The sampler's pass over canvas logits, in place, one row per canvas position:
  // processed = (softcap(logits) + bias) / temperature (softcap(x) = cap * tanh(x / cap) as
  // the softcap op computes it, when cap > 0; `bias`, when not null, one value per vocab id in
  // backend memory, -inf for an id excluded: its processed value is -inf); then per row the
  // argmax, a Gumbel-max
  // candidate drawn with `key` at (row, vocab id), and the entropy. Finally the processed
  // logits are rounded to `feedback_dtype` (the reference casts the next step's
  // self-conditioning input to the weight dtype) and, with `softmax_feedback`, replaced by
  // their softmax as the softmax op computes it: the very input the next step's soft
  // embedding multiplies, so that no pass over the vocabulary is left to the forward.
  virtual std::vector<RowSample> sample(Activation& logits, float cap, float temperature, const float* bias,
                                        const RandomKey& key, DType feedback_dtype, bool softmax_feedback) = 0;
  // One denoise step of a block on its canvas logits (left as sample leaves them, the next
  // step's feedback): sample at the scheduled temperature, then sampler.h's update_canvas
  // (acceptance, renoising, argmax history, stop flag, step count). By default on the
  // host, around `sample`; a backend may keep it all in its own memory.
  virtual void denoise_step(Activation& logits, CanvasState& canvas);
  // Runs first() and second(): two branches of a forward pass, each reading only what was
  // written before the call and writing only its own outputs, so that a backend may run
  // them at the same time (the CUDA backend queues second() on a stream of its own).
  virtual void concurrently(const std::function<void()>& first, const std::function<void()>& second) {
    first();
    second();
  }
  // Whether an MoE layer's experts (their gate/up stack `experts`, `rows` tokens) leave the
  // device room for a branch beside them: whether the dense MLP goes concurrently with them.
  virtual bool experts_leave_room(const Weight& /*experts*/, int64_t /*rows*/) const { return true; }
  // Runs body() up to max_times times (>= 1), stopping after a run that leaves any of
  // `canvases` stopped; returns the runs. The body must do the same work every run, its
  // changing inputs in backend memory (a steady batch of denoise steps), so that a backend
  // may record it once and loop on the device (the CUDA backend: a graph with a while node).
  // A loop on the host also stops once `interrupted` is set (Engine::interrupt); one on the
  // device runs on, its runs being milliseconds.
  virtual int repeat(const std::function<void()>& body, const std::vector<const CanvasState*>& canvases, int max_times,
                     const std::atomic<bool>& interrupted);
};

std::unique_ptr<Backend> make_cpu_backend(int num_threads);
// "cpu", "cuda" or "cuda:N" -> that backend; InvalidArgument for other names, or "cuda" in a
// build without the CUDA backend.
std::unique_ptr<Backend> make_backend(const std::string& device, int num_threads);
#ifdef DIFFUSERVE_WITH_CUDA
// GPU `device`; `name`, the device as the caller wrote it, is what its errors call it.
std::unique_ptr<Backend> make_cuda_backend(int device, const std::string& name);
#endif

}  // namespace diffuserve
