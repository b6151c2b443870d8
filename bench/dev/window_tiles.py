"""Tiles of the feature kernels for a narrow window on Hopper. Window (256, 0), causal, bf16, batch 2,
seqlen 16384, 16 heads, head_dim 128; GPU time by CUDA-graph replay of 20 calls (no host time).

Forward: each kernel forced through cuflash/_config.py:feat_fwd_config. Backward: the dK/dV tiles
(feat_bwd_config), dQ by atomics from the wgmma dK/dV kernel or by the separate pass
(FEAT_ATOMIC_DQ_HEAD_DIMS), and the separate pass's tiles (feat_dq_config). Prints ms and the ratio
to the plain causal call. Also the forward at wider windows, 64- against 128-row wgmma tiles.

PYTHONPATH=. python3 bench/dev/window_tiles.py [fwd] [bwd] [wide]     (default: all three)
"""
import sys

import torch

import cuflash
from graph_time import graph_ms
from cuflash import _config

T = _config.TileConfig
parts = [a for a in sys.argv[1:] if a in ("fwd", "bwd", "wide")] or ["fwd", "bwd", "wide"]


q, k, v, dout = (torch.randn(2, 16384, 16, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4))
W = (256, 0)

if "fwd" in parts:
    full = graph_ms(lambda: cuflash.attention(q, k, v, causal=True))
    print(f"fwd plain causal {full:.3f} ms")
    w = graph_ms(lambda: cuflash.attention(q, k, v, causal=True, window=W))
    print(f"fwd dispatcher's choice: window {w:.3f} ms, ratio {full / w:.2f}x")
    orig = _config.feat_fwd_config
    for cfg in (T(64, 64, 4), T(64, 64, 4, True), T(128, 64, 8, True), T(128, 128, 8, True)):
        _config.feat_fwd_config = lambda t, d, dt, narrow=False, c=cfg: c
        w = graph_ms(lambda: cuflash.attention(q, k, v, causal=True, window=W))
        kind = "wgmma" if cfg.wgmma else "mma.sync"
        print(f"fwd {kind} {cfg.block_m}x{cfg.block_n}x{cfg.warps}: window {w:.3f} ms, ratio {full / w:.2f}x")
    _config.feat_fwd_config = orig

if "bwd" in parts:
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    wout, wlse = cuflash.attention(q, k, v, causal=True, window=W, return_lse=True)
    full = graph_ms(lambda: cuflash.attention_backward(dout, q, k, v, out, lse, causal=True))
    print(f"bwd plain causal {full:.3f} ms")

    def window_bwd(deterministic=False):
        return graph_ms(lambda: cuflash.attention_backward(dout, q, k, v, wout, wlse, causal=True, window=W,
                                                           deterministic=deterministic))

    w = window_bwd()
    print(f"bwd dispatcher's choice: window {w:.3f} ms, ratio {full / w:.2f}x")
    w = window_bwd(True)
    print(f"bwd deterministic (separate dQ pass): window {w:.3f} ms, ratio {full / w:.2f}x")
    orig_b, orig_q, orig_atomic = _config.feat_bwd_config, _config.feat_dq_config, _config.FEAT_ATOMIC_DQ_HEAD_DIMS
    for kv_cfg, dq_cfg, atomic in ((T(64, 64, 4, True), None, True), (T(64, 64, 4, True), None, False),
                                   (None, T(64, 32, 4), False), (None, T(128, 32, 8), False)):
        _config.feat_bwd_config = (lambda t, d, dt, c=kv_cfg: c) if kv_cfg else orig_b
        _config.feat_dq_config = (lambda t, d, dt, c=dq_cfg: c) if dq_cfg else orig_q
        _config.FEAT_ATOMIC_DQ_HEAD_DIMS = (128,) if atomic else ()
        kv = kv_cfg or orig_b("sm_90a", 128, "bfloat16")
        label = f"dK/dV {'wgmma ' if kv.wgmma else ''}{kv.block_m}x{kv.block_n}, " + (
            "atomic dQ" if atomic else f"dQ pass {(dq_cfg or orig_q('sm_90a', 128, 'bfloat16'))}")
        try:
            w = window_bwd()
            print(f"bwd {label}: window {w:.3f} ms, ratio {full / w:.2f}x")
        except Exception as e:  # a tile the kernel does not take
            print(f"bwd {label}: {type(e).__name__}: {str(e)[:200]}")
    _config.feat_bwd_config, _config.feat_dq_config, _config.FEAT_ATOMIC_DQ_HEAD_DIMS = orig_b, orig_q, orig_atomic

if "wide" in parts:
    full = graph_ms(lambda: cuflash.attention(q, k, v, causal=True))
    orig = _config.feat_fwd_config
    for left in (256, 512, 768, 1024, 2048):
        row = []
        for cfg in (T(64, 64, 4, True), T(128, 128, 8, True)):
            _config.feat_fwd_config = lambda t, d, dt, narrow=False, c=cfg: c
            row.append(graph_ms(lambda: cuflash.attention(q, k, v, causal=True, window=(left, 0))))
        print(f"fwd window ({left}, 0): wgmma 64x64 {row[0]:.3f} ms, 128x128 {row[1]:.3f} ms "
              f"(plain causal {full:.3f})")
    _config.feat_fwd_config = orig
