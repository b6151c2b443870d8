"""The backward below head_dim 32 with the dQ kernel first (D* = D + E for the dK/dV kernel; cuflash/_config.py
_config.BWD_DS_SPLIT_BELOW) against the former order (dK/dV first, D from the rounded O; the constant 0 here,
plans rebuilt), in one process on one card.

1. Accuracy (ACC=1): dk's RMS error against float64 as a ratio to rounding the exact dk, over DRAWS fresh draws
   of values that share a component (tests/test_gpu_backward.py test_backward_dk_small_head_dim_d_star's
   inputs: batch 16, 1 query, 300 keys, 4 query heads on 1 kv head), per dtype and head_dim 8 / 16 / 24.
2. GPU time (CUDA events, warm-up first, the median of REPS calls a round, ROUNDS rounds alternating the two
   orders; the median of the round medians): bf16, batch 8, 16 heads, seqlen TIME_SEQS, causal off / on,
   deterministic off / on, head_dim TIME_HDS. The order changes no launch's work, so the host's part is the
   same for both: GPU time only.
Prints one line per point and, last, the geomean of new / old."""
import math, os, sys

sys.path.insert(0, "tests")
import numpy as np
import torch

import cuflash as cf
from cuflash import _config, _plan
import test_gpu_backward as T
from _cpu_helpers import dq_split_rms_ratio

ORDERS = {"new": 32, "old": 0}


def set_order(name):
    _config.BWD_DS_SPLIT_BELOW = ORDERS[name]
    _plan.CACHE.clear()


print("cuflash from", cf.__file__, "| GPU", torch.cuda.get_device_name())
if os.environ.get("ACC", "1") == "1":
    draws = int(os.environ.get("DRAWS", "4"))
    for dtype, npdt in ((torch.bfloat16, T._NP_DTYPES["bfloat16"]), (torch.float16, np.float16)):
        for hd in (8, 16, 24):
            line = []
            for name in ORDERS:
                set_order(name)
                torch.manual_seed(9100 + hd)
                dks, refs = [], []
                for i in range(draws):
                    q, k, _ = T.make_qkv(16, 1, 300, 4, 1, hd, dtype)
                    c = 2.0 * torch.randn(16, 1, 1, hd, device="cuda", dtype=torch.float64)
                    v = (c + 0.05 * torch.randn(16, 300, 1, hd, device="cuda", dtype=torch.float64)).to(dtype)
                    dout = T.make_dout(16, 1, 4, hd, dtype)
                    ref = T.reference_grads(q, k, v, dout, False, 1 / math.sqrt(hd), upcast=True)
                    out, lse = cf.attention(q, k, v, return_lse=True)
                    g = cf.attention_backward(dout, q, k, v, out, lse, deterministic=bool(i % 2))
                    dks.append(g[1].double().cpu().numpy())
                    refs.append(ref[1].cpu().numpy())
                line.append(f"{name} {dq_split_rms_ratio(np.concatenate(dks), np.concatenate(refs), npdt):7.2f}")
            print(f"acc {str(dtype)[6:]:8s} d{hd:<3d} dk rms / rounding: " + "  ".join(line))

reps, rounds = int(os.environ.get("REPS", "20")), int(os.environ.get("ROUNDS", "5"))
ratios = []
for hd in [int(x) for x in os.environ.get("TIME_HDS", "8 16 24").split()]:
    for s in [int(x) for x in os.environ.get("TIME_SEQS", "1024 4096").split()]:
        b, h = 8, 16
        torch.manual_seed(hd * 7 + s)
        q, k, v = (torch.randn(b, s, h, hd, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        dout = torch.randn_like(q)
        for causal in (False, True):
            out, lse = cf.attention(q, k, v, causal=causal, return_lse=True)
            for det in (False, True):
                meds = {n: [] for n in ORDERS}
                for r in range(rounds):
                    for name in (ORDERS if r % 2 == 0 else reversed(list(ORDERS))):
                        set_order(name)
                        f = lambda: cf.attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=det)
                        for _ in range(3):
                            f()
                        torch.cuda.synchronize()
                        ts = []
                        for _ in range(reps):
                            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                            e0.record(); f(); e1.record(); torch.cuda.synchronize()
                            ts.append(e0.elapsed_time(e1))
                        meds[name].append(float(np.median(ts)))
                new, old = float(np.median(meds["new"])), float(np.median(meds["old"]))
                ratios.append(new / old)
                print(f"time bf16 d{hd:<3d} b{b} h{h} s{s:<5d} causal={int(causal)} det={int(det)}: "
                      f"new {new * 1e3:8.1f} us  old {old * 1e3:8.1f} us  new/old {new / old:.3f}")
set_order("new")
if ratios:
    print(f"geomean new/old {math.exp(sum(map(math.log, ratios)) / len(ratios)):.3f} over {len(ratios)} points, "
          f"range {min(ratios):.3f}-{max(ratios):.3f}")
