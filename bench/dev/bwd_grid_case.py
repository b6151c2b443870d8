"""Dev: one backward grid case of tests/test_gpu_backward.py replayed by its seed (the test's own draws, in
its order: torch.manual_seed(seed), make_qkv, make_dout), run on both backward paths several times (the
atomic path's dq sums in an order that varies), each gradient's error against the grid's bound printed,
and the tensors saved (npz) for the NumPy mirror (bench/dev/bwd_grid_sim.py --case).

    python bench/dev/bwd_grid_case.py OUT_DIR SEED DTYPE D CAUSAL SQ SK H HKV LAYOUT [REPEATS]
    e.g. python bench/dev/bwd_grid_case.py $OUT 13838011016083039768 bf16 40 0 1 300 4 2 bhsd 5"""
import math
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))
import cuflash  # noqa: E402
from test_gpu_backward import grad_bounds, grid_batch, make_dout  # noqa: E402
from test_gpu_forward import make_qkv  # noqa: E402

out_dir, seed, dtype = sys.argv[1], int(sys.argv[2]), sys.argv[3]
d, causal, sq, sk, h, hkv = (int(x) for x in sys.argv[4:10])
layout = sys.argv[10]
repeats = int(sys.argv[11]) if len(sys.argv) > 11 else 5
tdt = torch.bfloat16 if dtype == "bf16" else torch.float16
torch.manual_seed(seed)
b = grid_batch(sq)
q, k, v = make_qkv(b, sq, sk, h, hkv, d, tdt, layout)
dout = make_dout(b, sq, h, d, tdt, layout)
scale = 1.0 / math.sqrt(d)
out, lse = cuflash.attention(q, k, v, causal=bool(causal), return_lse=True)
refs, bounds = grad_bounds(q, k, v, dout, bool(causal), scale)
print(f"case {dtype} d{d} causal={causal} b={b} {sq}x{sk} h{h}kv{hkv} {layout} seed {seed}; bounds "
      + ", ".join(f"{n} {x:.5g}" for n, x in zip(("dq", "dk", "dv"), bounds)))
saved = {}
for det in (False, True):
    for r in range(repeats):
        g = cuflash.attention_backward(dout, q, k, v, out, lse, causal=bool(causal), deterministic=det)
        errs = []
        for name, x, ref, bound in zip(("dq", "dk", "dv"), g, refs, bounds):
            diff = (x.double() - ref).abs()
            i = np.unravel_index(int(diff.argmax()), diff.shape)
            errs.append(f"{name} {diff.max().item():.5g} ({diff.max().item() / bound:.2f}x) at {tuple(int(j) for j in i)}")
        print(f"  deterministic={det} run {r}: " + "; ".join(errs))
        if r == 0:
            saved[f"dq_{'det' if det else 'atomic'}"] = g[0]
arrays = {"q": q, "k": k, "v": v, "dout": dout, "out": out, "lse": lse, "ref_dq": refs[0], **saved}
np.savez_compressed(os.path.join(out_dir, "bwd_case.npz"),
                    **{n: t.double().cpu().numpy() for n, t in arrays.items()})
print("saved", os.path.join(out_dir, "bwd_case.npz"))
