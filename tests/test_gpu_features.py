"""GPU tests of the optional attention features (cuflash/_features.py states their semantics):
per-sequence lengths of a padded batch, packed batches (attention_varlen), sliding windows, sink
tokens, sink logits, ALiBi and softcap, alone and in pairs, forward and backward.

Every test that needs a GPU is marked ``gpu`` (skipped without one). The argument checks at the end
of the file run on the CPU path (NumPy inputs) and carry no mark: they run everywhere, and fast.

Main library: CuPy arrays (bf16 through ml_dtypes, as cuflash itself allocates them); a few tests go
through torch autograd (incl. sink_logits.grad) and jax.grad.

Accuracy criterion, as in tests/test_gpu_forward.py and tests/test_gpu_backward.py, against the
float64 reference in cuflash._reference (forward) and tests/_grad_reference.py (backward), both
computed on the host from the very inputs the GPU saw:
    out:          max|out - ref64| <= 2 * max|naive - ref64| + 1e-5   (cuflash._reference.check_close)
    dq, dk, dv:   max|g - ref64|   <= 3 * max|naive - ref64| + 1e-4
    lse:          -inf on exactly the rows where the reference has -inf; elsewhere
                  |lse - ref| <= 1e-3 * (1 + |ref|)
    dsink:        (a) against the reference: 3 * max|naive - ref64| + 1e-4 + 1e-2 * max|ref64| (the
                  sum over all rows of a batch has few elements per test, so the naive error is a
                  noisy yardstick; the relative term keeps it from being luckily tiny), and (b) against
                  its own definition evaluated in float64 from the out and lse handed to the backward,
                  -sum_{b,i} exp(sink[h] - lse[b,h,i]) * sum_d dout * out, within 1e-4 of the sum of
                  the absolute terms (+1e-6). (b) is tight: a missing row or tile shows.
where naive is the textbook computation in the input dtype (compute_dtype='input').
Exact values where the semantics demand them: out rows that see no key are exactly 0; padded query
rows (i >= q_lengths[b]) and rows of a packed tensor past cu_seqlens_q[-1] have lse exactly -inf; dq
is exactly 0 on every row that sees no key; dk and dv are exactly 0 on every key that no valid
query sees (keys past kv_lengths[b], past cu_seqlens_k[-1], or outside every window). No NaN or inf
in any output. attention_backward leaves its inputs unmodified.

The GPU memory pools (CuPy's, and torch's when loaded) are refilled with 0xFF bytes (NaN in fp16, bf16
and fp32) before every forward and backward call, so that an output element the kernels forget to
write shows up as NaN.

Seeds: every test draws fresh inputs from a non-deterministic seed shown in each assertion message;
CUFLASH_TEST_SEED=<seed> replays it.

Coverage: the grid test_features runs each of 28 feature sets (each feature alone, the window
corner cases, and pairs) at every (dtype, causal) pair, forward and backward, with MHA / GQA / MQA,
head_dim, shapes and deterministic rotated across the four runs of a set; test_head_dims sweeps every
multiple of 8 from 8 to 256 with all features on (a spread by default, the rest marked ``slow``);
test_varlen checks packed batches against the reference and against per-sequence calls. Tests are in
pytest-xdist groups named after the kernel they compile (--dist loadgroup). In causal runs a window's
right bound > 0 is passed as 0 (causal=True means right = 0, and cuflash rejects a contradicting
window), so windows with right > 0 are exercised by the non-causal runs.

Timing: about 170 GPU tests by default; the float64 references on the host dominate (well under a
second per test), the GPU work is small. `pytest -n 8 --dist loadgroup tests/test_gpu_features.py`.

cuflash and the references are imported inside fixtures / helpers, never at module level, so that
collection works on any machine and while the package is being changed.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass

import ml_dtypes
import numpy as np
import pytest

gpu = pytest.mark.gpu

BF16 = np.dtype(ml_dtypes.bfloat16)
NP_DTYPES = {"float16": np.dtype(np.float16), "bfloat16": BF16}
SHORT = {"float16": "fp16", "bfloat16": "bf16"}

FWD_FACTOR, FWD_FLOOR = 2.0, 1e-5
BWD_FACTOR, BWD_FLOOR = 3.0, 1e-4
LSE_RTOL = 1e-3
DSINK_REL = 1e-2          # (a) relative slack of dsink against the reference
DSINK_SELF_RTOL = 1e-4    # (b) dsink against its definition from out and lse


# ---------------------------------------------------------------------------------------------
# Seeds, imports, device transfers, poison
# ---------------------------------------------------------------------------------------------

def fresh_seed() -> int:
    env = os.environ.get("CUFLASH_TEST_SEED")
    if env:
        return int(env)
    return int(np.random.SeedSequence().entropy % (1 << 63))


def seed_msg(seed: int, label: str) -> str:
    return f"[{label}] seed={seed} (replay: CUFLASH_TEST_SEED={seed})"


def _import_cuflash():
    try:
        import cuflash
    except ModuleNotFoundError as e:
        if e.name == "cuflash":
            pytest.skip("cuflash is not importable (package missing)")
        raise
    return cuflash


@pytest.fixture(scope="module")
def cf():
    """The cuflash package (a broken submodule fails the tests instead of skipping them)."""
    return _import_cuflash()


def _ref_forward(q, k, v, causal, scale, compute_dtype=None, **kw):
    """cuflash._reference.attention_reference -> (out, lse)."""
    from cuflash._reference import attention_reference

    return attention_reference(q, k, v, causal, scale, compute_dtype, **kw)


def _ref_grads(dout, q, k, v, causal, scale, compute_dtype=None, **kw):
    """tests/_grad_reference.attention_grad_reference -> (dq, dk, dv) or (dq, dk, dv, dsink)."""
    from _grad_reference import attention_grad_reference

    return attention_grad_reference(dout, q, k, v, causal, scale, compute_dtype, **kw)


def _check_close(out, ref, naive, factor, floor):
    from cuflash._reference import check_close

    return check_close(out, ref, naive, factor=factor, floor=floor)


def _cupy():
    import cupy

    return cupy


def _dev(a: np.ndarray):
    """A host array as a CuPy array on the current device (bfloat16 through ml_dtypes)."""
    cp = _cupy()
    a = np.ascontiguousarray(a)
    try:
        return cp.asarray(a)
    except Exception:
        if a.dtype != BF16:
            raise
        return cp.asarray(a.view(np.int16)).view(BF16)


def _host(x) -> np.ndarray:
    """A device array (CuPy) back on the host as NumPy (synchronizes)."""
    if isinstance(x, np.ndarray):
        return x
    return x.get()


_POISON_MIN_BYTES = 64 << 20


def poison(nbytes_hint: int = 0) -> None:
    """Refill the GPU memory pools with 0xFF bytes (NaN in fp16, bf16 and fp32): release the cached
    free blocks, then allocate, fill and free one large block and a few 1 MiB ones, which the next
    allocations (cuflash's outputs and scratch) are carved from. CuPy's pool always; torch's caching
    allocator when torch is loaded and CUDA is initialized."""
    n = max(_POISON_MIN_BYTES, 4 * int(nbytes_hint))
    cp = _cupy()
    cp.cuda.Device().synchronize()
    pool = cp.get_default_memory_pool()
    pool.free_all_blocks()
    x = cp.empty(n, dtype=cp.uint8)
    x.fill(0xFF)
    small = [cp.empty(1 << 20, dtype=cp.uint8) for _ in range(8)]
    for s in small:
        s.fill(0xFF)
    del x, small
    cp.cuda.Device().synchronize()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        big = torch.empty(n, dtype=torch.uint8, device="cuda")
        big.fill_(0xFF)
        tsmall = [torch.empty(1 << 20, dtype=torch.uint8, device="cuda") for _ in range(8)]
        for t in tsmall:
            t.fill_(0xFF)
        del big, tsmall
        torch.cuda.synchronize()


def _nbytes(*arrays) -> int:
    return sum(int(a.size) * a.dtype.itemsize for a in arrays)


# ---------------------------------------------------------------------------------------------
# Feature sets
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class FeatureSet:
    """What a case turns on; materialize() draws the arrays."""

    name: str
    lengths: str | None = None              # None, "q", "kv", "both" (padded batch of 5)
    window: tuple | None = None
    num_sink_tokens: int = 0
    sink_logits: bool = False
    alibi: str | None = None                # None, "h" (nheads,), "bh" (batch, nheads)
    softcap: float | None = None
    scale: float | None = None              # explicit softmax_scale
    qk_scale: float = 1.0                   # q and k drawn as N(0, qk_scale^2)


F = FeatureSet
SOFTCAP = 10.0
SOFTCAP_QK = 3.0   # scores ~ N(0, 9^2): tanh(s / 10) saturates on a good share of them

FEATURES = [
    # each feature alone
    F("qlens", lengths="q"),
    F("kvlens", lengths="kv"),
    F("lens", lengths="both"),
    F("win3_0", window=(3, 0)),
    F("win5_7", window=(5, 7)),
    F("win0_0", window=(0, 0)),
    F("win5000", window=(5000, 5000)),
    F("winm1_17", window=(-1, 17)),
    F("win33_m1", window=(33, -1)),
    F("sinktok_nowin", num_sink_tokens=4),
    F("win16_0_sinktok4", window=(16, 0), num_sink_tokens=4),
    F("win3_m1_sinktok1", window=(3, -1), num_sink_tokens=1),
    F("sinklogits", sink_logits=True),
    F("alibi_h", alibi="h"),
    F("alibi_bh", alibi="bh"),
    F("softcap", softcap=SOFTCAP, qk_scale=SOFTCAP_QK),
    # pairs
    F("lens+win", lengths="both", window=(32, 0)),
    F("lens+sinklogits", lengths="both", sink_logits=True),
    F("lens+alibi", lengths="both", alibi="bh"),
    F("lens+softcap", lengths="both", softcap=SOFTCAP, qk_scale=SOFTCAP_QK),
    F("win+sinklogits", window=(5, 7), sink_logits=True),
    F("win+alibi", window=(64, 8), alibi="h"),
    F("win+softcap", window=(7, 0), softcap=SOFTCAP, qk_scale=SOFTCAP_QK),
    F("sinklogits+alibi", sink_logits=True, alibi="bh"),
    F("sinklogits+softcap", sink_logits=True, softcap=SOFTCAP, qk_scale=SOFTCAP_QK),
    F("alibi+softcap", alibi="h", softcap=SOFTCAP, qk_scale=SOFTCAP_QK, scale=0.3),
    F("sinktok+sinklogits", window=(16, 0), num_sink_tokens=4, sink_logits=True),
    F("all", lengths="both", window=(24, 3), num_sink_tokens=2, sink_logits=True, alibi="bh",
      softcap=SOFTCAP, qk_scale=SOFTCAP_QK),
]
FEATURES_BY_NAME = {f.name: f for f in FEATURES}
ALL = FEATURES_BY_NAME["all"]

LENGTHS_BATCH = 5


def _odd_below(n: int) -> int:
    """An odd length below n (n itself when n <= 1): 300 -> 299, 77 -> 75, 2 -> 1."""
    if n <= 1:
        return n
    return n - 1 if n % 2 == 0 else max(1, n - 2)


def padded_lengths(kind: str, sq: int, sk: int):
    """(q_lengths, kv_lengths) for a padded batch of 5, numpy int32 or None. The (q, kv) pairs for
    "both": (37, full), (0, odd), (1, 1), (full, odd), (odd, 0): an empty query sequence, a single
    token, a key sequence of length 0 (rows that see no key) and odd lengths."""
    q = np.array([min(37, sq), 0, min(1, sq), sq, _odd_below(sq)], dtype=np.int32)
    kv = np.array([sk, _odd_below(sk), min(1, sk), _odd_below(sk), 0], dtype=np.int32)
    if kind == "q":
        return q, None
    if kind == "kv":
        return None, np.array([sk, _odd_below(sk), min(1, sk), 0, min(131, sk)], dtype=np.int32)
    if kind == "both":
        return q, kv
    raise ValueError(kind)


def alibi_slopes(kind: str, rng, batch: int, nheads: int) -> np.ndarray:
    if kind == "h":   # the usual geometric sequence 2^(-8 (h + 1) / nheads)
        return (2.0 ** (-8.0 * (np.arange(nheads) + 1) / nheads)).astype(np.float32)
    if kind == "bh":
        return rng.uniform(0.0, 0.5, size=(batch, nheads)).astype(np.float32)
    raise ValueError(kind)


def sink_values(rng, nheads: int) -> np.ndarray:
    s = rng.normal(0.0, 2.0, size=nheads)
    s[0] = 4.0   # one head where the sink takes a large share of the probability
    return s.astype(np.float32)


def causal_window(window, causal: bool):
    """The window to pass with `causal`: causal=True means right = 0, and cuflash rejects a window whose right
    bound contradicts it, so a right bound > 0 becomes 0 in causal runs (-1 and 0 are passed as they are)."""
    if window is None:
        return None
    left, right = window
    return (left, 0 if causal and right > 0 else right)


def materialize(fs: FeatureSet, rng, batch: int, sq: int, sk: int, nheads: int, causal: bool = False) -> dict:
    """The feature arguments of a case as host values (numpy arrays, tuples, floats)."""
    feat = {}
    if fs.lengths:
        ql, kl = padded_lengths(fs.lengths, sq, sk)
        if ql is not None:
            feat["q_lengths"] = ql
        if kl is not None:
            feat["kv_lengths"] = kl
    if fs.window is not None:
        feat["window"] = tuple(causal_window(fs.window, causal))
    if fs.num_sink_tokens:
        feat["num_sink_tokens"] = int(fs.num_sink_tokens)
    if fs.sink_logits:
        feat["sink_logits"] = sink_values(rng, nheads)
    if fs.alibi:
        feat["alibi_slopes"] = alibi_slopes(fs.alibi, rng, batch, nheads)
    if fs.softcap:
        feat["softcap"] = float(fs.softcap)
    return feat


def api_kwargs(feat: dict, to_dev=None) -> dict:
    """The keyword arguments for cuflash: arrays moved with to_dev (default: CuPy)."""
    to_dev = to_dev or _dev
    kw = {}
    for key, val in feat.items():
        kw[key] = to_dev(val) if isinstance(val, np.ndarray) else val
    return kw


def ref_kwargs(feat: dict) -> dict:
    """The keyword arguments for the float64 references (their defaults spelled out)."""
    return {"q_lengths": feat.get("q_lengths"), "kv_lengths": feat.get("kv_lengths"),
            "window": tuple(feat.get("window", (-1, -1))), "num_sink_tokens": int(feat.get("num_sink_tokens", 0)),
            "sink_logits": feat.get("sink_logits"), "alibi_slopes": feat.get("alibi_slopes"),
            "softcap": float(feat.get("softcap", 0.0))}


def describe(feat: dict) -> str:
    parts = []
    for key, val in feat.items():
        if isinstance(val, np.ndarray):
            parts.append(f"{key}={val.tolist() if val.size <= 8 else val.shape}")
        else:
            parts.append(f"{key}={val}")
    return " ".join(parts)


# ---------------------------------------------------------------------------------------------
# Visibility (the spec of cuflash/_features.py, for the exact-value checks)
# ---------------------------------------------------------------------------------------------

def visible_one(sq: int, sk: int, q_len: int, kv_len: int, causal: bool, window, num_sink_tokens: int):
    """(sq, sk) bool for one batch entry: True where valid query row i sees key j."""
    left, right = window if window is not None else (-1, -1)
    if causal:
        right = 0
    i = np.arange(sq)[:, None]
    j = np.arange(sk)[None, :]
    ip = i + kv_len - q_len
    vis = (i < q_len) & (j < kv_len)
    if right >= 0:
        vis &= j <= ip + right
    if left >= 0:
        vis &= (j >= ip - left) | (j < num_sink_tokens)
    return vis


def visible_padded(batch, sq, sk, causal, feat):
    """(batch, sq, sk) bool for a padded batch."""
    ql = feat.get("q_lengths")
    kl = feat.get("kv_lengths")
    return np.stack([visible_one(sq, sk, sq if ql is None else int(ql[b]), sk if kl is None else int(kl[b]),
                                 causal, feat.get("window"), feat.get("num_sink_tokens", 0))
                     for b in range(batch)])


# ---------------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------------

def _finite_report(name, x, msg):
    xf = np.asarray(x).astype(np.float32)
    n_nan = int(np.isnan(xf).sum())
    assert n_nan == 0, f"{msg}: {name} has {n_nan} NaN (an unwritten element?)"
    n_inf = int(np.isinf(xf).sum())
    assert n_inf == 0, f"{msg}: {name} has {n_inf} infinities"


def check_out(out, ref, naive, msg, name="out"):
    """out (host) against the float64 reference with the forward criterion."""
    _finite_report(name, out, msg)
    ok, detail = _check_close(out, ref, naive, FWD_FACTOR, FWD_FLOOR)
    if not ok:
        diff = np.abs(out.astype(np.float64) - ref)
        where = tuple(int(x) for x in np.unravel_index(int(np.argmax(diff)), diff.shape))
        raise AssertionError(f"{msg}: {name}: {detail}; worst at {where}")


def check_lse(lse, ref_lse, msg, shape):
    assert lse.shape == tuple(shape), f"{msg}: lse shape {lse.shape} != {tuple(shape)}"
    assert lse.dtype == np.float32, f"{msg}: lse dtype {lse.dtype} != float32"
    assert not np.isnan(lse).any(), f"{msg}: lse has {int(np.isnan(lse).sum())} NaN"
    assert not np.isposinf(lse).any(), f"{msg}: lse has +inf"
    got_inf, ref_inf = np.isneginf(lse), np.isneginf(ref_lse)
    if not np.array_equal(got_inf, ref_inf):
        extra = np.argwhere(got_inf & ~ref_inf)[:5].tolist()
        missing = np.argwhere(ref_inf & ~got_inf)[:5].tolist()
        raise AssertionError(f"{msg}: lse -inf on {int(got_inf.sum())} rows, reference on {int(ref_inf.sum())}; "
                             f"-inf but should be finite at {extra}; finite but should be -inf at {missing}")
    fin = ~ref_inf
    if fin.any():
        d = np.abs(lse[fin].astype(np.float64) - ref_lse[fin])
        tol = LSE_RTOL * (1.0 + np.abs(ref_lse[fin]))
        bad = d > tol
        assert not bad.any(), (f"{msg}: lse off on {int(bad.sum())} rows; max|lse-ref| = {d.max():.4g} "
                               f"(tolerance {LSE_RTOL:g} * (1 + |ref|))")


def check_grad(name, g, like_shape, like_dtype, ref, naive, msg):
    assert g.shape == tuple(like_shape), f"{msg}: {name} shape {g.shape} != {tuple(like_shape)}"
    assert g.dtype == like_dtype, f"{msg}: {name} dtype {g.dtype} != {like_dtype}"
    _finite_report(name, g, msg)
    ok, detail = _check_close(g, ref, naive, BWD_FACTOR, BWD_FLOOR)
    if not ok:
        diff = np.abs(g.astype(np.float64) - ref)
        where = tuple(int(x) for x in np.unravel_index(int(np.argmax(diff)), diff.shape))
        raise AssertionError(f"{msg}: {name}: {detail}; worst at {where}; max|ref| = {np.abs(ref).max():.4g}")


def dsink_from_definition(dout, out, lse, sink, layout):
    """d sink_logits from its definition, in float64 from the out and lse the backward received:
    -sum over rows of exp(sink[h] - lse) * sum_d dout * out. Returns (value (nheads,), sum of |terms|).
    layout "padded": dout/out (b, s, h, d), lse (b, h, s); "varlen": dout/out (t, h, d), lse (h, t)."""
    D = np.sum(dout.astype(np.float64) * out.astype(np.float64), axis=-1)
    lse = lse.astype(np.float64)
    s = sink.astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        if layout == "padded":
            p = np.exp(s[None, :, None] - lse)               # (b, h, s); rows with lse -inf: dropped below
            Dh = np.swapaxes(D, 1, 2)                        # (b, h, s)
            terms = np.where(np.isneginf(lse), 0.0, -p * Dh)
            return terms.sum(axis=(0, 2)), np.abs(terms).sum(axis=(0, 2))
        p = np.exp(s[:, None] - lse)                         # (h, t)
        terms = np.where(np.isneginf(lse), 0.0, -p * D.T)
        return terms.sum(axis=1), np.abs(terms).sum(axis=1)


def dsink_out_shift(dout, out, ref_out, ref_lse, sink, layout):
    """How far d sink_logits moves from the exact gradient because of the out the backward was handed: the
    definition's change, -sum over rows of exp(sink[h] - lse) * sum_d dout * (out - ref_out), in float64 at the
    reference lse (the definition is linear in out). Layouts as dsink_from_definition's."""
    return dsink_from_definition(dout, out.astype(np.float64) - ref_out, ref_lse, sink, layout)[0]


def check_dsink(dsink, ref, naive, self_val, self_abs, nheads, msg, shift):
    """d sink_logits: (b) against its definition from the out and lse the backward received (tight: how the
    kernels summed it), then (a) against the float64 gradient, after taking out `shift` (dsink_out_shift).

    Every backward forms d sink as FlashAttention forms D, from the forward's out rounded to the input dtype
    (D = rowsum(dout * out)), so d sink carries out's rounding, summed over every row of the batch; the
    naive autograd's d sink does not (it comes from P and dP), and its error is small by luck now and then.
    Checked as it was (3 x that error), the NumPy backward, exact for its inputs, failed in 3 of 120 draws;
    the GPU's seeds 3188955339975619768 (session 9) and 2287796830739956395 (session 12, head_dim 256
    sink logits) failed the same way, and the NumPy path reproduces both (0.0101 and 0.0033 off, of which
    all but 5e-7 and 6e-8 is the shift). out's own accuracy is checked by check_out; here the rule is
    applied to what d sink adds to it."""
    assert dsink.shape == (nheads,), f"{msg}: dsink shape {dsink.shape} != {(nheads,)}"
    assert dsink.dtype == np.float32, f"{msg}: dsink dtype {dsink.dtype} != float32 (sink_logits' dtype)"
    _finite_report("dsink", dsink, msg)
    d64 = dsink.astype(np.float64)
    # (b) first: it is the tight one, so a failure of (a) alone says the deviation is in the inputs the
    # backward received (out and lse), not in how the kernels summed them.
    serr = np.abs(d64 - self_val)
    stol = DSINK_SELF_RTOL * self_abs + 1e-6
    assert (serr <= stol).all(), (f"{msg}: dsink differs from -sum exp(sink - lse) * rowsum(dout * out) computed "
                                  f"from the backward's own out / lse: |diff| {serr.tolist()} > {stol.tolist()}; "
                                  f"dsink={dsink.tolist()}, from definition={self_val.tolist()}")
    raw = float(np.abs(d64 - ref).max())
    err = float(np.abs(d64 - ref - shift).max())
    err_naive = float(np.abs(naive.astype(np.float64) - ref).max())
    bound = BWD_FACTOR * err_naive + BWD_FLOOR + DSINK_REL * float(np.abs(ref).max())
    assert err <= bound, (f"{msg}: max|dsink - ref64 - shift| = {err:.4g} > {bound:.4g} (3 * naive {err_naive:.4g} "
                          f"+ 1e-4 + {DSINK_REL:g} * max|ref| {np.abs(ref).max():.4g}); max|dsink - ref64| {raw:.4g}, "
                          f"out's shift {shift.tolist()}; dsink={dsink.tolist()}, ref={ref.tolist()}; within (b) of "
                          f"its definition: |diff| {serr.tolist()}")


def check_padding_forward(out, lse, vis, feat, msg):
    """out rows that see no key exactly 0; padded query rows lse exactly -inf (padded layout)."""
    no_key = ~vis.any(axis=-1)                                # (b, sq)
    if no_key.any():
        rows = out[no_key]                                    # (n, h, d)
        nz = int(np.count_nonzero(rows.astype(np.float32)))
        assert nz == 0, f"{msg}: {nz} nonzero out elements on the {int(no_key.sum())} rows that see no key"
    ql = feat.get("q_lengths")
    if ql is not None:
        for b, n in enumerate(ql.tolist()):
            assert np.isneginf(lse[b, :, n:]).all(), f"{msg}: lse of padded rows {n}.. of batch {b} must be -inf"
    if "sink_logits" not in feat and no_key.any():
        assert np.isneginf(np.swapaxes(lse, 1, 2)[no_key]).all(), f"{msg}: lse of rows that see no key must be -inf"


def check_padding_backward(dq, dk, dv, vis, msg):
    """dq exactly 0 on rows that see no key; dk, dv exactly 0 on keys no valid query sees."""
    no_key = ~vis.any(axis=-1)          # (b, sq)
    unseen = ~vis.any(axis=1)           # (b, sk)
    if no_key.any():
        nz = int(np.count_nonzero(dq[no_key].astype(np.float32)))
        assert nz == 0, f"{msg}: dq has {nz} nonzero elements on the {int(no_key.sum())} rows that see no key"
    if unseen.any():
        for name, g in (("dk", dk), ("dv", dv)):
            nz = int(np.count_nonzero(g[unseen].astype(np.float32)))
            assert nz == 0, f"{msg}: {name} has {nz} nonzero elements on the {int(unseen.sum())} keys no query sees"


# ---------------------------------------------------------------------------------------------
# One padded-batch case: forward and backward through CuPy
# ---------------------------------------------------------------------------------------------

def make_inputs(rng, dtype, b, sq, sk, h, hkv, d, qk_scale=1.0):
    npdt = NP_DTYPES[dtype]
    q = (rng.standard_normal((b, sq, h, d)) * qk_scale).astype(npdt)
    k = (rng.standard_normal((b, sk, hkv, d)) * qk_scale).astype(npdt)
    v = rng.standard_normal((b, sk, hkv, d)).astype(npdt)
    return q, k, v


def forward_refs(q, k, v, causal, scale, feat):
    rk = ref_kwargs(feat)
    ref, ref_lse = _ref_forward(q, k, v, causal, scale, None, **rk)
    naive, _ = _ref_forward(q, k, v, causal, scale, "input", **rk)
    return np.asarray(ref, dtype=np.float64), np.asarray(ref_lse, dtype=np.float64), np.asarray(naive)


def grad_refs(dout, q, k, v, causal, scale, feat):
    rk = ref_kwargs(feat)
    ref = _ref_grads(dout, q, k, v, causal, scale, None, **rk)
    naive = _ref_grads(dout, q, k, v, causal, scale, "input", **rk)
    return ref, naive


def assert_softcap_saturates(q, k, scale, feat, msg):
    """Guards the test itself: a softcap case must have scores where tanh saturates."""
    c = feat.get("softcap")
    if not c:
        return
    # Every entry and head (the first 64 query rows of each): one row against a few hundred keys alone
    # fell short of 2c now and then (soak of 2026-11-23: max|s| 19.9 at sq=1, sk=300).
    g = q.shape[2] // k.shape[2]
    kk = np.repeat(k.astype(np.float64), g, axis=2)
    s = scale * np.einsum("bshd,bthd->bhst", q[:, :64].astype(np.float64), kk)
    assert np.abs(s).max() > 2.0 * c, f"{msg}: test inputs too small for softcap {c}: max|s| {np.abs(s).max():.3g}"


def run_padded_case(cf, *, seed, dtype, batch, sq, sk, h, hkv, d, causal, deterministic, fs: FeatureSet,
                    label, backward=True):
    """cuflash.attention on CuPy arrays with the features of fs, checked; then
    cuflash.attention_backward, checked. Returns the host results."""
    rng = np.random.default_rng(seed)
    msg = seed_msg(seed, label)
    q, k, v = make_inputs(rng, dtype, batch, sq, sk, h, hkv, d, fs.qk_scale)
    feat = materialize(fs, rng, batch, sq, sk, h, causal)
    msg += " " + describe(feat)
    scale = fs.scale if fs.scale is not None else 1.0 / math.sqrt(d)
    assert_softcap_saturates(q, k, scale, feat, msg)
    qd, kd, vd = _dev(q), _dev(k), _dev(v)
    kw = api_kwargs(feat)
    if fs.scale is not None:
        kw["softmax_scale"] = fs.scale
    poison(_nbytes(q) + batch * h * sq * 4)
    res = cf.attention(qd, kd, vd, causal=causal, return_lse=True, **kw)
    assert isinstance(res, tuple) and len(res) == 2, f"{msg}: return_lse=True must return (out, lse)"
    out_d, lse_d = res
    cp = _cupy()
    assert isinstance(out_d, cp.ndarray) and isinstance(lse_d, cp.ndarray), f"{msg}: {type(out_d)}, {type(lse_d)}"
    out, lse = _host(out_d), _host(lse_d)
    assert out.shape == q.shape and out.dtype == q.dtype, f"{msg}: out {out.shape} {out.dtype}"

    ref, ref_lse, naive = forward_refs(q, k, v, causal, scale, feat)
    vis = visible_padded(batch, sq, sk, causal, feat)
    check_out(out, ref, naive, msg)
    check_lse(lse, ref_lse, msg, (batch, h, sq))
    check_padding_forward(out, lse, vis, feat, msg)
    if not backward:
        return out, lse, None

    dout = rng.standard_normal((batch, sq, h, d)).astype(NP_DTYPES[dtype])
    doutd = _dev(dout)
    poison(2 * (_nbytes(q) + 2 * _nbytes(k)) + 8 * batch * h * (sq + 128) * (d + 2))
    grads = cf.attention_backward(doutd, qd, kd, vd, out_d, lse_d, causal=causal, deterministic=deterministic, **kw)
    has_sink = "sink_logits" in feat
    n_expect = 4 if has_sink else 3
    assert isinstance(grads, tuple) and len(grads) == n_expect, (
        f"{msg}: attention_backward returned {type(grads).__name__} of "
        f"{len(grads) if isinstance(grads, tuple) else '?'}"
        f" values, expected {n_expect} ({'dq, dk, dv, dsink' if has_sink else 'dq, dk, dv'})")
    for g in grads:
        assert isinstance(g, cp.ndarray), f"{msg}: a gradient is {type(g)}, expected cupy.ndarray"
    gh = [_host(g) for g in grads]
    ref_g, naive_g = grad_refs(dout, q, k, v, causal, scale, feat)
    given = None
    for i, (name, g, x, r, n) in enumerate(zip(("dq", "dk", "dv"), gh, (q, k, v), ref_g, naive_g)):
        try:
            check_grad(name, g, x.shape, x.dtype, np.asarray(r, dtype=np.float64), np.asarray(n), msg)
        except AssertionError as e:
            if name == "dv":  # dv = P^T dout does not involve D
                raise
            # dq and dk go through dS = P (dP - D), and every backward forms D = rowsum(dout * out) from the
            # out it is handed, rounded to the input dtype (FlashAttention's D); the naive autograd's D does
            # not pass through out. Where one row's D error is the largest term (a row with one query and a
            # sink logit or a steep ALiBi slope) that rounding alone can exceed the rule: sessions 8 and 9
            # recorded five such GPU seeds (5749519082516743148, 127345327228258926, 2675218138546244751,
            # 196078417100779651, 6481226003996618711), and the NumPy path, exact for its inputs, reproduces
            # each (tests/test_gpu_rules_cpu.py). So a gradient outside the rule is held, with the same
            # bound, against the exact gradients of the given out (D from it, in float64); out's own accuracy
            # is check_out's.
            if given is None:
                given = _ref_grads(dout, q, k, v, causal, scale, None, delta_out=out, **ref_kwargs(feat))
            check_grad(name, g, x.shape, x.dtype, np.asarray(given[i], dtype=np.float64), np.asarray(n),
                       f"{e}; and against the exact gradients of the given out")
    check_padding_backward(gh[0], gh[1], gh[2], vis, msg)
    if has_sink:
        sv, sa = dsink_from_definition(dout, out, lse, feat["sink_logits"], "padded")
        shift = dsink_out_shift(dout, out, ref, ref_lse, feat["sink_logits"], "padded")
        check_dsink(gh[3], np.asarray(ref_g[3], dtype=np.float64), np.asarray(naive_g[3]), sv, sa, h, msg, shift)
    # the backward's inputs are untouched
    for name, dev_arr, host_arr in (("q", qd, q), ("k", kd, k), ("v", vd, v), ("dout", doutd, dout),
                                    ("out", out_d, out), ("lse", lse_d, lse)):
        assert np.array_equal(_host(dev_arr).view(np.uint8), np.ascontiguousarray(host_arr).view(np.uint8)), (
            f"{msg}: attention_backward modified its input {name}")
    return out, lse, gh


# ---------------------------------------------------------------------------------------------
# The feature grid
# ---------------------------------------------------------------------------------------------

DTYPES = ("float16", "bfloat16")
CAUSALS = (False, True)
HEADS = ((4, 4), (4, 2), (4, 1))                       # MHA, GQA, MQA
GRID_HEAD_DIMS = (64, 128, 96, 40, 256)
SHAPES = ((113, 203), (256, 256), (300, 77), (1, 300), (190, 190), (77, 300), (128, 333), (257, 129))


def _group(dtype, hd):
    return pytest.mark.xdist_group(f"features-{SHORT[dtype]}-d{hd}")


def _grid_params():
    """28 feature sets x 2 dtypes x causal off/on = 112 cases, each a forward and a backward.

    Rotations (i_f: feature set, i_dt: dtype, i_c: causal), so that every feature set meets MHA, GQA
    and MQA, four head_dims, four shapes and both backward paths across its four runs:
        heads         = HEADS[(i_f + i_dt + 2 i_c) % 3]
        head_dim      = GRID_HEAD_DIMS[(i_f + 2 i_dt + i_c) % 5]
        shape         = SHAPES[(3 i_f + 2 i_dt + 5 i_c) % 8]
        deterministic = (i_f + i_dt + i_c) % 2 == 1
    """
    params = []
    for i_f, fs in enumerate(FEATURES):
        for i_dt, dt in enumerate(DTYPES):
            for i_c, causal in enumerate(CAUSALS):
                h, hkv = HEADS[(i_f + i_dt + 2 * i_c) % 3]
                hd = GRID_HEAD_DIMS[(i_f + 2 * i_dt + i_c) % len(GRID_HEAD_DIMS)]
                sq, sk = SHAPES[(3 * i_f + 2 * i_dt + 5 * i_c) % len(SHAPES)]
                det = (i_f + i_dt + i_c) % 2 == 1
                cid = (f"{fs.name}-{SHORT[dt]}-{'causal' if causal else 'full'}-d{hd}-q{sq}k{sk}-h{h}kv{hkv}"
                       f"-{'det' if det else 'nondet'}")
                params.append(pytest.param(fs.name, dt, causal, hd, sq, sk, h, hkv, det, id=cid,
                                           marks=[_group(dt, hd)]))
    return params


@gpu
@pytest.mark.parametrize("feature,dtype,causal,head_dim,seqlen_q,seqlen_k,nheads,nheads_kv,deterministic",
                         _grid_params())
def test_features(cf, feature, dtype, causal, head_dim, seqlen_q, seqlen_k, nheads, nheads_kv, deterministic):
    fs = FEATURES_BY_NAME[feature]
    batch = LENGTHS_BATCH if fs.lengths else 2
    seed = fresh_seed()
    run_padded_case(cf, seed=seed, dtype=dtype, batch=batch, sq=seqlen_q, sk=seqlen_k, h=nheads, hkv=nheads_kv,
                    d=head_dim, causal=causal, deterministic=deterministic, fs=fs,
                    label=f"{feature} {dtype} causal={causal} d={head_dim} sq={seqlen_q} sk={seqlen_k} "
                          f"h={nheads} hkv={nheads_kv} deterministic={deterministic}")


# ---------------------------------------------------------------------------------------------
# Every head_dim with all features on
# ---------------------------------------------------------------------------------------------

ALL_HEAD_DIMS = tuple(range(8, 257, 8))
DEFAULT_HEAD_DIMS = (8, 16, 40, 64, 72, 112, 128, 136, 192, 256)


def _head_dim_params():
    params = []
    for i, hd in enumerate(ALL_HEAD_DIMS):
        dt = DTYPES[i % 2]
        causal = (i // 2) % 2 == 1
        h, hkv = HEADS[i % 3]
        marks = [_group(dt, hd)]
        if hd not in DEFAULT_HEAD_DIMS:
            marks.append(pytest.mark.slow)
        params.append(pytest.param(hd, dt, causal, h, hkv, i % 2 == 0,
                                   id=f"d{hd}-{SHORT[dt]}-{'causal' if causal else 'full'}-h{h}kv{hkv}",
                                   marks=marks))
    return params


@gpu
@pytest.mark.parametrize("head_dim,dtype,causal,nheads,nheads_kv,deterministic", _head_dim_params())
def test_head_dims(cf, head_dim, dtype, causal, nheads, nheads_kv, deterministic):
    """Lengths, window + sink tokens, sink logits, ALiBi (batch, nheads) and softcap together at every
    head_dim the plain path supports (a spread by default; the others are marked slow)."""
    seed = fresh_seed()
    run_padded_case(cf, seed=seed, dtype=dtype, batch=LENGTHS_BATCH, sq=150, sk=171, h=nheads, hkv=nheads_kv,
                    d=head_dim, causal=causal, deterministic=deterministic, fs=ALL,
                    label=f"all features d={head_dim} {dtype} causal={causal} h={nheads} hkv={nheads_kv} "
                          f"deterministic={deterministic}")


# ---------------------------------------------------------------------------------------------
# Trivial feature arguments give the plain result
# ---------------------------------------------------------------------------------------------

@gpu
@pytest.mark.parametrize("variant,dtype,causal", [("full_lengths", "bfloat16", True),
                                                  ("full_lengths", "float16", False),
                                                  ("window_huge", "bfloat16", False),
                                                  ("window_unbounded", "float16", True),
                                                  ("zero_alibi", "bfloat16", True)])
def test_trivial_features_match_plain(cf, variant, dtype, causal):
    """Feature arguments that change nothing (full lengths, a window wider than the sequence, window
    (-1, -1), num_sink_tokens=0, all-zero ALiBi slopes) give the plain call's result, and both match
    the reference."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    b, sq, sk, h, hkv, d = 2, 200, 311, 4, 2, 128
    q, k, v = make_inputs(rng, dtype, b, sq, sk, h, hkv, d)
    feat = {"full_lengths": {"q_lengths": np.full(b, sq, np.int32), "kv_lengths": np.full(b, sk, np.int32)},
            "window_huge": {"window": (5000, 5000)},
            "window_unbounded": {"window": (-1, -1), "num_sink_tokens": 0},
            "zero_alibi": {"alibi_slopes": np.zeros(h, np.float32)}}[variant]
    msg = seed_msg(seed, f"{variant} {dtype} causal={causal} " + describe(feat))
    scale = 1.0 / math.sqrt(d)
    qd, kd, vd = _dev(q), _dev(k), _dev(v)
    poison()
    out_f, lse_f = (_host(x) for x in cf.attention(qd, kd, vd, causal=causal, return_lse=True, **api_kwargs(feat)))
    poison()
    out_p, lse_p = (_host(x) for x in cf.attention(qd, kd, vd, causal=causal, return_lse=True))
    ref, ref_lse, naive = forward_refs(q, k, v, causal, scale, {})
    check_out(out_f, ref, naive, msg + " (with the feature arguments)")
    check_out(out_p, ref, naive, msg + " (plain)")
    check_lse(lse_f, ref_lse, msg, (b, h, sq))
    bound = FWD_FACTOR * float(np.abs(naive.astype(np.float64) - ref).max()) + FWD_FLOOR
    diff = float(np.abs(out_f.astype(np.float64) - out_p.astype(np.float64)).max())
    assert diff <= 2 * bound, f"{msg}: feature path and plain path differ by {diff:.4g} > {2 * bound:.4g}"


# ---------------------------------------------------------------------------------------------
# Packed batches: attention_varlen / attention_varlen_backward
# ---------------------------------------------------------------------------------------------

VARLEN_SELF = (0, 1, 37, 130, 64, 5)                          # q and k lengths equal
VARLEN_CROSS = ((3, 0, 37, 130, 1, 64), (50, 7, 0, 129, 1, 200))   # (q lengths, k lengths)
VARLEN_EXTRA_Q, VARLEN_EXTRA_K = 13, 9                         # rows past cu_seqlens[-1]

VARLEN_FEATURES = [
    F("plain"),
    F("win5_7", window=(5, 7)),
    F("win3_0_sinktok2", window=(3, 0), num_sink_tokens=2),
    F("sinklogits", sink_logits=True),
    F("alibi_h", alibi="h"),
    F("alibi_bh", alibi="bh"),
    F("softcap", softcap=SOFTCAP, qk_scale=SOFTCAP_QK),
    F("all", window=(24, 3), num_sink_tokens=2, sink_logits=True, alibi="bh", softcap=SOFTCAP,
      qk_scale=SOFTCAP_QK),
]
VARLEN_HEAD_DIMS = (64, 128, 96, 40)


def _varlen_params():
    """8 feature sets x 2 dtypes x causal off/on = 32 cases; self- and cross-attention lengths,
    heads, head_dim and deterministic rotated."""
    params = []
    for i_f, fs in enumerate(VARLEN_FEATURES):
        for i_dt, dt in enumerate(DTYPES):
            for i_c, causal in enumerate(CAUSALS):
                h, hkv = HEADS[(i_f + i_dt + 2 * i_c) % 3]
                hd = VARLEN_HEAD_DIMS[(i_f + 2 * i_dt + i_c) % len(VARLEN_HEAD_DIMS)]
                cross = (i_f + i_c) % 2 == 1
                det = (i_f + i_dt) % 2 == 1
                cid = (f"{fs.name}-{SHORT[dt]}-{'causal' if causal else 'full'}-d{hd}-h{h}kv{hkv}-"
                       f"{'cross' if cross else 'self'}-{'det' if det else 'nondet'}")
                params.append(pytest.param(fs.name, dt, causal, hd, h, hkv, cross, det, id=cid,
                                           marks=[_group(dt, hd)]))
    return params


def cu_seqlens(lengths, total=None) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def pack_to_padded(x, cu, max_len):
    """(total, h, d) packed -> (batch, max_len, h, d) padded with zeros."""
    batch = len(cu) - 1
    out = np.zeros((batch, max_len) + x.shape[1:], dtype=x.dtype)
    for b in range(batch):
        n = cu[b + 1] - cu[b]
        out[b, :n] = x[cu[b]:cu[b + 1]]
    return out


def padded_to_pack(x, cu, total, fill=0.0):
    """(batch, max_len, ...) padded -> (total, ...) packed; rows past cu[-1] get `fill`."""
    out = np.full((total,) + x.shape[2:], fill, dtype=x.dtype)
    for b in range(len(cu) - 1):
        n = cu[b + 1] - cu[b]
        out[cu[b]:cu[b + 1]] = x[b, :n]
    return out


def lse_padded_to_pack(lse, cu, total):
    """(batch, h, max_len) -> (h, total), -inf past cu[-1]."""
    return padded_to_pack(np.swapaxes(lse, 1, 2), cu, total, fill=-np.inf).T


def varlen_feat_for_padded(feat, lq, lk):
    f = dict(feat)
    f["q_lengths"] = np.asarray(lq, np.int32)
    f["kv_lengths"] = np.asarray(lk, np.int32)
    return f


def varlen_visibility(lq, lk, total_q, total_k, causal, feat):
    """(no_key (total_q,), unseen (total_k,)) bool in packed layout."""
    cq, ck = cu_seqlens(lq), cu_seqlens(lk)
    no_key = np.ones(total_q, bool)
    unseen = np.ones(total_k, bool)
    for b in range(len(lq)):
        vis = visible_one(lq[b], lk[b], lq[b], lk[b], causal, feat.get("window"), feat.get("num_sink_tokens", 0))
        no_key[cq[b]:cq[b + 1]] = ~vis.any(axis=1)
        unseen[ck[b]:ck[b + 1]] = ~vis.any(axis=0)
    return no_key, unseen


@gpu
@pytest.mark.parametrize("feature,dtype,causal,head_dim,nheads,nheads_kv,cross,deterministic", _varlen_params())
def test_varlen(cf, feature, dtype, causal, head_dim, nheads, nheads_kv, cross, deterministic):
    """A packed batch with sequences of lengths 0, 1 and odd values, and rows past cu_seqlens[-1]:
    forward and backward against the reference (the padded equivalent with q_lengths / kv_lengths,
    repacked), and against cuflash.attention run on each sequence alone. Rows past the end: out 0,
    lse -inf, dq 0; keys past the end: dk = dv = 0."""
    fs = {f.name: f for f in VARLEN_FEATURES}[feature]
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    lq, lk = (VARLEN_CROSS if cross else (VARLEN_SELF, VARLEN_SELF))
    lq, lk = list(lq), list(lk)
    batch = len(lq)
    cq, ck = cu_seqlens(lq), cu_seqlens(lk)
    tq, tk = int(cq[-1]) + VARLEN_EXTRA_Q, int(ck[-1]) + VARLEN_EXTRA_K
    mq, mk = max(lq), max(lk)
    h, hkv, d = nheads, nheads_kv, head_dim
    npdt = NP_DTYPES[dtype]
    q = (rng.standard_normal((tq, h, d)) * fs.qk_scale).astype(npdt)
    k = (rng.standard_normal((tk, hkv, d)) * fs.qk_scale).astype(npdt)
    v = rng.standard_normal((tk, hkv, d)).astype(npdt)
    feat = materialize(fs, rng, batch, mq, mk, h, causal)
    msg = seed_msg(seed, f"varlen {feature} {dtype} causal={causal} d={d} h={h} hkv={hkv} lq={lq} lk={lk} "
                         f"total_q={tq} total_k={tk} deterministic={deterministic} " + describe(feat))
    scale = 1.0 / math.sqrt(d)
    qd, kd, vd = _dev(q), _dev(k), _dev(v)
    cqd, ckd = _dev(cq), _dev(ck)
    kw = api_kwargs(feat)

    poison(_nbytes(q) + h * tq * 4)
    res = cf.attention_varlen(qd, kd, vd, cqd, ckd, mq, mk, causal=causal, return_lse=True, **kw)
    assert isinstance(res, tuple) and len(res) == 2, f"{msg}: return_lse=True must return (out, lse)"
    out_d, lse_d = res
    out, lse = _host(out_d), _host(lse_d)
    assert out.shape == q.shape and out.dtype == q.dtype, f"{msg}: out {out.shape} {out.dtype}"

    # reference: the padded equivalent, repacked
    qp, kp, vp = pack_to_padded(q, cq, mq), pack_to_padded(k, ck, mk), pack_to_padded(v, ck, mk)
    pfeat = varlen_feat_for_padded(feat, lq, lk)
    ref_p, ref_lse_p, naive_p = forward_refs(qp, kp, vp, causal, scale, pfeat)
    ref = padded_to_pack(ref_p, cq, tq)
    naive = padded_to_pack(naive_p, cq, tq)
    ref_lse = lse_padded_to_pack(ref_lse_p, cq, tq)
    check_out(out, ref, naive, msg)
    check_lse(lse, ref_lse, msg, (h, tq))
    no_key, unseen = varlen_visibility(lq, lk, tq, tk, causal, feat)
    assert no_key[cq[-1]:].all() and unseen[ck[-1]:].all()
    nz = int(np.count_nonzero(out[no_key].astype(np.float32)))
    assert nz == 0, f"{msg}: {nz} nonzero out elements on rows that see no key or lie past cu_seqlens_q[-1]"
    assert np.isneginf(lse[:, cq[-1]:]).all(), f"{msg}: lse past cu_seqlens_q[-1] must be -inf"

    # each sequence on its own through cuflash.attention
    bound = FWD_FACTOR * float(np.abs(naive.astype(np.float64) - ref).max()) + FWD_FLOOR
    for b in range(batch):
        if lq[b] == 0 or lk[b] == 0:
            continue
        fb = dict(kw)
        if "alibi_slopes" in feat and feat["alibi_slopes"].ndim == 2:
            fb["alibi_slopes"] = _dev(np.ascontiguousarray(feat["alibi_slopes"][b]))
        ob, lb = cf.attention(qd[None, cq[b]:cq[b + 1]], kd[None, ck[b]:ck[b + 1]], vd[None, ck[b]:ck[b + 1]],
                              causal=causal, return_lse=True, **fb)
        ob, lb = _host(ob)[0], _host(lb)[0]
        diff = float(np.abs(ob.astype(np.float64) - out[cq[b]:cq[b + 1]].astype(np.float64)).max())
        assert diff <= 2 * bound, (f"{msg}: sequence {b} (lq {lq[b]}, lk {lk[b]}): attention_varlen and attention on "
                                   f"the sequence alone differ by {diff:.4g} > {2 * bound:.4g}")
        lv = lse[:, cq[b]:cq[b + 1]].astype(np.float64)
        lb = lb.astype(np.float64)
        assert np.array_equal(np.isneginf(lb), np.isneginf(lv)), (
            f"{msg}: sequence {b}: lse is -inf on other rows than attention on the sequence alone")
        fin = np.isfinite(lb)
        ldiff = np.abs(lb[fin] - lv[fin])
        assert (ldiff <= LSE_RTOL * (1 + np.abs(lb[fin]))).all(), (
            f"{msg}: sequence {b}: lse differs from attention on the sequence alone by {ldiff.max():.4g}")

    # backward
    dout = rng.standard_normal((tq, h, d)).astype(npdt)
    doutd = _dev(dout)
    poison(2 * (_nbytes(q) + 2 * _nbytes(k)) + 8 * h * (tq + 128 * batch) * (d + 2))
    grads = cf.attention_varlen_backward(doutd, qd, kd, vd, out_d, lse_d, cqd, ckd, mq, mk, causal=causal,
                                         deterministic=deterministic, **kw)
    has_sink = "sink_logits" in feat
    assert isinstance(grads, tuple) and len(grads) == (4 if has_sink else 3), f"{msg}: backward returned {len(grads)}"
    gh = [_host(g) for g in grads]
    doutp = pack_to_padded(dout, cq, mq)
    ref_g, naive_g = grad_refs(doutp, qp, kp, vp, causal, scale, pfeat)
    for name, g, x, r, n, cu, tot in (("dq", gh[0], q, ref_g[0], naive_g[0], cq, tq),
                                      ("dk", gh[1], k, ref_g[1], naive_g[1], ck, tk),
                                      ("dv", gh[2], v, ref_g[2], naive_g[2], ck, tk)):
        rp = padded_to_pack(np.asarray(r, dtype=np.float64), cu, tot)
        npk = padded_to_pack(np.asarray(n), cu, tot)
        check_grad(name, g, x.shape, x.dtype, rp, npk, msg)
    for name, g, mask in (("dq", gh[0], no_key), ("dk", gh[1], unseen), ("dv", gh[2], unseen)):
        nz = int(np.count_nonzero(g[mask].astype(np.float32)))
        assert nz == 0, (f"{msg}: {name} has {nz} nonzero elements on rows with no key / keys no query sees / "
                         f"past the end")
    if has_sink:
        sv, sa = dsink_from_definition(dout, out, lse, feat["sink_logits"], "varlen")
        shift = dsink_out_shift(dout, out, ref, ref_lse, feat["sink_logits"], "varlen")
        check_dsink(gh[3], np.asarray(ref_g[3], dtype=np.float64), np.asarray(naive_g[3]), sv, sa, h, msg, shift)


@gpu
@pytest.mark.parametrize("dtype,causal", [("bfloat16", True), ("float16", False)])
def test_varlen_matches_padded_call(cf, dtype, causal):
    """attention_varlen on a packed batch and attention(..., q_lengths, kv_lengths) on its padded
    equivalent agree (both checked against the reference), forward and backward."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    lq, lk = [5, 1, 0, 77, 128, 33], [9, 0, 12, 77, 128, 34]
    cq, ck = cu_seqlens(lq), cu_seqlens(lk)
    tq, tk, mq, mk = int(cq[-1]), int(ck[-1]), max(lq), max(lk)
    h, hkv, d = 4, 2, 64
    npdt = NP_DTYPES[dtype]
    q = rng.standard_normal((tq, h, d)).astype(npdt)
    k = rng.standard_normal((tk, hkv, d)).astype(npdt)
    v = rng.standard_normal((tk, hkv, d)).astype(npdt)
    dout = rng.standard_normal((tq, h, d)).astype(npdt)
    sink = sink_values(rng, h)
    feat = {"window": causal_window((40, 2), causal), "sink_logits": sink}
    msg = seed_msg(seed, f"varlen vs padded {dtype} causal={causal} lq={lq} lk={lk}")
    kw = api_kwargs(feat)
    qd, kd, vd, dod = _dev(q), _dev(k), _dev(v), _dev(dout)
    out_v, lse_v = cf.attention_varlen(qd, kd, vd, _dev(cq), _dev(ck), mq, mk, causal=causal, return_lse=True, **kw)
    g_v = cf.attention_varlen_backward(dod, qd, kd, vd, out_v, lse_v, _dev(cq), _dev(ck), mq, mk, causal=causal, **kw)
    qp, kp, vp, dop = (pack_to_padded(x, c, m) for x, c, m in ((q, cq, mq), (k, ck, mk), (v, ck, mk), (dout, cq, mq)))
    lens = {"q_lengths": _dev(np.asarray(lq, np.int32)), "kv_lengths": _dev(np.asarray(lk, np.int32))}
    qpd, kpd, vpd = _dev(qp), _dev(kp), _dev(vp)
    out_p, lse_p = cf.attention(qpd, kpd, vpd, causal=causal, return_lse=True, **kw, **lens)
    g_p = cf.attention_backward(_dev(dop), qpd, kpd, vpd, out_p, lse_p, causal=causal, **kw, **lens)
    out_v, lse_v, out_p, lse_p = (_host(x) for x in (out_v, lse_v, out_p, lse_p))
    g_v, g_p = [_host(g) for g in g_v], [_host(g) for g in g_p]

    pfeat = varlen_feat_for_padded(feat, lq, lk)
    ref_p, ref_lse_p, naive_p = forward_refs(qp, kp, vp, causal, 1 / math.sqrt(d), pfeat)
    bound = FWD_FACTOR * float(np.abs(naive_p.astype(np.float64) - ref_p).max()) + FWD_FLOOR
    out_vp = pack_to_padded(out_v, cq, mq)
    diff = float(np.abs(out_vp.astype(np.float64) - out_p.astype(np.float64)).max())
    assert diff <= 2 * bound, f"{msg}: out differs by {diff:.4g} > {2 * bound:.4g}"
    check_out(out_p, ref_p, naive_p, msg + " (padded call)")
    lse_vp = np.swapaxes(pack_to_padded(lse_v.T, cq, mq), 1, 2)     # (b, h, mq); padding 0 there
    for b, n in enumerate(lq):
        a, c = lse_vp[b, :, :n], lse_p[b, :, :n]
        assert np.array_equal(np.isneginf(a), np.isneginf(c)), f"{msg}: lse -inf pattern differs in sequence {b}"
        fin = np.isfinite(c)
        assert (np.abs(a[fin] - c[fin]) <= LSE_RTOL * (1 + np.abs(c[fin]))).all(), f"{msg}: lse differs, sequence {b}"
    ref_g, naive_g = grad_refs(dop, qp, kp, vp, causal, 1 / math.sqrt(d), pfeat)
    for i, (name, cu, m) in enumerate((("dq", cq, mq), ("dk", ck, mk), ("dv", ck, mk))):
        gb = BWD_FACTOR * float(np.abs(np.asarray(naive_g[i]).astype(np.float64) - ref_g[i]).max()) + BWD_FLOOR
        gvp = pack_to_padded(g_v[i], cu, m).astype(np.float64)
        gpp = g_p[i].astype(np.float64)
        for b, n in enumerate(lq if name == "dq" else lk):
            gpp[b, n:] = 0.0   # padded rows of the padded call: checked to be 0 in test_features
        dd = float(np.abs(gvp - gpp).max())
        assert dd <= 2 * gb, f"{msg}: {name} differs by {dd:.4g} > {2 * gb:.4g}"
    dd = float(np.abs(g_v[3].astype(np.float64) - g_p[3].astype(np.float64)).max())
    sb = BWD_FACTOR * float(np.abs(np.asarray(naive_g[3]) - ref_g[3]).max()) + BWD_FLOOR + DSINK_REL * float(
        np.abs(ref_g[3]).max())
    assert dd <= 2 * sb, f"{msg}: dsink differs by {dd:.4g} > {2 * sb:.4g}"


# ---------------------------------------------------------------------------------------------
# Determinism
# ---------------------------------------------------------------------------------------------

@gpu
@pytest.mark.parametrize("packed", [False, True])
def test_deterministic_bitwise_with_features(cf, packed):
    """deterministic=True: five backward calls give bitwise identical dq, dk, dv and dsink (the
    allocator is NaN-poisoned before each)."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    dtype, h, hkv, d = "bfloat16", 8, 2, 128
    npdt = NP_DTYPES[dtype]
    sink = sink_values(rng, h)
    feat = {"window": (300, 0), "num_sink_tokens": 4, "sink_logits": sink, "softcap": 20.0}
    kw = api_kwargs(feat)
    if packed:
        lq = [1000, 17, 1023, 0, 512]
        cq = cu_seqlens(lq)
        t = int(cq[-1]) + 5
        q, k, v, dout = (rng.standard_normal((t, hh, d)).astype(npdt) for hh in (h, hkv, hkv, h))
        args = (_dev(cq), _dev(cq), max(lq), max(lq))
        qd, kd, vd, dod = (_dev(x) for x in (q, k, v, dout))
        out, lse = cf.attention_varlen(qd, kd, vd, *args, causal=True, return_lse=True, **kw)
        call = lambda: cf.attention_varlen_backward(dod, qd, kd, vd, out, lse, *args, causal=True,  # noqa: E731
                                                    deterministic=True, **kw)
    else:
        b, s = 3, 1500
        q, k, v, dout = (rng.standard_normal((b, s, hh, d)).astype(npdt) for hh in (h, hkv, hkv, h))
        kw["q_lengths"] = _dev(np.array([s, 777, 1], np.int32))
        kw["kv_lengths"] = _dev(np.array([s, 1001, 64], np.int32))
        qd, kd, vd, dod = (_dev(x) for x in (q, k, v, dout))
        out, lse = cf.attention(qd, kd, vd, causal=True, return_lse=True, **kw)
        call = lambda: cf.attention_backward(dod, qd, kd, vd, out, lse, causal=True,  # noqa: E731
                                             deterministic=True, **kw)
    msg = seed_msg(seed, f"deterministic bitwise, packed={packed}")
    first = None
    for run in range(5):
        poison(4 * (_nbytes(q) + 2 * _nbytes(k)))
        grads = [_host(g) for g in call()]
        assert len(grads) == 4, f"{msg}: expected dq, dk, dv, dsink"
        for name, g in zip(("dq", "dk", "dv", "dsink"), grads):
            _finite_report(name, g, f"{msg} run {run}")
        if first is None:
            first = grads
            continue
        for name, a, g in zip(("dq", "dk", "dv", "dsink"), first, grads):
            if not np.array_equal(a.view(np.uint8), g.view(np.uint8)):
                n = int((a.astype(np.float32) != g.astype(np.float32)).sum())
                raise AssertionError(f"{msg}: run {run}: {name} differs from run 0 in {n} elements")


# ---------------------------------------------------------------------------------------------
# lengths_from_padding_mask
# ---------------------------------------------------------------------------------------------

def _right_padded_mask():
    lengths = np.array([3, 0, 7, 1, 5], np.int32)
    mask = np.arange(7)[None, :] < lengths[:, None]
    return mask, lengths


BAD_MASKS = {
    "left_padded": np.array([[False, True, True, True], [True, True, True, True]]),
    "hole": np.array([[True, False, True, False], [True, True, False, False]]),
    "trailing_true": np.array([[True, True, False, True], [False, False, False, False]]),
}


def test_lengths_from_padding_mask_numpy(cf):
    mask, lengths = _right_padded_mask()
    got = cf.lengths_from_padding_mask(mask)
    assert isinstance(got, np.ndarray), type(got)
    assert got.dtype == np.int32 and got.shape == (5,), (got.dtype, got.shape)
    assert got.tolist() == lengths.tolist()
    all_false = cf.lengths_from_padding_mask(np.zeros((3, 4), bool))
    assert all_false.tolist() == [0, 0, 0]
    all_true = cf.lengths_from_padding_mask(np.ones((2, 4), bool))
    assert all_true.tolist() == [4, 4]


@pytest.mark.parametrize("kind", sorted(BAD_MASKS))
def test_lengths_from_padding_mask_rejects_non_right_padding(cf, kind):
    with pytest.raises(ValueError, match="mask"):
        cf.lengths_from_padding_mask(BAD_MASKS[kind])


def test_lengths_from_padding_mask_torch_cpu(cf):
    torch = pytest.importorskip("torch")
    mask, lengths = _right_padded_mask()
    got = cf.lengths_from_padding_mask(torch.from_numpy(mask))
    assert isinstance(got, torch.Tensor) and got.dtype == torch.int32 and got.device.type == "cpu", got
    assert got.tolist() == lengths.tolist()


@gpu
def test_lengths_from_padding_mask_gpu(cf):
    cp = _cupy()
    mask, lengths = _right_padded_mask()
    got = cf.lengths_from_padding_mask(cp.asarray(mask))
    assert isinstance(got, cp.ndarray) and got.dtype == np.int32 and got.shape == (5,), (type(got), got.dtype)
    assert got.device.id == cp.cuda.Device().id
    assert got.get().tolist() == lengths.tolist()
    for bad in BAD_MASKS.values():
        with pytest.raises(ValueError, match="mask"):
            cf.lengths_from_padding_mask(cp.asarray(bad))
    torch = sys.modules.get("torch")
    if torch is None:
        try:
            import torch
        except ImportError:
            return
    if not torch.cuda.is_available():
        return
    tgot = cf.lengths_from_padding_mask(torch.from_numpy(mask).cuda())
    assert isinstance(tgot, torch.Tensor) and tgot.dtype == torch.int32 and tgot.is_cuda, tgot
    assert tgot.cpu().tolist() == lengths.tolist()
    # the result feeds attention directly
    rng = np.random.default_rng(0)
    q, k, v = make_inputs(rng, "bfloat16", 5, 7, 7, 2, 2, 64)
    qd, kd, vd = _dev(q), _dev(k), _dev(v)
    out = _host(cf.attention(qd, kd, vd, q_lengths=got, kv_lengths=got))
    ref, _, naive = forward_refs(q, k, v, False, 1 / 8, {"q_lengths": lengths, "kv_lengths": lengths})
    check_out(out, ref, naive, "attention with lengths_from_padding_mask's lengths")


# ---------------------------------------------------------------------------------------------
# torch autograd
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def torch_cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    return torch


def _np_to_torch(torch, a, device="cuda"):
    a = np.ascontiguousarray(a)
    if a.dtype == BF16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16).to(device)
    return torch.from_numpy(a).to(device)


def _torch_to_np(torch, t):
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(BF16)
    return t.numpy()


TORCH_CASES = [
    # feature set, dtype, causal, head_dim, heads, deterministic, sink requires grad
    ("all", "bfloat16", True, 128, (4, 2), False, True),
    ("win+sinklogits", "float16", False, 64, (4, 1), True, True),
    ("lens+alibi", "bfloat16", False, 96, (4, 4), True, False),
    ("sinklogits+softcap", "float16", True, 40, (4, 2), False, False),
]


@gpu
@pytest.mark.parametrize("feature,dtype,causal,head_dim,heads,deterministic,sink_grad", TORCH_CASES,
                         ids=[f"{c[0]}-{SHORT[c[1]]}-{'causal' if c[2] else 'full'}-d{c[3]}" for c in TORCH_CASES])
def test_torch_autograd(cf, torch_cuda, feature, dtype, causal, head_dim, heads, deterministic, sink_grad):
    """loss = (cuflash.attention(q, k, v, ..., features) * w).sum(); loss.backward(): q.grad, k.grad,
    v.grad and sink_logits.grad (when it requires grad) against the reference; lengths are torch
    int32 CUDA tensors."""
    torch = torch_cuda
    fs = FEATURES_BY_NAME[feature]
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    h, hkv = heads
    b = LENGTHS_BATCH if fs.lengths else 2
    sq, sk, d = 190, 230, head_dim
    q, k, v = make_inputs(rng, dtype, b, sq, sk, h, hkv, d, fs.qk_scale)
    w = rng.standard_normal((b, sq, h, d)).astype(NP_DTYPES[dtype])
    feat = materialize(fs, rng, b, sq, sk, h, causal)
    scale = fs.scale if fs.scale is not None else 1 / math.sqrt(d)
    msg = seed_msg(seed, f"torch autograd {feature} {dtype} causal={causal} d={d} heads={heads} "
                         f"deterministic={deterministic} sink_grad={sink_grad} " + describe(feat))
    kw = api_kwargs(feat, lambda a: _np_to_torch(torch, a))
    if "q_lengths" in kw:
        assert kw["q_lengths"].dtype == torch.int32 and kw["q_lengths"].is_cuda
    sink_t = kw.get("sink_logits")
    if sink_t is not None and sink_grad:
        sink_t.requires_grad_(True)
    if fs.scale is not None:
        kw["softmax_scale"] = fs.scale
    qt, kt, vt = (_np_to_torch(torch, x).requires_grad_(True) for x in (q, k, v))
    wt = _np_to_torch(torch, w)
    poison()
    out = cf.attention(qt, kt, vt, causal=causal, deterministic=deterministic, **kw)
    assert isinstance(out, torch.Tensor) and out.requires_grad and out.grad_fn is not None, f"{msg}: no autograd node"
    ref, ref_lse, naive = forward_refs(q, k, v, causal, scale, feat)
    check_out(_torch_to_np(torch, out), ref, naive, msg)
    poison()
    (out * wt).sum().backward()
    ref_g, naive_g = grad_refs(w, q, k, v, causal, scale, feat)
    for name, x, xt, r, n in zip(("dq", "dk", "dv"), (q, k, v), (qt, kt, vt), ref_g, naive_g):
        assert xt.grad is not None, f"{msg}: {name} is None"
        check_grad(name, _torch_to_np(torch, xt.grad), x.shape, x.dtype, np.asarray(r, np.float64), np.asarray(n), msg)
    vis = visible_padded(b, sq, sk, causal, feat)
    check_padding_backward(*(_torch_to_np(torch, x.grad) for x in (qt, kt, vt)), vis, msg)
    if sink_t is not None:
        if not sink_grad:
            assert sink_t.grad is None, f"{msg}: sink_logits does not require grad but got one"
        else:
            assert sink_t.grad is not None, f"{msg}: sink_logits.grad is None"
            assert sink_t.grad.dtype == torch.float32 and sink_t.grad.shape == (h,), f"{msg}: {sink_t.grad}"
            with torch.no_grad():
                out2, lse2 = cf.attention(qt.detach(), kt.detach(), vt.detach(), causal=causal, return_lse=True,
                                          **{key: (val.detach() if isinstance(val, torch.Tensor) else val)
                                             for key, val in kw.items()})
            out2 = _torch_to_np(torch, out2)
            sv, sa = dsink_from_definition(w, out2, _torch_to_np(torch, lse2), feat["sink_logits"], "padded")
            shift = dsink_out_shift(w, out2, ref, ref_lse, feat["sink_logits"], "padded")
            check_dsink(_torch_to_np(torch, sink_t.grad), np.asarray(ref_g[3], np.float64), np.asarray(naive_g[3]),
                        sv, sa, h, msg, shift)


@gpu
@pytest.mark.parametrize("dtype,causal", [("bfloat16", True), ("float16", False)])
def test_torch_varlen_autograd(cf, torch_cuda, dtype, causal):
    """attention_varlen through torch autograd: grads to q, k, v and sink_logits; rows past the end
    get zero gradients."""
    torch = torch_cuda
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    lq = [0, 1, 37, 130, 64, 5]
    cq = cu_seqlens(lq)
    tq = int(cq[-1]) + 11
    h, hkv, d = 4, 2, 64
    npdt = NP_DTYPES[dtype]
    q = rng.standard_normal((tq, h, d)).astype(npdt)
    k = rng.standard_normal((tq, hkv, d)).astype(npdt)
    v = rng.standard_normal((tq, hkv, d)).astype(npdt)
    w = rng.standard_normal((tq, h, d)).astype(npdt)
    feat = {"window": causal_window((20, 5), causal), "sink_logits": sink_values(rng, h),
            "alibi_slopes": alibi_slopes("h", rng, 6, h)}
    msg = seed_msg(seed, f"torch varlen autograd {dtype} causal={causal} " + describe(feat))
    kw = api_kwargs(feat, lambda a: _np_to_torch(torch, a))
    kw["sink_logits"].requires_grad_(True)
    qt, kt, vt = (_np_to_torch(torch, x).requires_grad_(True) for x in (q, k, v))
    cqt = _np_to_torch(torch, cq)
    out = cf.attention_varlen(qt, kt, vt, cqt, cqt, max(lq), max(lq), causal=causal, **kw)
    (out * _np_to_torch(torch, w)).sum().backward()
    qp, kp, vp, wp = (pack_to_padded(x, cq, max(lq)) for x in (q, k, v, w))
    pfeat = varlen_feat_for_padded(feat, lq, lq)
    ref_g, naive_g = grad_refs(wp, qp, kp, vp, causal, 1 / math.sqrt(d), pfeat)
    for name, x, xt, r, n in zip(("dq", "dk", "dv"), (q, k, v), (qt, kt, vt), ref_g, naive_g):
        rp = padded_to_pack(np.asarray(r, np.float64), cq, tq)
        npk = padded_to_pack(np.asarray(n), cq, tq)
        g = _torch_to_np(torch, xt.grad)
        check_grad(name, g, x.shape, x.dtype, rp, npk, msg)
        assert not np.count_nonzero(g[cq[-1]:].astype(np.float32)), f"{msg}: {name} nonzero past cu_seqlens[-1]"
    sg = kw["sink_logits"].grad
    assert sg is not None and sg.shape == (h,), f"{msg}: sink_logits.grad {sg}"
    with torch.no_grad():
        out2, lse2 = cf.attention_varlen(qt.detach(), kt.detach(), vt.detach(), cqt, cqt, max(lq), max(lq),
                                         causal=causal, return_lse=True,
                                         **{key: (val.detach() if isinstance(val, torch.Tensor) else val)
                                            for key, val in kw.items()})
    out2 = _torch_to_np(torch, out2)
    sv, sa = dsink_from_definition(w, out2, _torch_to_np(torch, lse2), feat["sink_logits"], "varlen")
    ref_p, ref_lse_p, _ = forward_refs(qp, kp, vp, causal, 1 / math.sqrt(d), pfeat)
    shift = dsink_out_shift(wp, pack_to_padded(out2, cq, max(lq)), ref_p, ref_lse_p, feat["sink_logits"], "padded")
    check_dsink(_torch_to_np(torch, sg), np.asarray(ref_g[3], np.float64), np.asarray(naive_g[3]), sv, sa, h, msg,
                shift)


# ---------------------------------------------------------------------------------------------
# JAX
# ---------------------------------------------------------------------------------------------

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


@gpu
@pytest.mark.parametrize("dtype,causal", [("bfloat16", True), ("float16", False)])
def test_jax_grad_features(cf, jax_gpu, dtype, causal):
    """jax.grad (eager) with respect to q and sink_logits, with lengths (JAX int32 arrays on the
    GPU), a window with sink tokens, ALiBi and softcap."""
    jax, dev = jax_gpu
    import jax.numpy as jnp

    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    fs = ALL
    b, sq, sk, h, hkv, d = LENGTHS_BATCH, 150, 222, 4, 2, 128
    q, k, v = make_inputs(rng, dtype, b, sq, sk, h, hkv, d, fs.qk_scale)
    w = rng.standard_normal((b, sq, h, d)).astype(NP_DTYPES[dtype])
    feat = materialize(fs, rng, b, sq, sk, h, causal)
    msg = seed_msg(seed, f"jax.grad {dtype} causal={causal} " + describe(feat))
    put = lambda a: jax.device_put(a, dev)  # noqa: E731
    qj, kj, vj = put(q), put(k), put(v)
    w32 = put(w.astype(np.float32))
    kw = api_kwargs(feat, put)
    sink = kw.pop("sink_logits")

    def loss(qq, ss):
        o = cf.attention(qq, kj, vj, causal=causal, sink_logits=ss, **kw)
        return jnp.sum(o.astype(jnp.float32) * w32)

    gq, gs = jax.grad(loss, argnums=(0, 1))(qj, sink)
    assert gq.shape == q.shape and gq.dtype == qj.dtype, f"{msg}: dq {gq.shape} {gq.dtype}"
    assert gs.shape == (h,) and gs.dtype == jnp.float32, f"{msg}: dsink {gs.shape} {gs.dtype}"
    scale = 1 / math.sqrt(d)
    ref_g, naive_g = grad_refs(w, q, k, v, causal, scale, feat)
    check_grad("dq", np.asarray(gq), q.shape, q.dtype, np.asarray(ref_g[0], np.float64), np.asarray(naive_g[0]), msg)
    out, lse = cf.attention(qj, kj, vj, causal=causal, return_lse=True, sink_logits=sink, **kw)
    sv, sa = dsink_from_definition(w, np.asarray(out), np.asarray(lse), feat["sink_logits"], "padded")
    ref, ref_lse, naive = forward_refs(q, k, v, causal, scale, feat)
    shift = dsink_out_shift(w, np.asarray(out), ref, ref_lse, feat["sink_logits"], "padded")
    check_dsink(np.asarray(gs), np.asarray(ref_g[3], np.float64), np.asarray(naive_g[3]), sv, sa, h, msg, shift)
    check_out(np.asarray(out), ref, naive, msg)
    check_lse(np.asarray(lse), ref_lse, msg, (b, h, sq))


# ---------------------------------------------------------------------------------------------
# Argument checks. CPU path (NumPy inputs): no GPU needed, no mark.
# ---------------------------------------------------------------------------------------------

def _require_params(fn, names):
    """The check must come from cuflash's validation, not from Python rejecting an unknown keyword
    (whose TypeError would name the argument too): fn must declare every name."""
    import inspect

    params = inspect.signature(fn).parameters
    missing = [n for n in names if n not in params]
    assert not missing, f"{fn.__name__} has no parameter(s) {missing}"


def _vq(b=2, sq=5, sk=7, h=4, hk=2, d=16):
    rng = np.random.default_rng(0)
    return (rng.standard_normal((b, sq, h, d)).astype(np.float16),
            rng.standard_normal((b, sk, hk, d)).astype(np.float16),
            rng.standard_normal((b, sk, hk, d)).astype(np.float16))


def _i32(*x):
    return np.array(x, dtype=np.int32)


def _f32(*shape):
    return np.zeros(shape, dtype=np.float32)


BOTH = (TypeError, ValueError)
# (id, keyword arguments for attention on q (2, 5, 4, 16), k/v (2, 7, 2, 16), exception, argument named)
BAD_FEATURE_ARGS = [
    ("window_len1", {"window": (1,)}, BOTH, "window"),
    ("window_len3", {"window": (1, 2, 3)}, BOTH, "window"),
    ("window_scalar", {"window": 5}, BOTH, "window"),
    ("window_left_m2", {"window": (-2, 0)}, ValueError, "window"),
    ("window_right_m5", {"window": (0, -5)}, ValueError, "window"),
    ("window_float", {"window": (1.5, 0)}, BOTH, "window"),
    ("sink_tokens_neg", {"num_sink_tokens": -1}, ValueError, "num_sink_tokens"),
    ("sink_tokens_float", {"num_sink_tokens": 1.5}, BOTH, "num_sink_tokens"),
    ("softcap_neg", {"softcap": -1.0}, ValueError, "softcap"),
    ("softcap_nan", {"softcap": float("nan")}, ValueError, "softcap"),
    ("softcap_str", {"softcap": "10"}, TypeError, "softcap"),
    ("sink_logits_f16", {"sink_logits": np.zeros(4, np.float16)}, TypeError, "sink_logits"),
    ("sink_logits_f64", {"sink_logits": np.zeros(4, np.float64)}, TypeError, "sink_logits"),
    ("sink_logits_len5", {"sink_logits": _f32(5)}, ValueError, "sink_logits"),
    ("sink_logits_nheads_kv", {"sink_logits": _f32(2)}, ValueError, "sink_logits"),
    ("sink_logits_2d", {"sink_logits": _f32(2, 4)}, ValueError, "sink_logits"),
    ("sink_logits_list", {"sink_logits": [0.0] * 4}, TypeError, "sink_logits"),
    ("alibi_nheads_kv", {"alibi_slopes": _f32(2)}, ValueError, "alibi_slopes"),
    ("alibi_batch3", {"alibi_slopes": _f32(3, 4)}, ValueError, "alibi_slopes"),
    ("alibi_3d", {"alibi_slopes": _f32(2, 4, 1)}, ValueError, "alibi_slopes"),
    ("alibi_f64", {"alibi_slopes": np.zeros(4, np.float64)}, TypeError, "alibi_slopes"),
    ("q_lengths_i64", {"q_lengths": np.array([5, 5], np.int64)}, TypeError, "q_lengths"),
    ("kv_lengths_i64", {"kv_lengths": np.array([7, 7], np.int64)}, TypeError, "kv_lengths"),
    ("kv_lengths_f32", {"kv_lengths": np.array([7, 7], np.float32)}, TypeError, "kv_lengths"),
    ("q_lengths_batch3", {"q_lengths": _i32(5, 5, 5)}, ValueError, "q_lengths"),
    ("q_lengths_2d", {"q_lengths": _i32(5, 5).reshape(2, 1)}, ValueError, "q_lengths"),
    ("kv_lengths_list", {"kv_lengths": [7, 7]}, TypeError, "kv_lengths"),
]


@pytest.mark.parametrize("kwargs,exc,name", [pytest.param(kw, e, n, id=i) for i, kw, e, n in BAD_FEATURE_ARGS])
def test_bad_feature_arguments(cf, kwargs, exc, name):
    _require_params(cf.attention, kwargs)
    q, k, v = _vq()
    with pytest.raises(exc, match=name):
        cf.attention(q, k, v, **kwargs)


@pytest.mark.parametrize("kwargs,exc,name", [pytest.param(kw, e, n, id=i) for i, kw, e, n in BAD_FEATURE_ARGS
                                             if i in ("window_left_m2", "softcap_neg", "sink_logits_f16",
                                                      "kv_lengths_i64", "alibi_batch3")])
def test_bad_feature_arguments_backward(cf, kwargs, exc, name):
    q, k, v = _vq()
    dout = np.zeros_like(q)
    lse = np.zeros((2, 4, 5), np.float32)
    _require_params(cf.attention_backward, kwargs)
    with pytest.raises(exc, match=name):
        cf.attention_backward(dout, q, k, v, dout, lse, **kwargs)


def test_lengths_from_another_library(cf):
    torch = pytest.importorskip("torch")
    _require_params(cf.attention, ["kv_lengths"])
    q, k, v = _vq()
    with pytest.raises(BOTH, match="kv_lengths"):
        cf.attention(q, k, v, kv_lengths=torch.tensor([7, 7], dtype=torch.int32))


def _vq_packed(total_q=12, total_k=12, h=4, hk=2, d=16):
    rng = np.random.default_rng(0)
    return (rng.standard_normal((total_q, h, d)).astype(np.float16),
            rng.standard_normal((total_k, hk, d)).astype(np.float16),
            rng.standard_normal((total_k, hk, d)).astype(np.float16))


# (id, cu_seqlens_q, cu_seqlens_k, extra keyword arguments, exception, argument named). total_q =
# total_k = 12, max_seqlen_q = max_seqlen_k = 7; the valid cu_seqlens are (0, 5, 12) (lengths 5, 7).
_CU = (0, 5, 12)
BAD_VARLEN_ARGS = [
    ("cu_lengths_differ", _i32(*_CU), _i32(0, 5, 9, 12), {}, ValueError, "cu_seqlens"),
    ("cu_q_i64", np.array(_CU, np.int64), _i32(*_CU), {}, TypeError, "cu_seqlens_q"),
    ("cu_k_f32", _i32(*_CU), np.array(_CU, np.float32), {}, TypeError, "cu_seqlens_k"),
    ("cu_q_2d", _i32(*_CU).reshape(1, 3), _i32(*_CU), {}, ValueError, "cu_seqlens_q"),
    ("cu_q_past_total", _i32(0, 6, 13), _i32(*_CU), {}, ValueError, "cu_seqlens_q"),
    ("cu_k_past_total", _i32(*_CU), _i32(0, 6, 13), {}, ValueError, "cu_seqlens_k"),
    ("alibi_batch", _i32(*_CU), _i32(*_CU), {"alibi_slopes": _f32(3, 4)}, ValueError, "alibi_slopes"),
    ("window_bad", _i32(*_CU), _i32(*_CU), {"window": (-3, 2)}, ValueError, "window"),
    ("sink_logits_shape", _i32(*_CU), _i32(*_CU), {"sink_logits": _f32(3)}, ValueError, "sink_logits"),
]


@pytest.mark.parametrize("cu_q,cu_k,kwargs,exc,name",
                         [pytest.param(a, b, kw, e, n, id=i) for i, a, b, kw, e, n in BAD_VARLEN_ARGS])
def test_bad_varlen_arguments(cf, cu_q, cu_k, kwargs, exc, name):
    _require_params(cf.attention_varlen, kwargs)
    q, k, v = _vq_packed()
    with pytest.raises(exc, match=name):
        cf.attention_varlen(q, k, v, cu_q, cu_k, 7, 7, **kwargs)


def test_varlen_rejects_4d_q(cf):
    q, k, v = _vq()
    with pytest.raises(ValueError, match=r"\bq\b"):
        cf.attention_varlen(q, k[0], v[0], _i32(0, 5), _i32(0, 7), 5, 7)


@gpu
def test_lengths_on_cpu_while_q_on_gpu(cf):
    """Lengths must live where q lives: NumPy lengths with CuPy q, and (with torch) CPU tensors with
    CUDA q, raise an error naming the argument, before anything runs."""
    rng = np.random.default_rng(0)
    q, k, v = make_inputs(rng, "float16", 2, 5, 7, 4, 2, 64)
    qd, kd, vd = _dev(q), _dev(k), _dev(v)
    with pytest.raises(BOTH, match="q_lengths"):
        cf.attention(qd, kd, vd, q_lengths=_i32(5, 3))
    with pytest.raises(BOTH, match="kv_lengths"):
        cf.attention(qd, kd, vd, kv_lengths=_i32(7, 2))
    with pytest.raises(BOTH, match="sink_logits"):
        cf.attention(qd, kd, vd, sink_logits=_f32(4))
    with pytest.raises(BOTH, match="cu_seqlens_q"):
        cf.attention_varlen(qd[0], kd[0], vd[0], _i32(0, 5), _dev(_i32(0, 7)), 5, 7)
    with pytest.raises(TypeError, match="kv_lengths"):
        cf.attention(qd, kd, vd, kv_lengths=_dev(np.array([7, 2], np.int64)))
    torch = sys.modules.get("torch")
    if torch is None:
        try:
            import torch
        except ImportError:
            return
    if not torch.cuda.is_available():
        return
    qt, kt, vt = (_np_to_torch(torch, x) for x in (q, k, v))
    with pytest.raises(BOTH, match="kv_lengths"):
        cf.attention(qt, kt, vt, kv_lengths=torch.tensor([7, 2], dtype=torch.int32))
    with pytest.raises(BOTH, match="alibi_slopes"):
        cf.attention(qt, kt, vt, alibi_slopes=torch.zeros(4, dtype=torch.float32))
