"""How far FP8 and NVFP4 checkpoints move a model's output from the unquantized one.

    python benchmarks/quant_accuracy.py [--model DIR] [--device cpu|cuda] [--prompts 8]

Quantizes MODEL (default: a small random checkpoint) with `diffuserve quantize` to
fp8-dynamic (FP8 weights, FP8 activations per token) and nvfp4 (NVFP4A16) in a temporary
directory, runs every checkpoint through the same prefill and canvas (random token ids,
seeded), and compares each quantized model's denoise logits with the original's, position
by position: KL(original || quantized) of the softmax distributions, and whether the argmax
agrees. First step (no self-conditioning) and a self-conditioned second step. Prints one table.
"""
import argparse
import os
import tempfile

import numpy as np

import diffuserve as ds
from diffuserve.quantize import quantize
from diffuserve.random_checkpoint import write_random_checkpoint

SCHEMES = ["fp8-dynamic", "nvfp4"]


def log_softmax(x):
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def denoise_logits(path, device, prompts, canvases):
    """[prompt][step] logits (first step, then self-conditioned on the first step's)."""
    model = ds.Model.load(path, device=device)
    out = []
    for prompt, canvas in zip(prompts, canvases):
        seq = model.sequence()
        seq.prefill(prompt)
        first = seq.denoise(canvas)
        out.append([first, seq.denoise(canvas, self_conditioning_logits=first)])
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="an unquantized checkpoint (default: a small random one)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or write_random_checkpoint(os.path.join(tmp, "random"), canvas_length=32, seed=1)
        base = ds.Model.load(model)
        rng = np.random.default_rng(0)
        vocab, canvas_length = base.config["vocab_size"], base.canvas_length
        prompts = [rng.integers(3, vocab, args.prompt_tokens).tolist() for _ in range(args.prompts)]
        canvases = [rng.integers(3, vocab, canvas_length).tolist() for _ in range(args.prompts)]
        reference = denoise_logits(model, args.device, prompts, canvases)
        rows = []
        for scheme in SCHEMES:
            path = os.path.join(tmp, scheme)
            quantize(model, path, scheme)
            quantized = denoise_logits(path, args.device, prompts, canvases)
            for step, name in enumerate(["first step", "self-conditioned"]):
                ref = np.concatenate([r[step] for r in reference])
                got = np.concatenate([q[step] for q in quantized])
                p_log, q_log = log_softmax(ref.astype(np.float64)), log_softmax(got.astype(np.float64))
                kl = (np.exp(p_log) * (p_log - q_log)).sum(axis=-1)
                top1 = (ref.argmax(axis=-1) == got.argmax(axis=-1)).mean()
                rows.append((scheme, name, kl.mean(), np.percentile(kl, 99), kl.max(), top1))

    print(f"quantized vs original, {os.path.basename(os.path.normpath(model)) if args.model else 'random model'}, "
          f"device {args.device}: {args.prompts} prompts x {canvas_length} canvas positions")
    print("| scheme | step | mean KL | p99 KL | max KL | top-1 agreement |")
    print("|--------|------|--------:|-------:|-------:|----------------:|")
    for scheme, name, mean, p99, worst, top1 in rows:
        print(f"| {scheme} | {name} | {mean:.2e} | {p99:.2e} | {worst:.2e} | {100 * top1:.1f}% |")


if __name__ == "__main__":
    main()
