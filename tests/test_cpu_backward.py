"""CPU tests of the NumPy FlashAttention-2 backward (cuflash._cpu_backward) and of the gradient references
(tests/_grad_reference.py).

No GPU needed. Every check draws fresh random inputs; the seed is printed in each failure message, and setting
CUFLASH_TEST_SEED=<seed> replays it (e.g. `CUFLASH_TEST_SEED=123 pytest tests/test_cpu_backward.py -k <test id>`).

Accuracy criterion: for each of dq, dk, dv, the max error against the float64 gradients is at most 3x the max
error of the naive computation in the input dtype (torch-autograd-style, see _grad_reference) plus 1e-4. out and
lse come from attention_forward_numpy, as users would call the backward.
"""

import math

import ml_dtypes
import numpy as np
import pytest

from _grad_reference import attention_grad_reference
from cuflash._cpu import attention_forward_numpy
from cuflash._cpu_backward import attention_backward_numpy
from cuflash._reference import attention_reference, check_close, max_abs_err
from _cpu_helpers import (DK_D_STAR_RMS_LIMIT, DQ_SPLIT_RMS_LIMIT, _batch_for, _ctx, _new_seed, _no_key_rows, _randn,
                          dq_split_rms_ratio, shared_component_values)

# Any numpy floating-point warning (divide by zero, invalid value, overflow) is a test failure.
pytestmark = pytest.mark.filterwarnings("error")

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [pytest.param(np.dtype(np.float16), id="fp16"), pytest.param(BF16, id="bf16")]
SEQLENS = [(1, 1), (1, 300), (113, 203), (300, 77), (128, 128)]
HEAD_DIMS = [8, 40, 64, 136]
# (nheads, nheads_kv): MHA, GQA, MQA
HEADS = [pytest.param((4, 4), id="mha"), pytest.param((6, 2), id="gqa"), pytest.param((3, 1), id="mqa")]

FACTOR = 3.0
FLOOR = 1e-4





def _make_inputs(rng, dtype, batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, qk_scale=1.0):
    """q, k, v, dout: random normal (q and k times qk_scale)."""
    q = _randn(rng, (batch, seqlen_q, nheads, head_dim), dtype, qk_scale)
    k = _randn(rng, (batch, seqlen_k, nheads_kv, head_dim), dtype, qk_scale)
    v = _randn(rng, (batch, seqlen_k, nheads_kv, head_dim), dtype)
    dout = _randn(rng, (batch, seqlen_q, nheads, head_dim), dtype)
    return q, k, v, dout




def _forward_backward(q, k, v, dout, causal, softmax_scale, block_m, block_n):
    out, lse = attention_forward_numpy(q, k, v, causal, softmax_scale, block_m=block_m, block_n=block_n)
    return attention_backward_numpy(dout, q, k, v, out, lse, causal, softmax_scale, block_m=block_m, block_n=block_n)


def _check_backward(q, k, v, dout, causal, softmax_scale, block_m, block_n, ctx):
    """Run forward + backward and check the gradients against the references; returns (dq, dk, dv)."""
    seqlen_q, head_dim = q.shape[1], q.shape[3]
    seqlen_k = k.shape[1]
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_dim)
    inputs = (q, k, v, dout)
    copies = [x.copy() for x in inputs]

    grads = _forward_backward(q, k, v, dout, causal, softmax_scale, block_m, block_n)

    # Output contract: shapes and dtypes of q, k, v; C-contiguous; inputs untouched.
    assert len(grads) == 3, ctx
    for name, g, x in zip(("dq", "dk", "dv"), grads, (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype and g.flags.c_contiguous, f"{name}; {ctx}"
        assert np.isfinite(g.astype(np.float32)).all(), f"non-finite {name}; {ctx}"
    for x, x0 in zip(inputs, copies):
        assert np.array_equal(x.astype(np.float32), x0.astype(np.float32)), f"input modified; {ctx}"

    # Accuracy: no worse than FACTOR x the naive input-dtype gradients (+FLOOR), both against float64.
    refs = attention_grad_reference(dout, q, k, v, causal, softmax_scale)
    naives = attention_grad_reference(dout, q, k, v, causal, softmax_scale, compute_dtype="input")
    for name, g, ref, naive in zip(("dq", "dk", "dv"), grads, refs, naives):
        ok, msg = check_close(g, ref, naive, factor=FACTOR, floor=FLOOR)
        assert ok, f"{name}: {msg}; {ctx}"

    # Rows that see no key contribute nothing: their dq rows are exactly 0.
    empty = _no_key_rows(seqlen_q, seqlen_k, causal)
    assert (grads[0].astype(np.float32)[:, empty] == 0).all(), f"dq rows without key must be 0; {ctx}"
    return grads


# --------------------------------------------------------------------------------------------------------------
# attention_backward_numpy


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("seqlens", SEQLENS, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_matches_reference(dtype, causal, seqlens, head_dim, heads):
    seed = _new_seed()
    rng = np.random.default_rng(seed)
    seqlen_q, seqlen_k = seqlens
    nheads, nheads_kv = heads
    q, k, v, dout = _make_inputs(rng, dtype, _batch_for(seqlen_q), seqlen_q, seqlen_k, nheads, nheads_kv, head_dim)
    ctx = _ctx(seed, dtype=dtype.name, causal=causal, seqlens=seqlens, head_dim=head_dim, heads=heads)
    _check_backward(q, k, v, dout, causal, None, 64, 64, ctx)


@pytest.mark.parametrize("blocks", [(16, 32), (32, 16), (24, 40)], ids=lambda b: f"bm{b[0]}-bn{b[1]}")
@pytest.mark.parametrize("seqlens", [(1, 300), (113, 203), (300, 77), (128, 128)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_block_sizes(dtype, causal, seqlens, blocks):
    """Many query and key tiles, partial last tiles, diagonal tiles at odd offsets, skipped query tiles."""
    seed = _new_seed()
    rng = np.random.default_rng(seed)
    seqlen_q, seqlen_k = seqlens
    block_m, block_n = blocks
    q, k, v, dout = _make_inputs(rng, dtype, _batch_for(seqlen_q), seqlen_q, seqlen_k, 6, 2, 40)
    ctx = _ctx(seed, dtype=dtype.name, causal=causal, seqlens=seqlens, blocks=blocks)
    _check_backward(q, k, v, dout, causal, None, block_m, block_n, ctx)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_strided_inputs(dtype, causal):
    """Non-contiguous dout, q, k, v, out give bit-identical gradients to their contiguous copies."""
    seed = _new_seed()
    rng = np.random.default_rng(seed)
    batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim = 2, 113, 203, 6, 3, 64
    # dout and q built as (b, h, s, d) and viewed as (b, s, h, d); k every other element of a wider last axis;
    # v reversed along the sequence (negative stride).
    q = _randn(rng, (batch, nheads, seqlen_q, head_dim), dtype).transpose(0, 2, 1, 3)
    dout = _randn(rng, (batch, nheads, seqlen_q, head_dim), dtype).transpose(0, 2, 1, 3)
    k = _randn(rng, (batch, seqlen_k, nheads_kv, 2 * head_dim), dtype)[..., ::2]
    v = _randn(rng, (batch, seqlen_k, nheads_kv, head_dim), dtype)[:, ::-1]
    assert not any(x.flags.c_contiguous for x in (q, dout, k, v))
    scale = 1.0 / math.sqrt(head_dim)
    ctx = _ctx(seed, dtype=dtype.name, causal=causal)
    grads = _check_backward(q, k, v, dout, causal, scale, 32, 64, ctx)

    qc, kc, vc, doc = (np.ascontiguousarray(x) for x in (q, k, v, dout))
    out, lse = attention_forward_numpy(qc, kc, vc, causal, scale, 32, 64)
    grads_c = attention_backward_numpy(doc, qc, kc, vc, out, lse, causal, scale, 32, 64)
    # out itself as a strided view too (a copy laid out heads-first).
    out_t = np.ascontiguousarray(out.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    grads_t = attention_backward_numpy(dout, q, k, v, out_t, lse, causal, scale, 32, 64)
    for name, a, b, c in zip(("dq", "dk", "dv"), grads, grads_c, grads_t):
        assert np.array_equal(a.astype(np.float32), b.astype(np.float32)), f"{name}; {ctx}"
        assert np.array_equal(a.astype(np.float32), c.astype(np.float32)), f"{name} (strided out); {ctx}"


@pytest.mark.parametrize("softmax_scale", [0.05, 0.5])
@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_explicit_scale(dtype, softmax_scale):
    seed = _new_seed()
    rng = np.random.default_rng(seed)
    q, k, v, dout = _make_inputs(rng, dtype, 2, 70, 90, 4, 2, 32)
    ctx = _ctx(seed, dtype=dtype.name, softmax_scale=softmax_scale)
    for causal in (False, True):
        _check_backward(q, k, v, dout, causal, softmax_scale, 32, 32, ctx + f" causal={causal}")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_large_scores(dtype, causal):
    """q and k scaled by 30: scores in the thousands, softmax nearly one-hot; still finite and accurate."""
    seed = _new_seed()
    rng = np.random.default_rng(seed)
    q, k, v, dout = _make_inputs(rng, dtype, 2, 113, 203, 4, 2, 64, qk_scale=30.0)
    ctx = _ctx(seed, dtype=dtype.name, causal=causal, qk_scale=30)
    _check_backward(q, k, v, dout, causal, None, 32, 32, ctx)


@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_rows_without_keys(dtype):
    """seqlen_q > seqlen_k, causal: the first seqlen_q - seqlen_k rows see no key, including whole query tiles."""
    seed = _new_seed()
    rng = np.random.default_rng(seed)
    seqlen_q, seqlen_k = 100, 10
    q, k, v, dout = _make_inputs(rng, dtype, 2, seqlen_q, seqlen_k, 2, 1, 16)
    ctx = _ctx(seed, dtype=dtype.name)
    with np.errstate(divide="raise", invalid="raise", over="raise"):
        dq, dk, dv = _check_backward(q, k, v, dout, True, None, 16, 16, ctx)
        _, lse = attention_forward_numpy(q, k, v, True, 0.25, 16, 16)
        assert (lse[:, :, :90] == -np.inf).all(), ctx
        ref = attention_grad_reference(dout, q, k, v, True, 0.25)
        naive = attention_grad_reference(dout, q, k, v, True, 0.25, compute_dtype="input")
    assert (dq.astype(np.float32)[:, :90] == 0).all(), ctx
    for grads in ((dq, dk, dv), ref, naive):
        assert not any(np.isnan(g.astype(np.float64)).any() for g in grads), ctx
        assert (grads[0].astype(np.float64)[:, :90] == 0).all(), ctx
    # Key 0 is seen by rows 90..99, key 9 only by row 99: dv[:, 9] = sum over the heads of P[99, 9] dout[99].
    assert np.abs(dv.astype(np.float32)[:, 9]).max() > 0, ctx

    # The rows without key really contribute nothing: changing their q and dout changes no gradient.
    q2, dout2 = q.copy(), dout.copy()
    q2[:, :90] = _randn(rng, q2[:, :90].shape, dtype)
    dout2[:, :90] = _randn(rng, dout2[:, :90].shape, dtype)
    dq2, dk2, dv2 = _forward_backward(q2, k, v, dout2, True, 0.25, 16, 16)
    for a, b in ((dq, dq2), (dk, dk2), (dv, dv2)):
        assert np.array_equal(a.astype(np.float32), b.astype(np.float32)), ctx


def _single_tile_emulation(dout, q, k, v, out, lse, softmax_scale, round_p, round_ds):
    """The module's algorithm for one query tile and one key tile (non-causal, MHA), rounding optional."""
    dtype = q.dtype
    qf, kf, vf, dof, of = (x.transpose(0, 2, 1, 3).astype(np.float32) for x in (q, k, v, dout, out))
    s = qf @ kf.swapaxes(-1, -2)
    p = np.exp2(s * np.float32(softmax_scale * math.log2(math.e)) - (lse * np.float32(math.log2(math.e)))[..., None])
    dp = dof @ vf.swapaxes(-1, -2)
    ds = p * (dp - (dof * of).sum(axis=-1)[..., None])
    if round_p:
        p = p.astype(dtype).astype(np.float32)
    if round_ds:
        ds = ds.astype(dtype).astype(np.float32)
    scale = np.float32(softmax_scale)
    dq = (ds @ kf) * scale
    dk = (ds.swapaxes(-1, -2) @ qf) * scale
    dv = p.swapaxes(-1, -2) @ dof
    return [x.astype(dtype).transpose(0, 2, 1, 3).astype(np.float32) for x in (dq, dk, dv)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_p_and_ds_rounded_to_input_dtype(dtype):
    """P (for dV) and dS (for dK and dQ) are rounded to the input dtype, as the GPU kernel's 16-bit MMAs do.

    With one query tile and one key tile there is no accumulation across tiles, so the gradients must agree
    with an emulation that rounds P and dS on (nearly) every element, and visibly disagree with one that does not.
    """
    seed = _new_seed()
    rng = np.random.default_rng(seed)
    q, k, v, dout = _make_inputs(rng, dtype, 2, 64, 96, 4, 4, 64)
    scale = 1.0 / 8.0
    out, lse = attention_forward_numpy(q, k, v, False, scale, block_m=64, block_n=128)
    grads = [g.astype(np.float32) for g in
             attention_backward_numpy(dout, q, k, v, out, lse, False, scale, block_m=64, block_n=128)]
    rounded = _single_tile_emulation(dout, q, k, v, out, lse, scale, True, True)
    unrounded = _single_tile_emulation(dout, q, k, v, out, lse, scale, False, False)
    for name, g, r, u in zip(("dq", "dk", "dv"), grads, rounded, unrounded):
        miss_rounded = np.mean(g != r)
        miss_unrounded = np.mean(g != u)
        ctx = _ctx(seed, dtype=dtype.name, grad=name, miss_rounded=miss_rounded, miss_unrounded=miss_unrounded)
        assert miss_rounded < 0.01, ctx
        assert miss_unrounded > 0.05, ctx


@pytest.mark.parametrize("key_offset", [0.0, 2.0], ids=["k", "k+2"])
@pytest.mark.parametrize("seqlens", [(1, 300), (64, 1024)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("head_dim", [8, 16, 24])
@pytest.mark.parametrize("dtype", DTYPES)
def test_dq_small_head_dim_exact(dtype, head_dim, seqlens, key_offset):
    """Below head_dim 32 dQ takes dS as hi + lo and corrects D (DS_SPLIT_BELOW), so dq's error is close to the
    rounding of the exact dq alone (DQ_SPLIT_RMS_LIMIT); with dS rounded once it is about 1.5x that, and with keys
    that share a component (k + 2) the split without D's correction is 2.5-3x. GQA 4:1, full attention."""
    seed = _new_seed()
    rng = np.random.default_rng(seed)
    sq, sk = seqlens
    batch = _batch_for(sq)
    dqs, refs = [], []
    for _ in range(2 if sq == 1 else 4):
        q, k, v, dout = _make_inputs(rng, dtype, batch, sq, sk, 4, 1, head_dim)
        k = (k.astype(np.float32) + key_offset).astype(dtype)
        scale = 1.0 / math.sqrt(head_dim)
        dqs.append(_forward_backward(q, k, v, dout, False, scale, 64, 128)[0])
        refs.append(attention_grad_reference(dout, q, k, v, False, scale)[0])
    ratio = dq_split_rms_ratio(np.concatenate(dqs), np.concatenate(refs), dtype)
    assert ratio <= DQ_SPLIT_RMS_LIMIT, _ctx(seed, dtype=dtype.name, head_dim=head_dim, seqlens=seqlens,
                                             key_offset=key_offset, ratio=ratio)


@pytest.mark.parametrize("seqlens", [(1, 300), (64, 1024)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("head_dim", [8, 16, 24])
@pytest.mark.parametrize("dtype", DTYPES)
def test_dk_small_head_dim_d_star(dtype, head_dim, seqlens):
    """Below head_dim 32 dK's dS takes D* = D + E from the dQ pass (DS_SPLIT_BELOW), not D from the stored (rounded)
    O: with values that share a component (dP_j close to D for every key, so D's error is large beside dS), dk's RMS
    error is at most DK_D_STAR_RMS_LIMIT times the rounding of the exact dk (with D from the rounded O 38-64x).
    GQA 4:1, full attention; the usual gradient check too."""
    seed = _new_seed()
    rng = np.random.default_rng(seed)
    sq, sk = seqlens
    batch = _batch_for(sq)
    dks, refs = [], []
    for _ in range(2 if sq == 1 else 3):
        q, k, _v, dout = _make_inputs(rng, dtype, batch, sq, sk, 4, 1, head_dim)
        v = shared_component_values(rng, batch, sk, 1, head_dim).astype(dtype)
        scale = 1.0 / math.sqrt(head_dim)
        dk = _check_backward(q, k, v, dout, False, scale, 64, 128, _ctx(seed, dtype=dtype.name, head_dim=head_dim))[1]
        dks.append(dk)
        refs.append(attention_grad_reference(dout, q, k, v, False, scale)[1])
    ratio = dq_split_rms_ratio(np.concatenate(dks), np.concatenate(refs), dtype)
    assert ratio <= DK_D_STAR_RMS_LIMIT, _ctx(seed, dtype=dtype.name, head_dim=head_dim, seqlens=seqlens, ratio=ratio)


@pytest.mark.parametrize("dtype", DTYPES)
def test_tiling_does_not_change_result_much(dtype):
    """One big tile vs many small tiles: P and dS are elementwise, only the float32 summation order changes."""
    seed = _new_seed()
    rng = np.random.default_rng(seed)
    q, k, v, dout = _make_inputs(rng, dtype, 2, 150, 170, 6, 2, 32)
    ctx = _ctx(seed, dtype=dtype.name)
    ulp = 2.0 ** -7 if dtype == BF16 else 2.0 ** -10
    for causal in (False, True):
        big = _forward_backward(q, k, v, dout, causal, 0.2, 256, 256)
        small = _forward_backward(q, k, v, dout, causal, 0.2, 16, 16)
        for name, a, b in zip(("dq", "dk", "dv"), big, small):
            a, b = a.astype(np.float64), b.astype(np.float64)
            # The forward's out differs by up to an ulp between tilings, and D with it; beyond that only the
            # rounding of float32 sums can flip.
            assert max_abs_err(a, b) <= 4 * ulp * np.abs(a).max(), f"{name} causal={causal}; {ctx}"


# --------------------------------------------------------------------------------------------------------------
# The gradient references themselves.


def _loss(q, k, v, dout, causal, scale):
    out, _ = attention_reference(q, k, v, causal, scale)
    return float(np.sum(out * dout))


def _finite_difference_grads(q, k, v, dout, causal, scale, eps=1e-5):
    """Central differences of sum(attention(q, k, v) * dout) over every element of q, k, v (float64)."""
    grads = []
    for which in range(3):
        args = [q.copy(), k.copy(), v.copy()]
        x = args[which]
        g = np.zeros_like(x)
        for idx in np.ndindex(*x.shape):
            x0 = x[idx]
            x[idx] = x0 + eps
            up = _loss(*args, dout, causal, scale)
            x[idx] = x0 - eps
            down = _loss(*args, dout, causal, scale)
            x[idx] = x0
            g[idx] = (up - down) / (2 * eps)
        grads.append(g)
    return grads


@pytest.mark.parametrize("seqlens", [(3, 4), (4, 4), (5, 3), (1, 6)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_grad_reference_matches_finite_differences(causal, seqlens):
    """The float64 analytic gradients equal central finite differences of the float64 forward (GQA, 2 heads : 1)."""
    seed = _new_seed()
    rng = np.random.default_rng(seed)
    seqlen_q, seqlen_k = seqlens
    q, k, v, dout = _make_inputs(rng, np.float64, 1, seqlen_q, seqlen_k, 2, 1, 8)
    scale = 0.6
    ctx = _ctx(seed, causal=causal, seqlens=seqlens)
    analytic = attention_grad_reference(dout, q, k, v, causal, scale)
    numeric = _finite_difference_grads(q, k, v, dout, causal, scale)
    for name, a, n in zip(("dq", "dk", "dv"), analytic, numeric):
        assert a.dtype == np.float64 and a.shape == n.shape, f"{name}; {ctx}"
        rel = max_abs_err(a, n) / np.abs(n).max()
        assert rel < 1e-6, f"{name}: relative error {rel:.3g}; {ctx}"
    if causal and seqlen_q > seqlen_k:
        empty = _no_key_rows(seqlen_q, seqlen_k, causal)
        assert empty.any() and (analytic[0][:, empty] == 0).all(), ctx
        assert (numeric[0][:, empty] == 0).all(), ctx


@pytest.mark.parametrize("dtype", DTYPES)
def test_grad_reference_input_mode(dtype):
    """The 'input' emulation returns input-dtype gradients close to, but not exactly, the float64 ones."""
    seed = _new_seed()
    rng = np.random.default_rng(seed)
    q, k, v, dout = _make_inputs(rng, dtype, 1, 40, 50, 4, 2, 32)
    ctx = _ctx(seed, dtype=dtype.name)
    naive = attention_grad_reference(dout, q, k, v, True, compute_dtype="input")
    ref = attention_grad_reference(dout, q, k, v, True)
    tol = 0.03 if dtype == BF16 else 0.005  # relative to max |grad|; seen: ~8e-3 (bf16), ~1e-3 (fp16)
    for name, n, r, x in zip(("dq", "dk", "dv"), naive, ref, (q, k, v)):
        assert n.dtype == dtype and n.shape == x.shape, f"{name}; {ctx}"
        assert r.dtype == np.float64 and r.shape == x.shape, f"{name}; {ctx}"
        err = max_abs_err(n, r)
        assert 0 < err < tol * np.abs(r).max(), f"{name}: err={err:.3g}; {ctx}"
    with pytest.raises(ValueError):
        attention_grad_reference(dout, q, k, v, compute_dtype="float32")
