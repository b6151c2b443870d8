"""GPU tests of cuflash's backward pass. Every test here is marked ``gpu`` (skipped without a GPU).

Accuracy criterion, per gradient (dq, dk, dv separately), as in FlashAttention's own tests:
    max |g - g64| <= 3 * max |g_naive - g64| + 1e-4
where g64 comes from torch autograd through naive attention on float64 copies of the inputs, and
g_naive from autograd through the same naive attention run in the input dtype (matmuls in
fp16/bf16, softmax in float32: `attention_ref(..., upcast=False)`). Both references repeat the kv
heads for GQA/MQA (so autograd sums dk, dv over each group), apply the bottom-right causal mask
explicitly, and use a safe softmax: a query row that sees no key has probabilities 0 and
contributes zero gradient, never NaN. On top: no NaN or inf in any gradient, dq exactly 0 on rows
that see no key, and attention_backward leaves all six of its inputs unmodified.

The GPU allocators are refilled with NaN (tests/test_gpu_forward.py:poison_allocators) between
the forward and the backward call, so that any gradient or scratch element the kernels forget to
write (or to zero, for the atomic dq accumulator) shows up as NaN.

Seeds: as in the forward tests, every check draws fresh inputs from a non-deterministic seed shown
in the assertion message; CUFLASH_TEST_SEED=<seed> replays it.

The backward grid is the forward's grid times deterministic in {False, True}, its batch 16 below 64
query rows (grid_batch)
(2 dtypes x 9 head_dims x 2 causal x 6 seqlen pairs x 3 head configs x 2 layouts x 2 = 2592
cases). 216 cases run by default, the other 2376 are marked ``slow`` (see _grid_params).

The helpers (seeds, inputs, masks, poison, fixtures) are imported from tests/test_gpu_forward.py:
pytest's default "prepend" import mode puts tests/ on sys.path (tests/ has no __init__.py), so
``from test_gpu_forward import ...`` resolves to the module pytest itself collected.
cuflash is imported inside a fixture only, so that collection works without CUDA.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
from _cpu_helpers import DK_D_STAR_RMS_LIMIT, DQ_SPLIT_RMS_LIMIT, _batch_for, dq_split_rms_ratio, record_fired

torch = pytest.importorskip("torch")

from test_gpu_forward import (  # noqa: E402  (after the importorskip; fixtures are used by name)
    CAUSALS,
    DTYPES,
    GRID_BATCH,
    HEAD_DIMS,
    HEADS,
    LAYOUTS,
    SEQLENS,
    SHORT,
    SLEEP_CYCLES,
    TORCH_DTYPES,
    _heads_first,
    _to_torch_via_host,
    assert_forward_close,
    cf,  # noqa: F401  (fixture)
    cupy_mod,  # noqa: F401  (fixture)
    fresh_seed,
    jax_gpu,  # noqa: F401  (fixture)
    make_qkv,
    poison_allocators,
    rows_with_no_key,
    seed_msg,
    visible_mask,
)

pytestmark = pytest.mark.gpu

_NP_DTYPES = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float16": np.dtype(np.float16)}

DETERMINISTIC = (False, True)


# ---------------------------------------------------------------------------------------------
# References: torch autograd through naive attention (float64, and in the input dtype)
# ---------------------------------------------------------------------------------------------

def _safe_softmax(s: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim where masked scores are -inf and a row may be entirely masked:
    such a row gets probabilities 0 (and zero gradient) instead of NaN. The row max is detached
    (the softmax does not depend on it) and replaced by 0 on empty rows; the denominator by 1."""
    m = s.detach().amax(dim=-1, keepdim=True)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    e = torch.exp(s - m)
    denom = e.sum(dim=-1, keepdim=True)
    denom = torch.where(denom == 0, torch.ones_like(denom), denom)
    return e / denom


def attention_ref(q, k, v, causal: bool, softmax_scale: float, upcast: bool = True):
    """Naive, differentiable attention. q (b, sq, h, d), k/v (b, sk, hkv, d) -> out (b, sq, h, d).

    upcast=True: everything in float64 (out float64).
    upcast=False: the input dtype's computation: S = Q K^T in the input dtype, scale + mask +
    softmax in float32, P cast to the input dtype, out = P V in the input dtype (out in that dtype).
    """
    if upcast:
        q, k, v = (x.to(torch.float64) for x in (q, k, v))
    b, sq, h, d = q.shape
    sk = k.shape[1]
    qh = q.transpose(1, 2)
    kh = _heads_first(k, h)
    vh = _heads_first(v, h)
    s = torch.matmul(qh, kh.transpose(-1, -2))
    s = s.to(torch.float64 if upcast else torch.float32) * softmax_scale
    mask = visible_mask(sq, sk, causal, q.device)
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf)
    p = _safe_softmax(s)
    out = torch.matmul(p.to(vh.dtype), vh)
    return out.transpose(1, 2)


def reference_grads(q, k, v, dout, causal: bool, softmax_scale: float, upcast: bool = True):
    """(dq, dk, dv) of sum(attention_ref(q, k, v) * dout) by torch autograd; float64 if upcast,
    else in the input dtype."""
    dtype = torch.float64 if upcast else q.dtype
    leaves = [x.detach().to(dtype).requires_grad_(True) for x in (q, k, v)]
    out = attention_ref(*leaves, causal, softmax_scale, upcast=upcast)
    out.backward(dout.detach().to(out.dtype))
    return tuple(x.grad for x in leaves)


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    return (a.to(torch.float64) - b.to(torch.float64)).abs().max().item()


def _argmax_index(diff: torch.Tensor) -> tuple:
    idx = int(torch.argmax(diff.reshape(-1)).item())
    return tuple(int(i) for i in np.unravel_index(idx, tuple(diff.shape)))


def grad_bounds(q, k, v, dout, causal: bool, softmax_scale: float):
    """The float64 reference gradients and the per-gradient error bounds: (refs, bounds)."""
    ref = reference_grads(q, k, v, dout, causal, softmax_scale, upcast=True)
    naive = reference_grads(q, k, v, dout, causal, softmax_scale, upcast=False)
    bounds = tuple(3.0 * _max_err(n, r) + 1e-4 for n, r in zip(naive, ref))
    return ref, bounds


def assert_grads_close(grads, q, k, v, dout, causal: bool, softmax_scale: float, msg: str, refs=None):
    """Checks (dq, dk, dv) (torch tensors on q's device) against the references; see the module
    docstring for the criterion. refs: a precomputed grad_bounds(...) result."""
    ref, bounds = refs if refs is not None else grad_bounds(q, k, v, dout, causal, softmax_scale)
    for name, g, r, bound, like in zip(("dq", "dk", "dv"), grads, ref, bounds, (q, k, v)):
        assert isinstance(g, torch.Tensor), f"{msg}: {name} is {type(g)}, expected a torch.Tensor"
        assert tuple(g.shape) == tuple(like.shape), f"{msg}: {name} shape {tuple(g.shape)} != {tuple(like.shape)}"
        assert g.dtype == like.dtype, f"{msg}: {name} dtype {g.dtype} != {like.dtype}"
        assert g.device == like.device, f"{msg}: {name} on {g.device}, input on {like.device}"
        n_nan = int(torch.isnan(g).sum().item())
        assert n_nan == 0, f"{msg}: {name} has {n_nan} NaN (unwritten output or scratch?)"
        assert torch.isfinite(g).all().item(), f"{msg}: {name} has infinities"
        if g.numel() == 0:
            continue
        diff = (g.to(torch.float64) - r).abs()
        err = diff.max().item()
        assert err <= bound, (
            f"{msg}: max|{name}-ref64|={err:.4g} at (b,s,h,d)={_argmax_index(diff)} > bound {bound:.4g} "
            f"(3 * max|naive_in_dtype-ref64| + 1e-4; max|ref64|={r.abs().max().item():.4g})")
    sq, sk = q.shape[1], k.shape[1]
    empty = rows_with_no_key(sq, sk, causal, q.device)
    if empty.any().item():
        assert (grads[0][:, empty] == 0).all().item(), f"{msg}: dq must be exactly 0 on rows that see no key"


def make_dout(b, sq, h, d, dtype, layout="bshd", device="cuda"):
    """Random normal dout (b, sq, h, d) in a memory layout: bshd (contiguous), bhsd (a (b, h, s, d)
    tensor passed as .transpose(1, 2)), padded (row stride d + 24: in place), padded4 (row stride
    d + 4: not a multiple of 8 elements, so cuflash copies it)."""
    kw = dict(device=device, dtype=dtype)
    if layout in ("bshd", "mixed", "packed"):
        return torch.randn(b, sq, h, d, **kw)
    if layout == "bhsd":
        return torch.randn(b, h, sq, d, **kw).transpose(1, 2)
    if layout == "padded":
        return torch.randn(b, sq, h, d + 24, **kw)[..., :d]
    if layout == "padded4":
        return torch.randn(b, sq, h, d + 4, **kw)[..., :d]
    raise ValueError(layout)


def _bwd_poison_hint(q, k) -> int:
    """Bytes the backward allocates, about: dq, dk, dv, and float32 scratch (two values per query
    row and, on the atomic path, a dq accumulator), rows padded to a multiple of 128."""
    b, sq, h, d = q.shape
    rows = b * h * (-(-sq // 128) * 128)
    return 2 * (q.numel() + 2 * k.numel()) + 4 * rows * (d + 2)


def run_backward_and_check(cf, q, k, v, dout, *, causal, deterministic, seed, label, softmax_scale=None,
                           check_untouched=True):
    """cuflash.attention(..., return_lse=True), NaN-poison, cuflash.attention_backward, check.
    Returns (dq, dk, dv)."""
    msg = seed_msg(seed, label)
    fkw = {"causal": causal, "return_lse": True}
    bkw = {"causal": causal, "deterministic": deterministic}
    if softmax_scale is not None:
        fkw["softmax_scale"] = bkw["softmax_scale"] = softmax_scale
    out, lse = cf.attention(q, k, v, **fkw)
    inputs = (dout, q, k, v, out, lse)
    before = [t.clone() for t in inputs] if check_untouched else None
    poison_allocators(_bwd_poison_hint(q, k))
    grads = cf.attention_backward(dout, q, k, v, out, lse, **bkw)
    assert isinstance(grads, tuple) and len(grads) == 3, f"{msg}: expected (dq, dk, dv), got {type(grads)}"
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    assert_grads_close(grads, q, k, v, dout, causal, scale, msg)
    if check_untouched:
        for name, t, b in zip(("dout", "q", "k", "v", "out", "lse"), inputs, before):
            assert torch.equal(t, b), f"{msg}: attention_backward modified its input {name}"
    return grads


# ---------------------------------------------------------------------------------------------
# The backward grid
# ---------------------------------------------------------------------------------------------

def _grid_params():
    """All 2592 cases; the 2376 outside the default subset carry the `slow` mark.

    Default subset: every (dtype, head_dim, causal, seqlens) combination once (2*9*2*6 = 216 cases),
    with heads, layout and deterministic each rotated on its own:
        heads         = (i_head_dim + i_seqlens + i_dtype + 2 * i_causal) % 3
        layout        = (i_head_dim + i_seqlens + i_causal) % 2
        deterministic = (i_head_dim + i_seqlens + i_dtype) % 2
    So each (head_dim, seqlens) meets MHA, GQA and MQA, both layouts and both backward paths
    across its 4 (dtype, causal) combinations; each (dtype, head_dim, causal) meets every head
    config, layout and path across its 6 seqlen pairs, and both paths on the even pairs
    (2048/512, 512/2048) as well as on the ragged ones: every backward kernel specialization
    (dtype x head_dim x causal x even x path) runs at least once by default.
    Groups as in the forward grid (<dtype>-d<head_dim>-<causal>), so with --dist loadgroup one
    worker builds the forward and backward kernels of one (dtype, head_dim, causal).
    """
    params = []
    for i_dt, dt in enumerate(DTYPES):
        for i_hd, hd in enumerate(HEAD_DIMS):
            for i_c, causal in enumerate(CAUSALS):
                for i_sl, (sq, sk) in enumerate(SEQLENS):
                    pick = ((i_hd + i_sl + i_dt + 2 * i_c) % 3, (i_hd + i_sl + i_c) % 2, (i_hd + i_sl + i_dt) % 2)
                    group = f"{SHORT[dt]}-d{hd}-{'causal' if causal else 'full'}"
                    for i_h, (h, hkv) in enumerate(HEADS):
                        for i_l, layout in enumerate(LAYOUTS):
                            for i_det, det in enumerate(DETERMINISTIC):
                                marks = [pytest.mark.xdist_group(group)]
                                if (i_h, i_l, i_det) != pick:
                                    marks.append(pytest.mark.slow)
                                case_id = (f"{SHORT[dt]}-d{hd}-{'causal' if causal else 'full'}-q{sq}k{sk}"
                                           f"-h{h}kv{hkv}-{layout}-{'det' if det else 'atomic'}")
                                params.append(pytest.param(dt, hd, causal, sq, sk, h, hkv, layout, det,
                                                           id=case_id, marks=marks))
    return params


GRID = _grid_params()


def grid_batch(seqlen_q: int) -> int:
    """The grid's batch: GRID_BATCH (the forward grid's), but below 64 query rows the CPU tests' batch
    (tests/_cpu_helpers.py _batch_for, 16): the check compares the max error over the gradient with 3x
    the naive computation's max, and over a handful of rows that max is a noisy statistic. At batch 2 x
    1 query row x 300 keys, bf16 head_dim 8, GQA 2, the NumPy mirror of the kernels exceeds the bound in
    4 (dk) and 2 (dv) of 100000 draws (worst 1.26x and 1.39x), though its dV = round(P)^T dO rounds P once
    as the naive computation does; at batch 16 in none of 20000 (worst 0.69x, 0.78x; bench/NOTES.md,
    session 67). Found by bf16-d8-full-q1k300-h4kv2-bhsd-det (seed 14363466586248944331, batch 2: dk
    1.06x its bound)."""
    return max(GRID_BATCH, _batch_for(seqlen_q))


@pytest.mark.parametrize("dtype,head_dim,causal,seqlen_q,seqlen_k,nheads,nheads_kv,layout,deterministic", GRID)
def test_backward_grid(cf, dtype, head_dim, causal, seqlen_q, seqlen_k, nheads, nheads_kv, layout, deterministic):
    seed = fresh_seed()
    tdt = TORCH_DTYPES[dtype]
    batch = grid_batch(seqlen_q)
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, tdt, layout)
    dout = make_dout(batch, seqlen_q, nheads, head_dim, tdt, layout)
    label = (f"bwd {dtype} d={head_dim} causal={causal} b={batch} sq={seqlen_q} sk={seqlen_k} h={nheads} "
             f"hkv={nheads_kv} {layout} deterministic={deterministic}")
    run_backward_and_check(cf, q, k, v, dout, causal=causal, deterministic=deterministic, seed=seed, label=label)


# ---------------------------------------------------------------------------------------------
# API details: softmax_scale, strides, rows without keys, determinism, huge batch * heads
# ---------------------------------------------------------------------------------------------

def _small_head_dim_rms_ratio(cf, dtype, head_dim, seqlens, deterministic, seed, qkv, grad: int, draws: int):
    """The small-head_dim accuracy tests' draws: `draws` fresh (q, k, v) = qkv(batch, sq, sk, torch dtype) of 4
    query heads on 1 kv head (batch _batch_for(sq): 16 one-row entries, or 2 of 64 rows), each backward
    passing the usual gradient check (NaN-poisoned allocators); returns the RMS error of gradient `grad`
    (0 dq, 1 dk) against float64 over all draws, as a ratio to rounding the exact gradient to the dtype."""
    tdt = TORCH_DTYPES[dtype]
    sq, sk = seqlens
    batch = _batch_for(sq)
    scale = 1.0 / math.sqrt(head_dim)
    got, refs = [], []
    for i in range(draws):
        q, k, v = qkv(batch, sq, sk, tdt)
        dout = make_dout(batch, sq, 4, head_dim, tdt)
        refs_i = grad_bounds(q, k, v, dout, False, scale)
        out, lse = cf.attention(q, k, v, return_lse=True)
        poison_allocators(_bwd_poison_hint(q, k))
        grads = cf.attention_backward(dout, q, k, v, out, lse, deterministic=deterministic)
        assert_grads_close(grads, q, k, v, dout, False, scale, seed_msg(seed, f"draw {i}"), refs=refs_i)
        got.append(grads[grad].double().cpu().numpy())
        refs.append(refs_i[0][grad].cpu().numpy())
    return dq_split_rms_ratio(np.concatenate(got), np.concatenate(refs), _NP_DTYPES[dtype])


@pytest.mark.parametrize("deterministic", DETERMINISTIC)
@pytest.mark.parametrize("key_offset", [0.0, 2.0], ids=["k", "k+2"])
@pytest.mark.parametrize("seqlens", [(1, 300), (64, 1024)], ids=lambda s: f"q{s[0]}k{s[1]}")
@pytest.mark.parametrize("head_dim", [8, 16, 24])
@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_dq_small_head_dim_exact(cf, dtype, head_dim, seqlens, key_offset, deterministic):
    """Below head_dim 32 the dQ kernel computes dq to about the dtype's rounding (cuda_src/flash_bwd.cu
    DS_SPLIT_BELOW: dS as hi + lo, and D corrected from the exact sum_j P_j dP_j): dq's RMS error
    against float64, over fresh draws of 4 query heads on 1 kv head (32 one-row entries, or 8 entries
    of 64 rows), is at most DQ_SPLIT_RMS_LIMIT times that of rounding the exact dq to the dtype. Keys
    with a common component (k + 2) make dQ cancel more and weigh D's error by sum_j P_j K_j: there the
    split alone measured 2.5-3.0x, and dS rounded once more; on plain keys dS rounded once 1.4-1.7x
    (tests/_cpu_helpers.py). The draws also pass the usual gradient check, with batch 16 for one-row
    entries as in the CPU tests (tests/_cpu_helpers.py:_batch_for: a max over few rows is a noisy
    statistic). Found by the grid case bf16-d8-full-q1k300-h4kv1 (seed 10361418856339468297: dq 4.3x the
    naive error before the change)."""
    seed = fresh_seed()

    def qkv(batch, sq, sk, tdt):
        q, k, v = make_qkv(batch, sq, sk, 4, 1, head_dim, tdt)
        return q, (k.float() + key_offset).to(tdt), v

    ratio = _small_head_dim_rms_ratio(cf, dtype, head_dim, seqlens, deterministic, seed, qkv, 0,
                                      2 if seqlens[0] == 1 else 4)
    assert ratio <= DQ_SPLIT_RMS_LIMIT, seed_msg(seed, f"dq rms error {ratio:.3f} x the output rounding > "
                                                       f"{DQ_SPLIT_RMS_LIMIT} ({dtype} d{head_dim} {seqlens} k+{key_offset})")


@pytest.mark.parametrize("deterministic", DETERMINISTIC)
@pytest.mark.parametrize("seqlens", [(1, 300), (64, 1024)], ids=lambda s: f"q{s[0]}k{s[1]}")
@pytest.mark.parametrize("head_dim", [8, 16, 24])
@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_dk_small_head_dim_d_star(cf, dtype, head_dim, seqlens, deterministic):
    """Below head_dim 32 the dQ kernel runs before the dK/dV kernel and leaves each row's D* = D + E
    (E = sum_j P_j (dP_j - D), its D correction) in the scratch, so that dK's dS carries no error of
    the stored (rounded) O (cuda_src/flash_bwd.cu DS_SPLIT_BELOW). Values that share a component
    (every v_j close to one vector: dP_j close to D, so D's error is large beside dS): dk's RMS error
    against float64, over fresh draws of 4 query heads on 1 kv head, is at most DK_D_STAR_RMS_LIMIT
    times that of rounding the exact dk (the NumPy mirror: 38-64x with D from the rounded O, 1.40-1.52
    with D*). The draws also pass the usual gradient check. Found by the grid case
    bf16-d8-full-q1k300-h4kv2-bhsd-det (seed 14363466586248944331: dk 1.06x its bound)."""
    seed = fresh_seed()

    def qkv(batch, sq, sk, tdt):
        q, k, _ = make_qkv(batch, sq, sk, 4, 1, head_dim, tdt)
        c = 2.0 * torch.randn(batch, 1, 1, head_dim, device="cuda", dtype=torch.float64)
        return q, k, (c + 0.05 * torch.randn(batch, sk, 1, head_dim, device="cuda", dtype=torch.float64)).to(tdt)

    ratio = _small_head_dim_rms_ratio(cf, dtype, head_dim, seqlens, deterministic, seed, qkv, 1,
                                      2 if seqlens[0] == 1 else 3)
    assert ratio <= DK_D_STAR_RMS_LIMIT, seed_msg(seed, f"dk rms error {ratio:.3f} x the output rounding > "
                                                        f"{DK_D_STAR_RMS_LIMIT} ({dtype} d{head_dim} {seqlens})")


@pytest.mark.parametrize("dtype,head_dim,causal,seqlen_q,seqlen_k,det", [
    ("bfloat16", 24, False, 700, 2048, False), ("float16", 40, True, 300, 4096, False),
    ("bfloat16", 56, False, 2048, 2500, True), ("float16", 32, True, 4096, 4096, True),
    ("bfloat16", 48, False, 600, 600, False)])
def test_backward_after_padded_forward(cf, monkeypatch, dtype, head_dim, causal, seqlen_q, seqlen_k, det):
    """Plain forwards at head_dim 24 to 56 past FWD_PAD_SMALL_MIN_SEQLEN_K's keys run the
    warp-specialized kernel of 64 (cuflash/_config.py fwd_pad_head_dim, plain=True); their out and lse
    feed the backward of the call's head_dim (mma.sync below 32, pad-up to 64 from 32). Then the same
    with the forward on the TMA variant of 64 (fwd_pad_tma, forced)."""
    from cuflash import _plan

    for forced in (None, "1"):
        if forced:
            monkeypatch.setenv("CUFLASH_FWD_PAD_TMA", forced)
        _plan.CACHE.clear()
        try:
            _backward_after_padded_forward(cf, dtype, head_dim, causal, seqlen_q, seqlen_k, det,
                                           "" if forced is None else " (TMA variant)")
        finally:
            _plan.CACHE.clear()


def _backward_after_padded_forward(cf, dtype, head_dim, causal, seqlen_q, seqlen_k, det, what):
    seed = fresh_seed()
    tdt = TORCH_DTYPES[dtype]
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, 4, 2, head_dim, tdt)
    dout = make_dout(2, seqlen_q, 4, head_dim, tdt)
    run_backward_and_check(cf, q, k, v, dout, causal=causal, deterministic=det, seed=seed,
                           label=(f"bwd after padded fwd{what} {dtype} d{head_dim} causal={causal} "
                                  f"{seqlen_q}x{seqlen_k}"))


@pytest.mark.parametrize("dtype,causal,scale,det", [("bfloat16", False, 0.37, False), ("float16", True, 1.3, True),
                                                    ("bfloat16", True, 0.05, False)])
def test_backward_explicit_softmax_scale(cf, dtype, causal, scale, det):
    seed = fresh_seed()
    tdt = TORCH_DTYPES[dtype]
    q, k, v = make_qkv(2, 257, 320, 4, 2, 64, tdt)
    dout = make_dout(2, 257, 4, 64, tdt)
    run_backward_and_check(cf, q, k, v, dout, causal=causal, deterministic=det, seed=seed, softmax_scale=scale,
                           label=f"bwd {dtype} softmax_scale={scale} causal={causal} deterministic={det}")


@pytest.mark.parametrize("layout,dout_layout,causal,det", [("mixed", "bhsd", True, False),
                                                           ("padded", "padded", False, True),
                                                           ("packed", "padded4", True, True),
                                                           ("bhsd", "padded4", False, False),
                                                           ("bshd", "bhsd", True, True)])
def test_backward_strided_inputs(cf, layout, dout_layout, causal, det):
    """q, k, v and dout with other strides (last dim contiguous): in place, or copied when a stride
    is not a multiple of 8 elements (padded4); inputs are not modified (checked in the helper)."""
    seed = fresh_seed()
    b, s, h, d = 3, 384, 6, 64
    q, k, v = make_qkv(b, s, s, h, 6 if layout == "packed" else 3, d, torch.bfloat16, layout)
    dout = make_dout(b, s, h, d, torch.bfloat16, dout_layout)
    strides = [t.stride() for t in (q, k, v, dout)]
    run_backward_and_check(cf, q, k, v, dout, causal=causal, deterministic=det, seed=seed,
                           label=f"bwd strides {layout} dout {dout_layout} {strides} deterministic={det}")


# (sq, sk) pairs of the one-launch backward's test: one row and key; ragged; rows that see no key (causal,
# sq > sk: dq = 0 there, written by the kernel); more keys than rows; the key block full (added per head_dim).
SINGLE_SEQLENS = ((1, 1), (37, 17), (100, 64), (5, 64), (64, 40))


@pytest.mark.parametrize("causal", CAUSALS)
@pytest.mark.parametrize("head_dim", [d for d in HEAD_DIMS if d >= 32])  # (below 32: the three launches)
@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_single_launch(cf, monkeypatch, dtype, head_dim, causal):
    """The one-launch backward of short calls (flash_bwd.cu's dK/dV kernel with SINGLE: D, lse * log2(e)
    and dQ formed in the kernel; cuflash/_config.py BWD_SINGLE_MAX_ROWS): at every (sq, sk) of
    SINGLE_SEQLENS and at sk = its key block, heads, layout and the deterministic flag rotating, the
    backward is that one launch and its gradients pass the accuracy rule on NaN-poisoned memory."""
    from cuflash import _config, _launch, _plan

    monkeypatch.delenv("CUFLASH_BWD_SINGLE", raising=False)
    _plan.CACHE.clear()
    names = record_fired(monkeypatch, _launch.Launch)
    family = "sm90" if torch.cuda.get_device_capability()[0] == 9 else "sm80"
    block_n = _config.bwd_single_config(family, head_dim, dtype).block_n
    tdt = TORCH_DTYPES[dtype]
    for i, (sq, sk) in enumerate(SINGLE_SEQLENS + ((block_n, block_n),)):
        h, hkv = HEADS[(i + head_dim // 8 + causal) % len(HEADS)]
        layout, det = LAYOUTS[i % 2], bool((i + causal) % 2)
        seed = fresh_seed()
        q, k, v = make_qkv(GRID_BATCH, sq, sk, h, hkv, head_dim, tdt, layout)
        dout = make_dout(GRID_BATCH, sq, h, head_dim, tdt, layout)
        label = f"single {dtype} d={head_dim} causal={causal} sq={sq} sk={sk} h={h} hkv={hkv} {layout} det={det}"
        n = len(names)
        run_backward_and_check(cf, q, k, v, dout, causal=causal, deterministic=det, seed=seed, label=label)
        bwd = [x for x in names[n:] if x.startswith("bwd")]
        tag = {"float16": "f16", "bfloat16": "bf16"}[dtype]
        assert len(bwd) == 1 and bwd[0].startswith(f"bwd_single_{tag}_d{head_dim}_"), (label, names[n:])
    _plan.CACHE.clear()


@pytest.mark.parametrize("dtype,det", [("float16", False), ("bfloat16", True), ("bfloat16", False),
                                       ("float16", True)])
def test_backward_rows_without_keys(cf, dtype, det):
    """seqlen_q 300 > seqlen_k 77, causal bottom-right: rows 0..222 see no key -> dq rows exactly
    0, no NaN anywhere (dq, dk, dv), every row that sees two or more keys has a nonzero dq and
    every key a nonzero dv."""
    seed = fresh_seed()
    sq, sk = 300, 77
    tdt = TORCH_DTYPES[dtype]
    q, k, v = make_qkv(2, sq, sk, 4, 2, 64, tdt)
    dout = make_dout(2, sq, 4, 64, tdt)
    dq, dk, dv = run_backward_and_check(cf, q, k, v, dout, causal=True, deterministic=det, seed=seed,
                                        label=f"bwd {dtype} rows without keys deterministic={det}")
    n_empty = sq - sk
    msg = seed_msg(seed, f"rows without keys {dtype} deterministic={det}")
    for name, g in (("dq", dq), ("dk", dk), ("dv", dv)):
        assert not torch.isnan(g).any().item(), f"{msg}: {name} has NaN"
    assert (dq[:, :n_empty] == 0).all().item(), f"{msg}: dq rows 0..{n_empty - 1} must be exactly 0"
    # row n_empty sees one key only: its softmax is constant 1, so its dq is 0 up to rounding
    assert (dq[:, n_empty + 1:].abs().amax(dim=-1) > 0).all().item(), f"{msg}: dq rows that see 2+ keys are zero"
    assert (dv.abs().amax(dim=-1) > 0).all().item(), f"{msg}: some key got a zero dv"


@pytest.mark.parametrize("dtype,causal,nheads,nheads_kv,seqlen,head_dim",
                         [("bfloat16", False, 8, 8, 2048, 128), ("bfloat16", True, 8, 8, 2048, 128),
                          ("bfloat16", True, 8, 2, 2048, 128), ("float16", False, 8, 1, 1023, 64)])
def test_deterministic_bitwise(cf, dtype, causal, nheads, nheads_kv, seqlen, head_dim):
    """deterministic=True: ten backward calls give bitwise identical dq, dk, dv. Many query blocks
    per key block (seqlen 2048) make a float-atomic dq accumulation reorder between runs; the
    allocator is NaN-poisoned before each call, so a stale or unwritten element breaks equality."""
    seed = fresh_seed()
    tdt = TORCH_DTYPES[dtype]
    b = 2
    q, k, v = make_qkv(b, seqlen, seqlen, nheads, nheads_kv, head_dim, tdt)
    dout = make_dout(b, seqlen, nheads, head_dim, tdt)
    out, lse = cf.attention(q, k, v, causal=causal, return_lse=True)
    msg = seed_msg(seed, f"deterministic {dtype} causal={causal} h={nheads} hkv={nheads_kv} s={seqlen} d={head_dim}")
    first = None
    for run in range(10):
        poison_allocators(_bwd_poison_hint(q, k))
        grads = cf.attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=True)
        for name, g in zip(("dq", "dk", "dv"), grads):
            assert not torch.isnan(g).any().item(), f"{msg}: run {run}: {name} has NaN"
        if first is None:
            first = tuple(g.clone() for g in grads)
            continue
        for name, a, g in zip(("dq", "dk", "dv"), first, grads):
            if not torch.equal(a, g):
                n = int((a != g).sum().item())
                raise AssertionError(f"{msg}: run {run}: {name} differs from run 0 in {n} elements "
                                     f"(max |diff| {_max_err(a, g):.3g})")
    # and the deterministic result is a correct one (checked on one batch element to bound memory)
    sl = slice(0, 1)
    assert_grads_close(tuple(g[sl] for g in first), q[sl], k[sl], v[sl], dout[sl], causal, head_dim ** -0.5,
                       msg + " (accuracy of the deterministic result, batch 0)")


@pytest.mark.parametrize("batch,nheads,nheads_kv,causal,det", [(1, 65600, 65600, False, False),
                                                               (1, 65600, 16400, True, True),
                                                               (300, 256, 64, True, False),
                                                               (300, 256, 256, False, True)])
def test_backward_batch_times_heads_over_65535(cf, batch, nheads, nheads_kv, causal, det):
    """batch * nheads > 65535 (more than a grid's y or z dimension holds), tiny seqlen / head_dim."""
    seed = fresh_seed()
    q, k, v = make_qkv(batch, 16, 16, nheads, nheads_kv, 8, torch.bfloat16)
    dout = make_dout(batch, 16, nheads, 8, torch.bfloat16)
    run_backward_and_check(cf, q, k, v, dout, causal=causal, deterministic=det, seed=seed, check_untouched=False,
                           label=f"bwd batch={batch} nheads={nheads} nheads_kv={nheads_kv} causal={causal} "
                                 f"deterministic={det}")


# ---------------------------------------------------------------------------------------------
# Through torch autograd (torch.ops.cuflash.attention_fwd's registered backward)
# ---------------------------------------------------------------------------------------------

def _leaf_inputs(b, sq, sk, h, hkv, d, dtype, layout):
    """Leaf tensors that require grad, and the views handed to cuflash: bshd (the leaves
    themselves), bhsd (leaves (b, h, s, d), passed as .transpose(1, 2)), mixed (q bshd, k and v
    bhsd). Returns (leaves, views); the grads of the views are leaf.grad in view form."""
    kw = dict(device="cuda", dtype=dtype)
    t_q = layout == "bhsd"
    t_kv = layout in ("bhsd", "mixed")
    leaves = [torch.randn(*((b, h, sq, d) if t_q else (b, sq, h, d)), **kw),
              torch.randn(*((b, hkv, sk, d) if t_kv else (b, sk, hkv, d)), **kw),
              torch.randn(*((b, hkv, sk, d) if t_kv else (b, sk, hkv, d)), **kw)]
    for x in leaves:
        x.requires_grad_(True)
    views = [leaves[0].transpose(1, 2) if t_q else leaves[0]] + \
            [x.transpose(1, 2) if t_kv else x for x in leaves[1:]]
    return leaves, views


def _grad_view(leaf, layout_transposed: bool):
    return leaf.grad.transpose(1, 2) if layout_transposed else leaf.grad


@pytest.mark.parametrize("dtype,d,sq,sk,heads,causal,layout,det",
                         [("bfloat16", 64, 257, 257, (4, 4), True, "bshd", False),
                          ("float16", 128, 300, 77, (4, 2), True, "bhsd", True),
                          ("bfloat16", 40, 113, 203, (4, 1), False, "mixed", False),
                          ("float16", 256, 1023, 1024, (4, 2), False, "bhsd", False),
                          ("bfloat16", 96, 512, 2048, (8, 2), True, "bshd", True)])
def test_autograd_matches_reference(cf, dtype, d, sq, sk, heads, causal, layout, det):
    """loss = (cuflash.attention(q, k, v, causal) * w).sum(); loss.backward(): q.grad, k.grad,
    v.grad against the float64 reference (dout = w). A deterministic case runs backward twice
    and must give bitwise identical grads."""
    seed = fresh_seed()
    tdt = TORCH_DTYPES[dtype]
    h, hkv = heads
    b = 2
    leaves, (q, k, v) = _leaf_inputs(b, sq, sk, h, hkv, d, tdt, layout)
    w = torch.randn(b, sq, h, d, device="cuda", dtype=tdt)
    msg = seed_msg(seed, f"autograd {dtype} d={d} sq={sq} sk={sk} heads={heads} causal={causal} {layout} "
                         f"deterministic={det}")

    def step():
        for x in leaves:
            x.grad = None
        out, lse = cf.attention(q, k, v, causal, return_lse=True, deterministic=det)
        assert out.requires_grad and out.grad_fn is not None, f"{msg}: out has no autograd node"
        assert not lse.requires_grad, f"{msg}: lse must not be differentiable"
        loss = (out * w).sum()
        poison_allocators(_bwd_poison_hint(q, k))
        loss.backward()
        trans = (layout == "bhsd", layout in ("bhsd", "mixed"), layout in ("bhsd", "mixed"))
        return tuple(_grad_view(x, t) for x, t in zip(leaves, trans))

    grads = step()
    assert_grads_close(grads, q.detach(), k.detach(), v.detach(), w, causal, d ** -0.5, msg)
    if det:
        first = tuple(g.clone() for g in grads)
        again = step()
        for name, a, g in zip(("dq", "dk", "dv"), first, again):
            assert torch.equal(a, g), f"{msg}: deterministic=True: {name} differs between two backward passes"


@pytest.mark.parametrize("which", ["q", "k", "v", "kv"])
def test_autograd_partial_requires_grad(cf, which):
    """Only some inputs require grad: those get the reference gradient, the others stay None."""
    seed = fresh_seed()
    q, k, v = make_qkv(2, 190, 260, 4, 2, 64, torch.bfloat16)
    names = ("q", "k", "v")
    for name, x in zip(names, (q, k, v)):
        x.requires_grad_(name in which)
    w = torch.randn_like(q.detach())
    out = cf.attention(q, k, v, causal=True)
    (out * w).sum().backward()
    msg = seed_msg(seed, f"autograd, only {which} requires grad")
    ref, bounds = grad_bounds(q.detach(), k.detach(), v.detach(), w, True, 64 ** -0.5)
    for name, x, r, bound in zip(names, (q, k, v), ref, bounds):
        if name not in which:
            assert x.grad is None, f"{msg}: {name} does not require grad but got one"
            continue
        assert x.grad is not None, f"{msg}: {name}.grad is None"
        assert not torch.isnan(x.grad).any().item(), f"{msg}: {name}.grad has NaN"
        err = _max_err(x.grad, r)
        assert err <= bound, f"{msg}: max|{name}.grad-ref64|={err:.4g} > {bound:.4g}"


@pytest.mark.parametrize("causal", [False, True])
def test_autograd_expanded_dout(cf, causal):
    """loss = out.sum(): the incoming gradient is an expanded tensor (all strides 0)."""
    seed = fresh_seed()
    q, k, v = make_qkv(2, 200, 333, 4, 1, 128, torch.float16, "bhsd")
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
    cf.attention(*leaves, causal=causal).sum().backward()
    dout = torch.ones_like(q)
    assert_grads_close(tuple(x.grad for x in leaves), q, k, v, dout, causal, 128 ** -0.5,
                       seed_msg(seed, f"autograd, loss = out.sum(), causal={causal}"))


# ---------------------------------------------------------------------------------------------
# Streams
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode,causal,det", [("direct", False, False), ("direct", True, True),
                                             ("autograd", True, False), ("autograd", False, True)])
def test_torch_stream_delayed_producer_backward(cf, mode, causal, det):
    """On a non-default stream s: spin, then write the inputs (and dout), run the forward and the
    backward (direct attention_backward, or loss.backward() through autograd, which runs the
    backward on the forward's stream), compute the errors there. No synchronization until the host
    reads the errors. The inputs hold NaN until the delayed copies land, so a kernel launched on any
    other stream reads NaN or races, and the check fails."""
    seed = fresh_seed()
    b, sq, sk, h, hkv, d = 2, 1024, 1536, 8, 2, 128
    tdt = torch.bfloat16
    src = make_qkv(b, sq, sk, h, hkv, d, tdt)
    src_do = make_dout(b, sq, h, d, tdt)
    scale = 1 / math.sqrt(d)
    ref, bounds = grad_bounds(*src, src_do, causal, scale)
    # compile every kernel this shape needs outside the stream section
    o0, l0 = cf.attention(*src, causal=causal, return_lse=True)
    cf.attention_backward(src_do, *src, o0, l0, causal=causal, deterministic=det)
    del o0, l0
    torch.cuda.synchronize()

    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        q, k, v, dout = (torch.full_like(t, float("nan")) for t in (*src, src_do))
        if mode == "autograd":
            for x in (q, k, v):
                x.requires_grad_(True)
    s.synchronize()
    with torch.cuda.stream(s):
        torch.cuda._sleep(SLEEP_CYCLES)
        with torch.no_grad():
            for dst, t in zip((q, k, v, dout), (*src, src_do)):
                dst.copy_(t)
        if mode == "direct":
            out, lse = cf.attention(q, k, v, causal=causal, return_lse=True)
            grads = cf.attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=det)
        else:
            out = cf.attention(q, k, v, causal=causal, deterministic=det)
            (out * dout).sum().backward()
            grads = (q.grad, k.grad, v.grad)
        pending = not s.query()
        errs = [(g.to(torch.float64) - r).abs().max() for g, r in zip(grads, ref)]
        nans = sum(torch.isnan(g).sum() for g in grads)
    torch.cuda.synchronize()
    msg = seed_msg(seed, f"torch stream, delayed producer, backward {mode} causal={causal} deterministic={det}")
    assert int(nans.item()) == 0, f"{msg}: {int(nans.item())} NaN: the backward did not run on the caller's stream"
    for name, e, bound in zip(("dq", "dk", "dv"), errs, bounds):
        assert e.item() <= bound, f"{msg}: {name} max err {e.item():.4g} > {bound:.4g}: wrong stream or race"
    assert pending, f"{msg}: the stream had drained when the backward returned (host synchronization?)"


# ---------------------------------------------------------------------------------------------
# CuPy and JAX
# ---------------------------------------------------------------------------------------------

def _cupy_to_torch(x, dtype):
    """A CuPy array as a torch tensor through DLPack (zero-copy); through float32 when this CuPy
    cannot export the dtype (exact: the values came from `dtype`)."""
    import cupy as cp

    try:
        t = torch.from_dlpack(x)
        if t.dtype == dtype:
            return t
    except Exception:
        pass
    return torch.from_dlpack(x.astype(cp.float32)).to(dtype)


@pytest.mark.parametrize("dtype,causal,heads,layout,det", [("float16", False, (4, 4), "bshd", False),
                                                           ("float16", True, (4, 2), "bhsd", True),
                                                           ("bfloat16", True, (4, 1), "bshd", False),
                                                           ("bfloat16", False, (4, 2), "bhsd", True)])
def test_cupy_backward(cf, cupy_mod, dtype, causal, heads, layout, det):
    """CuPy arrays in, CuPy arrays out; values checked against the torch reference via DLPack."""
    cp = cupy_mod
    seed = fresh_seed()
    h, hkv = heads
    b, sq, sk, d = 2, 190, 260, 64
    tdt = TORCH_DTYPES[dtype]
    q_t, k_t, v_t = make_qkv(b, sq, sk, h, hkv, d, tdt, layout)
    do_t = make_dout(b, sq, h, d, tdt, layout)
    torch.cuda.synchronize()
    try:
        q, k, v, dout = (cp.from_dlpack(t) for t in (q_t, k_t, v_t, do_t))
    except Exception as e:  # CuPy builds without bfloat16 support
        pytest.skip(f"CuPy cannot hold {dtype} arrays: {e}")
    msg = seed_msg(seed, f"cupy backward {dtype} causal={causal} heads={heads} {layout} deterministic={det}")
    out, lse = cf.attention(q, k, v, causal=causal, return_lse=True)
    poison_allocators(_bwd_poison_hint(q_t, k_t))
    grads = cf.attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=det)
    assert isinstance(grads, tuple) and len(grads) == 3, f"{msg}: {type(grads)}"
    for name, g, x in zip(("dq", "dk", "dv"), grads, (q, k, v)):
        assert isinstance(g, cp.ndarray), f"{msg}: {name} is {type(g)}, expected cupy.ndarray"
        assert g.shape == x.shape and g.dtype == x.dtype, f"{msg}: {name} {g.shape} {g.dtype}"
        assert g.device.id == x.device.id, f"{msg}: {name} on device {g.device.id}"
    cp.cuda.Device().synchronize()
    grads_t = tuple(_cupy_to_torch(g, tdt) for g in grads)
    torch.cuda.synchronize()
    assert_grads_close(grads_t, q_t, k_t, v_t, do_t, causal, d ** -0.5, msg)


def _jax_from_torch(t, jdt, dev):
    import jax
    import jax.numpy as jnp

    return jax.device_put(jnp.asarray(t.detach().float().cpu().numpy()).astype(jdt), dev)


def _torch_from_jax(x, tdt):
    import jax.numpy as jnp

    return _to_torch_via_host(np.asarray(x.astype(jnp.float32)), tdt, "cuda")


JAX_CASES = [("bfloat16", True, (4, 2), False), ("float16", False, (4, 4), True), ("bfloat16", False, (4, 1), True),
             ("float16", True, (4, 1), False)]


@pytest.mark.parametrize("dtype,causal,heads,det", JAX_CASES)
def test_jax_grad(cf, jax_gpu, dtype, causal, heads, det):
    """jax.grad of sum(attention(q, k, v).astype(float32) * w) with respect to q, k, v, eagerly."""
    jax, dev = jax_gpu
    import jax.numpy as jnp

    seed = fresh_seed()
    h, hkv = heads
    b, sq, sk, d = 2, 150, 222, 128
    tdt = TORCH_DTYPES[dtype]
    jdt = {"float16": jnp.float16, "bfloat16": jnp.bfloat16}[dtype]
    q_t, k_t, v_t = make_qkv(b, sq, sk, h, hkv, d, tdt)
    w_t = make_dout(b, sq, h, d, tdt)
    q, k, v, w = (_jax_from_torch(t, jdt, dev) for t in (q_t, k_t, v_t, w_t))
    w32 = w.astype(jnp.float32)   # exact; the cotangent of out is then w in the input dtype

    def loss(q, k, v):
        return jnp.sum(cf.attention(q, k, v, causal=causal, deterministic=det).astype(jnp.float32) * w32)

    msg = seed_msg(seed, f"jax.grad {dtype} causal={causal} heads={heads} deterministic={det}")
    grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    for name, g, x in zip(("dq", "dk", "dv"), grads, (q, k, v)):
        assert isinstance(g, jax.Array), f"{msg}: {name} is {type(g)}"
        assert g.shape == x.shape and g.dtype == x.dtype, f"{msg}: {name} {g.shape} {g.dtype}"
        assert g.devices() == {dev}, f"{msg}: {name} on {g.devices()}"
    assert_grads_close(tuple(_torch_from_jax(g, tdt) for g in grads), q_t, k_t, v_t, w_t, causal, d ** -0.5, msg)


@pytest.mark.parametrize("dtype,causal,heads,det", JAX_CASES[:2])
def test_jax_vjp(cf, jax_gpu, dtype, causal, heads, det):
    """jax.vjp: the primal output is the forward's, the pullback of dout gives the reference grads."""
    jax, dev = jax_gpu
    import jax.numpy as jnp

    seed = fresh_seed()
    h, hkv = heads
    b, sq, sk, d = 2, 129, 300, 64
    tdt = TORCH_DTYPES[dtype]
    jdt = {"float16": jnp.float16, "bfloat16": jnp.bfloat16}[dtype]
    q_t, k_t, v_t = make_qkv(b, sq, sk, h, hkv, d, tdt)
    do_t = make_dout(b, sq, h, d, tdt)
    q, k, v, dout = (_jax_from_torch(t, jdt, dev) for t in (q_t, k_t, v_t, do_t))
    msg = seed_msg(seed, f"jax.vjp {dtype} causal={causal} heads={heads} deterministic={det}")
    out, pullback = jax.vjp(lambda q, k, v: cf.attention(q, k, v, causal=causal, deterministic=det), q, k, v)
    assert isinstance(out, jax.Array) and out.shape == q.shape and out.dtype == q.dtype, msg
    assert_forward_close(_torch_from_jax(out, tdt), None, q_t, k_t, v_t, causal, d ** -0.5, msg + " (primal out)")
    grads = pullback(dout)
    assert len(grads) == 3, msg
    assert_grads_close(tuple(_torch_from_jax(g, tdt) for g in grads), q_t, k_t, v_t, do_t, causal, d ** -0.5, msg)


def test_jax_jit_not_supported(cf, jax_gpu, monkeypatch):
    """With the GPU route under jit turned off (CUFLASH_JAX_JIT_GPU=0; it is on by default and
    tests/test_jax_jit_route.py checks it), the forward, its gradient and attention_backward under
    jax.jit raise NotImplementedError naming jit and the platform, when the program is lowered."""
    monkeypatch.setenv("CUFLASH_JAX_JIT_GPU", "0")
    jax, dev = jax_gpu
    import jax.numpy as jnp

    q_t, k_t, v_t = make_qkv(1, 64, 64, 2, 2, 64, torch.bfloat16)
    q, k, v = (_jax_from_torch(t, jnp.bfloat16, dev) for t in (q_t, k_t, v_t))
    with pytest.raises(NotImplementedError, match="jit.*'cuda'"):
        jax.jit(lambda q, k, v: cf.attention(q, k, v, causal=True))(q, k, v)

    def loss(q, k, v):
        return jnp.sum(cf.attention(q, k, v).astype(jnp.float32))

    with pytest.raises(NotImplementedError, match="jit"):
        jax.jit(jax.grad(loss))(q, k, v)
    out, lse = cf.attention(q, k, v, return_lse=True)   # eager: fine
    with pytest.raises(NotImplementedError, match="jit"):
        jax.jit(lambda *a: cf.attention_backward(*a))(out, q, k, v, out, lse)
