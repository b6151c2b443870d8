"""The warp-specialized sm_90a backward with the options (cuda_src/flash_bwd_sm90_ws.cu, FEAT;
the default; CUFLASH_BWD_WS_FEAT=0 turns it off): sliding windows, sink tokens, sink logits and ALiBi, alone and in pairs,
at head_dim 64 and 128, both dtypes, causal or not, MHA / GQA / MQA, checked as
tests/test_gpu_features.py checks them (float64 reference gradients, 3x the naive error, exact
zeros where no query sees a key, NaN-poisoned allocators, inputs untouched). Calls with lengths,
packed batches or softcap keep the cp.async kernels (not sent here). The launched kernel's name is
checked, so a fallback cannot pass for it. Marked gpu; skipped below sm_90."""

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


@pytest.fixture
def ws_feat(monkeypatch):
    names = record_tma_launches(monkeypatch, CUFLASH_BWD_WS="1", CUFLASH_BWD_WS_FEAT="1")
    yield names
    from cuflash import _plan

    _plan.CACHE.clear()


def _params():
    out = []
    for i, name in enumerate(NAMES):
        for j, d in enumerate((64, 128)):
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
    want = "_tma" if (feature, causal) in PLAIN_EQUIVALENT else "_feat_tma"
    assert bwd and all(n.endswith(want) for n in bwd), (label, ws_feat[n0:])


def _pad_params():
    """Head_dim pad-up (cuflash/_config.py bwd_pad_head_dim): the options at head dims 32 to 120 run
    the FEAT kernel of 64 or 128 through maps whose columns past head_dim read as zeros."""
    out = []
    for i, name in enumerate(NAMES[::2]):
        d = (40, 96, 72, 120, 32)[i % 5]
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
    want = "_tma" if (feature, causal) in PLAIN_EQUIVALENT else "_feat_tma"
    pad = _config.bwd_pad_head_dim("sm_90a", head_dim)
    assert bwd and all(n.endswith(want) and f"_d{pad}_" in n for n in bwd), (label, ws_feat[n0:])
