"""Dev: the backward with ALiBi at bench_flex.py's shape (batch 2, seqlen 8192, 16 heads, head_dim 128,
bf16, causal) beside the plain causal backward, for Nsight Compute (only the profiled range), or
timed with CUDA events when run without it (--time).

ncu --profile-from-start off --clock-control none --section SpeedOfLight --section WarpStateStats \
    --section ComputeWorkloadAnalysis --section InstructionStats --csv --page details \
    python3 bench/dev/ncu_alibi_bwd.py
"""
import sys

import torch

import cuflash

b, s, h, d = 2, 8192, 16, 128
q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
slopes = torch.tensor([2.0 ** (-8 * (i + 1) / h) for i in range(h)], device="cuda", dtype=torch.float32)
runs = {}
for name, kw in (("plain", {}), ("alibi", {"alibi_slopes": slopes})):
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True, **kw)
    runs[name] = (lambda out=out, lse=lse, kw=kw: cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, **kw))
for f in runs.values():
    for _ in range(3):
        f()
torch.cuda.synchronize()
if "--time" in sys.argv:
    flops = 2.5 * 4 * b * h * s * s * d / 2
    for name, f in runs.items():
        ts = []
        for _ in range(20):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            f()
            e1.record()
            e1.synchronize()
            ts.append(e0.elapsed_time(e1))
        ms = sorted(ts)[len(ts) // 2]
        print(f"{name}: {ms:.3f} ms, {flops / ms / 1e9:.0f} TFLOP/s")
else:
    torch.cuda.profiler.start()
    for f in runs.values():
        f()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
