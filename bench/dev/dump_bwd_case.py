"""Dev: one backward grid case of tests/test_gpu_backward.py replayed by its seed (the test's own draws,
in its order), its tensors saved for offline study, and where dq's error comes from at the worst
element: the GPU's dq against float64 and the naive bf16 computation, and D = rowsum(dO * O) from the
stored O against the exact sum_j P_j dP_j. Session 41: bf16 d32 causal 1023 x 1024 h4 kv4 bshd, seed
16977893723196167458 (dq 0.0300 against a bound of 0.0257, both backward paths, session 40's code too).

    python bench/dev/dump_bwd_case.py OUT_DIR [seed]"""
import math
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))
import cuflash  # noqa: E402
from test_gpu_backward import GRID_BATCH, grad_bounds, make_dout  # noqa: E402
from test_gpu_forward import make_qkv  # noqa: E402

out_dir = sys.argv[1]
seed = int(sys.argv[2]) if len(sys.argv) > 2 else 16977893723196167458
torch.manual_seed(seed)
b, sq, sk, h, hkv, d, causal = GRID_BATCH, 1023, 1024, 4, 4, 32, True
q, k, v = make_qkv(b, sq, sk, h, hkv, d, torch.bfloat16, "bshd")
dout = make_dout(b, sq, h, d, torch.bfloat16, "bshd")
scale = 1.0 / math.sqrt(d)
out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
res = {}
for det in (False, True):
    res[det] = cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=det)
(ref_dq, ref_dk, ref_dv), bounds = grad_bounds(q, k, v, dout, causal, scale)
print("bounds", bounds)
for det in (False, True):
    dq = res[det][0].double()
    diff = (dq - ref_dq).abs()
    i = np.unravel_index(int(diff.argmax()), diff.shape)
    print(f"deterministic={det}: max|dq-ref| {diff.max().item():.5f} at {tuple(int(x) for x in i)}; dq {dq[i].item():.5f} "
          f"ref {ref_dq[i].item():.5f}")
# The row's pieces in float64 (exact) and from the stored O
bi, si, hi = (int(x) for x in i[:3])
q64, k64, v64, do64 = (t.double() for t in (q, k, v, dout))
s = torch.einsum("d,jd->j", q64[bi, si, hi], k64[bi, :, hi]) * scale
vis = torch.arange(sk, device=s.device) <= si + sk - sq
s = s.masked_fill(~vis, -math.inf)
lse64 = torch.logsumexp(s, 0)
p = torch.exp(s - lse64)
dp = torch.einsum("d,jd->j", do64[bi, si, hi], v64[bi, :, hi])
o64 = torch.einsum("j,jd->d", p, v64[bi, :, hi])
d_exact = (p * dp).sum()
d_stored = (do64[bi, si, hi] * out[bi, si, hi].double()).sum()
print(f"row ({bi},{si},{hi}): keys seen {int(vis.sum())}; lse {lse[bi, hi, si].item():.6f} ref {lse64.item():.6f}; "
      f"P {p[vis].tolist()}; dP {dp[vis].tolist()}")
print(f"  D exact {d_exact.item():.6f}, D from stored O {d_stored.item():.6f}; max|O - O64| "
      f"{(out[bi, si, hi].double() - o64).abs().max().item():.5f}")
ds = p * (dp - d_exact)
print(f"  dS exact {ds[vis].tolist()}; dq[{int(i[3])}] exact {(ds @ k64[bi, :, hi])[int(i[3])].item() * scale:.5f}")
np.savez_compressed(os.path.join(out_dir, "bwd_case.npz"),
                    **{n: t.float().cpu().numpy() for n, t in (("q", q), ("k", k), ("v", v), ("dout", dout),
                                                                ("out", out), ("lse", lse), ("dq_atomic", res[False][0]),
                                                                ("dq_det", res[True][0]), ("ref_dq", ref_dq))})
print("saved", os.path.join(out_dir, "bwd_case.npz"))
