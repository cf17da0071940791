// Drives diffuserve's C++ API with bad and edge input, one case per command-line argument:
//
//   api_edges CHECKPOINT_DIR CASE...
//
// Each case prints "CASE: ok ..." or "CASE: <exception type>: <message>"; tests/test_cpp_api.py
// checks that every bad input is an exception naming what is wrong (never a crash or a hang).
#include <atomic>
#include <chrono>
#include <cstdio>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <stop_token>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "diffuserve/diffuserve.h"
#include "diffuserve/dtype.h"
#include "diffuserve/engine.h"
#include "diffuserve/errors.h"
#include "diffuserve/generate.h"

using namespace diffuserve;

namespace {

std::shared_ptr<Model> load(const std::string& dir, int64_t kv_bytes = 0) {
  LoadOptions options;
  options.num_threads = 1;
  options.kv_cache_memory_bytes = kv_bytes;
  return Model::load(dir, options);
}

SamplingParams params(const Model& model, int max_new_tokens) {
  SamplingParams p = sampling_defaults(model.config());
  p.max_new_tokens = max_new_tokens;
  p.seed = 1;
  return p;
}

// An engine holding request 1 (prompt {2, 3}, 16 new tokens), admitted with KV for its prompt.
std::unique_ptr<Engine> admitted_engine(const std::string& dir) {
  auto model = load(dir);
  auto engine = std::make_unique<Engine>(model);
  engine->add(1, {2, 3}, params(*model, 16));
  engine->admit(1, 2);
  return engine;
}

// A new sequence of `model` with the prompt {2, 3} prefilled.
std::unique_ptr<Sequence> prefilled(Model& model) {
  auto seq = model.new_sequence();
  seq->prefill(std::vector<int32_t>{2, 3});
  return seq;
}

// A case: generate() with one of SamplingParams' float fields set to +inf.
std::function<std::string(const std::string&)> generate_with_infinite(float SamplingParams::*field) {
  return [field](const std::string& dir) {
    auto model = load(dir);
    SamplingParams p = params(*model, 16);
    p.*field = std::numeric_limits<float>::infinity();
    generate(*model, {{2, 3}}, {p});
    return std::string("generated");
  };
}

// A case: generate() with `bias` as the logit_bias.
std::function<std::string(const std::string&)> generate_with_logit_bias(std::vector<std::pair<int32_t, float>> bias) {
  return [bias](const std::string& dir) {
    auto model = load(dir);
    SamplingParams p = params(*model, 16);
    p.logit_bias = bias;
    generate(*model, {{2, 3}}, {p});
    return std::string("generated");
  };
}

// Prefills `seq` until the cache takes no more tokens; returns how many it holds.
int64_t fill(Sequence& seq) {
  for (int chunk = 4096; chunk >= 1; chunk /= 2) {
    const std::vector<int32_t> ids(chunk, 3);
    for (;;) {
      try {
        seq.prefill(ids);
      } catch (const InvalidArgument&) {
        break;
      }
    }
  }
  return seq.length();
}

const std::map<std::string, std::function<std::string(const std::string&)>> kCases = {
    {"negative_num_threads",
     [](const std::string& dir) {
       LoadOptions options;
       options.num_threads = -1;
       Model::load(dir, options);
       return std::string("loaded");
     }},
    // generate() with the rest of the cache held by another sequence of the model: its
    // prompt fits, its first block's commit does not.
    {"generate_with_the_cache_held",
     [](const std::string& dir) {
       auto model = load(dir, 1 << 20);
       const int64_t capacity = fill(*model->new_sequence());  // every token the full-attention pool holds
       auto held = model->new_sequence();
       held->prefill(std::vector<int32_t>(capacity - 16, 5));  // all but one KV block of 16 tokens
       generate(*model, {{2, 3}}, {params(*model, 2 * model->config().canvas_length)});
       return std::string("generated");
     }},
    // A 300-token prompt where the sliding-window layers keep room for one sequence's window
    // (max_num_seqs 1): it had been refused as not fitting the cache, nearly every block free.
    {"generate_a_prompt_longer_than_the_sliding_pool",
     [](const std::string& dir) {
       LoadOptions options;
       options.num_threads = 1;
       options.max_num_seqs = 1;
       auto model = Model::load(dir, options);
       std::vector<int32_t> prompt;
       for (int i = 0; i < 300; ++i) prompt.push_back(i * 7 % 64);
       const std::vector<GenerationOutput> outputs = generate(*model, {prompt}, {params(*model, 16)});
       std::string ids;
       for (int32_t id : outputs.front().token_ids) ids += (ids.empty() ? "" : ",") + std::to_string(id);
       return ids;
     }},
    {"kv_too_small_for_max_new_tokens",
     [](const std::string& dir) {
       auto model = load(dir, 1 << 20);
       generate(*model, {{2, 3}}, {params(*model, 100000)});
       return std::string("generated");
     }},
    // transformers' max_length with max_new_tokens at its default (256): prompt + new tokens
    // capped at it, the last block cut.
    {"max_length_caps_new_tokens",
     [](const std::string& dir) {
       auto model = load(dir);
       SamplingParams p = params(*model, 256);
       p.max_length = 2 + 5;
       p.eos_token_ids.clear();
       const GenerationOutput out = generate(*model, {{2, 3}}, {p}).front();
       return std::to_string(out.token_ids.size()) + " tokens, " + out.finish_reason;
     }},
    {"max_length_leaves_no_room",
     [](const std::string& dir) {
       auto model = load(dir);
       SamplingParams p = params(*model, 256);
       p.max_length = 2;
       generate(*model, {{2, 3}}, {p});
       return std::string("generated");
     }},
    {"step_plans_a_request_twice",
     [](const std::string& dir) {
       auto model = load(dir);
       Engine engine(model);
       engine.add(1, {2, 3}, params(*model, 16));
       engine.admit(1, 100);
       for (int i = 0; i < 50 && engine.size(); ++i) engine.step({{1, 100}, {1, 100}}, 100, 1000);
       return std::string("stepped");
     }},
    // Infinite bounds had been taken (Python's SamplingParams refuses them).
    {"infinite_entropy_bound", generate_with_infinite(&SamplingParams::entropy_bound)},
    {"infinite_confidence_threshold", generate_with_infinite(&SamplingParams::confidence_threshold)},
    {"logit_bias_naming_a_token_twice", generate_with_logit_bias({{5, 1.0f}, {3, 2.0f}, {5, -1.0f}})},
    {"logit_bias_of_nan", generate_with_logit_bias({{5, std::numeric_limits<float>::quiet_NaN()}})},
    {"logit_bias_past_the_vocabulary", generate_with_logit_bias({{-2, 1.0f}})},
    // A path the OS refuses to look up (too long) had escaped as std::filesystem_error.
    {"load_a_path_too_long",
     [](const std::string& dir) {
       load(dir + "/" + std::string(5000, 'x'));
       return std::string("loaded");
     }},
    {"engine_of_no_model",
     [](const std::string&) {
       Engine engine(nullptr);  // (it had crashed)
       return std::string("constructed");
     }},
    {"admit_negative_tokens",
     [](const std::string& dir) {
       auto model = load(dir);
       Engine engine(model);
       engine.add(1, {2, 3}, params(*model, 16));
       return std::string(engine.admit(1, -5) ? "admitted" : "refused");
     }},
    {"reserve_negative_tokens",
     [](const std::string& dir) { return std::string(admitted_engine(dir)->reserve(1, -1) ? "reserved" : "refused"); }},
    {"step_zero_max_steps",
     [](const std::string& dir) {
       return "finished " + std::to_string(admitted_engine(dir)->step({{1, 2}}, 0, 100).size());
     }},
    {"step_zero_max_batched_tokens",
     [](const std::string& dir) {
       return "finished " + std::to_string(admitted_engine(dir)->step({{1, 2}}, 4, 0).size());
     }},
    {"step_canvas_past_max_batched_tokens",
     [](const std::string& dir) {
       // (its 2 prompt tokens all planned: the step would denoise it, and 2 rows hold no canvas)
       return "finished " + std::to_string(admitted_engine(dir)->step({{1, 2}}, 4, 2).size());
     }},
    {"step_cuts_a_prompt_chunk_to_the_rows",
     [](const std::string& dir) {
       auto model = load(dir);
       Engine engine(model);
       engine.add(1, std::vector<int32_t>(40, 3), params(*model, 16));
       engine.admit(1, 40);
       engine.step({{1, 40}}, 1, engine.canvas_length(1));
       return "pending " + std::to_string(engine.pending_tokens(1)) + " of canvas " +
              std::to_string(engine.canvas_length(1));
     }},
    // One row of self-conditioning logits where the canvas needs canvas x vocab: a bare pointer
    // had been read past its end.
    {"denoise_with_one_row_of_self_conditioning",
     [](const std::string& dir) {
       auto model = load(dir);
       auto seq = prefilled(*model);
       const std::vector<int32_t> canvas(seq->canvas_length(), 4);
       const std::vector<float> one_row(model->config().vocab_size, 0.0f);
       seq->denoise(canvas, one_row);
       return std::string("denoised");
     }},
    // A first prefill the cache as it is cannot take (another sequence holds most of it): refused
    // whole before any chunk is encoded, naming its tokens (it had been refused a chunk's way
    // in, naming the chunk).
    {"prefill_past_the_room_other_sequences_leave",
     [](const std::string& dir) {
       LoadOptions options;
       options.num_threads = 1;
       options.kv_cache_memory_bytes = 1 << 20;
       options.max_num_seqs = 1;
       auto model = Model::load(dir, options);
       auto other = model->new_sequence();
       const int64_t capacity = fill(*other);
       other = model->new_sequence();
       other->prefill(std::vector<int32_t>(capacity / 2, 5));
       auto seq = model->new_sequence();
       try {
         seq->prefill(std::vector<int32_t>(capacity - 8, 6));
       } catch (const InvalidArgument& e) {
         return std::string("refused with ") + std::to_string(seq->length()) + " tokens encoded: " + e.what();
       }
       return std::string("prefilled");
     }},
    // The pointer form, as the API first took the logits: the same logits as the span form's.
    {"denoise_with_logits_by_pointer",
     [](const std::string& dir) {
       auto model = load(dir);
       auto seq = prefilled(*model);
       const std::vector<int32_t> canvas(seq->canvas_length(), 4);
       const std::vector<float> first = seq->denoise(canvas, nullptr);
       const bool same = seq->denoise(canvas, first.data()) == seq->denoise(canvas, first) &&
                         first == seq->denoise(canvas);
       return std::string(same ? "same" : "different");
     }},
    {"read_floats_of_a_negative_count",
     [](const std::string&) {
       const float x = 1.0f;
       read_floats(&x, DType::F32, -1);
       return std::string("read");
     }},
    // generate() with a stop requested before the call, and from another thread during a
    // generation of 100,000 tokens: Cancelled, and the model generates again after it.
    {"generate_stopped_before",
     [](const std::string& dir) {
       auto model = load(dir);
       std::stop_source stop;
       stop.request_stop();
       generate(*model, {{2, 3}}, {params(*model, 16)}, stop.get_token());
       return std::string("generated");
     }},
    {"generate_stopped_during",
     [](const std::string& dir) {
       auto model = load(dir);
       SamplingParams long_run = params(*model, 100000);
       long_run.eos_token_ids = {};
       std::stop_source stop;
       std::chrono::steady_clock::time_point asked;
       std::jthread stopper([&] {
         std::this_thread::sleep_for(std::chrono::milliseconds(200));
         asked = std::chrono::steady_clock::now();
         stop.request_stop();
       });
       try {
         generate(*model, {{2, 3}, {4}}, {long_run}, stop.get_token());
       } catch (const Cancelled& e) {
         const auto took = std::chrono::steady_clock::now() - asked;
         const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(took).count();
         const size_t after = generate(*model, {{2, 3}}, {params(*model, 16)}).front().token_ids.size();
         return std::string(e.what()) + "; returned " + std::to_string(ms) + " ms after the stop; then generated " +
                std::to_string(after);
       }
       return std::string("not stopped");
     }},
    // A stop while another thread's call holds the model (its one request of 100,000 tokens
    // holds it throughout) ends the wait: the stop had waited out the other call.
    {"generate_stopped_while_another_thread_holds_the_model",
     [](const std::string& dir) {
       auto model = load(dir);
       SamplingParams long_run = params(*model, 100000);
       long_run.eos_token_ids = {};
       std::stop_source other_stop, stop;
       std::atomic<bool> other_running{true};
       std::jthread other([&] {
         try {
           generate(*model, {{2, 3}}, {long_run}, other_stop.get_token());
         } catch (const Cancelled&) {
         }
         other_running = false;
       });
       std::jthread deadline([&] {  // (so that a wait that does not end at the stop ends at all)
         for (int i = 0; i < 2000 && !other_stop.stop_requested(); ++i)
           std::this_thread::sleep_for(std::chrono::milliseconds(10));
         other_stop.request_stop();
       });
       std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the other call holds the model
       std::jthread stopper([&] {
         std::this_thread::sleep_for(std::chrono::milliseconds(200));
         stop.request_stop();
       });
       std::string result = "not stopped";
       try {
         generate(*model, {{4}}, {params(*model, 16)}, stop.get_token());
       } catch (const Cancelled& e) {
         result = std::string(e.what()) +
                  (other_running ? ", while the other call ran" : ", once the other call ended");
       }
       other_stop.request_stop();
       return result;
     }},
    {"step_negative_max_encode_tokens",
     [](const std::string& dir) {
       return "finished " + std::to_string(admitted_engine(dir)->step({{1, -1}}, 4, 100).size());
     }},
};

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s CHECKPOINT_DIR CASE...\n", argv[0]);
    return 2;
  }
  for (int i = 2; i < argc; ++i) {
    const auto it = kCases.find(argv[i]);
    if (it == kCases.end()) {
      std::fprintf(stderr, "unknown case %s\n", argv[i]);
      return 2;
    }
    std::string result;
    try {
      result = "ok " + it->second(argv[1]);
    } catch (const InvalidArgument& e) {
      result = std::string("InvalidArgument: ") + e.what();
    } catch (const FormatError& e) {
      result = std::string("FormatError: ") + e.what();
    } catch (const Cancelled& e) {
      result = std::string("Cancelled: ") + e.what();
    } catch (const std::exception& e) {
      result = std::string("std::exception: ") + e.what();
    }
    std::printf("%s: %s\n", argv[i], result.c_str());
    std::fflush(stdout);
  }
  return 0;
}
