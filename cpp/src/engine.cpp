// Request state and batch execution for the Engine (engine.h), and the sampler step that
// advances a canvas (DESIGN.md, "The sampler").
#include "diffuserve/engine.h"

#include <algorithm>
#include <optional>
#include <random>
#include <string>
#include <utility>

#include "model.h"
#include "sampler.h"

namespace diffuserve {

struct RequestState {
  std::vector<int32_t> prompt;
  SamplingParams params;
  int canvas = 0;                     // this request's canvas length
  int64_t blocks = 0;                 // the most blocks it generates (max_new_tokens, max_length)
  std::vector<int32_t> allowed_ids;   // sorted, unique; empty: every id
  GenerationOutput out;               // out.seed: the seed used, from the start
  bool waiting = true;
  KvTable table;

  // The block in progress: its sampler state in backend memory, and the softmax of its
  // last step's processed logits (the next step's self-conditioning input).
  std::optional<CanvasState> block_state;
  Activation feedback;
  int steps = 0;  // denoise steps run (counted on the host as well, so it need not read them)
  bool prefix_queried = false;  // its prompt counted in the prefix cache's queries (once, not again after a preemption)

  int64_t target_length() const { return int64_t(prompt.size() + out.token_ids.size()); }
  int64_t pending() const { return target_length() - table.length(); }
  uint32_t block() const { return uint32_t(out.denoise_steps.size()); }
  bool in_block() const { return block_state.has_value(); }
  // The tokens [from, from + n) of prompt + generated.
  std::vector<int32_t> target_tokens(int64_t from, int64_t n) const {
    std::vector<int32_t> t;
    for (int64_t i = from; i < from + n; ++i)
      t.push_back(i < int64_t(prompt.size()) ? prompt[i] : out.token_ids[i - prompt.size()]);
    return t;
  }
  void end_block() {
    block_state.reset();
    feedback = Activation{};
    steps = 0;
  }
};

namespace {

// A new block: pinned positions hold their seed token in the first block; the rest start
// as noise (or as the seed canvas).
void start_block(RequestState& r, Backend& be, const ModelConfig& config, DType weight_dtype) {
  const int vocab = config.vocab_size;
  const SamplingParams& p = r.params;
  std::vector<uint8_t> free_position(r.canvas, 1);
  std::vector<int32_t> tokens(r.canvas);
  const RandomKey init{r.out.seed, r.block(), 0, RandomStream::InitialCanvas};
  for (int i = 0; i < r.canvas; ++i)
    tokens[i] = random_allowed_token(init, uint32_t(i), vocab, r.allowed_ids.data(), int(r.allowed_ids.size()));
  if (r.block() == 0 && !p.seed_canvas.empty()) {
    tokens = p.seed_canvas;
    for (int32_t pos : p.pinned_positions) free_position[pos] = 0;
  }
  const CanvasParams c = canvas_params(p, r.canvas, vocab, config.final_logit_softcapping, r.out.seed, r.block(),
                                       weight_dtype, int(r.allowed_ids.size()));
  // (The bias, a value per id, is made for each block, not kept: a waiting request holds only its lists.)
  r.block_state =
      new_canvas(be, c, tokens, free_position, r.allowed_ids, vocab_bias(vocab, r.allowed_ids, p.logit_bias));
  r.feedback = Activation{};
  r.steps = 0;
}

// The block's argmax canvas joins the output; true when the request is finished (EOS or
// its last block, or an error: logits that held NaN or infinity, which no token can come
// from). Otherwise the block becomes pending tokens to commit.
bool finish_block(RequestState& r, Backend& be, std::optional<int32_t> pad_token_id) {
  const SamplingParams& p = r.params;
  const CanvasReadout block = read_canvas(be, *r.block_state);
  if (block.non_finite) {
    r.out.finish_reason = "error";
    r.out.error = "the model's logits held NaN or infinity at denoise step " + std::to_string(block.steps) +
                  " of block " + std::to_string(r.block()) + ": " + kNotFiniteCause;
    r.end_block();
    return true;
  }
  const std::vector<int32_t>& argmax = block.argmax;
  std::vector<int32_t>& tokens = r.out.token_ids;
  auto eos = std::find_first_of(argmax.begin(), argmax.end(), p.eos_token_ids.begin(), p.eos_token_ids.end());
  tokens.insert(tokens.end(), argmax.begin(), eos == argmax.end() ? eos : eos + 1);
  r.out.denoise_steps.push_back(block.steps);
  r.end_block();
  if (eos == argmax.end() && r.block() < r.blocks) return false;
  // As transformers counts it: generated tokens other than the pad id, per decoder pass. It
  // generates whole blocks and counts the last one's tokens past max_new_tokens too: counted
  // before the cut. With a pad id it pads the last block past its EOS (uncounted); without one
  // it keeps the block as generated, every token counted.
  const int64_t valid =
      !pad_token_id ? int64_t(r.out.denoise_steps.size()) * int64_t(argmax.size())
                    : std::count_if(tokens.begin(), tokens.end(), [&](int32_t t) { return t != *pad_token_id; });
  int passes = 0;
  for (int s : r.out.denoise_steps) passes += s;
  r.out.tokens_per_forward = double(valid) / passes;
  const bool eos_kept = eos != argmax.end() && int(tokens.size()) <= p.max_new_tokens;
  r.out.finish_reason = eos_kept ? "stop" : "length";
  tokens.resize(std::min<size_t>(tokens.size(), size_t(p.max_new_tokens)));  // max_new_tokens cuts the last block
  return true;
}

// transformers' default max_new_tokens, which a max_length overrides (_prepare_generated_length).
constexpr int kTransformersMaxNewTokens = 256;

struct GenerationLength {
  int64_t blocks;     // the most blocks the request generates
  std::string limit;  // what sets them, for messages: "max_new_tokens 300" or "max_length 4096"
};

// transformers' rule: a max_length with max_new_tokens at its default sets max_new_tokens to
// what the prompt leaves (refused where it leaves none, as its autoregressive generate refuses
// it: DiffusionGemma's returns no tokens and a tokens_per_forward of NaN); any other
// max_new_tokens stands, and max_length's MaxLengthCriteria ends the request after the first
// block that reaches it (however short). Sets p.max_new_tokens, which cuts the last block.
GenerationLength generation_length(SamplingParams& p, int64_t prompt, int canvas) {
  const auto blocks_for = [canvas](int64_t tokens) { return (tokens + canvas - 1) / canvas; };
  const std::string by_max_length = "max_length " + std::to_string(p.max_length);
  if (p.max_length && p.max_new_tokens == kTransformersMaxNewTokens) {
    if (p.max_length <= prompt)
      throw InvalidArgument(by_max_length + ": the prompt (" + std::to_string(prompt) +
                            " tokens) leaves no room for new tokens within it (max_length caps the prompt plus its "
                            "new tokens)");
    p.max_new_tokens = int(p.max_length - prompt);
    return {blocks_for(p.max_new_tokens), by_max_length};
  }
  const int64_t blocks = blocks_for(p.max_new_tokens);
  if (p.max_length && blocks_for(p.max_length - prompt) < blocks)
    return {std::max<int64_t>(1, blocks_for(p.max_length - prompt)), by_max_length};
  return {blocks, "max_new_tokens " + std::to_string(p.max_new_tokens)};
}

// What a message about the whole cache's size advises.
constexpr const char* kRaiseKv = " (raise kv_cache_memory_bytes; the CLI's --kv-cache-gib)";

// The most blocks of `canvas` tokens after a prompt of `prompt` tokens that the positions and
// the whole KV cache admit (0: none).
int64_t blocks_that_fit(const ModelConfig& c, const KvCache& kv, int64_t prompt, int canvas) {
  return std::max<int64_t>(0, (kv.longest_sequence(c.max_model_len, canvas) - prompt) / canvas);
}

}  // namespace

Engine::Engine(std::shared_ptr<Model> model, bool fuse_commit) : model_(std::move(model)), fuse_commit_(fuse_commit) {
  if (!model_) throw InvalidArgument("Engine: the model is null");
}

Engine::~Engine() {
  for (auto& [id, r] : requests_) model_->state().release_soon(std::move(r->table));
}

RequestState& Engine::get(uint64_t id) const {
  auto it = requests_.find(id);
  if (it == requests_.end()) throw InvalidArgument("no request with id " + std::to_string(id));
  return *it->second;
}

void Engine::add(uint64_t id, std::vector<int32_t> prompt, const SamplingParams& params) {
  const auto lock = model_->state().lock();
  const ModelConfig& c = model_->config();
  const bool finished = std::any_of(finished_.begin(), finished_.end(), [&](const auto& f) { return f.first == id; });
  if (requests_.count(id) || finished)
    throw InvalidArgument("a request with id " + std::to_string(id) + " already exists");
  if (prompt.empty()) throw InvalidArgument("the prompt is empty");
  check_token_ids(prompt, c, "prompt");
  validate(params, c);
  auto r = std::make_unique<RequestState>();
  r->params = params;
  r->canvas = params.canvas_length ? params.canvas_length : c.canvas_length;
  GenerationLength length = generation_length(r->params, int64_t(prompt.size()), r->canvas);
  const KvCache& kv = *model_->state().kv;
  if (params.fit_to_context) {
    const int64_t fit = blocks_that_fit(c, kv, int64_t(prompt.size()), r->canvas);
    if (fit >= 1 && fit < length.blocks) {
      length.blocks = fit;
      r->params.max_new_tokens = int(fit * r->canvas);
    }
  }
  r->blocks = length.blocks;
  // Every block is denoised at full canvas width, so the last one may reach past max_new_tokens.
  const int64_t total = int64_t(prompt.size()) + length.blocks * r->canvas;
  // The prompt is at fault where it leaves no room for one block, in positions or in the whole
  // KV cache, whatever the length limit (which fit_to_context leaves at its most where not
  // even one block fits); else the length limit is (a short prompt with many new tokens had
  // been blamed on the prompt).
  if (int64_t(prompt.size()) + r->canvas > c.max_model_len)
    throw InvalidArgument("prompt: " + std::to_string(prompt.size()) + " tokens leave no room for a block of " +
                          std::to_string(r->canvas) + " new tokens within " + c.max_model_len_name() + " (" +
                          std::to_string(c.max_model_len) + ")");
  // The KV cache's refusals name the longest sequence it holds (max_model_len, where the
  // request's canvas is the model's), as the positions' refusals name theirs.
  auto longest = [&] {
    return ", whose longest sequence is " +
           std::to_string(kv.longest_sequence(c.max_model_len, r->canvas)) + " tokens";
  };
  if (!kv.could_hold(int64_t(prompt.size()) + r->canvas, r->canvas))
    throw InvalidArgument("prompt: " + std::to_string(prompt.size()) + " tokens and a block of " +
                          std::to_string(r->canvas) + " new tokens need more KV than the whole cache holds" +
                          longest() + kRaiseKv);
  if (total > c.max_model_len)
    throw InvalidArgument(length.limit + ": the prompt (" + std::to_string(prompt.size()) + " tokens) plus " +
                          std::to_string(length.blocks) + " blocks of " + std::to_string(r->canvas) +
                          " new tokens exceeds " + c.max_model_len_name() + " (" + std::to_string(c.max_model_len) +
                          ")");
  if (!kv.could_hold(total, r->canvas))
    throw InvalidArgument(length.limit + ": the prompt (" + std::to_string(prompt.size()) + " tokens) plus " +
                          std::to_string(length.blocks) + " blocks of " + std::to_string(r->canvas) +
                          " new tokens need KV for " + std::to_string(total) +
                          " tokens, more than the whole cache holds" + longest() + kRaiseKv);
  r->prompt = std::move(prompt);
  if (params.seed) {
    r->out.seed = *params.seed;
  } else {
    std::random_device entropy;
    r->out.seed = uint64_t(entropy()) << 32 | entropy();
  }
  r->allowed_ids = params.allowed_token_ids;
  std::sort(r->allowed_ids.begin(), r->allowed_ids.end());
  r->allowed_ids.erase(std::unique(r->allowed_ids.begin(), r->allowed_ids.end()), r->allowed_ids.end());
  requests_[id] = std::move(r);
}

namespace {

void check_encode_tokens(const char* what, int64_t encode_tokens) {
  if (encode_tokens < 0)
    throw InvalidArgument(std::string(what) + ": encode_tokens must be >= 0, got " + std::to_string(encode_tokens));
}

}  // namespace

bool Engine::admit(uint64_t id, int64_t encode_tokens) {
  const auto lock = model_->state().lock();
  check_encode_tokens("admit", encode_tokens);
  RequestState& r = get(id);
  if (!r.waiting) throw InvalidArgument("request " + std::to_string(id) + " is already running");
  KvCache& kv = *model_->state().kv;
  const std::vector<int32_t> target = r.target_tokens(0, r.target_length());
  const int64_t hit = kv.match_prefix(r.table, target);
  if (!kv.reserve(r.table, std::min(encode_tokens, r.pending()))) {
    kv.release(r.table);
    return false;
  }
  // A preempted request found its own blocks again: counted, they had made hits of the
  // prompts' lookups that no other prompt shared.
  if (!r.prefix_queried)
    kv.record_prefix_query(int64_t(r.prompt.size()), std::min<int64_t>(hit, int64_t(r.prompt.size())));
  r.prefix_queried = true;
  r.waiting = false;
  return true;
}

bool Engine::reserve(uint64_t id, int64_t encode_tokens) {
  const auto lock = model_->state().lock();
  check_encode_tokens("reserve", encode_tokens);
  RequestState& r = get(id);
  if (r.waiting) throw InvalidArgument("request " + std::to_string(id) + " is not admitted");
  return model_->state().kv->reserve(r.table, std::min(encode_tokens, r.pending()));
}

void Engine::preempt(uint64_t id) {
  const auto lock = model_->state().lock();
  RequestState& r = get(id);
  model_->state().kv->release(r.table);
  r.waiting = true;
  r.end_block();
}

void Engine::abort(uint64_t id) {
  const auto lock = model_->state().lock();
  if (std::erase_if(finished_, [&](const auto& f) { return f.first == id; })) return;
  RequestState& r = get(id);
  model_->state().kv->release(r.table);
  requests_.erase(id);
}

int64_t Engine::pending_tokens(uint64_t id) const {
  const auto lock = model_->state().lock();
  return get(id).pending();
}
int Engine::canvas_length(uint64_t id) const {
  const auto lock = model_->state().lock();
  return get(id).canvas;
}
std::vector<int32_t> Engine::generated(uint64_t id) const {
  const auto lock = model_->state().lock();
  return get(id).out.token_ids;
}
size_t Engine::size() const {
  const auto lock = model_->state().lock();
  return requests_.size();
}
int64_t Engine::passes() const {
  const auto lock = model_->state().lock();
  return passes_;
}
std::vector<int> Engine::denoise_steps(uint64_t id) const {
  const auto lock = model_->state().lock();
  return get(id).out.denoise_steps;
}
std::vector<int32_t> Engine::draft(uint64_t id) const {
  const auto lock = model_->state().lock();
  const RequestState& r = get(id);
  if (!r.in_block() || !r.steps) return {};
  // Logits that held NaN or infinity give no draft (their argmax is no token): the request
  // fails at its next step, where a step cut short (interrupt) had left this one posted first.
  CanvasReadout block = read_canvas(*model_->state().backend, *r.block_state);
  if (block.non_finite) return {};
  // Only what the block may add: max_new_tokens cuts the last block at its commit, and a draft
  // past that cut would show tokens that never come.
  const int64_t room = std::max<int64_t>(0, int64_t(r.params.max_new_tokens) - int64_t(r.out.token_ids.size()));
  if (int64_t(block.argmax.size()) > room) block.argmax.resize(size_t(room));
  return std::move(block.argmax);
}

std::vector<std::pair<uint64_t, GenerationOutput>> Engine::step(const std::vector<StepPlan>& plan, int max_steps,
                                                                int64_t max_batched_tokens) {
  const auto lock = model_->state().lock();
  ModelState& m = model_->state();
  Backend& be = *m.backend;
  const ModelConfig& c = m.config;
  if (max_steps < 1) throw InvalidArgument("step: max_steps must be >= 1, got " + std::to_string(max_steps));
  if (max_batched_tokens < 1)
    throw InvalidArgument("step: max_batched_tokens must be >= 1, got " + std::to_string(max_batched_tokens));
  std::vector<std::pair<uint64_t, RequestState*>> active;
  std::map<uint64_t, int64_t> allowance;
  for (const StepPlan& p : plan) {
    RequestState& r = get(p.id);
    if (r.waiting) throw InvalidArgument("request " + std::to_string(p.id) + " is not admitted");
    // A request planned twice would run two segments on one block state, and the second
    // would be read after the first finished the request and freed it.
    if (allowance.count(p.id)) throw InvalidArgument("step: request " + std::to_string(p.id) + " is planned twice");
    if (p.max_encode_tokens < 0)
      throw InvalidArgument("step: request " + std::to_string(p.id) + ": max_encode_tokens must be >= 0, got " +
                            std::to_string(p.max_encode_tokens));
    // A request that would denoise in this step (its pending tokens all planned) but whose
    // canvas no pass holds: the step had returned nothing, and a caller stepping until its
    // requests finish spun forever. (A step that only prefills may be smaller.)
    if (r.canvas > max_batched_tokens && r.pending() <= std::min<int64_t>(p.max_encode_tokens, max_batched_tokens))
      throw InvalidArgument("step: request " + std::to_string(p.id) + "'s canvas is " + std::to_string(r.canvas) +
                            " rows, more than max_batched_tokens (" + std::to_string(max_batched_tokens) + ")");
    active.push_back({p.id, &r});
    allowance[p.id] = p.max_encode_tokens;
  }

  Activation last_logits;  // the previous pass's
  for (int pass = 0; pass < max_steps && !active.empty() && !(pass > 0 && interrupted_);) {
    // A denoising request's segment and its rows of the pass's logits.
    struct Denoiser {
      RequestState* r;
      size_t segment;
      int64_t first_row;
    };
    std::vector<Segment> segments;
    std::vector<Denoiser> denoisers;
    segments.reserve(2 * active.size());
    int64_t rows = 0, denoise_rows = 0;
    // The first pass runs the plan. Later passes give their rows to the requests past their
    // prompts first (blocks to commit, denoise steps), and what is left to the prompts' next
    // chunks, in the plan's order: a long prompt beside one denoising request had waited a
    // whole step (slice_steps passes, 7 of 8 of their rows empty) for each chunk.
    std::vector<std::pair<uint64_t, RequestState*>> order = active;
    if (pass > 0)
      std::stable_partition(order.begin(), order.end(),
                            [](const auto& a) { return a.second->table.length() >= int64_t(a.second->prompt.size()); });
    for (auto& [id, r] : order) {
      const int64_t pending = r->pending();
      // The first pass encodes the chunk planned, later ones a prompt's next chunk in the rows
      // left, or a block to commit whole. (A prompt chunk past the pass's rows is cut to them,
      // not skipped every pass.)
      int64_t encode = pending;
      if (pass == 0)
        encode = std::min({pending, allowance[id], max_batched_tokens - rows});
      else if (r->table.length() < int64_t(r->prompt.size()))
        encode = std::min(pending, max_batched_tokens - rows);
      if (encode > 0) {
        if (rows + encode > max_batched_tokens || !m.kv->reserve(r->table, encode)) continue;
        const int64_t from = r->table.length();
        segments.push_back(Segment{&r->table, true, r->target_tokens(from, encode), nullptr});
        rows += encode;
      }
      if (encode < pending || (encode > 0 && !fuse_commit_) || rows + r->canvas > max_batched_tokens) continue;
      if (!r->in_block()) start_block(*r, be, c, m.weight_dtype);
      denoisers.push_back({r, segments.size(), denoise_rows});
      segments.push_back(Segment{&r->table, false, {}, nullptr, true, r->block_state->tokens, r->canvas});
      rows += r->canvas;
      denoise_rows += r->canvas;
    }
    if (segments.empty()) break;

    // A steady batch, only denoise steps each past its block's first (the forward is then
    // the same work every step, its inputs in backend memory), repeats until a block stops:
    // on its own logits matrix, a step's feedback being its previous step's rows of it
    // (the previous pass's matrix when the batch is the same, else copied in). Not where a
    // request that sits this pass out (its canvas past the pass's rows) keeps its feedback in
    // the previous pass's matrix: the pass would write another's logits over it.
    const bool steady = segments.size() == denoisers.size() &&
                        std::all_of(denoisers.begin(), denoisers.end(), [](const Denoiser& d) {
                          return d.r->steps > 0 || !d.r->params.self_conditioning;
                        });
    const auto denoises = [&](const RequestState* r) {
      return std::any_of(denoisers.begin(), denoisers.end(), [&](const Denoiser& d) { return d.r == r; });
    };
    const bool in_place = steady && last_logits.rows == denoise_rows &&
                          std::all_of(denoisers.begin(), denoisers.end(), [&](const Denoiser& d) {
                            return !d.r->feedback.data || d.r->feedback.data == last_logits.row(d.first_row);
                          }) &&
                          std::none_of(active.begin(), active.end(), [&](const auto& a) {
                            return a.second->feedback.data && a.second->feedback.storage == last_logits.storage &&
                                   !denoises(a.second);
                          });
    Activation logits = in_place ? last_logits : be.alloc_logits(denoise_rows, c.vocab_size);
    std::vector<Activation> feedback(denoisers.size());
    std::vector<const CanvasState*> states;
    for (size_t i = 0; i < denoisers.size(); ++i) {
      const Denoiser& d = denoisers[i];
      states.push_back(&*d.r->block_state);
      if (!d.r->feedback.data) continue;
      feedback[i] = d.r->feedback;
      if (steady) {
        feedback[i] = logits.view(d.first_row, d.r->canvas);
        if (!in_place) be.copy_rows(d.r->feedback, 0, logits, d.first_row, d.r->canvas);
      }
      segments[d.segment].self_conditioning = &feedback[i];
    }
    auto run = [&] {
      forward(m, *m.kv, segments, &logits, /*softcap=*/false);  // the sampler softcaps
      for (const Denoiser& d : denoisers) {
        Activation canvas_logits = logits.view(d.first_row, d.r->canvas);
        be.denoise_step(canvas_logits, *d.r->block_state);
      }
    };
    int runs = 1;
    if (steady) runs = be.repeat(run, states, max_steps - pass, interrupted_);
    else run();
    // Every canvas's stop flag is read below where the step ends, or a steady batch's repeat
    // was cut short (a canvas stopped, or an interrupt came).
    const bool read_stops = (steady && runs < max_steps - pass) || pass + runs >= max_steps;
    pass += runs;
    passes_ += runs;
    last_logits = logits;

    for (const Denoiser& d : denoisers) {
      RequestState* r = d.r;
      r->feedback = r->params.self_conditioning ? logits.view(d.first_row, r->canvas) : Activation{};
      r->steps += runs;
      // The stop rule cannot have fired before the argmax history is full, short of the
      // last step or logits that were not finite (which stop a canvas at once, and a steady
      // batch's repeat after that step; read at the step's end at the latest): then nothing
      // is read (the host goes on queueing work, or recording the next steps' graph, while
      // the device runs this pass).
      const bool may_stop =
          read_stops || r->steps > r->params.stability_threshold || r->steps >= r->params.max_denoising_steps;
      if (may_stop && canvas_stopped(be, *r->block_state) && finish_block(*r, be, c.generation.pad_token_id)) {
        auto it = std::find_if(active.begin(), active.end(), [&](const auto& a) { return a.second == r; });
        const uint64_t id = it->first;
        active.erase(it);
        m.kv->release(r->table);
        finished_.push_back({id, std::move(r->out)});
        requests_.erase(id);
      }
    }
  }
  // (Cleared only here: an interrupt that came during the step has ended it, and one that
  // comes after this is for the next.)
  interrupted_ = false;
  return std::exchange(finished_, {});
}

std::vector<std::pair<uint64_t, GenerationOutput>> Engine::take_finished() {
  const auto lock = model_->state().lock();
  return std::exchange(finished_, {});
}

}  // namespace diffuserve
