"""Trains the bundled Sudoku model: a small DiffusionGemma (the real architecture, with
transformers' classes holding the weights) that solves a puzzle as one canvas.

    python training/sudoku/train.py --out OUT [--minutes 8] [--init CHECKPOINT]

The prompt is the puzzle (81 characters, '0' or '.' for a blank); the canvas (82 tokens)
is the solved grid followed by <eos>, so plain generation (a chat message holding a
puzzle) ends by itself with the answer.

Recipe (issue 7): uniform-state diffusion. Each example's canvas is the answer with a
fraction t ~ U(0, 1) of its positions replaced by random tokens, in one of two ways, half
the examples each: as `diffuserve sudoku` infills (givens and <eos> clean, as it pins them;
blanks noised with digits) or as plain generation starts (every position noised with any
token of the vocabulary). The loss is cross-entropy over the canvas. On half the batches
the model is first run without gradients on a differently noised canvas and its logits,
divided by a temperature drawn from the inference schedule's range, are fed as the
self-conditioning input, as the sampler feeds them.

The forward pass is lean_model.py's: the same logits as transformers' forward, from the
same parameters, with far fewer kernels and static shapes (--hf-model trains through
transformers' forward instead). The loop is lean so the GPU does the work: puzzles with a
unique solution are made once on every CPU core (for a fixed time), and each batch draws
from that pool through the Sudoku symmetries (digit relabelling, row and column swaps
within a band or stack, band and stack swaps, transposition), which keep a puzzle's
solution unique, on the GPU. Learning rate: linear warm-up, then cosine decay over the
time budget. Every --eval-minutes the weights are written (bf16, sharded, <= 15 MB a
file) and evaluated through diffuserve itself, the real sampler, on held-out puzzles: loss
is not the metric. Evaluation runs in a process of its own on the CPU, so training goes on
meanwhile; the best evaluated checkpoint is kept in OUT/best.
"""
import argparse
import concurrent.futures
import copy
import json
import math
import multiprocessing
import os
import random
import shutil
import sys
import tempfile
import time

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

import diffuserve as ds
from diffuserve import sudoku as sd

# Vocabulary: specials, then the digits, then '.' (another way to write a blank).
VOCAB = {"<pad>": 0, "<eos>": 1, "<bos>": 2, **{str(d): 3 + d for d in range(10)}, ".": 13}
DIGIT0 = VOCAB["0"]  # digit v is token DIGIT0 + v; 0 is a blank
CANVAS = 82  # the grid, then <eos>
PROMPT = 82  # <bos>, then the puzzle's 81 cells
# Sampling defaults (generation_config.json), tuned on the bundled checkpoint: hotter
# sampling lets the model revise confident mistakes (training/sudoku/README.md).
GENERATION = {"max_new_tokens": CANVAS, "max_denoising_steps": 24, "t_min": 0.5, "t_max": 1.5,
              "stability_threshold": 1, "confidence_threshold": 0.01,
              "sampler_config": {"entropy_bound": 0.1, "_cls_name": "EntropyBoundSamplerConfig"},
              "eos_token_id": 1, "pad_token_id": 0, "bos_token_id": 2}
# The last message's cells alone: whitespace (any, as str.split finds it) and the box rules
# sudoku.format_grid draws go.
CHAT_TEMPLATE = ("{{ bos_token }}{{ messages[-1]['content'].split() | join('') | replace('|', '') "
                 "| replace('-', '') | replace('+', '') }}")


def model_config(hidden, layers, experts, moe_intermediate):
    # Every third layer (and the last) attends globally; the others through a 64-token
    # window, shorter than prompt + canvas (164 tokens), so both kinds matter.
    types = ["full_attention" if (i + 1) % 3 == 0 or i == layers - 1 else "sliding_attention" for i in range(layers)]
    text = dict(vocab_size=len(VOCAB), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, global_head_dim=hidden // 4,
                num_global_key_value_heads=2, sliding_window=64, num_experts=experts, top_k_experts=2,
                moe_intermediate_size=moe_intermediate, layer_types=types, pad_token_id=0, eos_token_id=1,
                bos_token_id=2, max_position_embeddings=512)
    vision = dict(model_type="gemma4_vision", hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=2, head_dim=8)
    return DiffusionGemmaConfig(text_config=text, vision_config=vision, canvas_length=CANVAS)


def write_text_files(path):
    """tokenizer.json (one token a character, <bos> first), tokenizer_config.json with the
    chat template, generation_config.json."""
    tok = Tokenizer(models.WordLevel(VOCAB, unk_token="<pad>"))
    tok.add_special_tokens(["<pad>", "<eos>", "<bos>"])  # whole tokens in text (the chat template's <bos>)
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    tok.decoder = decoders.Fuse()  # the grid's digits back to back
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "chat_template": CHAT_TEMPLATE},
                  f, indent=2)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump(GENERATION, f, indent=2)


# --- data -------------------------------------------------------------------------------

def _make_puzzles(args):
    seed, deadline, givens = args
    rng, pairs = random.Random(seed), []
    while time.time() < deadline or not pairs:
        pairs.append(sd.generate(rng.randint(*givens), rng))
    return pairs


def puzzle_pool(seconds, seed, givens=(26, 45)):
    """(puzzles, solutions) as [N, 81] value tensors (0: blank), unique solutions with about
    `givens` (a range) givens each, made on every core for `seconds`."""
    workers = os.cpu_count() or 1
    deadline = time.time() + seconds
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        parts = pool.map(_make_puzzles, [(seed * 1000 + w, deadline, givens) for w in range(workers)])
    pairs = [p for part in parts for p in part]
    values = lambda s: [int(c) for c in s]
    return torch.tensor([values(p) for p, _ in pairs]), torch.tensor([values(s) for _, s in pairs])


def _lines(batch, gen, device):
    """[B, 9] permutations of rows (or columns) that keep the Sudoku rules: the bands are
    shuffled, and the lines within each band."""
    bands = torch.argsort(torch.rand(batch, 3, device=device, generator=gen), dim=1)
    within = torch.argsort(torch.rand(batch, 3, 3, device=device, generator=gen), dim=2)
    return bands.repeat_interleave(3, dim=1) * 3 + within.flatten(1)


def augment(puzzles, solutions, gen):
    """Random Sudoku symmetries of each (puzzle, solution) pair: a bijection of valid grids
    that maps the givens along, so a unique solution stays unique."""
    b, device = puzzles.shape[0], puzzles.device
    rows, cols = _lines(b, gen, device), _lines(b, gen, device)
    cells = rows.unsqueeze(2) * 9 + cols.unsqueeze(1)  # [B, 9, 9]: new (r, c) <- old cell
    transpose = torch.rand(b, 1, 1, device=device, generator=gen) < 0.5
    cells = torch.where(transpose, cells.transpose(1, 2), cells).flatten(1)
    relabel = torch.cat([torch.zeros(b, 1, dtype=torch.long, device=device),
                         1 + torch.argsort(torch.rand(b, 9, device=device, generator=gen), dim=1)], dim=1)
    move = lambda grid: relabel.gather(1, grid.gather(1, cells))
    return move(puzzles), move(solutions)


def batch(pool, size, gen):
    """(prompt ids [B, 82], answer canvas ids [B, 82], free-position mask [B, 82]) on the
    pool's device. Blanks are written '0' or '.' (half the examples each); the free
    positions are the blanks (the givens and <eos> are pinned when infilling)."""
    puzzles, solutions = pool
    device = puzzles.device
    pick = torch.randint(0, puzzles.shape[0], (size,), device=device, generator=gen)
    puzzles, solutions = augment(puzzles[pick], solutions[pick], gen)
    blank = torch.where(torch.rand(size, 1, device=device, generator=gen) < 0.5, VOCAB["."], DIGIT0)
    bos, eos = torch.full((size, 1), VOCAB["<bos>"], device=device), torch.full((size, 1), VOCAB["<eos>"], device=device)
    prompts = torch.cat([bos, torch.where(puzzles == 0, blank, DIGIT0 + puzzles)], dim=1)
    free = torch.cat([puzzles == 0, torch.zeros_like(eos, dtype=torch.bool)], dim=1)
    return prompts, torch.cat([DIGIT0 + solutions, eos], dim=1), free


def noised(answers, free, gen):
    """A fraction t ~ U(0, 1) of each example's canvas replaced by random tokens: for half
    the examples only free positions, with digits (infilling); for the others any position,
    with any token (plain generation)."""
    b, device = answers.shape[0], answers.device
    t = torch.rand(b, 1, device=device, generator=gen)
    infill = torch.rand(b, 1, device=device, generator=gen) < 0.5
    flip = (torch.rand(answers.shape, device=device, generator=gen) < t) & (free | ~infill)
    digits = DIGIT0 + torch.randint(1, 10, answers.shape, device=device, generator=gen)
    tokens = torch.randint(0, len(VOCAB), answers.shape, device=device, generator=gen)
    return torch.where(flip, torch.where(infill, digits, tokens), answers)


# --- evaluation -------------------------------------------------------------------------

def evaluate(path, puzzles, device, threads):
    """Through diffuserve's sampler: (fraction solved by infilling, its mean denoise steps,
    fraction solved by plain generation from the puzzle as the prompt)."""
    llm = ds.LLM(path, device=device, num_threads=threads)
    cells = [sd.parse(p) for p in puzzles]
    _, infilled, steps = sd.solve_all(llm, cells)
    _, plain, _ = sd.solve_all(llm, cells, plain=True)
    return sum(infilled) / len(cells), sum(steps) / len(cells), sum(plain) / len(cells)


def save(model, path):
    os.makedirs(path, exist_ok=True)
    # A bf16 copy (not a bf16 state dict, which would store tied weights twice).
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(path, max_shard_size="15MB")
    write_text_files(path)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--init", help="start from this checkpoint's weights")
    # The bundled model's shape: deep and narrow (README.md, "Depth, not more steps").
    ap.add_argument("--hidden", type=int, default=192)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--experts", type=int, default=6)
    ap.add_argument("--moe-intermediate", type=int, default=96)
    # transformers' forward (--hf-model) runs ~2,000 examples/s on an H200 at any batch size
    # (overhead-bound): a smaller batch buys more optimizer steps a minute (README.md).
    ap.add_argument("--batch", type=int, default=512, help="halved until the first step fits")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=200, help="steps")
    ap.add_argument("--minutes", type=float, default=8.0, help="training time (the cosine decay spans it)")
    ap.add_argument("--pool-seconds", type=float, default=40.0, help="time spent making unique puzzles")
    ap.add_argument("--givens", type=int, nargs=2, default=(26, 45), metavar=("MIN", "MAX"),
                    help="training puzzles' givens, uniform in [MIN, MAX] (evaluation: always 26-45)")
    ap.add_argument("--eval-minutes", type=float, default=2.0)
    ap.add_argument("--eval-puzzles", type=int, default=200)
    ap.add_argument("--eval-device", default="cpu", help="diffuserve's device for evaluation")
    ap.add_argument("--eval-threads", type=int, default=max(1, (os.cpu_count() or 2) - 2),
                    help="CPU threads of the evaluation (leave some to the training process)")
    ap.add_argument("--profile", action="store_true", help="print where two steps' time goes first")
    ap.add_argument("--compile", nargs="?", const="inductor", metavar="BACKEND",
                    help="torch.compile the model (default backend inductor): fuses the elementwise work that "
                         "bounds eager training; three graphs (with and without self-conditioning, no-grad) "
                         "compile on the first steps")
    ap.add_argument("--compile-mode", help="torch.compile's mode with --compile, e.g. reduce-overhead (CUDA graphs) "
                                           "or max-autotune-no-cudagraphs")
    ap.add_argument("--hf-model", action="store_true",
                    help="train through transformers' own forward instead of lean_model.py's (the same logits)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    held_out = [sd.generate(random.Random(10**6 + i).randint(26, 45), random.Random(10**6 + i))[0]
                for i in range(args.eval_puzzles)]
    pool = tuple(t.to(args.device) for t in puzzle_pool(args.pool_seconds, args.seed, tuple(args.givens)))
    print(f"pool: {pool[0].shape[0]} unique puzzles", flush=True)
    gen = torch.Generator(args.device).manual_seed(args.seed)

    if args.init:
        model = DiffusionGemmaForBlockDiffusion.from_pretrained(args.init, dtype=torch.float32)
    else:
        model = DiffusionGemmaForBlockDiffusion(model_config(args.hidden, args.layers, args.experts,
                                                             args.moe_intermediate))
    model = model.to(args.device)
    params = sum(p.numel() for n, p in model.named_parameters() if "vision" not in n)
    print(f"text parameters: {params / 1e6:.2f} M ({2 * params / 2**20:.1f} MiB in bf16)", flush=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, fused=args.device != "cpu")
    autocast = torch.autocast(args.device.split(":")[0], dtype=torch.bfloat16, enabled=args.device != "cpu")

    if args.hf_model:
        logits_of = lambda **inputs: model(**inputs).logits
    else:
        from lean_model import LeanDiffusionGemma  # beside this script (tests load this file by path)
        logits_of = LeanDiffusionGemma(model, PROMPT)
    forward = torch.compile(logits_of, backend=args.compile, mode=args.compile_mode) if args.compile else logits_of

    def train_step(step, size):
        prompts, answers, free = batch(pool, size, gen)
        sc = None
        if step % 2 == 0:  # self-conditioning from another noising of the canvas, as at inference
            with torch.no_grad(), autocast:
                first = forward(input_ids=prompts, decoder_input_ids=noised(answers, free, gen))
            temperature = GENERATION["t_min"] + (GENERATION["t_max"] - GENERATION["t_min"]) * torch.rand(
                first.shape[0], 1, 1, device=first.device, generator=gen)
            sc = first / temperature
        with autocast:
            logits = forward(input_ids=prompts, decoder_input_ids=noised(answers, free, gen),
                             self_conditioning_logits=sc)  # fp32, as transformers returns them
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), answers.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        return loss

    os.makedirs(args.out, exist_ok=True)
    log = open(os.path.join(args.out, "training_log.jsonl"), "a")
    scratch = tempfile.mkdtemp()  # checkpoints waiting for (or under) evaluation; OUT keeps the best
    # One evaluation at a time, in a process of its own (spawned: no CUDA state is forked).
    evaluator = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    pending = None  # (checkpoint path, the record so far, the evaluation's future)
    best = -1.0

    def finish_evaluation():
        nonlocal pending, best
        path, record, future = pending
        pending = None
        solved, steps, solved_plain = future.result()
        record.update(solved=solved, mean_steps=steps, solved_plain=solved_plain)
        print(json.dumps(record), flush=True)
        log.write(json.dumps(record) + "\n")
        log.flush()
        if solved > best:
            best = solved
            shutil.copytree(path, os.path.join(args.out, "best"), dirs_exist_ok=True)
        shutil.rmtree(path)

    profile = torch.profiler.profile() if args.profile else None
    start = last_eval = time.time()
    step = 0
    while True:
        step += 1
        progress = (time.time() - start) / 60 / args.minutes
        lr = args.lr * min(1.0, step / args.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))
        for group in optimizer.param_groups:
            group["lr"] = lr
        if profile and step == 3:  # where a step's time goes (once the batch size is settled)
            profile.__enter__()
        try:
            loss = train_step(step, args.batch)
        except torch.OutOfMemoryError:
            if step > 2:
                raise
            args.batch //= 2  # the first step shows whether a batch fits
            print(f"out of memory: batch {args.batch} from now on", flush=True)
            optimizer.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            continue
        if profile and step == 4:
            torch.cuda.synchronize() if args.device.startswith("cuda") else None
            profile.__exit__(None, None, None)
            print(profile.key_averages().table(sort_by="self_device_time_total" if args.device != "cpu" else
                                               "self_cpu_time_total", row_limit=15), flush=True)
        done = progress >= 1.0
        minutes = round((time.time() - start) / 60, 2)
        if step % 100 == 0 or step <= 3:  # the first steps show compile time
            print(json.dumps({"step": step, "loss": round(loss.item(), 4), "lr": lr, "minutes": minutes}), flush=True)
        if pending and pending[2].done():
            finish_evaluation()
        if done or (not pending and time.time() - last_eval >= 60 * args.eval_minutes):
            if pending:  # the last checkpoint waits for the one under evaluation
                finish_evaluation()
            path = os.path.join(scratch, f"step{step}")
            save(model, path)
            record = {"step": step, "batch": args.batch, "loss": round(loss.item(), 4), "minutes": minutes}
            pending = (path, record, evaluator.submit(evaluate, path, held_out, args.eval_device, args.eval_threads))
            last_eval = time.time()
        if done:
            finish_evaluation()
            break
    evaluator.shutdown()

if __name__ == "__main__":
    sys.exit(main())
