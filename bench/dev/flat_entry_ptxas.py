#!/usr/bin/env python3
"""Feasibility check for the JAX-under-jit route (docs/jax_jit_route.md): jaxlib's Triton custom call
passes kernel arguments one by one, so each kernel needs an extern "C" entry with a flat argument
list. This script rewrites, in memory, each kernel of the dispatch table into a __device__ body
called by two entries: the current one (`const __grid_constant__ Params p`) and a flat one
(`cuflash_flat`: every Params field as its own argument, pointers as 64-bit integers, plus the two
trailing void* jaxlib appends), which fills a local Params and calls the body. Both are compiled
with NVRTC in one program and ptxas's report is printed per entry: registers, stack, spills.
No GPU needed; nothing in cuda_src/ is changed.

    PYTHONPATH=. python bench/dev/flat_entry_ptxas.py
"""
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import numpy as np
from cupy_backends.cuda.libs import nvrtc
from cuflash import _compile, _launch, _config

CT = {np.dtype(np.uint64): "unsigned long long", np.dtype(np.int64): "long long", np.dtype(np.int32): "int",
      np.dtype(np.float32): "float"}

def fields(dt, prefix=""):
    for name in dt.names:
        sub = dt.fields[name][0]
        if sub.names:
            yield from fields(sub, prefix + name + ".")
        else:
            yield prefix + name, sub

def wrapper(struct, dt, body_call, threads, entry):
    params, assigns = [], []
    for path, t in fields(dt):
        arg = "a_" + path.replace(".", "_")
        params.append(f"{CT[t]} {arg}")
        if t == np.dtype(np.uint64):
            assigns.append(f"    p.{path} = reinterpret_cast<decltype(p.{path})>({arg});")
        else:
            assigns.append(f"    p.{path} = {arg};")
    params += ["void* scratch_unused", "void* profile_unused"]
    return (f'extern "C" __global__ void __launch_bounds__({threads}, 1)\n{entry}({", ".join(params)}) {{\n'
            f"    cuflash::{struct} p;\n" + "\n".join(assigns) + f"\n    {body_call}(p);\n}}\n")

def split(src, kernel, body):
    # "__global__ void __launch_bounds__(X, 1)\n<kernel>(const __grid_constant__ FwdParams p) {"
    pat = re.compile(r"__global__ void __launch_bounds__\(([^\n]*)\)\n" + kernel + r"\(const __grid_constant__ (\w+) p\) \{")
    m = pat.search(src)
    assert m, kernel
    bounds, struct = m.group(1), m.group(2)
    tmpl = src[:m.start()].rsplit("template <", 1)[1]
    tmpl = "template <" + tmpl  # the template header of the kernel
    params = re.findall(r"(?:typename|int|bool) (\w+)", tmpl)
    src = src[:m.start()] + f"__device__ __forceinline__ void {body}(const {struct}& p) {{" + src[m.end():]
    entry = (f"\n{tmpl.strip()}\n__global__ void __launch_bounds__({bounds})\n{kernel}(const __grid_constant__ {struct} p) "
             f"{{ {body}<{', '.join(params)}>(p); }}\n")
    i = src.rfind("}  // namespace cuflash")
    return src[:i] + entry + src[i:], struct, bounds, params

def compile_both(spec, target):
    files, _ = _compile.sources()
    headers = {n: t for n, t in files.items() if n.endswith(".cuh")}
    src = files[spec.source]
    kernel = spec.expression.split("<")[0].split("::")[1]
    src, struct, bounds, names = split(src, kernel, kernel.replace("_kernel", "_body"))
    args = [a.strip() for a in spec.expression.split("<", 1)[1].rstrip(">").split(",")]
    env = {n: (int(a) if a.lstrip("-").isdigit() else a) for n, a in zip(names, args)}
    threads = int(eval(bounds.split(",")[0].replace("/", "//"), {}, env))
    body_call = "cuflash::" + spec.expression.replace("_kernel", "_body").split("::", 1)[1]
    dt = _launch.FWD_PARAMS if struct == "FwdParams" else _launch.BWD_PARAMS
    code = "" + src + "\n" + wrapper(struct, dt, body_call, threads, "cuflash_flat") + spec.checks
    prog = nvrtc.createProgram(code, spec.source, [t.encode() for t in headers.values()], [n.encode() for n in headers])
    nvrtc.addNameExpression(prog, spec.expression)
    try:
        nvrtc.compileProgram(prog, _compile.base_options(target))
    except Exception:
        print(nvrtc.getProgramLog(prog)[:3000]); raise
    log = nvrtc.getProgramLog(prog)
    lowered = nvrtc.getLoweredName(prog, spec.expression)
    nvrtc.destroyProgram(prog)
    out = {}
    cur = None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line)
        if m: cur = m.group(1)
        if cur and ("Used" in line or "spill" in line or "stack" in line):
            out.setdefault(cur, []).append(line.split("info    :")[-1].strip())
    return {("struct" if k == lowered else "flat" if k == "cuflash_flat" else k): v for k, v in out.items()}

def report(spec, target):
    r = compile_both(spec, target)
    print(target, spec.name)
    for k, v in r.items():
        print("   ", k.ljust(6), " | ".join(x.replace("ptxas         .     ", "") for x in v))


for target in ("sm_90a", "sm_80"):
    for d in (64, 128, 256):
        for feat in (False, True):
            cfg = _config.fwd_config_for_target(target, d, "bfloat16")
            report(_launch.fwd_specialization("bfloat16", d, cfg, False, not feat, feat)[0], target)
    for d in (64, 128):
        for feat in (False, True):
            for atomic in _launch.bwd_atomic_choices(target, d):
                if feat and atomic and not _config.bwd_config_for_target(target, d, "bfloat16").wgmma:
                    continue
                for spec, _, _ in _launch.bwd_specializations("bfloat16", d, target, False, not feat, not feat,
                                                               atomic, feat=feat):
                    report(spec, target)
