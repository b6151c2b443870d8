"""Sliding window (256, 0) on Hopper, forward: how much of a call is host time. bf16, batch 2,
seqlen 16384, 16 heads, head_dim 128, causal. Prints per call: host time (perf_counter over 100
calls, no sync), the CUDA-event median of back-to-back calls (bench.py's way), and the GPU time of
a CUDA-graph replay of 20 calls (no host work), for the plain causal call and the window, with the
wgmma and the mma.sync feature kernels (cuflash/_config.py:feat_fwd_config patched)."""
import statistics
import time

import torch

import cuflash
from cuflash import _config


def event_ms(fn, reps=50):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, b in evs:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in evs)


def host_us(fn, n=100):
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return host


def graph_ms(fn, n=20):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n):
            fn()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(5):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / (5 * n)


q, k, v = (torch.randn(2, 16384, 16, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
plain = lambda: cuflash.attention(q, k, v, causal=True)  # noqa: E731
print(f"plain causal: host {host_us(plain):.0f} us, events {event_ms(plain):.3f} ms, graph {graph_ms(plain):.3f} ms")
orig = _config.feat_fwd_config
mma = lambda t, d, dt: _config.fwd_config(_config.family_of_target(t), d, dt, True)  # noqa: E731
for label, cfg in (("wgmma", orig), ("mma.sync", mma)):
    _config.feat_fwd_config = cfg
    win = lambda: cuflash.attention(q, k, v, causal=True, window=(256, 0))  # noqa: E731
    print(f"window {label}: host {host_us(win):.0f} us, events {event_ms(win):.3f} ms, graph {graph_ms(win):.3f} ms")
_config.feat_fwd_config = orig
