"""The sampler's pieces against transformers' own classes, on identical inputs."""
import numpy as np
import pytest
import torch
from transformers.models.diffusion_gemma.generation_diffusion_gemma import (
    EntropyBoundSampler, EntropyBoundSamplerConfig, LinearTemperatureScheduleLogitsProcessor,
    StableAndConfidentStoppingCriteria)

from diffuserve import _core

sampler = _core.sampler


def sample_rows(logits, temperature=1.0, allowed=(), seed=0, block=0, step=0):
    return sampler.sample_rows(np.ascontiguousarray(logits, dtype=np.float32), temperature, list(allowed), seed, block,
                               step)


@pytest.mark.parametrize("t_min, t_max, steps", [(0.4, 0.8, 48), (1e-6, 2e-6, 7), (0.0, 1.0, 3), (0.25, 2.5, 100)])
def test_temperature_schedule(t_min, t_max, steps):
    logits = np.random.default_rng(0).standard_normal((4, 50)).astype(np.float32) * 5
    hf = LinearTemperatureScheduleLogitsProcessor(t_min=t_min, t_max=t_max, max_denoising_steps=steps)
    for remaining in range(steps, 0, -1):
        expected = hf(None, torch.from_numpy(logits), cur_step=torch.tensor(remaining, dtype=torch.int32)).numpy()
        temperature = sampler.schedule_temperature(t_min, t_max, remaining, steps)
        processed = sample_rows(logits, temperature)[0]
        np.testing.assert_array_equal(processed, expected)


def test_softcap_comes_before_the_temperature():
    """The engine leaves the final softcap to the sampler: processed = cap * tanh(logits / cap) / T,
    as the reference softcaps the logits and its sampler then divides them."""
    logits = (np.random.default_rng(3).standard_normal((8, 300)) * 12).astype(np.float32)
    processed, argmax, _, _ = sampler.sample_rows(logits, 0.7, [], 0, 0, 0, softcap=30.0)
    expected = (30 * torch.tanh(torch.from_numpy(logits) / 30) / 0.7).numpy()
    np.testing.assert_allclose(processed, expected, rtol=2e-6, atol=1e-6)
    np.testing.assert_array_equal(argmax, expected.argmax(-1))


@pytest.mark.parametrize("temperature", [0.7, 1e-3, 4e-4, 1e-6])
def test_self_conditioning_softmax_of_a_float16_model_at_cold_temperatures(temperature):
    """A float16 checkpoint's self-conditioning softmax is of its scaled logits cast to float16,
    as the reference casts them. Where a cold step's scaled logits pass float16's 65504 (a
    softcap of 30 below temperature 4.6e-4) that cast gives infinities and the softmax NaN (the
    request had failed as if the model's logits were NaN): such a row is shifted by its largest
    logit first, the same softmax."""
    logits = (np.random.default_rng(5).standard_normal((6, 300)) * 12).astype(np.float32)
    logits[1, 7] = logits[1, 9] = 40.0  # a tie at the top
    probs = sampler.sample_rows(logits, temperature, [], 0, 0, 0, softmax_feedback=True, softcap=30.0,
                                feedback_dtype="F16")[0]
    scaled = 30 * torch.tanh(torch.from_numpy(logits) / 30) / temperature
    if scaled.half().isfinite().all():  # the reference's own cast
        expected = scaled.to(torch.float16).softmax(-1, dtype=torch.float32).numpy()
        np.testing.assert_allclose(probs, expected, rtol=1e-6, atol=1e-7)
    else:
        assert np.isfinite(probs).all()
        expected = scaled.double().softmax(-1).numpy()
        np.testing.assert_allclose(probs, expected, atol=2e-3)
        np.testing.assert_allclose(probs[1, [7, 9]], 0.5, atol=1e-6)


def test_float16_feedback_that_rounds_to_its_largest_value_is_cast_as_the_reference_casts_it():
    """65504 < x < 65520 rounds to float16's 65504, finite: cast, not shifted."""
    logits = np.float32([[65510.0, 65500.0, 3.0]])
    probs = sampler.sample_rows(logits, 1.0, [], 0, 0, 0, softmax_feedback=True, feedback_dtype="F16")[0]
    expected = torch.from_numpy(logits).half().softmax(-1, dtype=torch.float32).numpy()
    np.testing.assert_allclose(probs, expected, rtol=1e-6)


def hf_accept(logits, bound):
    s = EntropyBoundSampler(EntropyBoundSamplerConfig(entropy_bound=float(bound)), logits.shape[0], logits.shape[1], 48)
    current = torch.zeros(1, logits.shape[0], dtype=torch.long)
    candidate = torch.arange(1, logits.shape[0] + 1)[None]
    accepted = s.accept_canvas(current, candidate, torch.from_numpy(logits)[None], cur_step=1)
    return (accepted[0] != 0).numpy(), s.accepted_token_mask[0].numpy()


def our_accept(logits, bound):
    entropy = sample_rows(logits)[3]
    return np.array(sampler.accept_by_entropy(entropy.tolist(), float(bound)), dtype=bool)


def spread_logits(n, vocab, seed):
    """Rows from near-one-hot to near-uniform, so entropies span the whole range."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, vocab)) * rng.uniform(0.05, 12, (n, 1))).astype(np.float32)


@pytest.mark.parametrize("bound", [1e-4, 0.1, 0.5, 2.0, 10.0, 1e9])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_entropy_bound_acceptance(bound, seed):
    logits = spread_logits(32, 64, seed)
    hf_mask, mask = hf_accept(logits, bound)
    assert hf_mask.tolist() == mask.tolist()
    np.testing.assert_array_equal(our_accept(logits, bound), mask)


def test_entropy_of_sample_op_matches_categorical():
    logits = spread_logits(16, 300, 3)
    logits[0, :200] = -np.inf  # masked ids contribute nothing, as in torch
    expected = torch.distributions.Categorical(logits=torch.from_numpy(logits)).entropy().numpy()
    np.testing.assert_allclose(sample_rows(logits)[3], expected, rtol=1e-5, atol=1e-6)


def test_acceptance_edges_all_and_one_and_ties():
    logits = spread_logits(12, 40, 4)
    assert our_accept(logits, 1e9).all()  # everything accepted
    only_one = our_accept(logits, 1e-9)  # the bound admits only the lowest-entropy position
    entropy = sample_rows(logits)[3]
    assert only_one.sum() == 1 and only_one[np.argmin(entropy)]
    # Ties: identical rows have identical entropies; the earlier position comes first,
    # as in torch's sort on CPU.
    tied = np.tile(spread_logits(1, 40, 5), (8, 1))
    for bound in [1e-9, entropy.mean(), 3 * entropy.mean()]:
        np.testing.assert_array_equal(our_accept(tied, bound), hf_accept(tied, bound)[1])


@pytest.mark.parametrize("stability", [0, 1, 2, 3])
def test_stable_and_confident_stopping(stability):
    rng = np.random.default_rng(stability)
    confidence = 0.5
    hf = StableAndConfidentStoppingCriteria(stability_threshold=stability, confidence_threshold=confidence)
    ours = sampler.StableAndConfident(stability, confidence)
    canvas = rng.integers(0, 5, 6)
    decisions = []
    for step in range(12):
        if step % 4 == 3:  # now and then the argmax changes
            canvas = canvas.copy()
            canvas[rng.integers(0, 6)] += 1
        sharp = step % 3 != 0  # confident on most steps, not all
        logits = (rng.standard_normal((6, 20)) * (40 if sharp else 0.5)).astype(np.float32)
        expected = bool(hf(torch.from_numpy(canvas)[None], torch.from_numpy(logits)[None])[0])
        mean_entropy = float(np.mean(sample_rows(logits)[3]))
        got = ours(canvas.astype(np.int32).tolist(), mean_entropy)
        assert got == expected, f"step {step}"
        decisions.append(got)
    assert any(decisions) and not all(decisions)


def test_gumbel_candidates_follow_the_distribution():
    """Candidate draws over many seeds match softmax(logits) (chi-square, df = 4)."""
    logits = np.log(np.array([[0.1, 0.2, 0.3, 0.15, 0.25]], dtype=np.float32))
    counts = np.zeros(5)
    for seed in range(4000):
        counts[sample_rows(logits, seed=seed)[2][0]] += 1
    expected = 4000 * np.array([0.1, 0.2, 0.3, 0.15, 0.25])
    assert ((counts - expected) ** 2 / expected).sum() < 18.5  # p = 0.001


def test_allowed_ids_restrict_argmax_candidate_and_entropy():
    logits = spread_logits(6, 30, 6)
    allowed = [3, 7, 11]
    processed, argmax, candidate, entropy = sample_rows(logits, allowed=allowed, seed=9)
    assert set(argmax) <= set(allowed) and set(candidate) <= set(allowed)
    assert np.isneginf(np.delete(processed, allowed, axis=1)).all()
    sub = torch.distributions.Categorical(logits=torch.from_numpy(logits[:, allowed])).entropy().numpy()
    np.testing.assert_allclose(entropy, sub, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("softcap", [0.0, 30.0])
def test_logit_bias_is_added_before_the_temperature(softcap):
    """A request's logit_bias is added to the (softcapped) logits before the temperature divides
    them, as a logits processor given to transformers' generate acts (it runs before the
    temperature schedule's): the processed logits, the argmax, the candidates, the entropies
    and the softmax feedback all see it. Ids outside allowed_ids stay -inf whatever their bias."""
    logits = spread_logits(6, 300, 11) * 3
    bias = [(7, 100.0), (8, -100.0), (20, 2.5), (299, -0.75)]
    t = 0.6
    processed, argmax, candidate, entropy = sampler.sample_rows(logits, t, [], 3, 0, 0, softcap=softcap,
                                                                logit_bias=bias)
    capped = torch.from_numpy(logits)
    if softcap:
        capped = softcap * torch.tanh(capped / softcap)
    add = torch.zeros(300)
    for token, value in bias:
        add[token] = value
    expected = (capped + add) / t
    np.testing.assert_allclose(processed, expected.numpy(), rtol=2e-6, atol=1e-5)
    assert (argmax == 7).all() and (candidate == 7).all()  # +100 outweighs any logit of a softcap of 30
    np.testing.assert_allclose(entropy, torch.distributions.Categorical(logits=expected).entropy().numpy(),
                               rtol=1e-4, atol=1e-6)
    probs = sampler.sample_rows(logits, t, [], 3, 0, 0, softmax_feedback=True, softcap=softcap, logit_bias=bias)[0]
    np.testing.assert_allclose(probs, torch.softmax(expected, -1).numpy(), rtol=1e-5, atol=1e-9)

    allowed = [8, 20, 30, 40]
    logits[:, 50] = np.nan  # an id excluded: -inf whatever its logit (NaN had made the row's entropy NaN)
    processed, argmax, candidate, entropy = sampler.sample_rows(logits, t, allowed, 3, 0, 0, softcap=softcap,
                                                                logit_bias=bias)
    assert np.isneginf(np.delete(processed, allowed, axis=1)).all()  # 7 too, biased by +100 but not allowed
    np.testing.assert_allclose(processed[:, allowed], expected[:, allowed].numpy(), rtol=2e-6, atol=1e-5)
    assert set(argmax) | set(candidate) <= {20, 30, 40}  # 8's -100 leaves it no chance
    np.testing.assert_allclose(entropy, torch.distributions.Categorical(logits=expected[:, allowed]).entropy().numpy(),
                               rtol=1e-4, atol=1e-6)


def test_softmax_feedback_is_the_softmax_of_the_processed_logits():
    # What the engine feeds back for self-conditioning: the row's processed logits, then
    # their softmax, as the forward would otherwise compute it; the draws are unchanged.
    logits = spread_logits(5, 40, 8)
    allowed = list(range(0, 40, 3))
    processed, argmax, candidate, entropy = sample_rows(logits, 0.7, allowed=allowed, seed=4)
    probs, *draws = sampler.sample_rows(logits, 0.7, allowed, 4, 0, 0, softmax_feedback=True)
    for a, b in zip((argmax, candidate, entropy), draws):
        np.testing.assert_array_equal(a, b)
    expected = torch.softmax(torch.from_numpy(processed), dim=-1).numpy()
    np.testing.assert_allclose(probs, expected, rtol=1e-6, atol=1e-9)
    assert (probs[:, [i for i in range(40) if i not in allowed]] == 0).all()


def test_draws_are_addressed_by_seed_block_step():
    logits = np.zeros((8, 1000), dtype=np.float32)
    base = sample_rows(logits, seed=5, block=1, step=2)[2]
    np.testing.assert_array_equal(base, sample_rows(logits, seed=5, block=1, step=2)[2])
    for other in [dict(seed=6, block=1, step=2), dict(seed=5, block=2, step=2), dict(seed=5, block=1, step=3)]:
        assert (sample_rows(logits, **other)[2] != base).any()


# A block's state through denoise_step on the CPU (the engine's path, the CUDA kernels'
# reference): the step count, the stop rule (stable after `stability` equal argmax canvases
# before this step, confident under the bound; or the last step), pinned positions held.
def test_block_state_steps_stop_and_pinned_positions():
    rng = np.random.default_rng(0)
    canvas, vocab = 12, 50
    base = (rng.standard_normal((canvas, vocab)) * 8).astype(np.float32)
    logits = np.stack([base] * 5)  # the same logits every step: the argmax canvas holds
    tokens = rng.integers(0, vocab, canvas).tolist()
    common = dict(tokens=tokens, pinned=[3], allowed_ids=[], t_min=0.4, t_max=0.8, entropy_bound=1e9, seed=1, block=0)
    out = sampler.denoise_steps(logits, max_steps=9, stability=2, confidence=100.0, **common)
    # The block stops at its third step (two argmax canvases alike after the first), and a
    # stopped block takes no more steps: its count stays.
    assert [s[2] for s in out] == [1, 2, 3, 3, 3]
    assert [s[3] for s in out] == [False, False, True, True, True]
    for ids, argmax, _, _ in out:
        assert ids[3] == tokens[3] and argmax[3] == tokens[3]
        assert [argmax[i] for i in range(canvas) if i != 3] == [int(base[i].argmax()) for i in range(canvas) if i != 3]
    # Not confident: only the last step stops the block.
    out = sampler.denoise_steps(logits[:3], max_steps=3, stability=1, confidence=1e-30, **common)
    assert [s[3] for s in out] == [False, False, True]


@pytest.mark.parametrize("bad, message", [
    (dict(allowed_ids=[3, 50]), r"allowed id 50 is out of range \[0, 49\]"),  # had written past the block's state
    (dict(allowed_ids=[-1]), r"allowed id -1 is out of range"),
    (dict(max_steps=0), "max_steps must be >= 1"),
    (dict(stability=-1), "stability must be >= 0"),
])
def test_block_state_refuses_bad_parameters(bad, message):
    logits = np.zeros((1, 4, 50), dtype=np.float32)
    kwargs = dict(tokens=[0] * 4, pinned=[], allowed_ids=[], t_min=0.4, t_max=0.8, max_steps=3, entropy_bound=1.0,
                  stability=1, confidence=1.0, seed=1, block=0)
    with pytest.raises(ValueError, match=message):
        sampler.denoise_steps(logits, **{**kwargs, **bad})
