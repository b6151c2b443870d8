"""Dev: the backward at bench.py's (batch 32, seqlen 512, 32 heads, head_dim 64, causal) point, kernel by
kernel (torch.profiler), bf16 against fp16, cuflash against SDPA-flash; plus the event-timed whole call.
The one point of the grid where eager cuflash trailed SDPA-flash (issue 11).

PYTHONPATH=. python bench/dev/bwd512_prof.py [--seqlen 512 --head-dim 64]
"""
import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

import cuflash

p = argparse.ArgumentParser()
p.add_argument("--seqlen", type=int, default=512)
p.add_argument("--head-dim", type=int, default=64)
p.add_argument("--causal", type=int, default=1)
a = p.parse_args()
s, d = a.seqlen, a.head_dim
h = 2048 // d
b = 16384 // s
causal = bool(a.causal)
flops = 4 * 2.5 * b * h * s * s * d / (2 if causal else 1)


def events(fn, reps=50):
    for _ in range(5):
        fn()
    ts = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        fn()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1))
    ts.sort()
    return ts[len(ts) // 2]


for dt in (torch.bfloat16, torch.float16):
    q, k, v, do = (torch.randn(b, s, h, d, device="cuda", dtype=dt) for _ in range(4))
    out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
    qt, kt, vt, dot = (x.transpose(1, 2) for x in (q, k, v, do))
    qt_, kt_, vt_ = (x.detach().requires_grad_() for x in (qt, kt, vt))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        ot = F.scaled_dot_product_attention(qt_, kt_, vt_, is_causal=causal)

    def ours():
        cuflash.attention_backward(do, q, k, v, out, lse, causal=causal)

    def sdpa():
        torch.autograd.grad(ot, (qt_, kt_, vt_), dot, retain_graph=True)

    for name, fn in (("cuflash", ours), ("sdpa_flash", sdpa)):
        ms = events(fn)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
        print(f"--- {dt} {name}: event median {ms:.4f} ms = {flops / ms / 1e9:.1f} TFLOP/s (bwd = 2.5 x fwd FLOPs)")
        tot = 0.0
        for ev in prof.key_averages():
            if ev.device_time_total > 0:
                us = ev.device_time_total / ev.count
                tot += us * ev.count / 20
                print(f"  {ev.key[:100]:100s} {us:9.2f} us x {ev.count // 20}")
        print(f"  kernels' sum per call {tot:.2f} us")
