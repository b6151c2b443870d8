"""Tile sweep of the mma.sync backward below head_dim 32 (the dK/dV kernel's and the dQ kernel's tiles;
_config.bwd_config and bwd_dq_config, which were measured at head_dim 64 and serve every head_dim up to
it; session 35 ran it with 64x128x8 in the dK/dV table, which now takes 64x64x4 there on sm90).
Each candidate replaces one of the two tables (the other keeps its entry) for head_dims 8, 16, 24; "default"
is the table as it stands.

  python bench/dev/bwd_small_tiles.py --precompile sm_90a     # here, no GPU: build every candidate
  python bench/dev/bwd_small_tiles.py                          # on the GPU: one process per candidate

GPU time of attention_backward (CUDA events around each call, 5 warm-up calls, median of 25) at
bf16, batch x seqlen = 16k tokens (seqlen 1k and 4k), heads = 2048 // head_dim, causal off and on;
fresh random inputs per shape. Prints one line per (candidate, shape) and a table of each candidate's
time over the default's, last."""
import json
import os
import subprocess
import sys

HEAD_DIMS = (8, 16, 24)
SEQLENS = (1024, 4096)
CANDIDATES = [("default",), ("dkdv", 128, 128, 8), ("dkdv", 64, 64, 4), ("dkdv", 128, 64, 8),
              ("dkdv", 32, 128, 8), ("dkdv", 32, 64, 4), ("dq", 64, 128, 4), ("dq", 128, 64, 8),
              ("dq", 128, 128, 8), ("dq", 64, 32, 4), ("dq", 32, 64, 2), ("default",)]


def patch(cand):
    """Replaces the table entry below head_dim 32 that `cand` names."""
    from cuflash import _config

    if cand[0] == "default":
        return
    kind, m, n, w = cand
    cfg = _config.TileConfig(m, n, w)
    table = "bwd_config" if kind == "dkdv" else "bwd_dq_config"
    orig = getattr(_config, table)

    def patched(family, head_dim, dtype, **kw):
        return cfg if head_dim < 32 else orig(family, head_dim, dtype, **kw)

    setattr(_config, table, patched)


def precompile(target):
    import cuflash
    from cuflash import _compile, _launch

    cuflash.precompile(head_dims=list(HEAD_DIMS), dtypes=["bfloat16"], causal=[False, True], backward=True,
                       target=target)
    n = 0
    for cand in CANDIDATES:
        import importlib

        from cuflash import _config
        importlib.reload(_config)
        patch(cand)
        for d in HEAD_DIMS:
            for causal in (False, True):
                for spec, _, _ in _launch.bwd_specializations("bfloat16", d, target, causal, True, True, False):
                    ck = _compile.compile_cached(spec, target)
                    regs = [ln.strip() for ln in ck.ptxas_log.splitlines() if "registers" in ln or "spill" in ln]
                    print(cand, d, causal, spec.name, regs[-1:] if ck.compile_seconds else "(cached)", flush=True)
                    n += 1
    print(n, "specializations")


def run_one(cand):
    import torch

    patch(cand)
    import cuflash

    out = []
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
                out.append({"cand": list(cand), "d": d, "s": s, "causal": causal, "ms": ts[len(ts) // 2]})
                print(json.dumps(out[-1]), flush=True)
                del q, k, v, dout, o, lse
    return out


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--precompile":
        precompile(sys.argv[2])
        return
    if len(sys.argv) > 2 and sys.argv[1] == "--one":
        run_one(tuple(json.loads(sys.argv[2])))
        return
    rows = []
    for cand in CANDIDATES:
        r = subprocess.run([sys.executable, __file__, "--one", json.dumps(list(cand))], capture_output=True,
                           text=True, env=os.environ)
        if r.returncode != 0:
            print("FAILED", cand, r.stderr[-2000:], flush=True)
            continue
        for line in r.stdout.splitlines():
            if line.startswith("{"):
                rows.append(json.loads(line))
                print(line, flush=True)
    base = {}
    for r in rows:
        if r["cand"] == ["default"]:
            base.setdefault((r["d"], r["s"], r["causal"]), []).append(r["ms"])
    print("\ncandidate / default (min of the default's runs); columns d{head_dim} s{seqlen} c{causal}")
    keys = sorted(base)
    print(f"{'candidate':22s} " + " ".join(f"d{d}s{s // 1024}k{'c' if c else 'f'}" for d, s, c in keys))
    print(f"{'default ms':22s} " + " ".join(f"{min(base[k]):8.3f}" for k in keys))
    seen = []
    for r in rows:
        if r["cand"] not in seen:
            seen.append(r["cand"])
    for cand in seen:
        vals = {(r["d"], r["s"], r["causal"]): r["ms"] for r in rows if r["cand"] == cand}
        print(f"{'/'.join(map(str, cand)):22s} " + " ".join(
            f"{vals[k] / min(base[k]):8.3f}" if k in vals else "     n/a" for k in keys))


if __name__ == "__main__":
    main()
