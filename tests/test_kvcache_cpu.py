"""CPU tests of cuflash.attention_with_kvcache (cuflash/_kvcache.py): decoding against a contiguous or paged KV
cache, with the new tokens appended in place.

No GPU needed. Every case draws fresh random inputs; the seed is in each failure message, and
CUFLASH_TEST_SEED=<seed> replays it. Each call is checked against tests/_kvcache_reference.py, which appends into
copies of the caches and gathers each entry's keys with plain loops through the block table or cache_batch_idx:

* the caches after the call equal the expected caches bit for bit (the appended slots hold k and v; every other
  element, including the NaN poison and rows or blocks the call does not use, is unchanged);
* out is within the accuracy rule of tests/test_cpu_features.py: max error against the float64 reference at most
  FWD_FACTOR x that of the naive computation in the input dtype + FWD_FLOOR; lse within its tolerances;
* out is finite everywhere: every cache slot that holds no key before the call is NaN, so a read past an entry's
  length, a key gathered from the wrong block or row, or an append that misses its position gives NaN.

Bad input must raise TypeError / ValueError naming the argument (the message starts with it) and leave the caches
as they were.
"""

import ml_dtypes
import numpy as np
import pytest

from _cpu_helpers import _ctx, _new_seed, _randn
from _kvcache_reference import appended_caches, kvcache_reference, slot
from cuflash._call import ArrayInfo
from cuflash._cpu import attention_forward_numpy
from cuflash._kvcache import attention_with_kvcache, describe_kvcache
from cuflash._reference import check_close
from test_cpu_features import FWD_FACTOR, FWD_FLOOR, LSE_ATOL, LSE_RTOL, _score_magnitude

# Any numpy floating-point warning (divide by zero, invalid value, overflow) is a test failure.
pytestmark = pytest.mark.filterwarnings("error")

FP16, BF16 = np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)
PAGE = {"contig": 0, "contig_idx": 0, "paged16": 16, "paged48": 48, "paged64": 64, "paged256": 256}


# --------------------------------------------------------------------------------------------------------------
# Cases: inputs of one call, with the caches poisoned where no key is.


class Case:
    """The arguments of one call (NumPy) and what describes them in a failure message."""

    def __init__(self, **kw):
        self.__dict__.update(kw)

    def args(self):
        return dict(q=self.q, k_cache=self.k_cache, v_cache=self.v_cache, k=self.k, v=self.v,
                    cache_seqlens=self.cache_seqlens, cache_batch_idx=self.cache_batch_idx,
                    block_table=self.block_table)


def _seqlens_pattern(rng, batch, room):
    """Cache lengths cycling through 0, 1, an odd length and the full room (rotated at random)."""
    values = [0, min(1, room), min(room, (room // 2) | 1), room]
    shift = int(rng.integers(4))
    return np.array([values[(b + shift) % 4] for b in range(batch)], dtype=np.int32)


def make_case(rng, *, dtype=FP16, batch=4, seqlen_q=1, nheads=8, nheads_kv=2, head_dim=32, layout="contig",
              capacity=40, seqlen_new=1, seqlens=None, qk_scale=1.0, table_garbage=False):
    """Random inputs of one call. capacity: keys per entry (rounded up to whole pages when paged); seqlen_new = 0:
    no append; seqlens: cache_seqlens (int32 (batch,)), or None for the pattern of _seqlens_pattern.

    Every cache slot that holds no key of an entry before the call is NaN (the slots the append fills, the rest of
    each entry's rows or blocks, the rows and blocks no entry uses). table_garbage: the block table entries past
    those an entry uses hold block numbers out of range (they must not be read)."""
    page = PAGE[layout] if layout in PAGE else int(layout.removeprefix("paged"))  # (other "pagedN": N-row pages)
    cap = -(-capacity // page) * page if page else capacity
    if seqlens is None:
        seqlens = _seqlens_pattern(rng, batch, cap - seqlen_new)
    seqlens = np.asarray(seqlens, dtype=np.int32)
    cache_batch_idx = block_table = None
    if page:
        max_blocks = cap // page
        num_blocks = batch * max_blocks + 3
        block_table = rng.permutation(num_blocks)[:batch * max_blocks].reshape(batch, max_blocks).astype(np.int32)
        shape = (num_blocks, page, nheads_kv, head_dim)
    elif layout == "contig_idx":
        cache_batch_idx = rng.permutation(batch + 3)[:batch].astype(np.int32)
        shape = (batch + 3, cap, nheads_kv, head_dim)
    else:
        shape = (batch + 1, cap, nheads_kv, head_dim)  # batch_cache > batch: row `batch` is never touched
    k_cache = _randn(rng, shape, dtype, qk_scale)
    v_cache = _randn(rng, shape, dtype)
    filled = np.zeros(shape[:2], dtype=bool)
    for b in range(batch):
        for t in range(int(seqlens[b])):
            filled[slot(b, t, cache_batch_idx, block_table, page)] = True
    k_cache[~filled] = np.nan
    v_cache[~filled] = np.nan
    if table_garbage:
        used = -(-(seqlens.astype(np.int64) + seqlen_new) // page)
        for b in range(batch):
            block_table[b, used[b]:] = rng.choice([-7, shape[0], 2 ** 30])
    k = v = None
    if seqlen_new:
        k = _randn(rng, (batch, seqlen_new, nheads_kv, head_dim), dtype, qk_scale)
        v = _randn(rng, (batch, seqlen_new, nheads_kv, head_dim), dtype)
    q = _randn(rng, (batch, seqlen_q, nheads, head_dim), dtype, qk_scale)
    return Case(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, cache_seqlens=seqlens,
                cache_batch_idx=cache_batch_idx, block_table=block_table, page_size=page, capacity=cap)


def _bits(x):
    x = np.asarray(x)
    return x.view(f"u{x.dtype.itemsize}")


def _diff_count(a, b) -> int:
    """How many elements of two caches differ bit for bit (NaN against NaN with the same bits is equal)."""
    return int(np.count_nonzero(_bits(a) != _bits(b)))


def _features(rng, name, batch, nheads):
    """(options, qk_scale of the inputs) of the named options."""
    slopes = (2.0 ** (-8.0 * (np.arange(nheads) + 1) / nheads) * rng.uniform(0.5, 2.0, nheads)).astype(np.float32)
    sinks = (rng.standard_normal(nheads) * 1.5 + 0.5).astype(np.float32)
    return {
        "none": ({}, 1.0),
        "win3_0": (dict(window=(3, 0)), 1.0),
        "win5_2": (dict(window=(5, 2)), 1.0),
        "win0_-1": (dict(window=(0, -1)), 1.0),
        "win20_0": (dict(window=(20, 0)), 1.0),
        "sinktok": (dict(window=(4, 0), num_sink_tokens=3), 1.0),
        "sinklogit": (dict(sink_logits=sinks), 1.0),
        "alibi_h": (dict(alibi_slopes=slopes), 1.0),
        "alibi_bh": (dict(alibi_slopes=rng.uniform(0.0, 1.0, (batch, nheads)).astype(np.float32)), 1.0),
        "softcap": (dict(softcap=5.0), 3.0),
        "scale": (dict(softmax_scale=0.3), 1.0),
        "all": (dict(window=(6, 0), num_sink_tokens=2, sink_logits=sinks, alibi_slopes=slopes, softcap=20.0), 2.0),
    }[name]


# --------------------------------------------------------------------------------------------------------------
# The check.


def run_and_check(case, causal, opts, ctx, return_lse=True):
    """Calls attention_with_kvcache on the case (its caches are written) and checks caches, out and lse.
    Returns (reference namespace, out, lse)."""
    opts = dict(opts)
    scale = opts.pop("softmax_scale", None)
    before_k, before_v = case.k_cache.copy(), case.v_cache.copy()
    ref = kvcache_reference(case.q, case.k_cache, case.v_cache, case.k, case.v, case.cache_seqlens,
                            case.cache_batch_idx, case.block_table, causal, scale, **opts)
    result = attention_with_kvcache(**case.args(), causal=causal, softmax_scale=scale, return_lse=return_lse, **opts)
    out, lse = result if return_lse else (result, None)
    checked = (ref, out, lse)

    # ---- the caches: exactly the appended ones
    batch, seqlen_q, nheads, head_dim = case.q.shape
    written = 0 if case.k is None else case.k.size
    for name, got, want, before in (("k_cache", case.k_cache, ref.k_cache, before_k),
                                    ("v_cache", case.v_cache, ref.v_cache, before_v)):
        # The expected append is not a no-op: it replaces NaN poison at exactly k.size elements.
        assert _diff_count(before, want) == written, f"{name}: the reference's append is wrong; {ctx}"
        n = _diff_count(got, want)
        assert n == 0, f"{name}: {n} elements differ from the expected cache after the append; {ctx}"

    # ---- out and lse
    assert isinstance(out, np.ndarray) and out.shape == case.q.shape and out.dtype == case.q.dtype, ctx
    out32 = out.astype(np.float32)
    assert np.isfinite(out32).all(), f"non-finite out (a poisoned cache slot was read?); {ctx}"
    ok, msg = check_close(out, ref.out, ref.naive_out, factor=FWD_FACTOR, floor=FWD_FLOOR)
    assert ok, f"out: {msg}; {ctx}"
    if lse is None:
        return checked
    assert lse.shape == (batch, nheads, seqlen_q) and lse.dtype == np.float32, ctx
    assert not np.isnan(lse).any(), f"NaN in lse; {ctx}"
    ref_neginf = np.isneginf(ref.lse)
    assert np.array_equal(np.isneginf(lse), ref_neginf), f"lse -inf pattern differs; {ctx}"
    finite = ~ref_neginf
    assert np.isfinite(lse[finite]).all(), f"lse must be finite where the reference's is; {ctx}"
    feats = {n: x for n, x in opts.items() if n in ("alibi_slopes", "sink_logits")}
    mag = _score_magnitude(case.q, ref.keys, scale if scale is not None else head_dim ** -0.5, feats)
    mag = np.maximum(np.abs(ref.lse), mag)[finite]
    lse_err = np.abs(lse[finite].astype(np.float64) - ref.lse[finite])
    assert (lse_err <= LSE_ATOL + LSE_RTOL * mag).all(), f"lse max err {lse_err.max(initial=0):.3g}; {ctx}"
    return checked


# --------------------------------------------------------------------------------------------------------------
# The grid: layout x append x seqlen_q x causal, with GQA ratio, head_dim and dtype rotating through their values.

GQA = [1, 2, 4, 8]
HEAD_DIMS = [8, 64, 128, 256, 40]
DTYPES = [FP16, BF16]
CAPACITY = {"contig": 45, "contig_idx": 37, "paged16": 70, "paged48": 150, "paged64": 130, "paged256": 300}


def _grid():
    cases = []
    i = 0
    for layout in PAGE:
        for append in (False, True):
            for seqlen_q in (1, 5):
                for causal in (False, True):
                    gqa, head_dim, dtype = GQA[i % 4], HEAD_DIMS[(i // 2) % 5], DTYPES[(i // 4 + i) % 2]
                    # Chunked prefill appends seqlen_q tokens; some cases append fewer (speculative decoding
                    # against a longer new chunk is the same rule).
                    seqlen_new = 0 if not append else (seqlen_q if i % 3 else max(1, seqlen_q - 2))
                    garbage = PAGE[layout] > 0 and i % 2 == 0
                    cid = (f"{layout}-{'append' + str(seqlen_new) if append else 'read'}-sq{seqlen_q}-"
                           f"{'causal' if causal else 'full'}-gqa{gqa}-d{head_dim}-{dtype.name}")
                    cases.append(pytest.param(layout, seqlen_new, seqlen_q, causal, gqa, head_dim, dtype, garbage,
                                              id=cid))
                    i += 1
    return cases


@pytest.mark.parametrize("layout, seqlen_new, seqlen_q, causal, gqa, head_dim, dtype, garbage", _grid())
def test_grid(layout, seqlen_new, seqlen_q, causal, gqa, head_dim, dtype, garbage):
    seed = _new_seed()
    rng = np.random.default_rng(seed)
    batch = 8 if seqlen_q == 1 else 4  # 64 or 160 query rows of 8 heads: a stable max-error statistic
    case = make_case(rng, dtype=dtype, batch=batch, seqlen_q=seqlen_q, nheads=8, nheads_kv=8 // gqa,
                     head_dim=head_dim, layout=layout, capacity=CAPACITY[layout], seqlen_new=seqlen_new,
                     table_garbage=garbage)
    ctx = _ctx(seed, layout=layout, seqlen_new=seqlen_new, seqlen_q=seqlen_q, causal=causal, gqa=gqa,
               head_dim=head_dim, dtype=dtype.name, cache_seqlens=case.cache_seqlens.tolist())
    run_and_check(case, causal, {}, ctx)


OPTION_NAMES = ["win3_0", "win5_2", "win0_-1", "sinktok", "sinklogit", "alibi_h", "alibi_bh", "softcap", "scale",
                "all"]


@pytest.mark.parametrize("layout", ["contig_idx", "paged16"])
@pytest.mark.parametrize("seqlen_q", [1, 4])
@pytest.mark.parametrize("name", OPTION_NAMES)
def test_options(name, seqlen_q, layout):
    seed = _new_seed()
    rng = np.random.default_rng(seed)
    batch, nheads = (8, 8) if seqlen_q == 1 else (4, 8)
    opts, qk_scale = _features(rng, name, batch, nheads)
    # Causal where the option allows it (a window's right bound > 0 conflicts with causal).
    causal = name != "win5_2" and (name in ("sinklogit", "alibi_h", "softcap", "all") or seqlen_q == 4)
    dtype = DTYPES[(len(name) + seqlen_q) % 2]
    case = make_case(rng, dtype=dtype, batch=batch, seqlen_q=seqlen_q, nheads=nheads, nheads_kv=2, head_dim=32,
                     layout=layout, capacity=40, seqlen_new=seqlen_q, qk_scale=qk_scale)
    ctx = _ctx(seed, option=name, layout=layout, seqlen_q=seqlen_q, causal=causal, dtype=dtype.name,
               cache_seqlens=case.cache_seqlens.tolist())
    run_and_check(case, causal, opts, ctx)


@pytest.mark.parametrize("layout, seqlen_q, head_dim, name, causal", [
    pytest.param("contig", 1, 8, "none", False, id="contig-decode-d8"),
    pytest.param("paged256", 1, 16, "none", True, id="paged256-decode-d16"),
    pytest.param("paged16", 8, 8, "sinktok_long", True, id="paged16-chunk8-window1024-sinks"),
    pytest.param("contig_idx", 8, 16, "alibi_h", True, id="contig_idx-chunk8-alibi"),
])
def test_long_cache(layout, seqlen_q, head_dim, name, causal):
    """A 4k cache: many key tiles, lengths near the capacity, one entry with a single key."""
    seed = _new_seed()
    rng = np.random.default_rng(seed)
    batch, nheads = 4, 8
    if name == "sinktok_long":
        opts, qk_scale = dict(window=(1024, 0), num_sink_tokens=4), 1.0
    else:
        opts, qk_scale = _features(rng, name, batch, nheads)
    room = 4096 - seqlen_q
    seqlens = [room, int(rng.integers(2049, room)) | 1, 2048, 0]
    case = make_case(rng, dtype=DTYPES[seqlen_q % 2], batch=batch, seqlen_q=seqlen_q, nheads=nheads, nheads_kv=2,
                     head_dim=head_dim, layout=layout, capacity=4096, seqlen_new=seqlen_q, seqlens=seqlens,
                     qk_scale=qk_scale)
    ctx = _ctx(seed, layout=layout, seqlen_q=seqlen_q, head_dim=head_dim, option=name, cache_seqlens=seqlens)
    run_and_check(case, causal, opts, ctx)


# --------------------------------------------------------------------------------------------------------------
# Forms of the arguments.


@pytest.mark.parametrize("form", ["int", "none"])
def test_cache_seqlens_forms(form):
    """cache_seqlens as an int (every entry) or None (the whole contiguous cache) means the array of those values."""
    seed = _new_seed()
    rng = np.random.default_rng(seed)
    n = 23 if form == "int" else 37
    seqlen_new = 2 if form == "int" else 0
    case = make_case(rng, batch=8, layout="contig" if form == "none" else "paged16", capacity=n + seqlen_new,
                     seqlen_new=seqlen_new, seqlens=[n] * 8)
    case.cache_seqlens = n if form == "int" else None
    ctx = _ctx(seed, form=form)
    ref, _, _ = run_and_check(case, True, {}, ctx)
    assert ref.lengths == [n + seqlen_new] * 8, ctx


def test_return_lse_false():
    seed = _new_seed()
    rng = np.random.default_rng(seed)
    case = make_case(rng, layout="paged64", capacity=100, seqlen_new=1, batch=8)
    run_and_check(case, True, {}, _ctx(seed), return_lse=False)


def test_repeated_batch_idx_without_append():
    """Entries may share a cache row when nothing is appended (several queries against one cached prompt)."""
    seed = _new_seed()
    rng = np.random.default_rng(seed)
    case = make_case(rng, layout="contig_idx", batch=8, seqlen_q=3, seqlen_new=0, seqlens=[17] * 8)
    case.cache_batch_idx = np.array([2, 2, 0, 2, 0, 0, 2, 1], dtype=np.int32)
    # Rows 0 and 2 now serve entries whose keys were not filled in: fill every row's first 17 keys.
    case.k_cache[:, :17] = _randn(rng, case.k_cache[:, :17].shape, case.k_cache.dtype)
    case.v_cache[:, :17] = _randn(rng, case.v_cache[:, :17].shape, case.v_cache.dtype)
    run_and_check(case, True, {}, _ctx(seed))


def test_shared_prefix_blocks():
    """Paged entries may share the blocks of a common prefix and read them, while each appends into its own."""
    seed = _new_seed()
    rng = np.random.default_rng(seed)
    case = make_case(rng, layout="paged16", batch=4, capacity=48, seqlen_new=2, seqlens=[16, 20, 30, 16])
    prefix = case.block_table[0, 0]
    case.block_table[1:, 0] = prefix  # the others' first blocks are left unused
    case.k_cache[prefix] = _randn(rng, case.k_cache[prefix].shape, case.k_cache.dtype)
    case.v_cache[prefix] = _randn(rng, case.v_cache[prefix].shape, case.v_cache.dtype)
    run_and_check(case, True, {}, _ctx(seed))


def test_shared_kv_storage_is_read_in_place():
    """k_cache and v_cache as two halves of one array (a (.., 2, nheads_kv, head_dim) buffer): no overlap, so the
    append is allowed and lands in the caller's buffer."""
    seed = _new_seed()
    rng = np.random.default_rng(seed)
    case = make_case(rng, layout="contig_idx", batch=8, capacity=33, seqlen_new=1)
    kv = np.stack([case.k_cache, case.v_cache], axis=2)
    case.k_cache, case.v_cache = kv[:, :, 0], kv[:, :, 1]
    run_and_check(case, False, {}, _ctx(seed))


# --------------------------------------------------------------------------------------------------------------
# The checks can fail.


def test_cache_check_catches_a_wrong_append():
    """An append one position late, into the wrong row or the wrong block, differs from the expected caches; a
    forward that reads one key past an entry's length gives NaN (the poison)."""
    seed = _new_seed()
    rng = np.random.default_rng(seed)
    for layout in ("contig_idx", "paged16"):
        case = make_case(rng, layout=layout, batch=4, capacity=40, seqlen_new=2, seqlens=[3, 14, 0, 30])
        want_k, _ = appended_caches(case.k_cache, case.v_cache, case.k, case.v, case.cache_seqlens,
                                    case.cache_batch_idx, case.block_table)
        late, _ = appended_caches(case.k_cache, case.v_cache, case.k, case.v, case.cache_seqlens + 1,
                                  case.cache_batch_idx, case.block_table)
        assert _diff_count(late, want_k) > 0, _ctx(seed, layout=layout)
        if layout == "paged16":
            other = case.block_table[::-1].copy()
            wrong, _ = appended_caches(case.k_cache, case.v_cache, case.k, case.v, case.cache_seqlens, None, other)
        else:
            wrong, _ = appended_caches(case.k_cache, case.v_cache, case.k, case.v, case.cache_seqlens,
                                       np.roll(case.cache_batch_idx, 1), None)
        assert _diff_count(wrong, want_k) > 0, _ctx(seed, layout=layout)

    case = make_case(rng, layout="contig", batch=4, capacity=40, seqlen_new=0, seqlens=[3, 14, 1, 30])
    lengths = case.cache_seqlens.astype(np.int64)
    keys, values = case.k_cache[:4], case.v_cache[:4]
    out, _ = attention_forward_numpy(case.q, keys, values, False, 0.25, kv_lengths=lengths)
    assert np.isfinite(out.astype(np.float32)).all(), _ctx(seed)
    with np.errstate(invalid="ignore"):
        out, _ = attention_forward_numpy(case.q, keys, values, False, 0.25, kv_lengths=lengths + 1)
    assert np.isnan(out.astype(np.float32)).any(), _ctx(seed)


# --------------------------------------------------------------------------------------------------------------
# Errors: the right exception, naming the argument, before anything is written.


def _torch():
    return pytest.importorskip("torch")


def _set(**kw):
    def mutate(a, case):
        a.update({n: (f(a, case) if callable(f) else f) for n, f in kw.items()})
    return mutate


def _readonly(name):
    def mutate(a, case):
        view = a[name].view()
        view.flags.writeable = False
        a[name] = view
    return mutate


def _seqlens_at(i, value):
    def mutate(a, case):
        s = a["cache_seqlens"].copy()
        s[i] = value(case) if callable(value) else value
        a["cache_seqlens"] = s
    return mutate


def _table_at(i, j, value):
    def mutate(a, case):
        t = a["block_table"].copy()
        t[i, j] = value(a, case) if callable(value) else value
        a["block_table"] = t
    return mutate


# Base calls: batch 3, seqlen_q 2, nheads 4, nheads_kv 2, head_dim 16, two tokens appended, capacity 32.
# cache_seqlens [20, 5, 0]: entry 0 reads blocks table[0, 0] and table[0, 1], entry 1 writes keys 5 and 6 of
# table[1, 0].
ERRORS = [
    # ---- arrays, libraries, dtypes, shapes
    ("contig", "q_list", _set(q=lambda a, c: a["q"].tolist()), TypeError, "q"),
    ("contig", "k_cache_torch", _set(k_cache=lambda a, c: _torch().zeros(a["k_cache"].shape, dtype=_torch().float16)),
     TypeError, "k_cache"),
    ("contig", "q_float32", _set(q=lambda a, c: a["q"].astype(np.float32)), TypeError, "q"),
    ("contig", "k_cache_dtype", _set(k_cache=lambda a, c: a["k_cache"].astype(BF16)), TypeError, "k_cache"),
    ("contig", "v_cache_dtype", _set(v_cache=lambda a, c: a["v_cache"].astype(np.float32)), TypeError, "v_cache"),
    ("contig", "k_dtype", _set(k=lambda a, c: a["k"].astype(BF16)), TypeError, "k"),
    ("contig", "v_dtype", _set(v=lambda a, c: a["v"].astype(BF16)), TypeError, "v"),
    ("contig", "q_3d", _set(q=lambda a, c: a["q"][0]), ValueError, "q"),
    ("contig", "k_cache_3d", _set(k_cache=lambda a, c: a["k_cache"][0]), ValueError, "k_cache"),
    ("contig", "v_cache_shape", _set(v_cache=lambda a, c: a["v_cache"][:, :-1]), ValueError, "v_cache"),
    ("contig", "head_dim_mismatch", _set(k_cache=lambda a, c: a["k_cache"][..., :8],
                                         v_cache=lambda a, c: a["v_cache"][..., :8]), ValueError, "k_cache"),
    ("contig", "head_dim_12", _set(q=lambda a, c: a["q"][..., :12], k_cache=lambda a, c: a["k_cache"][..., :12],
                                   v_cache=lambda a, c: a["v_cache"][..., :12], k=lambda a, c: a["k"][..., :12],
                                   v=lambda a, c: a["v"][..., :12]), ValueError, "q"),
    ("contig", "gqa", _set(q=lambda a, c: a["q"][:, :, :3]), ValueError, "k_cache"),
    ("contig", "k_without_v", _set(v=None), ValueError, "v"),
    ("contig", "v_without_k", _set(k=None), ValueError, "k"),
    ("contig", "k_batch", _set(k=lambda a, c: a["k"][:2], v=lambda a, c: a["v"][:2]), ValueError, "k"),
    ("contig", "k_heads", _set(k=lambda a, c: a["k"][:, :, :1], v=lambda a, c: a["v"][:, :, :1]), ValueError, "k"),
    ("contig", "k_3d", _set(k=lambda a, c: a["k"][0], v=lambda a, c: a["v"][0]), ValueError, "k"),
    ("contig", "v_shape", _set(v=lambda a, c: a["v"][:, :1]), ValueError, "v"),
    ("contig", "k_empty", _set(k=lambda a, c: a["k"][:, :0], v=lambda a, c: a["v"][:, :0]), ValueError, "k"),
    ("contig", "k_list", _set(k=lambda a, c: a["k"].tolist()), TypeError, "k"),
    # ---- cache_seqlens
    ("contig", "seqlens_int64", _set(cache_seqlens=lambda a, c: a["cache_seqlens"].astype(np.int64)), TypeError,
     "cache_seqlens"),
    ("contig", "seqlens_shape", _set(cache_seqlens=lambda a, c: np.append(a["cache_seqlens"], 0).astype(np.int32)),
     ValueError, "cache_seqlens"),
    ("contig", "seqlens_negative", _seqlens_at(1, -1), ValueError, "cache_seqlens"),
    ("contig", "seqlens_past_capacity", _seqlens_at(2, lambda c: c.capacity - 1), ValueError, "cache_seqlens"),
    ("paged16", "seqlens_past_table", _seqlens_at(0, lambda c: c.capacity - 1), ValueError, "cache_seqlens"),
    ("contig", "seqlens_int_past", _set(cache_seqlens=31), ValueError, "cache_seqlens"),
    ("contig", "seqlens_int_negative", _set(cache_seqlens=-1), ValueError, "cache_seqlens"),
    ("contig", "seqlens_bool", _set(cache_seqlens=True), TypeError, "cache_seqlens"),
    ("contig", "seqlens_float", _set(cache_seqlens=3.0), TypeError, "cache_seqlens"),
    ("contig", "seqlens_list", _set(cache_seqlens=[20, 5, 0]), TypeError, "cache_seqlens"),
    ("contig", "seqlens_none_append", _set(cache_seqlens=None), ValueError, "cache_seqlens"),
    ("contig", "seqlens_torch", _set(cache_seqlens=lambda a, c: _torch().tensor([20, 5, 0], dtype=_torch().int32)),
     TypeError, "cache_seqlens"),
    # ---- cache_batch_idx
    ("contig_idx", "idx_int64", _set(cache_batch_idx=lambda a, c: a["cache_batch_idx"].astype(np.int64)), TypeError,
     "cache_batch_idx"),
    ("contig_idx", "idx_shape", _set(cache_batch_idx=lambda a, c: a["cache_batch_idx"][:2]), ValueError,
     "cache_batch_idx"),
    ("contig_idx", "idx_negative", _set(cache_batch_idx=np.array([0, -1, 2], np.int32)), ValueError,
     "cache_batch_idx"),
    ("contig_idx", "idx_past_rows", _set(cache_batch_idx=lambda a, c: np.array([0, a["k_cache"].shape[0], 2],
                                                                              np.int32)), ValueError,
     "cache_batch_idx"),
    ("contig_idx", "idx_repeated", _set(cache_batch_idx=np.array([4, 1, 4], np.int32)), ValueError,
     "cache_batch_idx"),
    ("contig", "batch_cache_small", _set(k_cache=lambda a, c: a["k_cache"][:2], v_cache=lambda a, c: a["v_cache"][:2]),
     ValueError, "k_cache"),
    # ---- block_table and pages
    ("paged16", "table_int64", _set(block_table=lambda a, c: a["block_table"].astype(np.int64)), TypeError,
     "block_table"),
    ("paged16", "table_1d", _set(block_table=lambda a, c: a["block_table"][0]), ValueError, "block_table"),
    ("paged16", "table_batch", _set(block_table=lambda a, c: a["block_table"][:2]), ValueError, "block_table"),
    ("paged16", "table_negative", _table_at(0, 1, -1), ValueError, "block_table"),
    ("paged16", "table_past_blocks", _table_at(1, 0, lambda a, c: a["k_cache"].shape[0]), ValueError, "block_table"),
    ("paged16", "table_shared_write", _table_at(1, 0, lambda a, c: a["block_table"][2, 0]), ValueError,
     "block_table"),
    ("paged16", "table_write_under_reader", _table_at(1, 0, lambda a, c: a["block_table"][0, 0]), ValueError,
     "block_table"),
    ("paged16", "page_24", _set(k_cache=lambda a, c: np.zeros((8, 24) + a["k_cache"].shape[2:], FP16),
                                v_cache=lambda a, c: np.zeros((8, 24) + a["k_cache"].shape[2:], FP16)), ValueError,
     "k_cache"),
    ("paged16", "table_with_idx", _set(cache_batch_idx=np.array([0, 1, 2], np.int32)), ValueError, "cache_batch_idx"),
    ("paged16", "table_seqlens_none", _set(cache_seqlens=None), ValueError, "cache_seqlens"),
    # ---- writing in place
    ("contig", "readonly_k_cache", _readonly("k_cache"), ValueError, "k_cache"),
    ("paged16", "readonly_v_cache", _readonly("v_cache"), ValueError, "v_cache"),
    ("contig", "k_cache_is_v_cache", _set(v_cache=lambda a, c: a["k_cache"]), ValueError, "k_cache"),
    # ---- options
    ("contig", "causal_int", _set(causal=1), TypeError, "causal"),
    ("contig", "return_lse_str", _set(return_lse="yes"), TypeError, "return_lse"),
    ("contig", "scale_negative", _set(softmax_scale=-0.5), ValueError, "softmax_scale"),
    ("contig", "scale_str", _set(softmax_scale="0.5"), TypeError, "softmax_scale"),
    ("contig", "window_single", _set(window=(3,)), TypeError, "window"),
    ("contig", "window_right_causal", _set(causal=True, window=(2, 3)), ValueError, "window"),
    ("contig", "sinks_negative", _set(window=(2, 0), num_sink_tokens=-1), ValueError, "num_sink_tokens"),
    ("contig", "sink_logits_float64", _set(sink_logits=np.zeros(4)), TypeError, "sink_logits"),
    ("contig", "sink_logits_shape", _set(sink_logits=np.zeros(5, np.float32)), ValueError, "sink_logits"),
    ("paged16", "alibi_shape", _set(alibi_slopes=np.zeros((4, 4), np.float32)), ValueError, "alibi_slopes"),
    ("paged16", "softcap_negative", _set(softcap=-1.0), ValueError, "softcap"),
]


@pytest.mark.parametrize("layout, mutate, exc, name", [pytest.param(*e[:1], *e[2:], id=e[1]) for e in ERRORS])
def test_errors(layout, mutate, exc, name):
    seed = _new_seed()
    rng = np.random.default_rng(seed)
    case = make_case(rng, layout=layout, batch=3, seqlen_q=2, nheads=4, nheads_kv=2, head_dim=16, capacity=32,
                     seqlen_new=2, seqlens=[20, 5, 0])
    a = case.args()
    mutate(a, case)
    arrays = [x for x in (case.k_cache, case.v_cache, a["k_cache"], a["v_cache"]) if isinstance(x, np.ndarray)]
    before = [x.copy() for x in arrays]
    with pytest.raises(exc) as info:
        attention_with_kvcache(**a)
    msg = str(info.value)
    assert msg.startswith(f"{name}:"), f"message does not name {name}: {msg!r}; {_ctx(seed)}"
    if name != "window":  # cuflash/_features.py's message for a window that conflicts with causal says it otherwise
        assert "expected" in msg and "got" in msg, f"message lacks what it got / expected: {msg!r}; {_ctx(seed)}"
    for x, x0 in zip(arrays, before):
        assert _diff_count(x, x0) == 0, f"a cache was written by a call that raised {exc.__name__}; {_ctx(seed)}"


def test_gpu_arrays_are_described():
    """The description of a GPU call (no GPU here): CUDA arrays of every layout are accepted (contiguous,
    with cache_batch_idx, paged); the decode kernels run them (tests/test_kvcache_decode.py)."""
    def info(shape, dtype="float16", device=("cuda", 0)):
        strides = tuple(int(np.prod(shape[i + 1:])) for i in range(len(shape)))
        return ArrayInfo("cupy", shape, strides, dtype, device, True, "cupy.ndarray")

    q, cache = info((2, 1, 4, 64)), info((2, 64, 2, 64))
    c = describe_kvcache(q, cache, cache, cache_seqlens=3)
    assert c.device == ("cuda", 0) and not c.paged and not c.has_batch_idx
    c = describe_kvcache(q, info((3, 64, 2, 64)), info((3, 64, 2, 64)), cache_seqlens=3,
                         cache_batch_idx=info((2,), "int32"))
    assert c.has_batch_idx and c.cache_rows == 3
    c = describe_kvcache(q, cache, cache, info((2, 1, 2, 64)), info((2, 1, 2, 64)),
                         info((2,), "int32"), block_table=info((2, 4), "int32"))
    assert c.paged and c.page_size == 64 and c.capacity == 256 and c.seqlen_new == 1
    # A CPU q with a cache elsewhere is a device mismatch.
    cpu_q = info((2, 1, 4, 64), device=("cpu", 0))
    with pytest.raises(ValueError, match="^k_cache: on cuda:0"):
        describe_kvcache(cpu_q, info((2, 64, 2, 64)), info((2, 64, 2, 64)), cache_seqlens=3)


# --------------------------------------------------------------------------------------------------------------
# torch CPU tensors and JAX CPU arrays.


def _to_torch(a):
    torch = _torch()
    a = np.ascontiguousarray(a)
    if a.dtype == BF16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())


def _from_torch(t):
    torch = _torch()
    t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(BF16)
    return t.numpy()


@pytest.mark.parametrize("layout, dtype", [("paged16", FP16), ("contig_idx", BF16), ("contig", BF16)])
def test_torch_matches_numpy(layout, dtype):
    """torch CPU tensors: the same bits as the NumPy call, the appends written into the caller's tensors."""
    torch = _torch()
    seed = _new_seed()
    rng = np.random.default_rng(seed)
    case = make_case(rng, dtype=dtype, layout=layout, batch=4, seqlen_q=3, capacity=40, seqlen_new=3)
    sinks = rng.standard_normal(8).astype(np.float32)
    t = {n: (None if x is None else _to_torch(x)) for n, x in case.args().items()}
    k_cache, v_cache = t["k_cache"], t["v_cache"]
    versions = (k_cache._version, v_cache._version)
    out_t, lse_t = attention_with_kvcache(**t, causal=True, return_lse=True, sink_logits=torch.from_numpy(sinks))
    ref, out, lse = run_and_check(case, True, dict(sink_logits=sinks), _ctx(seed, layout=layout))
    assert isinstance(out_t, torch.Tensor) and out_t.dtype == getattr(torch, dtype.name), _ctx(seed)
    assert lse_t.dtype == torch.float32 and tuple(lse_t.shape) == lse.shape, _ctx(seed)
    assert _diff_count(_from_torch(out_t), out) == 0, f"torch out differs from NumPy's; {_ctx(seed)}"
    assert np.array_equal(lse_t.numpy(), lse), _ctx(seed)
    assert _diff_count(_from_torch(k_cache), ref.k_cache) == 0, f"torch k_cache; {_ctx(seed)}"
    assert _diff_count(_from_torch(v_cache), ref.v_cache) == 0, f"torch v_cache; {_ctx(seed)}"
    assert k_cache._version > versions[0] and v_cache._version > versions[1], f"version counters not bumped; {_ctx(seed)}"


def test_torch_strided_cache_in_place():
    """A (batch, seqlen, 2, nheads_kv, head_dim) torch buffer seen as k_cache = kv[:, :, 0], v_cache = kv[:, :, 1]."""
    torch = _torch()
    seed = _new_seed()
    rng = np.random.default_rng(seed)
    case = make_case(rng, layout="contig", batch=8, seqlen_q=1, capacity=29, seqlen_new=1)
    kv = _to_torch(np.stack([case.k_cache, case.v_cache], axis=2))
    ref = kvcache_reference(case.q, case.k_cache, case.v_cache, case.k, case.v, case.cache_seqlens, causal=True)
    t = {n: (None if x is None else _to_torch(x)) for n, x in case.args().items()}
    t.update(k_cache=kv[:, :, 0], v_cache=kv[:, :, 1])
    out = attention_with_kvcache(**t, causal=True)
    assert isinstance(out, torch.Tensor), _ctx(seed)
    assert _diff_count(_from_torch(kv[:, :, 0].contiguous()), ref.k_cache) == 0, _ctx(seed)
    assert _diff_count(_from_torch(kv[:, :, 1].contiguous()), ref.v_cache) == 0, _ctx(seed)
    ok, msg = check_close(_from_torch(out), ref.out, ref.naive_out, factor=FWD_FACTOR, floor=FWD_FLOOR)
    assert ok, f"out: {msg}; {_ctx(seed)}"


def test_torch_errors():
    torch = _torch()
    seed = _new_seed()
    rng = np.random.default_rng(seed)
    case = make_case(rng, layout="paged16", batch=3, seqlen_q=1, capacity=32, seqlen_new=1, seqlens=[20, 5, 0])
    t = {n: (None if x is None else _to_torch(x)) for n, x in case.args().items()}
    before = t["k_cache"].clone()
    t["k_cache"].requires_grad_(True)
    with pytest.raises(ValueError, match="^k_cache: expected a tensor that does not require grad"):
        attention_with_kvcache(**t)
    t["k_cache"] = t["k_cache"].detach()
    assert torch.equal(t["k_cache"].view(torch.int16), before.view(torch.int16)), _ctx(seed)
    with pytest.raises(TypeError, match="^block_table: expected a torch array like q"):
        attention_with_kvcache(**dict(t, block_table=case.block_table))
    with pytest.raises(ValueError, match="^k_cache: on meta:0"):
        attention_with_kvcache(**dict(t, k_cache=t["k_cache"].to("meta")))
    assert torch.equal(t["k_cache"].view(torch.int16), before.view(torch.int16)), _ctx(seed)


def test_jax_read_only_and_append_refused():
    """JAX CPU arrays: attention against the cache works; appending (in place) is a TypeError."""
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    seed = _new_seed()
    rng = np.random.default_rng(seed)
    case = make_case(rng, layout="paged16", batch=8, seqlen_q=2, capacity=40, seqlen_new=0)
    j = {n: (None if x is None else jnp.asarray(x)) for n, x in case.args().items()}
    out_j = attention_with_kvcache(**j, causal=True)
    assert isinstance(out_j, jax.Array), _ctx(seed)
    _, out, _ = run_and_check(case, True, {}, _ctx(seed))
    assert _diff_count(np.asarray(out_j), out) == 0, _ctx(seed)
    new = jnp.asarray(_randn(rng, (8, 1, 2, 32), FP16))
    with pytest.raises(TypeError, match="^k: expected None for JAX arrays, which are immutable"):
        attention_with_kvcache(**dict(j, k=new, v=new, cache_seqlens=jnp.asarray(case.cache_seqlens)))


def test_torch_inference_mode():
    """Caches made under torch.inference_mode (inference tensors, as a serving loop has them) are appended into."""
    torch = _torch()
    seed = _new_seed()
    rng = np.random.default_rng(seed)
    case = make_case(rng, layout="paged64", batch=8, seqlen_q=1, capacity=100, seqlen_new=1)
    ref = kvcache_reference(**case.args(), causal=True)
    with torch.inference_mode():
        t = {n: (None if x is None else _to_torch(x)) for n, x in case.args().items()}
        out = attention_with_kvcache(**t, causal=True)
    assert t["k_cache"].is_inference() and isinstance(out, torch.Tensor), _ctx(seed)
    assert _diff_count(_from_torch(t["k_cache"]), ref.k_cache) == 0, _ctx(seed)
    assert _diff_count(_from_torch(t["v_cache"]), ref.v_cache) == 0, _ctx(seed)
    ok, msg = check_close(_from_torch(out), ref.out, ref.naive_out, factor=FWD_FACTOR, floor=FWD_FLOOR)
    assert ok, f"out: {msg}; {_ctx(seed)}"


def test_jax_jit_refused():
    """Under jax.jit the arrays are tracers: NotImplementedError, not a crash or a silent host copy."""
    jax = pytest.importorskip("jax")
    seed = _new_seed()
    rng = np.random.default_rng(seed)
    case = make_case(rng, layout="contig", batch=2, seqlen_q=1, capacity=32, seqlen_new=0, seqlens=[5, 9])
    f = jax.jit(lambda q, kc, vc: attention_with_kvcache(q, kc, vc, cache_seqlens=7))
    with pytest.raises(NotImplementedError, match="does not support jax.jit"):
        f(jax.numpy.asarray(case.q), jax.numpy.asarray(case.k_cache), jax.numpy.asarray(case.v_cache))
