"""CPU benchmark on a small random DiffusionGemma: ms per prefill, denoise and commit, then
generation throughput with 1, 4 and 16 concurrent requests, with and without the commit
fusion.

    python benchmarks/cpu_step.py [--threads N] [--dtype float32|bfloat16]
                                  [--activations float32|bfloat16] [--repeats R]

Shape: hidden 256, 4 layers (3 sliding + 1 full), 8 experts top-2, canvas 64, 128-token
prompt; generation at a fixed 16 denoise steps per block. Prints tables of the median and
best of R runs. Not a test: numbers depend on the machine.
"""
import argparse
import os
import statistics
import tempfile
import time

import numpy as np

import diffuserve as ds
from diffuserve.random_checkpoint import write_random_checkpoint
from step_latency import fixed_steps  # beside this script

CONFIG = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_experts=8, top_k_experts=2,
              moe_intermediate_size=128, vocab_size=4096, sliding_window=64)
CANVAS, PROMPT = 64, 128


def timed(fn, repeats):
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - t))
    return statistics.median(times), min(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=0, help="0: one for each CPU the process may run on")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--activations", default="float32", choices=["float32", "bfloat16"],
                    help="bfloat16: the linears' and attention's inputs rounded to bf16, and a bf16 KV cache")
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        path = write_random_checkpoint(f"{tmp}/m", canvas_length=CANVAS, dtype=args.dtype, **CONFIG)
        model = ds.Model.load(path, num_threads=args.threads, activations=args.activations)
        rng = np.random.default_rng(0)
        prompt = rng.integers(0, CONFIG["vocab_size"], PROMPT)
        canvas = rng.integers(0, CONFIG["vocab_size"], CANVAS)

        seq = model.sequence()
        seq.prefill(prompt)
        logits = seq.denoise(canvas)
        fresh_prompts = iter(rng.integers(0, CONFIG["vocab_size"], (args.repeats, PROMPT)))  # no prefix-cache hits
        rows = [("prefill", PROMPT, timed(lambda: model.sequence().prefill(next(fresh_prompts)), args.repeats)),
                ("denoise (first step)", CANVAS, timed(lambda: seq.denoise(canvas), args.repeats)),
                ("denoise (self-cond.)", CANVAS, timed(lambda: seq.denoise(canvas, logits), args.repeats))]

        def commit():  # each commit on a fresh copy of the same prefilled state (its prefill a cache hit)
            s = model.sequence()
            s.prefill(prompt)
            t = time.perf_counter()
            s.commit(canvas)
            return 1e3 * (time.perf_counter() - t)
        commits = [commit() for _ in range(args.repeats)]
        rows.append(("commit", CANVAS, (statistics.median(commits), min(commits))))

        generation = [generation_row(path, args.threads, args.activations, n, fuse)
                      for n in (1, 4, 16) for fuse in (True, False)]

    threads = args.threads or int(os.environ.get("DIFFUSERVE_NUM_THREADS") or 0) or len(os.sched_getaffinity(0))
    print(f"diffuserve CPU step latency: hidden {CONFIG['hidden_size']}, {CONFIG['num_hidden_layers']} layers, "
          f"{CONFIG['num_experts']} experts top-{CONFIG['top_k_experts']}, vocab {CONFIG['vocab_size']}, "
          f"{args.dtype} weights, {args.activations} activations, {threads} threads, {args.repeats} runs")
    print(f"| {'pass':<22} | {'tokens':>6} | {'median ms':>9} | {'best ms':>8} | {'tokens/s':>9} |")
    print(f"|{'-' * 24}|{'-' * 8}|{'-' * 11}|{'-' * 10}|{'-' * 11}|")
    for name, tokens, (median, best) in rows:
        print(f"| {name:<22} | {tokens:>6} | {median:>9.2f} | {best:>8.2f} | {tokens / median * 1e3:>9.0f} |")

    print(f"\ngeneration: {GEN_TOKENS} new tokens per request ({GEN_TOKENS // CANVAS} blocks of {CANVAS}), "
          f"{STEPS} denoise steps per block")
    print(f"| {'requests':>8} | {'commit fusion':<13} | {'seconds':>7} | {'output tok/s':>12} | "
          f"{'forwards/block':>14} |")  # forward passes / blocks of one request
    print(f"|{'-' * 10}|{'-' * 15}|{'-' * 9}|{'-' * 14}|{'-' * 16}|")
    for n, fuse, seconds, forwards in generation:
        blocks = GEN_TOKENS // CANVAS  # per request; the requests run side by side in each forward
        print(f"| {n:>8} | {'on' if fuse else 'off':<13} | {seconds:>7.2f} | {n * GEN_TOKENS / seconds:>12.0f} | "
              f"{forwards / blocks:>14.2f} |")


GEN_TOKENS, STEPS = 4 * CANVAS, 16


def generation_row(path, threads, activations, requests, fuse):
    """Seconds and forward passes for `requests` concurrent requests, each generating
    GEN_TOKENS at exactly STEPS denoise steps per block (confidence made unreachable)."""
    llm = ds.LLM(path, num_threads=threads, fuse_commit=fuse, activations=activations)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, CONFIG["vocab_size"], PROMPT).tolist() for _ in range(requests)]
    params = fixed_steps(GEN_TOKENS, STEPS, seed=0)
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - t
    assert all(o.denoise_steps == [STEPS] * (GEN_TOKENS // CANVAS) for o in outs)
    return requests, fuse, seconds, llm.stats()["forward_passes"]


if __name__ == "__main__":
    main()
