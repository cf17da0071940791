"""The CPU backend's products come in one build per vector extension (AVX-512, AVX2 and the
compiler's baseline on x86-64; cpu_simd.h). DIFFUSERVE_CPU_ISA picks one, read once a
process, so each build runs in a subprocess here: the ones with fused multiply-adds must
agree to the bit, and every build must agree with the default to rounding: fp32's (1e-5 of
the logits' span), or with bf16 activations, where a value at a bf16 rounding's midpoint can
go either way, bf16's (2e-3; 3.5e-5 measured between the baseline and AVX-512 builds).
(Agreement with transformers is test_hf_parity.py's, on the default build.)"""
import os
import subprocess
import sys

import numpy as np
import pytest

from diffuserve.random_checkpoint import write_random_checkpoint

# Sizes that leave every product a remainder: widths not a multiple of 16 (a sum's lanes)
# or of the blocks' rows, a vocabulary not a multiple of 64 columns, bf16 weights widened
# in chunks, a prompt and canvas of odd lengths.
CONFIG = dict(hidden_size=83, intermediate_size=45, moe_intermediate_size=21, vocab_size=331, head_dim=18,
              global_head_dim=26, num_attention_heads=3, num_key_value_heads=1, num_global_key_value_heads=1,
              num_experts=5, top_k_experts=2, num_hidden_layers=3, sliding_window=9)

RUN = """
import sys, numpy as np, diffuserve as ds
m = ds.Model.load(sys.argv[1], dtype=sys.argv[2])
rng = np.random.default_rng(0)
seq = m.sequence()
seq.prefill(rng.integers(0, 331, 29).tolist())
canvas = rng.integers(0, 331, 11).tolist()
first = seq.denoise(canvas)
second = seq.denoise(canvas, self_conditioning_logits=first / 0.7)
seq.commit(canvas)
third = seq.denoise(canvas)
np.save(sys.argv[3], np.stack([first, second, third]))
"""


def run(isa, checkpoint, dtype, out):
    env = {**os.environ, "DIFFUSERVE_CPU_ISA": isa}
    return subprocess.run([sys.executable, "-c", RUN, checkpoint, dtype, out], env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_random_checkpoint(str(tmp_path_factory.mktemp("m") / "m"), canvas_length=11, **CONFIG)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_builds_agree(checkpoint, tmp_path, dtype):
    logits = {}
    for isa in ("", "baseline", "avx2", "avx512"):
        proc = run(isa, checkpoint, dtype, str(tmp_path / f"{isa or 'default'}.npy"))
        if proc.returncode and "this CPU lacks it" in proc.stderr + proc.stdout:
            continue  # a build this CPU cannot run
        if proc.returncode and "no such build" in proc.stderr + proc.stdout:
            continue  # not an x86-64 library: baseline only
        assert proc.returncode == 0, proc.stderr
        logits[isa or "default"] = np.load(tmp_path / f"{isa or 'default'}.npy")
    default = logits.pop("default")
    assert np.isfinite(default).all()
    span = default.max() - default.min()
    tolerance = {"float32": 1e-5, "bfloat16": 2e-3}[dtype] * span
    for isa, values in logits.items():
        assert np.abs(values - default).max() <= tolerance, isa
    if "avx2" in logits and "avx512" in logits:  # both fuse every multiply-add: the same sums
        assert np.array_equal(logits["avx2"], logits["avx512"])


@pytest.mark.parametrize("isa, message", [("sse9", "no such build"), ("AVX512", "no such build")])
def test_an_unknown_build_is_refused_by_name(checkpoint, tmp_path, isa, message):
    proc = run(isa, checkpoint, "float32", str(tmp_path / "x.npy"))
    assert proc.returncode != 0
    assert f"DIFFUSERVE_CPU_ISA={isa}: {message}" in proc.stderr


def test_softcap_tanh_is_within_its_stated_ulps():
    """The sampler's softcap with cap 1 is tanh itself (x / 1 and 1 * t are exact): within
    1.33 ulp of float64's tanh on a fine grid over [-12, 12], at the method's seams (0.625,
    10) and on tiny values; +-1 past 10; NaN kept, and +-inf made NaN (an infinite logit, from
    weights that are not finite, is then refused, where tanh's +-1 had hidden it)."""
    from diffuserve import _core
    grid = np.linspace(-12, 12, 400_001, dtype=np.float32)
    seams = np.concatenate([np.nextafter(np.float32(s), np.float32(s) + d * np.arange(1, 50, dtype=np.float32))
                            for s in (0.625, -0.625, 10.0, -10.0) for d in (1, -1)]).astype(np.float32)
    tiny = np.float32([0.0, -0.0, 1e-40, -1e-40, 1e-30, 3e-8, -3e-8, 1e-4])
    x = np.concatenate([grid, seams, tiny, np.float32([50, -50, 1e30, -1e30])])
    got = _core.sampler.sample_rows(x[None, :], 1.0, [], 0, 0, 0, softcap=1.0)[0][0]
    reference = np.tanh(x.astype(np.float64))
    ulp = np.spacing(np.abs(reference).astype(np.float32)).astype(np.float64)
    assert (np.abs(got - reference) / ulp).max() <= 1.33
    assert (got[-4:] == np.float32([1, -1, 1, -1])).all()
    special = _core.sampler.sample_rows(np.float32([[np.nan, np.inf, -np.inf]]), 1.0, [], 0, 0, 0, softcap=1.0)[0][0]
    assert np.isnan(special).all()
    # A finite logit past cap x FLT_MAX (cap < 1: x / cap overflows) is capped, not refused.
    big = _core.sampler.sample_rows(np.float32([[3e38, -3e38]]), 1.0, [], 0, 0, 0, softcap=0.5)[0][0]
    assert (big == np.float32([0.5, -0.5])).all()


def test_softmax_and_entropy_match_float64():
    """The sampler's softmax feedback and entropy (cpu_simd.h's softmax, sum_exp, entropy: e^x
    by Cephes' method, 0 below -87.34, sums in sixteen lanes): rows of lengths that leave a
    remainder of the lanes and of the 256-value chunks, spreads from flat to past e^-87, ids
    left out (-inf) by allowed_ids, against float64."""
    from diffuserve import _core
    rng = np.random.default_rng(7)
    for vocab, spread in [(1, 1.0), (3, 0.1), (17, 5.0), (300, 30.0), (1000, 3.0), (4099, 60.0)]:
        logits = (rng.standard_normal((4, vocab)) * spread).astype(np.float32)
        allowed = sorted(rng.choice(vocab, max(1, vocab - vocab // 3), replace=False).tolist()) if vocab > 3 else []
        probs, _, _, entropy = _core.sampler.sample_rows(logits, 1.0, allowed, 0, 0, 0, softmax_feedback=True)
        x = logits.astype(np.float64)
        if allowed:
            keep = np.zeros(vocab, bool)
            keep[allowed] = True
            x[:, ~keep] = -np.inf
        log_p = x - x.max(-1, keepdims=True)
        log_p -= np.log(np.exp(log_p).sum(-1, keepdims=True))
        p = np.exp(log_p)
        assert np.isfinite(probs).all() and (probs >= 0).all()
        # fp32's x - max is good to half an ulp of |log p|: e^that's relative error grows with it
        normal = p > 1e-37
        tolerance = (1e-6 + 1.2e-7 * np.abs(np.where(p > 0, log_p, 0))) * p
        assert (np.abs(probs - p) <= tolerance)[normal].all(), vocab
        assert (probs[~normal] <= 1e-37).all()
        expected = -(np.where(p > 0, log_p, 0) * p).sum(-1)
        # log p = x - log z, both near the largest logit: an ulp of it is the entropy's own noise
        noise = 2.4e-7 * np.abs(logits).max(-1)
        assert (np.abs(entropy - expected) <= 1e-5 * expected + noise).all(), vocab
    nan_row = np.float32([[0.0, np.nan, 1.0] + [0.5] * 20])
    probs, _, _, entropy = _core.sampler.sample_rows(nan_row, 1.0, [], 0, 0, 0, softmax_feedback=True)
    assert np.isnan(probs).all() and np.isnan(entropy).all()
