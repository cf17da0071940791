"""Serving benchmark, like `vllm bench serve`: starts `diffuserve serve`, sends streaming
completions at several concurrencies, and prints output tokens/s and latency percentiles.

    python benchmarks/serve.py --device cuda            # DiffusionGemma-26B-A4B shapes, random weights
    python benchmarks/serve.py --model PATH             # any checkpoint with a tokenizer (CPU by default)

Every request has a fixed number of denoise steps per block (confidence made unreachable)
and a fixed length (ignore_eos), and a prompt of its own (random ids: none is in the prefix
cache), so runs compare. A request that fails ends the run with its error, and no table.
With no --model it writes the real 26B-A4B text config (benchmarks/step_latency.py) with a
word-level tokenizer over the whole vocabulary and serves it with load_format=dummy. Prints
one table.
"""
import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from step_latency import CANVAS, TEXT_CONFIG, write_config  # noqa: E402

from diffuserve._checks import INT32_MAX  # noqa: E402
from diffuserve.cli import KV_CACHE_GIB, MAX_BENCH_REQUESTS, in_range, int_list  # noqa: E402


def write_tokenizer(path, vocab_size):
    """tokenizer.json: a word-level tokenizer naming every id ("t123"), so any id decodes."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, **{f"t{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(os.path.join(path, "tokenizer.json"))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def one_request(client, url, model, prompt, max_tokens, steps):
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "seed": 0,
            "stream_options": {"include_usage": True}, "max_denoising_steps": steps,
            "confidence_threshold": 1e-30, "ignore_eos": True}
    start = time.perf_counter()
    first, tokens = None, 0
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            sys.exit(f"error: the server answered {r.status_code}: {(await r.aread()).decode()}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:  # (the stream's own error event, under its 200: no row of it)
                sys.exit(f"error: a request failed: {chunk['error'].get('message')}")
            if chunk.get("choices") and chunk["choices"][0].get("text") and first is None:
                first = time.perf_counter() - start  # the first committed block
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return first, time.perf_counter() - start, tokens


async def sweep_point(url, model, concurrency, prompts, max_tokens, steps):
    async with httpx.AsyncClient(timeout=None) as client:
        queue = list(prompts)
        results = []

        async def worker():
            while queue:
                results.append(await one_request(client, url, model, queue.pop(), max_tokens, steps))
        start = time.perf_counter()
        await asyncio.gather(*[worker() for _ in range(concurrency)])
        return results, time.perf_counter() - start


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a checkpoint with tokenizer.json (default: the 26B-A4B shapes, random)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--concurrency", type=int_list(MAX_BENCH_REQUESTS), default=[1, 4, 16],
                    help="comma-separated concurrencies (default: 1,4,16)")
    ap.add_argument("--requests-per-client", type=in_range(int, 1, MAX_BENCH_REQUESTS), default=2)
    ap.add_argument("--prompt-tokens", type=in_range(int, 1, INT32_MAX), default=1024)
    ap.add_argument("--max-tokens", type=in_range(int, 1, INT32_MAX), default=2 * CANVAS)
    ap.add_argument("--steps", type=in_range(int, 1, INT32_MAX), default=16, help="denoise steps per block")
    ap.add_argument("--kv-cache-gib", type=KV_CACHE_GIB, default=None)
    ap.add_argument("--activations", choices=["float32", "bfloat16"], default="float32",
                    help="the server's --activations (bfloat16: the linears' inputs rounded, faster)")
    args = ap.parse_args()
    # SIGTERM (timeout's, a CI's cancel) exits through the finally below, which stops the server
    # (it had been left running, holding its port).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    with tempfile.TemporaryDirectory() as tmp:
        extra = []
        path = args.model
        if path is None:
            path = write_config(os.path.join(tmp, "dg26b"))
            write_tokenizer(path, TEXT_CONFIG["vocab_size"])
            extra = ["--load-format", "dummy"]
        if args.kv_cache_gib is not None:
            extra += ["--kv-cache-gib", str(args.kv_cache_gib)]
        extra += ["--activations", args.activations]
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        server = subprocess.Popen([sys.executable, "-m", "diffuserve", "serve", path, "--port", str(port), "--device",
                                   args.device, "--served-model-name", "bench", "--log-level", "warning", *extra])
        try:
            deadline = time.time() + 600
            while True:
                try:
                    if httpx.get(url + "/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if server.poll() is not None or time.time() > deadline:
                    sys.exit("the server did not start")
                time.sleep(0.5)
            with open(os.path.join(path, "config.json")) as f:  # (a --model's vocabulary may be smaller)
                vocab = json.load(f)["text_config"]["vocab_size"]
            rng = np.random.default_rng(0)

            def prompts(n):  # ids (no tokenization cost), each request's own
                return rng.integers(3, min(1000, vocab), (n, args.prompt_tokens)).tolist()
            asyncio.run(sweep_point(url, "bench", 1, prompts(1), args.max_tokens, 2))  # warm-up
            rows = []
            for concurrency in args.concurrency:
                results, seconds = asyncio.run(sweep_point(url, "bench", concurrency,
                                                           prompts(concurrency * args.requests_per_client),
                                                           args.max_tokens, args.steps))
                latency = np.array([r[1] for r in results])
                first = np.array([r[0] for r in results if r[0] is not None])
                tokens = sum(r[2] for r in results)
                rows.append((concurrency, len(results), tokens / seconds, np.percentile(first, 50),
                             *np.percentile(latency, [50, 90, 99])))
        finally:
            server.terminate()
            server.wait(timeout=60)

    print(f"diffuserve serve ({'random weights, 26B-A4B shapes' if args.model is None else args.model}) on "
          f"{args.device}: prompt {args.prompt_tokens} tokens, {args.max_tokens} new tokens, {args.steps} steps/block")
    print("| concurrency | requests | output tok/s | first block p50 s | latency p50 s | p90 s | p99 s |")
    print("|------------:|---------:|-------------:|------------------:|--------------:|------:|------:|")
    for c, n, tps, ttfb, p50, p90, p99 in rows:
        print(f"| {c:>11} | {n:>8} | {tps:>12.1f} | {ttfb:>17.2f} | {p50:>13.2f} | {p90:>5.2f} | {p99:>5.2f} |")


if __name__ == "__main__":
    main()
