#!/usr/bin/env python3
"""Where the host time of attention_with_kvcache's chunk routes goes (torch, bf16, head_dim 128, 32 query
heads, causal): host us per call of the whole call on each route (CUFLASH_KVCACHE_FORWARD=0 / 1) and of
some parts alone (attention() with and without kv_lengths, torch allocations),
each the median of rounds of back-to-back calls (perf_counter around the calls; the GPU kept busy by a
sleep kernel so that no call waits for it), then a cProfile of the forward route's calls."""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from prefill_route import chunk_inputs  # noqa: E402

def host_us(torch, fn, calls=20, rounds=7):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(rounds):
        torch.cuda._sleep(int(calls * 2_000_000))  # ~1 ms a call queued: the host never waits for the GPU
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(out)


def stamps_report(torch, call, routes, n):
    """Single calls (each on an idle GPU) of each route, timed by phase with perf_counter stamps taken by
    wrappers of the library's launch helper (_kvcache.run_launches: each launch group's start and end) and
    of the torch adapter's run_forward: the median us from the call's start to each stamp."""
    from cuflash import _kvcache
    from cuflash._adapters import _torch

    stamps = []
    real_run, real_fwd = _kvcache.run_launches, _torch.TorchAdapter.run_forward

    def run_launches(plan, *a, **k):
        stamps.append((type(plan).__name__ + " launch", time.perf_counter()))
        real_run(plan, *a, **k)
        stamps.append((type(plan).__name__ + " launched", time.perf_counter()))

    def run_forward(self, *a, **k):
        stamps.append(("forward", time.perf_counter()))
        out = real_fwd(self, *a, **k)
        stamps.append(("forward launched", time.perf_counter()))
        return out

    _kvcache.run_launches, _torch.TorchAdapter.run_forward = run_launches, run_forward
    try:
        for route in routes:
            os.environ["CUFLASH_KVCACHE_FORWARD"] = route
            _kvcache._FAST_PLANS.clear()
            for _ in range(5):
                call()
            rows = {}
            for _ in range(n):
                torch.cuda.synchronize()
                stamps.clear()
                t0 = time.perf_counter()
                call()
                t1 = time.perf_counter()
                for i, (name, t) in enumerate(stamps):
                    rows.setdefault((i, name), []).append((t - t0) * 1e6)
                rows.setdefault((len(stamps), "return"), []).append((t1 - t0) * 1e6)
            print(f"route {route}: us from the call's start (median of {n} single calls)")
            for (i, name), v in sorted(rows.items()):
                print(f"  {name:28} {statistics.median(v):7.1f}")
    finally:
        _kvcache.run_launches, _torch.TorchAdapter.run_forward = real_run, real_fwd


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="4x8192x8x64", help="BxLxGxSQ")
    ap.add_argument("--paged", type=int, default=0, help="page size (0: contiguous)")
    ap.add_argument("--profile", type=int, default=200, help="calls profiled (0: none)")
    ap.add_argument("--single", nargs="*", default=[], help="routes (0 / 1) whose single calls are profiled")
    ap.add_argument("--single-calls", type=int, default=50)
    ap.add_argument("--stamps", nargs="*", default=[], help="routes (0 / 1) whose single calls are timed by phase")
    args = ap.parse_args()

    import torch

    import cuflash
    from cuflash import _kvcache

    b, L, g, sq = (int(x) for x in args.shape.split("x"))
    dev = torch.device("cuda")
    h, d, hk, q, kc, vc, kn, vn, seqlens = chunk_inputs(torch, dev, b, L, g, sq)
    kw = dict(k_cache=kc, v_cache=vc)
    if args.paged:
        nblk = b * L // args.paged
        kw = dict(k_cache=kc.view(nblk, args.paged, hk, d), v_cache=vc.view(nblk, args.paged, hk, d),
                  block_table=torch.randperm(nblk, device=dev, dtype=torch.int32).view(b, L // args.paged))
    def call():
        return cuflash.attention_with_kvcache(q, k=kn, v=vn, cache_seqlens=seqlens, causal=True, **kw)

    lengths = torch.full((b,), L, device=dev, dtype=torch.int32)
    kg = torch.empty(b * L, hk, d, device=dev, dtype=torch.bfloat16)
    parts = {
        "attention(kv_lengths)": lambda: cuflash.attention(q, kc, vc, True, kv_lengths=lengths),
        "attention()": lambda: cuflash.attention(q, kc, vc, True),
        "torch.empty of the padded copy": lambda: torch.empty_like(kg),
        "torch.empty of the lengths": lambda: torch.empty(b, device=dev, dtype=torch.int32),
    }
    print(f"{args.shape} paged {args.paged}: host us a call (median of rounds of back-to-back calls)")
    for route in ("0", "1"):
        os.environ["CUFLASH_KVCACHE_FORWARD"] = route
        _kvcache._FAST_PLANS.clear()
        _kvcache._DECODE_PLANS.clear()
        print(f"  whole call, route {route}: {host_us(torch, call):8.1f}")
    for name, fn in parts.items():
        print(f"  {name:28}: {host_us(torch, fn):8.1f}")
    for route in args.single:
        # Single calls, each on an idle GPU (synchronized before it): the profiler on around the call alone.
        os.environ["CUFLASH_KVCACHE_FORWARD"] = route
        _kvcache._FAST_PLANS.clear()
        for _ in range(5):
            call()
        pr = cProfile.Profile()
        walls = []
        for _ in range(args.single_calls):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            pr.enable()
            call()
            pr.disable()
            walls.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
        print(f"single calls, route {route}: {args.single_calls} calls, median {statistics.median(walls):.1f} us "
              "(profiled)")
        st = pstats.Stats(pr, stream=sys.stdout)
        st.sort_stats("cumulative").print_stats(30)
    if args.stamps:
        stamps_report(torch, call, args.stamps, args.single_calls)
    if args.profile:
        os.environ["CUFLASH_KVCACHE_FORWARD"] = "1"
        for _ in range(5):
            call()
        torch.cuda.synchronize()
        torch.cuda._sleep(int(args.profile * 2_000_000))
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(args.profile):
            call()
        pr.disable()
        torch.cuda.synchronize()
        st = pstats.Stats(pr, stream=sys.stdout)
        st.sort_stats("tottime").print_stats(25)
        st.sort_stats("cumulative").print_stats(40)


if __name__ == "__main__":
    main()
