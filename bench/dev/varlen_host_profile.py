#!/usr/bin/env python3
"""Host time of attention_varlen against the plain forward, on a GPU (issue 11), with cProfile.

bench/bench_host.py measured `cuflash.attention_varlen` at 1.47x the plain torch forward's host
time (1.56x with inputs requiring grad; target <= 1.2x). This probe times the two calls on
bench_host's shape and profiles them, so the per-call Python work of each can be compared line by
line:

  plain        cuflash.attention(q, k, v, causal=True), q, k, v (1, 128, 2, 64) bf16
  varlen       cuflash.attention_varlen(q, k, v, cu, cu, S, S, causal=True), q, k, v (128, 2, 64)
               bf16, the 128 tokens as --seqs sequences of S = 128 / seqs (default 2: cu = [0, 64,
               128]; --seqs 1 is bench_host's own varlen row at its default batch 1)
  plain_grad, varlen_grad   the same with q, k, v requiring grad (the autograd node is recorded)

Method (bench_host's): each call --warmup times, then --rounds rounds of --calls back-to-back calls
ending with one torch.cuda.synchronize, round-robin over the rows; us/call = median over the rounds
(min beside it). The kernels take a few us at this shape, so the figure is the host's. Then, per
row, the kernel launches one call makes (counted once, outside the timing), and cProfile over
--profile-calls calls (2000) with the top 25 functions by tottime (cProfile's own overhead inflates
the totals; the ranking is what it is for).

Output: stdout, and $OUT/varlen_host_profile.txt when OUT is set (--out PATH overrides). Exit
status 0, or 2 without a CUDA device (nothing is timed). CUFLASH_BENCH_PATH=DIR measures the
cuflash package under DIR instead of this checkout's (an A/B against an earlier version).

Usage: python bench/dev/varlen_host_profile.py [--seqs 2] [--calls 2000] [--rounds 9] [--rows ...]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import platform
import pstats
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
if os.environ.get("CUFLASH_BENCH_PATH"):
    sys.path.insert(0, os.environ["CUFLASH_BENCH_PATH"])
elif ROOT not in sys.path:
    sys.path.insert(0, ROOT)

ROWS = ("plain", "varlen", "plain_grad", "varlen_grad")


class Report:
    """Lines to stdout as they come, and to the output file at the end."""

    def __init__(self, path):
        self.path, self.lines = path, []

    def __call__(self, text=""):
        print(text, flush=True)
        self.lines.append(text)

    def save(self):
        if self.path:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            with open(self.path, "w") as f:
                f.write("\n".join(self.lines) + "\n")
            print(f"written: {self.path}")


def make_rows(torch, cuflash, args, device):
    dt = getattr(torch, args.dtype)
    h, d, total = args.heads, args.head_dim, args.tokens
    s = total // args.seqs
    g = torch.Generator(device=device).manual_seed(0)

    def mk(*shape, grad=False):
        return torch.randn(*shape, device=device, dtype=dt, generator=g).requires_grad_(grad)

    q, k, v = (mk(1, total, h, d) for _ in range(3))
    qg, kg, vg = (mk(1, total, h, d, grad=True) for _ in range(3))
    qp, kp, vp = (mk(total, h, d) for _ in range(3))
    qpg, kpg, vpg = (mk(total, h, d, grad=True) for _ in range(3))
    cu = torch.arange(0, total + 1, s, dtype=torch.int32, device=device)
    att, attv = cuflash.attention, cuflash.attention_varlen
    rows = {"plain": lambda: att(q, k, v, causal=True),
            "varlen": lambda: attv(qp, kp, vp, cu, cu, s, s, causal=True),
            "plain_grad": lambda: att(qg, kg, vg, causal=True),
            "varlen_grad": lambda: attv(qpg, kpg, vpg, cu, cu, s, s, causal=True)}
    return {n: rows[n] for n in args.rows}


def count_launches(fn) -> int | None:
    """Kernel launches of one call: cuflash's launch binding wrapped for that one call."""
    try:
        from cuflash import _launch
    except Exception:
        return None
    real = _launch._launch_kernel
    n = [0]

    def counting(*a):
        n[0] += 1
        return real(*a)

    _launch._launch_kernel = counting
    try:
        fn()
    finally:
        _launch._launch_kernel = real
    return n[0]


def git_rev(path) -> str:
    try:
        r = subprocess.run(["git", "-C", path, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                           timeout=10)
        dirty = subprocess.run(["git", "-C", path, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return (r.stdout.strip() + (" (modified)" if dirty else "")) if r.returncode == 0 else "-"
    except Exception:
        return "-"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS))
    p.add_argument("--seqs", type=int, default=2, help="sequences the packed tokens are split into (default 2)")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--calls", type=int, default=2000, help="calls per timed round (default 2000)")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--profile-calls", type=int, default=2000)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--out", default=None, help="default: $OUT/varlen_host_profile.txt when OUT is set")
    # An offline check of this script's logic: CPU tensors (cuflash's NumPy path), no synchronize.
    p.add_argument("--cpu-check", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.seqs < 1 or args.tokens % args.seqs:
        p.error("--tokens must be a positive multiple of --seqs")
    out_path = args.out or (os.path.join(os.environ["OUT"], "varlen_host_profile.txt") if os.environ.get("OUT")
                            else None)
    rep = Report(out_path)

    import torch

    import cuflash

    if args.cpu_check:
        device, sync, name = "cpu", (lambda: None), "CPU check: cuflash's NumPy path, not a host-time figure"
    elif not torch.cuda.is_available():
        rep("varlen_host_profile.py: no CUDA device visible to torch; nothing timed (this probe needs a GPU)")
        rep.save()
        return 2
    else:
        device, sync, name = "cuda", torch.cuda.synchronize, torch.cuda.get_device_name()
    s = args.tokens // args.seqs
    rep(f"=== attention_varlen vs attention, host time per call ({name})")
    rep(f"cuflash {getattr(cuflash, '__version__', '?')} from {os.path.dirname(os.path.dirname(cuflash.__file__))} "
        f"(git {git_rev(os.path.dirname(os.path.dirname(cuflash.__file__)))}), torch {torch.__version__}, python "
        f"{platform.python_version()}, {platform.processor() or platform.machine()}")
    rep(f"{args.dtype}, {args.tokens} tokens, {args.heads} heads, head_dim {args.head_dim}, causal; varlen: "
        f"{args.seqs} sequence(s) of {s} (cu_seqlens_q is cu_seqlens_k, max_seqlen {s}); {args.rounds} rounds of "
        f"{args.calls} calls, round-robin, one synchronize per round")
    rows = make_rows(torch, cuflash, args, device)
    for fn in rows.values():
        for _ in range(args.warmup):
            fn()
    sync()
    launches = {name: count_launches(fn) for name, fn in rows.items()}
    sync()
    times = {n: [] for n in rows}
    for _ in range(args.rounds):
        for name, fn in rows.items():
            t0 = time.perf_counter()
            for _ in range(args.calls):
                fn()
            sync()
            times[name].append((time.perf_counter() - t0) / args.calls * 1e6)
    rep()
    rep(f"{'row':<12} {'us/call':>8} {'min':>7} {'launches':>8}   vs plain (same grad setting)")
    med = {n: statistics.median(t) for n, t in times.items()}
    for name in rows:
        ref = "plain_grad" if name.endswith("_grad") else "plain"
        vs = f"   {med[name] / med[ref]:.2f}x, {med[name] - med[ref]:+.2f} us" if name != ref and ref in med else ""
        n_launch = launches[name] if launches[name] is not None else "-"
        rep(f"{name:<12} {med[name]:8.2f} {min(times[name]):7.2f} {n_launch:>8}{vs}")
    for name, fn in rows.items():
        pr = cProfile.Profile()
        sync()
        t0 = time.perf_counter()
        pr.enable()
        for _ in range(args.profile_calls):
            fn()
        sync()
        pr.disable()
        wall = (time.perf_counter() - t0) / args.profile_calls * 1e6
        buf = io.StringIO()
        pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(args.top)
        rep()
        rep(f"--- cProfile: {name}, {args.profile_calls} calls, {wall:.2f} us/call under the profiler "
            f"({med[name]:.2f} without), top {args.top} by tottime")
        text = buf.getvalue()
        rep(text[text.find("   ncalls"):].rstrip() if "   ncalls" in text else text.rstrip())
    rep.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
