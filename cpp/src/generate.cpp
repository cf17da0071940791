// Sampling parameters (defaults, validation) and generate(): whole requests through the Engine.
#include "diffuserve/generate.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdio>

#include "diffuserve/engine.h"
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
      bad(param + "[" + std::to_string(i) + "]",
          "= " + std::to_string(ids[i]) + " is out of range [0, " + std::to_string(vocab) + ")");
}

}  // namespace

SamplingParams sampling_defaults(const ModelConfig& c) {
  const GenerationDefaults& g = c.generation;
  SamplingParams p;
  p.max_new_tokens = g.max_new_tokens;
  p.max_length = g.max_length;
  p.max_denoising_steps = g.max_denoising_steps;
  p.t_min = g.t_min;
  p.t_max = g.t_max;
  p.entropy_bound = g.entropy_bound;
  p.stability_threshold = g.stability_threshold;
  p.confidence_threshold = g.confidence_threshold;
  p.eos_token_ids = g.eos_token_ids;
  return p;
}

// The most argmax canvases a block keeps to judge its stability (stability_threshold).
constexpr int kMaxStabilityThreshold = 1024;
// The smallest temperature a step may take.
constexpr float kMinTemperature = 1e-20f;
// The largest bias a logit_bias may give (either sign): far past any logit's reach, and a
// softcapped logit so biased, divided by kMinTemperature, is still a finite float32.
constexpr float kMaxLogitBias = 1e6f;

void validate(const SamplingParams& p, const ModelConfig& c) {
  if (p.max_new_tokens < 1) bad("max_new_tokens", "must be >= 1, got " + std::to_string(p.max_new_tokens));
  if (p.max_length < 0) bad("max_length", "must be >= 0 (0: no cap), got " + std::to_string(p.max_length));
  if (p.max_denoising_steps < 1)
    bad("max_denoising_steps", "must be >= 1, got " + std::to_string(p.max_denoising_steps));
  // As transformers: t_min >= 0 and t_max > t_min, so every step's temperature is > 0.
  if (!std::isfinite(p.t_min) || p.t_min < 0) bad("t_min", "must be a finite number >= 0");
  if (!std::isfinite(p.t_max) || p.t_max <= p.t_min) bad("t_max", "must be a finite number > t_min");
  // The logits are divided by each step's temperature: below kMinTemperature they could
  // overflow to infinity, which the step would then refuse as the model's own NaN.
  if (const float coldest = schedule_temperature(p.t_min, p.t_max, 1, p.max_denoising_steps);
      coldest < kMinTemperature) {
    char text[160];
    std::snprintf(text, sizeof text,
                  "and t_min give a smallest temperature of %g (t_min + (t_max - t_min) / "
                  "max_denoising_steps), below %g",
                  coldest, kMinTemperature);
    bad("t_max", std::string(text) + ", where the scaled logits may overflow (1e-6 makes sampling greedy already)");
  }
  if (!std::isfinite(p.entropy_bound) || p.entropy_bound <= 0) bad("entropy_bound", "must be a finite number > 0");
  if (p.stability_threshold < 0) bad("stability_threshold", "must be >= 0");
  // A block compares its argmax canvas with the ones it keeps (stability_window, on the host
  // and on the device): bounded, so that one request cannot ask for gigabytes of them (and
  // fail the step of every other).
  if (stability_window(p) > kMaxStabilityThreshold)
    bad("stability_threshold",
        std::to_string(p.stability_threshold) + " with max_denoising_steps " + std::to_string(p.max_denoising_steps) +
            ": a block would keep " + std::to_string(stability_window(p)) + " canvases to compare; at most " +
            std::to_string(kMaxStabilityThreshold) + " (thresholds from max_denoising_steps - 1 on are the step limit's own stop)");
  if (!std::isfinite(p.confidence_threshold) || p.confidence_threshold <= 0)
    bad("confidence_threshold", "must be a finite number > 0");
  check_token_list(p.eos_token_ids, "eos_token_ids", c.vocab_size);
  if (const std::string why = canvas_length_problem(p.canvas_length, c); !why.empty()) bad("canvas_length", why);
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
  std::vector<int32_t> biased;  // (a map in Python: its ids are named, not their places in the list)
  for (const auto& [id, bias] : p.logit_bias) {
    if (id < 0 || id >= c.vocab_size)
      bad("logit_bias", "names token " + std::to_string(id) + ", outside the vocabulary [0, " +
                            std::to_string(c.vocab_size) + ")");
    // (Bounded, so that the biased logits, divided by the coldest temperature allowed, stay
    // within float32: a bias of 1e38 had made them infinite, a NaN entropy blamed on the model.)
    if (!(std::fabs(bias) <= kMaxLogitBias)) {
      char text[96];
      std::snprintf(text, sizeof text, " a bias of %g: a bias is a finite number within [-%g, %g]", bias,
                    kMaxLogitBias, kMaxLogitBias);
      bad("logit_bias", "gives token " + std::to_string(id) + text);
    }
    biased.push_back(id);
  }
  std::sort(biased.begin(), biased.end());
  if (const auto twice = std::adjacent_find(biased.begin(), biased.end()); twice != biased.end())
    bad("logit_bias", "names token " + std::to_string(*twice) + " twice");
}

std::vector<GenerationOutput> generate(Model& model, const std::vector<std::vector<int32_t>>& prompts,
                                       const std::vector<SamplingParams>& params, std::stop_token stop) {
  if (params.size() != 1 && params.size() != prompts.size())
    throw InvalidArgument("generate: " + std::to_string(params.size()) + " SamplingParams for " +
                          std::to_string(prompts.size()) + " prompts (give one, or one per prompt)");
  Engine engine(model.shared_from_this());
  // A stop ends the step in progress after its pass (the engine's interrupt, which any thread
  // may call); the loop then sees it between steps.
  const std::stop_callback interrupt_on_stop(stop, [&engine] { engine.interrupt(); });
  auto stop_if_asked = [&](size_t done_prompts) {
    if (stop.stop_requested())
      throw Cancelled("generate: stopped by its stop_token, " + std::to_string(done_prompts) + " of " +
                      std::to_string(prompts.size()) + " prompts done");
  };
  // The model's turn, taken here for the engine's calls that follow (each takes it again): the
  // wait for it, where another thread's call may hold it for a whole request, ends at a stop
  // too (a stop had waited out that request).
  auto turn = [&](size_t done_prompts) {
    auto held = model.state().lock(stop);
    stop_if_asked(done_prompts);
    return std::move(*held);
  };
  // Register everything first, so that a bad request fails the call before any work.
  {
    const auto held = turn(0);
    for (size_t i = 0; i < prompts.size(); ++i) {
      try {
        engine.add(i, prompts[i], params.size() == 1 ? params[0] : params[i]);
      } catch (const InvalidArgument& e) {
        throw InvalidArgument("generate: prompt " + std::to_string(i) + ": " + e.what());
      }
    }
  }
  // One request at a time, start to finish: the simplest policy that always fits in the
  // cache. Continuous batching is the Python scheduler's (python/diffuserve/scheduler.py).
  // The prompt goes in the largest chunks the cache takes, halved down to a canvas (which
  // add() checked the whole cache holds, a window's KV beside it), as the scheduler admits:
  // in one piece, a prompt longer than the sliding-window layers' pool had been refused with
  // nearly every block free.
  std::vector<GenerationOutput> outputs(prompts.size());
  const int64_t unlimited = INT64_MAX;
  for (size_t i = 0; i < prompts.size(); ++i) {
    // (Where even a canvas finds no room, the model's other sequences, or another thread's,
    // hold the rest of the cache, and the same step would fail again forever.)
    auto no_room = [&] {
      return InvalidArgument("generate: prompt " + std::to_string(i) + ": the KV cache has no room for its next " +
                             std::to_string(engine.pending_tokens(i)) +
                             " tokens while other sequences of this model hold the rest (release them, or raise "
                             "kv_cache_memory_bytes)");
    };
    const int64_t canvas = engine.canvas_length(i);
    int64_t chunk = std::max(engine.pending_tokens(i), canvas);
    {
      const auto held = turn(i);
      while (!engine.admit(i, chunk)) {
        if (chunk == canvas) throw no_room();
        chunk = std::max(canvas, chunk / 2);
      }
    }
    for (bool done = false; !done;) {
      const auto held = turn(i);
      const int64_t passes = engine.passes();
      for (auto& [id, out] : engine.step({StepPlan{i, chunk}}, INT32_MAX, unlimited)) {
        outputs[id] = std::move(out);
        done = true;
      }
      if (!done && engine.passes() == passes) {  // no pass: the chunk's KV found no room
        if (chunk == canvas) throw no_room();
        chunk = std::max(canvas, chunk / 2);
      }
    }
  }
  return outputs;
}

}  // namespace diffuserve
