"""Dev: one decode step per cuflash plan variant beside SDPA-flash's and cuDNN's, for Nsight Compute
run twice, with its clocks locked to base (--clock-control base) and left free (none): does a plan's
time depend on the SM clock? (Session 53: the unsplit 128-block plans at 128k keys read 18 % slower
after SDPA flash's kernel, when the 700 W power cap had lowered the SM clock; split plans and cuDNN
did not.) bench_decode's cache: (batch, cache, nheads_kv, 128) bf16, 32 query heads.

ncu --profile-from-start off --clock-control base \
    --metrics gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second,dram__throughput.avg.pct_of_peak_sustained_elapsed \
    --csv python3 bench/dev/ncu_decode_clock.py BATCH CACHE GQA SPLITS:WARPS ...

SPLITS:WARPS: num_splits forced (0: the library's choice) and CUFLASH_DECODE_WARPS while the plan is
made (0: the library's); each variant needs a split count of its own (the library keeps one plan per
split count and reads CUFLASH_DECODE_WARPS only when it makes one). The profiled range holds one call of each variant in the order given, then
SDPA flash, then cuDNN; the variants' labels are printed to stderr in that order.
"""
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import cuflash

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import bench_decode as BD  # noqa: E402

batch, cache, gqa = sys.argv[1:4]
variants = [tuple(int(y) for y in v.split(":")) for v in (sys.argv[4:] or ["0:0"])]
if len({s for s, _w in variants}) < len(variants):  # one plan per split count (warps read as it is made)
    sys.exit(f"variants need split counts of their own: got {sys.argv[4:]}")
args = BD.parse_args(["--batches", batch, "--caches", cache, "--gqa", gqa])
(shape,) = BD.build_shapes(args)
T = BD.Tensors(torch, "cuda", args, shape)  # bench_decode's q, cache and lengths
q, kc, vc, lens = T.q, T.k, T.v, T.seqlens
qt, (kt, vt) = q.transpose(1, 2), T.sdpa_kv()
gqa = int(gqa)


def ours(splits):
    return cuflash.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, num_splits=splits)


def peer(backend):
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=gqa > 1)


for splits, warps in variants:  # each plan made under its CUFLASH_DECODE_WARPS
    os.environ["CUFLASH_DECODE_WARPS"] = str(warps)
    ours(splits)
os.environ.pop("CUFLASH_DECODE_WARPS")
for _ in range(3):
    for splits, _w in variants:
        ours(splits)
    peer(SDPBackend.FLASH_ATTENTION)
    peer(SDPBackend.CUDNN_ATTENTION)
torch.cuda.synchronize()
print("order: " + " ".join(f"cf{s}:{w}" for s, w in variants) + " sdpa_flash sdpa_cudnn", file=sys.stderr)
torch.cuda.profiler.start()
for splits, _w in variants:
    ours(splits)
peer(SDPBackend.FLASH_ATTENTION)
peer(SDPBackend.CUDNN_ATTENTION)
torch.cuda.synchronize()
torch.cuda.profiler.stop()
