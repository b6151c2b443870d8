"""main's forward kernels against this tree's, in one process, interleaved (no order or process bias).

Loads .oldtree/main18's package as cuflash_main beside this tree's cuflash (CuPy arrays: no torch, so
no second torch.library namespace), then per configuration alternates ROUNDS x (main, new), each a
median of REPS CUDA-event timings of one forward call after a warm-up, and prints the median of the
per-round ratios new/main. float16 only (CuPy has no bfloat16). Env: ROUNDS (7), REPS (20)."""
import importlib.util
import os
import statistics as st
import sys

import cupy as cp


def load(name, root):
    pkg = os.path.join(root, "cuflash")
    spec = importlib.util.spec_from_file_location(name, os.path.join(pkg, "__init__.py"), submodule_search_locations=[pkg])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


old = load("cuflash_main", ".oldtree/main18")
new = load("cuflash", ".")
print("main from", old.__file__, "| new from", new.__file__)
ROUNDS, REPS = int(os.environ.get("ROUNDS", "7")), int(os.environ.get("REPS", "20"))


def gpu_ms(f):
    ts = []
    for _ in range(REPS):
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record()
        f()
        e1.record()
        e1.synchronize()
        ts.append(cp.cuda.get_elapsed_time(e0, e1))
    return st.median(ts)


rows = []
rng = cp.random.default_rng(7)
for hd in (64, 96, 128, 256):
    h = max(1, 2048 // hd)
    for s in (1024, 4096):
        b = max(1, 16384 // s)
        q, k, v = (rng.standard_normal((b, s, h, hd), dtype=cp.float32).astype(cp.float16) for _ in range(3))
        for causal in (False, True):
            fo = lambda: old.attention(q, k, v, causal=causal)
            fn = lambda: new.attention(q, k, v, causal=causal)
            for f in (fo, fn, fo, fn):
                f()
            cp.cuda.Device().synchronize()
            ratios, to, tn = [], [], []
            for _ in range(ROUNDS):
                a, c = gpu_ms(fo), gpu_ms(fn)
                to.append(a)
                tn.append(c)
                ratios.append(c / a)
            r = st.median(ratios)
            rows.append(r)
            print(f"fp16 d{hd:<3d} b{b} s{s} h{h} causal={int(causal)}: main {st.median(to):.4f} ms new {st.median(tn):.4f} ms "
                  f"new/main {r:.3f} (rounds {min(ratios):.3f}..{max(ratios):.3f})", flush=True)
        del q, k, v
kc = rng.standard_normal((8, 8192, 8, 128), dtype=cp.float32).astype(cp.float16)
vc = rng.standard_normal((8, 8192, 8, 128), dtype=cp.float32).astype(cp.float16)
qd = rng.standard_normal((8, 1, 32, 128), dtype=cp.float32).astype(cp.float16)
lens = cp.full((8,), 8192, dtype=cp.int32)
fo = lambda: old.attention_with_kvcache(qd, kc, vc, cache_seqlens=lens)
fn = lambda: new.attention_with_kvcache(qd, kc, vc, cache_seqlens=lens)
for f in (fo, fn, fo, fn):
    f()
ratios = [gpu_ms(fn) / gpu_ms(fo) for _ in range(ROUNDS)]
rows.append(st.median(ratios))
print(f"decode fp16 8x8192 h32/8 d128: new/main {rows[-1]:.3f}")
print(f"geomean new/main over {len(rows)} rows: {st.geometric_mean(rows):.4f}")
