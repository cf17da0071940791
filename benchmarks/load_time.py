"""Checkpoint load time on a GPU at DiffusionGemma-26B-A4B's real text shapes, fewer layers.

    python benchmarks/load_time.py [--layers 4] [--dir PATH] [--hf]

Writes a bf16 checkpoint of random weights (the real shapes, `--layers` decoder layers,
sliding-attention ones but the last, which transformers makes full attention: its weights are
within 3% of a sliding layer's size), then
times, from the warm page cache the writing leaves: diffuserve's Model.load onto the GPU;
safetensors' load_file onto the GPU, the read every PyTorch engine starts from; and with
--hf, transformers' from_pretrained onto the GPU. Prints one table: seconds and GB/s of
checkpoint bytes for each. `--layers 30` writes the whole model's size (50.4 GB); the
embedding is a fixed 1.5 GB of it.
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

from diffuserve.random_checkpoint import write_random_checkpoint
from step_latency import CANVAS, FULL_ATTENTION, TEXT_CONFIG


def write(path, layers):
    shapes = {key: TEXT_CONFIG[key] for key in (
        "vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
        "sliding_window", "num_experts", "top_k_experts", "moe_intermediate_size", "max_position_embeddings")}
    return write_random_checkpoint(path, canvas_length=CANVAS, dtype="bfloat16", fill="repeat",
                                   num_hidden_layers=layers, layer_types=["sliding_attention"] * layers,
                                   global_head_dim=FULL_ATTENTION["head_dim"],
                                   num_global_key_value_heads=FULL_ATTENTION["num_key_value_heads"], **shapes)


def timed(setup, load):
    """Seconds `load` takes after `setup`, in a process of its own (each starts from a GPU with
    nothing on it)."""
    script = f"{setup}\nimport time\nstart = time.perf_counter()\n{load}\nprint(time.perf_counter() - start)"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{load!r} failed:\n{out.stderr[-2000:]}")
    return float(out.stdout.split()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dir", default=None, help="where to write the checkpoint (default: a temporary directory)")
    parser.add_argument("--hf", action="store_true", help="also time transformers' from_pretrained")
    args = parser.parse_args()
    path = tempfile.mkdtemp(dir=args.dir, prefix="load-time-")
    try:
        start = time.perf_counter()
        write(path, args.layers)
        written = time.perf_counter()
        os.sync()  # the file's pages written back to the disk: no writeback beside the loads
        gb = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)) / 1e9
        print(f"checkpoint: {args.layers} layers at the 26B-A4B shapes, bf16, {gb:.1f} GB, written in "
              f"{written - start:.0f} s (synced in {time.perf_counter() - written:.0f} s); loads from the warm page "
              "cache, each in a process of its own")
        # Each load's process first makes its CUDA context (not timed: a tiny model's load, or a
        # tensor), as a serving process has one by then.
        tiny = os.path.join(path, "tiny")
        write_random_checkpoint(tiny, dtype="bfloat16")
        torch_setup = "import torch, safetensors.torch as st, transformers\ntorch.zeros(1, device='cuda')"
        loads = [
            ("diffuserve Model.load",
             f"import diffuserve as ds\nds.Model.load({tiny!r}, device='cuda', kv_cache_memory_bytes=1 << 20)",
             f"ds.Model.load({path!r}, device='cuda', dtype='bfloat16', kv_cache_memory_bytes=1 << 30)"),
            ("safetensors load_file", torch_setup,
             f"st.load_file({os.path.join(path, 'model.safetensors')!r}, device='cuda')\ntorch.cuda.synchronize()"),
        ]
        if args.hf:
            loads.append(("transformers from_pretrained", torch_setup,
                          f"transformers.AutoModel.from_pretrained({path!r}, dtype=torch.bfloat16, device_map='cuda')\n"
                          "torch.cuda.synchronize()"))
        print("| loader | seconds | GB/s |")
        print("|:--|--:|--:|")
        for name, setup, load in loads:
            try:
                seconds = timed(setup, load)
                print(f"| {name} | {seconds:.2f} | {gb / seconds:.1f} |")
            except RuntimeError as e:
                print(f"| {name} | failed: {str(e).splitlines()[-1]} | |")
    finally:
        shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    main()
