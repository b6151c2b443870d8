"""Does SDPA's cuDNN forward run another kernel when the inputs require grad? (session 28)

bench.py's full grid times the forward with inputs that require grad (as in training); its
forward-only grid does not. In session 27 (H100) cuDNN's head_dim 128 non-causal forward read
641-668 TFLOP/s in the first and 606-624 in the second, while cuflash's read the same in both.
This times four providers interleaved in one process (cuDNN and cuflash, each with inputs that do
and do not require grad; ROUNDS rounds, each a median of REPS CUDA-event timings of back-to-back
calls after a warm-up), then names the kernels each one launches (torch.profiler, one call).

Env: SHAPES ("128:2048 128:8192 64:4096": head_dim:seqlen; batch 16384 // seqlen, heads 2048 //
head_dim, bf16, non-causal; CAUSAL=1 for causal), ROUNDS (6), REPS (20).
Prints one table row per shape (TFLOP/s median over rounds) and the kernel names."""
import os
import statistics as st
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import cuflash  # noqa: E402

ROUNDS = int(os.environ.get("ROUNDS", "6"))
REPS = int(os.environ.get("REPS", "20"))
CAUSAL = os.environ.get("CAUSAL", "0") == "1"
shapes = [tuple(int(x) for x in s.split(":")) for s in os.environ.get("SHAPES", "128:2048 128:8192 64:4096").split()]


def providers(q, k, v, qg, kg, vg):
    t = lambda x: x.transpose(1, 2)  # noqa: E731

    def cudnn(a, b, c):
        def fn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return sdpa(t(a), t(b), t(c), is_causal=CAUSAL)
        return fn

    return {
        "cudnn_nograd": cudnn(q, k, v),
        "cudnn_grad": cudnn(qg, kg, vg),
        "cuflash_nograd": lambda: cuflash.attention(q, k, v, causal=CAUSAL),
        "cuflash_grad": lambda: cuflash.attention(qg, kg, vg, causal=CAUSAL),
    }


def time_fn(fn, reps):
    for _ in range(3):
        fn()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, b in ev:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return st.median(a.elapsed_time(b) for a, b in ev)


print(torch.cuda.get_device_name(), "torch", torch.__version__, "cudnn", torch.backends.cudnn.version(),
      "causal" if CAUSAL else "non-causal")
print(f"{'d':>4} {'seqlen':>6} " + " ".join(f"{p:>15}" for p in ("cudnn_nograd", "cudnn_grad", "cuflash_nograd",
                                                                  "cuflash_grad")) + "   cuflash/cudnn (grad)")
names = {}
for d, n in shapes:
    b, h = 16384 // n, 2048 // d
    q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    qg, kg, vg = (x.clone().requires_grad_(True) for x in (q, k, v))
    provs = providers(q, k, v, qg, kg, vg)
    ms = {p: [] for p in provs}
    for _ in range(ROUNDS):
        for p, fn in provs.items():
            ms[p].append(time_fn(fn, REPS))
    flops = 4 * b * h * n * n * d / (2 if CAUSAL else 1)
    tf = {p: flops / (st.median(v) * 1e-3) / 1e12 for p, v in ms.items()}
    print(f"{d:>4} {n:>6} " + " ".join(f"{tf[p]:>15.1f}" for p in provs)
          + f"   {tf['cuflash_grad'] / tf['cudnn_grad']:.3f}; no grad {tf['cuflash_nograd'] / tf['cudnn_nograd']:.3f}",
          flush=True)
    for p, fn in provs.items():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        ks = [(e.name, e.device_time) for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        names[(d, n, p)] = ks
for (d, n, p), ks in names.items():
    print(f"d{d} {n} {p}:")
    for name, us in ks:
        print(f"    {us:9.1f} us  {name[:200]}")
