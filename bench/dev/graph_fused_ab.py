"""CUDA-graph replay time of decode steps captured on a stream that has run eager calls (so the fused
combine's counters exist there and a captured call may take the fused merge), for A / B of
CUFLASH_DECODE_GRAPH_FUSED_MAX_PARTS (set it in the environment; read at import). bf16, 32 query heads,
head_dim 128, contiguous cache; µs per step, median of 7 replays of a 20-call graph."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import cuflash
from cuflash import _config

print("graph fused limit", _config.DECODE_GRAPH_FUSED_MAX_PARTS, "eager", _config.DECODE_FUSED_MAX_PARTS)
for shape in sys.argv[1:] or ["1x512x8", "1x1024x8", "1x2048x4", "1x2048x8", "4x2048x8", "1x8192x4", "4x8192x8"]:
    b, L, g = (int(x) for x in shape.split("x"))
    q = torch.randn(b, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    kc, vc = (torch.randn(b, L, 32 // g, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    sl = torch.full((b,), L, device="cuda", dtype=torch.int32)
    fn = lambda: cuflash.attention_with_kvcache(q, kc, vc, cache_seqlens=sl)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gr, stream=s):
        for _ in range(20):
            fn()
    gr.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(7):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record(); gr.replay(); e1.record(); torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) / 20 * 1e3)
    print(f"{shape:10s} {sorted(ts)[3]:7.2f} us")
