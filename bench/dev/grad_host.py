"""Where the host time of a forward with grad goes (issue 11: bench_host's torch.fwd_grad row is
1.28x SDPA-flash's while the plain forward is 0.70x). On bench_host's shape (bf16, batch 1, seqlen
128, 2 heads, head_dim 64, causal), the wall time per call of back-to-back calls (one synchronize
per round, median of rounds) for each step of the path taken apart:

  plain        cuflash.attention, no grad
  grad         cuflash.attention, inputs require grad (the row to explain)
  apply_noop   the autograd Function with the launch replaced by nothing (host only)
  fn_alloc     a trivial autograd.Function that allocates out and lse and saves them (torch's floor)
  alloc        out and lse allocated, nothing else
  sdpa / sdpa_grad   SDPA flash without and with grad

then a cProfile of 2000 grad calls. Usage: PYTHONPATH=. python bench/dev/grad_host.py [--json PATH]"""
import cProfile
import io
import json
import pstats
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import cuflash
from cuflash._adapters import _torch as T

CALLS, ROUNDS = 1000, 9


def timed(f):
    for _ in range(100):
        f()
    torch.cuda.synchronize()
    us = []
    for _ in range(ROUNDS):
        t = time.perf_counter()
        for _ in range(CALLS):
            f()
        torch.cuda.synchronize()
        us.append((time.perf_counter() - t) / CALLS * 1e6)
    return statistics.median(us), min(us)


class _Trivial(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v):
        out = torch.empty_like(q)
        lse = q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        return dout, dout, dout


def main():
    torch.manual_seed(0)
    mk = lambda g: torch.randn(1, 128, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=g)
    q, k, v = mk(True), mk(True), mk(True)
    qn, kn, vn = (x.detach() for x in (q, k, v))
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    qtn, ktn, vtn = (x.transpose(1, 2) for x in (qn, kn, vn))
    rows = {}
    rows["plain"] = timed(lambda: cuflash.attention(qn, kn, vn, causal=True))
    rows["grad"] = timed(lambda: cuflash.attention(q, k, v, causal=True))
    plan = T.CACHE[T._forward_key(q, k, v, True, None, False, False, None)]
    real = plan.launch
    plan.launch = lambda stream, ptrs, *rest: None
    try:
        rows["apply_noop"] = timed(lambda: cuflash.attention(q, k, v, causal=True))
        rows["plain_noop"] = timed(lambda: cuflash.attention(qn, kn, vn, causal=True))
    finally:
        plan.launch = real
    ap = torch._C._FunctionBase.__dict__["apply"].__get__(None, _Trivial)
    rows["fn_alloc"] = timed(lambda: ap(q, k, v))
    rows["alloc"] = timed(lambda: (torch.empty_like(qn), qn.new_empty((1, 2, 128), dtype=torch.float32)))
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
        rows["sdpa"] = timed(lambda: F.scaled_dot_product_attention(qtn, ktn, vtn, is_causal=True))
        rows["sdpa_grad"] = timed(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True))
    for name, (med, lo) in rows.items():
        print(f"{name:12s} {med:7.1f} us (min {lo:.1f})")
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(2000):
        cuflash.attention(q, k, v, causal=True)
    torch.cuda.synchronize()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(14)
    print(s.getvalue()[-3500:])
    if "--json" in sys.argv:
        with open(sys.argv[sys.argv.index("--json") + 1], "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows_us_median_min": rows}, f, indent=1)


if __name__ == "__main__":
    main()
