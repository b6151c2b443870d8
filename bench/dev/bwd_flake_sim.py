"""Monte-Carlo of the backward grid's 3x-naive max-error check on one-row entries with the NumPy mirror
(fresh draws of batch x 1 x 300, GQA 4:1, head_dim 8/16/24, both dtypes): failing draws per (dtype, head_dim, grad)
and the worst error / bound. Usage: python bench/dev/bwd_flake_sim.py SEED BATCH ITERATIONS."""
import sys, math, time, numpy as np, ml_dtypes
sys.path.insert(0, "tests")
from _grad_reference import attention_grad_reference
from cuflash._cpu import attention_forward_numpy
from cuflash._cpu_backward import attention_backward_numpy
BF16 = np.dtype(ml_dtypes.bfloat16)
rng = np.random.default_rng(int(sys.argv[1]))
batch = int(sys.argv[2]); n = int(sys.argv[3])
fails = {}; total = 0; worst = {}
t0 = time.time()
for it in range(n):
    for dt in (BF16, np.dtype(np.float16)):
        for d in (8, 16, 24):
            q = rng.standard_normal((batch, 1, 4, d)).astype(dt); k = rng.standard_normal((batch, 300, 1, d)).astype(dt)
            v = rng.standard_normal((batch, 300, 1, d)).astype(dt); do = rng.standard_normal((batch, 1, 4, d)).astype(dt)
            sc = 1 / math.sqrt(d)
            out, lse = attention_forward_numpy(q, k, v, False, sc, block_m=64, block_n=64)
            g = attention_backward_numpy(do, q, k, v, out, lse, False, sc, block_m=64, block_n=128)
            ref = attention_grad_reference(do, q, k, v, False, sc)
            nai = attention_grad_reference(do, q, k, v, False, sc, compute_dtype="input")
            total += 1
            for name, a, r, nv in zip(("dq", "dk", "dv"), g, ref, nai):
                e = np.abs(a.astype(np.float64) - r).max(); en = np.abs(nv.astype(np.float64) - r).max()
                ratio = e / (3 * en + 1e-4)
                key = (dt.name, d, name)
                worst[key] = max(worst.get(key, 0), ratio)
                if ratio > 1: fails[key] = fails.get(key, 0) + 1
print("batch", batch, "draws", total, "fails", fails, "time %.0fs" % (time.time() - t0))
print({k: round(v, 2) for k, v in sorted(worst.items())})
