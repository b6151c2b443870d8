#!/usr/bin/env python3
"""cuflash's options against FlexAttention, the tool users reach for masks (issue 12's target: each
option >= 1.0x Flex, forward and forward + backward, at seqlen 8k to 16k).

Providers: cuflash (its option: window, alibi_slopes, softcap, attention_varlen) and
torch.compile(flex_attention) with the equivalent block mask and score_mod (bench/flex_variants.py,
whose equivalence tests/test_bench_flex_cpu.py checks in float64). Variants, all causal: window (256,
0), window (4096, 0), ALiBi, softcap 30, and a packed (document-masked) batch of the same number of
tokens (documents of 64 to 4096 tokens, a fixed list). Shape (the issue's): batch 2, 16 heads,
head_dim 128, bf16; seqlen 8192 and 16384.

Timing as bench/bench.py: GPU time (its time_cuda: CUDA events around back-to-back calls, after
warm-up, the median of max(--reps, enough runs for --min-time seconds)), then single eager calls (its
time_eager: each starts on an idle GPU, host time included; the median of --eager-reps). The two
providers take turns --rounds (4) times, each turn with its share of the runs (time_pass). Passes: fwd (inputs require grad, as in
training) and fwdbwd (forward, then torch.autograd.grad of q, k, v). Flex's first call (its
torch.compile, and its block mask) and cuflash's first call (kernel compile or cache load) are timed on
their own and reported apart, never in the timings. The forward outputs of the two providers are
compared (max |difference|; bf16). FLOPs: 4 * heads * head_dim * visible (query, key) pairs (the
window's or the documents' exact count), x 3.5 for forward + backward.

    python bench/bench_flex.py [--quick] [--seqlens 8192 16384] [--variants ...] [--json PATH]
    python bench/bench_flex.py --dry-run      # the configurations and FLOPs, no GPU
bench/bench_features.py --sections flex runs the same measurement inside its report.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for p in (HERE, ROOT):
    if p not in sys.path:
        sys.path.insert(0, p)

import flex_variants as fv  # noqa: E402

NHEADS, HEAD_DIM, BATCH = 16, 128, 2  # the shape (run() takes others for the CPU smoke test)
PASSES = ("fwd", "fwdbwd")
PASS_FACTOR = {"fwd": 1.0, "fwdbwd": 3.5}
TARGET = 1.0


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--quick", action="store_true", help="seqlen 8192 only, 10 reps, 0.05 s per measurement")
    p.add_argument("--seqlens", type=int, nargs="+", help="default 8192 16384")
    p.add_argument("--variants", nargs="+", choices=fv.VARIANTS, help="default: all")
    p.add_argument("--reps", type=int, help="at least this many timed runs (default 20, quick 10)")
    p.add_argument("--min-time", type=float, help="seconds of timed work per measurement (default 0.2, quick 0.05)")
    p.add_argument("--max-reps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--eager-reps", type=int, default=10,
                   help="single eager calls timed after the GPU-time runs (host time included; default 10)")
    p.add_argument("--rounds", type=int, default=4,
                   help="the two providers take turns this many times per measurement (default 4; 1 = "
                        "each in one stretch, the order before session 27)")
    p.add_argument("--order", choices=("serpentine", "fixed"), default="serpentine",
                   help="the providers' order across rounds (bench/bench.py --order; default serpentine)")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args(argv)
    args.seqlens = args.seqlens or ([8192] if args.quick else [8192, 16384])
    args.variants = args.variants or list(fv.VARIANTS)
    args.reps = args.reps if args.reps is not None else (10 if args.quick else 20)
    args.min_time = args.min_time if args.min_time is not None else (0.05 if args.quick else 0.2)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    return args


def configs(args, batch=BATCH):
    """[(variant, seqlen, doc lengths or None, visible pairs)] in run order."""
    out = []
    for s in args.seqlens:
        for var in args.variants:
            lengths = fv.doc_lengths(batch * s, lo=min(64, s), hi=min(4096, s)) if var == "packed" else None
            out.append((var, s, lengths, fv.visible_pairs(var, batch, s, lengths)))
    return out


def run(torch, cuflash, args, log=print, device="cuda", shape=(BATCH, NHEADS, HEAD_DIM), compile_flex=True,
        timer=None, passes=PASSES, eager_timer=None):
    """Measures every configuration; returns the rows (one per variant, seqlen, provider, pass) and
    the cross-checks. device / shape (batch, heads, head_dim) / compile_flex / timer (default
    bench.py's time_cuda) and passes exist for tests/test_bench_flex_cpu.py's CPU run of this code
    (Flex has no backward on the CPU)."""
    from torch.nn.attention.flex_attention import flex_attention

    if timer is None:
        from bench import time_cuda as timer
    if eager_timer is None:
        from bench import time_eager as eager_timer
    batch, nheads, head_dim = shape
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    flex = torch.compile(flex_attention, dynamic=False) if compile_flex else flex_attention
    if compile_flex:
        # Each variant and shape is a recompile of the one compiled flex_attention; past Dynamo's
        # limit (8) it would fall back to the unfused eager path (which materializes the scores) and
        # be timed as Flex. Raise the limit, and make hitting it an error rather than a fallback.
        cfg = torch._dynamo.config
        for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                     "accumulated_cache_size_limit"):
            if hasattr(cfg, name):
                setattr(cfg, name, max(getattr(cfg, name), 256))
        if hasattr(cfg, "fail_on_recompile_limit_hit"):
            cfg.fail_on_recompile_limit_hit = True
    rows, checks = [], []
    dt = torch.bfloat16
    grad = "fwdbwd" in passes  # inputs require grad, as in training (the forward pass too)
    for var, s, lengths, pairs in configs(args, batch):
        pk = var == "packed"
        shp = (sum(lengths), nheads, head_dim) if pk else (batch, s, nheads, head_dim)
        torch.manual_seed(1234)
        base = [torch.randn(*shp, device=device, dtype=dt) for _ in range(4)]  # q, k, v, dout
        outs, ready = {}, {}
        for prov in ("cuflash", "flex"):
            row0 = {"variant": var, "seqlen": s, "batch": batch, "nheads": nheads, "head_dim": head_dim,
                    "provider": prov, "pairs": pairs}
            try:
                if prov == "cuflash":
                    q, k, v = (x.clone().requires_grad_(grad) for x in base[:3])
                    dout = base[3]
                    f = fv.cuflash_call(torch, cuflash, var, q, k, v, lengths)
                else:
                    q, k, v = (fv.to_flex(x, pk).contiguous().requires_grad_(grad) for x in base[:3])
                    dout = fv.to_flex(base[3], pk).contiguous()
                    t0 = time.perf_counter()
                    f = fv.flex_call(torch, flex, var, q, k, v, lengths)
                    sync()
                    row0["block_mask_s"] = time.perf_counter() - t0
                t0 = time.perf_counter()
                o = f()
                if "fwdbwd" in passes:
                    torch.autograd.grad(o, (q, k, v), dout)
                sync()
                row0["first_call_s"] = time.perf_counter() - t0
                with torch.no_grad():
                    outs[prov] = (f().detach() if prov == "cuflash" else fv.from_flex(f().detach(), pk)).float()
                ready[prov] = (f, q, k, v, dout, row0)
            except Exception as e:
                traceback.print_exc()
                rows += [dict(row0, **{"pass": ps}, error=f"{type(e).__name__}: {str(e)[:300]}") for ps in passes]
            finally:
                q = k = v = dout = f = o = None
        for ps in passes:
            rows += time_pass(torch, ps, ready, args, timer, eager_timer)
        ready.clear()
        if device == "cuda":
            torch.cuda.empty_cache()
        if len(outs) == 2:
            diff = (outs["cuflash"] - outs["flex"]).abs().max().item()
            checks.append({"variant": var, "seqlen": s, "max_abs_diff": diff,
                           "nan": bool(torch.isnan(outs["cuflash"]).any() or torch.isnan(outs["flex"]).any())})
        got = [r for r in rows if r["variant"] == var and r["seqlen"] == s]
        log(f"{var} s{s}: " + " | ".join(f"{r['provider']} {r['pass']} "
                                         + (f"{r['tflops']:.0f} TFLOP/s" if "tflops" in r else r.get("error", "?"))
                                         for r in got), flush=True)
    return rows, checks


def time_pass(torch, ps, ready, args, timer, eager_timer):
    """The rows of pass ps for the providers in `ready` (name -> (f, q, k, v, dout, row0)): the
    providers take turns --rounds times, each turn one call of `timer` with its share of the runs
    (--reps and --min-time divided by the rounds), then likewise the single eager calls. A row's ms
    is the median of its rounds' medians (ms_rounds), ms_min the fastest run, reps all its runs. The
    GPU's clock steps under its power cap (bench/bench.py --rounds), so each provider's turns sample
    the same stretch of time; the order alternates (bench.turn_order, --order), so neither provider
    always inherits the clock the other left."""
    import argparse as _argparse
    import math
    import statistics

    from bench import turn_order

    rounds = max(1, args.rounds)
    part = _argparse.Namespace(**dict(vars(args), reps=max(1, math.ceil(args.reps / rounds)),
                                      min_time=args.min_time / rounds))
    eager_n = [args.eager_reps // rounds + (1 if r < args.eager_reps % rounds else 0) for r in range(rounds)]
    got = {prov: {"gpu": [], "eager": []} for prov in ready}
    errors = {}
    for phase in ("gpu", "eager"):
        for rnd in range(rounds):
            for prov in turn_order(ready, rnd, args.order):
                f, q, k, v, dout, _row0 = ready[prov]
                if prov in errors or (phase == "eager" and not eager_n[rnd]):
                    continue
                fn = f if ps == "fwd" else (lambda f=f, q=q, k=k, v=v, dout=dout:
                                            torch.autograd.grad(f(), (q, k, v), dout))
                try:
                    if phase == "gpu":
                        got[prov]["gpu"].append(timer(torch, fn, part))
                    else:
                        got[prov]["eager"].append(eager_timer(torch, fn, eager_n[rnd]))
                except Exception as e:
                    traceback.print_exc()
                    errors[prov] = f"{type(e).__name__}: {str(e)[:300]}"
    rows = []
    for prov, (_f, _q, _k, _v, _dout, row0) in ready.items():
        row = dict(row0, **{"pass": ps}, flops=4.0 * row0["nheads"] * row0["head_dim"] * row0["pairs"]
                   * PASS_FACTOR[ps])
        if prov in errors:
            row["error"] = errors[prov]
            rows.append(row)
            continue
        g, e = got[prov]["gpu"], got[prov]["eager"]
        med = statistics.median(x[0] for x in g)
        row.update(ms=med, ms_min=min(x[1] for x in g), reps=sum(x[2] for x in g), rounds=len(g),
                   ms_rounds=[x[0] for x in g], tflops=row["flops"] / (med * 1e-3) / 1e12)
        if e:
            emed = statistics.median(x[0] for x in e)
            row.update(ms_eager=emed, ms_eager_min=min(x[1] for x in e), reps_eager=sum(x[2] for x in e),
                       tflops_eager=row["flops"] / (emed * 1e-3) / 1e12)
        rows.append(row)
    return rows


def ratios(rows, key="tflops"):
    """[(variant, seqlen, pass, cuflash / flex speed)] where both ran; key "tflops" (GPU time) or
    "tflops_eager" (single eager calls)."""
    out = []
    by = {(r["variant"], r["seqlen"], r["pass"], r["provider"]): r for r in rows if key in r}
    for (var, s, ps, prov), r in sorted(by.items()):
        if prov == "cuflash" and (var, s, ps, "flex") in by:
            out.append((var, s, ps, r[key] / by[(var, s, ps, "flex")][key]))
    return out


def report(rows, checks) -> str:
    lines = ["| variant | seqlen | pass | cuflash TFLOP/s | Flex TFLOP/s | cuflash / Flex | eager cuflash / Flex |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    by = {(r["variant"], r["seqlen"], r["pass"], r["provider"]): r for r in rows}
    eager = {(v, s, p): x for v, s, p, x in ratios(rows, "tflops_eager")}
    for var, s, ps, x in ratios(rows):
        e = eager.get((var, s, ps))
        lines.append(f"| {var} | {s} | {ps} | {by[(var, s, ps, 'cuflash')]['tflops']:.0f} | "
                     f"{by[(var, s, ps, 'flex')]['tflops']:.0f} | {x:.2f} | {'-' if e is None else f'{e:.2f}'} |")
    rs = [x for *_, x in ratios(rows)]
    if rs:
        bad = [f"{v} s{s} {p} {x:.2f}" for v, s, p, x in ratios(rows) if x < TARGET]
        lines.append(f"target cuflash / Flex >= {TARGET}: {'met' if not bad else 'NOT met at ' + ', '.join(bad)} "
                     f"(min {min(rs):.2f}, {len(rs)} points)")
    for c in checks:
        lines.append(f"check {c['variant']} s{c['seqlen']}: max |cuflash - Flex| forward {c['max_abs_diff']:.2e}"
                     + (" NaN" if c["nan"] else ""))
    errs = [r for r in rows if "error" in r]
    if errs:
        lines.append(f"{len(errs)} measurement(s) failed: " + "; ".join(
            f"{r['provider']} {r['variant']} s{r['seqlen']} {r['pass']}: {r['error']}" for r in errs[:4]))
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        for var, s, lengths, pairs in configs(args):
            print(f"{var} s{s} b{BATCH} h{NHEADS} d{HEAD_DIM}: {pairs:.4g} visible pairs, forward "
                  f"{4.0 * NHEADS * HEAD_DIM * pairs / 1e12:.3f} TFLOP"
                  + (f", {len(lengths)} documents of {min(lengths)}..{max(lengths)} tokens" if lengths else ""))
        return 0
    import torch

    if not torch.cuda.is_available():
        print("bench_flex.py: no CUDA device visible to torch", file=sys.stderr)
        return 2
    import cuflash

    t0 = time.perf_counter()
    rows, checks = run(torch, cuflash, args)
    text = report(rows, checks)
    print(text)
    if args.json:
        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "argv": sys.argv[1:],
                "wall_s": time.perf_counter() - t0}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": rows, "checks": checks}, f, indent=1)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
