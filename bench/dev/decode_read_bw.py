#!/usr/bin/env python3
"""Read bandwidth of decode-shaped kernels that only read the KV cache (bench/dev/decode_read_bw.cu):
the decode kernel's cp.async copies against TMA box copies, beside cuflash's decode, cuDNN's (SDPA)
and a device-to-device copy, at one shape (issue 13: cuflash's decode reads at ~96 % of the copy
bandwidth at batch 64, where cuDNN's reads at 102-107 %).

Shape: K, V (batch, seqlen, heads_kv, 128) bf16 (default 64 x 8192 x 32: 2048 blocks); block (b, h)
streams its kv head. Variants: read_cpasync<BN, STAGES> and read_tma<BN, STAGES> for BN 64 / 128, and
read_tma_rows<128, STAGES, ROWS, MODE>: 128-key tiles in boxes of ROWS = 16 / 32 / 64 / 128 rows, one box per
64-column panel (MODE 0) or one 5-D box for both (MODE 1: panel-major, strides not increasing; MODE 2:
row-major, the panels of a row interleaved), as the paged decode issues its 16-key groups
(does the box count cost what paged caches lose at small shapes? --batch 4 --seqlen 512 is 128 blocks of 512
keys, where paged decode read 1.34x the contiguous time in session 11).
Method: decode_splits.gpu_ms_per_call (CUDA events around --reps launches queued behind a sleep
kernel, after warm-up; median of --rounds); GB/s = K+V bytes / time;
the copy's figure counts the bytes read and written (as bench_decode.py's copy bandwidth). Needs sm_90 (TMA).

Usage: python bench/dev/decode_read_bw.py [--cubin PATH] [--batch 64 --seqlen 8192 --heads-kv 32]
  --cubin: a cubin of decode_read_bw.cu built elsewhere (with PATH.json: expression -> lowered name);
  otherwise it is compiled here with NVRTC.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
for _p in (ROOT, HERE):
    if _p not in sys.path:
        sys.path.insert(0, _p)

VARIANTS = [("cpasync", 64, 3), ("cpasync", 64, 4), ("cpasync", 128, 2), ("cpasync", 128, 3),
            ("tma", 64, 2), ("tma", 64, 3), ("tma", 64, 4), ("tma", 128, 2), ("tma", 128, 3)]
# read_tma_persist: (kind, BN, STAGES, blocks per SM); the grid is that many blocks per SM
PERSIST = [("persist", 64, 2, 3), ("persist", 64, 3, 2), ("persist", 64, 2, 2), ("persist", 64, 4, 1)]
# read_tma_dyn: (kind, BN, STAGES, blocks per SM[, parts]): persistent, the next work unit from a global
# counter, a unit being an item (parts 1) or one of `parts` equal key ranges of one
DYN = [("dyn", 64, 2, 3), ("dyn", 64, 3, 2), ("dyn", 64, 2, 2), ("dyn", 64, 4, 1), ("dyn", 128, 2, 1)]
DYN += [("dyn", 64, 2, 2, 8), ("dyn", 64, 2, 2, 32), ("dyn", 64, 3, 2, 8), ("dyn", 64, 3, 2, 32), ("dyn", 64, 2, 3, 32),
        ("dyn", 64, 4, 1, 32)]
# read_tma_heads: (kind, BN, STAGES, HEADS): HEADS adjacent kv heads a block, one box per panel for all
HEADS = [("heads", 32, 2, 2), ("heads", 32, 3, 2), ("heads", 64, 2, 2), ("heads", 16, 2, 4)]
# read_tma_stamp: (kind, BN, STAGES): the whole-tile reader with each block's SM and times (--stamps)
STAMP = [("stamp", 64, 2), ("stamp", 64, 3)]
# read_tma_heads_split: (kind, BN, STAGES, HEADS, splits): HEADS heads a block, its keys one of `splits` ranges
HSPLIT = [("hsplit", 16, 2, 4, 4), ("hsplit", 16, 3, 4, 4), ("hsplit", 32, 2, 2, 2), ("hsplit", 32, 3, 2, 2),
          ("hsplit", 16, 2, 2, 2), ("hsplit", 16, 4, 2, 2), ("hsplit", 64, 2, 1, 1), ("hsplit", 32, 2, 1, 1)]
# tma<64, 2> / <64, 3> again with the maps' other L2 promotions (CU_TENSOR_MAP_L2_PROMOTION: 0 none,
# 1 64 B, 3 256 B; every other reader's maps promote 128 B, as the library's)
L2 = [("tma", 64, st, None, None, l2) for st in (2, 3) for l2 in (0, 1, 3)]
# read_tma_rows: (kind, BN, STAGES, ROWS, MODE)
VARIANTS += [("tma_rows", 128, st, rows, mode) for st in (2, 3) for rows in (16, 32, 64, 128) for mode in (0, 1, 2)
             if (rows, mode) != (128, 0)]  # that one is ("tma", 128, st)
# read_tma_streamk: (kind, BN, STAGES, blocks per SM); the grid is that many blocks per SM, each a equal
# range of the items' tiles in sequence
STREAMK = [("streamk", 64, 2, 1), ("streamk", 64, 3, 1), ("streamk", 64, 2, 2), ("streamk", 64, 2, 3), ("streamk", 128, 2, 1)]
# read_tma_tail: (kind, BN, STAGES, tail items in SMs' worth, splits): a block an item, the last items in splits
TAIL = [("tail", 64, st, t, sp) for st in (2, 3) for t, sp in ((0, 1), (1, 2), (3, 2), (6, 2), (1, 4), (3, 4))]
# MODE 4 / 5: whole tiles, each block's walk starting at its own tile (rotated start) and wrapping
ROT = [("tma_rows", bn, st, bn, mode) for bn, sts in ((64, (2, 3, 4)), (128, (2, 3))) for st in sts for mode in (4, 5)]
# MODE 3: 16-row pages through a block table (timed with a random and an in-order table)
PAGED = [("tma_rows", 128, st, 16, 3) for st in (2, 3)]


def expression(kind, bn, stages, rows=None, mode=None, l2=None):
    if kind == "stamp":
        return f"cuflash::read_tma_stamp<{bn}, {stages}>"
    if kind == "hsplit":  # rows: the heads a block; mode: splits (a launch choice)
        return f"cuflash::read_tma_heads_split<{bn}, {stages}, {rows}>"
    if kind == "heads":  # rows: the heads a block
        return f"cuflash::read_tma_heads<{bn}, {stages}, {rows}>"
    if kind == "tail":  # rows, mode: the tail's items (in SMs' worth) and splits (launch choices)
        return f"cuflash::read_tma_tail<{bn}, {stages}>"
    if kind == "streamk":  # rows: blocks per SM (a launch choice)
        return f"cuflash::read_tma_streamk<{bn}, {stages}>"
    if kind == "persist":  # rows: blocks per SM (a launch choice, not a template argument)
        return f"cuflash::read_tma_persist<{bn}, {stages}>"
    if kind == "dyn":  # rows: blocks per SM
        return f"cuflash::read_tma_dyn<{bn}, {stages}>"
    if kind == "tma":  # one box per panel of the whole tile
        return f"cuflash::read_tma_rows<{bn}, {stages}, {bn}, 0>"
    if kind == "tma_rows":
        return f"cuflash::read_tma_rows<{bn}, {stages}, {rows}, {mode}>"
    return f"cuflash::read_{kind}<{bn}, {stages}>"


def label(kind, bn, stages, rows=None, mode=None, l2=None):
    if l2 is not None:
        return f"read_{kind}<{bn}, {stages}> L2 promotion {l2}"
    if kind == "heads":
        return f"read_tma_heads<{bn}, {stages}, {rows} heads>"
    if kind == "stamp":
        return f"read_tma_stamp<{bn}, {stages}>"
    if kind == "hsplit":
        return f"read_tma_heads<{bn}, {stages}, {rows} heads> in {mode}"
    if kind == "tail":
        return f"read_tma_tail<{bn}, {stages}> {rows}xSMs items in {mode}"
    if kind == "streamk":
        return f"read_tma_streamk<{bn}, {stages}> x{rows}/SM"
    if kind == "dyn" and mode:
        return f"read_tma_dyn<{bn}, {stages}> x{rows}/SM, {mode} parts"
    if kind in ("persist", "dyn"):
        return f"read_tma_{kind}<{bn}, {stages}> x{rows}/SM"
    if kind == "tma_rows":
        return f"read_tma_rows<{bn}, {stages}, {rows}, mode {mode}>"
    return f"read_{kind}<{bn}, {stages}>"


def build(path):
    """The cubin and the lowered names, compiled with NVRTC into `path` (and path.json)."""
    from cupy_backends.cuda.libs import nvrtc

    from cuflash import _compile

    files, _ = _compile.sources()
    headers = {n: t for n, t in files.items() if n.endswith(".cuh")}
    code = open(os.path.join(HERE, "decode_read_bw.cu")).read()
    prog = nvrtc.createProgram(code, "decode_read_bw.cu", [t.encode() for t in headers.values()],
                               [n.encode() for n in headers])
    exprs = sorted({expression(*v) for v in STAMP + VARIANTS + PAGED + PERSIST + DYN + HEADS + HSPLIT + ROT + STREAMK + TAIL})
    for e in exprs:
        nvrtc.addNameExpression(prog, e)
    nvrtc.compileProgram(prog, _compile.base_options("sm_90a"))
    names = {e: nvrtc.getLoweredName(prog, e) for e in exprs}
    with open(path, "wb") as f:
        f.write(bytes(nvrtc.getCUBIN(prog)))
    with open(path + ".json", "w") as f:
        json.dump(names, f)


def smem_bytes(kind, bn, stages, rows=None, *_):
    if kind in ("heads", "hsplit"):
        return stages * 4 * rows * bn * 128 + 1024
    return 2 * stages * bn * 136 * 2 if kind == "cpasync" else stages * 4 * bn * 128 + 1024


def stamp_runs(args, module, names, params, stamps, b, hk, stream, torch, driver, np):
    """read_tma_stamp at each STAMP variant: args.stamps times, 3 launches back to back, then the last
    launch's stamps: its span, when its blocks end, and the blocks' ends by how many of the grid's blocks
    their SM held."""
    out = dict(device=torch.cuda.get_device_name(), shape=[b, args.seqlen, hk, 128], runs=[])
    for var in STAMP:
        fn = module.get_function(names[expression(*var)])
        smem = smem_bytes(*var)
        fn.max_dynamic_shared_size_bytes = smem
        buf = params(var[1])
        argv = np.array([buf.ctypes.data], dtype=np.uint64)
        for _ in range(3):  # warm-up
            driver.launchKernel(fn.kernel.ptr, b * hk, 1, 1, 128, 1, 1, smem, stream, int(argv.ctypes.data), 0)
        for r in range(args.stamps):
            stamps.fill_(0)
            for _ in range(3):
                driver.launchKernel(fn.kernel.ptr, b * hk, 1, 1, 128, 1, 1, smem, stream, int(argv.ctypes.data), 0)
            torch.cuda.synchronize()
            st = stamps.view(-1, 4).cpu().numpy()
            sm, t0, th, t1 = st[:, 0], st[:, 1].astype(np.float64), st[:, 2].astype(np.float64), st[:, 3].astype(np.float64)
            base = t0.min()
            span = t1.max() - base
            per_sm = np.bincount(sm, minlength=int(sm.max()) + 1)
            held = per_sm[sm]  # blocks of this grid on this block's SM
            ends = (t1 - base) / 1e3
            line = (f"{label(*var):28} run {r}: span {span / 1e3:8.1f} us, SMs {int((per_sm > 0).sum())}, "
                    f"starts within {(t0.max() - base) / 1e3:6.2f} us; ends (us) min {ends.min():8.1f} p10 "
                    f"{np.percentile(ends, 10):8.1f} p50 {np.median(ends):8.1f} p90 {np.percentile(ends, 90):8.1f} "
                    f"max {ends.max():8.1f}")
            for n in sorted(set(held.tolist())):
                sel = held == n
                half = (th[sel] - t0[sel]) / (t1[sel] - t0[sel])
                line += (f"; {int(sel.sum())} blocks on {n}-block SMs: end mean {ends[sel].mean():8.1f} max "
                         f"{ends[sel].max():8.1f}, first half {half.mean():.3f} of the block")
            print(line, flush=True)
            out["runs"].append(dict(name=label(*var), run=r, sm=sm.tolist(), t0=(t0 - base).tolist(),
                                    th=(th - base).tolist(), t1=(t1 - base).tolist()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cubin")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--heads-kv", type=int, default=32)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json")
    ap.add_argument("--no-rows", action="store_true", help="skip the read_tma_rows box-size variants (not the paged ones)")
    ap.add_argument("--only-sk", action="store_true",
                    help="only the whole-tile TMA readers and the stream-K ones (read_tma_streamk), and the library rows")
    ap.add_argument("--only-dyn", action="store_true",
                    help="only the whole-tile TMA readers, the persistent ones (static and from a counter), and the library rows")
    ap.add_argument("--only-tail", action="store_true",
                    help="only the whole-tile TMA readers and the split-tail ones (read_tma_tail), and the library rows")
    ap.add_argument("--tail-repeat", type=int, default=1, help="--only-tail: time the list this many times")
    ap.add_argument("--only-rot", action="store_true",
                    help="only the whole-tile TMA readers, in order and with rotated starts (MODE 4 / 5), and the library rows")
    ap.add_argument("--only-heads", action="store_true",
                    help="only the whole-tile TMA readers, the several-heads readers (one range and split), and the library rows")
    ap.add_argument("--stamps", type=int, default=0,
                    help="only read_tma_stamp: this many times 3 launches back to back, the last one's blocks' SMs and "
                         "times summarized (and written to --json)")
    ap.add_argument("--gqa", type=int, default=1, help="query heads a kv head in the library's and cuDNN's rows")
    args = ap.parse_args()

    import cupy
    import numpy as np
    import torch
    from cupy_backends.cuda.api import driver

    import cuflash
    from cuflash import _tma

    path = args.cubin
    if path is None:
        path = "/tmp/decode_read_bw.cubin"
        build(path)
    names = json.load(open(path + ".json"))
    module = cupy.RawModule(path=path)

    b, L, hk, d = args.batch, args.seqlen, args.heads_kv, 128
    dev = torch.device("cuda")
    k = torch.randn(b, L, hk, d, device=dev, dtype=torch.bfloat16)
    v = torch.randn(b, L, hk, d, device=dev, dtype=torch.bfloat16)
    sink = torch.zeros(4 * b * hk, device=dev, dtype=torch.float32)  # (read_tma_tail's grid: up to 4 blocks an item)
    counter = torch.zeros(3, device=dev, dtype=torch.int32)
    stamps = torch.zeros(4 * b * hk, device=dev, dtype=torch.int64)  # read_tma_stamp's  # read_tma_dyn's ([0, 1] zero between launches)
    kv_bytes = 2 * k.numel() * 2
    stream = torch.cuda.current_stream().cuda_stream

    def tensor_map(x, rows, mode, l2=None, heads=1):
        bs, rs, hs, _ = x.stride()
        if heads > 1 or l2 is not None:  # (head_dim, seqlen, heads, batch), box {64, rows, heads, 1}
            return _tma.encode_tiled(x.data_ptr(), "bfloat16", (d, L, hk, b), (2 * rs, 2 * hs, 2 * bs),
                                     (64, rows, heads, 1), l2=_tma.L2_PROMOTION_128B if l2 is None else l2)
        if mode == 1:  # head_dim as 2 panels of 64: dims (64, seqlen, 2, heads_kv, batch), box {64, rows, 2, 1, 1}
            return _tma.encode_tiled(x.data_ptr(), "bfloat16", (64, L, 2, hk, b), (2 * rs, 128, 2 * hs, 2 * bs),
                                     (64, rows, 2, 1, 1))
        if mode == 2:  # dims (64, 2, heads_kv, seqlen, batch), box {64, 2, 1, rows, 1}
            return _tma.encode_tiled(x.data_ptr(), "bfloat16", (64, 2, hk, L, b), (128, 2 * hs, 2 * rs, 2 * bs),
                                     (64, 2, 1, rows, 1))
        return _tma.kv_map(x.data_ptr(), tuple(x.shape), tuple(x.stride()), rows, "bfloat16")

    nb = b * L // 16
    kp, vp = k.view(nb, 16, hk, d), v.view(nb, 16, hk, d)
    tables = {"random": torch.randperm(nb, device=dev).view(b, L // 16).to(torch.int32),
              "in order": torch.arange(nb, device=dev, dtype=torch.int32).view(b, L // 16)}

    def params(bn, rows=None, mode=0, table=None, l2=None, heads=1, tail=(0, 1)):
        buf = np.zeros(384, dtype=np.uint8)
        if heads > 1 or l2 is not None:
            maps = [tensor_map(x, bn, 0, l2, heads) for x in (k, v)]
        elif mode == 3:
            maps = [_tma.kv_map(x.data_ptr(), tuple(x.shape), tuple(x.stride()), 16, "bfloat16") for x in (kp, vp)]
        else:
            maps = [tensor_map(x, rows or bn, mode) for x in (k, v)]
        buf[0:128] = np.frombuffer(maps[0], np.uint8)
        buf[128:256] = np.frombuffer(maps[1], np.uint8)
        struct.pack_into("<QQQqqiiQi4xQiiQ", buf, 256, k.data_ptr(), v.data_ptr(), sink.data_ptr(), k.stride(0),
                         k.stride(1), L, hk, table.data_ptr() if table is not None else 0, b * hk, counter.data_ptr(),
                         *tail, stamps.data_ptr())
        return buf

    from decode_splits import gpu_ms_per_call

    def timed(fn):
        return gpu_ms_per_call(torch, fn, args.reps, args.rounds, warmup=2)

    rows = []

    def report(name, ms, nbytes=kv_bytes):
        gbps = nbytes / ms / 1e6
        rows.append(dict(name=name, us=ms * 1e3, gbps=gbps))
        print(f"{name:28} {ms * 1e3:10.1f} us  {gbps:7.0f} GB/s", flush=True)

    if args.stamps:
        stamp_runs(args, module, names, params, stamps, b, hk, stream, torch, driver, np)
        return
    dst = torch.empty_like(k)
    report("copy (bytes read + written)", timed(lambda: dst.copy_(k)), 2 * k.numel() * 2)
    if args.only_sk:
        runs = [(var, None, label(*var)) for var in VARIANTS if var[0] == "tma"]
        runs += [(var, None, label(*var)) for var in STREAMK]
    elif args.only_dyn:
        runs = [(var, None, label(*var)) for var in VARIANTS if var[0] == "tma"]
        runs += [(var, None, label(*var)) for var in PERSIST + DYN]
    elif args.only_tail:
        runs = [(var, None, label(*var)) for var in VARIANTS if var[0] == "tma" and var[1] == 64]
        runs += [(var, None, label(*var)) for var in TAIL]
        runs = runs * args.tail_repeat
    elif args.only_heads:
        runs = [(var, None, label(*var)) for var in VARIANTS if var[0] == "tma" and var[1] == 64]
        runs += [(var, None, label(*var)) for var in HEADS + HSPLIT if b * hk // var[3] * (var[4] if len(var) > 4 else 1) > 0
                 and hk % var[3] == 0]
        runs = runs + runs
    elif args.only_rot:
        runs = [(var, None, label(*var)) for var in VARIANTS if var[0] == "tma"]
        runs += [(var, None, label(*var)) for var in ROT]
    else:
        runs = [(var, None, label(*var)) for var in VARIANTS if not (args.no_rows and var[0] == "tma_rows")]
        runs += [(var, t, f"{label(*var)} pages {name}") for var in PAGED for name, t in tables.items()]
        runs += [(var, None, label(*var)) for var in PERSIST + DYN + HEADS + L2 + ROT + STREAMK]
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    for var, table, name in runs:
        kind, bn, stages = var[:3]
        fn = module.get_function(names[expression(*var)])
        smem = smem_bytes(*var)
        fn.max_dynamic_shared_size_bytes = smem
        try:
            if kind == "dyn":
                buf = params(bn, tail=(0, var[4] if len(var) > 4 else 1))
            elif kind in ("persist", "streamk"):
                buf = params(bn, table=table)
            elif kind == "tail":
                tail_items = min(var[3] * sms, b * hk)
                buf = params(bn, tail=(tail_items, var[4]))
            elif kind == "heads":
                buf = params(bn, heads=var[3])
            elif kind == "hsplit":
                buf = params(bn, heads=var[3], tail=(0, var[4]), l2=_tma.L2_PROMOTION_128B)  # the 4-D map, as heads
            elif len(var) == 6:
                buf = params(bn, l2=var[5])
            else:
                buf = params(*var[1:2], *var[3:], table=table)
        except _tma.TmaError as e:  # a layout the driver refuses: say so, time the rest
            print(f"{name:28} not encodable: {e}", flush=True)
            rows.append(dict(name=name, error=str(e)))
            continue
        argv = np.array([buf.ctypes.data], dtype=np.uint64)

        grid = (b * hk + min(var[3] * sms, b * hk) * (var[4] - 1) if kind == "tail"
                else var[3] * sms if kind == "streamk" else min(b * hk * (var[4] if len(var) > 4 and kind == "dyn" else 1), var[3] * sms) if kind in ("persist", "dyn") else b * hk // var[3] if kind == "heads"
                else b * hk // var[3] * var[4] if kind == "hsplit" else b * hk)

        def launch(fn=fn, smem=smem, argv=argv, grid=grid):
            driver.launchKernel(fn.kernel.ptr, grid, 1, 1, 128, 1, 1, smem, stream, int(argv.ctypes.data), 0)

        if kind == "dyn":  # one launch first: every tile read once, the counters back at zero
            counter.zero_()
            launch()
            got = counter.tolist()
            want = b * hk * (L // bn)
            if got != [0, 0, want]:
                print(f"{name:28} WRONG: counters {got}, want [0, 0, {want}]", flush=True)
                rows.append(dict(name=name, error=f"counters {got}"))
                continue
        report(name, timed(launch))
    q = torch.randn(b, 1, hk * args.gqa, d, device=dev, dtype=torch.bfloat16)
    seqlens = torch.full((b,), L, device=dev, dtype=torch.int32)
    report(f"cuflash decode (GQA {args.gqa})", timed(lambda: cuflash.attention_with_kvcache(q, k, v, cache_seqlens=seqlens)))
    # the same storage as 16-row pages in a random order (bench_decode.py's paged layout), and in order
    for name, table in tables.items():
        report(f"cuflash decode, 16-row pages {name}", timed(
            lambda t=table: cuflash.attention_with_kvcache(q, kp, vp, cache_seqlens=seqlens, block_table=t)))
    # pages of 64 and 256 rows, random order
    for page in (64, 256):
        nbp = b * L // page
        tp = torch.randperm(nbp, device=dev).view(b, L // page).to(torch.int32)
        report(f"cuflash decode, {page}-row pages random", timed(
            lambda t=tp, pg=page, n=nbp: cuflash.attention_with_kvcache(
                q, k.view(n, pg, hk, d), v.view(n, pg, hk, d), cache_seqlens=seqlens, block_table=t)))
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        report(f"cuDNN SDPA (GQA {args.gqa})", timed(lambda: torch.nn.functional.scaled_dot_product_attention(
            qt, kt, vt, enable_gqa=args.gqa > 1)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), shape=[b, L, hk, d], rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
