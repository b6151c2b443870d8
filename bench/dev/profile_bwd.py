"""Dev: where the backward's time goes, per kernel (torch.profiler / CUPTI), H200.

PYTHONPATH=. python bench/dev/profile_bwd.py
"""
import torch
from torch.profiler import ProfilerActivity, profile

import cuflash

for d in (64, 128):
    h = 2048 // d
    b, s = 4, 4096
    q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    for causal in (False, True):
        out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
        for _ in range(3):
            cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                cuflash.attention(q, k, v, causal=causal)
                cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal)
            torch.cuda.synchronize()
        fl = 4 * b * h * s * s * d / (2 if causal else 1)
        print(f"--- d{d} causal={causal}: fwd FLOPs {fl / 1e9:.0f} G")
        for ev in prof.key_averages():
            if ev.device_time_total > 0 and ("flash" in ev.key or "bwd" in ev.key):
                ms = ev.device_time_total / ev.count / 1e3
                print(f"  {ev.key[:90]:90s} {ms:8.3f} ms")
