"""CPU tests of the NumPy FlashAttention-2 forward (cuflash._cpu) and of the naive references (cuflash._reference).

No GPU needed. Every check draws fresh random inputs; the seed is printed in each failure message, and setting
CUFLASH_TEST_SEED=<seed> replays it (e.g. `CUFLASH_TEST_SEED=123 pytest tests/test_cpu_numpy.py -k <test id>`).
"""

import itertools
import math

import ml_dtypes
import numpy as np
import pytest

from cuflash._cpu import attention_forward_numpy
from cuflash._reference import attention_reference, causal_mask, check_close, max_abs_err
from _cpu_helpers import _batch_for, _ctx, _new_seed, _no_key_rows, _randn

# Any numpy floating-point warning (divide by zero, invalid value, overflow) is a test failure.
pytestmark = pytest.mark.filterwarnings("error")

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [pytest.param(np.dtype(np.float16), id="fp16"), pytest.param(BF16, id="bf16")]
SEQLENS = [(1, 1), (1, 300), (113, 203), (300, 77), (128, 128)]
HEAD_DIMS = [8, 40, 64, 136]
# (nheads, nheads_kv): MHA, GQA, MQA
HEADS = [pytest.param((4, 4), id="mha"), pytest.param((6, 2), id="gqa"), pytest.param((3, 1), id="mqa")]

LSE_ATOL = 1e-4
LSE_RTOL = 1e-5




def _make_qkv(rng, dtype, batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, qk_scale=1.0):
    q = _randn(rng, (batch, seqlen_q, nheads, head_dim), dtype, qk_scale)
    k = _randn(rng, (batch, seqlen_k, nheads_kv, head_dim), dtype, qk_scale)
    v = _randn(rng, (batch, seqlen_k, nheads_kv, head_dim), dtype)
    return q, k, v




def _score_magnitude(q, k, softmax_scale):
    """(batch, nheads, seqlen_q): per row, max over keys of softmax_scale * sum_c |q_c| |k_c|."""
    group = q.shape[2] // k.shape[2]
    qa = np.abs(q.astype(np.float64)).transpose(0, 2, 1, 3)
    ka = np.repeat(np.abs(k.astype(np.float64)).transpose(0, 2, 1, 3), group, axis=1)
    if ka.shape[2] == 0:
        return np.zeros(qa.shape[:3])
    return softmax_scale * (qa @ ka.swapaxes(-1, -2)).max(axis=-1)


def _check_forward(q, k, v, causal, softmax_scale, block_m, block_n, ctx):
    """Run attention_forward_numpy and check it against the references; returns (out, lse, n_rows_without_key)."""
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k = k.shape[1]
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_dim)
    q0, k0, v0 = q.copy(), k.copy(), v.copy()

    out, lse = attention_forward_numpy(q, k, v, causal, softmax_scale, block_m=block_m, block_n=block_n)

    # Output contract.
    assert out.shape == q.shape and out.dtype == q.dtype and out.flags.c_contiguous, ctx
    assert lse.shape == (batch, nheads, seqlen_q) and lse.dtype == np.float32, ctx
    for x, x0 in ((q, q0), (k, k0), (v, v0)):
        assert np.array_equal(x.astype(np.float32), x0.astype(np.float32)), f"input modified; {ctx}"

    # Nothing is NaN; out is finite.
    out32 = out.astype(np.float32)
    assert np.isfinite(out32).all(), f"non-finite out; {ctx}"
    assert not np.isnan(lse).any(), f"NaN in lse; {ctx}"

    # Accuracy of out: no worse than 2x the naive input-dtype computation (+1e-5), both against float64.
    ref_out, ref_lse = attention_reference(q, k, v, causal, softmax_scale)
    naive_out, _ = attention_reference(q, k, v, causal, softmax_scale, compute_dtype="input")
    ok, msg = check_close(out, ref_out, naive_out)
    assert ok, f"out: {msg}; {ctx}"

    # lse: -inf exactly where the reference has -inf, float32 accuracy elsewhere. The float32 score of a row
    # carries rounding error relative to the size of its dot-product terms, scale * sum_c |q_c k_c|, which can
    # be much larger than the score itself (cancellation), so the relative part of the tolerance uses that.
    ref_neginf = np.isneginf(ref_lse)
    assert np.array_equal(np.isneginf(lse), ref_neginf), f"lse -inf pattern differs; {ctx}"
    finite = ~ref_neginf
    lse_err = np.abs(lse[finite].astype(np.float64) - ref_lse[finite])
    lse_tol = LSE_ATOL + LSE_RTOL * np.maximum(np.abs(ref_lse), _score_magnitude(q, k, softmax_scale))[finite]
    assert (lse_err <= lse_tol).all(), f"lse max err {lse_err.max() if lse_err.size else 0:.3g}; {ctx}"

    # Rows that see no key: out == 0 and lse == -inf exactly.
    empty = _no_key_rows(seqlen_q, seqlen_k, causal)
    assert (out32[:, empty] == 0).all(), f"rows without key must be 0; {ctx}"
    assert (lse[:, :, empty] == -np.inf).all(), f"rows without key must have lse -inf; {ctx}"
    assert np.isfinite(lse[:, :, ~empty]).all(), f"rows with keys must have finite lse; {ctx}"
    return out, lse, int(empty.sum())



@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("seqlens", SEQLENS, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_matches_reference(dtype, causal, seqlens, head_dim, heads):
    seed = _new_seed()
    rng = np.random.default_rng(seed)
    seqlen_q, seqlen_k = seqlens
    nheads, nheads_kv = heads
    q, k, v = _make_qkv(rng, dtype, _batch_for(seqlen_q), seqlen_q, seqlen_k, nheads, nheads_kv, head_dim)
    ctx = _ctx(seed, dtype=dtype.name, causal=causal, seqlens=seqlens, head_dim=head_dim, heads=heads)
    _, _, n_empty = _check_forward(q, k, v, causal, None, 64, 64, ctx)
    if causal and seqlen_q > seqlen_k:
        assert n_empty == seqlen_q - seqlen_k  # the case really has rows that see no key


@pytest.mark.parametrize("blocks", [(16, 32), (32, 16), (16, 16), (128, 64), (24, 40)],
                         ids=lambda b: f"bm{b[0]}-bn{b[1]}")
@pytest.mark.parametrize("seqlens", [(1, 300), (113, 203), (300, 77), (128, 128)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_block_sizes(dtype, causal, seqlens, blocks):
    """Several query and key tiles, partial last tiles, and diagonal tiles at odd offsets."""
    seed = _new_seed()
    rng = np.random.default_rng(seed)
    seqlen_q, seqlen_k = seqlens
    block_m, block_n = blocks
    q, k, v = _make_qkv(rng, dtype, _batch_for(seqlen_q), seqlen_q, seqlen_k, 6, 2, 40)
    ctx = _ctx(seed, dtype=dtype.name, causal=causal, seqlens=seqlens, blocks=blocks)
    _check_forward(q, k, v, causal, None, block_m, block_n, ctx)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_strided_inputs(dtype, causal):
    """Non-contiguous inputs give bit-identical results to their contiguous copies."""
    seed = _new_seed()
    rng = np.random.default_rng(seed)
    batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim = 2, 113, 203, 6, 3, 64
    # q built as (b, h, s, d) and viewed as (b, s, h, d); k and v every other element of a wider last axis;
    # v additionally reversed along the sequence (negative stride).
    q = _randn(rng, (batch, nheads, seqlen_q, head_dim), dtype).transpose(0, 2, 1, 3)
    k = _randn(rng, (batch, seqlen_k, nheads_kv, 2 * head_dim), dtype)[..., ::2]
    v = _randn(rng, (batch, seqlen_k, nheads_kv, head_dim), dtype)[:, ::-1]
    assert not (q.flags.c_contiguous or k.flags.c_contiguous or v.flags.c_contiguous)
    ctx = _ctx(seed, dtype=dtype.name, causal=causal)
    out, lse, _ = _check_forward(q, k, v, causal, None, 32, 64, ctx)
    out_c, lse_c = attention_forward_numpy(np.ascontiguousarray(q), np.ascontiguousarray(k),
                                           np.ascontiguousarray(v), causal, 1.0 / math.sqrt(head_dim), 32, 64)
    assert np.array_equal(out.astype(np.float32), out_c.astype(np.float32)), ctx
    assert np.array_equal(lse, lse_c), ctx


@pytest.mark.parametrize("softmax_scale", [0.05, 0.5])
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_explicit_scale(dtype, softmax_scale):
    seed = _new_seed()
    rng = np.random.default_rng(seed)
    q, k, v = _make_qkv(rng, dtype, 2, 70, 90, 4, 2, 32)
    ctx = _ctx(seed, dtype=dtype.name, softmax_scale=softmax_scale)
    for causal in (False, True):
        _check_forward(q, k, v, causal, softmax_scale, 32, 32, ctx + f" causal={causal}")


@pytest.mark.parametrize("seqlens", [(113, 203), (300, 77), (1, 300)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_large_scores_finite(dtype, causal, seqlens):
    """q and k scaled by 30: scores in the thousands, softmax nearly one-hot; still finite and accurate."""
    seed = _new_seed()
    rng = np.random.default_rng(seed)
    seqlen_q, seqlen_k = seqlens
    q, k, v = _make_qkv(rng, dtype, _batch_for(seqlen_q), seqlen_q, seqlen_k, 4, 2, 64, qk_scale=30.0)
    ctx = _ctx(seed, dtype=dtype.name, causal=causal, seqlens=seqlens, qk_scale=30)
    out, lse, _ = _check_forward(q, k, v, causal, None, 32, 32, ctx)
    assert np.abs(lse[np.isfinite(lse)]).max() > 100  # the scores really are large


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_without_keys(dtype):
    """seqlen_q > seqlen_k, causal: the first seqlen_q - seqlen_k rows see no key, including whole query tiles."""
    seed = _new_seed()
    rng = np.random.default_rng(seed)
    seqlen_q, seqlen_k = 100, 10
    q, k, v = _make_qkv(rng, dtype, 2, seqlen_q, seqlen_k, 2, 1, 16)
    ctx = _ctx(seed, dtype=dtype.name)
    with np.errstate(divide="raise", invalid="raise", over="raise"):
        out, lse, n_empty = _check_forward(q, k, v, True, None, 16, 16, ctx)
        ref_out, ref_lse = attention_reference(q, k, v, True)
        naive_out, naive_lse = attention_reference(q, k, v, True, compute_dtype="input")
    assert n_empty == 90
    for o, l in ((out, lse), (ref_out, ref_lse), (naive_out, naive_lse)):
        o = o.astype(np.float64)
        assert (o[:, :90] == 0).all() and (l[:, :, :90] == -np.inf).all(), ctx
        assert not np.isnan(o).any() and not np.isnan(l).any(), ctx
        assert np.isfinite(l[:, :, 90:]).all(), ctx
    # Row seqlen_q - seqlen_k sees exactly key 0: its output is v[:, 0] (repeated over the query heads).
    assert np.array_equal(out[:, 90].astype(np.float32), np.repeat(v[:, 0], 2, axis=1).astype(np.float32)), ctx


def _single_tile_emulation(q, k, v, softmax_scale, round_p):
    """The module's algorithm for one query tile and one key tile (non-causal), optionally without P rounding
    (with it, O is divided by the sum of the rounded P, as the module does; without, by the float32 sum)."""
    dtype = q.dtype
    group = q.shape[2] // k.shape[2]
    qf = q.transpose(0, 2, 1, 3).astype(np.float32)
    kf = np.repeat(k.transpose(0, 2, 1, 3), group, axis=1).astype(np.float32)
    vf = np.repeat(v.transpose(0, 2, 1, 3), group, axis=1).astype(np.float32)
    s = (qf @ kf.swapaxes(-1, -2)) * np.float32(softmax_scale * math.log2(math.e))
    p = np.exp2(s - s.max(axis=-1, keepdims=True))
    if round_p:
        p = p.astype(dtype).astype(np.float32)
    o = (p @ vf) / p.sum(axis=-1, keepdims=True)
    return o.astype(dtype).transpose(0, 2, 1, 3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_p_rounded_to_input_dtype_before_pv(dtype):
    """The PV product uses P rounded to the input dtype, as the GPU kernel's 16-bit MMA does.

    With one query tile and one key tile the algorithm has no rescaling, so its output must agree with an
    emulation that rounds P on (nearly) every element, and visibly disagree with one that does not.
    """
    seed = _new_seed()
    rng = np.random.default_rng(seed)
    q, k, v = _make_qkv(rng, dtype, 2, 64, 96, 4, 2, 64)
    scale = 1.0 / 8.0
    out, _ = attention_forward_numpy(q, k, v, False, scale, block_m=64, block_n=128)
    out = out.astype(np.float32)
    miss_rounded = np.mean(out != _single_tile_emulation(q, k, v, scale, True).astype(np.float32))
    miss_unrounded = np.mean(out != _single_tile_emulation(q, k, v, scale, False).astype(np.float32))
    ctx = _ctx(seed, dtype=dtype.name, miss_rounded=miss_rounded, miss_unrounded=miss_unrounded)
    assert miss_rounded < 0.01, ctx
    assert miss_unrounded > 0.05, ctx


@pytest.mark.parametrize("dtype", DTYPES)
def test_tiling_does_not_change_result_much(dtype):
    """One big tile vs many small tiles: the online softmax rescaling reproduces the single-pass result."""
    seed = _new_seed()
    rng = np.random.default_rng(seed)
    q, k, v = _make_qkv(rng, dtype, 2, 150, 170, 4, 4, 32)
    ctx = _ctx(seed, dtype=dtype.name)
    for causal in (False, True):
        big, lse_big = attention_forward_numpy(q, k, v, causal, 0.2, block_m=256, block_n=256)
        small, lse_small = attention_forward_numpy(q, k, v, causal, 0.2, block_m=16, block_n=16)
        # Only P's rounding point differs (relative to the running vs the final max), plus float32 noise.
        ulp = 2.0 ** -7 if dtype == BF16 else 2.0 ** -10
        assert max_abs_err(big, small) <= 4 * ulp, ctx
        assert max_abs_err(lse_big, lse_small) <= 1e-5, ctx


# --------------------------------------------------------------------------------------------------------------
# The references themselves.


def _loop_attention(q, k, v, causal, scale):
    """Textbook attention, one row at a time in Python floats."""
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    group = nheads // nheads_kv
    out = np.zeros((batch, seqlen_q, nheads, head_dim))
    lse = np.full((batch, nheads, seqlen_q), -np.inf)
    for b in range(batch):
        for h in range(nheads):
            hk = h // group
            for i in range(seqlen_q):
                keys = [j for j in range(seqlen_k) if not causal or j <= i + seqlen_k - seqlen_q]
                if not keys:
                    continue
                s = [scale * sum(float(q[b, i, h, c]) * float(k[b, j, hk, c]) for c in range(head_dim)) for j in keys]
                mx = max(s)
                w = [math.exp(x - mx) for x in s]
                total = sum(w)
                lse[b, h, i] = mx + math.log(total)
                for c in range(head_dim):
                    out[b, i, h, c] = sum(wj * float(v[b, j, hk, c]) for wj, j in zip(w, keys)) / total
    return out, lse


@pytest.mark.parametrize("seqlens", [(3, 5), (5, 3), (4, 4), (1, 6)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_reference_matches_loop(causal, seqlens):
    seed = _new_seed()
    rng = np.random.default_rng(seed)
    seqlen_q, seqlen_k = seqlens
    q, k, v = _make_qkv(rng, np.float64, 2, seqlen_q, seqlen_k, 4, 2, 5)
    scale = 0.7
    ctx = _ctx(seed, causal=causal, seqlens=seqlens)
    want_out, want_lse = _loop_attention(q, k, v, causal, scale)
    out, lse = attention_reference(q, k, v, causal, scale)
    assert out.dtype == np.float64 and lse.dtype == np.float64
    assert out.shape == q.shape and lse.shape == (2, 4, seqlen_q)
    assert max_abs_err(out, want_out) < 1e-12, ctx
    assert max_abs_err(lse, want_lse) < 1e-12, ctx
    # With float64 inputs the 'input' mode rounds to float64 (a no-op) and must agree too.
    out_in, lse_in = attention_reference(q, k, v, causal, scale, compute_dtype="input")
    assert max_abs_err(out_in, want_out) < 1e-12, ctx
    assert max_abs_err(lse_in, want_lse) < 1e-12, ctx
    # Default scale is 1/sqrt(head_dim).
    want_default, _ = _loop_attention(q, k, v, causal, 1.0 / math.sqrt(5))
    assert max_abs_err(attention_reference(q, k, v, causal)[0], want_default) < 1e-12, ctx


def test_causal_mask_rule():
    for seqlen_q, seqlen_k in itertools.product([1, 2, 5, 9], [1, 3, 5, 12]):
        mask = causal_mask(seqlen_q, seqlen_k)
        want = np.array([[j <= i + seqlen_k - seqlen_q for j in range(seqlen_k)] for i in range(seqlen_q)])
        assert np.array_equal(mask, want), (seqlen_q, seqlen_k)
        # Bottom-right alignment: the last query row sees every key.
        assert mask[-1].all()
    # Spot checks: square is lower-triangular; wide sees the extra keys; tall starts with empty rows.
    assert np.array_equal(causal_mask(3, 3), np.tril(np.ones((3, 3), bool)))
    assert causal_mask(2, 5).sum(axis=1).tolist() == [4, 5]
    assert causal_mask(5, 2).sum(axis=1).tolist() == [0, 0, 0, 1, 2]


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_input_mode(dtype):
    """The 'input' emulation returns input-dtype out / float32 lse, and rounds where it should."""
    seed = _new_seed()
    rng = np.random.default_rng(seed)
    q, k, v = _make_qkv(rng, dtype, 1, 40, 50, 2, 1, 32)
    ctx = _ctx(seed, dtype=dtype.name)
    out, lse = attention_reference(q, k, v, True, compute_dtype="input")
    ref, ref_lse = attention_reference(q, k, v, True)
    assert out.dtype == dtype and lse.dtype == np.float32 and out.shape == q.shape
    err = max_abs_err(out, ref)
    tol = 0.05 if dtype == BF16 else 0.01
    assert 0 < err < tol, f"err={err}; {ctx}"
    # Scores are rounded to the input dtype before the float32 softmax: the lse error reflects that.
    assert 0 < max_abs_err(lse, ref_lse) < 10 * tol, ctx


def test_max_abs_err():
    assert max_abs_err([1.0, 2.0], [1.0, 2.5]) == 0.5
    assert max_abs_err([-np.inf, 1.0], [-np.inf, 1.0]) == 0.0
    assert max_abs_err([np.inf], [np.inf]) == 0.0
    assert max_abs_err([-np.inf], [np.inf]) == np.inf
    assert max_abs_err([-np.inf], [0.0]) == np.inf
    assert max_abs_err([np.nan], [1.0]) == np.inf
    assert max_abs_err([np.nan], [np.nan]) == np.inf
    assert max_abs_err(np.zeros((0, 3)), np.zeros((0, 3))) == 0.0
    assert max_abs_err(np.array([1.5], BF16), np.array([1.0], np.float16)) == 0.5
    with pytest.raises(ValueError):
        max_abs_err(np.zeros(2), np.zeros(3))


def test_check_close():
    ref = np.zeros(4)
    naive = np.array([0.0, 0.1, 0.0, 0.0])
    ok, msg = check_close(np.array([0.0, 0.0, 0.2, 0.0]), ref, naive)
    assert ok and "0.2" in msg and "0.1" in msg
    ok, _ = check_close(np.array([0.0, 0.0, 0.21, 0.0]), ref, naive)
    assert not ok
    ok, _ = check_close(np.array([np.nan, 0, 0, 0]), ref, np.array([np.nan, 0, 0, 0]))
    assert not ok
    ok, _ = check_close(np.zeros(4), ref, np.zeros(4))
    assert ok
