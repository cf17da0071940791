// diffuserve's C++ API: load a DiffusionGemma checkpoint, then run the three passes of
// block diffusion on a sequence.
//
//   auto model = diffuserve::Model::load("/path/to/checkpoint");
//   auto seq = model->new_sequence();
//   seq->prefill(prompt_ids);                          // causal encoder pass, appends KV
//   std::vector<float> logits = seq->denoise(canvas);  // [canvas, vocab], softcapped
//   seq->commit(canvas);                               // causal pass over a finished block
//
// Errors: InvalidArgument for bad arguments, FormatError for bad files (errors.h).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "diffuserve/config.h"
#include "diffuserve/dtype.h"
#include "diffuserve/errors.h"

namespace diffuserve {

struct LoadOptions {
  std::string device = "cpu";  // "cpu", "cuda" or "cuda:N" (builds with the CUDA backend)
  // Weight storage dtype: "" takes config.json's dtype (torch_dtype), as transformers does, or where
  // it names none the embedding's stored one (load_format "dummy": bfloat16, whatever config.json
  // says, as the GPU keeps its weights); "float32", "bfloat16" or "float16" casts.
  std::string dtype;
  int num_threads = 0;         // at most 1024; 0: DIFFUSERVE_NUM_THREADS, else each CPU it may run on
  // The paged KV cache: 0 = a quarter of physical memory, at most 4 GiB (CPU).
  int64_t kv_cache_memory_bytes = 0;
  int kv_block_size = 16;      // tokens per KV block
  // The most sequences live at once that each keep room for a sliding window's KV: it sizes
  // the sliding-window pool, so a prefill of one sequence more can be refused for want of room.
  int max_num_seqs = 64;
  // "auto": weights from the checkpoint's safetensors; "dummy": random weights of the
  // config's shapes (config.json alone is needed), for benchmarks at any size.
  std::string load_format = "auto";
  // With load_format "dummy": "" (plain weights), "fp8", "fp8-dynamic" or "nvfp4": the
  // linears' random weights packed as an FP8 (per-channel) or NVFP4 checkpoint stores them;
  // "fp8-dynamic" also quantizes their inputs to FP8 per token, as FP8_DYNAMIC does.
  std::string quantization;
  // How the linears' inputs enter their products: "float32" (every product as in fp32, the
  // reference's numbers; on the GPU two bf16 tensor-core products, the input's hi and lo
  // halves) or "bfloat16" (the inputs of the linears and experts with plain weights,
  // lm_head included, rounded to bf16 first, as transformers computes in bf16: one product,
  // about half the tensor-core work; attention's queries, keys, values and probabilities
  // are rounded too, one product instead of three; the router, the softmax sums and the
  // norms stay fp32).
  std::string activations = "float32";
  // How the KV cache stores keys and values: "auto" (bf16 where the attention rounds them to
  // bf16 as it reads them, activations "bfloat16", and the device's attention reads bf16 keys:
  // the CPU, or on CUDA head dims 256 and 512 on Hopper; the same results in half the
  // memory; else fp32), "float32", or "bfloat16" (an error where "auto" would not choose it).
  std::string kv_cache_dtype = "auto";
  // The longest sequence (prompt and generated tokens) a request may reach, as vLLM's
  // max_model_len: 0 takes config.json's max_position_embeddings; more than that is an error.
  int64_t max_model_len = 0;
};

// Occupancy of the KV cache (see kv_cache.h).
struct CacheStats {
  int64_t blocks_total = 0, blocks_free = 0;
  int64_t prefix_cache_queries = 0, prefix_cache_hits = 0;  // in prompt tokens
};

class Sequence;
struct ModelState;

// Whether this build has the CUDA backend and the machine a GPU for it.
bool cuda_available();

// Threads may share a model: the calls of its sequences and engines take turns (one at a
// time uses its backend and KV cache).
class Model : public std::enable_shared_from_this<Model> {
 public:
  // `path` is a checkpoint directory (config.json + safetensors).
  static std::shared_ptr<Model> load(const std::string& path, const LoadOptions& options = {});
  ~Model();

  const ModelConfig& config() const;
  DType weight_dtype() const;
  DType kv_cache_dtype() const;
  const std::string& device() const;
  CacheStats cache_stats() const;
  // The longest sequence (prompt and generated tokens) one request may reach: within
  // max_position_embeddings, and what the whole KV cache holds at the model's canvas. A
  // request's new tokens come in whole blocks, so a prompt leaves room for the whole blocks
  // that fit after it (max_new_tokens past those is refused).
  int64_t max_sequence_tokens() const;
  // A new, empty sequence. canvas_length: 0 for the model's, or a narrower canvas.
  std::unique_ptr<Sequence> new_sequence(int canvas_length = 0);

  // For the runtime; not part of the stable surface.
  ModelState& state() { return *state_; }

 private:
  explicit Model(std::unique_ptr<ModelState> state);
  std::unique_ptr<ModelState> state_;
};

// The keys and values one layer holds for a sequence, laid out [kv_heads, rows, head_dim]
// like the reference cache. Sliding-window layers hold only the last window - 1 rows. With
// activations "bfloat16" the cache keeps them rounded to bf16 (as the attention reads them).
struct LayerKV {
  std::vector<float> keys, values;
  int64_t kv_heads = 0, rows = 0, head_dim = 0;
  int64_t first_position = 0;
};

class Sequence {
 public:
  // Frees the sequence's KV blocks; while another thread's call holds the model, the next
  // call to start frees them, so that this never waits for a pass.
  ~Sequence();

  // Causal encoder pass over `ids` at the next positions; appends their KV. On an empty
  // sequence, whole blocks of `ids` already in the prefix cache are adopted, not recomputed.
  // Long `ids` go in chunks the sliding-window layers' KV pool holds (the same KV); a
  // prefill the cache has no room for is refused before any of it is encoded. Returns once
  // the pass is done on the device, as commit does.
  void prefill(std::span<const int32_t> ids);
  // Bidirectional decoder pass over a canvas of exactly canvas_length() tokens, reading
  // the KV cache without changing it. `self_conditioning_logits` is empty (first step of a
  // block) or [canvas, vocab] fp32, row-major (another size is refused). Returns softcapped
  // fp32 logits [canvas, vocab].
  std::vector<float> denoise(std::span<const int32_t> canvas, std::span<const float> self_conditioning_logits = {});
  // The same with the logits as a pointer (null: none) to canvas x vocab values, as this API
  // first took them: their count cannot be checked, so the span form is the one to use.
  std::vector<float> denoise(std::span<const int32_t> canvas, const float* self_conditioning_logits);
  // Throws InvalidArgument where denoise would refuse `canvas` (an empty sequence, another
  // length, an id or a position out of range), running nothing: a caller checking its own
  // inputs (the logits' shape) names the canvas first.
  void check_canvas(std::span<const int32_t> canvas) const;
  // Causal encoder pass over a finished block (1 to canvas_length() tokens); appends KV.
  void commit(std::span<const int32_t> block);

  int64_t length() const;  // tokens encoded so far (prompt + committed blocks)
  int canvas_length() const;
  const ModelConfig& config() const;

  LayerKV kv(int layer) const;
  // KV blocks the sequence holds in the full-attention and sliding-window pools.
  std::pair<int64_t, int64_t> kv_blocks() const;

 private:
  friend class Model;
  struct State;
  Sequence(std::shared_ptr<Model> model, int canvas_length);
  void encode(std::span<const int32_t> ids, const char* what);
  void continue_prefill(std::span<const int32_t> ids);
  std::shared_ptr<Model> model_;
  std::unique_ptr<State> state_;
};

}  // namespace diffuserve
