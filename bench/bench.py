#!/usr/bin/env python3
"""cuflash benchmark suite on FlashAttention-2's own grid, against every attention torch offers.

Grid (FlashAttention-2 paper, section 4.1): batch x seqlen = 16384 tokens, hidden size 2048, i.e.
head_dim 64 with 32 heads and head_dim 128 with 16 heads; seqlen 512, 1k, 2k, 4k, 8k, 16k (batch
32 down to 1); causal off and on; float16 and bfloat16; passes fwd, bwd and fwd+bwd.

Providers, all in one process (an error is recorded per provider and configuration, never fatal):
  cuflash         cuflash.attention (torch autograd through its custom op)
  sdpa_flash      torch SDPA forced to its flash backend (FlashAttention-2 inside torch)
  sdpa_cudnn      torch SDPA forced to cuDNN attention
  sdpa_efficient  torch SDPA forced to the memory-efficient backend
  naive           the standard implementation FlashAttention is measured against: matmul (with the
                  softmax scale applied to q), softmax, matmul, all in the input dtype; causal by a
                  boolean masked_fill with a mask made once per shape. Skipped where 4 score-sized
                  matrices would not fit in free memory.
  flash_attn      flash_attn.flash_attn_func, when the package imports
Inputs are torch.randn tensors in cuflash's (batch, seqlen, heads, head_dim) layout; SDPA and the
naive attention get .transpose(1, 2) views of the same tensors (zero copy).

Timing, two figures per measurement, after a first call and a warm-up:
  GPU time (ms, tflops)  CUDA events around each call on the current stream, the calls back to
      back, so the GPU stays busy and host work hides behind the queue: the kernels' own time.
      Median of max(--reps, enough runs for --min-time seconds) runs (the naive attention: fewer).
      The providers of a pass alternate --rounds (4) times, each round with its share of the runs
      after a short warm-up: the H100's clocks step by up to ~15 % for tens of milliseconds at a time
      under its power cap (bench/dev/s27_dist.py), and a provider timed in one stretch got whatever
      step that stretch fell on. ms_rounds in the JSON keeps each round's median.
  eager (ms_eager, tflops_eager)  per run: torch.cuda.synchronize(), start event, the call, end
      event; the next run synchronizes again. The GPU is idle when the call begins, so the time
      includes the host work before the first kernel starts (and any gap between kernels): what a
      user waiting on one eager call sees. Median of min(runs above, --eager-reps (30), half of
      --min-time's worth but at least 10) runs: each run synchronizes, so they cost more wall time.
      They alternate between the providers in rounds too, after the GPU-time rounds.
  fwd      the forward call (inputs require grad, as in training)
  bwd      torch.autograd.grad(out, (q, k, v), dout, retain_graph=True) after one forward
  fwd+bwd  the forward and torch.autograd.grad together
FLOPs: forward = 4 * batch * heads * seqlen_q * seqlen_k * head_dim, halved when causal;
backward = 2.5 x forward; fwd+bwd = 3.5 x forward (the FlashAttention papers' convention).
TFLOP/s of either figure = FLOPs / its median time.

Compile time is kept out of every figure and reported on its own: (a) cold, each cuflash
specialization the run uses compiled by NVRTC into a fresh, temporary cache in worker processes,
with NVRTC's own cache off (CUDA_CACHE_DISABLE=1; compile_seconds each); (b) warm, a new process that imports cuflash and loads each cubin from that
cache. Then everything the run needs is compiled into (or found in) the normal cache
($CUFLASH_CACHE_DIR) and loaded before any timing.

Memory: the extra device memory of one fwd+bwd per provider: peak allocated (torch's allocator)
minus what was allocated before the call (inputs, dout); it includes dq, dk, dv.

Output, in this order: one progress line per configuration (TFLOP/s, GPU time / eager); the
compile-time section; extra memory per provider; the TFLOP/s table per (pass, head_dim, causal,
dtype, seqlen) with cuflash / SDPA flash and cuflash / cuDNN, GPU time first, then the eager
figures of cuflash, SDPA flash and cuDNN and their ratios; with --compare, cuflash's GPU time
against an earlier results file; a compact summary last: the ratios' min and geometric mean for
both timings, the eager target (cuflash eager forward and backward >= 1.0x SDPA flash's at every
point: min, max, geomean, the worst point), and the --compare verdict. --json keeps every figure
and the versions, --plots draws bench/plot.py's figures (from the GPU-time figures). Exit status:
0, or 1 if cuflash failed on any configuration (or failed to import or compile), 2 without a CUDA
device.

--compare OLD.json: for every (pass, dtype, head_dim, causal, seqlen) point in both runs, cuflash's
GPU time new / old, each point outside +-3 % (--compare-tol) flagged, SDPA flash's new / old beside
it as a control (a shift of both is the machine, not cuflash), and a "no regression" verdict (no
point slower by more than the tolerance). After a run it compares that run; with --summarize NEW
it compares NEW, offline.

--summarize reads files with or without the eager figures (files written before they existed have
none; their eager columns and target then read "-" and "n/a").

Examples:
    python bench/bench.py --dry-run                         # list the configurations, estimate the time
    python bench/bench.py --quick                           # < 1 minute
    python bench/bench.py --json out/bench.json --plots out/plots
    python bench/bench.py --summarize out/bench.json        # print the tables of an earlier run
    python bench/bench.py --compare bench/results/h100.json --json out/bench.json   # run, then compare
    python bench/bench.py --compare bench/results/h100.json --summarize out/bench.json  # offline
    python bench/plot.py out/bench.json --out out/plots     # re-draw the figures, no GPU needed
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import pickle
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if HERE not in sys.path:
    sys.path.insert(0, HERE)
if os.path.isdir(os.path.join(ROOT, "cuflash")) and ROOT not in sys.path:
    sys.path.insert(0, ROOT)   # benchmark the checkout this script belongs to

from bench_forward import nvidia_smi_info, write_json  # noqa: E402
from plot import SHORT_DTYPE, find_row, make_plots, seqlen_label, vs_naive_rows  # noqa: E402

T_START = time.perf_counter()

TOKENS = 16384
HIDDEN = 2048
SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
HEAD_DIMS = (64, 128)
DTYPES = ("bfloat16", "float16")
PASSES = ("fwd", "bwd", "fwd+bwd")
PROVIDERS = ("cuflash", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "naive", "flash_attn")
PASS_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}
FLOP_CONVENTION = ("forward FLOPs = 4 * batch * heads * seqlen_q * seqlen_k * head_dim, halved when causal; "
                   "backward = 2.5 x forward; fwd+bwd = 3.5 x forward; TFLOP/s = FLOPs / median time")
COL = {"cuflash": "cuflash", "sdpa_flash": "sdpa-fa", "sdpa_cudnn": "cudnn", "sdpa_efficient": "mem-eff",
       "naive": "naive", "flash_attn": "flash-attn"}
NAIVE_MATRICES = 4   # score-sized (b, h, s, s) matrices alive at the naive fwd+bwd's peak (S, P, dP, dS)
QUICK = {"dtypes": ["bfloat16"], "head_dims": [64, 128], "seqlens": [1024, 4096], "passes": ["fwd", "bwd"],
         "providers": ["cuflash", "sdpa_flash", "sdpa_cudnn"], "reps": 10, "min_time": 0.05, "compile_specs": 2}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--quick", action="store_true",
                   help="under a minute: bf16, head_dim 64/128, seqlen 1k/4k, causal off/on, fwd and bwd, "
                        "cuflash + SDPA flash/cuDNN, 10 reps, compile timing of 2 specializations")
    p.add_argument("--dtypes", nargs="+", choices=DTYPES, help="default: bfloat16 float16")
    p.add_argument("--head-dims", type=int, nargs="+", metavar="D", help="heads = 2048 // D; default 64 128")
    p.add_argument("--seqlens", type=int, nargs="+", metavar="N",
                   help="batch = 16384 // N; default 512 1024 2048 4096 8192 16384")
    p.add_argument("--causal", choices=["both", "off", "on"], default="both")
    p.add_argument("--passes", nargs="+", choices=PASSES, help="default: fwd bwd fwd+bwd")
    p.add_argument("--providers", nargs="+", choices=PROVIDERS,
                   help="default: all (flash_attn only if it imports)")
    p.add_argument("--reps", type=int, help="at least this many timed runs per measurement (default 20; "
                                            "the naive attention uses a quarter, at least 3)")
    p.add_argument("--min-time", type=float,
                   help="seconds of timed work per measurement, at least (default 0.2)")
    p.add_argument("--max-reps", type=int, default=300, help="at most this many timed runs (default 300)")
    p.add_argument("--eager-reps", type=int, default=30,
                   help="at most this many eager runs (synchronize, call, events) per measurement, on top "
                        "of the GPU-time runs (default 30; 0 = no eager figure)")
    p.add_argument("--rounds", type=int, default=4,
                   help="the providers alternate this many times per measurement, each time with a share of "
                        "its runs (default 4; 1 = each provider's runs in one stretch, the order before "
                        "session 27)")
    p.add_argument("--order", choices=("serpentine", "fixed"), default="serpentine",
                   help="the providers' order across rounds: serpentine (ABC, CBA, ...; default) so that each "
                        "follows each other one equally often, or fixed (ABC every round, as before session 28)")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls before timing, at most ~50 ms worth "
                                                          "(default 3)")
    p.add_argument("--json", metavar="PATH", help="write every figure, the versions and the device here "
                                                  "(rewritten after each configuration)")
    p.add_argument("--plots", metavar="DIR", help="write PNG figures here (matplotlib, Agg)")
    p.add_argument("--plot-dtype", choices=DTYPES, default="bfloat16", help="dtype the figures show (default bf16)")
    p.add_argument("--no-compile-timing", action="store_true", help="skip the cold-compile / warm-load timing")
    p.add_argument("--compile-workers", type=int, default=0,
                   help="processes for the cold compile (default: min(8, CPUs / 2); 1 = one after another)")
    p.add_argument("--budget-s", type=float,
                   help="skip configurations predicted to end past this many seconds from the start "
                        "(default 520, for a 600 s device call; 0 = no limit)")
    p.add_argument("--dry-run", action="store_true",
                   help="list the configurations, measurements, cuflash specializations and a rough "
                        "time estimate; needs no GPU")
    p.add_argument("--summarize", metavar="PATH", help="print the tables of an earlier --json file and exit")
    p.add_argument("--compare", metavar="OLD", help="compare cuflash's GPU time per point with an earlier --json "
                                                    "file (this run's, or --summarize's file's)")
    p.add_argument("--compare-tol", type=float, default=0.03,
                   help="--compare flags points whose new / old differs from 1 by more than this (default 0.03)")
    p.add_argument("--_child-load", nargs=2, metavar=("IN", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    q = args.quick
    args.dtypes = args.dtypes or (QUICK["dtypes"] if q else list(DTYPES))
    args.head_dims = args.head_dims or (QUICK["head_dims"] if q else list(HEAD_DIMS))
    args.seqlens = args.seqlens or (QUICK["seqlens"] if q else list(SEQLENS))
    args.passes = [x for x in PASSES if x in (args.passes or (QUICK["passes"] if q else PASSES))]
    args.explicit_providers = args.providers is not None
    args.providers = [x for x in PROVIDERS if x in (args.providers or (QUICK["providers"] if q else PROVIDERS))]
    args.reps = args.reps if args.reps is not None else (QUICK["reps"] if q else 20)
    args.min_time = args.min_time if args.min_time is not None else (QUICK["min_time"] if q else 0.2)
    args.budget_s = args.budget_s if args.budget_s is not None else 520.0
    args.compile_specs = QUICK["compile_specs"] if q else None   # None: every specialization used
    for d in args.head_dims:
        if d < 8 or d > 256 or d % 8:
            p.error(f"--head-dims: {d} is not a multiple of 8 from 8 to 256")
    if any(s < 1 for s in args.seqlens):
        p.error("--seqlens must be positive")
    if args.reps < 1:
        p.error("--reps must be at least 1")
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    if args.eager_reps < 0:
        p.error("--eager-reps must be 0 or more")
    return args


# ------------------------------------------------------------------------------------ grid

def build_configs(args):
    causals = {"both": [False, True], "off": [False], "on": [True]}[args.causal]
    out = []
    for dtype in args.dtypes:
        for d in args.head_dims:
            for c in causals:
                for s in sorted(args.seqlens):
                    out.append({"dtype": dtype, "head_dim": d, "nheads": max(1, HIDDEN // d),
                                "batch": max(1, TOKENS // s), "seqlen": s, "causal": c})
    return out


def fwd_flops(cfg) -> float:
    f = 4.0 * cfg["batch"] * cfg["nheads"] * cfg["seqlen"] * cfg["seqlen"] * cfg["head_dim"]
    return f / 2 if cfg["causal"] else f


def pass_flops(cfg, pass_name) -> float:
    return fwd_flops(cfg) * PASS_FACTOR[pass_name]


def naive_matrix_bytes(cfg) -> int:
    """Bytes of one (batch, heads, seqlen, seqlen) score matrix in the input dtype."""
    return cfg["batch"] * cfg["nheads"] * cfg["seqlen"] * cfg["seqlen"] * 2


def cfg_name(cfg) -> str:
    return (f"{SHORT_DTYPE[cfg['dtype']]} d{cfg['head_dim']} {'causal' if cfg['causal'] else 'full  '} "
            f"s{seqlen_label(cfg['seqlen']):<4} (b{cfg['batch']} h{cfg['nheads']})")


def needs_backward(passes) -> bool:
    return "bwd" in passes or "fwd+bwd" in passes


# ------------------------------------------------------------------------------------ time estimate
# Assumed rates for an H200-class GPU, only to predict the run time (--dry-run, the budget guard,
# which rescales them by what it measures as it goes). TFLOP/s (forward, backward).
_EST_RATE = {"cuflash": (270, 130), "sdpa_flash": (330, 190), "sdpa_cudnn": (550, 330),
             "sdpa_efficient": (170, 100), "flash_attn": (330, 190)}
_EST_HOST_MS = {"cuflash": 0.12}
_EST_SYNC_MS = 0.03   # one torch.cuda.synchronize() on an idle GPU, and the event records around an eager run


def _est_call_ms(cfg, prov, pass_name) -> float:
    f = fwd_flops(cfg)
    if prov == "naive":
        full = f * (2 if cfg["causal"] else 1)   # the naive attention computes the masked half too
        mb = naive_matrix_bytes(cfg)
        fwd = full / 450e12 * 1e3 + mb * (6 if cfg["causal"] else 4) / 3.0e12 * 1e3
        bwd = 2 * full / 450e12 * 1e3 + mb * (8 if cfg["causal"] else 6) / 3.0e12 * 1e3
    else:
        rf, rb = _EST_RATE.get(prov, (200, 100))
        fwd = f / (rf * 1e12) * 1e3
        bwd = 2.5 * f / (rb * 1e12) * 1e3
    host = _EST_HOST_MS.get(prov, 0.04)
    fwd, bwd = max(fwd, host), max(bwd, 2 * host)
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}[pass_name]


def _reps_for(ms, args, naive):
    min_reps, max_reps = rep_limits(args, naive)
    return max(min_reps, min(max_reps, math.ceil(args.min_time * 1e3 / max(ms, 1e-3))))


def rep_limits(args, naive):
    if naive:
        return max(3, args.reps // 4), max(3, min(args.max_reps, 30))
    return args.reps, max(args.reps, args.max_reps)


def eager_reps(reps, ms, args) -> int:
    """Eager runs of a measurement that made `reps` GPU-time runs of `ms` each. Each run synchronizes,
    so they are capped at --eager-reps, and at half of --min-time's worth (at least 10): a long call's
    host share is small and steady, and without this cap the eager runs added ~94 s to the 184 s
    full grid of bench/results/h100.json (with it, ~64 s)."""
    return min(reps, args.eager_reps, max(10, math.ceil(args.min_time * 1e3 / 2 / max(ms, 1e-3))))


def estimate_config_s(cfg, providers, args) -> float:
    total = 0.3   # inputs, empty_cache, Python
    for prov in providers:
        naive = prov == "naive"
        if needs_backward(args.passes):
            total += 2 * _est_call_ms(cfg, prov, "fwd+bwd") / 1e3   # warm-up + memory call
        for ps in args.passes:
            ms = _est_call_ms(cfg, prov, ps)
            warm = max(1, min(args.warmup, math.ceil(50 / ms)))
            reps = _reps_for(ms, args, naive)
            total += (1 + warm + reps) * ms / 1e3 + 0.02
            total += (args.rounds - 1) * (max(1, warm) * ms / 1e3 + 0.01)   # each later round's warm-up
            # eager runs: the call with the GPU idle, so its host time adds to its GPU time, plus a sync
            total += eager_reps(reps, ms, args) * (ms + _EST_HOST_MS.get(prov, 0.04) + _EST_SYNC_MS) / 1e3
    return total


# ------------------------------------------------------------------------------------ cuflash kernels

def cuflash_specs(configs, passes, target):
    """The cuflash specializations the run launches, in first-use order: [(Specialization, smem)].
    Mirrors the selection in cuflash/_launch.py (launch_fwd / launch_bwd); if it ever drifts, a
    kernel missed here compiles at its first call, which is a warm-up call, never a timed one."""
    from cuflash import _config, _launch

    family = _config.family_of_target(target)
    seen = {}
    for cfg in configs:
        d, dt, c, s = cfg["head_dim"], cfg["dtype"], cfg["causal"], cfg["seqlen"]
        fc = _config.fwd_config_for_target(target, d, dt, c)
        # On sm_90a the plain forward loads by TMA (the tensors here are contiguous: their maps patch),
        # warp-specialized where the table says so.
        # Other head dims pad up to the next wgmma head_dim (_config.fwd_pad_head_dim / bwd_pad_head_dim).
        fd = _config.fwd_pad_head_dim(target, d, True, c, s) if _config.fwd_tma_mode() != "off" else None
        tma = (fc.wgmma and d % 64 == 0 or fd is not None) and _config.fwd_tma_mode() != "off"
        ws = (_config.fwd_ws_config(fd, c) if fd else _config.fwd_ws_config(d, c, s, s)) if tma else None
        if _config.fwd_pad_tma(target, d, c, s):  # (or pad-up on the TMA variant of 64, which goes first)
            fc = _config.fwd_pad_tma_config(target, d, dt, c, s)
            spec, smem = _launch.fwd_specialization(dt, 64, fc, c, s % fc.block_m == 0 and s % fc.block_n == 0, tma=True)
        elif ws:
            spec, smem = _launch.fwd_ws_specialization(dt, fd or d, c, s % (64 * ws[3]) == 0 and s % ws[0] == 0, *ws)
        else:
            if tma:
                fc = _config.fwd_tma_config_for_target(target, d, dt, c, s)
            spec, smem = _launch.fwd_specialization(dt, d, fc, c, s % fc.block_m == 0 and s % fc.block_n == 0, tma=tma)
        seen.setdefault(spec.expression, (spec, smem))
        if needs_backward(passes):
            bc, qc = _config.bwd_config_for_target(target, d, dt), _config.bwd_dq_config(family, d, dt)
            even_kv = s % bc.block_m == 0 and s % bc.block_n == 0
            even_q = s % qc.block_m == 0 and s % qc.block_n == 0
            atomic = _launch.bwd_uses_atomics(False, target, d)
            kd = _config.bwd_pad_head_dim(target, d) or d
            bws = (atomic and target == "sm_90a" and kd in _config.BWD_WS_HEAD_DIMS
                   and _config.bwd_ws_mode() != "off" and _config.fwd_tma_mode() != "off")
            btma = bc.wgmma and _config.bwd_tma_enabled() and _config.fwd_tma_mode() != "off"
            bm = _config.bwd_ws_block_m(kd) if bws else bc.block_m
            bn = _config.bwd_ws_block_n(kd)
            kernels = (_launch.bwd_ws_specializations(dt, kd, c, s % bm == 0 and s % bn == 0,
                                                      _config.bwd_ws_stages(kd, bm), bm, call_dim=d) if bws else
                       _launch.bwd_specializations(dt, d, target, c, even_kv, even_q,
                                                   atomic and _launch._mma_bwd_atomic(target, d), tma=btma))
            for spec, smem, _ in kernels:
                seen.setdefault(spec.expression, (spec, smem))
    return list(seen.values())


def pick_compile_subset(specs, n):
    """n specializations for --quick's compile timing: the largest head_dim's forward and dK/dV."""
    if n is None or n >= len(specs):
        return specs
    def hd(spec):
        m = re.search(r"_d(\d+)", spec.name)
        return int(m.group(1)) if m else 0
    ordered = sorted(specs, key=lambda x: -hd(x[0]))
    chosen = []
    for prefix in ("fwd", "bwd90_dkdv_", "bwd_dkdv_", "bwd_dq_", "bwd_"):
        for item in ordered:
            if item[0].name.startswith(prefix) and item not in chosen:
                chosen.append(item)
                break
        if len(chosen) >= n:
            break
    return chosen[:n]


def _ptxas_summary(log_text: str):
    regs = [int(x) for x in re.findall(r"Used (\d+) registers", log_text or "")]
    spills = [int(a) + int(b) for a, b in re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads",
                                                       log_text or "")]
    return (max(regs) if regs else None), (max(spills) if spills else None)


def _cuflash_pythonpath(cuflash):
    parent = os.path.dirname(os.path.dirname(os.path.abspath(cuflash.__file__)))
    old = os.environ.get("PYTHONPATH")
    return parent + (os.pathsep + old if old else "")


def compile_timing(cuflash, specs, target, device_index, args):
    """(a) cold NVRTC compile of each specialization into a fresh cache, in worker processes;
    (b) a new process loads each from that cache. Then copies the cubins into the normal cache."""
    from cuflash import _compile, _gpu

    res = {"target": target, "specializations": []}
    workers = args.compile_workers or max(1, min(8, (os.cpu_count() or 2) // 2))
    workers = max(1, min(workers, len(specs)))
    res["workers"] = workers
    tmp = tempfile.mkdtemp(prefix="cuflash_bench_cold_")
    # Inherited by compile_many's worker processes: a fresh cuflash cache, and NVRTC's own cache
    # (CUDA >= 12.9 caches the ptxas stage in the CUDA compute cache) off, or a kernel compiled
    # before on this machine comes back in a fraction of the time and without a ptxas report.
    cold_env = {"CUFLASH_CACHE_DIR": tmp, "CUDA_CACHE_DISABLE": "1"}
    res["env"] = dict(cold_env, CUFLASH_CACHE_DIR="<fresh temporary directory>")
    saved = {k: os.environ.get(k) for k in cold_env}
    try:
        os.environ.update(cold_env)
        try:
            t0 = time.perf_counter()
            logs = _gpu.compile_many([s for s, _ in specs], target, workers=workers, return_logs=True)
            res["cold_wall_s"] = time.perf_counter() - t0
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        by_name = {name: (secs, log) for name, secs, log in logs}
        for spec, smem in specs:
            secs, log = by_name.get(spec.name, (None, ""))
            regs, spill = _ptxas_summary(log)
            res["specializations"].append({"name": spec.name, "compile_seconds": secs, "registers": regs,
                                           "spill_bytes": spill, "smem_bytes": smem,
                                           "ptxas_report": "registers" in (log or "")})
        res["cold_sum_s"] = sum(r["compile_seconds"] or 0.0 for r in res["specializations"])

        # (b) warm load in a new process
        io_in, io_out = os.path.join(tmp, "_child_in.pkl"), os.path.join(tmp, "_child_out.json")
        with open(io_in, "wb") as f:
            pickle.dump({"target": target, "device": device_index, "specs": specs}, f)
        env = dict(os.environ, CUFLASH_CACHE_DIR=tmp, PYTHONPATH=_cuflash_pythonpath(cuflash))
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--_child-load", io_in, io_out],
                              env=env, capture_output=True, text=True, timeout=300)
        res["warm_process_wall_s"] = time.perf_counter() - t0
        if proc.returncode != 0 or not os.path.isfile(io_out):
            res["warm_error"] = f"child exited {proc.returncode}: {proc.stderr.strip()[-2000:]}"
        else:
            with open(io_out) as f:
                child = json.load(f)
            res["warm_import_s"] = child["import_s"]
            res["warm_context_s"] = child["context_s"]
            res["warm_sources_s"] = child["sources_s"]
            loads = dict(child["loads"])
            for r in res["specializations"]:
                r["warm_load_seconds"] = loads.get(r["name"])
            if child.get("error"):
                res["warm_error"] = child["error"]

        # the normal cache gets the cubins, so the run itself compiles nothing twice
        try:
            dst = _compile.cache_dir()
            dst.mkdir(parents=True, exist_ok=True)
            for name in os.listdir(tmp):
                if name.startswith((".", "_child")) or (dst / name).exists():
                    continue
                part = dst / f".{name}.{os.getpid()}.bench.tmp"
                shutil.copyfile(os.path.join(tmp, name), part)
                os.replace(part, dst / name)
        except OSError as e:
            res["copy_note"] = f"could not fill {_compile.cache_dir()}: {e}"
    except Exception as e:
        res["error"] = f"{type(e).__name__}: {str(e).strip()[-3000:]}"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return res


def child_load(io_in, io_out) -> int:
    """The warm-load process: import cuflash, make a CUDA context, load each cubin from the cache."""
    out = {"loads": []}
    try:
        t0 = time.perf_counter()
        import cupy

        import cuflash  # noqa: F401
        from cuflash import _compile
        out["import_s"] = time.perf_counter() - t0
        with open(io_in, "rb") as f:
            job = pickle.load(f)
        t0 = time.perf_counter()
        cupy.cuda.Device(job["device"]).use()
        cupy.zeros(1).sum()
        cupy.cuda.runtime.deviceSynchronize()
        out["context_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        _compile.sources()   # reads and hashes cuda_src/ once per process (part of every cache key)
        out["sources_s"] = time.perf_counter() - t0
        for spec, smem in job["specs"]:
            t0 = time.perf_counter()
            _compile.get_function(spec, job["target"], job["device"], smem)
            out["loads"].append((spec.name, time.perf_counter() - t0))
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"
    with open(io_out, "w") as f:
        json.dump(out, f)
    return 0 if "error" not in out else 1


def prepare_cuflash(specs, target, device_index, args):
    """Everything the run launches compiled into (or found in) the normal cache, then loaded."""
    from cuflash import _compile, _gpu

    t0 = time.perf_counter()
    res = {}
    try:
        workers = max(1, min(args.compile_workers or (os.cpu_count() or 1), len(specs)))
        logs = _gpu.compile_many([s for s, _ in specs], target, workers=workers, return_logs=True)
        res["compiled"] = sum(1 for _, secs, _ in logs if secs > 0)
        for spec, smem in specs:
            _compile.get_function(spec, target, device_index, smem)
        res["loaded"] = len(specs)
    except Exception as e:
        res["error"] = f"{type(e).__name__}: {str(e).strip()[-3000:]}"
    res["wall_s"] = time.perf_counter() - t0
    return res


# ------------------------------------------------------------------------------------ measuring

def first_estimate(torch, fn, args):
    """(ms of one timed call, untimed warm-up calls that followed it): the first call (lazy
    initialisation, never timed), one call between CUDA events for an estimate, then warm-up calls,
    about 50 ms worth at most (--warmup in all, the estimated call counting as one)."""
    fn()
    torch.cuda.synchronize()
    s, e = _event(torch), _event(torch)
    s.record()
    fn()
    e.record()
    torch.cuda.synchronize()
    est = max(s.elapsed_time(e), 1e-3)
    warm = max(0, min(args.warmup, math.ceil(50.0 / est)) - 1)
    for _ in range(warm):
        fn()
    return est, warm


def _event(torch):
    return torch.cuda.Event(enable_timing=True)


def time_block(torch, fn, n):
    """GPU time of n calls back to back (ms each): CUDA events around each call on the current
    stream; host work hides behind the queue."""
    events = [(_event(torch), _event(torch)) for _ in range(n)]
    torch.cuda.synchronize()
    for s, e in events:
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in events]


def time_eager_block(torch, fn, n):
    """Eager time of n calls (ms each): each run starts on an idle GPU (synchronize, then the start
    event), so the host work before the first kernel is inside the events: one eager call as a user
    waits on it."""
    events = [(_event(torch), _event(torch)) for _ in range(n)]
    for s, e in events:
        torch.cuda.synchronize()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in events]


def time_cuda(torch, fn, args, naive=False):
    """(median ms, min ms, reps) of one provider timed in one stretch (bench_flex.py and
    bench_features.py use this): first_estimate, then --min-time's worth of runs (time_block)."""
    est, _warm = first_estimate(torch, fn, args)
    reps = _reps_for(est, args, naive)
    times = time_block(torch, fn, reps)
    return statistics.median(times), min(times), reps


def time_eager(torch, fn, reps):
    """(median ms, min ms, reps) of reps eager runs (time_eager_block), in one stretch."""
    times = time_eager_block(torch, fn, reps)
    return statistics.median(times), min(times), reps


def turn_order(provs, rnd, order="serpentine"):
    """The providers' order in round rnd. "serpentine": as given in even rounds, reversed in odd ones
    (ABC, CBA, ABC, ...), so no provider always follows the same other one (with three, those at
    the ends follow the middle one in every other round and their own turn in the rest). Under
    the GPU's power cap a turn starts at the clock the turn before it left (session 28, H200: with
    the fixed order cuflash, SDPA flash, cuDNN, cuflash's turns after cuDNN's ran 1.07-1.12x its
    fastest run at head_dim 128, while cuDNN's, after SDPA flash's lighter kernel, stayed within
    1.03). "fixed": the order as given in every round (sessions 27 and before)."""
    provs = list(provs)
    return provs[::-1] if order == "serpentine" and rnd % 2 else provs


def split_runs(total, rounds):
    """Runs per round: `total` spread over `rounds` (the first rounds take the remainder), each at
    least 1."""
    rounds = max(1, rounds)
    base, extra = divmod(max(total, rounds), rounds)
    return [base + (1 if r < extra else 0) for r in range(rounds)]


def _err(e) -> str:
    msg = str(e).strip()
    first = msg.splitlines()[0][:300] if msg else ""
    return f"{type(e).__name__}: {first}"


def _is_oom(torch, e) -> bool:
    return isinstance(e, getattr(torch.cuda, "OutOfMemoryError", ())) or "out of memory" in str(e).lower()


class Runner:
    def __init__(self, torch, cuflash, flash_attn_func, args):
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        self.torch, self.F, self.cuflash, self.fa_func, self.args = torch, F, cuflash, flash_attn_func, args
        self.sdpa_kernel = sdpa_kernel
        self.backends = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
                         "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION}

    def _attn(self, prov, q, k, v, dout, causal, mask):
        """(forward callable, dout in its output's layout, a function that makes the context manager
        its calls run in: SDPA's backend choice is a one-use generator context, so each stretch of
        calls enters a new one)."""
        torch, F = self.torch, self.F
        if prov == "cuflash":
            if self.cuflash is None:
                raise RuntimeError("cuflash did not import")
            cf = self.cuflash
            return (lambda: cf.attention(q, k, v, causal=causal)), dout, contextlib.nullcontext
        if prov in self.backends:
            sdpa = F.scaled_dot_product_attention
            fn = lambda: sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)  # noqa: E731
            return fn, dout.transpose(1, 2), lambda: self.sdpa_kernel(self.backends[prov])
        if prov == "naive":
            scale = 1.0 / math.sqrt(q.shape[-1])

            def fn():
                qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
                s = torch.matmul(qt * scale, kt.transpose(-2, -1))
                if mask is not None:
                    s = s.masked_fill(mask, float("-inf"))
                p = torch.softmax(s, dim=-1)
                return torch.matmul(p, vt)
            return fn, dout.transpose(1, 2), contextlib.nullcontext
        if prov == "flash_attn":
            if self.fa_func is None:
                raise RuntimeError("flash_attn did not import")
            fa = self.fa_func
            return (lambda: fa(q, k, v, causal=causal)), dout, contextlib.nullcontext
        raise ValueError(prov)

    def run_config(self, cfg, providers):
        """Returns (timing rows, memory rows, check dict). Each provider is prepared in turn (first
        call, outputs for the cross-check, memory); then each pass is timed with the providers
        alternating --rounds times (time_pass), so that a change of the GPU's clocks during the
        measurement (they step under its power cap) falls on every provider alike."""
        torch, args = self.torch, self.args
        dt = getattr(torch, cfg["dtype"])
        b, s, h, d = cfg["batch"], cfg["seqlen"], cfg["nheads"], cfg["head_dim"]
        base = {k: cfg[k] for k in ("dtype", "head_dim", "nheads", "batch", "seqlen", "causal")}
        want_bwd = needs_backward(args.passes)
        rows, mem_rows, keep, check = [], [], {}, None
        q = k = v = dout = None
        preps = {}
        try:
            q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=dt) for _ in range(4))
            for x in (q, k, v):
                x.requires_grad_(True)
            for prov in providers:
                rows_p, mem, prep = self._prepare_provider(prov, cfg, base, q, k, v, dout, want_bwd, keep)
                rows += rows_p
                if mem is not None:
                    mem_rows.append(mem)
                if prep is not None:
                    preps[prov] = prep
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
            for ps in args.passes:
                self.time_pass(ps, preps, q, k, v)
            check = self._check(keep)
        except Exception as e:   # e.g. the inputs themselves did not fit: every provider gets the error
            msg = _err(e)
            done = {r["provider"] for r in rows}
            for prov in providers:
                if prov not in done:
                    rows += [dict(base, provider=prov, **{"pass": ps}, flops=pass_flops(cfg, ps), error=msg)
                             for ps in args.passes]
                    if want_bwd:
                        mem_rows.append(dict(base, provider=prov, error=msg))
            for r in rows:
                if "ms" not in r and "skipped" not in r:
                    r.setdefault("error", msg)
        finally:
            preps.clear()
            del q, k, v, dout, keep
            torch.cuda.empty_cache()
        return rows, mem_rows, check

    def _prepare_provider(self, prov, cfg, base, q, k, v, dout, want_bwd, keep):
        """(rows, memory row, prep): the provider's first call (its outputs kept for the cross-check)
        and its memory figure; prep = (forward callable, dout in its layout, context-manager maker,
        rows by pass, mask), or None where it is skipped or failed (the reason is in its rows)."""
        torch, args = self.torch, self.args
        causal = cfg["causal"]
        rows = [dict(base, provider=prov, **{"pass": ps}, flops=pass_flops(cfg, ps)) for ps in args.passes]
        mem = dict(base, provider=prov) if want_bwd else None
        mask = None
        if prov == "naive":
            need = NAIVE_MATRICES * naive_matrix_bytes(cfg) + cfg["seqlen"] ** 2
            torch.cuda.empty_cache()
            free, _total = torch.cuda.mem_get_info()
            if need > 0.9 * free:
                why = (f"memory: needs ~{need / 2**30:.1f} GiB ({NAIVE_MATRICES} x b*h*s*s*2 bytes), "
                       f"{free / 2**30:.1f} GiB free")
                for r in rows:
                    r["skipped"] = why
                if mem is not None:
                    mem["skipped"] = why
                return rows, mem, None
        try:
            if prov == "naive" and causal:
                s = cfg["seqlen"]
                mask = torch.ones(s, s, dtype=torch.bool, device="cuda").triu_(1)   # True = masked
            fwd, g, ctx = self._attn(prov, q, k, v, dout, causal, mask)
            with ctx():
                # first call (and the outputs for the cross-check); lazy initialisation happens here
                if want_bwd:
                    out = fwd()
                    grads = torch.autograd.grad(out, (q, k, v), g)
                else:
                    with torch.no_grad():
                        out = fwd()
                    grads = None
                torch.cuda.synchronize()
                if prov == "cuflash" or not any(p != "cuflash" for p in keep):   # cuflash and one reference
                    o = out.transpose(1, 2) if prov in self.backends or prov == "naive" else out
                    keep[prov] = (o.detach(), grads)
                del out, grads
                if mem is not None:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    before = torch.cuda.memory_allocated()
                    res = torch.autograd.grad(fwd(), (q, k, v), g)
                    torch.cuda.synchronize()
                    peak = torch.cuda.max_memory_allocated()
                    del res
                    mem.update(extra_bytes=int(peak - before), baseline_bytes=int(before), peak_bytes=int(peak))
        except Exception as e:
            msg = _err(e)
            for r in rows:
                r["error"] = msg
                if _is_oom(torch, e):
                    r["oom"] = True
            if mem is not None and "extra_bytes" not in mem:
                mem["error"] = msg
            keep.pop(prov, None)
            return rows, mem, None
        return rows, mem, (fwd, g, ctx, {r["pass"]: r for r in rows}, mask)

    def _pass_fn(self, ps, fwd, g, q, k, v):
        """The callable one timed run of pass ps makes (bwd: after one forward, whose graph it keeps)."""
        torch = self.torch
        if ps == "fwd":
            return fwd
        if ps == "bwd":
            out = fwd()
            return lambda: torch.autograd.grad(out, (q, k, v), g, retain_graph=True)  # noqa: E731
        return lambda: torch.autograd.grad(fwd(), (q, k, v), g)  # noqa: E731

    def time_pass(self, ps, preps, q, k, v):
        """Times pass ps of every prepared provider: --rounds rounds, in each the providers one after
        another (in turn_order: --order) with their share of the runs (the GPU-time runs back to back, then, in rounds of their
        own, the eager runs). Round 0 estimates each provider's call (first_estimate) and sets its
        runs as one stretch did before (_reps_for); later rounds warm up again before their runs. A
        row gets the median and minimum over all its runs, and the median of each round."""
        torch, args = self.torch, self.args
        state = {}
        for phase in ("gpu", "eager"):
            for rnd in range(args.rounds):
                for prov in turn_order(preps, rnd, args.order):
                    fwd, g, ctx, by_pass, _mask = preps[prov]
                    r = by_pass[ps]
                    if "error" in r or (phase == "eager" and not state.get(prov, {}).get("eager")):
                        continue
                    st = state.setdefault(prov, {"times": [], "eager_times": [], "rounds": [], "eager_rounds": []})
                    fn = None
                    try:
                        with ctx():
                            fn = self._pass_fn(ps, fwd, g, q, k, v)
                            if phase == "gpu":
                                if rnd == 0:
                                    est, _warm = first_estimate(torch, fn, args)
                                    st["est"] = est
                                    st["runs"] = split_runs(_reps_for(est, args, prov == "naive"), args.rounds)
                                else:
                                    for _ in range(max(1, min(args.warmup, math.ceil(50.0 / st["est"])))):
                                        fn()
                                t = time_block(torch, fn, st["runs"][rnd])
                                st["times"] += t
                                st["rounds"].append(statistics.median(t))
                            else:
                                t = time_eager_block(torch, fn, st["eager"][rnd])
                                st["eager_times"] += t
                                st["eager_rounds"].append(statistics.median(t))
                    except Exception as e:
                        key = "error" if phase == "gpu" else "eager_error"   # an eager failure leaves the GPU time
                        r[key] = _err(e)
                        if phase == "gpu" and _is_oom(torch, e):
                            r["oom"] = True
                        st["eager"] = None
                    finally:
                        fn = None
                        torch.cuda.synchronize()
                    if phase == "gpu" and rnd == args.rounds - 1 and "error" not in r:
                        med = statistics.median(st["times"])
                        n_eager = eager_reps(len(st["times"]), med, args)
                        st["eager"] = split_runs(n_eager, args.rounds) if n_eager > 0 else None
            if phase == "gpu":
                for prov, st in state.items():
                    r = preps[prov][3][ps]
                    if "error" in r or not st["times"]:
                        continue
                    med = statistics.median(st["times"])
                    r.update(ms=med, ms_min=min(st["times"]), reps=len(st["times"]), rounds=len(st["rounds"]),
                             ms_rounds=st["rounds"], tflops=r["flops"] / (med * 1e-3) / 1e12)
        for prov, st in state.items():
            r = preps[prov][3][ps]
            if st["eager_times"] and "eager_error" not in r and "error" not in r:
                med = statistics.median(st["eager_times"])
                r.update(ms_eager=med, ms_eager_min=min(st["eager_times"]), reps_eager=len(st["eager_times"]),
                         tflops_eager=r["flops"] / (med * 1e-3) / 1e12)

    def _check(self, keep):
        """Max |difference| of cuflash's out (and dq, dk, dv) against the first other provider that ran."""
        if "cuflash" not in keep:
            return None
        ref = next((p for p in keep if p != "cuflash"), None)
        if ref is None:
            return None
        (o1, g1), (o2, g2) = keep["cuflash"], keep[ref]
        res = {"vs": ref, "out": (o1.float() - o2.float()).abs().max().item()}
        if g1 is not None and g2 is not None:
            for name, a, b in zip(("dq", "dk", "dv"), g1, g2):
                res[name] = (a.float() - b.float()).abs().max().item()
        return res


# ------------------------------------------------------------------------------------ metadata

def collect_meta(torch, args, cuflash, cuflash_error, fa_version, fa_error):
    meta = {
        "timestamp_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "argv": sys.argv[1:],
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "nvidia_smi": nvidia_smi_info(),
        "cuflash": getattr(cuflash, "__version__", None) if cuflash is not None else None,
        "cuflash_path": os.path.dirname(os.path.abspath(cuflash.__file__)) if cuflash is not None else None,
        "cuflash_import_error": cuflash_error,
        "cuflash_cache_dir": os.environ.get("CUFLASH_CACHE_DIR"),
        "flash_attn": fa_version,
        "flash_attn_import_error": fa_error,
        "flop_convention": FLOP_CONVENTION,
        "grid": {"tokens": TOKENS, "hidden": HIDDEN, "dtypes": args.dtypes, "head_dims": args.head_dims,
                 "seqlens": sorted(args.seqlens), "causal": args.causal, "passes": args.passes,
                 "providers": args.providers},
        "timing": {"statistic": "median of per-call CUDA-event times (ms); first call and warm-up untimed",
                   "rounds": args.rounds,
                   "order": args.order,
                   "interleaving": "per pass, the providers alternate `rounds` times, each round with its "
                                   "share of a provider's runs (after a warm-up), in `order` (serpentine: "
                                   "the providers' order reversed in odd rounds; fixed: the same every "
                                   "round); ms_rounds: each round's median; the eager runs likewise, after "
                                   "the GPU-time rounds",
                   "ms": "GPU time: events around each call, calls back to back",
                   "ms_eager": "eager: per run synchronize, start event, call, end event (host time before "
                               "the first kernel included); runs = min(GPU-time runs, eager_reps, "
                               "max(10, min_time / 2 worth))",
                   "eager_reps": args.eager_reps,
                   "min_reps": args.reps, "max_reps": args.max_reps, "min_time_s": args.min_time,
                   "warmup": args.warmup, "naive_reps": list(rep_limits(args, True)),
                   "fwd": "forward call, inputs require grad",
                   "bwd": "torch.autograd.grad(out, (q, k, v), dout, retain_graph=True) after one forward",
                   "fwd+bwd": "forward + torch.autograd.grad"},
        "memory": "extra = max_memory_allocated() during one fwd+bwd - memory_allocated() before it "
                  "(inputs q, k, v, dout allocated; dq, dk, dv included); torch's allocator only",
        "naive": "matmul(q * scale, k^T), masked_fill(causal mask, -inf) with a precomputed boolean mask, "
                 "softmax, matmul(p, v), all in the input dtype; skipped where "
                 f"{NAIVE_MATRICES} x batch*heads*seqlen^2*2 bytes exceeds 90% of free memory",
        "plot_dtype": args.plot_dtype,
        "quick": bool(args.quick),
    }
    try:
        meta["cudnn"] = torch.backends.cudnn.version()
    except Exception:
        meta["cudnn"] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        meta["device"] = torch.cuda.get_device_name(0)
        meta["capability"] = list(torch.cuda.get_device_capability(0))
        meta["sm_count"] = props.multi_processor_count
        meta["memory_gib"] = round(props.total_memory / 2**30, 1)
    if meta.get("nvidia_smi"):
        parts = [x.strip() for x in meta["nvidia_smi"][0].split(",")]
        if len(parts) > 1:
            meta["driver"] = parts[1]
    try:
        import cupy

        meta["cupy"] = cupy.__version__
        meta["cuda_driver_version"] = cupy.cuda.runtime.driverGetVersion()
        meta["cuda_runtime_version_cupy"] = cupy.cuda.runtime.runtimeGetVersion()
        try:
            from cupy_backends.cuda.libs import nvrtc

            meta["nvrtc_version"] = list(nvrtc.getVersion())
        except Exception:
            pass
    except Exception as e:
        meta["cupy"] = f"unavailable: {type(e).__name__}"
    return meta


# ------------------------------------------------------------------------------------ analysis

POINT_KEYS = ("dtype", "head_dim", "causal", "seqlen")
EAGER_TARGET = 1.0                  # cuflash eager TFLOP/s / SDPA flash eager TFLOP/s, at every point
EAGER_TARGET_PASSES = ("fwd", "bwd")


def _geomean(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def _point_ratios(res, other, ps, key, test=lambda s: True):
    """[(cuflash / other by `key`, cuflash's row)] at every point of pass `ps` where both have `key`."""
    out = []
    for r in res:
        if r["provider"] != "cuflash" or r["pass"] != ps or not test(r["seqlen"]) or not r.get(key):
            continue
        o = find_row(res, provider=other, **{"pass": ps}, **{k: r[k] for k in POINT_KEYS})
        if o and o.get(key):
            out.append((r[key] / o[key], r))
    return out


def ratio_summary(data, other, key="tflops"):
    """cuflash / other TFLOP/s (by `key`: tflops = GPU time, tflops_eager = eager) per pass: min (with
    where) and geometric mean, seqlen >= 1024 and = 512."""
    res = data["results"]
    out = {}
    for ps in PASSES:
        for band, test in (("seqlen>=1024", lambda s: s >= 1024), ("seqlen=512", lambda s: s == 512)):
            ratios = _point_ratios(res, other, ps, key, test)
            if ratios:
                lo, where = min(ratios, key=lambda x: x[0])
                out[f"{ps} {band}"] = {"min": lo, "geomean": _geomean([x for x, _ in ratios]), "n": len(ratios),
                                       "min_at": {k: where[k] for k in POINT_KEYS}}
    return out


def eager_target(data):
    """The eager target: cuflash's eager TFLOP/s >= EAGER_TARGET x SDPA flash's at every point, forward
    and backward: per pass min (the worst point), max, geomean and PASS / FAIL; a pass without eager
    figures on both sides is left out (older files have none)."""
    res = data["results"]
    out = {"limit": EAGER_TARGET, "passes": {}}
    for ps in EAGER_TARGET_PASSES:
        ratios = _point_ratios(res, "sdpa_flash", ps, "tflops_eager")
        if not ratios:
            continue
        (lo, worst), (hi, _) = min(ratios, key=lambda x: x[0]), max(ratios, key=lambda x: x[0])
        out["passes"][ps] = {"min": lo, "max": hi, "geomean": _geomean([x for x, _ in ratios]), "n": len(ratios),
                             "worst": {k: worst[k] for k in POINT_KEYS}, "pass": lo >= EAGER_TARGET}
    return out


def finalize(data):
    data.setdefault("memory", [])
    data["vs_naive"] = vs_naive_rows(data)
    data["summary"] = {"cuflash_vs_sdpa_flash": ratio_summary(data, "sdpa_flash"),
                       "cuflash_vs_sdpa_cudnn": ratio_summary(data, "sdpa_cudnn"),
                       "cuflash_vs_sdpa_flash_eager": ratio_summary(data, "sdpa_flash", "tflops_eager"),
                       "cuflash_vs_sdpa_cudnn_eager": ratio_summary(data, "sdpa_cudnn", "tflops_eager"),
                       "eager_target": eager_target(data),
                       "cuflash_errors": sum(1 for r in data["results"] + data["memory"]
                                             if r["provider"] == "cuflash" and r.get("error"))}


def compare_runs(new, old, tol, old_path=None):
    """cuflash's GPU time new / old at every (pass, dtype, head_dim, causal, seqlen) point of both
    runs, SDPA flash's new / old beside it as a control, points outside 1 +- tol flagged."""
    keys = ("pass",) + POINT_KEYS
    old_res = old.get("results", [])
    points = []
    n_new = 0
    for r in new.get("results", []):
        if r["provider"] != "cuflash" or not r.get("ms"):
            continue
        n_new += 1
        sel = {k: r[k] for k in keys}
        o = find_row(old_res, provider="cuflash", **sel)
        if not o or not o.get("ms"):
            continue
        fa_new = find_row(new["results"], provider="sdpa_flash", **sel)
        fa_old = find_row(old_res, provider="sdpa_flash", **sel)
        ctrl = (fa_new["ms"] / fa_old["ms"]) if fa_new and fa_old and fa_new.get("ms") and fa_old.get("ms") else None
        ratio = r["ms"] / o["ms"]
        flag = "SLOWER" if ratio > 1 + tol else ("faster" if ratio < 1 - tol else "")
        points.append(dict(sel, ms_old=o["ms"], ms_new=r["ms"], ratio=ratio, sdpa_flash_ratio=ctrl, flag=flag))
    n_old = sum(1 for r in old_res if r["provider"] == "cuflash" and r.get("ms"))
    res = {"old_path": old_path, "old_device": old.get("meta", {}).get("device"),
           "old_timestamp": old.get("meta", {}).get("timestamp_utc"), "tol": tol, "points": points,
           "n": len(points), "only_new": n_new - len(points), "only_old": n_old - len(points)}
    if points:
        worst, best = max(points, key=lambda x: x["ratio"]), min(points, key=lambda x: x["ratio"])
        ctrl = [p["sdpa_flash_ratio"] for p in points if p["sdpa_flash_ratio"]]
        res.update(geomean=_geomean([p["ratio"] for p in points]), worst=worst, best=best,
                   n_slower=sum(1 for p in points if p["flag"] == "SLOWER"),
                   n_faster=sum(1 for p in points if p["flag"] == "faster"),
                   sdpa_flash_geomean=_geomean(ctrl) if ctrl else None)
        res["no_regression"] = res["n_slower"] == 0
    return res


# ------------------------------------------------------------------------------------ printing

def _cell(r, w, fmt="{:.1f}", key="tflops"):
    """A table cell: the figure under `key` (tflops: GPU time, tflops_eager: eager), or why none."""
    if r is None:
        return f"{'':>{w}}"
    if r.get(key) is not None:
        return f"{fmt.format(r[key]):>{w}}"
    if r.get("skipped"):
        return f"{'OOM' if str(r['skipped']).startswith('memory') else 'skip':>{w}}"
    if r.get("oom"):
        return f"{'OOM':>{w}}"
    if r.get("error") or (key == "tflops_eager" and r.get("eager_error")):
        return f"{'ERR':>{w}}"
    return f"{'-':>{w}}"


def _ratio(a, b, key="tflops"):
    if a and b and a.get(key) and b.get(key):
        return a[key] / b[key]
    return None


def _has_eager(rows) -> bool:
    return any(r.get("tflops_eager") is not None or r.get("eager_error") for r in rows)


def _rtext(x, w, digits=2):
    return f"{(f'{x:.{digits}f}' if x else '-'):>{w}}"


def _point_text(w) -> str:
    """'bf16 d64 causal 4k' for a point dict."""
    return (f"{SHORT_DTYPE.get(w['dtype'], w['dtype'])} d{w['head_dim']} {'causal' if w['causal'] else 'full'} "
            f"{seqlen_label(w['seqlen'])}")


def _providers_of(rows):
    present = {r["provider"] for r in rows}
    return [p for p in PROVIDERS if p in present]


def format_header(data) -> str:
    m = data.get("meta", {})
    lines = [f"device: {m.get('device', '?')} (driver {m.get('driver', '?')}, CUDA driver API "
             f"{m.get('cuda_driver_version', '?')}) | torch {m.get('torch')} (CUDA {m.get('torch_cuda')}, cuDNN "
             f"{m.get('cudnn')}) | cupy {m.get('cupy')} | cuflash {m.get('cuflash')} | flash_attn "
             f"{m.get('flash_attn') or 'not installed'} | {m.get('timestamp_utc', '')}"]
    if m.get("cuflash_import_error"):
        lines.append(f"cuflash import error: {m['cuflash_import_error']}")
    return "\n".join(lines)


def format_compile(data) -> str:
    c = data.get("compile")
    lines = ["=== compile time (kept out of every figure) ==="]
    if not c:
        lines.append("not measured (--no-compile-timing, or cuflash not benchmarked)")
    else:
        if c.get("specializations"):
            n = len(c["specializations"])
            lines.append(f"cold: NVRTC compile into a fresh cache (CUDA_CACHE_DISABLE=1), {c.get('workers')} worker "
                         f"process(es), target "
                         f"{c.get('target')}: {n} specialization(s), wall {c.get('cold_wall_s', float('nan')):.1f} s, "
                         f"sum {c.get('cold_sum_s', float('nan')):.1f} s")
            if c.get("warm_import_s") is not None:
                lines.append(f"warm: a new process: import cuflash {c['warm_import_s']:.2f} s, CUDA context "
                             f"{c['warm_context_s']:.2f} s, read+hash cuda_src {c['warm_sources_s'] * 1e3:.0f} ms, "
                             "then per specialization (cubin from the disk cache + module load):")
            if any(r.get("ptxas_report") is False for r in c["specializations"]):
                lines.append("  (regs '-': no ptxas report, so that compile was answered by a cache, not cold)")
            lines.append(f"  {'specialization':<56}{'cold s':>8}{'warm ms':>9}{'regs':>6}{'spill':>6}")
            for r in c["specializations"]:
                cs = f"{r['compile_seconds']:.2f}" if r.get("compile_seconds") is not None else "-"
                wl = f"{r['warm_load_seconds'] * 1e3:.1f}" if r.get("warm_load_seconds") is not None else "-"
                lines.append(f"  {r['name']:<56}{cs:>8}{wl:>9}{str(r.get('registers') or '-'):>6}"
                             f"{str(r.get('spill_bytes') if r.get('spill_bytes') is not None else '-'):>6}")
        for key in ("error", "warm_error", "copy_note"):
            if c.get(key):
                lines.append(f"{key}: {c[key]}")
    p = data.get("prepare")
    if p:
        lines.append(f"prepare (compile or load every kernel the run uses, before timing): {p['wall_s']:.1f} s, "
                     f"{p.get('compiled', '?')} compiled, {p.get('loaded', 0)} loaded"
                     + (f"; ERROR {p['error']}" if p.get("error") else ""))
    return "\n".join(lines)


def format_memory(data) -> str:
    mem = data.get("memory", [])
    if not mem:
        return ""
    dts = sorted({r["dtype"] for r in mem})
    pd = data.get("meta", {}).get("plot_dtype")
    if len(dts) > 1:   # fp16 and bf16 are both 2 bytes: one dtype shown, every figure in the JSON
        show = pd if pd in dts else dts[0]
        mem = [r for r in mem if r["dtype"] == show]
    provs = _providers_of(mem)
    lines = ["=== extra device memory of one fwd+bwd (MiB; peak allocated minus inputs and dout)"
             + (f"; {SHORT_DTYPE.get(mem[0]['dtype'])} shown, all dtypes in the JSON" if len(dts) > 1 else "") + " ==="]
    hdr = f"{'d':>4}{'causal':>7}{'dtype':>6}{'seqlen':>7}" + "".join(f"{COL[p]:>11}" for p in provs)
    lines += [hdr, "-" * len(hdr)]
    keys = sorted({(r["head_dim"], r["causal"], r["dtype"], r["seqlen"]) for r in mem},
                  key=lambda x: (x[0], x[1], DTYPES.index(x[2]) if x[2] in DTYPES else 9, x[3]))
    for hd, c, dt, s in keys:
        cells = []
        for p in provs:
            r = find_row(mem, provider=p, head_dim=hd, causal=c, dtype=dt, seqlen=s)
            if r is None:
                cells.append(f"{'':>11}")
            elif r.get("extra_bytes") is not None:
                cells.append(f"{r['extra_bytes'] / 2**20:>11.0f}")
            elif r.get("skipped"):
                cells.append(f"{'OOM':>11}")
            else:
                cells.append(f"{'ERR':>11}")
        lines.append(f"{hd:>4}{('on' if c else 'off'):>7}{SHORT_DTYPE[dt]:>6}{seqlen_label(s):>7}" + "".join(cells))
    return "\n".join(lines)


def format_table(data) -> str:
    res = data.get("results", [])
    provs = _providers_of(res)
    eager = _has_eager(res)
    eprovs = [p for p in ("cuflash", "sdpa_flash", "sdpa_cudnn") if p in provs] if eager else []
    lines = [f"=== TFLOP/s (median); {FLOP_CONVENTION} ===",
             "cf/fa = cuflash / SDPA flash (FlashAttention-2 in torch), cf/cudnn = cuflash / SDPA cuDNN; "
             "OOM = skipped or out of memory, ERR = error (see below)"]
    if eager:
        lines.append("GPU time (calls back to back) first; after '|' the eager figures (synchronize, then one call: "
                     "host time before the first kernel included) and their ratios, prefixed e")
    hdr = (f"{'pass':<8}{'d':>4}{'causal':>7}{'dtype':>6}{'seqlen':>7}" + "".join(f"{COL[p]:>11}" for p in provs)
           + f"{'cf/fa':>8}{'cf/cudnn':>9}")
    if eager:
        hdr += " |" + "".join(f"{'e ' + COL[p]:>11}" for p in eprovs) + f"{'e cf/fa':>9}{'e cf/cudnn':>11}"
    for ps in PASSES:
        prow = [r for r in res if r["pass"] == ps]
        if not prow:
            continue
        lines += ["", hdr, "-" * len(hdr)]
        keys = sorted({(r["head_dim"], r["causal"], r["dtype"], r["seqlen"]) for r in prow},
                      key=lambda x: (x[0], x[1], DTYPES.index(x[2]) if x[2] in DTYPES else 9, x[3]))
        for hd, c, dt, s in keys:
            get = {p: find_row(prow, provider=p, head_dim=hd, causal=c, dtype=dt, seqlen=s) for p in provs}
            r_fa, r_cu = _ratio(get.get("cuflash"), get.get("sdpa_flash")), _ratio(get.get("cuflash"), get.get("sdpa_cudnn"))
            line = (f"{ps:<8}{hd:>4}{('on' if c else 'off'):>7}{SHORT_DTYPE[dt]:>6}{seqlen_label(s):>7}"
                    + "".join(_cell(get[p], 11) for p in provs) + _rtext(r_fa, 8) + _rtext(r_cu, 9))
            if eager:
                e_fa = _ratio(get.get("cuflash"), get.get("sdpa_flash"), "tflops_eager")
                e_cu = _ratio(get.get("cuflash"), get.get("sdpa_cudnn"), "tflops_eager")
                line += (" |" + "".join(_cell(get.get(p), 11, key="tflops_eager") for p in eprovs)
                         + _rtext(e_fa, 9) + _rtext(e_cu, 11))
            lines.append(line)
    errors = {}
    for r in res + data.get("memory", []):
        for msg in (r.get("error"), f"eager: {r['eager_error']}" if r.get("eager_error") else None):
            if msg:
                errors.setdefault((r["provider"], msg), 0)
                errors[(r["provider"], msg)] += 1
    if errors:
        lines.append("")
        lines.append("errors:")
        for (p, msg), n in sorted(errors.items()):
            lines.append(f"  {p} ({n}x): {msg}")
    return "\n".join(lines)


def format_summary(data) -> str:
    s = data.get("summary", {})
    meta = data.get("meta", {})
    lines = ["=== summary ===", f"{meta.get('device', '?')}; {FLOP_CONVENTION}"]
    for key, name in (("cuflash_vs_sdpa_flash", "SDPA flash"), ("cuflash_vs_sdpa_cudnn", "SDPA cuDNN"),
                      ("cuflash_vs_sdpa_flash_eager", "SDPA flash, eager"),
                      ("cuflash_vs_sdpa_cudnn_eager", "SDPA cuDNN, eager")):
        block = s.get(key) or {}
        if not block:
            continue
        timing = "eager: synchronize, one call" if key.endswith("_eager") else "GPU time"
        lines.append(f"cuflash / {name} (TFLOP/s ratio, {timing}; min at dtype d causal seqlen; geomean):")
        for ps in PASSES:
            parts = []
            for band in ("seqlen>=1024", "seqlen=512"):
                b = block.get(f"{ps} {band}")
                if b:
                    w = b["min_at"]
                    parts.append(f"{band}: min {b['min']:.2f} ({SHORT_DTYPE[w['dtype']]} d{w['head_dim']} "
                                 f"{'causal' if w['causal'] else 'full'} {seqlen_label(w['seqlen'])}), "
                                 f"geomean {b['geomean']:.2f} over {b['n']}")
            if parts:
                lines.append(f"  {ps:<8}" + ";  ".join(parts))
    vn = data.get("vs_naive") or []
    if vn:
        pd = meta.get("plot_dtype", "bfloat16")
        rows = [r for r in vn if r["dtype"] == pd] or vn
        dt = rows[0]["dtype"]
        seqlens = sorted({r["seqlen"] for r in rows})
        lines.append(f"against the naive PyTorch attention, fwd+bwd, {SHORT_DTYPE[dt]}: speedup = naive time / time, "
                     "memory = naive extra memory / extra memory")
        lines.append(f"  {'':<28}" + "".join(f"{seqlen_label(x):>8}" for x in seqlens))
        for hd, c in sorted({(r["head_dim"], r["causal"]) for r in rows}):
            for key, label in (("speedup", "speedup"), ("memory_reduction", "memory")):
                for prov in ("cuflash", "sdpa_flash"):
                    cells = []
                    for x in seqlens:
                        r = find_row(rows, provider=prov, head_dim=hd, causal=c, seqlen=x)
                        v = r.get(key) if r else None
                        cells.append(f"{(f'{v:.1f}x' if v is not None else '-'):>8}")
                    tag = f"d{hd} {'causal' if c else 'full'} {label} {COL[prov]}"
                    lines.append(f"  {tag:<28}" + "".join(cells))
    checks = [r for r in data.get("checks", []) if r.get("check")]
    if checks:
        worst = {}
        for r in checks:
            for k, v in r["check"].items():
                if k != "vs" and (k not in worst or not (v <= worst[k][0])):
                    worst[k] = (v, r)
        lines.append("cuflash cross-check, max |difference| over all configurations (vs the first other provider "
                     "that ran): " + ", ".join(f"{k} {v:.2e}" for k, (v, _) in worst.items()))
    skipped = [r for r in data.get("results", []) if str(r.get("skipped", "")).startswith("time budget")]
    if skipped:
        n = len({(r["dtype"], r["head_dim"], r["causal"], r["seqlen"]) for r in skipped})
        lines.append(f"INCOMPLETE: {n} configuration(s) skipped by the time budget (--budget-s)")
    lines.append(format_eager_target(s.get("eager_target")))
    cmp = data.get("compare")
    if cmp:
        lines.append(compare_verdict(cmp))
    n_err = s.get("cuflash_errors", 0)
    c = data.get("compile") or {}
    bad = [x for x in (c.get("error"), (data.get("prepare") or {}).get("error"), meta.get("cuflash_import_error")) if x]
    lines.append(f"cuflash errors: {n_err} measurement(s)" + (f"; compile/import: {'; '.join(bad)}" if bad else "")
                 + (" -> exit status 1" if n_err or bad else ""))
    if meta.get("wall_s") is not None:
        lines.append(f"wall time {meta['wall_s']:.0f} s")
    return "\n".join(lines)


def format_eager_target(t) -> str:
    head = f"target: cuflash eager forward and backward >= {EAGER_TARGET:.1f}x SDPA flash's eager TFLOP/s at every point"
    passes = (t or {}).get("passes") or {}
    if not passes:
        return head + ": n/a (no eager figures for both; files written before they existed have none)"
    lines = [head + ":"]
    for ps in EAGER_TARGET_PASSES:
        b = passes.get(ps)
        if not b:
            lines.append(f"  n/a   {ps:<4} no eager figures for both")
            continue
        lines.append(f"  {'PASS' if b['pass'] else 'FAIL'}  {ps:<4} min {b['min']:.2f} (worst: {_point_text(b['worst'])}), "
                     f"max {b['max']:.2f}, geomean {b['geomean']:.2f} over {b['n']} points")
    return "\n".join(lines)


def compare_verdict(cmp) -> str:
    tol = f"+-{cmp['tol'] * 100:.0f} %"
    src = f"{cmp.get('old_path') or 'the old file'} ({cmp.get('old_device') or '?'}, {(cmp.get('old_timestamp') or '?')[:10]})"
    if not cmp.get("n"):
        return f"compare with {src}: no point in common"
    w, b = cmp["worst"], cmp["best"]
    verdict = "no regression" if cmp["no_regression"] else f"REGRESSION at {cmp['n_slower']} point(s)"
    ctrl = (f"; SDPA flash new / old geomean {cmp['sdpa_flash_geomean']:.3f} (the machine's drift)"
            if cmp.get("sdpa_flash_geomean") else "")
    return (f"compare with {src}: cuflash GPU time new / old over {cmp['n']} points: geomean {cmp['geomean']:.3f}, "
            f"slowest {w['ratio']:.3f} ({w['pass']} {_point_text(w)}), fastest {b['ratio']:.3f} "
            f"({b['pass']} {_point_text(b)}); {cmp['n_slower']} slower and {cmp['n_faster']} faster than {tol}"
            f"{ctrl} -> {verdict}")


def format_compare(cmp) -> str:
    lines = [f"=== cuflash GPU time, this run / {cmp.get('old_path') or 'the old file'} "
             f"({cmp.get('old_device') or '?'}, {(cmp.get('old_timestamp') or '?')[:10]}); flagged outside "
             f"+-{cmp['tol'] * 100:.0f} %; sdpa-fa = SDPA flash's new / old, a control for the machine ==="]
    hdr = (f"{'pass':<8}{'d':>4}{'causal':>7}{'dtype':>6}{'seqlen':>7}{'old ms':>10}{'new ms':>10}{'new/old':>9}"
           f"{'sdpa-fa':>9}  flag")
    lines += [hdr, "-" * len(hdr)]
    pts = sorted(cmp["points"], key=lambda p: (PASSES.index(p["pass"]) if p["pass"] in PASSES else 9, p["head_dim"],
                                               p["causal"], DTYPES.index(p["dtype"]) if p["dtype"] in DTYPES else 9,
                                               p["seqlen"]))
    for p in pts:
        lines.append(f"{p['pass']:<8}{p['head_dim']:>4}{('on' if p['causal'] else 'off'):>7}"
                     f"{SHORT_DTYPE.get(p['dtype'], p['dtype']):>6}{seqlen_label(p['seqlen']):>7}{p['ms_old']:>10.4f}"
                     f"{p['ms_new']:>10.4f}{p['ratio']:>9.3f}{_rtext(p['sdpa_flash_ratio'], 9, 3)}  {p['flag']}")
    if cmp.get("only_new") or cmp.get("only_old"):
        lines.append(f"({cmp['only_new']} point(s) only in this run, {cmp['only_old']} only in the old file: not compared)")
    return "\n".join(lines)


def print_report(data):
    print()
    print(format_header(data))
    print()
    print(format_compile(data))
    mem = format_memory(data)
    if mem:
        print()
        print(mem)
    print()
    print(format_table(data))
    if data.get("compare"):
        print()
        print(format_compare(data["compare"]))
    print()
    print(format_summary(data))


def progress_line(i, n, cfg, rows, mem_rows, check, elapsed) -> str:
    parts = []
    for ps in PASSES:
        pr = [r for r in rows if r["pass"] == ps]
        if pr:
            parts.append(ps + " " + " ".join(
                f"{COL[r['provider']]} {_cell(r, 0).strip()}"
                + (f"/{_cell(r, 0, key='tflops_eager').strip()}" if r.get("tflops_eager") is not None else "")
                for r in pr))
    cm = find_row(mem_rows, provider="cuflash")
    if cm and cm.get("extra_bytes") is not None:
        parts.append(f"mem cuflash {cm['extra_bytes'] / 2**20:.0f} MiB")
    if check:
        parts.append(f"max|d| vs {COL[check['vs']]} " + " ".join(f"{k} {v:.1e}" for k, v in check.items() if k != "vs"))
    return f"[{i}/{n} {elapsed:4.0f}s] {cfg_name(cfg)}: " + " | ".join(parts)


# ------------------------------------------------------------------------------------ dry run

def dry_run(args) -> int:
    configs = build_configs(args)
    providers = list(args.providers)
    print(f"bench.py --dry-run: {len(configs)} configurations x {len(providers)} providers "
          f"({', '.join(providers)}{'; flash_attn only if it imports' if 'flash_attn' in providers else ''}) "
          f"x passes {', '.join(args.passes)}")
    print(FLOP_CONVENTION)
    print(f"timing: GPU time: median of max({args.reps}, {args.min_time} s worth) runs, at most {args.max_reps}; "
          + (f"eager: median of min(those runs, {args.eager_reps}, max(10, {args.min_time / 2} s worth)) runs, each "
             "after a synchronize" if args.eager_reps else "eager: off (--eager-reps 0)")
          + "; naive "
          f"{rep_limits(args, True)[0]}..{rep_limits(args, True)[1]}; warm-up up to {args.warmup}; memory of one "
          f"fwd+bwd per provider: {'yes' if needs_backward(args.passes) else 'no (no backward pass)'}")
    hdr = (f"{'#':>3}  {'dtype':<6}{'d':>4}{'heads':>6}{'batch':>6}{'seqlen':>7}{'causal':>7}{'fwd GFLOP':>11}"
           f"{'naive need GiB':>15}{'est. s':>8}")
    print(hdr)
    print("-" * len(hdr))
    total = 0.0
    for i, cfg in enumerate(configs, 1):
        est = estimate_config_s(cfg, providers, args)
        total += est
        need = (NAIVE_MATRICES * naive_matrix_bytes(cfg) / 2**30) if "naive" in providers else None
        print(f"{i:>3}  {SHORT_DTYPE[cfg['dtype']]:<6}{cfg['head_dim']:>4}{cfg['nheads']:>6}{cfg['batch']:>6}"
              f"{cfg['seqlen']:>7}{('on' if cfg['causal'] else 'off'):>7}{fwd_flops(cfg) / 1e9:>11.1f}"
              f"{(f'{need:.1f}' if need is not None else '-'):>15}{est:>8.1f}")
    n_meas = len(configs) * len(providers) * len(args.passes)
    print(f"{n_meas} timed measurements"
          + (f", {len(configs) * len(providers)} memory measurements" if needs_backward(args.passes) else ""))
    if "naive" in providers:
        print(f"naive: skipped at run time where 'naive need' exceeds 90% of free device memory "
              f"({NAIVE_MATRICES} score matrices of batch*heads*seqlen^2*2 bytes)")
    specs_note, n_specs = "", 0
    if "cuflash" in providers:
        try:
            specs = cuflash_specs(configs, args.passes, "sm90")
            n_specs = len(specs)
            timed = pick_compile_subset(specs, args.compile_specs)
            print(f"cuflash specializations for sm_90a (H100/H200; the run uses its device's): {len(specs)}; "
                  + ("compile timing: none (--no-compile-timing)" if args.no_compile_timing else
                     f"cold-compile and warm-load timing for {len(timed)}"))
            timed_names = {s.name for s, _ in timed}
            for spec, smem in specs:
                mark = "*" if (spec.name in timed_names and not args.no_compile_timing) else " "
                print(f"  {mark} {spec.name:<58} smem {smem:>6} B")
        except Exception as e:
            specs_note = f" (could not list the specializations: {_err(e)})"
            print("cuflash specializations: " + specs_note)
    overhead = 12.0   # torch import, CUDA context, meta
    if "cuflash" in providers and not args.no_compile_timing and n_specs:
        k = min(args.compile_specs or n_specs, n_specs)
        workers = args.compile_workers or 8
        overhead += 1.5 * math.ceil(k / workers) + 5.0    # cold compiles (~1.5 s each, parallel), warm process
    if "cuflash" in providers:
        overhead += 3.0   # prepare
    print(f"rough time estimate (H200-class rates assumed, see _EST_RATE): {total + overhead:.0f} s "
          f"({total:.0f} s measuring + ~{overhead:.0f} s start-up and compile timing); budget guard "
          f"{'off' if not args.budget_s else f'{args.budget_s:.0f} s'}")
    print("outputs:" + (f" --json {args.json}" if args.json else " (no --json)")
          + (f", --plots {args.plots} ({args.plot_dtype})" if args.plots else ", (no --plots)"))
    return 0


# ------------------------------------------------------------------------------------ main

def main(argv=None) -> int:
    args = parse_args(argv)
    if args._child_load:
        return child_load(*args._child_load)
    old = None
    if args.compare:   # read first: a bad path should fail before a run, not after it
        with open(args.compare) as f:
            old = json.load(f)
    if args.summarize:
        with open(args.summarize) as f:
            data = json.load(f)
        # recomputed from the rows, so a file from an older bench.py gets today's summary (and its
        # eager target reads n/a where the file has no eager figures)
        finalize(data)
        if old is not None:
            data["compare"] = compare_runs(data, old, args.compare_tol, args.compare)
        print_report(data)
        return 0
    if args.dry_run:
        return dry_run(args)

    import torch

    if not torch.cuda.is_available():
        print("bench.py: no CUDA device visible to torch", file=sys.stderr)
        return 2
    torch.cuda.init()
    device_index = torch.cuda.current_device()

    cuflash = cuflash_error = None
    if "cuflash" in args.providers:
        try:
            import cuflash  # noqa: F811
        except Exception as e:
            cuflash_error = _err(e)
            traceback.print_exc()
    fa_func = fa_version = fa_error = None
    if "flash_attn" in args.providers:
        try:
            import flash_attn
            from flash_attn import flash_attn_func as fa_func

            fa_version = getattr(flash_attn, "__version__", "?")
        except Exception as e:
            fa_error = _err(e)
            if not args.explicit_providers:
                args.providers = [p for p in args.providers if p != "flash_attn"]

    configs = build_configs(args)
    data = {"meta": collect_meta(torch, args, cuflash, cuflash_error, fa_version, fa_error),
            "compile": None, "prepare": None, "results": [], "memory": [], "checks": []}
    providers = args.providers
    print(f"bench.py: {len(configs)} configurations x providers {', '.join(providers)} x passes "
          f"{', '.join(args.passes)} on {data['meta'].get('device')}; progress lines give TFLOP/s as "
          f"{'GPU time/eager' if args.eager_reps else 'GPU time'}", flush=True)
    if fa_error and "flash_attn" not in providers:
        print(f"  (flash_attn not benchmarked: {fa_error})")

    # ---- compile time, then every kernel the run needs, before any timing
    if cuflash is not None:
        try:
            from cuflash import _config

            cc = torch.cuda.get_device_capability(device_index)
            family, target = _config.arch_family(*cc), _config.compile_arch(*cc)
            specs = cuflash_specs(configs, args.passes, target)
            if not args.no_compile_timing:
                print(f"compile timing: {len(pick_compile_subset(specs, args.compile_specs))} specialization(s) "
                      f"for {target}, cold then warm ...", flush=True)
                data["compile"] = compile_timing(cuflash, pick_compile_subset(specs, args.compile_specs), target,
                                                 device_index, args)
            data["prepare"] = prepare_cuflash(specs, target, device_index, args)
            print(f"prepared {len(specs)} cuflash kernels in {data['prepare']['wall_s']:.1f} s "
                  f"({data['prepare'].get('compiled', '?')} compiled)", flush=True)
        except Exception as e:
            data["prepare"] = {"error": _err(e), "wall_s": 0.0}
            traceback.print_exc()
    write_json(args.json, data)

    runner = Runner(torch, cuflash, fa_func, args)
    est_done = act_done = 0.0
    t_loop = time.perf_counter()
    try:
        for i, cfg in enumerate(configs, 1):
            est = estimate_config_s(cfg, providers, args)
            elapsed = time.perf_counter() - T_START
            scale = (act_done / est_done) if est_done > 5 else 1.0
            if args.budget_s and elapsed + est * max(scale, 0.5) > args.budget_s:
                why = f"time budget: {elapsed:.0f} s elapsed, ~{est * scale:.0f} s predicted, budget {args.budget_s:.0f} s"
                for prov in providers:
                    for ps in args.passes:
                        data["results"].append(dict({k: cfg[k] for k in ("dtype", "head_dim", "nheads", "batch",
                                                                         "seqlen", "causal")},
                                                    provider=prov, **{"pass": ps}, flops=pass_flops(cfg, ps),
                                                    skipped=why))
                print(f"[{i}/{len(configs)} {elapsed:4.0f}s] {cfg_name(cfg)}: skipped ({why})", flush=True)
                continue
            t0 = time.perf_counter()
            rows, mem_rows, check = runner.run_config(cfg, providers)
            act_done += time.perf_counter() - t0
            est_done += est
            data["results"] += rows
            data["memory"] += mem_rows
            data["checks"].append({k: cfg[k] for k in ("dtype", "head_dim", "seqlen", "causal")} | {"check": check})
            print(progress_line(i, len(configs), cfg, rows, mem_rows, check, time.perf_counter() - T_START),
                  flush=True)
            write_json(args.json, data)
    finally:
        data["meta"]["wall_s"] = time.perf_counter() - T_START
        data["meta"]["measure_s"] = time.perf_counter() - t_loop
        finalize(data)
        if old is not None:
            data["compare"] = compare_runs(data, old, args.compare_tol, args.compare)
        write_json(args.json, data)

    if args.plots:
        try:
            for path in make_plots(data, args.plots, args.plot_dtype):
                print(f"plot: {path}")
        except Exception as e:
            print(f"plots failed: {_err(e)}", file=sys.stderr)
    print_report(data)

    failed = (data["summary"]["cuflash_errors"] > 0 or ("cuflash" in providers and cuflash is None)
              or bool((data.get("compile") or {}).get("error")) or bool((data.get("prepare") or {}).get("error")))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
