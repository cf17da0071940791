// DiffusionGemma's two passes over one shared Gemma-4 MoE backbone:
//   encoder: causal, over the prompt and each finished block; appends every layer's KV.
//   decoder: bidirectional over the canvas; reads the KV, never writes it; adds the
//            self-conditioning signal and ends in softcapped logits.
// Numerics follow transformers' modeling_diffusion_gemma.py (the oracle).
#include "model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <set>

#include "diffuserve/errors.h"

namespace diffuserve {
namespace {

// Hands out checkpoint tensors by name, checking shape and dtype, and remembers which
// were taken so that leftovers can be reported.
class TensorSource {
 public:
  TensorSource(ModelState& m, DType as) : m_(m), as_(as) {}

  const TensorView& take(const std::string& name, const std::vector<int64_t>& shape) {
    const TensorView* t = m_.checkpoint->find(name);
    if (!t) throw FormatError(m_.path + ": missing tensor '" + name + "' (expected shape " + shape_string(shape) + ")");
    if (t->shape != shape)
      throw FormatError(t->file + ": tensor '" + name + "' has shape " + shape_string(t->shape) + ", expected " +
                        shape_string(shape));
    if (t->dtype != DType::F32 && t->dtype != DType::BF16 && t->dtype != DType::F16)
      throw FormatError(t->file + ": tensor '" + name + "' has dtype " + dtype_name(t->dtype) +
                        "; expected F32, BF16 or F16");
    taken_.insert(name);
    return *t;
  }

  Weight weight(const std::string& name, const std::vector<int64_t>& shape) {
    const TensorView& t = take(name, shape);
    return m_.backend->upload(t.data, t.dtype, t.shape, as_, m_.checkpoint);
  }

  // Several [n_i, K] tensors stacked along rows into one weight (gate and up in one GEMM).
  Weight stacked(const std::vector<std::string>& names, const std::vector<int64_t>& part_shape) {
    auto host = std::make_shared<std::vector<float>>();
    for (const auto& name : names) {
      const std::vector<float> part = floats(name, part_shape);
      host->insert(host->end(), part.begin(), part.end());
    }
    std::vector<int64_t> shape = part_shape;
    shape[0] *= int64_t(names.size());
    return m_.backend->upload(host->data(), DType::F32, shape, as_, host);
  }

  // A small tensor (norm weights, scales) read into fp32.
  std::vector<float> floats(const std::string& name, const std::vector<int64_t>& shape) {
    const TensorView& t = take(name, shape);
    std::vector<float> out(t.numel());
    for (int64_t i = 0; i < t.numel(); ++i) {
      uint16_t h;
      switch (t.dtype) {
        case DType::F32: std::memcpy(&out[i], t.data + 4 * i, 4); break;
        case DType::BF16: std::memcpy(&h, t.data + 2 * i, 2); out[i] = bf16_to_f32(h); break;
        default: std::memcpy(&h, t.data + 2 * i, 2); out[i] = f16_to_f32(h); break;
      }
      // Stored values are rounded to the weight dtype, as the reference holds them.
      out[i] = round_to_dtype(out[i], as_);
    }
    return out;
  }

  // Every tensor that was not taken must be one we deliberately skip.
  void check_all_taken(bool tied) const {
    for (const auto& [name, view] : m_.checkpoint->tensors()) {
      if (taken_.count(name)) continue;
      if (name.rfind("model.encoder.vision_tower.", 0) == 0 || name.rfind("model.encoder.embed_vision.", 0) == 0)
        continue;  // the vision tower: this engine serves text only
      if (tied && name == "lm_head.weight") continue;  // a copy of the tied embedding
      throw FormatError(view.file + ": unexpected tensor '" + name + "' (not part of a DiffusionGemma text model)");
    }
  }

 private:
  ModelState& m_;
  DType as_;
  std::set<std::string> taken_;
};

}  // namespace

void load_weights(ModelState& m, DType as) {
  const ModelConfig& c = m.config;
  TensorSource src(m, as);
  ModelWeights& w = m.weights;
  const int64_t H = c.hidden_size, I = c.intermediate_size, E = c.num_experts, MI = c.moe_intermediate_size;
  const std::string d = "model.decoder.";

  w.embed_tokens = src.weight(d + "embed_tokens.weight", {c.vocab_size, H});
  if (!c.tie_word_embeddings) w.lm_head = src.weight("lm_head.weight", {c.vocab_size, H});
  w.norm = src.floats(d + "norm.weight", {H});
  const std::string sc = d + "self_conditioning.";
  w.sc_pre_norm = src.floats(sc + "pre_norm.weight", {H});
  w.sc_gate_up = src.stacked({sc + "gate_proj.weight", sc + "up_proj.weight"}, {I, H});
  w.sc_down = src.weight(sc + "down_proj.weight", {H, I});

  for (int i = 0; i < c.num_layers; ++i) {
    const LayerConfig& L = c.layers[i];
    const std::string p = d + "layers." + std::to_string(i) + ".";
    const int64_t q_out = int64_t(c.num_heads) * L.head_dim, kv_out = int64_t(L.num_kv_heads) * L.head_dim;
    LayerWeights lw;
    lw.q_proj = src.weight(p + "self_attn.q_proj.weight", {q_out, H});
    lw.k_proj = src.weight(p + "self_attn.k_proj.weight", {kv_out, H});
    if (L.has_v_proj) lw.v_proj = src.weight(p + "self_attn.v_proj.weight", {kv_out, H});
    lw.o_proj = src.weight(p + "self_attn.o_proj.weight", {H, q_out});
    lw.q_norm = src.floats(p + "self_attn.q_norm.weight", {L.head_dim});
    lw.k_norm = src.floats(p + "self_attn.k_norm.weight", {L.head_dim});
    lw.input_layernorm = src.floats(p + "input_layernorm.weight", {H});
    lw.post_attention_layernorm = src.floats(p + "post_attention_layernorm.weight", {H});
    lw.pre_feedforward_layernorm = src.floats(p + "pre_feedforward_layernorm.weight", {H});
    lw.post_feedforward_layernorm = src.floats(p + "post_feedforward_layernorm.weight", {H});
    lw.post_feedforward_layernorm_1 = src.floats(p + "post_feedforward_layernorm_1.weight", {H});
    lw.post_feedforward_layernorm_2 = src.floats(p + "post_feedforward_layernorm_2.weight", {H});
    lw.pre_feedforward_layernorm_2 = src.floats(p + "pre_feedforward_layernorm_2.weight", {H});
    lw.mlp_gate_up = src.stacked({p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"}, {I, H});
    lw.mlp_down = src.weight(p + "mlp.down_proj.weight", {H, I});
    lw.router_proj = src.weight(p + "router.proj.weight", {E, H});
    lw.router_scale = src.floats(p + "router.scale", {H});
    lw.router_per_expert_scale = src.floats(p + "router.per_expert_scale", {E});
    lw.experts_gate_up = src.weight(p + "experts.gate_up_proj", {E, 2 * MI, H});
    lw.experts_down = src.weight(p + "experts.down_proj", {E, H, MI});
    lw.decoder_layer_scalar = src.floats(p + "layer_scalar", {1})[0];
    lw.encoder_layer_scalar =
        src.floats("model.encoder.language_model.layers." + std::to_string(i) + ".layer_scalar", {1})[0];
    w.layers.push_back(std::move(lw));
  }
  src.check_all_taken(c.tie_word_embeddings);
  m.weight_dtype = as;
  m.embed_scale = round_to_dtype(std::sqrt(float(H)), as);
}

namespace {

// K and V of `x` for one layer: k_norm + RoPE on K; V is v_proj(x) (or, on full-attention
// layers, the raw k_proj output) through an unscaled norm.
void project_kv(ModelState& m, int li, const Activation& x, const std::vector<int64_t>& positions, Activation& k,
                Activation& v) {
  Backend& be = *m.backend;
  const LayerConfig& L = m.config.layers[li];
  const LayerWeights& W = m.weights.layers[li];
  be.linear(x, W.k_proj, k);
  if (L.has_v_proj) be.linear(x, W.v_proj, v);
  else be.copy_rows(k, 0, v, 0, k.rows);
  be.rms_norm(k, W.k_norm, L.head_dim, m.config.rms_norm_eps, k);
  be.rope(k, L.head_dim, L.rope_inv_freq, positions);
  be.rms_norm(v, {}, L.head_dim, m.config.rms_norm_eps, v);
}

void append_kv(Backend& be, LayerCache& c, const Activation& k, const Activation& v) {
  const int64_t need = c.rows + k.rows;
  if (c.keys.rows < need) {
    const int64_t capacity = std::max(need, 2 * c.keys.rows);
    Activation nk = be.alloc(capacity, k.cols), nv = be.alloc(capacity, k.cols);
    if (c.rows) {
      be.copy_rows(c.keys, 0, nk, 0, c.rows);
      be.copy_rows(c.values, 0, nv, 0, c.rows);
    }
    c.keys = nk;
    c.values = nv;
  }
  be.copy_rows(k, 0, c.keys, c.rows, k.rows);
  be.copy_rows(v, 0, c.values, c.rows, v.rows);
  c.rows = need;
}

// Sliding layers keep the last window - 1 rows: all that a later query (which sees keys
// j > p - window) or the decoder (which sees the cache whole) can still read.
void trim_to_window(Backend& be, LayerCache& c, int64_t window) {
  const int64_t keep = window - 1;
  if (c.rows <= keep) return;
  const int64_t drop = c.rows - keep;
  be.copy_rows(c.keys, drop, c.keys, 0, keep);
  be.copy_rows(c.values, drop, c.values, 0, keep);
  c.rows = keep;
  c.first_position += drop;
}

KeySpan span_of(const LayerCache& c) { return {c.keys.data, c.values.data, c.rows, c.first_position}; }

// out = gated GELU MLP of x with stacked [gate; up] weights.
void gated_mlp(Backend& be, const Activation& x, const Weight& gate_up, const Weight& down, Activation& out) {
  Activation gu = be.alloc(x.rows, gate_up.shape[0]), act = be.alloc(x.rows, gate_up.shape[0] / 2);
  be.linear(x, gate_up, gu);
  be.gelu_glu(gu, act);
  be.linear(act, down, out);
}

// The feed-forward half of a layer, in place on h:
//   h = (h + post_ff(post_ff_1(mlp(pre_ff(h))) + post_ff_2(experts(pre_ff_2(h), route(h))))) * scalar
void feed_forward(ModelState& m, int li, Activation& h, float layer_scalar) {
  Backend& be = *m.backend;
  const LayerWeights& W = m.weights.layers[li];
  const float eps = m.config.rms_norm_eps;
  const int64_t n = h.rows, H = h.cols;
  Activation x = be.alloc(n, H), dense = be.alloc(n, H), moe = be.alloc(n, H);
  be.rms_norm(h, W.pre_feedforward_layernorm, H, eps, x);
  gated_mlp(be, x, W.mlp_gate_up, W.mlp_down, dense);
  be.rms_norm(dense, W.post_feedforward_layernorm_1, H, eps, dense);

  const Routing routing = be.route(h, W.router_proj, W.router_scale, W.router_per_expert_scale,
                                   m.config.top_k_experts, eps);
  be.rms_norm(h, W.pre_feedforward_layernorm_2, H, eps, x);
  be.experts(x, routing, W.experts_gate_up, W.experts_down, moe);
  be.rms_norm(moe, W.post_feedforward_layernorm_2, H, eps, moe);

  be.add(dense, moe, x);
  be.rms_norm(x, W.post_feedforward_layernorm, H, eps, x);
  be.add(h, x, h);
  be.scale(h, layer_scalar);
}

// One layer. `cache` is the layer's KV; the encoder appends to it (mutable_cache), the
// decoder attends to it plus its own canvas keys.
void layer_forward(ModelState& m, int li, Activation& h, const std::vector<int64_t>& positions,
                   LayerCache* mutable_cache, const LayerCache& cache) {
  Backend& be = *m.backend;
  const ModelConfig& c = m.config;
  const LayerConfig& L = c.layers[li];
  const LayerWeights& W = m.weights.layers[li];
  const bool encoder = mutable_cache != nullptr;
  const int64_t n = h.rows, H = h.cols, kv_cols = int64_t(L.num_kv_heads) * L.head_dim;
  const int64_t q_cols = int64_t(c.num_heads) * L.head_dim;

  Activation x = be.alloc(n, H);
  be.rms_norm(h, W.input_layernorm, H, c.rms_norm_eps, x);
  Activation k = be.alloc(n, kv_cols), v = be.alloc(n, kv_cols);
  project_kv(m, li, x, positions, k, v);

  std::vector<KeySpan> spans;
  if (encoder) {
    append_kv(be, *mutable_cache, k, v);
    spans = {span_of(*mutable_cache)};
    // The encoder's last layer feeds nothing but its KV: the rest of it is dead work.
    if (li == c.num_layers - 1) {
      if (L.sliding) trim_to_window(be, *mutable_cache, c.sliding_window);
      return;
    }
  } else {
    spans = {span_of(cache), KeySpan{k.data, v.data, n, positions[0]}};
  }

  Activation q = be.alloc(n, q_cols), attn = be.alloc(n, q_cols);
  be.linear(x, W.q_proj, q);
  be.rms_norm(q, W.q_norm, L.head_dim, c.rms_norm_eps, q);
  be.rope(q, L.head_dim, L.rope_inv_freq, positions);
  be.attention(q, positions, spans, c.num_heads, L.num_kv_heads, L.head_dim, /*causal=*/encoder,
               L.sliding ? c.sliding_window : 0, attn);
  if (encoder && L.sliding) trim_to_window(be, *mutable_cache, c.sliding_window);

  be.linear(attn, W.o_proj, x);
  be.rms_norm(x, W.post_attention_layernorm, H, c.rms_norm_eps, x);
  be.add(h, x, h);
  feed_forward(m, li, h, encoder ? W.encoder_layer_scalar : W.decoder_layer_scalar);
}

std::vector<int64_t> positions_from(int64_t first, int64_t n) {
  std::vector<int64_t> p(n);
  for (int64_t i = 0; i < n; ++i) p[i] = first + i;
  return p;
}

}  // namespace

void encoder_forward(ModelState& m, std::vector<LayerCache>& cache, int64_t first_position,
                     std::span<const int32_t> ids) {
  Backend& be = *m.backend;
  const std::vector<int32_t> tokens(ids.begin(), ids.end());
  const std::vector<int64_t> positions = positions_from(first_position, int64_t(tokens.size()));
  Activation h = be.alloc(int64_t(tokens.size()), m.config.hidden_size);
  be.embed(m.weights.embed_tokens, tokens, m.embed_scale, h);
  for (int li = 0; li < m.config.num_layers; ++li) layer_forward(m, li, h, positions, &cache[li], cache[li]);
}

Activation decoder_forward(ModelState& m, const std::vector<LayerCache>& cache, int64_t first_position,
                           std::span<const int32_t> canvas, const Activation* self_conditioning_logits) {
  Backend& be = *m.backend;
  const ModelConfig& c = m.config;
  const ModelWeights& W = m.weights;
  const int64_t n = int64_t(canvas.size()), H = c.hidden_size;
  const std::vector<int32_t> tokens(canvas.begin(), canvas.end());
  const std::vector<int64_t> positions = positions_from(first_position, n);

  Activation h = be.alloc(n, H);
  be.embed(W.embed_tokens, tokens, m.embed_scale, h);

  // Self-conditioning: the previous step's distribution as a soft embedding (zero on a
  // block's first step; the MLP still runs), through a gated MLP, added to the canvas
  // embedding, then an unscaled norm.
  Activation soft = be.alloc(n, H), signal = be.alloc(n, H);
  if (self_conditioning_logits) {
    Activation probs = be.alloc(n, c.vocab_size);
    be.copy_rows(*self_conditioning_logits, 0, probs, 0, n);
    be.softmax(probs);
    be.linear_nt(probs, W.embed_tokens, soft);
    be.scale(soft, m.embed_scale);
  }
  be.rms_norm(soft, W.sc_pre_norm, H, c.rms_norm_eps, soft);
  gated_mlp(be, soft, W.sc_gate_up, W.sc_down, signal);
  be.add(h, signal, h);
  be.rms_norm(h, {}, H, c.rms_norm_eps, h);

  for (int li = 0; li < c.num_layers; ++li) layer_forward(m, li, h, positions, nullptr, cache[li]);

  be.rms_norm(h, W.norm, H, c.rms_norm_eps, h);
  Activation out = be.alloc(n, c.vocab_size);
  be.linear(h, W.lm_head.empty() ? W.embed_tokens : W.lm_head, out);
  if (c.final_logit_softcapping > 0) be.softcap(out, c.final_logit_softcapping);
  return out;
}

}  // namespace diffuserve
