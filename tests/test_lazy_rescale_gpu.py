"""The wgmma forwards' lazy rescale (cuda_src/softmax.cuh LAZY): a row's max moves only when a key tile's
max exceeds it by more than LAZY_LOG2 = 8 (log2 units), and a warp rescales O only where some row's max
moved. Random normal inputs almost never move the max after the first tile, so these inputs make it move:
every 32 keys (for the first 8 such steps) each row's scores rise, stay level or fall by a chosen step in
log2 units, the rows mixing the three at random so that one warp holds rows that rescale and rows that
keep their max. Steps per 32 keys: 1.9 (a 128-key tile rises 7.6: kept; 64-key tiles 3.8), 2.1 (a 128-key
tile rises 8.4: moved every tile; two 64-key tiles add up past 8) and 8.2 (moved at every tile of any
size; a kernel that kept the max would overflow p). The key lengths pick the kernels: 300 (the TMA variant
at head_dim 64) and 2500 / 4500 (head_dim 64's warp-specialized kernel, non-causal / causal); head_dims
128 and 256 run the warp-specialized kernel. Checked against the float64 reference with the forward
criterion (test_gpu_forward.assert_forward_close: out within 2x the naive computation's error + 1e-5,
lse within 1e-3 relative; NaN-filled memory pools first). Marked gpu."""

import math

import pytest

from test_gpu_forward import assert_forward_close, fresh_seed, poison_allocators, seed_msg

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu

STEP_KEYS, STEPS = 32, 8


def rising_scores_qkv(g, b, sq, sk, h, hkv, d, dtype, step_log2):
    """q, k, v (CPU, dtype) whose scores, per row, rise / stay / fall by step_log2 (log2 units at the
    default scale 1/sqrt(d)) every STEP_KEYS keys for the first STEPS steps, on top of random normal
    scores of about unit size. Column 0 of q holds the row's direction (+1, 0, -1 times a gain) and
    column 0 of k the key's step count."""
    scale = 1.0 / math.sqrt(d)
    q = torch.randn(b, sq, h, d, generator=g) * 0.5
    k = torch.randn(b, sk, hkv, d, generator=g) * 0.5
    v = torch.randn(b, sk, hkv, d, generator=g)
    direction = torch.randint(-1, 2, (b, sq, h), generator=g).float()
    gain = step_log2 / (scale * math.log2(math.e))  # q0 * k0 * scale * log2(e) = step per unit of k0
    steps = torch.clamp(torch.arange(sk) // STEP_KEYS, max=STEPS).float()
    q[..., 0] = direction * gain
    k[..., 0] = steps[None, :, None]
    return q.to(dtype), k.to(dtype), v.to(dtype)


# (head_dim, seqlen_k): the longer lengths choose head_dim 64's other kernel; 128 and 256 run one kernel
# at every length (128's pingpong kernel, which is not lazy, as a control).
SHAPES = [(64, 300), (64, 2500), (64, 4500), (128, 300), (128, 1100), (256, 300), (256, 1100)]


@pytest.mark.parametrize("step_log2", [1.9, 2.1, 8.2])
@pytest.mark.parametrize("head_dim,seqlen_k", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_lazy_rescale_matches_reference(dtype, causal, head_dim, seqlen_k, step_log2):
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    import cuflash

    seed = fresh_seed()
    g = torch.Generator(device="cpu").manual_seed(seed)
    dt = getattr(torch, dtype)
    b, sq, h, hkv = 1, 192, 4, 2
    q, k, v = (x.cuda() for x in rising_scores_qkv(g, b, sq, seqlen_k, h, hkv, head_dim, dt, step_log2))
    msg = seed_msg(seed, f"lazy rescale {dtype} d{head_dim} causal={causal} sk={seqlen_k} step={step_log2}")
    poison_allocators(q.numel() * 2 + b * h * sq * 4)
    out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
    assert_forward_close(out, lse, q, k, v, causal, 1.0 / math.sqrt(head_dim), msg)
