"""The KV cache's dtype (LoadOptions::kv_cache_dtype). With activations="bfloat16" the
attention rounds keys and values to bf16 as it reads them, so "auto" stores them rounded:
the same logits and tokens as an fp32 cache, bit for bit, in half the memory. Elsewhere the
cache stays fp32, and asking for bf16 where "auto" would not choose it is an error."""
import numpy as np
import pytest

import diffuserve as ds
from diffuserve.random_checkpoint import write_random_checkpoint
from diffuserve.safetensors_io import as_float32, bf16_bits

SHAPE = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, global_head_dim=64, num_global_key_value_heads=1,
             sliding_window=24, num_experts=4, top_k_experts=2, moe_intermediate_size=32)
MEMORY = 1 << 22


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("kv") / "m", canvas_length=16, dtype="bfloat16", seed=5,
                                   **SHAPE)


def rounded_to_bf16(x):
    """fp32 values rounded to the nearest bf16 (ties to even), as fp32."""
    return as_float32("BF16", bf16_bits(x))


def check_bf16_cache_gives_the_fp32_cache_results(path, models, load, prompt_length, prompt_lengths, new_tokens, seed):
    """models["auto"] (a bf16 cache) against models["float32"], both loaded from `path` with
    `load`: a prefill, a denoise, a commit and a self-conditioned denoise give the same logits
    bit for bit and the fp32 cache's KV rounded (sliding and full layers); then the engine
    (mixed-phase batches, commits fused with the next block's first step) over prompts of
    `prompt_lengths` gives the same tokens."""
    rng = np.random.default_rng(seed)
    m = models["float32"]
    vocab, canvas_length = m.vocab_size, m.canvas_length
    prompt = rng.integers(0, vocab, prompt_length)
    canvas, block = rng.integers(0, vocab, canvas_length), rng.integers(0, vocab, canvas_length)
    logits, kv = {}, {}
    for name, model in models.items():
        s = model.sequence()
        s.prefill(prompt)
        first = s.denoise(canvas)
        s.commit(block)
        logits[name] = (first, s.denoise(canvas, first))
        kv[name] = [s.kv(layer) for layer in range(m.config["num_layers"])]
    for a, b in zip(logits["auto"], logits["float32"]):
        np.testing.assert_array_equal(a, b)
    for (k16, v16, first16), (k32, v32, first32) in zip(kv["auto"], kv["float32"]):
        assert first16 == first32
        np.testing.assert_array_equal(k16, rounded_to_bf16(k32))
        np.testing.assert_array_equal(v16, rounded_to_bf16(v32))

    prompts = [rng.integers(0, vocab, n).tolist() for n in prompt_lengths]
    params = ds.SamplingParams(max_new_tokens=new_tokens, seed=seed + 1)
    outs = {kv: [o.token_ids for o in ds.LLM(path, kv_cache_dtype=kv, **load).generate(prompts, params)]
            for kv in ("auto", "float32")}
    assert outs["auto"] == outs["float32"]


def test_bf16_cache_gives_the_fp32_cache_results(path):
    load = dict(activations="bfloat16", kv_cache_memory_bytes=MEMORY)
    models = {kv: ds.Model.load(path, kv_cache_dtype=kv, **load) for kv in ("auto", "float32")}
    assert models["auto"].kv_cache_dtype == "bfloat16" and models["float32"].kv_cache_dtype == "float32"
    # Half the bytes a block: at least twice the blocks (the sliding pool may keep its count).
    blocks = {kv: m.cache_stats()["kv_blocks_total"] for kv, m in models.items()}
    assert blocks["auto"] >= 2 * blocks["float32"] - 2, blocks
    check_bf16_cache_gives_the_fp32_cache_results(path, models, load, prompt_length=40, prompt_lengths=(5, 33, 70),
                                                  new_tokens=40, seed=2)


def test_kv_cache_dtype_choices(path):
    assert ds.Model.load(path, kv_cache_memory_bytes=MEMORY).kv_cache_dtype == "float32"
    assert ds.Model.load(path, activations="bfloat16", kv_cache_dtype="bfloat16",
                         kv_cache_memory_bytes=MEMORY).kv_cache_dtype == "bfloat16"
    with pytest.raises(ValueError, match="kv_cache_dtype 'bfloat16' needs activations 'bfloat16'"):
        ds.Model.load(path, kv_cache_dtype="bfloat16", kv_cache_memory_bytes=MEMORY)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        ds.Model.load(path, kv_cache_dtype="float8", kv_cache_memory_bytes=MEMORY)
