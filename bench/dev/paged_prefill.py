#!/usr/bin/env python3
"""The paged prefill (cuflash.attention_varlen with a block_table): the warp-specialized feature forward
reading the pages in place (CUFLASH_PAGED_DIRECT=1; "1o": with CUFLASH_PAGED_ILV=0, one box a 64-column
panel, session 70's layout), the gather into packed arrays then attention_varlen
(=0), the library's rule (unset), and attention_varlen on the same keys already packed (no block_table: what
reading in place could reach), alternated in one process. Shapes "BxPxC": B sequences, each with a prefix
of P keys in the cache and a chunk of C new queries whose keys are the prefix's last C (causal, bottom-right
aligned); 32 query heads, head_dim 128, bf16, GQA --gqa, pages of --pages rows in a random order. GPU time
as decode_splits.py measures it (a sleep kernel queued ahead of the calls), the median of --rounds rounds of
--calls calls; and single eager calls (--eager N, host time included)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_splits import gpu_ms_per_call  # noqa: E402
from prefill_route import eager_ms  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["4x8192x512", "8x4096x1024", "2x32768x2048", "16x2048x256"])
    ap.add_argument("--gqa", type=int, nargs="+", default=[8])
    ap.add_argument("--pages", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--eager", type=int, default=0)
    ap.add_argument("--json")
    args = ap.parse_args()

    import torch

    import cuflash
    from cuflash import _kvcache

    dev = torch.device("cuda")
    h, d = 32, 128
    rows = []
    for shape in args.shapes:
        b, prefix, chunk = (int(x) for x in shape.split("x"))
        for g in args.gqa:
            hk = h // g
            q = torch.randn(b * chunk, h, d, device=dev, dtype=torch.bfloat16)
            cu_q = torch.arange(0, b * chunk + 1, chunk, device=dev, dtype=torch.int32)
            cu_k = torch.arange(0, b * prefix + 1, prefix, device=dev, dtype=torch.int32)
            flops = 4 * b * h * d * sum(prefix - chunk + i + 1 for i in range(chunk))
            for page in args.pages:
                width = -(-prefix // page)
                nblk = b * width
                k = torch.randn(nblk, page, hk, d, device=dev, dtype=torch.bfloat16)
                v = torch.randn(nblk, page, hk, d, device=dev, dtype=torch.bfloat16)
                table = torch.randperm(nblk, device=dev, dtype=torch.int32).view(b, width)
                # the same keys packed (what the gather makes): sequence i's key t at row i * prefix + t
                idx = table.long()[:, :, None] * page + torch.arange(page, device=dev)[None, None, :]
                idx = idx.reshape(b, -1)[:, :prefix].reshape(-1)
                kp, vp = k.reshape(-1, hk, d)[idx], v.reshape(-1, hk, d)[idx]

                def paged():
                    return cuflash.attention_varlen(q, k, v, cu_q, cu_k, chunk, prefix, causal=True,
                                                    block_table=table)

                def packed():
                    return cuflash.attention_varlen(q, kp, vp, cu_q, cu_k, chunk, prefix, causal=True)

                res, eager, outs = {}, {}, {}
                for route in ("1", "1o", "0", "rule", "packed") * 2:
                    if route in ("1", "1o", "0"):
                        os.environ["CUFLASH_PAGED_DIRECT"] = route[0]
                    else:
                        os.environ.pop("CUFLASH_PAGED_DIRECT", None)
                    if route == "1o":  # in place, the pages into the SW128 panels (one box a panel)
                        os.environ["CUFLASH_PAGED_ILV"] = "0"
                    else:
                        os.environ.pop("CUFLASH_PAGED_ILV", None)
                    _kvcache._DIRECT_VARLEN_PLANS.clear()
                    fn = packed if route == "packed" else paged
                    outs[route] = fn()
                    res.setdefault(route, []).append(gpu_ms_per_call(torch, fn, args.calls, args.rounds,
                                                                     lead_cycles=2_000_000))
                    if args.eager:
                        eager.setdefault(route, []).extend(eager_ms(torch, fn, args.eager)[0])
                os.environ.pop("CUFLASH_PAGED_DIRECT", None)
                os.environ.pop("CUFLASH_PAGED_ILV", None)
                ms = {r: min(t) for r, t in res.items()}
                same = {r: bool(torch.equal(outs[r], outs["packed"])) for r in ("1", "1o", "0", "rule")}
                row = dict(shape=shape, gqa=g, page=page, ms=ms, runs=res, tflops={r: flops / t / 1e9 for r, t in ms.items()},
                           equal_to_packed=same)
                line = ""
                if args.eager:
                    row["eager_ms"] = {r: statistics.median(e) for r, e in eager.items()}
                    line = "  eager in place / gather / packed " + " / ".join(
                        f"{row['eager_ms'][r] * 1e3:.1f}" for r in ("1", "0", "packed")) + " us"
                rows.append(row)
                print(f"{shape:>14} g{g} page {page:4d}  in place {ms['1'] * 1e3:8.1f}  "
                      f"(panels {ms['1o'] * 1e3:8.1f})  gather {ms['0'] * 1e3:8.1f}  "
                      f"rule {ms['rule'] * 1e3:8.1f}  packed {ms['packed'] * 1e3:8.1f} us  in place / gather "
                      f"{ms['1'] / ms['0']:5.2f}  / packed {ms['1'] / ms['packed']:5.2f}  equal {same}{line}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
