// The generation loop: per request, prefill; then block by block, denoise until the
// sampler stops, commit the argmax canvas, and stop at EOS or max_new_tokens.
#include "diffuserve/generate.h"

#include <algorithm>
#include <cmath>
#include <random>

#include "model.h"
#include "sampler.h"

namespace diffuserve {
namespace {

[[noreturn]] void bad(const std::string& param, const std::string& why) {
  throw InvalidArgument("SamplingParams." + param + " " + why);
}

void check_token_list(const std::vector<int32_t>& ids, const std::string& param, int vocab) {
  for (size_t i = 0; i < ids.size(); ++i)
    if (ids[i] < 0 || ids[i] >= vocab)
      bad(param, "[" + std::to_string(i) + "] = " + std::to_string(ids[i]) + " is out of range [0, " +
                     std::to_string(vocab) + ")");
}

// One request's state across its blocks.
struct Request {
  const SamplingParams& params;
  uint64_t seed;
  int canvas;                     // this request's canvas length
  std::vector<uint8_t> allowed;   // per vocab id; empty: every id
  std::vector<int32_t> allowed_ids;
  GenerationOutput out;
  int forwards = 0;

  // A uniformly random token from the allowed set.
  int32_t random_token(const RandomKey& key, uint32_t position, int vocab) const {
    const uint32_t bits = key.draw(position, 0)[0];
    return allowed_ids.empty() ? int32_t(uniform_below(bits, uint32_t(vocab)))
                               : allowed_ids[uniform_below(bits, uint32_t(allowed_ids.size()))];
  }
};

// Denoises one block until the sampler stops; returns its argmax canvas.
std::vector<int32_t> denoise_block(Sequence& seq, Backend& be, Request& r, uint32_t block, DType weight_dtype) {
  const SamplingParams& p = r.params;
  const int vocab = seq.config().vocab_size, n = r.canvas;
  // Pinned positions hold their seed token in the first block; the rest start as noise.
  std::vector<uint8_t> free_position(n, 1);
  std::vector<int32_t> canvas(n);
  const RandomKey init{r.seed, block, 0, RandomStream::InitialCanvas};
  for (int i = 0; i < n; ++i) canvas[i] = r.random_token(init, uint32_t(i), vocab);
  if (block == 0 && !p.seed_canvas.empty()) {
    canvas = p.seed_canvas;
    for (int32_t pos : p.pinned_positions) free_position[pos] = 0;
  }
  const std::vector<int32_t> pinned_tokens = canvas;

  StableAndConfident stop(p.stability_threshold, p.confidence_threshold);
  std::vector<int32_t> argmax = canvas;
  Activation feedback;  // the previous step's processed logits, for self-conditioning
  int steps = 0;
  for (int remaining = p.max_denoising_steps; remaining >= 1; --remaining) {
    Activation logits = seq.denoise_logits(canvas, steps ? &feedback : nullptr);
    ++steps;
    const uint32_t step = uint32_t(p.max_denoising_steps - remaining);
    const float temperature = schedule_temperature(p.t_min, p.t_max, remaining, p.max_denoising_steps);
    const std::vector<RowSample> rows =
        be.sample(logits, temperature, r.allowed, RandomKey{r.seed, block, step, RandomStream::Candidate}, weight_dtype);

    std::vector<float> entropy(n);
    double entropy_sum = 0;
    int counted = 0;
    for (int i = 0; i < n; ++i) {
      entropy[i] = rows[i].entropy;
      if (free_position[i]) entropy_sum += entropy[i], ++counted;
    }
    const std::vector<uint8_t> accepted = accept_by_entropy(entropy, p.entropy_bound, free_position);
    const RandomKey renoise{r.seed, block, step, RandomStream::Renoise};
    for (int i = 0; i < n; ++i) {
      if (!free_position[i]) continue;
      argmax[i] = rows[i].argmax;
      canvas[i] = accepted[i] ? rows[i].candidate : r.random_token(renoise, uint32_t(i), vocab);
    }
    feedback = logits;
    const float mean_entropy = counted ? float(entropy_sum / counted) : 0.0f;
    if (stop(argmax, mean_entropy)) break;
  }
  r.out.denoise_steps.push_back(steps);
  r.forwards += steps;
  return argmax;
}

GenerationOutput generate_one(Model& model, const std::vector<int32_t>& prompt, Request r) {
  const SamplingParams& p = r.params;
  auto seq = model.new_sequence(r.canvas);
  seq->prefill(prompt);
  Backend& be = *model.state().backend;
  std::vector<int32_t>& tokens = r.out.token_ids;
  for (uint32_t block = 0;; ++block) {
    const std::vector<int32_t> argmax = denoise_block(*seq, be, r, block, model.weight_dtype());
    auto eos = std::find_first_of(argmax.begin(), argmax.end(), p.eos_token_ids.begin(), p.eos_token_ids.end());
    tokens.insert(tokens.end(), argmax.begin(), eos == argmax.end() ? eos : eos + 1);
    if (int(tokens.size()) >= p.max_new_tokens) {  // max_new_tokens cuts the last block
      const bool eos_kept = eos != argmax.end() && int(tokens.size()) <= p.max_new_tokens;
      tokens.resize(std::min<size_t>(tokens.size(), size_t(p.max_new_tokens)));
      r.out.finish_reason = eos_kept ? "stop" : "length";
      break;
    }
    if (eos != argmax.end()) {
      r.out.finish_reason = "stop";
      break;
    }
    seq->commit(argmax);
  }
  const int pad = model.config().pad_token_id;
  const auto valid = std::count_if(tokens.begin(), tokens.end(), [&](int32_t t) { return t != pad; });
  r.out.tokens_per_forward = double(valid) / r.forwards;
  r.out.seed = r.seed;
  return r.out;
}

}  // namespace

SamplingParams sampling_defaults(const ModelConfig& c) {
  const GenerationDefaults& g = c.generation;
  SamplingParams p;
  p.max_new_tokens = g.max_new_tokens;
  p.max_denoising_steps = g.max_denoising_steps;
  p.t_min = g.t_min;
  p.t_max = g.t_max;
  p.entropy_bound = g.entropy_bound;
  p.stability_threshold = g.stability_threshold;
  p.confidence_threshold = g.confidence_threshold;
  p.eos_token_ids = g.eos_token_ids;
  return p;
}

void validate(const SamplingParams& p, const ModelConfig& c) {
  if (p.max_new_tokens < 1) bad("max_new_tokens", "must be >= 1, got " + std::to_string(p.max_new_tokens));
  if (p.max_denoising_steps < 1)
    bad("max_denoising_steps", "must be >= 1, got " + std::to_string(p.max_denoising_steps));
  // As transformers: t_min >= 0 and t_max > t_min, so every step's temperature is > 0.
  if (!std::isfinite(p.t_min) || p.t_min < 0) bad("t_min", "must be a finite number >= 0");
  if (!std::isfinite(p.t_max) || p.t_max <= p.t_min) bad("t_max", "must be a finite number > t_min");
  if (!(p.entropy_bound > 0) || std::isnan(p.entropy_bound)) bad("entropy_bound", "must be > 0");
  if (p.stability_threshold < 0) bad("stability_threshold", "must be >= 0");
  if (!(p.confidence_threshold > 0) || std::isnan(p.confidence_threshold)) bad("confidence_threshold", "must be > 0");
  check_token_list(p.eos_token_ids, "eos_token_ids", c.vocab_size);
  if (p.canvas_length < 0 || p.canvas_length > c.canvas_length)
    bad("canvas_length", "must be in [1, " + std::to_string(c.canvas_length) + "] (0: the model's), got " +
                             std::to_string(p.canvas_length));
  const int canvas = p.canvas_length ? p.canvas_length : c.canvas_length;
  if (!p.seed_canvas.empty() && int(p.seed_canvas.size()) != canvas)
    bad("seed_canvas", "has " + std::to_string(p.seed_canvas.size()) + " tokens, expected the canvas length " +
                           std::to_string(canvas));
  check_token_list(p.seed_canvas, "seed_canvas", c.vocab_size);
  if (!p.pinned_positions.empty() && p.seed_canvas.empty())
    bad("pinned_positions", "needs a seed_canvas to take the pinned tokens from");
  std::vector<uint8_t> seen(canvas, 0);
  for (int32_t pos : p.pinned_positions) {
    if (pos < 0 || pos >= canvas)
      bad("pinned_positions", "holds " + std::to_string(pos) + ", outside the canvas [0, " + std::to_string(canvas) + ")");
    if (seen[pos]++) bad("pinned_positions", "holds " + std::to_string(pos) + " twice");
  }
  check_token_list(p.allowed_token_ids, "allowed_token_ids", c.vocab_size);
}

std::vector<GenerationOutput> generate(Model& model, const std::vector<std::vector<int32_t>>& prompts,
                                       const std::vector<SamplingParams>& params) {
  const ModelConfig& c = model.config();
  if (params.size() != 1 && params.size() != prompts.size())
    throw InvalidArgument("generate: " + std::to_string(params.size()) + " SamplingParams for " +
                          std::to_string(prompts.size()) + " prompts (give one, or one per prompt)");
  // Check everything before any work, so a bad request fails the call up front.
  for (size_t i = 0; i < prompts.size(); ++i) {
    if (prompts[i].empty()) throw InvalidArgument("generate: prompt " + std::to_string(i) + " is empty");
    for (size_t j = 0; j < prompts[i].size(); ++j)
      if (prompts[i][j] < 0 || prompts[i][j] >= c.vocab_size)
        throw InvalidArgument("generate: prompt " + std::to_string(i) + ": token id " + std::to_string(prompts[i][j]) +
                              " at index " + std::to_string(j) + " is out of range [0, " +
                              std::to_string(c.vocab_size) + ")");
  }
  for (size_t i = 0; i < prompts.size(); ++i) {
    const SamplingParams& p = params.size() == 1 ? params[0] : params[i];
    validate(p, c);
    // Every block is denoised at full canvas width, so the last one may reach past max_new_tokens.
    const int canvas = p.canvas_length ? p.canvas_length : c.canvas_length;
    const int64_t blocks = (int64_t(p.max_new_tokens) + canvas - 1) / canvas;
    if (int64_t(prompts[i].size()) + blocks * canvas > c.max_position_embeddings)
      throw InvalidArgument("generate: prompt " + std::to_string(i) + " (" + std::to_string(prompts[i].size()) +
                            " tokens) plus max_new_tokens " + std::to_string(p.max_new_tokens) +
                            " in blocks of " + std::to_string(canvas) + " exceeds max_position_embeddings (" +
                            std::to_string(c.max_position_embeddings) + ")");
  }

  std::random_device entropy_source;
  std::vector<GenerationOutput> outputs;
  for (size_t i = 0; i < prompts.size(); ++i) {
    const SamplingParams& p = params.size() == 1 ? params[0] : params[i];
    Request r{p, p.seed ? *p.seed : (uint64_t(entropy_source()) << 32 | entropy_source()),
              p.canvas_length ? p.canvas_length : c.canvas_length, {}, p.allowed_token_ids, {}, 0};
    if (!p.allowed_token_ids.empty()) {
      r.allowed.assign(c.vocab_size, 0);
      for (int32_t t : p.allowed_token_ids) r.allowed[t] = 1;
      std::sort(r.allowed_ids.begin(), r.allowed_ids.end());
      r.allowed_ids.erase(std::unique(r.allowed_ids.begin(), r.allowed_ids.end()), r.allowed_ids.end());
    }
    outputs.push_back(generate_one(model, prompts[i], std::move(r)));
  }
  return outputs;
}

}  // namespace diffuserve
