"""Host time of one plain cuflash call (torch, requires_grad inputs, as bench.py times them): the
median wall time of a call with the GPU idle, and the cProfile top functions over 300 calls. Used to
check that the feature options add no host cost to plain calls. Usage: python bench/dev/host_profile.py"""
import cProfile
import pstats
import statistics
import time

import torch

import cuflash

for dtype in (torch.bfloat16, torch.float16):
    q, k, v = (torch.randn(32, 512, 16, 128, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    f = lambda: cuflash.attention(q, k, v, causal=True)  # noqa: E731
    for _ in range(20):
        f()
    ts = []
    for _ in range(200):
        torch.cuda.synchronize()
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    print(dtype, "host us per call (median of 200, GPU idle):", round(statistics.median(ts) * 1e6, 1))
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(300):
        f()
    torch.cuda.synchronize()
    pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(8)
