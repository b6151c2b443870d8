"""Dev (session 22): the backward's row-wise kernels of this tree, per-kernel GPU time (torch.profiler),
bf16 and fp16, head_dim 64 / 128, 16k tokens x hidden 2048 (FlashAttention-2's grid), seqlen 2048.
Run once per tree (PYTHONPATH), alternating, to compare trees: the kernels' names are equal.

PYTHONPATH=TREE python bench/dev/bwd_pre_ab.py LABEL
"""
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import cuflash

label = sys.argv[1]
for dtype in (torch.bfloat16, torch.float16):
    for d in (64, 128):
        s, h = 2048, 2048 // d
        b = 16384 // s
        q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=dtype) for _ in range(4))
        out, lse = cuflash.attention(q, k, v, return_lse=True)
        ref = cuflash.attention_backward(dout, q, k, v, out, lse)
        for _ in range(3):
            cuflash.attention_backward(dout, q, k, v, out, lse)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                cuflash.attention_backward(dout, q, k, v, out, lse)
            torch.cuda.synchronize()
        parts = []
        for ev in prof.key_averages():
            if ev.device_time_total > 0:
                kind = "pre" if "preprocess" in ev.key else "conv" if "convert" in ev.key else "main" if "bwd" in ev.key else ev.key[:20]
                parts.append(f"{kind} {ev.device_time_total / ev.count:.1f}")
        print(f"{label} {str(dtype)[6:]} d{d}: " + ", ".join(sorted(parts)), flush=True)
