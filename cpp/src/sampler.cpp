#include "sampler.h"

#include <algorithm>
#include <numeric>

namespace diffuserve {

float schedule_temperature(float t_min, float t_max, int steps_remaining, int max_steps) {
  // transformers: t_min + (t_max - t_min) * (cur_step / max_steps) with cur_step an int32
  // tensor: the Python-float difference is rounded to fp32, the rest is fp32 arithmetic.
  const float span = float(double(t_max) - double(t_min));
  const float fraction = float(steps_remaining) / float(max_steps);
  return t_min + span * fraction;
}

std::vector<uint8_t> accept_by_entropy(const std::vector<float>& entropy, float bound,
                                       const std::vector<uint8_t>& eligible) {
  std::vector<int32_t> order;
  for (int32_t i = 0; i < int32_t(entropy.size()); ++i)
    if (eligible.empty() || eligible[i]) order.push_back(i);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return entropy[a] < entropy[b]; });
  // The reference computes cumsum(sorted) - sorted <= bound with a double accumulator
  // rounded to fp32 per element (torch's CPU cumsum), then an fp32 subtraction.
  std::vector<uint8_t> accepted(entropy.size(), 0);
  double running = 0;
  for (int32_t i : order) {
    running += entropy[i];
    accepted[i] = (float(running) - entropy[i]) <= bound;
  }
  return accepted;
}

bool StableAndConfident::operator()(const std::vector<int32_t>& argmax_canvas, float mean_entropy) {
  bool stable = true;
  if (stability_ > 0) {
    // A history that is not yet full holds "no canvas" entries, which match nothing.
    stable = int(history_.size()) == stability_ &&
             std::all_of(history_.begin(), history_.end(), [&](const auto& h) { return h == argmax_canvas; });
    history_.push_back(argmax_canvas);
    if (int(history_.size()) > stability_) history_.erase(history_.begin());
  }
  return stable && mean_entropy < confidence_;
}

}  // namespace diffuserve
