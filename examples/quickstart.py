"""diffuserve quickstart: the bundled model solves a Sudoku.

The bundled model is a small DiffusionGemma (the real architecture: sliding and global
attention, a mixture of experts, self-conditioning) that we trained to write the solved
grid of a puzzle as one 82-token canvas, refined in parallel over a few denoise steps
(training/sudoku/). It solves 92% of fresh puzzles, all of the easier ones.

Two ways to ask it, both through the engine that serves any DiffusionGemma checkpoint:
- as a chat request: the puzzle is the user's message, the grid the answer;
- by infilling: the givens are pinned in the canvas and only the blanks are refined.
"""
import random
import sys
import time

import diffuserve as ds
from diffuserve import sudoku as sd


def verdict(cells, puzzle):
    return "solved" if sd.is_solution(cells, puzzle) else "not solved"


def main():
    llm = ds.LLM()  # no path: the bundled Sudoku model, on the CPU
    rng = random.Random(2026)
    puzzles = [sd.generate(rng.randint(30, 45), rng)[0] for _ in range(16)]  # unique solutions

    # A chat request, as `diffuserve serve` would get it: the puzzle as the user's message.
    puzzle = sd.parse(puzzles[0])
    print("puzzle:", puzzles[0])
    print(sd.format_grid(puzzle))
    t = time.perf_counter()
    out = llm.chat([{"role": "user", "content": puzzles[0]}])[0]
    answer = sd.parse(out.text[:sd.CELLS].ljust(sd.CELLS, "."))
    print(f"\nchat answer ({sum(out.denoise_steps)} denoise steps, {1e3 * (time.perf_counter() - t):.0f} ms): "
          f"{verdict(answer, puzzle)}")
    print(out.text)

    # Infilling, all 16 in one batch: the givens pinned, only the digits 1-9 drawn for the blanks.
    t = time.perf_counter()
    grids, solved, steps = sd.solve_all(llm, [sd.parse(p) for p in puzzles])
    print(f"\ninfilling 16 puzzles in one batch: {sum(solved)} solved, {sum(steps) / len(steps):.1f} denoise steps "
          f"on average, {time.perf_counter() - t:.1f} s")
    for cells, grid, ok in zip(puzzles, grids, solved):
        if ok:
            bold = sys.stdout.isatty()  # escape codes for a terminal only, not into a file or a pipe
            print("the first one solved" + (" (givens in bold):" if bold else ":"))
            print(sd.format_grid(grid, sd.parse(cells) if bold else None))
            break
    print("\nMore: `diffuserve sudoku` (a live view of the canvas), `diffuserve serve` (the OpenAI API).")


if __name__ == "__main__":
    main()
