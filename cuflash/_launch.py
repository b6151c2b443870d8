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

# Mirror of cuflash::MaskParams (cuda_src/mask.cuh), the last member of both Params structs.
MASK_PARAMS = np.dtype(
    [(n, np.uint64) for n in ("cu_seqlens_q", "cu_seqlens_k", "q_lengths", "kv_lengths", "alibi_slopes",
                              "sink_logits", "dsink_rows")]
    + [("lse_batch_stride", np.int64), ("lse_head_stride", np.int64)]
    + [(n, np.int32) for n in ("total_q", "total_k", "alibi_batch_stride", "window_left", "window_right",
                               "num_sink_tokens")]
    + [(n, np.float32) for n in ("softcap", "softcap_pre", "softcap_log2")],
    align=True,
)

_MASK_CHECKS_PARAMS = _compile.params_layout_checks("cuflash", "MaskParams", MASK_PARAMS)

# Mirror of cuflash::FwdParams (cuda_src/params.cuh). Field order and types must match; every
# compile static_asserts sizeof, the compile gate each offset (see params_layout_checks).
FWD_PARAMS = np.dtype(
    [("q", np.uint64), ("k", np.uint64), ("v", np.uint64), ("o", np.uint64), ("lse", np.uint64)]
    + [(f"{t}_{s}_stride", np.int64) for t in "qkvo" for s in ("batch", "row", "head")]
    + [(n, np.int32) for n in ("batch", "nheads", "nheads_kv", "head_group", "seqlen_q", "seqlen_k", "num_m_blocks")]
    + [("scale_log2", np.float32), ("mask", MASK_PARAMS)],
    align=True,
)

_FWD_CHECKS_PARAMS = (_compile.params_layout_checks("cuflash", "FwdParams", FWD_PARAMS) + "\n"
                      + _MASK_CHECKS_PARAMS)

# Mirror of cuflash::BwdParams (cuda_src/params.cuh).
BWD_PARAMS = np.dtype(
    [(n, np.uint64) for n in ("q", "k", "v", "o", "dout", "lse", "dq", "dk", "dv", "dq_accum", "lse_log2", "delta")]
    + [(f"{t}_{s}_stride", np.int64) for t in ("q", "k", "v", "o", "do", "dq", "dk", "dv")
       for s in ("batch", "row", "head")]
    + [(n, np.int32) for n in ("batch", "nheads", "nheads_kv", "head_group", "seqlen_q", "seqlen_k",
                               "seqlen_q_pad", "num_blocks")]
    + [("scale_log2", np.float32), ("scale", np.float32), ("mask", MASK_PARAMS)],
    align=True,
)

_BWD_CHECKS_PARAMS = _compile.params_layout_checks("cuflash", "BwdParams", BWD_PARAMS)

# Mirror of cuflash::TailParams (cuda_src/varlen.cu).
TAIL_PARAMS = np.dtype(
    [("ptr", np.uint64), ("row_stride", np.int64), ("head_stride", np.int64), ("start", np.uint64)]
    + [(n, np.int32) for n in ("total_rows", "nheads", "row_elems")] + [("fill", np.uint32)],
    align=True,
)

_TAIL_CHECKS_PARAMS = _compile.params_layout_checks("cuflash", "TailParams", TAIL_PARAMS)

_DTYPE_TAG = {"float16": ("f16", "cuflash::f16"), "bfloat16": ("bf16", "cuflash::bf16")}

MAX_GRID_X = 2**31 - 1


@dataclass(frozen=True)
class DeviceTensor:
    ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in elements


@dataclass(frozen=True)
class MaskArgs:
    """What the feature kernels read beyond the plain call (cuda_src/mask.cuh: MaskParams): device
    pointers (0 = absent) and scalars, validated by the caller. A packed batch (cu_seqlens_q != 0)
    hands the launchers q / k / v / out as 4-D views (batch, max_seqlen, heads, head_dim) with batch
    stride 0, and total_q / total_k rows in the arrays."""

    cu_seqlens_q: int = 0
    cu_seqlens_k: int = 0
    q_lengths: int = 0
    kv_lengths: int = 0
    alibi_slopes: int = 0
    alibi_batch_stride: int = 0
    sink_logits: int = 0
    dsink_rows: int = 0   # backward with sink logits: (batch, nheads, seqlen_q_pad) float32
    window_left: int = -1
    window_right: int = -1
    num_sink_tokens: int = 0
    softcap: float = 0.0
    total_q: int = 0
    total_k: int = 0

    @property
    def packed(self) -> bool:
        return self.cu_seqlens_q != 0


def _set_mask(p, m: MaskArgs, softmax_scale: float, nheads: int, seqlen_q: int) -> None:
    pm = p["mask"]
    for name in ("cu_seqlens_q", "cu_seqlens_k", "q_lengths", "kv_lengths", "alibi_slopes", "sink_logits",
                 "dsink_rows", "alibi_batch_stride", "window_left", "window_right", "num_sink_tokens",
                 "total_q", "total_k"):
        pm[name] = getattr(m, name)
    if m.packed:  # lse (nheads, total_q)
        pm["lse_batch_stride"], pm["lse_head_stride"] = 0, m.total_q
    else:         # lse (batch, nheads, seqlen_q)
        pm["lse_batch_stride"], pm["lse_head_stride"] = nheads * seqlen_q, seqlen_q
    if m.softcap > 0:
        pm["softcap"] = m.softcap
        pm["softcap_pre"] = softmax_scale / m.softcap
        pm["softcap_log2"] = m.softcap * LOG2E


def fwd_specialization(dtype: str, head_dim: int, cfg: _config.TileConfig, causal: bool, even: bool,
                       feat: bool = False):
    """feat: the kernel with the optional features (cuda_src/mask.cuh); causal and even are then
    run-time properties of the mask and must be False."""
    short, ctype = _DTYPE_TAG[dtype]
    smem = _config.fwd_smem_bytes(head_dim, cfg)
    flags = f"{'true' if causal else 'false'}, {'true' if even else 'false'}"
    suffix = f"_{'causal' if causal else 'full'}_{'even' if even else 'ragged'}"
    if feat:
        assert not (causal or even), (causal, even, cfg)
        flags += ", true"
        suffix = "_feat"
    if cfg.wgmma:
        assert cfg.warps * 16 == cfg.block_m, cfg
        expr = f"cuflash::flash_fwd_sm90_kernel<{ctype}, {head_dim}, {cfg.block_m}, {cfg.block_n}, {flags}>"
        name = f"fwd90_{short}_d{head_dim}_m{cfg.block_m}_n{cfg.block_n}" + suffix
        traits, source = f"cuflash::FwdSm90Traits<{head_dim}, {cfg.block_m}, {cfg.block_n}>", "flash_fwd_sm90.cu"
    else:
        expr = f"cuflash::flash_fwd_kernel<{ctype}, {head_dim}, {cfg.block_m}, {cfg.block_n}, {cfg.warps}, {flags}>"
        name = f"fwd_{short}_d{head_dim}_m{cfg.block_m}_n{cfg.block_n}_w{cfg.warps}" + suffix
        traits, source = f"cuflash::FwdTraits<{head_dim}, {cfg.block_m}, {cfg.block_n}, {cfg.warps}>", "flash_fwd.cu"
    checks = "\n".join([
        _FWD_CHECKS_PARAMS,
        f"static_assert({traits}::SMEM_BYTES == {smem},"
        f' "shared memory size differs from cuflash/_config.py:fwd_smem_bytes");',
    ])
    return _compile.Specialization(source, expr, name, checks), smem


def all_fwd_specializations(target: str, head_dims=None, dtypes=None, causal=(False, True), even=(False, True)):
    """Every forward specialization the dispatcher can select for a compile target."""
    out = []
    for dtype in dtypes or _config.DTYPES:
        for d in head_dims or _config.HEAD_DIMS:
            for c in causal:
                cfg = _config.fwd_config_for_target(target, d, dtype, c)
                for e in even:
                    out.append(fwd_specialization(dtype, d, cfg, c, e))
    return out


def all_feat_specializations(target: str, head_dims=None, dtypes=None, backward=True):
    """Every specialization of the feature kernels for a compile target: the forward, the backward
    (preprocess, dK/dV, dQ) and the packed batch's tail fill."""
    out = []
    for dtype in dtypes or _config.DTYPES:
        for d in head_dims or _config.HEAD_DIMS:
            fwd_cfgs = {_config.feat_fwd_config(target, d, dtype, narrow) for narrow in (False, True)}
            for cfg in sorted(fwd_cfgs, key=lambda c: c.wgmma):
                out.append(fwd_specialization(dtype, d, cfg, False, False, True))
            if backward:
                for atomic in feat_bwd_atomic_choices(target, d):
                    out += [(spec, smem) for spec, smem, _ in
                            bwd_specializations(dtype, d, target, False, False, False, atomic, feat=True)]
    out += [(tail_specialization(e), 0) for e in ("u16", "u32")]
    return out


_TAIL_CTYPE = {"u16": "unsigned short", "u32": "unsigned int"}


def feat_bwd_atomic_choices(target: str, head_dim: int) -> tuple[bool, ...]:
    """The dQ paths of the feature backward: the separate pass always; float atomics too where
    deterministic=False takes them (_config.feat_bwd_uses_atomics)."""
    return (False, True) if _config.feat_bwd_uses_atomics(False, target, head_dim) else (False,)


def tail_specialization(elem: str):
    """The packed batch's tail fill (cuda_src/varlen.cu) for 16-bit ('u16') or 32-bit elements."""
    return _compile.Specialization("varlen.cu", f"cuflash::varlen_fill_tail_kernel<{_TAIL_CTYPE[elem]}>",
                                   f"varlen_fill_tail_{elem}", _TAIL_CHECKS_PARAMS)


def _b(x: bool) -> str:
    return "true" if x else "false"


def bwd_uses_atomics(deterministic: bool, target: str | None = None, head_dim: int | None = None) -> bool:
    """Whether dQ is accumulated with float atomics inside the dK/dV kernel: never when
    deterministic; with the sm_90a wgmma kernel always otherwise (it computes dQ from the dS it
    already holds); with the mma.sync kernel as the measured choice in _config.BWD_ATOMIC_DQ says."""
    if deterministic:
        return False
    if target is not None and head_dim is not None and _config.bwd_config_for_target(target, head_dim, "float16").wgmma:
        return True
    return _config.BWD_ATOMIC_DQ


def bwd_specializations(dtype: str, head_dim: int, target: str, causal: bool, even_kv: bool, even_q: bool,
                        atomic: bool, cfg: _config.TileConfig | None = None, feat: bool = False):
    """The backward kernels one call launches, in order: [(Specialization, smem bytes, TileConfig)].

    even_kv / even_q: whether the lengths are multiples of the dK/dV and dQ kernels' tiles.
    atomic: dQ by float atomics in the dK/dV kernel (then a conversion kernel), or by the separate,
    deterministic dQ kernel. cfg overrides the dK/dV tile table (tuning scripts only).
    feat: the kernels with the optional features (causal and even_* must be False; atomic only with
    the sm_90a wgmma dK/dV kernel)."""
    short, ctype = _DTYPE_TAG[dtype]
    family = _config.family_of_target(target)
    if feat:
        assert not (causal or even_kv or even_q), (causal, even_kv, even_q)
        cfg = cfg or _config.feat_bwd_config(target, head_dim, dtype)
        assert cfg.wgmma or not atomic, cfg
    cfg = cfg or _config.bwd_config_for_target(target, head_dim, dtype)
    fx = ", true" if feat else ""
    pre = _compile.Specialization(
        "flash_bwd.cu", f"cuflash::flash_bwd_preprocess_kernel<{ctype}, {head_dim}, {_b(atomic)}{fx}>",
        f"bwd_pre_{short}_d{head_dim}{'_zero_dq' if atomic else ''}{'_feat' if feat else ''}", _BWD_CHECKS_PARAMS)
    smem = _config.bwd_smem_bytes(head_dim, cfg)
    flags = f"{_b(causal)}, {_b(even_kv)}, {_b(atomic)}{fx}"
    suffix = (f"_{'causal' if causal else 'full'}_{'even' if even_kv else 'ragged'}"
              f"_{'atomic_dq' if atomic else 'no_dq'}")
    if feat:
        suffix = "_feat" + ("_atomic_dq" if atomic else "")
    if cfg.wgmma:
        assert cfg.warps * 16 == cfg.block_n, cfg
        expr = f"cuflash::flash_bwd_dkdv_sm90_kernel<{ctype}, {head_dim}, {cfg.block_m}, {cfg.block_n}, {flags}>"
        name = f"bwd90_dkdv_{short}_d{head_dim}_m{cfg.block_m}_n{cfg.block_n}" + suffix
        traits, source = f"cuflash::BwdSm90Traits<{head_dim}, {cfg.block_m}, {cfg.block_n}>", "flash_bwd_sm90.cu"
    else:
        expr = (f"cuflash::flash_bwd_dkdv_kernel<{ctype}, {head_dim}, {cfg.block_m}, {cfg.block_n}, {cfg.warps}, "
                + flags + ">")
        name = f"bwd_dkdv_{short}_d{head_dim}_m{cfg.block_m}_n{cfg.block_n}_w{cfg.warps}" + suffix
        traits, source = f"cuflash::BwdTraits<{head_dim}, {cfg.block_m}, {cfg.block_n}, {cfg.warps}>", "flash_bwd.cu"
    dkdv = _compile.Specialization(
        source, expr, name,
        _BWD_CHECKS_PARAMS + "\n" +
        f"static_assert({traits}::SMEM_BYTES == {smem},"
        f' "shared memory size differs from cuflash/_config.py:bwd_smem_bytes");')
    out = [(pre, 0, None), (dkdv, smem, cfg)]
    if atomic:
        conv = _compile.Specialization(
            "flash_bwd.cu", f"cuflash::flash_bwd_convert_dq_kernel<{ctype}, {head_dim}{fx}>",
            f"bwd_convert_dq_{short}_d{head_dim}{'_feat' if feat else ''}", _BWD_CHECKS_PARAMS)
        out.append((conv, 0, None))
    else:
        qcfg = _config.feat_dq_config(target, head_dim, dtype) if feat else _config.bwd_dq_config(family, head_dim, dtype)
        qsmem = _config.bwd_dq_smem_bytes(head_dim, qcfg)
        dq = _compile.Specialization(
            "flash_bwd.cu",
            f"cuflash::flash_bwd_dq_kernel<{ctype}, {head_dim}, {qcfg.block_m}, {qcfg.block_n}, {qcfg.warps}, "
            f"{_b(causal)}, {_b(even_q)}{fx}>",
            f"bwd_dq_{short}_d{head_dim}_m{qcfg.block_m}_n{qcfg.block_n}_w{qcfg.warps}"
            + ("_feat" if feat else f"_{'causal' if causal else 'full'}_{'even' if even_q else 'ragged'}"),
            _BWD_CHECKS_PARAMS + "\n" +
            f"static_assert(cuflash::BwdDqTraits<{head_dim}, {qcfg.block_m}, {qcfg.block_n}, {qcfg.warps}>::SMEM_BYTES"
            f' == {qsmem}, "shared memory size differs from cuflash/_config.py:bwd_dq_smem_bytes");')
        out.append((dq, qsmem, qcfg))
    return out


def bwd_atomic_choices(target: str, head_dim: int) -> tuple[bool, ...]:
    """The dQ paths the dispatcher can select for (target, head_dim): the deterministic one always,
    the atomic one where a non-deterministic call takes it."""
    return (False, True) if bwd_uses_atomics(False, target, head_dim) else (False,)


def all_bwd_specializations(target: str, head_dims=None, dtypes=None, causal=(False, True), even=(False, True),
                            atomic=None):
    """Every backward specialization for a compile target, each once. atomic: the dQ paths to
    build, (False, True) for both; default: those the dispatcher can select (bwd_atomic_choices)."""
    seen = {}
    for dtype in dtypes or _config.DTYPES:
        for d in head_dims or _config.HEAD_DIMS:
            for c in causal:
                for e in even:
                    for a in (atomic if atomic is not None else bwd_atomic_choices(target, d)):
                        for spec, smem, _ in bwd_specializations(dtype, d, target, c, e, e, a):
                            seen.setdefault(spec.expression, (spec, smem))
    return list(seen.values())


def launch_fwd(q: DeviceTensor, k: DeviceTensor, v: DeviceTensor, o: DeviceTensor, lse_ptr: int,
               dtype: str, causal: bool, softmax_scale: float, device_id: int, cc: tuple[int, int],
               stream_ptr: int, cfg: _config.TileConfig | None = None, mask: MaskArgs | None = None) -> None:
    """Launches the forward kernel. All checks on shapes and strides were done by the caller.
    `cfg` overrides the tile table (tuning scripts only). With `mask`, the feature kernel runs and
    `causal` must already be folded into mask.window_right."""
    batch, seqlen_q, nheads, head_dim = q.shape
    _, seqlen_k, nheads_kv, _ = k.shape
    target = _config.compile_arch(*cc)
    if mask is not None:
        assert not causal
        narrow = 0 <= mask.window_left and mask.window_left + max(mask.window_right, 0) < _config.NARROW_WINDOW
        cfg = cfg or _config.feat_fwd_config(target, head_dim, dtype, narrow)
        spec, smem = fwd_specialization(dtype, head_dim, cfg, False, False, feat=True)
    else:
        cfg = cfg or _config.fwd_config_for_target(target, head_dim, dtype, causal)
        even = seqlen_q % cfg.block_m == 0 and seqlen_k % cfg.block_n == 0
        spec, smem = fwd_specialization(dtype, head_dim, cfg, causal, even)
    num_m_blocks = -(-seqlen_q // cfg.block_m)
    grid = batch * nheads * num_m_blocks
    if grid > MAX_GRID_X:
        raise ValueError(f"batch * nheads * ceil(seqlen_q / {cfg.block_m}) = {grid} thread blocks exceeds the "
                         f"grid limit {MAX_GRID_X}; split the batch")
    if grid == 0:  # a packed batch whose sequences are all empty
        return
    fn = _compile.get_function(spec, target, device_id, smem)

    p = np.zeros((), dtype=FWD_PARAMS)
    p["q"], p["k"], p["v"], p["o"], p["lse"] = q.ptr, k.ptr, v.ptr, o.ptr, lse_ptr
    _set_strides(p, (("q", q), ("k", k), ("v", v), ("o", o)))
    p["batch"], p["nheads"], p["nheads_kv"] = batch, nheads, nheads_kv
    p["head_group"] = nheads // nheads_kv
    p["seqlen_q"], p["seqlen_k"], p["num_m_blocks"] = seqlen_q, seqlen_k, num_m_blocks
    p["scale_log2"] = softmax_scale * LOG2E
    if mask is not None:
        _set_mask(p, mask, softmax_scale, nheads, seqlen_q)

    launch(fn, device_id, grid, cfg.warps * 32, smem, stream_ptr, p)


def launch_fill_tail(t: DeviceTensor, start_ptr: int, elem: str, fill_bits: int, device_id: int,
                     cc: tuple[int, int], stream_ptr: int) -> None:
    """Fills rows [*start_ptr, rows) of t (rows, heads, row_elems) with fill_bits: the rows of a
    packed tensor that belong to no sequence (cuda_src/varlen.cu)."""
    rows, heads, row_elems = t.shape
    if rows * heads * row_elems == 0:
        return
    target = _config.compile_arch(*cc)
    fn = _compile.get_function(tail_specialization(elem), target, device_id, 0)
    p = np.zeros((), dtype=TAIL_PARAMS)
    p["ptr"], p["row_stride"], p["head_stride"], p["start"] = t.ptr, t.strides[0], t.strides[1], start_ptr
    p["total_rows"], p["nheads"], p["row_elems"], p["fill"] = rows, heads, row_elems, fill_bits
    # A grid-stride loop: the tail's length is only known on the device (usually 0).
    grid = max(1, min(_cdiv(rows * heads * row_elems, 256), 264))
    launch(fn, device_id, grid, 256, 0, stream_ptr, p)


def _set_strides(p, named):
    for name, t in named:
        p[f"{name}_batch_stride"], p[f"{name}_row_stride"], p[f"{name}_head_stride"] = t.strides[:3]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def bwd_needs_lse_log2(target: str | None, head_dim: int, atomic: bool) -> bool:
    """Whether a backward call needs the lse * log2(e) scratch rows: the mma.sync kernels read them;
    the sm_90a wgmma dK/dV kernel reads the forward's lse directly, so its atomic path needs none."""
    if target is None:
        return True
    return not (atomic and _config.bwd_config_for_target(target, head_dim, "float16").wgmma)


def bwd_row_pad(seqlen_q: int) -> int:
    """seqlen_q_pad: the per-row scratch's rows per (batch, head)."""
    return _cdiv(seqlen_q, _config.BWD_ROW_PAD) * _config.BWD_ROW_PAD


def bwd_scratch_sizes(batch: int, nheads: int, seqlen_q: int, head_dim: int, atomic: bool,
                      target: str | None = None):
    """Float32 element counts of the backward's scratch: (delta [+ lse_log2], dq_accum)."""
    pad = _cdiv(seqlen_q, _config.BWD_ROW_PAD) * _config.BWD_ROW_PAD
    rows = batch * nheads * pad
    per_row = 2 if bwd_needs_lse_log2(target, head_dim, atomic) else 1
    return per_row * rows, (rows * head_dim if atomic else 0)


def launch_bwd(dout: DeviceTensor, q: DeviceTensor, k: DeviceTensor, v: DeviceTensor, o: DeviceTensor,
               lse_ptr: int, dq: DeviceTensor, dk: DeviceTensor, dv: DeviceTensor, rows_scratch_ptr: int,
               dq_accum_ptr: int, dtype: str, causal: bool, softmax_scale: float, atomic: bool,
               device_id: int, cc: tuple[int, int], stream_ptr: int,
               cfg: _config.TileConfig | None = None, mask: MaskArgs | None = None) -> None:
    """Launches the backward kernels. rows_scratch holds delta, then (where bwd_needs_lse_log2)
    lse_log2: batch * nheads * seqlen_q_pad floats each (bwd_scratch_sizes); dq_accum (atomic path
    only) batch * nheads * seqlen_q_pad * head_dim floats. With `mask`, the feature kernels run
    (separate dQ pass, atomic must be False; causal folded into mask.window_right)."""
    batch, seqlen_q, nheads, head_dim = q.shape
    _, seqlen_k, nheads_kv, _ = k.shape
    family = _config.arch_family(*cc)
    target = _config.compile_arch(*cc)
    if mask is not None:
        assert not causal
        cfg = cfg or _config.feat_bwd_config(target, head_dim, dtype)
        qcfg = _config.feat_dq_config(target, head_dim, dtype)
        kernels = bwd_specializations(dtype, head_dim, target, False, False, False, atomic, cfg, feat=True)
    else:
        cfg = cfg or _config.bwd_config_for_target(target, head_dim, dtype)
        qcfg = _config.bwd_dq_config(family, head_dim, dtype)
        even_kv = seqlen_q % cfg.block_m == 0 and seqlen_k % cfg.block_n == 0
        even_q = seqlen_q % qcfg.block_m == 0 and seqlen_k % qcfg.block_n == 0
        kernels = bwd_specializations(dtype, head_dim, target, causal, even_kv, even_q, atomic, cfg)
    pad = _cdiv(seqlen_q, _config.BWD_ROW_PAD) * _config.BWD_ROW_PAD
    rows_pad = batch * nheads * pad

    p = np.zeros((), dtype=BWD_PARAMS)
    p["q"], p["k"], p["v"], p["o"], p["dout"], p["lse"] = q.ptr, k.ptr, v.ptr, o.ptr, dout.ptr, lse_ptr
    p["dq"], p["dk"], p["dv"] = dq.ptr, dk.ptr, dv.ptr
    p["delta"] = rows_scratch_ptr
    # The feature kernels always read lse * log2(e) from the scratch (+inf marks padding rows).
    needs_lse_log2 = mask is not None or bwd_needs_lse_log2(target, head_dim, atomic)
    p["lse_log2"] = rows_scratch_ptr + 4 * rows_pad if needs_lse_log2 else 0
    p["dq_accum"] = dq_accum_ptr
    _set_strides(p, (("q", q), ("k", k), ("v", v), ("o", o), ("do", dout), ("dq", dq), ("dk", dk), ("dv", dv)))
    p["batch"], p["nheads"], p["nheads_kv"] = batch, nheads, nheads_kv
    p["head_group"] = nheads // nheads_kv
    p["seqlen_q"], p["seqlen_k"], p["seqlen_q_pad"] = seqlen_q, seqlen_k, pad
    p["scale_log2"], p["scale"] = softmax_scale * LOG2E, softmax_scale
    if mask is not None:
        _set_mask(p, mask, softmax_scale, nheads, seqlen_q)

    (pre, _, _), (dkdv, smem, _), (last, last_smem, _) = kernels
    grids = []
    grids.append((pre, 0, _cdiv(rows_pad, 8), 256, 0))
    n_blocks = _cdiv(seqlen_k, cfg.block_n)
    grids.append((dkdv, smem, batch * nheads_kv * n_blocks, cfg.warps * 32, n_blocks))
    if not atomic:
        m_blocks = _cdiv(seqlen_q, qcfg.block_m)
        grids.append((last, last_smem, batch * nheads * m_blocks, qcfg.warps * 32, m_blocks))
    else:
        grids.append((last, 0, _cdiv(batch * nheads * seqlen_q, 8), 256, 0))
    for spec, sm, grid, threads, num_blocks in grids:
        if grid > MAX_GRID_X:
            raise ValueError(f"{spec.name}: {grid} thread blocks exceed the grid limit {MAX_GRID_X}; split the batch")
    for spec, sm, grid, threads, num_blocks in grids:
        if grid == 0:  # a packed batch with max_seqlen 0 on one side
            continue
        fn = _compile.get_function(spec, target, device_id, sm)
        p["num_blocks"] = num_blocks
        # cuLaunchKernel copies the argument bytes at the call, so one struct serves every launch
        # (a copy per launch cost ~25 us of host time each).
        launch(fn, device_id, grid, threads, sm, stream_ptr, p)


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
