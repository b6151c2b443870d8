"""Dev: one forward for Nsight Compute, cuflash's kernel beside SDPA cuDNN's, only the profiled range
(torch.cuda.profiler.start / stop) after a warm-up. FlashAttention-2's grid shape: 16k tokens, hidden
2048 (heads = 2048 // head_dim), bf16, inputs not requiring grad.

ncu --profile-from-start off --clock-control none --section SpeedOfLight --section WarpStateStats \
    --section ComputeWorkloadAnalysis --section Occupancy --csv --page details \
    python3 bench/dev/ncu_fwd.py [seqlen] [head_dim] [causal 0/1]
"""
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import cuflash

s = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
d = int(sys.argv[2]) if len(sys.argv) > 2 else 128
causal = len(sys.argv) > 3 and sys.argv[3] == "1"
b, h = 16384 // s, 2048 // d
q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


def ours():
    return cuflash.attention(q, k, v, causal=causal)


def cudnn():
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)


for _ in range(3):
    ours()
    cudnn()
torch.cuda.synchronize()
torch.cuda.profiler.start()
ours()
cudnn()
torch.cuda.synchronize()
torch.cuda.profiler.stop()
