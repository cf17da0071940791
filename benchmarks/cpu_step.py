"""CPU step latency: ms per prefill, denoise and commit on a small random DiffusionGemma.

    python benchmarks/cpu_step.py [--threads N] [--dtype float32|bfloat16] [--repeats R]

Shape: hidden 256, 4 layers (3 sliding + 1 full), 8 experts top-2, canvas 64, 128-token
prompt. Prints a table of the median and best of R runs. Not a test: numbers depend on
the machine.
"""
import argparse
import os
import statistics
import tempfile
import time

import numpy as np

import diffuserve as ds
from diffuserve.random_checkpoint import write_random_checkpoint

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
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=0, help="0: every hardware thread")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        path = write_random_checkpoint(f"{tmp}/m", canvas_length=CANVAS, dtype=args.dtype, **CONFIG)
        model = ds.Model.load(path, num_threads=args.threads)
        rng = np.random.default_rng(0)
        prompt = rng.integers(0, CONFIG["vocab_size"], PROMPT)
        canvas = rng.integers(0, CONFIG["vocab_size"], CANVAS)

        seq = model.sequence()
        seq.prefill(prompt)
        logits = seq.denoise(canvas)
        rows = [("prefill", PROMPT, timed(lambda: model.sequence().prefill(prompt), args.repeats)),
                ("denoise (first step)", CANVAS, timed(lambda: seq.denoise(canvas), args.repeats)),
                ("denoise (self-cond.)", CANVAS, timed(lambda: seq.denoise(canvas, logits), args.repeats))]

        def commit():  # each commit on a fresh copy of the same prefilled state
            s = model.sequence()
            s.prefill(prompt)
            t = time.perf_counter()
            s.commit(canvas)
            return 1e3 * (time.perf_counter() - t)
        commits = [commit() for _ in range(args.repeats)]
        rows.append(("commit", CANVAS, (statistics.median(commits), min(commits))))

    threads = args.threads or os.environ.get("DIFFUSERVE_NUM_THREADS") or os.cpu_count()
    print(f"diffuserve CPU step latency: hidden {CONFIG['hidden_size']}, {CONFIG['num_hidden_layers']} layers, "
          f"{CONFIG['num_experts']} experts top-{CONFIG['top_k_experts']}, vocab {CONFIG['vocab_size']}, "
          f"{args.dtype} weights, {threads} threads, {args.repeats} runs")
    print(f"| {'pass':<22} | {'tokens':>6} | {'median ms':>9} | {'best ms':>8} | {'tokens/s':>9} |")
    print(f"|{'-' * 24}|{'-' * 8}|{'-' * 11}|{'-' * 10}|{'-' * 11}|")
    for name, tokens, (median, best) in rows:
        print(f"| {name:<22} | {tokens:>6} | {median:>9.2f} | {best:>8.2f} | {tokens / median * 1e3:>9.0f} |")


if __name__ == "__main__":
    main()
