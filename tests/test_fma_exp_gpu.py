"""The wgmma forwards' exponent (cuda_src/softmax.cuh prepare_in_place): p = exp2(fma(s, scale_log2, -base))
while every row of a warp has |base| < FMA_EXP_LIMIT = 2^16 (log2 units), else the tile's scores are first
rounded to s * scale_log2 and p = exp2(s' - base), the form whose largest p is exactly 1.

The inputs put each row's logits on an offset chosen per row (0, +-0.9 * 2^16, +-1.1 * 2^16 or +-2^20 log2
units, the rows of one warp drawn at random, so warps mix rows on both sides of the limit) plus an ordinary
spread of a few log2 units. q and k hold small integers, with q's column 0 the row's offset and k's column
0 a constant, so every score is an integer below 2^24 and the fp32 products hold it exactly: the only
errors left are the kernels' own. Checked against the float64 reference:
  out within (2 eps + 2 ulp(offset) ln 2) max|v| per row, eps the dtype's (P is rounded to it) and
    ulp(offset) the float32 spacing at the row's logits (the rounded form's error; the fma form's is
    smaller), NaN-filled memory first;
  lse within 4 ulp(|lse|) + 1e-4.
The key lengths pick the kernels as in tests/test_lazy_rescale_gpu.py (head_dim 64: the TMA variant at
300 keys, the warp-specialized kernel at 2500 / 4500; 128 and 256: warp-specialized), plus the options'
kernel (window). Marked gpu."""

import math

import numpy as np
import pytest

from test_gpu_forward import fresh_seed, poison_allocators, seed_msg

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu

LIMIT = 2.0 ** 16
OFFSETS = [0.0, 0.9 * LIMIT, -0.9 * LIMIT, 1.1 * LIMIT, -1.1 * LIMIT, 2.0 ** 20, -(2.0 ** 20)]
K0 = 250.0  # k's column 0: exact in fp16 and bf16


def offset_qkv(g, b, sq, sk, h, d, dtype):
    """q, k, v (CPU, dtype) and each row's offset in log2 units (b, sq, h)."""
    scale_log2 = math.log2(math.e) / math.sqrt(d)
    q = torch.randint(-2, 3, (b, sq, h, d), generator=g).float()
    k = torch.randint(-2, 3, (b, sk, h, d), generator=g).float()
    v = torch.randn(b, sk, h, d, generator=g)
    pick = torch.randint(0, len(OFFSETS), (b, sq, h), generator=g)
    target = torch.tensor(OFFSETS)[pick]
    q[..., 0] = (target / (K0 * scale_log2)).to(dtype).float()  # the row's offset, as the dtype holds it
    k[..., 0] = K0
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    offset = q[..., 0].double() * K0 * scale_log2
    assert q[..., 0].double().abs().max() * K0 + 4 * (d - 1) < 2 ** 24  # integer scores, held exactly
    return q, k, v, offset


def ulp32(x):
    """float32's spacing at |x| (elementwise, float64 tensors)."""
    e = torch.floor(torch.log2(x.abs().clamp(min=1.0)))
    return torch.pow(2.0, e - 23)


@pytest.mark.parametrize("head_dim,seqlen_k,window", [(64, 300, None), (64, 2500, None), (64, 4500, None),
                                                      (128, 300, None), (128, 1100, None), (256, 300, None),
                                                      (256, 1100, None), (128, 1100, (300, 40)), (64, 700, (100, 7))])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_fma_exp_matches_reference(dtype, causal, head_dim, seqlen_k, window):
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    import cuflash
    from cuflash._reference import attention_reference

    seed = fresh_seed()
    g = torch.Generator(device="cpu").manual_seed(seed)
    dt = getattr(torch, dtype)
    b, sq, h = 1, 256, 2
    q, k, v, offset = offset_qkv(g, b, sq, seqlen_k, h, head_dim, dt)
    msg = seed_msg(seed, f"fma exp {dtype} d{head_dim} causal={causal} sk={seqlen_k} window={window}")
    kw = {} if window is None else {"window": (window[0], 0) if causal else window}  # causal means right = 0
    qc, kc, vc = (x.cuda() for x in (q, k, v))
    poison_allocators(q.numel() * 2 + b * h * sq * 4)
    out, lse = cuflash.attention(qc, kc, vc, causal=causal, return_lse=True, **kw)
    ref, ref_lse = attention_reference(q.double().numpy(), k.double().numpy(), v.double().numpy(), causal, **kw)
    ref, ref_lse = torch.from_numpy(ref), torch.from_numpy(ref_lse)  # (b, sq, h, d), (b, h, sq)

    out64, lse64 = out.double().cpu(), lse.double().cpu()
    assert not torch.isnan(out64).any(), f"out has NaN; {msg}"
    assert not torch.isnan(lse64).any(), f"lse has NaN; {msg}"
    eps = torch.finfo(dt).eps
    vmax = v.double().abs().max().item()
    tol = (2 * eps + 2 * ulp32(offset) * math.log(2)) * vmax + 1e-6  # (b, sq, h)
    err = (out64 - ref).abs().amax(-1)
    bad = err > tol
    assert not bad.any(), (f"out off on {int(bad.sum())} rows; worst err {err[bad].max():.4g} against "
                           f"{tol[bad].min():.4g}, offsets {sorted(set(offset[bad].tolist()))[:4]}; {msg}")
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isneginf(lse64), ~fin), f"lse -inf rows differ; {msg}"
    ldiff = (lse64 - ref_lse).abs()[fin]
    ltol = (4 * ulp32(ref_lse) + 1e-4)[fin]
    assert (ldiff <= ltol).all(), f"lse off: max {(ldiff - ltol).max():.4g} over; {msg}"
