#!/usr/bin/env python3
"""Dev: the decode plans cuflash makes for bench_decode's shapes, without a GPU. A stand-in device
(tests/_decode_stand_in.py: compute capability 9.0, SM_COUNT SMs, peak memory bandwidth BW) and
hand-made array descriptions of bench_decode's layout (bf16 caches (batch, cache, nheads_kv, 128),
contiguous, or 16-row pages with a block table) go through describe_kvcache and DecodePlan as a call
would; the script prints each plan's kernel (warps, TMA,
stages), split count for eager calls and for CUDA graphs, blocks and waves at one block per SM.

Usage: python bench/dev/decode_plans.py [--batches 1 4 16 64 256] [--caches 512 2048 8192 32768 131072]
       [--gqa 1 4 8] [--paged] [--sm-count 132] [--bw 4.8e12]"""
from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]  # cuflash, and the stand-in the tests use

from _decode_stand_in import decode_launch, install_stand_in, stand_in_plan  # noqa: E402


def describe(plan) -> str:
    def kernels(variant):
        splits, _scratch, main, fused = variant
        launches = fused if fused is not None else main
        decode, _fused = decode_launch(variant)
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
    install_stand_in(setattr, a.sm_count, a.bw)
    describe.sm_count = a.sm_count
    for b in a.batches:
        for L in a.caches:
            for g in a.gqa:
                try:
                    plan = stand_in_plan(b, L, g, a.paged)
                except Exception as e:  # a shape the planner refuses: say so and go on
                    print(f"{b:4d} x {L:6d} x {g}: {type(e).__name__}: {e}")
                    continue
                print(f"{b:4d} x {L:6d} x {g}: {describe(plan)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
