"""diffuserve's CPU backend (fp32) against transformers (fp32, and float64 as the judge) on
random DiffusionGemma configurations wider than test_hf_parity.py's: head dims 64-256 (global
128-512), 1-8 heads, 1-3 layers, widths 40-600, up to 64 experts, canvases up to 200 rows and
prompts up to 400 tokens. Each configuration runs a prefill, a denoise step, a self-conditioned
step, a commit and the next block's two steps, comparing the logits and every layer's keys and
values. A difference past the parity tests' tolerance is classed:

- fp32-noise: diffuserve is no farther from the float64 reference than twice transformers'
  own fp32 forward is (plus the tolerance);
- near-tie-routing: the rows that differ have a router gap (k-th against (k+1)-th expert
  probability in transformers' fp32 forward) below 1e-4, where either rounding may choose;
- argmax-only: within the tolerance, but a row's argmax differs (a near-tied top two);
- SUSPECT: anything else, and EXCEPTION: a failure to run.

    python tests/fuzz_hf.py [--first-seed 0] [--seconds 600] [--router-std 1.0] [--seeds 3,17]

One line per configuration; the flagged ones' comparisons are printed after it. The fiftieth
session's run (1,586 configurations, router_std 1.0, 2 cores, 35 min) flagged 227: 213
fp32-noise, 9 near-tied routing (forcing transformers' router to the runner-up expert at the
row brought diffuserve back to the noise level: 4.70 -> 3.9e-4 at seed 285), 4 SUSPECT that
the same check showed to be one tied encoder row whose cached keys the later steps read, and
1 argmax-only. The parity tests' absolute tolerance is tight for these sizes' fp32 noise, and
router_std 0.08 (the tests' default) makes nearly every configuration near-tied. The
fifty-second session's (seeds 20000-20915, 25 min on a 2-core AVX2 EPYC) flagged 85 of 916:
79 fp32-noise, 3 near-tied routing, 1 SUSPECT that is again a tied prefill row (router gap
2.2e-8 at seed 20234) whose keys later steps read, and 2 SUSPECT of one self-conditioned row
each (seeds 20379 and 20842, 2e-3 from float64 where transformers' fp32 is 5e-4): at seed 20842
a relative 1e-7 change of the self-conditioning logits moves that row 1.4e-4 in diffuserve
and 1e-4 in the float64 reference, so the row magnifies rounding by ~1e3 whoever computes it,
and both were the same on the code before the session's changes. Rerun on the session's final
code (its vectorized softmax and norms), the same seeds' first 815 flagged 81 against 75: 3
SUSPECT (20182, 20234, 20724), each a tied prefill row (router gap 2.2e-8 to 3.5e-7) that
later steps read, and seed 20379's row within the tolerance. The sixty-third session's (seeds
63000-64089, 20 min, AVX-512) flagged 101 of 1,090: 91 fp32-noise, 5 near-tied routing, 2
both, 1 argmax-only and 2 SUSPECT, each a self-conditioned row (seeds 63661 and 64066: 1.2e-3
and 1.8e-3 from float64, where transformers' fp32 is 1.0e-4 and 4.3e-4) that a relative 1e-7
change of the self-conditioning logits moves by up to 5.6e-4 and 1.5e-3 in diffuserve: rows
that magnify rounding, as seed 20842's. The seventieth session's (seeds 70000-71286, 20 min,
transformers 5.25) flagged 121 of 1,287: 108 fp32-noise, 6 near-tied routing, 3 both, 1
argmax-only and 3 SUSPECT. One (70682) was a committed row whose cached keys differ, which the
classifier could not judge: a commit's router gaps are its own rows', and the cache rows were
not mapped to them (now they are: the row's encoder router gap is 7.8e-8, near-tied routing,
and the next block's rows that read it follow). The other two (70265, 70664) are
self-conditioned rows 5.2e-3 and 2.1e-3 from float64 where transformers' own fp32 is 1.8e-3
and 3.3e-4 off: the rounding-magnifying kind above by their signature, not checked row by row.
"""
import argparse
import itertools
import json
import shutil
import tempfile
import time
import traceback

import numpy as np
import torch
import transformers

import diffuserve as ds
from hf_reference import F, S, ReferenceSequence, build_model, load, save, text

transformers.utils.logging.disable_progress_bar()
ATOL = 1e-4  # the parity tests' fp32 tolerance, scaled below by the logits' magnitude


def divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def draw(seed):
    r = np.random.default_rng(seed)
    hd = int(r.choice([256, 128, 64]))
    ghd = 512 if hd == 256 else 2 * hd
    heads = int(r.integers(1, 9))
    n_layers = int(r.integers(1, 4))
    experts = int(r.integers(1, 65))
    cfg = text([S if r.random() < 0.5 else F for _ in range(n_layers)],
               head_dim=hd, global_head_dim=ghd, num_attention_heads=heads,
               num_key_value_heads=int(r.choice(divisors(heads))),
               num_global_key_value_heads=int(r.choice(divisors(heads))),
               hidden_size=int(r.integers(40, 601)), intermediate_size=int(r.integers(8, 401)),
               num_experts=experts, top_k_experts=int(r.integers(1, min(8, experts) + 1)),
               moe_intermediate_size=int(r.integers(4, 301)), vocab_size=int(r.integers(100, 2001)),
               sliding_window=int(r.integers(2, 201)))
    canvas = int(r.integers(1, 201))
    prompt = int(r.integers(1, 401))
    return cfg, canvas, prompt


class RouterTap:
    """Records, per HF router call, each row's gap between the k-th and (k+1)-th router probability."""

    def __init__(self, model):
        self.calls = []
        for name, mod in model.named_modules():
            if type(mod).__name__.endswith("TextRouter"):
                mod.register_forward_hook(self.hook(name))

    def hook(self, name):
        def f(mod, inp, out):
            probs = out[0].detach().float()
            k = mod.config.top_k_experts
            if probs.shape[-1] > k:
                top = torch.topk(probs, k + 1, dim=-1).values
                gap = (top[:, k - 1] - top[:, k]).numpy()
            else:
                gap = np.full(probs.shape[0], np.inf)
            self.calls.append((name, gap))
        return f

    def take(self):
        c, self.calls = self.calls, []
        return c


def classify(d32, e_ds, e_hf, scale, gaps_bad):
    """d32: |ds - hf32| per row; e_ds/e_hf: ds's / hf32's |. - hf64| per row (None for KV)."""
    if d32.max() <= ATOL * scale:
        return None
    if e_ds is not None and e_ds.max() <= 2 * e_hf.max() + ATOL * scale:
        return "fp32-noise"  # diffuserve no farther from fp64 than transformers' own fp32 is
    if gaps_bad is not None and gaps_bad < 1e-4:
        return "near-tie-routing"
    return "SUSPECT"


def compare_logits(ours, ref, ref64, where, log, taps):
    if ours.shape != ref.shape:
        return f"{where}: shape {ours.shape} vs {ref.shape} [SUSPECT]", np.inf, "SUSPECT"
    if not np.isfinite(ours).all():
        return f"{where}: non-finite logits [SUSPECT]", np.inf, "SUSPECT"
    scale = max(1.0, float(np.abs(ref).max()))
    d = np.abs(ours - ref)
    d_row = d.max(-1)
    e_ds, e_hf = np.abs(ours - ref64).max(-1), np.abs(ref - ref64).max(-1)
    rel = float(d.max()) / scale
    bad_arg = np.nonzero(ours.argmax(-1) != ref.argmax(-1))[0]
    rows = np.nonzero(d_row > ATOL * scale)[0]
    # the smallest router top-k gap (hf32, decoder) over the rows that differ
    gap_rows = min([float(g[rows].min()) for _, g in taps if len(g) == len(ref) and len(rows)], default=None)
    kind = classify(d_row, e_ds, e_hf, scale, gap_rows)
    if kind is None and len(bad_arg):
        kind = "argmax-only"
    log.append(f"  {where}: max|ds-hf32| {d.max():.3e} rel {rel:.3e}; max|ds-hf64| {e_ds.max():.3e}, "
               f"max|hf32-hf64| {e_hf.max():.3e}")
    if kind is None:
        return None, rel, None
    srt = np.sort(ref, -1)
    msg = (f"{where} [{kind}]: max|ds-hf32| {d.max():.3e} (rel {rel:.3e}, |ref|max {scale:.2f}), "
           f"max|ds-hf64| {e_ds.max():.3e} vs max|hf32-hf64| {e_hf.max():.3e}; "
           f"{len(rows)}/{len(ref)} rows over tol {[int(i) for i in rows[:20]]}, argmax differs at "
           f"{[int(i) for i in bad_arg[:20]]} (ref top1-top2 gaps {[float('%.1e' % (srt[i, -1] - srt[i, -2])) for i in bad_arg[:10]]})")
    for name, gap in taps:
        if len(gap) == len(ref):
            msg += f"\n    router {name}: min gap all rows {gap.min():.2e}; bad rows' gaps " \
                   f"{[float('%.1e' % gap[i]) for i in rows[:20]]}"
    return msg, rel, kind


def compare_kv(seq, ref, ref64, n_layers, where, log, taps):
    fails, worst = [], 0.0
    for layer in range(n_layers):
        k, v, first = seq.kv(layer)
        rk, rv = ref.kv(layer)
        k64, v64 = ref64.kv(layer)
        if k.shape != rk.shape or v.shape != rv.shape:
            fails.append((f"{where} layer {layer} [SUSPECT]: KV shape {k.shape}/{v.shape} vs {rk.shape}/{rv.shape} "
                          f"(first {first})", "SUSPECT"))
            continue
        for nm, a, b, c in (("keys", k, rk, k64), ("values", v, rv, v64)):
            scale = max(1.0, float(np.abs(b).max()))
            d = np.abs(a - b).max(axis=(0, 2))
            e_ds, e_hf = np.abs(a - c).max(axis=(0, 2)), np.abs(b - c).max(axis=(0, 2))
            worst = max(worst, float(d.max()) / scale)
            rows = np.nonzero(d > ATOL * scale)[0]
            # The pass wrote the cache's last rows (a commit: its own rows after the prompt's), so
            # cache row r is the pass's row r + off; rows before it came from an earlier pass.
            off = len(taps[0][1]) - a.shape[1] if taps else 0
            in_pass = rows[rows + off >= 0]
            gap = min([float(g[in_pass + off].min()) for _, g in taps
                       if len(in_pass) and len(g) == len(taps[0][1])], default=None)
            kind = classify(d, e_ds, e_hf, scale, gap)
            if kind:
                fails.append((f"{where} layer {layer} {nm} [{kind}]: max|ds-hf32| {d.max():.3e}, max|ds-hf64| "
                              f"{e_ds.max():.3e} vs max|hf32-hf64| {e_hf.max():.3e}; rows {len(rows)}/{a.shape[1]} "
                              f"{[int(i) for i in rows[:20]]} (first position {first}); min router gap there {gap}",
                              kind))
    log.append(f"  {where}: KV worst rel {worst:.3e}")
    return fails, worst


def run(seed, router_std, root):
    cfg, canvas, prompt_len = draw(seed)
    path = f"{root}/ckpt_{seed}"
    save(build_model(cfg, canvas, seed=seed, router_std=router_std), path)
    model = ds.Model.load(path)
    seq = model.sequence()
    hf = load(path, torch.float32, experts_implementation="eager")
    tap = RouterTap(hf)
    ref = ReferenceSequence(hf)
    ref64 = ReferenceSequence(load(path, torch.float64, experts_implementation="eager"))
    rng = np.random.default_rng(10_000 + seed)
    vocab, n_layers = cfg["vocab_size"], cfg["num_hidden_layers"]
    log, fails, worst = [], [], 0.0

    def enc(call, ids, where):
        for s in (seq, ref, ref64):
            getattr(s, call)(ids)
        f, w = compare_kv(seq, ref, ref64, n_layers, where, log, tap.take())
        fails.extend(f)
        return w

    prompt = rng.integers(0, vocab, prompt_len)
    worst = max(worst, enc("prefill", prompt, "after prefill"))
    for block in range(2):
        canvas_ids = rng.integers(0, vocab, canvas)
        sc = None
        for step in ("denoise", "self-conditioned"):
            a, b, c = seq.denoise(canvas_ids, sc), ref.denoise(canvas_ids, sc), ref64.denoise(canvas_ids, sc)
            m, r, kind = compare_logits(a, b, c, f"block {block} {step}", log, tap.take())
            worst = max(worst, r)
            if m:
                fails.append((m, kind))
            sc = b / 0.6
        if block == 0:
            worst = max(worst, enc("commit", canvas_ids, "after commit 0"))
    shutil.rmtree(path, ignore_errors=True)
    return cfg, canvas, prompt_len, fails, worst, log


def short(cfg, canvas, prompt_len):
    keys = ["layer_types", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "num_global_key_value_heads", "head_dim", "global_head_dim", "num_experts", "top_k_experts",
            "moe_intermediate_size", "vocab_size", "sliding_window"]
    d = {k: cfg[k] for k in keys}
    d["layer_types"] = "".join("S" if t == S else "F" for t in cfg["layer_types"])
    return json.dumps({**d, "canvas": canvas, "prompt": prompt_len})


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--seconds", type=float, default=600)
    ap.add_argument("--router-std", type=float, default=1.0, help="spread of the router weights (build_model)")
    ap.add_argument("--seeds", help="only these seeds, comma-separated")
    args = ap.parse_args()
    start, n, n_fail = time.time(), 0, 0
    seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else itertools.count(args.first_seed)
    root = tempfile.mkdtemp(prefix="fuzz_hf_")
    try:
        for seed in seeds:
            if time.time() - start > args.seconds:
                break
            t0 = time.time()
            try:
                cfg, canvas, prompt_len, fails, worst, log = run(seed, args.router_std, root)
            except Exception:  # noqa: BLE001 (reported, the fuzzing goes on)
                cfg, canvas, prompt_len = draw(seed)
                fails, worst, log = [("exception:\n" + traceback.format_exc(), "EXCEPTION")], float("nan"), []
            n += 1
            kinds = sorted({k for _, k in fails})
            status = ("FAIL[" + ",".join(kinds) + "]") if fails else "ok"
            print(f"seed {seed} {status} worst_rel {worst:.2e} {time.time() - t0:.1f}s {short(cfg, canvas, prompt_len)}",
                  flush=True)
            if fails:
                n_fail += 1
                print("\n".join(log + [m for m, _ in fails]) + "\n", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"done: {n} configurations, {n_fail} flagged, {time.time() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
