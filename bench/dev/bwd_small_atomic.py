"""Below head_dim 32: what the backward's two passes cost, and what one pass would (session 36).

The mma.sync backward below head_dim 32 runs the preprocess, the dK/dV kernel and the separate dQ
kernel (which recomputes Q K^T and dO V^T and takes dS as hi + lo with D's correction). The dK/dV
kernel's own atomic dQ (_config.BWD_ATOMIC_DQ) skips the second pass but keeps dS rounded once and D
uncorrected, so it fails tests/test_gpu_backward.py's small-head-dim precision test: it is timed
here only as the ceiling of a single-pass design (the NOTES' "atomic dQ with the split" lead).

  python bench/dev/bwd_small_atomic.py --precompile sm_90a   # here, no GPU: build both variants
  python bench/dev/bwd_small_atomic.py                        # on the GPU

Two variants, "separate" (the library) and "atomic" (BWD_ATOMIC_DQ = True), one process each,
run in the order separate, atomic, separate, atomic. Per shape: GPU time of attention_backward
(CUDA events around each call, 5 warm-up calls, median of 25; GPU time only, no single eager calls)
and each kernel's share from torch.profiler (10 calls). bf16, 16k tokens (seqlen 1k and 4k), heads
2048 // head_dim, causal off and on, fresh random inputs per shape."""
import json
import os
import subprocess
import sys

HEAD_DIMS = (8, 16, 24)
SEQLENS = (1024, 4096)
VARIANTS = ("separate", "atomic", "separate", "atomic")


def patch(variant):
    from cuflash import _config

    _config.BWD_ATOMIC_DQ = variant == "atomic"


def precompile(target):
    from cuflash import _compile, _launch

    for variant in ("separate", "atomic"):
        patch(variant)
        for d in HEAD_DIMS:
            for causal in (False, True):
                atomic = variant == "atomic"  # (the shapes here are whole tiles: even)
                for spec, _, _ in _launch.bwd_specializations("bfloat16", d, target, causal, True, True, atomic):
                    ck = _compile.compile_cached(spec, target)
                    regs = [ln.strip() for ln in ck.ptxas_log.splitlines() if "registers" in ln or "spill" in ln]
                    print(variant, d, causal, spec.name, regs[-1:] if ck.compile_seconds else "(cached)", flush=True)


def kernel_times(torch, f, n=10):
    """{kernel name (shortened): mean device us per call} over n calls under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            f()
        torch.cuda.synchronize()
    out = {}
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None)
        if t is None:
            t = getattr(ev, "cuda_time_total", 0.0)
        if t and ev.key and "kernel" in ev.key:
            name = ev.key.split("<")[0].split("::")[-1]
            out[name] = out.get(name, 0.0) + t / n
    return out


def run_one(variant):
    import torch

    patch(variant)
    import cuflash

    for d in HEAD_DIMS:
        for s in SEQLENS:
            for causal in (False, True):
                b, h = 16384 // s, 2048 // d
                q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
                o, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
                f = lambda: cuflash.attention_backward(dout, q, k, v, o, lse, causal=causal)  # noqa: E731
                for _ in range(5):
                    f()
                torch.cuda.synchronize()
                ts = []
                for _ in range(25):
                    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    e0.record()
                    f()
                    e1.record()
                    torch.cuda.synchronize()
                    ts.append(e0.elapsed_time(e1))
                ts.sort()
                row = {"variant": variant, "d": d, "s": s, "causal": causal, "ms": ts[len(ts) // 2],
                       "kernels_us": kernel_times(torch, f)}
                print(json.dumps(row), flush=True)
                del q, k, v, dout, o, lse


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--precompile":
        precompile(sys.argv[2])
        return
    if len(sys.argv) > 2 and sys.argv[1] == "--one":
        run_one(sys.argv[2])
        return
    rows = []
    for variant in VARIANTS:
        r = subprocess.run([sys.executable, __file__, "--one", variant], capture_output=True, text=True,
                           env=os.environ)
        if r.returncode != 0:
            print("FAILED", variant, r.stderr[-2000:], flush=True)
            continue
        for line in r.stdout.splitlines():
            if line.startswith("{"):
                rows.append(json.loads(line))
                print(line, flush=True)
    print("\nper shape: separate ms (two runs) | atomic ms (two runs) | atomic / separate (mins); "
          "kernel us of the first run of each")
    shapes = sorted({(r["d"], r["s"], r["causal"]) for r in rows})
    for sh in shapes:
        sep = [r for r in rows if (r["d"], r["s"], r["causal"]) == sh and r["variant"] == "separate"]
        ato = [r for r in rows if (r["d"], r["s"], r["causal"]) == sh and r["variant"] == "atomic"]
        if not sep or not ato:
            continue
        ratio = min(r["ms"] for r in ato) / min(r["ms"] for r in sep)
        ks = " ".join(f"{n}={t:.0f}" for n, t in sorted(sep[0]["kernels_us"].items()))
        ka = " ".join(f"{n}={t:.0f}" for n, t in sorted(ato[0]["kernels_us"].items()))
        print(f"d{sh[0]} s{sh[1] // 1024}k {'causal' if sh[2] else 'full  '}: "
              f"{' '.join('%.3f' % r['ms'] for r in sep)} | {' '.join('%.3f' % r['ms'] for r in ato)} | "
              f"{ratio:.3f}\n    separate: {ks}\n    atomic:   {ka}")


if __name__ == "__main__":
    main()
