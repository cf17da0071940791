"""Denoise-step latency on a GPU at DiffusionGemma-26B-A4B's real text shapes (random weights).

    python benchmarks/step_latency.py [--quick] [--hf] [--quantization fp8|fp8-dynamic|nvfp4]
                                      [--activations bfloat16] [--kv-cache-dtype float32]

Rows: ms per denoise step (one batched forward pass plus the sampler, through the
engine) and per commit, at batch 1/4/16 and context 1K/8K/32K; output tokens/s at 16
denoise steps per block; % of the weight-bandwidth roofline (weight bytes read per step
over the measured device copy bandwidth); and a floor that counts the tensor cores' work as
well as the bytes (floor_ms), with the step's % of it. --quantization packs the linears' random weights
as an FP8 or NVFP4 checkpoint would (the embedding and the router stay bf16). With --hf, transformers' forward at
every row's shape for the side-by-side ratio (run in a separate process: both models do not
fit at once). Prints one table.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

import diffuserve as ds
from diffuserve._checks import INT32_MAX
from diffuserve.cli import KV_CACHE_GIB, in_range

TEXT_CONFIG = dict(
    vocab_size=262144, hidden_size=2816, intermediate_size=2112, num_hidden_layers=30, num_attention_heads=16,
    num_key_value_heads=8, head_dim=256, num_experts=128, top_k_experts=8, moe_intermediate_size=704,
    sliding_window=1024, rms_norm_eps=1e-6, final_logit_softcapping=30.0, max_position_embeddings=262144,
    eos_token_id=1, bos_token_id=2, pad_token_id=0, hidden_activation="gelu_pytorch_tanh",
    layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(30)],
    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                     "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                        "rope_theta": 1000000.0}},
    model_type="diffusion_gemma_text", tie_word_embeddings=True)
# The full-attention layers' own attention shape (the checkpoint's per_layer_config).
FULL_ATTENTION = {"head_dim": 512, "num_key_value_heads": 2}
CANVAS, STEPS = 256, 16


def write_config(path):
    text = dict(TEXT_CONFIG)
    text["per_layer_config"] = {str(i): dict(FULL_ATTENTION)
                                for i, t in enumerate(text["layer_types"]) if t == "full_attention"}
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"model_type": "diffusion_gemma", "canvas_length": CANVAS, "tie_word_embeddings": True,
                   "text_config": text,
                   "vision_config": {"model_type": "gemma4_vision", "hidden_size": 16, "intermediate_size": 16,
                                     "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2,
                                     "head_dim": 8}}, f)
    return path


# Bytes per weight of the linears: bf16; FP8 (its fp32 scale per row is negligible); NVFP4
# (half a byte, and an E4M3 scale per 16).
LINEAR_BYTES = {"bf16": 2, "fp8": 1, "fp8-dynamic": 1, "nvfp4": 0.5 + 1 / 16}


def attention_shapes(layer_type):
    """A layer's (q/k/v parameters, o parameters, head dim, KV heads): full layers have their own
    head dim and KV heads (FULL_ATTENTION) and no v_proj (values come from the keys' projection)."""
    c = TEXT_CONFIG
    h, heads, full = c["hidden_size"], c["num_attention_heads"], layer_type == "full_attention"
    shape = FULL_ATTENTION if full else c
    d, kv = shape["head_dim"], shape["num_key_value_heads"]
    return h * heads * d + h * kv * d * (1 if full else 2), heads * d * h, d, kv


def weight_bytes(quantization="bf16"):
    """Bytes of the text weights a denoise step reads (every expert: 2048 pairs over 128)."""
    c = TEXT_CONFIG
    h = c["hidden_size"]
    linears = 3 * h * c["intermediate_size"]  # self-conditioning MLP
    plain = c["vocab_size"] * h  # embedding (= lm_head)
    for t in c["layer_types"]:
        qkv, o, _, _ = attention_shapes(t)
        linears += qkv + o + 3 * h * c["intermediate_size"] + 3 * c["num_experts"] * h * c["moe_intermediate_size"]
        plain += c["num_experts"] * h  # the router
    return 2 * plain + LINEAR_BYTES[quantization] * linears


def floor_parts(quantization, batch, context, kv_element_bytes, bandwidth, rates):
    """A lower bound on a denoise step's time that counts arithmetic as well as bytes, as ms
    per part of the model. At 256 canvas rows a product does 512 FLOPs a weight (256 a byte in
    bf16, 512 in FP8), above the H200's ratio of matmul rate to bandwidth, so the dense
    products, the lm_head and the soft embedding are bound by the tensor cores, not by the
    weight stream the roofline counts. Each group of products that can run at once costs the
    larger of its bytes over the copy bandwidth and its FLOPs over the measured matmul rate
    (`rates`: FLOP/s for "bf16" and "fp8" operands); the groups run one after another, each
    needing the one before. The experts' bytes are those of the experts a canvas reaches,
    routing taken as uniform."""
    c = TEXT_CONFIG
    h, inter, vocab = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    experts, top_k, moe = c["num_experts"], c["top_k_experts"], c["moe_intermediate_size"]
    heads = c["num_attention_heads"]
    rows, weight = batch * CANVAS, LINEAR_BYTES[quantization]
    # FP8_DYNAMIC quantizes the linears' inputs too, so their products run on E4M3 tensor cores.
    linear_rate = rates["fp8"] if quantization == "fp8-dynamic" else rates["bf16"]

    def group(*work):  # ms of (bytes, FLOPs, FLOP/s) products that may share the machine
        return 1e3 * max(sum(b for b, _, _ in work) / bandwidth, sum(f / r for _, f, r in work))

    def linear(params, bytes_per=weight, rate=linear_rate):
        return params * bytes_per, 2 * rows * params, rate

    reached = experts * (1 - (1 - top_k / experts) ** rows)
    parts = {
        # The lm_head and the soft embedding (the previous step's distribution times the
        # embedding: the same shape, on a transposed copy).
        "lm_head and soft embedding": 2 * group(linear(vocab * h, 2, rates["bf16"])),
        "attention projections": 0.0,
        "attention": 0.0,
        "MoE and MLPs": group(linear(3 * h * inter)),  # from the self-conditioning MLP
    }
    for t in c["layer_types"]:
        qkv, o, d, kv = attention_shapes(t)
        cached = context if t == "full_attention" else min(context, c["sliding_window"] - 1)
        keys = batch * cached * kv * d * 2 * kv_element_bytes  # K and V from the cache
        parts["attention projections"] += group(linear(qkv)) + group(linear(o))
        parts["attention"] += group((keys, 4 * rows * heads * d * (cached + CANVAS), rates["bf16"]))  # QK^T, PV
        parts["MoE and MLPs"] += group(linear(3 * h * inter),  # the dense MLP beside the router and the experts
                                       linear(experts * h, 2, rates["bf16"]),
                                       (reached * 3 * h * moe * weight, 2 * rows * top_k * 3 * h * moe, linear_rate))
    return parts


def floor_ms(*args):
    """floor_parts' sum: the whole step's floor."""
    return sum(floor_parts(*args).values())


def copy_bandwidth():
    import torch
    x = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    torch.cuda.synchronize()
    bandwidth = 2 * x.numel() * 10 / (time.perf_counter() - t)  # read + write
    del x, y
    torch.cuda.empty_cache()
    return bandwidth


def matmul_rate(operands):
    """FLOP/s of a large square product on the tensor cores: torch's bf16 matmul, or ("fp8")
    its E4M3 scaled product."""
    import torch
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    if operands == "fp8":
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()  # B column-major, as cuBLASLt takes it
        one = torch.ones((), device="cuda")
        product = lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16)  # noqa: E731
    else:
        product = lambda: a @ b  # noqa: E731
    for _ in range(3):
        product()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(20):
        product()
    torch.cuda.synchronize()
    rate = 2 * n**3 * 20 / (time.perf_counter() - t)
    torch.cuda.empty_cache()
    return rate


def fixed_steps(new_tokens, steps, seed):
    """Sampling that runs exactly `steps` denoise steps per block: no token is ever confident
    enough to stop a block early, and none ends the request."""
    return ds.SamplingParams(max_new_tokens=new_tokens, max_denoising_steps=steps, confidence_threshold=1e-30,
                             eos_token_id=[], seed=seed)


def measure(llm, batch, context):
    """(ms per denoise pass, output tok/s) for `batch` requests over a `context`-token prompt."""
    prompt = (np.arange(context) % 1000 + 3).tolist()  # shared: the prefix cache fills it once
    warm = fixed_steps(CANVAS, 2, seed=0)
    t = time.perf_counter()
    llm.generate([prompt], warm)  # prefill once: the prompt's blocks stay in the prefix cache
    prefill_s, t = time.perf_counter() - t, time.perf_counter()
    llm.generate([prompt] * batch, warm)  # warm-up at this batch size
    print(f"  batch {batch} context {context}: prefill and 2 steps {prefill_s:.1f} s, warm-up at this batch "
          f"{time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)  # where a slow row spends its time
    params = fixed_steps(2 * CANVAS, STEPS, seed=1)
    passes = llm.stats()["forward_passes"]
    t = time.perf_counter()
    outs = llm.generate([prompt] * batch, params)
    seconds = time.perf_counter() - t
    passes = llm.stats()["forward_passes"] - passes
    assert all(o.denoise_steps == [STEPS, STEPS] for o in outs)
    return 1e3 * seconds / passes, batch * 2 * CANVAS / seconds


def commit_ms(model, context):
    """A commit pass through the Sequence API, which launches its kernels from the host (as the
    engine's block's first step with the commit fused into it is) and returns once it is done."""
    seq = model.sequence()
    seq.prefill((np.arange(context) % 1000 + 3).tolist())
    canvas = np.arange(CANVAS) + 5
    seq.commit(canvas)  # warm-up
    times = []
    for _ in range(3):
        t = time.perf_counter()
        seq.commit(canvas)
        times.append(1e3 * (time.perf_counter() - t))
    return float(np.median(times))


def hf_forward_ms(path, grid, timeout_s, device="cuda"):
    """transformers' decoder forward (sdpa, bf16) over one canvas a sequence at each (batch, context)
    of `grid`, on `device`, in a child process: {(batch, context): ms, or why there is none}. The
    context is a cache of random keys and values in the encoder's own shapes (hf_random.context_cache:
    the decoder reads it as the encoder would leave it). A row that runs out of memory says so and the next runs;
    rows the child has not reached after `timeout_s` seconds say that."""
    code = f"""
import inspect, json, sys, time, torch
sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
from hf_random import context_cache, random_model
from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion
cfg = DiffusionGemmaConfig.from_pretrained({path!r})
torch.set_default_dtype(torch.bfloat16)
m = random_model(cfg, {device!r})  # one copy of the layers' weights, the encoder's tied to the decoder's
cuda = {device!r} == "cuda"
sync, empty_cache = (torch.cuda.synchronize, torch.cuda.empty_cache) if cuda else (lambda: None, lambda: None)
# past_key_values up to transformers 5.23, cache from 5.24
parameters = inspect.signature(DiffusionGemmaForBlockDiffusion.forward).parameters
name = "cache" if "cache" in parameters else "past_key_values"
for batch, context in {grid!r}:
    row = {{"batch": batch, "context": context}}
    try:
        with torch.no_grad():
            cache = context_cache(m, batch, context)
            canvas = torch.arange(cfg.canvas_length, device={device!r})[None].repeat(batch, 1) + 5
            for _ in range(2): m(decoder_input_ids=canvas, **{{name: cache}})
            sync(); t = time.perf_counter()
            for _ in range(5): m(decoder_input_ids=canvas, **{{name: cache}})
            sync()
        row["ms"] = 1e3 * (time.perf_counter() - t) / 5
    except torch.cuda.OutOfMemoryError:
        row["error"] = "out of memory"
    cache = canvas = None
    empty_cache()
    print(json.dumps(row), flush=True)
"""
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s)
        stdout, stderr, failed = out.stdout, out.stderr, out.returncode != 0
        missing = "failed: " + (stderr.strip().splitlines()[-1] if stderr.strip() else f"exit {out.returncode}")
    except subprocess.TimeoutExpired as e:  # (its output so far: the rows done)
        stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ""
        failed, missing = True, f"not reached in {timeout_s:.0f} s"
    results = {}
    for line in stdout.splitlines():
        if line.startswith('{"batch"'):
            row = json.loads(line)
            results[row["batch"], row["context"]] = row.get("ms", row.get("error"))
    return {row: results.get(row, missing if failed else "no result") for row in grid}


def grid_rows(text):
    """An argparse type: comma-separated BATCHxCONTEXT rows, each a batch and a context of at
    least one (a bad row had been a traceback after the model's load)."""
    rows = []
    for row in text.split(","):
        batch, _, context = row.partition("x")
        rows.append((in_range(int, 1, 4096)(batch), in_range(int, 1, INT32_MAX)(context)))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="batch 1, context 1K only")
    ap.add_argument("--grid", type=grid_rows,
                    default="1x1024,4x1024,16x1024,1x8192,4x8192,16x8192,1x32768,4x32768,16x32768",
                    help="comma-separated BATCHxCONTEXT rows")
    ap.add_argument("--hf", action="store_true",
                    help="also time transformers' forward at every row (in a child process, after diffuserve's "
                         "model is freed)")
    ap.add_argument("--hf-timeout", type=float, default=600,
                    help="seconds --hf's child process may take for all its rows (rows not reached say so)")
    ap.add_argument("--kv-gb", type=KV_CACHE_GIB, default=40.0,
                    help="KV cache size (GiB; on an 80 GB H100, 8 ran batch 1 and 4 at 1K and batch 1 at 8K "
                         "beside the 26B weights, where 40 does not fit)")
    ap.add_argument("--quantization", choices=list(LINEAR_BYTES), default="bf16",
                    help="the linears' random weights: bf16, or packed FP8 / NVFP4")
    ap.add_argument("--activations", choices=["float32", "bfloat16"], default="float32",
                    help="the linears' inputs as fp32 (two bf16 products) or rounded to bf16 (one)")
    ap.add_argument("--kv-cache-dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                    help="how the KV cache stores keys and values (LoadOptions.kv_cache_dtype)")
    args = ap.parse_args()

    bandwidth = copy_bandwidth()
    rates = {operands: matmul_rate(operands) for operands in ("bf16", "fp8")}
    roofline_ms = 1e3 * weight_bytes(args.quantization) / bandwidth
    grid = [(1, 1024)] if args.quick else args.grid
    with tempfile.TemporaryDirectory() as tmp:
        path = write_config(os.path.join(tmp, "dg26b"))
        t = time.perf_counter()
        # (kv_cache_dtype only where given: ab_steps.sh's base revision may predate it)
        kv = {} if args.kv_cache_dtype == "auto" else {"kv_cache_dtype": args.kv_cache_dtype}
        llm = ds.LLM(path, device="cuda", load_format="dummy", kv_cache_memory_bytes=int(args.kv_gb * 2**30),
                     max_num_batched_tokens=8192, slice_steps=64,
                     quantization=None if args.quantization == "bf16" else args.quantization,
                     activations=args.activations, **kv)
        load_s = time.perf_counter() - t
        llm_kv_dtype = getattr(llm.model, "kv_cache_dtype", "float32")
        rows = []
        kv_element_bytes = 2 if llm_kv_dtype == "bfloat16" else 4
        for batch, context in grid:
            step, tps = measure(llm, batch, context)
            floor = floor_ms(args.quantization, batch, context, kv_element_bytes, bandwidth, rates)
            rows.append((batch, context, step, floor, commit_ms(llm.model, context) if batch == 1 else None, tps))
            commit = "-" if rows[-1][4] is None else f"{rows[-1][4]:.1f} ms"
            print(f"  measured batch {batch} context {context}: {step:.2f} ms/step, commit {commit}, "
                  f"{tps:.0f} tok/s", file=sys.stderr, flush=True)  # seen even if a later row runs out of time
        del llm
        hf = hf_forward_ms(path, grid, args.hf_timeout) if args.hf else {}

    print(f"diffuserve denoise step, DiffusionGemma-26B-A4B text shapes (random {args.quantization} weights, "
          f"{args.activations} linear inputs, {llm_kv_dtype} KV cache), canvas {CANVAS}, {STEPS} steps/block")
    print(f"weights read per step {weight_bytes(args.quantization) / 1e9:.1f} GB; "
          f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; roofline {roofline_ms:.1f} ms/step; load {load_s:.0f} s")
    print(f"floor: each group of products at the slower of its bytes / copy bandwidth and its FLOPs / the measured "
          f"matmul rate (bf16 {rates['bf16'] / 1e12:.0f}, E4M3 {rates['fp8'] / 1e12:.0f} TFLOP/s), KV reads included")
    batch, context = grid[0]
    parts = floor_parts(args.quantization, batch, context, kv_element_bytes, bandwidth, rates)
    print(f"floor at batch {batch}, context {context}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in parts.items()))
    hf_columns = (" HF ms/forward | vs HF |", "--------------:|------:|") if hf else ("", "")
    print("| batch | context | ms/step | % roofline | floor ms | % floor | ms/commit | output tok/s |" + hf_columns[0])
    print("|------:|--------:|--------:|-----------:|---------:|--------:|----------:|-------------:|" + hf_columns[1])
    for batch, context, step, floor, commit, tps in rows:
        commit_s = f"{commit:.1f}" if commit is not None else "-"
        line = (f"| {batch:>5} | {context:>7} | {step:>7.2f} | {100 * roofline_ms / step:>9.0f}% | {floor:>8.1f} | "
                f"{100 * floor / step:>6.0f}% | {commit_s:>9} | {tps:>12.0f} |")
        if hf:
            theirs = hf[batch, context]
            line += (f" {theirs:>13.1f} | {theirs / step:>4.1f}x |" if isinstance(theirs, float)
                     else f" {theirs:>13} |     - |")
        print(line)
    if hf:
        print("HF: transformers' decoder forward (sdpa, bf16, the same random model) over the same canvases and "
              "contexts; vs HF: its time over diffuserve's step")


if __name__ == "__main__":
    main()
