"""The sm_90a forward's TMA variant (flash_fwd_sm90.cu with TMA; docs/hopper_plan.md step 1):
K and V through tensor maps and mbarriers instead of cp.async (cuda_src/flash_fwd_sm90.cu, TMA).
Checked as the default kernels are (tests/test_gpu_forward.py's run_and_check: float64 reference,
2x the naive error, NaN-poisoned allocators): both dtypes, head_dim 64 / 128 / 256, causal or not,
lengths that are and are not multiples of the tiles (rows past seqlen_k come as the map's zeros),
GQA, and the strided layouts the maps must describe (bhsd views, padded rows, packed qkv). The
launched kernel's name is checked, so a fallback to cp.async cannot pass for it. Marked gpu;
skipped below sm_90."""

import pytest
from _cpu_helpers import record_fired

from test_gpu_forward import fresh_seed, make_qkv, run_and_check

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu


def record_tma_launches(monkeypatch, **env):
    """Skips below sm_90; sets (value) or removes (None) the environment variables; clears the plan
    cache; returns the list that collects the name of every TmaLaunch fired from now on."""
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the TMA kernels are sm_90a's")
    from cuflash import _launch, _plan

    for name, value in env.items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    _plan.CACHE.clear()
    return record_fired(monkeypatch, _launch.TmaLaunch)


@pytest.fixture
def tma_on(monkeypatch):
    # this file checks flash_fwd_sm90.cu's TMA variant itself, not the warp-specialized kernel
    yield record_tma_launches(monkeypatch, CUFLASH_FWD_TMA="1", CUFLASH_FWD_WS="0")
    from cuflash import _plan

    _plan.CACHE.clear()


CASES = [  # dtype, head_dim, causal, seqlen_q, seqlen_k, nheads, nheads_kv, layout
    ("bfloat16", 128, False, 1024, 1024, 4, 4, "bshd"),
    ("float16", 128, True, 1000, 1000, 4, 2, "bshd"),
    ("bfloat16", 64, True, 513, 777, 8, 2, "bhsd"),
    ("float16", 64, False, 200, 130, 4, 1, "padded"),
    ("bfloat16", 256, True, 300, 300, 2, 2, "packed"),
    ("float16", 256, False, 64, 1000, 2, 1, "mixed"),
    ("bfloat16", 128, True, 1, 4097, 8, 8, "bshd"),
    # head_dim 64 causal from 2048 keys: 64 x 128 tiles (_config.FWD_TMA_CAUSAL_WIDE_SEQLEN_K)
    ("float16", 64, True, 2100, 2500, 4, 2, "bshd"),
    ("bfloat16", 64, True, 2048, 2048, 4, 4, "bhsd"),
    ("bfloat16", 64, True, 3000, 2049, 4, 1, "padded"),  # more queries than keys: the first rows see none
    ("float16", 64, True, 700, 2047, 2, 2, "mixed"),     # the last length of 64 x 64 tiles
]


@pytest.mark.parametrize("dtype,head_dim,causal,seqlen_q,seqlen_k,nheads,nheads_kv,layout", CASES)
def test_tma_forward(tma_on, dtype, head_dim, causal, seqlen_q, seqlen_k, nheads, nheads_kv, layout):
    import cuflash

    seed = fresh_seed()
    torch.manual_seed(seed)
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, getattr(torch, dtype), layout)
    label = f"tma {dtype} d{head_dim} causal={causal} {seqlen_q}x{seqlen_k} h{nheads}/{nheads_kv} {layout}"
    run_and_check(cuflash, q, k, v, causal=causal, seed=seed, label=label)
    assert tma_on and all(n.endswith("_tma") for n in tma_on), f"not the TMA kernel: {tma_on}; {label}"
    from cuflash import _config

    cfg = _config.fwd_tma_config_for_target("sm_90a", head_dim, dtype, causal, seqlen_k)
    assert all(f"_m{cfg.block_m}_n{cfg.block_n}_" in n for n in tma_on), (cfg, tma_on, label)
    # A second call on new tensors of the same shapes: new pointers, new maps, the same plan.
    q2, k2, v2 = make_qkv(2, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, getattr(torch, dtype), layout)
    run_and_check(cuflash, q2, k2, v2, causal=causal, seed=seed, label=label + " (second call)")


def test_default_mode_uses_tma_where_maps_patch(tma_on, monkeypatch):
    """Without CUFLASH_FWD_TMA, a plain sm_90a forward takes a TMA kernel (the TMA variant, or the
    warp-specialized kernel where its table has the shape) exactly when the driver's maps of the
    layout follow the one-word rule (cuflash/_tma.py learn_patch), and then the patched maps equal
    the driver's own at the call's real pointers. Results checked as above."""
    import cuflash
    from cuflash import _config, _plan, _tma

    monkeypatch.delenv("CUFLASH_FWD_TMA")
    monkeypatch.delenv("CUFLASH_FWD_WS")
    _plan.CACHE.clear()
    seed = fresh_seed()
    torch.manual_seed(seed)
    q, k, v = make_qkv(2, 700, 900, 8, 2, 128, torch.bfloat16, "bshd")
    bn = _config.fwd_config_for_target("sm_90a", 128, "bfloat16", False).block_n
    patch = _tma.layout_patch(tuple(k.shape), tuple(k.stride()), bn, "bfloat16")
    run_and_check(cuflash, q, k, v, causal=False, seed=seed, label="tma default mode")
    assert bool(tma_on) == (patch is not None), (tma_on, patch)
    if patch is not None:
        for t in (k, v):
            for off in (0, 16, 4096 * 16):
                ptr = t.data_ptr() + off
                assert patch.map(ptr) == _tma.kv_map(ptr, tuple(t.shape), tuple(t.stride()), bn, "bfloat16")


# Pad-up on the TMA variant (cuflash/_config.py fwd_pad_tma; CUFLASH_FWD_PAD_TMA=1: at every length):
# plain calls at head_dim 24 to 56 run the variant of 64 with maps of their own head_dim (TMA's zeros
# past it), Q's columns past it zero-filled by cp.async and O's left unwritten (FwdTmaParams.d_cols;
# run_and_check NaN-poisons out, so a column not written or a write past the row shows).
CASES_PAD = [  # dtype, head_dim, causal, seqlen_q, seqlen_k, nheads, nheads_kv, layout
    ("bfloat16", 24, False, 1000, 1000, 4, 2, "bshd"),
    ("float16", 40, True, 513, 777, 4, 1, "bhsd"),
    ("bfloat16", 56, False, 200, 130, 2, 2, "padded"),
    ("float16", 32, True, 300, 300, 2, 2, "packed"),
    ("bfloat16", 48, False, 64, 1000, 2, 1, "mixed"),
    ("float16", 56, True, 2048, 512, 2, 2, "bshd"),   # bottom-right causal: early rows see no key
    ("bfloat16", 40, False, 129, 1, 2, 2, "bshd"),    # one key
    ("float16", 24, True, 1024, 1024, 4, 4, "bshd"),
    ("bfloat16", 48, True, 1, 4097, 8, 8, "bshd"),
]


# ... and with the tree's rule (FWD_PAD_SMALL_TMA_SEQLEN_K's spans): "rule" in the last column.
CASES_PAD_RULE = [
    ("bfloat16", 48, True, 1000, 1000, 4, 2, "bshd", "rule"),
    ("float16", 32, False, 700, 1500, 4, 4, "bhsd", "rule"),
    ("bfloat16", 56, True, 513, 1500, 2, 1, "padded", "rule"),
    ("float16", 32, True, 3000, 3000, 2, 2, "bshd", "rule"),
    ("float16", 40, True, 1000, 1000, 4, 2, "bshd", "rule"),     # 128 x 64 tiles (FWD_PAD_SMALL_TMA_TILE)
    ("bfloat16", 40, False, 700, 1500, 4, 1, "bhsd", "rule"),
    ("float16", 56, False, 300, 1100, 2, 2, "mixed", "rule"),
]


@pytest.mark.parametrize("dtype,head_dim,causal,seqlen_q,seqlen_k,nheads,nheads_kv,layout,mode",
                         [c + ("1",) for c in CASES_PAD] + CASES_PAD_RULE)
def test_tma_padded_head_dim_forward(monkeypatch, dtype, head_dim, causal, seqlen_q, seqlen_k, nheads, nheads_kv,
                                     layout, mode):
    import cuflash
    from cuflash import _config, _plan

    names = record_tma_launches(monkeypatch, CUFLASH_FWD_PAD_TMA="1" if mode == "1" else None, CUFLASH_FWD_WS=None,
                                CUFLASH_FWD_TMA=None, CUFLASH_FWD_PAD=None)
    assert _config.fwd_pad_tma("sm_90a", head_dim, causal, seqlen_k), "a case the TMA variant does not take"
    try:
        seed = fresh_seed()
        torch.manual_seed(seed)
        q, k, v = make_qkv(2, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, getattr(torch, dtype), layout)
        label = f"tma pad-up {dtype} d{head_dim} causal={causal} {seqlen_q}x{seqlen_k} h{nheads}/{nheads_kv} {layout}"
        run_and_check(cuflash, q, k, v, causal=causal, seed=seed, label=label)
        short = "bf16" if dtype == "bfloat16" else "f16"
        mappable = all(t.stride(-1) == 1 and all(s > 0 and s % 8 == 0 for s in t.stride()[:3]) for t in (k, v))
        assert all(n.startswith(f"fwd90_{short}_d64_") and n.endswith("_tma") for n in names), (label, names)
        if mappable:
            assert names, label
    finally:
        _plan.CACHE.clear()
