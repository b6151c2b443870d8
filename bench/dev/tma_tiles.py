#!/usr/bin/env python3
"""Tile shapes of the sm_90a forward's TMA variant (docs/hopper_plan.md step 1), on a Hopper GPU.

With K and V loaded by TMA the kernel holds fewer registers (ptxas, NVRTC 13: 235 at head_dim 256
with 128 x 64 tiles, which spilled with cp.async), so the tile table may change. For each candidate
(head_dim, BLOCK_M, BLOCK_N): a correctness check on ragged GQA shapes against the float64 reference
(the accuracy rule: error <= 2x the naive bf16 computation's + 1e-5, no NaN, lse within 1e-3), then
GPU time of N back-to-back launches between two CUDA events (median of --reps), bf16, batch x
seqlen = 16k tokens, hidden 2048, causal off and on. Prints TFLOP/s per candidate; JSON to $OUT.

    PYTHONPATH=. python bench/dev/tma_tiles.py [--seqlens 4096 16384] [--reps 15] [--ws] [--no-tma]

--ws adds the warp-specialized kernel (cuda_src/flash_fwd_sm90_ws.cu) for each (BLOCK_N, STAGES) of
WS_CANDIDATES, checked and timed the same way; --pingpong adds each in the pingpong schedule,
--consumers 2 3 each with three consumer warpgroups (192-row blocks).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics

import ml_dtypes
import numpy as np
import torch

from cuflash import _config, _launch

T = _config.TileConfig
CANDIDATES = {
    64: [T(128, 64, 8, True), T(128, 96, 8, True), T(128, 128, 8, True), T(192, 128, 12, True), T(64, 128, 4, True),
         T(64, 64, 4, True)],
    128: [T(128, 128, 8, True), T(128, 192, 8, True), T(128, 64, 8, True)],
    256: [T(128, 32, 8, True), T(128, 64, 8, True)],
}
# The warp-specialized kernel (cuda_src/flash_fwd_sm90_ws.cu, CUFLASH_FWD_WS=1): (BLOCK_N, STAGES).
WS_CANDIDATES = {64: [(128, 2), (64, 2), (128, 3), (64, 4)], 128: [(128, 2), (128, 3), (64, 2)], 256: [(64, 2)]}


def ref(q, k, v, causal):
    """(out float64, lse float64, the naive bf16 computation's out) from cuflash/_reference.py."""
    from cuflash._reference import attention_reference

    a = [x.cpu().view(torch.int16).numpy().view(ml_dtypes.bfloat16) for x in (q, k, v)]
    out, lse = attention_reference(*a, causal=causal)
    naive, _ = attention_reference(*a, causal=causal, compute_dtype="input")
    t = lambda x: torch.from_numpy(np.asarray(x, dtype=np.float64)).to(q.device)
    return t(out), t(lse), t(naive)


def dt(x):
    return _launch.DeviceTensor(x.data_ptr(), tuple(x.shape), tuple(x.stride()))


def launches(q, k, v, o, lse, causal, cfg):
    cc = torch.cuda.get_device_capability()
    d = q.shape[3]
    return _launch.fwd_launches(dt(q), dt(k), dt(v), dt(o), lse.data_ptr(), "bfloat16", causal, d ** -0.5, 0,
                                cc, cfg)


def check(cfg, d, causal, want=None) -> str:
    msgs = []
    for b, sq, sk, h, hk in ((2, 333, 1000, 4, 2), (1, 1024, 1024, 2, 2), (2, 1, 517, 4, 1)):
        q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16)
        o = torch.full_like(q, float("nan"))
        lse = torch.full((b, h, sq), float("nan"), device="cuda")
        L = launches(q, k, v, o, lse, causal, cfg)
        tma = all(x.name.endswith("_tma") for x in L) if want is None else all(x.name.startswith(want) for x in L)
        _launch.fire_all(L, 0, torch.cuda.current_stream().cuda_stream)
        r, rl, nv = ref(q, k, v, causal)
        err = (o.double() - r).abs().max().item()
        nerr = (nv - r).abs().max().item()
        fin = torch.isfinite(rl)
        lerr = (lse.double()[fin] - rl[fin]).abs().max().item() if fin.any() else 0.0
        ok = (err <= 2 * nerr + 1e-5 and not o.isnan().any() and lerr < 1e-3
              and bool((lse[~fin] == float("-inf")).all()) and tma)
        if not ok:
            msgs.append(f"FAIL b{b} {sq}x{sk} h{h}/{hk}: err {err:.2e} naive {nerr:.2e} lse {lerr:.1e} tma {tma}")
    return "; ".join(msgs) or "ok"


def time_ms(L, reps, n):
    stream = torch.cuda.current_stream().cuda_stream
    for _ in range(3):
        _launch.fire_all(L, 0, stream)
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(True), torch.cuda.Event(True)
        s.record()
        for _ in range(n):
            _launch.fire_all(L, 0, stream)
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e) / n)
    return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--ws", action="store_true", help="also the warp-specialized kernel's candidates")
    ap.add_argument("--no-tma", action="store_true", help="skip the TMA variant's candidates")
    ap.add_argument("--pingpong", action="store_true", help="with --ws: each candidate in the pingpong schedule too")
    ap.add_argument("--consumers", type=int, nargs="+", default=[2], choices=[2, 3],
                    help="with --ws: consumer warpgroups (3: 192-row blocks, no pingpong)")
    ap.add_argument("--ws-tiles", nargs="+", default=None, metavar="BN:STAGES",
                    help="with --ws: only these (BLOCK_N, STAGES) of WS_CANDIDATES' shapes (any head_dim)")
    ap.add_argument("--tma-tiles", nargs="+", default=None, metavar="BM:BN",
                    help="only these TMA-variant tiles of CANDIDATES")
    args = ap.parse_args()
    ws_only = None if args.ws_tiles is None else {tuple(map(int, x.split(":"))) for x in args.ws_tiles}
    tma_only = None if args.tma_tiles is None else {tuple(map(int, x.split(":"))) for x in args.tma_tiles}
    rows = []
    print(f"device: {torch.cuda.get_device_name()}")

    def measure(row, label, cfg, d, causal, want=None):
        """Checks one candidate, then times it at each seqlen; appends and prints its row."""
        try:
            row["check"] = check(cfg, d, causal, want)
        except Exception as ex:  # a compile error or a launch refusal is a result here
            row["check"] = f"ERROR {type(ex).__name__}: {str(ex)[:200]}"
        if row["check"] == "ok":
            for s in args.seqlens:
                b, h = 16384 // s, 2048 // d
                q = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
                k, v = torch.randn_like(q), torch.randn_like(q)
                o = torch.empty_like(q)
                lse = torch.empty(b, h, s, device="cuda")
                ms = time_ms(launches(q, k, v, o, lse, causal, cfg), args.reps, max(1, int(20 / (s / 4096) ** 2)))
                row[f"tflops_{s}"] = round(4 * b * h * s * s * d / (2 if causal else 1) / ms / 1e9, 1)
        rows.append(row)
        print(label, {k_: v_ for k_, v_ in row.items() if k_.startswith("tflops") or k_ == "check"}, flush=True)

    for d in ([] if args.no_tma else args.head_dims):
        for causal in (False, True):
            for cfg in CANDIDATES[d]:
                if _config.fwd_smem_bytes(d, cfg) + _config.fwd_tma_bar_bytes(d) > 232448:
                    continue
                if tma_only is not None and (cfg.block_m, cfg.block_n) not in tma_only:
                    continue
                measure({"head_dim": d, "causal": causal, "block_m": cfg.block_m, "block_n": cfg.block_n},
                        f"d{d} {'causal' if causal else 'full  '} m{cfg.block_m} n{cfg.block_n}", cfg, d, causal)
    if args.ws:
        os.environ["CUFLASH_FWD_WS"] = "1"
        for d in args.head_dims:
            for causal in (False, True):
                for (bn, stages), pp, nc in itertools.product(WS_CANDIDATES[d], (False, True) if args.pingpong else (False,),
                                                              args.consumers):
                    if (pp and nc != 2) or (ws_only is not None and (bn, stages) not in ws_only):
                        continue
                    os.environ["CUFLASH_FWD_WS_BLOCK_N"], os.environ["CUFLASH_FWD_WS_STAGES"] = str(bn), str(stages)
                    os.environ["CUFLASH_FWD_WS_PINGPONG"] = "1" if pp else "0"
                    os.environ["CUFLASH_FWD_WS_CONSUMERS"] = str(nc)
                    measure({"kernel": "ws", "head_dim": d, "causal": causal, "block_n": bn, "stages": stages,
                             "pingpong": pp, "consumers": nc},
                            f"ws d{d} {'causal' if causal else 'full  '} n{bn} s{stages}{' pp' if pp else ''}"
                            f"{' c3' if nc == 3 else ''}", None, d, causal, want="fwd90ws_")
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "tma_tiles.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
