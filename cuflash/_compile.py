"""Run-time compilation of kernel specializations with NVRTC, and their caches.

A specialization is a template instance of a kernel in cuda_src/, e.g.
``cuflash::flash_fwd_kernel<cuflash::bf16, 128, 128, 64, 8, true, false>``. It has a readable name,
e.g. ``fwd_bf16_d128_m128_n64_w8_causal_ragged``, used in logs, errors and cache file names.

Compilation goes through NVRTC (CuPy's bindings) straight to a cubin for the device's architecture.
Every header under cuda_src/ is handed to NVRTC in memory, so the source actually compiled is
exactly what the cache key hashed. The key covers every file under cuda_src/, the options, the
target architecture, the specialization and the cuflash version: a changed header can never load a
stale kernel (CuPy's own cache key hashes only the main source string). The NVRTC version is in the
key too.

Caches:
  * in memory: (specialization, device) -> loaded kernel function;
  * on disk: ``$CUFLASH_CACHE_DIR`` (default ``~/.cache/cuflash``), one ``.cubin`` plus a ``.json``
    (lowered name, ptxas report) per key. Files are written to a temporary name and renamed, so
    concurrent processes never read a half-written file; at worst two of them compile the same
    specialization once each.

Environment:
  * CUFLASH_CACHE_DIR: the disk cache directory.
  * CUFLASH_LINEINFO=1: compile with -lineinfo (for profilers); part of the cache key.
  * CUFLASH_DEBUG=1: compile with -G (device debug); part of the cache key.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ._version import __version__

log = logging.getLogger("cuflash")

_SRC_CANDIDATES = (
    Path(__file__).resolve().parent / "cuda_src",         # installed wheel: shipped inside the package
    Path(__file__).resolve().parent.parent / "cuda_src",  # source checkout
)


def cuda_src_dir() -> Path:
    for p in _SRC_CANDIDATES:
        if (p / "flash_fwd.cu").is_file():
            return p
    raise FileNotFoundError(
        "cuflash cannot find its CUDA sources (cuda_src/flash_fwd.cu); looked in "
        + ", ".join(str(p) for p in _SRC_CANDIDATES))


def _read_sources() -> dict[str, str]:
    d = cuda_src_dir()
    return {p.name: p.read_text() for p in sorted(d.iterdir()) if p.suffix in (".cu", ".cuh")}


_sources_lock = threading.Lock()
_sources_cache: tuple[dict[str, str], str] | None = None


def sources() -> tuple[dict[str, str], str]:
    """All of cuda_src/ (name -> text) and its fingerprint (sha256 over names and contents)."""
    global _sources_cache
    with _sources_lock:
        if _sources_cache is None:
            files = _read_sources()
            h = hashlib.sha256()
            for name, text in files.items():
                h.update(name.encode() + b"\0" + text.encode() + b"\0")
            _sources_cache = (files, h.hexdigest())
        return _sources_cache


@dataclass(frozen=True)
class Specialization:
    """One kernel template instance: which file, which template, its arguments, a readable name,
    and extra compile-time checks (C++ static_asserts) appended to the source."""
    source: str            # e.g. "flash_fwd.cu"
    expression: str        # name expression handed to NVRTC
    name: str              # readable name
    checks: str = ""       # extra C++ appended to the translation unit


@functools.lru_cache(maxsize=None)
def nvrtc_version() -> tuple[int, int]:
    from cupy_backends.cuda.libs import nvrtc

    return tuple(nvrtc.getVersion())


def base_options(target: str) -> list[str]:
    opts = ["-std=c++17", f"-arch={target}", "--ptxas-options=-v", "-DCUFLASH_NVRTC=1"]
    if nvrtc_version() >= (12, 9):
        # NVRTC 12.9+ keeps a cache of its own; on a hit it skips ptxas and returns no resource report.
        # cuflash has its own disk cache (which keeps the report), so NVRTC's is turned off.
        opts.append("--no-cache")
    if os.environ.get("CUFLASH_LINEINFO") == "1":
        opts.append("-lineinfo")
    if os.environ.get("CUFLASH_DEBUG") == "1":
        opts.append("-G")
    return opts


def cache_dir() -> Path:
    env = os.environ.get("CUFLASH_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "cuflash"


def cache_key(spec: Specialization, target: str, options: list[str]) -> str:
    _, fingerprint = sources()
    h = hashlib.sha256()
    nvrtc = ".".join(map(str, nvrtc_version()))
    for part in (__version__, nvrtc, fingerprint, target, " ".join(options), spec.source, spec.expression, spec.checks):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:24]


@dataclass
class CompiledKernel:
    spec: Specialization
    target: str
    cubin: bytes
    lowered_name: str
    ptxas_log: str
    compile_seconds: float  # 0.0 when it came from the disk cache
    cubin_path: Path | None = None


class CompileError(RuntimeError):
    pass


def nvrtc_compile(spec: Specialization, target: str, options: list[str] | None = None) -> CompiledKernel:
    """Compiles one specialization to a cubin with NVRTC. No GPU is needed."""
    from cupy_backends.cuda.libs import nvrtc

    options = base_options(target) if options is None else options
    files, _ = sources()
    headers = {n: t for n, t in files.items() if n.endswith(".cuh")}
    code = files[spec.source] + "\n" + spec.checks + "\n"
    t0 = time.perf_counter()
    prog = nvrtc.createProgram(code, spec.source, [t.encode() for t in headers.values()],
                               [n.encode() for n in headers.keys()])
    try:
        nvrtc.addNameExpression(prog, spec.expression)
        try:
            nvrtc.compileProgram(prog, options)
        except nvrtc.NVRTCError as e:
            raise CompileError(
                f"NVRTC failed to compile {spec.name} for {target}:\n{nvrtc.getProgramLog(prog)}") from e
        log_text = nvrtc.getProgramLog(prog)
        lowered = nvrtc.getLoweredName(prog, spec.expression)
        cubin = nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)
    return CompiledKernel(spec, target, bytes(cubin), lowered, log_text, time.perf_counter() - t0)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def compile_cached(spec: Specialization, target: str) -> CompiledKernel:
    """Disk cache, then NVRTC. Logs the first compile of each specialization with its time."""
    options = base_options(target)
    key = cache_key(spec, target, options)
    d = cache_dir()
    stem = f"{spec.name}-{target}-{key}"
    cubin_path, meta_path = d / f"{stem}.cubin", d / f"{stem}.json"
    if cubin_path.is_file() and meta_path.is_file():
        try:
            meta = json.loads(meta_path.read_text())
            return CompiledKernel(spec, target, cubin_path.read_bytes(), meta["lowered_name"],
                                  meta.get("ptxas_log", ""), 0.0, cubin_path)
        except (OSError, ValueError, KeyError):
            pass  # unreadable entry: rebuild it
    ck = nvrtc_compile(spec, target, options)
    log.info("cuflash: compiled %s for %s in %.2f s", spec.name, target, ck.compile_seconds)
    try:
        d.mkdir(parents=True, exist_ok=True)
        _write_atomic(cubin_path, ck.cubin)
        _write_atomic(meta_path, json.dumps({
            "name": spec.name, "expression": spec.expression, "target": target,
            "lowered_name": ck.lowered_name, "ptxas_log": ck.ptxas_log,
            "compile_seconds": ck.compile_seconds}).encode())
        ck.cubin_path = cubin_path
    except OSError as e:  # a read-only home must not stop the kernel from running
        log.warning("cuflash: could not write the kernel cache in %s: %s", d, e)
    return ck


@dataclass(frozen=True)
class LoadedKernel:
    ptr: int          # CUfunction handle, for cuLaunchKernel
    module: object    # keeps the cupy.RawModule (and so the loaded cubin) alive
    raw: object       # the cupy.RawKernel


_loaded: dict[tuple[str, str, int], LoadedKernel] = {}
_loaded_lock = threading.Lock()
_build_locks: dict[tuple[str, str], threading.Lock] = {}


def get_function(spec: Specialization, target: str, device_id: int, smem_bytes: int) -> "LoadedKernel":
    """The kernel loaded on this device, compiling (or reading the disk cache) on first use."""
    key = (spec.expression, target, device_id)
    fn = _loaded.get(key)
    if fn is not None:
        return fn
    with _loaded_lock:
        lock = _build_locks.setdefault((spec.expression, target), threading.Lock())
    with lock:
        fn = _loaded.get(key)
        if fn is not None:
            return fn
        import cupy

        ck = compile_cached(spec, target)
        with cupy.cuda.Device(device_id):
            if ck.cubin_path is not None:
                module = cupy.RawModule(path=str(ck.cubin_path))
            else:  # cache not writable: load from a private temporary file
                import tempfile

                with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
                    f.write(ck.cubin)
                module = cupy.RawModule(path=f.name)
            kernel = module.get_function(ck.lowered_name)
            if smem_bytes > 48 * 1024:
                kernel.max_dynamic_shared_size_bytes = smem_bytes
            fn = LoadedKernel(kernel.kernel.ptr, module, kernel)
        _loaded[key] = fn
        return fn


def params_layout_checks(namespace: str, struct: str, dtype: np.dtype, offsets: bool = False) -> str:
    """C++ static_asserts that pin a NumPy structured dtype to the C struct it mirrors.

    sizeof is checked in every compile. Field offsets need __builtin_offsetof, which NVRTC 13.0
    does not know (13.4 does): the compile gate checks them with the NVRTC that CI installs, and a
    GPU test checks them with a probe kernel.
    """
    lines = [f"namespace {namespace} {{",
             f'static_assert(sizeof({struct}) == {dtype.itemsize}, "{struct}: size differs from the Python mirror");']
    if offsets:
        for name in dtype.names:
            off = dtype.fields[name][1]
            lines.append(
                f'static_assert(__builtin_offsetof({struct}, {name}) == {off}, "{struct}::{name}: offset differs from the Python mirror");')
    lines.append("}")
    return "\n".join(lines)
