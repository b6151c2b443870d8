"""CPU tests of the optional attention features (cuflash/_features.py: per-batch q/kv lengths, sliding window, sink
tokens, sink logits, ALiBi, softcap) in the NumPy forward / backward (cuflash._cpu, cuflash._cpu_backward) and in
the naive references (cuflash._reference, tests/_grad_reference.py).

No GPU needed. Every check draws fresh random inputs; the seed is printed in each failure message, and setting
CUFLASH_TEST_SEED=<seed> replays it (e.g. `CUFLASH_TEST_SEED=123 pytest tests/test_cpu_features.py -k <test id>`).

Accuracy criterion, as in tests/test_cpu_numpy.py and tests/test_cpu_backward.py: against the float64 reference, the
max error of out is at most 2x that of the naive computation in the input dtype (+1e-5), and the max errors of dq, dk,
dv at most 3x the naive ones (+1e-4); lse to float32 accuracy relative to the size of the row's score terms.

One allowance is added to the dq and dk bounds: the backward computes D = rowsum(dO * out) from the out the forward
returned, rounded to the input dtype (as FlashAttention does; the naive computes rowsum(dP * P) instead). dS carries
P * (error of D), and where a row's softmax is dominated by one key but not one-hot (a sink logit with a short key
length, a steep ALiBi slope) that error does not shrink with dS as the naive's does: the NumPy error there was
measured at up to 8x the naive's (a single row of a padded batch entry decides the max). Each element of dq and dk may
therefore also carry the propagation of the D error that the NumPy path actually had, computed in float64 with the
triangle inequality: dq_i: scale * |dD_i| * sum_j P_ij |k_j|, dk_j: scale * sum_i P_ij |dD_i| |q_i| (summed over
the group), dD_i = dout_i . (out_i - ref_out_i) (_d_allowance; the softcap's factor 1 - t^2 <= 1 only shrinks it).

The sink gradient is one sum per head over every row of the batch, so the max error of a naive evaluation is a
heavy-tailed statistic (the naive's own error can cancel by luck: measured ratios of the NumPy error to it reach 5x in
1% of the draws). Its accuracy bound is therefore DSINK_FACTOR x the root-sum-square of the naive's per-row error
terms (the typical size of a sum of such errors, without the lucky cancellation; measured ratios stay below 2.6),
and it is checked tightly against the _features.py formula evaluated in float64 from the NumPy forward's own out and
lse. Each row's term is itself a sum over head_dim elements (D = rowsum(dout * out)), and where one row carries the
whole sum (a row that sees one key beside the sink) the same luck returns inside it: CI's seed 60 (session 20: bf16,
64 x 60 causal, head_dim 40, softcap 50) had a NumPy out equal to the exact out correctly rounded to bf16 and a d sink
error 6x the per-row root-sum-square, whose one row's naive error had cancelled to a fifth of its elements'
root-sum-square. So the root-sum-square over rows and elements counts too, where it is larger.
"""

import math

import ml_dtypes
import numpy as np
import pytest

from _cpu_helpers import _batch_for, _ctx, _new_seed, _randn
from _grad_reference import attention_grad_reference
from cuflash._cpu import _key_tiles, _query_tiles, _tile_needs_mask, _tile_visible, attention_forward_numpy
from cuflash._cpu_backward import attention_backward_numpy
from cuflash._reference import _NaiveForward, attention_reference, check_close, feature_mask_bias, max_abs_err

# Any numpy floating-point warning (divide by zero, invalid value, overflow) is a test failure.
pytestmark = pytest.mark.filterwarnings("error")

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [pytest.param(np.dtype(np.float16), id="fp16"), pytest.param(BF16, id="bf16")]
CAUSAL = pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])

FWD_FACTOR, FWD_FLOOR = 2.0, 1e-5
BWD_FACTOR, BWD_FLOOR = 3.0, 1e-4
DSINK_FACTOR = 5.0
LSE_ATOL = 1e-4
LSE_RTOL = 1e-5

# (seqlen_q, seqlen_k, head_dim, (nheads, nheads_kv), (block_m, block_n)): one query row, several query and key
# tiles with partial last ones, more keys than queries and the reverse; GQA and MHA.
SHAPES = [
    pytest.param((1, 1, 16, (4, 2), (64, 64)), id="1x1"),
    pytest.param((17, 33, 24, (2, 2), (16, 8)), id="17x33"),
    pytest.param((65, 40, 64, (4, 2), (64, 64)), id="65x40"),
    pytest.param((130, 130, 16, (4, 2), (32, 16)), id="130x130"),
]


# --------------------------------------------------------------------------------------------------------------
# Feature arguments.


def _length_pattern(batch, seqlen, shift):
    """Valid lengths (batch,) cycling through 0, 1, an odd length and the full length (rotated by shift)."""
    values = [0, 1, min(seqlen, (seqlen // 2) | 1), seqlen]
    return np.array([values[(b + shift) % 4] for b in range(batch)], dtype=np.int64)


def _sinks(rng, nheads):
    """Sink logits of the size of the scores (some rows dominated by the sink, some not)."""
    return (rng.standard_normal(nheads) * 1.5 + 0.5).astype(np.float32)


def _slopes(rng, nheads):
    """ALiBi slopes: the usual geometric ones 2^(-8 (h + 1) / nheads), times a random factor in [0.5, 2)."""
    base = 2.0 ** (-8.0 * (np.arange(nheads) + 1) / nheads)
    return (base * rng.uniform(0.5, 2.0, nheads)).astype(np.float32)


# name -> (make(rng, batch, nheads, seqlen_q, seqlen_k) -> feature kwargs, qk_scale of the inputs)
FEATURES = {
    "qlen": (lambda r, b, h, sq, sk: dict(q_lengths=_length_pattern(b, sq, 0)), 1.0),
    "kvlen": (lambda r, b, h, sq, sk: dict(kv_lengths=_length_pattern(b, sk, 1)), 1.0),
    "qkvlen": (lambda r, b, h, sq, sk: dict(q_lengths=_length_pattern(b, sq, 0), kv_lengths=_length_pattern(b, sk, 1)),
               1.0),
    "win3_0": (lambda r, b, h, sq, sk: dict(window=(3, 0)), 1.0),
    "win5_7": (lambda r, b, h, sq, sk: dict(window=(5, 7)), 1.0),
    "win0_0": (lambda r, b, h, sq, sk: dict(window=(0, 0)), 1.0),
    "win1000": (lambda r, b, h, sq, sk: dict(window=(1000, 1000)), 1.0),
    "win-1_2": (lambda r, b, h, sq, sk: dict(window=(-1, 2)), 1.0),
    "win4_-1": (lambda r, b, h, sq, sk: dict(window=(4, -1)), 1.0),
    "sinktok": (lambda r, b, h, sq, sk: dict(window=(4, 1), num_sink_tokens=3), 1.0),
    "sinktok20": (lambda r, b, h, sq, sk: dict(window=(2, 0), num_sink_tokens=20), 1.0),
    "sinklogit": (lambda r, b, h, sq, sk: dict(sink_logits=_sinks(r, h)), 1.0),
    "alibi_h": (lambda r, b, h, sq, sk: dict(alibi_slopes=_slopes(r, h)), 1.0),
    "alibi_bh": (lambda r, b, h, sq, sk: dict(alibi_slopes=r.uniform(0.0, 1.0, (b, h)).astype(np.float32)), 1.0),
    "softcap5": (lambda r, b, h, sq, sk: dict(softcap=5.0), 3.0),
    "softcap30": (lambda r, b, h, sq, sk: dict(softcap=30.0), 5.0),
}

PAIRS = [
    ("qkvlen", "win5_7"), ("qkvlen", "sinktok"), ("qkvlen", "sinklogit"), ("qkvlen", "alibi_bh"),
    ("qkvlen", "softcap5"), ("win3_0", "sinklogit"), ("win3_0", "alibi_h"), ("win4_-1", "softcap5"),
    ("win-1_2", "sinklogit"), ("sinktok", "sinklogit"), ("sinktok20", "alibi_h"), ("sinklogit", "alibi_bh"),
    ("sinklogit", "softcap30"), ("alibi_h", "softcap5"),
]


def _make_features(names, rng, batch, nheads, seqlen_q, seqlen_k):
    feats, qk_scale = {}, 1.0
    for name in names:
        make, scale = FEATURES[name]
        feats.update(make(rng, batch, nheads, seqlen_q, seqlen_k))
        qk_scale = max(qk_scale, scale)
    return feats, qk_scale


def _make_inputs(rng, dtype, batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, qk_scale=1.0):
    """q, k, v, dout: random normal (q and k times qk_scale)."""
    q = _randn(rng, (batch, seqlen_q, nheads, head_dim), dtype, qk_scale)
    k = _randn(rng, (batch, seqlen_k, nheads_kv, head_dim), dtype, qk_scale)
    v = _randn(rng, (batch, seqlen_k, nheads_kv, head_dim), dtype)
    dout = _randn(rng, (batch, seqlen_q, nheads, head_dim), dtype)
    return q, k, v, dout


def _valid_lengths(feats, batch, seqlen_q, seqlen_k):
    """Clamped valid lengths (batch,) of q and kv."""
    sq = np.clip(np.asarray(feats.get("q_lengths", np.full(batch, seqlen_q))), 0, seqlen_q)
    sk = np.clip(np.asarray(feats.get("kv_lengths", np.full(batch, seqlen_k))), 0, seqlen_k)
    return sq, sk


def _score_magnitude(q, k, softmax_scale, feats):
    """(batch, nheads, seqlen_q): per row, a bound on the size of the float32 score terms: max over keys of
    softmax_scale * sum_c |q_c| |k_c|, plus the largest ALiBi bias and sink logit."""
    batch, seqlen_q, nheads, _ = q.shape
    seqlen_k = k.shape[1]
    group = nheads // k.shape[2]
    qa = np.abs(q.astype(np.float64)).transpose(0, 2, 1, 3)
    ka = np.repeat(np.abs(k.astype(np.float64)).transpose(0, 2, 1, 3), group, axis=1)
    mag = softmax_scale * (qa @ ka.swapaxes(-1, -2)).max(axis=-1) if seqlen_k else np.zeros(qa.shape[:3])
    if feats.get("alibi_slopes") is not None:
        mag = mag + np.abs(feats["alibi_slopes"]).max() * (seqlen_q + seqlen_k)
    if feats.get("sink_logits") is not None:
        mag = mag + np.abs(feats["sink_logits"]).max()
    return mag


# --------------------------------------------------------------------------------------------------------------
# The check: forward and backward against the references, and the padding contract.


def _check(q, k, v, dout, causal, softmax_scale, blocks, feats, ctx):
    """Forward and backward of the NumPy path with `feats`, checked against the references. Returns
    (out, lse, grads)."""
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k = k.shape[1]
    block_m, block_n = blocks
    inputs = (q, k, v, dout)
    copies = [x.copy() for x in inputs]
    sq, sk = _valid_lengths(feats, batch, seqlen_q, seqlen_k)
    pad_q = np.arange(seqlen_q)[None, :] >= sq[:, None]  # (batch, seqlen_q)
    pad_k = np.arange(seqlen_k)[None, :] >= sk[:, None]  # (batch, seqlen_k)

    # ---- forward ----
    out, lse = attention_forward_numpy(q, k, v, causal, softmax_scale, block_m, block_n, **feats)
    assert out.shape == q.shape and out.dtype == q.dtype and out.flags.c_contiguous, ctx
    assert lse.shape == (batch, nheads, seqlen_q) and lse.dtype == np.float32, ctx
    out32 = out.astype(np.float32)
    assert np.isfinite(out32).all(), f"non-finite out; {ctx}"
    assert not np.isnan(lse).any(), f"NaN in lse; {ctx}"

    ref_out, ref_lse = attention_reference(q, k, v, causal, softmax_scale, **feats)
    naive_out, _ = attention_reference(q, k, v, causal, softmax_scale, compute_dtype="input", **feats)
    ok, msg = check_close(out, ref_out, naive_out, factor=FWD_FACTOR, floor=FWD_FLOOR)
    assert ok, f"out: {msg}; {ctx}"

    ref_neginf = np.isneginf(ref_lse)
    assert np.array_equal(np.isneginf(lse), ref_neginf), f"lse -inf pattern differs; {ctx}"
    assert np.isfinite(lse[~ref_neginf]).all(), f"lse must be finite where the reference's is; {ctx}"
    finite = ~ref_neginf
    lse_err = np.abs(lse[finite].astype(np.float64) - ref_lse[finite])
    mag = np.maximum(np.abs(ref_lse), _score_magnitude(q, k, softmax_scale, feats))[finite]
    assert (lse_err <= LSE_ATOL + LSE_RTOL * mag).all(), \
        f"lse max err {lse_err.max() if lse_err.size else 0:.3g}; {ctx}"

    # Padded rows: out 0 and lse -inf, even with a sink logit.
    assert (out32[pad_q] == 0).all(), f"padded rows must have out 0; {ctx}"
    assert (lse.transpose(0, 2, 1)[pad_q] == -np.inf).all(), f"padded rows must have lse -inf; {ctx}"

    # ---- backward ----
    grads = attention_backward_numpy(dout, q, k, v, out, lse, causal, softmax_scale, block_m, block_n, **feats)
    has_sink = feats.get("sink_logits") is not None
    assert len(grads) == (4 if has_sink else 3), ctx
    for name, g, x in zip(("dq", "dk", "dv"), grads, (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype and g.flags.c_contiguous, f"{name}; {ctx}"
        assert np.isfinite(g.astype(np.float32)).all(), f"non-finite {name}; {ctx}"
    for x, x0 in zip(inputs, copies):
        assert np.array_equal(x.astype(np.float32), x0.astype(np.float32)), f"input modified; {ctx}"

    refs = attention_grad_reference(dout, q, k, v, causal, softmax_scale, **feats)
    naives = attention_grad_reference(dout, q, k, v, causal, softmax_scale, compute_dtype="input", **feats)
    allowances = _d_allowance(q, k, v, dout, out, causal, softmax_scale, feats) + (None,)
    for name, g, ref, naive, allow in zip(("dq", "dk", "dv"), grads, refs, naives, allowances):
        if allow is None:
            ok, msg = check_close(g, ref, naive, factor=BWD_FACTOR, floor=BWD_FLOOR)
        else:
            ok, msg = _check_close_with_allowance(g, ref, naive, allow)
        assert ok, f"{name}: {msg}; {ctx}"

    # Padded rows get dq = 0; keys past kv_len get dk = dv = 0.
    assert (grads[0].astype(np.float32)[pad_q] == 0).all(), f"dq of padded rows must be 0; {ctx}"
    assert (grads[1].astype(np.float32)[pad_k] == 0).all(), f"dk past kv_len must be 0; {ctx}"
    assert (grads[2].astype(np.float32)[pad_k] == 0).all(), f"dv past kv_len must be 0; {ctx}"

    if has_sink:
        _check_dsink(grads[3], refs[3], dout, out, lse, ref_out, ref_lse, naive_out, feats["sink_logits"], pad_q,
                     ctx)
    return out, lse, grads


def _d_allowance(q, k, v, dout, out, causal, softmax_scale, feats):
    """(dq_allow, dk_allow) float64, shaped like q and k: the propagation of the error of D = rowsum(dout * out) that
    the NumPy backward inherits from the forward's out (see the module docstring)."""
    nheads, nheads_kv = q.shape[2], k.shape[2]
    fw = _NaiveForward(q, k, v, causal, softmax_scale, None, **feats)  # float64 P, heads-first q, k (kv repeated)
    ref_out = np.matmul(fw.p, fw.vh)  # (batch, nheads, seqlen_q, d)
    d_err = np.abs((np.swapaxes(dout.astype(np.float64), 1, 2) * (np.swapaxes(out.astype(np.float64), 1, 2)
                                                                    - ref_out)).sum(axis=-1))
    scale = float(softmax_scale)
    dq_allow = scale * d_err[..., None] * np.matmul(fw.p, np.abs(fw.kh))
    dk_allow = scale * np.matmul(np.swapaxes(fw.p * d_err[..., None], -1, -2), np.abs(fw.qh))
    batch, _, seqlen_k, head_dim = dk_allow.shape
    dk_allow = dk_allow.reshape(batch, nheads_kv, nheads // nheads_kv, seqlen_k, head_dim).sum(axis=2)
    return np.swapaxes(dq_allow, 1, 2), np.swapaxes(dk_allow, 1, 2)


def _check_close_with_allowance(g, ref, naive, allow):
    """check_close(g, ref, naive, BWD_FACTOR, BWD_FLOOR) with each element's error first reduced by its allowance."""
    err = np.abs(g.astype(np.float64) - ref)
    excess = float(np.max(err - allow, initial=0.0)) if np.isfinite(err).all() else np.inf
    err_naive = max_abs_err(naive, ref)
    bound = BWD_FACTOR * err_naive + BWD_FLOOR
    msg = (f"max(|g-ref| - allowance)={excess:.4g} (max|g-ref|={float(np.max(err, initial=0.0)):.4g}, max allowance="
           f"{float(np.max(allow, initial=0.0)):.4g}), max|naive-ref|={err_naive:.4g}, bound={bound:.4g} "
           f"({BWD_FACTOR} * naive + {BWD_FLOOR:g})")
    return bool(np.isfinite(excess) and excess <= bound), msg


def _check_dsink(dsink, ref_dsink, dout, out, lse, ref_out, ref_lse, naive_out, sink, pad_q, ctx):
    """dsink: float32 (nheads,); the _features.py formula on the NumPy forward's out / lse to float32 accuracy; and
    accurate against the float64 gradient (see the module docstring for the bound)."""
    nheads = dout.shape[2]
    assert dsink.shape == (nheads,) and dsink.dtype == np.float32, ctx
    assert np.isfinite(dsink).all(), ctx
    d64 = dout.astype(np.float64)
    sink = np.asarray(sink, dtype=np.float64)[None, :, None]
    valid = ~pad_q[:, None, :]

    def p_sink(lse_):
        ok = np.isfinite(lse_) & valid
        return np.where(ok, np.exp(sink - np.where(ok, lse_, 0.0)), 0.0)

    # d sink[h] = -sum over b and valid rows of exp(sink[h] - lse) * D, D = rowsum(dout * out): float64 from the
    # forward's own out and lse.
    terms = p_sink(lse.astype(np.float64)) * (d64 * out.astype(np.float64)).sum(axis=-1).transpose(0, 2, 1)
    want = -terms.sum(axis=(0, 2))
    tol = 1e-5 * np.abs(terms).sum(axis=(0, 2)) + 1e-6
    assert (np.abs(dsink - want) <= tol).all(), f"dsink vs the formula: {np.abs(dsink - want).max():.3g}; {ctx}"

    # Accuracy against float64: the naive's per-row errors exp(sink - lse) * rowsum(dout * (naive_out - ref_out)),
    # root-sum-square per head; or, where larger, the root-sum-square of the per-element terms of those row sums
    # (see the module docstring: a row that carries the whole sum can have its naive error cancel by luck).
    naive_elems = p_sink(ref_lse)[..., None] * (d64 * (naive_out.astype(np.float64) - ref_out)).transpose(0, 2, 1, 3)
    rss_rows = np.sqrt((naive_elems.sum(axis=-1) ** 2).sum(axis=(0, 2)))
    rss_elems = np.sqrt((naive_elems ** 2).sum(axis=(0, 2, 3)))
    rss = np.maximum(rss_rows, rss_elems)
    err = max_abs_err(dsink, ref_dsink)
    bound = DSINK_FACTOR * rss.max() + BWD_FLOOR
    assert err <= bound, f"dsink: max|dsink-ref|={err:.4g}, bound={bound:.4g} ({DSINK_FACTOR} * rss(naive) + " \
                         f"{BWD_FLOOR:g}); {ctx}"


def _run_case(dtype, causal, shape, names, seed, batch=None):
    rng = np.random.default_rng(seed)
    seqlen_q, seqlen_k, head_dim, (nheads, nheads_kv), blocks = shape
    if batch is None:
        batch = max(4, _batch_for(seqlen_q))
    feats, qk_scale = _make_features(names, rng, batch, nheads, seqlen_q, seqlen_k)
    q, k, v, dout = _make_inputs(rng, dtype, batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, qk_scale)
    ctx = _ctx(seed, dtype=dtype.name, causal=causal, shape=shape[:2], features="+".join(names))
    scale = 1.0 / math.sqrt(head_dim)
    _check(q, k, v, dout, causal, scale, blocks, feats, ctx)
    return q, k, v, feats, scale, ctx


# --------------------------------------------------------------------------------------------------------------
# NumPy forward and backward vs the references.


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("feature", list(FEATURES))
@CAUSAL
@pytest.mark.parametrize("dtype", DTYPES)
def test_single_feature(dtype, causal, feature, shape):
    seed = _new_seed()
    q, k, v, feats, scale, ctx = _run_case(dtype, causal, shape, (feature,), seed)
    if "softcap" in feature:
        # The cap really matters: raw scores well beyond it.
        group = q.shape[2] // k.shape[2]
        raw = scale * np.einsum("bihd,bjhd->bhij", q.astype(np.float64),
                                np.repeat(k.astype(np.float64), group, axis=2))
        assert np.abs(raw).max() > feats["softcap"], ctx


@pytest.mark.parametrize("shape", [SHAPES[1], SHAPES[3]])
@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: "+".join(p))
@CAUSAL
@pytest.mark.parametrize("dtype", DTYPES)
def test_feature_pairs(dtype, causal, pair, shape):
    _run_case(dtype, causal, shape, pair, _new_seed())


@pytest.mark.parametrize("blocks", [(16, 16), (32, 8), (64, 64), (128, 32)], ids=lambda b: f"bm{b[0]}-bn{b[1]}")
@pytest.mark.parametrize("heads", [(4, 2), (3, 1)], ids=["gqa", "mqa"])
@CAUSAL
@pytest.mark.parametrize("dtype", DTYPES)
def test_all_features_together(dtype, causal, heads, blocks):
    """Lengths, window with sink tokens, sink logits, per-batch ALiBi and softcap at once, several tilings."""
    seed = _new_seed()
    rng = np.random.default_rng(seed)
    batch, seqlen_q, seqlen_k, head_dim = 4, 97, 120, 24
    nheads, nheads_kv = heads
    feats = dict(q_lengths=np.array([97, 50, 1, 0]), kv_lengths=np.array([120, 77, 33, 5]), window=(20, 9),
                 num_sink_tokens=4, sink_logits=_sinks(rng, nheads),
                 alibi_slopes=rng.uniform(0.0, 0.3, (batch, nheads)).astype(np.float32), softcap=8.0)
    q, k, v, dout = _make_inputs(rng, dtype, batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, 2.0)
    ctx = _ctx(seed, dtype=dtype.name, causal=causal, heads=heads, blocks=blocks)
    _check(q, k, v, dout, causal, 1.0 / math.sqrt(head_dim), blocks, feats, ctx)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_without_visible_key(dtype):
    """Rows that see no key (causal with seqlen_q > kv_len, kv_len 0): out 0, lse -inf without a sink logit and
    lse = sink with one, and no NaN anywhere."""
    seed = _new_seed()
    rng = np.random.default_rng(seed)
    batch, seqlen_q, seqlen_k, nheads = 3, 40, 30, 2
    q, k, v, dout = _make_inputs(rng, dtype, batch, seqlen_q, seqlen_k, nheads, 1, 16)
    kv_lengths = np.array([30, 10, 0])
    empty = np.arange(seqlen_q)[None, :] < seqlen_q - kv_lengths[:, None]  # i' = i + kv_len - seqlen_q < 0
    sink = np.array([0.25, -2.0], dtype=np.float32)
    for with_sink in (False, True):
        feats = dict(kv_lengths=kv_lengths)
        if with_sink:
            feats["sink_logits"] = sink
        ctx = _ctx(seed, dtype=dtype.name, sink=with_sink)
        with np.errstate(divide="raise", invalid="raise", over="raise"):
            out, lse, grads = _check(q, k, v, dout, True, 0.25, (16, 16), feats, ctx)
        lse_rows = lse.transpose(0, 2, 1)  # (batch, seqlen_q, nheads)
        assert (out.astype(np.float32)[empty] == 0).all(), ctx
        assert (grads[0].astype(np.float32)[empty] == 0).all(), ctx
        if with_sink:
            assert np.allclose(lse_rows[empty], np.broadcast_to(sink, lse_rows[empty].shape), rtol=0, atol=1e-6), ctx
        else:
            assert (lse_rows[empty] == -np.inf).all(), ctx
        assert np.isfinite(lse_rows[~empty]).all(), ctx


@pytest.mark.parametrize("backend", ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("head_dim", [8, 64, 128])
@pytest.mark.parametrize("dtype", DTYPES)
def test_stale_lse_under_a_huge_sink_logit(dtype, head_dim, backend):
    """attention_backward given the lse of a forward without the sink logit, and a sink logit of 1e4: the sink's
    P = exp(sink - lse) is capped at 1, as the keys' P is, so nothing is NaN. Before the cap it was inf, and below
    head_dim 32 dQ's D correction (E = sum_j P_j (dP_j - D) - P_sink D, times B = sum_j P_j K_j) gave inf * 0 =
    NaN where B is 0 (k = 0 here, so the exact dq is 0 whatever P is). The GPU fuzzer found it (session 42,
    tests/test_fuzz_inputs.py REGRESSIONS: a stale varlen backward with a huge sink logit)."""
    import cuflash

    seed = _new_seed()
    rng = np.random.default_rng(seed)
    batch, seqlen_q, seqlen_k, nheads = 2, 5, 3, 2
    q, _, v, dout = _make_inputs(rng, dtype, batch, seqlen_q, seqlen_k, nheads, 1, head_dim)
    k = np.zeros((batch, seqlen_k, 1, head_dim), dtype=dtype)
    sink = np.array([1e4, 0.5], dtype=np.float32)
    ctx = _ctx(seed, dtype=dtype.name, head_dim=head_dim, backend=backend)
    if backend == "gpu":  # the same values as torch CUDA tensors, the results back as NumPy
        torch = pytest.importorskip("torch")
        if not torch.cuda.is_available():
            pytest.skip("torch has no CUDA device")
        tdt = torch.bfloat16 if dtype == ml_dtypes.bfloat16 else torch.float16
        dev = [torch.from_numpy(x.astype(np.float32)).cuda().to(tdt) for x in (q, k, v, dout)]
        out_t, lse_t = cuflash.attention(*dev[:3], return_lse=True)
        res = cuflash.attention_backward(dev[3], *dev[:3], out_t, lse_t, sink_logits=torch.from_numpy(sink).cuda())
        out = out_t.float().cpu().numpy().astype(dtype)
        dq, dk, dv, dsink = (r.float().cpu().numpy() for r in res)
    else:
        out, lse = cuflash.attention(q, k, v, return_lse=True)
        dq, dk, dv, dsink = cuflash.attention_backward(dout, q, k, v, out, lse, sink_logits=sink)
    for name, g in (("dq", dq), ("dk", dk), ("dv", dv), ("dsink", dsink)):
        assert not np.isnan(np.asarray(g, np.float32)).any(), f"{name} has NaN; {ctx}"
    assert (np.asarray(dq, np.float32) == 0).all(), f"dq of k = 0 must be 0; {ctx}"
    # Head 0's P_sink is capped at 1: its d sink is -sum_i D_i, D from the stored out (float32 sums).
    d_rows = (out.astype(np.float32) * dout.astype(np.float32)).sum(axis=-1)  # (batch, seqlen_q, nheads)
    np.testing.assert_allclose(dsink[0], -d_rows[..., 0].sum(), rtol=1e-4, atol=1e-4, err_msg=ctx)


@pytest.mark.parametrize("dtype", DTYPES)
def test_padding_does_not_leak(dtype):
    """What lies in padded rows (q, dout) and past kv_len (k, v) changes nothing, and gets zero gradients."""
    seed = _new_seed()
    rng = np.random.default_rng(seed)
    batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim = 3, 50, 70, 4, 2, 16
    q, k, v, dout = _make_inputs(rng, dtype, batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim)
    feats = dict(q_lengths=np.array([50, 21, 0]), kv_lengths=np.array([3, 70, 40]), window=(8, 3),
                 num_sink_tokens=2, sink_logits=_sinks(rng, nheads), alibi_slopes=_slopes(rng, nheads), softcap=6.0)
    ctx = _ctx(seed, dtype=dtype.name)
    pad_q = np.arange(seqlen_q)[None, :] >= feats["q_lengths"][:, None]
    pad_k = np.arange(seqlen_k)[None, :] >= feats["kv_lengths"][:, None]
    out, lse, grads = _check(q, k, v, dout, False, 0.25, (16, 32), feats, ctx)

    q2, k2, v2, dout2 = (x.copy() for x in (q, k, v, dout))
    q2[pad_q] = _randn(rng, q2[pad_q].shape, dtype, 100.0)
    dout2[pad_q] = _randn(rng, dout2[pad_q].shape, dtype, 100.0)
    k2[pad_k] = _randn(rng, k2[pad_k].shape, dtype, 100.0)
    v2[pad_k] = _randn(rng, v2[pad_k].shape, dtype, 100.0)
    out2, lse2 = attention_forward_numpy(q2, k2, v2, False, 0.25, 16, 32, **feats)
    grads2 = attention_backward_numpy(dout2, q2, k2, v2, out2, lse2, False, 0.25, 16, 32, **feats)
    assert np.array_equal(out.astype(np.float32), out2.astype(np.float32)), ctx
    assert np.array_equal(lse, lse2), ctx
    for name, a, b in zip(("dq", "dk", "dv", "dsink"), grads, grads2):
        assert np.array_equal(a.astype(np.float32), b.astype(np.float32)), f"{name}; {ctx}"

    # The backward reads neither out nor lse of padded rows (lse_log2 = +inf there whatever lse says): finite
    # garbage in them changes no gradient, dsink included.
    out3, lse3 = out2.copy(), lse2.copy()
    out3[pad_q] = _randn(rng, out3[pad_q].shape, dtype)
    lse3.transpose(0, 2, 1)[pad_q] = rng.uniform(-3.0, 3.0, lse3.transpose(0, 2, 1)[pad_q].shape)
    grads3 = attention_backward_numpy(dout2, q2, k2, v2, out3, lse3, False, 0.25, 16, 32, **feats)
    for name, a, b in zip(("dq", "dk", "dv", "dsink"), grads, grads3):
        assert np.array_equal(a.astype(np.float32), b.astype(np.float32)), f"{name} (garbage padded rows); {ctx}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_equivalent_arguments_give_identical_results(dtype):
    """Arguments that mean 'no feature' give bit-identical results to the plain path: full or oversized lengths,
    a window wider than the sequence, sink tokens without a left bound; negative lengths mean 0."""
    seed = _new_seed()
    rng = np.random.default_rng(seed)
    batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim = 3, 45, 70, 4, 2, 16
    q, k, v, dout = _make_inputs(rng, dtype, batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim)
    ctx = _ctx(seed, dtype=dtype.name)

    def run(causal, **feats):
        out, lse = attention_forward_numpy(q, k, v, causal, 0.3, 16, 32, **feats)
        grads = attention_backward_numpy(dout, q, k, v, out, lse, causal, 0.3, 16, 32, **feats)
        return [x.astype(np.float32) for x in (out, lse) + tuple(grads)]

    def same(a, b, what):
        for x, y in zip(a, b):
            assert np.array_equal(x, y), f"{what}; {ctx}"

    for causal in (False, True):
        plain = run(causal)
        same(plain, run(causal, q_lengths=np.full(batch, seqlen_q), kv_lengths=np.full(batch, seqlen_k)),
             "full lengths")
        same(plain, run(causal, q_lengths=np.full(batch, 10 ** 6), kv_lengths=[seqlen_k + 1] * batch),
             "oversized lengths")
        same(plain, run(causal, window=(1000, 1000)), "wide window")
        same(plain, run(causal, window=(-1, -1), num_sink_tokens=5, softcap=0.0), "sinks without left bound")
    clamped = run(False, q_lengths=np.array([-3, 1000, 7]), kv_lengths=np.array([70, -1, 1000]))
    explicit = run(False, q_lengths=np.array([0, 45, 7]), kv_lengths=np.array([70, 0, 70]))
    same(clamped, explicit, "clamped lengths")
    # The same clamping in the references.
    ref_a = attention_reference(q, k, v, False, 0.3, q_lengths=np.array([-3, 1000, 7]),
                                kv_lengths=np.array([70, -1, 1000]))
    ref_b = attention_reference(q, k, v, False, 0.3, q_lengths=np.array([0, 45, 7]), kv_lengths=np.array([70, 0, 70]))
    for x, y in zip(ref_a, ref_b):
        assert np.array_equal(x, y), ctx


# --------------------------------------------------------------------------------------------------------------
# The tile bookkeeping of the NumPy path (which tiles are visited, which are masked).


def _random_tile_configs(rng, n):
    for _ in range(n):
        sq, sk = (int(x) for x in rng.integers(0, 80, 2))
        left = int(rng.choice([-1, 0, 1, 3, 10, 40]))
        right = int(rng.choice([-1, 0, 2, 7, 30]))
        nsink = int(rng.choice([0, 0, 1, 4, 20]))
        bm, bn = (int(x) for x in rng.choice([4, 8, 16, 32], 2))
        yield sq, sk, left, right, nsink, bm, bn


def test_tile_bookkeeping():
    """Per query block the forward visits exactly the key tiles that hold a key visible to one of its rows (so no
    fully masked tile, and every visible key); per key block the backward visits exactly the query tiles with a row
    that sees one of its keys; a tile left unmasked has every pair visible; the tile mask is the visibility rule."""
    seed = _new_seed()
    rng = np.random.default_rng(seed)
    for sq, sk, left, right, nsink, bm, bn in _random_tile_configs(rng, 150):
        ctx = _ctx(seed, sq=sq, sk=sk, window=(left, right), nsink=nsink, blocks=(bm, bn))
        vis = feature_mask_bias(1, 1, sq, sk, False, window=(left, right), num_sink_tokens=nsink)[0][0, 0]
        off = sk - sq
        for m0 in range(0, sq, bm):
            m1 = min(m0 + bm, sq)
            tiles = _key_tiles(m0, m1, off, sk, left, right, nsink, bn)
            want = [(n0, min(n0 + bn, sk)) for n0 in range(0, sk, bn) if vis[m0:m1, n0:n0 + bn].any()]
            assert tiles == want, f"rows {m0}:{m1}: {tiles} != {want}; {ctx}"
            for n0, n1 in tiles:
                block = vis[m0:m1, n0:n1]
                assert np.array_equal(_tile_visible(m0, m1, n0, n1, off, left, right, nsink), block), ctx
                if not _tile_needs_mask(m0, m1, n0, n1, off, left, right, nsink):
                    assert block.all(), f"tile {m0}:{m1} x {n0}:{n1} needs a mask; {ctx}"
        for n0 in range(0, sk, bn):
            n1 = min(n0 + bn, sk)
            tiles = _query_tiles(n0, n1, off, sq, left, right, nsink, bm)
            want = [(m0, min(m0 + bm, sq)) for m0 in range(0, sq, bm) if vis[m0:m0 + bm, n0:n1].any()]
            assert tiles == want, f"keys {n0}:{n1}: {tiles} != {want}; {ctx}"


# --------------------------------------------------------------------------------------------------------------
# The references themselves.


def _visible_by_formula(i, j, sq, sk, left, right, nsink):
    """cuflash/_features.py's rule, as written there, for one (row, key) pair."""
    if not (0 <= i < sq and 0 <= j < sk):
        return False
    ip = i + sk - sq
    return (right < 0 or j <= ip + right) and (left < 0 or j >= ip - left or j < nsink)


def test_reference_mask_matches_formula():
    """feature_mask_bias equals a per-element evaluation of the _features.py rule (visibility and ALiBi bias)."""
    seed = _new_seed()
    rng = np.random.default_rng(seed)
    for _ in range(40):
        batch, nheads = int(rng.integers(1, 4)), int(rng.integers(1, 4))
        seqlen_q, seqlen_k = (int(x) for x in rng.integers(0, 11, 2))
        causal = bool(rng.integers(0, 2))
        q_lengths = rng.integers(-2, seqlen_q + 3, batch) if rng.integers(0, 2) else None
        kv_lengths = rng.integers(-2, seqlen_k + 3, batch) if rng.integers(0, 2) else None
        window = (int(rng.integers(-1, 6)), int(rng.integers(-1, 6)))
        nsink = int(rng.integers(0, 4))
        slopes = rng.uniform(0, 1, (batch, nheads) if rng.integers(0, 2) else (nheads,)).astype(np.float32)
        ctx = _ctx(seed, batch=batch, seqlens=(seqlen_q, seqlen_k), causal=causal, q_lengths=q_lengths,
                   kv_lengths=kv_lengths, window=window, nsink=nsink)
        visible, bias = feature_mask_bias(batch, nheads, seqlen_q, seqlen_k, causal, q_lengths, kv_lengths, window,
                                          nsink, slopes)
        assert visible.shape == (batch, 1, seqlen_q, seqlen_k) and visible.dtype == bool, ctx
        assert bias.shape == (batch, nheads, seqlen_q, seqlen_k) and bias.dtype == np.float64, ctx
        left, right = window
        if causal:
            right = 0
        for b in range(batch):
            sq = seqlen_q if q_lengths is None else min(max(int(q_lengths[b]), 0), seqlen_q)
            sk = seqlen_k if kv_lengths is None else min(max(int(kv_lengths[b]), 0), seqlen_k)
            for i in range(seqlen_q):
                for j in range(seqlen_k):
                    want = _visible_by_formula(i, j, sq, sk, left, right, nsink)
                    assert visible[b, 0, i, j] == want, f"b={b} i={i} j={j}; {ctx}"
                    for h in range(nheads):
                        slope = float(slopes[h] if slopes.ndim == 1 else slopes[b, h])
                        assert bias[b, h, i, j] == -slope * abs(i + sk - sq - j), ctx
    assert feature_mask_bias(2, 3, 4, 5, False)[1] is None
    # Without features the mask is the plain causal one (or all-visible).
    assert np.array_equal(feature_mask_bias(1, 1, 5, 7, True)[0][0, 0], np.tril(np.ones((5, 7), bool), 2))
    assert feature_mask_bias(1, 1, 5, 7, False)[0].all()


def _loop_attention(q, k, v, causal, scale, feats):
    """Textbook attention with the features, one row at a time in Python floats (from _features.py's text)."""
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    group = nheads // nheads_kv
    left, right = feats.get("window", (-1, -1))
    if causal:
        right = 0
    nsink = feats.get("num_sink_tokens", 0)
    sink = feats.get("sink_logits")
    slopes = feats.get("alibi_slopes")
    cap = feats.get("softcap", 0.0)
    sq_all, sk_all = _valid_lengths(feats, batch, seqlen_q, seqlen_k)
    out = np.zeros((batch, seqlen_q, nheads, head_dim))
    lse = np.full((batch, nheads, seqlen_q), -np.inf)
    for b in range(batch):
        sq, sk = int(sq_all[b]), int(sk_all[b])
        for h in range(nheads):
            hk = h // group
            for i in range(sq):
                keys = [j for j in range(sk) if _visible_by_formula(i, j, sq, sk, left, right, nsink)]
                scores = []
                for j in keys:
                    s = scale * sum(float(q[b, i, h, c]) * float(k[b, j, hk, c]) for c in range(head_dim))
                    if cap > 0:
                        s = cap * math.tanh(s / cap)
                    if slopes is not None:
                        slope = float(slopes[h] if slopes.ndim == 1 else slopes[b, h])
                        s -= slope * abs(i + sk - sq - j)
                    scores.append(s)
                terms = scores + ([float(sink[h])] if sink is not None else [])
                if not terms:
                    continue
                mx = max(terms)
                total = sum(math.exp(x - mx) for x in terms)
                lse[b, h, i] = mx + math.log(total)
                for c in range(head_dim):
                    out[b, i, h, c] = sum(math.exp(s - lse[b, h, i]) * float(v[b, j, hk, c])
                                          for s, j in zip(scores, keys))
    return out, lse


@pytest.mark.parametrize("names", [("qkvlen",), ("win3_0",), ("sinktok",), ("sinklogit",), ("alibi_bh",),
                                   ("softcap5",), ("qkvlen", "sinktok", "sinklogit", "alibi_h", "softcap5")],
                         ids=lambda n: "+".join(n))
@CAUSAL
def test_reference_matches_loop(causal, names):
    seed = _new_seed()
    rng = np.random.default_rng(seed)
    batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim = 4, 6, 9, 2, 1, 5
    feats, qk_scale = _make_features(names, rng, batch, nheads, seqlen_q, seqlen_k)
    q, k, v, _ = _make_inputs(rng, np.float64, batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, qk_scale)
    ctx = _ctx(seed, causal=causal, features="+".join(names))
    want_out, want_lse = _loop_attention(q, k, v, causal, 0.7, feats)
    out, lse = attention_reference(q, k, v, causal, 0.7, **feats)
    assert out.dtype == np.float64 and lse.dtype == np.float64, ctx
    assert max_abs_err(out, want_out) < 1e-12, ctx
    assert max_abs_err(lse, want_lse) < 1e-12, ctx
    # With float64 inputs the 'input' mode rounds to float64 (a no-op) and must agree too.
    out_in, lse_in = attention_reference(q, k, v, causal, 0.7, compute_dtype="input", **feats)
    assert max_abs_err(out_in, want_out) < 1e-12, ctx
    assert max_abs_err(lse_in, want_lse) < 1e-12, ctx


def _finite_difference(f, x, eps=1e-5):
    """Central differences of the scalar f() over every element of the float64 array x (modified in place)."""
    g = np.zeros_like(x)
    for idx in np.ndindex(*x.shape):
        x0 = x[idx]
        x[idx] = x0 + eps
        up = f()
        x[idx] = x0 - eps
        down = f()
        x[idx] = x0
        g[idx] = (up - down) / (2 * eps)
    return g


@pytest.mark.parametrize("names", [("sinklogit",), ("qkvlen", "sinklogit", "win5_7"), ("sinklogit", "softcap5"),
                                   ("qkvlen", "sinktok", "sinklogit", "alibi_bh", "softcap5")],
                         ids=lambda n: "+".join(n))
@CAUSAL
def test_grad_reference_matches_finite_differences(causal, names):
    """The float64 gradients, dsink included, equal central finite differences of the float64 forward (GQA 2:1)."""
    seed = _new_seed()
    rng = np.random.default_rng(seed)
    batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim = 4, 4, 6, 2, 1, 4
    feats, qk_scale = _make_features(names, rng, batch, nheads, seqlen_q, seqlen_k)
    feats["sink_logits"] = feats["sink_logits"].astype(np.float64)
    q, k, v, dout = _make_inputs(rng, np.float64, batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, qk_scale)
    scale = 0.6
    ctx = _ctx(seed, causal=causal, features="+".join(names))

    def loss():
        out, _ = attention_reference(q, k, v, causal, scale, **feats)
        return float(np.sum(out * dout))

    analytic = attention_grad_reference(dout, q, k, v, causal, scale, **feats)
    assert len(analytic) == 4, ctx
    numeric = [_finite_difference(loss, x) for x in (q, k, v, feats["sink_logits"])]
    for name, a, n in zip(("dq", "dk", "dv", "dsink"), analytic, numeric):
        assert a.dtype == np.float64 and a.shape == n.shape, f"{name}; {ctx}"
        rel = max_abs_err(a, n) / max(np.abs(n).max(), 1e-3)
        assert rel < 1e-6, f"{name}: relative error {rel:.3g}; {ctx}"
    # dsink as stated in _features.py: -sum over b and valid rows of exp(sink - lse) * rowsum(dout * out).
    out, lse = attention_reference(q, k, v, causal, scale, **feats)
    d = (dout * out).sum(axis=-1).transpose(0, 2, 1)
    finite = np.isfinite(lse)
    p_sink = np.where(finite, np.exp(feats["sink_logits"][None, :, None] - np.where(finite, lse, 0)), 0)
    assert max_abs_err(analytic[3], -(p_sink * d).sum(axis=(0, 2))) < 1e-12, ctx


@pytest.mark.parametrize("dtype", DTYPES)
def test_grad_reference_input_mode(dtype):
    """The 'input' emulation with features returns input-dtype gradients (float32 dsink) close to the float64 ones."""
    seed = _new_seed()
    rng = np.random.default_rng(seed)
    names = ("qkvlen", "sinktok", "sinklogit", "alibi_h", "softcap5")
    feats, qk_scale = _make_features(names, rng, 4, 4, 40, 50)
    q, k, v, dout = _make_inputs(rng, dtype, 4, 40, 50, 4, 2, 32, qk_scale)
    ctx = _ctx(seed, dtype=dtype.name)
    naive = attention_grad_reference(dout, q, k, v, True, compute_dtype="input", **feats)
    ref = attention_grad_reference(dout, q, k, v, True, **feats)
    for name, n, r, x in zip(("dq", "dk", "dv"), naive, ref, (q, k, v)):
        assert n.dtype == dtype and n.shape == x.shape, f"{name}; {ctx}"
        assert r.dtype == np.float64 and r.shape == x.shape, f"{name}; {ctx}"
        assert 0 < max_abs_err(n, r) < 0.05 * np.abs(r).max(), f"{name}; {ctx}"
    assert naive[3].dtype == np.float32 and ref[3].dtype == np.float64 and naive[3].shape == (4,), ctx
    assert max_abs_err(naive[3], ref[3]) < 0.05 * np.abs(ref[3]).max(), ctx
    # Without features, the feature keywords' defaults change nothing.
    plain = attention_grad_reference(dout, q, k, v, True)
    explicit = attention_grad_reference(dout, q, k, v, True, window=(-1, -1), num_sink_tokens=0, softcap=0.0)
    for a, b in zip(plain, explicit):
        assert np.array_equal(a, b), ctx


def test_lengths_combinations_cover_edge_values():
    """The length patterns used above really include 0, 1, an odd length and the full length."""
    for seqlen in (17, 33, 40, 65, 130):
        values = set(_length_pattern(4, seqlen, 0).tolist())
        assert values == {0, 1, (seqlen // 2) | 1, seqlen}
        assert all(x % 2 == 1 for x in values if x not in (0, seqlen))
    assert _length_pattern(4, 1, 1).tolist() == [1, 1, 1, 0]
