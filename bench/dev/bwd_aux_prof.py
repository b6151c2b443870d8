"""Dev (session 22): per-kernel GPU time of the backward, cuflash against SDPA's cuDNN backend, on
FlashAttention-2's grid shapes (16k tokens, hidden 2048, bf16): how much of cuflash's backward the
row-wise kernels around the dK/dV/dQ kernel take (preprocess: D = rowsum(dO o O) and dq_accum
zeroed; conversion: dq_accum to dQ), and what cuDNN launches for the same call.

PYTHONPATH=. python bench/dev/bwd_aux_prof.py [--seqlens 2048 4096 16384] [--head-dims 64 128]
"""
import argparse
import json
import os

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

import cuflash


def kernels(fn, iters=10):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    out = []
    for ev in prof.key_averages():
        if ev.device_time_total > 0:
            out.append((ev.key[:110], ev.count / iters, ev.device_time_total / iters))
    return sorted(out, key=lambda x: -x[2])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlens", type=int, nargs="+", default=[2048, 4096, 16384])
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    args = ap.parse_args()
    rows = []
    print("device:", torch.cuda.get_device_name())
    for d in args.head_dims:
        for s in args.seqlens:
            for causal in (False, True):
                b, h = 16384 // s, 2048 // d
                q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
                out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
                cf = kernels(lambda: cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal))
                qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v))
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    o2 = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                    dt = dout.transpose(1, 2)
                    cd = kernels(lambda: torch.autograd.grad(o2, (qt, kt, vt), dt, retain_graph=True))
                tot_cf, tot_cd = sum(x[2] for x in cf), sum(x[2] for x in cd)
                print(f"--- d{d} s{s} {'causal' if causal else 'full'}: cuflash {tot_cf:.1f} us, cuDNN {tot_cd:.1f} us"
                      f" (cuflash / cuDNN time {tot_cf / tot_cd:.3f})")
                for name, per, us in cf:
                    print(f"  cf  {us:9.1f} us  x{per:.0f}  {name}")
                for name, per, us in cd:
                    print(f"  cd  {us:9.1f} us  x{per:.0f}  {name}")
                rows.append({"head_dim": d, "seqlen": s, "causal": causal, "cuflash": cf, "cudnn": cd})
    with open(os.path.join(os.environ.get("OUT", "."), "bwd_aux_prof.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
