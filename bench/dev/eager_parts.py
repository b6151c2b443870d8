#!/usr/bin/env python3
"""Where a single eager decode call's time goes, part by part (issue 13: at 512-key caches cuDNN's
single call is 4.6-6.7 us shorter than cuflash's while their back-to-back host times per call are
within 1 us; bench/NOTES.md session 49).

Per shape (batch x cache x GQA group; 32 query heads, head_dim 128, bf16, contiguous), the variants
below run interleaved (a fresh random order every repetition), each as one single call on an idle
GPU: synchronize, start event, host clock, the call, host clock, end event, synchronize. Reported:
median (min) of the host's time inside the call and of the events' time, us.
  lib      cuflash.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens)
  runcall  the call's DecodePlan.run_fast(arrays) (run_call(names) on trees without it): no
           signature key, no plan lookup
  launch   _plan.run_launches of the plan's eager launches into a preallocated out (pointers made
           once): lock, device check, Params patch, cuLaunchKernel(Ex)
  fire     Launch.fire of those launches, nothing around it
  empty    torch.empty_like of out's template (the call's one allocation)
  key      the fast path's signature key and its plan lookup (attention_with_kvcache's first lines)
  nothing  no call (the probe's floor)
  cudnn    SDPA, cuDNN backend (its sdpa_kernel context entered once, outside the timing)
  flash    SDPA, flash backend (the same)
Then, per variant, host us per call back to back (N calls after a sleep kernel, wall clock / N).

Usage: python bench/dev/eager_parts.py [--shapes 4x512x1 ...] [--reps 300] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from decode_splits import decode_inputs, eager_launch_ptrs  # noqa: E402


def single_call_us(torch, fn):
    """(host us inside the call, CUDA-event us around it) of one call of fn on an idle GPU:
    synchronize, start event, host clock, the call, host clock, end event, synchronize."""
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    t0 = time.perf_counter()
    fn()
    t1 = time.perf_counter()
    e1.record()
    torch.cuda.synchronize()
    return (t1 - t0) * 1e6, e0.elapsed_time(e1) * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["4x512x1", "16x512x8", "1x2048x4", "16x2048x8"])
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--bb-calls", type=int, default=200)
    ap.add_argument("--json")
    args = ap.parse_args()

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import cuflash
    from cuflash import _kvcache, _plan

    dev = torch.device("cuda")
    name = torch.cuda.get_device_name()
    print(name, flush=True)
    out_rows = []
    for shape in args.shapes:
        b, L, g = (int(x) for x in shape.split("x"))
        h, d, hk, q, kc, vc, seqlens = decode_inputs(torch, dev, b, L, g)
        qt, kt, vt = q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)
        _kvcache._FAST_PLANS.clear()
        _kvcache._DECODE_PLANS.clear()

        def lib():
            return cuflash.attention_with_kvcache(q, kc, vc, cache_seqlens=seqlens)

        lib()
        torch.cuda.synchronize()
        plan = next(iter(_kvcache._FAST_PLANS.values()))
        names = dict(q=q, k_cache=kc, v_cache=vc, k=None, v=None, cache_seqlens=seqlens, cache_batch_idx=None,
                     block_table=None, sink_logits=None, alibi_slopes=None)
        ad = plan.ad
        tmpl = plan.templates[ad.lib]
        out_t = next(iter(tmpl.values()))
        out = torch.empty_like(out_t)
        ptrs, launches, splits, keep = eager_launch_ptrs(torch, plan, out, q, kc, vc, seqlens, names)
        arrs = (q, kc, vc, None, None, seqlens, None, None, None, None)  # (_kvcache._RUN_ARRAYS' order)
        stream = torch.cuda.current_stream().cuda_stream
        desc = f"splits {splits} launches {'/'.join(x.name for x in launches)}"

        def runcall():
            return plan.run_fast(arrs) if hasattr(plan, "run_fast") else plan.run_call(names)

        # The kernel writes ptrs[_D_SEQ] into the plan's `started` word: keep it at the plan's current
        # number, so that lib's next call still sees an idle stream (its busy test; DecodePlan.run).
        def launch():
            ptrs[_kvcache._D_SEQ] = plan.seq
            _plan.run_launches(plan, stream, ptrs, launches, None, False, False)

        def fire():
            ptrs[_kvcache._D_SEQ] = plan.seq
            for x in launches:
                x.fire(stream, ptrs, False)

        def empty():
            return torch.empty_like(out_t)

        keyer = _kvcache._KEYERS.get(q.__class__) or _kvcache._keyer(q)

        def key():  # the fast path's signature key and plan lookup, nothing else
            return _kvcache._FAST_PLANS.get(keyer(q, kc, vc, None, None, seqlens, None, None, False, None, False,
                                                  None, 0, None, None, None, 0))

        def nothing():
            return None

        def cudnn():
            return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=(g > 1))

        variants = dict(lib=lib, runcall=runcall, launch=launch, fire=fire, empty=empty, key=key, nothing=nothing,
                        cudnn=cudnn, flash=cudnn)
        ctxs = dict(cudnn=lambda: sdpa_kernel(SDPBackend.CUDNN_ATTENTION),
                    flash=lambda: sdpa_kernel(SDPBackend.FLASH_ATTENTION))
        host = {k: [] for k in variants}
        ev = {k: [] for k in variants}
        for k, fn in variants.items():
            with ctxs[k]() if k in ctxs else _null():
                for _ in range(10):
                    fn()
        torch.cuda.synchronize()
        order = list(variants)
        rng = random.Random(1)
        for _ in range(args.reps):
            rng.shuffle(order)
            for k in order:
                fn = variants[k]
                ctx = ctxs[k]() if k in ctxs else None
                if ctx is not None:
                    ctx.__enter__()
                h, e = single_call_us(torch, fn)
                if ctx is not None:
                    ctx.__exit__(None, None, None)
                host[k].append(h)
                ev[k].append(e)
        bb = {}
        for k, fn in variants.items():
            with ctxs[k]() if k in ctxs else _null():
                vals = []
                for _ in range(7):
                    torch.cuda.synchronize()
                    torch.cuda._sleep(int(args.bb_calls * 100_000))
                    t0 = time.perf_counter()
                    for _ in range(args.bb_calls):
                        fn()
                    vals.append((time.perf_counter() - t0) * 1e6 / args.bb_calls)
                    torch.cuda.synchronize()
                bb[k] = statistics.median(vals)
        print(f"== {shape}  ({desc})", flush=True)
        for k in variants:
            row = dict(shape=shape, variant=k, host_med=statistics.median(host[k]), host_min=min(host[k]),
                       ev_med=statistics.median(ev[k]), ev_min=min(ev[k]), bb_host=bb[k], desc=desc)
            out_rows.append(row)
            print(f"{shape:>10} {k:8} host {row['host_med']:6.1f} (min {row['host_min']:5.1f})  events "
                  f"{row['ev_med']:6.1f} (min {row['ev_min']:5.1f})  back-to-back host {row['bb_host']:6.1f} us",
                  flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=name, rows=out_rows), f, indent=1)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


if __name__ == "__main__":
    main()
