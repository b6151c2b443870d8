#!/usr/bin/env python3
"""cuflash inside jax.jit against jax.nn.dot_product_attention (cuDNN and XLA) on FlashAttention-2's grid.

Grid (as bench/bench.py): batch x seqlen = 16384 tokens, hidden size 2048, i.e. head_dim 64 with 32
heads and head_dim 128 with 16 heads; seqlen 512, 1k, 2k, 4k, 8k, 16k (batch 32 down to 1); causal
off and on; bfloat16 by default (--dtypes). q, k, v are (batch, seqlen, heads, head_dim): the
layout of both cuflash and jax.nn.dot_product_attention.

Providers (an error is recorded per provider, point and pass, never fatal):
  cuflash-jit    jax.jit of cuflash.attention(q, k, v, causal=...). CUFLASH_JAX_JIT_GPU=1 is set
                 before anything is traced, so on a GPU the call runs through the experimental
                 buffer_callback route (cuflash/_adapters/_jax.py); --cmd-buffer also sets
                 CUFLASH_JAX_JIT_CMD_BUFFER=1 (XLA may record the launches into command buffers).
  cudnn          jax.jit of jax.nn.dot_product_attention(..., implementation="cudnn")
  xla            jax.jit of jax.nn.dot_product_attention(..., implementation="xla")
  cuflash-torch  cuflash.attention on torch tensors (eager), the same kernels called from torch:
                 the reference for cuflash-jit's overhead. Inputs are copies of the JAX inputs
                 (DLPack), so its outputs can be compared with cuflash-jit's.
Passes: fwd = out = attn(q, k, v) (cuflash-torch: return_lse=True and no grad, so it launches what the
jitted forward launches); fwd+bwd = jax.grad of sum(attn(q, k, v) * g) with respect to q, k, v
(cuflash-torch: torch.autograd.grad(attn(q, k, v), (q, k, v), g)).

Timing. JAX has no CUDA events: each jitted function is lowered and compiled ahead of time, then
called once; the wall time up to that first result (lower + XLA compile + first run, which for
cuflash also makes its plans and loads its kernels) is reported as compile time, on its own. Then
--warmup calls (they also set the calls per round: about --round-s worth, --min-calls to
--max-calls), then --rounds rounds of N back-to-back calls, each round ended by one
jax.block_until_ready on the last result: ms per call = round wall time / N, the figure is the
median over rounds (min beside it). cuflash-torch is timed the same way (rounds end with
torch.cuda.synchronize), so cuflash-jit / cuflash-torch compares like with like; one extra round
with CUDA events between its calls gives its GPU time per call (ms_events, median), as bench.py
measures it. The rounds of one point are timed round-robin over its providers and passes, in a new
seeded random order each round, so drift of the machine and the clock left by the previous call
fall on all of them alike. Before timing, every cuflash kernel the run needs is
compiled (in parallel, NVRTC) and loaded, as bench.py does (--no-prepare: not).
FLOPs (bench.py's convention): forward = 4 * batch * heads * seqlen^2 * head_dim, halved when
causal; fwd+bwd = 3.5 x forward.

Memory. Per JAX point: XLA's buffer assignment of the compiled program (compiled.memory_analysis():
temp + output bytes = what the call allocates beyond its arguments; cuflash's route allocates
nothing behind XLA's back, and cuDNN's workspace is one of XLA's temps); and, where the backend has
them, jax device memory_stats() before and after the first call (peak_bytes_in_use is the
process's high-water mark and cannot be reset, so a point's own peak is known only where it raised
it: peak_raised). A program whose buffers would not fit in the free device memory is skipped as
OOM before it runs.

Targets (a report, not a test), printed last as met / missed / not measured:
  jit overhead   cuflash-jit time <= 1.05 x cuflash-torch time at every point, fwd and fwd+bwd
  vs XLA         cuflash-jit >= 2.0x faster than xla at every point with seqlen >= 4k, fwd and
                 fwd+bwd (points where xla runs out of memory are listed, not counted)
  memory         cuflash-jit's temp + output bytes O(seqlen): per (batch x seqlen x heads) row,
                 flat across seqlen (max / min <= 1.5 in every pass, dtype, head_dim, causal group)
  vs cuDNN       cudnn time / cuflash-jit time over the whole grid: min, geomean, max (reported)

Output: one progress line per point; then the compile times, the memory table, the Markdown table
for README (per point and pass: ms of cuflash-jit / cudnn / xla / cuflash-torch, xla / jit and
cudnn / jit time ratios (> 1: cuflash-jit faster), jit / torch (target <= 1.05)); the summary last.
--json keeps every figure, the versions (GPU, jax/jaxlib, XLA flags, cuflash, the environment
flags) and the Markdown table, rewritten after every point. --budget-s (default 540) stops
gracefully: points predicted to end past it are skipped (and recorded as such). Exit status: 0, or
1 if cuflash-jit failed at any point (or cuflash did not import), 2 if JAX sees no GPU.

--cpu-smoke runs the whole pipeline on the CPU with tiny shapes (512 tokens, hidden 128, seqlen
128 and 256): cuflash-jit goes through pure_callback (the NumPy path), xla is the peer, cudnn is
recorded as not available, and cuflash-torch is cuflash on torch CPU tensors (no CUDA events).

Examples:
    python bench/bench_jax.py --dry-run                 # the points and a time estimate, no GPU needed
    python bench/bench_jax.py --quick                   # < 2 minutes
    python bench/bench_jax.py --json out/jax.json       # the full grid (bf16), ~budget
    python bench/bench_jax.py --head-dims 64 --json out/jax64.json; \\
        python bench/bench_jax.py --head-dims 128 --json out/jax128.json
    python bench/bench_jax.py --summarize out/jax64.json out/jax128.json   # one report from both
    python bench/bench_jax.py --cmd-buffer --xla-flags=--xla_gpu_graph_min_graph_size=1 --quick
    python bench/bench_jax.py --cpu-smoke --json /tmp/bj.json
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import platform
import random
import statistics
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if HERE not in sys.path:
    sys.path.insert(0, HERE)
if os.path.isdir(os.path.join(ROOT, "cuflash")) and ROOT not in sys.path:
    sys.path.insert(0, ROOT)   # benchmark the checkout this script belongs to

from bench_forward import nvidia_smi_info, write_json  # noqa: E402

T_START = time.perf_counter()

TOKENS = 16384
HIDDEN = 2048
SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
HEAD_DIMS = (64, 128)
DTYPES = ("bfloat16", "float16")
PASSES = ("fwd", "fwd+bwd")
PROVIDERS = ("cuflash_jit", "jax_cudnn", "jax_xla", "cuflash_torch")
JAX_PROVIDERS = ("cuflash_jit", "jax_cudnn", "jax_xla")
COL = {"cuflash_jit": "cuflash-jit", "jax_cudnn": "cudnn", "jax_xla": "xla", "cuflash_torch": "cuflash-torch"}
SHORT_COL = {"cuflash_jit": "jit", "jax_cudnn": "cudnn", "jax_xla": "xla", "cuflash_torch": "torch"}
SHORT_DTYPE = {"bfloat16": "bf16", "float16": "fp16"}
PASS_FACTOR = {"fwd": 1.0, "fwd+bwd": 3.5}
FLOP_CONVENTION = ("forward FLOPs = 4 * batch * heads * seqlen_q * seqlen_k * head_dim, halved when causal; "
                   "fwd+bwd = 3.5 x forward; TFLOP/s = FLOPs / median time")
ENV_FLAGS = ("CUFLASH_JAX_JIT_GPU", "CUFLASH_JAX_JIT_CMD_BUFFER", "XLA_FLAGS", "XLA_PYTHON_CLIENT_PREALLOCATE",
             "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_ALLOCATOR", "JAX_PLATFORMS", "CUFLASH_CACHE_DIR",
             "CUDA_VISIBLE_DEVICES", "JAX_ENABLE_X64")

JIT_VS_TORCH_LIMIT = 1.05   # cuflash-jit time / cuflash-torch time, at most, at every point
XLA_SPEEDUP_MIN = 2.0       # xla time / cuflash-jit time, at least, at seqlen >= XLA_TARGET_SEQLEN
XLA_TARGET_SEQLEN = 4096
MEM_FLAT_LIMIT = 1.5        # cuflash-jit bytes per row: max / min across seqlen, at most
OOM_FRACTION = 0.95         # skip a program whose buffers exceed this fraction of the free memory

QUICK = {"dtypes": ["bfloat16"], "head_dims": [128], "seqlens": [1024, 4096], "rounds": 5, "round_s": 0.05}
SMOKE = {"tokens": 512, "hidden": 128, "dtypes": ["bfloat16"], "head_dims": [64], "seqlens": [128, 256],
         "rounds": 3, "round_s": 0.02, "warmup": 1, "min_calls": 2, "max_calls": 20}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--quick", action="store_true",
                   help="a few points, < 2 minutes: bf16, head_dim 128, seqlen 1k and 4k, causal off and on, "
                        "5 rounds of ~0.05 s")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="run everything on the CPU with tiny shapes (pure_callback path; cudnn not available; "
                        "torch CPU as the torch column)")
    p.add_argument("--dtypes", nargs="+", choices=DTYPES, help="default: bfloat16")
    p.add_argument("--head-dims", type=int, nargs="+", metavar="D", help="heads = hidden // D; default 64 128")
    p.add_argument("--seqlens", type=int, nargs="+", metavar="N",
                   help="batch = tokens // N; default 512 1024 2048 4096 8192 16384")
    p.add_argument("--causal", choices=["both", "off", "on"], default="both")
    p.add_argument("--passes", nargs="+", choices=PASSES, help="default: fwd fwd+bwd")
    p.add_argument("--providers", nargs="+", choices=PROVIDERS, help="default: all")
    p.add_argument("--tokens", type=int, help=f"batch x seqlen (default {TOKENS}; --cpu-smoke {SMOKE['tokens']})")
    p.add_argument("--hidden", type=int, help=f"heads x head_dim (default {HIDDEN}; --cpu-smoke {SMOKE['hidden']})")
    p.add_argument("--rounds", type=int, help="timed rounds per measurement (default 7, --quick 5)")
    p.add_argument("--round-s", type=float, help="seconds per round, about (default 0.08, --quick 0.05)")
    p.add_argument("--min-calls", type=int, help="calls per round, at least (default 3)")
    p.add_argument("--max-calls", type=int, help="calls per round, at most (default 500)")
    p.add_argument("--warmup", type=int, help="calls after the first, untimed; they also set the calls per "
                                              "round (default 3)")
    p.add_argument("--cmd-buffer", action="store_true",
                   help="also set CUFLASH_JAX_JIT_CMD_BUFFER=1 (buffer_callback command_buffer_compatible)")
    p.add_argument("--xla-flags", metavar="FLAGS", help="appended to XLA_FLAGS before JAX starts")
    p.add_argument("--no-prepare", action="store_true",
                   help="do not compile and load cuflash's kernels before timing (they then compile at the "
                        "first call, inside the compile-time figure)")
    p.add_argument("--json", metavar="PATH", help="write every figure, the versions and the Markdown table here")
    p.add_argument("--budget-s", type=float, default=540.0,
                   help="skip points predicted to end past this many seconds from the start (default 540; "
                        "0 = no limit)")
    p.add_argument("--dry-run", action="store_true", help="list the points and a rough time estimate; no GPU")
    p.add_argument("--summarize", nargs="+", metavar="PATH",
                   help="print the report of earlier --json files and exit; with several, a later file's row "
                        "replaces an earlier one's at the same point, unless only the earlier one has a time")
    args = p.parse_args(argv)

    q, s = args.quick, args.cpu_smoke

    def pick(name, default):
        v = getattr(args, name)
        if v is not None:
            return v
        if s and name in SMOKE:
            return SMOKE[name]
        if q and name in QUICK:
            return QUICK[name]
        return default

    args.dtypes = pick("dtypes", ["bfloat16"])
    args.head_dims = pick("head_dims", list(HEAD_DIMS))
    args.seqlens = sorted(pick("seqlens", list(SEQLENS)))
    args.passes = [x for x in PASSES if x in (args.passes or PASSES)]
    args.providers = [x for x in PROVIDERS if x in (args.providers or PROVIDERS)]
    args.tokens = pick("tokens", TOKENS)
    args.hidden = pick("hidden", HIDDEN)
    args.rounds = pick("rounds", 7)
    args.round_s = pick("round_s", 0.08)
    args.min_calls = pick("min_calls", 3)
    args.max_calls = pick("max_calls", 500)
    args.warmup = pick("warmup", 3)
    for d in args.head_dims:
        if d < 8 or d > 256 or d % 8:
            p.error(f"--head-dims: {d} is not a multiple of 8 from 8 to 256")
    if any(n < 1 for n in args.seqlens) or args.tokens < 1 or args.hidden < 1:
        p.error("--seqlens, --tokens and --hidden must be positive")
    if args.rounds < 1 or args.min_calls < 1 or args.max_calls < args.min_calls or args.warmup < 1:
        p.error("--rounds, --min-calls and --warmup must be at least 1, --max-calls at least --min-calls")
    return args


# ------------------------------------------------------------------------------------ grid

def build_points(args):
    causals = {"both": [False, True], "off": [False], "on": [True]}[args.causal]
    out = []
    for dtype in args.dtypes:
        for d in args.head_dims:
            for c in causals:
                for s in args.seqlens:
                    out.append({"dtype": dtype, "head_dim": d, "nheads": max(1, args.hidden // d),
                                "batch": max(1, args.tokens // s), "seqlen": s, "causal": c})
    return out


POINT_KEYS = ("dtype", "head_dim", "nheads", "batch", "seqlen", "causal")


def fwd_flops(pt) -> float:
    f = 4.0 * pt["batch"] * pt["nheads"] * pt["seqlen"] * pt["seqlen"] * pt["head_dim"]
    return f / 2 if pt["causal"] else f


def seqlen_label(s: int) -> str:
    return f"{s // 1024}k" if s >= 1024 and s % 1024 == 0 else str(s)


def point_name(pt) -> str:
    return (f"{SHORT_DTYPE.get(pt['dtype'], pt['dtype'])} d{pt['head_dim']} "
            f"{'causal' if pt['causal'] else 'full  '} s{seqlen_label(pt['seqlen']):<4} "
            f"(b{pt['batch']} h{pt['nheads']})")


def find_row(rows, **sel):
    for r in rows:
        if all(r.get(k) == v for k, v in sel.items()):
            return r
    return None


# ------------------------------------------------------------------------------------ time estimate
# Guessed H100-class rates, only to predict the run time (--dry-run, the budget guard, which rescales
# them by what it measures as it goes). TFLOP/s (fwd, fwd+bwd); compile seconds (fwd, fwd+bwd).
_EST_RATE = {"cuflash_jit": (300, 170), "cuflash_torch": (300, 170), "jax_cudnn": (450, 300), "jax_xla": (150, 90)}
_EST_COMPILE_S = {"cuflash_jit": (0.6, 1.2), "jax_cudnn": (1.0, 2.5), "jax_xla": (0.5, 1.2), "cuflash_torch": (0.0, 0.0)}


def est_call_ms(pt, prov, ps) -> float:
    ms = fwd_flops(pt) * PASS_FACTOR[ps] / (_EST_RATE[prov][PASSES.index(ps)] * 1e12) * 1e3
    if prov == "jax_xla":   # fp32 (b, h, s, s) scores through HBM, a few times each way
        score = pt["batch"] * pt["nheads"] * pt["seqlen"] ** 2 * 4
        ms += score * (4 if ps == "fwd" else 12) / 3.0e12 * 1e3
    return max(ms, 0.03)


def calls_for(ms, args) -> int:
    return max(args.min_calls, min(args.max_calls, math.ceil(args.round_s * 1e3 / max(ms, 1e-3))))


def estimate_point_s(pt, args) -> float:
    total = 0.3   # inputs, checks, Python
    for prov in args.providers:
        for ps in args.passes:
            ms = est_call_ms(pt, prov, ps)
            total += _EST_COMPILE_S[prov][PASSES.index(ps)]
            total += (1 + args.warmup + args.rounds * calls_for(ms, args)) * ms / 1e3 + 0.01 * args.rounds
            if prov == "cuflash_torch":
                total += calls_for(ms, args) * ms / 1e3   # the events round
    return total


# ------------------------------------------------------------------------------------ helpers

def _err(e) -> str:
    msg = str(e).strip()
    first = msg.splitlines()[0][:300] if msg else ""
    return f"{type(e).__name__}: {first}"


def _is_oom(e) -> bool:
    m = str(e)
    return "RESOURCE_EXHAUSTED" in m or "out of memory" in m.lower() or "OutOfMemory" in type(e).__name__


def _size(n) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _fail(row, e, unavailable=False):
    if unavailable:
        row["unavailable"] = _err(e)
    else:
        row["error"] = _err(e)
        if _is_oom(e):
            row["oom"] = True


def memory_analysis(compiled):
    """XLA's buffer assignment of a compiled program (bytes), or None."""
    try:
        ma = compiled.memory_analysis()
    except Exception:
        return None
    if ma is None:
        return None
    out = {}
    for name in ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes", "alias_size_in_bytes",
                 "generated_code_size_in_bytes", "host_temp_size_in_bytes"):
        v = getattr(ma, name, None)
        if v is not None:
            out[name.replace("_size_in_bytes", "_bytes")] = int(v)
    if "temp_bytes" in out and "output_bytes" in out:
        out["extra_bytes"] = out["temp_bytes"] + out["output_bytes"] - out.get("alias_bytes", 0)
    return out or None


def mem_stats(dev):
    try:
        st = dev.memory_stats()
    except Exception:
        return None
    if not st:
        return None
    return {k: int(st[k]) for k in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit", "bytes_reserved",
                                    "largest_alloc_size") if k in st}


# ------------------------------------------------------------------------------------ measuring

class Entry:
    """One (provider, pass) of a point, ready to be timed: call() returns a result, sync(result) waits."""

    def __init__(self, prov, ps, row, call, sync, n, out):
        self.prov, self.ps, self.row, self.call, self.sync, self.n, self.out = prov, ps, row, call, sync, n, out
        self.rounds_ms = []


def warm_and_pilot(call, sync, args) -> int:
    """--warmup calls back to back (after the first call, made by the caller); their time sets N."""
    t0 = time.perf_counter()
    out = None
    for _ in range(args.warmup):
        out = call()
    sync(out)
    ms = (time.perf_counter() - t0) / args.warmup * 1e3
    return calls_for(ms, args)


def one_round(call, sync, n) -> float:
    """ms per call over n back-to-back calls and one wait at the end."""
    out = None
    was = gc.isenabled()
    gc.disable()   # no collection inside a round
    try:
        t0 = time.perf_counter()
        for _ in range(n):
            out = call()
        sync(out)
        return (time.perf_counter() - t0) / n * 1e3
    finally:
        if was:
            gc.enable()


class Runner:
    def __init__(self, jax, torch, torch_error, cuflash, args, smoke):
        import jax.numpy as jnp

        self.jax, self.jnp, self.torch, self.cf, self.args, self.smoke = jax, jnp, torch, cuflash, args, smoke
        self.torch_error = torch_error
        self.dev = jax.devices()[0]
        self.torch_gpu = bool(torch is not None and not smoke and torch.cuda.is_available())

    # ---- callables

    def attn(self, prov, causal):
        jax, cf = self.jax, self.cf
        if prov == "cuflash_jit":
            if cf is None:
                raise RuntimeError("cuflash did not import")
            return lambda q, k, v: cf.attention(q, k, v, causal=causal)
        impl = {"jax_cudnn": "cudnn", "jax_xla": "xla"}[prov]
        return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation=impl)

    def pass_fn(self, attn, ps):
        if ps == "fwd":
            return attn
        jnp = self.jnp

        def loss(q, k, v, g):
            return jnp.sum(attn(q, k, v) * g, dtype=jnp.float32)
        return self.jax.grad(loss, argnums=(0, 1, 2))

    # ---- one point

    def run_point(self, pt, deadline):
        """(rows, check). Prepares every (provider, pass), times their rounds round-robin, checks outputs."""
        jax, jnp, args = self.jax, self.jnp, self.args
        base = {k: pt[k] for k in POINT_KEYS}
        rows = {(prov, ps): dict(base, provider=prov, **{"pass": ps}, flops=fwd_flops(pt) * PASS_FACTOR[ps])
                for prov in args.providers for ps in args.passes}
        entries, check = [], {}
        try:
            b, s, h, d = pt["batch"], pt["seqlen"], pt["nheads"], pt["head_dim"]
            dt = getattr(jnp, pt["dtype"])
            keys = jax.random.split(jax.random.PRNGKey(1000 + s + d), 4)
            q, k, v, g = (jax.device_put(jax.random.normal(kk, (b, s, h, d), jnp.float32).astype(dt), self.dev)
                          for kk in keys)
            jax.block_until_ready((q, k, v, g))
            tin = None
            for prov in args.providers:
                for ps in args.passes:
                    row = rows[(prov, ps)]
                    if time.perf_counter() > deadline:
                        row["skipped"] = "time budget (during the point)"
                        continue
                    if prov == "cuflash_torch" and self.torch_error:
                        row["unavailable"] = self.torch_error
                        continue
                    try:
                        if prov == "cuflash_torch":
                            if tin is None:
                                tin = self.torch_inputs(q, k, v, g, pt)
                            e = self.prepare_torch(ps, pt, tin, row)
                        else:
                            e = self.prepare_jax(prov, ps, pt, (q, k, v, g), row)
                        if e is not None:
                            entries.append(e)
                    except Exception as ex:
                        _fail(row, ex, unavailable=self.smoke and prov == "jax_cudnn")
                        if not (self.smoke and prov == "jax_cudnn"):
                            traceback.print_exc()
            gc.collect()
            live = list(entries)
            for r in range(args.rounds):
                if r > 0 and time.perf_counter() > deadline:
                    break   # fewer rounds, figures still stand
                # A fresh order each round (seeded): what runs just before a provider (a long
                # compute-bound call heats the GPU and lowers its clock) is then random, not always
                # the same neighbour.
                order = list(live)
                random.Random(7919 * r + pt["seqlen"]).shuffle(order)
                for e in order:
                    try:
                        e.rounds_ms.append(one_round(e.call, e.sync, e.n))
                    except Exception as ex:
                        _fail(e.row, ex)
                        live.remove(e)
            for e in live:
                ms = e.rounds_ms
                med = statistics.median(ms)
                e.row.update(ms=med, ms_min=min(ms), calls=e.n, rounds=len(ms), rounds_ms=ms,
                             tflops=e.row["flops"] / (med * 1e-3) / 1e12)
                if e.prov == "cuflash_torch" and self.torch_gpu:
                    try:
                        e.row["ms_events"] = self.torch_events(e.call, e.n)
                    except Exception as ex:
                        e.row["events_error"] = _err(ex)
            check = self.check(entries, tin)
        except Exception as ex:   # e.g. the inputs did not fit: every row not yet done gets the error
            traceback.print_exc()
            for row in rows.values():
                if "ms" not in row and not row.get("error") and not row.get("skipped"):
                    _fail(row, ex)
        finally:
            entries = None
            if self.torch_gpu:
                self.torch.cuda.empty_cache()
        return list(rows.values()), check

    def prepare_jax(self, prov, ps, pt, inputs, row):
        jax = self.jax
        fn = self.pass_fn(self.attn(prov, pt["causal"]), ps)
        a = inputs[:3] if ps == "fwd" else inputs
        jitted = jax.jit(fn)
        st0 = mem_stats(self.dev)
        t0 = time.perf_counter()
        lowered = jitted.lower(*a)
        t1 = time.perf_counter()
        compiled = lowered.compile()
        t2 = time.perf_counter()
        row.update(lower_s=t1 - t0, xla_compile_s=t2 - t1)
        ma = memory_analysis(compiled)
        if ma is not None:
            row["memory"] = ma
        if st0 and ma and st0.get("bytes_limit"):
            need = ma.get("temp_bytes", 0) + ma.get("output_bytes", 0)
            free = st0["bytes_limit"] - st0.get("bytes_in_use", 0)
            if need > OOM_FRACTION * free:
                row.update(skipped=f"memory: XLA's buffers need {_size(need)}, {_size(free)} free", oom=True)
                return None
        del compiled, lowered
        t3 = time.perf_counter()
        out = jitted(*a)
        jax.block_until_ready(out)
        t4 = time.perf_counter()
        row.update(first_run_s=t4 - t3, compile_s=t4 - t0)
        st1 = mem_stats(self.dev)
        if st0 and st1:
            raised = st1.get("peak_bytes_in_use", 0) > st0.get("peak_bytes_in_use", 0)
            row["mem_stats"] = {"bytes_in_use_before": st0.get("bytes_in_use"),
                                "peak_before": st0.get("peak_bytes_in_use"), "peak_after": st1.get("peak_bytes_in_use"),
                                "bytes_limit": st0.get("bytes_limit"), "peak_raised": raised}
            if raised:
                row["mem_stats"]["peak_extra_bytes"] = st1["peak_bytes_in_use"] - st0.get("bytes_in_use", 0)

        def call():
            return jitted(*a)
        n = warm_and_pilot(call, jax.block_until_ready, self.args)
        return Entry(prov, ps, row, call, jax.block_until_ready, n, out)

    def torch_inputs(self, q, k, v, g, pt):
        """torch copies of the JAX inputs (DLPack); random ones if that fails (then outputs are not compared)."""
        torch = self.torch
        if torch is None:
            raise RuntimeError("torch did not import")
        if not self.smoke and not torch.cuda.is_available():
            raise RuntimeError("torch sees no CUDA device")
        dev = "cpu" if self.smoke else "cuda"
        try:
            ts = [torch.from_dlpack(x).clone() for x in (q, k, v, g)]
            if any(t.device.type != torch.device(dev).type for t in ts):
                raise RuntimeError("DLPack gave tensors on another device")
            same = True
        except Exception:
            dt = getattr(torch, pt["dtype"])
            shape = (pt["batch"], pt["seqlen"], pt["nheads"], pt["head_dim"])
            ts = [torch.randn(*shape, device=dev, dtype=dt) for _ in range(4)]
            same = False
        grad = [t.clone().requires_grad_(True) for t in ts[:3]]
        return {"plain": ts[:3], "grad": grad, "g": ts[3], "same_inputs": same}

    def prepare_torch(self, ps, pt, tin, row):
        torch, cf = self.torch, self.cf
        if cf is None:
            raise RuntimeError("cuflash did not import")
        c = pt["causal"]
        if ps == "fwd":
            q, k, v = tin["plain"]

            def call():
                return cf.attention(q, k, v, causal=c, return_lse=True)
        else:
            (q, k, v), g = tin["grad"], tin["g"]

            def call():
                return torch.autograd.grad(cf.attention(q, k, v, causal=c), (q, k, v), g)
        sync = (lambda out: torch.cuda.synchronize()) if self.torch_gpu else (lambda out: None)
        t0 = time.perf_counter()
        out = call()
        sync(out)
        row["first_call_s"] = time.perf_counter() - t0
        n = warm_and_pilot(call, sync, self.args)
        return Entry("cuflash_torch", ps, row, call, sync, n, out)

    def torch_events(self, call, n) -> float:
        """GPU time per call (ms): CUDA events between n back-to-back calls, median."""
        torch = self.torch
        evs = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
        torch.cuda.synchronize()
        evs[0].record()
        for i in range(n):
            call()
            evs[i + 1].record()
        torch.cuda.synchronize()
        return statistics.median(evs[i].elapsed_time(evs[i + 1]) for i in range(n))

    # ---- outputs compared

    def _np32(self, x):
        import numpy as np

        if self.torch is not None and isinstance(x, self.torch.Tensor):
            return x.detach().float().cpu().numpy()
        return np.asarray(x.astype(self.jnp.float32))

    def maxdiff(self, a, b) -> float:
        jnp = self.jnp
        torch = self.torch
        is_t = [torch is not None and isinstance(x, torch.Tensor) for x in (a, b)]
        try:   # on the device: a torch tensor joins JAX through DLPack
            a2, b2 = ((self.jax.dlpack.from_dlpack(x.detach().contiguous()) if t else x) for x, t in zip((a, b), is_t))
            return float(jnp.max(jnp.abs(a2.astype(jnp.float32) - b2.astype(jnp.float32))))
        except Exception:
            import numpy as np

            return float(np.max(np.abs(self._np32(a) - self._np32(b))))

    def check(self, entries, tin):
        """max |difference| of cuflash-jit's out (fwd) and dq, dk, dv (fwd+bwd) against xla (else cudnn), and
        against cuflash-torch (the same kernels: expect 0 forward, atomics-order noise in dq)."""
        outs = {(e.prov, e.ps): e.out for e in entries}
        res = {}
        for ps in self.args.passes:
            mine = outs.get(("cuflash_jit", ps))
            if mine is None:
                continue
            names = ("out",) if ps == "fwd" else ("dq", "dk", "dv")
            mine_l = [mine] if ps == "fwd" else list(mine)
            ref = next((p for p in ("jax_xla", "jax_cudnn") if (p, ps) in outs), None)
            try:
                if ref is not None:
                    other = outs[(ref, ps)]
                    other_l = [other] if ps == "fwd" else list(other)
                    res[f"{ps} vs {COL[ref]}"] = {n: self.maxdiff(a, b) for n, a, b in zip(names, mine_l, other_l)}
                t = outs.get(("cuflash_torch", ps))
                if t is not None and tin is not None and tin.get("same_inputs"):
                    t_l = [t[0]] if ps == "fwd" else list(t)
                    res[f"{ps} vs cuflash-torch"] = {n: self.maxdiff(a, b) for n, a, b in zip(names, mine_l, t_l)}
            except Exception as ex:
                res[f"{ps} error"] = _err(ex)
        return res


# ------------------------------------------------------------------------------------ cuflash kernels

def prepare_cuflash(points, passes, jax_dev):
    """Every cuflash kernel the run launches, compiled (in parallel) and loaded, as bench.py does it
    (bench.py's cuflash_specs mirrors cuflash's kernel selection)."""
    t0 = time.perf_counter()
    res = {}
    try:
        if HERE not in sys.path:
            sys.path.insert(0, HERE)
        import bench as _bench
        from cuflash import _compile, _config, _gpu

        major, minor = (int(x) for x in str(jax_dev.compute_capability).split("."))
        target = _config.compile_arch(major, minor)
        passes_b = ["fwd"] + (["fwd+bwd"] if "fwd+bwd" in passes else [])
        specs = _bench.cuflash_specs(points, passes_b, target)
        workers = max(1, min(os.cpu_count() or 1, len(specs)))
        logs = _gpu.compile_many([sp for sp, _ in specs], target, workers=workers, return_logs=True)
        res["compiled"] = sum(1 for _, secs, _ in logs if secs > 0)
        device_index = getattr(jax_dev, "local_hardware_id", None)
        device_index = 0 if device_index is None else device_index
        for sp, smem in specs:
            _compile.get_function(sp, target, device_index, smem)
        res.update(target=target, specializations=len(specs))
    except Exception as e:
        res["error"] = _err(e)
    res["wall_s"] = time.perf_counter() - t0
    return res


# ------------------------------------------------------------------------------------ metadata

def collect_meta(jax, torch, cuflash, cuflash_error, torch_error, args, smoke):
    import jaxlib

    dev = jax.devices()[0]
    meta = {
        "timestamp_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "argv": sys.argv[1:],
        "python": platform.python_version(),
        "host": platform.node(),
        "cpu_smoke": bool(smoke),
        "quick": bool(args.quick),
        "jax": jax.__version__,
        "jaxlib": getattr(jaxlib, "__version__", None),
        "jax_backend": jax.default_backend(),
        "jax_devices": [f"{d.platform}:{d.id} {getattr(d, 'device_kind', '')}" for d in jax.devices()],
        "device": getattr(dev, "device_kind", None) or str(dev),
        "compute_capability": getattr(dev, "compute_capability", None),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "env": {k: os.environ.get(k) for k in ENV_FLAGS},
        "cmd_buffer": bool(args.cmd_buffer),
        "cuflash": getattr(cuflash, "__version__", None) if cuflash is not None else None,
        "cuflash_path": os.path.dirname(os.path.abspath(cuflash.__file__)) if cuflash is not None else None,
        "cuflash_import_error": cuflash_error,
        "torch": getattr(torch, "__version__", None) if torch is not None else None,
        "torch_error": torch_error,
        "nvidia_smi": None if smoke else nvidia_smi_info(),
        "flop_convention": FLOP_CONVENTION,
        "grid": {"tokens": args.tokens, "hidden": args.hidden, "dtypes": args.dtypes, "head_dims": args.head_dims,
                 "seqlens": args.seqlens, "causal": args.causal, "passes": args.passes, "providers": args.providers},
        "timing": {"statistic": "median over rounds of (round wall time / calls); a round = N back-to-back calls "
                                "and one wait (jax.block_until_ready / torch.cuda.synchronize)",
                   "compile_s": "JAX: lower + XLA compile + first run (the first call's wall time); "
                                "cuflash-torch: first_call_s",
                   "ms_events": "cuflash-torch only: median CUDA-event time per call over one extra round",
                   "rounds": args.rounds, "round_s": args.round_s, "min_calls": args.min_calls,
                   "max_calls": args.max_calls, "warmup": args.warmup},
        "passes": {"fwd": "out = attn(q, k, v) (cuflash-torch: return_lse=True, inputs without grad)",
                   "fwd+bwd": "jax.grad of sum(attn(q, k, v) * g, dtype=float32) w.r.t. q, k, v "
                              "(cuflash-torch: torch.autograd.grad(attn(q, k, v), (q, k, v), g))"},
        "memory": "memory.extra_bytes = temp + output bytes of XLA's buffer assignment (compiled.memory_analysis()); "
                  "mem_stats: jax device memory_stats() around the first call (peak is process-wide, no reset)",
        "targets": {"jit_vs_torch_max": JIT_VS_TORCH_LIMIT, "xla_speedup_min": XLA_SPEEDUP_MIN,
                    "xla_target_seqlen": XLA_TARGET_SEQLEN, "mem_flat_max": MEM_FLAT_LIMIT},
    }
    try:
        from jax._src.lib import cuda_versions

        if cuda_versions is not None:
            meta["cudnn"] = cuda_versions.cudnn_get_version()
            meta["cuda_runtime"] = cuda_versions.cuda_runtime_get_version()
    except Exception:
        pass
    if torch is not None:
        meta["torch_cuda"] = getattr(torch.version, "cuda", None)
        try:
            if not smoke and torch.cuda.is_available():
                meta["torch_device"] = torch.cuda.get_device_name(0)
        except Exception:
            pass
    if meta.get("nvidia_smi"):
        parts = [x.strip() for x in meta["nvidia_smi"][0].split(",")]
        if len(parts) > 1:
            meta["driver"] = parts[1]
    return meta


# ------------------------------------------------------------------------------------ analysis

SEL = ("dtype", "head_dim", "causal", "seqlen")


def _geomean(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def _pt(r) -> dict:
    return {k: r[k] for k in SEL}


def _point_text(w) -> str:
    return (f"{SHORT_DTYPE.get(w['dtype'], w['dtype'])} d{w['head_dim']} {'causal' if w['causal'] else 'full'} "
            f"{seqlen_label(w['seqlen'])}")


def _pairs(res, ps, other, test=lambda r: True):
    """[(cuflash-jit row, other row)] of pass ps where cuflash-jit has a time."""
    out = []
    for r in res:
        if r["provider"] != "cuflash_jit" or r["pass"] != ps or not test(r):
            continue
        out.append((r, find_row(res, provider=other, **{"pass": ps}, **_pt(r))))
    return out


def _status(parts):
    st = [p["status"] for p in parts.values()]
    if "missed" in st:
        return "missed"
    if st and all(s == "met" for s in st):
        return "met"
    if "met" in st:
        return "met (partly measured)"
    return "not measured"


def target_jit_vs_torch(res, passes):
    out = {}
    for ps in passes:
        pairs = [(a, b) for a, b in _pairs(res, ps, "cuflash_torch") if b and a.get("ms") and b.get("ms")]
        jit_failed = [a for a, b in _pairs(res, ps, "cuflash_torch") if a.get("error") and b and b.get("ms")]
        if not pairs and not jit_failed:
            out[ps] = {"status": "not measured"}
            continue
        ratios = [(a["ms"] / b["ms"], a, b) for a, b in pairs]
        d = {"n": len(ratios), "jit_errors": len(jit_failed)}
        if ratios:
            worst = max(ratios, key=lambda x: x[0])
            d.update(max=worst[0], min=min(x[0] for x in ratios), geomean=_geomean([x[0] for x in ratios]),
                     worst=_pt(worst[1]))
            ev = [a["ms"] / b["ms_events"] for _, a, b in ratios if b.get("ms_events")]
            if ev:
                d["vs_events"] = {"max": max(ev), "geomean": _geomean(ev), "n": len(ev)}
        d["status"] = "missed" if jit_failed or (ratios and d["max"] > JIT_VS_TORCH_LIMIT) else "met"
        out[ps] = d
    return {"limit": JIT_VS_TORCH_LIMIT, "passes": out, "status": _status(out)}


def target_vs_xla(res, passes):
    out = {}
    test = lambda r: r["seqlen"] >= XLA_TARGET_SEQLEN  # noqa: E731
    for ps in passes:
        pairs = _pairs(res, ps, "jax_xla", test)
        ratios = [(b["ms"] / a["ms"], a) for a, b in pairs if b and a.get("ms") and b.get("ms")]
        xla_oom = [_pt(a) for a, b in pairs if b and b.get("oom") and a.get("ms")]
        jit_failed = [_pt(a) for a, b in pairs if not a.get("ms") and (a.get("error"))]
        if not ratios and not xla_oom and not jit_failed:
            out[ps] = {"status": "not measured"}
            continue
        d = {"n": len(ratios), "xla_oom_points": xla_oom, "jit_failed_points": jit_failed}
        if ratios:
            lo = min(ratios, key=lambda x: x[0])
            d.update(min=lo[0], geomean=_geomean([x for x, _ in ratios]), max=max(x for x, _ in ratios),
                     worst=_pt(lo[1]))
        if jit_failed or (ratios and d["min"] < XLA_SPEEDUP_MIN):
            d["status"] = "missed"
        else:
            d["status"] = "met"
        out[ps] = d
    return {"limit": XLA_SPEEDUP_MIN, "min_seqlen": XLA_TARGET_SEQLEN, "passes": out, "status": _status(out)}


def _bytes_per_row(r):
    m = r.get("memory") or {}
    if m.get("extra_bytes") is None:
        return None
    return m["extra_bytes"] / (r["batch"] * r["seqlen"] * r["nheads"])


def memory_growth(res, prov):
    """Per (pass, dtype, head_dim, causal): bytes per (batch x seqlen x heads) row across seqlen."""
    groups = {}
    for r in res:
        if r["provider"] != prov:
            continue
        bpr = _bytes_per_row(r)
        if bpr is None:
            continue
        key = (r["pass"], r["dtype"], r["head_dim"], r["causal"])
        groups.setdefault(key, []).append((r["seqlen"], bpr, r["memory"]["extra_bytes"]))
    out = []
    for (ps, dt, hd, c), pts in sorted(groups.items(), key=lambda x: str(x[0])):
        pts.sort()
        bprs = [x[1] for x in pts if x[1] > 0]
        out.append({"pass": ps, "dtype": dt, "head_dim": hd, "causal": c, "seqlens": [x[0] for x in pts],
                    "bytes_per_row": [x[1] for x in pts], "extra_bytes": [x[2] for x in pts],
                    "growth": (max(bprs) / min(bprs)) if len(bprs) >= 2 else None})
    return out


def target_memory(res):
    groups = memory_growth(res, "cuflash_jit")
    measured = [g for g in groups if g["growth"] is not None]
    xla = [g for g in memory_growth(res, "jax_xla") if g["growth"] is not None]
    d = {"limit": MEM_FLAT_LIMIT, "groups": groups, "xla_groups": xla}
    if not measured:
        d["status"] = "not measured"
        return d
    worst = max(measured, key=lambda g: g["growth"])
    d.update(max_growth=worst["growth"], worst={k: worst[k] for k in ("pass", "dtype", "head_dim", "causal")},
             n_groups=len(measured),
             max_extra_bytes=max(max(g["extra_bytes"]) for g in measured),
             status="met" if worst["growth"] <= MEM_FLAT_LIMIT else "missed")
    if xla:
        d["xla_max_growth"] = max(g["growth"] for g in xla)
    return d


def report_vs_cudnn(res, passes):
    out = {}
    for ps in passes:
        ratios = [(b["ms"] / a["ms"], a) for a, b in _pairs(res, ps, "jax_cudnn") if b and a.get("ms") and b.get("ms")]
        if not ratios:
            out[ps] = {"status": "not measured"}
            continue
        lo, hi = min(ratios, key=lambda x: x[0]), max(ratios, key=lambda x: x[0])
        out[ps] = {"status": "reported", "n": len(ratios), "min": lo[0], "min_at": _pt(lo[1]),
                   "geomean": _geomean([x for x, _ in ratios]), "max": hi[0], "max_at": _pt(hi[1])}
    st = "reported" if any(p["status"] == "reported" for p in out.values()) else "not measured"
    return {"ratio": "cudnn time / cuflash-jit time (> 1: cuflash-jit faster)", "passes": out, "status": st}


def finalize(data):
    res = data.get("results", [])
    passes = [p for p in PASSES if any(r["pass"] == p for r in res)] or list(PASSES)
    counts = {}
    for r in res:
        c = counts.setdefault(r["provider"], {"ok": 0, "error": 0, "oom": 0, "skipped": 0, "unavailable": 0})
        if r.get("ms") is not None:
            c["ok"] += 1
        elif r.get("oom"):
            c["oom"] += 1
        elif r.get("unavailable"):
            c["unavailable"] += 1
        elif r.get("skipped"):
            c["skipped"] += 1
        elif r.get("error"):
            c["error"] += 1
    data["targets"] = {"jit_vs_torch": target_jit_vs_torch(res, passes), "vs_xla": target_vs_xla(res, passes),
                       "memory": target_memory(res), "vs_cudnn": report_vs_cudnn(res, passes)}
    data["counts"] = counts
    data["summary"] = {name: t["status"] for name, t in data["targets"].items()}
    data["cuflash_jit_errors"] = sum(1 for r in res if r["provider"] == "cuflash_jit" and r.get("error")
                                     and not r.get("oom"))
    data["markdown"] = format_markdown(data)
    return data


# ------------------------------------------------------------------------------------ printing

def _ms_cell(r) -> str:
    if r is None:
        return ""
    if r.get("ms") is not None:
        ms = r["ms"]
        return f"{ms:.3f}" if ms < 10 else (f"{ms:.2f}" if ms < 100 else f"{ms:.1f}")
    if r.get("oom"):
        return "OOM"
    if r.get("unavailable"):
        return "n/a"
    if r.get("skipped"):
        return "skip"
    if r.get("error"):
        return "ERR"
    return "-"


def _ratio(a, b):
    """a's time / b's time, or None."""
    if a and b and a.get("ms") and b.get("ms"):
        return a["ms"] / b["ms"]
    return None


def _r(x) -> str:
    return f"{x:.2f}" if x is not None else "-"


def _sorted_points(res):
    keys = {(r["pass"], r["dtype"], r["head_dim"], r["causal"], r["seqlen"]) for r in res}
    return sorted(keys, key=lambda x: (PASSES.index(x[0]) if x[0] in PASSES else 9,
                                       DTYPES.index(x[1]) if x[1] in DTYPES else 9, x[2], x[3], x[4]))


def format_markdown(data) -> str:
    res = data.get("results", [])
    if not res:
        return ""
    m = data.get("meta", {})
    lines = [f"cuflash under `jax.jit` ({m.get('device', '?')}, jax {m.get('jax')}, cuflash {m.get('cuflash')}"
             f"{', XLA command buffers' if m.get('cmd_buffer') else ''}): ms per call, median of rounds of "
             "back-to-back calls. xla / jit and cudnn / jit: their time over cuflash-jit's (> 1: cuflash-jit "
             "faster); jit / torch: cuflash-jit over the same kernels called from torch (target <= "
             f"{JIT_VS_TORCH_LIMIT}).",
             "",
             "| pass | dtype | d | causal | seqlen | batch x heads | cuflash-jit | cudnn | xla | cuflash-torch "
             "| xla / jit | cudnn / jit | jit / torch |",
             "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for ps, dt, hd, c, s in _sorted_points(res):
        sel = {"pass": ps, "dtype": dt, "head_dim": hd, "causal": c, "seqlen": s}
        row = {p: find_row(res, provider=p, **sel) for p in PROVIDERS}
        j = row["cuflash_jit"]
        any_r = next(r for r in row.values() if r)
        lines.append(f"| {ps} | {SHORT_DTYPE.get(dt, dt)} | {hd} | {'on' if c else 'off'} | {seqlen_label(s)} | "
                     f"{any_r['batch']} x {any_r['nheads']} | " + " | ".join(_ms_cell(row[p]) for p in PROVIDERS)
                     + f" | {_r(_ratio(row['jax_xla'], j))} | {_r(_ratio(row['jax_cudnn'], j))} | "
                     f"{_r(_ratio(j, row['cuflash_torch']))} |")
    lines.append("")
    lines.append("OOM: XLA's buffers do not fit (skipped before running, or the run failed for memory); n/a: not "
                 "available on this backend; ERR: see the JSON; skip: time budget.")
    return "\n".join(lines)


def format_header(data) -> str:
    m = data.get("meta", {})
    lines = [f"device: {m.get('device', '?')} (cc {m.get('compute_capability')}, driver {m.get('driver', '?')}, "
             f"cuDNN {m.get('cudnn', '?')}) | jax {m.get('jax')} / jaxlib {m.get('jaxlib')} ({m.get('jax_backend')}) | "
             f"torch {m.get('torch') or 'not available'} | cuflash {m.get('cuflash')} | {m.get('timestamp_utc', '')}",
             "env: " + ", ".join(f"{k}={v}" for k, v in (m.get("env") or {}).items() if v is not None)]
    if m.get("cuflash_import_error"):
        lines.append(f"cuflash import error: {m['cuflash_import_error']}")
    if m.get("merged_from"):
        lines.append(f"merged from: {', '.join(m['merged_from'])}")
    return "\n".join(lines)


def format_compile(data) -> str:
    res = data.get("results", [])
    lines = ["=== compile time (s; kept out of every figure): JAX = lower + XLA compile + first run "
             "(the first call's wall time); torch = cuflash-torch's first call; f+b = fwd+bwd ==="]
    p = data.get("prepare")
    if p:
        lines.append(f"cuflash kernels prepared before timing: {p.get('specializations', '?')} for "
                     f"{p.get('target', '?')}, {p.get('compiled', '?')} compiled, {p.get('wall_s', 0):.1f} s"
                     + (f"; ERROR {p['error']}" if p.get("error") else ""))
    cols = [(prov, ps) for prov in PROVIDERS for ps in PASSES
            if any(r["provider"] == prov and r["pass"] == ps for r in res)]
    if not cols:
        return "\n".join(lines)
    hdr = f"{'dtype':<6}{'d':>4}{'causal':>7}{'seqlen':>7}" + "".join(
        f"{SHORT_COL[p] + ' ' + ('fwd' if ps == 'fwd' else 'f+b'):>11}" for p, ps in cols)
    lines += [hdr, "-" * len(hdr)]
    pts = sorted({(r["dtype"], r["head_dim"], r["causal"], r["seqlen"]) for r in res},
                 key=lambda x: (DTYPES.index(x[0]) if x[0] in DTYPES else 9, x[1], x[2], x[3]))
    for dt, hd, c, s in pts:
        cells = []
        for prov, ps in cols:
            r = find_row(res, provider=prov, **{"pass": ps}, dtype=dt, head_dim=hd, causal=c, seqlen=s)
            v = None if r is None else (r.get("compile_s") if r.get("compile_s") is not None else r.get("first_call_s"))
            cells.append(f"{(f'{v:.2f}' if v is not None else (_ms_cell(r) or '-')):>11}")
        lines.append(f"{SHORT_DTYPE.get(dt, dt):<6}{hd:>4}{('on' if c else 'off'):>7}{seqlen_label(s):>7}" + "".join(cells))
    return "\n".join(lines)


def format_memory(data) -> str:
    res = data.get("results", [])
    jaxp = [p for p in JAX_PROVIDERS if any(r["provider"] == p and r.get("memory") for r in res)]
    if not jaxp:
        return "=== memory: XLA's memory_analysis not available on this backend ==="
    lines = ["=== memory (MiB): temp + output bytes of XLA's buffer assignment per call; in brackets, the "
             "process peak the first call reached (memory_stats) where it raised it ==="]
    hdr = f"{'pass':<8}{'dtype':<6}{'d':>4}{'causal':>7}{'seqlen':>7}" + "".join(f"{COL[p]:>22}" for p in jaxp)
    lines += [hdr, "-" * len(hdr)]
    for ps, dt, hd, c, s in _sorted_points(res):
        cells = []
        for p in jaxp:
            r = find_row(res, provider=p, **{"pass": ps}, dtype=dt, head_dim=hd, causal=c, seqlen=s)
            mem = (r or {}).get("memory") or {}
            txt = f"{mem['extra_bytes'] / 2**20:.1f}" if mem.get("extra_bytes") is not None else (_ms_cell(r) or "-")
            if mem.get("extra_bytes") is not None and r.get("oom"):
                txt += " OOM"
            ms_ = (r or {}).get("mem_stats") or {}
            if ms_.get("peak_raised") and ms_.get("peak_extra_bytes") is not None:
                txt += f" [{ms_['peak_extra_bytes'] / 2**20:.0f}]"
            cells.append(f"{txt:>22}")
        lines.append(f"{ps:<8}{SHORT_DTYPE.get(dt, dt):<6}{hd:>4}{('on' if c else 'off'):>7}{seqlen_label(s):>7}"
                     + "".join(cells))
    return "\n".join(lines)


def format_errors(data) -> str:
    seen = {}
    for r in data.get("results", []):
        for key in ("error", "unavailable", "events_error"):
            if r.get(key):
                seen.setdefault((r["provider"], key, r[key]), []).append(r)
    if not seen:
        return ""
    lines = ["=== errors and unavailable providers ==="]
    for (prov, key, msg), rows in seen.items():
        lines.append(f"{COL[prov]} ({key}, {len(rows)} row(s), e.g. {rows[0]['pass']} {_point_text(rows[0])}): {msg}")
    return "\n".join(lines)


def format_summary(data) -> str:
    t = data["targets"]
    lines = ["=== summary: targets (a report, not a test) ==="]
    if data.get("meta", {}).get("cpu_smoke"):
        lines.append("(CPU smoke: NumPy path through pure_callback, tiny shapes; these figures check the pipeline, "
                     "the targets are for a GPU run)")

    jt = t["jit_vs_torch"]
    lines.append(f"[{jt['status'].upper()}] cuflash-jit time <= {JIT_VS_TORCH_LIMIT:.2f} x cuflash-torch time "
                 "(same kernels, same timing method) at every point:")
    for ps, d in jt["passes"].items():
        if d["status"] == "not measured":
            lines.append(f"    {ps:<8} not measured")
            continue
        txt = f"    {ps:<8} {d['status']}"
        if d.get("n"):
            txt += (f": max {d['max']:.3f} ({_point_text(d['worst'])}), geomean {d['geomean']:.3f}, min "
                    f"{d['min']:.3f} over {d['n']} points")
            if d.get("vs_events"):
                txt += f"; against torch's CUDA-event time: max {d['vs_events']['max']:.3f}, geomean " \
                       f"{d['vs_events']['geomean']:.3f}"
        if d.get("jit_errors"):
            txt += f"; cuflash-jit failed at {d['jit_errors']} point(s) where torch ran"
        lines.append(txt)

    xt = t["vs_xla"]
    lines.append(f"[{xt['status'].upper()}] cuflash-jit >= {XLA_SPEEDUP_MIN:.1f}x faster than xla at seqlen >= "
                 f"{seqlen_label(XLA_TARGET_SEQLEN)}:")
    for ps, d in xt["passes"].items():
        if d["status"] == "not measured":
            lines.append(f"    {ps:<8} not measured (no point with seqlen >= {seqlen_label(XLA_TARGET_SEQLEN)} "
                         "timed for both)")
            continue
        txt = f"    {ps:<8} {d['status']}"
        if d.get("n"):
            txt += (f": xla / jit min {d['min']:.2f} ({_point_text(d['worst'])}), geomean {d['geomean']:.2f}, "
                    f"max {d['max']:.2f} over {d['n']} points")
        if d.get("xla_oom_points"):
            txt += f"; xla OOM at {len(d['xla_oom_points'])} point(s) where cuflash-jit ran (not counted): " + \
                   ", ".join(_point_text(p) for p in d["xla_oom_points"])
        if d.get("jit_failed_points"):
            txt += f"; cuflash-jit failed at {len(d['jit_failed_points'])} point(s)"
        lines.append(txt)

    mt = t["memory"]
    lines.append(f"[{mt['status'].upper()}] cuflash-jit memory O(seqlen): temp + output bytes per (batch x seqlen x "
                 f"heads) row flat across seqlen (max / min <= {MEM_FLAT_LIMIT}):")
    if mt["status"] == "not measured":
        lines.append("    not measured (needs XLA's memory_analysis at >= 2 seqlens of one pass, dtype, head_dim, "
                     "causal)")
    else:
        w = mt["worst"]
        lines.append(f"    worst growth {mt['max_growth']:.2f} ({w['pass']} {SHORT_DTYPE.get(w['dtype'], w['dtype'])} "
                     f"d{w['head_dim']} {'causal' if w['causal'] else 'full'}) over {mt['n_groups']} group(s); largest "
                     f"per call {mt['max_extra_bytes'] / 2**20:.1f} MiB"
                     + (f"; xla's growth for contrast: up to {mt['xla_max_growth']:.1f}" if mt.get("xla_max_growth")
                        else ""))

    ct = t["vs_cudnn"]
    lines.append(f"[{ct['status'].upper()}] cuflash-jit against cuDNN over the grid ({ct['ratio']}):")
    for ps, d in ct["passes"].items():
        if d["status"] == "not measured":
            lines.append(f"    {ps:<8} not measured")
        else:
            lines.append(f"    {ps:<8} min {d['min']:.2f} ({_point_text(d['min_at'])}), geomean {d['geomean']:.2f}, "
                         f"max {d['max']:.2f} ({_point_text(d['max_at'])}) over {d['n']} points")

    cnt = data.get("counts", {})
    lines.append("rows: " + "; ".join(
        f"{COL[p]} " + ", ".join(f"{v} {k}" for k, v in cnt[p].items() if v) for p in PROVIDERS if p in cnt))
    m = data.get("meta", {})
    if m.get("cuflash_import_error"):
        lines.append(f"cuflash did not import: {m['cuflash_import_error']} -> exit status 1")
    elif data.get("cuflash_jit_errors"):
        lines.append(f"cuflash-jit errors: {data['cuflash_jit_errors']} row(s) -> exit status 1")
    if m.get("wall_s") is not None:
        lines.append(f"wall time {m['wall_s']:.0f} s (budget {m.get('budget_s') or 'none'})")
    return "\n".join(lines)


def print_report(data):
    print()
    print(format_header(data))
    print()
    print(format_compile(data))
    print()
    print(format_memory(data))
    err = format_errors(data)
    if err:
        print()
        print(err)
    print()
    print(data["markdown"])
    print()
    print(format_summary(data))


def progress_line(i, n, pt, rows, check, elapsed) -> str:
    parts = []
    for ps in PASSES:
        pr = [r for r in rows if r["pass"] == ps]
        if pr:
            parts.append(ps + " " + " ".join(f"{COL[r['provider']]} {_ms_cell(r)}" for r in pr))
    for key, d in (check or {}).items():
        if isinstance(d, dict):
            parts.append(f"max|d| {key} " + " ".join(f"{k} {v:.1e}" for k, v in d.items()))
        else:
            parts.append(f"{key}: {d}")
    return f"[{i}/{n} {elapsed:4.0f}s] {point_name(pt)} ms: " + " | ".join(parts)


# ------------------------------------------------------------------------------------ dry run

def dry_run(args) -> int:
    points = build_points(args)
    print(f"bench_jax.py --dry-run: {len(points)} points x providers {', '.join(COL[p] for p in args.providers)} "
          f"x passes {', '.join(args.passes)}{' (CPU smoke)' if args.cpu_smoke else ''}")
    print(FLOP_CONVENTION)
    print(f"timing: {args.rounds} rounds of ~{args.round_s} s ({args.min_calls}..{args.max_calls} calls), "
          f"{args.warmup} warm-up calls after the first")
    hdr = f"{'#':>3}  {'dtype':<6}{'d':>4}{'heads':>6}{'batch':>6}{'seqlen':>7}{'causal':>7}{'fwd GFLOP':>11}" \
          f"{'xla scores GiB':>15}{'est. s':>8}"
    print(hdr)
    print("-" * len(hdr))
    total = 0.0
    for i, pt in enumerate(points, 1):
        est = estimate_point_s(pt, args)
        total += est
        score = pt["batch"] * pt["nheads"] * pt["seqlen"] ** 2 * 4 / 2**30
        print(f"{i:>3}  {SHORT_DTYPE[pt['dtype']]:<6}{pt['head_dim']:>4}{pt['nheads']:>6}{pt['batch']:>6}"
              f"{pt['seqlen']:>7}{('on' if pt['causal'] else 'off'):>7}{fwd_flops(pt) / 1e9:>11.1f}{score:>15.1f}"
              f"{est:>8.1f}")
    overhead = 20.0   # imports, CUDA contexts, cuflash kernels (cached)
    print(f"rough time estimate (guessed H100-class rates, see _EST_RATE): {total + overhead:.0f} s "
          f"({total:.0f} s measuring and compiling + ~{overhead:.0f} s start-up); budget guard "
          f"{'off' if not args.budget_s else f'{args.budget_s:.0f} s'}")
    return 0


# ------------------------------------------------------------------------------------ main

def _summarize(paths) -> int:
    def rank(r):
        return 2 if r.get("ms") is not None else (0 if r.get("skipped") and not r.get("oom") else 1)

    data = None
    for path in paths:
        with open(path) as f:
            d = json.load(f)
        if data is None:
            data = d
            data.setdefault("meta", {})["merged_from"] = [path]
        else:
            keys = ("provider", "pass") + SEL
            for r in d.get("results", []):
                old = find_row(data["results"], **{k: r[k] for k in keys})
                if old is not None:
                    if rank(r) < rank(old):
                        continue   # a skipped row never replaces a failed one, nor either a measured one
                    data["results"].remove(old)
                data["results"].append(r)
            data["checks"] = data.get("checks", []) + d.get("checks", [])
            data["meta"]["merged_from"].append(path)
    finalize(data)
    print_report(data)
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.summarize:
        return _summarize(args.summarize)
    if args.dry_run:
        return dry_run(args)
    smoke = args.cpu_smoke

    # ---- environment, before JAX starts and before anything is traced
    os.environ["CUFLASH_JAX_JIT_GPU"] = "1"
    if args.cmd_buffer:
        os.environ["CUFLASH_JAX_JIT_CMD_BUFFER"] = "1"
    if args.xla_flags:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + args.xla_flags).strip()
    if smoke:
        os.environ["JAX_PLATFORMS"] = "cpu"
    else:
        # JAX would take 75 % of the GPU at its first array; torch needs some for the cuflash-torch column
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.90")

    import jax

    if smoke:
        try:
            jax.config.update("jax_platforms", "cpu")
        except Exception:
            pass
    else:
        gpus = [d for d in jax.devices() if d.platform in ("gpu", "cuda")]
        if not gpus:
            print(f"bench_jax.py: JAX sees no GPU (backend {jax.default_backend()}, jax {jax.__version__}); "
                  "install jax[cuda12/13] or use --cpu-smoke", file=sys.stderr)
            return 2

    cuflash = cuflash_error = None
    try:
        import cuflash  # noqa: F811
    except Exception as e:
        cuflash_error = _err(e)
        traceback.print_exc()
    torch = torch_error = None
    if "cuflash_torch" in args.providers:
        try:
            import torch  # noqa: F811

            if not smoke and not torch.cuda.is_available():
                torch_error = "torch sees no CUDA device"
        except Exception as e:
            torch_error = _err(e)
            torch = None

    points = build_points(args)
    data = {"meta": collect_meta(jax, torch, cuflash, cuflash_error, torch_error, args, smoke),
            "prepare": None, "results": [], "checks": []}
    data["meta"]["budget_s"] = args.budget_s
    print(f"bench_jax.py: {len(points)} points x providers {', '.join(COL[p] for p in args.providers)} x passes "
          f"{', '.join(args.passes)} on {data['meta']['device']} (jax {jax.__version__}, backend "
          f"{jax.default_backend()}{', CPU smoke' if smoke else ''}{', command buffers' if args.cmd_buffer else ''})"
          "; progress lines give ms per call", flush=True)
    if torch_error and "cuflash_torch" in args.providers:
        print(f"  (cuflash-torch not measured: {torch_error})", flush=True)

    if cuflash is not None and not smoke and not args.no_prepare and "cuflash_jit" in args.providers:
        print("preparing cuflash kernels (compile in parallel if not cached, then load) ...", flush=True)
        data["prepare"] = prepare_cuflash(points, args.passes, jax.devices()[0])
        p = data["prepare"]
        print(f"  {p.get('specializations', '?')} kernels, {p.get('compiled', '?')} compiled, {p['wall_s']:.1f} s"
              + (f"; ERROR {p['error']} (kernels then compile at their first call)" if p.get("error") else ""),
              flush=True)
    write_json(args.json, data, default=str)

    runner = Runner(jax, torch if torch_error is None else None, torch_error, cuflash, args, smoke)
    est_done = act_done = 0.0
    t_loop = time.perf_counter()
    deadline = T_START + args.budget_s if args.budget_s else float("inf")
    try:
        for i, pt in enumerate(points, 1):
            est = estimate_point_s(pt, args)
            elapsed = time.perf_counter() - T_START
            scale = (act_done / est_done) if est_done > 5 else 1.0
            if args.budget_s and elapsed + est * max(scale, 0.5) > args.budget_s:
                why = (f"time budget: {elapsed:.0f} s elapsed, ~{est * scale:.0f} s predicted, budget "
                       f"{args.budget_s:.0f} s")
                for prov in args.providers:
                    for ps in args.passes:
                        data["results"].append(dict({k: pt[k] for k in POINT_KEYS}, provider=prov, **{"pass": ps},
                                                    flops=fwd_flops(pt) * PASS_FACTOR[ps], skipped=why))
                print(f"[{i}/{len(points)} {elapsed:4.0f}s] {point_name(pt)}: skipped ({why})", flush=True)
                continue
            t0 = time.perf_counter()
            rows, check = runner.run_point(pt, deadline)
            act_done += time.perf_counter() - t0
            est_done += est
            data["results"] += rows
            data["checks"].append(dict({k: pt[k] for k in SEL}, check=check))
            print(progress_line(i, len(points), pt, rows, check, time.perf_counter() - T_START), flush=True)
            write_json(args.json, data, default=str)
    finally:
        data["meta"]["wall_s"] = time.perf_counter() - T_START
        data["meta"]["measure_s"] = time.perf_counter() - t_loop
        finalize(data)
        data["summary_text"] = format_summary(data)
        write_json(args.json, data, default=str)

    print_report(data)
    if args.json:
        print(f"json: {args.json}")
    failed = (cuflash is None and "cuflash_jit" in args.providers) or data["cuflash_jit_errors"] > 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
