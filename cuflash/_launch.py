"""Kernel specializations, the Params mirror, and launches on raw device pointers.

Nothing here knows torch, JAX or CuPy arrays: callers hand in `DeviceTensor`s (pointer, shape,
element strides) and a stream handle. cuflash/_interop.py makes those from the caller's arrays.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from . import _compile, _config

LOG2E = 1.4426950408889634

# Mirror of cuflash::FwdParams (cuda_src/params.cuh). Field order and types must match; every
# compile static_asserts sizeof, the compile gate each offset (see params_layout_checks).
FWD_PARAMS = np.dtype(
    [("q", np.uint64), ("k", np.uint64), ("v", np.uint64), ("o", np.uint64), ("lse", np.uint64)]
    + [(f"{t}_{s}_stride", np.int64) for t in "qkvo" for s in ("batch", "row", "head")]
    + [(n, np.int32) for n in ("batch", "nheads", "nheads_kv", "head_group", "seqlen_q", "seqlen_k", "num_m_blocks")]
    + [("scale_log2", np.float32)],
    align=True,
)

_FWD_CHECKS_PARAMS = _compile.params_layout_checks("cuflash", "FwdParams", FWD_PARAMS)

_DTYPE_TAG = {"float16": ("f16", "cuflash::f16"), "bfloat16": ("bf16", "cuflash::bf16")}

MAX_GRID_X = 2**31 - 1


@dataclass(frozen=True)
class DeviceTensor:
    ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in elements


def fwd_specialization(dtype: str, head_dim: int, cfg: _config.TileConfig, causal: bool, even: bool):
    short, ctype = _DTYPE_TAG[dtype]
    expr = (f"cuflash::flash_fwd_kernel<{ctype}, {head_dim}, {cfg.block_m}, {cfg.block_n}, {cfg.warps}, "
            f"{'true' if causal else 'false'}, {'true' if even else 'false'}>")
    name = (f"fwd_{short}_d{head_dim}_m{cfg.block_m}_n{cfg.block_n}_w{cfg.warps}"
            f"_{'causal' if causal else 'full'}_{'even' if even else 'ragged'}")
    smem = _config.fwd_smem_bytes(head_dim, cfg)
    checks = "\n".join([
        _FWD_CHECKS_PARAMS,
        f"static_assert(cuflash::FwdTraits<{head_dim}, {cfg.block_m}, {cfg.block_n}, {cfg.warps}>::SMEM_BYTES == {smem},"
        f' "shared memory size differs from cuflash/_config.py:fwd_smem_bytes");',
    ])
    return _compile.Specialization("flash_fwd.cu", expr, name, checks), smem


def all_fwd_specializations(target: str, head_dims=None, dtypes=None, causal=(False, True), even=(False, True)):
    """Every forward specialization the dispatcher can select for a compile target."""
    family = _config.family_of_target(target)
    out = []
    for dtype in dtypes or _config.DTYPES:
        for d in head_dims or _config.HEAD_DIMS:
            cfg = _config.fwd_config(family, d, dtype)
            for c in causal:
                for e in even:
                    out.append(fwd_specialization(dtype, d, cfg, c, e))
    return out


def launch_fwd(q: DeviceTensor, k: DeviceTensor, v: DeviceTensor, o: DeviceTensor, lse_ptr: int,
               dtype: str, causal: bool, softmax_scale: float, device_id: int, cc: tuple[int, int],
               stream_ptr: int, cfg: _config.TileConfig | None = None) -> None:
    """Launches the forward kernel. All checks on shapes and strides were done by the caller.
    `cfg` overrides the tile table (tuning scripts only)."""
    batch, seqlen_q, nheads, head_dim = q.shape
    _, seqlen_k, nheads_kv, _ = k.shape
    family = _config.arch_family(*cc)
    target = _config.compile_arch(*cc)
    cfg = cfg or _config.fwd_config(family, head_dim, dtype)
    even = seqlen_q % cfg.block_m == 0 and seqlen_k % cfg.block_n == 0
    spec, smem = fwd_specialization(dtype, head_dim, cfg, causal, even)
    num_m_blocks = -(-seqlen_q // cfg.block_m)
    grid = batch * nheads * num_m_blocks
    if grid > MAX_GRID_X:
        raise ValueError(f"batch * nheads * ceil(seqlen_q / {cfg.block_m}) = {grid} thread blocks exceeds the "
                         f"grid limit {MAX_GRID_X}; split the batch")
    fn = _compile.get_function(spec, target, device_id, smem)

    p = np.zeros((), dtype=FWD_PARAMS)
    p["q"], p["k"], p["v"], p["o"], p["lse"] = q.ptr, k.ptr, v.ptr, o.ptr, lse_ptr
    for name, t in (("q", q), ("k", k), ("v", v), ("o", o)):
        p[f"{name}_batch_stride"], p[f"{name}_row_stride"], p[f"{name}_head_stride"] = t.strides[:3]
    p["batch"], p["nheads"], p["nheads_kv"] = batch, nheads, nheads_kv
    p["head_group"] = nheads // nheads_kv
    p["seqlen_q"], p["seqlen_k"], p["num_m_blocks"] = seqlen_q, seqlen_k, num_m_blocks
    p["scale_log2"] = softmax_scale * LOG2E

    launch(fn, device_id, grid, cfg.warps * 32, smem, stream_ptr, p)


def launch(fn, device_id: int, grid: int, threads: int, smem: int, stream_ptr: int, params: np.ndarray) -> None:
    """cuLaunchKernel with one by-value struct argument, on a raw stream handle (the caller's own
    stream: torch's current stream, CuPy's, ...), with no stream object in between."""
    import cupy
    from cupy_backends.cuda.api import driver

    arg = np.ascontiguousarray(params)               # the struct's bytes
    argv = np.array([arg.ctypes.data], dtype=np.uint64)  # void* kernelParams[1]
    with cupy.cuda.Device(device_id):
        driver.launchKernel(fn.ptr, grid, 1, 1, threads, 1, 1, smem, stream_ptr, argv.ctypes.data, 0)


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
