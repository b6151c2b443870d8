"""Replays test_backward_grid[bf16-d8-full-q1k300-h4kv1-bhsd-*] with a seed, saves the tensors
($OUT/bwd_d8.npz), and sweeps fresh seeds over the same shape printing err / naive ratios."""
import os, sys, math
import numpy as np
sys.path.insert(0, "tests")
import torch
import test_gpu_backward as T
import cuflash as cf

def case(seed, det, save=None, hd=8, sq=1, sk=300, h=4, hkv=1, layout="bhsd"):
    torch.manual_seed(seed)
    q, k, v = T.make_qkv(2, sq, sk, h, hkv, hd, torch.bfloat16, layout)
    dout = T.make_dout(2, sq, h, hd, torch.bfloat16, layout)
    out, lse = cf.attention(q, k, v, causal=False, return_lse=True)
    dq, dk, dv = cf.attention_backward(dout, q, k, v, out, lse, causal=False, deterministic=det)
    scale = 1 / math.sqrt(hd)
    ref = T.reference_grads(q, k, v, dout, False, scale, upcast=True)
    nai = T.reference_grads(q, k, v, dout, False, scale, upcast=False)
    r = []
    for g, rr, n in zip((dq, dk, dv), ref, nai):
        e = (g.double() - rr).abs().max().item(); en = (n.double() - rr).abs().max().item()
        r.append((e, en))
    if save:
        np.savez(save, **{n: t.float().cpu().numpy() for n, t in
                          dict(q=q, k=k, v=v, dout=dout, out=out, lse=lse, dq=dq, dk=dk, dv=dv).items()})
    return r

seed = int(os.environ.get("SEED", "10361418856339468297"))
out = os.environ.get("OUT", ".")
r = case(seed, False, save=os.path.join(out, "bwd_d8.npz"))
print("replay", seed, [(f"{e:.3g}", f"{n:.3g}", f"{e/n:.2f}") for e, n in r])
for hd, sk in ((8, 300), (32, 300), (8, 1024), (64, 300)):
    worst = []
    for i in range(int(os.environ.get("N", "200"))):
        s = 1000 + i
        r = case(s, i % 2 == 1, hd=hd, sk=sk)
        worst.append((max(e / (3 * n + 1e-4) for e, n in r), s, [round(e / n, 2) for e, n in r]))
    worst.sort(reverse=True)
    print(f"d{hd} sk{sk}: worst err/bound", worst[:4], "fails:", sum(w[0] > 1 for w in worst))
