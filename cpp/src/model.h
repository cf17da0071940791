// The DiffusionGemma graph: weights, and the encoder and decoder passes written once
// against the Backend op interface.
#pragma once

#include <chrono>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <span>
#include <stop_token>
#include <string>
#include <vector>

#include "backend.h"
#include "diffuserve/config.h"
#include "kv_cache.h"
#include "safetensors.h"

namespace diffuserve {

// What is wrong with a sequence's or a request's canvas_length (0: the model's), or "" where
// nothing is. For too long a canvas the message does not offer 0, which Python and the server
// spell None or leave out.
inline std::string canvas_length_problem(int canvas_length, const ModelConfig& c) {
  if (canvas_length < 0) return "must be >= 0 (0: the model's), got " + std::to_string(canvas_length);
  if (canvas_length > c.canvas_length)
    return "must be at most the model's canvas_length (" + std::to_string(c.canvas_length) + "), got " +
           std::to_string(canvas_length);
  return "";
}

struct LayerWeights {
  // v_proj is empty on full-attention layers. Where the checkpoint lets q_proj, k_proj and
  // v_proj be one product (stored plainly, inputs quantized alike), they are stacked into
  // qkv_proj ([Wq; Wk; Wv] or [Wq; Wk]) and are themselves empty; else qkv_proj is.
  Weight q_proj, k_proj, v_proj, qkv_proj, o_proj;
  // Norm weights, scales and the RoPE frequencies are small fp32 weights.
  Weight q_norm, k_norm;
  Weight input_layernorm, post_attention_layernorm;
  Weight pre_feedforward_layernorm, post_feedforward_layernorm;
  Weight post_feedforward_layernorm_1, post_feedforward_layernorm_2, pre_feedforward_layernorm_2;
  Weight rope_inv_freq;
  Weight mlp_gate_up, mlp_down;  // gate_proj and up_proj stacked: one GEMM
  Weight router_proj;
  Weight router_scale, router_per_expert_scale;
  Weight experts_gate_up, experts_down;  // [E, 2I, H], [E, H, I]
  float decoder_layer_scalar = 1.0f;
  float encoder_layer_scalar = 1.0f;
};

struct ModelWeights {
  Weight embed_tokens;  // [vocab, hidden]; also the lm_head when tied
  Weight lm_head;       // empty when tied
  Weight norm;
  Weight sc_pre_norm;
  Weight sc_gate_up, sc_down;  // self-conditioning MLP, gate and up stacked
  std::vector<LayerWeights> layers;
  // The encoder's own embedding, layers and norm, where the checkpoint stores others than the
  // decoder's (load_weights says when transformers runs them); else null, and the decoder's
  // serve the encoder's rows too.
  std::unique_ptr<ModelWeights> encoder;
};

// One sequence's part of a batched forward pass.
struct Segment {
  KvTable* table = nullptr;  // the sequence's KV
  bool encoder = false;      // causal pass that appends KV (prefill chunk, commit); else a denoise step
  std::vector<int32_t> tokens;  // host ids (always, for an encoder segment)
  // denoise: the previous step's processed logits (or null), or with self_conditioning_softmax
  // their softmax, as Backend::sample leaves it
  const Activation* self_conditioning = nullptr;
  bool self_conditioning_softmax = false;
  // A denoise step's ids in backend memory instead of `tokens` (its block's CanvasState).
  const int32_t* token_ids = nullptr;
  int64_t token_count = 0;

  int64_t rows() const { return token_ids ? token_count : int64_t(tokens.size()); }
};

struct ModelState {
  ModelState();  // (registered for the fork handlers while it lives)
  ~ModelState();
  ModelState(const ModelState&) = delete;
  ModelState& operator=(const ModelState&) = delete;

  std::string path;
  std::string device;
  int num_threads = 0;  // LoadOptions': the load's conversions run on as many CPU threads (0: every CPU's)
  ModelConfig config;
  std::unique_ptr<Backend> backend;
  std::shared_ptr<Checkpoint> checkpoint;  // weights may point into its mappings; null for dummy weights
  ModelWeights weights;
  DType weight_dtype = DType::F32;
  WeightFormat dummy_quantization = WeightFormat::Plain;  // load_format "dummy": how the linears are packed
  ActivationScheme dummy_activations = ActivationScheme::None;  // and how their inputs are quantized
  bool bf16_activations = false;  // LoadOptions::activations "bfloat16"
  float embed_scale = 1.0f;  // sqrt(hidden) rounded to the weight dtype, as the reference does
  std::unique_ptr<KvCache> kv;
  // One caller at a time: every public call on the model (Sequence's, Engine's, cache_stats)
  // holds this while it uses the backend's buffers and the KV cache, so that threads may
  // share a model. Recursive: a call may make another (Sequence::prefill asks length()).
  std::recursive_timed_mutex calls;
  // Set in a child process forked while another thread's call held `calls`: there that thread
  // does not exist, `calls` stays held for good, and the model's state is the call's, half
  // done. Every call is then refused (it had waited forever).
  bool forked_in_use = false;
  std::unique_lock<std::recursive_timed_mutex> lock() {
    refuse_if_forked_in_use();
    std::unique_lock held(calls);
    release_dropped();
    return held;
  }
  // lock(), unless a stop is requested while it waits (another thread's call may hold the
  // model for a whole request): then none, within 10 ms of the stop.
  std::optional<std::unique_lock<std::recursive_timed_mutex>> lock(const std::stop_token& stop) {
    refuse_if_forked_in_use();
    std::unique_lock held(calls, std::defer_lock);
    while (!held.try_lock_for(std::chrono::milliseconds(10)))
      if (stop.stop_requested()) return std::nullopt;
    release_dropped();
    return held;
  }
  // Releases the KV blocks of a sequence or request being destroyed, now if no other thread's
  // call holds `calls`, else by the next caller to take it (before it uses the cache): a
  // destructor may run in any thread, in Python's holding the GIL, and waiting there for
  // another call's pass had stalled every Python thread.
  // Where the queue cannot grow (out of memory), it waits for the call after all: a
  // destructor must not throw.
  void release_soon(KvTable table) noexcept {
    std::unique_lock held(calls, std::try_to_lock);
    if (!held) {
      try {
        const std::lock_guard guard(dropped_mutex);
        dropped.push_back(std::move(table));  // (on bad_alloc, `table` is left as it was)
        return;
      } catch (const std::bad_alloc&) {
        held.lock();
      }
    }
    release_dropped();
    kv->release(table);
  }

 private:
  void refuse_if_forked_in_use() const;
  static void before_fork();  // the fork handlers (sequence.cpp)
  static void after_fork_in_parent();
  static void after_fork_in_child();
  void release_dropped() {  // (with `calls` held)
    const std::lock_guard guard(dropped_mutex);
    for (KvTable& table : dropped) kv->release(table);
    dropped.clear();
  }

  std::mutex dropped_mutex;
  std::vector<KvTable> dropped;
};

// What logits holding NaN or infinity say of the model, as the errors that refuse them end
// (Sequence::denoise, and a request's error in the engine).
inline constexpr const char* kNotFiniteCause =
    "the checkpoint's weights (or the activations they produce) are not finite, or the sampling temperature is "
    "so small that the logits divided by it overflow";

// Throws InvalidArgument "<what>: token id X at index i is out of range [0, vocab)" for
// the first id outside the vocabulary.
void check_token_ids(std::span<const int32_t> ids, const ModelConfig& config, const std::string& what);

// Loads weights from `checkpoint` into `state` (config and backend already set),
// checking that exactly the expected tensors are present with the expected shapes; with
// no checkpoint, random weights of those shapes.
void load_weights(ModelState& state, DType as);

// One forward pass over a batch in which each segment is in its own phase. Encoder
// segments need their KV blocks reserved (KvCache::reserve); their KV is written and
// recorded (KvCache::append). A denoise segment sees its sequence's cache including this
// batch's encoder rows of the same sequence, so commit + next block's first step can run
// as one pass. At most one encoder segment per sequence. Returns the softcapped fp32
// logits of the denoise segments' rows, in segment order: in `logits` when given (one row
// per denoise row; a segment's self_conditioning may be its own rows of it, read before
// they are overwritten). softcap false: before the final softcap, which the sampler then
// applies (CanvasParams::softcap).
Activation forward(ModelState& m, KvCache& kv, std::vector<Segment>& segments, const Activation* logits = nullptr,
                   bool softcap = true);

}  // namespace diffuserve
