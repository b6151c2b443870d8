#!/usr/bin/env python3
"""Launch mechanism micro-benchmark: the host cost of one kernel launch with one by-value struct
argument (as cuflash's Params) through each path Python has, and of the other per-call pieces a
launch needs (the caller's stream, an output buffer). Decides which launch path cuflash uses.

Kernel: `touch(const Blob p)`, Blob = --struct-bytes bytes (default 512, about cuflash's FwdParams
with its mask) of uint64 words; it reads one word and writes nothing. Compiled once with
cupy.RawModule(code=...) (NVRTC), 1 block of 32 threads, no shared memory, on CuPy's current
stream (the legacy default stream unless changed, as for torch). The struct's bytes live in a NumPy
buffer; argv is a NumPy uint64 array holding that buffer's address (void* kernelParams[1]).

Launch paths (each --launches launches, 20000 by default):
  a   cupy_backends.cuda.api.driver.launchKernel(fn_ptr, 1,1,1, 32,1,1, 0, stream_ptr, argv_ptr, 0),
      argv_ptr an int made once
  a+dev       the same inside `with cupy.cuda.Device(0):` per launch
  a+cuflash   what cuflash/_launch.py:launch did when this was written: np.ascontiguousarray(params),
              a fresh argv array, .ctypes.data twice, the Device context, launchKernel
  b   cuda.bindings.driver.cuLaunchKernel(CUfunction, ..., CUstream, argv_ptr, 0), handles made once
  b+int       the same with plain ints for the function and stream handles
  b+stream    a CUstream(stream_ptr) made per launch (the stream changes from call to call)
  c   cupy RawKernel __call__((1,), (32,), (blob,)) with blob a size-1 NumPy structured array (how
      CuPy documents struct arguments)
  c+scalar    the same with blob[0], a NumPy structured scalar (numpy.void)
Launches are timed in rounds of --batch (256) back-to-back launches: "host" is the time to issue a
round (a round stays well inside the driver's queue of pending launches, so no launch waits for the
GPU), "wall" adds the synchronize that drains it; if wall is far above host, the GPU (about 2 us
per empty kernel) and not the host set the pace. Figures: median over rounds, us per launch.

Other per-call pieces, each timed as 20000 back-to-back operations (median of 5 such rounds):
  streams    torch.cuda.current_stream().cuda_stream, torch.cuda.current_stream(0).cuda_stream,
             torch._C._cuda_getCurrentRawStream(0), cupy.cuda.get_current_stream().ptr,
             entering and leaving `with cupy.cuda.Device(0)`
  alloc      torch.empty of a (1, 128, 2, 64) bf16 tensor (device given as a string and as a
             torch.device), cupy.empty of the same (ml_dtypes.bfloat16, and float16)
  views      t.data_ptr(), t.stride(), tuple(t.shape) on a torch tensor, a.data.ptr on a CuPy array
  params     filling the struct: 24 field assignments on a size-1 structured array against one
             struct.pack_into of the same 24 values into a bytearray; and the NumPy calls a launch
             makes if it does not keep its argv: arr.ctypes.data, a fresh argv array,
             np.ascontiguousarray
Rows whose library does not import are skipped; an error in one row is printed and the rest run.

Output: one line per row (path, host us, wall us or us/op, a note), then the launch paths again
ranked by host us, last. --json keeps every figure.

Usage:
    python bench/dev/launch_cost.py [--struct-bytes 512] [--launches 20000] [--batch 256] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import struct
import sys
import time
import timeit

KERNEL = r"""
struct Blob { unsigned long long w[NWORDS]; };

// Reads one word so the argument is used; the sentinel never matches, so nothing is written.
extern "C" __global__ void touch(const Blob p) {
    if (p.w[0] == 0x5eedf00dull && threadIdx.x == 0) {
        *reinterpret_cast<unsigned long long*>(p.w[1]) = p.w[2];
    }
}
"""


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--struct-bytes", type=int, default=512, help="size of the by-value struct (multiple of 8)")
    p.add_argument("--launches", type=int, default=20000, help="launches per path (default 20000)")
    p.add_argument("--batch", type=int, default=256, help="launches per timed round (default 256)")
    p.add_argument("--ops", type=int, default=20000, help="operations per round for the other pieces")
    p.add_argument("--json", metavar="PATH", help="write every figure here")
    args = p.parse_args(argv)
    if args.struct_bytes < 8 or args.struct_bytes % 8 or args.struct_bytes > 4096:
        p.error("--struct-bytes must be a multiple of 8 from 8 to 4096 (the classic kernel-argument limit)")
    return args


def _err(e) -> str:
    msg = str(e).strip()
    return f"{type(e).__name__}: {msg.splitlines()[0][:200] if msg else ''}"


def _device_name(cupy) -> str:
    name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def time_launches(stmt, ns, sync, args):
    """{host_us, wall_us, rounds}: per launch, median over rounds of --batch launches."""
    t = timeit.Timer(stmt, globals=ns)
    t.timeit(64)       # first launches: lazy module and context work stays out
    sync()
    host, wall = [], []
    for _ in range(max(1, args.launches // args.batch)):
        sync()
        t0 = time.perf_counter()
        issue = t.timeit(args.batch)
        sync()
        wall.append((time.perf_counter() - t0) / args.batch * 1e6)
        host.append(issue / args.batch * 1e6)
    return {"host_us": statistics.median(host), "host_min_us": min(host), "wall_us": statistics.median(wall),
            "rounds": len(host)}


def time_ops(stmt, ns, args, rounds=5):
    t = timeit.Timer(stmt, globals=ns)
    t.timeit(100)
    per = [t.timeit(args.ops) / args.ops * 1e6 for _ in range(rounds)]
    return {"us": statistics.median(per), "min_us": min(per)}


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        import numpy as np
        import cupy
        from cupy_backends.cuda.api import driver as cupy_driver

        if cupy.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError("no CUDA device")
    except Exception as e:
        print(f"launch_cost.py: needs CuPy and a CUDA device ({_err(e)})", file=sys.stderr)
        return 2

    results = {"launch": {}, "streams": {}, "alloc": {}, "views": {}, "params": {}}
    dev = cupy.cuda.Device(0)
    dev.use()
    nwords = args.struct_bytes // 8
    t0 = time.perf_counter()
    module = cupy.RawModule(code=KERNEL, options=("-std=c++17", f"-DNWORDS={nwords}"))
    kern = module.get_function("touch")
    fn_ptr = kern.kernel.ptr
    compile_s = time.perf_counter() - t0
    blob_dtype = np.dtype([("w", np.uint64, (nwords,))])
    blob = np.zeros(1, dtype=blob_dtype)
    argv_arr = np.array([blob.ctypes.data], dtype=np.uint64)
    argv_ptr = int(argv_arr.ctypes.data)
    stream_ptr = cupy.cuda.get_current_stream().ptr
    sync = cupy.cuda.runtime.deviceSynchronize

    def launch_cuflash_style(params):
        arg = np.ascontiguousarray(params)
        argv = np.array([arg.ctypes.data], dtype=np.uint64)
        with cupy.cuda.Device(0):
            cupy_driver.launchKernel(fn_ptr, 1, 1, 1, 32, 1, 1, 0, stream_ptr, argv.ctypes.data, 0)

    ns = {"launch": cupy_driver.launchKernel, "fp": fn_ptr, "sp": stream_ptr, "ap": argv_ptr, "cupy": cupy,
          "blob": blob, "scalar": blob[0], "kern": kern, "lcf": launch_cuflash_style}
    paths = [
        ("a", "launch(fp, 1, 1, 1, 32, 1, 1, 0, sp, ap, 0)",
         "cupy_backends driver.launchKernel, argv pointer made once"),
        ("a+dev", "with cupy.cuda.Device(0):\n    launch(fp, 1, 1, 1, 32, 1, 1, 0, sp, ap, 0)",
         "the same inside `with cupy.cuda.Device(0)`"),
        ("a+cuflash", "lcf(blob)", "ascontiguousarray + fresh argv + Device context + launchKernel"),
    ]
    try:
        from cuda.bindings import driver as cb

        ns.update(cu_launch=cb.cuLaunchKernel, cuf=cb.CUfunction(fn_ptr), cus=cb.CUstream(stream_ptr),
                  CUstream=cb.CUstream)
        err = cb.cuLaunchKernel(ns["cuf"], 1, 1, 1, 32, 1, 1, 0, ns["cus"], argv_ptr, 0)[0]
        if err != cb.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuLaunchKernel returned {err}")
        paths += [
            ("b", "cu_launch(cuf, 1, 1, 1, 32, 1, 1, 0, cus, ap, 0)", "cuda.bindings cuLaunchKernel, handles made once"),
            ("b+int", "cu_launch(fp, 1, 1, 1, 32, 1, 1, 0, sp, ap, 0)", "the same with int handles"),
            ("b+stream", "cu_launch(cuf, 1, 1, 1, 32, 1, 1, 0, CUstream(sp), ap, 0)", "a CUstream made per launch"),
        ]
    except Exception as e:
        results["launch"]["b"] = {"error": f"cuda.bindings: {_err(e)}"}
    paths += [
        ("c", "kern((1,), (32,), (blob,))", "cupy RawKernel __call__, size-1 structured array"),
        ("c+scalar", "kern((1,), (32,), (scalar,))", "cupy RawKernel __call__, structured scalar (numpy.void)"),
    ]

    print(f"launch_cost.py: {_device_name(cupy)}, cupy {cupy.__version__}, "
          f"struct {args.struct_bytes} B, kernel compiled in {compile_s:.2f} s; {args.launches} launches per path "
          f"in rounds of {args.batch}")
    print(f"{'launch path':<12}{'host us':>9}{'min':>7}{'wall us':>9}  what")
    for key, stmt, what in paths:
        try:
            r = time_launches(stmt, ns, sync, args)
            r["what"] = what
            results["launch"][key] = r
            print(f"{key:<12}{r['host_us']:>9.2f}{r['host_min_us']:>7.2f}{r['wall_us']:>9.2f}  {what}", flush=True)
        except Exception as e:
            results["launch"][key] = {"error": _err(e), "what": what}
            print(f"{key:<12}{'ERR':>9}{'':>7}{'':>9}  {what}: {_err(e)}", flush=True)
        sync()
    if "error" in results["launch"].get("b", {}):
        print(f"{'b':<12}{'-':>9}{'':>7}{'':>9}  {results['launch']['b']['error']}")

    def section(name, items, extra_ns):
        print(f"\n{name:<44}{'us/op':>8}{'min':>8}")
        for key, stmt in items:
            try:
                r = time_ops(stmt, dict(ns, **extra_ns), args)
                results[name][key] = r
                print(f"{key:<44}{r['us']:>8.3f}{r['min_us']:>8.3f}", flush=True)
            except Exception as e:
                results[name][key] = {"error": _err(e)}
                print(f"{key:<44}{'ERR':>8}  {_err(e)}", flush=True)

    torch_ns, torch_ok = {}, False
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.init()
            tt = torch.empty((1, 128, 2, 64), dtype=torch.bfloat16, device="cuda")
            torch_ns = {"torch": torch, "getraw": torch._C._cuda_getCurrentRawStream, "tt": tt,
                        "bf16": torch.bfloat16, "cuda0": torch.device("cuda", 0)}
            torch_ok = True
        else:
            print("\n(torch sees no CUDA device: torch rows skipped)")
    except Exception as e:
        print(f"\n(torch rows skipped: {_err(e)})")
    ca = cupy.empty((1, 128, 2, 64), dtype=np.float16)
    cns = {"np": np, "ca": ca}
    try:
        import ml_dtypes

        cns["bf16_np"] = ml_dtypes.bfloat16
    except ImportError:   # the bf16 CuPy row then errors (a NameError in its statement); float16 still runs
        pass

    streams = [("cupy.cuda.get_current_stream().ptr", "cupy.cuda.get_current_stream().ptr"),
               ("with cupy.cuda.Device(0): pass", "with cupy.cuda.Device(0):\n    pass")]
    if torch_ok:
        streams = [("torch.cuda.current_stream().cuda_stream", "torch.cuda.current_stream().cuda_stream"),
                   ("torch.cuda.current_stream(0).cuda_stream", "torch.cuda.current_stream(0).cuda_stream"),
                   ("torch._C._cuda_getCurrentRawStream(0)", "getraw(0)")] + streams
    section("streams", streams, dict(torch_ns, **cns))

    alloc = [("cupy.empty(shape, ml_dtypes.bfloat16)", "cupy.empty((1, 128, 2, 64), dtype=bf16_np)"),
             ("cupy.empty(shape, float16)", "cupy.empty((1, 128, 2, 64), dtype=np.float16)")]
    if torch_ok:
        alloc = [("torch.empty(shape, bf16, device='cuda')", "torch.empty((1, 128, 2, 64), dtype=bf16, device='cuda')"),
                 ("torch.empty(shape, bf16, device=torch.device)",
                  "torch.empty((1, 128, 2, 64), dtype=bf16, device=cuda0)")] + alloc
    section("alloc", alloc, dict(torch_ns, **cns))

    views = [("cupy a.data.ptr", "ca.data.ptr"), ("cupy a.strides", "ca.strides")]
    if torch_ok:
        views = [("torch t.data_ptr()", "tt.data_ptr()"), ("torch t.stride()", "tt.stride()"),
                 ("torch tuple(t.shape)", "tuple(tt.shape)")] + views
    section("views", views, dict(torch_ns, **cns))

    # 24 fields as in a forward Params: 5 pointers, 12 strides, 7 ints
    fields = [(f"p{i}", np.uint64) for i in range(5)] + [(f"s{i}", np.int64) for i in range(12)] + \
             [(f"i{i}", np.int32) for i in range(7)]
    pdt = np.dtype(fields, align=True)
    parr = np.zeros(1, dtype=pdt)
    vals = [1 << 40] * 5 + [4096] * 12 + [128] * 7
    fmt = "<5Q12q7i"
    assign = "\n".join(f"parr['{n}'] = {v}" for (n, _), v in zip(fields, vals))
    section("params", [("24 structured-array field assignments", assign),
                       ("struct.pack_into of 24 values", "pack_into(fmt, buf, 0, *vals)"),
                       ("arr.ctypes.data (an address, asked per call)", "parr.ctypes.data"),
                       ("np.array([addr], uint64) (a fresh argv)", "np.array([ap], dtype=np.uint64)"),
                       ("np.ascontiguousarray(params)", "np.ascontiguousarray(parr)")],
            {"parr": parr, "pack_into": struct.pack_into, "fmt": fmt, "buf": bytearray(pdt.itemsize),
             "vals": vals, "np": np})

    ok = [(k, r) for k, r in results["launch"].items() if "host_us" in r]
    print("\n=== launch paths by host us per launch (median over rounds) ===")
    for k, r in sorted(ok, key=lambda x: x[1]["host_us"]):
        print(f"  {k:<12}{r['host_us']:>8.2f} us  {r['what']}")
    for k, r in results["launch"].items():
        if "error" in r:
            print(f"  {k:<12}{'ERR':>8}     {r['error']}")
    if args.json:
        meta = {"python": platform.python_version(), "numpy": np.__version__, "cupy": cupy.__version__,
                "torch": torch_ns["torch"].__version__ if torch_ok else None,
                "device": _device_name(cupy),
                "struct_bytes": args.struct_bytes, "launches": args.launches, "batch": args.batch, "ops": args.ops}
        try:
            import cuda.bindings

            meta["cuda_bindings"] = cuda.bindings.__version__
        except Exception:
            meta["cuda_bindings"] = None
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
