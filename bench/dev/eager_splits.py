#!/usr/bin/env python3
"""Single eager decode calls at forced split counts, beside the library's plan and the peers (issue 13:
the plans whose eager call runs the decode kernel and a combine kernel lose single eager calls to
cuDNN by 4-6 %, where their GPU time wins; bench/NOTES.md session 50).

Per shape (batch x cache x GQA group; 32 query heads, head_dim 128, bf16; contiguous, and with --paged
also 16-row pages in a random order) the variants are cuflash at num_splits 0 (the library's plan) and
at each count of --splits, and SDPA's cuDNN and flash backends. They run interleaved (a fresh random
order every repetition), each as one single call on an idle GPU (eager_parts.single_call_us:
synchronize, start event, the call, end event, synchronize); reported: the median (min) of the
events' time and of the host's time inside the call, us. Then each variant's GPU time per call back
to back (decode_splits.gpu_ms_per_call: a sleep kernel queued first). Each cuflash row names its plan:
the split count, the launches and how the splits merge (cluster, fused, kernel).

--alloc adds, per layout, the library's plan with its split scratch allocated per call (torch.empty, as
before session 51) in place of the plan's scratch for the stream (DecodePlan._scratch), in the same
process.

Usage: python bench/dev/eager_splits.py [--shapes 1x8192x1 ...] [--splits 4 8 16] [--paged] [--alloc]
       [--reps 200] [--json out.json]
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

from decode_splits import decode_inputs, gpu_ms_per_call, paged16, parse_shape  # noqa: E402
from eager_parts import _null, single_call_us  # noqa: E402


def plan_desc(plan) -> str:
    splits, _, launches, fused = plan.eager
    dec = next(x for x in launches if x.name.startswith("decode_") and "combine" not in x.name
               and "append" not in x.name)
    merge = ("-" if splits == 1 else "cluster" if dec.cluster > 1 else "fused" if fused is not None else "kernel")
    names = "/".join(x.name for x in (fused or launches))
    return f"splits {splits} {merge} [{names}]"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["1x8192x1", "1x32768x4", "1x32768x8"])
    ap.add_argument("--splits", type=int, nargs="*", default=[4, 8, 16])
    ap.add_argument("--paged", action="store_true", help="also 16-row pages (random order)")
    ap.add_argument("--alloc", action="store_true",
                    help="also each layout's library plan with its split scratch allocated per call (torch.empty), "
                         "as before session 51, in the same process")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--gpu1-rounds", type=int, default=60, help="rounds of the one-call GPU time (0: not measured)")
    ap.add_argument("--json")
    args = ap.parse_args()

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import cuflash
    from cuflash import _kvcache

    dev = torch.device("cuda")
    name = torch.cuda.get_device_name()
    print(name, flush=True)
    rows = []
    for shape in args.shapes:
        b, L, g, sq = parse_shape(shape)
        h, d, hk, q, kc, vc, seqlens = decode_inputs(torch, dev, b, L, g, sq)
        qt, kt, vt = q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)
        layouts = [("contig", dict(k_cache=kc, v_cache=vc))]
        if args.paged:
            layouts.append(("paged16", paged16(torch, dev, b, L, kc, vc)))
        variants, ctxs, descs = {}, {}, {}
        real_scratch = getattr(_kvcache.DecodePlan, "_scratch", None)
        keep = []

        def alloc_scratch(plan, stream, nbytes):  # a fresh allocation a call (freed at the next one)
            keep[:] = [torch.empty(nbytes // 4, dtype=torch.float32, device=dev)]
            return keep[0].data_ptr()

        class AllocCtx:  # the per-call allocation in place of the plan's scratch (set outside the timing)
            def __enter__(self):
                _kvcache.DecodePlan._scratch = alloc_scratch

            def __exit__(self, *a):
                _kvcache.DecodePlan._scratch = real_scratch
                return False

        _kvcache._FAST_PLANS.clear()
        _kvcache._DECODE_PLANS.clear()
        for lname, kw in layouts:
            for s in [0] + args.splits:
                key = f"{lname}.s{s}" if s else f"{lname}.lib"

                def fn(kw=kw, s=s):
                    return cuflash.attention_with_kvcache(q, cache_seqlens=seqlens, num_splits=s, **kw)

                before = set(_kvcache._FAST_PLANS)
                fn()
                torch.cuda.synchronize()
                new = [p for k_, p in _kvcache._FAST_PLANS.items() if k_ not in before]
                descs[key] = plan_desc(new[0]) if new else "?"
                variants[key] = fn
                if s == 0 and args.alloc and real_scratch is not None:
                    variants[key + ".alloc"] = fn
                    ctxs[key + ".alloc"] = AllocCtx
                    descs[key + ".alloc"] = descs[key]
        for k, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
            variants[k] = lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=(g > 1))
            ctxs[k] = (lambda be=be: sdpa_kernel(be))
        for k, fn in variants.items():
            with ctxs[k]() if k in ctxs else _null():
                for _ in range(10):
                    fn()
        torch.cuda.synchronize()
        host = {k: [] for k in variants}
        ev = {k: [] for k in variants}
        order = list(variants)
        rng = random.Random(1)
        for _ in range(args.reps):
            rng.shuffle(order)
            for k in order:
                with ctxs[k]() if k in ctxs else _null():
                    hh, e = single_call_us(torch, variants[k])
                host[k].append(hh)
                ev[k].append(e)
        print(f"== {shape}", flush=True)
        for k, fn in variants.items():
            with ctxs[k]() if k in ctxs else _null():
                gpu = gpu_ms_per_call(torch, fn, 50, 5) * 1e3
                gpu1 = gpu_ms_per_call(torch, fn, 1, args.gpu1_rounds) * 1e3 if args.gpu1_rounds else float("nan")
            row = dict(shape=shape, variant=k, plan=descs.get(k, ""), ev_med=statistics.median(ev[k]),
                       ev_min=min(ev[k]), host_med=statistics.median(host[k]), host_min=min(host[k]), gpu_us=gpu,
                       gpu1_us=gpu1, pdl_env=os.environ.get("CUFLASH_PDL", ""))
            rows.append(row)
            print(f"{shape:>10} {k:20} eager {row['ev_med']:7.1f} (min {row['ev_min']:6.1f})  host "
                  f"{row['host_med']:5.1f}  gpu {gpu:7.1f}  gpu1 {gpu1:7.1f} us  {row['plan']}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=name, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
