"""Device queries and ahead-of-time compilation."""

from __future__ import annotations

import functools
import logging
from concurrent.futures import ThreadPoolExecutor

from . import _compile, _config, _launch

log = logging.getLogger("cuflash")


@functools.lru_cache(maxsize=None)
def compute_capability(device_id: int) -> tuple[int, int]:
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(device_id)
    return int(props["major"]), int(props["minor"])


@functools.lru_cache(maxsize=None)
def peak_memory_bandwidth(device_id: int) -> float:
    """The device memory's peak bandwidth in bytes/s: 2 transfers a clock x the peak memory clock x the
    bus width (cudaDevAttrMemoryClockRate, kHz, and cudaDevAttrGlobalMemoryBusWidth, bits); 0.0 where
    the driver does not report them."""
    from cupy.cuda import runtime

    try:
        khz = runtime.deviceGetAttribute(runtime.cudaDevAttrMemoryClockRate, device_id)
        bits = runtime.deviceGetAttribute(runtime.cudaDevAttrGlobalMemoryBusWidth, device_id)
    except runtime.CUDARuntimeError:
        return 0.0
    return 2.0 * khz * 1e3 * bits / 8


def precompile(head_dims=None, dtypes=None, causal=(False, True), backward=True, target=None, device=None,
               workers=None, features=False):
    """Builds kernel specializations ahead of use, into the disk cache.

    Args:
        head_dims: iterable of head dims (default: every multiple of 8 from 8 to 256).
        dtypes: iterable of "float16" / "bfloat16" (default both).
        causal: iterable of bools (default both).
        backward: also build the backward kernels (default True).
        target: an NVRTC target such as "sm_90a" or "sm_80". Needs no GPU: a deployment image can be
            built on a machine without one. Default: the architecture of `device`.
        device: CUDA device ordinal (default 0) when `target` is None; the kernels are also loaded
            onto it, so the first call pays nothing.
        workers: compile processes (default: CPU count).
        features: also build the feature kernels (lengths, attention_varlen, window, sinks, ALiBi,
            softcap) and the KV-cache decode kernels (attention_with_kvcache) for these head_dims and
            dtypes.

    Returns:
        The readable names of the specializations built or found in the cache.
    """
    load = target is None
    if target is None:
        device = 0 if device is None else device
        target = _config.compile_arch(*compute_capability(device))
    head_dims = tuple(head_dims) if head_dims is not None else None
    if head_dims is not None:
        for d in head_dims:
            if d not in _config.HEAD_DIMS:
                raise ValueError(f"head_dims: {d} is not supported; expected multiples of 8 from 8 to 256")
    if dtypes is not None:
        dtypes = tuple(dtypes)
        for dt in dtypes:
            if dt not in _config.DTYPES:
                raise ValueError(f"dtypes: {dt!r} is not supported; expected 'float16' or 'bfloat16'")
    specs = _launch.all_fwd_specializations(target, head_dims, dtypes, tuple(causal))
    specs += _launch.all_fwd_tma_specializations(target, head_dims, dtypes, tuple(causal))
    specs += _launch.all_fwd_ws_specializations(target, head_dims, dtypes, tuple(causal))
    if backward:
        # both dQ paths where the dispatcher can select both (atomic=None)
        specs += _launch.all_bwd_specializations(target, head_dims, dtypes, tuple(causal))
        specs += _launch.all_bwd_ws_specializations(target, head_dims, dtypes, tuple(causal))
        specs += _launch.all_bwd_single_specializations(target, head_dims, dtypes, tuple(causal))
    if features:
        specs += _launch.all_feat_specializations(target, head_dims, dtypes, backward)
        specs += _launch.all_decode_specializations(target, head_dims, dtypes)
    names = compile_many([spec for spec, _ in specs], target, workers)
    if load:
        for spec, smem in specs:
            _compile.get_function(spec, target, device, smem)
    log.info("cuflash: %d specializations ready for %s", len(names), target)
    return names


def compile_many(specs, target, workers=None, return_logs=False):
    """Compiles specializations into the disk cache in parallel worker processes.

    Returns their names, or (name, compile_seconds, ptxas_log) triples with return_logs. A
    compile_seconds of 0.0 means the kernel came from the disk cache.
    """
    import os
    import pickle
    import subprocess
    import sys
    from pathlib import Path

    jobs = [(spec, target) for spec in specs]
    workers = max(1, min(workers or os.cpu_count() or 1, len(jobs)))
    if workers == 1:
        results = []
        for spec, tgt in jobs:
            ck = _compile.compile_cached(spec, tgt)
            results.append((spec.name, ck.compile_seconds, ck.ptxas_log))
    else:
        chunks = [jobs[i::workers] for i in range(workers)]
        pkg_parent = str(Path(__file__).resolve().parent.parent)
        env = dict(os.environ)
        env["PYTHONPATH"] = pkg_parent + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")

        def run(chunk):
            proc = subprocess.run([sys.executable, "-m", "cuflash._compile_worker"], input=pickle.dumps(chunk),
                                  capture_output=True, env=env)
            if proc.returncode != 0:
                raise _compile.CompileError(proc.stderr.decode(errors="replace")[-4000:])
            return pickle.loads(proc.stdout)

        with ThreadPoolExecutor(workers) as pool:  # each thread waits on one worker process
            per_chunk = list(pool.map(run, chunks))
        order = {spec.name: i for i, (spec, _) in enumerate(jobs)}
        results = sorted((r for rs in per_chunk for r in rs), key=lambda r: order[r[0]])
    return results if return_logs else [name for name, _, _ in results]
