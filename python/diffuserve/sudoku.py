"""Sudoku: puzzles, checks, and solving one through a model by infilling.

A puzzle is an 81-character string, row by row, '1'-'9' for givens and '0' or '.' for
blanks. A Sudoku model reads the puzzle as its prompt and writes the solved grid as one
81-token canvas: the givens are pinned (`pinned_positions`), every other cell is refined
from noise, and only the digits 1-9 may be drawn (`allowed_token_ids`).
"""
from __future__ import annotations

import random
from typing import List, Optional, Tuple

from ._checks import is_int
from .sampling import SamplingParams

CELLS = 81


def _units() -> List[List[int]]:
    rows = [[r * 9 + c for c in range(9)] for r in range(9)]
    cols = [[r * 9 + c for r in range(9)] for c in range(9)]
    boxes = [[(br * 3 + r) * 9 + bc * 3 + c for r in range(3) for c in range(3)] for br in range(3) for bc in range(3)]
    return rows + cols + boxes


UNITS = _units()
PEERS = [sorted({p for unit in UNITS if i in unit for p in unit} - {i}) for i in range(CELLS)]


# What format_grid draws between the cells: read past, so that a grid it printed reads back.
_BOX_RULES = str.maketrans("", "", "|-+")


def parse(puzzle: str) -> List[int]:
    """81 cells, 0 for a blank, from a line of them or a grid as format_grid draws it; ValueError
    naming what is wrong. (Any grid: an answer may repeat a digit; check_puzzle judges a
    puzzle's givens.)"""
    if not isinstance(puzzle, str):
        raise ValueError(f"a puzzle is a string of 81 cells (digits, '.' or 0 for a blank), got {puzzle!r:.100}")
    text = "".join(puzzle.translate(_BOX_RULES).split())
    if len(text) != CELLS:
        raise ValueError(f"a puzzle has 81 cells, got {len(text)} characters")
    bad = [ch for ch in text if ch not in "0123456789."]
    if bad:
        raise ValueError(f"a puzzle holds only digits and '.', got {bad[0]!r}")
    return [0 if ch == "." else int(ch) for ch in text]


def _cell(i: int) -> str:
    return f"r{i // 9 + 1}c{i % 9 + 1}"


def check_puzzle(cells: List[int]) -> List[int]:
    """cells, if they are a puzzle to solve: 81 values 0-9 (0 a blank) whose givens do not
    contradict each other; else ValueError naming the first conflict (the cells as row and
    column, r1c1 to r9c9)."""
    cells = list(cells)
    if len(cells) != CELLS:
        raise ValueError(f"a puzzle has 81 cells, got {len(cells)}")
    for i, v in enumerate(cells):
        if not is_int(v) or not 0 <= v <= 9:
            raise ValueError(f"a puzzle's cells are 0 (blank) to 9, got {v!r} at {_cell(i)}")
    for kind, units in (("row", UNITS[:9]), ("column", UNITS[9:18]), ("box", UNITS[18:])):
        for unit in units:
            seen = {}
            for i in unit:
                if cells[i] in seen:
                    raise ValueError(f"the givens contradict each other: {_cell(seen[cells[i]])} and {_cell(i)} "
                                     f"are both {cells[i]}, in one {kind}")
                if cells[i]:
                    seen[cells[i]] = i
    return [int(v) for v in cells]


def to_string(cells: List[int]) -> str:
    return "".join(str(v) for v in cells)


def is_solution(grid: List[int], puzzle: Optional[List[int]] = None) -> bool:
    """Every row, column and box holds 1-9 once, and (given a puzzle) the givens are kept."""
    if len(grid) != CELLS or any(not 1 <= v <= 9 for v in grid):
        return False
    if any(sorted(grid[i] for i in unit) != list(range(1, 10)) for unit in UNITS):
        return False
    return puzzle is None or all(p == 0 or p == g for p, g in zip(puzzle, grid))


def _candidates(cells: List[int], i: int) -> List[int]:
    used = {cells[p] for p in PEERS[i]}
    return [v for v in range(1, 10) if v not in used]


def count_solutions(cells: List[int], limit: int = 2) -> int:
    """Solutions of a puzzle, counted up to `limit` (backtracking on the most constrained cell)."""
    cells = list(cells)

    def search() -> int:
        best, best_options = -1, None
        for i in range(CELLS):
            if cells[i] == 0:
                options = _candidates(cells, i)
                if not options:
                    return 0
                if best_options is None or len(options) < len(best_options):
                    best, best_options = i, options
        if best < 0:
            return 1
        found = 0
        for v in best_options:
            cells[best] = v
            found += search()
            if found >= limit:
                break
        cells[best] = 0
        return found

    return search()


def generate(givens: int = 30, rng: Optional[random.Random] = None, unique: bool = True) -> Tuple[str, str]:
    """A (puzzle, solution) pair with about `givens` givens. unique: the puzzle has one
    solution (never fewer givens; more when no further cell can go without losing
    uniqueness); otherwise exactly `givens` random cells are kept, which is fast (training
    data only needs the solution to be consistent with the givens)."""
    if not 17 <= givens <= CELLS:
        raise ValueError(f"givens must be in [17, 81], got {givens}")
    rng = rng or random.Random()
    grid = [0] * CELLS

    def fill(i: int = 0) -> bool:
        if i == CELLS:
            return True
        options = _candidates(grid, i)
        rng.shuffle(options)
        for v in options:
            grid[i] = v
            if fill(i + 1):
                return True
        grid[i] = 0
        return False

    fill()
    puzzle = list(grid)
    order = list(range(CELLS))
    rng.shuffle(order)
    remaining = CELLS
    for i in order:
        if remaining <= givens:
            break
        kept, puzzle[i] = puzzle[i], 0
        if not unique or count_solutions(puzzle) == 1:
            remaining -= 1
        else:
            puzzle[i] = kept
    return to_string(puzzle), to_string(grid)


def format_grid(cells: List[int], puzzle: Optional[List[int]] = None) -> str:
    """The grid as 9 lines with box rules; givens in bold when a puzzle is given."""
    lines = []
    for r in range(9):
        if r and r % 3 == 0:
            lines.append("------+-------+------")
        row = []
        for c in range(9):
            if c and c % 3 == 0:
                row.append("|")
            v = cells[r * 9 + c]
            text = str(v) if v else "."
            row.append(f"\033[1m{text}\033[0m" if puzzle is not None and puzzle[r * 9 + c] else text)
        lines.append(" ".join(row))
    return "\n".join(lines)


def digit_token_ids(tokenizer) -> List[int]:
    """The token ids of '1'..'9' in a Sudoku model's vocabulary."""
    if tokenizer is None:
        raise ValueError("not a Sudoku model: it has no tokenizer.json, so no tokens for the digits 1-9")
    ids = [tokenizer.token_id(str(d)) for d in range(1, 10)]
    if None in ids:
        raise ValueError("not a Sudoku model: its tokenizer has no single tokens for the digits 1-9")
    return ids


def request(llm, cells: List[int], seed: int = 0, **options):
    """(prompt ids, SamplingParams) that solve `cells` by infilling: the givens pinned, the
    blanks started from random digits, only digits allowed. The canvas is the 81 cells, or
    the 81 cells and an end token (pinned too) where the model's canvas has 82 tokens.
    `options`: further SamplingParams fields (max_denoising_steps, self_conditioning, ...)."""
    cells = check_puzzle(cells)
    canvas_length = llm.model.canvas_length
    if canvas_length not in (CELLS, CELLS + 1):
        raise ValueError(f"not a Sudoku model: its canvas has {canvas_length} tokens, not 81 or 82")
    digits = digit_token_ids(llm.tokenizer)
    rng = random.Random(seed)
    canvas = [digits[v - 1] if v else rng.choice(digits) for v in cells]
    pinned, stop = [i for i, v in enumerate(cells) if v], []
    if canvas_length > CELLS:
        eos = llm.tokenizer.eos_token_id
        if eos is None:
            raise ValueError("not a Sudoku model: its canvas has 82 tokens but its tokenizer names no end token")
        canvas.append(eos)
        pinned.append(CELLS)
        stop = [eos]
    params = SamplingParams(max_new_tokens=canvas_length, seed_canvas=canvas, pinned_positions=pinned,
                            allowed_token_ids=digits, eos_token_id=stop, seed=seed, **options)
    return llm.tokenizer.encode(to_string(cells)), params


def solve_all(llm, puzzles: List[List[int]], seed: int = 0, plain: bool = False,
              **options) -> Tuple[list, list, list]:
    """Solves every puzzle in one batch: (answer grids, whether each solves its puzzle,
    denoise steps of each). By infilling (`request`), or with plain=True by plain generation
    from the puzzle as the prompt, as a chat request would; `options` are further
    SamplingParams fields. Puzzle i is seeded seed + i (modulo 2**64, as the server's choices are)."""
    for i, cells in enumerate(puzzles):
        try:
            check_puzzle(cells)
        except ValueError as e:
            raise ValueError(f"puzzle {i}: {e}") from None
    seeds = [(seed + i) % 2**64 for i in range(len(puzzles))]
    if plain:
        prompts = [llm.tokenizer.encode(to_string(cells)) for cells in puzzles]
        params = [SamplingParams(seed=s, **options) for s in seeds]
    else:
        requests = [request(llm, cells, s, **options) for cells, s in zip(puzzles, seeds)]
        prompts, params = [r[0] for r in requests], [r[1] for r in requests]
    outs = llm.generate(prompts, params) if puzzles else []
    digits = digit_token_ids(llm.tokenizer)
    grids = [grid_of(o.token_ids, digits) for o in outs]
    return grids, [is_solution(g, c) for g, c in zip(grids, puzzles)], [sum(o.denoise_steps) for o in outs]


def grid_of(token_ids: List[int], digits: List[int]) -> List[int]:
    """Cell values of the first 81 tokens of a canvas (0 for anything but a digit)."""
    value = {t: d + 1 for d, t in enumerate(digits)}
    return [value.get(t, 0) for t in token_ids[:CELLS]]
