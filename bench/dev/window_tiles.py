"""The feature forward for a narrow window on Hopper: the sm_90a wgmma kernel and a sweep of mma.sync
tiles. Window (256, 0), causal, bf16, batch 2, seqlen 16384, 16 heads, head_dim 128; GPU time by
CUDA-graph replay of 20 calls (no host time), each kernel forced through
cuflash/_config.py:feat_fwd_config. Prints ms and the ratio to the plain causal forward."""
import torch

import cuflash
from cuflash import _config

T = _config.TileConfig


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
full = graph_ms(lambda: cuflash.attention(q, k, v, causal=True))
print(f"plain causal {full:.3f} ms")
orig = _config.feat_fwd_config
for cfg in (orig("sm_90a", 128, "bfloat16"), T(64, 64, 4), T(128, 64, 8), T(64, 32, 4), T(128, 32, 8)):
    _config.feat_fwd_config = lambda t, d, dt, narrow=False, c=cfg: c
    w = graph_ms(lambda: cuflash.attention(q, k, v, causal=True, window=(256, 0)))
    kind = "wgmma" if cfg.wgmma else "mma.sync"
    print(f"{kind} {cfg.block_m}x{cfg.block_n}x{cfg.warps}: window {w:.3f} ms, ratio {full / w:.2f}x")
_config.feat_fwd_config = orig
