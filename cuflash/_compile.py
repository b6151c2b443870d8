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
    per key (the full key, the cubin's sha256, the lowered name, the ptxas report). An entry is used
    only if its metadata names this key and the cubin matches its digest; a bad entry (truncated,
    overwritten, refused by the driver) is a miss, rebuilt with one warning per process. Files are
    written to a temporary name and renamed, and the processes that build one entry take turns on
    its lock file, so none ever reads a half-written entry or compiles what another just built. A
    cache that cannot be written (read-only, full, not a directory) costs a warning, not the call.
    ``python -m cuflash cache [--clear]`` shows or empties it.

Environment:
  * CUFLASH_CACHE_DIR: the disk cache directory.
  * CUFLASH_LINEINFO=1: compile with -lineinfo (for profilers); part of the cache key.
  * CUFLASH_DEBUG=1: compile with -G (device debug); part of the cache key.
  * CUFLASH_DECODE_TIMELINE=1: compile the decode kernel's timeline probe in (cuda_src/flash_decode.cu,
    read by bench/dev/decode_timeline.py); part of the cache key. For measurements only.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import re
import threading
import time
from dataclasses import dataclass, field
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
    if os.environ.get("CUFLASH_DECODE_TIMELINE") == "1":
        opts.append("-DCUFLASH_DECODE_TIMELINE=1")
    return opts


def cache_dir() -> Path:
    env = os.environ.get("CUFLASH_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "cuflash"


def _key_digest(spec: Specialization, target: str, options: list[str]) -> str:
    """sha256 (64 hex digits) over everything that decides the cubin. File names carry its first 24
    digits; the metadata records all of it."""
    _, fingerprint = sources()
    h = hashlib.sha256()
    nvrtc = ".".join(map(str, nvrtc_version()))
    for part in (__version__, nvrtc, fingerprint, target, " ".join(options), spec.source, spec.expression, spec.checks):
        h.update(part.encode() + b"\0")
    return h.hexdigest()


def cache_key(spec: Specialization, target: str, options: list[str]) -> str:
    return _key_digest(spec, target, options)[:24]


@dataclass
class CompiledKernel:
    spec: Specialization
    target: str
    cubin: bytes
    lowered_name: str
    ptxas_log: str
    compile_seconds: float  # 0.0 when it came from the disk cache
    cubin_path: Path | None = None
    from_disk: bool = False


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


# ------------------------------------------------------------------------------------------------
# The disk cache. An entry is three files named after the specialization, the target and the key:
#   <stem>.cubin    the kernel;
#   <stem>.json     its metadata: the full key, the cubin's sha256 and size, the lowered name, the
#                   ptxas report; written after the cubin, so it is the commit point of the entry;
#   .<stem>.lock    empty; its flock serializes the processes that build this entry.
# Writes go to a temporary file (.<name>.<pid>.<thread>.tmp) renamed over the target.
#
# An entry is used only if its metadata parses, names this key, and the cubin's digest matches.
# Anything else (a truncated or overwritten cubin, garbage metadata, a cubin the driver refuses)
# is a miss: the first one in a process is a warning on the `cuflash` logger, the entry is
# rebuilt and rewritten. A cubin without its metadata is a write that was cut short: a plain miss.
#
# Why the lock: NVRTC's cubins are not byte-for-byte reproducible (internal symbols carry a hash
# that changes from one compile to the next), so two processes building one entry at once would
# otherwise be able to leave one's cubin beside the other's metadata, a mismatch that the next
# reader would take for damage. Under the lock a builder first re-reads the entry: the processes
# that waited find it built and compile nothing.
# ------------------------------------------------------------------------------------------------

_META_FORMAT = 2
_LOCK_WAIT_S = 120.0  # a build never takes this long; past it, build unlocked rather than hang

_warned: set[str] = set()


def _warn_once(kind: str, msg: str, *args) -> None:
    """The first problem of each kind in a process is a warning; later ones are logged at INFO (a
    cache full of bad files must not flood the caller's log)."""
    if kind in _warned:
        log.info(msg, *args)
    else:
        _warned.add(kind)
        log.warning(msg + " (further ones in this process are logged at INFO)", *args)


@dataclass(frozen=True)
class _Entry:
    """Where one specialization lives in the disk cache, and the key its metadata must name."""
    spec: Specialization
    target: str
    options: tuple[str, ...]
    key: str      # the full sha256
    cubin: Path
    meta: Path
    lock: Path


def _entry(spec: Specialization, target: str) -> _Entry:
    options = base_options(target)
    key = _key_digest(spec, target, options)
    d = cache_dir()
    stem = f"{spec.name}-{target}-{key[:24]}"
    return _Entry(spec, target, tuple(options), key, d / f"{stem}.cubin", d / f"{stem}.json", d / f".{stem}.lock")


def _read_entry(e: _Entry) -> tuple[CompiledKernel | None, str | None, Path | None]:
    """(kernel, None, None) for a good entry; (None, None, None) when there is none; (None, reason,
    bad file) for one that must not be used."""
    try:
        raw = e.meta.read_bytes()
    except (FileNotFoundError, NotADirectoryError):
        return None, None, None  # no entry (or only its .cubin: a write cut short before the metadata)
    except OSError as err:
        return None, f"cannot read it ({err})", e.meta
    try:
        meta = json.loads(raw)
    except (ValueError, RecursionError) as err:  # UnicodeDecodeError is a ValueError
        return None, f"the metadata is not valid JSON ({type(err).__name__}: {str(err)[:80]})", e.meta
    if not isinstance(meta, dict):
        return None, f"the metadata is a JSON {type(meta).__name__}, not an object", e.meta
    if meta.get("format") != _META_FORMAT:
        return None, (f"metadata format {meta.get('format')!r}, expected {_META_FORMAT} (written by another "
                      "cuflash version?)"), e.meta
    if meta.get("key") != e.key:
        return None, f"the metadata was written for another key ({str(meta.get('key'))[:24]}...)", e.meta
    lowered = meta.get("lowered_name")
    if not isinstance(lowered, str) or not lowered:
        return None, "the metadata has no lowered kernel name", e.meta
    try:
        cubin = e.cubin.read_bytes()
    except (FileNotFoundError, NotADirectoryError):
        return None, "its .cubin is missing", e.cubin
    except OSError as err:
        return None, f"cannot read it ({err})", e.cubin
    if hashlib.sha256(cubin).hexdigest() != meta.get("cubin_sha256"):
        return None, (f"the cubin ({len(cubin)} bytes) does not match the sha256 digest in its metadata "
                      f"({meta.get('cubin_bytes')} bytes)"), e.cubin
    ptxas_log = meta.get("ptxas_log", "")
    return (CompiledKernel(e.spec, e.target, cubin, lowered, ptxas_log if isinstance(ptxas_log, str) else "", 0.0,
                           e.cubin, from_disk=True), None, None)


def _write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def _write_atomic(path: Path, data: bytes) -> None:
    """Writes a temporary file and renames it over `path`: a reader sees the old file or the new one.
    A failed write (ENOSPC, EIO) removes its temporary file and raises."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        _write_file(tmp, data)
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise


def _store(e: _Entry, ck: CompiledKernel) -> bool:
    """Writes an entry: the cubin, then its metadata. A write error (read-only or full disk, the
    directory a regular file) is a warning: the kernel still runs, loaded from memory."""
    meta = {
        "format": _META_FORMAT, "key": e.key,
        "cubin_sha256": hashlib.sha256(ck.cubin).hexdigest(), "cubin_bytes": len(ck.cubin),
        "name": e.spec.name, "expression": e.spec.expression, "target": e.target, "options": list(e.options),
        "cuflash_version": __version__, "nvrtc": ".".join(map(str, nvrtc_version())),
        "lowered_name": ck.lowered_name, "ptxas_log": ck.ptxas_log, "compile_seconds": ck.compile_seconds,
    }
    try:
        e.cubin.parent.mkdir(parents=True, exist_ok=True)
        _write_atomic(e.cubin, ck.cubin)
        _write_atomic(e.meta, json.dumps(meta, indent=1).encode())
    except OSError as err:
        _warn_once("write", "cuflash: could not write the kernel cache in %s (%s: %s); the kernels still run, "
                   "but each process compiles them again", e.cubin.parent, type(err).__name__, err)
        return False
    ck.cubin_path = e.cubin
    return True


def _remove(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


def _try_lock(path: Path) -> int | None:
    """An exclusive flock on `path` (created if needed), as an open descriptor; None where there is no
    lock to take (no fcntl, an unwritable directory, a lock held past _LOCK_WAIT_S)."""
    try:
        import fcntl
    except ImportError:  # Windows: build unlocked
        return None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError:
        return None
    deadline = time.monotonic() + _LOCK_WAIT_S
    delay = 0.002
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() > deadline:
                log.info("cuflash: %s held for over %.0f s; building without it", path, _LOCK_WAIT_S)
                break
            time.sleep(delay)
            delay = min(2 * delay, 0.05)
        except OSError:  # e.g. ENOLCK on a network file system
            break
    os.close(fd)
    return None


def _build(e: _Entry, refused: bytes | None = None, load_error: str | None = None) -> CompiledKernel:
    """Builds a missing or bad entry under its lock, and writes it. `refused`: the cubin of a good-looking
    entry that the driver would not load (`load_error` says why)."""
    fd = _try_lock(e.lock)
    try:
        ck, reason, bad_file = _read_entry(e)
        if ck is not None and (refused is None or ck.cubin != refused):
            return ck  # built by another process while this one waited
        if ck is not None or (reason is None and load_error is not None):
            reason, bad_file = load_error, e.cubin
        if reason is not None:
            _warn_once("bad-entry", "cuflash: ignoring a bad kernel cache entry %s: %s; recompiling %s and "
                       "replacing it", bad_file, reason, e.spec.name)
            _remove(e.meta)  # now absent to everyone, until it is rewritten
        ck = nvrtc_compile(e.spec, e.target, list(e.options))
        log.info("cuflash: compiled %s for %s in %.2f s", e.spec.name, e.target, ck.compile_seconds)
        _store(e, ck)
        return ck
    finally:
        if fd is not None:
            os.close(fd)  # releases the lock


def compile_cached(spec: Specialization, target: str) -> CompiledKernel:
    """Disk cache, then NVRTC. Logs the first compile of each specialization with its time."""
    e = _entry(spec, target)
    ck, _, _ = _read_entry(e)
    if ck is not None:
        return ck
    return _build(e)


@dataclass(frozen=True)
class LoadedKernel:
    ptr: int          # CUfunction handle, for cuLaunchKernel
    module: object    # keeps the cupy.RawModule (and so the loaded cubin) alive
    raw: object       # the cupy.RawKernel


_loaded: dict[tuple[str, str, int], LoadedKernel] = {}
_loaded_lock = threading.Lock()
_build_locks: dict[tuple[str, str], threading.Lock] = {}


def _load_kernel(ck: CompiledKernel, device_id: int) -> LoadedKernel:
    """Loads the cubin into the driver on one device: the step where a damaged cubin fails
    (CUDA_ERROR_INVALID_IMAGE and kin)."""
    import cupy

    path, tmp = ck.cubin_path, None
    if path is None:  # cache not writable: load from a private temporary file
        import tempfile

        fd, tmp = tempfile.mkstemp(prefix="cuflash-", suffix=".cubin")
        with os.fdopen(fd, "wb") as f:
            f.write(ck.cubin)
        path = tmp
    try:
        with cupy.cuda.Device(device_id):
            module = cupy.RawModule(path=str(path))
            kernel = module.get_function(ck.lowered_name)  # cuModuleLoad happens here (CuPy loads lazily)
            return LoadedKernel(kernel.kernel.ptr, module, kernel)
    finally:
        if tmp is not None:
            _remove(Path(tmp))  # the driver holds its own copy of a loaded module


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
        ck = compile_cached(spec, target)
        try:
            fn = _load_kernel(ck, device_id)
        except Exception as err:
            if not ck.from_disk:
                raise
            # A cached cubin that passed its digest check but that the driver refuses: rebuild it.
            ck = _build(_entry(spec, target), refused=ck.cubin,
                        load_error=f"the driver could not load it ({type(err).__name__}: {err})")
            fn = _load_kernel(ck, device_id)
        if smem_bytes > 48 * 1024:
            import cupy

            with cupy.cuda.Device(device_id):
                fn.raw.max_dynamic_shared_size_bytes = smem_bytes
        _loaded[key] = fn
        return fn


# ------------------------------------------------------------------------------------------------
# `python -m cuflash cache [--clear]`
# ------------------------------------------------------------------------------------------------

_STEM = r"[A-Za-z0-9_]+-sm_[0-9]+[a-z]?-[0-9a-f]{24}"
_ENTRY_FILE = re.compile(rf"({_STEM})\.(cubin|json)")
_TMP_FILE = re.compile(rf"\.{_STEM}\.(cubin|json)\.[0-9]+\.[0-9]+\.tmp")
_LOCK_FILE = re.compile(rf"\.{_STEM}\.lock")


@dataclass
class CacheStats:
    directory: Path
    problem: str | None = None    # why the directory cannot be listed ("does not exist", ...)
    entries: int = 0              # complete entries: a .cubin with its .json
    entry_bytes: int = 0
    by_target: dict = field(default_factory=dict)
    partial: int = 0              # a .cubin or .json without the other, or a leftover temporary file
    partial_bytes: int = 0
    locks: int = 0


def _cuflash_files(d: Path):
    """(name, kind, size) of cuflash's own files in `d` (not recursive, regular files only): kind is
    "cubin", "json", "tmp" or "lock"."""
    with os.scandir(d) as it:
        for ent in it:
            if not ent.is_file(follow_symlinks=False):
                continue
            m = _ENTRY_FILE.fullmatch(ent.name)
            if m:
                kind = m.group(2)
            elif _TMP_FILE.fullmatch(ent.name):
                kind = "tmp"
            elif _LOCK_FILE.fullmatch(ent.name):
                kind = "lock"
            else:
                continue
            try:
                size = ent.stat(follow_symlinks=False).st_size
            except OSError:
                size = 0
            yield ent.name, kind, size


def cache_stats(d: Path | None = None) -> CacheStats:
    """What the disk cache holds: complete entries and their size, per target, and leftovers."""
    d = cache_dir() if d is None else Path(d)
    st = CacheStats(d)
    if not d.exists():
        st.problem = "does not exist (nothing cached yet)"
        return st
    if not d.is_dir():
        st.problem = "is not a directory (kernels cannot be cached: every process compiles them)"
        return st
    stems: dict[str, dict[str, int]] = {}
    try:
        for name, kind, size in _cuflash_files(d):
            if kind == "lock":
                st.locks += 1
            elif kind == "tmp":
                st.partial += 1
                st.partial_bytes += size
            else:
                stems.setdefault(name.rsplit(".", 1)[0], {})[kind] = size
    except OSError as err:
        st.problem = f"cannot be listed ({err})"
        return st
    for stem, parts in stems.items():
        if len(parts) == 2:
            st.entries += 1
            st.entry_bytes += sum(parts.values())
            target = stem.split("-")[1]
            st.by_target[target] = st.by_target.get(target, 0) + 1
        else:
            st.partial += 1
            st.partial_bytes += sum(parts.values())
    return st


def clear_cache(d: Path | None = None) -> tuple[int, int, list[str]]:
    """Deletes cuflash's own files from the cache directory: entries (.cubin, .json), leftover
    temporaries and lock files, nothing else (the directory may be shared). Returns (files removed,
    bytes freed, errors)."""
    d = cache_dir() if d is None else Path(d)
    removed, freed, errors = 0, 0, []
    if not d.is_dir():
        return 0, 0, []
    try:
        files = list(_cuflash_files(d))
    except OSError as err:
        return 0, 0, [f"{d}: {err}"]
    for name, _, size in files:
        try:
            (d / name).unlink()
        except FileNotFoundError:
            continue
        except OSError as err:
            errors.append(f"{d / name}: {err}")
            continue
        removed += 1
        freed += size
    return removed, freed, errors


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
