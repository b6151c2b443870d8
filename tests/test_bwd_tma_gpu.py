"""The sm_90a dK/dV kernel's TMA variant (cuda_src/flash_bwd_sm90.cu with TMA, CUFLASH_BWD_TMA=1):
Q, dO, K and V through tensor maps and mbarriers instead of cp.async. Checked as the default backward
is (tests/test_gpu_backward.py's run_backward_and_check: float64 reference gradients, 2x the naive
error, NaN-poisoned allocators, inputs untouched) over both dtypes, head_dim 64 and 128, causal or
not, lengths that are and are not multiples of the tiles (rows past the tensors come as the maps'
zeros), rows that see no key, GQA, strided layouts, and both dQ paths (atomic and deterministic).
The launched dK/dV kernel's name is checked, so a fallback to cp.async cannot pass for it. Marked
gpu; skipped below sm_90."""

import pytest

from test_fwd_tma_gpu import record_tma_launches
from test_gpu_backward import make_dout, run_backward_and_check
from test_gpu_forward import fresh_seed, make_qkv

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu

CASES = [  # dtype, head_dim, causal, seqlen_q, seqlen_k, nheads, nheads_kv, layout, deterministic
    ("bfloat16", 128, False, 1024, 1024, 4, 4, "bshd", False),
    ("float16", 128, True, 1000, 1000, 4, 2, "bshd", True),
    ("bfloat16", 64, True, 513, 777, 8, 2, "bhsd", False),
    ("float16", 64, False, 200, 130, 4, 1, "padded", True),
    ("bfloat16", 128, True, 700, 300, 4, 1, "bshd", False),   # bottom-right causal: rows with no key
    ("float16", 64, False, 1, 4097, 2, 2, "bshd", False),
    ("bfloat16", 128, False, 2048, 64, 2, 2, "mixed", True),  # many query blocks per key block
]


@pytest.mark.parametrize("dtype,head_dim,causal,seqlen_q,seqlen_k,nheads,nheads_kv,layout,det", CASES)
def test_tma_backward(monkeypatch, dtype, head_dim, causal, seqlen_q, seqlen_k, nheads, nheads_kv, layout, det):
    import cuflash
    from cuflash import _config, _plan, _tma

    names = record_tma_launches(monkeypatch, CUFLASH_BWD_SINGLE="0", CUFLASH_BWD_TMA="1", CUFLASH_BWD_WS="0")
    try:
        seed = fresh_seed()
        torch.manual_seed(seed)
        tdt = getattr(torch, dtype)
        q, k, v = make_qkv(2, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, tdt, layout)
        dout = make_dout(2, seqlen_q, nheads, head_dim, tdt, layout)
        label = (f"bwd tma {dtype} d{head_dim} causal={causal} {seqlen_q}x{seqlen_k} h{nheads}/{nheads_kv} "
                 f"{layout} deterministic={det}")
        run_backward_and_check(cuflash, q, k, v, dout, causal=causal, deterministic=det, seed=seed, label=label)
        cfg = _config.bwd_config_for_target("sm_90a", head_dim, dtype)
        patched = all(_tma.layout_patch(tuple(t.shape), tuple(t.stride()), rows, dtype) is not None
                      for t, rows in ((q, cfg.block_m), (dout, cfg.block_m), (k, cfg.block_n), (v, cfg.block_n)))
        dkdv = [n for n in names if n.startswith("bwd90_dkdv")]
        if patched:
            assert dkdv and all(n.endswith("_tma") for n in dkdv), (label, names)
    finally:
        _plan.CACHE.clear()
