#include "sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace diffuserve {

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

bool stable_argmax(int32_t* history, int step, const int32_t* argmax, int canvas, int stability) {
  if (stability <= 0) return true;
  // The ring holds min(step, stability) canvases; a ring not yet full has "no canvas"
  // entries, which match nothing.
  bool stable = step >= stability;
  for (int h = 0; h < stability && stable; ++h)
    stable = std::equal(argmax, argmax + canvas, history + int64_t(h) * canvas);
  std::copy(argmax, argmax + canvas, history + int64_t(step % stability) * canvas);
  return stable;
}

namespace {

// Where each part of a block's state lies in its one allocation: the int32 arrays, the bias,
// then the byte flags.
struct CanvasLayout {
  size_t tokens, argmax, history, counters, allowed_ids, bias, free_position, bytes;

  explicit CanvasLayout(const CanvasParams& p) {
    const size_t c = size_t(p.canvas), i32 = sizeof(int32_t);
    tokens = 0;
    argmax = tokens + c * i32;
    history = argmax + c * i32;
    counters = history + size_t(p.stability) * c * i32;
    allowed_ids = counters + kCanvasCounters * i32;
    bias = allowed_ids + size_t(p.allowed_count) * i32;
    free_position = bias + (p.biased ? size_t(p.vocab) * sizeof(float) : 0);
    bytes = free_position + c;
  }
};

}  // namespace

CanvasParams canvas_params(const SamplingParams& p, int canvas, int vocab, float softcap, uint64_t seed,
                           uint32_t block, DType feedback_dtype, int allowed_count) {
  CanvasParams c;
  c.canvas = canvas;
  c.vocab = vocab;
  c.softcap = softcap;
  c.t_min = p.t_min;
  c.t_max = p.t_max;
  c.max_steps = p.max_denoising_steps;
  c.entropy_bound = p.entropy_bound;
  c.stability = stability_window(p);
  c.confidence = p.confidence_threshold;
  c.seed = seed;
  c.block = block;
  c.self_conditioning = p.self_conditioning;
  c.feedback_dtype = feedback_dtype;
  c.allowed_count = allowed_count;
  c.biased = allowed_count > 0 || !p.logit_bias.empty();
  return c;
}

std::vector<float> vocab_bias(int vocab, const std::vector<int32_t>& allowed_ids,
                              const std::vector<std::pair<int32_t, float>>& logit_bias) {
  if (allowed_ids.empty() && logit_bias.empty()) return {};
  auto check = [vocab](int32_t id, const char* what) {
    if (id < 0 || id >= vocab)
      throw InvalidArgument(std::string(what) + " " + std::to_string(id) + " is out of range [0, " +
                            std::to_string(vocab - 1) + "]");
  };
  std::vector<float> bias(vocab, allowed_ids.empty() ? 0.0f : -INFINITY);
  for (int32_t id : allowed_ids) {
    check(id, "allowed id");
    bias[id] = 0.0f;
  }
  for (const auto& [id, value] : logit_bias) {
    check(id, "logit_bias id");
    bias[id] += value;  // (an id not allowed stays -inf)
  }
  return bias;
}

CanvasState new_canvas(Backend& be, const CanvasParams& params, const std::vector<int32_t>& tokens,
                       const std::vector<uint8_t>& free_position, const std::vector<int32_t>& allowed_ids,
                       const std::vector<float>& bias) {
  if (bias.size() != (params.biased ? size_t(params.vocab) : 0))
    throw InvalidArgument("new_canvas: a bias of " + std::to_string(bias.size()) + " values for a block " +
                          (params.biased ? "with a bias per id of " + std::to_string(params.vocab) : "without one"));
  const CanvasLayout at(params);
  std::vector<uint8_t> host(at.bytes, 0);  // history and counters start at zero
  auto put = [&](size_t offset, const void* src, size_t bytes) { copy_bytes(host.data() + offset, src, bytes); };
  put(at.tokens, tokens.data(), tokens.size() * sizeof(int32_t));
  put(at.argmax, tokens.data(), tokens.size() * sizeof(int32_t));
  put(at.allowed_ids, allowed_ids.data(), allowed_ids.size() * sizeof(int32_t));
  put(at.bias, bias.data(), bias.size() * sizeof(float));
  put(at.free_position, free_position.data(), free_position.size());

  CanvasState s;
  s.params = params;
  s.storage = be.alloc_bytes(at.bytes);
  be.write_bytes(s.storage.get(), host.data(), host.size());
  auto* base = static_cast<uint8_t*>(s.storage.get());
  s.tokens = reinterpret_cast<int32_t*>(base + at.tokens);
  s.argmax = reinterpret_cast<int32_t*>(base + at.argmax);
  s.history = reinterpret_cast<int32_t*>(base + at.history);
  s.counters = reinterpret_cast<int32_t*>(base + at.counters);
  s.allowed_ids = reinterpret_cast<int32_t*>(base + at.allowed_ids);
  s.bias = params.biased ? reinterpret_cast<float*>(base + at.bias) : nullptr;
  s.free_position = base + at.free_position;
  return s;
}

CanvasReadout read_canvas(Backend& be, const CanvasState& s) {
  CanvasReadout r;
  r.argmax.resize(s.params.canvas);
  int32_t counters[kCanvasCounters];
  be.read_bytes(counters, s.counters, sizeof(counters));
  be.read_bytes(r.argmax.data(), s.argmax, r.argmax.size() * sizeof(int32_t));
  r.steps = counters[kCanvasSteps];
  r.stopped = counters[kCanvasStopped] != 0;
  r.non_finite = counters[kCanvasNonFinite] != 0;
  return r;
}

bool canvas_stopped(Backend& be, const CanvasState& s) {
  int32_t stopped = 0;
  be.read_bytes(&stopped, s.counters + kCanvasStopped, sizeof(stopped));
  return stopped != 0;
}

void update_canvas(const CanvasParams& p, const std::vector<RowSample>& rows, CanvasHost& s) {
  // A stopped canvas takes no more steps. Only one stopped by logits that were not finite can
  // meet another: the host reads the stop flag once the stop rule could fire, so a first step's
  // NaN it finds a step later, and the step count must still name the step that failed.
  if (s.counters[kCanvasStopped]) return;
  const int step = s.counters[kCanvasSteps];
  std::vector<float> entropy(p.canvas);
  double entropy_sum = 0;
  int counted = 0;
  bool non_finite = false;
  for (int i = 0; i < p.canvas; ++i) {
    entropy[i] = rows[i].entropy;
    if (s.free_position[i]) entropy_sum += entropy[i], ++counted;
    // Every row's: a pinned row's NaN logits (an infilling canvas whose given tokens route to a
    // broken expert) had let the request finish as if its pass were finite.
    non_finite |= std::isnan(entropy[i]);
  }
  const std::vector<uint8_t> accepted = accept_by_entropy(entropy, p.entropy_bound, s.free_position);
  const RandomKey renoise{p.seed, p.block, uint32_t(step), RandomStream::Renoise};
  for (int i = 0; i < p.canvas; ++i) {
    if (!s.free_position[i]) continue;
    s.argmax[i] = rows[i].argmax;
    s.tokens[i] = accepted[i] ? rows[i].candidate
                              : random_allowed_token(renoise, uint32_t(i), p.vocab, s.allowed_ids.data(), p.allowed_count);
  }
  const float mean_entropy = counted ? float(entropy_sum / counted) : 0.0f;
  const bool stable = stable_argmax(s.history.data(), step, s.argmax.data(), p.canvas, p.stability);
  s.counters[kCanvasSteps] = step + 1;
  s.counters[kCanvasStopped] = (stable && mean_entropy < p.confidence) || step + 1 == p.max_steps || non_finite;
  s.counters[kCanvasNonFinite] |= non_finite;
}

void Backend::denoise_step(Activation& logits, CanvasState& canvas) {
  const CanvasParams& p = canvas.params;
  const CanvasLayout at(p);
  CanvasHost s;
  auto read = [&](auto& v, const void* src, size_t n) {
    v.resize(n);
    read_bytes(v.data(), src, n * sizeof(v[0]));
  };
  read(s.tokens, canvas.tokens, p.canvas);
  read(s.argmax, canvas.argmax, p.canvas);
  read(s.history, canvas.history, size_t(p.stability) * p.canvas);
  read(s.counters, canvas.counters, kCanvasCounters);
  read(s.allowed_ids, canvas.allowed_ids, p.allowed_count);
  read(s.free_position, canvas.free_position, p.canvas);

  const int step = s.counters[kCanvasSteps];
  const float temperature = schedule_temperature(p.t_min, p.t_max, p.max_steps - step, p.max_steps);
  const std::vector<RowSample> rows = sample(logits, p.softcap, temperature, canvas.bias,
                                             RandomKey{p.seed, p.block, uint32_t(step), RandomStream::Candidate},
                                             p.feedback_dtype, p.self_conditioning);
  update_canvas(p, rows, s);
  // Back in one write: tokens, argmax, history and counters lie one after the other.
  std::vector<int32_t> back = s.tokens;
  back.insert(back.end(), s.argmax.begin(), s.argmax.end());
  back.insert(back.end(), s.history.begin(), s.history.end());
  back.insert(back.end(), s.counters.begin(), s.counters.end());
  static_assert(sizeof(int32_t) == 4);
  write_bytes(canvas.tokens, back.data(), at.allowed_ids - at.tokens);
}

int Backend::repeat(const std::function<void()>& body, const std::vector<const CanvasState*>& canvases, int max_times,
                    const std::atomic<bool>& interrupted) {
  for (int runs = 1;; ++runs) {
    body();
    if (runs >= max_times || interrupted) return runs;
    for (const CanvasState* c : canvases)
      if (canvas_stopped(*this, *c)) return runs;
  }
}

}  // namespace diffuserve
