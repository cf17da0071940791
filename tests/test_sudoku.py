"""Sudoku puzzles and checks, `diffuserve sudoku`, and the bundled Sudoku model.

Most tests use a random model with the Sudoku model's vocabulary and text files, whose
grids are not solutions: they check the puzzle machinery, that the givens are kept, that
only digits are written, and the command's output contract. The bundled (trained) model's
tests check that it is what `LLM()` and the commands use by default, and that it solves."""
import importlib.util
import os
import random
import subprocess
import sys

import pytest
from tokenizers import Tokenizer, models

import diffuserve as ds
from diffuserve import sudoku as sd
from diffuserve.random_checkpoint import write_random_checkpoint


def test_generated_puzzles_are_unique_and_consistent():
    rng = random.Random(3)
    for givens in (26, 35, 45):
        puzzle, solution = sd.generate(givens, rng)
        cells, grid = sd.parse(puzzle), sd.parse(solution)
        assert sum(v > 0 for v in cells) >= givens
        assert sd.is_solution(grid, cells)
        assert sd.count_solutions(cells) == 1


def test_checks_and_parsing():
    puzzle, solution = sd.generate(30, random.Random(1))
    grid = sd.parse(solution)
    broken = list(grid)
    broken[0], broken[1] = broken[1], broken[0]
    assert not sd.is_solution(broken)
    other = list(grid)
    cells = sd.parse(puzzle)
    given = next(i for i, v in enumerate(cells) if v)
    other[given] = other[given] % 9 + 1
    assert not sd.is_solution(other, cells)
    assert sd.parse(puzzle.replace("0", ".")) == cells
    assert sd.parse(sd.format_grid(cells)) == cells  # a grid as printed reads back
    with pytest.raises(ValueError, match="a puzzle is a string of 81 cells"):
        sd.parse(cells)
    with pytest.raises(ValueError, match="81 cells"):
        sd.parse("123")
    with pytest.raises(ValueError, match="'x'"):
        sd.parse("x" * 81)
    with pytest.raises(ValueError, match="givens"):
        sd.generate(10)


@pytest.mark.parametrize("edits, message", [
    ({0: 5, 4: 5}, "r1c1 and r1c5 are both 5, in one row"),
    ({3: 7, 75: 7}, "r1c4 and r9c4 are both 7, in one column"),
    ({30: 2, 50: 2}, "r4c4 and r6c6 are both 2, in one box"),
])
def test_contradictory_givens_are_refused(edits, message):
    """A puzzle whose givens contradict each other has no solution: refused naming the two
    cells (it had been 'solved'); an answer grid still parses."""
    cells = [0] * 81
    for i, v in edits.items():
        cells[i] = v
    assert sd.parse(sd.to_string(cells)) == cells
    with pytest.raises(ValueError, match=f"the givens contradict each other: {message}"):
        sd.check_puzzle(cells)
    with pytest.raises(ValueError, match="a puzzle's cells are 0 .blank. to 9, got 10 at r1c2"):
        sd.check_puzzle([0, 10] + [0] * 79)


TRAINER = os.path.join(os.path.dirname(__file__), "..", "training", "sudoku", "train.py")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A random model with the Sudoku model's own text files (the trainer writes them)."""
    spec = importlib.util.spec_from_file_location("sudoku_train", TRAINER)
    trainer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(trainer)
    path = tmp_path_factory.mktemp("sudoku") / "m"
    write_random_checkpoint(path, canvas_length=trainer.CANVAS, vocab_size=len(trainer.VOCAB), hidden_size=32,
                            intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                            head_dim=16, global_head_dim=16, sliding_window=64, num_experts=4, top_k_experts=2,
                            moe_intermediate_size=16)
    trainer.write_text_files(str(path))
    return str(path)


def test_chat_prompt_is_the_puzzle_as_training_wrote_it(model):
    """A chat message holding a puzzle, as 9 spaced lines with '.' blanks, renders to the
    same ids as the trainer's prompts ('<bos>' and 81 cells); the answer decodes as digits."""
    from diffuserve.tokenizer import Tokenizer as DsTokenizer
    puzzle, solution = sd.generate(30, random.Random(11))
    tok = DsTokenizer.from_checkpoint(model)
    lines = "\n".join(" ".join(puzzle[r * 9:(r + 1) * 9].replace("0", ".")) for r in range(9))
    text = tok.apply_chat_template([{"role": "user", "content": "  " + lines + "\n"}])
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == tok.encode(puzzle.replace("0", "."))  # the post-processor adds <bos>
    assert len(ids) == 82 and ids[0] == tok.token_id("<bos>")
    answer = [tok.token_id(c) for c in solution] + [tok.eos_token_id]
    assert tok.decode(answer) == solution


def run(*args):
    return subprocess.run([sys.executable, "-m", "diffuserve", "sudoku", *args], capture_output=True, text=True)


def test_solve_keeps_givens_and_writes_digits(model):
    puzzle, _ = sd.generate(30, random.Random(5))
    out = run(puzzle, "--model", model, "--max-denoising-steps", "3")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    answer, verdict = lines[-2], lines[-1]
    assert lines[0] == f"{81 - puzzle.count('0')} givens:" and sd.parse("".join(lines[1:12])) == sd.parse(puzzle)
    assert len(answer) == 81 and set(answer) <= set("123456789")
    assert all(p == "0" or p == a for p, a in zip(puzzle, answer))  # the givens are pinned
    assert "denoise steps" in verdict


def test_eval_prints_the_summary_and_writes_answers(model, tmp_path):
    rng = random.Random(7)
    puzzles = [sd.generate(40, rng)[0].replace("0", ".") for _ in range(5)]
    # A blank line among them stays one in the answers: line n answers line n (it had been
    # dropped, and every answer after it was on the line of the next puzzle).
    (tmp_path / "in.txt").write_text("\n".join(puzzles[:2] + [""] + puzzles[2:]) + "\n")
    out = run("--model", model, "--eval", str(tmp_path / "in.txt"), "--output", str(tmp_path / "out.txt"),
              "--max-denoising-steps", "2")
    assert out.returncode == 0, out.stderr
    summary = out.stdout.strip().splitlines()[-1]
    assert summary.startswith("solved=") and "mean_steps=" in summary and summary.endswith("n=5")
    answers = (tmp_path / "out.txt").read_text().split("\n")
    assert answers[2] == "" and answers[-1] == "" and len(answers) == 7
    for puzzle, answer in zip(puzzles, answers[:2] + answers[3:6]):
        assert len(answer) == 81 and all(p == "." or p == a for p, a in zip(puzzle, answer))  # its givens


def test_clear_errors(model, tmp_path):
    assert "81 cells" in run("123", "--model", model).stderr
    plain = write_random_checkpoint(tmp_path / "plain", canvas_length=16, vocab_size=64, hidden_size=32,
                                    intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                                    num_key_value_heads=1, head_dim=16, global_head_dim=16, sliding_window=8,
                                    num_experts=4, top_k_experts=2, moe_intermediate_size=16)
    assert "not a Sudoku model: it has no tokenizer.json" in run("0" * 81, "--model", plain).stderr
    Tokenizer(models.WordLevel({"a": 0}, unk_token="a")).save(os.path.join(plain, "tokenizer.json"))
    assert "not a Sudoku model: its tokenizer has no single tokens" in run("0" * 81, "--model", plain).stderr
    conflict = "55" + "0" * 79
    out = run(conflict, "--model", model)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert "error: the givens contradict each other: r1c1 and r1c2 are both 5, in one row" in out.stderr
    (tmp_path / "in.txt").write_text("0" * 81 + "\n\n" + conflict + "\n")
    out = run("--eval", str(tmp_path / "in.txt"), "--model", model)
    assert f"error: {tmp_path / 'in.txt'}, line 3: the givens contradict each other: r1c1 and r1c2" in out.stderr
    llm = ds.LLM(model, kv_cache_memory_bytes=8 << 20)
    with pytest.raises(ValueError, match="puzzle 1: the givens contradict each other: r1c1 and r1c2"):
        sd.solve_all(llm, [[0] * 81, sd.parse(conflict)], plain=True)
    with pytest.raises(ValueError, match="the givens contradict each other: r1c1 and r1c2"):
        sd.request(llm, sd.parse(conflict))


def test_training_script_runs_and_its_checkpoint_solves_through_diffuserve(tmp_path):
    """training/sudoku/train.py end to end at toy size: a few steps, a checkpoint diffuserve
    loads, an evaluation through the real sampler, and a log line."""
    out = tmp_path / "run"
    run_ = subprocess.run([sys.executable, TRAINER, "--out", str(out), "--device", "cpu", "--hidden", "32",
                           "--layers", "2", "--experts", "4", "--moe-intermediate", "16", "--batch", "4",
                           "--minutes", "0.02", "--pool-seconds", "1", "--eval-puzzles", "2"],
                          capture_output=True, text=True)
    assert run_.returncode == 0, run_.stderr
    assert '"solved"' in (out / "training_log.jsonl").read_text()
    solved = run("--model", str(out / "best"), "--max-denoising-steps", "2")
    assert solved.returncode == 0, solved.stderr


def test_the_bundled_model_is_the_default_and_solves_puzzles():
    """`LLM()` with no path is the bundled model; it solves most easy puzzles, by infilling
    and from a chat message, through the real sampler with its generation defaults."""
    llm = ds.LLM()
    assert llm.model.canvas_length == sd.CELLS + 1
    rng = random.Random(11)
    puzzles = [sd.parse(sd.generate(45, rng)[0]) for _ in range(12)]
    grids, solved, steps = sd.solve_all(llm, puzzles)
    assert all(g[i] == v for g, p in zip(grids, puzzles) for i, v in enumerate(p) if v)  # givens kept
    assert sum(solved) >= 8, f"solved {sum(solved)} of 12 easy puzzles"
    assert max(steps) <= 24
    # From a chat message, a line of cells or the grid as sudoku prints it (its box rules, which
    # the template drops, had been read as 60 unknown tokens: no puzzle solved).
    pasted = lambda p: sd.format_grid(p).replace(" ", "\u00a0") + "\f"  # (no-break spaces, as from a web page)
    for show in (sd.to_string, sd.format_grid, pasted):
        outs = llm.chat([[{"role": "user", "content": show(p)}] for p in puzzles])
        assert all(o.finish_reason == "stop" for o in outs)  # the answer ends by itself, with <eos>
        chat_solved = [len(o.text) == sd.CELLS and sd.is_solution(sd.parse(o.text), p) for o, p in zip(outs, puzzles)]
        assert sum(chat_solved) >= 8, f"solved {sum(chat_solved)} of 12 easy puzzles from a chat message ({show})"


@pytest.mark.parametrize("command", [["sudoku"], ["generate", "Hi"]])
def test_a_command_with_stdout_closed_says_so(command):
    """With stdout closed (`>&-`), a command whose answer goes there fails, saying so, before
    any work (sudoku had ended in a traceback; generate had exited 0, its answer lost; before
    that, the final flush of a stdout that is None had been a traceback). serve's case is
    test_server's test_serve_with_stdout_closed_serves."""
    out = subprocess.run([sys.executable, "-m", "diffuserve", *command], capture_output=False, stderr=subprocess.PIPE,
                         text=True, preexec_fn=lambda: os.close(1))
    assert out.returncode == 1 and out.stderr == "error: stdout is closed: nowhere to write the answer\n", out.stderr


def test_eval_seeds_wrap_past_the_largest(model, tmp_path):
    """--eval seeds puzzle i with seed + i modulo 2**64, as the server seeds its choices: the
    largest seed --help allows had failed after the load, naming a seed the user never gave."""
    rng = random.Random(3)
    (tmp_path / "in.txt").write_text("".join(sd.generate(45, rng)[0] + "\n" for _ in range(2)))
    out = run("--model", model, "--eval", str(tmp_path / "in.txt"), "--seed", str(2**64 - 1),
              "--max-denoising-steps", "2")
    assert out.returncode == 0 and out.stdout.strip().splitlines()[-1].startswith("solved="), out.stderr


def test_commands_default_to_the_bundled_model():
    puzzle = sd.generate(45, random.Random(5))[0]
    out = run(puzzle)
    assert out.returncode == 0, out.stderr
    assert "denoise steps" in out.stdout.strip().splitlines()[-1]


def test_a_missing_bundled_model_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setattr(ds, "_HERE", tmp_path)
    with pytest.raises(FileNotFoundError, match="reinstall diffuserve, or pass a checkpoint directory"):
        ds.LLM()
