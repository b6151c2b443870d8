"""Kernel specializations, the Params mirrors, and prepared launches on raw device pointers.

Nothing here knows torch, JAX or CuPy arrays. A plan (cuflash/_plan.py) describes its tensors as
`DeviceTensor`s (shape, element strides, and a pointer that is either an int or a `Slot`: "the
pointer the caller passes in position i, plus a byte offset"). `fwd_launches` / `bwd_launches`
choose the kernels, compile or load them, check the grid, and fill a Params struct once; what is
left for each call is writing the slot pointers into it and calling cuLaunchKernel
(`Launch.fire`).
"""

from __future__ import annotations

import math
import threading
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
    + [(n, np.int32) for n in ("batch", "nheads", "nheads_kv", "head_group", "seqlen_q", "seqlen_k", "num_m_blocks",
                               "tail_heads")]
    + [("scale_log2", np.float32), ("mask", MASK_PARAMS)],
    align=True,
)

_FWD_CHECKS_PARAMS = (_compile.params_layout_checks("cuflash", "FwdParams", FWD_PARAMS) + "\n"
                      + _MASK_CHECKS_PARAMS)


def _with_maps(base: np.dtype, names, ints=(), ptrs=()) -> np.dtype:
    """base's fields at their offsets, then int32 fields `ints`, then pointer fields `ptrs` (8-byte
    aligned), then one 128-byte tensor map per name, each 64-byte aligned (a C++ struct deriving from
    base with those int, pointer and TmaDesc members)."""
    fields = [(n, base.fields[n][0], base.fields[n][1]) for n in base.names]
    off = base.itemsize
    for n in ints:
        fields.append((n, np.dtype(np.int32), off))
        off += 4
    if ptrs:
        off = -(-off // 8) * 8
    for n in ptrs:
        fields.append((n, np.dtype(np.uint64), off))
        off += 8
    off = -(-off // 64) * 64
    for n in names:
        fields.append((n, np.dtype((np.uint8, 128)), off))
        off += 128
    return np.dtype({"names": [f[0] for f in fields], "formats": [f[1] for f in fields],
                     "offsets": [f[2] for f in fields], "itemsize": -(-off // 64) * 64})


# Mirror of cuflash::FwdTmaParams (cuda_src/flash_fwd_sm90.cu): FwdParams, d_cols, then the maps of K and V.
FWD_TMA_PARAMS = _with_maps(FWD_PARAMS, ("map_k", "map_v"), ints=("d_cols",))
_FWD_TMA_CHECKS_PARAMS = (_compile.params_layout_checks("cuflash", "FwdTmaParams", FWD_TMA_PARAMS) + "\n"
                          + _FWD_CHECKS_PARAMS)

# Mirror of cuflash::FwdWsParams (cuda_src/flash_fwd_sm90_ws.cu): FwdParams, d_cols, the split tail's
# first tile, parts and chunk, a paged cache's page size, box rows, table stride and columns and page
# count, the persistent grid's work lists (sched), the split workspace and the block table, then the
# maps of Q, K, V.
FWD_WS_PARAMS = _with_maps(FWD_PARAMS, ("map_q", "map_k", "map_v"),
                           ints=("d_cols", "split_first", "split_parts", "split_chunk", "page_size", "page_box",
                                 "table_stride", "table_cols", "num_pages"),
                           ptrs=("sched", "split_ws", "block_table"))
_FWD_WS_CHECKS_PARAMS = (_compile.params_layout_checks("cuflash", "FwdWsParams", FWD_WS_PARAMS) + "\n"
                         + _FWD_CHECKS_PARAMS)

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

# Mirror of cuflash::BwdTmaParams (cuda_src/bwd_tma_params.cuh): BwdParams, tile_heads, then the maps of
# Q, dO, K, V.
BWD_TMA_PARAMS = _with_maps(BWD_PARAMS, ("map_q", "map_do", "map_k", "map_v"), ints=("tile_heads", "d_cols", "tail_heads"))
_BWD_TMA_CHECKS_PARAMS = (_compile.params_layout_checks("cuflash", "BwdTmaParams", BWD_TMA_PARAMS) + "\n"
                          + _BWD_CHECKS_PARAMS)

# Mirror of cuflash::TailParams (cuda_src/varlen.cu).
TAIL_PARAMS = np.dtype(
    [("ptr", np.uint64), ("row_stride", np.int64), ("head_stride", np.int64), ("cu_seqlens", np.uint64)]
    + [(n, np.int32) for n in ("batch", "max_seqlen", "total_rows", "nheads", "row_elems")] + [("fill", np.uint32)],
    align=True,
)

_TAIL_CHECKS_PARAMS = _compile.params_layout_checks("cuflash", "TailParams", TAIL_PARAMS)

# Mirror of cuflash::DecodeParams (cuda_src/flash_decode.cu): what a decode block reads first, then
# the mask, then the rest (the struct's order; the compiled layout checks hold the two together).
DECODE_PARAMS = np.dtype(
    [(n, np.int32) for n in ("num_splits", "num_row_tiles", "nheads_kv", "head_group", "rows", "seqlen_q", "capacity",
                             "page_size", "fixed_seqlen", "seqlen_new", "cache_rows", "page_tiles", "cluster_merge",
                             "batch")]
    + [(n, np.uint64) for n in ("cache_seqlens", "cache_batch_idx", "block_table")]
    + [("table_stride", np.int64)]
    + [(n, np.uint64) for n in ("split_counters", "seq", "q")]
    + [(f"q_{s}_stride", np.int64) for s in ("batch", "row", "head")]
    + [("scale_log2", np.float32), ("tail_first", np.int32), ("mask", MASK_PARAMS)]
    + [(n, np.int32) for n in ("nheads", "head_dim")]
    + [(n, np.uint64) for n in ("k", "v", "o", "lse", "o_part", "lse_part", "k_new", "v_new", "started")]
    + [(f"{t}_{s}_stride", np.int64) for t in ("k", "v", "o", "kn", "vn") for s in ("batch", "row", "head")]
    + [("kv_lengths", np.uint64), ("late_issue", np.int32)],
    align=True,
)

_DECODE_CHECKS_PARAMS = _compile.params_layout_checks("cuflash", "DecodeParams", DECODE_PARAMS)

# Mirror of cuflash::DecodeTmaParams (cuda_src/flash_decode.cu): DecodeParams, then the maps of the K
# and V caches.
DECODE_TMA_PARAMS = _with_maps(DECODE_PARAMS, ("map_k", "map_v"))
_DECODE_TMA_CHECKS_PARAMS = (_compile.params_layout_checks("cuflash", "DecodeTmaParams", DECODE_TMA_PARAMS) + "\n"
                             + _DECODE_CHECKS_PARAMS)

# Mirror of cuflash::GatherParams (cuda_src/paged_gather.cu).
GATHER_PARAMS = np.dtype(
    [(n, np.uint64) for n in ("src", "dst", "src_v", "dst_v", "block_table", "cu_seqlens_k", "cu_out",
                              "cache_seqlens", "lengths_out", "new_k", "new_v")]
    + [(f"{t}_{s}_stride", np.int64) for t in ("src", "srcv") for s in ("block", "row", "head")]
    + [("dst_row_stride", np.int64), ("dst_head_stride", np.int64)]
    + [(f"{t}_{s}_stride", np.int64) for t in ("newk", "newv") for s in ("batch", "row", "head")]
    + [("table_stride", np.int64)]
    + [(n, np.int32) for n in ("batch", "max_seqlen_k", "num_blocks", "page_size", "nheads_kv", "head_dim",
                               "total_rows", "tiles", "fixed_seqlen", "seqlen_new")],
    align=True,
)

_GATHER_CHECKS_PARAMS = _compile.params_layout_checks("cuflash", "GatherParams", GATHER_PARAMS)

_DTYPE_TAG = {"float16": ("f16", "cuflash::f16"), "bfloat16": ("bf16", "cuflash::bf16")}

MAX_GRID_X = 2**31 - 1


@dataclass(frozen=True)
class Slot:
    """A pointer known only at run time: the index-th pointer of the call, plus `add` bytes."""

    index: int
    add: int = 0

    def __add__(self, nbytes: int) -> "Slot":
        return Slot(self.index, self.add + nbytes)


@dataclass(frozen=True)
class DeviceTensor:
    ptr: "int | Slot"
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in elements


@dataclass(frozen=True)
class MaskArgs:
    """What the feature kernels read beyond the plain call (cuda_src/mask.cuh: MaskParams): device
    pointers (0 = absent) and scalars, validated by the caller. A packed batch (cu_seqlens_q != 0)
    hands the launchers q / k / v / out as 4-D views (batch, max_seqlen, heads, head_dim) with batch
    stride 0, and total_q / total_k rows in the arrays."""

    cu_seqlens_q: "int | Slot" = 0   # pointers: 0 = absent
    cu_seqlens_k: "int | Slot" = 0
    q_lengths: "int | Slot" = 0
    kv_lengths: "int | Slot" = 0
    alibi_slopes: "int | Slot" = 0
    alibi_batch_stride: int = 0
    sink_logits: "int | Slot" = 0
    dsink_rows: "int | Slot" = 0   # backward with sink logits: (batch, nheads, seqlen_q_pad) float32
    window_left: int = -1
    window_right: int = -1
    num_sink_tokens: int = 0
    softcap: float = 0.0
    total_q: int = 0
    total_k: int = 0

    @property
    def packed(self) -> bool:
        return self.cu_seqlens_q != 0


_MASK_PTRS = ("cu_seqlens_q", "cu_seqlens_k", "q_lengths", "kv_lengths", "alibi_slopes", "sink_logits", "dsink_rows")


def _set_mask(p, m: MaskArgs, softmax_scale: float, nheads: int, seqlen_q: int) -> dict:
    """Fills p["mask"]; returns the pointer fields ("mask.name" -> int | Slot) for `_Params`."""
    pm = p["mask"]
    for name in ("alibi_batch_stride", "window_left", "window_right", "num_sink_tokens", "total_q", "total_k"):
        pm[name] = getattr(m, name)
    if m.packed:  # lse (nheads, total_q)
        pm["lse_batch_stride"], pm["lse_head_stride"] = 0, m.total_q
    else:         # lse (batch, nheads, seqlen_q)
        pm["lse_batch_stride"], pm["lse_head_stride"] = nheads * seqlen_q, seqlen_q
    if m.softcap > 0:
        pm["softcap"] = m.softcap
        pm["softcap_pre"] = softmax_scale / m.softcap
        pm["softcap_log2"] = m.softcap * LOG2E
    return {f"mask.{name}": getattr(m, name) for name in _MASK_PTRS}


def fwd_specialization(dtype: str, head_dim: int, cfg: _config.TileConfig, causal: bool, even: bool,
                       feat: bool = False, tma: bool = False):
    """feat: the kernel with the optional features (cuda_src/mask.cuh); causal and even are then
    run-time properties of the mask and must be False. tma: the wgmma kernel's TMA variant (plain
    calls; cuflash/_config.py fwd_tma_mode), whose Params are FwdTmaParams."""
    short, ctype = _DTYPE_TAG[dtype]
    smem = _config.fwd_smem_bytes(head_dim, cfg) + (_config.fwd_tma_bar_bytes(head_dim) if tma else 0)
    flags = f"{'true' if causal else 'false'}, {'true' if even else 'false'}"
    suffix = f"_{'causal' if causal else 'full'}_{'even' if even else 'ragged'}"
    if tma:
        assert cfg.wgmma and not feat, (cfg, feat)
        flags += ", false, true"
        suffix += "_tma"
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
        _FWD_TMA_CHECKS_PARAMS if tma else _FWD_CHECKS_PARAMS,
        f"static_assert({traits}::SMEM_BYTES{f' + {traits}::TMA_BAR_BYTES' if tma else ''} == {smem},"
        f' "shared memory size differs from cuflash/_config.py:fwd_smem_bytes");',
    ])
    return _compile.Specialization(source, expr, name, checks), smem


def fwd_ws_specialization(dtype: str, head_dim: int, causal: bool, even: bool, block_n: int, stages: int,
                          pingpong: bool = False, consumers: int = 2, feat: bool = False, persistent: bool = False,
                          split: bool = False, paged: bool = False, ilv: bool = False):
    """(spec, smem) of the warp-specialized sm_90a forward (cuda_src/flash_fwd_sm90_ws.cu); pingpong:
    its schedule that alternates the two consumers at the tensor cores; consumers: 2 or 3 warpgroups
    of 64 query rows; feat: the optional features (causal and even must then be False); persistent:
    one block per SM walking the query blocks (plain calls); split (persistent, non-causal): on a work
    list whose last tiles may come cut along their key tiles (cuflash/_schedule.py split_schedule);
    paged (feat): K and V read from paged caches through a block table (FwdWsParams, PAGED); ilv (paged,
    head_dim 128 or 256): in boxes of whole rows, K into the interleaved layout and V group-major (ILV;
    paged_interleaved)."""
    short, ctype = _DTYPE_TAG[dtype]
    bn = block_n
    assert not (feat and persistent) and not (split and (causal or not persistent)) and not (paged and not feat)
    assert not ilv or (paged and head_dim >= 128)
    smem = _config.fwd_ws_smem_bytes(head_dim, bn, stages, consumers, persistent)
    flags = f"{'true' if causal else 'false'}, {'true' if even else 'false'}, {'true' if pingpong else 'false'}"
    expr = f"cuflash::flash_fwd_sm90_ws_kernel<{ctype}, {head_dim}, {bn}, {stages}, {flags}, {consumers}"
    expr += (", true, false, false, true, true>" if ilv else ", true, false, false, true>" if paged
             else ", true>" if feat else ", false, true, true>" if split else ", false, true>" if persistent else ">")
    kind = "feat" if feat else f"{'causal' if causal else 'full'}_{'even' if even else 'ragged'}"
    assert not (feat and (causal or even)), (causal, even)
    name = (f"fwd90ws_{short}_d{head_dim}_m{64 * consumers}_n{bn}_s{stages}_{kind}{'_pp' if pingpong else ''}"
            f"{'_pers' if persistent else ''}{'_split' if split else ''}{'_paged' if paged else ''}"
            f"{'_ilv' if ilv else ''}")
    pers = ", true" if persistent else ""
    checks = "\n".join([
        _FWD_WS_CHECKS_PARAMS,
        f"static_assert(cuflash::FwdWsTraits<{head_dim}, {bn}, {stages}, {consumers}{pers}>::SMEM_BYTES == {smem},"
        f' "shared memory size differs from cuflash/_config.py:fwd_ws_smem_bytes");',
    ])
    return _compile.Specialization("flash_fwd_sm90_ws.cu", expr, name, checks), smem


def all_fwd_ws_specializations(target: str, head_dims=None, dtypes=None, causal=(False, True),
                               pingpong=None, persistent=None):
    """The warp-specialized forward wherever cuflash/_config.py fwd_ws_config selects it, in its
    schedule (pingpong / persistent None) or in those of `pingpong` / `persistent` (the compile gate
    takes both); none on targets other than sm_90a."""
    if target != "sm_90a":
        return []
    out = []
    dims = list(head_dims or _config.HEAD_DIMS)
    # Pad-up (_config.fwd_pad_head_dim): a head_dim's calls may run the kernels of a larger one.
    dims += [p for p in (_config.fwd_pad_head_dim(target, d, plain=True) for d in dims) if p is not None and p not in dims]
    for dtype in dtypes or _config.DTYPES:
        for d in dict.fromkeys(dims):
            for c in causal:
                if persistent is not None:
                    grids = persistent
                else:  # the grids the dispatcher can pick under the current setting
                    grids = (False,) + ((True,) if _config.fwd_ws_persistent_config(d, c) is not None else ())
                for ps in grids:
                    cfg = _config.FWD_WS_PERSISTENT_TABLE.get((d, c)) if ps else _config.fwd_ws_config(d, c)
                    # (persistent non-causal: also the split kernels, where split_schedule may pick them)
                    splits = (False, True) if ps and not c and (persistent is not None or _config.fwd_split()) else (False,)
                    if cfg is not None:
                        out += [fwd_ws_specialization(dtype, d, c, e, cfg[0], cfg[1], pp, cfg[3], persistent=ps, split=sp)
                                for pp in (pingpong if pingpong is not None else (cfg[2],)) for e in (False, True)
                                for sp in splits if not (pp and cfg[3] != 2)]
            fcfg = _config.fwd_ws_feat_config(d, False)
            if fcfg is not None:  # (and its twins for paged caches: PagedKV; from head_dim 128 two layouts)
                out += [fwd_ws_specialization(dtype, d, False, False, *fcfg, feat=True, paged=pg, ilv=il)
                        for pg, il in ((False, False), (True, False), (True, True)) if not il or d >= 128]
    return out


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


def all_fwd_tma_specializations(target: str, head_dims=None, dtypes=None, causal=(False, True)):
    """The TMA variants of the sm_90a forward (plain calls; cuflash/_config.py fwd_tma_mode): every
    plain wgmma forward whose head_dim a tensor map can carry (a multiple of 64), and that of 64 for
    the head dims that pad up to it (_config.fwd_pad_tma), in the tiles of each length they run at. None
    on other targets."""
    out = []
    dims = list(head_dims or _config.HEAD_DIMS)
    # The lengths where a tile or the pad-up starts: each span of lengths they keep opens at one.
    lengths = sorted({1, _config.FWD_TMA_CAUSAL_WIDE_SEQLEN_K}
                     | {lo for lo, _ in _config.FWD_PAD_SMALL_TMA_SEQLEN_K.values()})
    for dtype in dtypes or _config.DTYPES:
        for d in dims:
            for c in causal:
                for sk in lengths:
                    if d % 64 == 0:
                        kd, cfg = d, _config.fwd_tma_config_for_target(target, d, dtype, c, sk)
                    elif _config.fwd_pad_tma(target, d, c, sk):
                        kd, cfg = 64, _config.fwd_pad_tma_config(target, d, dtype, c, sk)
                    else:
                        continue
                    if cfg.wgmma:
                        out += [fwd_specialization(dtype, kd, cfg, c, e, tma=True) for e in (False, True)]
    return list({spec.expression: (spec, smem) for spec, smem in out}.values())


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
    return (False, True) if _config.feat_kernel_atomic(target, head_dim) else (False,)


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
    # Head_dim 256 on sm_90a: the warp-specialized kernel (flash_bwd_sm90_ws256.cu) adds dQ into the
    # scratch; where it cannot run (a layout TMA cannot map), the mma.sync kernel's atomic path does.
    if target == "sm_90a" and _config.bwd_ws_mode() != "off" and (
            head_dim == 256 or _config.bwd_pad_head_dim(target, head_dim) is not None):
        return True
    return _config.BWD_ATOMIC_DQ


def bwd_ws_specializations(dtype: str, head_dim: int, causal: bool, even: bool,
                           stages: int = _config.BWD_WS_STAGES, block_m: int | None = None, feat: bool = False,
                           call_dim: int | None = None, seqs: bool = False, dq_red: bool | None = None):
    """The warp-specialized sm_90a backward's launches, in order (cuda_src/flash_bwd_sm90_ws.cu):
    the preprocess (zeroing dq_accum), the kernel (Params BwdTmaParams: Q / dO maps with block_m-row
    boxes, K / V with 128), and the conversion of its permuted dq_accum. even: seqlen_q % block_m
    == 0 and seqlen_k % 128 == 0. block_m: _config.bwd_ws_block_m by default. feat: the kernel with
    the options (windows, sinks, ALiBi; causal and even then False) after the feature preprocess.
    call_dim: the call's head_dim under pad-up (_config.bwd_pad_head_dim; head_dim is then the
    kernel's): the preprocess reads call_dim columns and zeroes head_dim-wide accumulator rows, the
    conversion writes call_dim columns. seqs (with feat): per-sequence lengths, a padded or a packed
    batch (the kernel's SEQS; the conversion then places each sequence's rows). dq_red: dQ added from
    registers (the kernel's DQ_RED; _config.bwd_ws_dq_red by default)."""
    short, ctype = _DTYPE_TAG[dtype]
    if dq_red is None:
        dq_red = _config.bwd_ws_dq_red(head_dim, seqs)
    assert head_dim in _config.BWD_WS_HEAD_DIMS, head_dim
    assert not (feat and (causal or even)), (causal, even)
    assert not (feat and head_dim not in _config.BWD_WS_FEAT_HEAD_DIMS), head_dim
    assert feat or not seqs
    m = block_m or _config.bwd_ws_block_m(head_dim)
    n = _config.bwd_ws_block_n(head_dim)
    if feat and (call_dim is None or call_dim == head_dim):
        pre = _compile.Specialization(
            "flash_bwd.cu", f"cuflash::flash_bwd_preprocess_kernel<{ctype}, {head_dim}, true, true>",
            f"bwd_pre_{short}_d{head_dim}_zero_dq_feat", _BWD_CHECKS_PARAMS)
    elif call_dim is not None and call_dim != head_dim:
        assert call_dim < head_dim, (call_dim, head_dim)
        pre = _compile.Specialization(
            "flash_bwd.cu", f"cuflash::flash_bwd_preprocess_kernel<{ctype}, {call_dim}, true, {_b(feat)}, {head_dim}>",
            f"bwd_pre_{short}_d{call_dim}_zero_dq{head_dim}{'_feat' if feat else ''}", _BWD_CHECKS_PARAMS)
    else:
        pre = _compile.Specialization(
            "flash_bwd.cu", f"cuflash::flash_bwd_preprocess_kernel<{ctype}, {head_dim}, true>",
            f"bwd_pre_{short}_d{head_dim}_zero_dq", _BWD_CHECKS_PARAMS)
    smem = _config.bwd_ws_smem_bytes(head_dim, stages, m, dq_red)
    kind = ("feat_seqs" if seqs else "feat") if feat else f"{'causal' if causal else 'full'}_{'even' if even else 'ragged'}"
    if head_dim == 256:
        traits = f"cuflash::BwdWs256Traits<{stages}>"
        source = "flash_bwd_sm90_ws256.cu"
        expr = (f"cuflash::flash_bwd_sm90_ws256_kernel<{ctype}, {_b(causal)}, {_b(even)}, {stages}"
                + ((", true, true>" if seqs else ", true>") if feat else ">"))
    else:
        traits = f"cuflash::BwdWsTraits<{head_dim}, {m}, {stages}" + (", true>" if dq_red else ">")
        source = "flash_bwd_sm90_ws.cu"
        expr = (f"cuflash::flash_bwd_sm90_ws_kernel<{ctype}, {head_dim}, {m}, {_b(causal)}, {_b(even)}, {stages}"
                + (f", {_b(feat)}, {_b(seqs)}, true>" if dq_red else
                   (", true, true>" if seqs else ", true>") if feat else ">"))
    ws = _compile.Specialization(
        source, expr, f"bwd90ws_{short}_d{head_dim}_m{m}_s{stages}_{kind}" + ("_red" if dq_red else "") + "_tma",
        _BWD_TMA_CHECKS_PARAMS + "\n" +
        f'static_assert({traits}::SMEM_BYTES == {smem}, "shared memory size differs from cuflash/_config.py:bwd_ws_smem_bytes");')
    part = head_dim if m == 128 else head_dim // 2  # BwdWsTraits::DQ_N (BwdWs256Traits::COLS)
    out_dim = call_dim if call_dim is not None else head_dim
    conv = _compile.Specialization(
        "flash_bwd.cu",
        f"cuflash::flash_bwd_convert_dq_kernel<{ctype}, {head_dim}, {_b(seqs)}, {part}, {m}"
        + (f", {out_dim}>" if out_dim != head_dim else ">"),
        f"bwd_convert_dq_{short}_d{head_dim}_perm{m}" + (f"_to{out_dim}" if out_dim != head_dim else "")
        + ("_feat" if seqs else ""), _BWD_CHECKS_PARAMS)
    return [(pre, 0, None), (ws, smem, _config.TileConfig(m, n, 8, wgmma=True)), (conv, 0, None)]


def _dq_red_variants(head_dim: int, seqs: bool, tuning: bool) -> tuple:
    """The default dQ path of the warp-specialized backward (_config.bwd_ws_dq_red); with tuning, also
    the bulk reductions where the default adds from registers."""
    red = _config.bwd_ws_dq_red(head_dim, seqs)
    return (True, False) if red and tuning else (red,)


def all_bwd_ws_specializations(target: str, head_dims=None, dtypes=None, causal=(False, True),
                               stages=(_config.BWD_WS_STAGES,), tuning=False):
    """Every specialization of the warp-specialized backward (sm_90a only), optionally only those of
    some head dims, dtypes, causal values, ring depths (where they fit); tuning: also BLOCK_M 64 at
    head_dim 64 (CUFLASH_BWD_WS_BLOCK_M=64), and dQ by bulk reductions where the default adds it
    from registers (CUFLASH_BWD_DQ_RED=0)."""
    if target != "sm_90a":
        return []
    seen = {}
    for dtype in dtypes or _config.DTYPES:
        for d in _config.BWD_WS_HEAD_DIMS:
            if head_dims is not None and d not in head_dims:
                continue
            for c in causal:
                for e in (False, True):
                    for st in stages:
                        for m in sorted({_config.BWD_WS_BLOCK_M[d], 64 if tuning and d != 256 else _config.BWD_WS_BLOCK_M[d]}):
                            for red in _dq_red_variants(d, False, tuning):
                                if _config.bwd_ws_smem_bytes(d, st, m, red) > _config.SMEM_LIMIT["sm90"]:
                                    continue
                                for spec, smem, _ in bwd_ws_specializations(dtype, d, c, e, st, m, dq_red=red):
                                    seen.setdefault(spec.expression, (spec, smem))
            if d not in _config.BWD_WS_FEAT_HEAD_DIMS:
                continue
            m = _config.BWD_WS_BLOCK_M[d]
            for seqs in (False, True):
                st = _config.bwd_ws_stages(d, m, seqs)
                for red in _dq_red_variants(d, seqs, tuning):
                    for spec, smem, _ in bwd_ws_specializations(dtype, d, False, False, st, m, feat=True, seqs=seqs,
                                                                dq_red=red):
                        seen.setdefault(spec.expression, (spec, smem))
        # Pad-up (_config.bwd_pad_head_dim): the other head dims' preprocess and conversion around the
        # kernel of the next supported head_dim (the kernels themselves are those above).
        for cd in _config.HEAD_DIMS:
            d = _config.bwd_pad_head_dim(target, cd)
            if d is None or (head_dims is not None and cd not in head_dims):
                continue
            m = _config.BWD_WS_BLOCK_M[d]
            for c in causal:
                for e in (False, True):
                    for spec, smem, _ in bwd_ws_specializations(dtype, d, c, e, _config.bwd_ws_stages(d, m), m,
                                                                call_dim=cd):
                        seen.setdefault(spec.expression, (spec, smem))
            if d in _config.BWD_WS_FEAT_HEAD_DIMS:
                for seqs in (False, True):
                    st = _config.bwd_ws_stages(d, m, seqs)
                    for spec, smem, _ in bwd_ws_specializations(dtype, d, False, False, st, m, feat=True, call_dim=cd,
                                                                seqs=seqs):
                        seen.setdefault(spec.expression, (spec, smem))
    return list(seen.values())


def bwd_specializations(dtype: str, head_dim: int, target: str, causal: bool, even_kv: bool, even_q: bool,
                        atomic: bool, cfg: _config.TileConfig | None = None, feat: bool = False, tma: bool = False):
    """The backward kernels one call launches, in order: [(Specialization, smem bytes, TileConfig)].

    even_kv / even_q: whether the lengths are multiples of the dK/dV and dQ kernels' tiles.
    atomic: dQ by float atomics in the dK/dV kernel (then a conversion kernel), or by the separate,
    deterministic dQ kernel. cfg overrides the dK/dV tile table (tuning scripts only).
    feat: the kernels with the optional features (causal and even_* must be False; atomic only with
    the sm_90a wgmma dK/dV kernel). tma: the wgmma dK/dV kernel's TMA variant (plain calls,
    CUFLASH_BWD_TMA=1), whose Params are BwdTmaParams."""
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
    if tma:
        assert cfg.wgmma and not feat, (cfg, feat)
        flags += ", false, true"
        suffix += "_tma"
        smem += _config.BWD_TMA_BAR_BYTES
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
        (_BWD_TMA_CHECKS_PARAMS if tma else _BWD_CHECKS_PARAMS) + "\n" +
        f"static_assert({traits}::SMEM_BYTES{f' + {traits}::TMA_BAR_BYTES' if tma else ''} == {smem},"
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


def bwd_single_specialization(dtype: str, head_dim: int, target: str, causal: bool, even: bool):
    """The one-launch backward (flash_bwd.cu's dK/dV kernel with SINGLE) on the mma.sync tiles of the
    target's family: (Specialization, smem bytes, TileConfig)."""
    short, ctype = _DTYPE_TAG[dtype]
    cfg = _config.bwd_single_config(_config.family_of_target(target), head_dim, dtype)
    smem = _config.bwd_smem_bytes(head_dim, cfg)
    traits = f"cuflash::BwdTraits<{head_dim}, {cfg.block_m}, {cfg.block_n}, {cfg.warps}>"
    spec = _compile.Specialization(
        "flash_bwd.cu",
        f"cuflash::flash_bwd_dkdv_kernel<{ctype}, {head_dim}, {cfg.block_m}, {cfg.block_n}, {cfg.warps}, "
        f"{_b(causal)}, {_b(even)}, false, false, true>",
        f"bwd_single_{short}_d{head_dim}_m{cfg.block_m}_n{cfg.block_n}_w{cfg.warps}"
        f"_{'causal' if causal else 'full'}_{'even' if even else 'ragged'}",
        _BWD_CHECKS_PARAMS + "\n" +
        f"static_assert({traits}::SMEM_BYTES == {smem},"
        f' "shared memory size differs from cuflash/_config.py:bwd_smem_bytes");')
    return spec, smem, cfg


def bwd_uses_single(target: str | None, head_dim: int, dtype: str, batch: int, nheads: int, seqlen_q: int,
                    seqlen_k: int) -> bool:
    """Whether a plain backward call runs as one launch (bwd_single_specialization;
    _config.BWD_SINGLE_MAX_ROWS, bwd_single_mode): its keys fit one block of the kernel's tiles."""
    mode = _config.bwd_single_mode()
    if target is None or mode == "off" or seqlen_q < 1 or seqlen_k < 1 or head_dim < _config.BWD_SINGLE_MIN_HEAD_DIM:
        return False
    if seqlen_k > _config.bwd_single_config(_config.family_of_target(target), head_dim, dtype).block_n:
        return False
    return mode == "force" or batch * nheads * seqlen_q <= _config.BWD_SINGLE_MAX_ROWS


def all_bwd_single_specializations(target: str, head_dims=None, dtypes=None, causal=(False, True)):
    """The one-launch backward for every (dtype, head_dim from BWD_SINGLE_MIN_HEAD_DIM, causal, even)
    of a compile target."""
    return [bwd_single_specialization(dtype, d, target, c, e)[:2] for dtype in dtypes or _config.DTYPES
            for d in head_dims or _config.HEAD_DIMS if d >= _config.BWD_SINGLE_MIN_HEAD_DIM
            for c in causal for e in (False, True)]


def bwd_atomic_choices(target: str, head_dim: int) -> tuple[bool, ...]:
    """The dQ paths the dispatcher can select for (target, head_dim): the deterministic one always,
    the atomic one where a non-deterministic call takes it."""
    return (False, True) if _mma_bwd_atomic(target, head_dim) else (False,)


def _mma_bwd_atomic(target: str, head_dim: int) -> bool:
    """Whether the dK/dV kernels other than the warp-specialized ones add dQ by atomics on a
    non-deterministic call: the sm_90a wgmma kernel always, the mma.sync kernel as BWD_ATOMIC_DQ
    says. (A call whose plan reserved the accumulator for the warp-specialized kernel, at head_dim
    256 or under pad-up, but whose layout keeps it off that kernel takes the separate dQ pass.)"""
    return _config.bwd_config_for_target(target, head_dim, "float16").wgmma or _config.BWD_ATOMIC_DQ


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


def all_bwd_tma_specializations(target: str):
    """The TMA variants of the sm_90a dK/dV kernel (CUFLASH_BWD_TMA=1) for every plain wgmma
    backward: each (dtype, head_dim, causal, even, dQ path); none on other targets."""
    out = []
    for dtype in _config.DTYPES:
        for d in _config.HEAD_DIMS:
            if not _config.bwd_config_for_target(target, d, dtype).wgmma:
                continue
            for c in (False, True):
                for e in (False, True):
                    for a in bwd_atomic_choices(target, d):
                        spec, smem, _ = bwd_specializations(dtype, d, target, c, e, e, a, tma=True)[1]
                        out.append((spec, smem))
    return out


def _field_offsets(dtype: np.dtype, prefix: str = "", base: int = 0) -> dict:
    """Byte offset of every field, nested structs as "mask.name"."""
    out = {}
    for name in dtype.names:
        sub, off = dtype.fields[name][:2]
        if sub.names:
            out.update(_field_offsets(sub, f"{prefix}{name}.", base + off))
        else:
            out[prefix + name] = base + off
    return out


_OFFSETS = {}


def _offsets(dtype: np.dtype) -> dict:
    o = _OFFSETS.get(dtype)
    if o is None:
        o = _OFFSETS[dtype] = _field_offsets(dtype)
    return o


class Launch:
    """One kernel launch, prepared: the loaded function, grid, block, shared memory, and the Params
    bytes with every pointer that varies per call left as a (word, slot, byte offset) patch.

    `fire(stream, ptrs)` writes ptrs[slot] + offset into each patched word and calls cuLaunchKernel,
    which copies the argument bytes at the call, so one buffer serves every launch. Launches of one
    plan may share a buffer (`share_params`): then the first patches it and the others only set the
    int32 fields in which they differ (`sets`). The caller serializes fires of one plan (a plan
    holds a lock around its launches)."""

    __slots__ = ("name", "fn", "grid", "threads", "smem", "words", "ints", "argv", "argv_ptr", "patches", "sets",
                 "device_id", "pdl", "ex", "cluster")

    def __init__(self, name: str, fn_ptr: int, grid: int, threads: int, smem: int, params: np.ndarray,
                 pointers: dict, device_id: int):
        offsets = _offsets(params.dtype)
        patches = []
        for field, value in pointers.items():
            if isinstance(value, Slot):
                patches.append((offsets[field] // 8, value.index, value.add))
                value = 0
            _assign(params, field, value)
        self.name, self.fn, self.grid, self.threads, self.smem = name, fn_ptr, grid, threads, smem
        self.device_id = device_id
        # The struct's bytes as uint64 words (every pointer field is 8-byte aligned), owned here.
        self.words = np.frombuffer(bytearray(params.tobytes()), dtype=np.uint64)
        self.ints = self.words.view(np.int32)
        self.argv = np.array([self.words.ctypes.data], dtype=np.uint64)  # void* kernelParams[1]
        self.argv_ptr = int(self.argv.ctypes.data)
        self.patches = tuple(patches)
        self.sets = ()
        self.pdl = None  # a PdlConfig: launched through cuLaunchKernelEx as a programmatic dependent
        self.ex = None   # a PdlConfig without the PDL attribute (a cluster launch): every plain launch goes through it
        self.cluster = 1  # blocks per cluster (set_cluster)

    def fire(self, stream: int, ptrs, pdl: bool = True) -> None:
        """pdl=False: the plain launch even where the launch has a PdlConfig."""
        if self.sets:
            ints = self.ints
            for i, value in self.sets:
                ints[i] = value
        words = self.words
        for word, slot, add in self.patches:
            words[word] = ptrs[slot] + add
        if pdl and self.pdl is not None:
            self.pdl.launch(stream)
        elif self.ex is not None:
            self.ex.launch(stream)
        else:
            _launch_kernel(self.fn, self.grid, 1, 1, self.threads, 1, 1, self.smem, stream, self.argv_ptr, 0)


class PdlConfig:
    """A CUlaunchConfig for cuLaunchKernelEx through ctypes on libcuda, with the attributes:
    - CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION (cuda.h; pdl=True): the kernel may start
      while the kernel before it in the stream finishes, once that one's blocks have all called
      pdl_launch_dependents (cuda_src/common.cuh) or exited, and waits for it with pdl_wait before it
      reads what that one wrote. Saves the gap between a kernel's end and the next one's start
      (launch, block scheduling, prologue).
    - CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION (cluster > 1): the grid runs in clusters of `cluster`
      consecutive blocks, each cluster on the SMs of one GPC, sharing their shared memory.
    Layout (64-bit): gridDim x/y/z, blockDim x/y/z, sharedMemBytes (7 x u32 at byte 0), hStream
    (byte 32), attrs (40), numAttrs (48); the attributes from byte 56, 72 bytes each: id (u32), 4
    bytes of padding, the 64-byte value union (programmaticStreamSerializationAllowed: a u32;
    clusterDim: x, y, z as u32)."""

    __slots__ = ("buf", "args")

    def __init__(self, grid: int, threads: int, smem: int, fn: int, argv_ptr: int, pdl: bool = True,
                 cluster: int = 1):
        import ctypes

        attrs = []
        if pdl:
            attrs.append((_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, (1,)))
        if cluster > 1:
            attrs.append((_CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION, (cluster, 1, 1)))
        buf = np.zeros(7 + 9 * max(1, len(attrs)), dtype=np.uint64)  # 56 bytes of config + 72 per attribute
        u32 = buf.view(np.uint32)
        u32[0:7] = (grid, 1, 1, threads, 1, 1, smem)
        buf[5] = buf.ctypes.data + 56  # attrs
        u32[12] = len(attrs)           # numAttrs
        for i, (ident, value) in enumerate(attrs):
            at = 14 + 18 * i           # the attribute's first u32
            u32[at] = ident
            u32[at + 2:at + 2 + len(value)] = value
        self.buf = buf
        # cuLaunchKernelEx's arguments, fixed for the launch (the stream goes into the config): made
        # once as ctypes objects, which the call passes without converting.
        self.args = (ctypes.c_void_p(int(buf.ctypes.data)), ctypes.c_void_p(fn), ctypes.c_void_p(argv_ptr), None)

    def launch(self, stream: int) -> None:
        self.buf[4] = stream
        rc = _launch_ex(*self.args)
        if rc:
            raise RuntimeError(f"cuLaunchKernelEx: {_error_name(rc)}")


def _error_name(rc: int) -> str:
    """The driver's name of a CUresult (cuGetErrorName), or its number."""
    import ctypes

    try:
        name = ctypes.c_char_p()
        if ctypes.CDLL("libcuda.so.1").cuGetErrorName(rc, ctypes.byref(name)) == 0 and name.value:
            return f"{name.value.decode()} ({rc})"
    except (OSError, AttributeError):
        pass
    return f"CUresult {rc}"


_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6
_CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4
_launch_ex = None  # libcuda's cuLaunchKernelEx (ctypes), loaded by launch_ex_available


def pdl_available(cc: tuple[int, int]) -> bool:
    """Whether launches on a device of compute capability `cc` may be programmatic dependents
    (PdlConfig): sm_90 or later, the driver exports cuLaunchKernelEx, and CUFLASH_PDL is not 0."""
    import os

    if cc < (9, 0) or os.environ.get("CUFLASH_PDL") == "0":
        return False
    return launch_ex_available()


def launch_ex_available() -> bool:
    """Whether the driver exports cuLaunchKernelEx (loaded once, through ctypes)."""
    global _launch_ex
    if _launch_ex is None:
        import ctypes

        try:
            fn = ctypes.CDLL("libcuda.so.1").cuLaunchKernelEx
        except (OSError, AttributeError):
            _launch_ex = False
            return False
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        fn.restype = ctypes.c_int
        _launch_ex = fn
    return bool(_launch_ex)


def as_pdl(launches: list, cc: tuple[int, int]) -> list:
    """Sets every launch of the list to launch as a programmatic dependent, where pdl_available.
    Only for kernels that call pdl_wait before their first read of an earlier kernel's output and
    before their first global write (cuda_src/common.cuh). After share_params, if at all: the
    config keeps the launch's argument pointer. The plan chooses per call whether the config is
    used (run_launches' pdl; DecodePlan.run: in a graph capture)."""
    if pdl_available(cc):
        for L in launches:
            L.pdl = PdlConfig(L.grid, L.threads, L.smem, L.fn, L.argv_ptr, cluster=L.cluster)
    return launches


_CLUSTER_FITS: dict = {}  # (function, threads, smem, cluster) -> the most clusters resident at once


def _max_active_clusters(fn: int, grid: int, threads: int, smem: int, cluster: int) -> int:
    """How many clusters of `cluster` blocks of the function can be resident at once on the current
    device (the driver's cuOccupancyMaxActiveClusters, ctypes on libcuda); 0 where the driver refuses."""
    import ctypes

    lib = ctypes.CDLL("libcuda.so.1")
    cfg = PdlConfig(grid, threads, smem, fn, 0, pdl=False, cluster=cluster)
    n = ctypes.c_int(0)
    lib.cuOccupancyMaxActiveClusters.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    rc = lib.cuOccupancyMaxActiveClusters(ctypes.byref(n), ctypes.c_void_p(fn),
                                          ctypes.c_void_p(int(cfg.buf.ctypes.data)))
    return n.value if rc == 0 else 0


def cluster_fits(launch: "Launch") -> bool:
    """Whether every cluster of a cluster launch (set_cluster) is resident at once: grid / cluster
    clusters at most what the driver says fit (cached per function, block, shared memory and cluster
    size). A grid of more clusters than that runs in waves: on an H200 (session 31; the driver's
    answer for the 4-warp TMA kernel at head_dim 128: 30 clusters of 8) 32 blocks of 512 keys in
    clusters of 8 (32 clusters) took 15.3 us per step against 10.5 for the fused combine, and 4 x 512 x
    8 in 8 splits with the dynamic shared memory raised to one block per SM (15 clusters of 8 fit
    then) 14.0 against 9.0 as launched (bench/dev/cluster_ab.py)."""
    key = (launch.fn, launch.threads, launch.smem, launch.cluster)
    n = _CLUSTER_FITS.get(key)
    if n is None:
        n = _CLUSTER_FITS[key] = _max_active_clusters(launch.fn, launch.grid, launch.threads, launch.smem,
                                                      launch.cluster)
    return launch.grid // launch.cluster <= n


def set_cluster(launch: "Launch", cluster: int) -> "Launch":
    """Makes every launch of `launch` a cluster launch of `cluster` consecutive blocks (cuLaunchKernelEx;
    launch_ex_available must hold, and the grid be a multiple of `cluster`). Before as_pdl."""
    assert launch.grid % cluster == 0 and launch_ex_available(), (launch.grid, cluster)
    launch.cluster = cluster
    launch.ex = PdlConfig(launch.grid, launch.threads, launch.smem, launch.fn, launch.argv_ptr, pdl=False,
                          cluster=cluster)
    return launch


class TmaLaunch(Launch):
    """A Launch whose Params also hold tensor maps (cuda_src/tma.cuh): `maps` lists (field, pointer
    (int or Slot), MapCache). Each fire writes the map of the call's pointer into the field's 16
    words: where the layout's MapPatch is known (cuflash/_tma.py), the template is written once and a
    fire sets the one word that holds the address; otherwise the cache encodes once per pointer."""

    __slots__ = ("maps", "patched")

    def __init__(self, name, fn_ptr, grid, threads, smem, params, pointers, device_id, maps):
        super().__init__(name, fn_ptr, grid, threads, smem, params, pointers, device_id)
        offsets = _offsets(params.dtype)
        self.maps, self.patched = [], []
        for field, ptr, cache in maps:
            word = offsets[field] // 8
            if not isinstance(ptr, Slot):  # a fixed pointer (tools and tests): its map now
                self.words[word:word + 16] = np.frombuffer(cache.get(ptr), dtype=np.uint64)
            elif cache.patch is not None:
                patch = cache.patch
                self.words[word:word + 16] = np.frombuffer(patch.template, dtype=np.uint64)
                self.patched.append((word + patch.word, ptr.index, ptr.add, patch.const, patch.shift))
            else:
                self.maps.append((word, ptr.index, ptr.add, cache))
        self.maps, self.patched = tuple(self.maps), tuple(self.patched)

    def fire(self, stream: int, ptrs, pdl: bool = True) -> None:
        words = self.words
        for word, slot, add, const, shift in self.patched:
            words[word] = (const + ((ptrs[slot] + add) >> shift)) & 0xFFFFFFFFFFFFFFFF
        for word, slot, add, cache in self.maps:
            words[word:word + 16] = np.frombuffer(cache.get(ptrs[slot] + add), dtype=np.uint64)
        super().fire(stream, ptrs, pdl)


class ScheduledLaunch(TmaLaunch):
    """A TmaLaunch whose Params also point to a read-only int32 table in device memory (the persistent
    forward's work lists, cuflash/_schedule.py). The table is copied to each stream the launch fires
    on, at its first fire there that is not captured into a graph: stream-ordered, so no
    synchronization, and no stream reads a copy that another may still be making. Until then the
    field stays 0 for that stream's fires and the kernel takes its own order (blocks.cuh
    persistent_tile), so a plan made while a graph is captured still runs, and such a graph keeps
    that order. The Params are set up again only when the stream changes (`armed`)."""

    __slots__ = ("table", "tables", "table_word", "armed")

    def __init__(self, name, fn_ptr, grid, threads, smem, params, pointers, device_id, maps, table, field="sched"):
        super().__init__(name, fn_ptr, grid, threads, smem, params, pointers, device_id, maps)
        self.table, self.tables = table, {}  # stream -> the table's copy there
        self.table_word = _offsets(params.dtype)[field] // 8
        self.armed = None  # the stream the Params are set up for

    def fire(self, stream: int, ptrs, pdl: bool = True) -> None:
        if stream != self.armed:
            self._arm(stream)
        TmaLaunch.fire(self, stream, ptrs, pdl)

    def _table_on(self, stream: int):
        """The table's copy on this stream (made now if there is none), or None while it captures."""
        mem = self.tables.get(stream)
        if mem is None:
            mem = _upload_table(self.device_id, self.table, stream)
            if mem is not None:
                self.tables[stream] = mem
        return mem

    def _arm(self, stream: int) -> None:
        mem = self._table_on(stream)
        self.words[self.table_word] = 0 if mem is None else mem.ptr
        self.armed = None if mem is None else stream


# The split workspace's counters (cuda_src/fwd_sm90_steps.cuh SPLIT_COUNTERS: int32, [split tile][warp]).
SPLIT_COUNTERS = 4096
# (device, stream) -> (allocation, bytes): the split forward's workspace, one a stream, shared by every
# plan on it (kernels on one stream run one after another, and each leaves the counters it used at
# zero); replaced by a larger one when a plan needs more. Replaced ones stay allocated in
# _SPLIT_OLD: a launch armed with one, or a captured graph, may still use it.
_SPLIT_WS: dict = {}
_SPLIT_OLD: list = []
_SPLIT_LOCK = threading.Lock()


def split_workspace_bytes(split_tiles: int, parts: int, head_dim: int, warps: int) -> int:
    """Bytes of the split forward's workspace (cuda_src/fwd_sm90_steps.cuh split_part_merge): the
    counters, then each (split tile, part, warp)'s lse and O."""
    return 4 * (SPLIT_COUNTERS + split_tiles * parts * warps * (64 + 16 * head_dim))


def split_workspace(device_id: int, stream: int, nbytes: int) -> int:
    """A workspace of at least nbytes for the split forward on this stream, its counters zero (made
    and cleared on the stream at first use); 0 while the stream captures a graph and has none large
    enough (no allocation then: the launch runs unsplit)."""
    key = (device_id, stream)
    have = _SPLIT_WS.get(key)
    if have is not None and have[1] >= nbytes:
        return have[0].ptr
    if stream_capturing(stream):
        return 0
    import cupy

    with _SPLIT_LOCK:
        have = _SPLIT_WS.get(key)
        if have is not None and have[1] >= nbytes:
            return have[0].ptr
        size = max(nbytes, 2 * have[1]) if have is not None else nbytes
        with cupy.cuda.Device(device_id):
            mem = cupy.cuda.memory.alloc(size)
            cupy.cuda.runtime.memsetAsync(mem.ptr, 0, 4 * SPLIT_COUNTERS, stream)
        if have is not None:
            _SPLIT_OLD.append(have[0])
        _SPLIT_WS[key] = (mem, size)
        return mem.ptr


class SplitLaunch(ScheduledLaunch):
    """The persistent non-causal forward with a split tail (cuflash/_schedule.py split_schedule): a
    ScheduledLaunch whose Params also point to the stream's workspace (split_workspace) and hold the
    split's first tile, parts and chunk. A fire on a stream that has no list copy or workspace yet and
    is capturing a graph runs the kernel's own order, unsplit (sched 0, parts 0)."""

    __slots__ = ("ws_bytes", "split", "w_ws", "i_split")

    def __init__(self, name, fn_ptr, grid, threads, smem, params, pointers, device_id, maps, table, split,
                 ws_bytes):
        super().__init__(name, fn_ptr, grid, threads, smem, params, pointers, device_id, maps, table)
        offsets = _offsets(params.dtype)
        self.ws_bytes = ws_bytes
        self.split = split  # (split_first, split_parts, split_chunk)
        self.w_ws = offsets["split_ws"] // 8
        self.i_split = offsets["split_first"] // 4  # then split_parts, split_chunk

    def _arm(self, stream: int) -> None:
        mem = self._table_on(stream)
        ws = split_workspace(self.device_id, stream, self.ws_bytes) if mem is not None else 0
        i = self.i_split
        if ws:
            self.words[self.table_word], self.words[self.w_ws] = mem.ptr, ws
            self.ints[i:i + 3] = self.split
            self.armed = stream
        else:
            self.words[self.table_word] = self.words[self.w_ws] = 0
            self.ints[i:i + 3] = 0
            self.armed = None


def _upload_table(device_id: int, table: np.ndarray, stream: int):
    """The table in device memory (a CuPy allocation, freed with the launch that holds it), copied on
    the stream; None while the stream captures a graph (an allocation and a copy there would join the
    graph)."""
    if stream_capturing(stream):
        return None
    import cupy

    with cupy.cuda.Device(device_id):
        mem = cupy.cuda.memory.alloc(table.nbytes)
        cupy.cuda.runtime.memcpyAsync(mem.ptr, table.ctypes.data, table.nbytes,
                                      cupy.cuda.runtime.memcpyHostToDevice, stream)
    return mem


def share_params(launches: list) -> list:
    """Lets the launches that follow a launch with the same Params layout and pointers reuse its
    buffer: they differ only in int32 fields (the backward's num_blocks), which each sets before
    firing, and need no pointer patches of their own (the first one, fired before them in the same
    plan run, has written the pointers). Saves the per-launch pointer writes of the backward."""
    for i, first in enumerate(launches):
        if first.sets or not first.patches:
            continue
        followers = [L for L in launches[i + 1:] if L.patches == first.patches and L.words.size == first.words.size
                     and L.words is not first.words and not L.sets]
        if not followers:
            continue
        fixed = np.zeros(first.ints.size, dtype=bool)
        for L in followers:
            fixed |= L.ints != first.ints
        # A pointer word must never differ (the patches rewrite it for the first launch only).
        if any(fixed[2 * w] or fixed[2 * w + 1] for w, _, _ in first.patches):
            continue
        idx = np.nonzero(fixed)[0]
        first.sets = tuple((int(j), int(first.ints[j])) for j in idx)
        for L in followers:
            L.sets = tuple((int(j), int(L.ints[j])) for j in idx)
            L.words, L.ints, L.argv, L.argv_ptr, L.patches = first.words, first.ints, first.argv, first.argv_ptr, ()
        break
    return launches


def _assign(params: np.ndarray, field: str, value) -> None:
    if "." in field:
        outer, inner = field.split(".", 1)
        params[outer][inner] = value
    else:
        params[field] = value


def _launch_kernel(*args):
    """cupy_backends' cuLaunchKernel binding (a direct Cython call): measured the cheapest of the
    launch routes available (bench/dev/launch_cost.py, bench/NOTES.md)."""
    global _launch_kernel
    from cupy_backends.cuda.api import driver

    _launch_kernel = driver.launchKernel
    return driver.launchKernel(*args)


def stream_capturing(stream: int) -> bool:
    """Whether a stream is being captured into a CUDA graph (cudaStreamIsCapturing; a direct Cython
    call). False for the legacy default stream, which cannot be captured, and on any error."""
    if not stream:
        return False
    from cupy.cuda import runtime

    try:
        return runtime.streamIsCapturing(stream) != 0
    except Exception:
        return False


def _tma_context(target: str, device_id: int) -> None:
    """Before a plan's tensor-map decisions on sm_90a: a current context in this thread (the
    autograd engine's thread may have none; cuflash/_tma.py ensure_context)."""
    if target == "sm_90a":
        from . import _tma

        if _tma.available():
            _tma.ensure_context(device_id)


def _tensor_ptrs(named) -> dict:
    return {name: t.ptr for name, t in named}


@dataclass(frozen=True)
class PagedKV:
    """Paged K and V caches for the warp-specialized feature forward (fwd_launches' `paged`): k and v
    (num_pages, page_size, nheads_kv, head_dim), and batch entry (or packed sequence) b's key t at row
    t % page_size of page block_table[b * table_stride + t // page_size] (the kernel clamps the column
    to table_cols - 1 and the page to [0, num_pages)). small_ok: boxes of fewer rows than
    _config.PAGED_DIRECT_MIN_BOX are taken too (the caller has no gather to fall back on). rows: the call's
    packed query rows a kv head (_config.paged_direct's rule for boxes of whole rows)."""

    k: DeviceTensor
    v: DeviceTensor
    block_table: "int | Slot"
    table_stride: int
    table_cols: int
    small_ok: bool = False
    rows: int = 0


def paged_interleaved(paged: PagedKV, kernel_dim: int, box_rows: int) -> bool:
    """Whether the paged forward copies the pages in boxes of whole rows (flash_fwd_sm90_ws.cu ILV: K in a
    box of 16 rows over 8-row groups into the interleaved layout, V in a box of 16 rows into a 16-row
    group, rather than each in a box per 64-column panel): boxes of 16 rows (16- and 48-row pages), at
    head_dim 128 or 256 with no pad-up (a box of whole rows would read past a row's head_dim columns), on
    pages that follow one another in memory (K's map numbers the 8-row groups across the pages:
    _tma.kv_map_args' ilv). H200, session 71 (bench/dev/paged_prefill.py, 16-row pages, bf16, head_dim
    128, GQA 8; prefill_route.py, chunks): 0.87-0.92x the time of a box a panel; with boxes of 32 rows or
    more 1.00-1.07x (likely the boxes' slabs of 8 rows, where a panel's box is one slab; not measured
    apart). CUFLASH_PAGED_ILV=0: never (A/B)."""
    import os

    num_pages, page_size, _, head_dim = paged.k.shape
    return (os.environ.get("CUFLASH_PAGED_ILV") != "0" and box_rows == 16 and kernel_dim >= 128
            and head_dim == kernel_dim and all(t.strides[0] == page_size * t.strides[1] for t in (paged.k, paged.v)))


def paged_box_rows(page_size: int, block_n: int) -> int:
    """The rows of a paged forward's K / V boxes: the largest that divides both the page and the key
    tile, so that no box crosses a page and a tile is whole boxes (page sizes are multiples of 16)."""
    return math.gcd(page_size, block_n)


def fwd_launches(q: DeviceTensor, k: DeviceTensor, v: DeviceTensor, o: DeviceTensor, lse_ptr, dtype: str,
                 causal: bool, softmax_scale: float, device_id: int, cc: tuple[int, int],
                 cfg: _config.TileConfig | None = None, mask: MaskArgs | None = None,
                 paged: PagedKV | None = None) -> list[Launch] | None:
    """The forward's launches (one kernel). All checks on shapes and strides were done by the caller.
    `cfg` overrides the tile table (tuning scripts only). With `mask`, the feature kernel runs and
    `causal` must already be folded into mask.window_right. With `paged` (and `mask`), k and v give only
    the logical shape (batch, seqlen_k, nheads_kv, head_dim) and the warp-specialized feature kernel reads
    the paged caches; None where that kernel does not serve the call, or its boxes would be too small
    (_config.paged_direct): the caller gathers the keys instead."""
    batch, seqlen_q, nheads, head_dim = q.shape
    _, seqlen_k, nheads_kv, _ = k.shape
    target = _config.compile_arch(*cc)
    _tma_context(target, device_id)
    mq, mk, mv = q, k, v  # what the warp-specialized kernel's tensor maps describe
    split = None  # the split tail's (list, first, parts, chunk): cuflash/_schedule.py split_schedule
    if mask is not None:
        assert not causal
        narrow = 0 <= mask.window_left and mask.window_left + max(mask.window_right, 0) < _config.NARROW_WINDOW
        # Pad-up as for plain calls (below): the kernel of pad_dim where the options' table serves it.
        # Below 64 the rule depends on the options (per-score work or masks only) and on the keys a
        # query row can see.
        scores = mask.softcap != 0 or mask.alibi_slopes != 0 or mask.sink_logits != 0
        keys = seqlen_k if mask.window_left < 0 or mask.window_right < 0 else min(
            seqlen_k, mask.window_left + mask.window_right + 1)
        pad_dim = None if cfg is not None else _config.fwd_pad_head_dim(
            target, head_dim, causal=mask.window_right == 0, seqlen_k=keys, feat="scores" if scores else "mask")
        kernel_dim = pad_dim or head_dim
        ws = None if cfg is not None or target != "sm_90a" else _config.fwd_ws_feat_config(kernel_dim, narrow)
        if mask.packed:  # the arrays as one sequence of all their rows (flash_fwd_sm90_ws.cu)
            mq, mk, mv = (_one_sequence(t, n) for t, n in ((q, mask.total_q), (k, mask.total_k), (v, mask.total_k)))
        pad = pad_dim is not None
        kv_rows = ws[0] if ws else 0  # the K / V maps' box rows
        ilv = False
        if paged is not None:
            mk, mv = paged.k, paged.v
            kv_rows = paged_box_rows(paged.k.shape[1], ws[0]) if ws else 0
            ilv = bool(ws) and paged_interleaved(paged, kernel_dim, kv_rows) and _use_tma_ilv(paged, kv_rows, dtype)
            if not (ws and _config.paged_direct(kv_rows, paged.small_ok, paged.rows if ilv else None)):
                return None
        if ws and _use_tma(mq, mq, 64 * ws[3], dtype, pad) and (ilv or _use_tma(mk, mv, kv_rows, dtype, pad)):
            cfg = _config.TileConfig(64 * ws[3], ws[0], 4 * (1 + ws[3]), wgmma=True)
            spec, smem = fwd_ws_specialization(dtype, kernel_dim, False, False, *ws, feat=True,
                                               paged=paged is not None, ilv=ilv)
        elif paged is not None:
            return None
        else:
            cfg = cfg or _config.feat_fwd_config(target, head_dim, dtype, narrow)
            spec, smem = fwd_specialization(dtype, head_dim, cfg, False, False, feat=True)
    else:
        chosen = cfg is not None
        # Head_dim pad-up (_config.fwd_pad_head_dim): the warp-specialized kernel of pad_dim reads the
        # call's tensors through maps whose columns past head_dim are zeros, and writes head_dim columns.
        pad_dim = None if chosen else _config.fwd_pad_head_dim(target, head_dim, True, causal, seqlen_k)
        # ... or the TMA variant of 64 (_config.fwd_pad_tma), likewise: maps of the call's head_dim, Q's
        # columns past it zero-filled, O's not written (FwdTmaParams.d_cols).
        tma_pad = None
        if not chosen and _config.fwd_pad_tma(target, head_dim, causal, seqlen_k):
            tcfg = _config.fwd_pad_tma_config(target, head_dim, dtype, causal, seqlen_k)
            if _use_tma(k, v, tcfg.block_n, dtype, True):
                cfg, tma_pad, pad_dim = tcfg, 64, None
        if pad_dim is not None:
            pers = _config.fwd_ws_persistent_config(pad_dim, causal, seqlen_k, seqlen_q)
            # (No seqlen_k: where a call pads is fwd_pad_head_dim's rule, not head_dim 64's own
            # FWD_WS_MIN_SEQLEN_K.)
            ws = pers or _config.fwd_ws_config(pad_dim, causal)
            if not (ws and _use_tma(q, q, 64 * ws[3], dtype, True) and _use_tma(k, v, ws[0], dtype, True)):
                pad_dim = None
        cfg = cfg or _config.fwd_config_for_target(target, head_dim, dtype, causal)
        tma = tma_pad is not None or (cfg.wgmma and _use_tma(k, v, cfg.block_n, dtype))
        if pad_dim is None:
            pers = None if chosen or tma_pad or not tma else _config.fwd_ws_persistent_config(
                head_dim, causal, seqlen_k, seqlen_q)
            ws = pers or (None if chosen or tma_pad or not tma else _config.fwd_ws_config(head_dim, causal, seqlen_k,
                                                                                           seqlen_q))
        if pad_dim is not None or (ws and _use_tma(q, q, 64 * ws[3], dtype) and _use_tma(k, v, ws[0], dtype)):
            cfg = _config.TileConfig(64 * ws[3], ws[0], 4 * (1 + ws[3]), wgmma=True)
            even = seqlen_q % cfg.block_m == 0 and seqlen_k % cfg.block_n == 0
            if pers is not None and not causal and _config.fwd_split():
                # The last wave's tiles cut along their key tiles (cuflash/_schedule.py split_schedule)
                from ._kvcache import _sm_count
                from ._schedule import split_schedule

                n_work = batch * nheads * -(-seqlen_q // cfg.block_m)
                split = split_schedule(n_work, min(n_work, _sm_count(device_id)), -(-seqlen_k // cfg.block_n))
            spec, smem = fwd_ws_specialization(dtype, pad_dim or head_dim, causal, even, *ws,
                                               persistent=pers is not None, split=split is not None)
        else:
            if tma and not chosen and not tma_pad:
                cfg = _config.fwd_tma_config_for_target(target, head_dim, dtype, causal, seqlen_k)
                tma = _use_tma(k, v, cfg.block_n, dtype)  # the maps' box is the tile's rows
            even = seqlen_q % cfg.block_m == 0 and seqlen_k % cfg.block_n == 0
            spec, smem = fwd_specialization(dtype, tma_pad or head_dim, cfg, causal, even, tma=tma)
    num_m_blocks = -(-seqlen_q // cfg.block_m)
    grid = batch * nheads * num_m_blocks
    if grid > MAX_GRID_X:
        raise ValueError(f"batch * nheads * ceil(seqlen_q / {cfg.block_m}) = {grid} thread blocks exceeds the "
                         f"grid limit {MAX_GRID_X}; split the batch")
    if grid == 0:  # a packed batch whose sequences are all empty
        return []
    from ._kvcache import _sm_count

    persistent = spec.name.endswith(("_pers", "_split"))
    if persistent:  # one block per SM, each walking query blocks
        grid = min(grid, _sm_count(device_id))
    fn = _compile.get_function(spec, target, device_id, smem)
    tail_heads = 0
    if (causal or (mask is not None and mask.window_right == 0)) and not persistent:
        tail_heads = _config.fwd_causal_tail_heads(batch * nheads, num_m_blocks, _sm_count(device_id),
                                                   _blocks_per_sm(fn, cfg.warps * 32, smem))

    ws = spec.name.startswith("fwd90ws_")
    tma = spec.name.endswith("_tma")
    p = np.zeros((), dtype=FWD_WS_PARAMS if ws else FWD_TMA_PARAMS if tma else FWD_PARAMS)
    ptrs = _tensor_ptrs((("q", q), ("k", k), ("v", v), ("o", o)))
    ptrs["lse"] = lse_ptr
    _set_strides(p, (("q", q), ("k", k), ("v", v), ("o", o)))
    p["batch"], p["nheads"], p["nheads_kv"] = batch, nheads, nheads_kv
    p["head_group"] = nheads // nheads_kv
    p["seqlen_q"], p["seqlen_k"], p["num_m_blocks"] = seqlen_q, seqlen_k, num_m_blocks
    p["tail_heads"] = tail_heads
    p["scale_log2"] = softmax_scale * LOG2E
    if ws or tma:
        p["d_cols"] = head_dim  # the call's columns (the kernel's head_dim may be larger: pad-up)
    if mask is not None:
        ptrs.update(_set_mask(p, mask, softmax_scale, nheads, seqlen_q))
    kv_rows = cfg.block_n
    if paged is not None:
        kv_rows = paged_box_rows(paged.k.shape[1], cfg.block_n)
        p["page_size"], p["page_box"], p["num_pages"] = paged.k.shape[1], kv_rows, paged.k.shape[0]
        p["table_stride"], p["table_cols"] = paged.table_stride, paged.table_cols
        ptrs["block_table"] = paged.block_table
    if tma or ws:
        from . import _tma

        # ILV (the paged layouts of whole rows): K's map over 8-row groups (kv_map_args' ilv), V's boxes of 16
        # rows and every panel (its panels argument)
        ilv = spec.name.endswith("_ilv")
        maps = [(name, t.ptr, _tma.MapCache(t.shape, t.strides, rows, dtype, **kw)) for name, t, rows, kw in
                (("map_k", mk, kv_rows, {"ilv": ilv}),
                 ("map_v", mv, 16 if ilv else kv_rows, {"panels": mv.shape[3] // 64} if ilv else {}))
                + ((("map_q", mq, cfg.block_m, {}),) if ws else ())]
        if persistent and causal and _config.fwd_sched():
            # The blocks' work lists (cuflash/_schedule.py; the kernel's pairs where there is none)
            from ._schedule import causal_schedule

            table = causal_schedule(num_m_blocks, batch * nheads, grid, cfg.block_m, cfg.block_n, seqlen_q, seqlen_k)
            return [ScheduledLaunch(spec.name, fn.ptr, grid, cfg.warps * 32, smem, p, ptrs, device_id, maps, table)]
        if split is not None:  # (the split kernel: spec.name ends in _split)
            table, first, parts, chunk = split
            nbytes = split_workspace_bytes(batch * nheads * num_m_blocks - first, parts, pad_dim or head_dim,
                                           cfg.warps - 4)
            return [SplitLaunch(spec.name, fn.ptr, grid, cfg.warps * 32, smem, p, ptrs, device_id, maps, table,
                                (first, parts, chunk), nbytes)]
        return [TmaLaunch(spec.name, fn.ptr, grid, cfg.warps * 32, smem, p, ptrs, device_id, maps)]
    return [Launch(spec.name, fn.ptr, grid, cfg.warps * 32, smem, p, ptrs, device_id)]


def _blocks_per_sm(fn, threads: int, smem: int) -> int:
    """How many blocks of a loaded kernel one SM holds at once (sm_80 / sm_90 limits: 2048 threads,
    64K registers allocated per warp in units of 256, 228 KiB of shared memory with 1 KiB reserved a
    block, 32 blocks). Without the kernel's register count (a test's stand-in for the loaded kernel)
    the threads and shared memory alone decide."""
    by = [2048 // threads, 228 * 1024 // (smem + 1024), 32]
    regs = getattr(getattr(fn, "raw", None), "num_regs", None)
    if isinstance(regs, int) and regs > 0:
        per_warp = -(-regs * 32 // 256) * 256
        by.append(65536 // (per_warp * (threads // 32)))
    return max(1, min(by))


def _one_sequence(t: DeviceTensor, rows: int) -> DeviceTensor:
    """A packed batch's 4-D view (batch, max_seqlen, heads, head_dim; batch stride 0) as the array it
    views: one sequence of all `rows` rows (a batch of 1, its stride that of the whole array)."""
    _, _, heads, head_dim = t.shape
    rs, hs, es = t.strides[1:]
    return DeviceTensor(t.ptr, (1, max(rows, 1), heads, head_dim), (max(rows, 1) * rs, rs, hs, es))


def _tma_ok(t: DeviceTensor, pad: bool = False) -> bool:
    """Whether a K/V tensor can be described by a tensor map (cuflash/_tma.py kv_map): head_dim a
    multiple of 64 (any multiple of 8 with pad: the kernel's columns past it read as zeros), a
    unit-stride last dimension, other strides positive multiples of 8 elements, every size in
    [1, 2^32]."""
    strides = tuple(t.strides)
    return (t.shape[3] % (8 if pad else 64) == 0 and strides[3] == 1 and all(s > 0 and s % 8 == 0 for s in strides[:3])
            and all(1 <= n <= 2**32 for n in t.shape))


def _use_tma(k: DeviceTensor, v: DeviceTensor, block_n: int, dtype: str, pad: bool = False) -> bool:
    """Whether two tensors may be read through tensor maps with `block_n`-row boxes
    (cuflash/_config.py fwd_tma_mode: CUFLASH_FWD_TMA=0 keeps every kernel on cp.async): never where
    the driver cannot be loaded (a machine without a GPU: the fake device of the CPU tests). pad: for
    a kernel of a larger head_dim (pad-up; _tma_ok)."""
    from . import _tma

    gate = _tma_gate(k, v, pad)
    if gate is not None:
        return gate
    return all(_tma.layout_patch(t.shape, t.strides, block_n, dtype) is not None for t in (k, v))


def _tma_gate(k: DeviceTensor, v: DeviceTensor, pad: bool = False) -> "bool | None":
    """What _use_tma and _use_tma_ilv answer before the maps' patches: False where CUFLASH_FWD_TMA=0, a
    tensor that no map describes (_tma_ok) or no driver; True where CUFLASH_FWD_TMA forces TMA; None:
    the patches decide."""
    from . import _tma

    mode = _config.fwd_tma_mode()
    if mode == "off" or not (_tma_ok(k, pad) and _tma_ok(v, pad)) or not _tma.available():
        return False
    return True if mode == "force" else None


def _use_tma_ilv(paged: PagedKV, rows: int, dtype: str) -> bool:
    """_use_tma for the maps of the paged forward's boxes of whole rows (paged_interleaved): K's over
    8-row groups with `rows`-row boxes, V's of 16-row boxes over every panel (fwd_launches' map_k,
    map_v). Where one of them has no pointer patch (a driver that refuses the layout, or maps that do
    not follow the one-word rule), the pages go in a box a panel, whose maps _use_tma checks."""
    from . import _tma

    k, v = paged.k, paged.v
    gate = _tma_gate(k, v)
    if gate is not None:
        return gate
    return (_tma.layout_patch(k.shape, k.strides, rows, dtype, ilv=True) is not None
            and _tma.layout_patch(v.shape, v.strides, 16, dtype, v.shape[3] // 64) is not None)


def decode_tma_rows(paged: bool, warps: int, page_size: int = 0) -> int:
    """The rows of a decode tensor map's box: a tile (16 * warps keys) of a contiguous cache, or of a
    paged one whose page_size is a multiple of the tile (whole tiles, _config.decode_page_tiles), else
    a 16-key group of a paged one (cuda_src/flash_decode.cu, TMA)."""
    if paged and not _config.decode_page_tiles(page_size, 16 * warps):
        return 16
    return 16 * warps


def decode_tma_panels(rows: int, warps: int, head_dim: int) -> int:
    """The 64-column panels one box of a decode tensor map fills: both panels of head_dim 128 for a
    paged cache's 16-key groups (rows < the tile: one 5-D box per group, the kernel's group-major
    tiles; cuda_src/flash_decode.cu GROUP_BOX), else 1 (a box per panel)."""
    return head_dim // 64 if rows < 16 * warps and head_dim == 128 else 1


def use_decode_tma(k: DeviceTensor, v: DeviceTensor, dtype: str, target: str, paged: bool, num_sink_tokens: int,
                   window_left: int) -> bool:
    """Whether a decode reads its caches through TMA (cuda_src/flash_decode.cu, TMA): sm_90a, head_dim
    64 or 128, no sink tokens beside a window (a tile across their boundary is not consecutive keys),
    maps with the one-word pointer patch for the boxes it uses (so a call costs no encode), and
    CUFLASH_DECODE_TMA not 0. Never where the driver cannot be loaded. k, v: the caches as 4-D
    (rows or blocks, capacity or page_size, nheads_kv, head_dim)."""
    from . import _tma

    if (target != "sm_90a" or k.shape[3] not in _config.DECODE_TMA_HEAD_DIMS
            or (num_sink_tokens > 0 and window_left >= 0) or not _config.decode_tma_enabled()):
        return False
    if not (_tma_ok(k) and _tma_ok(v)) or not _tma.available():
        return False
    boxes = {(r, decode_tma_panels(r, w, k.shape[3]))
             for w in (4, 8) for r in (decode_tma_rows(paged, w, k.shape[1] if paged else 0),)}
    return all(_tma.layout_patch(t.shape, t.strides, r, dtype, n) is not None for t in (k, v) for r, n in boxes)


def _use_bwd_ws(q: DeviceTensor, dout: DeviceTensor, k: DeviceTensor, v: DeviceTensor, dtype: str,
                block_m: int, block_n: int = 128, pad: bool = False) -> bool:
    """Whether the warp-specialized backward may run (cuflash/_config.py bwd_ws_mode): Q and dO
    through maps of block_m-row boxes, K and V of block_n."""
    from . import _tma

    mode = _config.bwd_ws_mode()
    if mode == "off" or not all(_tma_ok(t, pad) for t in (q, dout, k, v)) or not _tma.available():
        return False
    if mode == "force":
        return True
    return _use_tma(q, dout, block_m, dtype, pad) and _use_tma(k, v, block_n, dtype, pad)


def tail_launches(t: DeviceTensor, cu_seqlens, batch: int, max_seqlen: int, elem: str, fill_bits: int,
                  device_id: int, cc: tuple[int, int]) -> list[Launch]:
    """Fills the rows of a packed tensor t (rows, heads, row_elems) that no attention kernel visits
    with fill_bits: rows [cu_seqlens[batch], rows), which belong to no sequence, and the rows of a
    sequence past its first max_seqlen (a sequence longer than the call said; cuda_src/varlen.cu).
    Launched after the attention kernels."""
    rows, heads, row_elems = t.shape
    if rows * heads * row_elems == 0:
        return []
    target = _config.compile_arch(*cc)
    spec = tail_specialization(elem)
    fn = _compile.get_function(spec, target, device_id, 0)
    p = np.zeros((), dtype=TAIL_PARAMS)
    p["row_stride"], p["head_stride"] = t.strides[0], t.strides[1]
    p["total_rows"], p["nheads"], p["row_elems"], p["fill"] = rows, heads, row_elems, fill_bits
    p["batch"], p["max_seqlen"] = batch, max_seqlen
    # A grid-stride loop: the tail's length is only known on the device (usually 0).
    grid = max(1, min(_cdiv(rows * heads * row_elems, 256), 264))
    return [Launch(spec.name, fn.ptr, grid, 256, 0, p, {"ptr": t.ptr, "cu_seqlens": cu_seqlens}, device_id)]


def fire_all(launches, device_id: int, stream_ptr: int, ptrs=()) -> None:
    """Fires prepared launches with the device made current (tools and tests; plans do this
    themselves, without the device switch where it is already current)."""
    import cupy

    with cupy.cuda.Device(device_id):
        for launch in launches:
            launch.fire(stream_ptr, ptrs)


def launch_fwd(q, k, v, o, lse_ptr, dtype, causal, softmax_scale, device_id, cc, stream_ptr, cfg=None, mask=None):
    """Prepares and fires the forward on concrete pointers (tuning scripts and tests)."""
    fire_all(fwd_launches(q, k, v, o, lse_ptr, dtype, causal, softmax_scale, device_id, cc, cfg, mask),
             device_id, stream_ptr)


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
    rows = batch * nheads * bwd_row_pad(seqlen_q)
    per_row = 2 if bwd_needs_lse_log2(target, head_dim, atomic) else 1
    # Under pad-up the accumulator rows are the kernel's head_dim wide.
    acc_dim = (_config.bwd_pad_head_dim(target, head_dim) or head_dim) if target is not None else head_dim
    return per_row * rows, (rows * acc_dim if atomic else 0)


def _bwd_params(dout, q, k, v, o, dq, dk, dv, lse_ptr, delta_ptr, dq_accum_ptr, lse_log2_ptr, softmax_scale):
    """The backward's Params (BWD_PARAMS: shapes, strides, scales) and pointers, shared by its launches
    (num_blocks and the mask's fields set by the caller). Pointers may be ints or Slots."""
    batch, seqlen_q, nheads, _ = q.shape
    _, seqlen_k, nheads_kv, _ = k.shape
    p = np.zeros((), dtype=BWD_PARAMS)
    ptrs = _tensor_ptrs((("q", q), ("k", k), ("v", v), ("o", o), ("dout", dout), ("dq", dq), ("dk", dk), ("dv", dv)))
    ptrs["lse"], ptrs["delta"], ptrs["dq_accum"], ptrs["lse_log2"] = lse_ptr, delta_ptr, dq_accum_ptr, lse_log2_ptr
    _set_strides(p, (("q", q), ("k", k), ("v", v), ("o", o), ("do", dout), ("dq", dq), ("dk", dk), ("dv", dv)))
    p["batch"], p["nheads"], p["nheads_kv"] = batch, nheads, nheads_kv
    p["head_group"] = nheads // nheads_kv
    p["seqlen_q"], p["seqlen_k"], p["seqlen_q_pad"] = seqlen_q, seqlen_k, bwd_row_pad(seqlen_q)
    p["scale_log2"], p["scale"] = softmax_scale * LOG2E, softmax_scale
    return p, ptrs


def bwd_launches(dout: DeviceTensor, q: DeviceTensor, k: DeviceTensor, v: DeviceTensor, o: DeviceTensor,
                 lse_ptr, dq: DeviceTensor, dk: DeviceTensor, dv: DeviceTensor, rows_scratch_ptr, dq_accum_ptr,
                 dtype: str, causal: bool, softmax_scale: float, atomic: bool, device_id: int, cc: tuple[int, int],
                 cfg: _config.TileConfig | None = None, mask: MaskArgs | None = None) -> list[Launch]:
    """The backward's launches: preprocess, dK/dV, then dQ (or the atomic path's conversion); below
    _config.BWD_DS_SPLIT_BELOW the deterministic path's dQ kernel before dK/dV.
    rows_scratch holds delta, then (where bwd_needs_lse_log2) lse_log2: batch * nheads *
    seqlen_q_pad floats each (bwd_scratch_sizes); dq_accum (atomic path only) batch * nheads *
    seqlen_q_pad * head_dim floats. With `mask`, the feature kernels run (causal folded into
    mask.window_right). Pointers may be ints or Slots."""
    batch, seqlen_q, nheads, head_dim = q.shape
    _, seqlen_k, nheads_kv, _ = k.shape
    family = _config.arch_family(*cc)
    target = _config.compile_arch(*cc)
    _tma_context(target, device_id)
    kernel_dim = head_dim  # the dK/dV kernel's head_dim (larger under pad-up)
    mq, mdo, mk, mv = q, dout, k, v  # what the warp-specialized kernel's tensor maps describe
    if mask is not None:
        assert not causal
        pad_dim = None if cfg is not None else _config.bwd_pad_head_dim(target, head_dim)
        kernel_dim = pad_dim if pad_dim in _config.BWD_WS_FEAT_HEAD_DIMS else head_dim
        # Per-sequence lengths (the kernel's SEQS): a packed batch's maps see each array as one sequence
        # of all its rows, as the forward's (flash_fwd_sm90_ws.cu).
        seqs = bool(mask.packed or mask.q_lengths or mask.kv_lengths)
        if mask.packed:
            mq, mdo = _one_sequence(q, mask.total_q), _one_sequence(dout, mask.total_q)
            mk, mv = _one_sequence(k, mask.total_k), _one_sequence(v, mask.total_k)
        ws = (cfg is None and atomic and target == "sm_90a" and kernel_dim in _config.BWD_WS_FEAT_HEAD_DIMS
              and _config.bwd_ws_feat_enabled() and (not seqs or _config.bwd_ws_seqs_enabled()) and not mask.softcap
              and _use_bwd_ws(mq, mdo, mk, mv, dtype, _config.bwd_ws_block_m(kernel_dim),
                              _config.bwd_ws_block_n(kernel_dim), pad=kernel_dim != head_dim))
        if ws:
            cfg = _config.TileConfig(_config.bwd_ws_block_m(kernel_dim), _config.bwd_ws_block_n(kernel_dim), 8,
                                     wgmma=True)
            qcfg = cfg
            kernels = bwd_ws_specializations(dtype, kernel_dim, False, False,
                                             _config.bwd_ws_stages(kernel_dim, cfg.block_m, seqs), cfg.block_m,
                                             feat=True, call_dim=head_dim, seqs=seqs)
        else:
            # A plan that reserved the accumulator for pad-up, where the call cannot take the kernel:
            # the feature kernels' own dQ path.
            atomic = atomic and (cfg is not None or _config.feat_kernel_atomic(target, head_dim))
            cfg = cfg or _config.feat_bwd_config(target, head_dim, dtype)
            qcfg = _config.feat_dq_config(target, head_dim, dtype)
            kernels = bwd_specializations(dtype, head_dim, target, False, False, False, atomic, cfg, feat=True)
    elif cfg is None and bwd_uses_single(target, head_dim, dtype, batch, nheads, seqlen_q, seqlen_k):
        # One launch, no scratch: the kernel forms D and lse * log2(e) and writes dQ itself.
        tiles = _config.bwd_single_config(_config.family_of_target(target), head_dim, dtype)
        even = seqlen_q % tiles.block_m == 0 and seqlen_k == tiles.block_n
        spec, smem, cfg = bwd_single_specialization(dtype, head_dim, target, causal, even)
        p, ptrs = _bwd_params(dout, q, k, v, o, dq, dk, dv, lse_ptr, 0, 0, 0, softmax_scale)
        p["num_blocks"] = 1
        fn = _compile.get_function(spec, target, device_id, smem)
        return [Launch(spec.name, fn.ptr, batch * nheads_kv, cfg.warps * 32, smem, p, ptrs, device_id)]
    else:
        explicit_cfg = cfg is not None
        cfg = cfg or _config.bwd_config_for_target(target, head_dim, dtype)
        qcfg = _config.bwd_dq_config(family, head_dim, dtype)
        even_kv = seqlen_q % cfg.block_m == 0 and seqlen_k % cfg.block_n == 0
        even_q = seqlen_q % qcfg.block_m == 0 and seqlen_k % qcfg.block_n == 0
        # cfg.wgmma: the sm_90a wgmma configuration (head_dim 64, 128), unless a caller chose tiles; head_dim
        # 256's default configuration is the mma.sync kernel's, which the warp-specialized one replaces.
        # Head_dim pad-up (_config.bwd_pad_head_dim): the warp-specialized kernel of kernel_dim runs on the
        # call's tensors, whose maps read the columns past head_dim as zeros.
        pad_dim = None if explicit_cfg else _config.bwd_pad_head_dim(target, head_dim)
        kernel_dim = pad_dim or head_dim
        ws_n = _config.bwd_ws_block_n(kernel_dim)
        ws = (atomic and target == "sm_90a" and kernel_dim in _config.BWD_WS_HEAD_DIMS
              and (cfg.wgmma or (kernel_dim != head_dim or head_dim == 256) and not explicit_cfg)
              and _use_bwd_ws(q, dout, k, v, dtype, _config.bwd_ws_block_m(kernel_dim), ws_n, pad=pad_dim is not None))
        if ws:
            cfg = _config.TileConfig(_config.bwd_ws_block_m(kernel_dim), ws_n, 8, wgmma=True)
            even_kv = seqlen_q % cfg.block_m == 0 and seqlen_k % cfg.block_n == 0
            kernels = bwd_ws_specializations(dtype, kernel_dim, causal, even_kv,
                                             _config.bwd_ws_stages(kernel_dim, cfg.block_m), cfg.block_m,
                                             call_dim=head_dim)
        else:
            tma = (cfg.wgmma and _config.bwd_tma_enabled() and _use_tma(q, dout, cfg.block_m, dtype)
                   and _use_tma(k, v, cfg.block_n, dtype))
            atomic = atomic and (explicit_cfg or _mma_bwd_atomic(target, head_dim))
            kernels = bwd_specializations(dtype, head_dim, target, causal, even_kv, even_q, atomic, cfg, tma=tma)
    rows_pad = batch * nheads * bwd_row_pad(seqlen_q)
    # The feature kernels always read lse * log2(e) from the scratch (+inf marks padding rows).
    needs_lse_log2 = mask is not None or bwd_needs_lse_log2(target, head_dim, atomic)
    p, ptrs = _bwd_params(dout, q, k, v, o, dq, dk, dv, lse_ptr, rows_scratch_ptr, dq_accum_ptr,
                          rows_scratch_ptr + 4 * rows_pad if needs_lse_log2 else 0, softmax_scale)
    if mask is not None:
        ptrs.update(_set_mask(p, mask, softmax_scale, nheads, seqlen_q))

    (pre, _, _), (dkdv, smem, _), (last, last_smem, _) = kernels
    row_block = _config.row_kernel_rows(head_dim)
    grids = [(pre, 0, _cdiv(rows_pad, row_block), 256, 0)]
    n_blocks = _cdiv(seqlen_k, cfg.block_n)
    ws_kernel = dkdv.source in ("flash_bwd_sm90_ws.cu", "flash_bwd_sm90_ws256.cu")
    threads = 384 if ws_kernel else cfg.warps * 32
    tiles = batch * nheads_kv * n_blocks
    tile_heads, tail_heads = 1, 0
    if ws_kernel:
        from ._kvcache import _sm_count

        sms = _sm_count(device_id)
        # key_block_grouped's order: about one SM count of tiles per group of heads, whose Q and dO
        # the blocks running together then share in L2.
        # (n_blocks 0: a packed batch with max_seqlen_k 0, whose key grid is empty and not launched.)
        tile_heads = max(1, min(batch * nheads_kv, _cdiv(sms, max(n_blocks, 1))))
        if causal or (mask is not None and mask.window_right == 0):
            tail_heads = _config.bwd_causal_tail_heads(batch * nheads_kv, n_blocks, tile_heads, sms)
        if _config.bwd_ws_persistent():
            # One block per SM (its shared memory allows no second), each walking tiles blockIdx.x, +
            # gridDim.x, ...
            tiles = min(tiles, sms)
    grids.append((dkdv, smem, tiles, threads, n_blocks))
    if not atomic:
        m_blocks = _cdiv(seqlen_q, qcfg.block_m)
        dq_grid = (last, last_smem, batch * nheads * m_blocks, qcfg.warps * 32, m_blocks)
        if head_dim < _config.BWD_DS_SPLIT_BELOW:
            # The dQ kernel first: it leaves each row's D corrected from the exact sum of P dP in the
            # scratch, which the dK/dV kernel's dS then reads (cuda_src/flash_bwd.cu, DS_SPLIT_BELOW).
            grids.insert(1, dq_grid)
        else:
            grids.append(dq_grid)
    else:
        # The conversion's rows per block are those of the accumulator's width (the kernel's head_dim).
        conv_rows = _config.row_kernel_rows(kernel_dim if ws else head_dim)
        grids.append((last, 0, _cdiv(batch * nheads * seqlen_q, conv_rows), 256, 0))
    for spec, sm, grid, threads, num_blocks in grids:
        if grid > MAX_GRID_X:
            raise ValueError(f"{spec.name}: {grid} thread blocks exceed the grid limit {MAX_GRID_X}; split the batch")
    launches = []
    for spec, sm, grid, threads, num_blocks in grids:
        if grid == 0:  # a packed batch with max_seqlen 0 on one side
            continue
        fn = _compile.get_function(spec, target, device_id, sm)
        p["num_blocks"] = num_blocks
        if spec.name.endswith("_tma"):  # the dK/dV kernel's TMA variant: the Params gain the maps
            from . import _tma

            pt = np.zeros((), dtype=BWD_TMA_PARAMS)
            for name in BWD_PARAMS.names:
                pt[name] = p[name]
            pt["tile_heads"], pt["tail_heads"] = tile_heads, tail_heads
            pt["d_cols"] = head_dim
            maps = [(f"map_{n}", t.ptr, _tma.MapCache(t.shape, t.strides, rows, dtype)) for n, t, rows in
                    (("q", mq, cfg.block_m), ("do", mdo, cfg.block_m), ("k", mk, cfg.block_n), ("v", mv, cfg.block_n))]
            launches.append(TmaLaunch(spec.name, fn.ptr, grid, threads, sm, pt, ptrs, device_id, maps))
        else:
            launches.append(Launch(spec.name, fn.ptr, grid, threads, sm, p.copy(), ptrs, device_id))
    return share_params(launches)


def launch_bwd(dout, q, k, v, o, lse_ptr, dq, dk, dv, rows_scratch_ptr, dq_accum_ptr, dtype, causal, softmax_scale,
               atomic, device_id, cc, stream_ptr, cfg=None, mask=None):
    """Prepares and fires the backward on concrete pointers (tuning scripts and tests)."""
    fire_all(bwd_launches(dout, q, k, v, o, lse_ptr, dq, dk, dv, rows_scratch_ptr, dq_accum_ptr, dtype, causal,
                          softmax_scale, atomic, device_id, cc, cfg, mask), device_id, stream_ptr)


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


# ---- decoding against a KV cache (cuda_src/flash_decode.cu) ----

def decode_specialization(dtype: str, head_dim: int, stages: int, warps: int = 4, tma: bool = False,
                          grp: bool = False, mt: int = 1, heads: int = 1):
    """The decode kernel's specialization and dynamic shared memory; grp (TMA kernels only): the twin
    built for a paged cache's 16-key groups (_config.decode_group_kernel); mt: the m16 row tiles of a
    warp (2: 32 packed rows a block, TMA kernels only: _config.decode_two_tiles); heads: the kv heads a
    block serves (TMA, not grp, mt 1: _config.decode_heads)."""
    assert tma or not grp
    assert mt == 1 or (mt == 2 and tma)
    assert heads == 1 or (tma and not grp and mt == 1 and warps % heads == 0)
    short, ctype = _DTYPE_TAG[dtype]
    smem = _config.decode_smem_bytes(head_dim, stages, warps, tma, mt)
    flag = "true" if tma else "false"
    checks = "\n".join([
        _DECODE_TMA_CHECKS_PARAMS if tma else _DECODE_CHECKS_PARAMS,
        f"static_assert(cuflash::DecodeTraits<{head_dim}, {stages}, {warps}, {flag}, {mt}>::SMEM_BYTES == {smem},"
        f' "shared memory size differs from cuflash/_config.py:decode_smem_bytes");',
    ])
    tag = ("" if warps == 4 else f"_w{warps}") + ("_tma" if tma else "") + ("_grp" if grp else "") + (
        f"_m{mt}" if mt > 1 else "") + (f"_h{heads}" if heads > 1 else "")
    extra = (", true" if grp else (", false" if mt > 1 or heads > 1 else "")) + (
        f", {mt}" if mt > 1 or heads > 1 else "") + (f", {heads}" if heads > 1 else "")
    return _compile.Specialization("flash_decode.cu",
                                   f"cuflash::flash_decode_kernel<{ctype}, {head_dim}, {stages}, {warps}, {flag}{extra}>",
                                   f"decode_{short}_d{head_dim}_s{stages}{tag}", checks), smem


def decode_combine_specialization(dtype: str, head_dim: int):
    short, ctype = _DTYPE_TAG[dtype]
    return _compile.Specialization("flash_decode.cu", f"cuflash::decode_combine_kernel<{ctype}, {head_dim}>",
                                   f"decode_combine_{short}_d{head_dim}", _DECODE_CHECKS_PARAMS)


def decode_append_specialization():
    return _compile.Specialization("flash_decode.cu", "cuflash::decode_append_kernel", "decode_append",
                                   _DECODE_CHECKS_PARAMS)


def all_decode_specializations(target: str, head_dims=None, dtypes=None):
    """The decode kernel (4 warps; and 8 where built; each also reading through TMA on sm_90a at
    _config.DECODE_TMA_HEAD_DIMS, and each TMA kernel's twin for 16-key groups of a paged cache) and
    the split combine per (dtype, head_dim) the target serves, the append, and the paged prefill's
    gather."""
    out = []
    for dtype in dtypes or _config.DTYPES:
        for d in head_dims or _config.HEAD_DIMS:
            stages = _config.decode_stages(target, d)
            if stages is not None:
                tma_ok = target == "sm_90a" and d in _config.DECODE_TMA_HEAD_DIMS
                kinds = ((False, False), (True, False), (True, True)) if tma_ok else ((False, False),)
                for tma, grp in kinds:
                    out.append(decode_specialization(dtype, d, stages, 4, tma, grp))
                for grp in (False, True) if tma_ok else ():
                    if _config.decode_deep_supported(target, d):
                        out.append(decode_specialization(dtype, d, 4, 4, True, grp))
                    if _config.decode_shallow_supported(target, d):
                        out.append(decode_specialization(dtype, d, 2, 4, True, grp))
                    # two m16 tiles a warp (_config.decode_two_tiles), at each depth of the 4-warp TMA kernel
                    for st in sorted({stages} | ({4} if _config.decode_deep_supported(target, d) else set())
                                     | ({2} if _config.decode_shallow_supported(target, d) else set())):
                        out.append(decode_specialization(dtype, d, st, 4, True, grp, 2))
                # several kv heads a block (_config.decode_heads), contiguous caches
                for h in _config.DECODE_HEADS_BUILT if tma_ok else ():
                    for w, st in _config.DECODE_HEADS_KERNELS:
                        if _config.decode_heads_supported(target, d, h, st, w, 1, False, 1, h):
                            out.append(decode_specialization(dtype, d, st, w, True, False, 1, h))
                out.append((decode_combine_specialization(dtype, d), 0))
                wide = _config.decode_wide_stages(target, d)
                if wide is not None:
                    for tma, grp in kinds:
                        out.append(decode_specialization(dtype, d, wide, 8, tma, grp))
    out.append((decode_append_specialization(), 0))
    out.append((gather_specialization(), 0))
    return out


@dataclass(frozen=True)
class DecodeArgs:
    """What the decode launches read besides q / caches / out: pointers (int or Slot; 0 = absent) and
    the sizes of the call (validated by the caller)."""

    lse: "int | Slot"
    scratch: "int | Slot"          # float32 o_part then lse_part, when num_splits > 1
    cache_seqlens: "int | Slot"    # 0: fixed_seqlen
    cache_batch_idx: "int | Slot"
    block_table: "int | Slot"
    table_stride: int
    k_new: "DeviceTensor | None"
    v_new: "DeviceTensor | None"
    cache_rows: int
    capacity: int
    page_size: int                 # 0: contiguous
    fixed_seqlen: int
    num_splits: int
    split_counters: "int | Slot" = 0  # the fused combine's counters (cuda_src/flash_decode.cu); 0: a combine kernel
    cluster: bool = False          # the splits merged in a cluster (sm_90, num_splits <= DECODE_CLUSTER_MAX): no
                                   # scratch, no counters, no combine kernel
    started: int = 0               # a word of mapped host memory (started_word), or 0: then every launch but the
                                   # call's first gets a PdlConfig; else all of them (DecodePlan.run chooses)
    seq: "int | Slot" = 0          # the call's number, which the decode kernel writes to `started` (0: none)
    kv_lengths: "int | Slot" = 0   # where the append kernel writes each entry's L_b (0: nowhere; decode_launches'
                                   # append_only)
    tail_first: int = 0            # the split tail: row tiles before it unsplit, the rest in num_splits blocks
                                   # each, merged by the fused combine (cuda_src/flash_decode.cu Grid); 0: none
    late_issue: bool = False       # the TMA kernel of 3+ stages issues a tile once the one two before it landed
                                   # (a contiguous cache; _config.decode_late_issue)
    heads: int = 1                 # the kv heads a decode block serves (_config.decode_heads; the TMA kernel, a
                                   # contiguous cache, one row tile of seqlen_q x nheads / nheads_kv x heads rows)


def decode_scratch_floats(batch: int, nheads: int, seqlen_q: int, head_dim: int, num_splits: int,
                          cluster: bool = False) -> int:
    """float32 scratch of a split decode: o_part then lse_part (0 without splitting, or with the cluster
    merge)."""
    if num_splits <= 1 or cluster:
        return 0
    return num_splits * batch * nheads * seqlen_q * (head_dim + 1)


def decode_depth(target: str, head_dim: int, warps: int, stages: int | None = None) -> int:
    """The decode kernel's pipeline depth: on 4 warps `stages` (the TMA kernel's per-call choice,
    _config.decode_deep_tma / decode_shallow_tma) or else _config.decode_stages; on 8 warps
    _config.decode_wide_stages."""
    depth = (stages or _config.decode_stages(target, head_dim)) if warps == 4 else \
        _config.decode_wide_stages(target, head_dim)
    assert depth is not None, (target, head_dim, warps)
    return depth


def decode_launches(q: DeviceTensor, k: DeviceTensor, v: DeviceTensor, o: DeviceTensor, a: DecodeArgs, dtype: str,
                    softmax_scale: float, mask: MaskArgs, device_id: int, cc: tuple[int, int],
                    warps: int = 4, tma: bool = False, stages: int | None = None, mt: int = 1,
                    append_only: bool = False) -> list[Launch]:
    """The launches of one attention_with_kvcache call on the GPU: the append (when k_new is given),
    the decode kernel (with `warps` warps: 4, or 8 where _config.decode_wide_stages builds it;
    tma: reading the caches through tensor maps, use_decode_tma; stages: the 4-warp kernel's
    pipeline depth, None: _config.decode_stages; mt: its m16 row tiles a warp, 2 for 32 packed rows
    a block, _config.decode_two_tiles), and the combine of the
    splits (num_splits > 1). k / v: the caches, with the strides of a cache row (contiguous) or a
    block (paged) first. append_only: the append kernel's launch alone, which also writes each entry's
    L_b to a.kv_lengths (cuflash/_kvcache.py ChunkPlan: launched even where nothing is appended, for
    the lengths; no decode kernel is compiled)."""
    batch, seqlen_q, nheads, head_dim = q.shape
    nheads_kv = k.shape[2]
    target = _config.compile_arch(*cc)
    stages = decode_depth(target, head_dim, warps, stages)
    group = nheads // nheads_kv
    rows = seqlen_q * group
    heads = a.heads
    if heads > 1:  # a block of `heads` kv heads: the kernel sees nheads_kv / heads heads of heads x group query heads
        assert (not append_only and _config.decode_heads_supported(target, head_dim, heads, stages, warps, mt,
                                                                   a.page_size != 0, rows, nheads_kv)), (heads, a)
        nheads_kv, group, rows = nheads_kv // heads, group * heads, rows * heads
    assert mt == 1 or (mt == 2 and tma and warps == 4 and not a.cluster), (mt, tma, warps, a.cluster)
    row_tiles = _cdiv(rows, _config.DECODE_ROWS * mt)
    tiles = batch * nheads_kv * row_tiles
    assert 0 <= a.tail_first < tiles and (not a.tail_first or (a.split_counters and not a.cluster)), a
    grid = a.tail_first + (tiles - a.tail_first) * a.num_splits
    if grid > MAX_GRID_X:
        raise ValueError(f"batch * nheads_kv * ceil(seqlen_q * nheads / nheads_kv / {16 * mt}) * num_splits = {grid} "
                         f"thread blocks exceeds the grid limit {MAX_GRID_X}; split the batch")
    p = np.zeros((), dtype=DECODE_TMA_PARAMS if tma else DECODE_PARAMS)
    named = [("q", q), ("k", k), ("v", v), ("o", o)]
    ptrs = _tensor_ptrs(named)
    _set_strides(p, named)
    seqlen_new = 0
    if a.k_new is not None:
        seqlen_new = a.k_new.shape[1]
        ptrs["k_new"], ptrs["v_new"] = a.k_new.ptr, a.v_new.ptr
        _set_strides(p, (("kn", a.k_new), ("vn", a.v_new)))
    ptrs["lse"] = a.lse
    ptrs["cache_seqlens"], ptrs["cache_batch_idx"], ptrs["block_table"] = (a.cache_seqlens, a.cache_batch_idx,
                                                                           a.block_table)
    cluster = a.cluster and a.num_splits > 1
    assert not (cluster and a.split_counters) and (not cluster or a.num_splits <= _config.DECODE_CLUSTER_MAX)
    ptrs["split_counters"] = a.split_counters if a.num_splits > 1 else 0
    ptrs["started"], ptrs["seq"] = a.started, a.seq
    ptrs["kv_lengths"] = a.kv_lengths
    if a.num_splits > 1 and not cluster:
        ptrs["o_part"] = a.scratch
        ptrs["lse_part"] = a.scratch + 4 * a.num_splits * batch * nheads * seqlen_q * head_dim
    else:
        ptrs["o_part"] = ptrs["lse_part"] = 0
    p["table_stride"] = a.table_stride
    for name, value in (("batch", batch), ("nheads", nheads), ("nheads_kv", nheads_kv), ("head_group", group),
                        ("seqlen_q", seqlen_q), ("cache_rows", a.cache_rows), ("capacity", a.capacity),
                        ("page_size", a.page_size), ("fixed_seqlen", a.fixed_seqlen), ("seqlen_new", seqlen_new),
                        ("rows", rows), ("num_row_tiles", row_tiles), ("num_splits", a.num_splits),
                        ("head_dim", head_dim), ("cluster_merge", int(cluster))):
        p[name] = value
    p["scale_log2"] = softmax_scale * LOG2E
    p["tail_first"] = a.tail_first
    assert not a.late_issue or (tma and a.page_size == 0 and stages >= 3), (a.late_issue, tma, a.page_size, stages)
    p["late_issue"] = int(a.late_issue)
    ptrs.update(_set_mask(p, mask, softmax_scale, nheads, seqlen_q))

    launches = []
    if seqlen_new or append_only:
        spec = decode_append_specialization()
        fn = _compile.get_function(spec, target, device_id, 0)
        pa = p
        if heads > 1:  # (the append writes every kv head: the caches' own count)
            pa = p.copy()
            pa["nheads_kv"] = k.shape[2]
        count = max(batch * seqlen_new * k.shape[2] * head_dim, batch)  # (append_only: the lengths, at least)
        launches.append(Launch(spec.name, fn.ptr, max(1, min(_cdiv(count, 256), 1024)), 256, 0, pa, ptrs, device_id))
    if append_only:
        return launches
    rows = decode_tma_rows(a.page_size != 0, warps, a.page_size) if tma else 0
    grp = tma and rows < 16 * warps and _config.decode_group_kernel()  # (rows < the tile: 16-key groups)
    spec, smem = decode_specialization(dtype, head_dim, stages, warps, tma, grp, mt, heads)
    fn = _compile.get_function(spec, target, device_id, smem)
    if tma:
        from . import _tma

        panels = decode_tma_panels(rows, warps, head_dim)
        p["page_tiles"] = int(a.page_size != 0 and rows == 16 * warps)  # whole tiles of a paged cache
        # (heads > 1: boxes of rows / heads keys of `heads` adjacent kv heads)
        maps = [(name, t.ptr, _tma.MapCache(t.shape, t.strides, rows // heads, dtype, panels=panels,
                                            box_heads=heads))
                for name, t in (("map_k", k), ("map_v", v))]
        launches.append(TmaLaunch(spec.name, fn.ptr, grid, 32 * warps, smem, p, ptrs, device_id, maps))
    else:
        launches.append(Launch(spec.name, fn.ptr, grid, 32 * warps, smem, p, ptrs, device_id))
    if cluster:  # a row tile's splits: one cluster of consecutive blocks, which merge them
        set_cluster(launches[-1], a.num_splits)
    # (fused: the decode kernel's last split block combines; cluster: the cluster's blocks)
    if a.num_splits > 1 and not a.split_counters and not cluster:
        spec = decode_combine_specialization(dtype, head_dim)
        fn = _compile.get_function(spec, target, device_id, 0)
        launches.append(Launch(spec.name, fn.ptr, batch * nheads * seqlen_q, 128, 0, p, ptrs, device_id))
    # Every decode kernel waits for the grid before it (pdl_wait) ahead of its first global read and
    # write; the kernels after the call's first are programmatic dependents (DecodePlan.run launches
    # them so in a graph capture): each may start while the one before it finishes. Not the first
    # in a graph: after a kernel of the caller's it gained nothing there (H100, session 15: 10.8 ->
    # 11.0 us per replay after a copy kernel, one decode kernel; bench/NOTES.md). With `started`, the
    # first gets a config too, for eager calls on a busy stream (DecodePlan.run).
    return as_pdl(launches, cc) if a.started else launches[:1] + as_pdl(launches[1:], cc)


_STARTED_PAGES: dict = {}  # device id -> [host pointer of a page of mapped host memory, words handed out]


def started_word(device_id: int):
    """(a ctypes c_uint64 on a fresh word of mapped, pinned host memory, its address) for a decode
    plan's DecodeParams::started: the kernel writes the call's number there, the host reads it with
    no CUDA call. Allocated 512 words a page (cudaHostAlloc, portable and mapped: with unified
    addressing the host pointer is the device's too), never freed (plans live as long as the
    process)."""
    import ctypes

    page = _STARTED_PAGES.get(device_id)
    if page is None or page[1] == 512:
        import cupy

        with cupy.cuda.Device(device_id):
            ptr = cupy.cuda.runtime.hostAlloc(4096, 3)  # cudaHostAllocPortable | cudaHostAllocMapped
        ctypes.memset(ptr, 0, 4096)
        page = _STARTED_PAGES[device_id] = [ptr, 0]
    addr = page[0] + 8 * page[1]
    page[1] += 1
    return ctypes.c_uint64.from_address(addr), addr


def gather_specialization():
    return _compile.Specialization("paged_gather.cu", "cuflash::paged_gather_kernel", "paged_gather",
                                   _GATHER_CHECKS_PARAMS)


GATHER_ROWS = 16  # key rows per thread block of paged_gather_kernel


@dataclass(frozen=True)
class GatherChunk:
    """attention_with_kvcache's paged chunk in one gather launch (cuda_src/paged_gather.cu, chunk mode):
    the V cache and its padded copy beside K's, the cache lengths (a pointer, or 0 for fixed_seqlen),
    the new tokens (None: nothing appended) and where each entry's length L_b goes."""

    src_v: DeviceTensor
    dst_v: "int | Slot"
    cache_seqlens: "int | Slot"
    fixed_seqlen: int
    new_k: "DeviceTensor | None"
    new_v: "DeviceTensor | None"
    lengths_out: "int | Slot"


def gather_launches(src: DeviceTensor, dst: DeviceTensor, table: DeviceTensor, cu_seqlens_k, cu_out, batch: int,
                    max_seqlen_k: int, device_id: int, cc: tuple[int, int],
                    chunk: GatherChunk | None = None) -> list[Launch]:
    """Copies each sequence's keys from a paged cache src (num_blocks, page_size, nheads_kv, head_dim)
    to rows cu_seqlens_k[b] - cu_seqlens_k[0] + t of dst (rows, nheads_kv, head_dim), and those offsets
    to cu_out (cuda_src/paged_gather.cu); with `chunk`, entry b's keys and values t < L_b to rows
    b * max_seqlen_k + t of dst and chunk.dst_v instead, the new tokens appended into the caches on
    the way and L_b written to chunk.lengths_out (cu_seqlens_k, cu_out: 0). table: the int32 block
    table (batch, max_blocks) with a unit last stride."""
    num_blocks, page, hk, d = src.shape
    tiles = _cdiv(max_seqlen_k, GATHER_ROWS)
    if batch * tiles == 0:
        return []
    grid = batch * tiles
    if grid > MAX_GRID_X:
        raise ValueError(f"batch * ceil(max_seqlen_k / {GATHER_ROWS}) = {grid} thread blocks exceeds the grid limit "
                         f"{MAX_GRID_X}; split the batch")
    target = _config.compile_arch(*cc)
    spec = gather_specialization()
    fn = _compile.get_function(spec, target, device_id, 0)
    p = np.zeros((), dtype=GATHER_PARAMS)
    p["src_block_stride"], p["src_row_stride"], p["src_head_stride"] = src.strides[:3]
    p["dst_row_stride"], p["dst_head_stride"] = dst.strides[:2]
    p["table_stride"] = table.strides[0]
    for name, value in (("batch", batch), ("max_seqlen_k", max_seqlen_k), ("num_blocks", num_blocks),
                        ("page_size", page), ("nheads_kv", hk), ("head_dim", d), ("total_rows", dst.shape[0]),
                        ("tiles", tiles)):
        p[name] = value
    ptrs = {"src": src.ptr, "dst": dst.ptr, "block_table": table.ptr, "cu_seqlens_k": cu_seqlens_k, "cu_out": cu_out}
    if chunk is not None:
        p["srcv_block_stride"], p["srcv_row_stride"], p["srcv_head_stride"] = chunk.src_v.strides[:3]
        p["fixed_seqlen"] = chunk.fixed_seqlen
        ptrs.update(src_v=chunk.src_v.ptr, dst_v=chunk.dst_v, cache_seqlens=chunk.cache_seqlens,
                    lengths_out=chunk.lengths_out)
        if chunk.new_k is not None:
            p["seqlen_new"] = chunk.new_k.shape[1]
            for name, t in (("newk", chunk.new_k), ("newv", chunk.new_v)):
                p[f"{name}_batch_stride"], p[f"{name}_row_stride"], p[f"{name}_head_stride"] = t.strides[:3]
            ptrs.update(new_k=chunk.new_k.ptr, new_v=chunk.new_v.ptr)
    return [Launch(spec.name, fn.ptr, grid, 128, 0, p, ptrs, device_id)]
