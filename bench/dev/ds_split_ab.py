"""dS hi + lo below head_dim 32 (cuda_src/flash_bwd.cu DS_SPLIT_BELOW): accuracy statistic and backward
time at small head dims, for the checkout on sys.path (CUFLASH_BENCH_PATH=<tree> runs an older one).

Prints, per (dtype, head_dim, seqlen_q): the RMS error of dq and dk against float64 over TRIALS fresh inputs,
as a ratio to the naive in-dtype computation's; then the backward's GPU time (CUDA events, median) at
batch 8, 16 heads, seqlen 4096."""
import math, os, sys
if os.environ.get("CUFLASH_BENCH_PATH"):
    sys.path.insert(0, os.environ["CUFLASH_BENCH_PATH"])
sys.path.insert(0, "tests")
import torch
import cuflash as cf
import test_gpu_backward as T

print("cuflash from", cf.__file__)
trials = int(os.environ.get("TRIALS", "12"))
for dtype in (torch.bfloat16, torch.float16):
    for hd in (8, 16, 24, 32) if os.environ.get('ACC', '1') == '1' else ():
        for sq, off in ((1, 0.0), (3, 0.0), (1, 2.0), (16, 2.0)):
            se = {"dq": [0.0, 0.0], "dk": [0.0, 0.0]}
            worst = 0.0
            for i in range(trials):
                torch.manual_seed(7000 + 100 * hd + 10 * sq + i)
                q, k, v = T.make_qkv(2, sq, 300, 4, 1, hd, dtype)
                k = k + off  # a common component: dQ = sum dS_j K_j cancels (sum_j dS_j = 0)
                dout = T.make_dout(2, sq, 4, hd, dtype)
                out, lse = cf.attention(q, k, v, return_lse=True)
                g = cf.attention_backward(dout, q, k, v, out, lse, deterministic=bool(i % 2))
                sc = 1 / math.sqrt(hd)
                ref = T.reference_grads(q, k, v, dout, False, sc, upcast=True)
                nai = T.reference_grads(q, k, v, dout, False, sc, upcast=False)
                for j, name in ((0, "dq"), (1, "dk")):
                    se[name][0] += ((g[j].double() - ref[j]) ** 2).sum().item()
                    se[name][1] += ((nai[j].double() - ref[j]) ** 2).sum().item()
                    e = (g[j].double() - ref[j]).abs().max().item()
                    en = (nai[j].double() - ref[j]).abs().max().item()
                    worst = max(worst, e / (3 * en + 1e-4))
            print(f"{str(dtype)[6:]:8s} d{hd:<3d} sq{sq} off{off}: rms ratio dq {math.sqrt(se['dq'][0] / se['dq'][1]):.3f} "
                  f"dk {math.sqrt(se['dk'][0] / se['dk'][1]):.3f}  worst max-err/bound {worst:.2f}")

for hd in [int(x) for x in os.environ.get("TIME_HDS", "8 16 24").split()]:
    for causal in [c == "1" for c in os.environ.get("TIME_CAUSAL", "0 1").split()]:
        b, h, s = 8, 16, 4096
        q, k, v = (torch.randn(b, s, h, hd, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        dout = torch.randn_like(q)
        out, lse = cf.attention(q, k, v, causal=causal, return_lse=True)
        for det in [d == "1" for d in os.environ.get("TIME_DET", "0 1").split()]:
            f = lambda: cf.attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=det)
            for _ in range(3): f()
            torch.cuda.synchronize()
            ts = []
            for _ in range(15):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record(); f(); e1.record(); torch.cuda.synchronize(); ts.append(e0.elapsed_time(e1))
            ts.sort()
            print(f"bwd bf16 d{hd} causal={causal} det={det} b{b} h{h} s{s}: {ts[len(ts)//2]:.3f} ms")
