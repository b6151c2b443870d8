"""The warp-specialized sm_90a forward with the optional features (cuda_src/flash_fwd_sm90_ws.cu,
FEAT; padded batches): every feature set of tests/test_gpu_features.py at head_dim 64, 128 and 256,
checked as that file checks them (float64 reference, 2x the naive error, NaN-poisoned allocators,
exact zeros and -inf where the semantics demand them), with CUFLASH_FWD_WS=1 so that narrow windows
take the kernel too; the launched kernel's name is checked, so a fallback cannot pass for it.

TMA reads whole tensors, so a padded batch's rows past q_lengths / kv_lengths reach shared memory as
they are in memory (the cp.async kernels zero-fill them): test_nan_padding fills them with NaN and
expects the result of the zero-padded inputs. Marked gpu; skipped below sm_90."""

import math

import numpy as np
import pytest

from test_fwd_tma_gpu import record_tma_launches
from test_gpu_features import (FEATURES, FEATURES_BY_NAME, cf, LENGTHS_BATCH, NP_DTYPES, _dev, _host, api_kwargs,
                               check_lse, check_out, check_padding_forward, describe, forward_refs, fresh_seed,
                               make_inputs, materialize, poison, run_padded_case, seed_msg, visible_padded)

pytestmark = pytest.mark.gpu

SHAPES = ((113, 203), (256, 256), (300, 77), (1, 300), (190, 190), (77, 300), (128, 333), (257, 129))
HEADS = ((4, 4), (4, 2), (4, 1))


@pytest.fixture
def ws_feat(monkeypatch):
    names = record_tma_launches(monkeypatch, CUFLASH_FWD_WS="1", CUFLASH_FWD_TMA=None)
    yield names
    from cuflash import _plan

    _plan.CACHE.clear()


# Feature sets that a call reduces to plain attention (cuflash folds them away: a window wider than
# both sequences, sink tokens without a window, causal with an unbounded left): the plain
# warp-specialized kernel runs them.
PLAIN_EQUIVALENT = {("win5000", False), ("win5000", True), ("sinktok_nowin", False), ("sinktok_nowin", True),
                    ("winm1_17", True)}


def _assert_ws_feat(names, n0, label, feature=None, causal=None):
    fired = names[n0:]
    want = "fwd90ws_" if (feature, causal) in PLAIN_EQUIVALENT else "_feat"
    assert fired and all(n.startswith("fwd90ws_") and want in n for n in fired), (label, fired)


def _params():
    out = []
    for i, fs in enumerate(FEATURES):
        for j, d in enumerate((64, 128, 256)):
            dtype = ("float16", "bfloat16")[(i + j) % 2]
            causal = (i + 2 * j) % 3 == 1
            sq, sk = SHAPES[(3 * i + j) % len(SHAPES)]
            h, hkv = HEADS[(i + j) % 3]
            out.append(pytest.param(fs.name, dtype, causal, d, sq, sk, h, hkv,
                                    id=f"{fs.name}-{dtype}-{'causal' if causal else 'full'}-d{d}-q{sq}k{sk}-h{h}kv{hkv}"))
    return out


@pytest.mark.parametrize("feature,dtype,causal,head_dim,seqlen_q,seqlen_k,nheads,nheads_kv", _params())
def test_ws_feat_forward(cf, ws_feat, feature, dtype, causal, head_dim, seqlen_q, seqlen_k, nheads, nheads_kv):
    fs = FEATURES_BY_NAME[feature]
    n0 = len(ws_feat)
    label = f"ws feat {feature} {dtype} causal={causal} d={head_dim} {seqlen_q}x{seqlen_k} h={nheads}/{nheads_kv}"
    run_padded_case(cf, seed=fresh_seed(), dtype=dtype, batch=LENGTHS_BATCH if fs.lengths else 2, sq=seqlen_q,
                    sk=seqlen_k, h=nheads, hkv=nheads_kv, d=head_dim, causal=causal, deterministic=False, fs=fs,
                    label=label, backward=False)
    _assert_ws_feat(ws_feat, n0, label, feature, causal)


def _pad_params():
    """Head_dim pad-up (cuflash/_config.py fwd_pad_head_dim): feature sets at head dims 72 to 248, which
    run the kernel of 128 or 256 with the maps reading the columns past head_dim as zeros."""
    out = []
    for i, fs in enumerate(FEATURES[::3]):
        d = (72, 96, 136, 200, 248)[i % 5]
        dtype = ("float16", "bfloat16")[i % 2]
        causal = i % 3 == 1
        sq, sk = SHAPES[(5 * i + 1) % len(SHAPES)]
        h, hkv = HEADS[i % 3]
        out.append(pytest.param(fs.name, dtype, causal, d, sq, sk, h, hkv,
                                id=f"{fs.name}-{dtype}-{'causal' if causal else 'full'}-d{d}-q{sq}k{sk}-h{h}kv{hkv}"))
    return out


def _pad_small_params():
    """Pad-up below 64 (fwd_pad_head_dim, feat=True): every feature set once at head dims 24 to 56,
    which run the feature kernel of 64 (at every length here: CUFLASH_FWD_WS=1)."""
    out = []
    for i, fs in enumerate(FEATURES):
        d = (24, 32, 40, 48, 56)[i % 5]
        dtype = ("bfloat16", "float16")[(i // 5) % 2]
        causal = i % 3 == 2
        sq, sk = SHAPES[(3 * i + 2) % len(SHAPES)]
        h, hkv = HEADS[(i + 1) % 3]
        out.append(pytest.param(fs.name, dtype, causal, d, sq, sk, h, hkv,
                                id=f"{fs.name}-{dtype}-{'causal' if causal else 'full'}-d{d}-q{sq}k{sk}-h{h}kv{hkv}"))
    return out


@pytest.mark.parametrize("feature,dtype,causal,head_dim,seqlen_q,seqlen_k,nheads,nheads_kv",
                         _pad_params() + _pad_small_params())
def test_ws_feat_forward_padded_head_dim(cf, ws_feat, feature, dtype, causal, head_dim, seqlen_q, seqlen_k, nheads,
                                         nheads_kv):
    from cuflash import _config

    fs = FEATURES_BY_NAME[feature]
    n0 = len(ws_feat)
    label = f"ws feat pad-up {feature} {dtype} causal={causal} d={head_dim} {seqlen_q}x{seqlen_k} h={nheads}/{nheads_kv}"
    run_padded_case(cf, seed=fresh_seed(), dtype=dtype, batch=LENGTHS_BATCH if fs.lengths else 2, sq=seqlen_q,
                    sk=seqlen_k, h=nheads, hkv=nheads_kv, d=head_dim, causal=causal, deterministic=False, fs=fs,
                    label=label, backward=False)
    _assert_ws_feat(ws_feat, n0, label, feature, causal)
    pad = _config.fwd_pad_head_dim("sm_90a", head_dim, feat="mask")  # (64 below 64 under CUFLASH_FWD_WS=1)
    assert pad is not None and all(f"_d{pad}_" in n for n in ws_feat[n0:]), (label, ws_feat[n0:])


@pytest.mark.parametrize("head_dim,dtype,causal,feature", [(64, "bfloat16", True, "lens"),
                                                           (128, "float16", False, "lens+alibi"),
                                                           (128, "bfloat16", True, "all"),
                                                           (256, "float16", False, "lens+softcap"),
                                                           (96, "bfloat16", True, "lens+alibi"),
                                                           (200, "float16", False, "all"),
                                                           (40, "bfloat16", True, "lens+alibi"),
                                                           (24, "float16", False, "all")])
def test_nan_padding(cf, ws_feat, head_dim, dtype, causal, feature):
    """Rows past q_lengths and kv_lengths hold NaN: the output is that of the zero-padded inputs."""
    fs = FEATURES_BY_NAME[feature]
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    batch, sq, sk, h, hkv = LENGTHS_BATCH, 200, 333, 4, 2
    label = f"nan padding {feature} {dtype} causal={causal} d={head_dim}"
    msg = seed_msg(seed, label)
    q, k, v = make_inputs(rng, dtype, batch, sq, sk, h, hkv, head_dim, fs.qk_scale)
    feat = materialize(fs, rng, batch, sq, sk, h, causal)
    msg += " " + describe(feat)
    ql = feat.get("q_lengths")
    kl = feat.get("kv_lengths")
    assert ql is not None and kl is not None and (ql < sq).any() and (kl < sk).any(), msg
    qn, kn, vn = q.copy(), k.copy(), v.copy()
    for b in range(batch):
        q[b, ql[b]:] = 0
        k[b, kl[b]:] = 0
        v[b, kl[b]:] = 0
        qn[b, ql[b]:] = np.nan
        kn[b, kl[b]:] = np.nan
        vn[b, kl[b]:] = np.nan
    scale = fs.scale if fs.scale is not None else 1.0 / math.sqrt(head_dim)
    kw = api_kwargs(feat)
    if fs.scale is not None:
        kw["softmax_scale"] = fs.scale
    n0 = len(ws_feat)
    poison(0)
    out_d, lse_d = cf.attention(_dev(qn), _dev(kn), _dev(vn), causal=causal, return_lse=True, **kw)
    _assert_ws_feat(ws_feat, n0, label)
    out, lse = _host(out_d), _host(lse_d)
    assert out.dtype == NP_DTYPES[dtype], msg
    ref, ref_lse, naive = forward_refs(q, k, v, causal, scale, feat)
    check_out(out, ref, naive, msg)
    check_lse(lse, ref_lse, msg, (batch, h, sq))
    check_padding_forward(out, lse, visible_padded(batch, sq, sk, causal, feat), feat, msg)


@pytest.mark.parametrize("feature,dtype,causal,head_dim,cross", [("plain", "bfloat16", True, 64, False),
                                                                 ("win5_7", "float16", False, 128, True),
                                                                 ("alibi_bh", "bfloat16", False, 128, False),
                                                                 ("sinklogits", "float16", True, 256, True),
                                                                 ("win3_0_sinktok2", "bfloat16", True, 128, True),
                                                                 ("win5_7", "float16", False, 96, True),
                                                                 ("alibi_bh", "bfloat16", True, 200, False),
                                                                 ("alibi_bh", "float16", True, 40, True),
                                                                 ("win5_7", "bfloat16", False, 24, False)])
def test_ws_feat_varlen(cf, ws_feat, feature, dtype, causal, head_dim, cross):
    """Packed batches (the maps see the arrays as one sequence of all rows): tests/test_gpu_features.py's
    test_varlen (lengths 0, 1 and odd ones, rows past cu_seqlens[-1], forward and backward, against
    the reference and against each sequence alone), through the warp-specialized kernel."""
    from test_gpu_features import test_varlen

    n0 = len(ws_feat)
    test_varlen(cf, feature, dtype, causal, head_dim, 4, 2, cross, False)
    assert any(n.startswith("fwd90ws_") and "_feat" in n for n in ws_feat[n0:]), ws_feat[n0:]


@pytest.mark.parametrize("head_dim,causal", [(64, True), (128, False), (256, True), (40, False)])
def test_ws_feat_varlen_nan_tails(cf, ws_feat, head_dim, causal):
    """Rows of the packed arrays past cu_seqlens[-1] hold NaN: every sequence's output and lse equal,
    bit for bit, those of the same call with zeros there (the last sequence's last key tile reaches
    into those rows)."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    msg = seed_msg(seed, f"ws varlen nan tails d={head_dim} causal={causal}")
    lq, lk = [37, 130, 5], [200, 7, 99]
    cq = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
    tq, tk = int(cq[-1]) + 40, int(ck[-1]) + 40
    q = rng.standard_normal((tq, 4, head_dim)).astype(np.float16)
    k, v = (rng.standard_normal((tk, 2, head_dim)).astype(np.float16) for _ in range(2))
    res = []
    for fill in (0.0, np.nan):
        qf, kf, vf = q.copy(), k.copy(), v.copy()
        qf[cq[-1]:] = fill
        kf[ck[-1]:] = fill
        vf[ck[-1]:] = fill
        n0 = len(ws_feat)
        poison(0)
        out, lse = cf.attention_varlen(_dev(qf), _dev(kf), _dev(vf), _dev(cq), _dev(ck), max(lq), max(lk),
                                       causal=causal, return_lse=True)
        assert any(n.startswith("fwd90ws_") and "_feat" in n for n in ws_feat[n0:]), (msg, ws_feat[n0:])
        res.append((_host(out)[:cq[-1]], _host(lse)[:, :cq[-1]]))
    (o0, l0), (o1, l1) = res
    assert not np.isnan(o1.astype(np.float32)).any(), f"{msg}: NaN in the outputs of valid rows"
    assert np.array_equal(o0.view(np.uint16), o1.view(np.uint16)), f"{msg}: outputs differ with NaN tails"
    assert np.array_equal(l0, l1), f"{msg}: lse differs with NaN tails"
