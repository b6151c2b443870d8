#!/usr/bin/env python3
"""The Python work of one eager torch call, measured without a GPU (issue 11).

bench/bench_host.py measures host time per call on a GPU machine: Python, torch's allocator and
cuLaunchKernel together. This script isolates the Python part on any machine: the torch adapter's
GPU path runs on CPU tensors that report cuda:0 (as tests/test_plan_wiring.py's `torch_dev`
fixture does), with real plans (real Launch objects, Params bytes and pointer patches) for compute
capability 9.0 without tensor maps, and with cuLaunchKernel replaced by a counter. What is left per
call is cuflash's own Python (key, cache lookup, checks, pointer lists, patches into the Params
words, the autograd.Function's apply for grad rows) plus torch's CPU allocations of the outputs
(or none with --no-alloc: the outputs then come from a per-template cache).

Rows (bench_host's shape by default: bf16, 2 heads, head_dim 64, 128 tokens):
  plain             cuflash.attention(q, k, v, causal=True), q (1, 128, 2, 64)
  varlen            cuflash.attention_varlen(q, k, v, cu, cu, max, max, causal=True), q (128, 2, 64),
                    cu = [0, 64, 128] (--seqs 2: the 128 tokens as 2 sequences; --seqs 1 is
                    bench_host's own varlen row at batch 1)
  plain_grad, varlen_grad   the same with q, k, v requiring grad (the autograd node is recorded)
  lengths           attention with q_lengths = kv_lengths (batch,) int32, no grad (another option
                    with arrays, for comparison)
  alibi, sink_logits, window, softcap   bench_host's other option rows: alibi_slopes / sink_logits
                    float32 (heads,), window=(32, 0), softcap=30.0; no grad
  fwdbwd            out = attention(q, k, v, causal=True) on inputs that require grad, then
                    torch.autograd.grad(out, (q, k, v), dout) (on CPU tensors the engine runs the
                    backward on the calling thread: a GPU host adds its device-thread hand-off)
  decode, decode_paged   attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=...), q (4, 1, 32, 128),
                    a 512-key cache of 32 kv heads (bench_decode's 4 x 512 x 1), contiguous / in 16-row
                    pages with a block_table (no append)
  plan, plan_grad, plan_lengths   the explicit plan API: p = cuflash.plan(...) once, then p(q, k, v)
                    per call (plain, plain_grad and lengths's calls; compared with those rows)

Method: a warm-up, then --rounds rounds of --calls back-to-back calls per row, round-robin over the
rows; us/call = median over the rounds (min beside it). Also the kernel launches each call makes (a
launch costs a few us of driver time on a GPU host that this script does not see). The absolute
difference varlen - plain is the figure that carries over to a GPU host; ratios here are diluted
(no driver, CPU allocations) and are only indicative.

CUFLASH_BENCH_PATH=DIR measures the cuflash package under DIR instead of this checkout's.

Usage: python bench/dev/host_python_cost.py [--calls 2000] [--rounds 15] [--no-alloc] [--profile ROW]
       [--json PATH]
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import json
import os
import pstats
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
if os.environ.get("CUFLASH_BENCH_PATH"):  # measure another checkout (the code before a change, say)
    sys.path.insert(0, os.environ["CUFLASH_BENCH_PATH"])
elif ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

import cuflash  # noqa: E402
from cuflash import _compile, _gpu, _kvcache, _launch, _plan  # noqa: E402
from cuflash._adapters import _torch as T  # noqa: E402
from cuflash._call import ArrayInfo  # noqa: E402

LAUNCHES = [0]


def install_fake_device(no_alloc: bool) -> None:
    """The torch adapter's GPU path on CPU tensors (see tests/test_plan_wiring.py: torch_dev)."""

    class Loaded:
        ptr = 1

    def launch_kernel(*args):
        LAUNCHES[0] += 1

    real_info = T.TorchAdapter.info

    def info(self, x):
        i = real_info(self, x)
        return ArrayInfo(i.lib, i.shape, i.strides, i.dtype, ("cuda", 0), i.aligned, i.type_name)

    class CpuState(T._State):
        def __init__(self, plan):
            c = plan.call
            self.device = torch.device("cpu")
            dt = getattr(torch, c.dtype)
            self.out = T._like(plan.out_shape, dt, self.device)
            self.lse = T._like(plan.lse_shape, torch.float32, self.device)
            kv = (c.total_k, c.nheads_kv, c.head_dim) if c.packed else (c.batch, c.seqlen_k, c.nheads_kv, c.head_dim)
            self.kv = T._like(kv, dt, self.device)

    def cpu_template(cache, shape, dtype):  # the adapter's stride-0 template, on the CPU
        key = (shape, dtype, 0)
        t = cache.get(key)
        if t is None:
            t = cache[key] = T._like(shape, getattr(torch, dtype), torch.device("cpu"))
        return t

    # The decode plans' outputs (attention_with_kvcache): empty_from, and the allocators of trees that
    # have them, on CPU templates.
    T.TorchAdapter.empty_from = lambda self, cache, shape, dtype, device_id: T._empty_like(
        cpu_template(cache, shape, dtype))
    if hasattr(T.TorchAdapter, "allocator"):
        T.TorchAdapter.allocator = lambda self, cache, shape, dtype, device_id: functools.partial(
            T._empty_like, cpu_template(cache, shape, dtype))
    _gpu.compute_capability = lambda device_id: (9, 0)
    _kvcache._sm_count = lambda device_id: 132   # an H100's (the causal tail order, persistent grids)
    _compile.get_function = lambda spec, target, device_id, smem: Loaded()
    if hasattr(_kvcache.DecodePlan, "_scratch"):  # the eager split decodes' scratch (cupy memory on a GPU)
        _kvcache.DecodePlan._scratch = lambda self, stream, nbytes: 0x5C7A000
    _launch._launch_kernel = launch_kernel
    _plan._current_device = lambda: 0
    T.TorchAdapter.info = info
    T._State = CpuState
    T._raw_stream = lambda device_id: 77
    if no_alloc:
        real_empty_like = T._empty_like
        made = {}

        def empty_like(t):
            x = made.get(id(t))
            if x is None:
                x = made[id(t)] = (t, real_empty_like(t))
            return x[1]

        T._empty_like = empty_like


def make_rows(args):
    dt = getattr(torch, args.dtype)
    h, d, total = args.heads, args.head_dim, args.tokens
    if total % args.seqs:
        raise SystemExit(f"--tokens {total} is not a multiple of --seqs {args.seqs}")
    s = total // args.seqs
    g = torch.Generator().manual_seed(0)

    def mk(*shape, grad=False):
        return torch.randn(*shape, generator=g).to(dt).requires_grad_(grad)

    q, k, v = (mk(1, total, h, d) for _ in range(3))
    qg, kg, vg = (mk(1, total, h, d, grad=True) for _ in range(3))
    qp, kp, vp = (mk(total, h, d) for _ in range(3))
    qpg, kpg, vpg = (mk(total, h, d, grad=True) for _ in range(3))
    cu = torch.arange(0, total + 1, s, dtype=torch.int32)
    lengths = torch.full((1,), total, dtype=torch.int32)
    slopes = torch.rand(h, generator=g)
    sinks = torch.randn(h, generator=g)
    dout = mk(1, total, h, d)
    att, attv = cuflash.attention, cuflash.attention_varlen

    def fwdbwd():
        out = att(qg, kg, vg, causal=True)
        return torch.autograd.grad(out, (qg, kg, vg), dout)

    pl, plg = cuflash.plan(q, k, v, causal=True), cuflash.plan(qg, kg, vg, causal=True)
    pll = cuflash.plan(q, k, v, causal=True, q_lengths=lengths, kv_lengths=lengths)

    # A decode step (attention_with_kvcache, no append): 4 x 512-key cache, 32 query heads over 32
    # kv heads, head_dim 128 (bench_decode's 4 x 512 x 1), contiguous and in 16-row pages.
    qd = mk(4, 1, 32, 128)
    kc, vc = mk(4, 512, 32, 128), mk(4, 512, 32, 128)
    seqlens = torch.full((4,), 512, dtype=torch.int32)
    table = torch.randperm(128, generator=g).to(torch.int32).view(4, 32)
    kp16, vp16 = kc.view(128, 16, 32, 128), vc.view(128, 16, 32, 128)
    kvc = cuflash.attention_with_kvcache

    return {
        "decode": lambda: kvc(qd, kc, vc, cache_seqlens=seqlens),
        "decode_paged": lambda: kvc(qd, kp16, vp16, cache_seqlens=seqlens, block_table=table),
        "plain": lambda: att(q, k, v, causal=True),
        "varlen": lambda: attv(qp, kp, vp, cu, cu, s, s, causal=True),
        "plain_grad": lambda: att(qg, kg, vg, causal=True),
        "varlen_grad": lambda: attv(qpg, kpg, vpg, cu, cu, s, s, causal=True),
        "lengths": lambda: att(q, k, v, causal=True, q_lengths=lengths, kv_lengths=lengths),
        "alibi": lambda: att(q, k, v, causal=True, alibi_slopes=slopes),
        "sink_logits": lambda: att(q, k, v, causal=True, sink_logits=sinks),
        "window": lambda: att(q, k, v, causal=True, window=(32, 0)),
        "softcap": lambda: att(q, k, v, causal=True, softcap=30.0),
        "fwdbwd": fwdbwd,
        "plan": lambda: pl(q, k, v),
        "plan_grad": lambda: plg(qg, kg, vg),
        "plan_lengths": lambda: pll(q, k, v, q_lengths=lengths, kv_lengths=lengths),
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--seqs", type=int, default=2)
    p.add_argument("--no-alloc", action="store_true", help="outputs from a cache instead of torch.empty_like")
    p.add_argument("--rows", nargs="*", default=None)
    p.add_argument("--profile", default=None, help="cProfile this row over --calls calls (top 25 by tottime)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    install_fake_device(args.no_alloc)
    rows = make_rows(args)
    if args.rows:
        rows = {n: f for n, f in rows.items() if n in args.rows}
    launches = {}
    for name, f in rows.items():
        for _ in range(200):
            f()
        LAUNCHES[0] = 0
        f()
        launches[name] = LAUNCHES[0]
    times = {n: [] for n in rows}
    for _ in range(args.rounds):
        for name, f in rows.items():
            t0 = time.perf_counter()
            for _ in range(args.calls):
                f()
            times[name].append((time.perf_counter() - t0) / args.calls * 1e6)
    res = {}
    print(f"cuflash from {os.path.dirname(os.path.dirname(cuflash.__file__))}")
    print(f"torch {torch.__version__}, {args.dtype}, {args.tokens} tokens, {args.heads} heads, head_dim "
          f"{args.head_dim}, varlen as {args.seqs} sequences; {args.rounds} rounds of {args.calls} calls; "
          f"allocation {'cached (--no-alloc)' if args.no_alloc else 'torch.empty_like on the CPU'}")
    print(f"{'row':<12} {'us/call':>8} {'min':>7} {'launches':>8}   vs plain (same grad setting)")
    for name in rows:
        med, lo = statistics.median(times[name]), min(times[name])
        res[name] = dict(us_median=med, us_min=lo, launches=launches[name], rounds=times[name])
        ref = ("plain_grad" if name.endswith("_grad") else None if name == "fwdbwd" or name.startswith("decode")
               else "lengths" if name == "plan_lengths" else "plain")
        extra = ""
        if name != ref and ref in times:
            rm = statistics.median(times[ref])
            extra = f"   {med / rm:.2f}x, {med - rm:+.2f} us"
        print(f"{name:<12} {med:8.2f} {lo:7.2f} {launches[name]:8d}{extra}")
    if args.profile:
        f = rows[args.profile]
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(args.calls):
            f()
        pr.disable()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
        print(f"\ncProfile of {args.profile}, {args.calls} calls:\n{s.getvalue()}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(args=vars(args), rows=res), fh, indent=1)


if __name__ == "__main__":
    main()
