"""Session 30's GPU fuzz failure on the CPU (no GPU needed): test_fuzz_torch_cuda's
attention_varlen_backward case (float16, head_dim 8, one 3 x 3 sequence; cu_seqlens_k's first
offset -2, q set to +-6e4 after the forward gave out and lse) rebuilt with the fuzzer's own _build,
and the backward kernels' formula for that sequence in float64: P = min(exp(s - lse), 1) (the
kernels cap P at 1; cuda_src/flash_bwd.cu), D = rowsum(dout * out), dS = P (dout V^T - D),
dK = scale dS^T Q. With the stale lse P is 1 where it should be ~0, and |dK| exceeds float16's
65504: an inf in the kernel's float16 dK is the formula's value, not a fault.
Usage: python bench/dev/fuzz_stale_dk.py"""
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(ROOT, "tests"), ROOT]

import test_fuzz_inputs as T  # noqa: E402
from test_property_cpu import Problem  # noqa: E402

p = Problem(seed=0, dtype="float16", batch=12, seqlen_q=3, seqlen_k=3, nheads_kv=1, group=1, head_dim=8, causal=False,
            scale=None, layouts=("contiguous",) * 4, seq_q=[0, 0, 0, 0, 3, 0, 0, 0, 0, 0, 0, 0],
            seq_k=[0, 0, 0, 0, 3, 0, 0, 0, 0, 0, 0, 0])
call = T.Call("attention_varlen_backward", p, (("cu_seqlens_k", "set", "negative_start"), ("q", "value", "huge")),
              ("unchecked", "valid"))
a, stale = T._build(call, "cpu")
print("stale", stale, "category", T._category(call, stale), "cu_seqlens_k", a["cu_seqlens_k"][:6])
q, k, v, dout, out = (np.asarray(a[n], np.float64)[0:3, 0] for n in ("q", "k", "v", "dout", "out"))
lse = np.asarray(a["lse"], np.float64)[0, 0:3]  # (nheads, total_q): entry 4's rows are 0..2
scale = 8 ** -0.5
with np.errstate(over="ignore"):
    P = np.minimum(np.exp(scale * q @ k.T - lse[:, None]), 1.0)
dS = P * (dout @ v.T - (dout * out).sum(-1)[:, None])
dk = scale * dS.T @ q
print(f"P {P.round(3).tolist()}; max |dK| {np.abs(dk).max():.0f} (float16's largest: 65504)")
