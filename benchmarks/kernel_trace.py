"""Where a denoise step's GPU time goes, without synchronising any op: the kernels and copies
of a few steps at DiffusionGemma-26B-A4B's text shapes (random bf16 weights, batch 1 and
context 1K unless told), recorded by torch's profiler (CUPTI sees every kernel of the process,
diffuserve's included). Needs a CUDA build and PyTorch.

    python benchmarks/kernel_trace.py [--batch 1] [--context 1024] [--steps 8] [--activations bfloat16]
                                      [--kv-cache-dtype float32]
                                      [--quantization fp8-dynamic] [--timeline moe_plan]
                                      [--timeline-shift -15]

Prints the GPU-busy share of the wall time, then one row per kernel name: time and launches
per forward pass, mean time per launch; then each kernel's share of the busy time (each
instant goes to the earliest-started kernel running); then the gaps between GPU work, by length;
with --timeline NAME, one period of the trace from the middle launch of the kernel whose name
holds NAME to the next (for a kernel launched once a layer, a layer, or, from the last layer's
launch, the step's end and the next step's start), or from the launch --timeline-shift launches
after it (before, where negative: the router's middle launch has been a step's last layer's,
and -15 then gives a layer halfway through that step): each kernel's start and end from the
period's start, and its stream.
(DIFFUSERVE_PROFILE=1 instead times each op with a synchronisation around it.)
Programmatic dependent launch is off here unless DIFFUSERVE_PDL is set: with it a kernel's
blocks start while the kernel before is still running and wait for it, so each kernel's time
would include that wait (its share of the busy time does not: with DIFFUSERVE_PDL=1 that
table says where a step's time goes).
"""
import argparse
import heapq
import os
import tempfile
import time

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

import diffuserve as ds
from step_latency import CANVAS, LINEAR_BYTES, fixed_steps, write_config  # beside this script


def busy_shares(kernels):
    """What each kernel costs: of (start, end, name) intervals, every instant of the GPU's busy
    time goes to the kernel running then that started first. With programmatic dependent
    launch (DIFFUSERVE_PDL=1) a kernel's own time includes its wait for the one before, which
    goes to that one; of two branches side by side, the one that started first is charged
    while both run. Returns {name: time}; the times add up to the busy time."""
    shares = {name: 0.0 for _, _, name in kernels}
    running = []  # (start, end, name) of the kernels started so far, earliest start on top
    upcoming = iter(sorted(kernels))
    following = next(upcoming, None)
    times = sorted({t for start, end, _ in kernels for t in (start, end)})
    for t0, t1 in zip(times, times[1:]):
        while following is not None and following[0] <= t0:
            heapq.heappush(running, following)
            following = next(upcoming, None)
        while running and running[0][1] <= t0:
            heapq.heappop(running)  # the earliest-started kernel has ended
        if running:
            shares[running[0][2]] += t1 - t0
    return shares


def period(kernels, anchor, shift=0):
    """One period of a trace: of (start, end, stream, name) kernels, those that start from the
    middle launch of the kernel whose name holds `anchor`, or the launch `shift` launches after
    it, up to the launch after that, as (start, end, stream, name) with times from that
    launch's start, in order of their starts. Empty where no such launch has one after it."""
    kernels = sorted(kernels)
    starts = [start for start, _, _, name in kernels if anchor in name]
    first = (len(starts) - 1) // 2 + shift
    if not 0 <= first < len(starts) - 1:
        return []
    t0, t1 = starts[first], starts[first + 1]
    return [(start - t0, end - t0, stream, name) for start, end, stream, name in kernels if t0 <= start < t1]


def short_name(name):
    """A kernel's name without diffuserve's namespaces and its parameters, at most 70 characters."""
    return name.replace("diffuserve::cuda::(anonymous namespace)::", "").split("(")[0][:70]


def print_by_kernel(times, passes, rows, label=""):
    """A table of the `rows` largest of {kernel name: [ms, launches]}: a pass's ms and launches,
    us a launch."""
    head = [f"{label}ms a pass", "launches a pass", f"{label}us a launch"]
    print("| " + " | ".join(head) + " | kernel |")
    print("|" + "|".join("-" * (len(h) + 1) + ":" for h in head) + "|:-------|")
    for name, (ms, n) in sorted(times.items(), key=lambda kv: -kv[1][0])[:rows]:
        cells = [f"{ms / passes:.3f}", f"{n / passes:.1f}", f"{1e3 * ms / n:.1f}"]
        print("| " + " | ".join(c.rjust(len(h)) for c, h in zip(cells, head)) + f" | {short_name(name)} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=1, help="requests denoised together")
    ap.add_argument("--steps", type=int, default=8, help="denoise steps traced (one block)")
    ap.add_argument("--rows", type=int, default=24, help="kernel names shown")
    ap.add_argument("--activations", choices=["float32", "bfloat16"], default="float32",
                    help="what the linears and attention take their inputs as (LoadOptions.activations)")
    ap.add_argument("--quantization", choices=list(LINEAR_BYTES), default="bf16",
                    help="the random linears' format, as step_latency.py's")
    ap.add_argument("--kv-cache-dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                    help="how the KV cache stores keys and values (LoadOptions.kv_cache_dtype)")
    ap.add_argument("--timeline", metavar="NAME",
                    help="also print one period of the trace from a launch of the kernel whose name holds NAME")
    ap.add_argument("--timeline-shift", type=int, default=0, metavar="N",
                    help="the period from the launch N launches after the middle one (before, where negative)")
    args = ap.parse_args()
    os.environ.setdefault("DIFFUSERVE_PDL", "0")  # read at the first launch, below
    with tempfile.TemporaryDirectory() as tmp:
        llm = ds.LLM(write_config(os.path.join(tmp, "dg26b")), device="cuda", load_format="dummy",
                     kv_cache_memory_bytes=20 << 30, max_num_batched_tokens=8192, slice_steps=64,
                     activations=args.activations, kv_cache_dtype=args.kv_cache_dtype,
                     quantization=None if args.quantization == "bf16" else args.quantization)
        prompts = [((np.arange(args.context) + 7 * r) % 1000 + 3).tolist() for r in range(args.batch)]
        llm.generate(prompts, fixed_steps(CANVAS, 2, seed=0))  # prefill (the prefix cache keeps it) and warm-up
        passes = llm.stats()["forward_passes"]
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as trace:
            start = time.perf_counter()
            llm.generate(prompts, fixed_steps(CANVAS, args.steps, seed=0))
            wall_ms = 1e3 * (time.perf_counter() - start)
        passes = llm.stats()["forward_passes"] - passes

    gpu = sorted((e for e in trace.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                 key=lambda e: e.time_range.start)
    by_name = {}
    for e in gpu:
        total = by_name.setdefault(e.name, [0.0, 0])
        total[0] += e.time_range.elapsed_us() / 1e3
        total[1] += 1
    busy_ms = sum(ms for ms, _ in by_name.values())
    print(f"diffuserve kernel trace, 26B-A4B shapes (random {args.quantization} weights, {args.activations} inputs), "
          f"batch {args.batch}, "
          f"context {args.context}, {passes} forward passes")
    print(f"wall {wall_ms / passes:.1f} ms a pass, GPU busy {busy_ms / passes:.1f} ms "
          f"({100 * busy_ms / wall_ms:.0f}%), {len(gpu) / passes:.0f} kernels and copies a pass")
    print_by_kernel(by_name, passes, args.rows)
    shares = busy_shares([(e.time_range.start, e.time_range.end, e.name) for e in gpu])
    shares = {name: [us / 1e3, by_name[name][1]] for name, us in shares.items()}
    print(f"each kernel's share of the busy time, {sum(ms for ms, _ in shares.values()) / passes:.1f} ms a pass "
          f"(programmatic dependent launch {'on' if os.environ['DIFFUSERVE_PDL'] != '0' else 'off'}):")
    print_by_kernel(shares, passes, args.rows, "share ")
    gaps = [max(b.time_range.start - a.time_range.end, 0) for a, b in zip(gpu, gpu[1:])]
    long_gaps = sorted(g for g in gaps if g > 20)
    longest = ", ".join(f"{g:.0f}" for g in long_gaps[-3:])
    print(f"idle between GPU work: {sum(gaps) / 1e3 / passes:.1f} ms a pass; "
          f"{len(long_gaps)} gaps over 20 us (host work), the longest {longest} us")
    # Short gaps are the GPU starting one queued kernel after another; long ones, the host
    # not keeping the queue ahead (or waiting for a result).
    bounds = [0, 2, 5, 20, float("inf")]
    print("| gap (us) | gaps a pass | idle ms a pass |")
    print("|:---------|------------:|---------------:|")
    for lo, hi in zip(bounds, bounds[1:]):
        inside = [g for g in gaps if lo <= g < hi]
        print(f"| {lo:g}-{hi:g} | {len(inside) / passes:11.1f} | {sum(inside) / 1e3 / passes:14.2f} |")
    if args.timeline:
        # The stream a kernel ran on: the profiler's resource id of a device event.
        kernels = [(e.time_range.start, e.time_range.end, e.device_resource_id, e.name) for e in gpu]
        shifted = f", shifted by {args.timeline_shift} launches" if args.timeline_shift else ""
        print(f"one period from the middle launch of a kernel named *{args.timeline}*{shifted} (us from its start):")
        print("| start us | end us | stream | kernel |")
        print("|---------:|-------:|-------:|:-------|")
        for start, end, stream, name in period(kernels, args.timeline, args.timeline_shift):
            print(f"| {start:8.1f} | {end:6.1f} | {stream!s:>6} | {short_name(name)} |")
    # The host's side: time in the CUDA runtime calls (launches, waits, graph recording and
    # instantiation), which the long gaps above are waiting for.
    host = {}
    for e in trace.events():
        if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith("cuda"):
            total = host.setdefault(e.name, [0.0, 0])
            total[0] += e.time_range.elapsed_us() / 1e3
            total[1] += 1
    print("| host ms a pass | calls a pass | CUDA runtime call |")
    print("|---------------:|-------------:|:------------------|")
    for name, (ms, n) in sorted(host.items(), key=lambda kv: -kv[1][0])[:8]:
        print(f"| {ms / passes:14.2f} | {n / passes:12.1f} | {name} |")


if __name__ == "__main__":
    main()
