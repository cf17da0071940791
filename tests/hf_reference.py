"""Tiny random DiffusionGemma checkpoints built with transformers, and the reference passes.

Every parameter and buffer is randomised (norm weights, layer scalars, router scales
included), so a mistake in any of them shows in the logits.
"""
from __future__ import annotations

import inspect

import torch
import transformers
from transformers import DynamicCache
from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

transformers.logging.set_verbosity_error()  # no load reports or progress bars in test output

TINY_VISION = dict(model_type="gemma4_vision", hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                   num_attention_heads=2, num_key_value_heads=2, head_dim=8)


S, F = "sliding_attention", "full_attention"


def text(layer_types, **kw):
    """A tiny text_config with the given layer types; `kw` overrides fields."""
    base = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                head_dim=8, global_head_dim=16, num_global_key_value_heads=1, sliding_window=8, num_experts=4,
                top_k_experts=2, moe_intermediate_size=16)
    return {**base, **kw, "layer_types": layer_types, "num_hidden_layers": len(layer_types)}


def model_config(text: dict, canvas_length: int, **config) -> DiffusionGemmaConfig:
    """A DiffusionGemmaConfig of `text`'s text_config fields, the tiny vision tower and the canvas;
    `config` DiffusionGemmaConfig's own fields (tie_word_embeddings)."""
    return DiffusionGemmaConfig(text_config=dict(text), vision_config=dict(TINY_VISION), canvas_length=canvas_length,
                                **config)


def build_model(text: dict, canvas_length: int, seed: int = 0, dtype=torch.float32, router_std: float = 0.08,
                **config):
    """A randomly initialised HF model; `text` holds text_config fields (plus global_head_dim etc.),
    `config` DiffusionGemmaConfig's own (tie_word_embeddings).

    router_std: spread of the router weights. A larger one makes routing decisive, so that
    low-precision rounding noise does not flip a token's top-k experts (a discontinuity
    that would swamp the rounding error a bf16 comparison means to bound).
    """
    cfg = model_config(text, canvas_length, **config)
    torch.manual_seed(seed)
    model = DiffusionGemmaForBlockDiffusion(cfg).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if "vision" in name or not p.is_floating_point() or "inv_freq" in name or "embed_scale" in name:
                continue
            if name.endswith("layer_scalar"):
                p.copy_(0.5 + torch.rand(p.shape, generator=gen))
            elif "norm" in name or name.endswith(("router.scale", "per_expert_scale")):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("router.proj.weight"):
                p.copy_(router_std * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=gen))
    return model


def save(model, path, dtype=torch.float32, max_shard_size=None):
    """save_pretrained with the weights in `dtype`; returns the path."""
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.to(dtype).save_pretrained(path, **kwargs)
    model.to(torch.float32)
    return path


def load(path, dtype=torch.float32, **kwargs):
    """The reference as a user gets it: from_pretrained in `dtype`. (Casting a live model
    with .to(bf16) would also round its RoPE inv_freq buffers, which loading does not.)
    kwargs go to from_pretrained: experts_implementation="eager" for odd hidden sizes, whose
    rows the default grouped_mm refuses ("strides should be multiple of 16 bytes")."""
    return DiffusionGemmaForBlockDiffusion.from_pretrained(path, dtype=dtype, **kwargs).eval()


def load_exact(path, checkpoint_dtype, **kwargs):
    """The reference in fp32 on the parameters a `checkpoint_dtype` model holds: its weights as
    stored, and sqrt(hidden_size), which transformers computes as the embeddings' scale and
    rounds to the model's dtype, rounded so (a bf16 model scales by bf16(sqrt(35)) = 5.906 for
    5.916, which a hidden size of 32 hardly shows: 5.65625 for 5.65685)."""
    model = load(path, torch.float32, **kwargs)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("embed_tokens.embed_scale"):
                buffer.copy_(buffer.to(checkpoint_dtype).float())
    return model


class ReferenceSequence:
    """prefill / denoise / commit through the HF modules, mirroring diffuserve.Sequence."""

    def __init__(self, model):
        self.model = model
        self.cache = DynamicCache(config=model.config.text_config)
        # The cache's keyword: past_key_values up to transformers 5.23, cache from 5.24 (which
        # warns at the old name, to be removed in 5.40).
        name = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
        self.with_cache = {name: self.cache}

    @torch.no_grad()
    def prefill(self, ids):
        self.model.model.encoder(input_ids=torch.tensor([list(ids)]), **self.with_cache)

    commit = prefill

    @torch.no_grad()
    def denoise(self, canvas, self_conditioning_logits=None):
        sc = None if self_conditioning_logits is None else torch.as_tensor(self_conditioning_logits)[None]
        out = self.model(decoder_input_ids=torch.tensor([list(canvas)]), self_conditioning_logits=sc,
                         **self.with_cache)
        return out.logits[0].float().numpy()

    def kv(self, layer):
        lay = self.cache.layers[layer]
        return lay.keys[0].float().numpy(), lay.values[0].float().numpy()
