#!/usr/bin/env python3
"""Where a single eager decode call's time goes (issue 13: single eager calls read 1.05x cuDNN's
geomean in session 43's grid, up to 1.6x at batch 1, where the GPU time is at par).

Per shape (batch x cache x GQA group; 32 query heads, head_dim 128, bf16, contiguous) and variant
(environment switches read when a decode plan is made; the plans are made anew per variant, and the
variants run one after another), R single calls on an idle GPU: synchronize, start event, host clock, the call, host clock, end
event, synchronize. Reported medians: the host's time inside the call (us), the events' time (us),
and the GPU time per call back-to-back (decode_splits.gpu_ms_per_call). cuDNN's SDPA (k/v
transposed views, enable_gqa) is measured the same way.

Usage: python bench/dev/eager_probe.py [--shapes 1x2048x8 ...] [--reps 200]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from decode_splits import decode_inputs, gpu_ms_per_call  # noqa: E402
from eager_parts import single_call_us  # noqa: E402

VARIANTS = {
    "lib": {},
    "nocluster": {"CUFLASH_DECODE_CLUSTER": "0"},
    "nofused": {"CUFLASH_DECODE_FUSED_COMBINE": "0"},
    "nopdl": {"CUFLASH_PDL": "0"},
    "split1": "split1",
    "fused128": ("DECODE_FUSED_MAX_PARTS", 128),
    "fused512": ("DECODE_FUSED_MAX_PARTS", 512),
}
SWITCHES = ("CUFLASH_DECODE_CLUSTER", "CUFLASH_DECODE_FUSED_COMBINE", "CUFLASH_PDL")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["1x2048x8", "1x32768x4", "16x512x1", "4x512x8", "1x8192x8",
                                                    "16x512x8", "1x512x1"])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--profile", action="store_true",
                    help="instead: each shape's library call under cProfile, --reps single calls (a synchronize "
                         "between calls, outside the profile's count only by its own rows), the top functions")
    args = ap.parse_args()

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import cuflash
    from cuflash import _config, _kvcache

    fused_default = _config.DECODE_FUSED_MAX_PARTS

    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), flush=True)
    for shape in args.shapes:
        b, L, g = (int(x) for x in shape.split("x"))
        h, d, hk, q, kc, vc, seqlens = decode_inputs(torch, dev, b, L, g)
        qt = q.transpose(1, 2)
        kt, vt = kc.transpose(1, 2), vc.transpose(1, 2)

        def cudnn():  # (timed inside one sdpa_kernel context: entering it per call costs host time)
            return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=(g > 1))

        if args.profile:
            import cProfile
            import pstats

            fn = (lambda: cuflash.attention_with_kvcache(q, kc, vc, cache_seqlens=seqlens))
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
            prof = cProfile.Profile()
            for _ in range(args.reps):
                torch.cuda.synchronize()
                prof.enable()
                fn()
                prof.disable()
            torch.cuda.synchronize()
            print(f"==== {shape}: {args.reps} single calls", flush=True)
            pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(22)
            continue
        # The variants one after another: each sets its switches and makes its plans anew.
        rows = []
        for name in list(args.variants) + ["cudnn"]:
            if name == "cudnn":
                fn = cudnn
            else:
                env = VARIANTS[name]
                for s in SWITCHES:
                    os.environ.pop(s, None)
                if isinstance(env, dict):
                    os.environ.update(env)
                _config.DECODE_FUSED_MAX_PARTS = fused_default
                if isinstance(env, tuple):  # a _config limit (read when a plan is made)
                    setattr(_config, *env)
                _kvcache._FAST_PLANS.clear()
                _kvcache._DECODE_PLANS.clear()
                ns = 1 if env == "split1" else 0
                fn = (lambda ns=ns: cuflash.attention_with_kvcache(q, kc, vc, cache_seqlens=seqlens, num_splits=ns))
                fn()
            ctx = sdpa_kernel(SDPBackend.CUDNN_ATTENTION) if name == "cudnn" else contextlib.nullcontext()
            ctx.__enter__()
            for _ in range(10):
                fn()
            host, ev = [], []
            for _ in range(args.reps):
                h, e = single_call_us(torch, fn)
                host.append(h)
                ev.append(e)
            gpu = gpu_ms_per_call(torch, fn, 50, 5) * 1e3
            ctx.__exit__(None, None, None)
            _config.DECODE_FUSED_MAX_PARTS = fused_default
            plan = (next(p for p in _kvcache._FAST_PLANS.values() if p.out_shape == (b, 1, h, d))
                    if name != "cudnn" else None)
            desc = (f"splits {plan.num_splits} fused {plan.eager[3] is not None} launches {len(plan.launches)} "
                    f"{'/'.join(L.name for L in plan.launches)}") if plan is not None else ""
            rows.append((name, statistics.median(host), min(host), statistics.median(ev), min(ev), gpu, desc))
        for s in SWITCHES:
            os.environ.pop(s, None)
        for name, hm, hmin, em, emin, gpu, desc in rows:
            print(f"{shape:>10} {name:9} host {hm:6.1f} (min {hmin:5.1f}) us  events {em:6.1f} (min {emin:5.1f}) us  "
                  f"gpu {gpu:6.1f} us  {desc}", flush=True)


if __name__ == "__main__":
    main()
