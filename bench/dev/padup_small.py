"""Head_dim pad-up below the warp-specialized kernels' smallest head_dim, measured (session 36).

Issue 12 asks that pad-up to the next head_dim of the new kernels be measured against today's kernels
wherever it could apply. _config.fwd_pad_head_dim pads from 72 up, and bwd_pad_head_dim from 32 up;
below those the mma.sync kernels run, and that choice had been estimated, not measured. Here, one
process per variant (native, pad, native, pad):
  native  the library as it stands;
  pad     fwd_pad_head_dim and bwd_pad_head_dim patched to give 64 below their ranges (forward: head
          dims 8-56, with CUFLASH_FWD_WS=1 so that the kernel of 64 serves every seqlen_k; backward:
          head dims 8-24).
Per shape: GPU time (CUDA events around each call, 5 warm-up calls, median of 25 back-to-back calls)
and single eager calls (synchronize, events around one call, median of 10), bf16, 16k tokens
(seqlen 1k and 4k), heads 2048 // head_dim, causal off and on, fresh random inputs per shape. The
backward rows time attention_backward alone. Then, for the backward, the statistic of
tests/test_gpu_backward.py::test_backward_dq_small_head_dim_exact: dq's RMS error against float64
over that of rounding the exact dq to bf16 (limit 1.3, tests/_cpu_helpers.py DQ_SPLIT_RMS_LIMIT), at
its four settings (one query x 300 keys, 64 x 1024; keys plain and + 2), 4 query heads on 1 kv head.

  python bench/dev/padup_small.py            # on the GPU
  python bench/dev/padup_small.py --summarize LOG   # the tables again, from a run's log
"""
import json
import math
import os
import subprocess
import sys

FWD_HEAD_DIMS = (8, 16, 24, 32, 40, 48, 56)
BWD_HEAD_DIMS = (8, 16, 24)
SEQLENS = (1024, 4096)
VARIANTS = ("native", "pad", "native", "pad")


def patch(variant):
    from cuflash import _config

    if variant != "pad":
        return
    os.environ["CUFLASH_FWD_WS"] = "1"
    fwd, bwd = _config.fwd_pad_head_dim, _config.bwd_pad_head_dim
    _config.fwd_pad_head_dim = lambda target, d: 64 if target == "sm_90a" and d < 64 else fwd(target, d)
    _config.bwd_pad_head_dim = lambda target, d: 64 if target == "sm_90a" and d < 32 else bwd(target, d)


def timed(torch, f):
    for _ in range(5):
        f()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(25)]
    for e0, e1 in ev:
        e0.record()
        f()
        e1.record()
    torch.cuda.synchronize()
    gpu = sorted(e0.elapsed_time(e1) for e0, e1 in ev)[12]
    eager = []
    for _ in range(10):
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        f()
        e1.record()
        torch.cuda.synchronize()
        eager.append(e0.elapsed_time(e1))
    return gpu, sorted(eager)[5]


def dq_ratio(torch, cuflash, d, sq, sk, key_offset):
    """test_backward_dq_small_head_dim_exact's statistic for one setting (bf16)."""
    dqs, refs = [], []
    batch = 16 if sq == 1 else 2
    scale = 1.0 / math.sqrt(d)
    for _ in range(2 if sq == 1 else 4):
        q = torch.randn(batch, sq, 4, d, device="cuda").to(torch.bfloat16)
        k = (torch.randn(batch, sk, 1, d, device="cuda") + key_offset).to(torch.bfloat16)
        v = torch.randn(batch, sk, 1, d, device="cuda").to(torch.bfloat16)
        dout = torch.randn(batch, sq, 4, d, device="cuda").to(torch.bfloat16)
        out, lse = cuflash.attention(q, k, v, return_lse=True)
        dq = cuflash.attention_backward(dout, q, k, v, out, lse)[0]
        q64, k64, v64, do64 = (t.double().transpose(1, 2) for t in (q, k, v, dout))
        q64.requires_grad_(True)
        k64 = k64.expand(-1, 4, -1, -1)
        v64 = v64.expand(-1, 4, -1, -1)
        p = torch.softmax(q64 @ k64.transpose(-1, -2) * scale, dim=-1)
        (ref,) = torch.autograd.grad(p @ v64, q64, do64)
        dqs.append(dq.double())
        refs.append(ref.transpose(1, 2))
    dq, ref = torch.cat(dqs), torch.cat(refs)
    floor = (ref.to(torch.bfloat16).double() - ref).pow(2).mean().sqrt()
    return float((dq - ref).pow(2).mean().sqrt() / floor)


def run_one(variant):
    import torch

    patch(variant)
    import cuflash

    for d in FWD_HEAD_DIMS:
        for s in SEQLENS:
            for causal in (False, True):
                b, h = 16384 // s, 2048 // d
                q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                gpu, eager = timed(torch, lambda: cuflash.attention(q, k, v, causal=causal))
                flops = 4 * b * h * s * s * d / (2 if causal else 1)
                print(json.dumps({"variant": variant, "pass": "fwd", "d": d, "s": s, "causal": causal, "ms": gpu,
                                  "eager_ms": eager, "tflops": flops / gpu / 1e9}), flush=True)
                del q, k, v
    for d in BWD_HEAD_DIMS:
        for s in SEQLENS:
            for causal in (False, True):
                b, h = 16384 // s, 2048 // d
                q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
                o, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
                gpu, eager = timed(torch, lambda: cuflash.attention_backward(dout, q, k, v, o, lse, causal=causal))
                flops = 2.5 * 4 * b * h * s * s * d / (2 if causal else 1)
                print(json.dumps({"variant": variant, "pass": "bwd", "d": d, "s": s, "causal": causal, "ms": gpu,
                                  "eager_ms": eager, "tflops": flops / gpu / 1e9}), flush=True)
                del q, k, v, dout, o, lse
    torch.manual_seed(1)
    for d in BWD_HEAD_DIMS:
        for sq, sk in ((1, 300), (64, 1024)):
            for off in (0.0, 2.0):
                print(json.dumps({"variant": variant, "pass": "dq_ratio", "d": d, "sq": sq, "sk": sk, "k_off": off,
                                  "ratio": dq_ratio(torch, cuflash, d, sq, sk, off)}), flush=True)


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--one":
        run_one(sys.argv[2])
        return
    if len(sys.argv) > 2 and sys.argv[1] == "--summarize":  # a log of an earlier run
        summarize([json.loads(ln) for ln in open(sys.argv[2]) if ln.startswith("{")])
        return
    summarize(run_variants(__file__, VARIANTS))


def run_variants(script, variants):
    """Runs `script --one VARIANT` for each variant in its own process; returns (and prints) the JSON
    rows they printed."""
    rows = []
    for variant in variants:
        r = subprocess.run([sys.executable, script, "--one", variant], capture_output=True, text=True,
                           env=os.environ)
        if r.returncode != 0:
            print("FAILED", variant, r.stderr[-3000:], flush=True)
        for line in r.stdout.splitlines():
            if line.startswith("{"):
                rows.append(json.loads(line))
                print(line, flush=True)
    return rows


def summarize(rows):
    print("\npad / native, GPU time (min of each variant's two runs) | eager (min of the two medians); "
          "TFLOP/s native -> pad")
    keys = sorted({(r["pass"], r["d"], r["s"], r["causal"]) for r in rows if r["pass"] != "dq_ratio"})
    for key in keys:
        sel = {v: [r for r in rows if r["pass"] != "dq_ratio" and (r["pass"], r["d"], r["s"], r["causal"]) == key and r["variant"] == v]
               for v in ("native", "pad")}
        if not sel["native"] or not sel["pad"]:
            continue
        g = min(r["ms"] for r in sel["pad"]) / min(r["ms"] for r in sel["native"])
        e = min(r["eager_ms"] for r in sel["pad"]) / min(r["eager_ms"] for r in sel["native"])
        print(f"{key[0]} d{key[1]:<3d} s{key[2] // 1024}k {'causal' if key[3] else 'full  '}: {g:.3f} | {e:.3f}   "
              f"{max(r['tflops'] for r in sel['native']):6.1f} -> {max(r['tflops'] for r in sel['pad']):6.1f}")
    print("\ndq RMS ratio (limit 1.3): native / pad")
    for r in rows:
        if r["pass"] == "dq_ratio" and r["variant"] == "native":
            pads = [x["ratio"] for x in rows if x["pass"] == "dq_ratio" and x["variant"] == "pad"
                    and (x["d"], x["sq"], x["k_off"]) == (r["d"], r["sq"], r["k_off"])]
            print(f"d{r['d']} q{r['sq']}k{r['sk']} k+{r['k_off']:.0f}: {r['ratio']:.3f} / "
                  f"{' '.join('%.3f' % p for p in pads)}")


if __name__ == "__main__":
    main()
