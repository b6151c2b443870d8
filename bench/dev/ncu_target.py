"""Dev: one forward and one backward at the headline shape, for Nsight Compute to profile.

ncu --clock-control none --section SpeedOfLight --section WarpStateStats --section ComputeWorkloadAnalysis \
    --section MemoryWorkloadAnalysis -k regex:flash_ -c 4 python3 bench/dev/ncu_target.py
"""
import torch

import cuflash

b, s, h, d = 4, 4096, 16, 128
q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
out, lse = cuflash.attention(q, k, v, return_lse=True)           # compile + warm
cuflash.attention_backward(dout, q, k, v, out, lse)
torch.cuda.synchronize()
out, lse = cuflash.attention(q, k, v, return_lse=True)           # profiled
cuflash.attention_backward(dout, q, k, v, out, lse)
torch.cuda.synchronize()
