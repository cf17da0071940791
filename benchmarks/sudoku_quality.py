"""How well the bundled Sudoku model solves puzzles it never saw, through diffuserve.

    python benchmarks/sudoku_quality.py [--model DIR] [--n 1000] [--device cpu|cuda] [--ways default,fixed48,...]

Fresh puzzles with a unique solution (26 to 45 givens, uniformly; seeds apart from the
training pool's and the trainer's held-out set), solved four ways: infilling with the
model's generation settings (what `diffuserve sudoku` does), the same at a fixed 48 denoise
steps (no early stop), the same with self-conditioning disabled, and plain generation from
the puzzle as the prompt (what a chat request does). Prints one table: the fraction fully
valid and consistent with the givens, and the mean denoise steps, by number of givens.
"""
import argparse
import multiprocessing
import os
import random
import sys
import time

import diffuserve as ds
from diffuserve import sudoku as sd
from diffuserve._checks import INT32_MAX
from diffuserve.cli import in_range

BUCKETS = [(26, 29), (30, 33), (34, 37), (38, 41), (42, 45)]


def _puzzle(i):
    rng = random.Random(2 * 10**6 + i)
    return sd.generate(rng.randint(26, 45), rng)[0]


# The four ways, as solve_all's options. fixed48: the stopping rule can never hold (it needs
# the argmax stable for more steps than there are), so all 48 steps run.
WAYS = {"default": {}, "fixed48": dict(max_denoising_steps=48, stability_threshold=1000),
        "no_sc": dict(self_conditioning=False), "plain": dict(plain=True)}
TITLES = {"default": "default", "fixed48": "fixed 48 steps", "no_sc": "no self-conditioning",
          "plain": "plain generation"}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a Sudoku checkpoint (default: the bundled one)")
    ap.add_argument("--n", type=in_range(int, 1, INT32_MAX), default=1000, help="puzzles")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--ways", default=",".join(WAYS), help="comma-separated, of " + ", ".join(WAYS))
    args = ap.parse_args()
    ways = args.ways.split(",")
    if not set(ways) <= set(WAYS):
        ap.error(f"--ways: unknown {', '.join(sorted(set(ways) - set(WAYS)))} (use {', '.join(WAYS)})")

    t = time.perf_counter()
    with multiprocessing.get_context("fork").Pool(os.cpu_count()) as pool:
        puzzles = pool.map(_puzzle, range(args.n))
    made_s = time.perf_counter() - t
    llm = ds.LLM(args.model, device=args.device)
    cells = [sd.parse(p) for p in puzzles]
    results, seconds = {}, {}
    for how in ways:
        t = time.perf_counter()
        results[how] = sd.solve_all(llm, cells, **WAYS[how])[1:]  # (solved flags, denoise steps)
        seconds[how] = time.perf_counter() - t
        ok, steps = results[how]  # each way as it ends: a long run shows its progress
        print(f"  {how}: {100 * sum(ok) / len(ok):.1f}% solved, {sum(steps) / len(steps):.1f} mean steps, "
              f"{seconds[how]:.0f} s", file=sys.stderr, flush=True)
    givens = [sum(v > 0 for v in c) for c in cells]

    print(f"Sudoku, {args.n} fresh puzzles with unique solutions (made in {made_s:.0f} s), model "
          f"{args.model or 'bundled'}, device {args.device}; solved % / mean denoise steps")
    print("| givens | n | " + " | ".join(TITLES[how] for how in ways) + " |")
    print("|-------:|--:|" + "".join("-" * (len(TITLES[how]) + 1) + ":|" for how in ways))
    for bucket in BUCKETS + [None]:
        lo, hi = bucket or (None, None)
        idx = [i for i, g in enumerate(givens) if lo is None or lo <= g <= hi]
        if not idx:
            continue
        cells = []
        for how in ways:
            ok, steps = results[how]
            solved, mean_steps = 100 * sum(ok[i] for i in idx) / len(idx), sum(steps[i] for i in idx) / len(idx)
            cells.append(f"{solved:.1f}% / {mean_steps:.1f}")
        label = "all" if lo is None else f"{lo}-{hi}"
        print(f"| {label:>6} | {len(idx)} | " + " | ".join(cells) + " |")
    print("seconds per puzzle (batched): " + ", ".join(f"{how} {seconds[how] / args.n * 1e3:.1f} ms" for how in ways))


if __name__ == "__main__":
    main()
