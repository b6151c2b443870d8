#!/usr/bin/env python3
"""CUDA-graph replay of one decode call, by where the graph was captured (issue 13: graph replay at 4 x
2k x 8 read 1.03-1.04x cuDNN's in session 55; a split plan's graph takes the fused merge only where the
capturing stream already has the fused combine's counters, which torch.cuda.graph's own capture stream
never has, and only up to DECODE_GRAPH_FUSED_MAX_PARTS rows x splits).

Per shape (batch x cache x GQA group; 32 query heads, head_dim 128, bf16, contiguous), variants:
  fresh      captured on torch.cuda.graph's own capture stream (no counters: the combine kernel), as a
             user's capture and bench_decode's
  warm32     captured on a stream that ran eager calls of the plan first (its counters exist), the
             graph limit 32 rows x splits (the library's)
  warm64     the same with the limit 64 (the plan made anew)
  cudnn      SDPA's cuDNN backend, captured the same way as fresh
GPU time per replay (CUDA events around 100 back-to-back replays behind a sleep kernel, median of 7),
the passes over the variants alternated --alternations times; each graph's output against an eager
call's (max abs difference); the captured kernels.

Usage: python bench/dev/graph_counters_ab.py [--shapes 4x2048x8 ...] [--alternations 2]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from decode_splits import gpu_ms_per_call, shape_inputs  # noqa: E402


def record_captures(kvcache, launch, label=lambda L: L.name) -> list:
    """Patches kvcache.run_launches so that each call made while its stream captures a graph appends
    its launches (label of each, joined by "/") to the list returned."""
    names = []
    real_run = kvcache.run_launches

    def run_launches(plan, stream, ptrs, launches, *a, **k):
        if launch.stream_capturing(stream):
            names.append("/".join(label(x) for x in launches))
        return real_run(plan, stream, ptrs, launches, *a, **k)

    kvcache.run_launches = run_launches
    return names


def warm_and_capture(torch, fn, names: list, on_side_stream: bool = False):
    """(graph, out): fn called three times on a side stream, then captured in a CUDAGraph on
    torch.cuda.graph's own capture stream (or, on_side_stream, on that side stream, which has then
    run the calls) and replayed once; names (record_captures's list) emptied before the capture."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    del names[:]
    with torch.cuda.graph(graph, stream=s if on_side_stream else None):
        out = fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph, out


def shape_case(torch, dev, shape: str):
    """(q, k_cache, v_cache, cache_seqlens, ref, cudnn) of a "BxLxG" decode shape: ref, the library's
    eager output (float32); cudnn, SDPA's cuDNN backend on the same arrays."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import cuflash

    b, L, g, q, kc, vc, seqlens, (qt, kt, vt) = shape_inputs(torch, dev, shape)
    ref = cuflash.attention_with_kvcache(q, kc, vc, cache_seqlens=seqlens).float()

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=(g > 1))

    return q, kc, vc, seqlens, ref, cudnn


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["1x2048x4", "1x2048x8", "4x2048x4", "4x2048x8", "1x8192x4",
                                                    "1x8192x8", "4x8192x4", "4x8192x8", "1x32768x4", "16x8192x8"])
    ap.add_argument("--alternations", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()

    import torch

    import cuflash
    from cuflash import _config, _kvcache, _launch

    names = record_captures(_kvcache, _launch)  # what each capture takes
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), flush=True)
    rows = []
    for shape in args.shapes:
        q, kc, vc, seqlens, ref, cudnn = shape_case(torch, dev, shape)

        def lib():
            return cuflash.attention_with_kvcache(q, kc, vc, cache_seqlens=seqlens)

        times = {v: [] for v in ("fresh", "warm32", "warm64", "cudnn")}
        info = {}
        for _ in range(args.alternations):
            for v in times:
                _config.DECODE_GRAPH_FUSED_MAX_PARTS = 64 if v == "warm64" else 32
                _kvcache._DECODE_PLANS.clear()
                _kvcache._FAST_PLANS.clear()
                fn = cudnn if v == "cudnn" else lib
                graph, out = warm_and_capture(torch, fn, names, on_side_stream=v.startswith("warm"))
                if v == "cudnn":
                    diff = float((out.transpose(1, 2).float() - ref).abs().max())
                else:
                    diff = float((out.float() - ref).abs().max())
                times[v].append(gpu_ms_per_call(torch, graph.replay, 100, 7) * 1e3)
                info[v] = dict(captured=list(names), diff=diff)
                del graph, out
        _config.DECODE_GRAPH_FUSED_MAX_PARTS = 32
        row = dict(shape=shape, times=times, info=info)
        rows.append(row)
        print(f"{shape:>10} " + "  ".join(f"{v} {'/'.join(f'{t:.2f}' for t in ts)}" for v, ts in times.items()), flush=True)
        for v in ("fresh", "warm32", "warm64"):
            print(f"{'':>12}{v}: {info[v]['captured']} diff {info[v]['diff']:.2e}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
