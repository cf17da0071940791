// DiffusionGemma's sampler (DESIGN.md, "The sampler") on one canvas. The per-row work over
// the vocabulary (temperature, argmax, candidate draw, entropy) is the backend's `sample`
// op; what is here is O(canvas): the schedule, the acceptance, the renoising and the stop
// rule, and the block's state that they update (CanvasState, in backend memory, so that
// a block's steps need nothing from the host in between). The host functions are the
// reference that a backend's own denoise_step (the CUDA one's kernels) matches bit for bit.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "backend.h"
#include "diffuserve/generate.h"

namespace diffuserve {

// Linear schedule over the steps remaining: t_min + (t_max - t_min) * (remaining / max_steps),
// rounded as the reference's fp32 tensor arithmetic rounds it: the Python-float difference
// to fp32, the rest fp32 operations one at a time (no fused multiply-add on the device).
DS_HOST_DEVICE inline float schedule_temperature(float t_min, float t_max, int steps_remaining, int max_steps) {
  const float span = float(double(t_max) - double(t_min));
#ifdef __CUDA_ARCH__
  return __fadd_rn(t_min, __fmul_rn(span, __fdiv_rn(float(steps_remaining), float(max_steps))));
#else
  const float fraction = float(steps_remaining) / float(max_steps);
  return t_min + span * fraction;
#endif
}

// A uniformly random token (a renoised position, an initial canvas) from the allowed ids
// (sorted; none: the whole vocabulary).
DS_HOST_DEVICE inline int32_t random_allowed_token(const RandomKey& key, uint32_t position, int vocab,
                                                   const int32_t* allowed_ids, int allowed_count) {
  const uint32_t bits = key.draw(position, 0)[0];
  return allowed_count ? allowed_ids[uniform_below(bits, uint32_t(allowed_count))]
                       : int32_t(uniform_below(bits, uint32_t(vocab)));
}

// Entropy-bound acceptance: positions sorted by entropy (ascending, ties by position) are
// accepted while the sum of the entropies before them is <= bound. `eligible` (empty: all)
// excludes positions from the sort. Returns one flag per position.
std::vector<uint8_t> accept_by_entropy(const std::vector<float>& entropy, float bound,
                                       const std::vector<uint8_t>& eligible);

// The stop rule's stability half on a ring of the last `stability` argmax canvases (slot
// s % stability holds step s's; `step` steps came before this one): whether this step's
// argmax canvas equals each of them, none missing. Records this step's canvas in the ring.
// Stability 0 is always stable.
bool stable_argmax(int32_t* history, int step, const int32_t* argmax, int canvas, int stability);

// A block's parameters: its request's sampling parameters, where it is (seed, block), the
// model's vocabulary and final softcap, the dtype the feedback is rounded to, and how many
// ids are allowed (0: every id). The block has a bias per id where ids are allowed or the
// request gives a logit_bias.
// The argmax canvases a block keeps (its ring) to judge whether its canvas is stable. A block
// runs max_denoising_steps steps at most, and its canvas is stable only once `stability`
// steps came before: a threshold of max_denoising_steps - 1 can hold at the last step alone,
// which stops the block anyway, and any larger one never holds. So every threshold from
// max_denoising_steps - 1 on stops a block as that one does, with no more slots in the ring
// (a threshold of 2^31 had asked for that many; 1,025 at 1,025 steps had been refused).
inline int stability_window(const SamplingParams& p) {
  return std::min(p.stability_threshold, p.max_denoising_steps - 1);
}

CanvasParams canvas_params(const SamplingParams& p, int canvas, int vocab, float softcap, uint64_t seed,
                           uint32_t block, DType feedback_dtype, int allowed_count);

// The bias the sampler adds to each id's logit (Backend::sample's `bias`): -inf for an id
// outside allowed_ids (when not empty), else its logit_bias (0 for an id it does not name).
// Empty where neither is given: no bias at all.
std::vector<float> vocab_bias(int vocab, const std::vector<int32_t>& allowed_ids,
                              const std::vector<std::pair<int32_t, float>>& logit_bias);

// A new block's state: its first step's input ids, which positions are free, and the bias
// (vocab_bias's; empty: none).
CanvasState new_canvas(Backend& be, const CanvasParams& params, const std::vector<int32_t>& tokens,
                       const std::vector<uint8_t>& free_position, const std::vector<int32_t>& allowed_ids,
                       const std::vector<float>& bias);

// What the host reads of a block between engine steps (one wait for the device).
struct CanvasReadout {
  std::vector<int32_t> argmax;
  int steps = 0;
  bool stopped = false;
  bool non_finite = false;  // a step's logits held NaN or infinity (kCanvasNonFinite)
};
CanvasReadout read_canvas(Backend& be, const CanvasState& canvas);
// Whether the block stopped (one counter read).
bool canvas_stopped(Backend& be, const CanvasState& canvas);

// The host side of a denoise step (Backend::denoise_step's default), on host copies of a
// block's state: given the step's rows (sample's output at the scheduled temperature),
// accept by entropy, renoise the rest, update the argmax and its history, decide the stop
// and count the step.
struct CanvasHost {
  std::vector<int32_t> tokens, argmax, history, counters, allowed_ids;
  std::vector<uint8_t> free_position;
};
void update_canvas(const CanvasParams& p, const std::vector<RowSample>& rows, CanvasHost& s);

}  // namespace diffuserve
