"""Monte-Carlo of the backward grid's check (max|g - ref64| <= 3 max|naive - ref64| + 1e-4 over the whole
gradient; tests/test_gpu_backward.py) on one grid shape with the NumPy mirror of the tiled backward
(cuflash/_cpu_backward.py), fresh standard-normal draws each time: how often each gradient fails, and
the worst error / bound. A grid failure on the GPU whose shape fails in the mirror at a like rate is the
check's statistic, not the kernels. --naive torch: the bound from the GPU test's own naive computation
(tests/test_gpu_backward.py attention_ref with upcast=False: torch autograd in the input dtype, scores
and softmax in float32), here on torch's CPU, in place of the NumPy one (every step in the input dtype).

    python bench/dev/bwd_grid_sim.py SEED DRAWS [--dtype bf16] [--d 40] [--batch 16] [--sq 1] [--sk 300]
                                     [--h 4] [--hkv 2] [--causal] [--naive torch]"""
import argparse
import math
import os
import sys
import time

import ml_dtypes
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))
from _grad_reference import attention_grad_reference  # noqa: E402

from cuflash._cpu import attention_forward_numpy  # noqa: E402
from cuflash._cpu_backward import attention_backward_numpy  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("seed", type=int)
ap.add_argument("draws", type=int)
ap.add_argument("--dtype", default="bf16")
ap.add_argument("--d", type=int, default=40)
ap.add_argument("--batch", type=int, default=16)
ap.add_argument("--sq", type=int, default=1)
ap.add_argument("--sk", type=int, default=300)
ap.add_argument("--h", type=int, default=4)
ap.add_argument("--hkv", type=int, default=2)
ap.add_argument("--causal", action="store_true")
ap.add_argument("--naive", default="numpy", choices=("numpy", "torch", "torchlike"))
a = ap.parse_args()


def _r(x):
    """x rounded to the input dtype (from float32 or float64), as float32."""
    return np.asarray(x, np.float32).astype(dt).astype(np.float32)


def torchlike_naive_grads(q, k, v, do, causal, sc):
    """torch_naive_grads in NumPy (float32 accumulation, the input dtype where torch rounds to it): S =
    round(Q K^T) then float32 and scaled; P = softmax(S) in float32; O = round(round(P) V); dP = round(dO
    V^T); dS = P (dP - rowsum(P dP)) in float32; dS' = round(dS * scale); dQ = round(dS' K), dK =
    round(dS'^T Q), dV = round(round(P)^T dO); GQA's heads summed in float32 before the rounding."""
    rep = q.shape[2] // k.shape[2]
    qh = np.asarray(q, np.float32).transpose(0, 2, 1, 3)
    kh = np.repeat(np.asarray(k, np.float32).transpose(0, 2, 1, 3), rep, axis=1)
    vh = np.repeat(np.asarray(v, np.float32).transpose(0, 2, 1, 3), rep, axis=1)
    doh = np.asarray(do, np.float32).transpose(0, 2, 1, 3)
    s = _r(qh @ kh.transpose(0, 1, 3, 2)) * np.float32(sc)
    if causal:
        sq, sk = s.shape[-2:]
        s = np.where(np.arange(sk)[None, :] <= np.arange(sq)[:, None] + sk - sq, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p = (p / p.sum(-1, keepdims=True)).astype(np.float32)
    pr = _r(p)
    dp = _r(doh @ vh.transpose(0, 1, 3, 2))
    ds = p * (dp - (p * dp).sum(-1, keepdims=True))
    ds2 = _r(ds * np.float32(sc))
    dq = _r(ds2 @ kh)
    b, h, sq, d = qh.shape
    hk = k.shape[2]
    dk = _r((ds2.transpose(0, 1, 3, 2) @ qh).reshape(b, hk, rep, -1, d).sum(2))
    dv = _r((pr.transpose(0, 1, 3, 2) @ doh).reshape(b, hk, rep, -1, d).sum(2))
    return (dq.transpose(0, 2, 1, 3).astype(np.float64), dk.transpose(0, 2, 1, 3).astype(np.float64),
            dv.transpose(0, 2, 1, 3).astype(np.float64))


def torch_naive_grads(q, k, v, do, causal, sc):
    """(dq, dk, dv) of the GPU test's naive computation on torch's CPU: scores from input-dtype matmuls,
    cast to float32 and scaled, softmax in float32, P cast back for P V; autograd through it."""
    import torch

    def t(x):  # (exact: the values are already in the dtype)
        return torch.from_numpy(np.asarray(x, np.float32)).to(torch.bfloat16 if a.dtype == "bf16" else torch.float16)

    leaves = [t(x).requires_grad_(True) for x in (q, k, v)]
    qh = leaves[0].transpose(1, 2)
    rep = q.shape[2] // k.shape[2]
    kh = leaves[1].transpose(1, 2).repeat_interleave(rep, dim=1)
    vh = leaves[2].transpose(1, 2).repeat_interleave(rep, dim=1)
    s = torch.matmul(qh, kh.transpose(-1, -2)).to(torch.float32) * sc
    if causal:
        sq, sk = s.shape[-2:]
        vis = torch.arange(sk)[None, :] <= torch.arange(sq)[:, None] + sk - sq
        s = s.masked_fill(~vis, float("-inf"))
    p = torch.softmax(s, dim=-1)
    out = torch.matmul(p.to(vh.dtype), vh).transpose(1, 2)
    out.backward(t(do))
    return tuple(x.grad.double().numpy() for x in leaves)
dt = np.dtype(ml_dtypes.bfloat16) if a.dtype == "bf16" else np.dtype(np.float16)
rng = np.random.default_rng(a.seed)
fails, worst, ratios = {}, {}, {"dq": [], "dk": [], "dv": []}
t0 = time.time()
for it in range(a.draws):
    q = rng.standard_normal((a.batch, a.sq, a.h, a.d)).astype(dt)
    k = rng.standard_normal((a.batch, a.sk, a.hkv, a.d)).astype(dt)
    v = rng.standard_normal((a.batch, a.sk, a.hkv, a.d)).astype(dt)
    do = rng.standard_normal((a.batch, a.sq, a.h, a.d)).astype(dt)
    sc = 1 / math.sqrt(a.d)
    out, lse = attention_forward_numpy(q, k, v, a.causal, sc, block_m=64, block_n=64)
    g = attention_backward_numpy(do, q, k, v, out, lse, a.causal, sc, block_m=64, block_n=128)
    ref = attention_grad_reference(do, q, k, v, a.causal, sc)
    if a.naive == "torch":
        nai = torch_naive_grads(q, k, v, do, a.causal, sc)
    elif a.naive == "torchlike":
        nai = torchlike_naive_grads(q, k, v, do, a.causal, sc)
    else:
        nai = attention_grad_reference(do, q, k, v, a.causal, sc, compute_dtype="input")
    for name, x, r, n in zip(("dq", "dk", "dv"), g, ref, nai):
        ratio = np.abs(x.astype(np.float64) - r).max() / (3 * np.abs(n.astype(np.float64) - r).max() + 1e-4)
        ratios[name].append(ratio)
        worst[name] = max(worst.get(name, 0.0), ratio)
        if ratio > 1:
            fails[name] = fails.get(name, 0) + 1
print(f"{a.dtype} d{a.d} batch {a.batch} {a.sq}x{a.sk} h{a.h}kv{a.hkv} causal={a.causal} naive {a.naive}: "
      f"{a.draws} draws, "
      f"fails {fails}, worst {dict((n, round(w, 3)) for n, w in worst.items())}, "
      f"p99.9 {dict((n, round(float(np.quantile(r, 0.999)), 3)) for n, r in ratios.items())} "
      f"({time.time() - t0:.0f} s)")
