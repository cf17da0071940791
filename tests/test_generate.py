"""Generation end to end: against transformers' generate, and the sampler's behaviour."""
import copy
import dataclasses
import inspect
import json
import os
import pickle
import shutil
import threading

import numpy as np
import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSamplerConfig

import diffuserve as ds
from hf_reference import F, S, build_model, load, save, text


MODELS = {
    "small": (text([S, F, F]), 8),
    "wide_canvas": (text([S, S, F], num_experts=6, top_k_experts=3, sliding_window=12), 24),
    "gqa4": (text([F, S, F], num_attention_heads=8, num_key_value_heads=2, sliding_window=16), 16),
}


def save_with_pad(model, path):
    """save() with pad_token_id 0 in generation_config.json (save_pretrained writes none), the
    pad id the comparisons below give transformers: it pads past an EOS, uncounted."""
    save(model, path)
    file = path / "generation_config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), "pad_token_id": 0}))
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("generate")
    return {name: save_with_pad(build_model(cfg, canvas, seed=i), root / name) for i, (name, (cfg, canvas)) in
            enumerate(MODELS.items())}


# Near-zero temperature makes every step's distribution one-hot and a huge entropy bound
# accepts every position: what remains is deterministic, so both engines must agree token
# for token (and in the number of steps each block took, through tokens_per_forward).
GREEDY = dict(t_min=1e-6, t_max=2e-6)
HUGE_BOUND = 1e9


def hf_generate(model, prompt, seed_canvas, eos=None):
    """transformers' greedy generate of one block from `seed_canvas`: (tokens, tokens_per_forward).
    eos None: the EOS id of the checkpoint's generation config; else these EOS ids. The pad id is
    the generation config's (save_with_pad's 0)."""
    ids = {} if eos is None else dict(eos_token_id=eos)
    out = model.generate(input_ids=torch.tensor([prompt]), decoder_input_ids=torch.tensor([seed_canvas]),
                         max_new_tokens=len(seed_canvas),
                         sampler_config=EntropyBoundSamplerConfig(entropy_bound=HUGE_BOUND), **ids, **GREEDY)
    return out.sequences[0, len(prompt):].tolist(), float(out.tokens_per_forward[0])


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("prompt_len", [3, 11, 30])
def test_matches_hf_generate(checkpoints, name, prompt_len):
    path = checkpoints[name]
    canvas = MODELS[name][1]
    hf, llm = load(path), ds.LLM(path)
    rng = np.random.default_rng(prompt_len)
    prompt = rng.integers(3, 96, prompt_len).tolist()
    seed_canvas = rng.integers(3, 96, canvas).tolist()
    expected, expected_tpf = hf_generate(hf, prompt, seed_canvas, eos=[1])
    params = ds.SamplingParams(max_new_tokens=canvas, seed_canvas=seed_canvas, entropy_bound=HUGE_BOUND,
                               eos_token_id=[1], seed=0, **GREEDY)
    out = llm.generate([prompt], params)[0]
    eos_at = expected.index(1) + 1 if 1 in expected else len(expected)
    assert out.token_ids == expected[:eos_at]
    assert out.tokens_per_forward == pytest.approx(expected_tpf)


def philox(seed, block, step, stream, position, index4=0):
    """The runtime's Philox4x32-10 words (cpp/src/philox.h) at counter (index4, position, step,
    block | stream << 30), key seed. Streams: 0 candidates, 1 renoising, 2 initial canvases."""
    m32 = 0xFFFFFFFF
    c, k = [index4, position, step, (block & 0x3FFFFFFF) | (stream << 30)], [seed & m32, seed >> 32]
    for _ in range(10):
        p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [((p1 >> 32) ^ c[1] ^ k[0]) & m32, p1 & m32, ((p0 >> 32) ^ c[3] ^ k[1]) & m32, p0 & m32]
        k = [(k[0] + 0x9E3779B9) & m32, (k[1] + 0xBB67AE85) & m32]
    return c


def uniform_tokens(seed, block, step, stream, canvas, vocab):
    """One uniformly random token per position, as the runtime draws them: the first word times vocab >> 32."""
    return [(philox(seed, block, step, stream, position)[0] * vocab) >> 32 for position in range(canvas)]


def philox_initial_canvas(seed, block, canvas, vocab):
    """Block `block`'s initial canvas as the runtime draws it (engine.cpp's start_block)."""
    return uniform_tokens(seed, block, 0, 2, canvas, vocab)


def gumbel_noise(seed, block, step, canvas, vocab):
    """The Gumbel noise the runtime adds to a step's processed logits to draw its candidates
    (philox.h's uniform_open and gumbel), [canvas, vocab]."""
    words = np.array([[w for i in range(0, vocab, 4) for w in philox(seed, block, step, 0, position, i // 4)][:vocab]
                      for position in range(canvas)], dtype=np.uint64)
    u = ((words >> 9).astype(np.float32) + np.float32(0.5)) * np.float32(2.0**-23)
    return -np.log(-np.log(u))


def hf_generate_with_our_draws(model, prompt, seed, **kwargs):
    """transformers' generate with diffuserve's random numbers in place of torch's: each block's
    initial canvas, each step's candidates (Gumbel-max over the processed logits, for
    torch.multinomial) and its renoised tokens, all addressed by (seed, block, step, position)
    as the runtime addresses them. Everything else (temperatures, acceptance, stop rule,
    self-conditioning, EOS, tokens_per_forward) is transformers' own.

    Returns (generated tokens, tokens_per_forward, closest), closest being how near any of the
    run's decisions came to a tie: an accepted candidate's or an argmax's lead over the runner-up,
    the acceptance sums' distance from entropy_bound, the mean entropy's from
    confidence_threshold. Two engines whose logits differ by float rounding can decide a near
    tie differently, and from there go different ways."""
    canvas, vocab = model.config.canvas_length, model.config.text_config.vocab_size
    at = {"block": -1, "step": 0, "closest": np.inf}

    def near(margin):
        at["closest"] = min(at["closest"], float(np.min(np.abs(margin))))

    def prepare_denoiser(self, **kw):  # a new block: its initial canvas
        at["block"], at["step"] = at["block"] + 1, 0
        kw["model_kwargs"]["decoder_input_ids"] = torch.tensor([philox_initial_canvas(seed, at["block"], canvas,
                                                                                      vocab)])
        return type(self)._prepare_denoiser_inputs(self, **kw)

    def prepare_sampler(self, config):
        sampler = type(self)._prepare_sampler(self, config)

        def renoise(accepted, cur_step):
            mask = sampler.accepted_token_mask[0].numpy()
            near(at["lead"][mask])  # only accepted candidates count
            noise = torch.tensor([uniform_tokens(seed, at["block"], at["step"], 1, canvas, vocab)])
            at["step"] += 1
            return torch.where(~sampler.accepted_token_mask, noise, accepted)

        sampler.renoise_canvas = renoise
        at["bound"] = sampler.entropy_bound
        return sampler

    def prepare_stopping(self, config):
        criteria = type(self)._prepare_diffusion_stopping_criteria(self, config)
        at["confidence"] = criteria.confidence_threshold
        return criteria

    def multinomial(probs, num_samples):
        probs = probs.double().numpy()
        log_p = np.log(np.maximum(probs, 1e-300))
        noisy = log_p + gumbel_noise(seed, at["block"], at["step"], canvas, vocab)
        at["lead"] = np.diff(np.sort(noisy, axis=1)[:, -2:], axis=1)[:, 0]
        near(np.diff(np.sort(log_p, axis=1)[:, -2:], axis=1))
        entropy = np.sort(-(probs * log_p).sum(axis=1))
        near(np.cumsum(entropy) - entropy - at["bound"])
        near(entropy.mean() - at["confidence"])
        return torch.from_numpy(noisy.argmax(axis=1))[:, None]

    patches = {"_prepare_denoiser_inputs": prepare_denoiser, "_prepare_sampler": prepare_sampler,
               "_prepare_diffusion_stopping_criteria": prepare_stopping}
    for name, f in patches.items():
        setattr(model, name, f.__get__(model))
    real_multinomial, torch.multinomial = torch.multinomial, multinomial
    try:
        out = model.generate(input_ids=torch.tensor([prompt]), **kwargs)
    finally:
        torch.multinomial = real_multinomial
        for name in patches:
            delattr(model, name)
    return out.sequences[0, len(prompt):].tolist(), float(out.tokens_per_forward[0]), at["closest"]


def hf_generate_blocks(model, prompt, seed_canvas, eos, seed, **length):
    """transformers' generate over several blocks, each later block starting from the canvas
    diffuserve draws for it (transformers draws its own with torch.randint), greedy. length:
    max_new_tokens and max_length as generate takes them (none: the checkpoint's)."""
    canvas, vocab = model.config.canvas_length, model.config.text_config.vocab_size
    blocks = iter(range(1 << 30))
    prepare = type(model)._prepare_denoiser_inputs

    def prepare_with_our_canvas(self, **kwargs):
        block = next(blocks)
        if block:
            kwargs["model_kwargs"]["decoder_input_ids"] = torch.tensor([philox_initial_canvas(seed, block, canvas,
                                                                                             vocab)])
        return prepare(self, **kwargs)

    model._prepare_denoiser_inputs = prepare_with_our_canvas.__get__(model)
    out = model.generate(input_ids=torch.tensor([prompt]), decoder_input_ids=torch.tensor([seed_canvas]),
                         **length, eos_token_id=eos, pad_token_id=0,
                         sampler_config=EntropyBoundSamplerConfig(entropy_bound=HUGE_BOUND), **GREEDY)
    return out.sequences[0, len(prompt):].tolist(), float(out.tokens_per_forward[0])


@pytest.mark.parametrize("name", ["small", "gqa4"])
@pytest.mark.parametrize("blocks", [1.5, 3])
def test_several_blocks_match_hf_generate(checkpoints, name, blocks):
    """Several blocks, each committed and the next denoised after it, against transformers'
    generate started from the same canvases; max_new_tokens of 1.5 blocks cuts the last one,
    where transformers generates (and counts in tokens_per_forward) the whole block: diffuserve
    had counted only the tokens it returns (0.211 where transformers gave 0.256)."""
    check_blocks_match_hf_generate(checkpoints[name], MODELS[name][1], blocks)


def test_untied_encoder_matches_hf_generate(tmp_path):
    """tie_word_embeddings false with encoder weights of their own: the prompt and each
    committed block run on the encoder's weights, in a pass before the next block's first step
    (one pass where the weights are shared), as transformers runs them."""
    path = save_with_pad(build_model(text([S, F, F]), 8, seed=7, tie_word_embeddings=False), tmp_path / "m")
    check_blocks_match_hf_generate(path, 8, 3)
    # In a batch, a sequence's commit runs beside another's prefill and a third's steps.
    llm, rng = ds.LLM(path), np.random.default_rng(0)
    prompts = [rng.integers(3, 96, n).tolist() for n in (5, 17, 40)]
    params = ds.SamplingParams(max_new_tokens=24, seed=11, t_min=0.5, t_max=1.0)
    assert [o.token_ids for o in llm.generate(prompts, params)] == \
        [llm.generate([p], params)[0].token_ids for p in prompts]


def check_blocks_match_hf_generate(path, canvas, blocks):
    hf, llm = load(path), ds.LLM(path)
    rng = np.random.default_rng(3)
    prompt, seed_canvas = rng.integers(3, 96, 9).tolist(), rng.integers(3, 96, canvas).tolist()
    max_new_tokens = int(blocks * canvas)
    expected, expected_tpf = hf_generate_blocks(hf, prompt, seed_canvas, [1], 5, max_new_tokens=max_new_tokens)
    assert len(expected) == -(-max_new_tokens // canvas) * canvas  # whole blocks
    out = llm.generate([prompt], ds.SamplingParams(max_new_tokens=max_new_tokens, seed_canvas=seed_canvas, seed=5,
                                                   entropy_bound=HUGE_BOUND, eos_token_id=[1], **GREEDY))[0]
    eos_at = expected.index(1) + 1 if 1 in expected else len(expected)
    assert out.token_ids == expected[:min(eos_at, max_new_tokens)]
    assert out.tokens_per_forward == pytest.approx(expected_tpf)


@pytest.mark.parametrize("name", ["small", "wide_canvas"])
def test_eos_mid_canvas_matches_hf(checkpoints, name):
    """Pick as EOS a token that first appears mid-canvas: both stop there, HF pads the rest."""
    path = checkpoints[name]
    canvas = MODELS[name][1]
    hf, llm = load(path), ds.LLM(path)
    rng = np.random.default_rng(7)
    prompt, seed_canvas = rng.integers(3, 96, 9).tolist(), rng.integers(3, 96, canvas).tolist()
    free_run, _ = hf_generate(hf, prompt, seed_canvas, eos=[95])
    mid = next(i for i in range(canvas // 3, canvas) if free_run[i] not in free_run[:i])
    eos = [free_run[mid], 2]  # several EOS ids: any of them ends the sequence
    expected, expected_tpf = hf_generate(hf, prompt, seed_canvas, eos=eos)
    assert expected[mid] == eos[0] and set(expected[mid + 1:]) == {0}  # HF's pad after EOS
    out = llm.generate([prompt], ds.SamplingParams(max_new_tokens=canvas, seed_canvas=seed_canvas, eos_token_id=eos,
                                                   entropy_bound=HUGE_BOUND, seed=0, **GREEDY))[0]
    assert out.token_ids == expected[:mid + 1]
    assert out.finish_reason == "stop"
    assert out.tokens_per_forward == pytest.approx(expected_tpf)


# The decisions of a run fed the same draws come out the same in both engines unless one came
# within float rounding of a tie; a case that does proves nothing either way, and is skipped.
# (The engines' processed logits differ by up to ~2e-4 on the bundled model, mostly far less,
# and by far less on the random ones; the bundled model's cases below keep their decisions at
# least 1e-3 from a tie, the random model's 1.5e-4.)
NEAR_TIE = 1e-4


def expect_our_draws(hf, prompt, seed, max_new_tokens, eos, **kwargs):
    """transformers' generate fed diffuserve's draws: the tokens diffuserve must return (to the first
    EOS, cut at max_new_tokens) and the tokens_per_forward it must report."""
    hf_kwargs = dict(kwargs, max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=0)
    if "entropy_bound" in kwargs:
        hf_kwargs["sampler_config"] = EntropyBoundSamplerConfig(entropy_bound=hf_kwargs.pop("entropy_bound"))
    tokens, tpf, closest = hf_generate_with_our_draws(hf, prompt, seed, **hf_kwargs)
    if closest < NEAR_TIE:
        pytest.skip(f"a decision came within {closest:.1e} of a tie, where float rounding may decide it")
    ends = [tokens.index(e) + 1 for e in eos if e in tokens]
    return tokens[:min(ends + [max_new_tokens])], tpf


class AddBias(LogitsProcessor):
    """transformers' form of a logit_bias: a logits processor adding a bias to some ids' logits
    (given to generate, it runs before the temperature schedule's)."""

    def __init__(self, bias: dict, vocab: int):
        self.add = torch.zeros(vocab)
        for token, value in bias.items():
            self.add[token] = value

    def __call__(self, input_ids, scores):
        return scores + self.add


@pytest.mark.parametrize("seed, bias", [(2, {"9": 3.0, "1": -2.0}), (5, {"9": -100.0})], ids=["moves_steps", "bans"])
def test_logit_bias_matches_hf_generate_with_a_bias_processor(seed, bias):
    """logit_bias end to end against transformers' generate given a logits processor that adds
    the same bias (and diffuserve's draws): the bias changes the run (the bundled Sudoku
    solver, sure of its digits, takes more steps to reach them; or, banned a digit, writes
    none), and both engines the same way."""
    path = ds.default_model()
    hf, llm = load(path), ds.LLM(path, dtype="float32")
    tokenizer = llm.tokenizer
    prompt = tokenizer.encode("002500146300270500000046307067008400409000002020300005780000050000400700001000080")
    bias = {tokenizer.encode(digit, add_special_tokens=False)[0]: value for digit, value in bias.items()}
    plain = expect_our_draws(hf, prompt, seed, 82, [1])
    processor = LogitsProcessorList([AddBias(bias, llm.model.vocab_size)])
    expected, expected_tpf = expect_our_draws(hf, prompt, seed, 82, [1], logits_processor=processor)
    assert (expected, expected_tpf) != plain
    out = llm.generate([prompt], ds.SamplingParams(seed=seed, logit_bias=bias))[0]
    assert out.token_ids == expected
    assert out.tokens_per_forward == pytest.approx(expected_tpf)
    if min(bias.values()) == -100:
        assert not set(bias) & set(out.token_ids)


@pytest.mark.parametrize("seed, kwargs", [
    (2, dict()),  # the checkpoint's generation_config.json: t 1.5 -> 0.5, at most 24 steps, stability 1
    (2, dict(stability_threshold=3, confidence_threshold=0.05)),
    (11, dict(stability_threshold=0, t_min=0.1, t_max=0.3, max_denoising_steps=7)),
], ids=["checkpoint_defaults", "stability_3", "stability_0_cold"])
def test_matches_hf_generate_at_real_temperatures_with_early_stops(seed, kwargs):
    """The sampler at the temperatures it is meant for, end to end against transformers' generate
    given diffuserve's random draws (the greedy comparisons above accept every position and
    leave the entropy-bound acceptance, the renoising, the temperature schedule's effect on
    the draws and the stop rule's confidence half untested together). The bundled model is
    trained, so its blocks stop early, by the stop rule, and end at its EOS; both engines read
    the defaults from its generation_config.json."""
    path = ds.default_model()
    hf, llm = load(path), ds.LLM(path, dtype="float32")
    prompt = llm.tokenizer.encode("002500146300270500000046307067008400409000002020300005780000050000400700001000080")
    expected, expected_tpf = expect_our_draws(hf, prompt, seed, 82, [1], **kwargs)
    out = llm.generate([prompt], ds.SamplingParams(seed=seed, **kwargs))[0]
    assert out.token_ids == expected and out.finish_reason == "stop"
    assert out.tokens_per_forward == pytest.approx(expected_tpf)
    assert out.denoise_steps[0] < kwargs.get("max_denoising_steps", 24)  # the stop rule ended the block


def test_matches_hf_generate_at_real_temperatures_in_odd_shapes(tmp_path):
    """As above on a random model of odd sizes (a 13-token canvas, a sliding window of 5),
    prompts shorter than, equal to and past the window, several blocks and max_new_tokens
    that cuts the last, two EOS ids, non-default temperatures and entropy bound; and a
    request's narrower canvas (5) against transformers running the same weights with a
    5-token canvas."""
    path = save_with_pad(build_model(text([S, F, S, F], sliding_window=5, vocab_size=61), 13, seed=4), tmp_path / "c13")
    narrow = tmp_path / "c5"
    narrow.mkdir()
    for f in path.iterdir():
        (narrow / f.name).write_bytes(f.read_bytes())
    config = json.loads((narrow / "config.json").read_text())
    (narrow / "config.json").write_text(json.dumps({**config, "canvas_length": 5}))
    llm, rng = ds.LLM(path), np.random.default_rng(1)
    common = dict(max_new_tokens=30, t_min=0.2, t_max=2.5, max_denoising_steps=6, entropy_bound=0.7)
    for hf, canvas_length in ((load(path), None), (load(narrow), 5)):
        for prompt_len in (1, 5, 17):
            prompt = rng.integers(2, 61, prompt_len).tolist()
            expected, expected_tpf = expect_our_draws(hf, prompt, 3, eos=[1, 7], **common)
            out = llm.generate([prompt], ds.SamplingParams(seed=3, eos_token_id=[1, 7], canvas_length=canvas_length,
                                                           **common))[0]
            assert out.token_ids == expected, (canvas_length, prompt_len)
            assert out.tokens_per_forward == pytest.approx(expected_tpf)


def test_seeded_request_is_the_same_alone_and_in_a_batch(checkpoints):
    llm = ds.LLM(checkpoints["small"])
    params = ds.SamplingParams(max_new_tokens=20, seed=1234, eos_token_id=[], max_denoising_steps=6)
    prompt = [5, 6, 7, 8]
    alone = llm.generate([prompt], params)[0]
    batch = llm.generate([[9, 9, 9], prompt, list(range(3, 40))],
                         [ds.SamplingParams(max_new_tokens=9, seed=1), params,
                          ds.SamplingParams(max_new_tokens=30, canvas_length=5, t_min=0.1, t_max=2.0)])
    assert batch[1].token_ids == alone.token_ids
    assert batch[1].denoise_steps == alone.denoise_steps
    assert llm.generate([prompt], params)[0].token_ids == alone.token_ids  # and again


def test_unseeded_requests_draw_fresh_seeds_that_replay(checkpoints):
    llm = ds.LLM(checkpoints["small"])
    params = ds.SamplingParams(max_new_tokens=16, eos_token_id=[], max_denoising_steps=4)
    a, b = llm.generate([[4, 5], [4, 5]], params)
    assert a.seed != b.seed
    replay = llm.generate([[4, 5]], ds.SamplingParams(max_new_tokens=16, eos_token_id=[], max_denoising_steps=4,
                                                      seed=a.seed))[0]
    assert replay.token_ids == a.token_ids


def test_steps_run_to_the_limit_when_never_confident(checkpoints):
    """A random model at temperature ~1 is far from the 1e-9 confidence bar: every block
    takes max_denoising_steps."""
    llm = ds.LLM(checkpoints["small"])
    out = llm.generate([[3, 4, 5]], ds.SamplingParams(max_new_tokens=24, max_denoising_steps=9, t_min=0.9, t_max=1.0,
                                                      confidence_threshold=1e-9, eos_token_id=[], seed=3))[0]
    assert out.denoise_steps == [9, 9, 9]
    # As transformers counts it: generated tokens other than the pad id, per decoder pass.
    assert out.tokens_per_forward == pytest.approx(sum(t != 0 for t in out.token_ids) / 27)


def test_a_float16_checkpoint_runs_at_near_greedy_temperatures(checkpoints, tmp_path):
    """A float16 checkpoint at the temperatures the tests' greedy runs and the server's
    temperature 0 take: its self-conditioning feedback, cast to float16, had overflowed to
    infinity and failed the request as if the model's logits were NaN."""
    model = build_model(text([S, F, F]), 8, seed=0)
    llm = ds.LLM(save(model, tmp_path / "fp16", dtype=torch.float16))
    for t_min, t_max in [(1e-6, 2e-6), (4e-4, 8e-4)]:
        params = ds.SamplingParams(max_new_tokens=16, max_denoising_steps=12, eos_token_id=[], seed=1, t_min=t_min,
                                   t_max=t_max, stability_threshold=12)
        out = llm.generate([[3, 4, 5]], params)[0]
        assert out.finish_reason == "length" and len(out.token_ids) == 16, (t_min, out.error)


def test_random_checkpoint_stores_the_dtype_its_config_names(tmp_path):
    """write_random_checkpoint's weights are stored in the dtype config.json names (a float16
    one had stored float32 under "float16"), and a dtype it cannot store is refused."""
    from diffuserve.random_checkpoint import write_random_checkpoint
    from diffuserve.safetensors_io import read_safetensors

    for dtype, stored in [("float32", "F32"), ("bfloat16", "BF16"), ("float16", "F16")]:
        path = write_random_checkpoint(tmp_path / dtype, canvas_length=8, dtype=dtype, num_hidden_layers=1)
        with open(os.path.join(path, "config.json")) as f:
            assert json.load(f)["dtype"] == dtype
        kinds = {kind for kind, _ in read_safetensors(os.path.join(path, "model.safetensors")).values()}
        assert kinds == {stored}, (dtype, kinds)
        assert ds.LLM(path).model.dtype == dtype
    with pytest.raises(ValueError, match="dtype must be 'float32', 'bfloat16' or 'float16', not 'int8'"):
        write_random_checkpoint(tmp_path / "int8", dtype="int8")


def test_stops_at_once_when_confident(checkpoints):
    """Near-zero temperature makes every position certain: with stability_threshold 0 each
    block stops after one step; with 1 it needs at least a second step to see the same
    argmax (a random model's argmax keeps moving, so it may need many more)."""
    llm = ds.LLM(checkpoints["small"])
    common = dict(max_new_tokens=24, max_denoising_steps=20, eos_token_id=[], seed=3, **GREEDY)
    out = llm.generate([[3, 4, 5]], ds.SamplingParams(stability_threshold=0, **common))[0]
    assert out.denoise_steps == [1, 1, 1]
    assert out.tokens_per_forward == pytest.approx(sum(t != 0 for t in out.token_ids) / 3)
    out = llm.generate([[3, 4, 5]], ds.SamplingParams(stability_threshold=1, **common))[0]
    assert all(s >= 2 for s in out.denoise_steps)


def test_stability_thresholds_past_the_step_limit_are_one(checkpoints):
    """A block runs max_denoising_steps steps at most, so no stability threshold from there on
    can hold: each gives the same tokens and steps, and the largest costs nothing (the ring of
    argmax canvases it had asked for, 2^31 of them, failed the request)."""
    llm = ds.LLM(checkpoints["small"])
    common = dict(max_new_tokens=24, max_denoising_steps=3, eos_token_id=[], seed=3, **GREEDY)
    outs = [llm.generate([[3, 4, 5]], ds.SamplingParams(stability_threshold=s, **common))[0]
            for s in (2, 3, 4, 2**31 - 1)]
    assert all(o.token_ids == outs[0].token_ids and o.denoise_steps == [3, 3, 3] for o in outs)


def test_a_stability_window_of_gigabytes_is_refused(checkpoints):
    """Thresholds past 1,024 steps that max_denoising_steps leaves in force are refused up front
    (a block keeps that many canvases: 2^24 of them had taken 4 GB, 2^31 failed the step of
    every request batched with it); the largest allowed runs."""
    llm = ds.LLM(checkpoints["small"])
    for steps, threshold in ((2**24, 2**24), (2**31 - 1, 1025)):
        with pytest.raises(ValueError, match="stability_threshold .* at most 1024"):
            llm.generate([[3, 4]], ds.SamplingParams(max_denoising_steps=steps, stability_threshold=threshold))
    # The largest allowed, and thresholds that only the last step could meet (which ends the
    # block anyway), however large (1,025 at 1,025 steps had been refused).
    for steps, threshold in ((2**31 - 1, 1024), (1025, 1025), (1025, 5000)):
        out = llm.generate([[3, 4]], ds.SamplingParams(max_new_tokens=4, max_denoising_steps=steps,
                                                       stability_threshold=threshold, eos_token_id=[], seed=0,
                                                       **GREEDY))[0]
        assert len(out.token_ids) == 4


def test_max_new_tokens_cuts_the_last_block(checkpoints):
    llm = ds.LLM(checkpoints["small"])
    params = ds.SamplingParams(max_new_tokens=11, eos_token_id=[], max_denoising_steps=3, seed=0)
    out = llm.generate([[3, 4]], params)[0]
    assert len(out.token_ids) == 11 and out.finish_reason == "length" and len(out.denoise_steps) == 2


def test_narrow_canvas_seed_canvas_and_pinned_positions(checkpoints):
    llm = ds.LLM(checkpoints["wide_canvas"])
    seed_canvas = list(range(10, 20))
    out = llm.generate([[3, 4, 5]], ds.SamplingParams(canvas_length=10, max_new_tokens=25, seed_canvas=seed_canvas,
                                                      pinned_positions=[0, 4, 9], eos_token_id=[],
                                                      max_denoising_steps=5, seed=2))[0]
    assert len(out.denoise_steps) == 3  # blocks of 10
    assert [out.token_ids[i] for i in (0, 4, 9)] == [10, 14, 19]  # infilling keeps the pinned tokens


def test_allowed_token_ids_constrain_every_output(checkpoints):
    llm = ds.LLM(checkpoints["gqa4"])
    allowed = [7, 8, 30, 61]
    out = llm.generate([[3, 4, 5]], ds.SamplingParams(max_new_tokens=32, allowed_token_ids=allowed, eos_token_id=[],
                                                      max_denoising_steps=4, seed=5))[0]
    assert set(out.token_ids) <= set(allowed)


def test_self_conditioning_off_feeds_no_logits(checkpoints):
    """self_conditioning=False: every step is a plain denoise of the current canvas. Near-greedy
    with every position accepted, three steps are three argmaxes of denoise(canvas) without
    self-conditioning logits; with it on, the later steps see the previous logits and differ."""
    path = checkpoints["small"]
    llm, canvas = ds.LLM(path), MODELS["small"][1]
    prompt, seed_canvas = [3, 4, 5, 6], list(range(20, 20 + canvas))
    common = dict(max_new_tokens=canvas, seed_canvas=seed_canvas, entropy_bound=HUGE_BOUND, eos_token_id=[],
                  max_denoising_steps=3, confidence_threshold=1e-30, seed=0, **GREEDY)
    off = llm.generate([prompt], ds.SamplingParams(self_conditioning=False, **common))[0]
    on = llm.generate([prompt], ds.SamplingParams(**common))[0]
    seq = llm.model.sequence()
    seq.prefill(prompt)
    expected = seed_canvas
    for _ in range(3):
        expected = seq.denoise(expected).argmax(axis=1).tolist()
    assert off.denoise_steps == [3] and off.token_ids == expected
    assert on.token_ids != expected


def copy_of_small(checkpoints, tmp_path, **generation):
    """A copy of the small checkpoint, with these fields set in its generation_config.json."""
    path = tmp_path / "m"
    shutil.copytree(checkpoints["small"], path)
    file = path / "generation_config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), **generation}))
    return path


def test_defaults_come_from_generation_config(checkpoints, tmp_path):
    path = copy_of_small(checkpoints, tmp_path, max_new_tokens=12, max_denoising_steps=3, eos_token_id=[], t_min=0.5,
                         t_max=0.6, confidence_threshold=1e-9,
                         sampler_config={"entropy_bound": 0.2, "_cls_name": "EntropyBoundSamplerConfig"})
    out = ds.LLM(path).generate([[3, 4]], ds.SamplingParams(seed=0))[0]
    assert len(out.token_ids) == 12 and out.denoise_steps == [3, 3]


# transformers' generate with a max_length: where max_new_tokens is at its default of 256,
# max_new_tokens = max_length - prompt length, in whole blocks (a last one past max_length
# included, which diffuserve cuts at that max_new_tokens); any other max_new_tokens stands, and
# the MaxLengthCriteria ends the run after the first block that reaches max_length. The
# prompt has 9 tokens, the canvas 8.
@pytest.mark.parametrize("generation, request_length, new_tokens", [
    (dict(max_length=9 + 16), {}, 16),
    (dict(max_length=9 + 13), {}, 13),  # transformers generates 2 blocks
    (dict(max_length=9 + 13, max_new_tokens=256), {}, 13),  # 256 given is 256 all the same
    (dict(max_length=9 + 13, max_new_tokens=40), {}, 16),  # the MaxLengthCriteria ends it after 2 blocks, not 5
    (dict(max_length=3, max_new_tokens=40), {}, 8),  # ... after the first, even where the prompt is past it
    ({}, dict(max_length=9 + 13), 13),  # a request's own max_length
    (dict(max_length=9 + 100), dict(max_length=9 + 13, max_new_tokens=40), 16),  # a request's own pair
    ({}, dict(max_length=9 + 30, max_new_tokens=12), 12),  # a longer max_length leaves max_new_tokens alone
], ids=["whole_blocks", "cut_block", "256_given", "criteria_ends", "criteria_one_block", "request", "request_pair",
        "request_longer"])
def test_max_length_matches_hf_generate(checkpoints, tmp_path, generation, request_length, new_tokens):
    """As transformers applies max_length (generation_config.json's or the request's); diffuserve
    had ignored it, generating the checkpoint's max_new_tokens."""
    path = copy_of_small(checkpoints, tmp_path, eos_token_id=[], **generation)
    canvas = MODELS["small"][1]
    rng = np.random.default_rng(3)
    prompt, seed_canvas = rng.integers(3, 96, 9).tolist(), rng.integers(3, 96, canvas).tolist()
    expected, expected_tpf = hf_generate_blocks(load(path), prompt, seed_canvas, [], 5, **request_length)
    assert len(expected) == -(-new_tokens // canvas) * canvas  # whole blocks
    out = ds.LLM(path).generate([prompt], ds.SamplingParams(seed_canvas=seed_canvas, seed=5, entropy_bound=HUGE_BOUND,
                                                            **request_length, **GREEDY))[0]
    assert out.token_ids == expected[:new_tokens] and out.finish_reason == "length"
    assert out.tokens_per_forward == pytest.approx(expected_tpf)


def test_a_requests_max_new_tokens_wins_over_the_checkpoints_max_length(checkpoints, tmp_path):
    """max_new_tokens given, the checkpoint's max_length is left out (an OpenAI max_tokens means
    as many tokens), even at 256, which the max_length would have replaced."""
    path = copy_of_small(checkpoints, tmp_path, max_length=2 + 13, eos_token_id=[], max_denoising_steps=2)
    llm = ds.LLM(path)
    assert llm.model.config["generation"]["max_length"] == 15
    for max_new_tokens, length in ((None, 13), (40, 40), (256, 256), (5, 5)):
        out = llm.generate([[3, 4]], ds.SamplingParams(max_new_tokens=max_new_tokens, seed=0))[0]
        assert len(out.token_ids) == length, max_new_tokens


def test_a_prompt_that_leaves_max_length_no_room_is_refused(checkpoints, tmp_path):
    """transformers' DiffusionGemma generate returns no tokens there (and a tokens_per_forward of
    NaN); its autoregressive generate refuses it, as diffuserve does, naming max_length and the
    prompt's length. diffuserve had generated the checkpoint's max_new_tokens."""
    llm = ds.LLM(copy_of_small(checkpoints, tmp_path, max_length=5))
    for prompt in ([3] * 5, [3] * 9):
        with pytest.raises(ValueError, match=rf"prompt 0: max_length 5: the prompt \({len(prompt)} tokens\) leaves "
                                             "no room for new tokens"):
            llm.generate([prompt], ds.SamplingParams(seed=0))
    assert len(llm.generate([[3] * 9], ds.SamplingParams(max_new_tokens=3, seed=0))[0].token_ids) == 3
    assert len(llm.generate([[3] * 4], ds.SamplingParams(seed=0))[0].token_ids) == 1


def test_a_negative_max_length_is_refused_by_the_runtime(checkpoints):
    model = ds.LLM(checkpoints["small"]).model._native
    params = model.sampling_defaults()
    assert params.max_length == 0  # the checkpoint has none
    params.max_length = -1
    with pytest.raises(ValueError, match=r"SamplingParams.max_length must be >= 0 \(0: no cap\), got -1"):
        ds._core.Engine(model).add(0, [3, 4], params)


def free_run_of_a_copy(checkpoints, tmp_path):
    """A copy of the small checkpoint to edit, a prompt and seed canvas, and transformers' greedy
    block from them with no EOS: (path, prompt, seed_canvas, free_run)."""
    path = copy_of_small(checkpoints, tmp_path)
    rng = np.random.default_rng(11)
    prompt, seed_canvas = rng.integers(3, 96, 5).tolist(), rng.integers(3, 96, MODELS["small"][1]).tolist()
    return path, prompt, seed_canvas, hf_generate(load(path), prompt, seed_canvas, eos=[])[0]


def name_eos_in_config_json(path, eos):
    """config.json's text_config names `eos` as its EOS id."""
    config = json.loads((path / "config.json").read_text())
    config["text_config"]["eos_token_id"] = eos
    (path / "config.json").write_text(json.dumps(config))


def greedy_block(llm, prompt, seed_canvas):
    """diffuserve's greedy block from `seed_canvas`, as hf_generate runs transformers'."""
    return llm.generate([prompt], ds.SamplingParams(max_new_tokens=len(seed_canvas), seed_canvas=seed_canvas,
                                                    entropy_bound=HUGE_BOUND, seed=0, **GREEDY))[0]


def test_an_empty_eos_list_in_generation_config_means_no_eos(checkpoints, tmp_path):
    """generation_config.json's "eos_token_id": [] leaves transformers no EOS to stop at, whatever
    config.json names; diffuserve had taken config.json's EOS instead, and stopped where
    transformers runs on."""
    path, prompt, seed_canvas, free_run = free_run_of_a_copy(checkpoints, tmp_path)
    name_eos_in_config_json(path, free_run[2])  # config.json's EOS comes up mid-canvas
    generation = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**generation, "eos_token_id": []}))
    hf = load(path)
    assert hf.generation_config.eos_token_id == []
    expected, _ = hf_generate(hf, prompt, seed_canvas)
    assert expected == free_run  # transformers ran on past config.json's EOS
    llm = ds.LLM(path)
    assert llm.model.config["generation"]["eos_token_ids"] == []
    got = greedy_block(llm, prompt, seed_canvas)
    assert got.token_ids == expected and got.finish_reason == "length"


@pytest.mark.parametrize("eos_field", ["absent", "null", "no file"])
def test_no_eos_in_generation_config_means_no_eos_whatever_config_json_says(checkpoints, tmp_path, eos_field):
    """transformers' DiffusionGemma generate takes its EOS and pad ids from the generation config
    alone: where generation_config.json names none (or is missing), it runs on past the EOS that
    config.json names, and counts the whole block in tokens_per_forward. diffuserve had taken
    config.json's EOS (and pad) as the defaults, stopped early and counted less."""
    path, prompt, seed_canvas, free_run = free_run_of_a_copy(checkpoints, tmp_path)
    name_eos_in_config_json(path, free_run[2])  # config.json's EOS comes up mid-canvas
    generation = json.loads((path / "generation_config.json").read_text())
    generation.pop("eos_token_id", None), generation.pop("pad_token_id", None)
    if eos_field == "no file":
        (path / "generation_config.json").unlink()
    else:
        (path / "generation_config.json").write_text(json.dumps(
            {**generation, **({"eos_token_id": None} if eos_field == "null" else {})}))
    hf = load(path)
    assert hf.generation_config.eos_token_id is None and hf.generation_config.pad_token_id is None
    expected, expected_tpf = hf_generate(hf, prompt, seed_canvas)
    assert expected == free_run  # transformers ran on past config.json's EOS
    llm = ds.LLM(path)
    assert llm.model.config["generation"]["eos_token_ids"] == [] and llm.model.config["generation"]["pad_token_id"] is None
    got = greedy_block(llm, prompt, seed_canvas)
    assert got.token_ids == expected and got.finish_reason == "length"
    assert got.tokens_per_forward == pytest.approx(expected_tpf)


def test_without_a_pad_id_the_block_past_the_eos_counts(checkpoints, tmp_path):
    """An EOS but no pad id in the generation config: transformers leaves the block past the EOS
    as generated and counts every token of it in tokens_per_forward (it pads, and leaves the
    padding out, only where it has a pad id); diffuserve had counted the tokens up to the EOS."""
    path, prompt, seed_canvas, free_run = free_run_of_a_copy(checkpoints, tmp_path)
    canvas = len(seed_canvas)
    at = next(i for i in range(1, canvas) if free_run[i] not in free_run[:i])  # the EOS's first place
    eos = free_run[at]
    generation = json.loads((path / "generation_config.json").read_text())
    generation.pop("pad_token_id", None)
    (path / "generation_config.json").write_text(json.dumps({**generation, "eos_token_id": eos}))
    hf = load(path)
    expected, expected_tpf = hf_generate(hf, prompt, seed_canvas)
    assert expected == free_run  # nothing padded past the EOS
    got = greedy_block(ds.LLM(path), prompt, seed_canvas)
    assert got.token_ids == expected[:at + 1] and got.finish_reason == "stop"
    assert got.tokens_per_forward == pytest.approx(expected_tpf) == pytest.approx(canvas / sum(got.denoise_steps))


def test_tokens_per_forward_leaves_out_generation_configs_pad_id(checkpoints, tmp_path):
    """transformers counts tokens_per_forward without its generation config's pad_token_id (the
    one generation_config.json names); diffuserve had left out config.json's instead, and
    counted a pad id of the generation config's as a token."""
    path, prompt, seed_canvas, free_run = free_run_of_a_copy(checkpoints, tmp_path)
    pad, eos = free_run[1], free_run[-2]  # a pad id the output holds, and an EOS past it
    assert pad not in (0, eos) and eos not in free_run[:-2]
    generation = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**generation, "eos_token_id": eos, "pad_token_id": pad}))
    hf = load(path)
    assert json.loads((path / "config.json").read_text())["text_config"]["pad_token_id"] == 0
    expected, expected_tpf = hf_generate(hf, prompt, seed_canvas)
    assert expected[:-1] == free_run[:-1] and expected[-1] == pad  # transformers pads after the EOS
    llm = ds.LLM(path)
    assert llm.model.config["generation"]["pad_token_id"] == pad
    got = greedy_block(llm, prompt, seed_canvas)
    assert got.token_ids == expected[:-1] and got.finish_reason == "stop"
    assert got.tokens_per_forward == pytest.approx(expected_tpf)
    assert got.tokens_per_forward == pytest.approx(sum(t != pad for t in got.token_ids) / sum(got.denoise_steps))
    # -1 is a pad id too, which no token is: transformers pads past the EOS with it and leaves
    # that padding out (diffuserve had read -1 as no pad id, and counted the block whole).
    (path / "generation_config.json").write_text(json.dumps({**generation, "eos_token_id": eos, "pad_token_id": -1}))
    expected, expected_tpf = hf_generate(load(path), prompt, seed_canvas)
    assert expected[:-1] == free_run[:-1] and expected[-1] == -1
    llm = ds.LLM(path)
    assert llm.model.config["generation"]["pad_token_id"] == -1
    got = greedy_block(llm, prompt, seed_canvas)
    assert got.token_ids == expected[:-1] and got.tokens_per_forward == pytest.approx(expected_tpf)
    assert got.tokens_per_forward == pytest.approx(len(got.token_ids) / sum(got.denoise_steps))


@pytest.mark.parametrize("kwargs, name", [
    (dict(self_conditioning=1), "self_conditioning"),
    (dict(max_new_tokens=0), "max_new_tokens"), (dict(max_new_tokens=2.5), "max_new_tokens"),
    (dict(max_new_tokens=True), "max_new_tokens"), (dict(max_denoising_steps=0), "max_denoising_steps"),
    (dict(t_min=-0.1), "t_min"), (dict(t_max=float("nan")), "t_max"), (dict(t_min=0.5, t_max=0.5), "t_max"),
    (dict(entropy_bound=0), "entropy_bound"), (dict(entropy_bound=float("inf")), "entropy_bound"),
    (dict(stability_threshold=-1), "stability_threshold"), (dict(confidence_threshold=0.0), "confidence_threshold"),
    (dict(seed=-1), "seed"), (dict(seed=2**64), "seed"), (dict(eos_token_id=[-1]), "eos_token_id"),
    (dict(eos_token_id="x"), "eos_token_id"), (dict(canvas_length=0), "canvas_length"),
    (dict(seed_canvas=[]), "seed_canvas"), (dict(pinned_positions=[1]), "pinned_positions"),
    (dict(seed_canvas=[1] * 8, pinned_positions=[2, 2]), "pinned_positions"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"), (dict(allowed_token_ids=[1.5]), "allowed_token_ids"),
    # Past the runtime's int32 and float32 (1e-300 is 0 there, 1e300 infinite).
    (dict(max_new_tokens=2**31), "max_new_tokens"), (dict(canvas_length=2**31), "canvas_length"),
    (dict(stability_threshold=2**40), "stability_threshold"), (dict(eos_token_id=[2**70]), "eos_token_id"),
    (dict(seed_canvas=[2**40] * 8), "seed_canvas"), (dict(allowed_token_ids=[2**31]), "allowed_token_ids"),
    (dict(t_max=1e300), "t_max"), (dict(entropy_bound=1e-300), "entropy_bound"),
    (dict(confidence_threshold=1e-320), "confidence_threshold"), (dict(t_min=1e-301, t_max=1e-300), "t_max"),
    (dict(t_max=10**400), "t_max"), (dict(max_length=0), "max_length"), (dict(max_length=2**31), "max_length"),
    (dict(max_length=7.5), "max_length"),
    # One id, not a list: named as given (it had been "eos_token_id[0]").
    (dict(eos_token_id=-1), r"eos_token_id must be an integer in \[0, 2\*\*31 - 1\], got -1"),
    # A dict had given its keys, and a set a canvas in hash order.
    (dict(eos_token_id={1: "eos"}), r"eos_token_id must be a list of integers, got \{1: 'eos'\}"),
    (dict(seed_canvas={3, 1, 2, 5, 4, 6, 7, 8}), "seed_canvas must be a list of integers, got "),
    (dict(logit_bias=[(3, 1.0)]), r"logit_bias must be a dict of token id -> bias, got \[\(3, 1.0\)\]"),
    (dict(logit_bias={-1: 1.0}), r"logit_bias's token id must be an integer in \[0, 2\*\*31 - 1\], got -1"),
    (dict(logit_bias={"3": 1.0}), "logit_bias's token id must be an integer"),
    (dict(logit_bias={3: float("nan")}), r"logit_bias\[3\] must be a finite number, got nan"),
    (dict(logit_bias={3: 1e39}), r"logit_bias\[3\] must be a finite float32"),
])
def test_invalid_params_name_the_parameter(kwargs, name):
    with pytest.raises(ValueError, match=name):
        ds.SamplingParams(**kwargs)


def test_names_that_are_no_parameter_are_refused_naming_the_equivalent():
    """vLLM's names, given or set, are refused naming diffuserve's: `params.max_tokens = 4` had
    been kept and read by nothing (the request generated 256 tokens)."""
    params = ds.SamplingParams(max_new_tokens=8)
    with pytest.raises(AttributeError, match=r"SamplingParams has no parameter 'max_tokens' \(vLLM's; here: "
                                             r"max_new_tokens\); its parameters: max_new_tokens, max_length"):
        params.max_tokens = 4
    with pytest.raises(TypeError, match=r"no parameter 'temperature' \(vLLM's; here: t_min and t_max"):
        ds.SamplingParams(temperature=0.0)
    with pytest.raises(AttributeError, match="no parameter 'max_new_token';"):
        params.max_new_token = 4  # (a misspelling too)
    params.max_new_tokens = 4  # the fields themselves stay settable, and copies and pickles work
    assert copy.deepcopy(params) == params == pickle.loads(pickle.dumps(params))
    # help() and editors show the fields, not the refusing __new__'s (*args, **kwargs).
    shown = inspect.signature(ds.SamplingParams).parameters
    assert list(shown) == [f.name for f in dataclasses.fields(ds.SamplingParams)] and shown["seed"].default is None


@pytest.mark.parametrize("kwargs, name", [
    (dict(t_max=0.3), "t_max"),  # below the checkpoint's t_min default (0.4)
    # Which end is the checkpoint's: the message had named only t_max, even where t_min was the one given.
    (dict(t_max=0.3), r"t_max must be > t_min, got t_max=0.3 <= t_min=0.4 \(the checkpoint's default\)"),
    (dict(t_min=1.5), r"t_min must be < t_max, got t_min=1.5 >= t_max=0.8 \(the checkpoint's default\)$"),
    (dict(eos_token_id=[96]), "eos_token_ids"), (dict(canvas_length=9), "canvas_length"),
    (dict(seed_canvas=[1] * 7), "seed_canvas"), (dict(seed_canvas=[1] * 7 + [96]), "seed_canvas"),
    (dict(seed_canvas=[1] * 8, pinned_positions=[8]), "pinned_positions"),
    (dict(allowed_token_ids=[3, 200]), "allowed_token_ids"),
    (dict(logit_bias={96: -1.0, 3: 1.0}), r"SamplingParams.logit_bias names token 96, outside the vocabulary \[0, 96\)"),
    # (A bias of 3e38, finite, had made the biased logits infinite: a NaN entropy, blamed on the checkpoint.)
    (dict(logit_bias={3: 3e38}), r"logit_bias gives token 3 a bias of 3e\+38: a bias is a finite number within "
                                 r"\[-1e\+06, 1e\+06\]"),
    # Logits over so cold a temperature overflow (had failed the step as the model's NaN).
    (dict(t_min=0.0, t_max=1e-38), "t_max and t_min give a smallest temperature of"),
    (dict(t_min=0.0, t_max=1e-18, max_denoising_steps=1000), "smallest temperature of 1e-21"),
])
def test_params_checked_against_the_model(checkpoints, kwargs, name):
    llm = ds.LLM(checkpoints["small"])
    with pytest.raises(ValueError, match=name):
        llm.generate([[3, 4]], ds.SamplingParams(**kwargs))
    assert llm.generate([[3, 4]], ds.SamplingParams(max_new_tokens=8, max_denoising_steps=2, seed=0))[0].token_ids


@pytest.mark.parametrize("prompts, params, match", [
    ([[3, 96]], None, "out of range"), ([[]], None, "empty"), ("hello", None, "tokenizer"),
    ([[3], [4]], [ds.SamplingParams()] * 3, "3 SamplingParams for 2 prompts"),
    # The fault named as params' (it had been named after prompt 0).
    ([[3]], [{"seed": 1}], r"^params\[0\] must be a SamplingParams, got dict$"),
    ([[3], [4]], {"seed": 1}, r"^params must be a SamplingParams, got dict$"),
    ([[3]], ds.SamplingParams(max_new_tokens=10**9), "max_position_embeddings"),
    # True beside ints (numpy had made it the id 1), and one empty array prompt (it had returned []).
    ([[True, 5]], None, "must be integers, got True at index 0"), (np.array([], np.int32), None, "empty"),
    ([[3]], ds.SamplingParams(stop=["x"]), "stop strings are looked for in the text, and this checkpoint has no "
                                           "tokenizer.json"),
])
def test_bad_generate_calls(checkpoints, prompts, params, match):
    with pytest.raises(ValueError, match=match):
        ds.LLM(checkpoints["small"]).generate(prompts, params)


def test_a_prompt_too_long_for_any_block_is_blamed_on_the_prompt(checkpoints):
    """Not on max_new_tokens, which no value would have helped (the server then names
    `prompt`, or `messages` for a chat)."""
    cfg = json.loads((checkpoints["small"] / "config.json").read_text())["text_config"]
    llm = ds.LLM(checkpoints["small"])
    with pytest.raises(ValueError, match=r"prompt 0: prompt: \d+ tokens leave no room for a block of 8 new tokens"):
        llm.generate([[3] * (cfg["max_position_embeddings"] - 7)], ds.SamplingParams(max_new_tokens=1))
    with pytest.raises(ValueError, match="max_new_tokens 9: the prompt"):
        llm.generate([[3] * (cfg["max_position_embeddings"] - 8)], ds.SamplingParams(max_new_tokens=9))


def test_prompts_as_vllm_dicts_and_object_arrays(checkpoints):
    """vLLM's {"prompt_token_ids": ids} prompts, and an object array's items (pandas' .values)
    as prompts each (it had been read as one prompt of ids, and refused as dtype object);
    bytes and other dicts are refused by name."""
    llm = ds.LLM(checkpoints["small"])
    params = ds.SamplingParams(max_new_tokens=8, seed=0)
    expected = [out.token_ids for out in llm.generate([[3, 4], [5, 6, 7]], params)]
    ragged = np.empty(2, dtype=object)
    ragged[:] = [[3, 4], [5, 6, 7]]
    for prompts in ([{"prompt_token_ids": [3, 4]}, {"prompt_token_ids": [5, 6, 7]}], ragged):
        assert [out.token_ids for out in llm.generate(prompts, params)] == expected
    assert llm.generate({"prompt_token_ids": [3, 4]}, params)[0].token_ids == expected[0]
    assert llm.generate(np.array([3, 4], dtype=object), params)[0].token_ids == expected[0]
    with pytest.raises(ValueError, match=r"prompt 0: a prompt given as a dict holds one of 'prompt' \(text\) or "
                                         r"'prompt_token_ids', got the keys \['ids'\]"):
        llm.generate([{"ids": [3, 4]}], params)
    # vLLM's images beside a prompt: refused as such (DESIGN: a text-only engine says so)
    with pytest.raises(ValueError, match=r"prompt 0: this engine is text-only: a prompt's multi_modal_data \(images\) "
                                         "is not supported"):
        llm.generate([{"prompt_token_ids": [3, 4], "multi_modal_data": {"image": None}}], params)
    with pytest.raises(ValueError, match="prompt 0: a prompt is text .* got bytes: decode them to str first"):
        llm.generate([b"Hi"], params)
    # Each key holds its own kind (ids under "prompt" had been taken as ids, and text under
    # "prompt_token_ids" encoded).
    for prompt, kind in [({"prompt": [3, 4]}, "list under 'prompt'"), ({"prompt_token_ids": "Hi"}, "str under "
                                                                       "'prompt_token_ids'")]:
        with pytest.raises(ValueError, match=f"prompt 0: a prompt given as a dict holds text under 'prompt' and "
                                             f"token ids under 'prompt_token_ids', got {kind}"):
            llm.generate([prompt], params)


def test_vllms_example_reads_the_outputs_as_in_vllm():
    """vLLM's own example runs unchanged past its SamplingParams: each output's `prompt` (the
    text, where it was given as text) and `outputs[0].text`, vLLM's CompletionOutput."""
    llm = ds.LLM(ds.default_model())
    prompts = ["002500146300270500000046307067008400409000002020300005780000050000400700001000080",
               {"prompt": "102500146300270500000046307067008400409000002020300005780000050000400700001000080"}]
    outputs = llm.generate(prompts + [[3, 4, 5]], ds.SamplingParams(seed=0, max_new_tokens=16))
    for output, prompt in zip(outputs, [prompts[0], prompts[1]["prompt"], None]):
        assert output.prompt == prompt
        (completion,) = output.outputs
        assert (completion.index, completion.text, completion.token_ids, completion.finish_reason) == \
            (0, output.text, output.token_ids, output.finish_reason)
    assert outputs[0].outputs[0].text
    # vLLM's keywords: sampling_params for params, and its progress bar (on stderr)
    params = ds.SamplingParams(seed=0, max_new_tokens=16)
    again = llm.generate(prompts[:1], sampling_params=params, use_tqdm=True)
    assert again[0].token_ids == outputs[0].token_ids
    with pytest.raises(ValueError, match=r"give params or sampling_params \(vLLM's name for it\), not both"):
        llm.generate(prompts[:1], params, sampling_params=params)
    with pytest.raises(ValueError, match="use_tqdm must be True or False"):
        llm.generate(prompts[:1], params, use_tqdm="yes")
    assert llm.get_tokenizer() is llm.tokenizer  # (vLLM's name for it)
    # and LLM(model=...), vLLM's name for the path; its arguments without an equivalent say what takes their place
    assert ds.LLM(model=ds.default_model()).generate(prompts[:1], params)[0].token_ids == outputs[0].token_ids
    with pytest.raises(TypeError, match=r"LLM\(\) got an unexpected keyword argument 'gpu_memory_utilization' "
                                        r"\(vLLM's: the KV cache is sized by kv_cache_memory_bytes"):
        ds.LLM(model=ds.default_model(), gpu_memory_utilization=0.9)
    with pytest.raises(TypeError, match=r"LLM\(\) got an unexpected keyword argument 'no_such'$"):
        ds.LLM(no_such=1)
    with pytest.raises(ValueError, match=r"give path or model \(vLLM's name for it\), not both"):
        ds.LLM(ds.default_model(), model=ds.default_model())


def test_truncate_prompt_tokens_keeps_the_prompts_end(checkpoints):
    """vLLM's truncate_prompt_tokens: only the prompt's last k tokens run (and are its
    prompt_token_ids); 0 is refused by name."""
    llm = ds.LLM(checkpoints["small"])
    prompt = list(range(3, 40))
    params = dict(max_new_tokens=16, seed=3)
    cut = llm.generate([prompt], ds.SamplingParams(truncate_prompt_tokens=5, **params))[0]
    assert cut.prompt_token_ids == prompt[-5:]
    assert cut.token_ids == llm.generate([prompt[-5:]], ds.SamplingParams(**params))[0].token_ids
    assert llm.generate([prompt], ds.SamplingParams(truncate_prompt_tokens=100, **params))[0].prompt_token_ids == prompt
    with pytest.raises(ValueError, match=r"truncate_prompt_tokens must be an integer in \[1, "):
        ds.SamplingParams(truncate_prompt_tokens=0)


def test_prompts_as_torch_tensors(checkpoints):
    """A torch tensor is token ids to generate as to add_request: one prompt, or a batch's rows
    (transformers' input_ids); generate had refused it as no list. One numpy cannot read is
    named."""
    llm = ds.LLM(checkpoints["small"])
    params = ds.SamplingParams(max_new_tokens=8, seed=0)
    expected = [out.token_ids for out in llm.generate([[3, 4], [5, 6]], params)]
    assert [out.token_ids for out in llm.generate(torch.tensor([[3, 4], [5, 6]]), params)] == expected
    assert llm.generate(torch.tensor([3, 4]), params)[0].token_ids == expected[0]
    # A list of a tensor's 0-d items is one prompt too (each had been taken as a prompt of one id, and refused).
    for ids in (list(torch.tensor([3, 4])), [np.array(3), np.array(4)]):
        assert llm.generate(ids, params)[0].token_ids == expected[0]
    with pytest.raises(ValueError, match="prompt 0: text prompts need a tokenizer"):  # (numpy's strings: texts, each
        # a prompt: as one prompt of ids they had been named "token ids must be integers, got dtype <U1")
        llm.generate(list(np.array(["a", "b"])), params)
    with pytest.raises(ValueError, match="prompt 1: prompt: token ids must be a 1-D sequence, got one int, 4"):
        llm.generate([[3], 4], params)
    with pytest.raises(ValueError, match=r"prompts: token ids must be integers numpy can read, got torch.bfloat16"):
        llm.generate(torch.tensor([3, 4], dtype=torch.bfloat16), params)


def test_sampling_params_compare_by_what_they_ask(checkpoints):
    """Id lists compare as lists, however given (an array's comparison had raised "the truth
    value of an array is ambiguous")."""
    a = ds.SamplingParams(seed_canvas=np.arange(8), eos_token_id=(1,))
    b = ds.SamplingParams(seed_canvas=list(range(8)), eos_token_id=[1])
    assert a == b and a != ds.SamplingParams(seed_canvas=np.arange(8)) and a != "params"


def test_id_lists_may_be_iterators(checkpoints):
    """A generator of ids is read once: its check had used it up, so that EOS ids given so were
    none (the output ran to max_new_tokens), and a seed canvas or allowed ids "empty"."""
    llm = ds.LLM(checkpoints["small"])

    def out(make):
        params = ds.SamplingParams(max_new_tokens=16, seed=0, eos_token_id=make([5]), allowed_token_ids=make([5, 6]),
                                   seed_canvas=make([6] * 8))
        return llm.generate([[3, 4]], params)[0]

    assert (out(iter).token_ids, out(iter).finish_reason) == (out(list).token_ids, out(list).finish_reason)
    assert out(list).finish_reason == "stop"
    # Set after construction, and shared by a batch's prompts: read once for all of them (the
    # first prompt's check had used it up, and the second ran without EOS or its pins).
    params = ds.SamplingParams(max_new_tokens=16, seed=0, allowed_token_ids=[5, 6], seed_canvas=[6] * 8)
    params.eos_token_id, params.pinned_positions = iter([5]), iter([0, 1])
    outs = llm.generate([[3, 4], [3, 4]], params)
    assert [(o.token_ids, o.finish_reason) for o in outs] == [(outs[0].token_ids, "stop")] * 2
    assert params.eos_token_id == [5] and params.pinned_positions == [0, 1]


def test_fit_to_context_generates_the_blocks_that_fit(tmp_path):
    """fit_to_context (the server's rule without max_tokens, as vLLM's): a length limit past the
    positions or the whole KV cache shrinks to the whole blocks that fit; a prompt that leaves no
    block is still refused; a limit that fits is kept."""
    path = save(build_model(text([S, F, F], max_position_embeddings=64), 8), tmp_path / "short")
    params = dict(max_new_tokens=10**6, seed=0, eos_token_id=[])

    def generated(llm, prompt_length, **kwargs):
        out = llm.generate([[3] * prompt_length], ds.SamplingParams(**{**params, **kwargs}))[0]
        return len(out.token_ids), out.finish_reason

    llm = ds.LLM(path)
    with pytest.raises(ValueError, match="exceeds max_position_embeddings"):
        generated(llm, 10)
    assert generated(llm, 10, fit_to_context=True) == (48, "length")  # 10 + 6 blocks of 8 <= 64
    assert generated(llm, 56, fit_to_context=True) == (8, "length")
    assert generated(llm, 10, fit_to_context=True, max_new_tokens=13) == (13, "length")
    with pytest.raises(ValueError, match="leave no room for a block"):
        generated(llm, 57, fit_to_context=True)
    # Two KV blocks of 16 tokens for the full-attention layers: 10 + 2 blocks of 8 fit, not 3.
    small = ds.LLM(path, kv_cache_memory_bytes=16 << 10)
    with pytest.raises(ValueError, match="more than the whole cache holds"):
        generated(small, 10, max_new_tokens=24)
    assert generated(small, 10, fit_to_context=True) == (16, "length")
    # A prompt that leaves no room for a block in the cache is the prompt's fault (it had been
    # blamed on max_new_tokens, which fit_to_context callers such as the server's never set).
    with pytest.raises(ValueError, match="prompt: 30 tokens and a block of 8 new tokens need more KV"):
        generated(small, 30, fit_to_context=True)


def test_max_model_len_lowers_the_longest_sequence(tmp_path):
    """vLLM's max_model_len: requests are held to it as to max_position_embeddings (refusals name
    it; fit_to_context fits to it; Model.max_sequence_tokens and the server's card say it),
    and outputs within it do not change; more than the model's positions, or no room for a
    block, is refused at load."""
    path = save(build_model(text([S, F, F], max_position_embeddings=64), 8), tmp_path / "short")
    params = ds.SamplingParams(max_new_tokens=16, seed=0, eos_token_id=[])
    full = ds.LLM(path)
    llm = ds.LLM(path, max_model_len=40)
    assert (llm.model.config["max_model_len"], llm.model.config["max_position_embeddings"]) == (40, 64)
    assert (llm.model.max_sequence_tokens, full.model.max_sequence_tokens) == (40, 64)
    assert llm.generate([[3] * 20], params)[0].token_ids == full.generate([[3] * 20], params)[0].token_ids
    with pytest.raises(ValueError, match=r"exceeds max_model_len \(40\)"):
        llm.generate([[3] * 30], params)  # (30 + 2 blocks of 8 fits 64, not 40)
    with pytest.raises(ValueError, match=r"leave no room for a block of 8 new tokens within max_model_len \(40\)"):
        llm.generate([[3] * 33], params)
    fitted = llm.generate([[3] * 20], ds.SamplingParams(max_new_tokens=10**6, seed=0, eos_token_id=[],
                                                          fit_to_context=True))[0]
    assert len(fitted.token_ids) == 16  # 20 + 2 blocks of 8 <= 40
    sequence = llm.model.sequence()
    with pytest.raises(ValueError, match=r"exceed max_model_len \(40\)"):
        sequence.prefill([3] * 41)
    for bad, said in [(65, r"max_model_len 65 is more than the model's max_position_embeddings \(64\)"),
                      (8, r"max_model_len 8 leaves no room for a prompt token and a block of canvas_length \(8\)"),
                      (0, r"max_model_len must be an integer in \[1, "), (-1, "max_model_len must be")]:
        with pytest.raises(ValueError, match=said):
            ds.LLM(path, max_model_len=bad)


@pytest.mark.parametrize("kwargs, name", [
    (dict(max_num_seqs=2**40), "max_num_seqs"), (dict(slice_steps=2**40), "slice_steps"),
    (dict(kv_block_size=2**31), "kv_block_size"), (dict(fuse_commit="no"), "fuse_commit"),
    (dict(kv_cache_memory_bytes=2**70), "kv_cache_memory_bytes"), (dict(num_threads=True), "num_threads"),
])
def test_invalid_llm_limits_name_the_argument(checkpoints, kwargs, name):
    with pytest.raises(ValueError, match=name):
        ds.LLM(checkpoints["small"], **kwargs)


def test_a_kv_cache_larger_than_memory_is_refused_before_loading(checkpoints):
    """A budget past the machine's memory (a typo: 4096 GiB for 4) had filled tens of GB of
    block tables before failing; one too small names the layers it starves."""
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    with pytest.raises(ValueError, match=f"kv_cache_memory_bytes {physical + 1} is more than cpu has in all"):
        ds.LLM(checkpoints["small"], kv_cache_memory_bytes=physical + 1)
    with pytest.raises(ValueError, match="leaves .* bytes to the .*-attention layers, too few for one KV block"):
        ds.LLM(checkpoints["small"], kv_cache_memory_bytes=64)


def test_numpy_integers_are_integers(checkpoints):
    llm = ds.LLM(checkpoints["small"], kv_cache_memory_bytes=np.int64(8 << 20), max_num_seqs=np.int32(4))
    out = llm.generate([[3, 4]], ds.SamplingParams(max_new_tokens=np.int64(8), seed=np.uint64(1)))[0]
    assert len(out.token_ids) == 8


def _in_threads(f, n=4, repeats=3) -> list:
    """f(i) for i < n, each i in a thread of its own, all at once, `repeats` times over: the
    last result of each."""
    results = [None] * n

    def run(i):
        for _ in range(repeats):
            results[i] = f(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_generate_leaves_queued_requests_to_step(checkpoints):
    """A request queued by add_request that a generate call runs to its end is returned by
    the next step, not dropped (generate had discarded its output)."""
    llm = ds.LLM(checkpoints["small"])
    params = ds.SamplingParams(max_new_tokens=8, max_denoising_steps=2, seed=1)
    queued = llm.add_request([3, 4, 5], params)
    mine = llm.generate([[6, 7]], ds.SamplingParams(max_new_tokens=40, max_denoising_steps=4, seed=2))[0]
    assert mine.token_ids and llm.has_unfinished()
    outs = []
    while llm.has_unfinished():
        outs += llm.step()
    assert [o.request_id for o in outs] == [queued] and outs[0].token_ids


def test_threads_share_an_llm(checkpoints):
    """generate from several threads at once: each gets its own outputs, as if run alone (the
    calls take turns; unguarded, the runtime crashed)."""
    llm = ds.LLM(checkpoints["small"])
    params = [ds.SamplingParams(max_new_tokens=16, max_denoising_steps=3, seed=i) for i in range(4)]
    prompts = [[3, 4, 5 + i] for i in range(4)]

    def generate(i):
        return llm.generate([prompts[i]], params[i])[0].token_ids

    alone = [generate(i) for i in range(4)]
    assert _in_threads(generate) == alone and not llm.has_unfinished()


def test_threads_share_a_model(checkpoints):
    """Sequences of one model used from several threads at once give the logits each gives alone."""
    model = ds.Model.load(checkpoints["small"])

    def logits(i):
        s = model.sequence()
        s.prefill([3, 4, 5 + i])
        return s.denoise(np.arange(model.canvas_length) % 7 + 2)

    alone = [logits(i) for i in range(4)]
    assert all(np.array_equal(a, b) for a, b in zip(alone, _in_threads(logits)))


def test_params_set_after_construction_are_checked(checkpoints):
    """A field set on a SamplingParams after construction is checked when the request is
    added, by name, as the constructor checks it."""
    llm = ds.LLM(checkpoints["small"])
    for name, value in [("max_new_tokens", 2**31), ("max_new_tokens", 8.5), ("seed", -1), ("t_max", "0.8"),
                        ("self_conditioning", None)]:
        params = ds.SamplingParams(max_new_tokens=8, seed=0)
        setattr(params, name, value)
        with pytest.raises(ValueError, match=name):
            llm.generate([[3, 4]], params)
    assert not llm.has_unfinished()


@pytest.mark.parametrize("prompts", [None, 5, (p for p in [[3, 4]])], ids=["None", "int", "generator"])
def test_generate_needs_a_list_of_prompts(checkpoints, prompts):
    with pytest.raises(ValueError, match="prompts must be a list of prompts"):
        ds.LLM(checkpoints["small"]).generate(prompts)
