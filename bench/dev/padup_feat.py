"""Dev probe: head_dim pad-up with options (cuflash/_config.py fwd_pad_head_dim / bwd_pad_head_dim).

Times cuflash's forward and forward + backward with each option at head dims that pad up, with
pad-up on and off (CUFLASH_FWD_PAD / CUFLASH_BWD_PAD = 0) in one process (the plan cache cleared
between settings): GPU time of back-to-back calls, CUDA events, median of 20 after warm-up; random
bf16 inputs, batch 2, 16k tokens in all, hidden ~2048. Writes JSON to $OUT/padup_feat.json if OUT is
set. Run on the GPU machine: PYTHONPATH=. python bench/dev/padup_feat.py
"""
import json
import os
import statistics

import torch

import cuflash
from cuflash import _plan

VARIANTS = {
    "plain causal": dict(causal=True),
    "window (256, 0)": dict(window=(256, 0)),
    "window (4096, 0)": dict(window=(4096, 0)),
    "alibi causal": "alibi",
    "softcap causal": dict(causal=True, softcap=30.0),
}


def timed(fn, reps=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def main():
    out = []
    seqlen, batch = 8192, 2
    for d in (96, 72, 200):
        heads = max(1, 2048 // d)
        q, k, v = (torch.randn(batch, seqlen, heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        do = torch.randn_like(q)
        slopes = torch.rand(heads, device="cuda", dtype=torch.float32) * 0.1
        for name, kw in VARIANTS.items():
            if kw == "alibi":
                kw = dict(causal=True, alibi_slopes=slopes)
            row = {"head_dim": d, "heads": heads, "variant": name}
            for pad in ("1", "0"):
                os.environ["CUFLASH_FWD_PAD"] = os.environ["CUFLASH_BWD_PAD"] = pad
                _plan.CACHE.clear()
                qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
                row[f"fwd_ms_pad{pad}"] = timed(lambda: cuflash.attention(q, k, v, **kw))

                def fb():
                    o = cuflash.attention(qq, kk, vv, **kw)
                    torch.autograd.grad(o, (qq, kk, vv), do)
                row[f"fwdbwd_ms_pad{pad}"] = timed(fb)
            row["fwd_speedup"] = row["fwd_ms_pad0"] / row["fwd_ms_pad1"]
            row["fwdbwd_speedup"] = row["fwdbwd_ms_pad0"] / row["fwdbwd_ms_pad1"]
            print(f"d{d} h{heads} {name:18s} fwd {row['fwd_ms_pad1']:.3f} / {row['fwd_ms_pad0']:.3f} ms "
                  f"({row['fwd_speedup']:.2f}x)  fwd+bwd {row['fwdbwd_ms_pad1']:.3f} / {row['fwdbwd_ms_pad0']:.3f} ms "
                  f"({row['fwdbwd_speedup']:.2f}x)", flush=True)
            out.append(row)
    os.environ.pop("CUFLASH_FWD_PAD")
    os.environ.pop("CUFLASH_BWD_PAD")
    meta = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "seqlen": seqlen, "batch": batch,
            "dtype": "bfloat16", "timing": "CUDA events, median of 20 back-to-back calls after 3 warm-up"}
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "padup_feat.json"), "w") as f:
            json.dump({"meta": meta, "rows": out}, f, indent=1)


if __name__ == "__main__":
    main()
