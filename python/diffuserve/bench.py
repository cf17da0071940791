"""`diffuserve bench`: end-to-end generation throughput of a model through LLM (scheduler,
batching, KV cache), at several numbers of concurrent requests.

Every request gets a random prompt and generates exactly `max_tokens` tokens at exactly
`steps` denoise steps per block (EOS and early stopping are switched off), so runs are
comparable across models and machines and random weights measure the same work as real
ones. Without a model it writes a small random checkpoint (the shape of
benchmarks/cpu_step.py). Per-pass latencies are benchmarks/cpu_step.py's job.
"""
from __future__ import annotations

import tempfile
import time
from typing import List, Optional

import numpy as np
from tqdm import tqdm

from .llm import LLM
from .random_checkpoint import write_random_checkpoint
from .sampling import SamplingParams

SMALL_MODEL = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_experts=8, top_k_experts=2,
                   moe_intermediate_size=128, vocab_size=4096, sliding_window=64)


def run(llm: LLM, concurrency: List[int], prompt_tokens: int, max_tokens: int, steps: int) -> List[dict]:
    rng = np.random.default_rng(0)
    vocab = llm.model.vocab_size
    params = SamplingParams(max_new_tokens=max_tokens, max_denoising_steps=steps, confidence_threshold=1e-30,
                            eos_token_id=[], seed=0)
    positions = llm.model.config["max_model_len"]
    if prompt_tokens + llm.model.canvas_length > positions:  # before the prompts are drawn (2^31 tokens each)
        raise ValueError(f"--prompt-tokens {prompt_tokens} leaves no room for a block within max_model_len "
                         f"({positions})")
    # One request first, untimed: first-use costs (allocations; on a GPU, graphs and GEMM
    # plans) had gone into the first row, the batch-1 figure.
    _generate(llm, [np.random.default_rng(1).integers(0, vocab, prompt_tokens).tolist()], params, "warm-up")
    rows = []
    for n in concurrency:
        prompts = [rng.integers(0, vocab, prompt_tokens).tolist() for _ in range(n)]  # fresh: no prefix-cache hits
        passes = llm.stats()["forward_passes"]
        seconds = _generate(llm, prompts, params, f"{n} concurrent")
        forwards = llm.stats()["forward_passes"] - passes
        rows.append({"requests": n, "seconds": seconds, "tokens_per_s": n * max_tokens / seconds,
                     "forwards": forwards, "ms_per_forward": 1e3 * seconds / forwards})
    return rows


def _generate(llm: LLM, prompts: List[List[int]], params: SamplingParams, desc: str) -> float:
    """Runs the prompts at once to their end; returns the seconds taken."""
    with tqdm(total=len(prompts) * params.max_new_tokens, desc=desc, unit="tok", leave=False) as bar:
        start = time.perf_counter()
        ids = [llm.add_request(p, params) for p in prompts]
        finished = {}  # request id -> tokens
        while llm.has_unfinished():
            for out in llm.step():
                if out.finish_reason == "error":  # no throughput to report (it had been counted)
                    raise ValueError(f"a request failed: {out.error}")
                finished[out.request_id] = len(out.token_ids)
            made = sum(finished[r] if r in finished else len(llm.generated(r)) for r in ids)
            bar.update(made - bar.n)
        return time.perf_counter() - start


def main(model: Optional[str], concurrency: List[int], prompt_tokens: int, max_tokens: int, steps: int,
         load) -> None:
    """load: path -> LLM (the CLI's, with its progress display and options)."""
    with tempfile.TemporaryDirectory() as tmp:
        if model is None:
            model = write_random_checkpoint(f"{tmp}/small", canvas_length=64, **SMALL_MODEL)
            print("no model given: a small random checkpoint (hidden 256, 4 layers, 8 experts top-2, canvas 64)")
        llm = load(model)
        canvas = llm.model.canvas_length
        blocks = -(-max_tokens // canvas)
        print(f"{prompt_tokens}-token prompts, {max_tokens} new tokens each ({blocks} block{'s' * (blocks != 1)} of "
              f"{canvas}), {steps} denoise steps per block")
        rows = run(llm, concurrency, prompt_tokens, max_tokens, steps)
    print(f"| {'requests':>8} | {'seconds':>8} | {'output tok/s':>12} | {'forwards':>8} | {'ms/forward':>10} |")
    print(f"|{'-' * 10}|{'-' * 10}|{'-' * 14}|{'-' * 10}|{'-' * 12}|")
    for r in rows:
        print(f"| {r['requests']:>8} | {r['seconds']:>8.2f} | {r['tokens_per_s']:>12.0f} | {r['forwards']:>8} | "
              f"{r['ms_per_forward']:>10.2f} |")
