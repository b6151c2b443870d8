#!/usr/bin/env python3
"""Dev: the decode plans cuflash makes for bench_decode's shapes, without a GPU. A stand-in device
(compute capability 9.0, SM_COUNT SMs, peak memory bandwidth BW; every layout taken as one that
tensor maps describe; no programmatic dependent launch) and hand-made ArrayInfo objects (bf16 caches of bench_decode's
layout: (batch, cache, nheads_kv, 128), contiguous, or 16-row pages with a block table) go through
describe_kvcache and DecodePlan as a call would; the script prints each plan's kernel (warps, TMA,
stages), split count for eager calls and for CUDA graphs, blocks and waves at one block per SM.

Usage: python bench/dev/decode_plans.py [--batches 1 4 16 64 256] [--caches 512 2048 8192 32768 131072]
       [--gqa 1 4 8] [--paged] [--sm-count 132] [--bw 4.8e12]"""
from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from cuflash import _compile, _gpu, _kvcache, _launch, _tma  # noqa: E402
from cuflash._call import ArrayInfo  # noqa: E402


class _Loaded:
    ptr = 1


def install_stand_in(sm_count: int, bw: float) -> None:
    """A Hopper the planner can ask: capability, SMs, bandwidth, kernels and tensor maps."""
    _gpu.compute_capability = lambda device_id: (9, 0)
    _gpu.peak_memory_bandwidth = lambda device_id: bw
    _kvcache._sm_count = lambda device_id: sm_count
    _compile.get_function = lambda spec, target, device_id, smem: _Loaded()
    _launch.pdl_available = lambda cc: False
    _tma.available = lambda: True

    # Every cache layout takes tensor maps (the planner asks layout_patch whether a map's pointer
    # word is known; a plan's maps are encoded at its calls, which this script never makes).
    patch = _tma.MapPatch(bytes(128), 1, 0, 4)  # a map's 16 words, its address word stood in
    _tma.layout_patch = lambda shape, strides, rows, dtype, panels=1: patch


def info(shape, dtype="bfloat16", strides=None):
    if strides is None:
        strides, acc = [], 1
        for n in reversed(shape):
            strides.append(acc)
            acc *= n
        strides = tuple(reversed(strides))
    return ArrayInfo("torch", tuple(shape), tuple(strides), dtype, ("cuda", 0), True, "torch.Tensor")


def plan_of(batch: int, cache: int, gqa: int, paged: bool, nheads: int = 32, d: int = 128, page: int = 16):
    hk = nheads // gqa
    q = info((batch, 1, nheads, d))
    if paged:
        blocks = batch * -(-cache // page)
        kc = info((blocks, page, hk, d))
        table = info((batch, -(-cache // page)), "int32")
    else:
        kc, table = info((batch, cache, hk, d)), None
    seqlens = info((batch,), "int32")
    c = _kvcache.describe_kvcache(q, kc, kc, None, None, seqlens, block_table=table)
    infos = dict(q=q, k_cache=kc, v_cache=kc, k=None, v=None, cache_batch_idx=None, block_table=table,
                 sink_logits=None, alibi_slopes=None, cache_seqlens=seqlens)
    return _kvcache.DecodePlan(c, infos, 0)


def describe(plan) -> str:
    def kernels(variant):
        splits, _scratch, main, fused = variant
        launches = fused if fused is not None else main
        decode = next(L for L in launches if L.name.startswith("decode_") and "combine" not in L.name)
        waves = decode.grid / describe.sm_count
        rest = [L.name for L in launches if L is not decode]
        return (f"splits {splits:3d} {decode.name:28s} {decode.grid:6d} blocks ({waves:5.2f} waves)"
                + (" fused" if fused is not None else "") + (f" + {', '.join(rest)}" if rest else ""))

    return kernels(plan.eager) + ("" if plan.graph is plan.eager else " | graph: " + kernels(plan.graph))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    p.add_argument("--caches", type=int, nargs="+", default=[512, 2048, 8192, 32768, 131072])
    p.add_argument("--gqa", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--paged", action="store_true", help="16-row pages with a block table")
    p.add_argument("--sm-count", type=int, default=132)
    p.add_argument("--bw", type=float, default=4.8e12, help="peak memory bandwidth, bytes/s")
    a = p.parse_args()
    install_stand_in(a.sm_count, a.bw)
    describe.sm_count = a.sm_count
    for b in a.batches:
        for L in a.caches:
            for g in a.gqa:
                try:
                    plan = plan_of(b, L, g, a.paged)
                except Exception as e:  # a shape the planner refuses: say so and go on
                    print(f"{b:4d} x {L:6d} x {g}: {type(e).__name__}: {e}")
                    continue
                print(f"{b:4d} x {L:6d} x {g}: {describe(plan)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
