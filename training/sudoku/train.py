"""Trains the bundled Sudoku model: a small DiffusionGemma (the real architecture, with
transformers' classes as the training model) that solves a puzzle as one 81-token canvas.

    python training/sudoku/train.py --out OUT [--device cuda] [--minutes 20]

Recipe (issue 7): uniform-state diffusion. Each example's canvas is the solution with a
fraction t ~ U(0, 1) of its blank cells replaced by random digits; the givens stay clean,
as inference pins them. The loss is cross-entropy on the blank cells. On half the
batches the model is first run without gradients on a differently noised canvas and its
logits, divided by a temperature drawn from the inference schedule's range, are fed as
the self-conditioning input, as the sampler feeds them. Every --eval-every steps the
checkpoint is written (sharded, <= 15 MB a file) and evaluated through diffuserve itself,
the real sampler, on held-out puzzles with a unique solution: loss is not the metric.
"""
import argparse
import json
import os
import random
import sys
import time

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

import diffuserve as ds
from diffuserve import sudoku as sd

# Vocabulary: specials, then the digits, then '.' (another way to write a blank).
VOCAB = {"<pad>": 0, "<eos>": 1, "<bos>": 2, **{str(d): 3 + d for d in range(10)}, ".": 13}
DIGIT = [VOCAB[str(d)] for d in range(10)]  # DIGIT[v]: the token of value v (0: blank)
GENERATION = {"max_new_tokens": 81, "max_denoising_steps": 24, "t_min": 0.05, "t_max": 0.5,
              "stability_threshold": 1, "confidence_threshold": 0.01,
              "sampler_config": {"entropy_bound": 2.0, "_cls_name": "EntropyBoundSamplerConfig"},
              "eos_token_id": 1, "pad_token_id": 0, "bos_token_id": 2}
CHAT_TEMPLATE = "{{ bos_token }}{% for message in messages %}{{ message['content'] | trim }}{% endfor %}"


def model_config(hidden, layers, experts):
    types = ["full_attention" if (i + 1) % 3 == 0 or i == layers - 1 else "sliding_attention" for i in range(layers)]
    text = dict(vocab_size=len(VOCAB), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, global_head_dim=hidden // 4,
                num_global_key_value_heads=2, sliding_window=64, num_experts=experts, top_k_experts=2,
                moe_intermediate_size=hidden, layer_types=types, pad_token_id=0, eos_token_id=1, bos_token_id=2,
                max_position_embeddings=512)
    vision = dict(model_type="gemma4_vision", hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=2, head_dim=8)
    return DiffusionGemmaConfig(text_config=text, vision_config=vision, canvas_length=81)


def write_text_files(path):
    """tokenizer.json (one token a character, <bos> first), tokenizer_config.json with the
    chat template, generation_config.json."""
    tok = Tokenizer(models.WordLevel(VOCAB, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "chat_template": CHAT_TEMPLATE},
                  f, indent=2)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump(GENERATION, f, indent=2)


def batch(rng, size, device):
    """(prompt ids [B, 82], target canvas [B, 81], blank mask [B, 81])."""
    pairs = [sd.generate(rng.randint(26, 45), rng, unique=False) for _ in range(size)]
    puzzles = torch.tensor([[DIGIT[int(c)] for c in p] for p, _ in pairs])
    targets = torch.tensor([[DIGIT[int(c)] for c in s] for _, s in pairs])
    prompts = torch.cat([torch.full((size, 1), VOCAB["<bos>"]), puzzles], dim=1)
    return prompts.to(device), targets.to(device), (puzzles == DIGIT[0]).to(device)


def noised(targets, blanks, gen):
    """Each example: a fraction t ~ U(0, 1) of its blanks set to random digits 1-9."""
    t = torch.rand(targets.shape[0], 1, device=targets.device, generator=gen)
    flip = (torch.rand(targets.shape, device=targets.device, generator=gen) < t) & blanks
    noise = torch.tensor(DIGIT[1:], device=targets.device)[
        torch.randint(0, 9, targets.shape, device=targets.device, generator=gen)]
    return torch.where(flip, noise, targets)


def evaluate(path, puzzles, device):
    llm = ds.LLM(path, device=device)
    requests = [sd.request(llm, sd.parse(p), seed=i) for i, p in enumerate(puzzles)]
    outs = llm.generate([r[0] for r in requests], [r[1] for r in requests])
    digits = sd.digit_token_ids(llm.tokenizer)
    solved = sum(sd.is_solution(sd.grid_of(o.token_ids, digits), sd.parse(p)) for o, p in zip(outs, puzzles))
    return solved / len(puzzles), sum(sum(o.denoise_steps) for o in outs) / len(outs)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--steps", type=int, default=100000)
    ap.add_argument("--minutes", type=float, default=float("inf"), help="stop after this long")
    ap.add_argument("--eval-every", type=int, default=500)
    ap.add_argument("--eval-puzzles", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    rng, gen = random.Random(args.seed), torch.Generator(args.device).manual_seed(args.seed)
    held_out = [sd.generate(rng.randint(26, 45), random.Random(10**6 + i))[0] for i in range(args.eval_puzzles)]
    model = DiffusionGemmaForBlockDiffusion(model_config(args.hidden, args.layers, args.experts)).to(args.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 200))
    autocast = torch.autocast(args.device.split(":")[0], dtype=torch.bfloat16, enabled=args.device != "cpu")
    os.makedirs(args.out, exist_ok=True)
    log = open(os.path.join(args.out, "training_log.jsonl"), "a")
    start = time.time()
    for step in range(1, args.steps + 1):
        prompts, targets, blanks = batch(rng, args.batch, args.device)
        sc = None
        if step % 2 == 0:  # self-conditioning from another noising of the canvas, as at inference
            with torch.no_grad(), autocast:
                first = model(input_ids=prompts, decoder_input_ids=noised(targets, blanks, gen)).logits.float()
            temperature = GENERATION["t_min"] + (GENERATION["t_max"] - GENERATION["t_min"]) * torch.rand(
                first.shape[0], 1, 1, device=first.device, generator=gen)
            sc = first / temperature
        with autocast:
            logits = model(input_ids=prompts, decoder_input_ids=noised(targets, blanks, gen),
                           self_conditioning_logits=sc).logits.float()
        loss = torch.nn.functional.cross_entropy(logits[blanks], targets[blanks])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        done = step == args.steps or (time.time() - start) / 60 >= args.minutes
        if step % args.eval_every == 0 or done:
            model.save_pretrained(args.out, max_shard_size="15MB")
            write_text_files(args.out)
            solved, steps = evaluate(args.out, held_out, args.device)
            record = {"step": step, "loss": round(loss.item(), 4), "solved": solved, "mean_steps": steps,
                      "minutes": round((time.time() - start) / 60, 2)}
            print(json.dumps(record), flush=True)
            log.write(json.dumps(record) + "\n")
            log.flush()
        if done:
            break


if __name__ == "__main__":
    sys.exit(main())
