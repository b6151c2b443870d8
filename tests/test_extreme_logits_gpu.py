"""Logits near 2^31 (q and k of +-59904, the largest value fp16 and bf16 share in this range): the
forward's P and the backward's P must stay in [0, 1] however the row max and lse round
(cuda_src/softmax.cuh: s * scale is rounded before the max is subtracted; the backward caps P at 1).
Before, P = exp2(fma(s, scale, -m)) took m's rounding error (up to 128 there) as its exponent and
gave inf, then NaN, from finite input (the GPU fuzzer's find of 2026-11-23; its case replays in
tests/test_fuzz_inputs.py REGRESSIONS). Every kernel family: head_dim 8 and 72 (mma.sync), 64 / 128 /
256 (the sm_90a TMA and warp-specialized forwards and the wgmma backward where the GPU has them),
causal or not. Checked: nothing is NaN, |out| <= max |v| (a convex combination of v's rows), and
out equals the float64 reference where the largest logit of a row is clear of the rest (ties and
near-ties, which float32 logits of this size cannot order, are left out). Marked gpu."""

import math

import pytest

from test_gpu_forward import fresh_seed, poison_allocators, seed_msg

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu

HUGE = 59904.0


@pytest.mark.parametrize("head_dim", [8, 64, 72, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_huge_logits_stay_finite(head_dim, causal, dtype):
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    import cuflash

    seed = fresh_seed()
    g = torch.Generator(device="cpu").manual_seed(seed)
    dt = getattr(torch, dtype)
    b, sq, sk, h = 2, 150, 300, 2
    sign = lambda shape: (torch.randint(0, 2, shape, generator=g) * 2 - 1).to(dt) * HUGE
    q = sign((b, sq, h, head_dim)).cuda().requires_grad_()
    k = sign((b, sk, h, head_dim)).cuda().requires_grad_()
    v = torch.randn(b, sk, h, head_dim, generator=g).to(dt).cuda().requires_grad_()
    msg = seed_msg(seed, f"huge logits {dtype} d{head_dim} causal={causal}")
    poison_allocators(64 << 20)
    out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    for name, x in (("out", out), ("lse", lse), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert not torch.isnan(x).any(), f"{name} has NaN; {msg}"
    assert out.abs().max() <= v.abs().max(), msg

    # float64 reference where the row's best logit leads the second by more than float32 can blur
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) / math.sqrt(head_dim)
    if causal:
        qi = torch.arange(sq, device=s.device)[:, None]
        kj = torch.arange(sk, device=s.device)[None, :]
        s = s.masked_fill(kj > qi + sk - sq, float("-inf"))
    top2 = s.topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > 2e-5 * top2[..., 0].abs() + 1.0
    ref = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), v.double())
    rows = clear.permute(0, 2, 1)  # (b, q, h)
    if rows.any():
        err = (out.double() - ref).abs()[rows].max().item()
        assert err <= 2 * torch.finfo(dt).eps * v.abs().max().item() + 1e-6, f"err {err}; {msg}"
