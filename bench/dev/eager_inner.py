#!/usr/bin/env python3
"""Single eager decode calls whose plan has two kernels (decode, then the combine kernel), with the
combine launched plainly (the library's eager call on an idle stream) or as a programmatic dependent
of the call's decode kernel ("inner": as a CUDA graph of the call launches it; the decode kernel
triggers its dependents once all its blocks run, and the combine waits with pdl_wait before it reads
the partials). Issue 13, session 56: at 1 x 2k x 8 the single call's GPU time read 1.11x cuDNN's.

Per shape (batch x cache x GQA group; 32 query heads, head_dim 128, bf16, contiguous), the modes and
SDPA's cuDNN backend run interleaved (a fresh random order every repetition):
  eager  one single call on an idle GPU (synchronize, event, call, event, synchronize), median (min)
  gpu1   one call queued behind a sleep kernel (its GPU time alone, without the host), median
and, per mode, the GPU time per call back to back (50 calls behind a sleep kernel, median of 7);
whether the modes' outputs are identical. cuDNN's call enters its SDPA backend context inside the
timed call, so its eager figure carries that context's cost: compare the modes with each other, and
gpu1 with cuDNN's gpu1 (bench/dev/eager_splits.py times cuDNN's eager calls without it).

Usage: python bench/dev/eager_inner.py [--shapes 1x2048x8 ...] [--reps 300]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from decode_splits import gpu_ms_per_call, shape_inputs  # noqa: E402

MODE = ["off"]


def _patch() -> None:
    """In "inner" mode, every eager decode call launches its kernels after the first as programmatic
    dependents (run_launches' pdl=True, pdl_first=False), where a launch has a PdlConfig."""
    from cuflash import _kvcache

    real = _kvcache.run_launches

    def run_launches(plan, stream, ptrs, launches, what=None, pdl=True, pdl_first=True):
        if MODE[0] == "inner":
            pdl, pdl_first = True, False
        return real(plan, stream, ptrs, launches, what, pdl, pdl_first)

    _kvcache.run_launches = run_launches


def one(torch, fn, sleep: bool):
    """us of one call: behind a sleep kernel (GPU time alone) or on an idle GPU (host included)."""
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if sleep:
        torch.cuda._sleep(200_000)
    e0.record()
    fn()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["1x2048x8", "1x8192x8", "1x32768x8", "1x131072x8"])
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--json")
    args = ap.parse_args()

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import cuflash
    from cuflash import _kvcache

    _patch()
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), flush=True)
    rows = []
    for shape in args.shapes:
        b, L, g, q, kc, vc, seqlens, (qt, kt, vt) = shape_inputs(torch, dev, shape)

        def lib():
            return cuflash.attention_with_kvcache(q, kc, vc, cache_seqlens=seqlens)

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=(g > 1))

        outs = {}
        for m in ("off", "inner"):
            MODE[0] = m
            for _ in range(5):
                outs[m] = lib()
            torch.cuda.synchronize()
            outs[m] = outs[m].clone()
        for _ in range(5):
            cudnn()
        plan = next(p for p in _kvcache._DECODE_PLANS.values() if p.eager is not None)
        splits, _, launches, fused = plan.eager
        desc = f"splits {splits}: " + "/".join(x.name for x in (fused or launches))
        variants = {"off": ("off", lib), "inner": ("inner", lib), "cudnn": ("off", cudnn)}
        res = {k: {"eager": [], "gpu1": []} for k in variants}
        order = [(k, s) for k in variants for s in (False, True)]
        rng = random.Random(1)
        for _ in range(args.reps):
            rng.shuffle(order)
            for k, s in order:
                MODE[0] = variants[k][0]
                res[k]["gpu1" if s else "eager"].append(one(torch, variants[k][1], s))
        row = dict(shape=shape, plan=desc, same=bool(torch.equal(outs["off"], outs["inner"])))
        for k in variants:
            MODE[0] = variants[k][0]
            bb = gpu_ms_per_call(torch, variants[k][1], 50, 7) * 1e3
            e, g1 = res[k]["eager"], res[k]["gpu1"]
            row[k] = dict(eager_med=statistics.median(e), eager_min=min(e), gpu1_med=statistics.median(g1),
                          gpu1_min=min(g1), b2b=bb)
        rows.append(row)
        _kvcache._DECODE_PLANS.clear()
        _kvcache._FAST_PLANS.clear()
        print(f"{shape:>11} {desc}  same {row['same']}", flush=True)
        for k in variants:
            r = row[k]
            print(f"    {k:6} eager {r['eager_med']:7.1f} (min {r['eager_min']:6.1f})  gpu1 {r['gpu1_med']:7.1f} "
                  f"(min {r['gpu1_min']:6.1f})  b2b {r['b2b']:7.1f} us", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
