"""Dev: one decode step for Nsight Compute, cuflash's kernels beside SDPA-flash's and cuDNN's, only
the profiled range (torch.cuda.profiler.start / stop) after a warm-up. The cache is bench_decode's
default: (batch, cache, nheads_kv, 128) bf16, 32 query heads, SDPA on transposed views of it.

ncu --profile-from-start off --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis \
    --section WarpStateStats --section LaunchStats --section Occupancy --csv --page details \
    python3 bench/dev/ncu_decode.py [batch] [cache] [gqa] [num_splits] [stages] [page_size]

stages: the 4-warp kernel's pipeline depth (0 or absent: the library's; others compiled on the spot).
page_size: cuflash's cache seen as pages of that many rows in a random order (bench_decode's paged
layout; 0 or absent: contiguous).
"""
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import cuflash

batch = int(sys.argv[1]) if len(sys.argv) > 1 else 16
cache = int(sys.argv[2]) if len(sys.argv) > 2 else 8192
gqa = int(sys.argv[3]) if len(sys.argv) > 3 else 8
splits = int(sys.argv[4]) if len(sys.argv) > 4 else 0
stages = int(sys.argv[5]) if len(sys.argv) > 5 else 0
page = int(sys.argv[6]) if len(sys.argv) > 6 else 0
if stages:
    from cuflash import _config

    _config.decode_stages = lambda target, head_dim: stages
h, d = 32, 128
hk = h // gqa
q = torch.randn(batch, 1, h, d, device="cuda", dtype=torch.bfloat16)
kc, vc = (torch.randn(batch, cache, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
lens = torch.full((batch,), cache, device="cuda", dtype=torch.int32)
qt, kt, vt = q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)


paged = {}
if page:
    nb = batch * cache // page
    paged = dict(block_table=torch.randperm(nb, device="cuda").to(torch.int32).view(batch, cache // page))


def ours():
    if page:
        return cuflash.attention_with_kvcache(q, kc.view(nb, page, hk, d), vc.view(nb, page, hk, d),
                                              cache_seqlens=lens, num_splits=splits, **paged)
    return cuflash.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, num_splits=splits)


def peer(backend):
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=gqa > 1)


for _ in range(3):
    ours()
    peer(SDPBackend.FLASH_ATTENTION)
    peer(SDPBackend.CUDNN_ATTENTION)
torch.cuda.synchronize()
torch.cuda.profiler.start()
ours()
peer(SDPBackend.FLASH_ATTENTION)
peer(SDPBackend.CUDNN_ATTENTION)
torch.cuda.synchronize()
torch.cuda.profiler.stop()
