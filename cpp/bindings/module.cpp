// nanobind module `diffuserve._core`: the C++ Model and Sequence, with numpy in and out.
// The Python package (python/diffuserve) wraps these with argument conversion; the heavy
// work runs with the GIL released.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <set>
#include <thread>

#include "backend.h"
#include "cgroup.h"
#include "diffuserve/diffuserve.h"
#include "diffuserve/engine.h"
#include "diffuserve/generate.h"
#include "safetensors.h"
#include "sampler.h"

namespace nb = nanobind;
using namespace diffuserve;

using IdArray = nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using LogitsIn = nb::ndarray<const float, nb::ndim<2>, nb::c_contig, nb::device::cpu>;

namespace {

// The GIL let go of for a native call, and taken back after it. A daemon thread that takes it
// back once the interpreter finalizes is ended there by pthread_exit, whose unwinding through
// these C++ frames aborts the process (SIGABRT as it exited, where a user's daemon thread was
// inside generate). So a call that returns once the interpreter finalizes, in a thread other
// than the one finalizing it, parks its thread instead: the process is ending. A thread that
// waits for the GIL as the finalization starts is ended all the same, and the exit hooks hold
// the GIL up to then; so from the package's exit hook on (the last of the hooks, unless some
// were registered before diffuserve was imported), a call returning in another thread waits
// up to 50 ms for the finalization, and parks if it came. (Not parked at once: a hook that
// runs after the package's may wait for that thread.)
unsigned long main_thread = 0;  // the interpreter's main thread, which finalizes it (set at import)
std::atomic<bool> exit_hook_ran{false};
std::atomic<int> taking_gil{0};  // threads past the checks below, taking the GIL back

bool interpreter_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing();
#else
  return _Py_IsFinalizing();
#endif
}

class GilReleased {
 public:
  GilReleased() : state_(PyEval_SaveThread()) {}
  ~GilReleased() {
    const bool other_thread = PyThread_get_thread_ident() != main_thread;
    if (other_thread) {
      ++taking_gil;  // (before the check, as the hook sets its flag before it counts these)
      if (exit_hook_ran || interpreter_finalizing()) {
        --taking_gil;
        for (int ms = 0; ms < 50 && !interpreter_finalizing(); ++ms)
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
        if (interpreter_finalizing())
          for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
        ++taking_gil;
      }
    }
    PyEval_RestoreThread(state_);
    if (other_thread) --taking_gil;
  }
  GilReleased(const GilReleased&) = delete;
  GilReleased& operator=(const GilReleased&) = delete;

 private:
  PyThreadState* state_;
};

// The package's exit hook (registered as _core is imported, so run after the package's other
// hooks, AsyncLLM's that stops its engine threads among them). The threads that were already
// taking the GIL back get it first. Threads still running at exit (daemon threads, which the
// finalization ends or parks) keep their objects, which nanobind would report as the bindings'
// leaks.
void at_exit() {
  exit_hook_ran = true;
  {
    nb::gil_scoped_release release;
    for (int ms = 0; ms < 1000 && taking_gil > 0; ++ms) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  if (nb::cast<int>(nb::module_::import_("threading").attr("active_count")()) > 1) nb::set_leak_warnings(false);
}

// f() with the GIL released: a call that waits for the model's turn (another thread's pass
// may hold it for seconds) must not hold every Python thread up with it.
template <class F>
auto without_gil(F f) {
  GilReleased release;
  return f();
}

// A numpy array that owns a std::vector's storage.
template <typename T>
nb::ndarray<nb::numpy, T> to_numpy(std::vector<T>&& v, std::initializer_list<size_t> shape) {
  auto* heap = new std::vector<T>(std::move(v));
  nb::capsule owner(heap, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  return nb::ndarray<nb::numpy, T>(heap->data(), shape, owner);
}

std::span<const int32_t> ids_of(const IdArray& a) { return {a.data(), a.shape(0)}; }

nb::dict config_dict(const ModelConfig& c) {
  nb::dict d;
  d["vocab_size"] = c.vocab_size;
  d["hidden_size"] = c.hidden_size;
  d["num_layers"] = c.num_layers;
  d["num_heads"] = c.num_heads;
  d["num_experts"] = c.num_experts;
  d["top_k_experts"] = c.top_k_experts;
  d["sliding_window"] = c.sliding_window;
  d["canvas_length"] = c.canvas_length;
  d["max_position_embeddings"] = c.max_position_embeddings;
  d["max_model_len"] = c.max_model_len;
  d["final_logit_softcapping"] = c.final_logit_softcapping;
  d["quantization"] = c.quantization;
  nb::list layer_types;
  for (const auto& L : c.layers) layer_types.append(L.sliding ? "sliding_attention" : "full_attention");
  d["layer_types"] = layer_types;
  const GenerationDefaults& g = c.generation;
  nb::dict gen;
  gen["max_new_tokens"] = g.max_new_tokens;
  gen["max_length"] = g.max_length;  // 0: none
  gen["length_given"] = g.length_given;  // whether generation_config.json set either
  gen["max_denoising_steps"] = g.max_denoising_steps;
  gen["t_min"] = g.t_min;
  gen["t_max"] = g.t_max;
  gen["entropy_bound"] = g.entropy_bound;
  gen["stability_threshold"] = g.stability_threshold;
  gen["confidence_threshold"] = g.confidence_threshold;
  gen["eos_token_ids"] = g.eos_token_ids;
  gen["pad_token_id"] = g.pad_token_id;
  d["generation"] = gen;
  return d;
}

// The sampler's pieces, exposed for testing against transformers' own classes.
void bind_sampler(nb::module_& m) {
  nb::module_ s = m.def_submodule("sampler", "DiffusionGemma's sampler pieces (for tests)");
  s.def("schedule_temperature", &schedule_temperature, nb::arg("t_min"), nb::arg("t_max"),
        nb::arg("steps_remaining"), nb::arg("max_steps"));
  s.def("accept_by_entropy", [](const std::vector<float>& entropy, float bound) {
    return accept_by_entropy(entropy, bound, {});
  });
  // One `sample` op on `device`'s backend (softcap > 0: the logits' final softcap first; the
  // bias of allowed_ids and logit_bias, as a request's): returns (processed logits, rounded to
  // feedback_dtype ("F32", "BF16" or "F16": a checkpoint's weight dtype), or with
  // softmax_feedback their softmax, argmax, candidate, entropy).
  s.def("sample_rows", [](LogitsIn logits, float temperature, std::vector<int32_t> allowed_ids, uint64_t seed,
                          uint32_t block, uint32_t step, bool softmax_feedback, const std::string& device,
                          float softcap, const std::string& feedback_dtype,
                          const std::vector<std::pair<int32_t, float>>& logit_bias) {
    DType feedback;
    if (!dtype_from_name(feedback_dtype, &feedback) || !is_float(feedback))
      throw InvalidArgument("sample_rows: feedback_dtype must be F32, BF16 or F16, got " + feedback_dtype);
    const int64_t rows = logits.shape(0), vocab = logits.shape(1);
    auto be = make_backend(device, 1);
    std::sort(allowed_ids.begin(), allowed_ids.end());
    allowed_ids.erase(std::unique(allowed_ids.begin(), allowed_ids.end()), allowed_ids.end());
    const std::vector<float> host_bias = vocab_bias(int(vocab), allowed_ids, logit_bias);
    std::shared_ptr<void> bias;
    if (!host_bias.empty()) {
      bias = be->alloc_bytes(host_bias.size() * sizeof(float));
      be->write_bytes(bias.get(), host_bias.data(), host_bias.size() * sizeof(float));
    }
    Activation a = be->alloc(rows, vocab);
    be->from_host(logits.data(), a);
    const std::vector<RowSample> out = be->sample(a, softcap, temperature, static_cast<const float*>(bias.get()),
                                                  RandomKey{seed, block, step}, feedback, softmax_feedback);
    std::vector<float> processed(a.size());
    be->to_host(a, processed.data());
    std::vector<int32_t> argmax, candidate;
    std::vector<float> entropy;
    for (const auto& r : out) {
      argmax.push_back(r.argmax);
      candidate.push_back(r.candidate);
      entropy.push_back(r.entropy);
    }
    const size_t n = size_t(rows);
    return nb::make_tuple(to_numpy(std::move(processed), {n, size_t(vocab)}), to_numpy(std::move(argmax), {n}),
                          to_numpy(std::move(candidate), {n}), to_numpy(std::move(entropy), {n}));
  }, nb::arg("logits"), nb::arg("temperature"), nb::arg("allowed_ids"), nb::arg("seed"), nb::arg("block"),
     nb::arg("step"), nb::arg("softmax_feedback") = false, nb::arg("device") = "cpu", nb::arg("softcap") = 0.0f,
     nb::arg("feedback_dtype") = "F32", nb::arg("logit_bias") = std::vector<std::pair<int32_t, float>>{});
  // A block's denoise steps on given logits ([steps, canvas, vocab]), on `device`'s backend:
  // its own denoise_step, or with host_update the default one (the backend's sample, then
  // update_canvas on the host). Returns (tokens, argmax, steps done, stopped) after each.
  using StepLogits = nb::ndarray<const float, nb::ndim<3>, nb::c_contig, nb::device::cpu>;
  s.def("denoise_steps", [](StepLogits logits, const std::vector<int32_t>& tokens, const std::vector<int32_t>& pinned,
                            std::vector<int32_t> allowed_ids, float t_min, float t_max, int max_steps,
                            float entropy_bound, int stability, float confidence, uint64_t seed, uint32_t block,
                            const std::string& device, bool host_update, float softcap) {
    const int64_t canvas = logits.shape(1), vocab = logits.shape(2);
    if (int64_t(tokens.size()) != canvas) throw InvalidArgument("denoise_steps: one token per canvas row");
    if (max_steps < 1) throw InvalidArgument("denoise_steps: max_steps must be >= 1");
    if (stability < 0) throw InvalidArgument("denoise_steps: stability must be >= 0");
    auto be = make_backend(device, 1);
    std::sort(allowed_ids.begin(), allowed_ids.end());
    allowed_ids.erase(std::unique(allowed_ids.begin(), allowed_ids.end()), allowed_ids.end());
    std::vector<uint8_t> free_position(canvas, 1);
    for (int32_t pos : pinned) free_position.at(pos) = 0;
    SamplingParams sampling;
    sampling.t_min = t_min;
    sampling.t_max = t_max;
    sampling.max_denoising_steps = max_steps;
    sampling.entropy_bound = entropy_bound;
    sampling.stability_threshold = stability;
    sampling.confidence_threshold = confidence;
    const CanvasParams p = canvas_params(sampling, int(canvas), int(vocab), softcap, seed, block, DType::F32,
                                         int(allowed_ids.size()));
    CanvasState state = new_canvas(*be, p, tokens, free_position, allowed_ids, vocab_bias(int(vocab), allowed_ids, {}));
    nb::list out;
    for (int64_t step = 0; step < int64_t(logits.shape(0)); ++step) {
      Activation a = be->alloc(canvas, vocab);
      be->from_host(logits.data() + step * canvas * vocab, a);
      if (host_update) be->Backend::denoise_step(a, state);
      else be->denoise_step(a, state);
      const CanvasReadout r = read_canvas(*be, state);
      std::vector<int32_t> now(canvas);
      be->read_bytes(now.data(), state.tokens, now.size() * sizeof(int32_t));
      out.append(nb::make_tuple(now, r.argmax, r.steps, r.stopped));
    }
    return out;
  }, nb::arg("logits"), nb::arg("tokens"), nb::arg("pinned"), nb::arg("allowed_ids"), nb::arg("t_min"),
     nb::arg("t_max"), nb::arg("max_steps"), nb::arg("entropy_bound"), nb::arg("stability"), nb::arg("confidence"),
     nb::arg("seed"), nb::arg("block"), nb::arg("device") = "cpu", nb::arg("host_update") = false,
     nb::arg("softcap") = 0.0f);
  // The stop rule one step at a time, as update_canvas applies it (less its last-step stop).
  struct StopRule {
    int stability;
    float confidence;
    std::vector<int32_t> history;
    int step = 0;
  };
  nb::class_<StopRule>(s, "StableAndConfident")
      .def("__init__", [](StopRule* self, int stability, float confidence) {
        new (self) StopRule{stability, confidence, {}, 0};
      }, nb::arg("stability_threshold"), nb::arg("confidence_threshold"))
      .def("__call__", [](StopRule& self, const std::vector<int32_t>& argmax, float mean_entropy) {
        self.history.resize(size_t(std::max(self.stability, 0)) * argmax.size());
        const bool stable = stable_argmax(self.history.data(), self.step++, argmax.data(), int(argmax.size()),
                                          self.stability);
        return stable && mean_entropy < self.confidence;
      }, nb::arg("argmax_canvas"), nb::arg("mean_entropy"));
}

void bind_generate(nb::module_& m) {
  nb::class_<SamplingParams>(m, "SamplingParams")
      .def(nb::init<>())
      .def_rw("max_new_tokens", &SamplingParams::max_new_tokens)
      .def_rw("max_length", &SamplingParams::max_length)
      .def_rw("max_denoising_steps", &SamplingParams::max_denoising_steps)
      .def_rw("t_min", &SamplingParams::t_min)
      .def_rw("t_max", &SamplingParams::t_max)
      .def_rw("entropy_bound", &SamplingParams::entropy_bound)
      .def_rw("stability_threshold", &SamplingParams::stability_threshold)
      .def_rw("confidence_threshold", &SamplingParams::confidence_threshold)
      .def_rw("eos_token_ids", &SamplingParams::eos_token_ids)
      .def_rw("seed", &SamplingParams::seed, nb::arg().none())
      .def_rw("canvas_length", &SamplingParams::canvas_length)
      .def_rw("seed_canvas", &SamplingParams::seed_canvas)
      .def_rw("pinned_positions", &SamplingParams::pinned_positions)
      .def_rw("allowed_token_ids", &SamplingParams::allowed_token_ids)
      .def_rw("logit_bias", &SamplingParams::logit_bias)
      .def_rw("self_conditioning", &SamplingParams::self_conditioning)
      .def_rw("fit_to_context", &SamplingParams::fit_to_context);
  nb::class_<GenerationOutput>(m, "GenerationOutput")
      .def_ro("token_ids", &GenerationOutput::token_ids)
      .def_ro("finish_reason", &GenerationOutput::finish_reason)
      .def_ro("error", &GenerationOutput::error)
      .def_ro("denoise_steps", &GenerationOutput::denoise_steps)
      .def_ro("tokens_per_forward", &GenerationOutput::tokens_per_forward)
      .def_ro("seed", &GenerationOutput::seed);
  nb::class_<StepPlan>(m, "StepPlan")
      .def(nb::init<uint64_t, int64_t>(), nb::arg("id"), nb::arg("max_encode_tokens"));
  // Each call waits for the model's turn, which another thread's pass (Engine.step, a
  // Sequence's) may hold for seconds: without the GIL, as without_gil says.
  const auto unlocked = nb::call_guard<GilReleased>();
  nb::class_<Engine>(m, "Engine")
      .def(nb::init<std::shared_ptr<Model>, bool>(), nb::arg("model"), nb::arg("fuse_commit") = true)
      .def_prop_ro("passes", [](const Engine& self) { return without_gil([&] { return self.passes(); }); })
      // (The params copied with the GIL held: another Python thread may change them meanwhile.)
      .def("add", [](Engine& self, uint64_t id, std::vector<int32_t> prompt, SamplingParams params) {
             GilReleased release;
             self.add(id, std::move(prompt), params);
           }, nb::arg("id"), nb::arg("prompt"), nb::arg("params"))
      .def("admit", &Engine::admit, nb::arg("id"), nb::arg("encode_tokens"), unlocked)
      .def("reserve", &Engine::reserve, nb::arg("id"), nb::arg("encode_tokens"), unlocked)
      .def("preempt", &Engine::preempt, nb::arg("id"), unlocked)
      .def("abort", &Engine::abort, nb::arg("id"), unlocked)
      .def("pending_tokens", &Engine::pending_tokens, nb::arg("id"), unlocked)
      .def("canvas_length", &Engine::canvas_length, nb::arg("id"), unlocked)
      .def("generated", &Engine::generated, nb::arg("id"), unlocked)
      .def("draft", &Engine::draft, nb::arg("id"), unlocked)
      .def("denoise_steps", &Engine::denoise_steps, nb::arg("id"), unlocked)
      .def("step", &Engine::step, nb::arg("plan"), nb::arg("max_steps"), nb::arg("max_batched_tokens"), unlocked)
      .def("take_finished", &Engine::take_finished, unlocked)
      .def("interrupt", &Engine::interrupt)
      .def("__len__", &Engine::size, unlocked);
}

}  // namespace

NB_MODULE(_core, m) {
  m.doc() = "diffuserve native runtime";
  nb::exception<FormatError>(m, "CheckpointError", PyExc_ValueError);
  m.def("cuda_available", &cuda_available);
  // The container limits the CPU backend sizes its default KV cache and threads by, as
  // (memory bytes, CPUs), 0 for none: read from given files, for the tests' own groups.
  m.def(
      "cgroup_limits",
      [](const std::string& proc_self_cgroup, const std::string& root) {
        const CgroupLimits limits = cgroup_limits(proc_self_cgroup, root);
        return std::make_pair(limits.memory_bytes, limits.cpus);
      },
      nb::arg("proc_self_cgroup") = "/proc/self/cgroup", nb::arg("root") = "/sys/fs/cgroup");
  main_thread = nb::cast<unsigned long>(nb::module_::import_("threading").attr("main_thread")().attr("ident"));
  nb::module_::import_("atexit").attr("register")(nb::cpp_function(at_exit));
  // The safetensors files a load of checkpoint directory `dir` reads, checked as a load checks
  // them (the single file or the index's shards): what `diffuserve quantize` converts.
  m.def("weight_files", [](const std::string& dir) {
    GilReleased release;
    const Checkpoint checkpoint(dir);
    std::set<std::string> files;
    for (const auto& [name, view] : checkpoint.tensors()) files.insert(view.file);
    return std::vector<std::string>(files.begin(), files.end());
  });

  nb::class_<Model>(m, "Model")
      .def_static(
          "load",
          [](const std::string& path, const std::string& device, const std::string& dtype, int num_threads,
             int64_t kv_cache_memory_bytes, int kv_block_size, int max_num_seqs, const std::string& load_format,
             const std::string& quantization, const std::string& activations, const std::string& kv_cache_dtype,
             int64_t max_model_len) {
            GilReleased release;
            return Model::load(path, LoadOptions{device, dtype, num_threads, kv_cache_memory_bytes, kv_block_size,
                                                 max_num_seqs, load_format, quantization, activations, kv_cache_dtype,
                                                 max_model_len});
          },
          nb::arg("path"), nb::arg("device") = "cpu", nb::arg("dtype") = "", nb::arg("num_threads") = 0,
          nb::arg("kv_cache_memory_bytes") = 0, nb::arg("kv_block_size") = 16, nb::arg("max_num_seqs") = 64,
          nb::arg("load_format") = "auto", nb::arg("quantization") = "", nb::arg("activations") = "float32",
          nb::arg("kv_cache_dtype") = "auto", nb::arg("max_model_len") = 0)
      .def_prop_ro("config", [](const Model& self) { return config_dict(self.config()); })
      .def_prop_ro("dtype", [](const Model& self) { return std::string(dtype_name(self.weight_dtype())); })
      .def_prop_ro("kv_cache_dtype", [](const Model& self) { return std::string(dtype_name(self.kv_cache_dtype())); })
      .def_prop_ro("device", &Model::device)
      .def("sequence", &Model::new_sequence, nb::arg("canvas_length") = 0)
      .def_prop_ro("max_sequence_tokens", &Model::max_sequence_tokens, nb::call_guard<GilReleased>())
      .def("sampling_defaults", [](const Model& self) { return sampling_defaults(self.config()); })
      .def("cache_stats", [](const Model& self) {
        const CacheStats s = without_gil([&] { return self.cache_stats(); });
        nb::dict d;
        d["kv_blocks_total"] = s.blocks_total;
        d["kv_blocks_free"] = s.blocks_free;
        d["prefix_cache_queries"] = s.prefix_cache_queries;
        d["prefix_cache_hits"] = s.prefix_cache_hits;
        return d;
      });

  nb::class_<Sequence>(m, "Sequence")
      .def("prefill",
           [](Sequence& self, IdArray ids) {
             GilReleased release;
             self.prefill(ids_of(ids));
           })
      .def("commit",
           [](Sequence& self, IdArray ids) {
             GilReleased release;
             self.commit(ids_of(ids));
           })
      .def(
          "denoise",
          [](Sequence& self, IdArray canvas, std::optional<LogitsIn> sc) {
            const int vocab = self.config().vocab_size;
            const size_t rows = size_t(self.canvas_length());
            std::vector<float> logits;
            {
              // The canvas first (an empty sequence, a canvas of another length), then the
              // logits against the sequence's canvas length: a canvas's fault had been blamed on
              // them. (Checked within the call's one release of the GIL: each release is a
              // return at which a daemon thread may meet the interpreter's exit.)
              GilReleased release;
              self.check_canvas(ids_of(canvas));
              if (sc && (sc->shape(0) != rows || sc->shape(1) != size_t(vocab)))
                throw InvalidArgument("denoise: self_conditioning_logits must have shape [" + std::to_string(rows) +
                                      ", " + std::to_string(vocab) + "], got [" + std::to_string(sc->shape(0)) +
                                      ", " + std::to_string(sc->shape(1)) + "]");
              logits = self.denoise(ids_of(canvas), sc ? std::span<const float>(sc->data(), sc->size())
                                                       : std::span<const float>());
            }
            return to_numpy(std::move(logits), {canvas.shape(0), size_t(vocab)});
          },
          nb::arg("canvas"), nb::arg("self_conditioning_logits").none())
      .def("__len__", &Sequence::length, nb::call_guard<GilReleased>())
      .def_prop_ro("canvas_length", &Sequence::canvas_length)
      .def("kv_blocks", [](const Sequence& self) {
        const auto [full, sliding] = without_gil([&] { return self.kv_blocks(); });
        nb::dict d;
        d["full"] = full;
        d["sliding"] = sliding;
        return d;
      })
      .def("kv", [](const Sequence& self, int layer) {
        LayerKV kv = without_gil([&] { return self.kv(layer); });
        const size_t h = kv.kv_heads, r = kv.rows, d = kv.head_dim;
        return nb::make_tuple(to_numpy(std::move(kv.keys), {h, r, d}), to_numpy(std::move(kv.values), {h, r, d}),
                              kv.first_position);
      });

  bind_generate(m);
  bind_sampler(m);
}
