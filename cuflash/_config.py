"""Tile configurations: one table per GPU architecture, looked up by (head_dim, dtype).

This is the only place block sizes live. The C++ side (FwdTraits in cuda_src/flash_fwd.cu) derives
everything else from the template arguments and static_asserts divisibility; the compile gate and
every run-time compile also assert that FwdTraits::SMEM_BYTES equals `fwd_smem_bytes` below.

Each entry says why it was chosen. Figures are forward TFLOP/s measured with bench/bench_forward.py;
see bench/NOTES.md for the runs.
"""

from __future__ import annotations

from dataclasses import dataclass

HEAD_DIMS = tuple(range(8, 257, 8))
DTYPES = ("float16", "bfloat16")

# Per-block dynamic shared memory limits (opt-in maximum), bytes.
SMEM_LIMIT = {
    "sm80": 166912,  # A100 / A30: 163 KB
    "sm86": 101376,  # GA10x, Ada (sm_86/87/89) and consumer Blackwell (sm_120): 99 KB
    "sm90": 232448,  # H100 / H200: 227 KB
}


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    warps: int


def fwd_smem_bytes(head_dim: int, cfg: TileConfig) -> int:
    """Dynamic shared memory of the forward kernel: sQ plus two stages of sK and sV.

    Rows are padded to an odd number of 16-byte chunks (conflict-free ldmatrix).
    """
    chunks = head_dim // 8
    pitch = head_dim if chunks % 2 == 1 else head_dim + 8
    return (cfg.block_m + 4 * cfg.block_n) * pitch * 2


def arch_family(cc_major: int, cc_minor: int) -> str:
    """Maps a compute capability to the table that serves it."""
    if cc_major < 8:
        raise RuntimeError(
            f"cuflash needs a GPU of compute capability 8.0 or newer (bf16 mma.sync); got {cc_major}.{cc_minor}")
    if cc_major == 8 and cc_minor == 0:
        return "sm80"
    if cc_major == 9 or cc_major == 10:
        return "sm90"  # sm_100 has the same 227 KB of shared memory per block
    return "sm86"      # 8.6 / 8.7 / 8.9 / 12.x: 99 KB


def compile_arch(cc_major: int, cc_minor: int) -> str:
    """The NVRTC target for a device: Hopper gets sm_90a (wgmma / setmaxnreg available)."""
    if cc_major == 9 and cc_minor == 0:
        return "sm_90a"
    return f"sm_{cc_major}{cc_minor}"


def family_of_target(target: str) -> str:
    """'sm_90a' -> 'sm90', 'sm_80' -> 'sm80', ... (used by the compile gate and precompile)."""
    digits = "".join(ch for ch in target if ch.isdigit())
    return arch_family(int(digits[:-1]), int(digits[-1]))


def fwd_config(family: str, head_dim: int, dtype: str) -> TileConfig:
    """The forward tile configuration for one (architecture family, head_dim, dtype).

    dtype does not change the choice today: fp16 and bf16 have the same size and mma rate.
    """
    if family not in SMEM_LIMIT:
        raise KeyError(f"no tile table for architecture family {family!r}")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim {head_dim} has no configuration; expected a multiple of 8 in [8, 256]")
    if family == "sm90" or family == "sm80":
        # Measured on an H200 (bench/dev/smoke_fwd.py, bf16, batch 4 x seqlen 4096, hidden 2048,
        # forward TFLOP/s non-causal / causal; bench/NOTES.md, 2026-11-21). Not yet measured on A100:
        # sm80 takes the same choices, which fit its 163 KB.
        if head_dim <= 64:
            # 128x64, 4 warps (2 m16 tiles each): 302 / 290. 64x64x4: 237 / 243; 128x64x8: 261 / 186;
            # 128x32x4: 292 / 240. Two m16 tiles per warp reuse every K/V fragment twice.
            cfg = TileConfig(128, 64, 4)
        elif head_dim <= 128:
            # 64x64, 4 warps: 285 / 253. 128x64x4: 217 / 224; 128x64x8: 215 / 191; 128x32x8: 246 / 196;
            # 128x128x8: 263 / 248.
            cfg = TileConfig(64, 64, 4)
        else:
            # At head_dim 256: 128x32, 8 warps: 244 / 206. 64x32x4: 231 / 199; 64x64x4: 119 / 130
            # (255 registers: O alone is 128 floats a thread).
            cfg = TileConfig(128, 32, 8)
    else:
        # sm86 family (99 KB): not measured yet; the sm90 choices, shrunk to fit.
        if head_dim <= 64:
            cfg = TileConfig(128, 64, 4)
        elif head_dim <= 128:
            cfg = TileConfig(64, 64, 4)
        else:
            cfg = TileConfig(64, 32, 4)
    assert fwd_smem_bytes(head_dim, cfg) <= SMEM_LIMIT[family], (family, head_dim, cfg)
    return cfg
