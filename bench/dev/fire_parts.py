#!/usr/bin/env python3
"""Why a split decode plan's Launch.fire costs more host time than an unsplit one's (bench/NOTES.md
session 52: 8.9 against 5.6 us back to back). Per shape (batch x cache x GQA group; 32 query heads,
head_dim 128, bf16, contiguous), the library's plan is made by one call, then its eager launches are
timed back to back (N calls after a sleep kernel, wall clock / N, median of rounds) in parts:
  fire      Launch.fire (patches, tensor maps, cuLaunchKernel)
  patch     the Python part of fire alone: pointer patches and the tensor maps' words (no launch)
  launch    the launch alone on the patched Params (cuLaunchKernel through ctypes, or the plan's
            cuLaunchKernelEx config where it has one)
  maps      the tensor maps' words alone (MapCache.get and the copy into the Params)
Usage: python bench/dev/fire_parts.py [--shapes 1x32768x4 4x512x1] [--calls 200] [--rounds 9]"""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from decode_splits import decode_inputs, eager_launch_ptrs  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["1x32768x4", "1x8192x1", "4x512x1", "16x512x8"])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    import numpy as np
    import torch

    import cuflash
    from cuflash import _kvcache, _launch

    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), flush=True)
    for shape in args.shapes:
        b, L, g = (int(x) for x in shape.split("x"))
        h, d, hk, q, kc, vc, seqlens = decode_inputs(torch, dev, b, L, g)
        _kvcache._FAST_PLANS.clear()
        _kvcache._DECODE_PLANS.clear()
        cuflash.attention_with_kvcache(q, kc, vc, cache_seqlens=seqlens)
        torch.cuda.synchronize()
        plan = next(iter(_kvcache._FAST_PLANS.values()))
        stream = torch.cuda.current_stream().cuda_stream
        out = torch.empty(b, 1, h, d, device=dev, dtype=q.dtype)
        ptrs, launches, splits, keep = eager_launch_ptrs(torch, plan, out, q, kc, vc, seqlens)
        x = launches[0]
        ptrs[_kvcache._D_SEQ] = plan.seq

        def fire():
            x.fire(stream, ptrs, False)

        def patch():
            words = x.words
            for word, slot, add in getattr(x, "patches", ()):
                words[word] = ptrs[slot] + add
            for word, slot, add, const, shift in getattr(x, "patched", ()):
                words[word] = (const + ((ptrs[slot] + add) >> shift)) & 0xFFFFFFFFFFFFFFFF
            for word, slot, add, cache in getattr(x, "maps", ()):
                words[word:word + 16] = np.frombuffer(cache.get(ptrs[slot] + add), dtype=np.uint64)

        def maps():
            words = x.words
            for word, slot, add, cache in getattr(x, "maps", ()):
                words[word:word + 16] = np.frombuffer(cache.get(ptrs[slot] + add), dtype=np.uint64)

        def launch():
            if x.ex is not None:
                x.ex.launch(stream)
            else:
                _launch._launch_kernel(x.fn, x.grid, 1, 1, x.threads, 1, 1, x.smem, stream, x.argv_ptr, 0)

        parts = dict(fire=fire, patch=patch, launch=launch, maps=maps)
        res = {k: [] for k in parts}
        for _ in range(args.rounds):
            for k, fn in parts.items():
                torch.cuda.synchronize()
                torch.cuda._sleep(int(args.calls * 100_000))
                t0 = time.perf_counter()
                for _ in range(args.calls):
                    fn()
                res[k].append((time.perf_counter() - t0) * 1e6 / args.calls)
                torch.cuda.synchronize()
        desc = (f"{x.name} grid {x.grid} threads {x.threads} smem {x.smem} patches "
                f"{len(getattr(x, 'patches', ()))}+{len(getattr(x, 'patched', ()))} maps {len(getattr(x, 'maps', ()))} "
                f"ex {x.ex is not None} splits {splits} fused {plan.eager[3] is not None}")
        print(f"== {shape}: {desc}")
        for k in parts:
            print(f"{shape:>10} {k:7} {statistics.median(res[k]):6.2f} us (min {min(res[k]):5.2f})", flush=True)


if __name__ == "__main__":
    main()
