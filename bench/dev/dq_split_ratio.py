"""The statistic of tests/test_gpu_backward.py::test_backward_dq_small_head_dim_keeps_ds_precision, repeated:
per (dtype, head_dim, seqlens) REPS fresh runs of the test's draws, printing each RMS ratio and the largest
max-error / bound of the usual gradient check (dq, dk, dv), so that the test's margin can be read."""
import math, os, sys
sys.path.insert(0, "tests")
import numpy as np
import torch
import cuflash as cf
import test_gpu_backward as T
from _cpu_helpers import dq_split_rms_ratio

reps = int(os.environ.get("REPS", "4"))
for dtype in ("bfloat16", "float16"):
    for hd in (8, 16, 24):
        for sq, sk in ((1, 300), (64, 1024)):
            ratios, worst = [], [0.0, 0.0, 0.0]
            for r in range(reps):
                batch = 16 if sq == 1 else 2
                dqs, refs = [], []
                for i in range(2 if sq == 1 else 4):
                    q, k, v = T.make_qkv(batch, sq, sk, 4, 1, hd, T.TORCH_DTYPES[dtype])
                    dout = T.make_dout(batch, sq, 4, hd, T.TORCH_DTYPES[dtype])
                    ref, bounds = T.grad_bounds(q, k, v, dout, False, 1 / math.sqrt(hd))
                    out, lse = cf.attention(q, k, v, return_lse=True)
                    g = cf.attention_backward(dout, q, k, v, out, lse, deterministic=bool(r % 2))
                    for j in range(3):
                        worst[j] = max(worst[j], (g[j].double() - ref[j]).abs().max().item() / bounds[j])
                    dqs.append(g[0].double().cpu().numpy()); refs.append(ref[0].cpu().numpy())
                ratios.append(dq_split_rms_ratio(np.concatenate(dqs), np.concatenate(refs), T._NP_DTYPES[dtype]))
            print(f"{dtype:8s} d{hd:<3d} q{sq}k{sk}: rms ratios {' '.join(f'{x:.3f}' for x in ratios)}  "
                  f"worst err/bound dq {worst[0]:.2f} dk {worst[1]:.2f} dv {worst[2]:.2f}")
