"""Write a DiffusionGemma checkpoint with random weights, in the Hugging Face layout.

For examples, benchmarks and the C++ embedding demo: it needs only numpy, and the files
are what `save_pretrained` writes (config.json, generation_config.json, model.safetensors),
so transformers loads them too. The weights are random: the model's output is noise.
"""
from __future__ import annotations

import json
import os

import numpy as np

from .safetensors_io import bf16_bits, write_safetensors

DEFAULT_TEXT_CONFIG = dict(
    vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=64, global_head_dim=128, num_global_key_value_heads=1, sliding_window=64,
    num_experts=8, top_k_experts=2, moe_intermediate_size=128, rms_norm_eps=1e-6, final_logit_softcapping=30.0,
    max_position_embeddings=131072, eos_token_id=1, bos_token_id=2, pad_token_id=0,
)


# Each dtype a checkpoint may name: its values as safetensors stores them.
_STORED_AS = {"float32": lambda a: ("F32", a.astype(np.float32)), "bfloat16": lambda a: ("BF16", bf16_bits(a)),
              "float16": lambda a: ("F16", a.astype(np.float16))}


def write_random_checkpoint(path, canvas_length: int = 64, dtype: str = "float32", seed: int = 0,
                            fill: str = "normal", **text) -> str:
    """Writes a random-weight checkpoint to `path`; `text` overrides DEFAULT_TEXT_CONFIG fields.

    `layer_types` defaults to sliding layers with a full-attention layer every 4th and last.
    fill: "normal" draws every weight; "repeat" repeats a block of 65,536 drawn values through
    each linear, quick to make at a real model's sizes (benchmarks/load_time.py).
    """
    if fill not in ("normal", "repeat"):
        raise ValueError(f"fill must be 'normal' or 'repeat', not {fill!r}")
    if dtype not in _STORED_AS:  # (config.json had named another than the weights')
        *others, last = map(repr, _STORED_AS)
        raise ValueError(f"dtype must be {', '.join(others)} or {last}, not {dtype!r}")
    cfg = {**DEFAULT_TEXT_CONFIG, **text}
    n_layers = cfg["num_hidden_layers"]
    cfg.setdefault("layer_types", ["full_attention" if (i + 1) % 4 == 0 or i == n_layers - 1 else "sliding_attention"
                                   for i in range(n_layers)])
    # transformers' config makes the last layer full attention whatever layer_types says (and
    # writes it so): its weights then take the full layers' shapes.
    if cfg["layer_types"]:
        cfg["layer_types"] = [*cfg["layer_types"][:-1], "full_attention"]
    global_head_dim = cfg.pop("global_head_dim")
    global_kv = cfg.pop("num_global_key_value_heads")
    cfg["per_layer_config"] = {str(i): {"head_dim": global_head_dim, "num_key_value_heads": global_kv}
                               for i, t in enumerate(cfg["layer_types"]) if t == "full_attention"}
    cfg["rope_parameters"] = {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
    }
    cfg.update(model_type="diffusion_gemma_text", hidden_activation="gelu_pytorch_tanh", attention_bias=False,
               tie_word_embeddings=True)

    rng = np.random.default_rng(seed)
    H, I, E, MI = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_experts"], cfg["moe_intermediate_size"]
    store = _STORED_AS[dtype]
    tensors = {}

    def add(name, shape, kind="linear"):
        if kind == "norm":
            value = 1.0 + 0.1 * rng.standard_normal(shape)
        elif kind == "one":
            value = np.ones(shape)
        elif fill == "repeat" and np.prod(shape) > 1 << 16:
            stored_as, block = store((rng.standard_normal(1 << 16) / np.sqrt(shape[-1])).astype(np.float32))
            tensors[name] = (stored_as, np.resize(block, shape))
            return
        else:
            value = rng.standard_normal(shape) / np.sqrt(shape[-1])
        tensors[name] = store(value.astype(np.float32))

    d = "model.decoder."
    add(d + "embed_tokens.weight", (cfg["vocab_size"], H))
    add(d + "norm.weight", (H,), "norm")
    for part, shape in [("pre_norm.weight", (H,)), ("gate_proj.weight", (I, H)), ("up_proj.weight", (I, H)),
                        ("down_proj.weight", (H, I))]:
        add(d + "self_conditioning." + part, shape, "norm" if "norm" in part else "linear")
    for i, layer_type in enumerate(cfg["layer_types"]):
        full = layer_type == "full_attention"
        hd, kv = (global_head_dim, global_kv) if full else (cfg["head_dim"], cfg["num_key_value_heads"])
        p = f"{d}layers.{i}."
        q_out = cfg["num_attention_heads"] * hd
        add(p + "self_attn.q_proj.weight", (q_out, H))
        add(p + "self_attn.k_proj.weight", (kv * hd, H))
        if not full:
            add(p + "self_attn.v_proj.weight", (kv * hd, H))
        add(p + "self_attn.o_proj.weight", (H, q_out))
        add(p + "self_attn.q_norm.weight", (hd,), "norm")
        add(p + "self_attn.k_norm.weight", (hd,), "norm")
        for norm in ["input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm", "post_feedforward_layernorm_1", "post_feedforward_layernorm_2",
                     "pre_feedforward_layernorm_2"]:
            add(p + norm + ".weight", (H,), "norm")
        add(p + "mlp.gate_proj.weight", (I, H))
        add(p + "mlp.up_proj.weight", (I, H))
        add(p + "mlp.down_proj.weight", (H, I))
        add(p + "router.proj.weight", (E, H))
        add(p + "router.scale", (H,), "norm")
        add(p + "router.per_expert_scale", (E,), "norm")
        add(p + "experts.gate_up_proj", (E, 2 * MI, H))
        add(p + "experts.down_proj", (E, H, MI))
        add(p + "layer_scalar", (1,), "one")
        add(f"model.encoder.language_model.layers.{i}.layer_scalar", (1,), "one")

    os.makedirs(path, exist_ok=True)
    config = {"architectures": ["DiffusionGemmaForBlockDiffusion"], "model_type": "diffusion_gemma",
              "canvas_length": canvas_length, "tie_word_embeddings": True, "dtype": dtype, "text_config": cfg,
              # A minimal vision tower config so transformers builds a small one; we write no vision weights.
              "vision_config": {"model_type": "gemma4_vision", "hidden_size": 16, "intermediate_size": 16,
                                "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2,
                                "head_dim": 8}}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    # The special ids there too, as a released checkpoint's (generation takes its EOS and pad
    # ids from this file alone, as transformers does).
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"max_denoising_steps": 48, "t_min": 0.4, "t_max": 0.8, "stability_threshold": 1,
                   "confidence_threshold": 0.005,
                   "sampler_config": {"entropy_bound": 0.1, "_cls_name": "EntropyBoundSamplerConfig"},
                   **{key: cfg[key] for key in ("eos_token_id", "pad_token_id", "bos_token_id") if key in cfg}},
                  f, indent=2)
    write_safetensors(os.path.join(path, "model.safetensors"), tensors)
    return str(path)
