"""Dev: the backward at one shape for Nsight Compute, cuflash's kernels beside cuDNN's (SDPA's cuDNN
backend), only the profiled range (torch.cuda.profiler.start / stop) after a warm-up.

ncu --profile-from-start off --clock-control none --section SpeedOfLight --section WarpStateStats \
    --section ComputeWorkloadAnalysis --section LaunchStats --section Occupancy --csv --page details \
    python3 bench/dev/ncu_bwd.py [head_dim] [seqlen] [causal]
"""
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import cuflash

d = int(sys.argv[1]) if len(sys.argv) > 1 else 128
s = int(sys.argv[2]) if len(sys.argv) > 2 else 8192
causal = len(sys.argv) > 3 and sys.argv[3] == "causal"
h, b = 2048 // d, 16384 // s
q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
    o2 = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
for _ in range(2):
    cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal)
    torch.autograd.grad(o2, (qt, kt, vt), dout.transpose(1, 2), retain_graph=True)
torch.cuda.synchronize()
torch.cuda.profiler.start()
cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal)
torch.autograd.grad(o2, (qt, kt, vt), dout.transpose(1, 2), retain_graph=True)
torch.cuda.synchronize()
torch.cuda.profiler.stop()
