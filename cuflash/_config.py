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
SM90_SMEM_PER_SM = 228 * 1024  # an H100 / H200 SM's shared memory (each resident block also takes 1 KB of it)


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    warps: int
    wgmma: bool = False  # the sm_90a warpgroup kernel (cuda_src/flash_fwd_sm90.cu); warps = 4 per 64 rows


def padded_pitch(cols: int) -> int:
    """Row pitch (elements) of a 16-bit shared-memory tile: an odd number of 16-byte chunks, so that
    ldmatrix is conflict-free (cuda_src/common.cuh:padded_pitch)."""
    return cols if (cols // 8) % 2 == 1 else cols + 8


# The TMA variant of the sm_90a forward (docs/hopper_plan.md step 1): K and V through tensor maps,
# its four mbarriers after the V stages; plain calls only. CUFLASH_FWD_TMA (read when a plan is made):
# "0" never, "1" wherever the layout fits a map, unset: where it fits and the driver's maps of that
# layout can be patched per pointer (cuflash/_tma.py learn_patch), so a new pointer costs no encode.
FWD_TMA_BAR_BYTES = 64


def fwd_tma_bar_bytes(head_dim: int) -> int:
    """The TMA variant's mbarrier bytes past fwd_smem_bytes: none at head_dim 64, where they sit in
    unread bytes of the ones rows (FwdSm90Traits::TMA_BAR_BYTES)."""
    return 0 if head_dim == 64 else FWD_TMA_BAR_BYTES


# The TMA variant of the sm_90a dK/dV kernel (cuda_src/flash_bwd_sm90.cu, TMA): Q, dO, K and V
# through tensor maps, its three mbarriers after sDelta; plain calls only, opt-in with
# CUFLASH_BWD_TMA=1 (read when a plan is made; the deterministic backward, or where the
# warp-specialized one is off). Measured on an H100: 0.69-0.74 of cuDNN against 0.66-0.74 for
# cp.async, far below flash_bwd_sm90_ws.cu.
BWD_TMA_BAR_BYTES = 64


def bwd_tma_enabled() -> bool:
    import os

    return os.environ.get("CUFLASH_BWD_TMA") == "1"


# The warp-specialized sm_90a backward (cuda_src/flash_bwd_sm90_ws.cu): a TMA producer warp, two
# consumer warpgroups, dQ by vector reductions from registers (BWD_WS_DQ_RED) or by bulk reductions
# from shared memory; 64 x 128 tiles (128 x 128 at head_dim 64), head_dim 64
# and 128; at 256 cuda_src/flash_bwd_sm90_ws256.cu (64 x 64 tiles, dQ by vector reductions); calls
# with the atomic dQ path. CUFLASH_BWD_WS (read when a plan is made): "1" wherever it serves the call,
# "0" never; unset: where it serves the call and the maps patch per pointer (as CUFLASH_FWD_TMA).
BWD_WS_STAGES = 2
BWD_WS_HEAD_DIMS = (64, 128, 256)
# Head dims whose options' backward (windows, sinks, ALiBi, lengths, packed batches) runs on the
# warp-specialized kernels (256: cuda_src/flash_bwd_sm90_ws256.cu, 64 x 64 tiles).
BWD_WS_FEAT_HEAD_DIMS = (64, 128, 256)
# Query rows per iteration (BLOCK_M) by head_dim: 128 at head_dim 64 (FlashAttention-3's choice
# there; the consumers then split dQ by rows), 64 at 128 (128 would not fit in shared memory).
# Measured on an H100 (bench.py --quick, bf16, head_dim 64, backward TFLOP/s at 2k / 8k, cuDNN in
# the same run): non-causal 412 / 481 against 342 / 397 with 64 rows (cuDNN 418 / 481); causal 299 /
# 427 against 277 / 369 (cuDNN 314 / 420).
BWD_WS_BLOCK_M = {64: 128, 128: 64, 256: 64}
# dQ from the consumers' registers by vector reductions (red.global.add.v4.f32) at head_dim 64 and
# 128, rather than through sdQ and a bulk reduction (cp.reduce.async.bulk) per consumer and query
# block. H200, session 38, call 3, same process (bench/dev/fwd_ab_inproc.py PASS=bwd, bf16 and fp16,
# 1k-16k keys): 0.893-0.969 of the bulk path's GPU time non-causal, 0.927-0.969 causal (geomean
# 0.941; single eager calls 0.927-0.975). bench.py in the same call, against cuDNN: backward geomean
# 1.04 -> 1.08, lowest point 0.96 -> 1.02. Head_dim 64 with per-sequence lengths keeps the bulk path
# (bwd_ws_dq_red).
BWD_WS_DQ_RED = True


def bwd_pad_head_dim(target: str, head_dim: int) -> int | None:
    """Head_dim pad-up of the backward: the head_dim of the warp-specialized kernel a plain call of
    another head_dim runs on (the next of BWD_WS_HEAD_DIMS), or None. The kernel reads the call's
    tensors through tensor maps whose columns past head_dim are TMA's zeros, and writes only the
    call's columns; the scores and the gradients' columns below head_dim are unchanged. Measured on
    an H100 (session 9, bench.py bf16, 16k tokens, seqlen 1k / 4k, non-causal and causal, pad-up on
    against CUFLASH_BWD_PAD=0 in one call; bench/results/padup_{on,off}_h100.json): head_dim 40
    1.93-2.51x, 72 1.92-2.37x, 96 2.06-2.59x, 136 1.55-1.88x, 200 1.90-2.43x. Head dims below 32 keep
    the mma.sync kernel (padding would more than double their products; not measured).
    CUFLASH_BWD_PAD=0 turns it off."""
    import os

    if (target != "sm_90a" or head_dim in BWD_WS_HEAD_DIMS or not 32 <= head_dim <= 256
            or os.environ.get("CUFLASH_BWD_PAD") == "0"):
        return None
    return next(d for d in BWD_WS_HEAD_DIMS if d > head_dim)


def fwd_pad_head_dim(target: str, head_dim: int, plain: bool = False, causal: bool = False,
                     seqlen_k: int | None = None, feat: str | None = None) -> int | None:
    """Head_dim pad-up of the forward (as bwd_pad_head_dim for the backward): the head_dim of the
    warp-specialized forward a call of another head_dim runs on, or None. From FWD_PAD_MIN_HEAD_DIM to
    256 for every call. Plain calls (plain=True) also at head_dim 24 to 56, to the kernel of 64, from
    FWD_PAD_SMALL_MIN_SEQLEN_K's keys on (seqlen_k None: the call's length unknown, as when listing
    specializations; the kernel of 64 then serves them at any length, past fwd_ws_config's own
    FWD_WS_MIN_SEQLEN_K for head_dim 64). Measured on an H100 (session 9, bench.py bf16, 16k tokens,
    seqlen 1k / 4k, non-causal and causal, against CUFLASH_FWD_PAD=0 in one call;
    bench/results/padup_{on,off}_h100.json): head_dim 72 1.23-1.46x, 96 1.40-1.67x, 136 1.35-1.65x,
    200 1.76-1.97x. Below 64: FWD_PAD_SMALL_MIN_SEQLEN_K. Calls with options at head_dim 24 to 56 pad to the
    feature kernel of 64 from FWD_PAD_SMALL_SCORES_MIN_SEQLEN_K's keys on (feat="scores": softcap,
    ALiBi or sink logits among them) or FWD_PAD_SMALL_MASK_MIN_SEQLEN_K's (feat="mask": only lengths,
    packed batches, windows, sink tokens); causal there: the window's right edge is 0; seqlen_k:
    the keys a query row can see (a window's width where it is narrower). CUFLASH_FWD_WS=1 pads at
    every length (plain calls: where the table has the head_dim; calls with options: 24 to 56).
    CUFLASH_FWD_PAD=0 turns it off."""
    import os

    if (target != "sm_90a" or head_dim in WGMMA_FWD_HEAD_DIMS or head_dim > 256
            or os.environ.get("CUFLASH_FWD_PAD") == "0" or os.environ.get("CUFLASH_FWD_WS") == "0"):
        return None
    if head_dim >= FWD_PAD_MIN_HEAD_DIM:
        return 128 if head_dim < 128 else 256
    if feat is not None and head_dim >= 24 and os.environ.get("CUFLASH_FWD_WS") == "1":
        return 64  # (every length and option, as for plain calls below: tuning runs and tests)
    table = {None: FWD_PAD_SMALL_MIN_SEQLEN_K if plain else {}, "scores": FWD_PAD_SMALL_SCORES_MIN_SEQLEN_K,
             "mask": FWD_PAD_SMALL_MASK_MIN_SEQLEN_K}[feat]
    least = table.get((head_dim, bool(causal)))
    if least is None or (seqlen_k is not None and seqlen_k < least
                         and os.environ.get("CUFLASH_FWD_WS") != "1"):  # (=1: every length, tuning runs)
        return None
    return 64


FWD_PAD_MIN_HEAD_DIM = 72  # the first multiple of 8 above 64
# Plain calls below 64 pad up to the kernel of 64 from this many keys on, per (head_dim, causal)
# (fwd_pad_head_dim). Measured on an H200 (session 36, bench.py bf16 and fp16, 16k tokens, pad-up at
# every length (CUFLASH_FWD_WS=1) against CUFLASH_FWD_PAD=0 in one call, GPU time of the padded call
# over the mma.sync kernel's; bench/results/fwd_small_pad{all,off}_s36_h200.json): non-causal, 512 /
# 1k / 2k / 4k keys: head_dim 24 1.31 / 1.08 / 0.88 / 0.82-0.83, 32 1.05-1.25 / 0.90-1.05 / 0.75-0.87 /
# 0.70-0.81, 40 0.95-0.96 / 0.80-0.82 / 0.67-0.68 / 0.63-0.64, 48 0.90-0.91 / 0.76 / 0.62 / 0.59-0.60,
# 56 0.80-0.82 / 0.67-0.69 / 0.57 / 0.54; causal: 24 1.43-1.62 / 1.26-1.40 / 0.96-1.05 / 0.86-0.93, 32
# 1.33-1.37 / 1.16-1.21 / 0.89-0.92 / 0.80-0.82, 40 1.20-1.23 / 1.03-1.06 / 0.78-0.80 / 0.70, 48
# 1.13-1.16 / 0.99-1.01 / 0.75-0.77 / 0.68-0.69, 56 1.00-1.04 / 0.86-0.90 / 0.65-0.67 / 0.60-0.62.
# Single eager calls (host included) in the same run, at the lengths the table pads: 0.55-1.02 (the
# 1.02: head_dim 48 bf16 non-causal 512, GPU 0.90; 0.89 eager in session 36's final run). Head dims 8
# and 16 lose at every length measured (bench/dev/padup_small.py, 1k and 4k: 1.03-1.83x) and are not
# in the table.
FWD_PAD_SMALL_MIN_SEQLEN_K = {(24, False): 2048, (32, False): 2048, (40, False): 512, (48, False): 512,
                              (56, False): 512, (24, True): 4096, (32, True): 2048, (40, True): 2048,
                              (48, True): 2048, (56, True): 1024}
# Calls with options below 64 pad up to the feature kernel of 64 (FWD_WS_FEAT_TABLE: two consumers, not
# the plain kernel's three; never with a narrow window, which that kernel does not take) from this many
# keys on, per (head_dim, causal: the window's right edge is 0). Measured on an H200 (session 37,
# bench/dev/padup_small_feat.py: 16k tokens, 512-4096 keys, bf16 and fp16, pad-up at every length
# against CUFLASH_FWD_PAD=0; GPU time of the padded call over the mma.sync feature kernel's, the worst
# over the options and dtypes; bench/results/logs_s37/). The options split in two:
# - softcap, ALiBi, sink logits (per-score work, cheaper on the warp-specialized kernel): non-causal
#   512 / 1k / 2k / 4k: head_dim 24 1.24 / 1.06 / 0.96 / 0.91, 32 1.14 / 0.98 / 0.90 / 0.86, 40 1.05 /
#   0.89 / 0.81 / 0.76, 48 0.99 / 0.85 / 0.77 / 0.72, 56 0.89 / 0.75 / 0.67 / 0.64; causal: 24 1.25 /
#   1.03 / 0.87 / 0.77, 32 1.20 / 0.99 / 0.84 / 0.75, 40 1.13 / 0.94 / 0.79 / 0.69, 48 1.09 / 0.91 /
#   0.77 / 0.68, 56 1.00 / 0.83 / 0.70 / 0.62 (softcap alone 0.54-0.76 non-causal);
# - lengths, packed batches, windows (masks only): non-causal (lengths): 24 1.76 / 1.39 / 1.13 / 1.02,
#   32 1.65 / 1.29 / 1.06 / 0.95, 40 1.51 / 1.20 / 0.97 / 0.84, 48 1.43 / 1.14 / 0.93 / 0.82, 56 1.27 /
#   0.99 / 0.80 / 0.71; causal (lengths, packed): 24 2.09 / 1.72 / 1.38 / 1.21, 32 2.02 / 1.68 / 1.33 /
#   1.20, 40 1.84 / 1.51 / 1.27 / 1.10, 48 1.76 / 1.40 / 1.17 / 1.01, 56 1.58 / 1.29 / 0.96 / 0.86; a
#   window (1024, 0) at 2k-4k keys 0.99-1.42 (as its width, 1k keys, reads).
# Each entry is the first length from which every longer one measured won by 2 % or more (GPU time).
FWD_PAD_SMALL_SCORES_MIN_SEQLEN_K = {(24, False): 2048, (32, False): 2048, (40, False): 1024, (48, False): 1024,
                                     (56, False): 512, (24, True): 2048, (32, True): 2048, (40, True): 1024,
                                     (48, True): 1024, (56, True): 1024}
FWD_PAD_SMALL_MASK_MIN_SEQLEN_K = {(32, False): 4096, (40, False): 2048, (48, False): 2048, (56, False): 2048,
                                   (56, True): 4096}


def fwd_pad_tma(target: str, head_dim: int, causal: bool, seqlen_k: int | None = None) -> bool:
    """Whether a plain forward at head_dim 24 to 56 runs the TMA variant of flash_fwd_sm90.cu at
    head_dim 64 (64-row blocks: what head_dim 64 itself runs at these lengths), with maps of its own
    head_dim and FwdTmaParams.d_cols: from the first to the second length of
    FWD_PAD_SMALL_TMA_SEQLEN_K's entry (the warp-specialized kernel's pad-up, fwd_pad_head_dim, from
    FWD_PAD_SMALL_MIN_SEQLEN_K's on). seqlen_k None: any length (listing specializations).
    CUFLASH_FWD_PAD_TMA=1 at every length and head_dim 24-56 (tuning runs; it then takes the calls
    the warp-specialized kernel would), =0 never; CUFLASH_FWD_PAD=0 or CUFLASH_FWD_TMA=0 turn it off
    too, and CUFLASH_FWD_WS=1 (the warp-specialized kernel wherever it serves) leaves the calls to
    that kernel. Read when a plan is made."""
    import os

    mode = os.environ.get("CUFLASH_FWD_PAD_TMA", "")
    if (target != "sm_90a" or not 24 <= head_dim < 64 or mode == "0" or os.environ.get("CUFLASH_FWD_PAD") == "0"
            or fwd_tma_mode() == "off" or (os.environ.get("CUFLASH_FWD_WS") == "1" and mode != "1")):
        return False
    if mode == "1":
        return True
    span = FWD_PAD_SMALL_TMA_SEQLEN_K.get((head_dim, bool(causal)))
    return span is not None and (seqlen_k is None or span[0] <= seqlen_k < span[1])


# Plain calls below 64 on the TMA variant of 64 (fwd_pad_tma): (from, below) keys per (head_dim,
# causal); inside the span it goes before the warp-specialized kernel's pad-up. Measured on an H200
# (session 37, bench.py bf16 and fp16, 16k tokens, CUFLASH_FWD_PAD_TMA=1 against the tree's rule in
# one call; GPU time, bench/results/fwd_small_tma_{tree,all}_s37_h200.json), 512 / 1k / 2k / 4k keys:
# non-causal head_dim 32 0.81-0.97 / 0.82-0.90 / 1.07-1.10 / 1.13-1.14, 48 0.77 / 0.93-0.94 / 1.09-1.13 /
# 1.13-1.15, 56 0.94 / 1.08-1.09 / 1.21-1.32 / 1.30-1.44; causal 32 0.80-0.83 / 0.81-0.84 / 0.90-0.93 /
# 1.01, 48 0.69-0.70 / 0.68-0.69 / 0.90-0.99 / 1.10-1.11, 56 0.68-0.70 / 0.81 / 1.10-1.11 / 1.15-1.27
# (against the mma.sync kernel below FWD_PAD_SMALL_MIN_SEQLEN_K, the warp-specialized kernel's pad-up
# from it). Head dims 24 and 40 lose everywhere with these tiles (1.12-1.74; 0.97-0.99 at causal 40
# 512): the rows of 48 and 80 bytes, unaligned to 32-byte sectors, cost 64-row blocks more traffic per
# product than the warp-specialized kernel's 192 (the padded kernel at 4k keys: 270-300 TFLOP/s of
# head_dim 64's work at 24 and 40, 430-455 at 32 and 48, 335-355 at 56); 40 and 56 take 128-row
# tiles (FWD_PAD_SMALL_TMA_TILE). Each span: the lengths where both dtypes won by 2 % or more.
FWD_PAD_SMALL_TMA_SEQLEN_K = {(32, False): (512, 2048), (32, True): (512, 4096), (48, False): (512, 2048),
                              (48, True): (512, 2048), (56, False): (512, 2048), (56, True): (512, 2048),
                              (40, False): (512, 2048), (40, True): (512, 4096)}
# ... with 128 x 64 tiles in place of head_dim 64's own (fwd_tma_config_for_target) at these: 128-row
# blocks read K and V half as often, which is what the unaligned rows of 80 and 112 bytes cost.
# Measured on an H200 (session 37, bench.py bf16 / fp16, CUFLASH_FWD_PAD_TMA=1 CUFLASH_FWD_TMA_TILE=
# 128x64 against the rule above with 64-row tiles, whose spans then held 32, 48, 56 only (56
# non-causal to 1024); bench/results/fwd_small_tma128_{tree,all}_s37_h200.json), GPU time, 512 / 1k /
# 2k / 4k: head_dim 40 non-causal 0.86-0.87 / 0.95-0.97 / 1.10-1.11 / 1.14 (against the warp-
# specialized kernel's pad-up), causal 0.83 / 0.80 / 0.98 / 1.05-1.06 (mma.sync, then the warp-
# specialized kernel); 56 non-causal 0.97-0.98 / 0.95-0.96 (64 x 128 tiles, then the warp-specialized
# kernel) / 1.09-1.11; 24 causal 0.97-1.10 / 0.94-1.04 / 0.91-1.01 (fp16 lost: not taken).
FWD_PAD_SMALL_TMA_TILE = {(40, False): (128, 64), (40, True): (128, 64), (56, False): (128, 64)}


def fwd_pad_tma_config(target: str, head_dim: int, dtype: str, causal: bool,
                       seqlen_k: int | None = None) -> TileConfig:
    """The TMA variant of 64's tiles for a call of head_dim that fwd_pad_tma puts there:
    FWD_PAD_SMALL_TMA_TILE's where it has the call, else head_dim 64's own at seqlen_k
    (fwd_tma_config_for_target, which CUFLASH_FWD_TMA_TILE overrides for both)."""
    import os

    tile = FWD_PAD_SMALL_TMA_TILE.get((head_dim, bool(causal)))
    if tile is None or os.environ.get("CUFLASH_FWD_TMA_TILE"):
        return fwd_tma_config_for_target(target, 64, dtype, causal, seqlen_k)
    return TileConfig(tile[0], tile[1], tile[0] // 16, wgmma=True)


def bwd_ws_block_n(head_dim: int) -> int:
    """Keys per tile of the warp-specialized backward: 128 (two consumers of 64 keys), 64 at head_dim
    256 (flash_bwd_sm90_ws256.cu: the consumers split head_dim instead)."""
    return 64 if head_dim == 256 else 128


def bwd_ws_block_m(head_dim: int) -> int:
    """BWD_WS_BLOCK_M, or CUFLASH_BWD_WS_BLOCK_M=64 (tuning) at head_dim 64."""
    import os

    if head_dim == 256:
        return 64
    return 64 if os.environ.get("CUFLASH_BWD_WS_BLOCK_M") == "64" else BWD_WS_BLOCK_M[head_dim]


def bwd_ws_dq_red(head_dim: int, seqs: bool = False) -> bool:
    """Whether flash_bwd_sm90_ws.cu adds dQ by red.global.add.v4.f32 from the consumers' registers (the
    kernel's DQ_RED; BWD_WS_DQ_RED) rather than through sdQ and one bulk reduction per consumer;
    CUFLASH_BWD_DQ_RED=0 / 1 (tuning) overrides. Head dims 64 and 128 (256 always adds from registers),
    except head_dim 64 with per-sequence lengths (seqs, the kernel's SEQS), where ptxas spills 4 bytes
    with DQ_RED (NVRTC 13.0, sm_90a) and the compile gate would refuse it."""
    import os

    v = os.environ.get("CUFLASH_BWD_DQ_RED")
    return head_dim != 256 and not (seqs and head_dim == 64) and (v == "1" if v in ("0", "1") else BWD_WS_DQ_RED)


def bwd_ws_stages(head_dim: int, block_m: int, seqs: bool = False) -> int:
    """Stages of the Q / dO ring: CUFLASH_BWD_WS_STAGES (2 or 3; tuning) where they fit in shared
    memory (with sdQ or without: bwd_ws_dq_red), else BWD_WS_STAGES."""
    import os

    v = os.environ.get("CUFLASH_BWD_WS_STAGES")
    if v in ("2", "3") and (bwd_ws_smem_bytes(head_dim, int(v), block_m, bwd_ws_dq_red(head_dim, seqs))
                            <= SMEM_LIMIT["sm90"]):
        return int(v)
    return BWD_WS_STAGES


def bwd_ws_persistent() -> bool:
    """CUFLASH_BWD_WS_PERSISTENT=1: the warp-specialized backward on a persistent grid (one block per
    SM walking the tiles, longest causal ones first; blocks.cuh key_block_lpt) instead of one block
    per tile. Opt-in until measured."""
    import os

    return os.environ.get("CUFLASH_BWD_WS_PERSISTENT") == "1"


def bwd_ws_mode() -> str:
    """'off', 'force' or 'auto'."""
    import os

    v = os.environ.get("CUFLASH_BWD_WS")
    return "off" if v == "0" else "force" if v == "1" else "auto"


def bwd_ws_smem_bytes(head_dim: int, stages: int = BWD_WS_STAGES, block_m: int = 64, dq_red: bool = False) -> int:
    """Dynamic shared memory of flash_bwd_sm90_ws.cu (BwdWsTraits::SMEM_BYTES): sK, sV (128 rows),
    sQ / sdO rings (block_m rows), sdS[2] (128 x block_m), sdQ (block_m x head_dim floats; none with
    dq_red), the lse / delta rows, the mbarriers and 1024 bytes of alignment slack. Head_dim 256
    (flash_bwd_sm90_ws256.cu, BwdWs256Traits::SMEM_BYTES): sK, sV of 64 rows, the rings of 64 rows,
    sP[2] and sdS[2] (64 x 64), no sdQ."""
    m = block_m
    if head_dim == 256:
        assert m == 64, m
        return (2 * 64 * 256 * 2 + 2 * stages * 64 * 256 * 2 + 4 * 64 * 64 * 2 + stages * 2 * 64 * 4
                + 8 * (2 + 2 * stages) + 1024)
    sdq = 0 if dq_red else m * head_dim * 4
    return (2 * 128 * head_dim * 2 + 2 * stages * m * head_dim * 2 + 2 * 128 * m * 2 + sdq
            + stages * 2 * m * 4 + 8 * (2 + 2 * stages) + 1024)


def fwd_tma_mode() -> str:
    """'off', 'force' or 'auto' (see above)."""
    import os

    v = os.environ.get("CUFLASH_FWD_TMA", "")
    return "off" if v == "0" else "force" if v == "1" else "auto"


def fwd_tma_config_for_target(target: str, head_dim: int, dtype: str, causal: bool = False,
                              seqlen_k: int | None = None) -> TileConfig:
    """The tiles of the TMA variant: those of fwd_config_for_target, except at head_dim 256, where
    128 x 64 fits without the cp.async kernel's spill (235 registers, NVRTC 13) and is faster.
    Measured on an H100 (bench/dev/tma_tiles.py, bf16, 16k tokens, hidden 2048, TFLOP/s non-causal /
    causal at seqlen 4k): head_dim 256 128x64 565 / 472, 128x32 451 / 369; head_dim 128 128x128
    510 / 440, 128x192 486 / 436, 128x64 462 / 397; head_dim 64 128x64 406 / 367, 128x128 367 /
    323, 192x128 368 / 315, 128x96 338 / 300.
    Head_dim 64, where the TMA variant runs (below FWD_WS_MIN_SEQLEN_K), with the lazy rescale of
    session 21: 64-row blocks of one warpgroup, as cuDNN's kernel there. Same script, H100, TFLOP/s
    at 512 / 1k / 2k / 4k keys: non-causal 64x128 311 / 340 / 364 / 388, 64x64 302 / 331 / 352 /
    369, 128x64 303 / 335 / 359 / 376; causal 64x64 224 / 270 / 316 / 328, 64x128 205 / 268 / 305 /
    355, 128x64 206 / 263 / 304 / 337 (bench/results/tma_tiles_d64_s21_h100.json).
    Causal from FWD_TMA_CAUSAL_WIDE_SEQLEN_K keys on: 64 x 128 (seqlen_k None, as when a caller
    does not know the length: 64 x 64). CUFLASH_FWD_TMA_TILE="MxN" overrides head_dim 64's tiles
    (tuning runs; read when a plan is made)."""
    import os

    cfg = fwd_config_for_target(target, head_dim, dtype, causal)
    tile = os.environ.get("CUFLASH_FWD_TMA_TILE", "")   # tuning runs: "MxN" (M 64 or 128) at head_dim 64
    if cfg.wgmma and head_dim == 64 and tile:
        m, _, n = tile.partition("x")
        if m not in ("64", "128") or n not in ("64", "128"):
            raise ValueError(f"CUFLASH_FWD_TMA_TILE: expected 'MxN' with M and N 64 or 128, got {tile!r}")
        return TileConfig(int(m), int(n), int(m) // 16, wgmma=True)
    if cfg.wgmma and head_dim == 256:
        return TileConfig(128, 64, 8, wgmma=True)
    if cfg.wgmma and head_dim == 64:
        narrow = causal and (seqlen_k is None or seqlen_k < FWD_TMA_CAUSAL_WIDE_SEQLEN_K)
        return TileConfig(64, 64, 4, wgmma=True) if narrow else TileConfig(64, 128, 4, wgmma=True)
    return cfg


# Head_dim 64 causal on the TMA variant (below FWD_WS_MIN_SEQLEN_K's 4096 keys): 64 x 128 tiles from
# this many keys, 64 x 64 below. Measured on an H200 (session 59, bench/dev/fwd_ab_inproc.py, both
# tiles in one process, 9 rounds, 16k tokens; bench/results/logs_s59), 64 x 128's time / 64 x 64's,
# bf16 / fp16: 1024 keys 1.035 / 1.032, 1536 0.998 / 1.004, 2048 0.985 / 0.984 (0.986 / 0.979 and
# 0.983 / 0.978 in two more calls), 3072 0.966 / 0.966; head_dim 32, which pads up to this kernel
# (fwd_pad_tma), 1536 1.003 / 1.001, 2048 0.989 / 0.986, 3072 0.970 / 0.970. (On an H100 in session
# 21, before the later softmax changes, 64 x 64 led at 2048 keys causal: 316 against 305 TFLOP/s.)
FWD_TMA_CAUSAL_WIDE_SEQLEN_K = 2048


# The warp-specialized sm_90a forward (cuda_src/flash_fwd_sm90_ws.cu; docs/hopper_plan.md step 2):
# a TMA producer warpgroup and two or three wgmma consumer warpgroups of 64 query rows each; plain
# calls whose q, k and v fit tensor maps (the TMA variant's conditions, cuflash/_launch.py _use_tma).
FWD_WS_STAGES = 2

# (head_dim, causal) -> (BLOCK_N, STAGES, ...) of the K / V rings, where the warp-specialized kernel is
# the default. Measured on an H100 (bench/dev/tma_tiles.py --ws, bf16, 16k tokens, hidden 2048,
# TFLOP/s at seqlen 4k / 16k; the TMA variant of flash_fwd_sm90.cu in brackets, from the same
# script's run one device call earlier):
#   d64  full:   n128 s3 424 / 440; n128 s2 408 / 423; n64 s2 364 / 389   (TMA 128x64: 406 / 425)
#   d64  causal: n64 s2 341 / 391; n64 s4 339 / 392; n128 s2 332 / 376    (TMA 128x64: 367 / 398): TMA kept
#   d128 full:   n128 s2 611 / 655; n128 s3 602 / 618                     (TMA 128x128: 510 / 536)
#   d128 causal: n128 s3 506 / 620; n128 s2 509 / 557                     (TMA 128x128: 440 / 523)
#   d256 full:   n64 s2 661 / 706                                         (TMA 128x64: 565 / 602)
#   d256 causal: n64 s2 507 / 621                                         (TMA 128x64: 472 / 581)
# The third entry: the pingpong schedule between the consumers (flash_fwd_sm90_ws.cu PINGPONG); the
# fourth: the consumer warpgroups (2: 128 query rows a block; 3: 192).
# Measured on an H100 (same script, --pingpong, seqlen 2k / 4k / 16k, one run): d128 full n128 s2
# 546 / 590 / 637, with pingpong 570 / 612 / 612 (an earlier run: 584 -> 589 at 4k, 628 -> 653 at 16k);
# d128 causal n128 s3 418 / 482 / 584, n128 s2 417 / 488 / 577, n128 s2 with pingpong 435 / 491 / 589;
# d64 full n128 s2 395 / 417 / 441, with pingpong 390 / 408 / 426 (kept without).
# Three consumers at head_dim 64 (--consumers 2 3, seqlen 2k / 4k / 16k, one run): full n128 s3 389 /
# 413 / 471 against 383 / 410 / 437 with two; causal n128 s3 307 / 351 / 436 against the TMA
# variant's 329 / 360 / 384 (kept: it leads at 2k and 4k).
# Below a seqlen_k the warp-specialized kernel's per-block setup outweighs its speed: head_dim 64
# non-causal at 512 keys took 1.12 to 1.15x the time of the cp.async wgmma kernel of
# bench/results/h100.json (two and three consumers, two runs); from 2k it is 7 to 17 % faster.
# Those calls take the TMA variant of flash_fwd_sm90.cu.
# Head_dim 64 causal (H200, session 7, bench.py fwd, 16k tokens, both dtypes, TFLOP/s at 2k / 4k / 8k
# / 16k, bench/results/fwd64_causal_*_h200.json): TMA variant 336 / 368 / 379 / 398 (bf16), 330 /
# 354 / 374 / 388 (fp16); three consumers n128 s2 302 / 352 / 402 / 430, 294 / 342 / 397 / 428; two
# consumers 282 / 321 / 346 / 370. Three consumers from 8192 keys.
# Session 20 (H100, the kernels with iteration 0 peeled and the mask-free loop; bench/dev/fwd_ab_inproc.py
# with CUFLASH_FWD_WS=1 against the table's choice, same process, both trees with an environment set
# around their calls; NOTES, call 5): head_dim 64 causal, three consumers' time /
# the TMA variant's 0.945 at 4096 keys (bf16 and fp16 alike), 1.007 at 2048, 1.21 at 1024. Three
# consumers from 4096 keys.
FWD_WS_MIN_SEQLEN_K = {(64, False): 2048, (64, True): 4096}
# ... and from these keys where seqlen_q fills the kernel's blocks (a multiple of 64 rows a consumer: 192
# at head_dim 64), whose last block then has no idle consumer. Measured on an H200 (session 59,
# bench/dev/fwd_ab_inproc.py, 16k tokens, 9 rounds, bf16 / fp16), head_dim 64 causal, three consumers'
# time / the TMA variant's (64 x 128 tiles): whole blocks 2304 keys 0.979 / 0.984, 3072 0.966 / 0.957 and
# 0.963 / 0.962 (two calls); a last block 2/3 full 2816 1.015 / 1.016, 3584 0.997 / 0.997; 1/3 full
# 2560 1.044 / 1.047; 2048 (10 2/3 blocks) about 1.07. With the rule, time / without it (another
# call): 2304 0.982 / 0.979, 2496 1.015 / 1.017, 2688 0.970 / 0.951, 3072 0.962 / 0.972, 3264 0.986 /
# 0.982 (geomean 0.981); the lengths it leaves alone (2048, 2560, 4096) 0.994-1.003.
FWD_WS_WHOLE_BLOCKS_MIN_SEQLEN_K = {(64, True): 2304}
FWD_WS_TABLE = {(64, False): (128, 3, False, 3), (64, True): (128, 2, False, 3), (128, False): (128, 2, True, 2),
                (128, True): (128, 2, True, 2), (256, False): (64, 2, False, 2), (256, True): (64, 2, False, 2)}


def fwd_ws_config(head_dim: int, causal: bool, seqlen_k: int | None = None, seqlen_q: int | None = None):
    """(BLOCK_N, STAGES, PINGPONG, CONSUMERS) of the warp-specialized forward for a plain call, or None where the
    table keeps the TMA variant. CUFLASH_FWD_WS: "0" never; "1" at every head_dim it serves (64, 128,
    256); unset: the table. CUFLASH_FWD_WS_BLOCK_N and CUFLASH_FWD_WS_STAGES override the tiles
    (tuning runs, bench/dev/tma_tiles.py); seqlen_k below FWD_WS_MIN_SEQLEN_K keeps the TMA variant
    (unless CUFLASH_FWD_WS=1), except from FWD_WS_WHOLE_BLOCKS_MIN_SEQLEN_K's keys when seqlen_q is a
    multiple of the blocks' rows; CUFLASH_FWD_WS_PINGPONG "1" / "0" turns the pingpong
    schedule between the two consumers on / off (flash_fwd_sm90_ws.cu); CUFLASH_FWD_WS_CONSUMERS
    "2" / "3" the consumer warpgroups (three: head_dim 64 only, where 160 registers a thread suffice;
    no pingpong)."""
    import os

    mode = os.environ.get("CUFLASH_FWD_WS", "")
    if mode == "0" or head_dim not in WGMMA_FWD_HEAD_DIMS:
        return None
    cfg = FWD_WS_TABLE.get((head_dim, causal))
    if cfg is not None and mode != "1" and seqlen_k is not None and seqlen_k < FWD_WS_MIN_SEQLEN_K.get(
            (head_dim, causal), 0):
        whole = FWD_WS_WHOLE_BLOCKS_MIN_SEQLEN_K.get((head_dim, causal))
        if whole is None or seqlen_k < whole or seqlen_q is None or seqlen_q % (64 * cfg[3]):
            return None
    if cfg is None:
        if mode != "1":
            return None
        cfg = (64 if head_dim > 128 else 128, FWD_WS_STAGES, False, 2)
    bn, stages = os.environ.get("CUFLASH_FWD_WS_BLOCK_N"), os.environ.get("CUFLASH_FWD_WS_STAGES")
    pp, cons = os.environ.get("CUFLASH_FWD_WS_PINGPONG"), os.environ.get("CUFLASH_FWD_WS_CONSUMERS")
    consumers = int(cons) if cons in ("2", "3") and head_dim == 64 else cfg[3]  # three: head_dim 64 only
    pingpong = (cfg[2] if pp not in ("0", "1") else pp == "1") and consumers == 2
    return int(bn) if bn else cfg[0], int(stages) if stages else cfg[1], pingpong, consumers


# The warp-specialized forward with the optional features (FEAT: padded batches, windows, sinks, ALiBi,
# softcap; not packed batches, whose 4-D views have batch stride 0): (BLOCK_N, STAGES, PINGPONG,
# CONSUMERS) per head_dim, the causal tiles (windows are masked as causal is). Two consumers at
# head_dim 64 too: the mask's state does not fit three consumers' 160 registers.
FWD_WS_FEAT_TABLE = {64: (128, 2, False, 2), 128: (128, 2, True, 2), 256: (64, 2, False, 2)}


def fwd_ws_feat_config(head_dim: int, narrow_window: bool):
    """The warp-specialized forward's tiles for a call with options, or None where the feature
    kernels of flash_fwd_sm90.cu / flash_fwd.cu run: CUFLASH_FWD_WS=0, a head_dim outside
    FWD_WS_FEAT_TABLE, or a narrow window (NARROW_WINDOW; 64-row tiles waste less there) unless
    CUFLASH_FWD_WS=1."""
    import os

    mode = os.environ.get("CUFLASH_FWD_WS", "")
    if mode == "0" or (narrow_window and mode != "1"):
        return None
    return FWD_WS_FEAT_TABLE.get(head_dim)


def fwd_ws_smem_bytes(head_dim: int, block_n: int, stages: int = FWD_WS_STAGES, consumers: int = 2,
                      persistent: bool = False) -> int:
    """sQ (64 rows a consumer; two buffers when persistent), the K and V rings, the mbarriers, and 1024
    bytes of alignment slack. Must equal FwdWsTraits::SMEM_BYTES."""
    qbuf = 2 if persistent else 1
    ones = block_n * 128 if head_dim <= 128 else 0  # FwdWsTraits::ONES_PANEL_BYTES, after each V stage
    return (qbuf * 64 * consumers * head_dim * 2 + stages * (2 * block_n * head_dim * 2 + ones)
            + 8 * (qbuf + 4 * stages + (2 if persistent else 0)) + 1024)


def fwd_causal_tail_heads(bh_count: int, num_m_blocks: int, sm_count: int, blocks_per_sm: int) -> int:
    """FwdParams.tail_heads of a causal forward, plain or with a window (left, 0) among its options
    (blocks.cuh causal_block_order): enough (batch, head)s at the grid's end, taken query block by
    query block from the longest, to fill FWD_CAUSAL_TAIL_WAVES waves of the GPU (sm_count *
    blocks_per_sm blocks each); the rest keep the head-by-head order. CUFLASH_FWD_TAIL_BLOCKS=n asks for n blocks instead (0: head by head
    everywhere, the order before session 23), CUFLASH_FWD_TAIL_WAVES=x for x waves. Read when a plan
    is made."""
    import os

    env = os.environ.get("CUFLASH_FWD_TAIL_BLOCKS", "")
    waves = float(os.environ.get("CUFLASH_FWD_TAIL_WAVES", "") or FWD_CAUSAL_TAIL_WAVES)
    blocks = int(env) if env else int(waves * sm_count * blocks_per_sm)
    if blocks <= 0 or num_m_blocks <= 1:
        return 0
    return min(bh_count, -(-blocks // num_m_blocks))


# Waves of blocks that causal_block_order's tail covers. A list-scheduling model (blocks start in
# index order on the first free slot; a block's time its key tiles plus 1-2 tiles of setup) at
# FlashAttention-2's grid (16k tokens) put head-by-head order at 3-7 % over the ideal at 1k-8k keys,
# and two waves at the end taken longest first at 0.5-2 %. Measured (H100, session 23, same process,
# bf16, head_dim 64 / 128 / 256, 1k-16k keys, causal; bench/results/logs_s23/call2_*), time against
# head by head: 1 wave geomean 0.977 over 30 rows (causal 0.918-0.994), 2 waves 0.982, 4 waves 0.989
# (1.12-1.13 at two points), the whole grid 1.040 (1.3-1.8 at 1k: the blocks running together then
# belong to as many heads, whose K / V no longer stay in L2). Non-causal rows, the control: 0.97-1.01.
FWD_CAUSAL_TAIL_WAVES = 1


def bwd_causal_tail_heads(bh_count: int, n_blocks: int, group: int, sm_count: int) -> int:
    """BwdTmaParams.tail_heads of a causal backward (plain, or options with a window (left, 0)) on
    the warp-specialized kernels (blocks.cuh key_block_grouped): the last group of the tile order, at
    least a group of `group` and about BWD_CAUSAL_TAIL_WAVES waves of tiles (one block an SM). CUFLASH_BWD_TAIL_WAVES=x asks for x waves
    (0: no tail group, the order before session 23). Read when a plan is made."""
    import os

    waves = float(os.environ.get("CUFLASH_BWD_TAIL_WAVES", "") or BWD_CAUSAL_TAIL_WAVES)
    if waves <= 0 or n_blocks <= 1:
        return 0
    return min(bh_count, max(group, -(-int(waves * sm_count) // n_blocks)))


# Waves of tiles in the backward's tail group. The list-scheduling model of FWD_CAUSAL_TAIL_WAVES at
# FlashAttention-2's grid (head_dim 64 / 128, 1k-8k keys): groups of about one wave, the last one
# whatever is left, 1.03-1.09 over the ideal; a last group of one wave 1.005-1.024, of two 1.007-1.020.
# Measured (H100, session 23, both dtypes, head_dim 64 / 128 / 256, 1k-8k keys;
# bench/results/logs_s23/call3_inproc_bwd.log), backward time against no tail group: 1 wave geomean
# 0.987 over 48 rows (causal 0.944-0.999), 2 waves 0.988 (causal 0.950-1.008). One wave: with groups
# of about one wave, the last group is then a whole one.
BWD_CAUSAL_TAIL_WAVES = 1


def fwd_sched() -> bool:
    """Whether the persistent causal forward runs on work lists (cuflash/_schedule.py: the last heads'
    query blocks one by one, longest first, to the least loaded block) rather than its pairs alone
    (blocks.cuh persistent_tile). CUFLASH_FWD_SCHED=0 turns them off (read when a plan is made)."""
    import os

    return os.environ.get("CUFLASH_FWD_SCHED", "") != "0"


def fwd_split() -> bool:
    """Whether the persistent non-causal forward cuts the work tiles of its last wave into parts along
    their key tiles (cuflash/_schedule.py split_schedule) where the cost model gains.
    CUFLASH_FWD_SPLIT=0 turns that off (read when a plan is made)."""
    import os

    return os.environ.get("CUFLASH_FWD_SPLIT", "") != "0"


def fwd_ws_persistent() -> str:
    """Where the warp-specialized forward of plain calls runs on a persistent grid (one block per SM
    walking the query blocks; flash_fwd_sm90_ws.cu PERSISTENT): CUFLASH_FWD_WS_PERSISTENT "1": every
    entry of FWD_WS_PERSISTENT_TABLE ("all"); "0": none ("off"); unset: FWD_WS_PERSISTENT_DEFAULT's
    ("default")."""
    import os

    mode = os.environ.get("CUFLASH_FWD_WS_PERSISTENT", "")
    return {"1": "all", "0": "off"}.get(mode, "default")


# The persistent grid's tiles, (BLOCK_N, STAGES, PINGPONG, CONSUMERS) per (head_dim, causal): two
# consumers at head_dim 64 (with three, the loop's state over work tiles spilled at 160 registers);
# none at head_dim 256 (it spilled at 240). Measured (H100, session 8, bench.py fwd, 16k tokens,
# TFLOP/s persistent / one block per query block, same run, at 512 / 1k / 2k / 4k / 8k;
# bench/results/fwd_persistent_h100.json): head_dim 128 non-causal bf16 441 / 405, 528 / 522, 550 /
# 592, 589 / 611, 614 / 645 (fp16 419 / 398, 516 / 517, 566 / 566, 582 / 614, 596 / 601); causal
# bf16 262 / 225, 309 / 373, 465 / 469, 457 / 539, 584 / 588 (fp16 283 / 220, 302 / 368, 456 / 464,
# 471 / 503, 574 / 562). Head_dim 64 on two consumers lost at every length to the default's three
# consumers or TMA variant. So by default: head_dim 128 up to 512 keys, where the setup of a block
# per query block weighs most. Session 25 (H100, bench/dev/fwd_ab_inproc.py, both trees in one
# process, CUFLASH_FWD_WS_PERSISTENT=1 against =0, bf16 / fp16 GPU time, persistent / not): non-causal
# 512 0.949 / 0.948, 1k 0.985 / 0.988 (eager 0.969 / 0.972), 2k 0.995 / 0.996, 4k-16k 1.007-1.026;
# causal 512 0.905 / 0.909, 1k 1.18 / 1.19, 2k 1.04, 4k 1.12. So non-causal up to 1k keys.
# Session 26 (flash_fwd_sm90_ws.cu: the pingpong turns carried across work tiles, non-causal tiles in
# a block-per-tile grid's order, the stmatrix epilogue). Nsight Compute on an H100 had the persistent
# kernel's consumers at 2k keys wait for Q at each block's start where the block-per-tile grid ran
# (4.5 % of the stall samples). bench/dev/fwd_ab_inproc.py, both dtypes, against session 25's default
# kernels: persistent non-causal 512 0.92 / 0.96, 1k 0.92 / 0.92, 2k 0.95 / 0.94, 4k 0.99 / 0.97, 8k
# 0.98 / 1.00, 16k 0.96 / 0.99, where the block-per-tile grid read 0.99-1.00 from 2k; causal 1k-16k
# 1.07-1.75 (the snake order's imbalance). With locked clocks (ncu --clock-control base, bf16): 2k
# 505.5 us against 543.3 for session 25's persistent kernel (cuDNN 504.5), 16k 3.728 ms (cuDNN 3.758).
# Causal tiles then in pairs of equal work (cuda_src/blocks.cuh persistent_tile), same A/B, persistent
# / a block per query block (both this session's kernels), bf16 / fp16: 512 0.86, 1k 0.91 / 0.92, 2k
# 0.97 / 0.99, 4k 1.03 / 1.06, 8k 1.08, 16k 1.14. So non-causal at every length; causal up to 2048 keys.
FWD_WS_PERSISTENT_TABLE = {(64, False): (128, 3, False, 2), (64, True): (128, 2, False, 2),
                           (128, False): (128, 2, True, 2), (128, True): (128, 2, True, 2)}
# (head_dim, causal) -> the most keys for which the persistent grid is the default (None: every length)
FWD_WS_PERSISTENT_DEFAULT = {(128, False): None, (128, True): 2048}


def fwd_ws_persistent_default(head_dim: int, causal: bool, seqlen_k: int | None) -> bool:
    """Whether FWD_WS_PERSISTENT_DEFAULT puts a plain call on the persistent grid (seqlen_k None: the
    call's length unknown, as when listing specializations)."""
    if (head_dim, causal) not in FWD_WS_PERSISTENT_DEFAULT:
        return False
    bound = FWD_WS_PERSISTENT_DEFAULT[(head_dim, causal)]
    return bound is None or seqlen_k is None or seqlen_k <= bound


def fwd_ws_persistent_config(head_dim: int, causal: bool, seqlen_k: int | None = None,
                             seqlen_q: int | None = None):
    """The persistent warp-specialized forward's (BLOCK_N, STAGES, PINGPONG, CONSUMERS) for a plain
    call, or None (fwd_ws_config decides then): where fwd_ws_persistent() admits (head_dim, causal)
    and the table has it; by default up to FWD_WS_PERSISTENT_DEFAULT's keys (seqlen_k / seqlen_q
    None: the call's lengths unknown, as when listing specializations). Causal: only for an even
    number of query blocks a head (cuda_src/blocks.cuh persistent_tile pairs them). CUFLASH_FWD_WS=0:
    never."""
    import os

    mode = os.environ.get("CUFLASH_FWD_WS", "")
    where = fwd_ws_persistent()
    if mode == "0" or where == "off":
        return None
    if where == "default" and not fwd_ws_persistent_default(head_dim, causal, seqlen_k):
        return None
    cfg = FWD_WS_PERSISTENT_TABLE.get((head_dim, causal))
    if cfg is None:
        return None
    if causal and seqlen_q is not None and -(-seqlen_q // (64 * cfg[3])) % 2:
        return None
    pp = os.environ.get("CUFLASH_FWD_WS_PINGPONG")
    return cfg[0], cfg[1], (cfg[2] if pp not in ("0", "1") else pp == "1") and cfg[3] == 2, cfg[3]


def fwd_smem_bytes(head_dim: int, cfg: TileConfig) -> int:
    """Dynamic shared memory of the forward kernel: sQ plus two stages of sK and sV (the wgmma
    kernel: unpadded swizzled tiles, plus 1024 bytes to align them, and at head_dim 64 the 2048
    bytes of ones rows that make lp columns of P V: FwdSm90Traits::ONES_REGION_BYTES)."""
    if cfg.wgmma:
        return (cfg.block_m + 4 * cfg.block_n) * head_dim * 2 + 1024 + (2048 if head_dim == 64 else 0)
    return (cfg.block_m + 4 * cfg.block_n) * padded_pitch(head_dim) * 2


def bwd_smem_bytes(head_dim: int, cfg: TileConfig) -> int:
    """dK/dV kernel: sK, sV, two stages of sQ and sdO, sP^T and sdS^T, two stages of lse and delta
    (the wgmma kernel: swizzled tiles, sdS^T only, and 1024 bytes of alignment slack)."""
    if cfg.wgmma:
        d, m, n = head_dim, cfg.block_m, cfg.block_n
        return (2 * n * d + 4 * m * d + n * m) * 2 + 4 * m * 4 + 1024
    p, pp = padded_pitch(head_dim), padded_pitch(cfg.block_m)
    return (2 * cfg.block_n * p + 4 * cfg.block_m * p + 2 * cfg.block_n * pp) * 2 + 4 * cfg.block_m * 4


def bwd_dq_smem_bytes(head_dim: int, cfg: TileConfig) -> int:
    """Deterministic dQ kernel: sQ, sdO, two stages of sK and sV."""
    return (2 * cfg.block_m + 4 * cfg.block_n) * padded_pitch(head_dim) * 2


def row_kernel_rows(head_dim: int) -> int:
    """Rows per 256-thread block of the backward's row-wise kernels (preprocess, dq conversion):
    flash_bwd.cu's RowLanes<head_dim>::ROWS_PER_BLOCK. A row's head_dim / 8 chunks go to the next
    power of two of lanes; each thread takes 4 rows."""
    chunks = head_dim // 8
    tpr = 1
    while tpr < chunks:
        tpr *= 2
    return 256 // tpr * 4


# Every backward BLOCK_M divides this: the preprocess pads the per-row scratch to it.
BWD_ROW_PAD = 128

# For the mma.sync dK/dV kernel (every target but sm_90a at head_dim 64 / 128, where the wgmma
# kernel always takes the atomic path unless deterministic=True): dQ by float atomics inside the
# dK/dV kernel (True), or by the separate dQ kernel (False, also the deterministic path). Measured on an H200, bf16, batch 4 x seqlen 4096, hidden 2048, backward
# TFLOP/s atomic / separate: head_dim 64: 147 / 159 (causal 129 / 137); head_dim 128: 111 / 130
# (causal 105 / 120); again on the final kernels: head_dim 64: 142 / 157 (128 / 139), head_dim 128:
# 148 / 157 (131 / 138). The separate pass wins everywhere measured, so it is the default.
BWD_ATOMIC_DQ = False

# cuda_src/flash_bwd.cu DS_SPLIT_BELOW (the kernel's own constant; tests/test_plan_wiring.py checks they agree):
# below this head_dim the dQ kernel feeds dS as hi + lo and corrects D, and runs before the dK/dV kernel, leaving
# each row's corrected D* in the scratch for dK's dS (_launch.bwd_launches; the NumPy mirror, _cpu_backward).
BWD_DS_SPLIT_BELOW = 32

# The one-launch backward (flash_bwd.cu's dK/dV kernel with SINGLE): plain calls whose keys fit one
# key block of the mma.sync kernel (1 <= seqlen_k <= its BLOCK_N) and whose query rows (batch *
# nheads * seqlen_q) number at most this. It forms D and lse * log2(e) itself and writes dQ, so the
# preprocess, the dQ conversion (or the dQ kernel) and the scratch allocation go: a short call's
# backward is one launch instead of three. Above the bound the warp-specialized / wgmma kernels'
# throughput matters more than two launches.
BWD_SINGLE_MAX_ROWS = 16384
# ... and from this head_dim: below it the separate dQ kernel splits dS into two 16-bit operands and
# corrects D (flash_bwd.cu, DS_SPLIT_BELOW), which the one-launch kernel's dQ, from the rounded dS as
# the atomic path's, does not.
BWD_SINGLE_MIN_HEAD_DIM = 32


def bwd_single_config(family: str, head_dim: int, dtype: str) -> TileConfig:
    """The one-launch backward's tiles: the mma.sync kernel's (bwd_config), but 32 x 64 x 8 from head_dim
    88 to 128, where 32 x 128 x 8 with the kernel's own dQ stores spilled 8-56 bytes (NVRTC 13.0: at
    104-128 and 88 on sm_90a, at 128 on sm_80; bench/NOTES.md, session 60); its key block, and so the
    calls it serves, is then 64 keys."""
    if 80 < head_dim <= 128:
        return TileConfig(32, 64, 8)
    return bwd_config(family, head_dim, dtype)


def bwd_single_mode() -> str:
    """CUFLASH_BWD_SINGLE: "0" never the one-launch backward, "1" wherever it can run (tests and
    tuning: any row count), else "auto" (BWD_SINGLE_MAX_ROWS). Read when a plan is made."""
    import os

    v = os.environ.get("CUFLASH_BWD_SINGLE")
    return {"0": "off", "1": "force"}.get(v, "auto")


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


def fwd_config(family: str, head_dim: int, dtype: str, causal: bool = False) -> TileConfig:
    """The forward tile configuration for one (architecture family, head_dim, dtype, causal).

    dtype does not change the choice today: fp16 and bf16 have the same size and mma rate.
    """
    _check_family_head_dim(family, head_dim)
    if family == "sm90" or family == "sm80":
        # Measured on an H200 (bench/dev/smoke_fwd.py, bf16, batch 4 x seqlen 4096, hidden 2048,
        # forward TFLOP/s non-causal / causal; bench/NOTES.md, 2026-11-21). Not yet measured on A100:
        # sm80 takes the same choices, which fit its 163 KB.
        if head_dim <= 64:
            # 128x64, 4 warps (2 m16 tiles each): 316 / 275. 128x32x4: 261 / 240; 64x64x4: 275 / 244;
            # 128x128x8: 238 / 214. Two m16 tiles per warp reuse every K/V fragment twice.
            cfg = TileConfig(128, 64, 4)
        elif head_dim <= 128:
            # non-causal 128x32, 4 warps: 299 (64x64x4: 273; 64x32x4: 244; 128x32x8: 214; 64x128x4:
            # 135). Causal 64x64x4: 255 (128x32x4: 251). 128x64x4 spills (320 B) at head_dim 128.
            # 128x32x4 sits at 252-255 registers: for sm_90a it spills 8 B at head_dims 112 and 120
            # (not at 128), and 32 B on sm_80 at 128; those take 64x64x4 (the compile gate checks).
            wide = family == "sm90" and not causal and (head_dim <= 104 or head_dim == 128)
            cfg = TileConfig(128, 32, 4) if wide else TileConfig(64, 64, 4)
        else:
            # At head_dim 256: 128x32, 8 warps: 246 / 204. 64x32x4: 231 / 208; 128x16x8: 198 / 168;
            # 64x16x4: 187 / 168; 64x64x4: 119 / 130 (255 registers: O alone is 128 floats a thread).
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


# head_dims served by the sm_90a wgmma forward kernel (its tiles are 64-column swizzled panels).
WGMMA_FWD_HEAD_DIMS = (64, 128, 256)


def fwd_config_for_target(target: str, head_dim: int, dtype: str, causal: bool = False) -> TileConfig:
    """The forward kernel and tiles for an NVRTC target: on sm_90a the wgmma kernel where it serves
    the head_dim, else the mma.sync kernel of `fwd_config`."""
    family = family_of_target(target)
    if target == "sm_90a" and head_dim in WGMMA_FWD_HEAD_DIMS:
        _check_family_head_dim(family, head_dim)
        # BLOCK_M = 64 per warpgroup (S is BLOCK_N / 2 floats a thread, O head_dim / 2, P BLOCK_N / 4
        # registers). Measured on an H100 (bench/dev/smoke_fwd.py, bf16, batch 4 x seqlen 4096,
        # hidden 2048, TFLOP/s non-causal / causal; SDPA-flash in the same run 303 / 279 at head_dim
        # 64, 354 / 301 at 128, 324 / 281 at 256):
        if head_dim <= 64:
            # 128x64: 370 / 329. 128x128: 339 / 292; 128x192: 307 / 278; 192x64 (3 warpgroups):
            # 278 / 242. mma.sync 128x64x4: 315 / 274.
            cfg = TileConfig(128, 64, 8, wgmma=True)
        elif head_dim <= 128:
            # 128x128: 444 / 382. 128x64: 439 / 369; 192x64: 388 / 329. mma.sync 128x32x4: 298 / 251.
            cfg = TileConfig(128, 128, 8, wgmma=True)
        else:
            # 128x32: 404 / 331. 128x64 measured 489 / 345 but spills (104 B, causal even-length
            # variant): O alone is 128 floats a thread. mma.sync 128x32x8: 244 / 204.
            cfg = TileConfig(128, 32, 8, wgmma=True)
        assert fwd_smem_bytes(head_dim, cfg) <= SMEM_LIMIT[family], (target, head_dim, cfg)
        return cfg
    return fwd_config(family, head_dim, dtype, causal)


def bwd_config(family: str, head_dim: int, dtype: str, feat: bool = False) -> TileConfig:
    """The dK/dV kernel's tiles: BLOCK_M query rows per iteration, BLOCK_N keys per block, warps.
    feat: for the feature kernel (feat_bwd_config), which keeps 64x128x8 below head_dim 32 (the
    64x64x4 entry was timed on the plain kernel only).

    Constraints (static_asserts in BwdTraits): BLOCK_N / 16 <= warps and divides warps;
    BLOCK_M / 16 <= warps and divides warps.
    """
    _check_family_head_dim(family, head_dim)
    if family == "sm90" and head_dim < 32 and not feat:
        # Below 32 (no pad-up to the warp-specialized kernel on sm_90a). H200, session 35
        # (bench/dev/bwd_small_tiles.py: bf16, 16k tokens, heads 2048 / head_dim, seqlen 1k and 4k,
        # causal off / on, backward GPU time over 64x128x8's): 64x64x4 0.94-0.98 at head_dim 8,
        # 0.86-0.90 at 16, 0.88-0.93 at 24; 128x128x8 0.88-0.91 at 16 but 1.02-1.08 at 8; 32x128x8,
        # 32x64x4 0.90-1.14; 128x64x8 1.08-1.17.
        cfg = TileConfig(64, 64, 4)
    elif family in ("sm90", "sm80"):
        # Measured on an H200 (bench/dev/smoke_bwd.py, bf16, batch 4 x seqlen 4096, hidden 2048,
        # backward TFLOP/s non-causal / causal, with the separate dQ pass; bench/NOTES.md).
        if head_dim <= 64:
            # 64x128x8: 158 / 139. 32x128x8: 147 / 126; 64x64x4: 152 / 139; earlier: 128x128x8:
            # 152 / 132; 64x64x8: 125 / 111.
            cfg = TileConfig(64, 128, 8)
        elif head_dim <= 128:
            # 32x128x8: 158 / 138. 64x128x8: 148 / 131; 64x64x8: 152 / 136; 32x64x4: 157 / 140
            # (after phase B moved to two m16 key tiles per warp; before it: 155 / 137 for 32x128x8).
            cfg = TileConfig(32, 128, 8)
        else:
            # head_dim 256: 32x64x8: 136 / 123. 64x64x8: 127 / 115; 32x32x8: 106 / 102.
            cfg = TileConfig(32, 64, 8)
    else:
        if head_dim <= 64:
            cfg = TileConfig(32, 64, 4)
        elif head_dim <= 128:
            cfg = TileConfig(32, 64, 8)
        else:
            cfg = TileConfig(16, 32, 4)
    assert bwd_smem_bytes(head_dim, cfg) <= SMEM_LIMIT[family], (family, head_dim, cfg)
    assert BWD_ROW_PAD % cfg.block_m == 0
    return cfg


# head_dims served by the sm_90a wgmma dK/dV kernel (dK and dV of 64 keys x head_dim per warpgroup
# must fit in registers: 128 floats a thread at head_dim 128).
WGMMA_BWD_HEAD_DIMS = (64, 128)


def bwd_config_for_target(target: str, head_dim: int, dtype: str) -> TileConfig:
    """The dK/dV kernel and tiles for an NVRTC target: on sm_90a the wgmma kernel where it serves
    the head_dim (BLOCK_N = 64 keys per warpgroup), else the mma.sync kernel of `bwd_config`."""
    family = family_of_target(target)
    if target == "sm_90a" and head_dim in WGMMA_BWD_HEAD_DIMS:
        _check_family_head_dim(family, head_dim)
        # Measured on an H100 (bench/dev/smoke_bwd.py, bf16, batch 4 x seqlen 4096, hidden 2048,
        # backward TFLOP/s non-causal / causal, atomic dQ): head_dim 64: 270-299 / 234-244 (SDPA-flash
        # 274 / 232); head_dim 128: 351-371 / 284-296 (SDPA-flash 285 / 245). 64x64 (one warpgroup):
        # 248 / 218 and 217 / 208. The mma.sync kernel: 158 / 139 at both head_dims.
        cfg = TileConfig(64, 128, 8, wgmma=True)
        assert bwd_smem_bytes(head_dim, cfg) <= SMEM_LIMIT[family], (target, head_dim, cfg)
        assert BWD_ROW_PAD % cfg.block_m == 0
        return cfg
    return bwd_config(family, head_dim, dtype)


def bwd_dq_config(family: str, head_dim: int, dtype: str) -> TileConfig:
    """The deterministic dQ kernel's tiles: BLOCK_M = 16 * warps query rows, BLOCK_N keys per step."""
    _check_family_head_dim(family, head_dim)
    if head_dim <= 64:
        cfg = TileConfig(64, 64, 4)
    elif head_dim <= 128:
        cfg = TileConfig(64, 32, 4)
    else:
        cfg = TileConfig(64, 16, 4) if family != "sm86" else TileConfig(32, 16, 2)
    assert bwd_dq_smem_bytes(head_dim, cfg) <= SMEM_LIMIT[family], (family, head_dim, cfg)
    assert BWD_ROW_PAD % cfg.block_m == 0
    return cfg


def _check_family_head_dim(family: str, head_dim: int) -> None:
    if family not in SMEM_LIMIT:
        raise KeyError(f"no tile table for architecture family {family!r}")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim {head_dim} has no configuration; expected a multiple of 8 in [8, 256]")


# ---- the kernels with the optional features (lengths, packed batches, window, sinks, ALiBi,
# softcap; cuda_src/mask.cuh): the kernels above with FEAT = true, on both the mma.sync and the
# sm_90a wgmma kernels. The backward always takes the separate (mma.sync) dQ pass.

# A bounded window narrower than this many keys visits only a few key tiles per query block; it takes
# 64-row tiles, which visit fewer masked keys: on sm_90a the wgmma kernel with 64 x 64 tiles (one
# warpgroup, two blocks per multiprocessor) at head_dim 64 and 128, elsewhere the mma.sync table's.
# Window (256, 0), bf16, batch 2 x seqlen 16384, 16 heads, head_dim 128, on an H100 (CUDA-graph
# replay, bench/dev/window_tiles.py, final mask code): wgmma 64x64 0.402 ms, 128x64 0.537, 128x128
# 0.524; mma.sync 64x64x4 0.455. Wider windows, wgmma 64x64 / 128x128 (one earlier run): (512, 0)
# 0.588 / 0.718, (1024, 0) 0.918 / 0.943, (2048, 0) 1.615 / 1.557 ms. At head_dim 256 the 64 x 64
# wgmma kernel spills with the mask code.
NARROW_WINDOW = 1024
NARROW_WGMMA_HEAD_DIMS = (64, 128)


def feat_fwd_config(target: str, head_dim: int, dtype: str, narrow_window: bool = False) -> TileConfig:
    """Forward tiles of the feature kernel: the causal choice of the target's table (on sm_90a the
    wgmma kernel where it serves the head_dim); causal tiles suit windows, which the feature kernel
    masks the same way. narrow_window: see NARROW_WINDOW."""
    if narrow_window:
        if target == "sm_90a" and head_dim in NARROW_WGMMA_HEAD_DIMS:
            return TileConfig(64, 64, 4, wgmma=True)
        return fwd_config(family_of_target(target), head_dim, dtype, causal=True)
    return fwd_config_for_target(target, head_dim, dtype, causal=True)


def feat_bwd_config(target: str, head_dim: int, dtype: str) -> TileConfig:
    """dK/dV tiles of the feature kernel: the mma.sync table, except at head_dim 120 and 128 on
    sm80 / sm90, where the table's 32x128x8 spills with the mask code on sm_90a (16-24 B of stack;
    32x64x4 too). 64x64x8 fits (204-212 registers) and measured within 4 % of 32x128x8 for the
    plain kernel (152 / 136 against 158 / 138)."""
    family = family_of_target(target)
    if target == "sm_90a" and head_dim in WGMMA_BWD_HEAD_DIMS:
        return bwd_config_for_target(target, head_dim, dtype)  # the wgmma kernel, without atomics
    if family in ("sm80", "sm90") and 112 < head_dim <= 128:
        return TileConfig(64, 64, 8)
    return bwd_config(family, head_dim, dtype, feat=True)


# head_dims at which the feature backward on sm_90a adds dQ with float atomics from the wgmma dK/dV
# kernel when deterministic=False, as the plain backward does (both wgmma head_dims: at 128 it fits
# in 255 registers since edge tiles mask through per-key query spans, mask.cuh).
FEAT_ATOMIC_DQ_HEAD_DIMS = (64, 128)


def feat_bwd_uses_atomics(deterministic: bool, target: str, head_dim: int) -> bool:
    """Whether the feature backward accumulates dQ with float atomics (see FEAT_ATOMIC_DQ_HEAD_DIMS)."""
    if deterministic:
        return False
    kernel_dim = bwd_pad_head_dim(target, head_dim) or head_dim  # pad-up (see bwd_pad_head_dim)
    if target == "sm_90a" and kernel_dim in BWD_WS_FEAT_HEAD_DIMS and bwd_ws_feat_enabled():
        return True  # the warp-specialized FEAT kernel's accumulator
    return feat_kernel_atomic(target, head_dim)


def feat_kernel_atomic(target: str, head_dim: int) -> bool:
    """Whether the feature dK/dV kernels other than the warp-specialized one add dQ by atomics."""
    return target == "sm_90a" and head_dim in FEAT_ATOMIC_DQ_HEAD_DIMS and feat_bwd_config(target, head_dim,
                                                                                           "float16").wgmma


def feat_dq_config(target: str, head_dim: int, dtype: str) -> TileConfig:
    """dQ tiles of the feature kernel: the mma.sync table."""
    return bwd_dq_config(family_of_target(target), head_dim, dtype)


# ---- decoding against a KV cache (cuda_src/flash_decode.cu) ----
DECODE_BLOCK_N = 64   # keys per tile of the 4-warp kernel: 4 warps x 16 (16 * warps in general)
DECODE_ROWS = 16      # packed query rows (query heads of a kv head x positions) per thread block


def decode_smem_bytes(head_dim: int, stages: int, warps: int = 4, tma: bool = False, mt: int = 1) -> int:
    """Dynamic shared memory of the decode kernel: sQ (16 rows per m-tile of a warp, mt) and `stages`
    stages of sK and sV, 16 * warps keys each: rows padded to padded_pitch (cp.async), or dense SW128
    panels after up to 1 KB of alignment (TMA) (cuda_src/flash_decode.cu: DecodeTraits::SMEM_BYTES)."""
    pitch = padded_pitch(head_dim)
    return (DECODE_ROWS * mt * pitch * 2 + 2 * stages * 16 * warps * (head_dim if tma else pitch) * 2
            + (1024 if tma else 0))


def decode_static_smem_bytes(stages: int, warps: int, tma: bool = False) -> int:
    """The decode kernel's static shared memory, rounded up: the offset tables s_off (stages x 2 x
    16 * warps int64; one stage's with TMA), the warps' (m, l, lp), the TMA barriers, a flag and the
    cluster merge's 16 lse."""
    return (1 if tma else stages) * 2 * 16 * warps * 8 + 3 * warps * 16 * 4 + 8 * stages + 64 + 64


# Head dims of the TMA decode kernel (sm_90a): whole 64-column panels, Q in registers.
DECODE_TMA_HEAD_DIMS = (64, 128)


def decode_two_tiles(target: str, head_dim: int, rows: int, keys: int, kv_bytes: int) -> bool:
    """Whether a decode packs 32 query rows a thread block, two m16 tiles a warp (the kernel's MT = 2),
    where a kv head has more than 16 rows (seqlen_q x head_group: speculative decoding at GQA 8 from
    3 query positions, at GQA 4 from 5): a K/V tile is then read once per 32 rows instead of once per
    16. The TMA kernels on 4 warps (sm_90a, DECODE_TMA_HEAD_DIMS), which keep Q in shared memory there
    (in registers it would take 64), where the call reads enough of the cache for the reads to decide:
    at least DECODE_TWO_TILES_MIN_KEYS keys a kv head (keys: the most one block may see), or at least
    DECODE_TWO_TILES_MIN_BYTES of K and V (kv_bytes). H200, session 65 (bench_decode.py --seqlen-q 4 /
    8, 32 query heads, head_dim 128, bf16, GPU us per step, this rule against CUFLASH_DECODE_TWO_TILES=0,
    each its own process): GQA 8 x 4 positions, 1 x 32k 27 / 31, 16 x 8k 73 / 91, 16 x 32k 244 / 355,
    64 x 32k 936 / 1291; GQA 8 x 8 positions, 1 x 32k 33 / 52, 64 x 32k 1315 / 1728; GQA 4 x 8 positions,
    16 x 2k 37 / 37, 64 x 32k 1889 / 2477. The calls it leaves read slower with two tiles (forced):
    1 x 2k 11-12 against 9-11, 1 x 8k x GQA 8 x 4 positions 14-16 against 12, 16 x 2k x GQA 8 29-34
    against 27-31. CUFLASH_DECODE_TWO_TILES=0: never, 1: wherever built (A/B). Read when a decode plan
    is made."""
    import os

    force = os.environ.get("CUFLASH_DECODE_TWO_TILES")
    if force == "0":
        return False
    if not (target == "sm_90a" and head_dim in DECODE_TMA_HEAD_DIMS and rows > DECODE_ROWS):
        return False
    return force == "1" or keys >= DECODE_TWO_TILES_MIN_KEYS or kv_bytes >= DECODE_TWO_TILES_MIN_BYTES


DECODE_TWO_TILES_MIN_KEYS = 16384
DECODE_TWO_TILES_MIN_BYTES = 128 << 20


# A paged cache read in place by the warp-specialized feature forward (cuflash/_launch.py PagedKV) takes
# each key tile's rows in TMA boxes of gcd(page_size, BLOCK_N) rows; where those are fewer than this, the
# pages are gathered into a padded copy first instead. H200, session 70 (bench/dev/prefill_route.py, bf16,
# 32 query heads, head_dim 128, causal chunks of 16-256 positions appended, GQA 4-8; GPU time of the
# forward reading the pages in place over gather + forward, at 256 rows a kv head or more): 16-row boxes
# (16-row pages) 1.00-1.23 from 512 rows (1.00-1.06 where kvcache_feature_forward takes the forward), 32-row
# 0.80-0.91, 64-row 0.68-0.90, 128-row (256-row pages) 0.74-0.84; e.g. 16 x 8k x GQA 8 x 128 positions:
# 16-row pages 609.5 against 585.2 us, 32-row 521.7 against 587.0, 64-row 480.2 against 586.3, 256-row
# 472.0 against 582.5. A chunk that the gather route would not take
# (fewer rows a kv head than KVCACHE_PAGED_FORWARD_MIN_ROWS, or a copy over KVCACHE_GATHER_MAX_BYTES: the
# decode kernels otherwise) reads 16-row boxes in place all the same (small_ok): 256 rows, 16-row pages,
# in place / decode kernels: 16 x 2k x GQA 4 x 64 positions 185.7 / 218.8 us, 4 x 8k x GQA 4 x 64 161.8 /
# 181.0 (H200, session 70).
PAGED_DIRECT_MIN_BOX = 32
# 16-row boxes copied as whole rows (cuflash/_launch.py paged_interleaved; session 71) are read in place
# below this many packed query rows a kv head (the chunk's seqlen_q, or the prefill's max_seqlen_q, times
# the GQA group), gathered from it on: the copy's cost is per key, the boxes' per key tile a query tile
# reads, so the more query tiles share a kv head's keys, the better the gather. H200, session 71 (bf16,
# head_dim 128, 16-row pages; GPU time in place over gather + forward): chunks (prefill_route.py) at
# 384-1024 rows 0.89-0.97 where the forward is taken (1.09 / 1.16 on 32k-key caches at batch 1-2, where
# the decode kernels run; e.g. 16 x 8k x GQA 8 x 128 positions 542.1 against 577.9 us; 2 x 32k x GQA 4 x
# 96 positions 521.6 against 548.7), at 2048 rows 1.06-1.08; the paged prefill (paged_prefill.py) at 2048
# rows 0.96, at 4096-16384 rows 1.04-1.11.
PAGED_WHOLE_ROWS_GATHER = 2048


def paged_direct(box_rows: int, small_ok: bool = False, whole_rows: int | None = None) -> bool:
    """Whether a paged cache is read in place (cuflash/_launch.py fwd_launches with PagedKV; ChunkPlan and
    the paged prefill) with TMA boxes of box_rows rows: from PAGED_DIRECT_MIN_BOX rows, at any box where
    the caller has no gather to fall back on (small_ok), and where the boxes are copied as whole rows
    (whole_rows: the call's packed query rows a kv head; None where they are not) below
    PAGED_WHOLE_ROWS_GATHER rows. CUFLASH_PAGED_DIRECT=0: never (the gather), =1: at any box (A/B). Read
    when a plan is made."""
    import os

    mode = os.environ.get("CUFLASH_PAGED_DIRECT", "")
    if mode in ("0", "1"):
        return mode == "1"
    return (small_ok or box_rows >= PAGED_DIRECT_MIN_BOX
            or (whole_rows is not None and whole_rows < PAGED_WHOLE_ROWS_GATHER))


def kvcache_feature_forward(seqlen_q: int, rows: int, batch: int, nheads: int, sm_count: int,
                            paged: bool = False) -> bool:
    """Whether attention_with_kvcache on a contiguous cache whose row b is entry b (paged: on a paged cache)
    runs the feature forward with kv_lengths (cuflash/_kvcache.py ChunkPlan) instead of the decode
    kernels. The forward has no split-KV: its grid is batch x nheads x ceil(seqlen_q / 128) query tiles
    of 128 rows, each walking every key, so a short chunk leaves SMs idle and its tiles part empty, and
    every query head reads its kv head's cache; the decode kernels pack a kv head's seqlen_q x
    head_group rows (one K/V read per 16-32 rows) and split the keys to fill the GPU, but their
    mma.sync tiles run at about 150-245 TFLOP/s where the forward's wgmma tiles reach 600. So the
    forward takes a call of more than 64 packed rows a kv head with at least
    KVCACHE_FORWARD_MIN_SEQLEN_Q query positions where the share of the GPU its tiles keep busy,
    min(tiles, SMs) / SMs x seqlen_q / (128 x ceil(seqlen_q / 128)) (the SMs with a tile, times the
    rows of its tiles that hold queries), is at least KVCACHE_FORWARD_MIN_FILL. H200, session 69
    (bench/dev/prefill_route.py, 32 query heads, head_dim 128, bf16, causal, the chunk appended;
    forward / decode GPU time, both routes with their session-69 host paths): share 0.24 (batch 2 x
    64 positions, 64 tiles of 132 SMs half full; batch 1 x 128 positions) 0.95-1.42, e.g. 2 x 32k x
    GQA 8 x 64 positions 1.38; share 0.36 (batch 3 x 64 positions) 0.58-0.78; 0.48 and more (batch 4
    x 64, batch 2 x 128, batch 1 x 256) 0.38-0.87, e.g. 2 x 8k x GQA 4 x 128 positions 0.59; single
    eager calls (host included) 1.14-1.52 at share 0.24, 0.66-0.78 at 0.36. (Session
    68's rule, a third of the SMs with a tile, came from GPU times that the forward route's host part,
    then 200-600 us a call, had stretched.) A paged cache (paged): the forward after the pages are
    gathered into a padded contiguous copy (cuflash/_kvcache.py ChunkPlan, cuda_src/paged_gather.cu),
    which reads and writes the keys once more, a cost against the attention's work that falls with the
    rows a kv head: so also at least KVCACHE_PAGED_FORWARD_MIN_ROWS rows, and only where the copy fits
    KVCACHE_GATHER_MAX_BYTES (the caller checks). H200, session 69, 16-row pages: 256 rows (GQA 4 x
    64 positions) 1.05-1.34, the decode kernels there; 512-2048 rows at share 0.36 and more
    0.42-0.83 (with the gather's one launch). A paged cache that the forward reads in place
    (paged_direct) has no copy to pay for: the caller applies the rule without paged there.
    CUFLASH_KVCACHE_FORWARD=0: never (the decode kernels at any row count), 1: wherever rows > 64 (A/B).
    Read at each call that could take it."""
    import os

    if rows <= 4 * DECODE_ROWS:
        return False
    force = os.environ.get("CUFLASH_KVCACHE_FORWARD")
    if force in ("0", "1"):
        return force == "1"
    per_head = -(-seqlen_q // 128)
    share = min(batch * nheads * per_head, sm_count) / sm_count * seqlen_q / (128 * per_head)
    return (seqlen_q >= KVCACHE_FORWARD_MIN_SEQLEN_Q and share >= KVCACHE_FORWARD_MIN_FILL
            and (not paged or rows >= KVCACHE_PAGED_FORWARD_MIN_ROWS))


KVCACHE_FORWARD_MIN_SEQLEN_Q = 64
KVCACHE_FORWARD_MIN_FILL = 0.3
KVCACHE_PAGED_FORWARD_MIN_ROWS = 512
KVCACHE_GATHER_MAX_BYTES = 2 << 30  # the paged forward route's padded copy of K and V


def decode_tma_enabled() -> bool:
    """Whether decodes may read their caches through TMA where it serves (cuda_src/flash_decode.cu, TMA;
    _launch.use_decode_tma): yes unless CUFLASH_DECODE_TMA=0. Read when a decode plan is made."""
    import os

    return os.environ.get("CUFLASH_DECODE_TMA") != "0"


def decode_spare_outputs() -> bool:
    """Whether a decode plan allocates the next eager call's outputs after its launch
    (cuflash/_kvcache.py DecodePlan._make_spare), so that the next call launches without allocating:
    yes unless CUFLASH_DECODE_SPARE=0 (A/B). Read when a decode plan is made."""
    import os

    return os.environ.get("CUFLASH_DECODE_SPARE") != "0"


def decode_idle_variant() -> bool:
    """Whether a decode plan whose eager call runs a combine kernel after the decode kernel keeps a
    one-launch variant for eager calls on an idle stream (cuflash/_kvcache.py DecodePlan.idle): yes
    unless CUFLASH_DECODE_IDLE=0 (A/B). Read when a decode plan is made."""
    import os

    return os.environ.get("CUFLASH_DECODE_IDLE") != "0"


# The most keys a split of a plan's idle variant (above) may see: past it the longer GPU part costs a
# single call more than the combine kernel's launch saves. H200, session 64 (bench/dev/eager_splits.py,
# 300 single calls a variant, interleaved, median us): the library's plan (its combine kernel) against
# 8 splits merged in one launch on 8 warps, both with CUFLASH_DECODE_WARPS=8: 1 x 2048 x 8 (256 keys a
# split, clusters) 46.3 -> 39.7, 1 x 4096 x 8 (512, fused) 45.0 -> 39.4, 1 x 8192 x 8 (1024) 45.1 ->
# 38.4, 2 x 8192 x 8 45.0 -> 39.1; 1 x 32768 x 8 (4096 keys a split) 45.7 -> 56.0, and 16 fused splits
# there (CUFLASH_DECODE_FUSED_MAX_PARTS=128) 42.0 -> 45.8. The rule as built, CUFLASH_DECODE_IDLE 1 / 0
# / 1 / 0, each its own process, cuflash / cuDNN (whose figure there includes entering its SDPA backend):
# 1 x 2048 x 8 0.958 / 1.117 / 0.986 / 1.034, 1 x 8192 x 8 0.973 / 1.148 / 0.997 / 1.094, 2 x 8192 x 8
# 0.957 / 1.090 / 1.001 / 1.035; 1 x 32768 x 8 (no idle variant) 1.053 / 1.089 / 1.061 / 1.039.
DECODE_IDLE_SPLIT_KEYS = 1024


def decode_group_kernel() -> bool:
    """Whether a paged decode read through TMA in 16-key groups runs the kernel built for them
    (cuda_src/flash_decode.cu, GRP: paged and groups constants, "_grp" in its name) rather than the
    one that serves every layout: yes unless CUFLASH_DECODE_GRP=0 (A/B). H200, session 62, the
    library's plans, GPU time: 16-row pages at 512-key caches 0.94-0.96x the shared kernel's time (4 x
    512 x 1, 16 x 512 x 4, 16 x 512 x 8 on 8 warps; 1 x 512 x 1 on 4), 0.98-1.0x at 2k-32k keys; the
    contiguous kernels unchanged (their SASS is the same). Read when a decode plan is made."""
    import os

    return os.environ.get("CUFLASH_DECODE_GRP") != "0"


def decode_page_tiles(page_size: int, block_n: int) -> bool:
    """Whether the TMA decode kernel reads a paged cache in whole tiles (cuda_src/flash_decode.cu,
    page_tiles): one box per panel of block_n rows, issued by one thread as for a contiguous cache,
    where page_size is a multiple of block_n (every tile then lies in one page); else each warp
    issues its 16-key group's boxes. CUFLASH_DECODE_PAGE_TILES=0: never (A/B). Session 28 (H200,
    bench_decode, 32 query heads, head_dim 128): the 16-key groups read 82-86 % of the copy bandwidth
    at long caches with pages of 16, 64 or 256 rows alike, contiguous caches 102-109 %. Session 29
    (H200, whole tiles, the table lookups off the issuing lane): 256-row pages 1.02x the contiguous
    time by geomean over bench_decode's 74 shapes (worst 1.06); at five long-cache shapes of
    bench/dev/paged_locality.py, whole tiles 1.00-1.03x, 16-key groups of the same pages 1.00-1.14x.
    Read when a decode plan is made."""
    import os

    if os.environ.get("CUFLASH_DECODE_PAGE_TILES") == "0":
        return False
    return page_size > 0 and page_size % block_n == 0


def decode_paged_groups_wide(blocks: int, splits: int, keys: int, sm_count: int) -> bool:
    """Whether a paged decode that the 4-warp TMA kernel would read in 16-key groups (a page_size
    that is not a multiple of its 64-key tile; decode_page_tiles) runs the 8-warp kernel instead, at
    the same split count: where the 4-warp plan gives each SM at most one block (blocks x splits <=
    sm_count) and a block sees many keys (at least 8192 a split, or 2048 unsplit). Its 128-key tiles
    keep twice the bytes in flight, and its eight issuing lanes share a tile's 16-row boxes. H200,
    session 29 (bench/dev/s29_warps_ab.sh: 16-row pages, head_dim 128, 32 query heads, bench_decode's
    grid up to batch 64 and 32k keys, CUFLASH_DECODE_WARPS=8 against the 4-warp plan, two runs each):
    0.91-0.97x the time at the nine points this takes (128 blocks unsplit with 2048-32768 keys, 32 x
    4 and 64 x 2 splits of 8192 and 16384 keys); at fewer keys a split, 0.94-1.04x (16 x 8 splits of
    1024-4096 keys 1.02); where the grid has more blocks than SMs, 0.96-1.25x (1.17-1.25 at 512-key
    caches). Measured at head_dim 128 (the callers ask only there)."""
    if splits < 1 or blocks * splits > sm_count:
        return False
    per_split = -(-keys // splits)
    return per_split >= 8192 or (splits == 1 and keys >= 2048)


def decode_paged_fill_splits(target: str, head_dim: int, blocks: int, keys: int, sm_count: int,
                             peak_bw: float = 0.0) -> int | None:
    """The split count of a paged decode read in 16-key groups by the TMA kernel (a page_size that is
    not a multiple of the 64-key tile; decode_page_tiles) where blocks (batch x kv heads x row tiles)
    fill at most half the SMs: enough splits for two blocks per SM, min(2 sm_count // blocks,
    DECODE_PAGED_FILL_MAX_SPLITS), on the 4-warp kernel, which decode_shallow_tma then runs on 2
    stages; None where the rule does not hold: more blocks, a grid that would not pass one block per
    SM, splits of fewer than DECODE_PAGED_FILL_MIN_KEYS keys, a target or GPU where 2 stages are not
    taken, or CUFLASH_DECODE_PAGED_FILL=0. The 16-key groups cost their time in TMA copies (eight
    per 64-key tile against two), which each SM issues for its own blocks: two blocks per SM issue
    them on every SM, one per SM on half the SMs or fewer. H200, session 47
    (bench/dev/decode_splits.py, 16-row pages in a random order, 32 query heads, head_dim 128, bf16,
    GPU us per step, the library's plan -> this count): 32 blocks, 8 splits: 1 x 8k x 1 40.1 -> 38.5,
    1 x 32k x 1 134.8 -> 127.5, 1 x 128k x 1 502.2 -> 492.2, 4 x 8k x 4 40.4 -> 39.2, 4 x 32k x 4 138.2
    -> 128.9 (contiguous 125.0), 4 x 128k x 4 502.3 -> 492.3; 64 blocks, 4 splits: 16 x 2k x 8 25.8 ->
    24.9, 16 x 8k x 8 72.8 -> 70.1, 16 x 32k x 8 256.9 -> 250.4; 16 blocks, 16 splits: 4 x 8k x 8
    25.4 -> 25.2, 4 x 32k x 8 72.8 -> 70.7, 4 x 128k x 8 258.1 -> 250.8; 8 blocks, 33 splits: 1 x 32k x
    4 41.5 -> 39.9, 1 x 128k x 4 136.0 -> 129.3. Not at 4 blocks (66 splits: 1 x 32k x 8 24.9 -> 26.0),
    at 128 blocks (2 splits: 4 x 2k x 1 36.3 -> 38.8, 16 x 8k x 4 127.6 -> 129.7), nor at splits of 256
    keys or fewer (16 x 512 x 4, 2 splits: 10.4 -> 12.0; 16 x 512 x 8, 4 splits: 9.9 -> 10.7).
    Contiguous caches lose by it (4 x 32k x 4 125.0 -> 127.4): paged ones only.
    Not in the 8-warp kernel's unsplit region (decode_wide_unsplit: 64 blocks of 2048 keys): after
    session 54 halved the TMA loop, 16 x 2k x 8 (64 blocks) ran 20.9-21.0 us there against 23.4-23.5
    with this rule's 4 splits (H200, session 55, bench/dev/s55_call.sh fillab: the library's plan
    with the rule and with CUFLASH_DECODE_PAGED_FILL=0, alternated twice; contiguous 19.1-19.2). The
    rule's other points kept their lead in the same run: 16 x 8k / 32k x 8 68.4 / 248 against 70.1 /
    257, 4 x 32k x 4 127.1 against 136, 1 x 32k x 1 126.4 against 133, 1 x 128k x 4 128.3 against 139."""
    import os

    if os.environ.get("CUFLASH_DECODE_PAGED_FILL") == "0" or blocks < 1 or 2 * blocks > sm_count:
        return None
    if decode_wide_unsplit(blocks, keys, sm_count, one_per_sm=True):
        return None
    splits = min(2 * sm_count // blocks, DECODE_PAGED_FILL_MAX_SPLITS)
    if blocks * splits <= sm_count or -(-keys // splits) < DECODE_PAGED_FILL_MIN_KEYS:
        return None
    if not decode_shallow_tma(target, head_dim, blocks * splits, sm_count, peak_bw, -(-keys // splits)):
        return None
    return splits


def decode_paged_two_tile_splits(blocks: int, splits: int, keys: int, sm_count: int) -> int:
    """The split count of a paged decode with two m16 tiles a warp (decode_two_tiles) read in 16-key
    groups by the 4-warp TMA kernel on more than half and at most all of the SMs' worth of blocks (at
    most half, decode_paged_fill_splits' region): 2 where the plan would run it unsplit on blocks of at
    least DECODE_PAGED_TWO_TILE_MIN_KEYS keys, `splits` otherwise, or with
    CUFLASH_DECODE_PAGED_TWO_TILE_SPLITS=0 (A/B). Each warp issues its own group's copies, and with two
    m-tiles its loop between issues is twice as long: one block per SM kept the contiguous cache's
    pace at one m-tile (1.04x) but not at two. H200, session 66 (bench/dev/decode_splits.py, 16-row
    pages in a random order, 32 query heads, head_dim 128, bf16, 8 query positions, GQA 4: 32 rows a
    kv head, 128 blocks; GPU us per step): 16 x 8k 141.0 unsplit, 137.2 in 2 splits (contiguous 125.3
    unsplit), 16 x 32k 535.5 / 500.1 (contiguous 475.2)."""
    import os

    if (os.environ.get("CUFLASH_DECODE_PAGED_TWO_TILE_SPLITS") == "0" or splits != 1 or blocks < 1
            or 2 * blocks <= sm_count or blocks > sm_count or keys < DECODE_PAGED_TWO_TILE_MIN_KEYS):
        return splits
    return 2


DECODE_PAGED_TWO_TILE_MIN_KEYS = 8192  # (measured at 8k and 32k keys)


# decode_paged_fill_splits: the most splits it takes (33 measured faster at 8 blocks, 66 slower at 4),
# the fewest keys a split may see (512 faster, 256 slower), and the K+V bytes from which an eager call
# takes its count with a combine kernel (a second launch, hidden behind steps this long: at least
# 128 MiB, about 30 us at the H200's bandwidth) where the fused combine cannot merge it.
DECODE_PAGED_FILL_MAX_SPLITS = 33
DECODE_PAGED_FILL_MIN_KEYS = 512
DECODE_PAGED_FILL_EAGER_BYTES = 1 << 27


def decode_wide_supported(head_dim: int) -> bool:
    """Whether the 8-warp decode kernel (128-key tiles) is built for head_dim: multiples of 16 from
    64 to 128 (its Q stays in registers; above 128 the 4-warp kernel is already at the register
    limit)."""
    return 64 <= head_dim <= 128 and head_dim % 16 == 0


def decode_wide_stages(target: str, head_dim: int) -> int | None:
    """Pipeline stages of the 8-warp decode kernel (one block per SM by design: it serves grids that
    leave an SM a single block): 3 where they fit the target's shared memory, else 2; None when
    not built (decode_wide_supported) or 2 do not fit."""
    if not decode_wide_supported(head_dim):
        return None
    fam = family_of_target(target)
    for stages in (3, 2):
        if decode_smem_bytes(head_dim, stages, 8) + decode_static_smem_bytes(stages, 8) <= SMEM_LIMIT[fam]:
            return stages
    return None


def decode_warps_forced() -> int:
    """CUFLASH_DECODE_WARPS: 4 or 8 forces the decode kernel's warp count where that kernel exists
    (A/B measurements, tests; the split count is then the 4-warp kernel's); unset or 0: chosen per
    call (decode_warps_and_splits). Read when a decode plan is made."""
    import os

    v = os.environ.get("CUFLASH_DECODE_WARPS", "0")
    return int(v) if v in ("4", "8") else 0


# The 8-warp decode kernel runs unsplit where its blocks leave no SM a second one and, for some
# (min_blocks, max_keys) here, there are at least min_blocks of them and a block sees at most max_keys
# keys (decode_warps_and_splits): the regions where that was measured to win.
DECODE_WIDE_UNSPLIT = ((4, 512), (64, 2048))

# one_per_sm: the 8-warp kernel where a split sees more than this many keys (and at most 512;
# decode_warps_and_splits), at most DECODE_CLUSTER_MAX splits (more: 256, as before session 48).
# Session 48's cheaper cross-warp merge and split K / V barriers made the 8-warp kernel faster at two
# of its 128-key tiles a split, where the splits merge in a cluster or in the last block (H200, GPU us
# per step, main's plan -> this one, bench/dev/decode_splits.py, alternated twice): 1 x 2048 x 4 (8
# blocks x 8 splits in clusters) 9.10 -> 8.04 (16-row pages 9.69 -> 8.53), 4 x 2048 x 8 (16 x 8,
# fused) 9.94 -> 9.60 (pages 10.58 -> 10.29); but 1 x 8192 x 8 (4 x 32, the combine kernel) 10.14 ->
# 10.36 (pages 10.74 -> 11.55), so not past 8 splits: session 49, the unbounded window -> this bound
# (alternated twice, one card), 1 x 8192 x 8 contiguous 10.33 -> 10.32 us, 16-row pages 11.51 -> 10.90
# (0.947), the plans of 1 x 2048 x 4, 4 x 2048 x 8 and 16 x 512 x 8 unchanged (0.996-1.001). At 1024
# keys a split it was mixed (4 x 8192 x 8 23.0 against 23.8; 1 x 32768 x 8 24.0 against 23.6): not
# taken.
DECODE_WIDE_MIN_SPLIT_KEYS = 2 * DECODE_BLOCK_N

# Head dims where the TMA decode kernel takes the one-block-per-SM rule (decode_num_splits and
# decode_warps_and_splits, one_per_sm=True): where it was measured (H100, session 14, head_dim 128).
DECODE_ONE_PER_SM_HEAD_DIMS = (128,)


def decode_wide_unsplit(blocks: int, keys: int, sm_count: int, one_per_sm: bool = False) -> bool:
    """Whether a decode of `blocks` blocks that see at most `keys` keys lies in a region of
    DECODE_WIDE_UNSPLIT, where decode_warps_and_splits runs the 8-warp kernel unsplit: blocks <=
    sm_count and, for some (min_blocks, max_keys), blocks >= min_blocks and keys <= max_keys; with
    one_per_sm, the (64, 2048) region only up to sm_count // 2 blocks."""
    return blocks <= sm_count and any(
        blocks >= nb and keys <= nk and (not one_per_sm or nk <= 512 or 2 * blocks <= sm_count)
        for nb, nk in DECODE_WIDE_UNSPLIT)


def decode_warps_and_splits(blocks: int, splits: int, sm_count: int, forced: bool,
                            paged: bool = False, keys: int | None = None,
                            one_per_sm: bool = False, cluster: int = 0,
                            cluster_keys: int = DECODE_BLOCK_N) -> tuple[int, int]:
    """(warps, num_splits) of a decode whose 4-warp kernel would take `splits` splits (decode_num_splits'
    choice, or the caller's forced count): the 8-warp kernel where its grid gives no SM a second block,
    so that each SM runs 8 warps instead of a lone block's 4 (one per scheduler, nothing to hide its
    latencies) and keeps twice the bytes in flight. Its tiles are 128 keys, so it takes half the
    splits: ceil(splits / 2), used where splits <= 4 and blocks x that <= sm_count. A forced count is
    kept: the 8-warp kernel where splits <= 2 and blocks x splits <= sm_count.
    Measured on an H200 (bench/dev/decode_splits.py --warps 4 8, batch x cache 512-8k x GQA 1/4/8, 32
    query heads, head_dim 128, session 11): at the same split count the 8-warp kernel was faster
    wherever blocks x splits <= 132 (splits 1 and 2 tried), and slower past it; against the 4-warp
    kernel's choice, 128 blocks unsplit: 0.93-0.98x (4x512x1 13.1 against 13.9 us, 16x8192x4 134.5
    against 138.7); 64 blocks, 4 splits against 8 warps x 2: 0.97-1.01x; 32 blocks and fewer (8 splits
    or more chosen): the 4-warp kernel's choice was the fastest of those tried, so it is kept there.
    paged: a paged cache read by the cp.async kernel (per-tile offset tables) takes 8 warps only where
    the 4-warp kernel would not split, the rule measured in session 11 when paged TMA tiles were
    issued by warp 0 alone (H200, 16-row pages, 128 blocks: 512 keys 8 warps unsplit 14.3 us against
    15.5 with 4 warps in 2 splits; 2048 and 8192 keys 4 warps in 2 splits 42.8 / 135.7-138.0 against
    48.0 / 164.5-166.2 with 8 warps). A paged cache read through TMA, each warp issuing its own
    group's boxes (session 13), takes the contiguous rule (paged=False): H100, 16-row pages, 128
    blocks of 2048 keys: 4 warps unsplit 51.0 us, 8 warps unsplit 53.9, 4 warps x 2 splits 56.2
    (the old rule's choice); of 8192 keys (16x8192x4) 187.3 / 193.2 / 193.4.
    keys (the most keys a block sees; None: not known): blocks <= sm_count and, for a (min_blocks,
    max_keys) of DECODE_WIDE_UNSPLIT, blocks >= min_blocks and keys <= max_keys: the 8-warp kernel
    unsplit, whatever split count the 4-warp model asked for. H100, session 13 (bench/dev/decode_splits.py
    --warps 4 8, GQA 8, 32 query heads, head_dim 128; us per step): 512 keys, 16 / 32 / 64 blocks: 9.7
    / 9.9 / 10.0 unsplit against 10.7 / 12.1 / 12.6 for the old choice (8, 8 and 4-warp x 2 splits)
    and 10.7 / 11.1 / 12.6 for the best split count; 4 blocks: 9.8 against 10.5 with the 8 splits
    chosen (16-row pages: 11.2 against 11.0); 64 blocks of 1024 and 2048 keys: 13.9 and 32.1
    against 14.6 and 34.8 (8 warps x 2). Not at 16 or 32 blocks of 2048 keys: there unsplit took 21.0-21.4
    us (bench_decode, batch 4 GQA 8, batch 1 GQA 1, batch 4 GQA 4), 1.66-1.86x cuDNN's time, where the
    split counts had run 1.1-1.2x; nor for longer caches on few blocks (1 x 8192 x 8, 4 blocks: 63.3
    unsplit against 14.7 with 64 splits), nor below 4 blocks (not measured).
    one_per_sm (the TMA kernel at DECODE_ONE_PER_SM_HEAD_DIMS, whose `splits` come from
    decode_num_splits(one_per_sm=True): at most one block per SM where the grid allows): the split
    count is kept, and the 8-warp kernel runs where each split sees 129 to 512 keys (two to four of
    its tiles; DECODE_WIDE_MIN_SPLIT_KEYS, from 257 until session 48 and still past
    DECODE_CLUSTER_MAX splits) and blocks x splits <= sm_count; the unsplit region (64, 2048) holds
    only up to sm_count // 2 blocks. H100, session 14 (bench/dev/decode_splits.py, GQA 1 / 4 / 8, 32
    query heads, head_dim 128, GPU us per step, 8 against 4 warps at the same count): 32 blocks of
    2048 keys x 4 splits (512 keys each) 14.0 against 15.1; at 256 keys a split, a tie: 16 x 2048 x 8
    splits 12.9 against 13.1, 4 x 8192 x 32 13.6 against 13.5; 128 blocks unsplit: 1024 keys 29.9 /
    30.8 against 29.0 / 29.6, 2048 keys 51.6 / 52.5 against 50.2 / 50.6, 8192 keys 182.6 / 185.4
    against 180.3 / 179.3; 512 keys 10.5 against 12.0 (the (4, 512) region). 64 blocks of 2048
    keys: 8 warps unsplit 31.4 against 33.2-33.3 for 4 warps at 1 or 2 splits.
    cluster (one_per_sm; the most splits the cluster merge serves, 0: none): the 4-warp kernel keeps
    its count where it splits into one block per SM and each split is one of its tiles (64 keys),
    ahead of the 8-warp unsplit region: the cluster merge costs such splits no second kernel and no
    trip through global memory. H200, session 31 (bench/dev/decode_splits.py, bench_decode.py; 32
    query heads, head_dim 128, GPU us per step, 4 warps in clusters against 8 warps unsplit): 1 x
    512 x 4 (8 blocks, 8 splits) 7.9 against 9.8; 1 x 512 x 8 8.1 / 9.8; 4 x 512 x 8 (16 blocks, 8
    splits) 9.3 / 9.8; not at two tiles a split: 1 x 512 x 1 (32 blocks, 4 splits) 9.7-10.0 / 9.9,
    4 x 512 x 4 10.0-10.2 / 9.9-10.0; 16 x 512 x 8 (64 blocks, 2 splits of 256 keys) 10.8 / 10.0.
    cluster_keys: the most keys such a split may see (one tile by default); decode_cluster_split_keys
    gives two tiles where those splits run on 2 stages."""
    if forced:
        return (8, splits) if splits <= 2 and blocks * splits <= sm_count else (4, splits)
    if paged and splits > 1:
        return 4, splits
    if (cluster and one_per_sm and keys is not None and 1 < splits <= cluster and blocks * splits <= sm_count
            and -(-keys // splits) <= cluster_keys):
        return 4, splits
    if keys is not None and decode_wide_unsplit(blocks, keys, sm_count, one_per_sm):
        return 8, 1
    if one_per_sm:
        per_split = -(-keys // splits) if keys is not None else 0
        low = DECODE_WIDE_MIN_SPLIT_KEYS if splits <= DECODE_CLUSTER_MAX else 4 * DECODE_BLOCK_N
        wide = blocks * splits <= sm_count and low < per_split <= 8 * DECODE_BLOCK_N
        return (8 if wide else 4), splits
    wide = max(1, -(-splits // 2))
    return (8, wide) if splits <= 4 and blocks * wide <= sm_count else (4, splits)


def decode_stages(target: str, head_dim: int) -> int | None:
    """Pipeline stages of the decode kernel for a compile target: 4 up to head_dim 64; 3 up to 128 on
    sm_90 (two blocks still fit an SM), else 2; fewer where the target's shared memory is smaller.
    None when even 2 stages do not fit (large head_dims on 99 KB parts). Measured at head_dim 128 on
    an H100 (bench/dev/decode_splits.py --stages; bench/NOTES.md): 2 stages fit three blocks per SM
    and read 4 % faster at batch 64 (8k keys, GQA 1), but lost 17 % at batch 16 (512 blocks: 1.3
    waves of 396 slots against 1.9 of 264) while the split heuristic counts two blocks per SM; 4 or
    6 stages (one block per SM) were up to 25 % slower. Two stages wait for a heuristic that counts
    waves at the real occupancy."""
    fam = family_of_target(target)
    want = 4 if head_dim <= 64 else (3 if head_dim <= 128 and fam == "sm90" else 2)
    for stages in range(want, 1, -1):
        if decode_smem_bytes(head_dim, stages) + 512 <= SMEM_LIMIT[fam]:  # + the merge's static (m, l)
            return stages
    return None


# The peak memory bandwidth (bytes/s, from the device's memory clock and bus width) at or above which
# decode_deep_tma keeps 3 stages: the 4-stage kernel won on an H100 SXM (3.35 TB/s) and lost on an
# H200 (4.8 TB/s); see decode_deep_tma.
DECODE_DEEP_MAX_BW = 4.3e12


def decode_deep_tma(target: str, head_dim: int, grid: int, keys: int, sm_count: int, paged: bool,
                    peak_bw: float = 0.0) -> bool:
    """Whether the 4-warp TMA decode kernel runs 4 stages (128 KB of tiles, one block per SM)
    instead of decode_stages' 3: sm_90a, head_dim 128, a contiguous cache, more than two blocks per
    SM (grid) and at least 2048 keys a block. H100 (bench/NOTES.md): in session 15 every TMA decode
    on 4 stages read 1-4 % faster there (64 x 8192 x 1 2862 -> 2747 us, one card), 3-5 % slower at
    512-key caches on 256-512 blocks, and paged caches 2 % slower on average; in session 16 this
    rule against 3 stages (the bench_decode grid twice on one card): the 20 grid points it takes
    0.959-0.992x the time (geomean 0.975), the 21 others above 100 us 0.998. On an H200 (session 33,
    bench_decode at the 18 shapes with batch 16-256 and 2048-8192 keys, one card, the rule against
    CUFLASH_DECODE_DEEP=0 twice) 3 stages were as fast or faster at every point the rule takes: 256 x
    2048 x 1 1975 -> 1888 us, 64 x 2048 x 1 505 -> 487, 16 x 2048 x 1 132 -> 127 (a likely cause,
    not measured: 3-stage blocks fit two to an SM and keep more bytes in flight per SM than one
    4-stage block, which the faster memory needs). So the rule holds only below DECODE_DEEP_MAX_BW of peak
    bandwidth (peak_bw, bytes/s: cuflash/_gpu.py peak_memory_bandwidth; 0, unknown, counts as
    below). CUFLASH_DECODE_DEEP=0: never, 1: wherever the kernel is built (A/B measurements)."""
    import os

    force = os.environ.get("CUFLASH_DECODE_DEEP")
    if force == "0":
        return False
    if force == "1":
        return decode_deep_supported(target, head_dim)
    return (decode_deep_supported(target, head_dim) and not paged and grid > 2 * sm_count and keys >= 2048
            and peak_bw < DECODE_DEEP_MAX_BW)


def decode_shallow_tma(target: str, head_dim: int, grid: int, sm_count: int, peak_bw: float = 0.0,
                       keys: int | None = None) -> bool:
    """Whether the 4-warp TMA decode kernel runs 2 stages (64 KB of tiles, three blocks per SM) instead of
    decode_stages' 3 (two per SM): sm_90a, head_dim 128, peak memory bandwidth (peak_bw, bytes/s; 0,
    unknown, counts as below) at least DECODE_DEEP_MAX_BW (where decode_deep_tma's 4-stage rule does
    not hold), and a grid of more than one block per SM up to two (every block resident either way,
    a third of the bytes in flight per SM fewer), or of at least DECODE_SHALLOW_MIN_WAVES blocks per
    SM, or of at most one per SM where each block sees at most DECODE_SHALLOW_MAX_KEYS keys (keys:
    the most one block sees; None: not known). H200, session 43 (bench/dev/decode_splits.py --stages
    0 2 0 2, 32 query heads, head_dim 128, bf16, GPU us per step, 2 / 3 stages at each shape,
    contiguous and 16-row pages, one process): grids of 2048 blocks (64 x 512-32k x 1, 256 x 512-32k
    x 4) 0.957-0.996 (64 x 32k x 1 7.85 -> 7.57 ms, 256 x 2k x 4 in call 1 491.6 -> 479.7 us); 8192
    blocks (256 x 512-8k x 1) 0.992-1.006; 256 blocks (64 x 512-8k x 8) 0.973-0.998; 1024 blocks
    (256 x * x 8) of at most DECODE_SHALLOW_MID_KEYS keys: 512 keys 0.985 (pages 0.973), 2k 0.988
    (1.003), 8k 0.997 (0.997), but 32k 1.010 (1.013), so grids of DECODE_SHALLOW_MID_WAVES blocks per
    SM or more take 2 stages up to that many keys (the bound lies between the 3.9 blocks per SM
    measured slower and the 7.8 measured faster; session 47). Not at 512
    blocks (16 x 512-32k x 1, 64 x 512-32k x 4: 1.02-1.16, worst with the longest caches: 396 slots
    hold a wave and 116 blocks trail it), nor at one block
    per SM (16 x 128k x 4: 1983 us against 1874-1924) or the split grids of few blocks (1 x 128k x
    8, 4 x 32k x 8, 16 x 8k x 8: 1.02-1.03, 62-64 tiles a block) unless a block sees at most four
    tiles: call 10, one block per SM, 8 splits of 256 keys in clusters, 1 x 2k x 4 9.55 -> 9.31
    (16-row pages 10.04 -> 9.87), 4 x 2k x 8 11.18 -> 11.03; 16 splits of 128 keys, 1 x 2k x 8 8.61
    -> 8.37; one tile a split (1 x 512 x 4 / 8, 4 x 512 x 8) 0.99-1.00. CUFLASH_DECODE_SHALLOW=0:
    never, 1: wherever the kernel is built (A/B measurements)."""
    import os

    force = os.environ.get("CUFLASH_DECODE_SHALLOW")
    if force == "0":
        return False
    if force == "1":
        return decode_shallow_supported(target, head_dim)
    return (decode_shallow_supported(target, head_dim) and peak_bw >= DECODE_DEEP_MAX_BW
            and (sm_count < grid <= 2 * sm_count or grid >= DECODE_SHALLOW_MIN_WAVES * sm_count
                 or (grid >= DECODE_SHALLOW_MID_WAVES * sm_count and keys is not None
                     and keys <= DECODE_SHALLOW_MID_KEYS)
                 or (grid <= sm_count and keys is not None and keys <= DECODE_SHALLOW_MAX_KEYS)))


def decode_mid_wide(target: str, head_dim: int, blocks: int, keys: int, sm_count: int, paged: bool,
                    peak_bw: float = 0.0) -> bool:
    """Whether an unsplit decode of a contiguous cache whose grid decode_shallow_tma's mid-waves clause
    would run on 2 stages (DECODE_SHALLOW_MID_WAVES to DECODE_SHALLOW_MIN_WAVES blocks per SM, three
    2-stage blocks resident per SM) runs the 8-warp kernel instead (3 stages of 128-key tiles, one
    block per SM), where each block sees more than DECODE_MID_WIDE_MIN_KEYS and at most
    DECODE_SHALLOW_MID_KEYS keys: sm_90a, head_dim 128, peak bandwidth (peak_bw, bytes/s) at least
    DECODE_DEEP_MAX_BW, as that clause. On some H200s the 2-stage plan reads 9-14 % slower than on
    others, where the 8-warp kernel and cuDNN do not (bench/NOTES.md, sessions 64, 66, 67). H200,
    session 67 (bench/dev/decode_splits.py, unsplit, 1024 blocks: 256 x 2k / 8k keys x GQA 8, GPU us
    per step, 2 stages / 3 stages 4 warps / 8 warps; cuDNN from bench_decode.py in the same call):
    one card 266.0 / 243.6 / 241.0 (cuDNN 245) and 1036.8 / 940.0 / 940.5 (cuDNN 943); another 243.0 /
    246.5 / 244.7 (cuDNN 248) and 955 / 961 / 956.5 (cuDNN 964). At 512 keys the 8-warp kernel read
    69.0 against 67.0 on 2 stages (cuDNN 70; the second card), so those keep 2 stages. 16-row pages
    (the group kernels) read 1.02-1.03x on the slow card of session 66 against the fast one at 2k and
    8k, as cuDNN's: not changed. CUFLASH_DECODE_MID_WIDE=0: never (A/B). Read when a plan is made."""
    import os

    if os.environ.get("CUFLASH_DECODE_MID_WIDE") == "0":
        return False
    return (decode_shallow_supported(target, head_dim) and not paged and peak_bw >= DECODE_DEEP_MAX_BW
            and DECODE_SHALLOW_MID_WAVES * sm_count <= blocks < DECODE_SHALLOW_MIN_WAVES * sm_count
            and DECODE_MID_WIDE_MIN_KEYS < keys <= DECODE_SHALLOW_MID_KEYS)


def decode_long_splits(target: str, head_dim: int, blocks: int, keys: int, sm_count: int,
                       peak_bw: float = 0.0) -> int:
    """The split count of a TMA decode of long caches on a grid of more than two and at most
    DECODE_LONG_SPLIT_MAX_WAVES blocks per SM, which decode_num_splits leaves unsplit: enough splits
    for DECODE_SHALLOW_MIN_WAVES blocks per SM (so that decode_shallow_tma runs them on 2 stages),
    ceil(DECODE_SHALLOW_MIN_WAVES x sm_count / blocks), each seeing at least
    DECODE_LONG_SPLIT_MIN_SPLIT_KEYS keys; 1 where the rule does not hold: fewer than
    DECODE_LONG_SPLIT_MIN_KEYS keys, another grid, or where 2 stages are not taken (an H100's
    bandwidth, another head_dim or target), or CUFLASH_DECODE_LONG_SPLIT=0. H200, session 55
    (bench/dev/decode_splits.py, 32 query heads, head_dim 128, bf16, contiguous, GPU us per step,
    unsplit -> this count, two runs): 256 x 128k x 8 (1024 blocks, 2 splits) 15550-15624 -> 15200-15207,
    256 x 32k x 8 3889-3890 -> 3803-3804; 512 blocks, 4 splits: 16 x 128k x 1 7699-7715 -> 7660-7662,
    16 x 32k x 1 1910 -> 1896-1897, 64 x 128k x 4 7689 -> 7639-7652, 64 x 32k x 4 1917 -> 1903. Not
    at 8k keys (256 x 8k x 8 955 -> 971 with 2 splits; 16 x 8k x 1 480 -> 485 with 4), nor on grids of
    2048 blocks (64 x 32k x 1 7544 -> 7602 with 2, though 256 x 32k x 4 7674 -> 7586). The rule against
    CUFLASH_DECODE_LONG_SPLIT=0 (bench/dev/s55_call.sh ruleab, alternated twice, another card), time
    with / without: those six points 0.963-0.991 contiguous, 0.960-0.985 with 16-row pages."""
    import os

    if os.environ.get("CUFLASH_DECODE_LONG_SPLIT") == "0" or keys < DECODE_LONG_SPLIT_MIN_KEYS:
        return 1
    if not 2 * sm_count < blocks <= DECODE_LONG_SPLIT_MAX_WAVES * sm_count:
        return 1
    splits = min(-(-DECODE_SHALLOW_MIN_WAVES * sm_count // blocks), keys // DECODE_LONG_SPLIT_MIN_SPLIT_KEYS)
    if splits < 2 or not decode_shallow_tma(target, head_dim, blocks * splits, sm_count, peak_bw):
        return 1
    return splits


# decode_long_splits: the fewest keys a block must see (32k measured faster, 8k slower), the fewest a
# split keeps, and the most blocks per SM of the unsplit grid (1024 blocks on 132 SMs measured, 2048 mixed).
DECODE_LONG_SPLIT_MIN_KEYS = 32768
DECODE_LONG_SPLIT_MIN_SPLIT_KEYS = 8192
DECODE_LONG_SPLIT_MAX_WAVES = 8


def decode_resident_unsplit(target: str, head_dim: int, blocks: int, sm_count: int, peak_bw: float = 0.0) -> bool:
    """Whether a TMA decode of `blocks` unsplit blocks runs unsplit whatever decode_num_splits' model
    says: more than one block per SM up to two, so that every block is resident at once, where
    decode_shallow_tma runs them on 2 stages. The model counts the SMs that hold two blocks as the
    time's bound; with every block resident, the memory bandwidth is, and the blocks of the SMs that
    hold one read faster. H200, session 43 (bench/dev/decode_splits.py, 32 query heads, head_dim 128,
    bf16, GPU us per step): 64 x 131072 x 8 (256 blocks) unsplit 3692 against the model's 17 splits
    3767 (8: 3711, 16: 3725, 32: 3771); the model splits no shorter cache there (up to 32k keys)."""
    return sm_count < blocks <= 2 * sm_count and decode_shallow_tma(target, head_dim, blocks, sm_count, peak_bw)


def decode_split_tail(target: str, head_dim: int, blocks: int, keys: int, sm_count: int, paged: bool,
                      peak_bw: float = 0.0) -> tuple[int, int] | None:
    """(row tiles, splits) of an unsplit 4-warp TMA decode whose last row tiles are read in splits (the
    split tail: cuda_src/flash_decode.cu Grid, merged by the fused combine), or None: sm_90a, head_dim
    128, a contiguous cache, peak bandwidth (peak_bw, bytes/s) at least DECODE_DEEP_MAX_BW, a grid of at
    least DECODE_TAIL_MIN_WAVES blocks per SM (blocks: batch x kv heads x row tiles), each seeing at least
    DECODE_TAIL_MIN_KEYS keys: the last sm_count row tiles in DECODE_TAIL_SPLITS splits each. The grid's
    end, where too few blocks remain to keep the memory busy, is then a quarter as long. H200, session 72
    (bench/dev/decode_tail_ab.py on branch s72-tail, 32 query heads, head_dim 128, bf16, every entry
    full, GPU us per step, 5-7 rounds alternated in one process, two calls; the 2-stage plans):
    - 8192 blocks (256 x L x 1): 2k keys 1838.5-1838.6 -> 1836.1-1836.2 (0.999; cuDNN 1838.9-1839.1),
      8k 7384.8-7386.4 -> 7347.7-7348.0 (0.995; cuDNN 7368-7370); the last 132 tiles in 2 splits 1836.4 /
      7357.3, the last 396 in 4 1838.3-1838.5 / 7352.4-7353.3; but 512 keys 465.6 -> 468.4 (1.006).
    - 2048 blocks, slower with every tail tried: 64 x 2k x 1 462.7 -> 466.4 (1.008), 64 x 8k x 1 1.006, 64 x
      32k x 1 1.004, 256 x 2k x 4 1.011, 256 x 8k x 4 1.001 (the last 132 in 4; the other tails tried,
      132 in 2 and 396 in 4, 1.001-1.018). 512 blocks of 32k keys (16 x 32k x 1): 1.000.
    - A reader of the same tiles without attention (bench/dev/decode_read_bw.py read_tma_tail) gained
      0.3 % at 8192 items of 2k and 8k keys and 0.3-0.8 % at 2048 of 8k: the split blocks' partials and
      merge cost the decode the rest.
    CUFLASH_DECODE_TAIL: "0" never; "T,S" the last T row tiles in S splits wherever the plan is an unsplit
    4-warp TMA decode with the fused combine (A/B measurements, tests). Read when a plan is made."""
    import os

    v = os.environ.get("CUFLASH_DECODE_TAIL")
    if v == "0":
        return None
    if v:
        t, s = (int(x) for x in v.split(","))
        return (min(t, blocks), s) if t > 0 and s > 1 else None
    if (decode_shallow_supported(target, head_dim) and not paged and peak_bw >= DECODE_DEEP_MAX_BW
            and blocks >= DECODE_TAIL_MIN_WAVES * sm_count and keys >= DECODE_TAIL_MIN_KEYS):
        return sm_count, DECODE_TAIL_SPLITS
    return None


# decode_split_tail: from 48 blocks per SM (8192 blocks on 132 SMs measured faster, 2048 slower), blocks
# of at least 2048 keys (512 slower), the last SM count of row tiles in 4 splits.
DECODE_TAIL_MIN_WAVES = 48
DECODE_TAIL_MIN_KEYS = 2048
DECODE_TAIL_SPLITS = 4


def decode_late_issue(target: str, head_dim: int, grid: int, keys: int, sm_count: int, paged: bool, warps: int,
                      stages: int, peak_bw: float = 0.0, mt: int = 1, span: int = 0) -> bool:
    """Whether the TMA decode kernel issues each tile once the tile two before it landed (late_issue:
    cuda_src/flash_decode.cu Copies) rather than at the loop's top: 4 warps, sm_90a, head_dim 128, a
    contiguous cache, 3 stages, one m16 tile a warp (mt; two not measured), peak bandwidth (peak_bw,
    bytes/s) at least DECODE_DEEP_MAX_BW, a grid of at most one block per SM (sm_count), each block
    seeing at least DECODE_LATE_MIN_KEYS keys, whose rows span at most DECODE_LATE_MAX_SPAN bytes of the
    cache (span: keys x the K and V caches' larger row stride in bytes).
    A read-only reader of one block an item read 128 items of 128k keys 1.0-1.1 % faster with two tiles
    in flight than with three, the decode's count where the memory is the limit (bench/dev/decode_read_bw.py,
    H200, session 73: 8 kv heads 1872.9 against 1891.3 us, 32 kv heads 1886.4 against 1906.6; the decode
    1891.5 / 1895.2). The decode with the late issue against without (bench/dev/decode_split_peers.py on
    bench/dev/s73_late_issue.patch, 32 query heads, head_dim 128, bf16, GPU us per step, 11 rounds
    round-robin with cuDNN, two H200 machines): 16 x 128k x 4 0.997 / 0.993 (x cuDNN 1.0004 -> 0.9973,
    1.0053 -> 0.9984), 4 x 8k x 1 0.988 / 0.988, 16 x 32k x 4 0.997 / 0.995, 4 x 32k x 1 1.000 / 0.995,
    16 x 8k x 4 0.998, 1 x 128k x 1 (4 splits) 0.999; but 4 x 128k x 1 1.008 / 1.005 (x cuDNN 0.990 ->
    0.998, 0.992 -> 0.997). Outside the rule: 16 x 2k x 4 (2048 keys) 1.009, 64 x 8k x 4 and 16 x 8k x 1
    (512 blocks) 0.999 / 1.002, the 8-warp kernel 1.002-1.057. The branch's rule against
    CUFLASH_DECODE_LATE=0 (9 rounds, round-robin with cuDNN; two more H200 machines, sessions 73 / 74):
    16 x 128k x 4 0.999 / 0.998, 4 x 8k x 1 0.989 / 0.993, 1 x 32k x 1 0.994 / 0.993; 4 x 128k x 1
    1.006 / 1.0085 (x cuDNN 0.9915 -> 0.9977, 0.9905 -> 0.9989): four machines of four read it slower,
    the one point of bench_decode's grid whose blocks' rows span 1 GiB (32 kv heads: 8 KiB a row;
    16 x 128k x 4 spans 256 MiB, 4 x 32k x 1 256 MiB, and both read faster), so DECODE_LATE_MAX_SPAN
    leaves it out. Why the span matters is not known.
    CUFLASH_DECODE_LATE: "0" never, "1" wherever the kernel allows it (a contiguous cache, 3+ stages; A/B
    measurements, tests). Read when a plan is made."""
    import os

    if stages < 3 or paged:
        return False
    v = os.environ.get("CUFLASH_DECODE_LATE")
    if v in ("0", "1"):
        return v == "1"
    return (warps == 4 and stages == 3 and mt == 1 and decode_shallow_supported(target, head_dim)
            and peak_bw >= DECODE_DEEP_MAX_BW and grid <= sm_count and keys >= DECODE_LATE_MIN_KEYS
            and span <= DECODE_LATE_MAX_SPAN)


# decode_late_issue: blocks of at least 8192 keys (2048 measured slower), whose rows span at most 512 MiB
# (256 MiB measured faster, 1 GiB slower).
DECODE_LATE_MIN_KEYS = 8192
DECODE_LATE_MAX_SPAN = 512 << 20


# decode_shallow_tma: the grids of many blocks per SM where 2 stages run (2048 blocks on 132 SMs
# measured faster, 1024 not), and the most keys a block of a grid of one block per SM or fewer may
# see there (four 64-key tiles: 128- and 256-key splits measured faster, 4096-key ones slower).
DECODE_SHALLOW_MIN_WAVES = 12
DECODE_SHALLOW_MAX_KEYS = 256
# ... and from DECODE_SHALLOW_MID_WAVES blocks per SM, grids whose blocks see at most
# DECODE_SHALLOW_MID_KEYS keys (1024 blocks on 132 SMs: 512-8k keys faster on 2 stages, 32k slower).
DECODE_SHALLOW_MID_WAVES = 6
DECODE_SHALLOW_MID_KEYS = 8192
# decode_mid_wide: above this many keys a block, those grids run the 8-warp kernel unsplit on contiguous caches.
DECODE_MID_WIDE_MIN_KEYS = 512


# decode_heads: the kv heads a block of the several-heads kernel may serve, and the (warps, stages) it is
# built for (head_dim 128, sm_90a).
DECODE_HEADS_BUILT = (2, 4)
DECODE_HEADS_KERNELS = ((4, 2), (4, 3), (4, 4), (8, 3))
# ... and the rule's reach: blocks of 2 heads of at least this many keys (2048 measured slower, 8k-128k
# faster), of 4 heads at least DECODE_HEADS4_MIN_KEYS (2k-128k measured faster).
DECODE_HEADS_MIN_KEYS = 8192
DECODE_HEADS4_MIN_KEYS = 2048


def decode_heads_supported(target: str, head_dim: int, heads: int, stages: int, warps: int, mt: int, paged: bool,
                           rows: int, nheads_kv: int) -> bool:
    """Whether the decode kernel of `heads` kv heads a block (cuda_src/flash_decode.cu Heads) serves a
    plan: built for sm_90a at head_dim 128 (DECODE_HEADS_BUILT, DECODE_HEADS_KERNELS), the TMA kernel
    of one m16 tile a warp on a contiguous cache, the kv heads a multiple of `heads`, and the block's
    rows (rows: seqlen_q x nheads / nheads_kv, one kv head's) x heads one row tile."""
    return (heads in DECODE_HEADS_BUILT and (warps, stages) in DECODE_HEADS_KERNELS and target == "sm_90a"
            and head_dim == 128 and mt == 1 and not paged and nheads_kv % heads == 0
            and rows * heads <= DECODE_ROWS)


def decode_heads_rule(target: str, head_dim: int, blocks: int, splits: int, keys: int, sm_count: int, paged: bool,
                      mt: int, rows: int, nheads_kv: int, plain: bool, peak_bw: float = 0.0) -> int:
    """The kv heads a decode block reads on the 8-warp TMA kernel by the rule (cuda_src/flash_decode.cu
    Heads; decode_heads, decode_heads_wide; 1: none): H = 16 / rows kv heads for 8 or 4 rows a kv head
    (GQA 8 or 4 at seqlen_q 1: a block's 16 rows), where the unsplit grid of H-head blocks is one wave
    with more than half the SMs busy (blocks counted one kv head each: sm_count / 2 < blocks / H <=
    sm_count; one block per SM, 8 warps), each block seeing at least DECODE_HEADS_MIN_KEYS keys (2 heads)
    or DECODE_HEADS4_MIN_KEYS (4), with no mask or score modification (plain), at a peak bandwidth
    (peak_bw, bytes/s) of at least DECODE_DEEP_MAX_BW, where decode_heads_supported. `splits`: the
    plan's count (the planner asks with 1, and then plans the call unsplit).
    H200, session 77 (bench/dev/decode_split_peers.py, cuDNN in the same rounds, 9 rounds, GPU us per
    step, x cuDNN's). bench_decode's 64 x 8k / 32k / 128k x GQA 8 (256 one-head blocks): the one-head
    plan (4 warps, 2 stages) 0.990 / 0.999 / 1.000-1.001; 2 heads on 8 warps (3 stages) 0.987 /
    0.990-0.993 / 0.989-0.992; 2 heads on 4 warps 1.007 / 1.015 / 1.012 on 2 stages, 1.002 / 0.998 /
    0.994 on 3, 1.012 / 1.016 / 1.016 on 4; 2 heads on 8 warps in 2 splits (256 blocks) 1.009-1.013 at
    32k and 128k; at 2048 keys 2 heads 0.982 against the one-head plan's 0.970. 64 x 2k / 8k / 32k / 128k
    x GQA 4 (512 one-head blocks; the plan 3 stages unsplit at 2k and 8k, 4 splits at 32k and 128k):
    0.985 / 0.995 / 0.993 / 1.015; 4 heads on 8 warps (128 blocks) 0.975 / 0.980 / 0.975 / 0.973; 2
    heads on 8 warps (256 blocks) 0.991 / 0.993 / 0.996 / 0.997."""
    h = {8: 2, 4: 4}.get(rows, 1)
    least = DECODE_HEADS_MIN_KEYS if h == 2 else DECODE_HEADS4_MIN_KEYS
    ok = (h > 1 and splits == 1 and plain and sm_count < 2 * (blocks // h) and blocks <= h * sm_count
          and keys >= least and peak_bw >= DECODE_DEEP_MAX_BW
          and decode_heads_supported(target, head_dim, h, decode_wide_stages(target, head_dim) or 0, 8, mt, paged,
                                     rows, nheads_kv))
    return h if ok else 1


def decode_heads_forced() -> int:
    """CUFLASH_DECODE_HEADS: 1 ("0" or "1": one kv head a block everywhere), 2 or 4 (that many wherever the
    kernel serves the plan, on the plan's own warps; A/B measurements, tests), 0 unset (the rule). Read
    when a plan is made."""
    import os

    v = os.environ.get("CUFLASH_DECODE_HEADS")
    return {"0": 1, "1": 1, "2": 2, "4": 4}.get(v, 0)


def decode_heads_wide(*rule_args, **rule_kw) -> bool:
    """Whether the planner plans a call on the 8-warp kernel for several kv heads a block, unsplit:
    decode_heads_rule's terms (its arguments) give more than 1, CUFLASH_DECODE_HEADS unset."""
    return decode_heads_forced() == 0 and decode_heads_rule(*rule_args, **rule_kw) > 1


def decode_heads(target: str, head_dim: int, blocks: int, splits: int, keys: int, sm_count: int, paged: bool,
                 warps: int, stages: int, mt: int, rows: int, nheads_kv: int, plain: bool,
                 peak_bw: float = 0.0) -> int:
    """The kv heads a decode block serves (cuda_src/flash_decode.cu Heads) in a plan of `warps` warps and
    `stages` stages whose one-head grid has `blocks` blocks: decode_heads_rule's count on the 8-warp
    kernel of its own depth, else 1; CUFLASH_DECODE_HEADS forces (decode_heads_forced)."""
    forced = decode_heads_forced()
    if forced:
        ok = forced > 1 and decode_heads_supported(target, head_dim, forced, stages, warps, mt, paged, rows, nheads_kv)
        return forced if ok else 1
    if warps != 8 or stages != decode_wide_stages(target, head_dim):
        return 1
    return decode_heads_rule(target, head_dim, blocks, splits, keys, sm_count, paged, mt, rows, nheads_kv, plain,
                             peak_bw)


def decode_shallow_supported(target: str, head_dim: int) -> bool:
    """Whether the 2-stage 4-warp TMA decode kernel is built for (target, head_dim): sm_90a, head_dim
    128, where three of its blocks fit an SM (decode_shallow_tma chooses it per call)."""
    return (target == "sm_90a" and head_dim == 128
            and 3 * (decode_smem_bytes(128, 2, 4, tma=True) + decode_static_smem_bytes(2, 4, tma=True) + 1024)
            <= SM90_SMEM_PER_SM)


def decode_cluster_split_keys(target: str, head_dim: int, sm_count: int, peak_bw: float = 0.0) -> int:
    """The most keys a split of the 4-warp TMA kernel may see for decode_warps_and_splits to keep a
    one-block-per-SM count in clusters ahead of the 8-warp unsplit region (its cluster_keys): two
    64-key tiles where decode_shallow_tma runs such splits on 2 stages, else one. H200, session 44
    (bench/dev/decode_splits.py, 32 query heads, head_dim 128, bf16, GPU us per step, 4 splits of 128
    keys in clusters on 2 stages against 8 warps unsplit, the (4, 512) region of DECODE_WIDE_UNSPLIT):
    1 x 512 x 1 (32 blocks) 8.71 against 8.80, 16-row pages 9.14 against 9.69; 4 x 512 x 4 8.85 / 8.91,
    pages 9.26 / 9.79. (Session 31, on 3 stages: 10.0-10.2 against 9.9-10.0 unsplit.)"""
    two = 2 * DECODE_BLOCK_N
    return two if decode_shallow_tma(target, head_dim, sm_count, sm_count, peak_bw, two) else DECODE_BLOCK_N


def decode_deep_supported(target: str, head_dim: int) -> bool:
    """Whether the 4-stage 4-warp TMA decode kernel is built for (target, head_dim): sm_90a, head_dim
    128, where its shared memory fits (decode_deep_tma chooses it per call)."""
    return (target == "sm_90a" and head_dim == 128
            and decode_smem_bytes(128, 4, 4, tma=True) + decode_static_smem_bytes(4, 4, tma=True)
            <= SMEM_LIMIT[family_of_target(target)])


# The fused combine serves a split decode only where (valid rows of a row tile) x splits is at most
# this: its last block reads all of the tile's partial outputs alone (rows x splits x head_dim x 4
# bytes), where the combine kernel spreads them over a block per row. H200, session 7: with no limit,
# batch 1, 8192 keys, GQA 8 (8 rows, 64 splits) took 24.8 us per step against 14.5 with the limit.
# CUFLASH_DECODE_FUSED_MAX_PARTS sets it at import (measurements).
DECODE_FUSED_MAX_PARTS = int(__import__("os").environ.get("CUFLASH_DECODE_FUSED_MAX_PARTS", "64"))

# In a CUDA graph (no launch to save) the fused combine serves at most this many rows x splits; past
# it the graph runs the combine kernel, whose blocks spread the merge. (A capture uses the fused merge
# only on a stream that ran an eager decode before, where its counters exist; torch.cuda.graph's own
# capture stream takes the combine kernel anyway.) H100, session 17 (bench/dev/graph_fused_ab.py,
# capture on the warmed stream, limit 64 / 32 alternated twice, replay µs per step): 1 x 2048 x 4 (4
# rows x 16 splits) 10.1-10.3 -> 8.4-8.5, 4 x 2048 x 8 (8 x 8) 11.9-12.0 -> 10.1, 1 x 8192 x 4
# 14.0-14.3 -> 12.7-12.8, 4 x 8192 x 8 31.4-31.8 -> 29.6-29.8; 1 x 512 / 1024 / 2048 x 8 unchanged.
# Eager calls keep DECODE_FUSED_MAX_PARTS: there the fused merge saves a launch of host time.
# CUFLASH_DECODE_GRAPH_FUSED_MAX_PARTS sets it at import (measurements).
DECODE_GRAPH_FUSED_MAX_PARTS = min(DECODE_FUSED_MAX_PARTS, int(__import__("os").environ.get(
    "CUFLASH_DECODE_GRAPH_FUSED_MAX_PARTS", "32")))


def bwd_ws_seqs_enabled() -> bool:
    """The warp-specialized FEAT backward for calls with per-sequence lengths (padded or packed
    batches; the kernel's SEQS): yes unless CUFLASH_BWD_WS_SEQS=0."""
    import os

    return os.environ.get("CUFLASH_BWD_WS_SEQS") != "0"


def bwd_ws_feat_enabled() -> bool:
    """Whether backward calls with windows, sink tokens or logits, or ALiBi (no per-sequence lengths,
    packed batches or softcap) run the warp-specialized backward's FEAT variant
    (cuda_src/flash_bwd_sm90_ws.cu): yes unless CUFLASH_BWD_WS_FEAT=0. Measured (H100, session 8,
    bench_flex --quick, 8k, forward + backward against FlexAttention, on / off in one call): ALiBi
    1.20 / 0.96, window (4096, 0) 1.18 / 0.93, window (256, 0) 159 / 142 TFLOP/s."""
    import os

    return os.environ.get("CUFLASH_BWD_WS_FEAT") != "0"


def decode_fused_combine() -> bool:
    """Whether split decodes may merge their splits inside the decode kernel (the last split block of
    each row tile; cuda_src/flash_decode.cu merge_tile) instead of a second kernel, where rows x
    splits <= DECODE_FUSED_MAX_PARTS; a split then costing no extra launch, eager calls choose their
    split count by GPU time there (decode_num_splits host_bound_rule=False). The default;
    CUFLASH_DECODE_FUSED_COMBINE=0 keeps the combine kernel. H200, session 7 (bench_decode, 24
    contiguous points, cuflash / the faster of SDPA-flash and cuDNN, GPU time): geomean 1.30 without,
    1.20 with; 512-key caches at batch 1-4 from 1.85-1.90 to 1.18-1.26."""
    import os

    return os.environ.get("CUFLASH_DECODE_FUSED_COMBINE") != "0"


DECODE_CLUSTER_MAX = 8  # the most splits one cluster merges (cuda_src/flash_decode.cu CLUSTER_MAX: the portable size)
# ... and the most keys a split may see for its row tile's splits to be merged in a cluster: past it
# the fused combine or the combine kernel was faster (H200, session 31, bench/dev/cluster_ab.py, GPU us
# per step, fused / cluster: 1 x 8192 x 1 in 4 splits of 2048 keys 38.1 / 41.3; 1 x 2048 x 1 in 4 of
# 512, 15.1 / 15.5; 4 x 2048 x 8 in 8 of 256, 12.7 / 12.1).
DECODE_CLUSTER_KEYS = 256


def decode_eager_pdl() -> bool:
    """Whether eager decode calls on sm_90 launch their kernels as programmatic dependents where the
    stream is busy (cuflash/_kvcache.py DecodePlan.run): the default; CUFLASH_DECODE_EAGER_PDL=0
    turns it off (A/B measurements), CUFLASH_PDL=0 turns off PDL altogether. Read when a plan is made."""
    import os

    return os.environ.get("CUFLASH_DECODE_EAGER_PDL") != "0"


def decode_narrow_clusters() -> bool:
    """Whether a split decode planned on the 8-warp kernel whose clusters do not all fit the GPU at once
    (one 8-warp block per SM: 15 clusters of 8 on an H200) and whose splits the fused combine cannot
    merge (row tile rows x splits over DECODE_FUSED_MAX_PARTS: speculative decoding, 16 rows a tile)
    runs the 4-warp kernel in clusters instead (two blocks per SM), one launch, where those fit: yes
    unless CUFLASH_DECODE_NARROW_CLUSTERS=0 (A/B). Without it the plan keeps 8 warps and merges its
    splits in a combine kernel (a second launch). H200, session 66 (bench/dev/eager_splits.py, 300
    single calls a variant, interleaved; 1 x 2048 keys x 8 query positions, GQA 8 / 4 (64 / 32 rows a
    kv head: 128 blocks of 16 rows in 8 splits of 256 keys)): the 4-warp clusters, forced, 10.2 us of
    GPU time back to back against the library's 10.8 / 10.8 (8 warps and the combine kernel), single
    calls 32.7 / 31.9 against 36.6 / 35.6 (SDPA flash 39.3 / 38.4). Read when a decode plan is made."""
    import os

    return os.environ.get("CUFLASH_DECODE_NARROW_CLUSTERS") != "0"


def decode_cluster() -> bool:
    """Whether split decodes on sm_90 with at most DECODE_CLUSTER_MAX splits run each row tile's
    splits as one thread block cluster that merges them through distributed shared memory
    (cuda_src/flash_decode.cu cluster_merge_tile), instead of the fused combine or the combine
    kernel: the default; CUFLASH_DECODE_CLUSTER=0 turns it off."""
    import os

    return os.environ.get("CUFLASH_DECODE_CLUSTER") != "0"


def decode_num_splits(blocks: int, keys: int, sm_count: int, blocks_per_sm: int, max_splits: int = 64,
                      host_bound_rule: bool = True, paged: bool = False, one_per_sm: bool = False) -> int:
    """How many chunks the keys of each (entry, kv head, row tile) are split into (flash-decoding).
    blocks: thread blocks without splitting; keys: the most keys one block may see. Splitting pays
    when `blocks` cannot fill the GPU. Modelled time, in tiles of keys, for s splits (n = blocks * s
    blocks; a split walks whole tiles, ceil(tiles / s) of them, so 61 splits of 128 tiles take 3
    tiles each, as 43 would, where 64 take 2):
      - each SM streams ceil(n / sm_count) blocks' tiles: an SM's share of the memory bandwidth is
        what a tile's time stands for, so blocks beyond one per SM add no bandwidth; where two or
        more share an SM (blocks_per_sm >= 2), they hide each other's latencies: x 0.94 for a
        contiguous cache (and a paged one read through TMA), x 0.8 for a paged one read by the
        cp.async kernel (paged=True), whose copies (an offset table per tile) leave more latency to
        hide;
      - 2 tiles per wave of n over the sm_count * blocks_per_sm resident blocks (a block's start:
        its first copies' latency, the pipeline's fill, the merge of its warps);
      - 2 more tiles when s > 1: the combine of the splits, serialized after them.
    Each split keeps at least 2 tiles of keys (1 without host_bound_rule). Returns the smallest s
    within 1 % of the best. The fastest forced counts measured on an H100 (bench/dev/decode_splits.py,
    GPU time), which the model picks: batch 1, 8k and 128k keys, GQA 8 (4 blocks): 64 splits (16.4
    and 111.9 us); batch 16, 8k, GQA 8 (64 blocks): 4; batch 4, 32k (16 blocks): 16; and 128 blocks
    of 512 keys (batch 16 GQA 4, batch 4 GQA 1): 1 (14.2 and 14.3 us, against 16.4 and 16.9 with the
    2 splits that the model without the SM's bandwidth share chose; session 10); 128 blocks of 2048
    keys (batch 16 GQA 4, batch 4 GQA 1): contiguous 1 (53.3 / 52.0 against 56.3 / 56.4 with 2),
    paged, the cp.async kernel (session 10) 2 (59.8 / 58.9 against 65.4 / 65.1 unsplit).
    host_bound_rule: blocks of at most 16 tiles are not split, for eager calls without the fused
    combine: such a call is host-bound, and a split adds a launch and an allocation (measured on an
    H100 at 512 keys: 33 against 50 us per call at batch 1, 39 against 62 at batch 16). A call
    captured in a CUDA graph has no host time to save: there the GPU time alone decides
    (host_bound_rule=False; measured at batch 1, 512 keys, GQA 8: 20.2 us with 1 split, 10.8 with
    the 8 chosen).
    one_per_sm (the TMA kernel at DECODE_ONE_PER_SM_HEAD_DIMS): where blocks < sm_count, the most
    splits that keep one block per SM, sm_count // blocks (within the cap above; then the fewest
    that give each split as many whole tiles, so none is left empty): the TMA kernel's
    4-warp block keeps enough bytes in flight alone, and a second block per SM cost more than it
    hid. H100, session 14 (bench/dev/decode_splits.py, GQA 1 / 4 / 8, 32 query heads, head_dim 128,
    GPU us per step, the one-per-SM count against the model's): batch 1, 8192 keys, GQA 8 (4
    blocks): 32 splits 13.5 against 64 splits 14.8; 1 x 32768 x 4 (8 blocks): 16 splits 54.3 against
    32 57.5; 4 x 8192 x 8 (16 blocks): 8 33.5 against 16 35.2; 4 x 32768 x 8: 8 98.8 against 16
    102.5; 1 x 8192 x 1 (32 blocks): 4 53.3 against 8 56.2; 16 x 8192 x 8 (64 blocks): 2 98.4
    against 4 (8 warps x 2: 100.2). At 32 blocks of 2048 keys 4 splits took 15.1 against 14.3 with
    8; decode_warps_and_splits gives those 4 splits 8 warps (14.0)."""
    slots = max(1, sm_count * blocks_per_sm)
    cap = max(1, min(max_splits, keys // ((2 if host_bound_rule else 1) * DECODE_BLOCK_N)))
    if blocks >= slots or cap == 1 or (host_bound_rule and keys <= 16 * DECODE_BLOCK_N):
        return 1
    tiles = -(-keys // DECODE_BLOCK_N)
    if one_per_sm and blocks < sm_count:
        s = max(1, min(cap, sm_count // max(1, blocks)))
        return -(-tiles // -(-tiles // s))  # no split left without tiles: 33 of 128 tiles -> 32
    sms = max(1, sm_count)

    def cost(s: int) -> float:
        n = blocks * s
        per_sm = -(-n // sms)
        streamed = per_sm * -(-tiles // s) * ((0.8 if paged else 0.94) if per_sm >= 2 and blocks_per_sm >= 2 else 1.0)
        return streamed + 2 * -(-n // slots) + (2 if s > 1 else 0)

    costs = {s: cost(s) for s in range(1, cap + 1)}
    best = min(costs.values())
    return min(s for s, c in costs.items() if c <= best * 1.01)
