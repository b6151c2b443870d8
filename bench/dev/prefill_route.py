#!/usr/bin/env python3
"""attention_with_kvcache on a cache with many packed rows a kv head (chunked prefill, long speculative
steps): the decode kernels (CUFLASH_KVCACHE_FORWARD=0) against the feature forward with kv_lengths (=1;
a paged cache's pages gathered into a padded copy first), alternated in one process, and the library's
own choice (lib), at "BxLxGxSQ" shapes (batch x cache x GQA group x
seqlen_q; 32 query heads, head_dim 128, bf16, causal, cache_seqlens = cache - SQ and the chunk's k, v
appended), contiguous and --layouts' paged views (pages of N rows in a random order; for those also the
forward route after the gather, CUFLASH_PAGED_DIRECT=0, beside the pages read in place). GPU time as
decode_splits.py measures it, behind a longer sleep kernel (--lead-cycles); the ratio forward / decode per shape. With --eager N also single eager calls,
host time included (N calls a route, each alone on an idle GPU: CUDA events around the call, the median),
and the host's part alone (perf_counter around the call, the median of the same calls)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_splits import gpu_ms_per_call, parse_shape  # noqa: E402


def chunk_inputs(torch, dev, b: int, L: int, g: int, sq: int):
    """(h, d, hk, q, k_cache, v_cache, k, v, cache_seqlens) of a chunk: 32 query heads, head_dim 128,
    bf16, random values, caches of L keys holding L - sq, the sq new tokens to append."""
    h, d = 32, 128
    hk = h // g
    q = torch.randn(b, sq, h, d, device=dev, dtype=torch.bfloat16)
    kc = torch.randn(b, L, hk, d, device=dev, dtype=torch.bfloat16)
    vc = torch.randn(b, L, hk, d, device=dev, dtype=torch.bfloat16)
    kn = torch.randn(b, sq, hk, d, device=dev, dtype=torch.bfloat16)
    vn = torch.randn(b, sq, hk, d, device=dev, dtype=torch.bfloat16)
    seqlens = torch.full((b,), L - sq, device=dev, dtype=torch.int32)
    return h, d, hk, q, kc, vc, kn, vn, seqlens


def eager_ms(torch, fn, n: int) -> tuple[list, list]:
    """(ms of each single call with the host's work included, host ms of each): n calls, each on an
    idle GPU, CUDA events recorded before and after it, perf_counter around the call alone."""
    import time

    ev, host = [], []
    for _ in range(n):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        s.record()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        e.record()
        torch.cuda.synchronize()
        ev.append(s.elapsed_time(e))
        host.append((t1 - t0) * 1e3)
    return ev, host


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 4, 16])
    ap.add_argument("--caches", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--gqa", type=int, nargs="+", default=[8, 4])
    ap.add_argument("--sq", type=int, nargs="+", default=[16, 32, 64, 128])
    ap.add_argument("--shapes", nargs="*", default=[], help="more BxLxGxSQ shapes")
    ap.add_argument("--layouts", nargs="+", default=["contig"], help="contig, pagedN (pages of N rows)")
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--eager", type=int, default=0, help="single eager calls a route and round (0: none)")
    ap.add_argument("--lead-cycles", type=int, default=2_000_000,
                    help="the GPU time's sleep kernel, cycles a call (about 1 ms at 2 GHz: session 68's 0.1 ms "
                         "let calls with a longer host part than that wait for the host)")
    ap.add_argument("--json")
    args = ap.parse_args()

    import torch

    import cuflash
    from cuflash import _kvcache

    dev = torch.device("cuda")
    shapes = [f"{b}x{L}x{g}x{sq}" for b in args.batches for L in args.caches for g in args.gqa for sq in args.sq
              if sq * g > 64] + args.shapes
    out = []
    for shape in shapes:
        b, L, g, sq = parse_shape(shape)
        h, d, hk, q, kc, vc, kn, vn, seqlens = chunk_inputs(torch, dev, b, L, g, sq)
        flops = 4 * b * h * d * sum(L - sq + i + 1 for i in range(sq))
        for layout in args.layouts:
            kw = dict(k_cache=kc, v_cache=vc)
            if layout != "contig":
                page = int(layout.removeprefix("paged"))
                nblk = b * L // page
                kw = dict(k_cache=kc.view(nblk, page, hk, d), v_cache=vc.view(nblk, page, hk, d),
                          block_table=torch.randperm(nblk, device=dev, dtype=torch.int32).view(b, L // page))
            res, eager, hosts = {}, {}, {}
            outs = {}
            # (paged: "1g" is the forward route after the gather, CUFLASH_PAGED_DIRECT=0; "1" reads
            # the pages in place wherever the kernel serves the call, CUFLASH_PAGED_DIRECT=1; "1o" as "1"
            # with CUFLASH_PAGED_ILV=0: a box a 64-column panel where "1" may copy 16-row boxes of whole rows)
            routes = ("0", "1", "1o", "1g", "lib") if layout != "contig" else ("0", "1", "lib")
            for route in routes + routes:
                if route == "lib":
                    os.environ.pop("CUFLASH_KVCACHE_FORWARD", None)
                else:
                    os.environ["CUFLASH_KVCACHE_FORWARD"] = route[0]
                if route in ("1", "1o", "1g"):  # (forced either way: the library's rule is "lib"'s)
                    os.environ["CUFLASH_PAGED_DIRECT"] = "0" if route == "1g" else "1"
                else:
                    os.environ.pop("CUFLASH_PAGED_DIRECT", None)
                if route == "1o":
                    os.environ["CUFLASH_PAGED_ILV"] = "0"
                else:
                    os.environ.pop("CUFLASH_PAGED_ILV", None)
                _kvcache._FAST_PLANS.clear()
                _kvcache._DECODE_PLANS.clear()
                _kvcache._CHUNK_PLANS.clear()
                fn = lambda: cuflash.attention_with_kvcache(q, k=kn, v=vn, cache_seqlens=seqlens, causal=True, **kw)  # noqa: E731
                outs[route] = fn().float()
                res.setdefault(route, []).append(gpu_ms_per_call(torch, fn, args.calls, args.rounds,
                                                                 lead_cycles=args.lead_cycles))
                if args.eager:
                    ev, host = eager_ms(torch, fn, args.eager)
                    eager.setdefault(route, []).extend(ev)
                    hosts.setdefault(route, []).extend(host)
            os.environ.pop("CUFLASH_KVCACHE_FORWARD", None)
            os.environ.pop("CUFLASH_PAGED_DIRECT", None)
            os.environ.pop("CUFLASH_PAGED_ILV", None)
            dec, fwd, lib = min(res["0"]), min(res["1"]), min(res["lib"])
            diff = float((outs["0"] - outs["1"]).abs().max())
            row = dict(shape=shape, layout=layout, decode_ms=dec, forward_ms=fwd, lib_ms=lib, decode_runs=res["0"],
                       forward_runs=res["1"], lib_runs=res["lib"], fwd_over_dec=fwd / dec,
                       tflops_decode=flops / dec / 1e9, tflops_forward=flops / fwd / 1e9, max_diff=diff)
            line = ""
            if "1g" in res:
                gat, pan = min(res["1g"]), min(res["1o"])
                row.update(gather_ms=gat, gather_runs=res["1g"], direct_over_gather=fwd / gat,
                           direct_vs_gather_bits_equal=bool(torch.equal(outs["1"], outs["1g"])),
                           panels_ms=pan, panels_runs=res["1o"], panels_vs_gather_bits_equal=bool(
                               torch.equal(outs["1o"], outs["1g"])))
                line += (f"\n{'':>25} paged in place {fwd * 1e3:9.1f} us (a box a panel {pan * 1e3:9.1f})  after the "
                         f"gather {gat * 1e3:9.1f} us  in place / gather {fwd / gat:5.2f}  equal: "
                         f"{row['direct_vs_gather_bits_equal']} / {row['panels_vs_gather_bits_equal']}")
                if args.eager:
                    row.update(eager_gather_ms=statistics.median(eager["1g"]),
                               host_gather_ms=statistics.median(hosts["1g"]))
            if args.eager:
                med = {r: statistics.median(eager[r]) for r in eager}
                hmed = {r: statistics.median(hosts[r]) for r in hosts}
                row.update(eager_decode_ms=med["0"], eager_forward_ms=med["1"], eager_lib_ms=med["lib"],
                           host_decode_ms=hmed["0"], host_forward_ms=hmed["1"], host_lib_ms=hmed["lib"])
                line += (f"\n{'':>25} eager: decode {med['0'] * 1e3:9.1f} us  forward {med['1'] * 1e3:9.1f} us  "
                        f"fwd/dec {med['1'] / med['0']:5.2f}  lib {med['lib'] * 1e3:9.1f} us "
                        f"({med['lib'] / min(med['0'], med['1']):5.2f} of the faster)  host decode / forward / lib "
                        f"{hmed['0'] * 1e3:6.1f} / {hmed['1'] * 1e3:6.1f} / {hmed['lib'] * 1e3:6.1f} us"
                         + (f"  gather route {med['1g'] * 1e3:9.1f} us (host {hmed['1g'] * 1e3:6.1f})"
                            if "1g" in med else ""))
            out.append(row)
            print(f"{shape:>16} {layout:8} rows {sq * g:5d}  decode {dec * 1e3:9.1f} us  forward {fwd * 1e3:9.1f} us  "
                  f"fwd/dec {fwd / dec:5.2f}  lib {lib * 1e3:9.1f} us ({lib / min(dec, fwd):5.2f} of the faster)  "
                  f"({flops / dec / 1e9:4.0f} / {flops / fwd / 1e9:4.0f} TFLOP/s)  max|diff| {diff:.1e}{line}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), rows=out), f, indent=1)


if __name__ == "__main__":
    main()
