// Block-diffusion generation from token ids: the sampler of DiffusionGemma (entropy-bound
// acceptance, renoising, stable-and-confident stopping, a linear temperature schedule)
// with the whole denoise loop of each block run inside the runtime.
#pragma once

#include <cstdint>
#include <optional>
#include <stop_token>
#include <string>
#include <utility>
#include <vector>

#include "diffuserve/diffuserve.h"

namespace diffuserve {

// Per-request parameters, named as in transformers' DiffusionGemmaGenerationConfig.
// sampling_defaults(model.config()) fills them from the checkpoint's generation_config.json.
struct SamplingParams {
  int max_new_tokens = 256;
  // transformers' max_length, a cap on prompt + new tokens (0: none), applied by its rule: with
  // max_new_tokens at 256 (transformers' default) it sets max_new_tokens to max_length - prompt
  // length (a prompt that leaves no room is refused); with any other max_new_tokens, that one
  // stands and max_length only ends the request after the first block that reaches it.
  int max_length = 0;
  int max_denoising_steps = 48;
  float t_min = 0.4f;  // temperature at the last step
  float t_max = 0.8f;  // temperature at the first step
  float entropy_bound = 0.1f;
  int stability_threshold = 1;
  float confidence_threshold = 0.005f;
  std::vector<int32_t> eos_token_ids;
  std::optional<uint64_t> seed;  // unset: a fresh random seed (reported in the output)
  // true: where the length limit (max_new_tokens, max_length) would reach past
  // max_position_embeddings or the whole KV cache, generate the whole blocks that fit instead
  // (at least one: a prompt that leaves none is still refused). vLLM's rule for a request that
  // gives no max_tokens: the server sets it then.
  bool fit_to_context = false;

  // Diffusion options (as vLLM offers them):
  int canvas_length = 0;                   // 0: the model's; else a narrower canvas
  std::vector<int32_t> seed_canvas;        // initial tokens of the first block's canvas
  std::vector<int32_t> pinned_positions;   // first-block positions held at their seed_canvas token
  std::vector<int32_t> allowed_token_ids;  // only these may be drawn or accepted (pinned tokens stay as given)
  bool self_conditioning = true;           // false: every step sees no previous logits (an ablation)
  // (token id, bias) pairs, each id at most once, each bias finite: added to that id's
  // (softcapped) logit before the temperature divides it, as OpenAI's and vLLM's logit_bias,
  // and as a logits processor given to transformers' generate acts: the argmax, the draws,
  // the entropies and the next step's self-conditioning all see the biased logits. (An id
  // outside allowed_token_ids stays excluded; the renoising draws stay uniform.)
  std::vector<std::pair<int32_t, float>> logit_bias;
};

struct GenerationOutput {
  std::vector<int32_t> token_ids;  // generated tokens, up to and including an EOS
  std::string finish_reason;       // "stop" (EOS), "length" (max_new_tokens, max_length) or "error" (below)
  std::string error;               // with "error": why the request failed (its logits were not finite)
  std::vector<int> denoise_steps;  // decoder passes of each block
  double tokens_per_forward = 0;   // generated tokens (pad ids excluded) / decoder passes
  uint64_t seed = 0;               // the seed used
};

SamplingParams sampling_defaults(const ModelConfig& config);

// Throws InvalidArgument naming the first bad parameter.
void validate(const SamplingParams& params, const ModelConfig& config);

// Generates for each prompt with its parameters (one set for all, or one per prompt).
// A seeded request's output depends only on its prompt, parameters and seed. Throws
// InvalidArgument naming the prompt for a bad prompt or parameter (before any work), and for
// a request the KV cache cannot take because the model's other sequences hold it. Its
// requests run one after another, each holding the model's turn (diffuserve.h) while it
// runs: other threads' calls on the model run between them. A stop requested on `stop` (from
// any thread: a timeout, a client gone) ends the call after the forward pass in progress, or
// ends its wait for the turn (which another thread's call may hold for a whole request),
// throwing Cancelled (errors.h), the requests' KV freed. A service that must abort single requests, or
// serve others meanwhile, runs them on an Engine (engine.h).
std::vector<GenerationOutput> generate(Model& model, const std::vector<std::vector<int32_t>>& prompts,
                                       const std::vector<SamplingParams>& params, std::stop_token stop = {});

}  // namespace diffuserve
