#!/usr/bin/env python3
"""Why single eager decode calls ran slower with programmatic dependent launch (session 15): per
shape, single calls (synchronize, then the call) timed with CUDA events and with the host clock
(perf_counter around the call and a synchronize), the launch modes interleaved call by call:
  off    plain launches;
  pdl    every launch PDL (forced, as bench/dev/decode_pdl.py "all");
  rule   PDL only where cudaStreamQuery says the stream still has work (counted: how often);
  ev-    as pdl, but without the event recorded before the call (host clock only).
Also the host cost of one cudaStreamQuery / cudaStreamIsCapturing call.

Usage: python bench/dev/pdl_eager_probe.py [--shapes 1x512x1 ...] [--reps 600]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import decode_pdl  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["1x512x1", "1x2048x8", "4x512x4", "1x8192x8"])
    ap.add_argument("--reps", type=int, default=600)
    args = ap.parse_args()

    import torch
    from cupy_backends.cuda.api import runtime

    import cuflash
    from cuflash import _kvcache

    stream0 = torch.cuda.current_stream().cuda_stream
    t0 = time.perf_counter()
    for _ in range(10000):
        runtime.streamQuery(stream0)
    q_us = (time.perf_counter() - t0) / 10000 * 1e6
    t0 = time.perf_counter()
    for _ in range(10000):
        runtime.streamIsCapturing(stream0)
    c_us = (time.perf_counter() - t0) / 10000 * 1e6
    print(f"device {torch.cuda.get_device_name()}; stream {stream0}; host us per streamQuery {q_us:.2f}, "
          f"streamIsCapturing {c_us:.2f}", flush=True)

    mode = ["off"]
    busy_count = {True: 0, False: 0}
    real = _kvcache.run_launches

    def busy(stream):
        try:
            return runtime.streamQuery(stream) != 0
        except runtime.CUDARuntimeError as e:
            return e.status == 600

    def run_launches(plan, stream, ptrs, launches, what=None, pdl=True):
        m = mode[0]
        if m == "rule":
            pdl = busy(stream)
            busy_count[pdl] += 1
        else:
            pdl = m in ("pdl", "ev-")
        return real(plan, stream, ptrs, launches, what, pdl)

    _kvcache.run_launches = run_launches
    H, D = 32, 128
    modes = ["off", "pdl", "rule", "ev-"]
    for text in args.shapes:
        b, L, g = (int(x) for x in text.split("x"))
        hk = H // g
        q = torch.randn(b, 1, H, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, L, hk, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(b, L, hk, D, device="cuda", dtype=torch.bfloat16)
        cs = torch.full((b,), L, device="cuda", dtype=torch.int32)
        fn = lambda: cuflash.attention_with_kvcache(q, k, v, cache_seqlens=cs, causal=True)
        fn()
        decode_pdl.set_pdl("all")  # every launch has its PdlConfig; run_launches above picks per mode
        ev = {m: [] for m in modes}
        wall = {m: [] for m in modes}
        busy_count[True] = busy_count[False] = 0
        for i in range(args.reps):
            m = modes[i % len(modes)]
            mode[0] = m
            torch.cuda.synchronize()
            if m != "ev-":
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                w0 = time.perf_counter()
                e0.record()
                fn()
                e1.record()
                torch.cuda.synchronize()
                w1 = time.perf_counter()
                ev[m].append(e0.elapsed_time(e1) * 1e3)
            else:
                w0 = time.perf_counter()
                fn()
                torch.cuda.synchronize()
                w1 = time.perf_counter()
            wall[m].append((w1 - w0) * 1e6)
        med = lambda xs: statistics.median(xs) if xs else float("nan")
        print(f"{text:>9}: events " + " ".join(f"{m} {med(ev[m]):.1f}" for m in modes if ev[m])
              + " | host clock " + " ".join(f"{m} {med(wall[m]):.1f}" for m in modes)
              + f" | rule chose PDL {busy_count[True]} of {busy_count[True] + busy_count[False]}", flush=True)


if __name__ == "__main__":
    main()
