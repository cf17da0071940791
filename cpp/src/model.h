// The DiffusionGemma graph: weights, and the encoder and decoder passes written once
// against the Backend op interface.
#pragma once

#include <memory>
#include <span>
#include <string>
#include <vector>

#include "backend.h"
#include "diffuserve/config.h"
#include "safetensors.h"

namespace diffuserve {

struct LayerWeights {
  Weight q_proj, k_proj, v_proj, o_proj;  // v_proj is empty on full-attention layers
  std::vector<float> q_norm, k_norm;
  std::vector<float> input_layernorm, post_attention_layernorm;
  std::vector<float> pre_feedforward_layernorm, post_feedforward_layernorm;
  std::vector<float> post_feedforward_layernorm_1, post_feedforward_layernorm_2, pre_feedforward_layernorm_2;
  Weight mlp_gate_up, mlp_down;  // gate_proj and up_proj stacked: one GEMM
  Weight router_proj;
  std::vector<float> router_scale, router_per_expert_scale;
  Weight experts_gate_up, experts_down;  // [E, 2I, H], [E, H, I]
  float decoder_layer_scalar = 1.0f;
  float encoder_layer_scalar = 1.0f;
};

struct ModelWeights {
  Weight embed_tokens;  // [vocab, hidden]; also the lm_head when tied
  Weight lm_head;       // empty when tied
  std::vector<float> norm;
  std::vector<float> sc_pre_norm;
  Weight sc_gate_up, sc_down;  // self-conditioning MLP, gate and up stacked
  std::vector<LayerWeights> layers;
};

// One layer's KV rows for one sequence, token-major [rows, kv_heads * head_dim].
struct LayerCache {
  Activation keys, values;  // capacity = keys.rows
  int64_t rows = 0;
  int64_t first_position = 0;
};

struct ModelState {
  std::string path;
  std::string device;
  ModelConfig config;
  std::unique_ptr<Backend> backend;
  std::shared_ptr<Checkpoint> checkpoint;  // weights may point into its mappings
  ModelWeights weights;
  DType weight_dtype = DType::F32;
  float embed_scale = 1.0f;  // sqrt(hidden) rounded to the weight dtype, as the reference does
};

// Loads weights from `checkpoint` into `state` (config and backend already set),
// checking that exactly the expected tensors are present with the expected shapes.
void load_weights(ModelState& state, DType as);

// Causal pass over `ids` at positions cache_length.., appending each layer's KV.
void encoder_forward(ModelState& m, std::vector<LayerCache>& cache, int64_t first_position,
                     std::span<const int32_t> ids);

// Bidirectional pass over a canvas at positions first_position.., reading the cache.
// `self_conditioning_logits` ([canvas, vocab], backend memory) is null on a block's first
// step. Returns softcapped fp32 logits [canvas, vocab] in backend memory.
Activation decoder_forward(ModelState& m, const std::vector<LayerCache>& cache, int64_t first_position,
                           std::span<const int32_t> canvas, const Activation* self_conditioning_logits);

}  // namespace diffuserve
