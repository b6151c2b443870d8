"""Nearly equal scores over a few keys: the forward's output against the float64 reference.

With scores that differ by ~1e-3 (a tiny softcap, or tiny queries), the naive computation's normalized
probabilities land next to 1/n, which for n = 2, 4, 8 rounds almost exactly; the tiled algorithm's unnormalized
ones sit just below 1 (the row's largest is exactly 1). Dividing O by the exact sum of the float32 P then exceeded
2x the naive's error in 9 of 810 bfloat16 draws of this size, worst 2.53x (the CPU fuzzer's seed 260855508: 2.23x).
The forward now divides by the sum of the rounded P (cuda_src/softmax.cuh, cuflash/_cpu.py); 30 draws per
setting measured the NumPy forward's ratio below 1.3. On an H100 the GPU cases below failed once with the kernels
that divided by the float32 sum (bf16, 4 keys, softcap, head_dim 64: 2.07x, seed 4779674195997466636) and pass
with the new ones.

Each test makes DRAWS independent calls of the fuzzer's size (16 x 2 query rows, 4 heads over 2 kv heads, head_dim
16 and up), fresh inputs per draw, and applies the forward criterion to each (max error <= 2x the naive's + 1e-5).
The first failing draw is reported with its seed (replay: CUFLASH_TEST_SEED=<seed>).
"""

import math

import ml_dtypes
import numpy as np
import pytest

from _cpu_helpers import _new_seed
from cuflash._cpu import attention_forward_numpy
from cuflash._reference import attention_reference, check_close

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [pytest.param(np.dtype(np.float16), id="fp16"), pytest.param(BF16, id="bf16")]
DRAWS = 120
FACTOR, FLOOR = 2.0, 1e-5


def _draw(rng, dtype, seqlen_k, mode, head_dim=16, batch=16, seqlen_q=2, nheads=4, nheads_kv=2):
    """q, k, v (host, dtype) and the call's options: mode "softcap" (a softcap of 1e-3) or "tiny_q" (queries of size
    1e-3, no option). The values get a common offset of 0 or 1 per draw."""
    q_scale = 1e-3 if mode == "tiny_q" else 1.0
    q = (rng.standard_normal((batch, seqlen_q, nheads, head_dim)) * q_scale).astype(dtype)
    k = rng.standard_normal((batch, seqlen_k, nheads_kv, head_dim)).astype(dtype)
    v = (rng.standard_normal((batch, seqlen_k, nheads_kv, head_dim)) * 2 + rng.integers(0, 2)).astype(dtype)
    opts = {"softcap": 1e-3} if mode == "softcap" else {}
    return q, k, v, opts


def _check(out, q, k, v, opts, msg):
    scale = 1.0 / math.sqrt(q.shape[-1])
    ref, _ = attention_reference(q, k, v, False, scale, **opts)
    naive, _ = attention_reference(q, k, v, False, scale, compute_dtype="input", **opts)
    out = np.asarray(out)
    assert not np.isnan(out.astype(np.float32)).any(), f"NaN in out; {msg}"
    ok, detail = check_close(out, ref, naive, factor=FACTOR, floor=FLOOR)
    assert ok, f"out: {detail}; {msg}"


@pytest.mark.parametrize("mode", ["softcap", "tiny_q"])
@pytest.mark.parametrize("seqlen_k", [2, 3, 4, 8])
@pytest.mark.parametrize("dtype", DTYPES)
def test_near_equal_scores_numpy(dtype, seqlen_k, mode):
    seed = _new_seed()
    rng = np.random.default_rng(seed)
    for i in range(DRAWS):
        q, k, v, opts = _draw(rng, dtype, seqlen_k, mode)
        out, _ = attention_forward_numpy(q, k, v, False, 1.0 / math.sqrt(q.shape[-1]), 64, 64, **opts)
        _check(out, q, k, v, opts, f"seed={seed} draw {i} ({dtype}, seqlen_k={seqlen_k}, {mode})")


# ---- the GPU kernels: the mma.sync forward (head_dim 16), the wgmma / warp-specialized ones on sm_90 (64, 128), plain
# and with a softcap (the feature kernels); and the decode kernel (attention_with_kvcache, cache lengths 2-8). ----


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [16, 64, 128])
@pytest.mark.parametrize("mode", ["softcap", "tiny_q"])
@pytest.mark.parametrize("seqlen_k", [2, 4, 8])
@pytest.mark.parametrize("dtype", DTYPES)
def test_near_equal_scores_gpu(dtype, seqlen_k, mode, head_dim):
    from test_gpu_features import _dev, _host, _import_cuflash, poison

    cf = _import_cuflash()
    seed = _new_seed()
    rng = np.random.default_rng(seed)
    poison()
    for i in range(DRAWS // 2):
        q, k, v, opts = _draw(rng, dtype, seqlen_k, mode, head_dim=head_dim)
        out = _host(cf.attention(_dev(q), _dev(k), _dev(v), **opts))
        _check(out, q, k, v, opts, f"seed={seed} draw {i} ({dtype}, seqlen_k={seqlen_k}, {mode}, d{head_dim})")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_near_equal_scores_decode_gpu(dtype):
    from test_gpu_features import _dev, _host, _import_cuflash, poison

    cf = _import_cuflash()
    seed = _new_seed()
    rng = np.random.default_rng(seed)
    poison()
    for i in range(DRAWS // 2):
        seqlen_k = int(rng.choice([2, 4, 8]))
        q, k, v, _ = _draw(rng, dtype, seqlen_k, "tiny_q", head_dim=64, seqlen_q=1)
        # A cache of capacity 16 holding seqlen_k keys per entry (the rest random, never read).
        kc = rng.standard_normal((16, 16, 2, 64)).astype(dtype)
        vc = rng.standard_normal((16, 16, 2, 64)).astype(dtype)
        kc[:, :seqlen_k], vc[:, :seqlen_k] = k, v
        lens = np.full(16, seqlen_k, dtype=np.int32)
        out = _host(cf.attention_with_kvcache(_dev(q), _dev(kc), _dev(vc), cache_seqlens=_dev(lens)))
        _check(out, q, k, v, {}, f"seed={seed} draw {i} ({dtype}, decode, seqlen_k={seqlen_k})")
