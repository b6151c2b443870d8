#!/usr/bin/env python3
"""The decode's cluster merge, variant by variant (session 31): GPU time per step (decode_splits.py's
gpu_ms_per_call: CUDA events around back-to-back calls behind a sleep kernel) of forced split counts
at each shape (batch x cache x GQA; 32 query heads, head_dim 128, bf16, contiguous cache), for
  fused    the fused combine (CUFLASH_DECODE_CLUSTER=0)
  cl       the cluster merge as the library launches it
  cl1      the same launch with the dynamic shared memory raised past half an SM's, so that a
           cluster's blocks are placed one per SM (not packed two to an SM)
in three phases: (1) counts up to 8; (2) the same after the decode functions are allowed
non-portable cluster sizes (cuFuncSetAttribute, as a 16-block cluster's fit query does); (3) counts
past 8 (--big). Where a launch's clusters do not all fit at once (cluster_fits), the row says so.
Usage: python bench/dev/cluster_ab.py [--shapes ...] [--splits ...] [--big ...]"""
from __future__ import annotations

import argparse
import ctypes
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from decode_splits import gpu_ms_per_call  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["1x512x1", "1x512x4", "1x512x8", "4x512x4", "4x512x8",
                                                    "1x2048x4", "1x2048x8", "4x2048x8", "1x8192x1", "1x8192x4"])
    ap.add_argument("--splits", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--big", type=int, nargs="*", default=[16])
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()

    import torch

    import cuflash
    from cuflash import _kvcache, _launch

    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuFuncSetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    dev = torch.device("cuda")
    sm_half = 228 * 1024 // 2 + 1024  # past half an H100/H200 SM's 228 KB: one block per SM
    data = {}
    for shape in args.shapes:
        b, L, g = (int(x) for x in shape.split("x"))
        h, d = 32, 128
        hk = h // g
        data[shape] = dict(q=torch.randn(b, 1, h, d, device=dev, dtype=torch.bfloat16),
                           k_cache=torch.randn(b, L, hk, d, device=dev, dtype=torch.bfloat16),
                           v_cache=torch.randn(b, L, hk, d, device=dev, dtype=torch.bfloat16),
                           cache_seqlens=torch.full((b,), L, device=dev, dtype=torch.int32))
    fns = set()

    def plan_of(shape, s):
        kw = data[shape]
        return next(p for p in _kvcache._FAST_PLANS.values()
                    if p.out_shape == tuple(kw["q"].shape) and p.call.capacity == kw["k_cache"].shape[1]
                    and p.call.nheads_kv == kw["k_cache"].shape[2] and p.num_splits == s)

    def time(shape, s, variant):
        os.environ["CUFLASH_DECODE_CLUSTER"] = "0" if variant == "fused" else "1"
        _kvcache._FAST_PLANS.clear()
        _kvcache._DECODE_PLANS.clear()
        kw = data[shape]
        fn = lambda: cuflash.attention_with_kvcache(num_splits=s, **kw)  # noqa: E731
        fn()
        pl = plan_of(shape, s)
        dec = pl.launches[-1] if pl.launches[-1].cluster > 1 else None
        note = ""
        if variant != "fused":
            if dec is None:
                return None, "no cluster (does not fit)"
            fns.add(dec.fn)
            if variant == "cl1":
                if dec.smem >= sm_half:
                    return None, "one block per SM already"
                # (raised, never lowered: the function's other plans need their own size)
                lib.cuFuncSetAttribute(ctypes.c_void_p(dec.fn), 8, sm_half)  # MAX_DYNAMIC_SHARED_SIZE_BYTES
                dec.smem = sm_half
                _launch.set_cluster(dec, dec.cluster)
                if not _launch.cluster_fits(dec):
                    note = "not all resident"
        ms = gpu_ms_per_call(torch, fn, args.calls, args.rounds)
        return ms, note

    def phase(name, counts, variants):
        print(f"== {name}", flush=True)
        for shape in args.shapes:
            for s in counts:
                line = f"{shape:>10} s{s:<3d}"
                for v in variants:
                    ms, note = time(shape, s, v)
                    line += f"  {v} " + (f"{ms * 1e3:6.1f}" if ms is not None else "   -  ") + (f" ({note})" if note
                                                                                           else "")
                print(line, flush=True)

    phase("phase 1: counts up to 8, portable clusters only", args.splits, ["fused", "cl", "cl1", "cl"])
    for f in fns:
        lib.cuFuncSetAttribute(ctypes.c_void_p(f), 14, 1)  # NON_PORTABLE_CLUSTER_SIZE_ALLOWED
    phase("phase 2: the same after allowing non-portable sizes", args.splits, ["cl", "cl1"])
    if args.big:
        phase("phase 3: counts past 8", args.big, ["fused", "cl", "cl1"])


if __name__ == "__main__":
    main()
