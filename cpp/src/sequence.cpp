// Model loading and the Sequence API: argument checks, then one-segment batches through
// the graph in model.cpp.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <system_error>
#include <cctype>
#include <new>
#include <mutex>
#include <optional>
#include <set>
#include <stdexcept>

#include <pthread.h>

#include "diffuserve/diffuserve.h"
#include "json.h"
#include "model.h"

namespace diffuserve {

struct Sequence::State {
  KvTable table;
  int canvas_length = 0;
};

namespace {

// The weight dtype `name` names, if it is one weights load in.
std::optional<DType> weight_dtype_named(const std::string& name) {
  if (name == "float32" || name == "fp32") return DType::F32;
  if (name == "bfloat16" || name == "bf16") return DType::BF16;
  if (name == "float16" || name == "fp16") return DType::F16;
  return std::nullopt;
}

DType parse_dtype(const std::string& name, DType stored) {
  if (name.empty()) return stored;
  if (const auto dtype = weight_dtype_named(name)) return *dtype;
  throw InvalidArgument("dtype '" + name + "' is not supported (use float32, bfloat16 or float16)");
}

void check_positions(int64_t length, size_t n, const ModelConfig& c, const char* what) {
  if (length + int64_t(n) > c.max_model_len)
    throw InvalidArgument(std::string(what) + ": " + std::to_string(length) + " + " + std::to_string(n) +
                          " tokens exceed " + c.max_model_len_name() + " (" + std::to_string(c.max_model_len) +
                          ")");
}

}  // namespace

std::unique_ptr<Backend> make_backend(const std::string& device, int num_threads) {
  if (device == "cpu") return make_cpu_backend(num_threads);
  if (device == "cuda" || device.rfind("cuda:", 0) == 0) {
#ifdef DIFFUSERVE_WITH_CUDA
    const std::string index = device.size() > 5 ? device.substr(5) : "0";
    if (index.empty() || index.size() > 3 || !std::all_of(index.begin(), index.end(), json::is_digit))
      throw InvalidArgument("device '" + device + "': expected cuda or cuda:N");
    return make_cuda_backend(std::stoi(index), device);
#else
    throw InvalidArgument("device '" + device + "' is not available: this build has no CUDA backend");
#endif
  }
  throw InvalidArgument("device '" + device + "' is not available: use cpu, cuda or cuda:N");
}

bool cuda_available() {
#ifdef DIFFUSERVE_WITH_CUDA
  try {
    make_cuda_backend(0, "cuda");
    return true;
  } catch (const InvalidArgument&) {
    return false;
  }
#else
  return false;
#endif
}

void check_token_ids(std::span<const int32_t> ids, const ModelConfig& c, const std::string& what) {
  for (size_t i = 0; i < ids.size(); ++i)
    if (ids[i] < 0 || ids[i] >= c.vocab_size)
      throw InvalidArgument(what + ": token id " + std::to_string(ids[i]) + " at index " + std::to_string(i) +
                            " is out of range [0, " + std::to_string(c.vocab_size) + ")");
}

// The live models, for the fork handlers. A fork copies a model's turn as it is: in a child
// forked while another thread's call held it, forked_in_use (model.h) says so. The mutexes
// held only for a moment (the registry's, each model's queue of dropped tables) are taken
// before the fork, so that no thread the child lacks holds them there.
namespace {

std::mutex live_models_mutex;
std::set<ModelState*>& live_models() {
  static auto* models = new std::set<ModelState*>;  // (never destroyed: a model may outlive statics)
  return *models;
}

}  // namespace

void ModelState::before_fork() {
  live_models_mutex.lock();
  for (ModelState* m : live_models()) m->dropped_mutex.lock();
}

void ModelState::after_fork_in_parent() {
  for (ModelState* m : live_models()) m->dropped_mutex.unlock();
  live_models_mutex.unlock();
}

void ModelState::after_fork_in_child() {  // (its one thread is the forking one)
  for (ModelState* m : live_models()) {
    m->dropped_mutex.unlock();
    if (m->calls.try_lock())
      m->calls.unlock();
    else
      m->forked_in_use = true;
  }
  live_models_mutex.unlock();
}

ModelState::ModelState() {
  static std::once_flag handlers;
  std::call_once(handlers, [] { pthread_atfork(before_fork, after_fork_in_parent, after_fork_in_child); });
  const std::lock_guard guard(live_models_mutex);
  live_models().insert(this);
}

ModelState::~ModelState() {
  const std::lock_guard guard(live_models_mutex);
  live_models().erase(this);
}

void ModelState::refuse_if_forked_in_use() const {
  if (forked_in_use)
    throw InvalidArgument("this model was in use by another thread when the process forked: in this process its "
                          "state is that call's, half done, and that thread does not exist; load the model again "
                          "here (or fork while no thread uses it)");
}

Model::Model(std::unique_ptr<ModelState> state) : state_(std::move(state)) {}
Model::~Model() = default;

std::shared_ptr<Model> Model::load(const std::string& path, const LoadOptions& options) {
  if (options.kv_cache_memory_bytes < 0) throw InvalidArgument("kv_cache_memory_bytes must be >= 0");
  // Checked before the weights load, which takes long (a negative num_threads had been taken
  // silently as 0).
  if (options.num_threads < 0)
    throw InvalidArgument("num_threads must be >= 0 (0: the default), got " + std::to_string(options.num_threads));
  if (options.kv_block_size < 1)
    throw InvalidArgument("kv_block_size must be >= 1, got " + std::to_string(options.kv_block_size));
  if (options.max_num_seqs < 1)
    throw InvalidArgument("max_num_seqs must be >= 1, got " + std::to_string(options.max_num_seqs));
  if (options.max_model_len < 0)
    throw InvalidArgument("max_model_len must be >= 0 (0: max_position_embeddings), got " +
                          std::to_string(options.max_model_len));
  // (The overload that reports through an error code: a path the OS refuses to look up, one
  // too long say, had escaped as std::filesystem::filesystem_error.)
  std::error_code error;
  if (!std::filesystem::is_directory(path, error))
    throw FormatError("'" + path + "' is not a checkpoint directory" + (error ? ": " + error.message() : ""));
  auto state = std::make_unique<ModelState>();
  state->path = path;
  state->device = options.device;
  state->num_threads = options.num_threads;
  state->config = load_config(path);
  if (options.max_model_len) {  // (vLLM's option: a shorter longest sequence than the model's)
    ModelConfig& c = state->config;
    if (options.max_model_len > c.max_position_embeddings)
      throw InvalidArgument("max_model_len " + std::to_string(options.max_model_len) +
                            " is more than the model's max_position_embeddings (" +
                            std::to_string(c.max_position_embeddings) + ")");
    if (options.max_model_len <= c.canvas_length)
      throw InvalidArgument("max_model_len " + std::to_string(options.max_model_len) +
                            " leaves no room for a prompt token and a block of canvas_length (" +
                            std::to_string(c.canvas_length) + ") new tokens");
    c.max_model_len = options.max_model_len;
  }
  DType stored = DType::BF16;  // dummy weights default to bf16
  if (options.load_format == "auto") {
    state->checkpoint = std::make_shared<Checkpoint>(path);
    // DiffusionGemmaModel.save_pretrained writes the base model's tensors without "model.".
    state->checkpoint->prefix_names_of_base_model("model.");
    const TensorView* embed = state->checkpoint->find("model.decoder.embed_tokens.weight");
    if (!embed) throw FormatError(path + ": missing tensor 'model.decoder.embed_tokens.weight'");
    // The weights' default dtype is config.json's, as transformers loads them; where it names
    // none, the embedding's (bf16 where it is stored quantized).
    stored = is_float(embed->dtype) ? embed->dtype : DType::BF16;
    if (options.dtype.empty() && !state->config.dtype.empty()) {
      const auto dtype = weight_dtype_named(state->config.dtype);
      if (!dtype)
        throw FormatError(path + "/config.json: dtype '" + state->config.dtype +
                          "' is not one this engine loads weights in (float32, bfloat16 or float16): pass dtype= "
                          "to load them in one of those");
      stored = *dtype;
    }
  } else if (options.load_format != "dummy") {
    throw InvalidArgument("load_format '" + options.load_format + "' is not supported (use auto or dummy)");
  }
  if (!options.quantization.empty() && options.load_format != "dummy")
    throw InvalidArgument("quantization '" + options.quantization + "' is for load_format 'dummy' (a checkpoint's "
                          "quantization_config says how its weights are quantized)");
  if (options.quantization == "fp8" || options.quantization == "fp8-dynamic") state->dummy_quantization = WeightFormat::Fp8;
  else if (options.quantization == "nvfp4") state->dummy_quantization = WeightFormat::Nvfp4;
  else if (!options.quantization.empty())
    throw InvalidArgument("quantization '" + options.quantization + "' is not supported (use fp8, fp8-dynamic or nvfp4)");
  if (options.quantization == "fp8-dynamic") state->dummy_activations = ActivationScheme::Fp8Token;
  if (options.activations != "float32" && options.activations != "bfloat16")
    throw InvalidArgument("activations '" + options.activations + "' is not supported (use float32 or bfloat16)");
  state->bf16_activations = options.activations == "bfloat16";
  state->backend = make_backend(options.device, options.num_threads);
  if (state->config.exact_gelu && !state->backend->use_exact_gelu())
    throw InvalidArgument("hidden_activation 'gelu' (GELU by erf) is not supported on " + options.device +
                          " (its kernels compute GELU's tanh approximation; the CPU backend runs it)");
  if (const std::string why = state->backend->unsupported(state->config, state->bf16_activations); !why.empty())
    throw InvalidArgument("this model cannot run on " + options.device + ": " + why);
  // The KV cache's dtype, refused before the weights load where it cannot be had.
  const DType kv_auto = state->backend->kv_cache_dtype(state->config, state->bf16_activations);
  if (options.kv_cache_dtype != "auto" && options.kv_cache_dtype != "float32" && options.kv_cache_dtype != "bfloat16")
    throw InvalidArgument("kv_cache_dtype '" + options.kv_cache_dtype +
                          "' is not supported (use auto, float32 or bfloat16)");
  if (options.kv_cache_dtype == "bfloat16" && kv_auto != DType::BF16) {
    const std::string where = options.device == "cpu" ? "any head dim" : "head dims 256 and 512 on Hopper";
    throw InvalidArgument(
        "kv_cache_dtype 'bfloat16' needs activations 'bfloat16' and an attention reading bf16 keys (" + options.device +
        ": " + where + "); 'auto' takes it where it can");
  }
  const DType kv_dtype = options.kv_cache_dtype == "float32" ? DType::F32 : kv_auto;
  DType as = parse_dtype(options.dtype, stored);
  if (options.device != "cpu") {  // the GPU's GEMMs run on bf16 weights
    if (!options.dtype.empty() && as != DType::BF16)
      throw InvalidArgument("dtype '" + options.dtype + "' is not supported on " + options.device +
                            ": its GEMMs take bfloat16 weights");
    as = DType::BF16;
  }
  // Before the weights, which take long to load: a budget past the memory there is (a typo,
  // 4096 GiB for 4) had filled tens of GB of block tables before failing.
  if (const int64_t memory = state->backend->memory_bytes(); options.kv_cache_memory_bytes > memory)
    throw InvalidArgument("kv_cache_memory_bytes " + std::to_string(options.kv_cache_memory_bytes) + " is more than " +
                          options.device + " has in all (" + std::to_string(memory) + " bytes" +
                          (options.device == "cpu" ? ": its memory, or its container's limit where lower" : "") + ")");
  try {
    load_weights(*state, as);
  } catch (const std::bad_alloc&) {
    // Random weights take their sizes from the config alone, which may ask for any amount;
    // a checkpoint's are the files', and running out of memory for them stays std::bad_alloc.
    if (options.load_format != "dummy") throw;
    throw InvalidArgument("load_format 'dummy': out of memory making random weights of the config's sizes");
  } catch (const std::length_error&) {
    if (options.load_format != "dummy") throw;
    throw InvalidArgument("load_format 'dummy': the config's sizes are past what one weight can hold");
  }
  // A budget past what the weights left would fail partway through the cache's allocations,
  // naming only one of them ("out of GPU memory allocating 2260729856 bytes", 40 GiB asked
  // beside the 26B model's weights on an 80 GB H100).
  if (options.kv_cache_memory_bytes)
    if (const int64_t free = state->backend->free_memory_bytes(); options.kv_cache_memory_bytes > free)
      throw InvalidArgument("kv_cache_memory_bytes " + std::to_string(options.kv_cache_memory_bytes) +
                            " is more than the " + std::to_string(free) + " bytes " + options.device +
                            " has free once the weights are loaded (0 takes 80% of those)");
  const int64_t kv_bytes =
      options.kv_cache_memory_bytes ? options.kv_cache_memory_bytes : state->backend->default_kv_cache_bytes();
  state->kv = std::make_unique<KvCache>(*state->backend, state->config, kv_bytes, options.kv_block_size,
                                        options.max_num_seqs, kv_dtype);
  return std::shared_ptr<Model>(new Model(std::move(state)));
}

const ModelConfig& Model::config() const { return state_->config; }
DType Model::weight_dtype() const { return state_->weight_dtype; }
DType Model::kv_cache_dtype() const { return state_->kv->dtype(); }
const std::string& Model::device() const { return state_->device; }

CacheStats Model::cache_stats() const {
  const auto lock = state_->lock();
  const KvStats s = state_->kv->stats();
  return {s.blocks_total, s.blocks_free, s.prefix_cache_queries, s.prefix_cache_hits};
}

int64_t Model::max_sequence_tokens() const {
  const auto lock = state_->lock();
  return state_->kv->longest_sequence(config().max_model_len, config().canvas_length);
}

std::unique_ptr<Sequence> Model::new_sequence(int canvas_length) {
  if (const std::string why = canvas_length_problem(canvas_length, config()); !why.empty())
    throw InvalidArgument("canvas_length " + why);
  return std::unique_ptr<Sequence>(
      new Sequence(shared_from_this(), canvas_length ? canvas_length : config().canvas_length));
}

Sequence::Sequence(std::shared_ptr<Model> model, int canvas_length)
    : model_(std::move(model)), state_(std::make_unique<State>()) {
  state_->canvas_length = canvas_length;
}

Sequence::~Sequence() { model_->state().release_soon(std::move(state_->table)); }

int64_t Sequence::length() const {
  const auto lock = model_->state().lock();
  return state_->table.length();
}
const ModelConfig& Sequence::config() const { return model_->config(); }
int Sequence::canvas_length() const { return state_->canvas_length; }

namespace {
// `tokens` more tokens refused for want of KV blocks.
InvalidArgument no_room(const char* what, size_t tokens) {
  return InvalidArgument(std::string(what) + ": the KV cache has no room for " + std::to_string(tokens) +
                         " more tokens (raise kv_cache_memory_bytes; or max_num_seqs where more sequences are "
                         "live: the sliding-window layers keep room for that many sequences' windows)");
}
}  // namespace

void Sequence::encode(std::span<const int32_t> ids, const char* what) {
  const ModelConfig& c = model_->config();
  if (ids.empty()) throw InvalidArgument(std::string(what) + ": no tokens given");
  check_token_ids(ids, c, what);
  check_positions(length(), ids.size(), c, what);
  ModelState& m = model_->state();
  if (!m.kv->reserve(state_->table, int64_t(ids.size()))) throw no_room(what, ids.size());
  std::vector<Segment> batch{Segment{&state_->table, true, {ids.begin(), ids.end()}, nullptr}};
  forward(m, *m.kv, batch);
  // The pass is done when prefill or commit returns, as denoise's is (its logits come back):
  // on CUDA a commit had returned as soon as it was queued, its failures surfacing in the next
  // call and its time in no one's (benchmarks/step_latency.py had timed its queueing, 4.4 ms).
  m.backend->synchronize();
}

namespace {
// The largest of n, n / 2, n / 4, ... (rounded up, down to 1) that `fits`; 1 where none does.
template <class Fits>
size_t largest_chunk(size_t n, Fits fits) {
  while (n > 1 && !fits(n)) n = (n + 1) / 2;
  return n;
}
}  // namespace

void Sequence::prefill(std::span<const int32_t> ids) {
  const auto lock = model_->state().lock();
  if (ids.empty()) return encode(ids, "prefill");
  check_token_ids(ids, config(), "prefill");
  check_positions(length(), ids.size(), config(), "prefill");  // all of it, before any chunk's work
  if (length() > 0) return continue_prefill(ids);
  KvCache& kv = *model_->state().kv;
  const int64_t hit = kv.match_prefix(state_->table, ids);
  if (hit == int64_t(ids.size())) return kv.record_prefix_query(hit, hit);  // every token's KV was cached
  try {
    // The sliding-window layers keep a window and a chunk a sequence (KvCache), not a whole
    // long prompt at once: a prompt that could not fit in one pass even in an otherwise empty
    // cache is encoded in the largest chunks that could, as the engine's chunked prefill does
    // (the same KV). A 3,200-token prompt had been refused with half a million blocks free.
    const size_t chunk =
        largest_chunk(ids.size() - hit, [&](size_t n) { return kv.could_hold(int64_t(ids.size()), int64_t(n)); });
    if (!kv.could_hold(int64_t(ids.size()), int64_t(chunk)))  // not even a token at a time
      throw InvalidArgument("prefill: " + std::to_string(ids.size()) +
                            " tokens need more KV than the whole cache holds (raise kv_cache_memory_bytes)");
    // The cache as it is (other sequences holding blocks) must take them all, before any
    // chunk's work: a prompt had been refused a chunk's way in, naming the chunk.
    if (!kv.could_continue(state_->table, int64_t(ids.size()) - hit, int64_t(chunk)))
      throw no_room("prefill", ids.size() - size_t(hit));
    for (size_t done = hit; done < ids.size(); done += chunk)
      encode(ids.subspan(done, std::min(chunk, ids.size() - done)), "prefill");
  } catch (...) {
    kv.release(state_->table);  // a failed prefill leaves the sequence empty
    throw;
  }
  kv.record_prefix_query(int64_t(ids.size()), hit);
}

// A prefill after the first: in chunks the sliding-window layers' pool holds, as a first
// prefill's, where the cache as it is now could take them all (else the one pass's refusal,
// with nothing encoded). In one pass, a 3,000-token continuation had been refused with
// nearly every block free.
void Sequence::continue_prefill(std::span<const int32_t> ids) {
  const KvCache& kv = *model_->state().kv;
  auto fits = [&](size_t n) { return kv.could_continue(state_->table, int64_t(ids.size()), int64_t(n)); };
  const size_t chunk = largest_chunk(ids.size(), fits);
  if (!fits(chunk)) return encode(ids, "prefill");
  for (size_t done = 0; done < ids.size(); done += chunk)
    encode(ids.subspan(done, std::min(chunk, ids.size() - done)), "prefill");
}

std::pair<int64_t, int64_t> Sequence::kv_blocks() const {
  const auto lock = model_->state().lock();
  auto held = [](const std::vector<int32_t>& blocks) {
    return int64_t(std::count_if(blocks.begin(), blocks.end(), [](int32_t b) { return b >= 0; }));
  };
  return {held(state_->table.blocks[kFullGroup]), held(state_->table.blocks[kSlidingGroup])};
}

void Sequence::commit(std::span<const int32_t> block) {
  const auto lock = model_->state().lock();
  const int canvas = state_->canvas_length;
  if (block.size() > size_t(canvas))
    throw InvalidArgument("commit: block of " + std::to_string(block.size()) + " tokens is longer than canvas_length " +
                          std::to_string(canvas));
  if (length() == 0) throw InvalidArgument("commit: call prefill before committing a block");
  encode(block, "commit");
}

void Sequence::check_canvas(std::span<const int32_t> canvas) const {
  const ModelConfig& c = model_->config();
  if (length() == 0) throw InvalidArgument("denoise: call prefill before denoising (the cache is empty)");
  if (canvas.size() != size_t(state_->canvas_length))
    throw InvalidArgument("denoise: canvas has " + std::to_string(canvas.size()) + " tokens, expected canvas_length " +
                          std::to_string(state_->canvas_length));
  check_token_ids(canvas, c, "denoise");
  check_positions(length(), canvas.size(), c, "denoise");
}

std::vector<float> Sequence::denoise(std::span<const int32_t> canvas, std::span<const float> self_conditioning_logits) {
  const auto lock = model_->state().lock();
  check_canvas(canvas);
  const int64_t vocab = config().vocab_size, n = int64_t(canvas.size());
  ModelState& m = model_->state();
  Activation sc;
  const bool conditioned = !self_conditioning_logits.empty();
  if (conditioned) {
    if (int64_t(self_conditioning_logits.size()) != n * vocab)
      throw InvalidArgument("denoise: self_conditioning_logits holds " +
                            std::to_string(self_conditioning_logits.size()) + " values, not canvas x vocab = " +
                            std::to_string(n) + " x " + std::to_string(vocab));
    for (int64_t r = 0; r < n; ++r) {
      const float* row = self_conditioning_logits.data() + r * vocab;
      bool any_finite = false;
      for (int64_t j = 0; j < vocab; ++j) {
        if (std::isnan(row[j]) || row[j] == INFINITY)
          throw InvalidArgument("denoise: self_conditioning_logits holds NaN or +inf at row " + std::to_string(r) +
                                ", column " + std::to_string(j));
        any_finite |= std::isfinite(row[j]);
      }
      if (!any_finite)
        throw InvalidArgument("denoise: self_conditioning_logits row " + std::to_string(r) + " is all -inf");
    }
    sc = m.backend->alloc(n, vocab);
    m.backend->from_host(self_conditioning_logits.data(), sc);
  }
  std::vector<Segment> batch{Segment{&state_->table, false, {canvas.begin(), canvas.end()}, conditioned ? &sc : nullptr}};
  Activation logits = forward(m, *m.kv, batch);
  std::vector<float> out(logits.size());
  m.backend->to_host(logits, out.data());
  // NaN or infinity comes only from weights (or activations they produce) that are not
  // finite: refused here rather than passed on.
  const auto bad = std::find_if(out.begin(), out.end(), [](float x) { return !std::isfinite(x); });
  if (bad != out.end()) {
    const int64_t at = bad - out.begin();
    throw FormatError("denoise: the model's logits hold " + std::string(std::isnan(*bad) ? "NaN" : "infinity") +
                          " at row " + std::to_string(at / vocab) + ", column " + std::to_string(at % vocab) + ": " +
                          kNotFiniteCause);
  }
  return out;
}

std::vector<float> Sequence::denoise(std::span<const int32_t> canvas, const float* self_conditioning_logits) {
  if (!self_conditioning_logits) return denoise(canvas);
  return denoise(canvas, std::span<const float>(self_conditioning_logits, canvas.size() * size_t(config().vocab_size)));
}

LayerKV Sequence::kv(int layer) const {
  const auto lock = model_->state().lock();
  const ModelConfig& c = model_->config();
  if (layer < 0 || layer >= c.num_layers)
    throw InvalidArgument("kv: layer " + std::to_string(layer) + " is out of range [0, " +
                          std::to_string(c.num_layers) + ")");
  const LayerConfig& L = c.layers[layer];
  KvCache& kv = *model_->state().kv;
  Backend& be = *model_->state().backend;
  LayerKV out;
  out.kv_heads = L.num_kv_heads;
  out.head_dim = L.head_dim;
  // What the reference's cache holds: every row, or the last window - 1 on sliding layers.
  out.first_position = L.sliding ? std::max<int64_t>(0, length() - (c.sliding_window - 1)) : 0;
  out.rows = length() - out.first_position;
  const int64_t cols = out.kv_heads * out.head_dim;
  out.keys.resize(out.rows * cols);
  out.values.resize(out.rows * cols);
  // A run of consecutive slots (a KV block's rows) comes over in one read: a read a row, each
  // waiting for the device, made a layer of 2,304 rows take 66 ms on CUDA.
  const int64_t row_bytes = cols * int64_t(dtype_size(kv.dtype()));
  std::vector<uint8_t> bytes;
  for (int64_t r = 0; r < out.rows;) {
    const int64_t slot = kv.slot(state_->table, layer, out.first_position + r);
    int64_t n = 1;
    while (r + n < out.rows && kv.slot(state_->table, layer, out.first_position + r + n) == slot + n) ++n;
    bytes.resize(size_t(n * row_bytes));
    for (auto [rows, dst] : {std::pair{&kv.keys(layer), &out.keys}, std::pair{&kv.values(layer), &out.values}}) {
      be.read_bytes(bytes.data(), rows->row(slot), bytes.size());
      const std::vector<float> x = read_floats(bytes.data(), kv.dtype(), n * cols);
      // Token-major [rows, heads, dim] -> head-major [heads, rows, dim].
      for (int64_t i = 0; i < n; ++i)
        for (int64_t h = 0; h < out.kv_heads; ++h)
          std::copy_n(x.data() + (i * out.kv_heads + h) * out.head_dim, out.head_dim,
                      dst->data() + (h * out.rows + r + i) * out.head_dim);
    }
    r += n;
  }
  return out;
}

}  // namespace diffuserve
