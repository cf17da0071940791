"""A lean training forward of transformers' DiffusionGemmaForBlockDiffusion for the Sudoku
trainer: the same logits as

    hf_model(input_ids=prompts, decoder_input_ids=canvas, self_conditioning_logits=sc).logits

computed from the HF model's own parameters (so the optimizer trains the HF model and
save_pretrained writes it), without HF's per-call overhead: no caches or mask building, no
Python loop over experts, no data-dependent shapes, so torch.compile takes the whole
forward as one graph (fullgraph=True) with static shapes, as CUDA graphs need.

What HF computes, and how this follows it:
- The encoder runs the prompt causally (sliding layers: each token sees itself and the
  window - 1 before it) and leaves its K/V in a cache; the decoder runs the canvas, each
  layer attending bidirectionally to the canvas and to that layer's cached prompt K/V, all
  of it on full layers but only the last window - 1 prompt tokens on sliding ones (what
  DynamicSlidingWindowLayer keeps; the canvas itself is not windowed). Positions continue
  from the prompt into the canvas. The encoder's and decoder's weights are tied, so here
  both run as one sequence, prompt then canvas, through each layer once, with a mask that
  gives every row exactly the keys HF gives it: half the kernel launches, the same values.
- Attention: q/k RMS-normed with weights, v RMS-normed without; full layers have no v_proj
  (v is k's projection before its norm); RoPE per layer type (the full layers' proportional
  RoPE rotates only part of the head); scaling 1 (the norms set the scale); GQA by
  repeating K/V heads.
- Each layer: attention, then a dense gated MLP and a mixture of experts side by side on
  the same residual, each with its own norms, summed, normed, added; then the layer scalar
  (a buffer, the encoder's on prompt rows and the decoder's on canvas rows).
- Router: RMS norm without weight, times `scale` and hidden^-1/2, softmax in fp32, top-k,
  renormalised to sum 1, times the chosen experts' `per_expert_scale`. Here every expert
  runs on every token (two matmuls over all experts' weights at once) and its output is
  weighted by the routing weight, which is zero outside the token's top k: the same sum.
- Embeddings times sqrt(hidden) (padding row gets no gradient from the lookup, as in
  nn.Embedding(padding_idx)). Self-conditioning: softmax(logits) @ embeddings * sqrt(hidden),
  through a gated MLP with a pre-norm, added to the canvas embeddings, then an RMS norm
  without weight; without logits the soft embeddings are zeros (the MLP still runs, so its
  parameters get zero gradients as in HF, and AdamW treats them alike).
- Logits: the decoder's final norm, the (tied) LM head, cast to fp32, tanh softcapping.
Norms, softmaxes and dtype casts follow HF's, so bf16 autocast behaves as it does there,
except that the experts' matmuls run in bf16 like every other linear (HF's grouped_mm
experts are not autocast-aware: they run in fp32 on the fp32 master weights).
"""
import torch
import torch.nn.functional as F
from torch import nn


def _rms_norm(x, weight, eps):
    """DiffusionGemmaRMSNorm: in fp32, times `weight` itself (not 1 + weight) when it has one;
    one fused op (HF's pow(mean + eps, -0.5) is rsqrt here, a rounding apart)."""
    return F.rms_norm(x.float(), x.shape[-1:], None if weight is None else weight.float(), eps).type_as(x)


def _rope(x, cos, sin):
    """x: [batch, tokens, heads, head_dim]; cos, sin: [tokens, head_dim] (HF's rotate_half)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


def _gated_mlp(x, mlp):
    return F.linear(mlp.act_fn(F.linear(x, mlp.gate_proj.weight)) * F.linear(x, mlp.up_proj.weight),
                    mlp.down_proj.weight)


def _embed(embedding, ids):
    return F.embedding(ids, embedding.weight, embedding.padding_idx) * embedding.embed_scale.to(embedding.weight.dtype)


class LeanDiffusionGemma(nn.Module):
    """Logits of `hf_model` (a DiffusionGemmaForBlockDiffusion with tied encoder and decoder,
    as transformers builds it) for prompts of `prompt_length` tokens and canvases of the
    config's canvas_length. It holds `hf_model` as its only submodule: its parameters are the
    HF model's, and `.to()` moves both."""

    def __init__(self, hf_model, prompt_length):
        super().__init__()
        self.hf = hf_model
        text = hf_model.config.text_config
        enc, dec = hf_model.model.encoder.language_model, hf_model.model.decoder
        # One pass serves both only if they share every weight (tie_word_embeddings, the default).
        for a, b in [(enc.embed_tokens, dec.embed_tokens), (enc.norm, dec.norm), *zip(enc.layers, dec.layers)]:
            shared = dict(b.named_parameters())
            if any(shared.get(name) is not p for name, p in a.named_parameters()):
                raise ValueError("the encoder and decoder weights are not tied")
        if text.use_bidirectional_attention is not None or text.attention_bias or text.attention_dropout:
            raise ValueError("only a causal encoder without attention biases or dropout is implemented")
        self.layer_types = list(text.layer_types)
        self.eps = text.rms_norm_eps
        self.top_k = text.top_k_experts
        self.prompt_length, self.canvas_length = prompt_length, hf_model.config.canvas_length

        # The fixed-shape tables, made once: RoPE over positions 0..P+C-1 (the prompt's, then
        # the canvas's, as HF numbers them) and each layer type's mask over the joint sequence.
        p, window = prompt_length, text.sliding_window
        device = dec.embed_tokens.weight.device
        position = torch.arange(p + self.canvas_length, device=device)
        for layer_type in set(self.layer_types):
            inv_freq = getattr(dec.rotary_emb, f"{layer_type}_inv_freq")
            scaling = getattr(dec.rotary_emb, f"{layer_type}_attention_scaling")
            freqs = position[:, None].float() * inv_freq.to(device=device, dtype=torch.float)
            angles = torch.cat((freqs, freqs), dim=-1)
            self.register_buffer(f"{layer_type}_cos", angles.cos() * scaling, persistent=False)
            self.register_buffer(f"{layer_type}_sin", angles.sin() * scaling, persistent=False)
        query, key = position[:, None], position[None, :]
        canvas_row = query >= p
        # Prompt rows: causal (within the window on sliding layers). Canvas rows: the whole
        # canvas, and all of the prompt (full layers) or its last window - 1 tokens (sliding).
        self.register_buffer("full_attention_mask", canvas_row | (key <= query), persistent=False)
        self.register_buffer("sliding_attention_mask", torch.where(canvas_row, key > p - window,
                                                                   (key <= query) & (key > query - window)),
                             persistent=False)
        self.register_buffer("canvas_row", canvas_row, persistent=False)  # [P+C, 1]: where the decoder's scalars apply

    def forward(self, input_ids, decoder_input_ids, self_conditioning_logits=None):
        """input_ids: [B, P] prompt ids; decoder_input_ids: [B, C] canvas ids;
        self_conditioning_logits: [B, C, vocab] or None. Returns the logits, [B, C, vocab] fp32."""
        if (input_ids.shape[1], decoder_input_ids.shape[1]) != (self.prompt_length, self.canvas_length):
            raise ValueError(f"built for a {self.prompt_length}-token prompt and a {self.canvas_length}-token canvas")
        enc, dec = self.hf.model.encoder.language_model, self.hf.model.decoder
        canvas = _embed(dec.embed_tokens, decoder_input_ids)
        if self_conditioning_logits is None:
            soft = torch.zeros_like(canvas)  # HF's first denoising step
        else:
            embedding = dec.embed_tokens.weight
            probabilities = self_conditioning_logits.softmax(dim=-1, dtype=torch.float32).to(embedding.dtype)
            soft = torch.matmul(probabilities, embedding) * dec.embed_tokens.embed_scale.to(canvas.dtype)
        sc = dec.self_conditioning
        canvas = _rms_norm(canvas + _gated_mlp(_rms_norm(soft, sc.pre_norm.weight, self.eps), sc), None, self.eps)

        h = torch.cat([_embed(enc.embed_tokens, input_ids), canvas], dim=1)
        for i, (layer_type, enc_layer, layer) in enumerate(zip(self.layer_types, enc.layers, dec.layers)):
            # The last layer's outputs on prompt rows feed nothing (HF computes and drops them):
            # its queries, MLP and experts run on the canvas rows only.
            first = self.prompt_length if i == len(self.layer_types) - 1 else 0
            h = self._layer(h, layer, first, getattr(self, f"{layer_type}_cos"), getattr(self, f"{layer_type}_sin"),
                            getattr(self, f"{layer_type}_mask"))
            h = h * torch.where(self.canvas_row[first:], layer.layer_scalar, enc_layer.layer_scalar)
        h = _rms_norm(h, dec.norm.weight, self.eps)
        logits = F.linear(h, self.hf.lm_head.weight).float()
        cap = self.hf.final_logit_softcapping
        return torch.tanh(logits / cap) * cap

    def _layer(self, h, layer, first, cos, sin, mask):
        """One layer on h [B, T, hidden]; returns the rows from `first` on (keys and values
        come from every row)."""
        eps = self.eps
        attn = layer.self_attn
        cos, sin = cos.to(h.dtype), sin.to(h.dtype)
        x = _rms_norm(h, layer.input_layernorm.weight, eps)
        heads = (*x.shape[:2], -1, attn.head_dim)
        k = F.linear(x, attn.k_proj.weight).view(heads)
        v = F.linear(x, attn.v_proj.weight).view(heads) if attn.v_proj is not None else k  # full layers: v is k
        k = _rope(_rms_norm(k, attn.k_norm.weight, eps), cos, sin)
        v = _rms_norm(v, None, eps)
        h, x = h[:, first:], x[:, first:]
        q = F.linear(x, attn.q_proj.weight).view(*x.shape[:2], -1, attn.head_dim)
        q = _rope(_rms_norm(q, attn.q_norm.weight, eps), cos[first:], sin[first:])
        # [B, heads, T, D], K/V heads repeated for their query groups (SDPA's enable_gqa would
        # send masked attention to the math kernel on CUDA).
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        k = k.repeat_interleave(attn.num_key_value_groups, dim=1)
        v = v.repeat_interleave(attn.num_key_value_groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[first:], scale=attn.scaling)
        out = F.linear(out.transpose(1, 2).flatten(2), attn.o_proj.weight)
        h = h + _rms_norm(out, layer.post_attention_layernorm.weight, eps)

        dense = _rms_norm(_gated_mlp(_rms_norm(h, layer.pre_feedforward_layernorm.weight, eps), layer.mlp),
                          layer.post_feedforward_layernorm_1.weight, eps)
        experts = _rms_norm(self._experts(h, layer), layer.post_feedforward_layernorm_2.weight, eps)
        return h + _rms_norm(dense + experts, layer.post_feedforward_layernorm.weight, eps)

    def _experts(self, h, layer):
        """The mixture of experts on the residual h: routed as HF routes, computed densely."""
        router, experts = layer.router, layer.experts
        x = _rms_norm(h, None, self.eps) * router.scale * router.scalar_root_size
        probabilities = F.linear(x, router.proj.weight).softmax(dim=-1, dtype=torch.float32)
        top_weights, top_index = torch.topk(probabilities, self.top_k, dim=-1)
        top_weights = top_weights / top_weights.sum(dim=-1, keepdim=True)
        # [B, T, experts]: each token's routing weight per expert, zero outside its top k.
        weights = torch.zeros_like(probabilities).scatter(-1, top_index, top_weights) * router.per_expert_scale

        n, two_i, hidden = experts.gate_up_proj.shape  # [experts, 2 * intermediate, hidden]: gate rows, then up
        x = _rms_norm(h, layer.pre_feedforward_layernorm_2.weight, self.eps)
        gate_up = F.linear(x, experts.gate_up_proj.reshape(n * two_i, hidden)).unflatten(-1, (n, 2, two_i // 2))
        act = experts.act_fn(gate_up[..., 0, :]) * gate_up[..., 1, :] * weights.to(gate_up.dtype)[..., None]
        # down_proj [experts, hidden, intermediate] as one [hidden, experts * intermediate]
        # matrix: the product sums the weighted experts' outputs.
        return F.linear(act.flatten(-2), experts.down_proj.transpose(0, 1).reshape(hidden, -1))
