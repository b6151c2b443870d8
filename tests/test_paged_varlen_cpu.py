"""CPU tests of cuflash.attention_varlen with a block_table (paged prefill; cuflash/_kvcache.py,
attention_varlen_paged): k and v are paged caches (num_blocks, page_size, nheads_kv, head_dim), sequence b's key t
is k[block_table[b, t // page_size], t % page_size] for t < cu_seqlens_k[b + 1] - cu_seqlens_k[b].

No GPU needed. Every case draws fresh random inputs; the seed is in each failure message, and
CUFLASH_TEST_SEED=<seed> replays it. Each call is checked three ways, against references built here without
cuflash/_kvcache.py (the logical keys of each sequence gathered one position at a time, in a plain Python loop
through the block table):

* bit for bit against cuflash.attention_varlen on those keys packed (total_k, nheads_kv, head_dim), without
  block_table: the paged call gathers and then runs that same NumPy algorithm;
* out within the accuracy rule of tests/test_cpu_features.py against the float64 reference on the equivalent padded
  batch (cuflash._reference.attention_reference with q_lengths / kv_lengths): max error at most FWD_FACTOR x that of
  the naive computation in the input dtype + FWD_FLOOR; lse within LSE_ATOL + LSE_RTOL x the size of the row's score
  terms, with the same -inf pattern;
* out finite everywhere: every cache slot that no sequence reads is NaN (the blocks no sequence uses, the rows of a
  last block past the sequence's length), and the block table's entries past those a sequence reads hold block
  numbers out of range, so a read in the wrong place gives NaN or an error.

Bad input must raise TypeError / ValueError naming the argument (the message starts with it) before anything runs.
The backward is not built with a block_table: torch inputs that require grad, JAX tracers (jit, grad) and
attention_varlen_backward raise NotImplementedError naming block_table.
"""

import inspect

import ml_dtypes
import numpy as np
import pytest

import cuflash
from _cpu_helpers import _ctx, _new_seed, _randn
from cuflash._call import ArrayInfo
from cuflash._kvcache import describe_paged_varlen
from cuflash._reference import attention_reference, check_close
from test_cpu_features import FWD_FACTOR, FWD_FLOOR, LSE_ATOL, LSE_RTOL, _score_magnitude
from test_kvcache_cpu import _features, _from_torch, _to_torch  # shared with the KV-cache tests

# Any numpy floating-point warning (divide by zero, invalid value, overflow) is a test failure.
pytestmark = pytest.mark.filterwarnings("error")

FP16, BF16 = np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)
GARBAGE = (-7, -2 ** 31, 2 ** 30)  # block numbers no cache has (plus num_blocks itself, per case)


# --------------------------------------------------------------------------------------------------------------
# Cases: the arguments of one call (NumPy), the caches poisoned where no sequence reads.


class Case:
    def __init__(self, **kw):
        self.__dict__.update(kw)

    def args(self):
        return dict(q=self.q, k=self.k, v=self.v, cu_seqlens_q=self.cu_q, cu_seqlens_k=self.cu_k,
                    max_seqlen_q=self.max_q, max_seqlen_k=self.max_k, block_table=self.table)


def _cu(lengths, start=0):
    return (start + np.concatenate([[0], np.cumsum(lengths)])).astype(np.int32)


def _poison(k, v, table, seq_k, page):
    """NaN in every slot of k and v that no sequence reads."""
    read = np.zeros(k.shape[:2], dtype=bool)
    for b, n in enumerate(seq_k):
        for t in range(n):
            read[table[b][t // page], t % page] = True
    k[~read] = np.nan
    v[~read] = np.nan


def make_case(rng, *, seq_q, seq_k, page=16, dtype=FP16, nheads=8, nheads_kv=2, head_dim=32, qk_scale=1.0,
              spare_blocks=3, spare_cols=1, table_garbage=True, shared=0, cu_k_start=0, tail_q=0, max_extra=(0, 0)):
    """Random inputs of one call. seq_q, seq_k: the lengths of each sequence. The sequences' blocks are distinct
    random blocks of the cache (shared > 0: every sequence after the first reads the first `shared` blocks of
    sequence 0 instead of its own, a common prefix), spare_blocks more are never read, and each table row has
    spare_cols entries more than the longest sequence needs. table_garbage: the entries a sequence does not read
    hold block numbers out of range (else valid numbers of unread blocks). cu_k_start: the first offset of
    cu_seqlens_k (offsets only give lengths); tail_q: rows of q past the last sequence; max_extra: added to the
    longest lengths for max_seqlen_q / max_seqlen_k."""
    seq_q, seq_k = [int(n) for n in seq_q], [int(n) for n in seq_k]
    batch = len(seq_q)
    used = [-(-n // page) for n in seq_k]
    max_blocks = max(1, max(used)) + spare_cols
    num_blocks = sum(used) + spare_blocks
    perm = rng.permutation(num_blocks)
    table = np.empty((batch, max_blocks), dtype=np.int32)
    for b in range(batch):
        own, perm = perm[:used[b]], perm[used[b]:]
        table[b, :used[b]] = own
        rest = max_blocks - used[b]
        if table_garbage:
            table[b, used[b]:] = rng.choice(GARBAGE + (num_blocks,), size=rest)
        else:
            table[b, used[b]:] = rng.integers(0, num_blocks, size=rest)
    if shared:
        assert seq_k[0] >= shared * page
        for b in range(1, batch):
            if seq_k[b] > shared * page:
                table[b, :shared] = table[0, :shared]
    shape = (num_blocks, page, nheads_kv, head_dim)
    k = _randn(rng, shape, dtype, qk_scale)
    v = _randn(rng, shape, dtype)
    _poison(k, v, table, seq_k, page)
    q = _randn(rng, (sum(seq_q) + tail_q, nheads, head_dim), dtype, qk_scale)
    return Case(q=q, k=k, v=v, cu_q=_cu(seq_q), cu_k=_cu(seq_k, cu_k_start), table=table, page=page,
                seq_q=seq_q, seq_k=seq_k, max_q=max(seq_q) + max_extra[0], max_k=max(seq_k) + max_extra[1])


def logical_keys(case):
    """[(keys, values)] per sequence: its first seq_k[b] logical keys, gathered one position at a time."""
    out = []
    for b, n in enumerate(case.seq_k):
        keys = np.zeros((n,) + case.k.shape[2:], case.k.dtype)
        values = np.zeros((n,) + case.v.shape[2:], case.v.dtype)
        for t in range(n):
            block, row = int(case.table[b][t // case.page]), t % case.page
            keys[t] = case.k[block, row]
            values[t] = case.v[block, row]
        out.append((keys, values))
    return out


def _padded(rows, fill=0):
    """[(n_b, ...)] -> (batch, max(1, max n_b), ...) with `fill` past each n_b."""
    longest = max([1] + [len(r) for r in rows])
    out = np.full((len(rows), longest) + rows[0].shape[1:], fill, dtype=rows[0].dtype)
    for b, r in enumerate(rows):
        out[b, :len(r)] = r
    return out


def _bits(x):
    x = np.asarray(x)
    return x.view(f"u{x.dtype.itemsize}")


def _same_bits(a, b) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(_bits(a), _bits(b))


# --------------------------------------------------------------------------------------------------------------
# The check.


def run_and_check(case, causal, opts, ctx, return_lse=True):
    """Calls attention_varlen with the case's block table and checks it (see the module docstring). Returns
    (out, lse)."""
    opts = dict(opts)
    scale = opts.pop("softmax_scale", None)
    inputs = [case.q, case.k, case.v, case.cu_q, case.cu_k, case.table] + list(opts.values())
    before = [x.copy() for x in inputs if isinstance(x, np.ndarray)]
    result = cuflash.attention_varlen(**case.args(), causal=causal, softmax_scale=scale, return_lse=return_lse,
                                      **opts)
    out, lse = result if return_lse else (result, None)
    for x, x0 in zip([x for x in inputs if isinstance(x, np.ndarray)], before):
        assert _same_bits(x, x0), f"an input was written; {ctx}"
    total_q, nheads, head_dim = case.q.shape
    assert isinstance(out, np.ndarray) and out.shape == case.q.shape and out.dtype == case.q.dtype, ctx
    assert np.isfinite(out.astype(np.float32)).all(), f"non-finite out (a poisoned cache slot was read?); {ctx}"

    # ---- bit for bit: attention_varlen on the logical keys, packed (with rows past the last sequence)
    seqs = logical_keys(case)
    rng = np.random.default_rng(len(ctx))
    tail = _randn(rng, (2,) + case.k.shape[2:], case.k.dtype)
    keys = np.concatenate([s[0] for s in seqs] + [tail])
    values = np.concatenate([s[1] for s in seqs] + [tail])
    unpaged = cuflash.attention_varlen(case.q, keys, values, case.cu_q, _cu(case.seq_k), case.max_q, case.max_k,
                                       causal=causal, softmax_scale=scale, return_lse=True, **opts)
    assert _same_bits(out, unpaged[0]), f"out differs from attention_varlen on the gathered keys; {ctx}"
    if lse is not None:
        assert _same_bits(lse, unpaged[1]), f"lse differs from attention_varlen on the gathered keys; {ctx}"

    # ---- the float64 reference on the equivalent padded batch
    cq = case.cu_q
    rows = [case.q[cq[b]:cq[b + 1]] for b in range(len(case.seq_q))]
    q_pad = _padded(rows)
    k_pad, v_pad = _padded([s[0] for s in seqs]), _padded([s[1] for s in seqs])
    lengths = dict(q_lengths=np.array(case.seq_q), kv_lengths=np.array(case.seq_k))
    ref_out, ref_lse = attention_reference(q_pad, k_pad, v_pad, causal, scale, **lengths, **opts)
    naive, _ = attention_reference(q_pad, k_pad, v_pad, causal, scale, compute_dtype="input", **lengths, **opts)
    out_pad = _padded([out[cq[b]:cq[b + 1]] for b in range(len(case.seq_q))])
    ok, msg = check_close(out_pad, ref_out, naive, factor=FWD_FACTOR, floor=FWD_FLOOR)
    assert ok, f"out: {msg}; {ctx}"
    tq = int(cq[-1])
    assert (out[tq:].astype(np.float32) == 0).all(), f"rows past the last sequence must have out 0; {ctx}"
    if lse is None:
        return out, None
    assert lse.shape == (nheads, total_q) and lse.dtype == np.float32, ctx
    assert np.isneginf(lse[:, tq:]).all(), f"rows past the last sequence must have lse -inf; {ctx}"
    lse_pad = _padded([lse.T[cq[b]:cq[b + 1]] for b in range(len(case.seq_q))], -np.inf).transpose(0, 2, 1)
    assert not np.isnan(lse_pad).any(), f"NaN in lse; {ctx}"
    ref_neginf = np.isneginf(ref_lse)
    assert np.array_equal(np.isneginf(lse_pad), ref_neginf), f"lse -inf pattern differs; {ctx}"
    finite = ~ref_neginf
    assert np.isfinite(lse_pad[finite]).all(), f"lse must be finite where the reference's is; {ctx}"
    feats = {n: x for n, x in opts.items() if n in ("alibi_slopes", "sink_logits")}
    mag = _score_magnitude(q_pad, k_pad, scale if scale is not None else head_dim ** -0.5, feats)
    mag = np.maximum(np.abs(ref_lse), mag)[finite]
    err = np.abs(lse_pad[finite].astype(np.float64) - ref_lse[finite])
    assert (err <= LSE_ATOL + LSE_RTOL * mag).all(), f"lse max err {err.max(initial=0):.3g}; {ctx}"
    return out, lse


# --------------------------------------------------------------------------------------------------------------
# The grid: page size x causal x layout variant, with the GQA ratio, head_dim and dtype rotating through their values.


def _lengths(page, variant):
    """(seq_q, seq_k): key lengths 0, 1, odd below a page, exactly a page, crossing pages (odd), several pages; query
    chunks shorter than, equal to and longer than the keys (a chunk longer than its keys has causal rows that see
    none). Variant 1 shuffles the order."""
    seq_k = [0, 1, page - 1, page, page + 5, 2 * page + 3]
    seq_q = [4, 1, 17, 16, 23, 33]
    if variant:
        order = [3, 5, 0, 2, 4, 1]
        seq_k, seq_q = [seq_k[i] for i in order], [seq_q[i] for i in order]
    return seq_q, seq_k


def _grid():
    cases, i = [], 0
    for page in (16, 64, 256):
        for causal in (False, True):
            for variant in (0, 1):
                gqa = (1, 2, 4, 8)[i % 4]
                head_dim = (8, 64, 128, 256)[(i // 4 + i) % 4]
                dtype = (FP16, BF16)[(i // 2) % 2]
                cid = f"page{page}-{'causal' if causal else 'full'}-v{variant}-gqa{gqa}-d{head_dim}-{dtype.name}"
                cases.append(pytest.param(page, causal, variant, gqa, head_dim, dtype, id=cid))
                i += 1
    return cases


@pytest.mark.parametrize("page, causal, variant, gqa, head_dim, dtype", _grid())
def test_grid(page, causal, variant, gqa, head_dim, dtype):
    seed = _new_seed()
    rng = np.random.default_rng(seed)
    seq_q, seq_k = _lengths(page, variant)
    # Variant 1: offsets of cu_seqlens_k that do not start at 0, rows of q past the last sequence, larger
    # max_seqlen_*, valid (unread) block numbers past the used entries of the table.
    case = make_case(rng, seq_q=seq_q, seq_k=seq_k, page=page, dtype=dtype, nheads=8, nheads_kv=8 // gqa,
                     head_dim=head_dim, table_garbage=not variant, cu_k_start=1000 * variant, tail_q=3 * variant,
                     max_extra=(5 * variant, 7 * variant))
    ctx = _ctx(seed, page=page, causal=causal, gqa=gqa, head_dim=head_dim, dtype=dtype.name, seq_q=seq_q,
               seq_k=seq_k, table=case.table.tolist())
    run_and_check(case, causal, {}, ctx)


OPTION_NAMES = ["win3_0", "win5_2", "win0_-1", "win20_0", "sinktok", "sinklogit", "alibi_h", "alibi_bh", "softcap",
                "scale", "all"]


@pytest.mark.parametrize("page", [16, 64])
@pytest.mark.parametrize("name", OPTION_NAMES)
def test_options(name, page):
    seed = _new_seed()
    rng = np.random.default_rng(seed)
    seq_q, seq_k = [5, 1, 19, 16, 0, 24], [0, 1, 19, 2 * page + 7, 3, page + 1]
    opts, qk_scale = _features(rng, name, len(seq_q), 8)
    causal = name not in ("win5_2", "win0_-1") and (len(name) + page) % 3 != 0
    dtype = (FP16, BF16)[(len(name) + page // 16) % 2]
    case = make_case(rng, seq_q=seq_q, seq_k=seq_k, page=page, dtype=dtype, nheads=8, nheads_kv=2, head_dim=32,
                     qk_scale=qk_scale, tail_q=2)
    ctx = _ctx(seed, option=name, page=page, causal=causal, dtype=dtype.name, table=case.table.tolist())
    run_and_check(case, causal, opts, ctx)


# --------------------------------------------------------------------------------------------------------------
# Particular layouts.


@pytest.mark.parametrize("page", [16, 64])
def test_shared_prefix_blocks(page):
    """Sequences reading the blocks of a common prefix (the first two blocks of sequence 0) through their tables."""
    seed = _new_seed()
    rng = np.random.default_rng(seed)
    seq_k = [2 * page + 9, 2 * page + 1, 3 * page, 5, 2 * page + page // 2]
    seq_q = [9, 1, 30, 5, 17]
    case = make_case(rng, seq_q=seq_q, seq_k=seq_k, page=page, dtype=BF16, shared=2)
    assert (case.table[[1, 2, 4], :2] == case.table[0, :2]).all()
    run_and_check(case, True, {}, _ctx(seed, page=page, table=case.table.tolist()))
    run_and_check(case, False, dict(window=(page, 0), num_sink_tokens=4), _ctx(seed, page=page, window=True))


def test_table_longer_than_the_cache():
    """A table may name one block several times (max_blocks_per_seq * page_size > num_blocks * page_size): the
    window's reach is bounded by the sequence's length, not by the cache's rows."""
    seed = _new_seed()
    rng = np.random.default_rng(seed)
    k, v = _randn(rng, (1, 16, 2, 16), FP16), _randn(rng, (1, 16, 2, 16), FP16)
    case = Case(q=_randn(rng, (8, 4, 16), FP16), k=k, v=v, cu_q=_cu([8]), cu_k=_cu([45]),
                table=np.zeros((1, 3), np.int32), page=16, seq_q=[8], seq_k=[45], max_q=8, max_k=45)
    for window in ((35, 0), (17, -1), (-1, 0)):
        run_and_check(case, False, dict(window=window), _ctx(seed, window=window))


def test_no_keys_anywhere():
    """Every sequence has 0 keys: out 0, lse -inf (the sink logit with sink_logits); nothing is read."""
    seed = _new_seed()
    rng = np.random.default_rng(seed)
    case = make_case(rng, seq_q=[3, 0, 5], seq_k=[0, 0, 0], page=16, tail_q=1)
    assert np.isnan(case.k.astype(np.float32)).all()
    out, lse = run_and_check(case, True, {}, _ctx(seed))
    assert (out.astype(np.float32) == 0).all() and np.isneginf(lse).all(), _ctx(seed)
    sinks = rng.standard_normal(8).astype(np.float32)
    out, lse = run_and_check(case, False, dict(sink_logits=sinks), _ctx(seed, sink=True))
    assert np.array_equal(lse[:, :8], np.repeat(sinks[:, None], 8, axis=1)), _ctx(seed)


def test_return_lse_false_and_one_sequence():
    seed = _new_seed()
    rng = np.random.default_rng(seed)
    case = make_case(rng, seq_q=[64], seq_k=[300], page=64, nheads=4, nheads_kv=4, head_dim=64)
    run_and_check(case, True, {}, _ctx(seed), return_lse=False)


def test_strided_caches():
    """k and v as two halves of one (num_blocks, page_size, 2, nheads_kv, head_dim) buffer, q a transposed view."""
    seed = _new_seed()
    rng = np.random.default_rng(seed)
    case = make_case(rng, seq_q=[7, 20, 1, 12], seq_k=[40, 20, 17, 0], page=16, dtype=BF16)
    kv = np.stack([case.k, case.v], axis=2)
    case.k, case.v = kv[:, :, 0], kv[:, :, 1]
    case.q = np.ascontiguousarray(case.q.transpose(1, 0, 2)).transpose(1, 0, 2)
    run_and_check(case, True, {}, _ctx(seed))


def test_poison_catches_a_read_past_the_length():
    """The check can fail: the same cache read one key past a sequence's length gives NaN."""
    seed = _new_seed()
    rng = np.random.default_rng(seed)
    case = make_case(rng, seq_q=[4, 4], seq_k=[20, 9], page=16)
    out = cuflash.attention_varlen(**case.args())
    assert np.isfinite(out.astype(np.float32)).all(), _ctx(seed)
    with np.errstate(invalid="ignore"):
        out = cuflash.attention_varlen(**dict(case.args(), cu_seqlens_k=_cu([21, 9]), max_seqlen_k=21))
    assert np.isnan(out[:4].astype(np.float32)).all() and np.isfinite(out[4:].astype(np.float32)).all(), _ctx(seed)


# --------------------------------------------------------------------------------------------------------------
# Errors: the right exception, naming the argument, before anything runs.


def _torch():
    return pytest.importorskip("torch")


def _set(**kw):
    def mutate(a):
        a.update({n: (f(a) if callable(f) else f) for n, f in kw.items()})
    return mutate


def _at(name, index, value):
    def mutate(a):
        x = a[name].copy()
        x[index] = value(a) if callable(value) else value
        a[name] = x
    return mutate


# Base call: 3 sequences, q lengths [2, 3, 1], key lengths [20, 5, 0], page 16, 2 table columns (capacity 32),
# nheads 4, nheads_kv 2, head_dim 16; max_seqlen_q 3, max_seqlen_k 20.
ERRORS = [
    # ---- arrays, libraries, dtypes, shapes
    ("q_list", _set(q=lambda a: a["q"].tolist()), TypeError, "q"),
    ("k_torch", _set(k=lambda a: _torch().zeros(a["k"].shape, dtype=_torch().float16)), TypeError, "k"),
    ("v_list", _set(v=lambda a: a["v"].tolist()), TypeError, "v"),
    ("q_float32", _set(q=lambda a: a["q"].astype(np.float32)), TypeError, "q"),
    ("k_dtype", _set(k=lambda a: a["k"].astype(BF16)), TypeError, "k"),
    ("v_dtype", _set(v=lambda a: a["v"].astype(np.float32)), TypeError, "v"),
    ("q_4d", _set(q=lambda a: a["q"][None]), ValueError, "q"),
    ("k_packed", _set(k=lambda a: a["k"][0], v=lambda a: a["v"][0]), ValueError, "k"),
    ("v_shape", _set(v=lambda a: a["v"][:-1]), ValueError, "v"),
    ("head_dim_mismatch", _set(k=lambda a: a["k"][..., :8], v=lambda a: a["v"][..., :8]), ValueError, "k"),
    ("head_dim_12", _set(q=lambda a: a["q"][..., :12], k=lambda a: a["k"][..., :12], v=lambda a: a["v"][..., :12]),
     ValueError, "q"),
    ("gqa", _set(q=lambda a: a["q"][:, :3]), ValueError, "k"),
    ("q_empty", _set(q=lambda a: a["q"][:0]), ValueError, "q"),
    ("page_24", _set(k=lambda a: np.zeros((6, 24, 2, 16), FP16), v=lambda a: np.zeros((6, 24, 2, 16), FP16)),
     ValueError, "k"),
    # ---- cu_seqlens_q / cu_seqlens_k
    ("cu_q_int64", _set(cu_seqlens_q=lambda a: a["cu_seqlens_q"].astype(np.int64)), TypeError, "cu_seqlens_q"),
    ("cu_q_list", _set(cu_seqlens_q=[0, 2, 5, 6]), TypeError, "cu_seqlens_q"),
    ("cu_q_torch", _set(cu_seqlens_q=lambda a: _torch().tensor([0, 2, 5, 6], dtype=_torch().int32)), TypeError,
     "cu_seqlens_q"),
    ("cu_q_one", _set(cu_seqlens_q=np.array([0], np.int32)), ValueError, "cu_seqlens_q"),
    ("cu_q_2d", _set(cu_seqlens_q=lambda a: a["cu_seqlens_q"][None]), ValueError, "cu_seqlens_q"),
    ("cu_k_shape", _set(cu_seqlens_k=lambda a: np.append(a["cu_seqlens_k"], 25).astype(np.int32)), ValueError,
     "cu_seqlens_k"),
    ("cu_k_int64", _set(cu_seqlens_k=lambda a: a["cu_seqlens_k"].astype(np.int64)), TypeError, "cu_seqlens_k"),
    ("cu_q_decreasing", _at("cu_seqlens_q", 2, 1), ValueError, "cu_seqlens_q"),
    ("cu_q_negative", _at("cu_seqlens_q", 0, -1), ValueError, "cu_seqlens_q"),
    ("cu_q_past_total", _at("cu_seqlens_q", 3, lambda a: a["q"].shape[0] + 1), ValueError, "cu_seqlens_q"),
    ("cu_q_past_max", _set(max_seqlen_q=2), ValueError, "cu_seqlens_q"),
    ("cu_k_decreasing", _at("cu_seqlens_k", 2, 3), ValueError, "cu_seqlens_k"),
    ("cu_k_past_max", _set(max_seqlen_k=19), ValueError, "cu_seqlens_k"),
    ("cu_k_past_table", _set(cu_seqlens_k=np.array([0, 33, 38, 38], np.int32), max_seqlen_k=40), ValueError,
     "cu_seqlens_k"),
    # ---- block_table
    ("table_int64", _set(block_table=lambda a: a["block_table"].astype(np.int64)), TypeError, "block_table"),
    ("table_list", _set(block_table=lambda a: a["block_table"].tolist()), TypeError, "block_table"),
    ("table_torch", _set(block_table=lambda a: _torch().zeros((3, 2), dtype=_torch().int32)), TypeError,
     "block_table"),
    ("table_1d", _set(block_table=lambda a: a["block_table"][0]), ValueError, "block_table"),
    ("table_batch", _set(block_table=lambda a: a["block_table"][:2]), ValueError, "block_table"),
    ("table_no_columns", _set(block_table=lambda a: a["block_table"][:, :0]), ValueError, "block_table"),
    ("table_negative", _at("block_table", (0, 1), -1), ValueError, "block_table"),
    ("table_past_blocks", _at("block_table", (1, 0), lambda a: a["k"].shape[0]), ValueError, "block_table"),
    # ---- scalars and options
    ("max_q_float", _set(max_seqlen_q=3.0), TypeError, "max_seqlen_q"),
    ("max_k_bool", _set(max_seqlen_k=True), TypeError, "max_seqlen_k"),
    ("max_k_negative", _set(max_seqlen_k=-1), ValueError, "max_seqlen_k"),
    ("causal_int", _set(causal=1), TypeError, "causal"),
    ("return_lse_str", _set(return_lse="yes"), TypeError, "return_lse"),
    ("deterministic_str", _set(deterministic="no"), TypeError, "deterministic"),
    ("scale_negative", _set(softmax_scale=-0.5), ValueError, "softmax_scale"),
    ("scale_str", _set(softmax_scale="0.5"), TypeError, "softmax_scale"),
    ("window_single", _set(window=(3,)), TypeError, "window"),
    ("window_right_causal", _set(causal=True, window=(2, 3)), ValueError, "window"),
    ("sinks_negative", _set(window=(2, 0), num_sink_tokens=-1), ValueError, "num_sink_tokens"),
    ("sink_logits_float64", _set(sink_logits=np.zeros(4)), TypeError, "sink_logits"),
    ("sink_logits_shape", _set(sink_logits=np.zeros(5, np.float32)), ValueError, "sink_logits"),
    ("alibi_shape", _set(alibi_slopes=np.zeros((4, 4), np.float32)), ValueError, "alibi_slopes"),
    ("softcap_negative", _set(softcap=-1.0), ValueError, "softcap"),
]


def _error_case(rng):
    return make_case(rng, seq_q=[2, 3, 1], seq_k=[20, 5, 0], page=16, nheads=4, nheads_kv=2, head_dim=16,
                     spare_cols=0, spare_blocks=3)


@pytest.mark.parametrize("mutate, exc, name", [pytest.param(*e[1:], id=e[0]) for e in ERRORS])
def test_errors(mutate, exc, name):
    seed = _new_seed()
    case = _error_case(np.random.default_rng(seed))
    assert case.table.shape == (3, 2) and case.max_q == 3 and case.max_k == 20
    a = case.args()
    mutate(a)
    with pytest.raises(exc) as info:
        cuflash.attention_varlen(**a)
    msg = str(info.value)
    assert msg.startswith(f"{name}:"), f"message does not name {name}: {msg!r}; {_ctx(seed)}"
    if name != "window":  # cuflash/_features.py's message for a window that conflicts with causal says it otherwise
        assert "expected" in msg and "got" in msg, f"message lacks what it got / expected: {msg!r}; {_ctx(seed)}"


def test_gpu_arrays_are_described():
    """CUDA arrays are described for the GPU path (tests/test_paged_varlen_gpu.py runs it); the devices
    must agree."""
    def info(shape, dtype="float16", device=("cuda", 0)):
        strides = tuple(int(np.prod(shape[i + 1:])) for i in range(len(shape)))
        return ArrayInfo("cupy", shape, strides, dtype, device, True, "cupy.ndarray")

    cu = info((3,), "int32")
    c = describe_paged_varlen(info((10, 4, 64)), info((8, 16, 2, 64)), info((8, 16, 2, 64)), cu, cu, 5, 40,
                              block_table=info((2, 4), "int32"))
    assert c.device == ("cuda", 0) and c.batch == 2 and c.page_size == 16
    # A CPU q with a cache elsewhere is a device mismatch.
    cpu = ("cpu", 0)
    with pytest.raises(ValueError, match="^k: on cuda:0"):
        describe_paged_varlen(info((10, 4, 64), device=cpu), info((8, 16, 2, 64)), info((8, 16, 2, 64), device=cpu),
                              info((3,), "int32", cpu), info((3,), "int32", cpu), 5, 40,
                              block_table=info((2, 4), "int32", cpu))


# --------------------------------------------------------------------------------------------------------------
# No backward with a block_table (yet).


def test_varlen_backward_refuses_block_table():
    """attention_varlen_backward has no paged form: a block_table (or paged k, v) is refused, naming it."""
    seed = _new_seed()
    case = _error_case(np.random.default_rng(seed))
    a = case.args()
    out, lse = cuflash.attention_varlen(**a, return_lse=True)
    table = a.pop("block_table")
    args = (out, case.q, case.k, case.v, out, lse, case.cu_q, case.cu_k, case.max_q, case.max_k)
    takes_table = "block_table" in inspect.signature(cuflash.attention_varlen_backward).parameters
    with pytest.raises(NotImplementedError if takes_table else TypeError, match="block_table"):
        cuflash.attention_varlen_backward(*args, block_table=table)
    with pytest.raises(ValueError, match="^k: expected 3 dimensions"):
        cuflash.attention_varlen_backward(*args)


# --------------------------------------------------------------------------------------------------------------
# torch CPU tensors and JAX CPU arrays.


def _torch_args(case):
    return {n: (_to_torch(x) if isinstance(x, np.ndarray) else x) for n, x in case.args().items()}


@pytest.mark.parametrize("dtype", [FP16, BF16], ids=["fp16", "bf16"])
def test_torch_matches_numpy(dtype):
    torch = _torch()
    seed = _new_seed()
    rng = np.random.default_rng(seed)
    case = make_case(rng, seq_q=[7, 20, 1, 12, 9], seq_k=[40, 20, 17, 0, 70], page=16, dtype=dtype, tail_q=1)
    sinks = rng.standard_normal(8).astype(np.float32)
    t = _torch_args(case)
    out_t, lse_t = cuflash.attention_varlen(**t, causal=True, return_lse=True, sink_logits=torch.from_numpy(sinks))
    out, lse = run_and_check(case, True, dict(sink_logits=sinks), _ctx(seed, dtype=dtype.name))
    assert isinstance(out_t, torch.Tensor) and out_t.dtype == getattr(torch, dtype.name), _ctx(seed)
    assert _same_bits(_from_torch(out_t), out), f"torch out differs from NumPy's; {_ctx(seed)}"
    assert lse_t.dtype == torch.float32 and np.array_equal(lse_t.numpy(), lse), _ctx(seed)


def test_torch_no_backward():
    """Tensors that require grad: NotImplementedError naming block_table (no silent missing gradient); under
    torch.no_grad() / torch.inference_mode() the forward runs and records nothing."""
    torch = _torch()
    seed = _new_seed()
    rng = np.random.default_rng(seed)
    case = make_case(rng, seq_q=[3, 5], seq_k=[20, 5], page=16)
    want = cuflash.attention_varlen(**case.args(), causal=True)
    for name in ("q", "k", "v", "sink_logits"):
        t = _torch_args(case)
        t["sink_logits"] = torch.zeros(8)
        t[name].requires_grad_(True)
        with pytest.raises(NotImplementedError, match=f"^block_table: .*forward only.* got {name} with requires_grad"):
            cuflash.attention_varlen(**t, causal=True)
    t = _torch_args(case)
    t["q"].requires_grad_(True)
    with torch.no_grad():
        out = cuflash.attention_varlen(**t, causal=True)
    assert out.grad_fn is None and not out.requires_grad and _same_bits(_from_torch(out), want), _ctx(seed)
    with torch.inference_mode():
        t = _torch_args(case)
        out = cuflash.attention_varlen(**t, causal=True)
    assert _same_bits(_from_torch(out), want), _ctx(seed)


def test_torch_errors():
    torch = _torch()
    seed = _new_seed()
    case = _error_case(np.random.default_rng(seed))
    t = _torch_args(case)
    with pytest.raises(TypeError, match="^block_table: expected a torch array like q"):
        cuflash.attention_varlen(**dict(t, block_table=case.table))
    with pytest.raises(ValueError, match="^k: on meta:0"):
        cuflash.attention_varlen(**dict(t, k=t["k"].to("meta")))
    with pytest.raises(ValueError, match="^cu_seqlens_k: on meta:0"):
        cuflash.attention_varlen(**dict(t, cu_seqlens_k=t["cu_seqlens_k"].to("meta")))
    with pytest.raises(TypeError, match="^cu_seqlens_k: expected dtype int32; got int64"):
        cuflash.attention_varlen(**dict(t, cu_seqlens_k=t["cu_seqlens_k"].to(torch.int64)))


def test_jax_eager_matches_numpy():
    jax = pytest.importorskip("jax")
    seed = _new_seed()
    rng = np.random.default_rng(seed)
    case = make_case(rng, seq_q=[7, 20, 1, 12], seq_k=[40, 20, 17, 0], page=16, dtype=BF16)
    slopes = rng.uniform(0.0, 1.0, (4, 8)).astype(np.float32)
    j = {n: (jax.numpy.asarray(x) if isinstance(x, np.ndarray) else x) for n, x in case.args().items()}
    out_j, lse_j = cuflash.attention_varlen(**j, causal=True, return_lse=True, alibi_slopes=jax.numpy.asarray(slopes))
    out, lse = run_and_check(case, True, dict(alibi_slopes=slopes), _ctx(seed))
    assert isinstance(out_j, jax.Array) and _same_bits(np.asarray(out_j), out), _ctx(seed)
    assert np.array_equal(np.asarray(lse_j), lse), _ctx(seed)


def test_jax_jit_and_grad_refused():
    """Under jax.jit or jax.grad the arrays are tracers: NotImplementedError naming block_table."""
    jax = pytest.importorskip("jax")
    seed = _new_seed()
    case = make_case(np.random.default_rng(seed), seq_q=[3, 5], seq_k=[20, 5], page=16)
    j = {n: (jax.numpy.asarray(x) if isinstance(x, np.ndarray) else x) for n, x in case.args().items()}
    rest = {n: x for n, x in j.items() if n != "q"}

    def f(q):
        return cuflash.attention_varlen(q, **rest, causal=True).astype(np.float32).sum()

    for transform in (jax.jit, jax.grad):
        with pytest.raises(NotImplementedError, match="^block_table: .*JAX tracer for q"):
            transform(f)(j["q"])
