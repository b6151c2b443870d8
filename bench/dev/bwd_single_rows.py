#!/usr/bin/env python3
"""The one-launch backward of short calls against the three-launch one, by row count (issue 11).

For head_dim 64 at 128 keys and head_dim 128 at 64 keys (each the kernel's key block), bf16, causal
and not, and batch x heads giving batch * nheads * seqlen_q rows from 256 to 131072: the backward
(cuflash.attention_backward on one forward's out and lse) timed with CUDA events, back to back (GPU
time: the median of --reps calls after a warm-up) and as single eager calls (synchronize, event, call,
event: host included), with CUFLASH_BWD_SINGLE=1 (the one-launch kernel at any row count) and =0 (the
three launches), alternated --rounds times in one process (the plan cache cleared at each switch).
Prints per point the two times and single / three, GPU and eager; the library's row bound is
cuflash/_config.py BWD_SINGLE_MAX_ROWS.

Usage: python bench/dev/bwd_single_rows.py [--reps 200] [--rounds 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import cuflash  # noqa: E402
from cuflash import _plan  # noqa: E402


def gpu_time(fn, reps):
    for _ in range(5):
        fn()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    s.record()
    for _ in range(reps):
        fn()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) * 1e3 / reps


def eager_time(fn, reps):
    out = []
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(reps):
        torch.cuda.synchronize()
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        out.append(s.elapsed_time(e) * 1e3)
    return statistics.median(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    rows_list = (256, 1024, 4096, 16384, 65536, 131072)
    results = []
    for d, s in ((64, 128), (128, 64)):
        for causal in (False, True):
            for rows in rows_list:
                bh = rows // s
                h = min(bh, 16)
                b = bh // h
                q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                dout = torch.randn_like(q)
                out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)

                def call():
                    return cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal)

                fig = {"1": ([], []), "0": ([], [])}
                for _ in range(args.rounds):
                    for mode in ("1", "0"):
                        os.environ["CUFLASH_BWD_SINGLE"] = mode
                        _plan.CACHE.clear()
                        fig[mode][0].append(gpu_time(call, args.reps))
                        fig[mode][1].append(eager_time(call, max(20, args.reps // 4)))
                g1, g0 = statistics.median(fig["1"][0]), statistics.median(fig["0"][0])
                e1, e0 = statistics.median(fig["1"][1]), statistics.median(fig["0"][1])
                r = dict(head_dim=d, seqlen=s, causal=causal, rows=rows, batch=b, nheads=h, gpu_us_single=g1,
                         gpu_us_three=g0, eager_us_single=e1, eager_us_three=e0)
                results.append(r)
                print(f"d{d} s{s} {'causal' if causal else 'full  '} rows {rows:6d} (b{b} h{h}): GPU {g1:8.1f} / {g0:8.1f} us "
                      f"({g1 / g0:.3f}); eager {e1:8.1f} / {e0:8.1f} us ({e1 / e0:.3f})", flush=True)
    os.environ.pop("CUFLASH_BWD_SINGLE", None)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
