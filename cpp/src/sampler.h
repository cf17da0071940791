// The host-side pieces of DiffusionGemma's sampler, one canvas at a time. The per-row
// work over the vocabulary (temperature, argmax, candidate draw, entropy) is the
// backend's `sample` op; what is here is O(canvas).
#pragma once

#include <cstdint>
#include <vector>

#include "backend.h"

namespace diffuserve {

// Linear schedule over the steps remaining: t_min + (t_max - t_min) * (remaining / max_steps),
// rounded as the reference's fp32 tensor arithmetic rounds it.
float schedule_temperature(float t_min, float t_max, int steps_remaining, int max_steps);

// Entropy-bound acceptance: positions sorted by entropy (ascending, ties by position) are
// accepted while the sum of the entropies before them is <= bound. `eligible` (empty: all)
// excludes positions from the sort. Returns one flag per position.
std::vector<uint8_t> accept_by_entropy(const std::vector<float>& entropy, float bound,
                                       const std::vector<uint8_t>& eligible);

// Stops a block when the argmax canvas equals each of the last `stability` argmax canvases
// and the mean entropy is below `confidence`.
class StableAndConfident {
 public:
  StableAndConfident(int stability, float confidence) : stability_(stability), confidence_(confidence) {}
  bool operator()(const std::vector<int32_t>& argmax_canvas, float mean_entropy);

 private:
  int stability_;
  float confidence_;
  std::vector<std::vector<int32_t>> history_;  // oldest first, at most `stability_`
};

}  // namespace diffuserve
