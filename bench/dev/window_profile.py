"""Dev: where a narrow window's time goes. bf16, batch 2, seqlen 16384, 16 heads, head_dim 128.

1. Forward time against the window's width (left = 0 .. 1024, right = 0), CUDA-graph replay: a
   straight line time = a + b * tiles separates the per-block fixed cost from the per-tile cost.
2. The backward of window (256, 0) and of full causal, per kernel (torch.profiler).

PYTHONPATH=. python3 bench/dev/window_profile.py [--ncu | --fwd | --bwd]
(--ncu: one forward + backward only; --fwd / --bwd: the forward / backward part only)
"""
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import cuflash
from graph_time import graph_ms

B, S, H, D = 2, 16384, 16, 128
q, k, v, dout = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))

if "--ncu" in sys.argv:
    for _ in range(2):
        out, lse = cuflash.attention(q, k, v, causal=True, window=(256, 0), return_lse=True)
        cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, window=(256, 0))
    torch.cuda.synchronize()
    sys.exit(0)


full = graph_ms(lambda: cuflash.attention(q, k, v, causal=True))
print(f"plain causal fwd {full:.3f} ms")
for left in (() if "--bwd" in sys.argv else (0, 64, 128, 256, 512, 1024)):
    w = graph_ms(lambda: cuflash.attention(q, k, v, causal=True, window=(left, 0)))
    tiles = left // 64 + 1
    print(f"fwd window ({left:4d}, 0): {w:.3f} ms, {tiles:2d} tiles/block of 64, ratio {full / w:.2f}x")

if "--fwd" in sys.argv:
    sys.exit(0)

out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
wout, wlse = cuflash.attention(q, k, v, causal=True, window=(256, 0), return_lse=True)
fb = graph_ms(lambda: cuflash.attention_backward(dout, q, k, v, out, lse, causal=True))
wb = graph_ms(lambda: cuflash.attention_backward(dout, q, k, v, wout, wlse, causal=True, window=(256, 0)))
print(f"bwd: causal {fb:.3f} ms, window (256, 0) {wb:.3f} ms, ratio {fb / wb:.2f}x")
for left in (0, 64, 128, 512):
    o2, l2 = cuflash.attention(q, k, v, causal=True, window=(left, 0), return_lse=True)
    t = graph_ms(lambda: cuflash.attention_backward(dout, q, k, v, o2, l2, causal=True, window=(left, 0)))
    print(f"bwd window ({left:4d}, 0): {t:.3f} ms")

for name, kw, o, l in (("window", dict(window=(256, 0)), wout, wlse), ("causal", {}, out, lse)):
    for _ in range(2):
        cuflash.attention_backward(dout, q, k, v, o, l, causal=True, **kw)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            cuflash.attention_backward(dout, q, k, v, o, l, causal=True, **kw)
        torch.cuda.synchronize()
    print(f"--- bwd {name}, per kernel")
    for ev in prof.key_averages():
        if ev.device_time_total > 0:
            print(f"  {ev.key[:100]:100s} {ev.device_time_total / ev.count / 1e3:8.3f} ms x{ev.count // 5}")
