#!/usr/bin/env python3
"""Decode kernel: one block's timeline, from the probe compiled in with CUFLASH_DECODE_TIMELINE=1
(cuda_src/flash_decode.cu DECODE_TL: thread 0 of each block writes its SM clock at fixed points, the
global timer at its start and end, and its SM).

For each shape (batch x cache x GQA group; 32 query heads, head_dim 128, bf16; contiguous, and with
--paged 16-row pages in a random order) and each mode:
  idle   synchronize, one eager call (a plain launch on an idle GPU), synchronize;
  graph  one call captured in a CUDA graph, replayed on an idle GPU;
  b2b    a sleep kernel, then --calls back-to-back eager calls (the last one's timeline: launched as a
         programmatic dependent of the one before, its blocks wait at pdl_wait);
the probe's buffer is zeroed, the step runs, and the buffer is read back; --reps times. Printed per
shape and mode: the kernel's span (first block's start to last block's end, global timer), the spread
of the blocks' starts, and per point the median over blocks (then over reps) of the SM-clock time since
the block's start, in us (the clock's rate from each block's global timer span). Points:
  pdl      after pdl_wait; Q: Q's copies issued; bars: thread 0's barriers made (TMA)
  early    the first tiles' copies issued (thread 0; TMA)
  loop     the loop reached (Q's copies waited for)
  tile i   tile i's stage complete (thread 0 past its mbarrier wait)
  issue3   tile STAGES's copy issued (iteration 1)
  S0, P0, PV0   the first tile's S = Q K^T, P (softmax), O += P V done (thread 0: its registers ready);
  V0            the first tile's V landed (thread 0 past its wait; TMA)
  S-1 ...       the same of the last tile
  end w0   warp 0's last tile done; end wL: the last warp's
  merge    the warps' (m, l) barrier; sO: their O in shared memory; item0 sums / done: thread 0's first
           output item's sums ready, its writes issued
  out      the output written (a split's partials); fin: the cluster or fused merge done (its last block)
--json writes every block's raw slots too. Needs the GPU; the kernels compile with the probe on first use
(their own cache entries)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_splits import paged16  # noqa: E402

os.environ["CUFLASH_DECODE_TIMELINE"] = "1"

SLOTS = 40
POINTS = [("pdl", 2), ("Q", 30), ("bars", 31), ("early", 3), ("loop", 4)] + [(f"tile{i}", 5 + i) for i in range(8)] + [
    ("issue3", 23), ("S0", 24), ("P0", 25), ("V0", 34), ("PV0", 26), ("S-1", 27), ("P-1", 28), ("V-1", 35), ("PV-1", 29), ("end w0", 13), ("end wL", 14), ("merge", 15), ("sO", 16), ("item0 sums", 32), ("item0 done", 33), ("out", 17), ("fin", 18)]


def timeline_buffers(cupy, _compile):
    """(name, uint64 array view) of every loaded decode module's probe buffer."""
    out = []
    for (expr, _target, _dev), fn in list(_compile._loaded.items()):
        if "flash_decode_kernel" not in expr:
            continue
        ptr = fn.module.get_global("cuflash_decode_timeline")
        out.append((expr, cupy.ndarray((4096 * SLOTS,), dtype=cupy.uint64, memptr=ptr)))
    return out


def analyse(raw, n_blocks):
    """raw: (blocks, SLOTS) uint64 (numpy). Per-point medians (us since each block's start), span, spread."""
    import numpy as np

    r = raw[:n_blocks].astype(np.int64)
    gt0, clk0, gt_end, clk_end = r[:, 0], r[:, 1], r[:, 22], r[:, 17]
    ok = (gt0 > 0) & (gt_end > gt0) & (clk_end > clk0)
    rate = np.median((gt_end[ok] - gt0[ok]) / (clk_end[ok] - clk0[ok]))  # ns per clock
    res = {"blocks": int(ok.sum()), "ns_per_clock": float(rate)}
    t0 = gt0[ok].min()
    ends = np.maximum(gt_end, r[:, 19])
    res["span_us"] = float((ends[ok].max() - t0) / 1e3)
    starts = (gt0[ok] - t0) / 1e3
    res["start_med_us"], res["start_max_us"] = float(np.median(starts)), float(starts.max())
    res["end_med_us"] = float(np.median((ends[ok] - t0) / 1e3))
    res["n_tiles"] = int(np.median(r[ok, 21]))
    for name, slot in POINTS:
        v = r[ok, slot]
        have = v > 0
        if have.sum() == 0:
            continue
        d = (v[have] - clk0[ok][have]) * rate / 1e3
        res[name] = (float(np.median(d)), float(d.max()))
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["16x512x8", "4x512x1", "16x512x4", "1x8192x4", "16x2048x8"])
    ap.add_argument("--modes", nargs="+", default=["idle", "graph", "b2b"])
    ap.add_argument("--paged", action="store_true", help="also 16-row pages in a random order")
    ap.add_argument("--splits", type=int, default=0, help="num_splits (0: the library's)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--calls", type=int, default=8, help="b2b: calls after the sleep kernel")
    ap.add_argument("--json", help="write the summaries and raw slots here")
    ap.add_argument("--raw-all", action="store_true", help="--json: every rep's raw slots (default: the last rep's)")
    args = ap.parse_args()

    import cupy
    import numpy as np
    import torch

    import cuflash
    from cuflash import _compile

    dev = torch.device("cuda")
    print(f"device: {torch.cuda.get_device_name(0)}", flush=True)
    rows = []
    for shape in args.shapes:
        b, L, g = (int(x) for x in shape.split("x"))
        h, d = 32, 128
        hk = h // g
        q = torch.randn(b, 1, h, d, device=dev, dtype=torch.bfloat16)
        kc = torch.randn(b, L, hk, d, device=dev, dtype=torch.bfloat16)
        vc = torch.randn(b, L, hk, d, device=dev, dtype=torch.bfloat16)
        seqlens = torch.full((b,), L, device=dev, dtype=torch.int32)
        layouts = [("contig", dict(k_cache=kc, v_cache=vc))]
        if args.paged:
            layouts.append(("paged16", paged16(torch, dev, b, L, kc, vc)))
        for lname, kw in layouts:
            def step(kw=kw):
                return cuflash.attention_with_kvcache(q, cache_seqlens=seqlens, num_splits=args.splits, **kw)

            for _ in range(3):
                step()
            torch.cuda.synchronize()
            bufs = timeline_buffers(cupy, _compile)
            for mode in args.modes:
                graph = None
                if mode == "graph":
                    s = torch.cuda.Stream()
                    s.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(s):
                        step()
                    torch.cuda.current_stream().wait_stream(s)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        step()
                    torch.cuda.synchronize()
                    bufs = timeline_buffers(cupy, _compile)
                per = []
                raws = []
                for _ in range(args.reps):
                    for _, buf in bufs:
                        buf.fill(0)
                    torch.cuda.synchronize()
                    if mode == "idle":
                        step()
                    elif mode == "graph":
                        graph.replay()
                    else:
                        torch.cuda._sleep(2_000_000)
                        for _ in range(args.calls):
                            step()
                    torch.cuda.synchronize()
                    for name, buf in bufs:
                        a = cupy.asnumpy(buf).reshape(4096, SLOTS)
                        n = int((a[:, 0] > 0).sum())
                        if n:
                            per.append((name, analyse(a, 4096)))
                            raws.append((name, a[:max(n, 1)].tolist()))
                if not per:
                    print(f"{shape} {lname} {mode}: no timeline written", flush=True)
                    continue
                names = sorted({p[0] for p in per})
                for kname in names:
                    rs = [p[1] for p in per if p[0] == kname]
                    summ = {"shape": shape, "layout": lname, "mode": mode, "kernel": kname, "reps": len(rs)}
                    for key in ("blocks", "n_tiles", "span_us", "start_med_us", "start_max_us", "end_med_us",
                                "ns_per_clock"):
                        summ[key] = statistics.median(r[key] for r in rs)
                    for pname, _ in POINTS:
                        have = [r[pname] for r in rs if pname in r]
                        if have:
                            summ[pname] = (statistics.median(x[0] for x in have), statistics.median(x[1] for x in have))
                    rows.append(dict(summ, raw_last=[x[1] for x in raws if x[0] == kname][-1 if not args.raw_all else 0:]))
                    short = kname.split("<")[1].rstrip(">") if "<" in kname else kname
                    pts = "  ".join(f"{pn} {summ[pn][0]:.2f}/{summ[pn][1]:.2f}" for pn, _ in POINTS if pn in summ)
                    print(f"{shape} {lname} {mode} [{short}] blocks {summ['blocks']} tiles {summ['n_tiles']} "
                          f"span {summ['span_us']:.2f} us, starts med {summ['start_med_us']:.2f} max "
                          f"{summ['start_max_us']:.2f}, ends med {summ['end_med_us']:.2f} | per block med/max us: {pts}",
                          flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f)


if __name__ == "__main__":
    main()
