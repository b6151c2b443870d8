#!/usr/bin/env python3
"""CUDA-graph replay of one decode call under forced plans (issue 13: graph replay at 4 x 2k x 8 read
1.03-1.04x cuDNN's in sessions 55 and 56, where the graph runs 8 splits on the 8-warp kernel and the
combine kernel; torch.cuda.graph's own capture stream has no fused-combine counters).

Per shape (batch x cache x GQA group; 32 query heads, head_dim 128, bf16, contiguous), each variant
is captured on torch.cuda.graph's own stream after three warm-up calls on a side stream (as a user's
capture and bench_decode's), with the plan cache cleared first. A variant is "lib" (the library's
plan) or "w{W}s{S}" with an optional "nc" suffix: CUFLASH_DECODE_WARPS=W (0: the library's choice),
num_splits=S, and with "nc" CUFLASH_DECODE_CLUSTER=0 (no cluster merge). Beside them, cuDNN captured
the same way. GPU time per replay: CUDA events around 100 back-to-back replays behind a sleep kernel,
median of 7; the variants taken in turn --alternations times. Each graph's output against the
library's eager call (max abs difference) and the captured kernels are printed.

Usage: python bench/dev/graph_variants.py [--shapes 4x2048x8] [--variants lib w8s8 w4s8 ...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from decode_splits import gpu_ms_per_call  # noqa: E402
from graph_counters_ab import record_captures, shape_case, warm_and_capture  # noqa: E402

DEFAULT_VARIANTS = ["lib", "w8s8", "w4s8", "w4s8nc", "w8s4", "w4s4", "w4s4nc", "w4s16", "w8s16", "w0s1"]


def parse(v: str):
    """(warps, splits, cluster) of a variant name; None for the library's plan."""
    if v == "lib":
        return None
    cluster = not v.endswith("nc")
    w, s = v.rstrip("nc")[1:].split("s")
    return int(w), int(s), cluster


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["4x2048x8", "4x2048x4"])
    ap.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS)
    ap.add_argument("--alternations", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()

    import torch

    import cuflash
    from cuflash import _kvcache, _launch

    names = record_captures(_kvcache, _launch, lambda L: f"{L.name}[{L.grid}]")  # what each capture takes
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), flush=True)
    rows = []
    for shape in args.shapes:
        q, kc, vc, seqlens, ref, cudnn = shape_case(torch, dev, shape)

        variants = args.variants + ["cudnn"]
        times = {v: [] for v in variants}
        info = {}
        for _ in range(args.alternations):
            for v in variants:
                os.environ.pop("CUFLASH_DECODE_WARPS", None)
                os.environ.pop("CUFLASH_DECODE_CLUSTER", None)
                splits = 0
                spec = None if v in ("lib", "cudnn") else parse(v)
                if spec is not None:
                    w, splits, cluster = spec
                    if w:
                        os.environ["CUFLASH_DECODE_WARPS"] = str(w)
                    if not cluster:
                        os.environ["CUFLASH_DECODE_CLUSTER"] = "0"
                _kvcache._DECODE_PLANS.clear()
                _kvcache._FAST_PLANS.clear()

                def lib(splits=splits):
                    return cuflash.attention_with_kvcache(q, kc, vc, cache_seqlens=seqlens, num_splits=splits)

                fn = cudnn if v == "cudnn" else lib
                try:
                    graph, out = warm_and_capture(torch, fn, names)
                except Exception as e:  # a forced plan the library refuses (a cluster that does not fit, say)
                    info[v] = dict(error=f"{type(e).__name__}: {e}")
                    times[v].append(None)
                    torch.cuda.synchronize()
                    continue
                o = out.transpose(1, 2) if v == "cudnn" else out
                diff = float((o.float() - ref).abs().max())
                times[v].append(gpu_ms_per_call(torch, graph.replay, 100, 7) * 1e3)
                info[v] = dict(captured=list(names), diff=diff)
                del graph, out
        os.environ.pop("CUFLASH_DECODE_WARPS", None)
        os.environ.pop("CUFLASH_DECODE_CLUSTER", None)
        row = dict(shape=shape, times=times, info=info)
        rows.append(row)
        print(f"{shape}:", flush=True)
        for v in variants:
            ts = "/".join("-" if t is None else f"{t:.2f}" for t in times[v])
            i = info.get(v, {})
            extra = i.get("error") or f"{i.get('captured')} diff {i.get('diff', float('nan')):.2e}"
            print(f"  {v:>8} {ts:>14} us  {extra}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
