#!/usr/bin/env python3
"""Chunked prefill and long speculative steps through attention_with_kvcache: GPU time per call of a
contiguous cache against paged views of the same cache (16- and 256-row pages in a random order), each on
the library's route (_config.kvcache_feature_forward; before session 68 a contiguous cache took the feature
forward with kv_lengths past 64 packed rows a kv head, a paged one the decode kernels). Causal, bf16, 32 query heads, head_dim
128, every entry's cache full (cache_seqlens = cache - seqlen_q: the chunk's own keys are in the cache).
Shapes "BxLxGxSQ" (batch x cache x GQA group x seqlen_q). GPU time as decode_splits.py measures it (the
median over rounds of CUDA-event time around back-to-back calls, a sleep kernel queued first); the
TFLOP/s of the causal chunk (its rows see cache - SQ + i + 1 keys). The max|diff| column is not a check:
a paged view with pages in a random order is another sequence of the same keys (session 68's call 3
printed it; bench/dev/prefill_route.py compares the routes on one layout).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_splits import gpu_ms_per_call, parse_shape  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["1x8192x8x64", "1x8192x8x256", "1x32768x8x512", "4x8192x8x128",
                                                    "4x32768x4x256", "16x8192x8x16"])
    ap.add_argument("--page-sizes", type=int, nargs="+", default=[16, 256])
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()

    import torch

    import cuflash
    from cuflash import _kvcache

    dev = torch.device("cuda")
    out = []
    for shape in args.shapes:
        b, L, g, sq = parse_shape(shape)
        h, d = 32, 128
        hk = h // g
        q = torch.randn(b, sq, h, d, device=dev, dtype=torch.bfloat16)
        kc = torch.randn(b, L, hk, d, device=dev, dtype=torch.bfloat16)
        vc = torch.randn(b, L, hk, d, device=dev, dtype=torch.bfloat16)
        seqlens = torch.full((b,), L - sq, device=dev, dtype=torch.int32)
        # cache_seqlens = L - sq and the chunk's own k, v appended: they land in the cache's last sq rows
        kn = torch.randn(b, sq, hk, d, device=dev, dtype=torch.bfloat16)
        vn = torch.randn(b, sq, hk, d, device=dev, dtype=torch.bfloat16)
        flops = 4 * b * h * d * sum(L - sq + i + 1 for i in range(sq))
        layouts = [("contig", dict(k_cache=kc, v_cache=vc), None)]
        for page in args.page_sizes:
            nblk = b * L // page
            table = torch.randperm(nblk, device=dev, dtype=torch.int32).view(b, L // page)
            layouts.append((f"paged{page}", dict(k_cache=kc.view(nblk, page, hk, d), v_cache=vc.view(nblk, page, hk, d),
                                                 block_table=table), table))
        ref = None
        for name, kw, table in layouts:
            fn = lambda: cuflash.attention_with_kvcache(q, k=kn, v=vn, cache_seqlens=seqlens, causal=True, **kw)  # noqa: E731
            o = fn()
            if ref is None:
                ref = o
            diff = float((o.float() - ref.float()).abs().max())
            ms = gpu_ms_per_call(torch, fn, args.calls, args.rounds)
            kern = "-"
            for p in _kvcache._DECODE_PLANS.values():
                if p.out_shape == (b, sq, h, d) and p.call.paged == (name != "contig"):
                    kern = next(L_.name for L_ in p.launches if L_.name.startswith("decode_") and "append" not in L_.name)
            row = dict(shape=shape, layout=name, ms=ms, tflops=flops / ms / 1e9, diff_vs_contig=diff, kernel=kern)
            out.append(row)
            print(f"{shape:>16} {name:8} {ms * 1e3:9.1f} us {flops / ms / 1e9:7.1f} TFLOP/s  {kern:34} "
                  f"max|diff| vs contig {diff:.4f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), rows=out), f, indent=1)


if __name__ == "__main__":
    main()
