// The model's shape and defaults, read from a checkpoint's config.json and
// generation_config.json (model_type "diffusion_gemma").
#pragma once

#include "diffuserve/abi.h"

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace diffuserve {

// What differs between layers: attention type, head geometry and rotary embedding.
struct LayerConfig {
  bool sliding = false;      // sliding_attention (window) or full_attention
  int head_dim = 0;
  int num_kv_heads = 0;
  bool has_v_proj = true;    // full-attention layers reuse k_proj's output as V
  // RoPE: head_dim/2 inverse frequencies (proportional RoPE leaves the tail at 0, which
  // rotates nothing) applied as rotate_half over the whole head.
  std::vector<float> rope_inv_freq;
};

// Sampler defaults (generation_config.json); fields the file leaves null keep these.
struct GenerationDefaults {
  int max_new_tokens = 256;
  int max_length = 0;  // a cap on prompt + new tokens (SamplingParams::max_length); 0: none
  bool length_given = false;  // generation_config.json sets max_new_tokens or max_length (else the defaults)
  int max_denoising_steps = 48;
  float t_min = 0.4f;
  float t_max = 0.8f;
  float entropy_bound = 0.1f;
  int stability_threshold = 1;
  float confidence_threshold = 0.005f;
  // As transformers' DiffusionGemma generate takes them: generation_config.json's alone
  // (config.json's are not its defaults; none: no EOS, and no pad id).
  std::vector<int32_t> eos_token_ids;
  // The id tokens_per_forward leaves uncounted, as transformers' generate counts it (none: no
  // pad id; any integer is one, even where no token is that id).
  std::optional<int32_t> pad_token_id;
};

// How a quantized linear's input is quantized (compressed-tensors' input_activations),
// with scales computed from the values at run time:
//   Fp8Token: E4M3 values, one scale per row (token): amax / 448 (FP8_DYNAMIC);
//   Nvfp4:    E2M1 values in groups of 16 along K, each group's E4M3 scale amax / 6 under
//             the linear's calibrated input_global_scale (NVFP4, W4A4).
//   Bf16:     rounded to bf16 (LoadOptions::activations "bfloat16": the inputs of the linears
//             that multiply plain weights; one bf16 product instead of fp32's hi/lo pair).
enum class ActivationScheme { None, Fp8Token, Nvfp4, Bf16 };

// How a config group's quantized weights share their scales (compressed-tensors' strategy):
// one scale for the tensor, one a row ("channel"), or one for each `group_size` inputs of a
// row ("group"; NVFP4's "tensor_group" is groups of 16 under the tensor's global scale).
struct WeightScales {
  enum class Strategy { Tensor, Channel, Group };
  Strategy strategy = Strategy::Tensor;
  int64_t group_size = 0;  // Group's
  bool operator==(const WeightScales&) const = default;
};

// A config group of quantization_config: the linears its targets name (exact module
// names, "re:" regexes, or the class "Linear") quantize their input as `input` says.
struct QuantizationGroup {
  std::vector<std::string> targets;
  ActivationScheme input = ActivationScheme::None;
  std::optional<WeightScales> weights;  // its targets' weights' scales; none: it quantizes their inputs alone
};

struct ModelConfig {
  int vocab_size = 0;
  int hidden_size = 0;
  int intermediate_size = 0;     // dense MLP and self-conditioning MLP
  int num_layers = 0;
  int num_heads = 0;
  int num_experts = 0;
  int top_k_experts = 0;
  int moe_intermediate_size = 0;
  int sliding_window = 0;
  int canvas_length = 0;
  int64_t max_position_embeddings = 0;
  float rms_norm_eps = 1e-6f;
  float final_logit_softcapping = 0.0f;  // 0: no softcap
  bool tie_word_embeddings = true;
  bool exact_gelu = false;  // hidden_activation "gelu": GELU by erf (else its tanh approximation)
  // config.json's dtype (torch_dtype in older files), which transformers loads the weights in
  // by default; empty where it gives none (the embedding's stored dtype then).
  std::string dtype;
  int pad_token_id = -1;
  int bos_token_id = -1;
  std::vector<LayerConfig> layers;
  GenerationDefaults generation;
  // compressed-tensors format of quantized linear weights ("float-quantized" for FP8, or
  // "naive-quantized" for FP8 weights whose inputs stay plain; "nvfp4-pack-quantized"),
  // empty for a plain checkpoint; its config groups, and the
  // modules that none of them applies to.
  std::string quantization;
  std::vector<QuantizationGroup> quantization_groups;
  std::vector<std::string> quantization_ignore;
  // The longest sequence (prompt and generated tokens) a request may reach: max_position_embeddings,
  // or less where the load option max_model_len lowers it.
  int64_t max_model_len = 0;
  // What refusals at that length name: the option where it lowered the config's limit.
  const char* max_model_len_name() const {
    return max_model_len < max_position_embeddings ? "max_model_len" : "max_position_embeddings";
  }
};

// Reads `dir`/config.json and, when present, `dir`/generation_config.json. Throws
// FormatError naming the file and the field for anything missing, mistyped or unsupported.
ModelConfig load_config(const std::string& dir);

}  // namespace diffuserve
