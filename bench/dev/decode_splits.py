#!/usr/bin/env python3
"""Decode kernel: GPU time per step against the forced split count (tuning the num_splits heuristic).

For each shape (batch, cache length, GQA group; 32 query heads, head_dim 128, bf16, contiguous cache,
no append; --paged: also paged views of it, pages of --page-sizes rows in a random order, and in
order with --in-order) and each num_splits in --splits (0 = the
heuristic's choice, printed) and each pipeline depth in --stages (0 = the library's choice,
cuflash/_config.py decode_stages; others are compiled on the spot; 4-warp kernel only) and each warp
count in --warps (0 = the library's choice, 4 or 8: CUFLASH_DECODE_WARPS), the median over rounds of CUDA-event time around N back-to-back calls
/ N, with a sleep kernel queued first so that the host runs ahead: the GPU's time per call, not the
host's. Prints one table; --json writes it.
"""

from __future__ import annotations

import argparse
import json
import statistics


def gpu_ms_per_call(torch, fn, calls: int, rounds: int, warmup: int = 3, lead_cycles: int = 200_000) -> float:
    """GPU time of one call of fn: median over `rounds` of CUDA-event time around `calls` back-to-back
    calls / calls, with a sleep kernel of lead_cycles a call queued first so that the host runs ahead
    (200000: about 0.1 ms a call, enough for a call whose host part is shorter)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(int(calls * lead_cycles))  # queued first: the host runs ahead
        e0.record()
        for _ in range(calls):
            fn()
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1) / calls)
    return statistics.median(times)


def decode_inputs(torch, dev, b: int, L: int, g: int, sq: int = 1):
    """(h, d, hk, q, k_cache, v_cache, cache_seqlens) of a batch x cache x GQA-group decode shape: 32
    query heads, head_dim 128, bf16, random values, every entry's cache full; sq query positions."""
    h, d = 32, 128
    hk = h // g
    q = torch.randn(b, sq, h, d, device=dev, dtype=torch.bfloat16)
    kc = torch.randn(b, L, hk, d, device=dev, dtype=torch.bfloat16)
    vc = torch.randn(b, L, hk, d, device=dev, dtype=torch.bfloat16)
    return h, d, hk, q, kc, vc, torch.full((b,), L, device=dev, dtype=torch.int32)


def parse_shape(shape: str):
    """(batch, cache, group, seqlen_q) of "BxLxG" (seqlen_q 1) or "BxLxGxSQ"."""
    f = [int(x) for x in shape.split("x")]
    if len(f) not in (3, 4):
        raise ValueError(f"shape: expected BxLxG or BxLxGxSQ; got {shape!r}")
    return f[0], f[1], f[2], f[3] if len(f) == 4 else 1


def shape_inputs(torch, dev, shape: str):
    """(b, L, g, q, k_cache, v_cache, cache_seqlens, sdpa) of a "BxLxG" shape (decode_inputs), sdpa being
    q, k_cache and v_cache as SDPA's (batch, heads, keys, head_dim) views."""
    b, L, g = (int(x) for x in shape.split("x"))
    _, _, _, q, kc, vc, seqlens = decode_inputs(torch, dev, b, L, g)
    return b, L, g, q, kc, vc, seqlens, (q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2))


def eager_launch_ptrs(torch, plan, out, q, kc, vc, seqlens, names=None):
    """(ptrs, launches, splits, keep) of one eager call of a contiguous decode plan, set up by hand for
    timing its parts (eager_parts.py, fire_parts.py): the Params pointer slots of out, the plan's
    scratch (allocated here; keep holds it alive), the fused combine's counters, and q, the caches and
    cache_seqlens; launches are the eager variant's (the fused ones where it has them). names: the
    call's arrays by name, for trees whose plans predate input_positions (input_slots)."""
    from cuflash import _kvcache

    splits, scratch_floats, launches, fused = plan.eager
    ptrs = plan.zero_ptrs.copy()
    ptrs[_kvcache._D_OUT] = out.data_ptr()
    keep = [out]
    if scratch_floats:
        scratch = torch.empty(scratch_floats, device=out.device, dtype=torch.float32)
        keep.append(scratch)
        ptrs[_kvcache._D_SCRATCH] = scratch.data_ptr()
    if fused is not None:
        launches = fused
        ptrs[_kvcache._D_COUNTERS] = plan._counters(torch.cuda.current_stream().cuda_stream)
    arrs = (q, kc, vc, None, None, seqlens, None, None, None, None)  # (_kvcache._RUN_ARRAYS' order)
    if hasattr(plan, "input_positions"):
        for slot, i in plan.input_positions:
            ptrs[slot] = arrs[i].data_ptr()
    else:
        for i, n in plan.input_slots:
            ptrs[i] = names[n].data_ptr()
    return ptrs, launches, splits, keep


def paged16(torch, dev, b: int, L: int, kc, vc) -> dict:
    """The k_cache, v_cache and block_table arguments of a paged view of contiguous caches (b, L, hk, d):
    16-row pages in a random order."""
    nblk, hk, d = b * L // 16, kc.shape[2], kc.shape[3]
    table = torch.randperm(nblk, device=dev, dtype=torch.int32).view(b, L // 16)
    return dict(k_cache=kc.view(nblk, 16, hk, d), v_cache=vc.view(nblk, 16, hk, d), block_table=table)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["1x512x8", "1x8192x8", "1x8192x1", "16x512x8", "16x8192x8",
                                                    "64x512x8", "64x8192x8", "4x32768x8", "1x131072x8"],
                    help="batch x cache x group, or batch x cache x group x seqlen_q (speculative decoding)")
    ap.add_argument("--splits", type=int, nargs="+", default=[0, 1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--paged", action="store_true", help="also time a paged layout of the same cache")
    ap.add_argument("--page-sizes", type=int, nargs="+", default=[16],
                    help="--paged: the page sizes (rows) of the paged layouts, each its own row")
    ap.add_argument("--in-order", action="store_true",
                    help="--paged: also time each page size with its pages in order (block_table = arange: "
                         "the contiguous cache's addresses, only the lookups added), beside the random order")
    ap.add_argument("--stages", type=int, nargs="+", default=[0],
                    help="cp.async pipeline stages of the decode kernel (0: the library's choice)")
    ap.add_argument("--warps", type=int, nargs="+", default=[0], choices=[0, 4, 8],
                    help="the decode kernel's warps (0: the library's choice; CUFLASH_DECODE_WARPS)")
    ap.add_argument("--cluster", nargs="+", default=["lib"], choices=["lib", "0", "1"],
                    help="the cluster merge (CUFLASH_DECODE_CLUSTER; lib: the library's default)")
    ap.add_argument("--two-tiles", nargs="+", default=["lib"], choices=["lib", "0", "1"],
                    help="two m16 tiles a warp (CUFLASH_DECODE_TWO_TILES; lib: the library's rule)")
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()

    import os

    import torch

    import cuflash
    from cuflash import _config, _kvcache

    library_stages = _config.decode_stages

    dev = torch.device("cuda")
    rows = []
    for shape in args.shapes:
        b, L, g, sq = parse_shape(shape)
        h, d, hk, q, kc, vc, seqlens = decode_inputs(torch, dev, b, L, g, sq)
        layouts = [("contig", dict(k_cache=kc, v_cache=vc))]
        for page in args.page_sizes if args.paged else []:
            nblk = b * L // page
            tables = [("", torch.randperm(nblk, device=dev, dtype=torch.int32))]
            if args.in_order:
                tables.append(("o", torch.arange(nblk, device=dev, dtype=torch.int32)))
            for tag, table in tables:
                layouts.append((f"paged{page}{tag}", dict(k_cache=kc.view(nblk, page, hk, d),
                                                          v_cache=vc.view(nblk, page, hk, d),
                                                          block_table=table.view(b, L // page))))
        kv_bytes = 2 * b * L * hk * d * 2
        for lname, kw, st, w, cl, tt in [(lname, kw, st, w, cl, tt) for lname, kw in layouts for st in args.stages
                                         for w in args.warps for cl in args.cluster for tt in args.two_tiles]:
            # A forced depth or warp count: every plan is made anew with it (both are in the kernel's name).
            _config.decode_stages = library_stages if st == 0 else (lambda target, head_dim, st=st: st)
            for rule in ("CUFLASH_DECODE_DEEP", "CUFLASH_DECODE_SHALLOW"):  # a forced depth: no per-call rule
                if st == 0:
                    os.environ.pop(rule, None)
                else:
                    os.environ[rule] = "0"
            os.environ["CUFLASH_DECODE_WARPS"] = str(w)
            if cl == "lib":
                os.environ.pop("CUFLASH_DECODE_CLUSTER", None)
            else:
                os.environ["CUFLASH_DECODE_CLUSTER"] = cl
            if tt == "lib":
                os.environ.pop("CUFLASH_DECODE_TWO_TILES", None)
            else:
                os.environ["CUFLASH_DECODE_TWO_TILES"] = tt
            _kvcache._FAST_PLANS.clear()
            _kvcache._DECODE_PLANS.clear()
            for s in args.splits:
                fn = lambda: cuflash.attention_with_kvcache(q, cache_seqlens=seqlens, num_splits=s, **kw)  # noqa: E731
                ms = gpu_ms_per_call(torch, fn, args.calls, args.rounds)
                plan = next(p for p in _kvcache._FAST_PLANS.values()
                            if p.out_shape == (b, sq, h, d) and p.call.capacity == L and p.call.nheads_kv == hk
                            and p.call.paged == (lname != "contig") and p.num_splits == (s or p.num_splits))
                chosen = plan.num_splits
                dec = next(L_ for L_ in plan.launches if L_.name.startswith("decode_") and "combine" not in
                           L_.name and "append" not in L_.name)
                kernel = dec.name
                merge = ("-" if chosen == 1 else "cluster" if dec.cluster > 1 else
                         "fused" if plan.eager[3] is not None else "kernel")
                rows.append(dict(shape=shape, layout=lname, kernel=kernel, splits=s, chosen=chosen, merge=merge,
                                 cluster=cl, two_tiles=tt, ms=ms, gbps=kv_bytes / ms / 1e6))
                print(f"{shape:>14} {lname:8} {kernel:26} splits {s:3d} ({chosen:3d}) {merge:7} {ms * 1e3:9.1f} us  "
                      f"{kv_bytes / ms / 1e6:7.0f} GB/s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
