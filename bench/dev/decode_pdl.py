#!/usr/bin/env python3
"""Decode with and without programmatic dependent launch (cuflash/_launch.py PdlConfig), A/B in one
process: the same plans, their launches switched between modes (--modes), eager calls included (the
library itself launches PDL in graph captures only): "off" (cuLaunchKernel),
"inner" (cuLaunchKernelEx with the PDL attribute for every launch but a call's first: the kernels
that follow one of the call's own) and "all" (every launch).

Shapes: batch x cache x GQA group (32 query heads, head_dim 128, bf16, contiguous cache; suffix "p":
16-row pages; suffix "a": one new token appended per step (k, v given), the cache length held). Per
shape and mode: GPU time per call (CUDA events around --calls back-to-back calls queued behind a sleep
kernel, median of --rounds; --alternations passes over the modes), single eager calls (synchronize,
event, one call, event; --interleaved calls, the modes in turn call by call, median per mode), the
GPU time per replay of a CUDA graph of one call (and of one whose first node is a copy into q, a
kernel of the caller's that the call's first kernel follows), the host's time per call (200 back-to-back calls,
then one synchronize), and whether the modes' outputs are identical (and each graph's equal to an
eager call's up to rounding). cuDNN's SDPA (q (b, h, 1, d), k/v transposed views, enable_gqa) is
timed once per shape, as the yardstick.

Usage: python bench/dev/decode_pdl.py [--shapes 1x2048x8 16x512x8p ...] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from decode_splits import gpu_ms_per_call  # noqa: E402


def eager_ms(torch, fn, reps):
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        fn()
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1))
    return statistics.median(times)


_FORCE = [False]


def _force_pdl() -> None:
    """The library launches PDL in graph captures only (DecodePlan.run); this tool forces it on eager
    calls too, where set_pdl gave a launch its PdlConfig."""
    from cuflash import _kvcache

    real = _kvcache.run_launches

    def run_launches(plan, stream, ptrs, launches, what=None, pdl=True):
        return real(plan, stream, ptrs, launches, what, pdl or _FORCE[0])

    _kvcache.run_launches = run_launches


def set_pdl(mode: str) -> int:
    """Every decode plan's launches: "all" PDL, "inner" PDL but a call's first launch (the kernels
    that follow one of the call's own), "off" none, eager calls included; returns how many launches
    were set."""
    from cuflash import _kvcache
    from cuflash._launch import PdlConfig

    _FORCE[0] = mode != "off"

    n = 0
    for plan in _kvcache._DECODE_PLANS.values():
        for variant in (plan.graph, plan.eager):
            for launches in (variant[2], variant[3]):
                for i, L in enumerate(launches or ()):
                    on = mode == "all" or (mode == "inner" and i > 0)
                    L.pdl = PdlConfig(L.grid, L.threads, L.smem, L.fn, L.argv_ptr, cluster=L.cluster) if on else None
                    n += 1
    return n


def graph_us(torch, fn, replays=100, rounds=5):
    """GPU time per replay of a CUDA graph of one call (events around back-to-back replays)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    graph.replay()
    torch.cuda.synchronize()
    return gpu_ms_per_call(torch, graph.replay, replays, rounds) * 1e3, out, graph


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=[
        "1x512x1", "1x512x8", "1x2048x8", "1x2048x4", "4x512x4", "1x8192x8", "16x512x8", "4x2048x8",
        "1x2048x8p", "1x2048x8a", "16x8192x8", "64x2048x4"])
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--eager-reps", type=int, default=40)
    ap.add_argument("--alternations", type=int, default=2)
    ap.add_argument("--interleaved", type=int, default=600, help="single eager calls, the modes in turn")
    ap.add_argument("--modes", nargs="+", default=["off", "inner", "all"], choices=["off", "inner", "all"],
                    help="off: plain launches; inner: PDL but a call's first launch; all: every launch PDL")
    ap.add_argument("--json")
    args = ap.parse_args()

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import cuflash
    from cuflash import _launch

    _force_pdl()
    cc = torch.cuda.get_device_capability()
    print(f"device {torch.cuda.get_device_name()}, pdl_available {_launch.pdl_available(cc)}", flush=True)
    H, D = 32, 128
    rows = []
    for text in args.shapes:
        paged, append = text.endswith("p"), text.endswith("a")
        b, L, g = (int(x) for x in text.rstrip("pa").split("x"))
        hk = H // g
        torch.manual_seed(0)
        q = torch.randn(b, 1, H, D, device="cuda", dtype=torch.bfloat16)
        cap = L + (1 if append else 0)
        k = torch.randn(b, cap, hk, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(b, cap, hk, D, device="cuda", dtype=torch.bfloat16)
        cs = torch.full((b,), L, device="cuda", dtype=torch.int32)
        if paged:
            ps = 16
            nb = b * cap // ps
            perm = torch.randperm(nb, device="cuda")
            kp = k.reshape(nb, ps, hk, D)[perm.argsort()].contiguous()  # block perm[i] holds logical block i
            vp = v.reshape(nb, ps, hk, D)[perm.argsort()].contiguous()
            table = perm.reshape(b, cap // ps).to(torch.int32)
            fn = lambda: cuflash.attention_with_kvcache(q, kp, vp, cache_seqlens=cs, block_table=table, causal=True)
        elif append:
            kn = torch.randn(b, 1, hk, D, device="cuda", dtype=torch.bfloat16)
            vn = torch.randn(b, 1, hk, D, device="cuda", dtype=torch.bfloat16)
            fn = lambda: cuflash.attention_with_kvcache(q, k, v, kn, vn, cache_seqlens=cs, causal=True)
        else:
            fn = lambda: cuflash.attention_with_kvcache(q, k, v, cache_seqlens=cs, causal=True)
        fn()
        torch.cuda.synchronize()
        modes = args.modes
        outs, gpu, eag = {}, {m: [] for m in modes}, {m: [] for m in modes}
        for _ in range(args.alternations):
            for m in modes:
                set_pdl(m)
                gpu[m].append(gpu_ms_per_call(torch, fn, args.calls, args.rounds) * 1e3)
                eag[m].append(eager_ms(torch, fn, args.eager_reps) * 1e3)
                outs[m] = fn().clone()
        # single eager calls with the modes interleaved call by call (host noise hits all alike), and
        # the host's own time per call (back-to-back calls, one synchronize)
        inter = {m: [] for m in modes}
        host = {m: [] for m in modes}
        for i in range(args.interleaved):
            m = modes[i % len(modes)]
            set_pdl(m)
            inter[m].append(eager_ms(torch, fn, 1) * 1e3)
        for _ in range(3):
            for m in modes:
                set_pdl(m)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(200):
                    fn()
                host[m].append((time.perf_counter() - t0) / 200 * 1e6)
                torch.cuda.synchronize()
        same = all(torch.equal(outs[m], outs[modes[0]]) for m in modes)
        # a CUDA graph per mode: its replay time, and its output against an eager call's (the graph's
        # split count may differ from the eager one's: equal up to rounding)
        graph, graph_prev, graph_ok = {}, {}, True
        qsrc = q.clone()
        fn_prev = lambda: (q.copy_(qsrc), fn())[1]  # a kernel of the caller's writes q, then the call
        for m in modes:
            set_pdl(m)
            ref = fn().clone()
            graph[m], gout, _g = graph_us(torch, fn)
            graph_ok &= bool(torch.allclose(gout.float(), ref.float(), atol=2e-2, rtol=0))
            graph_prev[m], gout, _g = graph_us(torch, fn_prev)
            graph_ok &= bool(torch.allclose(gout.float(), ref.float(), atol=2e-2, rtol=0))
        # cuDNN's yardstick (no append, contiguous view)
        q4 = q.transpose(1, 2)
        k4, v4 = k[:, :L].transpose(1, 2), v[:, :L].transpose(1, 2)
        kw = {"enable_gqa": True} if g > 1 else {}
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            sd = lambda: F.scaled_dot_product_attention(q4, k4, v4, **kw)
            try:
                sd()
                cud = gpu_ms_per_call(torch, sd, args.calls, args.rounds) * 1e3
                cud_e = eager_ms(torch, sd, args.eager_reps) * 1e3
            except Exception as e:  # noqa: BLE001
                print(f"  cuDNN: {type(e).__name__}: {e}")
                cud = cud_e = float("nan")
        row = {"shape": text, "modes": modes, "gpu": gpu, "eager": eag,
               "eager_interleaved": {m: statistics.median(inter[m]) for m in modes}, "host": host,
               "graph": graph, "graph_after_copy": graph_prev, "same": same, "graph_ok": graph_ok, "cudnn_gpu": cud, "cudnn_eager": cud_e}
        rows.append(row)
        f = lambda xs: "/".join(f"{x:.1f}" for x in xs)
        print(f"{text:>11}: GPU us " + " ".join(f"{m} {f(gpu[m])}" for m in modes)
              + " | eager interleaved " + " ".join(f"{m} {statistics.median(inter[m]):.1f}" for m in modes)
              + " | graph " + " ".join(f"{m} {graph[m]:.1f}" for m in modes)
              + " | graph after a copy " + " ".join(f"{m} {graph_prev[m]:.1f}" for m in modes)
              + " | host " + " ".join(f"{m} {statistics.median(host[m]):.1f}" for m in modes)
              + f" | cuDNN {cud:.1f} / {cud_e:.1f} | same {same} graph {graph_ok}", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
