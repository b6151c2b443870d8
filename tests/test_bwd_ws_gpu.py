"""The warp-specialized sm_90a backward (cuda_src/flash_bwd_sm90_ws.cu, CUFLASH_BWD_WS=1): a TMA
producer warp, two consumer warpgroups, dQ added in a permuted scratch layout that the conversion
kernel undoes, from the consumers' registers by vector reductions (the default) or through shared
memory by bulk reductions (CUFLASH_BWD_DQ_RED=0). Checked as the default backward is (tests/test_gpu_backward.py's
run_backward_and_check: float64 reference gradients, 2x the naive error, NaN-poisoned allocators,
inputs untouched) over both dtypes, head_dim 64 and 128, causal or not, lengths that are and are not
multiples of the 64 x 128 tiles (rows past the tensors come as the maps' zeros), rows that see no
key, query blocks that see no key block, GQA and MQA, strided layouts, with the default tiles
(BLOCK_M 128 at head_dim 64, 64 at 128; 2 stages) and the tuning ones (CUFLASH_BWD_WS_BLOCK_M=64,
CUFLASH_BWD_WS_STAGES=3, at both BLOCK_M with dQ from registers), and on a persistent grid
(CUFLASH_BWD_WS_PERSISTENT=1: blocks walk several tiles, so K / V reloads and the ring's phases cross
tiles). The launched kernel's name is
checked, so a fallback cannot pass for it; deterministic calls must not take it. Head_dim 256 has
its own kernel (cuda_src/flash_bwd_sm90_ws256.cu), the default there, checked the same way over
CASES_256 (one block per tile and persistent). Marked gpu; skipped below sm_90."""

import pytest

from test_fwd_tma_gpu import record_tma_launches
from test_gpu_backward import make_dout, run_backward_and_check
from test_gpu_forward import fresh_seed, make_qkv

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu

CASES = [  # dtype, head_dim, causal, seqlen_q, seqlen_k, nheads, nheads_kv, layout
    ("bfloat16", 128, False, 1024, 1024, 4, 4, "bshd"),
    ("float16", 128, True, 1000, 1000, 4, 2, "bshd"),
    ("bfloat16", 64, True, 513, 777, 8, 2, "bhsd"),
    ("float16", 64, False, 200, 130, 4, 1, "padded"),
    ("bfloat16", 128, True, 700, 300, 4, 1, "bshd"),    # bottom-right causal: rows with no key
    ("float16", 128, True, 300, 700, 4, 4, "bshd"),     # key blocks no query sees (dK = dV = 0)
    ("float16", 64, False, 1, 4097, 2, 2, "bshd"),
    ("bfloat16", 128, False, 2048, 64, 2, 2, "mixed"),  # many query blocks per key block
    ("bfloat16", 64, False, 2048, 2048, 2, 2, "bshd"),     # the stage ring wraps 16 times
    # 96 (batch, kv head)s of 2 key blocks: tile groups of ceil(SMs / 2) heads, the last one smaller.
    ("bfloat16", 64, True, 100, 200, 48, 48, "bshd"),
]
# More tiles (batch x kv heads x key blocks = 256) than an H100 has SMs: a persistent block walks
# several. Run with the persistent grid only.
MANY_TILES = [
    ("float16", 128, True, 1024, 4096, 8, 4, "bshd"),
    ("bfloat16", 64, False, 300, 8192, 4, 2, "bhsd"),
]


@pytest.mark.parametrize("dtype,head_dim,causal,seqlen_q,seqlen_k,nheads,nheads_kv,layout", CASES + MANY_TILES)
@pytest.mark.parametrize("det", [False, True])
@pytest.mark.parametrize("stages,block_m,persistent,dq_red", [("2", None, None, None), ("3", "64", None, None),
                                                              ("2", "64", None, None), ("2", None, "1", None),
                                                              ("3", None, None, None), ("2", None, None, "0"),
                                                              ("2", None, "1", "0")])
def test_ws_backward(monkeypatch, dtype, head_dim, causal, seqlen_q, seqlen_k, nheads, nheads_kv, layout, det, stages,
                     block_m, persistent, dq_red):
    """dq_red None: the default, dQ added from the consumers' registers (red.global.add.v4.f32);
    "0": through sdQ and a bulk reduction per consumer (CUFLASH_BWD_DQ_RED=0), which leaves no room
    for 3 stages."""
    import cuflash
    from cuflash import _plan

    if head_dim == 128 and block_m == "64" and stages == "2":
        pytest.skip("the default at head_dim 128")
    if (dtype, head_dim, causal, seqlen_q, seqlen_k, nheads, nheads_kv, layout) in MANY_TILES and not persistent:
        pytest.skip("the many-tile shapes check the persistent grid")
    names = record_tma_launches(monkeypatch, CUFLASH_BWD_SINGLE="0", CUFLASH_BWD_WS="1", CUFLASH_BWD_WS_STAGES=stages,
                                CUFLASH_BWD_WS_BLOCK_M=block_m, CUFLASH_BWD_WS_PERSISTENT=persistent,
                                CUFLASH_BWD_DQ_RED=dq_red)
    try:
        seed = fresh_seed()
        torch.manual_seed(seed)
        tdt = getattr(torch, dtype)
        q, k, v = make_qkv(2, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, tdt, layout)
        dout = make_dout(2, seqlen_q, nheads, head_dim, tdt, layout)
        label = (f"bwd ws {dtype} d{head_dim} causal={causal} {seqlen_q}x{seqlen_k} h{nheads}/{nheads_kv} "
                 f"{layout} deterministic={det}")
        n0 = len(names)
        run_backward_and_check(cuflash, q, k, v, dout, causal=causal, deterministic=det, seed=seed, label=label)
        ws = [n for n in names[n0:] if n.startswith("bwd90ws_")]
        assert not (det and ws), (label, names[n0:])
        m = block_m or ("128" if head_dim == 64 else "64")
        assert all(f"_m{m}_s{stages}_" in n and n.endswith("_red_tma") == (dq_red != "0") for n in ws), (label, ws)
        # Layouts a tensor map can describe (else the plan's contiguous copies may still qualify).
        mappable = all(t.stride(-1) == 1 and all(s > 0 and s % 8 == 0 for s in t.stride()[:3])
                       for t in (q, k, v, dout))
        if mappable and not det:
            assert ws, (label, names[n0:])
    finally:
        _plan.CACHE.clear()


@pytest.mark.parametrize("how", ["thread", "autograd"])
def test_backward_planned_on_a_thread_without_context(monkeypatch, how):
    """A backward's plan is made where its first call arrives; under autograd that is the engine's
    own thread, which may have no current CUDA context. There the driver refused every tensor map
    (CUresult 201) and the refusal was remembered as the layout's, so the process's backwards ran
    the cp.async kernels. A plan made on a fresh thread (or through autograd) with no layout learned
    yet must take the warp-specialized kernel, and compute the right gradients."""
    import threading

    import cuflash
    from cuflash import _tma

    names = record_tma_launches(monkeypatch, CUFLASH_BWD_SINGLE="0", CUFLASH_BWD_WS=None, CUFLASH_FWD_TMA=None)
    monkeypatch.setattr(_tma, "_patches", {})  # nothing learned on the main thread yet
    seed = fresh_seed()
    torch.manual_seed(seed)
    q, k, v = make_qkv(2, 1000, 1000, 4, 2, 128, torch.bfloat16, "bshd")
    dout = make_dout(2, 1000, 4, 128, torch.bfloat16)
    if how == "thread":
        out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
        got = []
        t = threading.Thread(target=lambda: got.append(cuflash.attention_backward(dout, q, k, v, out, lse, causal=True)))
        t.start()
        t.join()
        grads = got[0]
    else:
        qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
        grads = torch.autograd.grad(cuflash.attention(qq, kk, vv, causal=True), (qq, kk, vv), dout)
    assert names and all(n.startswith("bwd90ws_") for n in names if n.startswith("bwd")), (how, names)
    assert any(n.startswith("bwd90ws_") for n in names), (how, names)
    # The same gradients as the main thread's call (the same kernels; dQ's atomics aside), whose
    # accuracy the CASES tests check against the float64 reference.
    out2, lse2 = cuflash.attention(q, k, v, causal=True, return_lse=True)
    ref = cuflash.attention_backward(dout, q, k, v, out2, lse2, causal=True)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref):
        assert torch.isfinite(g).all() and torch.allclose(g.float(), r.float(), atol=1e-2, rtol=1e-2), (how, name, seed)


# Head_dim 256 (cuda_src/flash_bwd_sm90_ws256.cu): 64 x 64 tiles, the consumers split head_dim for dK,
# dV and dQ and the queries for S and dP; dQ by vector reductions. The default there (no setting).
CASES_256 = [  # dtype, causal, seqlen_q, seqlen_k, nheads, nheads_kv, layout
    ("bfloat16", False, 1024, 1024, 4, 4, "bshd"),
    ("float16", True, 1000, 1000, 4, 2, "bshd"),
    ("bfloat16", True, 513, 777, 4, 2, "bhsd"),
    ("float16", False, 200, 130, 4, 1, "padded"),
    ("bfloat16", True, 700, 300, 2, 1, "bshd"),    # bottom-right causal: rows with no key
    ("float16", True, 300, 700, 2, 2, "bshd"),     # key blocks no query sees (dK = dV = 0)
    ("float16", False, 1, 4097, 2, 2, "bshd"),
    ("bfloat16", False, 2048, 64, 2, 2, "mixed"),  # many query blocks per key block
    ("float16", True, 1024, 4096, 4, 2, "bshd"),   # 256 tiles: a persistent block walks several
]


@pytest.mark.parametrize("dtype,causal,seqlen_q,seqlen_k,nheads,nheads_kv,layout", CASES_256)
@pytest.mark.parametrize("det", [False, True])
@pytest.mark.parametrize("persistent", [None, "1"])
def test_ws256_backward(monkeypatch, dtype, causal, seqlen_q, seqlen_k, nheads, nheads_kv, layout, det, persistent):
    import cuflash
    from cuflash import _plan

    if det and persistent:
        pytest.skip("deterministic calls do not take the kernel")
    names = record_tma_launches(monkeypatch, CUFLASH_BWD_SINGLE="0", CUFLASH_BWD_WS=None, CUFLASH_BWD_WS_PERSISTENT=persistent)
    try:
        seed = fresh_seed()
        torch.manual_seed(seed)
        tdt = getattr(torch, dtype)
        q, k, v = make_qkv(2, seqlen_q, seqlen_k, nheads, nheads_kv, 256, tdt, layout)
        dout = make_dout(2, seqlen_q, nheads, 256, tdt, layout)
        label = (f"bwd ws256 {dtype} causal={causal} {seqlen_q}x{seqlen_k} h{nheads}/{nheads_kv} {layout} "
                 f"deterministic={det} persistent={persistent}")
        n0 = len(names)
        run_backward_and_check(cuflash, q, k, v, dout, causal=causal, deterministic=det, seed=seed, label=label)
        ws = [n for n in names[n0:] if n.startswith("bwd90ws_")]
        assert not (det and ws), (label, names[n0:])
        assert all("_d256_m64_s2_" in n for n in ws), (label, ws)
        mappable = all(t.stride(-1) == 1 and all(s > 0 and s % 8 == 0 for s in t.stride()[:3])
                       for t in (q, k, v, dout))
        if mappable and not det:
            assert ws, (label, names[n0:])
    finally:
        _plan.CACHE.clear()


# Head_dim pad-up (cuflash/_config.py bwd_pad_head_dim): other head dims from 32 run the kernel of the
# next supported head_dim through maps whose columns past head_dim read as zeros, and write only their
# own columns (dq, dk and dv are NaN-poisoned by run_backward_and_check, so a write past them or a
# column left unwritten shows).
CASES_PAD = [  # dtype, head_dim, causal, seqlen_q, seqlen_k, nheads, nheads_kv, layout
    ("bfloat16", 40, False, 1000, 1000, 4, 2, "bshd"),
    ("float16", 32, True, 513, 777, 4, 4, "bhsd"),
    ("float16", 96, True, 1000, 1000, 4, 1, "bshd"),
    ("bfloat16", 72, False, 200, 130, 4, 2, "padded"),
    ("bfloat16", 120, True, 700, 300, 2, 1, "bshd"),
    ("float16", 136, False, 300, 700, 2, 2, "mixed"),
    ("bfloat16", 200, True, 1024, 1024, 4, 2, "bshd"),
    ("float16", 248, False, 1, 4097, 2, 2, "bshd"),
]


@pytest.mark.parametrize("dtype,head_dim,causal,seqlen_q,seqlen_k,nheads,nheads_kv,layout", CASES_PAD)
def test_padded_head_dim_backward(monkeypatch, dtype, head_dim, causal, seqlen_q, seqlen_k, nheads, nheads_kv, layout):
    import cuflash
    from cuflash import _config, _plan

    names = record_tma_launches(monkeypatch, CUFLASH_BWD_SINGLE="0", CUFLASH_BWD_WS=None, CUFLASH_BWD_PAD=None)
    try:
        seed = fresh_seed()
        torch.manual_seed(seed)
        tdt = getattr(torch, dtype)
        q, k, v = make_qkv(2, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, tdt, layout)
        dout = make_dout(2, seqlen_q, nheads, head_dim, tdt, layout)
        label = f"bwd pad-up {dtype} d{head_dim} causal={causal} {seqlen_q}x{seqlen_k} h{nheads}/{nheads_kv} {layout}"
        n0 = len(names)
        run_backward_and_check(cuflash, q, k, v, dout, causal=causal, deterministic=False, seed=seed, label=label)
        ws = [n for n in names[n0:] if n.startswith("bwd90ws_")]
        pad = _config.bwd_pad_head_dim("sm_90a", head_dim)
        assert pad is not None and all(f"_d{pad}_" in n for n in ws), (label, ws)
        mappable = all(t.stride(-1) == 1 and all(s > 0 and s % 8 == 0 for s in t.stride()[:3])
                       for t in (q, k, v, dout))
        if mappable:
            assert ws, (label, names[n0:])
    finally:
        _plan.CACHE.clear()
