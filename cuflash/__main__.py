"""`python -m cuflash`: the self-check a new user runs first; `python -m cuflash cache`: the kernel cache.

`python -m cuflash`: with a GPU, compiles the kernels for a few shapes, checks them against a
float64 reference and prints shape, max error, time, TFLOP/s and (if torch is installed) torch
SDPA's time. Without one: says so, and checks the NumPy path the same way on small shapes.

`python -m cuflash cache`: the disk cache's directory, its entries (per target) and their size.
`python -m cuflash cache --clear`: deletes cuflash's own files from it (entries, leftover
temporaries, lock files); nothing else in the directory is touched.
"""

from __future__ import annotations

import sys
import time

import numpy as np

import cuflash
from cuflash._reference import attention_reference


def _gpu_available() -> str | None:
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() > 0:
            name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
            return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:
        return None
    return None


def _flops(b, sq, sk, h, d, causal):
    return 4 * b * h * sq * sk * d / (2 if causal else 1)


def _row(cells, widths):
    return "  ".join(str(c).rjust(w) for c, w in zip(cells, widths))


HEAD = ("dtype", "shape (b, sq, sk, h, d)", "causal", "max err", "naive err", "ms", "TFLOP/s", "SDPA ms")
WIDTHS = (8, 26, 6, 9, 9, 8, 8, 8)


def _check_gpu() -> bool:
    import cupy
    import ml_dtypes

    try:
        import torch
        from torch.nn.functional import scaled_dot_product_attention as sdpa
    except ImportError:
        torch = None
    shapes = [(2, 1024, 1024, 16, 64, False), (2, 1024, 1024, 16, 128, True),
              (1, 333, 1000, 8, 40, True), (4, 4096, 4096, 16, 128, False)]
    print(_row(HEAD, WIDTHS))
    ok = True
    for dtype in ("bfloat16", "float16"):
        npdt = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16
        for b, sq, sk, h, d, causal in shapes:
            big = sq * sk * b * h > 2**26
            q = cupy.random.standard_normal((b, sq, h, d), dtype=np.float32).astype(npdt)
            k = cupy.random.standard_normal((b, sk, h, d), dtype=np.float32).astype(npdt)
            v = cupy.random.standard_normal((b, sk, h, d), dtype=np.float32).astype(npdt)
            out = cuflash.attention(q, k, v, causal=causal)  # compiles on first use
            err = naive_err = float("nan")
            if not big:  # the float64 reference on the CPU is too slow for the largest shape
                qn, kn, vn, on = (cupy.asnumpy(x) for x in (q, k, v, out))
                ref, _ = attention_reference(qn, kn, vn, causal)
                naive, _ = attention_reference(qn, kn, vn, causal, compute_dtype="input")
                err = float(np.abs(on.astype(np.float64) - ref).max())
                naive_err = float(np.abs(naive.astype(np.float64) - ref).max())
                ok &= bool(np.isfinite(on.astype(np.float32)).all()) and err <= 2 * naive_err + 1e-5
            ms = _time(lambda: cuflash.attention(q, k, v, causal=causal))
            sdpa_ms = ""
            if torch is not None:
                tq, tk, tv = (torch.from_dlpack(x).transpose(1, 2) for x in (q, k, v))
                sdpa_ms = f"{_time(lambda: sdpa(tq, tk, tv, is_causal=causal)):.3f}"
            tflops = _flops(b, sq, sk, h, d, causal) / ms / 1e9
            print(_row((dtype, (b, sq, sk, h, d), causal, f"{err:.2e}", f"{naive_err:.2e}", f"{ms:.3f}",
                        f"{tflops:.1f}", sdpa_ms), WIDTHS), flush=True)
    return ok


def _time(fn, reps=20) -> float:
    import cupy

    fn()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end))
    return float(np.median(times))


def _check_cpu() -> bool:
    import ml_dtypes

    rng = np.random.default_rng()
    shapes = [(1, 128, 128, 4, 64, False), (1, 77, 200, 4, 40, True), (2, 64, 64, 2, 128, True)]
    print(_row(HEAD[:-1], WIDTHS[:-1]))
    ok = True
    for dtype, npdt in (("bfloat16", ml_dtypes.bfloat16), ("float16", np.float16)):
        for b, sq, sk, h, d, causal in shapes:
            q = rng.standard_normal((b, sq, h, d)).astype(npdt)
            k = rng.standard_normal((b, sk, h, d)).astype(npdt)
            v = rng.standard_normal((b, sk, h, d)).astype(npdt)
            t0 = time.perf_counter()
            out = cuflash.attention(q, k, v, causal=causal)
            ms = (time.perf_counter() - t0) * 1e3
            ref, _ = attention_reference(q, k, v, causal)
            naive, _ = attention_reference(q, k, v, causal, compute_dtype="input")
            err = float(np.abs(out.astype(np.float64) - ref).max())
            naive_err = float(np.abs(naive.astype(np.float64) - ref).max())
            ok &= err <= 2 * naive_err + 1e-5
            tflops = _flops(b, sq, sk, h, d, causal) / ms / 1e9
            print(_row((dtype, (b, sq, sk, h, d), causal, f"{err:.2e}", f"{naive_err:.2e}", f"{ms:.1f}",
                        f"{tflops:.4f}"), WIDTHS[:-1]))
    return ok


def _self_check() -> int:
    print(f"cuflash {cuflash.__version__}")
    gpu = _gpu_available()
    if gpu:
        print(f"GPU: {gpu}. Checking the CUDA kernels against a float64 reference "
              "(the first call of each shape compiles its kernel).")
        ok = _check_gpu()
    else:
        print("No CUDA GPU found (or CuPy / NVRTC not installed): checking the NumPy path instead.")
        ok = _check_cpu()
    print("max err must be <= 2 x naive err (the same attention computed naively in the input dtype) + 1e-5")
    print("self-check:", "PASSED" if ok else "FAILED")
    return 0 if ok else 1


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n:,} bytes ({n / scale:.1f} {unit})"
    return f"{n:,} bytes"


def _cache_command(clear: bool) -> int:
    import os

    from cuflash import _compile

    d = _compile.cache_dir()
    where = ("from CUFLASH_CACHE_DIR" if os.environ.get("CUFLASH_CACHE_DIR")
             else "the default; CUFLASH_CACHE_DIR moves it")
    print(f"cuflash kernel cache: {d}  ({where})")
    st = _compile.cache_stats(d)
    if st.problem is not None:
        print(f"  {st.problem}" + ("; nothing to clear" if clear and not d.exists() else ""))
        return 0 if not d.exists() else 1
    if clear:
        removed, freed, errors = _compile.clear_cache(d)
        print(f"  removed {removed} files, {_size(freed)}")
        for e in errors:
            print(f"  could not remove {e}")
        return 1 if errors else 0
    targets = ", ".join(f"{t}: {n}" for t, n in sorted(st.by_target.items()))
    print(f"  {st.entries} kernels (a .cubin and its .json each), {_size(st.entry_bytes)}"
          + (f"; by target: {targets}" if targets else ""))
    if st.partial:
        print(f"  {st.partial} incomplete entries or temporary files, {_size(st.partial_bytes)}")
    print("  safe to delete at any time (a kernel is recompiled on its next use): python -m cuflash cache --clear")
    return 0


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m cuflash", usage="python -m cuflash [-h] [cache [--clear]]",
        description="Without a command: the self-check (the kernels against a float64 reference).")
    sub = parser.add_subparsers(dest="command", metavar="{cache}")
    cache = sub.add_parser("cache", help="show the kernel cache: directory, entries, size",
                           description="Show the disk cache of compiled kernels ($CUFLASH_CACHE_DIR, default "
                                       "~/.cache/cuflash): its directory, entries and size.")
    cache.add_argument("--clear", action="store_true",
                       help="delete cuflash's files from it (nothing else in the directory is touched)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.command == "cache":
        return _cache_command(args.clear)
    return _self_check()


if __name__ == "__main__":
    sys.exit(main())
