"""The warp-specialized sm_90a backward with the options (cuda_src/flash_bwd_sm90_ws.cu and, at
head_dim 256, flash_bwd_sm90_ws256.cu, FEAT; the default; CUFLASH_BWD_WS_FEAT=0 turns it off):
sliding windows, sink tokens, sink logits and ALiBi, alone and in pairs, at head_dim 64, 128, 256,
both dtypes, causal or not, MHA / GQA / MQA, checked as tests/test_gpu_features.py checks them
(float64 reference gradients, 3x the naive error, exact zeros where no query sees a key,
NaN-poisoned allocators, inputs untouched). Calls with lengths or packed batches run its SEQS
variant (tested below, NaN in the rows past the sequences included); softcap keeps the cp.async
kernels (not sent here). The launched kernel's name is checked, so a fallback cannot pass for it.
Marked gpu; skipped below sm_90."""

import pytest

from test_fwd_tma_gpu import record_tma_launches
from test_gpu_features import FEATURES, FEATURES_BY_NAME, cf, fresh_seed, run_padded_case  # noqa: F401

pytestmark = pytest.mark.gpu

SHAPES = ((113, 203), (256, 256), (300, 77), (1, 300), (190, 190), (77, 300), (128, 333), (257, 129))
HEADS = ((4, 4), (4, 2), (4, 1))
NAMES = [f.name for f in FEATURES if not f.lengths and not f.softcap]
# Feature sets that a call reduces to plain attention (cuflash folds them away): the plain kernel runs.
PLAIN_EQUIVALENT = {("win5000", False), ("win5000", True), ("sinktok_nowin", False), ("sinktok_nowin", True),
                    ("winm1_17", True)}


def _suffix(kind, head_dim, seqs=False):
    """The end of the launched kernel's name: kind ("_feat" or "_feat_seqs"), "_red" where the kernel
    adds dQ from registers (_config.bwd_ws_dq_red, by the head_dim it runs at), "_tma"."""
    from cuflash import _config

    d = head_dim if head_dim in _config.BWD_WS_HEAD_DIMS else _config.bwd_pad_head_dim("sm_90a", head_dim)
    return kind + ("_red" if _config.bwd_ws_dq_red(d, seqs) else "") + "_tma"


@pytest.fixture
def ws_feat(monkeypatch):
    # (CUFLASH_BWD_SINGLE=0: the feature sets that fold to plain attention keep the warp-specialized kernel)
    names = record_tma_launches(monkeypatch, CUFLASH_BWD_SINGLE="0", CUFLASH_BWD_WS="1", CUFLASH_BWD_WS_FEAT="1")
    yield names
    from cuflash import _plan

    _plan.CACHE.clear()


def _params():
    out = []
    for i, name in enumerate(NAMES):
        for j, d in enumerate((64, 128, 256)):
            for c, causal in enumerate((False, True)):
                dtype = ("float16", "bfloat16")[(i + j + c) % 2]
                sq, sk = SHAPES[(3 * i + j + 5 * c) % len(SHAPES)]
                h, hkv = HEADS[(i + j + c) % 3]
                out.append(pytest.param(name, dtype, causal, d, sq, sk, h, hkv,
                                        id=f"{name}-{dtype}-{'causal' if causal else 'full'}-d{d}-q{sq}k{sk}-h{h}kv{hkv}"))
    return out


@pytest.mark.parametrize("feature,dtype,causal,head_dim,seqlen_q,seqlen_k,nheads,nheads_kv", _params())
def test_ws_feat_backward(cf, ws_feat, feature, dtype, causal, head_dim, seqlen_q, seqlen_k, nheads, nheads_kv):
    fs = FEATURES_BY_NAME[feature]
    n0 = len(ws_feat)
    label = f"ws bwd feat {feature} {dtype} causal={causal} d={head_dim} {seqlen_q}x{seqlen_k} h={nheads}/{nheads_kv}"
    run_padded_case(cf, seed=fresh_seed(), dtype=dtype, batch=2, sq=seqlen_q, sk=seqlen_k, h=nheads, hkv=nheads_kv,
                    d=head_dim, causal=causal, deterministic=False, fs=fs, label=label)
    bwd = [n for n in ws_feat[n0:] if n.startswith("bwd90ws_")]
    want = "_tma" if (feature, causal) in PLAIN_EQUIVALENT else _suffix("_feat", head_dim)
    assert bwd and all(n.endswith(want) for n in bwd), (label, ws_feat[n0:])


def _pad_params():
    """Head_dim pad-up (cuflash/_config.py bwd_pad_head_dim): the options at head dims 32 to 248 run
    the FEAT kernel of 64, 128 or 256 through maps whose columns past head_dim read as zeros."""
    out = []
    for i, name in enumerate(NAMES[::2]):
        d = (40, 96, 72, 120, 32, 200, 136)[i % 7]
        causal = i % 2 == 1
        dtype = ("float16", "bfloat16")[i % 2]
        sq, sk = SHAPES[(3 * i + 2) % len(SHAPES)]
        h, hkv = HEADS[i % 3]
        out.append(pytest.param(name, dtype, causal, d, sq, sk, h, hkv,
                                id=f"{name}-{dtype}-{'causal' if causal else 'full'}-d{d}-q{sq}k{sk}-h{h}kv{hkv}"))
    return out


@pytest.mark.parametrize("feature,dtype,causal,head_dim,seqlen_q,seqlen_k,nheads,nheads_kv", _pad_params())
def test_ws_feat_backward_padded_head_dim(cf, ws_feat, feature, dtype, causal, head_dim, seqlen_q, seqlen_k, nheads,
                                          nheads_kv):
    from cuflash import _config

    fs = FEATURES_BY_NAME[feature]
    n0 = len(ws_feat)
    label = f"ws bwd feat pad-up {feature} {dtype} causal={causal} d={head_dim} {seqlen_q}x{seqlen_k} h={nheads}/{nheads_kv}"
    run_padded_case(cf, seed=fresh_seed(), dtype=dtype, batch=2, sq=seqlen_q, sk=seqlen_k, h=nheads, hkv=nheads_kv,
                    d=head_dim, causal=causal, deterministic=False, fs=fs, label=label)
    bwd = [n for n in ws_feat[n0:] if n.startswith("bwd90ws_")]
    want = "_tma" if (feature, causal) in PLAIN_EQUIVALENT else _suffix("_feat", head_dim)
    pad = _config.bwd_pad_head_dim("sm_90a", head_dim)
    assert bwd and all(n.endswith(want) and f"_d{pad}_" in n for n in bwd), (label, ws_feat[n0:])


# Per-sequence lengths (the kernel's SEQS): padded batches with q_lengths / kv_lengths (a batch of 5
# with empty, one-row and odd lengths) and packed batches (attention_varlen), with and without the
# other options; rows past a sequence reach shared memory as they are in memory and are zeroed there.
LEN_NAMES = [f.name for f in FEATURES if f.lengths and not f.softcap]


def _len_params():
    out = []
    for i, name in enumerate(LEN_NAMES):
        for j, d in enumerate((64, 128, 96, 256, 200)):
            causal = (i + j) % 2 == 1
            dtype = ("float16", "bfloat16")[(i + 2 * j) % 2]
            sq, sk = SHAPES[(2 * i + 3 * j) % len(SHAPES)]
            h, hkv = HEADS[(i + j) % 3]
            out.append(pytest.param(name, dtype, causal, d, sq, sk, h, hkv,
                                    id=f"{name}-{dtype}-{'causal' if causal else 'full'}-d{d}-q{sq}k{sk}-h{h}kv{hkv}"))
    return out


@pytest.mark.parametrize("feature,dtype,causal,head_dim,seqlen_q,seqlen_k,nheads,nheads_kv", _len_params())
def test_ws_seqs_backward_lengths(cf, ws_feat, feature, dtype, causal, head_dim, seqlen_q, seqlen_k, nheads,
                                  nheads_kv):
    from test_gpu_features import LENGTHS_BATCH

    fs = FEATURES_BY_NAME[feature]
    n0 = len(ws_feat)
    label = f"ws bwd seqs {feature} {dtype} causal={causal} d={head_dim} {seqlen_q}x{seqlen_k} h={nheads}/{nheads_kv}"
    run_padded_case(cf, seed=fresh_seed(), dtype=dtype, batch=LENGTHS_BATCH, sq=seqlen_q, sk=seqlen_k, h=nheads,
                    hkv=nheads_kv, d=head_dim, causal=causal, deterministic=False, fs=fs, label=label)
    bwd = [n for n in ws_feat[n0:] if n.startswith("bwd90ws_")]
    assert bwd and all(n.endswith(_suffix("_feat_seqs", head_dim, True)) for n in bwd), (label, ws_feat[n0:])


@pytest.mark.parametrize("feature,dtype,causal,head_dim,cross", [("plain", "bfloat16", True, 64, False),
                                                                 ("win5_7", "float16", False, 128, True),
                                                                 ("alibi_bh", "bfloat16", False, 128, False),
                                                                 ("sinklogits", "float16", True, 96, True),
                                                                 ("win3_0_sinktok2", "bfloat16", True, 64, True),
                                                                 ("alibi_h", "float16", True, 40, False),
                                                                 ("win5_7", "bfloat16", True, 256, True),
                                                                 ("plain", "float16", False, 200, False)])
def test_ws_seqs_backward_varlen(cf, ws_feat, feature, dtype, causal, head_dim, cross):
    """Packed batches: tests/test_gpu_features.py's test_varlen (lengths 0, 1 and odd ones, rows past
    cu_seqlens[-1]; forward and backward against the reference), the backward on the SEQS kernel."""
    from test_gpu_features import test_varlen

    n0 = len(ws_feat)
    test_varlen(cf, feature, dtype, causal, head_dim, 4, 2, cross, False)
    bwd = [n for n in ws_feat[n0:] if n.startswith("bwd90ws_")]
    assert bwd and all(n.endswith(_suffix("_feat_seqs", head_dim, True)) for n in bwd), ws_feat[n0:]


@pytest.mark.parametrize("head_dim,causal,packed", [(64, True, False), (128, False, False), (128, True, True),
                                                    (96, False, True), (256, True, True), (200, False, False)])
def test_ws_seqs_backward_nan_rows(ws_feat, head_dim, causal, packed):
    """Rows past the sequences (a padded batch's padding, a packed batch's rows past cu_seqlens[-1])
    hold NaN in q, k, v and dout: the gradients of the sequences' rows are finite and equal those of
    the same call with zeros there (within float32 accumulation order: dQ's atomics)."""
    import torch

    import cuflash

    seed = fresh_seed()
    g = torch.Generator(device="cuda").manual_seed(seed)
    h, hkv, dt = 4, 2, torch.bfloat16
    lq, lk = [37, 130, 5, 64], [200, 7, 99, 64]

    def rnd(*shape):
        return torch.randn(*shape, device="cuda", generator=g).to(dt)

    if packed:
        cq = torch.tensor([0] + list(__import__("itertools").accumulate(lq)), device="cuda", dtype=torch.int32)
        ck = torch.tensor([0] + list(__import__("itertools").accumulate(lk)), device="cuda", dtype=torch.int32)
        tq, tk = int(cq[-1]) + 40, int(ck[-1]) + 40
        q, dout = rnd(tq, h, head_dim), rnd(tq, h, head_dim)
        k, v = rnd(tk, hkv, head_dim), rnd(tk, hkv, head_dim)
        pad_q = torch.zeros(tq, dtype=torch.bool, device="cuda")
        pad_q[int(cq[-1]):] = True
        pad_k = torch.zeros(tk, dtype=torch.bool, device="cuda")
        pad_k[int(ck[-1]):] = True
    else:
        sq, sk = max(lq), max(lk)
        q, dout = rnd(len(lq), sq, h, head_dim), rnd(len(lq), sq, h, head_dim)
        k, v = rnd(len(lq), sk, hkv, head_dim), rnd(len(lq), sk, hkv, head_dim)
        ql = torch.tensor(lq, device="cuda", dtype=torch.int32)
        kl = torch.tensor(lk, device="cuda", dtype=torch.int32)
        pad_q = torch.arange(sq, device="cuda")[None, :] >= ql[:, None]
        pad_k = torch.arange(sk, device="cuda")[None, :] >= kl[:, None]

    def grads(fill):
        qq, dd, kk, vv = (x.clone() for x in (q, dout, k, v))
        for x, m in ((qq, pad_q), (dd, pad_q), (kk, pad_k), (vv, pad_k)):
            x[m] = fill
        if packed:
            out, lse = cuflash.attention_varlen(qq, kk, vv, cq, ck, max(lq), max(lk), causal=causal, return_lse=True)
            out[pad_q] = fill
            return cuflash.attention_varlen_backward(dd, qq, kk, vv, out, lse, cq, ck, max(lq), max(lk), causal=causal)
        out, lse = cuflash.attention(qq, kk, vv, causal=causal, return_lse=True, q_lengths=ql, kv_lengths=kl)
        out[pad_q] = fill
        return cuflash.attention_backward(dd, qq, kk, vv, out, lse, causal=causal, q_lengths=ql, kv_lengths=kl)

    n0 = len(ws_feat)
    ref = grads(0.0)
    got = grads(float("nan"))
    assert any(n.endswith(_suffix("_feat_seqs", head_dim, True)) for n in ws_feat[n0:]), ws_feat[n0:]
    for name, a, b, m in (("dq", got[0], ref[0], ~pad_q), ("dk", got[1], ref[1], ~pad_k), ("dv", got[2], ref[2], ~pad_k)):
        a, b = a[m].float(), b[m].float()
        assert torch.isfinite(a).all(), (name, seed, head_dim, causal, packed)
        assert torch.allclose(a, b, atol=2e-2, rtol=2e-2), (name, seed, float((a - b).abs().max()))
