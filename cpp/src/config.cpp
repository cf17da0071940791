// config.json / generation_config.json -> ModelConfig. Anything we would otherwise have
// to guess at (an unknown rope type, an activation we do not implement, an override we do
// not understand) is refused with the file and field named, so a checkpoint never loads
// into a model that silently computes something else.
#include "diffuserve/config.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <system_error>

#include "diffuserve/errors.h"
#include "diffuserve/generate.h"
#include "json.h"
#include "safetensors.h"

namespace diffuserve {
namespace {

// Typed field access with errors that name the file and the dotted field path.
struct Fields {
  const json::Value& obj;
  std::string file;
  std::string prefix;  // "text_config." etc.

  [[noreturn]] void fail(const std::string& key, const std::string& why) const {
    throw FormatError(file + ": " + prefix + key + " " + why);
  }
  const json::Value* get(const std::string& key) const {
    const json::Value* v = obj.find(key);
    return (v && !v->is_null()) ? v : nullptr;
  }
  int64_t integer(const std::string& key, int64_t lo, int64_t hi) const {
    const json::Value* v = get(key);
    if (!v) fail(key, "is missing");
    return checked_integer(key, *v, lo, hi);
  }
  int64_t integer_or(const std::string& key, int64_t fallback, int64_t lo, int64_t hi) const {
    const json::Value* v = get(key);
    return v ? checked_integer(key, *v, lo, hi) : fallback;
  }
  int64_t checked_integer(const std::string& key, const json::Value& v, int64_t lo, int64_t hi) const {
    if (!v.is_number() || !v.is_integer) fail(key, "must be an integer");
    if (v.integer < lo || v.integer > hi)
      fail(key, "= " + std::to_string(v.integer) + " is out of range [" + std::to_string(lo) + ", " +
                    std::to_string(hi) + "]");
    return v.integer;
  }
  double number_or(const std::string& key, double fallback) const {
    const json::Value* v = get(key);
    if (!v) return fallback;
    if (!v->is_number() || !std::isfinite(v->number)) fail(key, "must be a finite number");
    return v->number;
  }
  // A number the runtime keeps as a float32, which it must fit (1e300 would be infinite).
  float float_or(const std::string& key, float fallback) const {
    const double v = number_or(key, fallback);
    if (std::fabs(v) > double(std::numeric_limits<float>::max())) {
      char text[32];
      std::snprintf(text, sizeof text, "%g", v);
      fail(key, std::string("= ") + text + " does not fit a 32-bit float");
    }
    return float(v);
  }
  std::string string_or(const std::string& key, const std::string& fallback) const {
    const json::Value* v = get(key);
    if (!v) return fallback;
    if (!v->is_string()) fail(key, "must be a string");
    return v->string;
  }
  bool bool_or(const std::string& key, bool fallback) const {
    const json::Value* v = get(key);
    if (!v) return fallback;
    if (!v->is_bool()) fail(key, "must be true or false");
    return v->boolean;
  }
  std::vector<std::string> string_list(const std::string& key) const {
    const json::Value* v = get(key);
    std::vector<std::string> out;
    if (!v) return out;
    if (!v->is_array()) fail(key, "must be a list of strings");
    for (const auto& e : v->array) {
      if (!e.is_string()) fail(key, "must be a list of strings");
      out.push_back(e.string);
    }
    return out;
  }
  // An int or a list of ints, each a 32-bit one (eos_token_id is either).
  std::vector<int32_t> int_list_or_empty(const std::string& key) const {
    const json::Value* v = get(key);
    std::vector<int32_t> out;
    if (!v) return out;
    if (v->is_array()) {
      for (const auto& e : v->array) out.push_back(int32_t(checked_integer(key, e, INT32_MIN, INT32_MAX)));
    } else {
      out.push_back(int32_t(checked_integer(key, *v, INT32_MIN, INT32_MAX)));
    }
    return out;
  }
};

constexpr int64_t kMaxDim = 1 << 24;
// config.json and generation_config.json are a few KB (a compressed-tensors ignore list of
// every expert a few MB); parsed whole, as they are, 16 MB could take over a GB as json::Values.
constexpr uint64_t kMaxConfigBytes = 16ull * 1000 * 1000;

// 1 / theta^(k/dim), rounded at each step as HF's fp32 tensor arithmetic rounds it, so
// positions in the thousands still give the reference's angles to the last bit or two.
float inv_freq_fp32(double theta, int k, int dim) {
  const float exponent = float(k) / float(dim);
  const float power = float(std::pow(double(float(theta)), double(exponent)));
  return 1.0f / power;
}

// What transformers fills a layer type's RoPE dict with where the dict lacks it
// (standardize_rope_params): text_config's own rope_theta and partial_rotary_factor.
struct RopeDefaults {
  std::optional<double> theta;  // none: a dict without rope_theta is an error (transformers fails on it)
  double partial = 1.0;
};

// Inverse frequencies as HF's rope init functions compute them, always head_dim/2 long.
// rope_types whose frequencies depend on the sequence length (longrope) or that scale cos
// and sin (yarn's attention factor) are refused by name.
std::vector<float> rope_inv_freq(const Fields& rope, int head_dim, const RopeDefaults& defaults) {
  // "type": the key's older name, which transformers still reads where rope_type is absent.
  const std::string type = rope.get("rope_type") ? rope.string_or("rope_type", "") : rope.string_or("type", "default");
  if (!rope.get("rope_theta") && !defaults.theta)
    rope.fail("rope_theta", "is missing (and text_config gives no rope_theta to fill it from)");
  const double theta = rope.number_or("rope_theta", defaults.theta.value_or(0.0));
  const double partial = rope.number_or("partial_rotary_factor", defaults.partial);
  const double factor = rope.number_or("factor", 1.0);
  if (theta <= 0) rope.fail("rope_theta", "must be > 0");
  // 0 is proportional RoPE without rotation (transformers' NoPE layers).
  if (!(partial >= 0 && partial <= 1)) rope.fail("partial_rotary_factor", "must be in [0, 1]");
  std::vector<float> inv(head_dim / 2, 0.0f);
  // default, linear, dynamic and llama3 rotate int(head_dim * partial) dims but transformers
  // still applies the embedding to the whole head, which only works for partial == 1.
  auto whole_head = [&] {
    if (partial != 1.0) rope.fail("partial_rotary_factor", "must be 1.0 for rope_type '" + type + "'");
    for (int i = 0; i < head_dim / 2; ++i) inv[i] = inv_freq_fp32(theta, 2 * i, head_dim);
  };
  auto positive = [&](const std::string& key, double v) {
    if (!(v > 0)) rope.fail(key, "must be > 0");
    return v;
  };
  if (type == "default") {
    whole_head();
  } else if (type == "dynamic") {
    // Dynamic NTK changes theta only past max_position_embeddings, where no position of this
    // engine goes (the runtime refuses longer sequences): below it transformers' frequencies
    // are default's.
    whole_head();
  } else if (type == "linear") {
    whole_head();
    const float f = float(positive("factor", rope.number_or("factor", 0.0)));
    for (float& x : inv) x /= f;
  } else if (type == "llama3") {
    whole_head();
    // transformers' _compute_llama3_parameters, in its fp32 tensor arithmetic (a scalar over a
    // tensor is the tensor's reciprocal times the scalar there).
    constexpr double kPi = 3.141592653589793;
    const float f = float(positive("factor", rope.number_or("factor", 0.0)));
    const double low = positive("low_freq_factor", rope.number_or("low_freq_factor", 0.0));
    const double high = positive("high_freq_factor", rope.number_or("high_freq_factor", 0.0));
    const double old_len =
        positive("original_max_position_embeddings", rope.number_or("original_max_position_embeddings", 0.0));
    if (high == low) rope.fail("high_freq_factor", "must differ from low_freq_factor");
    const float low_wavelen = float(old_len / low), high_wavelen = float(old_len / high);
    for (float& x : inv) {
      const float wavelen = (1.0f / x) * float(2 * kPi);
      const float scaled = wavelen > low_wavelen ? x / f : x;
      const float smooth = ((1.0f / wavelen) * float(old_len) - float(low)) / float(high - low);
      const float smoothed = (1.0f - smooth) * scaled / f + smooth * scaled;
      x = !(wavelen < high_wavelen) && !(wavelen > low_wavelen) ? smoothed : scaled;
    }
  } else if (type == "proportional") {
    // The first `angles` frequencies rotate with exponents over the whole head_dim; the
    // rest are 0 (no rotation), so the encoding still spans head_dim.
    const int angles = int(std::floor(partial * head_dim / 2));
    if (factor <= 0) rope.fail("factor", "must be > 0");
    for (int i = 0; i < angles && i < head_dim / 2; ++i) inv[i] = inv_freq_fp32(theta, 2 * i, head_dim) / float(factor);
  } else {
    rope.fail("rope_type",
              "'" + type + "' is not supported (supported: default, proportional, linear, dynamic, llama3)");
  }
  if (!std::all_of(inv.begin(), inv.end(), [](float x) { return std::isfinite(x); }))
    rope.fail(type == "default" ? "rope_theta" : "factor", "gives rotary frequencies that are not finite as float32");
  return inv;
}

// QuantizationArgs' strategy, which compressed-tensors infers from group_size where the file
// names none (a positive size: group; -1: channel; none: tensor), and which must then take a
// positive size (compressed-tensors refuses a size beside any other strategy).
std::string strategy_of(const Fields& args, int64_t group_size) {
  const std::string strategy =
      args.string_or("strategy", group_size > 0 ? "group" : group_size == -1 ? "channel" : "tensor");
  if (group_size > 0 && strategy != "group" && strategy != "tensor_group")
    args.fail("group_size", "= " + std::to_string(group_size) + " goes with strategy group or tensor_group, not '" +
                                strategy + "'");
  return strategy;
}

// A config group's input_activations (compressed-tensors' QuantizationArgs, whose
// defaults fill what the file leaves out) as the scheme it names; any other is refused
// with its settings spelled out.
ActivationScheme activation_scheme(const Fields& group) {
  const json::Value* v = group.get("input_activations");
  if (!v) return ActivationScheme::None;
  if (!v->is_object()) group.fail("input_activations", "must be an object or null");
  const Fields a{*v, group.file, group.prefix + "input_activations."};
  const int64_t bits = a.integer_or("num_bits", 8, 1, 64), group_size = a.integer_or("group_size", 0, -1, kMaxDim);
  const std::string type = a.string_or("type", "int"), strategy = strategy_of(a, group_size);
  const bool symmetric = a.bool_or("symmetric", true);
  std::string dynamic = "static";
  if (const json::Value* d = a.get("dynamic")) {
    if (d->is_bool()) dynamic = d->boolean ? "dynamic" : "static";
    else if (d->is_string() && d->string == "local") dynamic = "local dynamic";
    else a.fail("dynamic", "must be true, false or \"local\"");
  }
  if (type == "float" && bits == 8 && symmetric && strategy == "token" && dynamic == "dynamic")
    return ActivationScheme::Fp8Token;
  if (type == "float" && bits == 4 && symmetric && strategy == "tensor_group" && group_size == 16 &&
      dynamic == "local dynamic")
    return ActivationScheme::Nvfp4;
  const std::string grouped = group_size > 0 ? " of " + std::to_string(group_size) : "";
  group.fail("input_activations", "= " + std::string(symmetric ? "" : "asymmetric ") + dynamic + " " + strategy +
                                      grouped + " " + std::to_string(bits) + "-bit " + type +
                                      " is not supported (supported: dynamic token 8-bit float as in FP8_DYNAMIC, "
                                      "local dynamic tensor_group of 16 4-bit float as in NVFP4)");
}

// How a config group quantizes its targets' weights (QuantizationArgs, defaults filling what
// the file leaves out; null: it quantizes their inputs alone), which must be what `format`
// stores, the one kind of weights the loader reads for it. The tensors' scales are checked
// against the strategy as they load; settings the format's weights never have (integers,
// zero points, blocks) are refused here, by name.
std::optional<WeightScales> weight_scales(const Fields& group, const std::string& format) {
  const json::Value* v = group.get("weights");
  if (!v) return std::nullopt;
  if (!v->is_object()) group.fail("weights", "must be an object or null");
  const Fields w{*v, group.file, group.prefix + "weights."};
  const int64_t bits = w.integer_or("num_bits", 8, 1, 64), group_size = w.integer_or("group_size", 0, -1, kMaxDim);
  const std::string type = w.string_or("type", "int"), strategy = strategy_of(w, group_size);
  if (w.get("block_structure")) w.fail("block_structure", "is not supported (block-quantized weights)");
  // (compressed-tensors refuses it so: the scales' shape alone would say the groups)
  if ((strategy == "group" || strategy == "tensor_group") && group_size <= 0)
    w.fail("group_size", "must be a positive number of inputs for strategy '" + strategy + "'");
  const bool symmetric = w.bool_or("symmetric", true);
  const json::Value* d = w.get("dynamic");
  const bool dynamic = d && !(d->is_bool() && !d->boolean);  // scales computed at run time: not stored ones
  // (compressed-tensors labels FP8 weights without quantized inputs naive-quantized: the same tensors.)
  const bool fp8 = (format == "float-quantized" || format == "naive-quantized") && type == "float" && bits == 8 &&
                   (strategy == "tensor" || strategy == "channel" || strategy == "group");
  const bool nvfp4 = format == "nvfp4-pack-quantized" && type == "float" && bits == 4 && strategy == "tensor_group" &&
                     group_size == 16;
  if (!(fp8 || nvfp4) || !symmetric || dynamic)
    group.fail("weights", "= " + std::string(symmetric ? "" : "asymmetric ") + (dynamic ? "dynamic " : "") + strategy +
                              (group_size > 0 ? " of " + std::to_string(group_size) : "") + " " +
                              std::to_string(bits) + "-bit " + type + " does not go with format '" + format +
                              "' (float-quantized or naive-quantized: 8-bit float by tensor, channel or group; "
                              "nvfp4-pack-quantized: tensor_group of 16 4-bit float)");
  using Strategy = WeightScales::Strategy;
  if (strategy == "tensor") return WeightScales{Strategy::Tensor};
  if (strategy == "channel") return WeightScales{Strategy::Channel};
  return WeightScales{Strategy::Group, group_size};
}

// quantization_config (compressed-tensors) into `c`: the weights' format, and which linears
// quantize their inputs how. The KV cache and outputs are never quantized here.
void load_quantization(const Fields& f, ModelConfig& c) {
  const std::string method = f.string_or("quant_method", "");
  if (method != "compressed-tensors")
    f.fail("quant_method", "'" + method + "' is not supported (supported: compressed-tensors)");
  c.quantization = f.string_or("format", "");
  if (c.quantization != "float-quantized" && c.quantization != "naive-quantized" &&
      c.quantization != "nvfp4-pack-quantized")
    f.fail("format", "'" + c.quantization + "' is not supported (supported: float-quantized, naive-quantized, "
                     "nvfp4-pack-quantized)");
  if (f.get("kv_cache_scheme")) f.fail("kv_cache_scheme", "is not supported (the KV cache is not quantized)");
  // Settings that change what the stored weights mean, which the loader does not apply.
  // (LLM Compressor writes both as {} where there are none.)
  for (const auto& [key, why] : {std::pair<std::string, std::string>{"transform_config", "no transforms are applied"},
                                 {"sparsity_config", "the weights are read dense"}})
    if (const json::Value* v = f.get(key); v && !(v->is_object() && v->object.empty()))
      f.fail(key, "is not supported (" + why + ")");
  // "compressed": the quantized form the loader reads (frozen and earlier ones store the
  // weights unpacked beside their scales).
  if (const std::string status = f.string_or("quantization_status", "compressed"); status != "compressed")
    f.fail("quantization_status", "'" + status + "' is not supported (supported: compressed)");
  c.quantization_ignore = f.string_list("ignore");
  const json::Value* groups = f.get("config_groups");
  if (!groups) return;
  if (!groups->is_object()) f.fail("config_groups", "must be an object");
  std::set<std::string> targets;  // config groups apply in file order; one target in two would depend on it
  for (const auto& [name, value] : groups->object) {
    if (!value.is_object()) f.fail("config_groups." + name, "must be an object");
    const Fields g{value, f.file, f.prefix + "config_groups." + name + "."};
    if (g.get("output_activations")) g.fail("output_activations", "is not supported (outputs are not quantized)");
    if (const std::string format = g.string_or("format", c.quantization); format != c.quantization)
      g.fail("format", "'" + format + "' differs from quantization_config.format '" + c.quantization +
                           "' (mixed formats are not supported)");
    // (The weights first: a scheme whose weights are refused is named by them, not by its
    // activations.)
    QuantizationGroup group;
    group.weights = weight_scales(g, c.quantization);
    group.input = activation_scheme(g);
    group.targets = g.string_list("targets");
    for (const std::string& t : group.targets)
      if (!targets.insert(t).second) g.fail("targets", "names '" + t + "', which another config group also targets");
    c.quantization_groups.push_back(std::move(group));
  }
}

// The fields transformers' DiffusionGemmaGenerationConfig takes, which refuses any other (a
// min_new_tokens or a temperature there had been ignored): those that generation reads, the
// cache's (transformers' own choice of KV cache, not this engine's) and metadata.
const std::set<std::string> kGenerationFields = {
    // read here
    "max_new_tokens", "max_length", "max_denoising_steps", "sampler_config", "t_min", "t_max", "stability_threshold",
    "confidence_threshold", "eos_token_id", "pad_token_id",
    // transformers' own (its BOS, its KV cache, its return type) and metadata
    "bos_token_id", "cache_implementation", "cache_config", "disable_compile", "return_dict_in_generate",
    "transformers_version", "_from_model_config", "_commit_hash"};

// The KV caches transformers' generation config may name (it refuses any other). Its own choice
// of cache, which this engine's paged cache replaces: the results are those of its default,
// dynamic cache. (Its static cache gives other logits past a sliding window.)
const std::set<std::string> kCacheImplementations = {
    "static", "offloaded_static", "sliding_window", "hybrid", "hybrid_chunked", "offloaded_hybrid",
    "offloaded_hybrid_chunked", "dynamic", "offloaded", "quantized"};

GenerationDefaults load_generation(const std::string& path, int vocab_size) {
  GenerationDefaults g;
  std::error_code error;
  const bool present = std::filesystem::exists(path, error);
  if (error) throw FormatError(path + ": cannot be looked up: " + error.message());
  if (!present) return g;
  const json::Value doc = json::parse(read_text_file(path, kMaxConfigBytes), path);
  if (!doc.is_object()) throw FormatError(path + ": top level must be a JSON object");
  Fields f{doc, path, ""};
  for (const auto& [key, value] : doc.object)
    if (!kGenerationFields.count(key))
      f.fail(key, "is not a DiffusionGemma generation setting (transformers refuses it too)");
  g.max_new_tokens = int(f.integer_or("max_new_tokens", g.max_new_tokens, 1, INT32_MAX));
  g.max_length = int(f.integer_or("max_length", g.max_length, 1, INT32_MAX));  // transformers refuses 0 too
  g.length_given = f.get("max_new_tokens") || f.get("max_length");
  g.max_denoising_steps = int(f.integer_or("max_denoising_steps", g.max_denoising_steps, 1, INT32_MAX));
  g.t_min = f.float_or("t_min", g.t_min);
  g.t_max = f.float_or("t_max", g.t_max);
  g.stability_threshold = int(f.integer_or("stability_threshold", g.stability_threshold, 0, INT32_MAX));
  g.confidence_threshold = f.float_or("confidence_threshold", g.confidence_threshold);
  // As transformers writes it: {"entropy_bound": x, "_cls_name": "EntropyBoundSamplerConfig"},
  // the one sampler it has (it fails on any other name, field or a missing bound).
  if (const json::Value* s = f.get("sampler_config")) {
    if (!s->is_object()) f.fail("sampler_config", "must be an object");
    const Fields sampler{*s, path, "sampler_config."};
    for (const auto& [key, value] : s->object)
      if (key != "entropy_bound" && key != "_cls_name") sampler.fail(key, "is not a field of EntropyBoundSamplerConfig");
    if (const std::string name = sampler.string_or("_cls_name", ""); name != "EntropyBoundSamplerConfig")
      sampler.fail("_cls_name", "must be 'EntropyBoundSamplerConfig' (the one sampler), got '" + name + "'");
    if (!sampler.get("entropy_bound")) sampler.fail("entropy_bound", "is missing");
    g.entropy_bound = sampler.float_or("entropy_bound", g.entropy_bound);
  }
  if (const std::string cache = f.string_or("cache_implementation", "dynamic"); !kCacheImplementations.count(cache))
    f.fail("cache_implementation", "'" + cache + "' is not a KV cache transformers has (it refuses it too)");
  // Absent, null or [], no EOS: transformers then never stops early, whatever config.json names.
  // An id past the vocabulary (or below 0) is never generated: it ends nothing and is left out,
  // where transformers keeps it and runs the same.
  for (int32_t id : f.int_list_or_empty("eos_token_id"))
    if (id >= 0 && id < vocab_size) g.eos_token_ids.push_back(id);
  // Any integer is a pad id, as transformers takes it (null or absent: none), even one that no
  // token is (-1, say): it pads past the EOS with it, and leaves it out of tokens_per_forward.
  if (f.get("pad_token_id")) g.pad_token_id = int32_t(f.integer("pad_token_id", INT32_MIN, INT32_MAX));
  if (g.t_min < 0) f.fail("t_min", "must be >= 0");
  if (g.t_max <= g.t_min) f.fail("t_max", "must be > t_min");
  if (g.entropy_bound <= 0) f.fail("sampler_config.entropy_bound", "must be > 0");
  if (g.confidence_threshold <= 0) f.fail("confidence_threshold", "must be > 0");
  return g;
}

}  // namespace

ModelConfig load_config(const std::string& dir) {
  const std::string path = (std::filesystem::path(dir) / "config.json").string();
  const json::Value doc = json::parse(read_text_file(path, kMaxConfigBytes), path);
  if (!doc.is_object()) throw FormatError(path + ": top level must be a JSON object");
  Fields top{doc, path, ""};
  const std::string model_type = top.string_or("model_type", "");
  if (model_type != "diffusion_gemma")
    throw FormatError(path + ": model_type '" + model_type + "' is not supported (expected 'diffusion_gemma')");
  const json::Value* text = top.get("text_config");
  if (!text || !text->is_object()) top.fail("text_config", "is missing or not an object");
  Fields t{*text, path, "text_config."};

  // Fields that transformers' typed config refuses as null: read as absent (their defaults),
  // they had loaded a model no one asked for.
  // (The experts' sizes, which it takes as null, have no default: "is missing" below.)
  for (const char* key : {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                          "num_key_value_heads", "head_dim", "sliding_window", "max_position_embeddings",
                          "rms_norm_eps", "hidden_activation", "attention_bias", "tie_word_embeddings"})
    if (const json::Value* v = t.obj.find(key); v && v->is_null())
      t.fail(key, "is null, which transformers' config refuses: give a value, or leave the field out for its default");
  if (const json::Value* v = top.obj.find("tie_word_embeddings"); v && v->is_null())
    top.fail("tie_word_embeddings", "is null, which transformers' config refuses: give true or false, or leave it out");

  ModelConfig c;
  // Fields that transformers' DiffusionGemmaTextConfig gives a default take the same one; the
  // experts' have none there (its model cannot be built without them).
  c.vocab_size = int(t.integer_or("vocab_size", 262144, 1, INT32_MAX));
  c.hidden_size = int(t.integer_or("hidden_size", 2304, 1, kMaxDim));
  c.intermediate_size = int(t.integer_or("intermediate_size", 9216, 1, kMaxDim));
  c.num_layers = int(t.integer_or("num_hidden_layers", 30, 1, 4096));
  c.num_heads = int(t.integer_or("num_attention_heads", 8, 1, 4096));
  c.num_experts = int(t.integer("num_experts", 1, 65536));
  c.top_k_experts = int(t.integer("top_k_experts", 1, c.num_experts));
  c.moe_intermediate_size = int(t.integer("moe_intermediate_size", 1, kMaxDim));
  c.sliding_window = int(t.integer_or("sliding_window", 512, 1, INT32_MAX));  // >= 2 with a sliding layer (below)
  c.max_position_embeddings = t.integer_or("max_position_embeddings", 131072, 1, INT64_C(1) << 40);
  c.max_model_len = c.max_position_embeddings;  // (Model::load's max_model_len may lower it)
  c.rms_norm_eps = t.float_or("rms_norm_eps", 1e-6f);
  // transformers' DiffusionGemma divides the logits by it whatever it is: null (which other
  // Gemma configs read as "no softcapping", and which would otherwise take the default, 30)
  // fails there, and 0 makes every logit 0 or NaN.
  if (const json::Value* v = t.obj.find("final_logit_softcapping"); v && v->is_null())
    t.fail("final_logit_softcapping", "is null; give a number > 0 (transformers divides the logits by it)");
  c.final_logit_softcapping = t.float_or("final_logit_softcapping", 30.0f);
  // Any 32-bit ids, as transformers' config takes them (the engine reads neither: generation
  // takes generation_config.json's).
  c.pad_token_id = int(t.integer_or("pad_token_id", -1, INT32_MIN, INT32_MAX));
  c.bos_token_id = int(t.integer_or("bos_token_id", -1, INT32_MIN, INT32_MAX));
  c.canvas_length = int(top.integer_or("canvas_length", 256, 1, 1 << 20));
  // The top level's alone, as transformers reads it (DiffusionGemmaConfig's own field, true where
  // absent): text_config's does not untie the head (save_pretrained leaves it true there on an untied model).
  c.tie_word_embeddings = top.bool_or("tie_word_embeddings", true);
  // The top level's dtype alone is the model's (transformers' dtype="auto"); torch_dtype is its
  // older name, read where dtype is absent.
  c.dtype = top.get("dtype") ? top.string_or("dtype", "") : top.string_or("torch_dtype", "");
  if (!(c.final_logit_softcapping > 0))
    t.fail("final_logit_softcapping", "must be > 0 (transformers divides the logits by it)");
  if (c.rms_norm_eps <= 0) t.fail("rms_norm_eps", "must be > 0");

  // transformers' names for GELU: by its tanh approximation, or exactly (by erf).
  const std::string act = t.string_or("hidden_activation", "gelu_pytorch_tanh");
  const bool tanh_gelu = act == "gelu_pytorch_tanh" || act == "gelu_python_tanh" || act == "gelu_new" ||
                         act == "gelu_fast" || act == "gelu_accurate";
  c.exact_gelu = act == "gelu" || act == "gelu_python";
  if (!tanh_gelu && !c.exact_gelu)
    t.fail("hidden_activation", "'" + act + "' is not supported (GELU's tanh approximation is: gelu_pytorch_tanh, "
                                "gelu_python_tanh, gelu_new, gelu_fast, gelu_accurate; GELU by erf: gelu, gelu_python)");
  if (t.bool_or("attention_bias", false)) t.fail("attention_bias", "= true is not supported");
  // "all" makes the encoder bidirectional and halves the window; no DiffusionGemma uses it.
  const std::string bidirectional = t.string_or("use_bidirectional_attention", "");
  if (bidirectional == "all") t.fail("use_bidirectional_attention", "= 'all' is not supported");
  // "vision" concerns image tokens only, which a text engine never sees; transformers' config
  // refuses any other value.
  if (!bidirectional.empty() && bidirectional != "vision")
    t.fail("use_bidirectional_attention", "'" + bidirectional + "' is not one of null, 'vision' or 'all'");

  const int head_dim = int(t.integer_or("head_dim", 256, 1, kMaxDim));
  const int kv_heads = int(t.integer_or("num_key_value_heads", 4, 1, c.num_heads));

  // Absent, transformers makes every sixth layer full attention, the rest sliding.
  std::vector<std::string> layer_types;
  if (const json::Value* types = t.get("layer_types")) {
    if (!types->is_array() || int(types->array.size()) != c.num_layers)
      t.fail("layer_types", "must list one type per layer (" + std::to_string(c.num_layers) + ")");
    for (size_t i = 0; i < types->array.size(); ++i) {
      const json::Value& type = types->array[i];
      // "attention" is the legacy name transformers reads as "full_attention" (kept as written
      // here, for the shapes derived below).
      if (!type.is_string() ||
          (type.string != "sliding_attention" && type.string != "full_attention" && type.string != "attention"))
        t.fail("layer_types[" + std::to_string(i) + "]", "must be 'sliding_attention' or 'full_attention'");
      layer_types.push_back(type.string);
    }
  } else {
    for (int i = 0; i < c.num_layers; ++i) layer_types.push_back((i + 1) % 6 ? "sliding_attention" : "full_attention");
  }
  // rope_scaling, the field's deprecated name, replaces rope_parameters where given (as its
  // setter does in transformers); absent both, transformers' defaults.
  static const json::Value kDefaultRope = json::parse(
      R"({"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
          "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0}})",
      "transformers' default rope_parameters");
  const std::string rope_field = t.get("rope_scaling") ? "rope_scaling" : "rope_parameters";
  const json::Value* rope = t.get(rope_field) ? t.get(rope_field) : &kDefaultRope;
  if (!rope->is_object()) t.fail(rope_field, "must be an object");
  RopeDefaults rope_defaults;
  if (t.get("rope_theta")) {
    rope_defaults.theta = t.number_or("rope_theta", 0.0);
    if (!(*rope_defaults.theta > 0)) t.fail("rope_theta", "must be > 0");
  }
  rope_defaults.partial = t.number_or("partial_rotary_factor", 1.0);
  if (!(rope_defaults.partial >= 0 && rope_defaults.partial <= 1)) t.fail("partial_rotary_factor", "must be in [0, 1]");
  // Overrides by layer index. transformers writes the keys zero-padded to the widest index
  // ("05", "11" where a layer index has two digits) and reads them as integers: so does this.
  // Where config.json has no per_layer_config at all, transformers makes one (its text
  // config's __post_init__): every full-attention layer takes global_head_dim (512 where that
  // is not given either) and num_global_key_value_heads where given. So does this. (It does so
  // before it renames a legacy "attention" layer: such a layer, but the last, which it forces
  // to "full_attention" first, keeps head_dim; the check of one shape a type then refuses a
  // model with both, as transformers cannot build it.)
  const bool derived_overrides = !t.obj.find("per_layer_config");
  const int global_head_dim = derived_overrides ? int(t.integer_or("global_head_dim", 512, 1, kMaxDim)) : 0;
  const int global_kv_heads =
      derived_overrides ? int(t.integer_or("num_global_key_value_heads", kv_heads, 1, c.num_heads)) : 0;
  const json::Value* per_layer = t.get("per_layer_config");
  if (per_layer && !per_layer->is_object()) t.fail("per_layer_config", "must be an object");
  std::map<int, std::pair<std::string, const json::Value*>> overrides;  // layer -> (key, override)
  if (per_layer)
    for (const auto& [key, value] : per_layer->object) {
      const bool is_layer = !key.empty() && key.size() < 6 && std::all_of(key.begin(), key.end(), json::is_digit) &&
                            std::stoi(key) < c.num_layers;
      if (!is_layer) t.fail("per_layer_config." + key, "does not name a layer index below num_hidden_layers");
      const auto [at, added] = overrides.emplace(std::stoi(key), std::pair{key, &value});
      if (!added) t.fail("per_layer_config." + key, "names the same layer as per_layer_config." + at->second.first);
    }

  for (int i = 0; i < c.num_layers; ++i) {
    LayerConfig L;
    // transformers runs the last layer with full attention whatever layer_types says (its
    // config forces it, with a warning): so does this, to compute the same model.
    const bool last = i == c.num_layers - 1;
    const std::string kind = last || layer_types[i] == "attention" ? "full_attention" : layer_types[i];
    L.sliding = kind == "sliding_attention";
    L.has_v_proj = L.sliding;
    const bool global = derived_overrides && (last || layer_types[i] == "full_attention");
    L.head_dim = global ? global_head_dim : head_dim;
    L.num_kv_heads = global ? global_kv_heads : kv_heads;
    // The fields the two came from, for the errors below.
    std::string head_dim_field = global ? "global_head_dim" : "head_dim";
    std::string kv_heads_field = global && t.get("num_global_key_value_heads") ? "num_global_key_value_heads"
                                                                                : "num_key_value_heads";
    if (const auto found = overrides.find(i); found != overrides.end()) {
      const json::Value* o = found->second.second;
      const std::string where = "per_layer_config." + found->second.first + ".";
      if (!o->is_object()) t.fail(where, "must be an object");
      Fields f{*o, path, "text_config." + where};
      for (const auto& [key, value] : o->object)
        if (key != "head_dim" && key != "num_key_value_heads") f.fail(key, "is not a supported per-layer override");
      L.head_dim = int(f.integer_or("head_dim", L.head_dim, 1, kMaxDim));
      L.num_kv_heads = int(f.integer_or("num_key_value_heads", L.num_kv_heads, 1, c.num_heads));
      if (f.get("head_dim")) head_dim_field = where + "head_dim";
      if (f.get("num_key_value_heads")) kv_heads_field = where + "num_key_value_heads";
    }
    if (L.head_dim % 2)
      t.fail(head_dim_field, "= " + std::to_string(L.head_dim) + " must be even for RoPE (layer " + std::to_string(i) + ")");
    if (c.num_heads % L.num_kv_heads)
      t.fail(kv_heads_field, "= " + std::to_string(L.num_kv_heads) + " must divide num_attention_heads (layer " +
                                 std::to_string(i) + ")");
    const json::Value* rp = rope->find(kind);
    if (!rp || !rp->is_object()) t.fail(rope_field + "." + kind, "is missing or not an object");
    L.rope_inv_freq =
        rope_inv_freq(Fields{*rp, path, "text_config." + rope_field + "." + kind + "."}, L.head_dim, rope_defaults);
    c.layers.push_back(std::move(L));
  }
  // transformers makes one RoPE a layer type, from that type's shape, and cannot build a model
  // whose layers of one type differ in shape: refused here too, where it had run a model that
  // has no reference.
  for (int i = 1; i < c.num_layers; ++i) {
    const auto same_type = std::find_if(c.layers.begin(), c.layers.begin() + i,
                                        [&](const LayerConfig& l) { return l.sliding == c.layers[i].sliding; });
    if (same_type == c.layers.begin() + i) continue;
    const LayerConfig &first = *same_type, &layer = c.layers[i];
    // (Without per_layer_config, only a legacy "attention" layer can differ: it took no global shape.)
    if (layer.head_dim != first.head_dim || layer.num_kv_heads != first.num_kv_heads)
      t.fail(derived_overrides ? "layer_types" : "per_layer_config",
             std::string(derived_overrides ? "(a layer named 'attention' takes no global_head_dim: name it "
                                             "'full_attention') " : "") +
                 "gives layer " + std::to_string(i) + " head_dim " + std::to_string(layer.head_dim) + " and " +
                 std::to_string(layer.num_kv_heads) + " KV heads, where layer " +
                 std::to_string(same_type - c.layers.begin()) + ", also " +
                 (layer.sliding ? "sliding_attention" : "full_attention") + ", has head_dim " +
                 std::to_string(first.head_dim) + " and " + std::to_string(first.num_kv_heads) +
                 " KV heads: every layer of a type must have one shape (transformers makes one RoPE a type)");
  }
  // (Where a layer slides, transformers 5.25 runs a window of 1 inconsistently: its mask lets
  // an encoder token see only itself, while its cache then keeps every token, so that the
  // decoder reads the whole prefix. Where no layer slides it never reads the window.)
  if (c.sliding_window < 2 && std::any_of(c.layers.begin(), c.layers.end(), [](const LayerConfig& l) { return l.sliding; }))
    t.fail("sliding_window", "= " + std::to_string(c.sliding_window) + " must be >= 2 where a layer is sliding_attention");

  if (const json::Value* q = top.get("quantization_config")) {
    if (!q->is_object()) top.fail("quantization_config", "must be an object");
    load_quantization(Fields{*q, path, "quantization_config."}, c);
  }

  t.int_list_or_empty("eos_token_id");  // checked, though generation takes generation_config.json's
  const std::string generation_path = (std::filesystem::path(dir) / "generation_config.json").string();
  c.generation = load_generation(generation_path, c.vocab_size);
  // The defaults must pass a request's own checks too (the coldest step's temperature, the
  // canvases a block keeps): else every request that leaves them alone would fail, naming a
  // parameter it never set.
  try {
    validate(sampling_defaults(c), c);
  } catch (const InvalidArgument& e) {
    throw FormatError(generation_path + ": its defaults fail a request's checks: " + e.what());
  }
  return c;
}

}  // namespace diffuserve
