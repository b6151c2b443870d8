"""The causal block orders (cuda_src/blocks.cuh). Forward (causal_block_order, FwdParams.tail_heads):
the grid's first (batch, head)s run head by head, its last tail_heads query block by query block
across those heads. Every forward kernel that reads tail_heads (the warp-specialized kernel with two
or three consumers, flash_fwd_sm90.cu's TMA and cp.async variants, flash_fwd.cu) runs causal calls
with the tail forced to a few blocks (CUFLASH_FWD_TAIL_BLOCKS), so that both parts of the grid and a
last group that is not a whole number of query blocks occur, and with the tail off (0) and over the
whole grid. Backward (key_block_grouped, BwdTmaParams.tail_heads): the warp-specialized kernels'
groups of tile_heads (batch, kv head)s, then a tail group of its own size, at several sizes
(CUFLASH_BWD_TAIL_WAVES), on a grid of several groups. Checked as every call is (tests/test_gpu_forward.py's
run_and_check, tests/test_gpu_backward.py's run_backward_and_check: float64 reference, 2x the naive
error, NaN-poisoned outputs, so a block that ran twice while another never ran leaves NaN). The
launched kernel's name and the Params' tail are checked, so a fallback cannot pass for the kernel
meant."""

import pytest

from test_gpu_backward import make_dout, run_backward_and_check
from test_gpu_forward import fresh_seed, make_qkv, run_and_check

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu

def record_params(monkeypatch, params_dtype, fields, prefix):
    """Clears the plan cache; returns the list that collects (name, grid, *fields as int32 at the
    offsets of params_dtype) of every launch fired from now on whose kernel name starts with prefix
    (Launch.fire: TmaLaunch.fire ends in it)."""
    from cuflash import _launch, _plan

    fired = []
    real = _launch.Launch.fire
    at = _launch._offsets(params_dtype)

    def fire(self, stream, ptrs, pdl=True):
        if self.name.startswith(prefix):
            fired.append((self.name, int(self.grid), *(int(self.ints[at[f] // 4]) for f in fields)))
        return real(self, stream, ptrs, pdl)

    monkeypatch.setattr(_launch.Launch, "fire", fire)
    _plan.CACHE.clear()
    return fired


# name, env, dtype, head_dim, seqlen_q, seqlen_k, nheads, nheads_kv, layout, kernel name prefix (a
# trailing "$": the name ends with the rest, ragged or even; "^": it does not end in "_tma")
CASES = [
    # (a block per query block: causal calls up to 2048 keys take the persistent grid by default,
    # whose pairs of query blocks need no tail order)
    ("ws_pingpong", {"CUFLASH_FWD_WS_PERSISTENT": "0"}, "bfloat16", 128, 1000, 1000, 6, 2, "bshd",
     "fwd90ws_bf16_d128_"),
    ("ws_three", {}, "float16", 64, 4200, 4200, 3, 3, "bshd", "fwd90ws_f16_d64_m192_"),
    ("ws_d256", {}, "bfloat16", 256, 700, 900, 4, 1, "bhsd", "fwd90ws_bf16_d256_"),
    ("tma_variant", {}, "float16", 64, 1100, 1100, 6, 3, "bshd", "fwd90_f16_d64_m64_n64_causal_ragged_tma$"),
    ("cp_async_sm90", {"CUFLASH_FWD_TMA": "0", "CUFLASH_FWD_WS": "0"}, "bfloat16", 128, 900, 1300, 6, 6, "bshd",
     "fwd90_bf16_d128_m128_n128_causal_^"),
    ("mma_sync", {}, "float16", 24, 1000, 1000, 6, 2, "bshd", "fwd_f16_d24_"),
    # head_dim 48 on the TMA variant of 64 (cuflash/_config.py fwd_pad_tma)
    ("tma_padded", {}, "bfloat16", 48, 1000, 1000, 6, 2, "bshd", "fwd90_bf16_d64_m64_n64_causal_ragged_tma$"),
]


@pytest.mark.parametrize("tail", ["1", "37", "0", "100000"])
@pytest.mark.parametrize("name,env,dtype,head_dim,seqlen_q,seqlen_k,nheads,nheads_kv,layout,prefix", CASES,
                         ids=[c[0] for c in CASES])
def test_causal_block_order(monkeypatch, tail, name, env, dtype, head_dim, seqlen_q, seqlen_k, nheads, nheads_kv,
                            layout, prefix):
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the case list names sm_90a's kernels")
    import cuflash
    from cuflash import _launch, _plan

    for var in ("CUFLASH_FWD_TMA", "CUFLASH_FWD_WS", "CUFLASH_FWD_WS_PERSISTENT", "CUFLASH_FWD_WS_CONSUMERS",
                "CUFLASH_FWD_WS_PINGPONG"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    monkeypatch.setenv("CUFLASH_FWD_TAIL_BLOCKS", tail)
    # (FwdParams' fields sit at the same offsets in every forward's Params.)
    fwd = record_params(monkeypatch, _launch.FWD_PARAMS, ("tail_heads", "num_m_blocks"), "fwd")
    try:
        seed = fresh_seed()
        torch.manual_seed(seed)
        batch = 2
        q, k, v = make_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, getattr(torch, dtype), layout)
        label = f"block order tail={tail} {name} {dtype} d{head_dim} {seqlen_q}x{seqlen_k} h{nheads}/{nheads_kv} {layout}"
        run_and_check(cuflash, q, k, v, causal=True, seed=seed, label=label)
    finally:
        _plan.CACHE.clear()
    got = fwd[0][0] if len(fwd) == 1 else ""
    if prefix.endswith("$"):
        ok = got == prefix[:-1]
    elif prefix.endswith("^"):
        ok = got.startswith(prefix[:-1]) and not got.endswith("_tma")
    else:
        ok = got.startswith(prefix)
    assert ok and "causal" in got, (label, fwd)
    _, _, tail_heads, num_m = fwd[0]
    want = min(batch * nheads, -(-int(tail) // num_m)) if int(tail) > 0 else 0
    assert num_m > 1 and tail_heads == want, (label, fwd[0], want)


# dtype, head_dim, seqlen, nheads, nheads_kv, batch: with 128-key tiles, groups of ceil(SMs / key
# blocks) (batch, kv head)s, so several groups and a tail group on a 132-SM card
BWD_CASES = [
    ("bfloat16", 128, 1024, 8, 8, 8),    # 64 (batch, kv head)s of 8 key blocks: groups of 17
    ("float16", 64, 1000, 6, 3, 24),     # 72 of 8, GQA 2:1, the last key block ragged
    ("bfloat16", 256, 700, 4, 2, 20),    # the head_dim 256 kernel: 40 of 11 (64-key blocks)
]


@pytest.mark.parametrize("waves", ["0", "0.01", "2", "100"])
@pytest.mark.parametrize("dtype,head_dim,seqlen,nheads,nheads_kv,batch", BWD_CASES)
def test_causal_backward_tail_group(monkeypatch, waves, dtype, head_dim, seqlen, nheads, nheads_kv, batch):
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the warp-specialized backward is sm_90a's")
    import cuflash
    from cuflash import _launch, _plan

    for var in ("CUFLASH_BWD_WS", "CUFLASH_BWD_WS_PERSISTENT", "CUFLASH_BWD_WS_BLOCK_M", "CUFLASH_BWD_WS_STAGES"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("CUFLASH_BWD_TAIL_WAVES", waves)
    fired = record_params(monkeypatch, _launch.BWD_TMA_PARAMS, ("tile_heads", "tail_heads", "num_blocks"), "bwd90ws_")
    try:
        seed = fresh_seed()
        torch.manual_seed(seed)
        tdt = getattr(torch, dtype)
        q, k, v = make_qkv(batch, seqlen, seqlen, nheads, nheads_kv, head_dim, tdt, "bshd")
        dout = make_dout(batch, seqlen, nheads, head_dim, tdt, "bshd")
        label = f"bwd tail waves={waves} {dtype} d{head_dim} {seqlen} h{nheads}/{nheads_kv} b{batch}"
        run_backward_and_check(cuflash, q, k, v, dout, causal=True, deterministic=False, seed=seed, label=label)
    finally:
        _plan.CACHE.clear()
    assert len(fired) == 1, (label, fired)
    name, grid, group, tail, n_blocks = fired[0]
    bh = batch * nheads_kv
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    want = 0 if float(waves) <= 0 else min(bh, max(group, -(-int(float(waves) * sms) // n_blocks)))
    assert grid == bh * n_blocks and tail == want and group == min(bh, -(-sms // n_blocks)), (label, fired[0], want)
    if waves in ("0", "0.01", "2"):
        assert bh > group + max(tail, 1), ("the case should have groups before its tail", label, fired[0])


# Calls with options whose window is (left, 0) (causal included) take the same orders (the host
# sets tail_heads for them): feature, causal, dtype, head_dim, seqlen_q, seqlen_k, nheads, nheads_kv.
# A (padded) batch of 5: at head_dim 128, 12 kv heads make 60 (batch, kv head)s of 6 key blocks (700
# keys), so the backward's groups of 22 come before a tail group; at 256, 40 of 11 64-key blocks,
# groups of 12.
FEAT_CASES = [
    ("lens+win", False, "bfloat16", 128, 700, 700, 12, 12),       # window (32, 0), lengths
    ("softcap", True, "float16", 64, 700, 700, 8, 4),             # the backward keeps cp.async here
    ("alibi_h", True, "bfloat16", 256, 600, 700, 8, 8),
    ("win16_0_sinktok4", False, "float16", 128, 640, 700, 12, 12),
    ("sinklogits", True, "bfloat16", 128, 700, 700, 12, 12),
]


@pytest.mark.parametrize("tail", ["5", "0"])
@pytest.mark.parametrize("feature,causal,dtype,head_dim,seqlen_q,seqlen_k,nheads,nheads_kv", FEAT_CASES,
                         ids=[c[0] for c in FEAT_CASES])
def test_feature_calls_block_order(monkeypatch, tail, feature, causal, dtype, head_dim, seqlen_q, seqlen_k, nheads,
                                   nheads_kv):
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the warp-specialized kernels are sm_90a's")
    from test_gpu_features import FEATURES_BY_NAME, _import_cuflash, run_padded_case

    from cuflash import _launch

    cf = _import_cuflash()
    for var in ("CUFLASH_FWD_WS", "CUFLASH_BWD_WS", "CUFLASH_BWD_WS_FEAT", "CUFLASH_FWD_TAIL_WAVES"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("CUFLASH_FWD_TAIL_BLOCKS", tail)
    monkeypatch.setenv("CUFLASH_BWD_TAIL_WAVES", "0.01" if tail != "0" else "0")  # a tail group of one group
    bwd = record_params(monkeypatch, _launch.BWD_TMA_PARAMS, ("tile_heads", "tail_heads", "num_blocks"), "bwd90ws_")
    fwd = record_params(monkeypatch, _launch.FWD_PARAMS, ("tail_heads", "num_m_blocks"), "fwd")
    batch = 5
    label = f"block order tail={tail} {feature} causal={causal} {dtype} d{head_dim} {seqlen_q}x{seqlen_k} h{nheads}/{nheads_kv}"
    try:
        run_padded_case(cf, seed=fresh_seed(), dtype=dtype, batch=batch, sq=seqlen_q, sk=seqlen_k, h=nheads,
                        hkv=nheads_kv, d=head_dim, causal=causal, deterministic=False, fs=FEATURES_BY_NAME[feature],
                        label=label, backward=True)
    finally:
        from cuflash import _plan

        _plan.CACHE.clear()
    main = [f for f in fwd if "_feat" in f[0]]
    assert len(main) == 1, (label, fwd)
    _, _, tail_heads, num_m = main[0]
    assert num_m > 1 and tail_heads == (min(batch * nheads, -(-int(tail) // num_m)) if tail != "0" else 0), (label,
                                                                                                       main[0])
    if feature != "softcap":
        assert len(bwd) == 1 and "_feat" in bwd[0][0], (label, bwd)
        _, grid, group, tail_group, n_blocks = bwd[0]
        bh = batch * nheads_kv
        assert grid == bh * n_blocks and tail_group == (min(bh, group) if tail != "0" else 0), (label, bwd[0])
        assert tail == "0" or bh > group + tail_group, ("the case should have groups before its tail", label, bwd[0])
