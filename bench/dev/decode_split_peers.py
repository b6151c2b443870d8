#!/usr/bin/env python3
"""Dev: forced split counts of the decode against the library's plan and SDPA's cuDNN backend, in the
same rounds (issue 13's near-tie points).

For each shape (batch x cache x GQA group; 32 query heads, head_dim 128, bf16, contiguous cache, every
entry full, no append) the variants are cuflash with the library's plan (splits 0), cuflash at each
forced count of --splits (num_splits=S: the library's own depth and merge rules for that count),
cuflash under each setting of --settings (NAME:VAR=VAL,...: environment variables set while its plan
is made, e.g. w8:CUFLASH_DECODE_WARPS=8 or deep:CUFLASH_DECODE_DEEP=1, or NAME@S:... at the forced count
S; VAR "stages" forces the 4-warp
kernel's depth as decode_splits.py --stages does; each setting's plans are put back on the fast path
before its rounds), and
cuDNN (sdpa_kernel(CUDNN_ATTENTION), q (b, h, 1, d) and the caches as (b, hkv, L, d) views,
enable_gqa=True where hkv < h). Each round times every variant once, in turn (round-robin): CUDA events
around --calls back-to-back calls queued behind a sleep kernel, divided by the calls (GPU time per
step). Prints per variant the median over --rounds, its ratio to cuDNN's, the plan (decode kernel,
grid, splits, merge) and the largest difference from the library plan's output; --json writes it.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_splits import decode_inputs, parse_shape  # noqa: E402


def one_round(torch, fn, calls: int, lead_cycles: int = 200_000) -> float:
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(int(calls * lead_cycles))
    e0.record()
    for _ in range(calls):
        fn()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) / calls


def plan_of(kvc, b, sq, h, d, L, hk, s):
    plan = next(p for p in kvc._FAST_PLANS.values()
                if p.out_shape == (b, sq, h, d) and p.call.capacity == L and p.call.nheads_kv == hk
                and not p.call.paged and p.num_splits == (s or p.num_splits))
    splits, _scratch, main, fused = plan.eager
    launches = fused if fused is not None else main
    dec = next(x for x in launches if x.name.startswith("decode_") and "combine" not in x.name
               and "append" not in x.name)
    merge = ("-" if plan.num_splits == 1 else "cluster" if dec.cluster > 1 else
             "fused" if fused is not None else "kernel")
    return dict(kernel=dec.name, grid=dec.grid, chosen=plan.num_splits, merge=merge)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["16x131072x4", "4x8192x1", "64x131072x8"])
    ap.add_argument("--splits", type=int, nargs="*", default=[2, 4, 8, 16],
                    help="forced counts beside the library's plan (counts past a shape's tiles are skipped)")
    ap.add_argument("--settings", nargs="*", default=[],
                    help="NAME:VAR=VAL[,VAR=VAL]: the library's plan made under these variables")
    ap.add_argument("--calls", type=int, default=0, help="calls a round (0: about 20 ms of the library plan)")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--json")
    args = ap.parse_args()

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import cuflash
    from cuflash import _kvcache

    dev = torch.device("cuda")
    out_rows = []
    print(torch.cuda.get_device_name(), flush=True)
    for shape in args.shapes:
        out_rows += run_shape(torch, F, SDPBackend, sdpa_kernel, cuflash, _kvcache, dev, shape, args)
        _kvcache._FAST_PLANS.clear()
        _kvcache._DECODE_PLANS.clear()
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), rows=out_rows), f, indent=1)
    return 0


def run_shape(torch, F, SDPBackend, sdpa_kernel, cuflash, _kvcache, dev, shape, args) -> list:
    """The rows of one shape (its arrays freed on return)."""
    rows = []
    b, L, g, sq = parse_shape(shape)
    h, d, hk, q, kc, vc, seqlens = decode_inputs(torch, dev, b, L, g, sq)
    q4, k4, v4 = q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)
    gqa = {"enable_gqa": True} if hk < h else {}
    variants = [("lib", 0, {})] + [(f"s{s}", s, {}) for s in args.splits if s * 64 <= L]
    for setting in args.settings:
        name, _, assigns = setting.partition(":")
        name, _, forced = name.partition("@")  # NAME@S: the setting at the forced count S
        variants.append((name, int(forced or 0), dict(a.split("=", 1) for a in assigns.split(",") if a)))
    fns, plans, outs, saved = {}, {}, {}, {}
    from cuflash import _config

    library_stages = _config.decode_stages
    for name, s, env in variants:
        # Each variant's plans made alone under its settings, then kept to be put back before its rounds.
        old = {k: os.environ.get(k) for k in env if k != "stages"}
        os.environ.update({k: v for k, v in env.items() if k != "stages"})
        if "stages" in env:
            st = int(env["stages"])
            _config.decode_stages = lambda target, head_dim, st=st: st
            for rule in ("CUFLASH_DECODE_DEEP", "CUFLASH_DECODE_SHALLOW"):
                old.setdefault(rule, os.environ.get(rule))
                os.environ[rule] = "0"
        _kvcache._FAST_PLANS.clear()
        _kvcache._DECODE_PLANS.clear()
        try:
            fns[name] = (lambda s=s: cuflash.attention_with_kvcache(q, kc, vc, cache_seqlens=seqlens, num_splits=s))
            outs[name] = fns[name]()
            plans[name] = plan_of(_kvcache, b, sq, h, d, L, hk, s)
            saved[name] = (dict(_kvcache._FAST_PLANS), dict(_kvcache._DECODE_PLANS))
        finally:
            _config.decode_stages = library_stages
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def put_back(name):
        if name in saved:
            for live, kept in zip((_kvcache._FAST_PLANS, _kvcache._DECODE_PLANS), saved[name]):
                live.clear()
                live.update(kept)

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q4, k4, v4, **gqa)

    fns["cudnn"] = cudnn
    ref = cudnn().transpose(1, 2)
    torch.cuda.synchronize()
    for n, fn in fns.items():  # warm-up
        put_back(n)
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    put_back("lib")
    calls = args.calls or max(5, min(200, int(20.0 / max(one_round(torch, fns["lib"], 3), 1e-3))))
    times = {n: [] for n in fns}
    for _ in range(args.rounds):
        for n, fn in fns.items():
            put_back(n)
            times[n].append(one_round(torch, fn, calls))
    kv_bytes = 2 * b * L * hk * d * 2
    ref_ms = statistics.median(times["cudnn"])
    print(f"== {shape} ({kv_bytes / 1e9:.2f} GB K+V, {calls} calls x {args.rounds} rounds); cuDNN "
          f"{ref_ms * 1e3:.1f} us", flush=True)
    for n, ts in times.items():
        ms = statistics.median(ts)
        row = dict(shape=shape, variant=n, ms=ms, ms_min=min(ts), rounds_ms=ts, x_cudnn=ms / ref_ms,
                   gbps=kv_bytes / ms / 1e6)
        if n != "cudnn":
            row.update(plans[n])
            row["max_diff_lib"] = float((outs[n].float() - outs["lib"].float()).abs().max())
            row["max_diff_cudnn"] = float((outs[n].float() - ref.float()).abs().max())
            desc = (f"{row['kernel']:28s} grid {row['grid']:5d} splits {row['chosen']:3d} {row['merge']:7s} "
                    f"diff {row['max_diff_cudnn']:.4f}")
        else:
            desc = ""
        print(f"  {n:6s} {ms * 1e3:9.1f} us (min {min(ts) * 1e3:9.1f})  x cuDNN {ms / ref_ms:.4f}  "
              f"{kv_bytes / ms / 1e6:6.0f} GB/s  {desc}", flush=True)
        rows.append(row)
    return rows


if __name__ == "__main__":
    sys.exit(main())
