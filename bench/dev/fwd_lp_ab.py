"""O divided by the sum of the rounded P (cuda_src/softmax.cuh): accuracy and forward time for the
checkout on sys.path (CUFLASH_BENCH_PATH=<tree> runs an older one).

Accuracy: per dtype, the max and RMS error of out against float64, as a ratio to the naive in-dtype
computation's, over TRIALS fresh inputs, at: a tiny softcap (nearly equal scores, 2 and 4 keys), random
inputs, and values with a common offset (v + 3).
Time: the forward's GPU time (CUDA events around each call, median of REPS after a warm-up) at 16k
tokens, 2048 hidden (head_dim 64: 32 heads; 96: 21; 128: 16; 256: 8), and one decode step; at 1024 tokens
(head_dim 64, 128) also single eager calls, host included (synchronize, call, synchronize; wall time, median).
Env: ACC=0 skips accuracy; SEQS (default "1024 4096"); HDS (default "64 96 128 256")."""
import math
import os
import sys

if os.environ.get("CUFLASH_BENCH_PATH"):
    sys.path.insert(0, os.environ["CUFLASH_BENCH_PATH"])
import numpy as np
import torch

import cuflash as cf

print("cuflash from", cf.__file__)


def ref(q, k, v, softcap=0.0):
    qd, kd, vd = (x.double().transpose(1, 2) for x in (q, k, v))
    g = qd.shape[1] // kd.shape[1]
    kd, vd = kd.repeat_interleave(g, 1), vd.repeat_interleave(g, 1)
    s = qd @ kd.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    return (torch.softmax(s, -1) @ vd).transpose(1, 2)


def naive(q, k, v, softcap=0.0):
    qf, kf, vf = (x.float().transpose(1, 2) for x in (q, k, v))
    g = qf.shape[1] // kf.shape[1]
    kf, vf = kf.repeat_interleave(g, 1), vf.repeat_interleave(g, 1)
    s = (qf @ kf.transpose(-1, -2) / math.sqrt(q.shape[-1])).to(q.dtype).float()
    if softcap:
        s = (softcap * torch.tanh(s / softcap)).to(q.dtype).float()
    p = torch.softmax(s, -1).to(q.dtype).float()
    return (p @ vf).to(q.dtype).transpose(1, 2)


trials = int(os.environ.get("TRIALS", "40"))
if os.environ.get("ACC", "1") == "1":
    for dtype in (torch.bfloat16, torch.float16):
        for name, sk, cap, off in (("softcap1e-3 k2", 2, 1e-3, 0.0), ("softcap1e-3 k4", 4, 1e-3, 0.0),
                                   ("random k300", 300, 0.0, 0.0), ("v+3 k300", 300, 0.0, 3.0)):
            worst, se, sn = 0.0, 0.0, 0.0
            for i in range(trials):
                torch.manual_seed(9000 + i)
                q = torch.randn(16, 2, 4, 16, device="cuda", dtype=dtype)
                k = torch.randn(16, sk, 2, 16, device="cuda", dtype=dtype)
                v = (torch.randn(16, sk, 2, 16, device="cuda") + off).to(dtype)
                o = cf.attention(q, k, v, softcap=cap) if cap else cf.attention(q, k, v)
                r, n = ref(q, k, v, cap), naive(q, k, v, cap)
                e, en = (o.double() - r).abs(), (n.double() - r).abs()
                worst = max(worst, e.max().item() / en.max().item())
                se += (e ** 2).sum().item()
                sn += (en ** 2).sum().item()
            print(f"acc {str(dtype)[6:]:8s} {name:15s}: max-err ratio worst {worst:.2f}  rms ratio {math.sqrt(se / sn):.3f}")


def gpu_ms(f, reps=int(os.environ.get("REPS", "30"))):
    for _ in range(5):
        f()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        f()
        e1.record()
        torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1))
    return float(np.median(ts))


def eager_ms(f, reps=int(os.environ.get("REPS", "30"))):
    """One call with its host time: synchronize, call, synchronize; wall time, median."""
    import time

    for _ in range(3):
        f()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(ts))


for dtype in (torch.bfloat16, torch.float16):
    for hd in [int(x) for x in os.environ.get("HDS", "64 96 128 256").split()]:
        h = max(1, 2048 // hd)
        for s in [int(x) for x in os.environ.get("SEQS", "1024 4096").split()]:
            b = max(1, 16384 // s)
            q, k, v = (torch.randn(b, s, h, hd, device="cuda", dtype=dtype) for _ in range(3))
            for causal in (False, True):
                ms = gpu_ms(lambda: cf.attention(q, k, v, causal=causal))
                flops = 4 * b * h * s * s * hd / (2 if causal else 1)
                print(f"fwd {str(dtype)[6:]:8s} d{hd:<3d} b{b} s{s} h{h} causal={int(causal)}: {ms:.4f} ms "
                      f"{flops / ms / 1e9:.0f} TFLOP/s")
                if s == 1024 and hd in (64, 128):
                    ms = eager_ms(lambda: cf.attention(q, k, v, causal=causal))
                    print(f"eager {str(dtype)[6:]:8s} d{hd:<3d} b{b} s{s} h{h} causal={int(causal)}: {ms:.4f} ms")
            del q, k, v

kc = torch.randn(8, 8192, 8, 128, device="cuda", dtype=torch.bfloat16)
vc = torch.randn_like(kc)
qd = torch.randn(8, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
lens = torch.full((8,), 8192, device="cuda", dtype=torch.int32)
print(f"decode bf16 8x8192 h32/8 d128: {gpu_ms(lambda: cf.attention_with_kvcache(qd, kc, vc, cache_seqlens=lens)) * 1e3:.1f} us")
