// Request state and batch execution for the Engine (engine.h), and the sampler step that
// advances a canvas (DESIGN.md, "The sampler").
#include "diffuserve/engine.h"

#include <algorithm>
#include <random>

#include "model.h"
#include "sampler.h"

namespace diffuserve {

struct RequestState {
  std::vector<int32_t> prompt;
  SamplingParams params;
  uint64_t seed = 0;
  int canvas = 0;                     // this request's canvas length
  std::vector<uint8_t> allowed;       // per vocab id; empty: every id
  std::vector<int32_t> allowed_ids;   // sorted, unique
  GenerationOutput out;
  bool waiting = true;
  KvTable table;

  // The block in progress.
  bool in_block = false;
  std::vector<int32_t> canvas_ids, argmax;
  std::vector<uint8_t> free_position;  // 0: pinned to its seed_canvas token
  std::unique_ptr<StableAndConfident> stop;
  Activation feedback;  // the softmax of the previous step's processed logits, for self-conditioning
  int steps = 0;

  int64_t target_length() const { return int64_t(prompt.size() + out.token_ids.size()); }
  int64_t pending() const { return target_length() - table.length(); }
  uint32_t block() const { return uint32_t(out.denoise_steps.size()); }
  // The tokens [from, from + n) of prompt + generated.
  std::vector<int32_t> target_tokens(int64_t from, int64_t n) const {
    std::vector<int32_t> t;
    for (int64_t i = from; i < from + n; ++i)
      t.push_back(i < int64_t(prompt.size()) ? prompt[i] : out.token_ids[i - prompt.size()]);
    return t;
  }
  // A uniformly random token from the allowed set.
  int32_t random_token(const RandomKey& key, uint32_t position, int vocab) const {
    const uint32_t bits = key.draw(position, 0)[0];
    return allowed_ids.empty() ? int32_t(uniform_below(bits, uint32_t(vocab)))
                               : allowed_ids[uniform_below(bits, uint32_t(allowed_ids.size()))];
  }
};

namespace {

// A new block: pinned positions hold their seed token in the first block; the rest start
// as noise (or as the seed canvas).
void start_block(RequestState& r, int vocab) {
  const SamplingParams& p = r.params;
  r.free_position.assign(r.canvas, 1);
  r.canvas_ids.resize(r.canvas);
  const RandomKey init{r.seed, r.block(), 0, RandomStream::InitialCanvas};
  for (int i = 0; i < r.canvas; ++i) r.canvas_ids[i] = r.random_token(init, uint32_t(i), vocab);
  if (r.block() == 0 && !p.seed_canvas.empty()) {
    r.canvas_ids = p.seed_canvas;
    for (int32_t pos : p.pinned_positions) r.free_position[pos] = 0;
  }
  r.argmax = r.canvas_ids;
  r.stop = std::make_unique<StableAndConfident>(p.stability_threshold, p.confidence_threshold);
  r.feedback = Activation{};
  r.steps = 0;
  r.in_block = true;
}

// One sampler step on this step's logits (processed in place); true when the block stops.
bool advance(RequestState& r, Backend& be, Activation logits, int vocab, DType weight_dtype) {
  const SamplingParams& p = r.params;
  const int remaining = p.max_denoising_steps - r.steps;
  const uint32_t step = uint32_t(r.steps++);
  const float temperature = schedule_temperature(p.t_min, p.t_max, remaining, p.max_denoising_steps);
  const std::vector<RowSample> rows =
      be.sample(logits, temperature, r.allowed, RandomKey{r.seed, r.block(), step, RandomStream::Candidate},
                weight_dtype, p.self_conditioning);

  std::vector<float> entropy(r.canvas);
  double entropy_sum = 0;
  int counted = 0;
  for (int i = 0; i < r.canvas; ++i) {
    entropy[i] = rows[i].entropy;
    if (r.free_position[i]) entropy_sum += entropy[i], ++counted;
  }
  const std::vector<uint8_t> accepted = accept_by_entropy(entropy, p.entropy_bound, r.free_position);
  const RandomKey renoise{r.seed, r.block(), step, RandomStream::Renoise};
  for (int i = 0; i < r.canvas; ++i) {
    if (!r.free_position[i]) continue;
    r.argmax[i] = rows[i].argmax;
    r.canvas_ids[i] = accepted[i] ? rows[i].candidate : r.random_token(renoise, uint32_t(i), vocab);
  }
  if (p.self_conditioning) r.feedback = logits;
  const float mean_entropy = counted ? float(entropy_sum / counted) : 0.0f;
  return (*r.stop)(r.argmax, mean_entropy) || r.steps == p.max_denoising_steps;
}

// The block's argmax canvas joins the output; true when the request is finished (EOS or
// max_new_tokens). Otherwise the block becomes pending tokens to commit.
bool finish_block(RequestState& r, int pad_token_id) {
  const SamplingParams& p = r.params;
  std::vector<int32_t>& tokens = r.out.token_ids;
  auto eos = std::find_first_of(r.argmax.begin(), r.argmax.end(), p.eos_token_ids.begin(), p.eos_token_ids.end());
  tokens.insert(tokens.end(), r.argmax.begin(), eos == r.argmax.end() ? eos : eos + 1);
  r.out.denoise_steps.push_back(r.steps);
  r.in_block = false;
  r.feedback = Activation{};
  bool finished = false;
  if (int(tokens.size()) >= p.max_new_tokens) {  // max_new_tokens cuts the last block
    const bool eos_kept = eos != r.argmax.end() && int(tokens.size()) <= p.max_new_tokens;
    tokens.resize(std::min<size_t>(tokens.size(), size_t(p.max_new_tokens)));
    r.out.finish_reason = eos_kept ? "stop" : "length";
    finished = true;
  } else if (eos != r.argmax.end()) {
    r.out.finish_reason = "stop";
    finished = true;
  }
  if (finished) {
    // As transformers counts it: generated tokens other than the pad id, per decoder pass.
    const auto valid = std::count_if(tokens.begin(), tokens.end(), [&](int32_t t) { return t != pad_token_id; });
    int passes = 0;
    for (int s : r.out.denoise_steps) passes += s;
    r.out.tokens_per_forward = double(valid) / passes;
    r.out.seed = r.seed;
  }
  return finished;
}

}  // namespace

Engine::Engine(std::shared_ptr<Model> model, bool fuse_commit) : model_(std::move(model)), fuse_commit_(fuse_commit) {}

Engine::~Engine() {
  for (auto& [id, r] : requests_) model_->state().kv->release(r->table);
}

RequestState& Engine::get(uint64_t id) const {
  auto it = requests_.find(id);
  if (it == requests_.end()) throw InvalidArgument("no request with id " + std::to_string(id));
  return *it->second;
}

void Engine::add(uint64_t id, std::vector<int32_t> prompt, const SamplingParams& params) {
  const ModelConfig& c = model_->config();
  if (requests_.count(id)) throw InvalidArgument("a request with id " + std::to_string(id) + " already exists");
  if (prompt.empty()) throw InvalidArgument("the prompt is empty");
  check_token_ids(prompt, c, "prompt");
  validate(params, c);
  auto r = std::make_unique<RequestState>();
  r->canvas = params.canvas_length ? params.canvas_length : c.canvas_length;
  // Every block is denoised at full canvas width, so the last one may reach past max_new_tokens.
  const int64_t blocks = (int64_t(params.max_new_tokens) + r->canvas - 1) / r->canvas;
  const int64_t total = int64_t(prompt.size()) + blocks * r->canvas;
  if (total > c.max_position_embeddings)
    throw InvalidArgument("the prompt (" + std::to_string(prompt.size()) + " tokens) plus max_new_tokens " +
                          std::to_string(params.max_new_tokens) + " in blocks of " + std::to_string(r->canvas) +
                          " exceeds max_position_embeddings (" + std::to_string(c.max_position_embeddings) + ")");
  if (!model_->state().kv->could_hold(total, r->canvas))
    throw InvalidArgument("the request needs KV for " + std::to_string(total) +
                          " tokens, more than the whole cache holds (raise kv_cache_memory_bytes)");
  r->prompt = std::move(prompt);
  r->params = params;
  if (params.seed) {
    r->seed = *params.seed;
  } else {
    std::random_device entropy;
    r->seed = uint64_t(entropy()) << 32 | entropy();
  }
  r->allowed_ids = params.allowed_token_ids;
  if (!r->allowed_ids.empty()) {
    r->allowed.assign(c.vocab_size, 0);
    for (int32_t t : r->allowed_ids) r->allowed[t] = 1;
    std::sort(r->allowed_ids.begin(), r->allowed_ids.end());
    r->allowed_ids.erase(std::unique(r->allowed_ids.begin(), r->allowed_ids.end()), r->allowed_ids.end());
  }
  requests_[id] = std::move(r);
}

bool Engine::admit(uint64_t id, int64_t encode_tokens) {
  RequestState& r = get(id);
  if (!r.waiting) throw InvalidArgument("request " + std::to_string(id) + " is already running");
  KvCache& kv = *model_->state().kv;
  const std::vector<int32_t> target = r.target_tokens(0, r.target_length());
  const int64_t hit = kv.match_prefix(r.table, target);
  if (!kv.reserve(r.table, std::min(encode_tokens, r.pending()))) {
    kv.release(r.table);
    return false;
  }
  kv.record_prefix_query(int64_t(r.prompt.size()), std::min<int64_t>(hit, int64_t(r.prompt.size())));
  r.waiting = false;
  return true;
}

bool Engine::reserve(uint64_t id, int64_t encode_tokens) {
  RequestState& r = get(id);
  if (r.waiting) throw InvalidArgument("request " + std::to_string(id) + " is not admitted");
  return model_->state().kv->reserve(r.table, std::min(encode_tokens, r.pending()));
}

void Engine::preempt(uint64_t id) {
  RequestState& r = get(id);
  model_->state().kv->release(r.table);
  r.waiting = true;
  r.in_block = false;
  r.feedback = Activation{};
}

void Engine::abort(uint64_t id) {
  RequestState& r = get(id);
  model_->state().kv->release(r.table);
  requests_.erase(id);
}

int64_t Engine::pending_tokens(uint64_t id) const { return get(id).pending(); }
int Engine::canvas_length(uint64_t id) const { return get(id).canvas; }
std::vector<int32_t> Engine::generated(uint64_t id) const { return get(id).out.token_ids; }
std::vector<int32_t> Engine::draft(uint64_t id) const {
  const RequestState& r = get(id);
  return r.in_block && r.steps ? r.argmax : std::vector<int32_t>{};
}

std::vector<std::pair<uint64_t, GenerationOutput>> Engine::step(const std::vector<StepPlan>& plan, int max_steps,
                                                                int64_t max_batched_tokens) {
  ModelState& m = model_->state();
  const ModelConfig& c = m.config;
  std::vector<std::pair<uint64_t, RequestState*>> active;
  std::map<uint64_t, int64_t> allowance;
  for (const StepPlan& p : plan) {
    RequestState& r = get(p.id);
    if (r.waiting) throw InvalidArgument("request " + std::to_string(p.id) + " is not admitted");
    active.push_back({p.id, &r});
    allowance[p.id] = p.max_encode_tokens;
  }

  std::vector<std::pair<uint64_t, GenerationOutput>> finished;
  for (int pass = 0; pass < max_steps && !active.empty(); ++pass) {
    std::vector<Segment> segments;
    std::vector<RequestState*> denoisers;
    segments.reserve(2 * active.size());
    int64_t rows = 0;
    for (auto& [id, r] : active) {
      const int64_t pending = r->pending();
      // Prompt chunks go only into the first pass, as planned; later passes commit blocks.
      const bool prompt_left = r->table.length() < int64_t(r->prompt.size());
      const int64_t encode = pass == 0 ? std::min(pending, allowance[id]) : (prompt_left ? 0 : pending);
      if (encode > 0) {
        if (rows + encode > max_batched_tokens || !m.kv->reserve(r->table, encode)) continue;
        const int64_t from = r->table.length();
        segments.push_back(Segment{&r->table, true, r->target_tokens(from, encode), nullptr});
        rows += encode;
      }
      if (encode < pending || (encode > 0 && !fuse_commit_) || rows + r->canvas > max_batched_tokens) continue;
      if (!r->in_block) start_block(*r, c.vocab_size);
      segments.push_back(Segment{&r->table, false, r->canvas_ids, r->feedback.data ? &r->feedback : nullptr, true});
      denoisers.push_back(r);
      rows += r->canvas;
    }
    if (segments.empty()) break;
    Activation logits = forward(m, *m.kv, segments);
    ++passes_;

    int64_t row = 0;
    for (RequestState* r : denoisers) {
      const bool block_done = advance(*r, *m.backend, logits.view(row, r->canvas), c.vocab_size, m.weight_dtype);
      row += r->canvas;
      if (block_done && finish_block(*r, c.pad_token_id)) {
        auto it = std::find_if(active.begin(), active.end(), [&](const auto& a) { return a.second == r; });
        const uint64_t id = it->first;
        active.erase(it);
        m.kv->release(r->table);
        finished.push_back({id, std::move(r->out)});
        requests_.erase(id);
      }
    }
    // A request whose prompt is still incomplete waits for its next planned chunk.
    std::erase_if(active, [](const auto& a) { return a.second->table.length() < int64_t(a.second->prompt.size()); });
  }
  return finished;
}

}  // namespace diffuserve
