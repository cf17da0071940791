// DiffusionGemma's two passes over one shared Gemma-4 MoE backbone:
//   encoder: causal, over the prompt and each finished block; appends every layer's KV.
//   decoder: bidirectional over the canvas; reads the KV, never writes it; adds the
//            self-conditioning signal and ends in softcapped logits.
// Numerics follow transformers' modeling_diffusion_gemma.py (the oracle).
#include "model.h"

#include <algorithm>
#include <atomic>
#include <cassert>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <numeric>
#include <optional>
#include <regex>
#include <set>
#include <tuple>
#include <utility>

#include "activation_quant.h"
#include "diffuserve/errors.h"
#include "packed_weight.h"
#include "thread_pool.h"

namespace diffuserve {
namespace {

// Which config group of quantization_config applies to a linear, by compressed-tensors'
// rules (compressed_tensors.utils.match): none when an `ignore` entry matches it;
// otherwise the most specific target: its exact name, then the first matching "re:"
// regex in sorted order (anchored at the start, as Python's re.match), then the class
// "Linear" (every module asked about is a torch Linear). A base model's checkpoint (its
// tensors read under `base_prefix`, "model.") names its modules without that prefix, as
// compressed-tensors matched them in the base model.
class QuantizationTargets {
 public:
  QuantizationTargets(const ModelConfig& c, const std::string& path, std::string base_prefix)
      : base_prefix_(std::move(base_prefix)) {
    for (const QuantizationGroup& g : c.quantization_groups)
      for (const std::string& t : g.targets) targets_.push_back({pattern(t, path), {g.input, g.weights}});
    std::sort(targets_.begin(), targets_.end(), [](const auto& a, const auto& b) {
      return std::pair(a.first.regex.has_value(), a.first.text) < std::pair(b.first.regex.has_value(), b.first.text);
    });
    for (const std::string& t : c.quantization_ignore) ignore_.push_back(pattern(t, path));
  }

  // How the config quantizes `module`'s weights (none: not at all) and its input.
  std::optional<WeightScales> weight_scales(const std::string& module) const { return group_of(module).weights; }
  ActivationScheme input_scheme(const std::string& module) const { return group_of(module).input; }

 private:
  // What the group that takes `module` quantizes (nothing where none does).
  struct Quantized {
    ActivationScheme input = ActivationScheme::None;
    std::optional<WeightScales> weights;
  };
  Quantized group_of(const std::string& name) const {
    if (!base_prefix_.empty() && name == "lm_head") return {};  // a base model has none (its embedding serves)
    const std::string module = name.starts_with(base_prefix_) ? name.substr(base_prefix_.size()) : name;
    for (const Pattern& p : ignore_)
      if (p.names(module) || p.text == "Linear") return {};
    for (const auto& [p, quantized] : targets_)
      if (p.names(module)) return quantized;
    for (const auto& [p, quantized] : targets_)
      if (p.text == "Linear") return quantized;
    return {};
  }

  struct Pattern {
    std::string text;
    std::optional<std::regex> regex;  // of a "re:" target
    bool names(const std::string& module) const {
      return regex ? std::regex_search(module, *regex, std::regex_constants::match_continuous) : text == module;
    }
  };
  // libstdc++'s matcher backtracks by default: a pattern such as "(.|.)*X" took time
  // exponential in the name's length (a load that never ended). Its polynomial mode (an
  // extension) walks the states breadth-first; it takes no back-references, which are no
  // module names' business (pattern() refuses them first: libstdc++ 13's refusal crashed).
#ifdef __GLIBCXX__
  static constexpr std::regex::flag_type kSyntax = std::regex::ECMAScript | std::regex_constants::__polynomial;
#else
  static constexpr std::regex::flag_type kSyntax = std::regex::ECMAScript;
#endif
  static Pattern pattern(const std::string& text, const std::string& path) {
    if (!text.starts_with("re:")) return {text, std::nullopt};
    // std::regex compiles (and matches) by recursion, a frame per term and per group: a
    // pattern of 20,000 nested groups had overflowed the stack. Module names are short;
    // their patterns need neither many terms nor deep groups.
    constexpr size_t kMaxLength = 1024;
    constexpr int kMaxDepth = 32;
    int depth = 0, deepest = 0;
    bool back_reference = false;  // \1 .. \9, or \k<name>
    for (size_t i = 3; i < text.size(); ++i) {
      if (text[i] == '\\') {
        const char escaped = ++i < text.size() ? text[i] : '\0';
        back_reference |= (escaped >= '1' && escaped <= '9') || escaped == 'k';
      } else if (text[i] == '(') {
        deepest = std::max(deepest, ++depth);
      } else if (text[i] == ')') {
        --depth;
      }
    }
    if (text.size() > kMaxLength || deepest > kMaxDepth)
      throw FormatError(path + ": quantization_config: '" + text.substr(0, 64) + (text.size() > 64 ? "...'" : "'") +
                        " is longer than " + std::to_string(kMaxLength) + " characters or nests groups deeper than " +
                        std::to_string(kMaxDepth));
    if (back_reference)
      throw FormatError(path + ": quantization_config: '" + text + "' holds a back-reference, which this runtime's "
                        "matcher does not take");
    try {
      return {text, std::regex(ecmascript(text.substr(3)), kSyntax)};
    } catch (const std::regex_error&) {
      throw FormatError(path + ": quantization_config: '" + text + "' is not a regular expression this runtime reads");
    }
  }
  // Python's \A and \Z (the start and the end of the name) as ECMAScript's ^ and $, which
  // read them as the letters A and Z (a target ending in \Z had matched nothing). Names hold
  // no newlines, where the two would differ.
  static std::string ecmascript(const std::string& python) {
    std::string out;
    for (size_t i = 0; i < python.size(); ++i) {
      if (python[i] == '\\' && i + 1 < python.size()) {
        const char next = python[++i];
        out += next == 'A' ? std::string("^") : next == 'Z' ? std::string("$") : std::string{'\\', next};
      } else {
        out += python[i];
      }
    }
    return out;
  }
  std::string base_prefix_;
  std::vector<std::pair<Pattern, Quantized>> targets_;
  std::vector<Pattern> ignore_;
};

// Hands out checkpoint tensors by name, checking shape and dtype, and remembers which
// were taken so that leftovers can be reported. A linear weight may be stored quantized
// as compressed-tensors writes it (config.json's quantization_config): FP8 ("weight"
// in F8_E4M3 with "weight_scale" per tensor, channel or group) or NVFP4 ("weight_packed",
// two E2M1 values a byte, with an E4M3 "weight_scale" per 16 inputs and a fp32
// "weight_global_scale"). It is read as a PackedWeight, which the backend keeps packed
// if it can (Backend::keeps_packed), else dequantized here (packed_weight.h), so that the
// runtime's GEMMs see the same weights as the dequantized model. A linear's weight also
// carries how the config quantizes its input (ActivationQuant), with NVFP4's
// "input_global_scale". With no checkpoint (load_format "dummy") it makes random weights
// of the same shapes, the linears' packed as ModelState::dummy_quantization says.
class TensorSource {
 public:
  static inline const std::string kDecoder = "model.decoder.", kEncoder = "model.encoder.language_model.";
  // sizes_only: random weights (no checkpoint) are counted (random_bytes), not made.
  TensorSource(ModelState& m, DType as, bool sizes_only = false)
      : m_(m), as_(as), targets_(m.config, m.path, m.checkpoint ? m.checkpoint->added_prefix() : ""),
        sizes_only_(sizes_only) {}
  bool dummy() const { return !m_.checkpoint; }
  const std::string& path() const { return m_.path; }
  bool has(const std::string& name) const { return m_.checkpoint && find(name); }
  // Whether the checkpoint stores the weight `name` quantized (FP8, or NVFP4's weight_packed).
  bool stored_quantized(const std::string& name) const { return m_.checkpoint && is_packed(name); }
  // The encoder's weights are its own (load_weights): its modules are quantized as the config
  // says of them, not checked against the decoder's, and a tensor of the encoder's that the
  // checkpoint leaves out is its decoder twin's (`diffuserve quantize` writes only those that
  // differ; a partly untied encoder may store only those).
  void set_encoder_apart() { encoder_apart_ = true; }
  // Whether the checkpoint stores both `name` and `twin`, with different shapes or values. A
  // pair found equal is remembered: the load asks this of every encoder copy twice
  // (encoder_stored_apart, then check_all_taken), and a model's worth of copies is read from
  // disk to be compared.
  bool stored_apart(const std::string& name, const std::string& twin) const {
    const TensorView* a = m_.checkpoint ? m_.checkpoint->find(name) : nullptr;
    const TensorView* b = m_.checkpoint ? m_.checkpoint->find(twin) : nullptr;
    if (!a || !b || equal_pairs_.count({name, twin})) return false;
    if (!same_tensor(*a, *b)) return true;
    equal_pairs_.insert({name, twin});
    return false;
  }
  // Whether the config quantizes linear `module`'s weights (random weights: as dummy_quantization says).
  bool quantizes(const std::string& module) const { return !dummy() && targets_.weight_scales(module); }
  // How the config quantizes the input of linear `module` (random weights: not at all).
  ActivationScheme input_scheme(const std::string& module) const {
    return dummy() ? ActivationScheme::None : targets_.input_scheme(module);
  }

  const TensorView& take(const std::string& name, const std::vector<int64_t>& shape) {
    const std::string key = resolved(name);
    const TensorView* t = m_.checkpoint->find(key);
    if (!t) throw FormatError(m_.path + ": missing tensor '" + name + "' (expected shape " + shape_string(shape) + ")");
    if (t->shape != shape)
      throw FormatError(t->file + ": tensor '" + key + "' has shape " + shape_string(t->shape) + ", expected " +
                        shape_string(shape));
    taken_.insert(key);
    return *t;
  }

  // A weight that is not a linear's (the embedding, the router): plain, dequantized if stored quantized.
  Weight weight(const std::string& name, const std::vector<int64_t>& shape) {
    if (dummy()) return random_weight(shape);
    if (is_packed(name)) return upload_dequantized(packed(name, shape), "'" + name + "'");
    const TensorView& t = fits(take(name, shape));
    return m_.backend->upload(t.data, t.dtype, t.shape, as_, m_.checkpoint);  // may keep pointing into the file
  }

  // A linear layer's weight `<module>.weight`, with its input quantization.
  Weight linear(const std::string& name, const std::vector<int64_t>& shape) {
    if (dummy()) return dummy_linear(shape);
    Weight w = is_packed(name) ? upload(packed(name, shape), "'" + name + "'") : plain_linear(name, shape);
    w.input_quant = input_quant({{module_of(name)}}, shape.back());
    return w;
  }

  // The MoE router's linear (plain, dequantized where stored quantized), whose input is never
  // quantized: a config that quantizes it, or its encoder copy's (the same weights), is refused.
  Weight router(const std::string& name, const std::vector<int64_t>& shape) {
    if (dummy()) return weight(name, shape);
    const std::string module = module_of(name), twin = encoder_copy(module);
    for (const std::string& m : {module, twin})
      if (input_scheme(m) != ActivationScheme::None)
        throw FormatError(m_.path + ": quantization_config quantizes the input of '" + m +
                          "'; the router's activations are not quantized here");
    if (is_packed(name)) return weight(name, shape);
    if (twin != module) expect_unquantized(twin + ".weight");  // (its copy, stored alike)
    return plain_linear(name, shape);
  }

  // Several [rows[i], cols] linears stacked along rows into one weight (gate and up in one GEMM).
  Weight stacked(const std::vector<std::string>& names, const std::vector<int64_t>& rows, int64_t cols) {
    const int64_t total = std::accumulate(rows.begin(), rows.end(), int64_t(0));
    if (dummy()) return dummy_linear({total, cols});
    std::vector<std::string> modules;
    for (const auto& name : names) modules.push_back(module_of(name));
    Weight w = concatenated(names, rows, {total, cols});
    w.input_quant = input_quant({modules}, cols);
    return w;
  }

  // Whether the linears `names`, which a checkpoint may store each its own way (a layer's
  // queries, keys and values), can be stacked into one weight: all stored plainly, their
  // inputs quantized alike. (Quantized ones may differ in format, group size and scales.)
  bool stackable(const std::vector<std::string>& names, int64_t cols) {
    if (dummy()) return m_.dummy_quantization == WeightFormat::Plain;
    if (std::any_of(names.begin(), names.end(), [&](const std::string& name) { return is_packed(name); })) return false;
    const ActivationQuant first = input_quant({{module_of(names[0])}}, cols);
    return std::all_of(names.begin() + 1, names.end(),
                       [&](const std::string& name) { return input_quant({{module_of(name)}}, cols) == first; });
  }

  // An MoE layer's experts as one [E, rows, K] stack: stored fused (`fused`, which is not
  // a Linear and so never quantized), or one linear per expert as LLM Compressor writes
  // them (`<prefix>.<e>.<part>.weight` for each part, stacked along rows, e.g. gate then up).
  Weight experts(const std::string& fused, const std::string& prefix, const std::vector<std::string>& parts,
                 int64_t num_experts, const std::vector<int64_t>& part_shape) {
    const std::vector<int64_t> shape = {num_experts, part_shape[0] * int64_t(parts.size()), part_shape[1]};
    if (dummy()) return dummy_linear(shape);
    if (has(fused)) return weight(fused, shape);
    std::vector<std::vector<std::string>> modules(num_experts);
    std::vector<std::string> names;
    for (int64_t e = 0; e < num_experts; ++e)
      for (const auto& part : parts) {
        modules[e].push_back(prefix + "." + std::to_string(e) + "." + part);
        names.push_back(modules[e].back() + ".weight");
      }
    Weight w = concatenated(names, std::vector<int64_t>(names.size(), part_shape[0]), shape);
    w.input_quant = input_quant(modules, part_shape[1]);
    return w;
  }

  // A small tensor (norm weights, scales) as an fp32 weight.
  Weight small(const std::string& name, const std::vector<int64_t>& shape) {
    if (sizes_only_) return count(shape, sizeof(float));
    return fp32_weight(floats(name, shape), shape);
  }

  // Host values as an fp32 weight in backend memory.
  Weight fp32_weight(std::vector<float> values, const std::vector<int64_t>& shape) {
    if (sizes_only_) return count(shape, sizeof(float));
    auto host = std::make_shared<std::vector<float>>(std::move(values));
    return m_.backend->upload(host->data(), DType::F32, shape, DType::F32, host);
  }

  // A tensor read into fp32 and rounded to the weight dtype, as the reference holds it.
  std::vector<float> floats(const std::string& name, const std::vector<int64_t>& shape) {
    if (dummy()) {  // norm weights, scales and scalars of one
      int64_t n = 1;
      for (int64_t d : shape) n *= d;
      return std::vector<float>(n, 1.0f);
    }
    std::vector<float> out = widen(fits(take(name, shape)));
    for (float& v : out) v = round_to_dtype(v, as_);
    return out;
  }

  // Whether the checkpoint stores any of the encoder's text weights apart from the decoder's
  // twin (other values, dtype or shape): transformers then runs the encoder's own where the
  // config unties them. (LLM Compressor writes byte-equal copies even of tied models. The
  // layer scalars, and W4A4 NVFP4's input scales, are the encoder's own in any case, which
  // one set of weights serves: LayerWeights::encoder_layer_scalar, encoder_global_scale.)
  bool encoder_stored_apart() const {
    if (dummy()) return false;
    for (const auto& [name, view] : m_.checkpoint->tensors())
      if (name.starts_with(kEncoder) && !name.ends_with(".layer_scalar") && !name.ends_with(".input_global_scale") &&
          stored_apart(name, kDecoder + name.substr(kEncoder.size())))
        return true;
    return false;
  }

  // Every tensor that was not taken must be one we deliberately skip.
  void check_all_taken(bool tied) const {
    if (dummy()) return;
    for (const auto& [name, view] : m_.checkpoint->tensors()) {
      if (taken_.count(name)) continue;
      if (name.rfind("model.encoder.vision_tower.", 0) == 0 || name.rfind("model.encoder.embed_vision.", 0) == 0)
        continue;  // the vision tower: this engine serves text only
      if (tied && name == "lm_head.weight") continue;  // a copy of the tied embedding
      // RoPE's frequencies, which older exports stored as buffers: computed from the config.
      // (`<layer type>_inv_freq`, `inv_freq`, `original_inv_freq`).
      if (name.find(".rotary_emb.") != std::string::npos && name.ends_with("inv_freq")) continue;
      // An encoder that shares the decoder's weights: a checkpoint whose ties were broken when
      // it was written (LLM Compressor does this) holds equal copies. (Copies that differ made
      // the encoder one of its own, whose loading took them.)
      if (name.starts_with(kEncoder)) {
        const std::string twin = kDecoder + name.substr(kEncoder.size());
        if (m_.checkpoint->find(twin) && !stored_apart(name, twin)) continue;
      }
      for (const char* quantization : {".weight_scale", ".weight_global_scale", ".weight_zero_point", ".weight_g_idx",
                                       ".input_scale", ".input_global_scale", ".input_zero_point"})
        if (name.ends_with(quantization))
          throw FormatError(view.file + ": unexpected tensor '" + name + "': a quantization parameter that nothing " +
                            "here reads (its linear is stored unquantized, or quantization_config's scheme for it " +
                            "has no such tensor)");
      throw FormatError(view.file + ": unexpected tensor '" + name + "' (not part of a DiffusionGemma text model)");
    }
  }

 public:
  // Bytes of the weights counted so far (sizes_only), at least what they take.
  int64_t random_bytes() const { return random_bytes_; }

 private:
  // Counts a weight of `shape` at `value_bytes` a value (past int64: the most it holds), and
  // makes none: an empty Weight.
  Weight count(const std::vector<int64_t>& shape, int64_t value_bytes) {
    bool past = false;
    for (int64_t d : shape) past |= __builtin_mul_overflow(value_bytes, d, &value_bytes);
    past |= __builtin_add_overflow(random_bytes_, value_bytes, &random_bytes_);
    if (past) random_bytes_ = std::numeric_limits<int64_t>::max();
    return {};
  }

  // A plain random weight of `shape`.
  Weight random_weight(const std::vector<int64_t>& shape) {
    if (sizes_only_) return count(shape, int64_t(dtype_size(as_)));
    return m_.backend->random_weight(shape, as_, ++seed_, 1.0f / std::sqrt(float(shape.back())));
  }

  // A linear's random weight of `shape`, packed as the load option says (counted at a byte a
  // value, the least a packed format's values and scales take in all).
  Weight dummy_linear(const std::vector<int64_t>& shape) {
    if (m_.dummy_quantization == WeightFormat::Plain) return random_weight(shape);
    if (sizes_only_) return count(shape, 1);
    Weight w = upload(random_packed_weight(m_.dummy_quantization, shape, ++seed_), "a random weight");
    w.input_quant.scheme = m_.dummy_activations;
    return w;
  }

  // The encoder's copy of a decoder layer's module (the same weights, matched by the config
  // under its own name), or `module` itself where the encoder's weights are its own or the
  // module is no layer's.
  std::string encoder_copy(const std::string& module) const {
    const bool layer = module.starts_with(kDecoder + "layers.");
    return layer && !encoder_apart_ ? kEncoder + module.substr(kDecoder.size()) : module;
  }

  // A linear stored plainly, which the config must leave unquantized.
  Weight plain_linear(const std::string& name, const std::vector<int64_t>& shape) {
    expect_unquantized(name);
    return weight(name, shape);
  }
  // A plain weight that the config quantizes (a dequantized export that kept its
  // quantization_config, say) contradicts its checkpoint: its inputs would be quantized as if
  // its weights were, and transformers would look for scales it does not have.
  void expect_unquantized(const std::string& name) const {
    if (quantizes(module_of(name)))
      throw FormatError(m_.path + ": '" + name + "' is stored unquantized, but quantization_config quantizes '" +
                        module_of(name) + "' (a config group targets it, and ignore does not name it)");
  }

  // A quantized weight as the backend takes it: packed, or dequantized into the weight dtype
  // (`what` names its tensors, for an error).
  Weight upload(const PackedWeight& w, const std::string& what) {
    return m_.backend->keeps_packed(w) ? m_.backend->upload_packed(w) : upload_dequantized(w, what);
  }
  Weight upload_dequantized(const PackedWeight& w, const std::string& what) {
    auto host = std::make_shared<std::vector<float>>(dequantize(w));
    check_fits(host->data(), DType::F32, int64_t(host->size()), m_.path + ": the dequantized values of " + what);
    return m_.backend->upload(host->data(), DType::F32, w.shape, as_, host);
  }

  // A finite value past the weight dtype's range (float16's 65504, or float32's largest
  // values in bfloat16) would load as infinity, and the logits it reaches would be refused
  // with nothing naming it: the load names the tensor instead. (A value stored infinite is
  // the checkpoint's own, passed on as the reference passes it.) `fits` also checks that t
  // holds floats. Only a narrowing cast reads the values for this, on the load's threads.
  const TensorView& fits(const TensorView& t) const {
    expect_float(t);
    check_fits(t.data, t.dtype, t.numel(), t.file + ": tensor '" + t.name + "'");
    return t;
  }
  void check_fits(const void* data, DType from, int64_t n, const std::string& what) const {
    const bool narrows = from != as_ && (as_ == DType::F16 || (as_ == DType::BF16 && from == DType::F32));
    if (!narrows) return;
    constexpr int64_t kSlice = 4096;
    std::atomic<int64_t> first = n;  // the lowest index found
    threads_->parallel_for(n, 16 * kSlice, [&](int64_t a, int64_t b) {
      float values[kSlice];
      for (int64_t s = a; s < b && s < first.load(); s += kSlice) {
        const int64_t count = std::min(kSlice, b - s);
        convert_floats(static_cast<const uint8_t*>(data) + s * int64_t(dtype_size(from)), from, count, values,
                       DType::F32);
        for (int64_t i = 0; i < count; ++i)
          if (std::isfinite(values[i]) && !std::isfinite(round_to_dtype(values[i], as_))) {
            for (int64_t seen = first.load(); s + i < seen && !first.compare_exchange_weak(seen, s + i);) {}
            return;
          }
      }
    });
    if (first.load() == n) return;
    const float value = read_floats(static_cast<const uint8_t*>(data) + first.load() * int64_t(dtype_size(from)),
                                    from, 1)[0];
    char text[32];
    std::snprintf(text, sizeof text, "%g", double(value));
    const bool f16 = as_ == DType::F16;  // (else bf16: the other narrowing cast)
    throw FormatError(what + " holds " + text + " (flat index " + std::to_string(first.load()) +
                      "), past the largest finite " + (f16 ? "float16" : "bfloat16") + " value: it would load as " +
                      "infinity. Load the model in a wider dtype (dtype " + (f16 ? "\"bfloat16\" or " : "") +
                      "\"float32\")");
  }

  // The [rows[i], K] weights `names` stacked along rows into one weight of `shape` (their
  // rows' total, then K; or an expert stack's [E, rows, K]): packed when the first is stored
  // quantized, else in the weight dtype.
  Weight concatenated(const std::vector<std::string>& names, const std::vector<int64_t>& rows,
                      const std::vector<int64_t>& shape) {
    const int64_t cols = shape.back();
    // Quantized where any part is, so that a plain part is named as such wherever it comes (a
    // plain first part had sent a quantized second one to the plain path's dtype check).
    if (std::any_of(names.begin(), names.end(), [&](const std::string& name) { return is_packed(name); })) {
      PackedWeight w = packed(names[0], {rows[0], cols});
      std::string what = "'" + names[0] + "'";
      for (size_t i = 1; i < names.size(); ++i) {
        try {
          w.append(packed(names[i], {rows[i], cols}), m_.path + ": '" + names[i] + "'");
          what += ", '" + names[i] + "'";
        } catch (const InvalidArgument& e) {  // the checkpoint's fault: its stacked parts are quantized differently
          throw FormatError(e.what());
        }
      }
      w.shape = shape;
      return upload(w, what);
    }
    // Each part converted straight into the weight dtype by the worker threads, one after the
    // other into one buffer, which the backend copies up (or keeps). (Widened into a vector of
    // floats on one thread and then converted again, the stacked q/k/v and MLP weights had
    // taken most of a bf16 checkpoint's load: 1.3 s for 4 layers at the 26B shapes.)
    // Every part's shape is checked before the buffer, which the config's sizes alone would
    // have made (terabytes from a config whose head counts the tensors do not have).
    std::vector<const TensorView*> parts;
    for (size_t i = 0; i < names.size(); ++i) {
      expect_unquantized(names[i]);
      parts.push_back(&fits(take(names[i], {rows[i], cols})));
    }
    const size_t size = dtype_size(as_);
    const int64_t values = std::accumulate(rows.begin(), rows.end(), int64_t(0)) * cols;
    std::shared_ptr<uint8_t> host(new uint8_t[size_t(values) * size], std::default_delete<uint8_t[]>());
    uint8_t* out = host.get();
    for (const TensorView* part : parts) {
      convert_floats(*threads_, part->data, part->dtype, part->numel(), out, as_);
      out += size_t(part->numel()) * size;
    }
    return m_.backend->upload(host.get(), as_, shape, as_, host);
  }

  // `name`, or its decoder twin's where the encoder's weights are its own (set_encoder_apart)
  // and the checkpoint holds no tensor of the encoder's module (a linear's weight, packed
  // values and scales come from one side; not a layer scalar: those are the encoder's own).
  std::string resolved(const std::string& name) const {
    if (!encoder_apart_ || !name.starts_with(kEncoder) || name.ends_with(".layer_scalar")) return name;
    const std::string module = name.substr(0, name.rfind('.') + 1);  // with its dot
    const auto& tensors = m_.checkpoint->tensors();
    const auto first = tensors.lower_bound(module);
    if (first != tensors.end() && first->first.starts_with(module)) return name;
    return kDecoder + name.substr(kEncoder.size());
  }
  const TensorView* find(const std::string& name) const { return m_.checkpoint->find(resolved(name)); }

  // Whether two stored tensors hold the same values: the same bytes, or float tensors of
  // different dtypes whose values widen to the same fp32 bits (a tied checkpoint whose
  // encoder copies were written in fp32 beside bf16 weights), compared a slice at a time.
  static bool same_tensor(const TensorView& a, const TensorView& b) {
    if (a.shape != b.shape) return false;
    if (a.dtype == b.dtype) return std::memcmp(a.data, b.data, a.nbytes) == 0;
    if (!is_float(a.dtype) || !is_float(b.dtype)) return false;
    constexpr int64_t kSlice = int64_t(1) << 16;
    const auto* pa = static_cast<const uint8_t*>(a.data);
    const auto* pb = static_cast<const uint8_t*>(b.data);
    for (int64_t first = 0, n = a.numel(); first < n; first += kSlice) {
      const int64_t count = std::min(kSlice, n - first);
      const std::vector<float> va = read_floats(pa + first * int64_t(dtype_size(a.dtype)), a.dtype, count);
      const std::vector<float> vb = read_floats(pb + first * int64_t(dtype_size(b.dtype)), b.dtype, count);
      if (std::memcmp(va.data(), vb.data(), sizeof(float) * size_t(count)) != 0) return false;
    }
    return true;
  }

  static const TensorView& expect_float(const TensorView& t) {
    if (!is_float(t.dtype))
      throw FormatError(t.file + ": tensor '" + t.name + "' has dtype " + dtype_name(t.dtype) +
                        "; expected F32, BF16 or F16");
    return t;
  }

  // A stored float tensor (any shape) in fp32.
  static std::vector<float> widen(const TensorView& t) {
    expect_float(t);
    return read_floats(t.data, t.dtype, t.numel());
  }

  // A companion tensor (a scale) of any shape, marked taken.
  const TensorView& companion(const std::string& name) {
    const std::string key = resolved(name);
    const TensorView* t = m_.checkpoint->find(key);
    if (!t) throw FormatError(m_.path + ": missing tensor '" + name + "' (a quantized linear's scale)");
    taken_.insert(key);
    return *t;
  }

  // A companion scale that holds one value.
  float scalar(const std::string& name) {
    const TensorView& t = companion(name);
    if (t.numel() != 1) throw FormatError(t.file + ": tensor '" + name + "' must hold one value");
    return widen(t)[0];
  }
  // ... one that values are divided by (NVFP4's global scales): positive and finite, or
  // every output of the linear would be NaN or infinite.
  float divisor_scalar(const std::string& name) {
    const float v = scalar(name);
    // (The largest value it divides, E2M1's 6 times E4M3's 448, must stay finite.)
    if (!(std::isfinite(v) && v > 0 && std::isfinite(6.0f * 448.0f / v)))
      throw FormatError(m_.path + ": '" + name + "' is " + std::to_string(v) + "; NVFP4 needs a positive, finite " +
                        "global scale, 6 x 448 over which is finite");
    return v;
  }

  static std::string module_of(const std::string& weight_name) {
    return weight_name.substr(0, weight_name.size() - std::string(".weight").size());
  }

  // How linears that the runtime feeds one input quantize it: modules[e] lists expert e's
  // linears (one expert for a plain linear; gate and up for a stacked pair), which must
  // all quantize it alike. `k` is their input size.
  ActivationQuant input_quant(const std::vector<std::vector<std::string>>& modules, int64_t k) {
    ActivationQuant q;
    q.scheme = input_scheme(modules[0][0]);
    for (const auto& parts : modules)
      for (const std::string& module : parts) {
        if (input_scheme(module) != q.scheme)
          throw FormatError(m_.path + ": quantization_config quantizes the inputs of '" + modules[0][0] + "' and '" +
                            module + "' differently, but the runtime runs them as one (stacked gate and up, or one "
                            "MoE layer's experts)");
        const std::string twin = encoder_copy(module);
        if (input_scheme(twin) != q.scheme || targets_.weight_scales(twin) != targets_.weight_scales(module))
          throw FormatError(m_.path + ": quantization_config quantizes '" + module + "' and its encoder copy '" + twin +
                            "' differently, but they are one weight, run alike");
        if (q.scheme != ActivationScheme::Nvfp4) continue;
        // The encoder's copy of the linear has its own scale, where the checkpoint has one.
        const float decoder_scale = divisor_scalar(module + ".input_global_scale");
        const float encoder_scale =
            has(twin + ".input_global_scale") ? divisor_scalar(twin + ".input_global_scale") : decoder_scale;
        if (module == parts[0]) {
          q.decoder_global_scale.push_back(decoder_scale);
          q.encoder_global_scale.push_back(encoder_scale);
        } else if (decoder_scale != q.decoder_global_scale.back() || encoder_scale != q.encoder_global_scale.back()) {
          throw FormatError(m_.path + ": '" + parts[0] + "' and '" + module +
                            "' have different input_global_scale, but the runtime quantizes their one input once");
        }
      }
    if (q.scheme == ActivationScheme::Nvfp4 && k % kNvfp4Group)
      throw FormatError(m_.path + ": '" + modules[0][0] + "' has " + std::to_string(k) +
                        " inputs; NVFP4 activations need a multiple of " + std::to_string(kNvfp4Group));
    return q;
  }

  // How many scales a row of a [rows, cols] weight has, as the config's strategy lays them
  // out (scales[row * groups + col / (cols / groups)]): 0 for the tensor's one scale, 1 a row
  // ([rows] or [rows, 1]: "channel"), or cols / group_size ([rows, cols / group_size]). A
  // partial last group is refused (current LLM Compressor will not write one; older versions
  // did): read as cols / groups inputs a scale, its scales had loaded onto the wrong inputs.
  static int64_t groups_of(const TensorView& scale, int64_t rows, int64_t cols, const WeightScales& layout) {
    using Strategy = WeightScales::Strategy;
    const std::vector<int64_t>& s = scale.shape;
    std::string wanted;
    switch (layout.strategy) {
      case Strategy::Tensor:
        if (scale.numel() == 1) return 0;
        wanted = "one value (strategy tensor)";
        break;
      case Strategy::Channel:
        if (s == std::vector<int64_t>{rows} || s == std::vector<int64_t>{rows, 1}) return 1;
        wanted = "[" + std::to_string(rows) + "] or [" + std::to_string(rows) + ", 1] (strategy channel)";
        break;
      case Strategy::Group: {
        const int64_t g = layout.group_size;
        // Fewer inputs than a group: one group of them all ([rows, 1]), as compressed-tensors
        // writes it.
        if (cols < g && (s == std::vector<int64_t>{rows, 1} || s == std::vector<int64_t>{rows})) return 1;
        if (cols % g)
          throw FormatError(scale.file + ": '" + scale.name + "' scales a weight of " + std::to_string(cols) +
                            " inputs, which quantization_config's group_size " + std::to_string(g) +
                            " does not divide (a partial last group is not supported)");
        if (s == std::vector<int64_t>{rows, cols / g}) return cols / g;
        wanted = "[" + std::to_string(rows) + ", " + std::to_string(cols / g) + "] (groups of " + std::to_string(g) +
                 ")";
        break;
      }
    }
    throw FormatError(scale.file + ": tensor '" + scale.name + "' of shape " + shape_string(s) + " does not hold " +
                      "the scales quantization_config lays out for a [" + std::to_string(rows) + ", " +
                      std::to_string(cols) + "] weight: " + wanted);
  }

  static std::string prefix_of(const std::string& weight_name) {
    return weight_name.ends_with(".weight") ? module_of(weight_name) : weight_name;
  }

  // Whether the weight `name` is stored quantized: NVFP4's "<prefix>.weight_packed", or FP8.
  bool is_packed(const std::string& name) const {
    const TensorView* t = find(name);
    return (!t && has(prefix_of(name) + ".weight_packed")) || (t && t->dtype == DType::F8_E4M3);
  }

  // The quantized weight `name` ([rows, cols]) as stored, its scales per row or group.
  PackedWeight packed(const std::string& name, const std::vector<int64_t>& shape) {
    const std::string prefix = prefix_of(name);
    if (shape.size() != 2)  // a fused expert stack: no Linear, so never quantized by compressed-tensors
      throw FormatError(m_.path + ": '" + name + "' of shape " + shape_string(shape) +
                        " is stored quantized; only a linear's [rows, cols] weight may be");
    if (!is_packed(name)) {
      if (!find(name))
        throw FormatError(m_.path + ": missing tensor '" + name + "' (nor is it stored as NVFP4's '" + prefix +
                          ".weight_packed'), which is stacked with quantized linears");
      throw FormatError(m_.path + ": '" + name + "' is stored plainly, but the linears stacked with it are "
                        "quantized; the runtime runs them as one weight");
    }
    // Without the config's say, transformers would read the stored values as plain weights,
    // their scales unused: the checkpoint contradicts itself. So it does where the config
    // leaves the module unquantized (in `ignore`, or no group's target).
    if (m_.config.quantization.empty())
      throw FormatError(m_.path + ": '" + name + "' is stored quantized (F8_E4M3, or NVFP4's weight_packed), but " +
                        "config.json has no quantization_config");
    if (!quantizes(prefix))
      throw FormatError(m_.path + ": '" + name + "' is stored quantized (F8_E4M3, or NVFP4's weight_packed), but " +
                        "quantization_config leaves '" + prefix + "' unquantized (in ignore, or no group's target)");
    // The format says how: an FP8 tensor in an NVFP4 checkpoint, or the other way, is not what it says.
    if (has(prefix + ".weight_packed") != (m_.config.quantization == "nvfp4-pack-quantized"))
      throw FormatError(m_.path + ": '" + name + "' is stored as " +
                        (has(prefix + ".weight_packed") ? "NVFP4 (weight_packed)" : "FP8 (F8_E4M3)") +
                        ", but quantization_config.format is '" + m_.config.quantization + "'");
    const WeightScales layout = *targets_.weight_scales(prefix);
    return has(prefix + ".weight_packed") ? nvfp4(prefix, shape, layout) : fp8(name, prefix, shape, layout);
  }

  PackedWeight fp8(const std::string& name, const std::string& prefix, const std::vector<int64_t>& shape,
                   const WeightScales& layout) {
    const TensorView& w = take(name, shape);
    const TensorView& scale = companion(prefix + ".weight_scale");
    const int64_t rows = shape[0], cols = shape[1], groups = groups_of(scale, rows, cols, layout);
    PackedWeight p;
    p.format = WeightFormat::Fp8;
    p.shape = shape;
    p.group_size = groups ? cols / groups : cols;
    // E4M3's NaN codes (0x7f, 0xff) would reach the logits as NaN only at the first denoise,
    // named by no tensor: looked for as the codes are copied, one pass without an early exit
    // (a 26B checkpoint has 26 GB of them).
    p.values.resize(w.nbytes);
    bool nan = false;
    for (size_t i = 0; i < w.nbytes; ++i) nan |= !fp8_is_number(p.values[i] = w.data[i]);
    if (nan) throw FormatError(w.file + ": tensor '" + w.name + "' holds NaN codes; FP8 weights must be numbers");
    p.scales = widen(scale);
    for (float s : p.scales)  // (times E4M3's largest, 448, the weights must stay finite)
      if (!std::isfinite(s * 448.0f))
        throw FormatError(scale.file + ": tensor '" + scale.name + "' holds " + std::to_string(s) +
                          "; FP8 weight scales must be finite, and finite times 448");
    if (!groups) p.scales.assign(size_t(rows), p.scales[0]);  // one per tensor: the same for every row
    return p;
  }

  PackedWeight nvfp4(const std::string& prefix, const std::vector<int64_t>& shape, const WeightScales& layout) {
    const int64_t rows = shape[0], cols = shape[1];
    if (cols % 2) throw FormatError(m_.path + ": '" + prefix + ".weight_packed' needs an even number of columns");
    const TensorView& packed = take(prefix + ".weight_packed", {rows, cols / 2});
    const TensorView& scale = companion(prefix + ".weight_scale");
    if (packed.dtype != DType::U8 || scale.dtype != DType::F8_E4M3)
      throw FormatError(packed.file + ": '" + prefix + "' is not NVFP4 as compressed-tensors writes it (U8 " +
                        "weight_packed, F8_E4M3 weight_scale)");
    const int64_t groups = groups_of(scale, rows, cols, layout);
    assert(groups > 0);  // (tensor_group: groups of 16, or one of fewer inputs)
    PackedWeight p;
    p.format = WeightFormat::Nvfp4;
    p.shape = shape;
    p.group_size = cols / groups;
    p.values.assign(packed.data, packed.data + packed.nbytes);
    p.group_scales.assign(scale.data, scale.data + scale.nbytes);
    // E4M3's NaN: its group's values would be NaN (the CUDA backend's GEMM layout cannot even
    // encode it). One pass without an early exit, which the compiler vectorizes (3x any_of's
    // speed): a 26B checkpoint has 1.6 GB of group scales.
    bool nan = false;
    for (uint8_t code : p.group_scales) nan |= !fp8_is_number(code);
    if (nan)
      throw FormatError(scale.file + ": tensor '" + scale.name + "' holds NaN; NVFP4 group scales must be numbers");
    p.global_scales.assign(size_t(rows), divisor_scalar(prefix + ".weight_global_scale"));
    return p;
  }

  ModelState& m_;
  DType as_;
  QuantizationTargets targets_;
  std::set<std::string> taken_;
  uint64_t seed_ = 0;  // dummy weights: one stream per tensor
  bool sizes_only_;
  int64_t random_bytes_ = 0;  // count's
  bool encoder_apart_ = false;  // set_encoder_apart
  mutable std::set<std::pair<std::string, std::string>> equal_pairs_;  // stored_apart's, found equal
  // The load's pool, held for the load: concatenated's conversions run on it (taken per call it
  // had been made anew where no backend held it, the GPU's before its first copy up). Of the
  // load's thread count: the process's pool where that is the default, else one of its own
  // (num_threads 1 had had the load's conversions run on every CPU).
  std::shared_ptr<ThreadPool> threads_ = ThreadPool::make(m_.num_threads);
};

// Activations "bfloat16": every linear and expert stack whose input the checkpoint leaves
// unquantized (plain weights, and weight-only FP8 or NVFP4 ones, however a backend keeps
// them) takes its input rounded to bf16, the lm_head (the tied embedding) included; the
// router stays fp32 (near-tied experts), as do the norms. (Attention rounds its inputs
// too: layer_forward passes the mode.)
void round_linear_inputs(ModelWeights& w) {
  auto round_input = [](Weight& x) {
    if (!x.empty() && x.input_quant.scheme == ActivationScheme::None) x.input_quant.scheme = ActivationScheme::Bf16;
  };
  round_input(w.lm_head.empty() ? w.embed_tokens : w.lm_head);
  round_input(w.sc_gate_up);
  round_input(w.sc_down);
  for (LayerWeights& l : w.layers)
    for (Weight* x : {&l.q_proj, &l.k_proj, &l.v_proj, &l.qkv_proj, &l.o_proj, &l.mlp_gate_up, &l.mlp_down,
                      &l.experts_gate_up, &l.experts_down})
      round_input(*x);
}

// Every layer's weights of the backbone stored under `prefix` (the decoder's, or an untied
// encoder's): each layer's decoder_layer_scalar is its own, and encoder_layer_scalar the
// encoder's layer's.
void load_layers(TensorSource& src, const ModelConfig& c, const std::string& prefix, std::vector<LayerWeights>& layers) {
  const int64_t H = c.hidden_size, I = c.intermediate_size, E = c.num_experts, MI = c.moe_intermediate_size;
  for (int i = 0; i < c.num_layers; ++i) {
    const LayerConfig& L = c.layers[i];
    const std::string p = prefix + "layers." + std::to_string(i) + ".";
    const int64_t q_out = int64_t(c.num_heads) * L.head_dim, kv_out = int64_t(L.num_kv_heads) * L.head_dim;
    LayerWeights lw;
    std::vector<std::string> qkv = {p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight"};
    std::vector<int64_t> qkv_rows = {q_out, kv_out};
    if (L.has_v_proj) qkv.push_back(p + "self_attn.v_proj.weight"), qkv_rows.push_back(kv_out);
    if (src.stackable(qkv, H)) {
      lw.qkv_proj = src.stacked(qkv, qkv_rows, H);
    } else {
      lw.q_proj = src.linear(qkv[0], {q_out, H});
      lw.k_proj = src.linear(qkv[1], {kv_out, H});
      if (L.has_v_proj) lw.v_proj = src.linear(qkv[2], {kv_out, H});
    }
    lw.o_proj = src.linear(p + "self_attn.o_proj.weight", {H, q_out});
    lw.q_norm = src.small(p + "self_attn.q_norm.weight", {L.head_dim});
    lw.k_norm = src.small(p + "self_attn.k_norm.weight", {L.head_dim});
    lw.input_layernorm = src.small(p + "input_layernorm.weight", {H});
    lw.post_attention_layernorm = src.small(p + "post_attention_layernorm.weight", {H});
    lw.pre_feedforward_layernorm = src.small(p + "pre_feedforward_layernorm.weight", {H});
    lw.post_feedforward_layernorm = src.small(p + "post_feedforward_layernorm.weight", {H});
    lw.post_feedforward_layernorm_1 = src.small(p + "post_feedforward_layernorm_1.weight", {H});
    lw.post_feedforward_layernorm_2 = src.small(p + "post_feedforward_layernorm_2.weight", {H});
    lw.pre_feedforward_layernorm_2 = src.small(p + "pre_feedforward_layernorm_2.weight", {H});
    lw.mlp_gate_up = src.stacked({p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"}, {I, I}, H);
    lw.mlp_down = src.linear(p + "mlp.down_proj.weight", {H, I});
    lw.router_proj = src.router(p + "router.proj.weight", {E, H});
    lw.router_scale = src.small(p + "router.scale", {H});
    lw.router_per_expert_scale = src.small(p + "router.per_expert_scale", {E});
    lw.rope_inv_freq = src.fp32_weight(L.rope_inv_freq, {int64_t(L.rope_inv_freq.size())});
    lw.experts_gate_up = src.experts(p + "experts.gate_up_proj", p + "experts", {"gate_proj", "up_proj"}, E, {MI, H});
    lw.experts_down = src.experts(p + "experts.down_proj", p + "experts", {"down_proj"}, E, {H, MI});
    // A checkpoint without the decoder's scalars (a buffer transformers then sets to its initial 1).
    lw.decoder_layer_scalar = src.has(p + "layer_scalar") || src.dummy() ? src.floats(p + "layer_scalar", {1})[0] : 1.0f;
    lw.encoder_layer_scalar = src.floats(TensorSource::kEncoder + "layers." + std::to_string(i) + ".layer_scalar", {1})[0];
    layers.push_back(std::move(lw));
  }
}

// Activations "bfloat16" rounds the linears' inputs; each backend lays its weights out.
void prepare_weights(ModelState& m, ModelWeights& w) {
  if (m.bf16_activations) round_linear_inputs(w);
  for (LayerWeights& l : w.layers) {
    if (!l.v_proj.empty()) m.backend->place_together({&l.k_proj, &l.v_proj});
    m.backend->lay_out_experts(l.experts_gate_up, l.experts_down);
  }
}

// The decoder's weights, and the head's where it is not tied to the embedding; returns whether it is.
bool load_decoder(TensorSource& src, const ModelConfig& c, ModelWeights& w) {
  const int64_t H = c.hidden_size, I = c.intermediate_size;
  const std::string& d = TensorSource::kDecoder;
  w.embed_tokens = src.weight(d + "embed_tokens.weight", {c.vocab_size, H});
  // A tied config whose checkpoint stores an lm_head.weight other than the embedding (other
  // values, or quantized): transformers then leaves the two untied (warning that the config is
  // wrong) and runs the stored head. So does this.
  const bool tied = c.tie_word_embeddings && !src.stored_quantized("lm_head.weight") &&
                    !src.stored_apart("lm_head.weight", d + "embed_tokens.weight");
  if (!tied) w.lm_head = src.linear("lm_head.weight", {c.vocab_size, H});
  else if (src.quantizes("lm_head"))
    throw FormatError(src.path() + ": quantization_config quantizes 'lm_head' (not in its ignore), but the head is " +
                      "tied to the embedding, which is stored unquantized");
  w.norm = src.small(d + "norm.weight", {H});
  const std::string sc = d + "self_conditioning.";
  w.sc_pre_norm = src.small(sc + "pre_norm.weight", {H});
  w.sc_gate_up = src.stacked({sc + "gate_proj.weight", sc + "up_proj.weight"}, {I, I}, H);
  w.sc_down = src.linear(sc + "down_proj.weight", {H, I});
  load_layers(src, c, d, w.layers);
  return tied;
}

// Random weights (load_format "dummy") take their sizes from the config alone, which may ask
// for any amount: counted first, by a walk that makes none, against the backend's memory (many
// weights, each within memory, had grown past it together, and the kernel killed the process).
void check_random_weights_fit(ModelState& m, DType as) {
  TensorSource sizes(m, as, /*sizes_only=*/true);
  ModelWeights none;
  load_decoder(sizes, m.config, none);
  if (const int64_t memory = m.backend->free_memory_bytes(); sizes.random_bytes() > memory)
    throw InvalidArgument("load_format 'dummy': the config's random weights take at least " +
                          std::to_string(sizes.random_bytes()) + " bytes, more than the " + std::to_string(memory) +
                          " bytes of memory free for them");
}

}  // namespace

void load_weights(ModelState& m, DType as) {
  const ModelConfig& c = m.config;
  if (!m.checkpoint) check_random_weights_fit(m, as);
  TensorSource src(m, as);
  ModelWeights& w = m.weights;
  const int64_t H = c.hidden_size;
  // Where the checkpoint holds encoder weights of their own (other values than the decoder's
  // twins), transformers runs the encoder on them, and so does this (forward's encoder pass):
  // under tie_word_embeddings false, which unties the encoder from the decoder as well as the
  // head from the embedding, and under a tied config too, where transformers leaves a pair
  // whose stored values differ untied (warning that the config is wrong), as for the head below.
  const bool encoder_apart = src.encoder_stored_apart();
  if (encoder_apart) src.set_encoder_apart();

  const bool tied = load_decoder(src, c, w);
  if (encoder_apart) {
    const std::string& e = TensorSource::kEncoder;
    w.encoder = std::make_unique<ModelWeights>();
    w.encoder->embed_tokens = src.weight(e + "embed_tokens.weight", {c.vocab_size, H});
    w.encoder->norm = src.small(e + "norm.weight", {H});  // (the encoder's output feeds nothing)
    load_layers(src, c, e, w.encoder->layers);
    prepare_weights(m, *w.encoder);
  }
  src.check_all_taken(tied);
  prepare_weights(m, w);
  m.weight_dtype = as;
  m.embed_scale = round_to_dtype(std::sqrt(float(H)), as);
}

namespace {

// A layer's queries (of x's rows from q_first on, q.rows of them) and keys and values (of
// every row) from its input x: q_norm + RoPE on Q, k_norm + RoPE on K, and V = v_proj(x) (or,
// on full-attention layers, the raw k_proj output) through an unscaled norm. K and V come as
// rows of one matrix, [K; V]. One product where the loader stacked the three weights
// (qkv_proj), else three: K and V as one Backend::linears (which the GPU makes one product
// where it can: a K or V projection alone fills half of it at batch 1), beside Q's.
void project_qkv(ModelState& m, const LayerWeights& W, int li, const Activation& x, int64_t encoder_rows,
                 const std::vector<int64_t>& positions, int64_t q_first, Activation& q, Activation& k, Activation& v) {
  Backend& be = *m.backend;
  const LayerConfig& L = m.config.layers[li];
  const float eps = m.config.rms_norm_eps;
  const int64_t n = x.rows;
  Activation kv = be.alloc_attention_rows(2 * n, int64_t(L.num_kv_heads) * L.head_dim, L.head_dim, m.bf16_activations);
  k = kv.view(0, n), v = kv.view(n, n);
  if (!W.qkv_proj.empty()) {
    Activation qkv = be.alloc_output(n, W.qkv_proj.shape[0]);
    be.linear_with_input_quant(x, W.qkv_proj, qkv, encoder_rows);
    return be.split_qkv_norms(qkv, q_first, W.q_norm, W.k_norm, L.head_dim, eps, W.rope_inv_freq, positions, q, kv);
  }
  auto keys_and_values = [&] {
    if (L.has_v_proj && W.k_proj.format == W.v_proj.format && W.k_proj.dtype == W.v_proj.dtype) {
      be.linears(x, {&W.k_proj, &W.v_proj}, kv, encoder_rows);
    } else {
      be.linear_with_input_quant(x, W.k_proj, k, encoder_rows);
      if (L.has_v_proj) be.linear_with_input_quant(x, W.v_proj, v, encoder_rows);
      else be.copy_rows(k, 0, v, 0, k.rows);
    }
    be.key_value_norms(kv, W.k_norm, L.head_dim, eps, W.rope_inv_freq, positions);
  };
  if (!q.rows) return keys_and_values();
  be.concurrently(keys_and_values, [&] {
    be.linear_with_input_quant(x.view(q_first, q.rows), W.q_proj, q, encoder_rows - q_first);
    be.rms_norm_rope(q, W.q_norm, L.head_dim, eps, W.rope_inv_freq, {positions.begin() + q_first, positions.end()});
  });
}

// out = gated GELU MLP of x with stacked [gate; up] weights.
void gated_mlp(Backend& be, const Activation& x, int64_t encoder_rows, const Weight& gate_up, const Weight& down,
               Activation& out) {
  Activation gu = be.alloc_output(x.rows, gate_up.shape[0]);
  be.linear_with_input_quant(x, gate_up, gu, encoder_rows);
  be.gelu_glu_linear(gu, down, out, encoder_rows);
}

// The attention's output added to the residual stream, then the feed-forward half of a
// layer and the layer scalar, in place on h, then the stream's next norm into `next`:
//   h = h + post_attn(attn)
//   h = (h + post_ff(post_ff_1(mlp(pre_ff(h))) + post_ff_2(experts(pre_ff_2(h), route(h))))) * scalar
//   next = rms_norm(h) by next_norm
// Rows of h below `encoder_rows` are the encoder's.
void feed_forward(ModelState& m, const LayerWeights& W, const Activation& attn, Activation& h, int64_t encoder_rows,
                  const Weight& next_norm, Activation& next) {
  Backend& be = *m.backend;
  const float eps = m.config.rms_norm_eps;
  const int64_t n = h.rows, H = h.cols;
  Activation x = be.alloc_product_input(n, H, {&W.mlp_gate_up});
  Activation x2 = be.alloc_product_input(n, H, {&W.experts_gate_up});
  Activation router_in = be.alloc_output(n, H), dense = be.alloc_output(n, H);
  ExpertOutput moe;
  // The new h's three norms (the MLP's input, the experts', the router's) in the same pass.
  be.add_rms_norm_then_norms(attn, &W.post_attention_layernorm, eps, h,
                             {&W.pre_feedforward_layernorm, &W.pre_feedforward_layernorm_2, &W.router_scale},
                             {&x, &x2, &router_in});
  // The two branches are independent: the dense MLP's short products may run in the gaps
  // of the experts' (the router's steps before them, the tails of their waves), where the
  // experts leave room for them. (Its down product then waits for the experts' down
  // product's last blocks, and the layer's last norm for it: 23 us from the experts' end to
  // the norm's end at batch 1 while the MLP's own norm was a launch between them. Joining the
  // MLP's branch before the experts' products instead, beside the router alone, measured
  // slower, 17.0-17.1 -> 17.3 ms a batch-1 step (H200, thirty-fourth session): the experts
  // then started 20 us later, and the norm, which sums their rows, still ended 13 us after
  // them.)
  auto experts = [&] {
    Routing routing = be.route(router_in, W.router_proj, W.router_per_expert_scale, m.config.top_k_experts);
    routing.encoder_tokens = encoder_rows;
    moe = be.experts_unsummed(x2, routing, W.experts_gate_up, W.experts_down);
  };
  // The MLP's output norm (post_feedforward_layernorm_1) is the layer's last norm's first
  // step, a launch fewer on the chain after the experts (forty-third session, H200, A/B
  // twice: 16.89 / 16.93 -> 16.84 / 16.88 ms a step at 1x1K, 36.18 / 36.16 -> 36.04 / 36.14
  // at 4x1K).
  auto mlp = [&] { gated_mlp(be, x, encoder_rows, W.mlp_gate_up, W.mlp_down, dense); };
  if (be.experts_leave_room(W.experts_gate_up, n)) {
    be.concurrently(experts, mlp);
  } else {
    experts();
    mlp();
  }

  // The two branches' sum, then its norm added to the residual and the layer scalar
  // applied (the encoder's rows, first, and the decoder's each have their own), then the
  // next norm of the stream.
  const int64_t decoder_rows = n - encoder_rows;
  for (const auto& [first, rows, scalar] : {std::tuple{int64_t(0), encoder_rows, W.encoder_layer_scalar},
                                            std::tuple{encoder_rows, decoder_rows, W.decoder_layer_scalar}}) {
    if (!rows) continue;
    Activation sum = dense.view(first, rows), residual = h.view(first, rows), normed = next.view(first, rows);
    be.add_experts_rms_norm_twice(moe.view(first, rows), &W.post_feedforward_layernorm_2, sum,
                                  &W.post_feedforward_layernorm_1, &W.post_feedforward_layernorm, eps, residual, scalar,
                                  &next_norm, &normed);
  }
}

// A segment's place in the batch's rows and in its sequence.
struct Placed {
  Segment* segment;
  int64_t first_row;
  int64_t rows;
  int64_t first_position;  // of its first row
  int64_t cache_length;    // cached tokens it reads (decoder: including this batch's encoder rows)
};

// A layer's input norm's output: the queries', keys' and values' products read it.
Activation alloc_layer_input(ModelState& m, const ModelWeights& weights, int li, int64_t rows) {
  const LayerWeights& W = weights.layers[li];
  std::vector<const Weight*> projections = {&W.q_proj, &W.k_proj};
  if (!W.qkv_proj.empty()) projections = {&W.qkv_proj};
  else if (m.config.layers[li].has_v_proj) projections.push_back(&W.v_proj);
  return m.backend->alloc_product_input(rows, m.config.hidden_size, projections);
}

// One layer over every row of the batch, from x = its input norm of h; its last op writes
// `next` = h's next norm by next_norm (the next layer's input norm, or the final norm) for
// the rows that go on. Encoder rows write their KV into the cache before any row attends, so
// a decoder segment reads the encoder rows of the same sequence from this very layer (the
// commit-fused denoise).
void layer_forward(ModelState& m, const LayerWeights& W, KvCache& kv, int li, Activation& h, const Activation& x,
                   const std::vector<int64_t>& positions, const std::vector<Placed>& placed, int64_t encoder_rows,
                   const Weight& next_norm, Activation& next) {
  Backend& be = *m.backend;
  const ModelConfig& c = m.config;
  const LayerConfig& L = c.layers[li];
  const int64_t n = h.rows, H = h.cols;
  const int64_t q_cols = int64_t(c.num_heads) * L.head_dim;
  const int64_t window = L.sliding ? c.sliding_window : 0;

  // Tried and not kept (thirty-seventh session, H200, steps at 1x1K / 4x1K, A/B twice): a
  // kernel between ops that asks L2 to prefetch the next product's weights (cp.async.bulk
  // .prefetch.L2, 24 MB) while a latency-bound op leaves DRAM idle: o_proj's before the
  // attention 17.1 / 36.7-36.8 -> 17.2 / 36.9 ms, the experts' first up rows before the router
  // 18.4 / 37.1-37.3, the next layer's q/k/v before its last norm 18.9-19.0 / 37.8-38.0, all
  // three 18.6 / 37.3-37.4: the prefetch's launch sits in the chain of launches, and its lines
  // evict the ones the next kernels were about to read.
  // Past its KV, the encoder's last layer feeds nothing: only decoder rows go on (`next`'s rows).
  const int64_t first = li == c.num_layers - 1 ? encoder_rows : 0;
  Activation q = be.alloc_attention_rows(n - first, q_cols, L.head_dim, m.bf16_activations), k, v;
  project_qkv(m, W, li, x, encoder_rows, positions, first, q, k, v);
  // Encoder rows come first in the batch: rows [0, encoder_rows) go to their cache slots.
  if (encoder_rows) {
    std::vector<int64_t> slots;
    for (const Placed& p : placed)
      if (p.segment->encoder)
        for (int64_t r = 0; r < p.rows; ++r) slots.push_back(kv.slot(*p.segment->table, li, p.first_position + r));
    be.scatter_rows(k.view(0, encoder_rows), slots, kv.keys(li));
    be.scatter_rows(v.view(0, encoder_rows), slots, kv.values(li));
  }
  if (first == n) return;
  Activation rows_h = h.view(first, n - first);
  const int64_t rows_encoder = encoder_rows - first;
  Activation attn = be.alloc_product_input(n - first, q_cols, {&W.o_proj});

  std::vector<AttentionSegment> segments;
  for (const Placed& p : placed) {
    if (p.first_row < first) continue;
    AttentionSegment a{p.first_row - first, p.rows, p.first_position, p.segment->encoder, window, {}};
    // Sliding layers read only the last window - 1 cached tokens: what the encoder's
    // mask admits, and exactly what the reference's decoder sees.
    const int64_t cache_end = p.segment->encoder ? p.first_position + p.rows : p.cache_length;
    const int64_t cache_begin = window ? std::max<int64_t>(0, (p.segment->encoder ? p.first_position : cache_end) -
                                                                  (window - 1))
                                       : 0;
    a.spans = kv.spans(*p.segment->table, li, cache_begin, cache_end);
    if (!p.segment->encoder)
      a.spans.push_back(KeySpan{k.row(p.first_row), v.row(p.first_row), p.rows, p.first_position, DType::F32,
                                k.product_input.row(p.first_row), v.product_input.row(p.first_row)});
    segments.push_back(std::move(a));
  }
  be.attention(q, segments, c.num_heads, L.num_kv_heads, L.head_dim, attn, m.bf16_activations);

  Activation projected = be.alloc_output(n - first, H);
  be.linear_with_input_quant(attn, W.o_proj, projected, rows_encoder);
  feed_forward(m, W, projected, rows_h, rows_encoder, next_norm, next);
}

// forward()'s pass over segments whose encoder rows all run on weights W.
Activation forward_pass(ModelState& m, const ModelWeights& W, KvCache& kv, std::vector<Segment>& segments,
                        const Activation* logits_out, bool softcap) {
  Backend& be = *m.backend;
  const ModelConfig& c = m.config;
  const int64_t H = c.hidden_size;

  // Lay the rows out: encoder segments first, then decoder segments.
  std::vector<Placed> placed;
  std::vector<int64_t> positions;
  int64_t encoder_rows = 0;
  for (int pass = 0; pass < 2; ++pass) {
    for (Segment& s : segments) {
      if (s.encoder != (pass == 0)) continue;
      int64_t first_position = s.table->length();
      if (!s.encoder)  // after this batch's encoder rows of the same sequence
        for (const Placed& e : placed)
          if (e.segment->encoder && e.segment->table == s.table) first_position += e.rows;
      placed.push_back({&s, int64_t(positions.size()), s.rows(), first_position, first_position});
      for (int64_t i = 0; i < s.rows(); ++i) positions.push_back(first_position + i);
    }
    if (pass == 0) encoder_rows = int64_t(positions.size());
  }
  const int64_t n = int64_t(positions.size()), decoder_rows = n - encoder_rows;

  // Each segment's embedding rows, from its ids in backend memory (host ids go there first).
  Activation h = be.alloc_output(n, H);
  for (const Placed& p : placed) {
    const Segment& s = *p.segment;
    std::shared_ptr<void> uploaded;
    const int32_t* ids = s.token_ids;
    if (!ids) {
      uploaded = be.alloc_bytes(s.tokens.size() * sizeof(int32_t));
      be.write_bytes(uploaded.get(), s.tokens.data(), s.tokens.size() * sizeof(int32_t));
      ids = static_cast<const int32_t*>(uploaded.get());
    }
    Activation rows = h.view(p.first_row, p.rows);
    be.embed(W.embed_tokens, ids, m.embed_scale, rows);
  }

  // Decoder rows: self-conditioning. The previous step's distribution as a soft embedding
  // (zero on a block's first step; the MLP still runs), through a gated MLP, added to the
  // canvas embedding, then an unscaled norm.
  if (decoder_rows) {
    Activation soft = be.alloc(decoder_rows, H);  // zero, the rows without feedback stay so
    Activation signal = be.alloc_output(decoder_rows, H);
    for (const Placed& p : placed) {
      if (p.segment->encoder || !p.segment->self_conditioning) continue;
      Activation probs = *p.segment->self_conditioning, rows = soft.view(p.first_row - encoder_rows, p.rows);
      if (!p.segment->self_conditioning_softmax) {
        probs = be.alloc_output(p.rows, c.vocab_size);
        be.copy_rows(*p.segment->self_conditioning, 0, probs, 0, p.rows);
        be.softmax(probs);
      }
      be.linear_nt(probs, W.embed_tokens, rows);
      be.scale(rows, m.embed_scale);
    }
    Activation dec = h.view(encoder_rows, decoder_rows);
    be.rms_norm(soft, &W.sc_pre_norm, H, c.rms_norm_eps, soft);
    gated_mlp(be, soft, 0, W.sc_gate_up, W.sc_down, signal);
    be.add(dec, signal, dec);
    be.rms_norm(dec, nullptr, H, c.rms_norm_eps, dec);
  }

  // Each layer's input norm comes from the layer before, whose last op writes it; the last
  // layer's writes the final norm of the decoder rows, the lm_head's input.
  const Weight& lm_head = W.lm_head.empty() ? W.embed_tokens : W.lm_head;
  Activation x = alloc_layer_input(m, W, 0, n);
  be.rms_norm(h, &W.layers[0].input_layernorm, H, c.rms_norm_eps, x);
  for (int li = 0; li < c.num_layers; ++li) {
    const bool last = li == c.num_layers - 1;
    Activation next = last ? be.alloc_product_input(decoder_rows, H, {&lm_head}) : alloc_layer_input(m, W, li + 1, n);
    layer_forward(m, W.layers[li], kv, li, h, x, positions, placed, encoder_rows,
                  last ? W.norm : W.layers[li + 1].input_layernorm, next);
    x = next;
  }
  for (Placed& p : placed)
    if (p.segment->encoder) kv.append(*p.segment->table, p.segment->tokens);

  if (logits_out && (logits_out->rows != decoder_rows || logits_out->cols != c.vocab_size))
    throw InvalidArgument("forward: the logits matrix is not [denoise rows, vocab]");
  Activation logits = logits_out ? *logits_out : be.alloc_output(decoder_rows, c.vocab_size);
  if (decoder_rows) {
    be.linear_with_input_quant(x, lm_head, logits, 0);
    if (softcap && c.final_logit_softcapping > 0) be.softcap(logits, c.final_logit_softcapping);
  }
  return logits;
}

}  // namespace

Activation forward(ModelState& m, KvCache& kv, std::vector<Segment>& segments, const Activation* logits_out,
                   bool softcap) {
  const ModelWeights* encoder = m.weights.encoder.get();
  const auto is_encoder = [](const Segment& s) { return s.encoder; };
  if (!encoder || std::none_of(segments.begin(), segments.end(), is_encoder))
    return forward_pass(m, m.weights, kv, segments, logits_out, softcap);
  if (std::all_of(segments.begin(), segments.end(), is_encoder))
    return forward_pass(m, *encoder, kv, segments, logits_out, softcap);
  // An untied encoder's rows run on its own weights, in a pass before the decoder's, whose
  // segments then read their keys and values from the cache (in one pass they read them
  // from the same layer's rows: the same values).
  std::vector<Segment> encoders, decoders;
  for (const Segment& s : segments) (s.encoder ? encoders : decoders).push_back(s);
  forward_pass(m, *encoder, kv, encoders, nullptr, softcap);
  return forward_pass(m, m.weights, kv, decoders, logits_out, softcap);
}

}  // namespace diffuserve
