"""GPU tests of cuflash's forward pass. Every test here is marked ``gpu`` (skipped without a GPU).

Accuracy criterion (per case), as in FlashAttention's own tests:
    max |out - ref64| <= 2 * max |naive_in_dtype - ref64| + 1e-5
where ref64 is attention in float64 and naive_in_dtype is the textbook computation in the input
dtype (both written below in torch, on the GPU for speed). lse is checked against the float64 lse
(|lse - ref| <= 1e-3 * (1 + |ref|)) and must be exactly -inf where a query row sees no key, where
out must be exactly 0. No NaN anywhere.

Inputs are fresh random normals for every check, drawn from a non-deterministic seed (torch.seed());
the seed is in every assertion message. To replay a failure: CUFLASH_TEST_SEED=<seed> pytest -k <id>.

The forward grid (dtype x head_dim x causal x seqlens x heads x layout = 1296 cases) is one
parametrized test: a deterministic covering subset of 216 cases runs by default, the other 1080 are
marked ``slow`` (see _grid_params).

cuflash is imported inside a fixture, never at module level, so that collection works while the
package is being written or on a machine without CUDA.
"""

from __future__ import annotations

import math
import os
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu

TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
SHORT = {"float16": "fp16", "bfloat16": "bf16"}


# ---------------------------------------------------------------------------------------------
# Torch references (float64, and the naive computation in the input dtype). Device-agnostic:
# they run where the inputs live (GPU for the GPU tests, CPU for the CPU-path tests).
# ---------------------------------------------------------------------------------------------

def visible_mask(seqlen_q: int, seqlen_k: int, causal: bool, device) -> torch.Tensor | None:
    """(seqlen_q, seqlen_k) bool, True where query row i sees key j (bottom-right causal); None = all."""
    if not causal:
        return None
    i = torch.arange(seqlen_q, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    return j <= i + (seqlen_k - seqlen_q)


def rows_with_no_key(seqlen_q: int, seqlen_k: int, causal: bool, device) -> torch.Tensor:
    """(seqlen_q,) bool, True for query rows that see no key at all."""
    mask = visible_mask(seqlen_q, seqlen_k, causal, device)
    if mask is None:
        return torch.full((seqlen_q,), seqlen_k == 0, dtype=torch.bool, device=device)
    return ~mask.any(dim=-1)


def _heads_first(x: torch.Tensor, nheads: int) -> torch.Tensor:
    """(b, s, hkv, d) -> (b, nheads, s, d); kv head j serves query heads j*g .. j*g+g-1 (g = nheads/hkv)."""
    hkv = x.shape[2]
    assert nheads % hkv == 0, (nheads, hkv)
    x = x.transpose(1, 2)
    if nheads != hkv:
        x = x.repeat_interleave(nheads // hkv, dim=1)
    return x


def reference_f64(q, k, v, causal: bool, softmax_scale: float):
    """Attention in float64. Returns out (b, sq, h, d) float64 and lse (b, h, sq) float64.

    Rows that see no key: out 0, lse -inf.
    """
    b, sq, h, d = q.shape
    sk = k.shape[1]
    qh = q.to(torch.float64).transpose(1, 2)
    kh = _heads_first(k.to(torch.float64), h)
    vh = _heads_first(v.to(torch.float64), h)
    s = torch.matmul(qh, kh.transpose(-1, -2)) * softmax_scale
    mask = visible_mask(sq, sk, causal, q.device)
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    empty = rows_with_no_key(sq, sk, causal, q.device)
    p = torch.softmax(s, dim=-1)
    p = p.masked_fill(empty[:, None], 0.0)
    lse = lse.masked_fill(empty, -math.inf)
    out = torch.matmul(p, vh).transpose(1, 2)
    return out, lse


def naive_in_dtype(q, k, v, causal: bool, softmax_scale: float):
    """The naive computation in the input dtype: S = q @ k^T in the input dtype (rounded), softmax in
    float32 on the rounded scores, P cast to the input dtype, out = P @ v in the input dtype."""
    b, sq, h, d = q.shape
    sk = k.shape[1]
    dtype = q.dtype
    qh = q.transpose(1, 2)
    kh = _heads_first(k, h)
    vh = _heads_first(v, h)
    s = torch.matmul(qh, kh.transpose(-1, -2))          # input dtype
    s = s.to(torch.float32) * softmax_scale
    mask = visible_mask(sq, sk, causal, q.device)
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf)
    p = torch.softmax(s, dim=-1)
    p = p.masked_fill(rows_with_no_key(sq, sk, causal, q.device)[:, None], 0.0)
    out = torch.matmul(p.to(dtype), vh)                  # input dtype
    return out.transpose(1, 2)


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    return (a.to(torch.float64) - b.to(torch.float64)).abs().max().item()


def _where_max(diff: torch.Tensor) -> tuple:
    idx = int(torch.argmax(diff.reshape(-1)).item())
    return tuple(int(i) for i in np.unravel_index(idx, tuple(diff.shape)))


def assert_forward_close(out, lse, q, k, v, causal: bool, softmax_scale: float, msg: str):
    """Checks out (and lse unless None) against the references. All arguments are torch tensors on
    one device; out has q's shape; lse is (b, h, sq)."""
    b, sq, h, d = q.shape
    sk = k.shape[1]
    ref, ref_lse = reference_f64(q, k, v, causal, softmax_scale)
    naive = naive_in_dtype(q, k, v, causal, softmax_scale)

    assert not torch.isnan(out).any().item(), f"{msg}: out has {int(torch.isnan(out).sum())} NaN"
    assert torch.isfinite(out).all().item(), f"{msg}: out has infinities"
    diff = (out.to(torch.float64) - ref).abs()
    err = diff.max().item() if diff.numel() else 0.0
    err_naive = _max_abs(naive, ref)
    bound = 2.0 * err_naive + 1e-5
    assert err <= bound, (
        f"{msg}: max|out-ref64|={err:.4g} at (b,s,h,d)={_where_max(diff)} > bound {bound:.4g} "
        f"(2 * max|naive-ref64| = 2 * {err_naive:.4g}, + 1e-5)")

    empty = rows_with_no_key(sq, sk, causal, q.device)
    if empty.any().item():
        assert (out[:, empty] == 0).all().item(), f"{msg}: rows that see no key must be exactly 0"

    if lse is None:
        return
    assert tuple(lse.shape) == (b, h, sq), f"{msg}: lse shape {tuple(lse.shape)} != {(b, h, sq)}"
    assert lse.dtype == torch.float32, f"{msg}: lse dtype {lse.dtype} != float32"
    assert not torch.isnan(lse).any().item(), f"{msg}: lse has {int(torch.isnan(lse).sum())} NaN"
    lse64 = lse.to(torch.float64)
    ref_inf = torch.isneginf(ref_lse)
    got_inf = torch.isneginf(lse64)
    assert torch.equal(got_inf, ref_inf), (
        f"{msg}: lse is -inf on {int(got_inf.sum())} rows, expected exactly the {int(ref_inf.sum())} rows "
        f"that see no key")
    assert not torch.isposinf(lse64).any().item(), f"{msg}: lse has +inf"
    fin = ~ref_inf
    if fin.any().item():
        ldiff = (lse64[fin] - ref_lse[fin]).abs()
        ltol = 1e-3 * (1.0 + ref_lse[fin].abs())
        bad = ldiff > ltol
        assert not bad.any().item(), (
            f"{msg}: lse off on {int(bad.sum())} rows; max|lse-ref|={ldiff.max().item():.4g} "
            f"(tolerance 1e-3 * (1 + |ref|))")


# ---------------------------------------------------------------------------------------------
# Inputs, seeds, poison
# ---------------------------------------------------------------------------------------------

def fresh_seed() -> int:
    """A non-deterministic seed for torch (CPU and CUDA generators), or CUFLASH_TEST_SEED to replay."""
    env = os.environ.get("CUFLASH_TEST_SEED")
    if env:
        seed = int(env)
        torch.manual_seed(seed)
        return seed
    return int(torch.seed())


def seed_msg(seed: int, label: str) -> str:
    return f"[{label}] seed={seed} (replay: CUFLASH_TEST_SEED={seed})"


def make_qkv(b, sq, sk, h, hkv, d, dtype, layout="bshd", device="cuda"):
    """Random normal q (b, sq, h, d), k, v (b, sk, hkv, d) in the given memory layout.

    bshd: contiguous (b, s, h, d).
    bhsd: contiguous (b, h, s, d) tensors passed as .transpose(1, 2) views (torch SDPA's layout).
    mixed: q bshd, k and v bhsd.
    padded: (b, s, h, d + 24) tensors sliced to [..., :d] (last dim contiguous, padded rows).
    packed: q, k, v are views of one (b, s, 3, h, d) tensor (needs sq == sk and h == hkv).
    """
    kw = dict(device=device, dtype=dtype)
    if layout == "bshd":
        return (torch.randn(b, sq, h, d, **kw), torch.randn(b, sk, hkv, d, **kw),
                torch.randn(b, sk, hkv, d, **kw))
    if layout == "bhsd":
        return (torch.randn(b, h, sq, d, **kw).transpose(1, 2), torch.randn(b, hkv, sk, d, **kw).transpose(1, 2),
                torch.randn(b, hkv, sk, d, **kw).transpose(1, 2))
    if layout == "mixed":
        return (torch.randn(b, sq, h, d, **kw), torch.randn(b, hkv, sk, d, **kw).transpose(1, 2),
                torch.randn(b, hkv, sk, d, **kw).transpose(1, 2))
    if layout == "padded":
        return (torch.randn(b, sq, h, d + 24, **kw)[..., :d], torch.randn(b, sk, hkv, d + 24, **kw)[..., :d],
                torch.randn(b, sk, hkv, d + 24, **kw)[..., :d])
    if layout == "packed":
        assert sq == sk and h == hkv
        return torch.randn(b, sq, 3, h, d, **kw).unbind(dim=2)
    raise ValueError(layout)


_POISON_MIN_BYTES = 64 << 20


def poison_allocators(nbytes_hint: int = 0) -> None:
    """Refill the GPU memory pools with NaN bytes (0xFF: NaN in fp16, bf16 and fp32).

    cuflash.attention allocates its outputs itself, so an output element the kernel forgets to write
    would otherwise hold whatever the pool handed back (often a plausible stale value). Here: release
    the cached free blocks, then allocate, fill with 0xFF and free one large block (the large pool)
    and a few 1 MiB blocks (the small pool, which serves e.g. a tiny lse); the caching allocator then
    hands this NaN-filled memory to the next allocations on this stream. The same is done for CuPy's
    default pool when CuPy is loaded.
    test_launch_into_nan_prefilled_buffers also calls the launch layer directly with NaN-filled
    out / lse buffers.
    """
    n = max(_POISON_MIN_BYTES, 4 * int(nbytes_hint))
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    big = torch.empty(n, dtype=torch.uint8, device="cuda")
    big.fill_(0xFF)
    small = [torch.empty(1 << 20, dtype=torch.uint8, device="cuda") for _ in range(8)]
    for t in small:
        t.fill_(0xFF)
    del big, small
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        try:
            pool = cupy.get_default_memory_pool()
            pool.free_all_blocks()
            x = cupy.empty(n, dtype=cupy.uint8)
            x.fill(0xFF)
            del x
            cupy.cuda.Device().synchronize()
        except Exception:
            pass


def _nbytes(*ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def assert_like(out, q, msg):
    assert isinstance(out, torch.Tensor), f"{msg}: expected a torch.Tensor, got {type(out)}"
    assert tuple(out.shape) == tuple(q.shape), f"{msg}: out shape {tuple(out.shape)} != q {tuple(q.shape)}"
    assert out.dtype == q.dtype, f"{msg}: out dtype {out.dtype} != {q.dtype}"
    assert out.device == q.device, f"{msg}: out on {out.device}, q on {q.device}"


def run_and_check(cf, q, k, v, *, causal, seed, label, softmax_scale=None, return_lse=True,
                  pass_scale=False, poison=True):
    """Calls cuflash.attention on torch tensors and checks everything. Returns (out, lse)."""
    msg = seed_msg(seed, label)
    if poison and q.is_cuda:
        poison_allocators(_nbytes(q) + q.shape[0] * q.shape[2] * q.shape[1] * 4)
    kwargs = {"causal": causal}
    if softmax_scale is not None or pass_scale:
        kwargs["softmax_scale"] = softmax_scale
    if return_lse is not None:          # None: leave the argument out (its default must be False)
        kwargs["return_lse"] = return_lse
    res = cf.attention(q, k, v, **kwargs)
    if return_lse:
        assert isinstance(res, tuple) and len(res) == 2, f"{msg}: return_lse=True must return (out, lse)"
        out, lse = res
        assert isinstance(lse, torch.Tensor) and lse.device == q.device, f"{msg}: lse {type(lse)}"
    else:
        assert not isinstance(res, tuple), f"{msg}: return_lse=False must return out alone"
        out, lse = res, None
    assert_like(out, q, msg)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    assert_forward_close(out, lse, q, k, v, causal, scale, msg)
    return out, lse


# ---------------------------------------------------------------------------------------------
# Fixtures
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cf():
    """The cuflash package. Skips only when the package itself does not exist; any other import
    error (a broken submodule, a syntax error) fails the tests instead of hiding behind a skip."""
    try:
        import cuflash
    except ModuleNotFoundError as e:
        if e.name == "cuflash":
            pytest.skip("cuflash is not importable (package missing)")
        raise
    return cuflash


@pytest.fixture(scope="module")
def cupy_mod():
    return pytest.importorskip("cupy")


# ---------------------------------------------------------------------------------------------
# The forward grid
# ---------------------------------------------------------------------------------------------

DTYPES = ("float16", "bfloat16")
HEAD_DIMS = (8, 32, 40, 64, 96, 128, 136, 200, 256)
CAUSALS = (False, True)
SEQLENS = ((1, 1), (1, 300), (113, 203), (1023, 1024), (2048, 512), (512, 2048))
HEADS = ((4, 4), (4, 2), (4, 1))          # MHA, GQA, MQA
LAYOUTS = ("bshd", "bhsd")                 # contiguous; (b,h,s,d) tensors passed as .transpose(1,2)
GRID_BATCH = 2


def _grid_params():
    """All 1296 cases; the 1080 outside the default subset carry the `slow` mark.

    Default subset: every (dtype, head_dim, causal, seqlens) combination once (2*9*2*6 = 216 cases),
    with the (heads, layout) pair (6 values) rotated by
        rot = (i_head_dim + i_seqlens + i_dtype + 2 * i_causal) % 6,  heads = rot % 3, layout = rot // 3.
    So each (head_dim, dtype, causal) meets all 6 (heads, layout) pairs across the 6 seqlen pairs, each
    (seqlens, dtype, causal) meets all 6 across the 9 head_dims, and each (head_dim, seqlens) meets MHA,
    GQA and MQA and both layouts across its 4 (dtype, causal) combinations.
    Each case is in pytest-xdist group <dtype>-d<head_dim>-<causal> (the kernel it compiles), so with
    --dist loadgroup one kernel is built by one worker.
    """
    params = []
    for i_dt, dt in enumerate(DTYPES):
        for i_hd, hd in enumerate(HEAD_DIMS):
            for i_c, causal in enumerate(CAUSALS):
                for i_sl, (sq, sk) in enumerate(SEQLENS):
                    rot = (i_hd + i_sl + i_dt + 2 * i_c) % 6
                    for i_h, (h, hkv) in enumerate(HEADS):
                        for i_l, layout in enumerate(LAYOUTS):
                            group = f"{SHORT[dt]}-d{hd}-{'causal' if causal else 'full'}"
                            marks = [pytest.mark.xdist_group(group)]
                            if i_h + 3 * i_l != rot:
                                marks.append(pytest.mark.slow)
                            case_id = (f"{SHORT[dt]}-d{hd}-{'causal' if causal else 'full'}-q{sq}k{sk}"
                                       f"-h{h}kv{hkv}-{layout}")
                            params.append(pytest.param(dt, hd, causal, sq, sk, h, hkv, layout,
                                                       id=case_id, marks=marks))
    return params


GRID = _grid_params()


@pytest.mark.parametrize("dtype,head_dim,causal,seqlen_q,seqlen_k,nheads,nheads_kv,layout", GRID)
def test_forward_grid(cf, dtype, head_dim, causal, seqlen_q, seqlen_k, nheads, nheads_kv, layout):
    seed = fresh_seed()
    q, k, v = make_qkv(GRID_BATCH, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, TORCH_DTYPES[dtype], layout)
    label = (f"{dtype} d={head_dim} causal={causal} sq={seqlen_q} sk={seqlen_k} h={nheads} "
             f"hkv={nheads_kv} {layout}")
    run_and_check(cf, q, k, v, causal=causal, seed=seed, label=label)


# ---------------------------------------------------------------------------------------------
# API details: softmax_scale, return_lse, strides, rows without keys, huge batch*heads
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,causal,scale", [("bfloat16", False, 0.37), ("float16", True, 1.3),
                                                ("bfloat16", True, 0.05)])
def test_explicit_softmax_scale(cf, dtype, causal, scale):
    seed = fresh_seed()
    q, k, v = make_qkv(2, 257, 320, 4, 2, 64, TORCH_DTYPES[dtype])
    run_and_check(cf, q, k, v, causal=causal, seed=seed, softmax_scale=scale,
                  label=f"{dtype} softmax_scale={scale} causal={causal}")


def test_softmax_scale_none_is_default(cf):
    seed = fresh_seed()
    q, k, v = make_qkv(2, 200, 200, 4, 4, 96, torch.bfloat16)
    run_and_check(cf, q, k, v, causal=True, seed=seed, pass_scale=True, label="softmax_scale=None")


@pytest.mark.parametrize("causal", [False, True])
def test_return_lse_both_ways(cf, causal):
    seed = fresh_seed()
    q, k, v = make_qkv(2, 333, 333, 4, 1, 128, torch.float16)
    label = f"return_lse causal={causal}"
    run_and_check(cf, q, k, v, causal=causal, seed=seed, return_lse=False, label=label + " (False)")
    run_and_check(cf, q, k, v, causal=causal, seed=seed, return_lse=None, label=label + " (omitted)")
    run_and_check(cf, q, k, v, causal=causal, seed=seed, return_lse=True, label=label + " (True)")


@pytest.mark.parametrize("layout,causal", [("mixed", True), ("padded", False), ("packed", True), ("bhsd", False)])
def test_strided_inputs_untouched(cf, layout, causal):
    """Inputs with other strides (last dim contiguous) give the right answer and are not modified."""
    seed = fresh_seed()
    q, k, v = make_qkv(3, 384, 384, 6, 6 if layout == "packed" else 3, 64, torch.bfloat16, layout)
    before = [t.clone() for t in (q, k, v)]
    strides = [t.stride() for t in (q, k, v)]
    run_and_check(cf, q, k, v, causal=causal, seed=seed, label=f"strides {layout} {strides}")
    for name, t, b in zip("qkv", (q, k, v), before):
        assert torch.equal(t, b), f"{seed_msg(seed, layout)}: cuflash modified input {name}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_without_keys(cf, dtype):
    """seqlen_q 300 > seqlen_k 77, causal bottom-right: rows 0..222 see no key -> out 0, lse -inf."""
    seed = fresh_seed()
    sq, sk = 300, 77
    q, k, v = make_qkv(2, sq, sk, 4, 2, 64, TORCH_DTYPES[dtype])
    out, lse = run_and_check(cf, q, k, v, causal=True, seed=seed, label=f"{dtype} rows without keys")
    n_empty = sq - sk
    msg = seed_msg(seed, "rows without keys")
    assert (out[:, :n_empty] == 0).all().item(), f"{msg}: out rows 0..{n_empty - 1} must be exactly 0"
    assert torch.isneginf(lse[:, :, :n_empty]).all().item(), f"{msg}: lse rows 0..{n_empty - 1} must be -inf"
    assert torch.isfinite(lse[:, :, n_empty:]).all().item(), f"{msg}: lse rows {n_empty}.. must be finite"
    assert (out[:, n_empty:].abs().amax(dim=-1) > 0).all().item(), f"{msg}: rows that see keys are zero"


@pytest.mark.parametrize("batch,nheads,nheads_kv,causal", [(1, 65600, 65600, False), (1, 65600, 16400, True),
                                                           (300, 256, 64, True)])
def test_batch_times_heads_over_65535(cf, batch, nheads, nheads_kv, causal):
    """batch * nheads > 65535 (more than a grid's y or z dimension holds)."""
    seed = fresh_seed()
    q, k, v = make_qkv(batch, 16, 16, nheads, nheads_kv, 8, torch.bfloat16)
    run_and_check(cf, q, k, v, causal=causal, seed=seed,
                  label=f"batch={batch} nheads={nheads} nheads_kv={nheads_kv} causal={causal}")


@pytest.mark.parametrize("d,sq,sk,hkv,causal", [(64, 300, 77, 2, True), (40, 113, 203, 1, False),
                                                (136, 1023, 1024, 4, True), (8, 1, 300, 4, False)])
def test_launch_into_nan_prefilled_buffers(cf, d, sq, sk, hkv, causal):
    """The launch layer writes into caller-provided buffers: fill them with NaN first, so that any
    element the kernel leaves unwritten (out or lse) shows up."""
    from cuflash import _launch
    from cuflash._gpu import compute_capability

    seed = fresh_seed()
    q, k, v = make_qkv(2, sq, sk, 4, hkv, d, torch.bfloat16)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((2, 4, sq), float("nan"), device="cuda", dtype=torch.float32)
    view = lambda t: _launch.DeviceTensor(t.data_ptr(), tuple(t.shape), tuple(t.stride()))
    _launch.launch_fwd(view(q), view(k), view(v), view(out), lse.data_ptr(), "bfloat16", causal, d ** -0.5,
                       torch.cuda.current_device(), compute_capability(torch.cuda.current_device()),
                       torch.cuda.current_stream().cuda_stream)
    assert not torch.isnan(lse).any().item(), seed_msg(seed, "lse left unwritten")
    assert_forward_close(out, lse, q, k, v, causal, d ** -0.5, seed_msg(seed, "NaN-prefilled buffers"))


@pytest.mark.parametrize("causal", [False, True])
def test_explicit_plan(cf, cupy_mod, causal):
    """cuflash.plan made on one set of arrays, called on fresh ones of the same signature (outputs
    from poisoned allocators): out and lse against the float64 reference, without lse too; with
    inputs that require grad (deterministic) the gradients equal attention's bit for bit, and
    p.backward's; on CuPy arrays the plan's out equals the torch call's bit for bit."""
    seed = fresh_seed()
    msg = seed_msg(seed, f"explicit plan causal={causal}")
    q, k, v = make_qkv(2, 200, 333, 4, 2, 128, torch.bfloat16)
    p = cf.plan(q, k, v, causal=causal, deterministic=True)
    q, k, v = make_qkv(2, 200, 333, 4, 2, 128, torch.bfloat16)
    poison_allocators(_nbytes(q) * 4)
    out, lse = p(q, k, v, return_lse=True)
    assert_like(out, q, msg)
    assert_forward_close(out, lse, q, k, v, causal, 128 ** -0.5, msg)
    poison_allocators(_nbytes(q) * 4)
    out1 = p(q, k, v)
    assert not isinstance(out1, tuple), msg
    assert torch.equal(out1, out), f"{msg}: out without lse differs from out with lse"
    qg, kg, vg = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    dout = torch.randn_like(out)
    grads_plan = torch.autograd.grad(p(qg, kg, vg), (qg, kg, vg), dout)
    grads_api = torch.autograd.grad(cf.attention(qg, kg, vg, causal=causal, deterministic=True), (qg, kg, vg), dout)
    grads_direct = p.backward(dout, q, k, v, out, lse)
    for name, a, b, c in zip(("dq", "dk", "dv"), grads_plan, grads_api, grads_direct):
        assert torch.equal(a, b) and torch.equal(a, c), f"{msg}: {name} through the plan differs"
        assert torch.isfinite(a).all().item(), f"{msg}: {name} not finite"
    cp = cupy_mod
    qc, kc, vc = (cp.from_dlpack(t) for t in (q, k, v))
    pc = cf.plan(qc, kc, vc, causal=causal, deterministic=True)
    oc = pc(qc, kc, vc)
    assert isinstance(oc, cp.ndarray), f"{msg}: CuPy plan returned {type(oc)}"
    torch.cuda.synchronize()
    assert torch.equal(torch.from_dlpack(oc), out), f"{msg}: CuPy plan's out differs from torch's"


# ---------------------------------------------------------------------------------------------
# Streams
# ---------------------------------------------------------------------------------------------

SLEEP_CYCLES = 600_000_000   # ~0.3 s at ~2 GHz: far longer than the cuflash call takes to return


def _delay(stream_ctx_stream):
    """Enqueue a long spin kernel on the given torch stream."""
    with torch.cuda.stream(stream_ctx_stream):
        torch.cuda._sleep(SLEEP_CYCLES)


@pytest.mark.parametrize("causal", [False, True])
def test_torch_stream_delayed_producer(cf, causal):
    """On a non-default stream s: spin, then write the inputs, call cuflash, compute the error there.

    No synchronization between producer, cuflash and consumer; only a final synchronize before the
    host reads the error. The inputs hold NaN until the delayed copies land, so a kernel launched on
    any other stream (e.g. the legacy default stream, which does not wait for torch's non-blocking
    streams) reads NaN or races with the consumer, and the check fails.
    """
    seed = fresh_seed()
    b, sq, sk, h, hkv, d = 2, 1024, 1536, 8, 2, 128
    src = make_qkv(b, sq, sk, h, hkv, d, torch.bfloat16)
    scale = 1 / math.sqrt(d)
    ref, ref_lse = reference_f64(*src, causal, scale)
    bound = 2 * _max_abs(naive_in_dtype(*src, causal, scale), ref) + 1e-5
    cf.attention(*src, causal=causal)                      # compile outside the timed region
    torch.cuda.synchronize()

    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        q, k, v = (torch.full_like(t, float("nan")) for t in src)
    s.synchronize()
    with torch.cuda.stream(s):
        torch.cuda._sleep(SLEEP_CYCLES)
        for dst, t in zip((q, k, v), src):
            dst.copy_(t)
        out, lse = cf.attention(q, k, v, causal=causal, return_lse=True)
        pending = not s.query()
        err = (out.to(torch.float64) - ref).abs().max()
        lerr = torch.where(torch.isneginf(ref_lse), 0.0, (lse.to(torch.float64) - ref_lse).abs()).max()
        nans = torch.isnan(out).sum() + torch.isnan(lse).sum()
    torch.cuda.synchronize()
    msg = seed_msg(seed, f"torch stream, delayed producer, causal={causal}")
    assert int(nans.item()) == 0, f"{msg}: {int(nans.item())} NaN: cuflash did not run on the caller's stream"
    assert err.item() <= bound, f"{msg}: max err {err.item():.4g} > {bound:.4g}: wrong stream or race"
    assert lerr.item() <= 1e-3 * (1 + ref_lse[torch.isfinite(ref_lse)].abs().max().item()), f"{msg}: lse err"
    assert out.device == q.device
    # Not a correctness requirement of streams, but of an asynchronous API: the call must return
    # while the stream is still busy with the spin kernel, i.e. it must not block the host.
    assert pending, f"{msg}: the stream had drained when cuflash.attention returned (host synchronization?)"


def test_torch_stream_large_inputs_no_sync(cf):
    """Large inputs produced on a non-default stream (behind a spin kernel, then randn and a matmul
    chain), cuflash and the consumer on the same stream, no synchronization until the host reads."""
    seed = fresh_seed()
    b, s_len, h, d = 2, 4096, 16, 128
    warm = make_qkv(1, s_len, s_len, 1, 1, d, torch.float16)
    cf.attention(*warm, causal=True)                      # compile outside the stream section
    torch.cuda.synchronize()
    st = torch.cuda.Stream()
    with torch.cuda.stream(st):
        torch.cuda._sleep(SLEEP_CYCLES // 3)
        q, k, v = make_qkv(b, s_len, s_len, h, h, d, torch.float16)
        mix = torch.randn(d, d, device="cuda", dtype=torch.float16) / math.sqrt(d)
        for _ in range(8):
            q = q @ mix
            k = k @ mix
        out, lse = cf.attention(q, k, v, causal=True, return_lse=True)
        # consume on the same stream: batch 1, the last two heads, against the references
        sl = (slice(1, 2), slice(None), slice(h - 2, h))
        qs, ks, vs = q[sl], k[sl], v[sl]
        ref, ref_lse = reference_f64(qs, ks, vs, True, 1 / math.sqrt(d))
        base = (naive_in_dtype(qs, ks, vs, True, 1 / math.sqrt(d)).to(torch.float64) - ref).abs().max()
        err = (out[sl].to(torch.float64) - ref).abs().max()
        lerr = (lse[1:2, h - 2:].to(torch.float64) - ref_lse).abs().max()
        nans = torch.isnan(out).sum() + torch.isnan(lse).sum()
    torch.cuda.synchronize()
    msg = seed_msg(seed, "torch stream, large inputs, no sync")
    assert int(nans.item()) == 0, f"{msg}: NaN in out or lse"
    assert err.item() <= 2 * base.item() + 1e-5, f"{msg}: err {err.item():.4g} > 2 * {base.item():.4g} + 1e-5"
    assert lerr.item() <= 1e-3 * (1 + ref_lse.abs().max().item()), f"{msg}: lse err {lerr.item():.4g}"


def test_cupy_stream_delayed_producer(cf, cupy_mod):
    """Same as the torch test with CuPy arrays on a non-blocking CuPy stream (CuPy's current stream)."""
    cp = cupy_mod
    seed = fresh_seed()
    b, sq, sk, h, hkv, d = 2, 777, 1024, 4, 4, 64
    src = make_qkv(b, sq, sk, h, hkv, d, torch.float16)
    scale = 1 / math.sqrt(d)
    ref, _ = reference_f64(*src, True, scale)
    bound = 2 * _max_abs(naive_in_dtype(*src, True, scale), ref) + 1e-5
    torch.cuda.synchronize()
    src_cp = [cp.from_dlpack(t) for t in src]
    ref_cp = cp.from_dlpack(ref.contiguous())
    cf.attention(*src_cp, causal=True)   # compile first
    cp.cuda.Device().synchronize()

    s = cp.cuda.Stream(non_blocking=True)
    with s:
        q, k, v = (cp.full(t.shape, cp.nan, dtype=cp.float16) for t in src_cp)
    s.synchronize()
    with s:
        _delay(torch.cuda.ExternalStream(s.ptr))
        for dst, t in zip((q, k, v), src_cp):
            cp.copyto(dst, t)
        out = cf.attention(q, k, v, causal=True)
        pending = not s.done
        err = cp.abs(out.astype(cp.float64) - ref_cp).max()
        nans = cp.isnan(out).sum()
    s.synchronize()
    cp.cuda.Device().synchronize()
    msg = seed_msg(seed, "cupy stream, delayed producer")
    assert isinstance(out, cp.ndarray), f"{msg}: got {type(out)}"
    assert int(nans.get()) == 0, f"{msg}: NaN in out: cuflash did not run on CuPy's current stream"
    assert float(err.get()) <= bound, f"{msg}: err {float(err.get()):.4g} > {bound:.4g}"
    assert pending, f"{msg}: the stream had drained when cuflash.attention returned (host synchronization?)"


# ---------------------------------------------------------------------------------------------
# Inputs from each library
# ---------------------------------------------------------------------------------------------

def _to_torch_via_host(x_np_f32: np.ndarray, dtype, device) -> torch.Tensor:
    """float32 numpy -> torch in `dtype` on `device` (exact for values that came from `dtype`)."""
    return torch.from_numpy(np.ascontiguousarray(x_np_f32)).to(device=device).to(dtype)


@pytest.mark.parametrize("dtype,causal,heads,layout", [("float16", False, (4, 4), "bshd"),
                                                       ("float16", True, (4, 2), "bhsd"),
                                                       ("bfloat16", True, (4, 1), "bshd")])
def test_cupy_inputs(cf, cupy_mod, dtype, causal, heads, layout):
    cp = cupy_mod
    seed = fresh_seed()
    h, hkv = heads
    q_t, k_t, v_t = make_qkv(2, 190, 260, h, hkv, 64, TORCH_DTYPES[dtype], layout)
    torch.cuda.synchronize()
    try:
        q, k, v = (cp.from_dlpack(t) for t in (q_t, k_t, v_t))
    except Exception as e:  # CuPy builds without bfloat16 support
        pytest.skip(f"CuPy cannot hold {dtype} arrays: {e}")
    msg = seed_msg(seed, f"cupy {dtype} causal={causal} {layout}")
    res = cf.attention(q, k, v, causal=causal, return_lse=True)
    assert isinstance(res, tuple) and len(res) == 2, msg
    out, lse = res
    assert isinstance(out, cp.ndarray) and isinstance(lse, cp.ndarray), f"{msg}: {type(out)}, {type(lse)}"
    assert out.device.id == q.device.id and lse.device.id == q.device.id, f"{msg}: output on another device"
    assert out.shape == q.shape and out.dtype == q.dtype, f"{msg}: {out.shape} {out.dtype}"
    assert lse.dtype == cp.float32, msg
    cp.cuda.Device().synchronize()
    out_t = _to_torch_via_host(cp.asnumpy(out.astype(cp.float32)), q_t.dtype, q_t.device)
    lse_t = torch.from_numpy(cp.asnumpy(lse)).to(q_t.device)
    assert_forward_close(out_t, lse_t, q_t, k_t, v_t, causal, 1 / 8, msg)


@pytest.fixture(scope="module")
def jax_gpu():
    jax = pytest.importorskip("jax")
    try:
        gpus = jax.devices("gpu")
    except Exception as e:
        pytest.skip(f"JAX has no GPU backend: {e}")
    if not gpus:
        pytest.skip("JAX has no GPU device")
    return jax, gpus[0]


@pytest.mark.parametrize("dtype,causal,heads", [("bfloat16", True, (4, 2)), ("float16", False, (4, 4)),
                                                ("bfloat16", False, (4, 1))])
def test_jax_inputs(cf, jax_gpu, dtype, causal, heads):
    jax, dev = jax_gpu
    import jax.numpy as jnp

    seed = fresh_seed()
    h, hkv = heads
    b, sq, sk, d = 2, 150, 222, 128
    jdt = {"float16": jnp.float16, "bfloat16": jnp.bfloat16}[dtype]
    keys = jax.random.split(jax.random.PRNGKey(seed % (2**31)), 3)
    shapes = [(b, sq, h, d), (b, sk, hkv, d), (b, sk, hkv, d)]
    # No block_until_ready: the inputs may still be in flight when cuflash receives them.
    q, k, v = (jax.device_put(jax.random.normal(kk, shp, dtype=jnp.float32).astype(jdt), dev)
               for kk, shp in zip(keys, shapes))
    msg = seed_msg(seed, f"jax {dtype} causal={causal} heads={heads}")
    out, lse = cf.attention(q, k, v, causal=causal, return_lse=True)
    assert isinstance(out, jax.Array) and isinstance(lse, jax.Array), f"{msg}: {type(out)}, {type(lse)}"
    assert out.devices() == {dev} and lse.devices() == {dev}, f"{msg}: {out.devices()} {lse.devices()}"
    assert out.shape == q.shape and out.dtype == q.dtype, f"{msg}: {out.shape} {out.dtype}"
    assert lse.shape == (b, h, sq) and lse.dtype == jnp.float32, f"{msg}: lse {lse.shape} {lse.dtype}"
    out_only = cf.attention(q, k, v, causal=causal)
    assert isinstance(out_only, jax.Array), msg

    tdt = TORCH_DTYPES[dtype]
    q_t, k_t, v_t = (_to_torch_via_host(np.asarray(x.astype(jnp.float32)), tdt, "cuda") for x in (q, k, v))
    out_t = _to_torch_via_host(np.asarray(out.astype(jnp.float32)), tdt, "cuda")
    out_only_t = _to_torch_via_host(np.asarray(out_only.astype(jnp.float32)), tdt, "cuda")
    lse_t = torch.from_numpy(np.asarray(lse)).to("cuda")
    assert_forward_close(out_t, lse_t, q_t, k_t, v_t, causal, 1 / math.sqrt(d), msg)
    assert_forward_close(out_only_t, None, q_t, k_t, v_t, causal, 1 / math.sqrt(d), msg + " (out only)")


def _np_dtype(name):
    if name == "bfloat16":
        ml_dtypes = pytest.importorskip("ml_dtypes")
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(np.float16)


@pytest.mark.parametrize("dtype,causal,transposed", [("float16", True, False), ("bfloat16", False, True),
                                                     ("bfloat16", True, False)])
def test_numpy_cpu_path(cf, dtype, causal, transposed):
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    b, sq, sk, h, hkv, d = 2, 65, 97, 4, 2, 64
    npdt = _np_dtype(dtype)

    def mk(s, hh):
        if transposed:
            return np.swapaxes(rng.standard_normal((b, hh, s, d), dtype=np.float32).astype(npdt), 1, 2)
        return rng.standard_normal((b, s, hh, d), dtype=np.float32).astype(npdt)

    q, k, v = mk(sq, h), mk(sk, hkv), mk(sk, hkv)
    msg = seed_msg(seed, f"numpy {dtype} causal={causal} transposed={transposed}")
    out, lse = cf.attention(q, k, v, causal=causal, return_lse=True)
    assert isinstance(out, np.ndarray) and isinstance(lse, np.ndarray), f"{msg}: {type(out)}, {type(lse)}"
    assert out.shape == q.shape and out.dtype == npdt, f"{msg}: {out.shape} {out.dtype}"
    assert lse.shape == (b, h, sq) and lse.dtype == np.float32, f"{msg}: lse {lse.shape} {lse.dtype}"
    tdt = TORCH_DTYPES[dtype]
    q_t, k_t, v_t = (_to_torch_via_host(x.astype(np.float32), tdt, "cpu") for x in (q, k, v))
    out_t = _to_torch_via_host(out.astype(np.float32), tdt, "cpu")
    assert_forward_close(out_t, torch.from_numpy(np.ascontiguousarray(lse)), q_t, k_t, v_t, causal,
                         1 / math.sqrt(d), msg)


@pytest.mark.parametrize("dtype,causal", [("bfloat16", True), ("float16", False)])
def test_torch_cpu_path(cf, dtype, causal):
    seed = fresh_seed()
    q, k, v = make_qkv(2, 70, 70, 4, 1, 32, TORCH_DTYPES[dtype], "bhsd", device="cpu")
    out, lse = run_and_check(cf, q, k, v, causal=causal, seed=seed, label=f"torch cpu {dtype} causal={causal}")
    assert out.device.type == "cpu" and lse.device.type == "cpu"
