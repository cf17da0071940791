"""diffuserve quickstart: write a small DiffusionGemma checkpoint, load it, and refine
one canvas block by block.

THE WEIGHTS ARE RANDOM: the tokens printed are noise. This shows the engine's passes
(prefill, denoise with self-conditioning, commit) and their speed on this machine, not
a model's quality. Point `diffuserve.Model.load` at a real checkpoint for real output.
"""
import tempfile
import time

import numpy as np

import diffuserve as ds
from diffuserve.random_checkpoint import write_random_checkpoint


def main():
    with tempfile.TemporaryDirectory() as tmp:
        path = write_random_checkpoint(f"{tmp}/random-diffusiongemma", canvas_length=32)
        model = ds.Model.load(path)
        print(f"{model} (random weights), {model.config['num_layers']} layers, vocab {model.vocab_size}")

        rng = np.random.default_rng(0)
        seq = model.sequence()
        t = time.perf_counter()
        seq.prefill(rng.integers(0, model.vocab_size, 48))
        print(f"prefill 48 tokens: {1e3 * (time.perf_counter() - t):.1f} ms")

        for block in range(3):
            canvas = rng.integers(0, model.vocab_size, model.canvas_length)  # start from noise
            logits = None
            t = time.perf_counter()
            for step in range(4):  # greedy refinement, each step conditioned on the last
                logits = seq.denoise(canvas, logits)
                canvas = logits.argmax(-1)
            seq.commit(canvas)
            print(f"block {block}: 4 denoise steps + commit in {1e3 * (time.perf_counter() - t):.1f} ms, "
                  f"tokens {canvas[:8].tolist()} ...")
        print(f"sequence length {len(seq)}")


if __name__ == "__main__":
    main()
