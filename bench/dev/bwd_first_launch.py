#!/usr/bin/env python3
"""When a torch backward's kernels go out, measured without a GPU (issue 12's single eager backward).

host_python_cost.py's fake device (CPU tensors that report cuda:0, cuLaunchKernel replaced) with a
clock read at each launch: for torch.autograd.grad(out, (q, k, v), dout) on bench_host's shape (or
--shape), the µs from the call to the backward's first launch (the preprocess) and to its last.
On a GPU host the first kernel then starts that much after the call, plus the driver's part of the
launch; the GPU work before it is none, so a single eager backward's time moves by the same amount.

CUFLASH_BENCH_PATH=DIR measures the cuflash package under DIR (the tree before a change, say).

Usage: python bench/dev/bwd_first_launch.py [--calls 2000] [--rounds 9] [--shape B S H D]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import host_python_cost as H  # noqa: E402  (puts the measured cuflash first on sys.path)
import torch  # noqa: E402

import cuflash  # noqa: E402
from cuflash import _launch  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--shape", type=int, nargs=4, default=(1, 128, 2, 64), metavar=("B", "S", "H", "D"))
    args = p.parse_args(argv)
    H.install_fake_device(no_alloc=False)
    stamps = []
    _launch._launch_kernel = lambda *a: stamps.append(time.perf_counter_ns())
    b, s, h, d = args.shape
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, s, h, d, generator=g).to(torch.bfloat16).requires_grad_(True) for _ in range(3))
    dout = torch.randn(b, s, h, d, generator=g).to(torch.bfloat16)
    firsts, lasts = [], []
    for rnd in range(args.rounds + 1):
        f, la = [], []
        for _ in range(args.calls):
            out = cuflash.attention(q, k, v, causal=True)
            del stamps[:]
            t0 = time.perf_counter_ns()
            torch.autograd.grad(out, (q, k, v), dout)
            f.append((stamps[0] - t0) / 1e3)
            la.append((stamps[-1] - t0) / 1e3)
        if rnd:  # round 0 warms up
            firsts.append(statistics.median(f))
            lasts.append(statistics.median(la))
    print(f"cuflash from {os.path.dirname(os.path.dirname(cuflash.__file__))}; shape {tuple(args.shape)} bf16 causal; "
          f"{len(stamps)} launches in the backward")
    print(f"us from torch.autograd.grad to the first launch: median {statistics.median(firsts):.2f} "
          f"(rounds {min(firsts):.2f}-{max(firsts):.2f}); to the last: {statistics.median(lasts):.2f} "
          f"({min(lasts):.2f}-{max(lasts):.2f})")


if __name__ == "__main__":
    main()
