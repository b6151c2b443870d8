"""attention_with_kvcache on device arrays: torch CUDA and CuPy (marked gpu), and torch CPU (the NumPy
path, so that this file's checks run everywhere).

JAX arrays on the GPU ("jax") take the same cases with the new tokens written by the caller. On the GPU every layout runs the decode kernels of
cuda_src/flash_decode.cu (append, split-KV decode with GQA packing, combine); a chunk of more than 64
packed query rows per kv head may take the feature forward with kv_lengths instead
(_config.kvcache_feature_forward: test_chunk_routes), after the library appends the new tokens on the
device (cuflash/_kvcache.py ChunkPlan; a paged cache read in place on sm_90a, its pages gathered first
elsewhere). Checked against the float64 reference of
tests/_kvcache_reference.py with the accuracy rule of the CPU tests (out within 2x the naive
input-dtype error + 1e-5; lse as there), the caches after the call bit for bit, and cache slots that
hold no key NaN-poisoned (a read past an entry's length would show). tests/test_kvcache_decode.py
covers the layouts, splits and CUDA graphs.
"""

from __future__ import annotations

import numpy as np
import pytest

from _cpu_helpers import _ctx, _kvcache_route, _new_seed
from _kvcache_reference import kvcache_reference
from cuflash._kvcache import attention_with_kvcache
from cuflash._reference import check_close
from test_cpu_features import FWD_FACTOR, FWD_FLOOR, LSE_ATOL, LSE_RTOL, _score_magnitude
from test_kvcache_cpu import BF16, FP16, _diff_count, _features, make_case

torch = pytest.importorskip("torch")

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu), pytest.param("cupy", marks=pytest.mark.gpu),
           pytest.param("jax", marks=pytest.mark.gpu)]


def _to(a, device):
    if a is None or isinstance(a, int):
        return a
    a = np.ascontiguousarray(a)
    if device == "cupy":
        import cupy

        return cupy.asarray(a)  # float16 only: CuPy has no bfloat16 (those cases are skipped)
    if device == "jax":
        import jax

        return jax.device_put(a, jax.devices("cuda")[0])
    if a.dtype == BF16:
        t = torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    else:
        t = torch.from_numpy(a.copy())
    return t.to(device)


def _back(x):
    if x is None:
        return None
    if type(x).__module__.startswith("cupy"):
        return x.get()
    if type(x).__module__.startswith("jax"):
        return np.asarray(x)
    x = x.detach().cpu()
    if x.dtype == torch.bfloat16:
        return x.view(torch.int16).numpy().view(BF16)
    return x.numpy()


# The accuracy rule compares max errors, which need many rows to be stable (session 12's rule for the
# fuzzer and tests/test_property_cpu.py's pool()): a call whose rows that see a key number fewer than
# MIN_POOLED_ROWS is repeated on fresh values (the same shapes and options) and the calls' outs are
# checked as one batch. Seed 185793632559966754 of test_layouts[1-paged256-jax] checked 8 rows alone:
# one row with 2 keys rounded P to float16 before P V and came out 6.62e-4 off, where the naive
# computation happened to land within 3.19e-4 (the NumPy path gives the same 6.62e-4).
MIN_POOLED_ROWS = 16
MAX_REPEATS = 16


def _call_and_check(case, device, causal, opts, scale, ctx, num_splits, adjust=None):
    """One call on `device`: checks the caches, out's finiteness and lse; returns (out, reference).
    adjust: a function of the call's device arrays (a dict) that changes them in place before the call
    (another layout of the same values)."""
    ref = kvcache_reference(case.q, case.k_cache, case.v_cache, case.k, case.v, case.cache_seqlens,
                            case.cache_batch_idx, case.block_table,
                            causal, scale, **opts)
    args = {n: _to(x, device) for n, x in case.args().items()}
    if device == "jax" and case.k is not None:
        # JAX arrays cannot be appended into: the caller writes the new tokens (here: the caches as the
        # reference leaves them) and counts them in cache_seqlens.
        n = case.k.shape[1]
        cs = case.cache_seqlens
        args.update(k_cache=_to(ref.k_cache, device), v_cache=_to(ref.v_cache, device), k=None, v=None,
                    cache_seqlens=cs + n if isinstance(cs, int) else _to((cs + n).astype(np.int32), device))
    if adjust is not None:
        adjust(args)
    dev_opts = {n: (_to(x, device) if isinstance(x, np.ndarray) else x) for n, x in opts.items()}
    out, lse = attention_with_kvcache(**args, causal=causal, softmax_scale=scale, return_lse=True,
                                      num_splits=num_splits, **dev_opts)
    if device == "cuda":
        torch.cuda.synchronize()
    out, lse = _back(out), _back(lse)
    for name, got, want in (("k_cache", args["k_cache"], ref.k_cache), ("v_cache", args["v_cache"], ref.v_cache)):
        n = _diff_count(_back(got), want)
        assert n == 0, f"{name}: {n} elements differ from the expected cache after the append; {ctx}"
    assert out.shape == case.q.shape and out.dtype == case.q.dtype, ctx
    assert np.isfinite(out.astype(np.float32)).all(), f"non-finite out (a poisoned slot was read?); {ctx}"
    fin = ~np.isneginf(ref.lse)
    assert np.array_equal(np.isneginf(lse), ~fin), f"lse -inf pattern; {ctx}"
    feats = {n: x for n, x in opts.items() if n in ("alibi_slopes", "sink_logits")}
    d = case.q.shape[-1]
    mag = np.maximum(np.abs(ref.lse), _score_magnitude(case.q, ref.keys, scale or d ** -0.5, feats))[fin]
    err = np.abs(lse[fin].astype(np.float64) - ref.lse[fin])
    assert (err <= LSE_ATOL + LSE_RTOL * mag).all(), f"lse max err {err.max(initial=0):.3g}; {ctx}"
    return out, ref


def _check(make, device, causal, opts, ctx, num_splits=0, adjust=None):
    """Calls attention_with_kvcache on make()'s case and checks it against the float64 reference.

    make: a function of no arguments that returns a fresh case (new values, the same shapes) each time
    it is called. Every call's caches, finiteness and lse are checked alone; out is checked against
    the accuracy rule over the calls pooled until at least MIN_POOLED_ROWS rows see a key."""
    opts = dict(opts)
    scale = opts.pop("softmax_scale", None)
    outs, refs = [], []
    rows = 0
    while not outs or (rows < MIN_POOLED_ROWS and len(outs) < MAX_REPEATS):
        rep = f" repeat={len(outs)}" if outs else ""
        out, ref = _call_and_check(make(), device, causal, opts, scale, ctx + rep, num_splits, adjust)
        if outs and out.shape != outs[0].shape:
            raise AssertionError(f"test: make() changed the shapes between repeats; {ctx}")
        outs.append(out)
        refs.append(ref)
        rows += int(np.count_nonzero(~np.isneginf(ref.lse)))
        if rows == 0:
            break  # no row sees a key: out is all zeros, checked exactly by the rule
    pooled = f" (pooled over {len(outs)} calls)" if len(outs) > 1 else ""
    ok, msg = check_close(np.concatenate(outs), np.concatenate([r.out for r in refs]),
                          np.concatenate([r.naive_out for r in refs]), factor=FWD_FACTOR, floor=FWD_FLOOR)
    assert ok, f"out: {msg}{pooled}; {ctx}"


def _skip_unusable(device, dtype):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    if device == "cupy":
        pytest.importorskip("cupy")
        if dtype == BF16:
            pytest.skip("CuPy arrays have no bfloat16 dtype")
    if device == "jax":
        jax = pytest.importorskip("jax")
        try:
            jax.devices("cuda")
        except RuntimeError:
            pytest.skip("JAX has no CUDA backend")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seqlen_q,seqlen_new", [(1, 1), (1, 0), (4, 4), (5, 2)])
@pytest.mark.parametrize("gqa,head_dim,dtype", [(1, 64, FP16), (4, 128, BF16), (8, 64, BF16), (2, 256, FP16)])
def test_contiguous_cache(device, seqlen_q, seqlen_new, gqa, head_dim, dtype):
    _skip_unusable(device, dtype)
    seed = _new_seed()
    for causal in (False, True):
        rng = np.random.default_rng([seed, int(causal)])
        _check(lambda: make_case(rng, dtype=dtype, batch=4, seqlen_q=seqlen_q, nheads=2 * gqa, nheads_kv=2,
                                 head_dim=head_dim, layout="contig", capacity=300, seqlen_new=seqlen_new),
               device, causal, {}, _ctx(seed, device=device, causal=causal, gqa=gqa, d=head_dim))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["win3_0", "sinktok", "sinklogit", "alibi_h", "alibi_bh", "softcap", "scale", "all"])
def test_options(device, name):
    _skip_unusable(device, FP16)
    seed = _new_seed()
    rng = np.random.default_rng(seed)
    opts, qk_scale = _features(rng, name, 4, 8)
    _check(lambda: make_case(rng, dtype=FP16, batch=4, seqlen_q=3, nheads=8, nheads_kv=2, head_dim=64,
                             layout="contig", capacity=200, seqlen_new=3, qk_scale=qk_scale),
           device, True, opts, _ctx(seed, device=device, option=name))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["contig", "paged16"])
@pytest.mark.parametrize("route", ["rule", "0"])
def test_chunk_routes(monkeypatch, device, layout, route):
    """A long chunk (70 positions x GQA 8 = 560 packed rows a kv head, batch 4, 32 query heads, 70 new
    tokens) in every array library: on the GPU the rule (_config.kvcache_feature_forward) gives it the
    feature forward (cuflash/_kvcache.py ChunkPlan; a paged cache read in place on sm_90a);
    CUFLASH_KVCACHE_FORWARD=0 the decode kernels. The caches after the append and out against the
    float64 reference; on the GPU the path taken (a chunk plan and no decode plan, or the reverse)."""
    from cuflash import _kvcache

    _skip_unusable(device, FP16)
    _kvcache_route(monkeypatch, route)
    seed = _new_seed()
    rng = np.random.default_rng(seed)
    _check(lambda: make_case(rng, dtype=FP16, batch=4, seqlen_q=70, nheads=32, nheads_kv=4, head_dim=64,
                             layout=layout, capacity=300, seqlen_new=70),
           device, True, {}, _ctx(seed, device=device, layout=layout, route=route))
    if device != "cpu":
        forward = route == "rule"
        assert bool(_kvcache._CHUNK_PLANS) == forward and bool(_kvcache._DECODE_PLANS) != forward, (
            list(_kvcache._CHUNK_PLANS), list(_kvcache._DECODE_PLANS))


@pytest.mark.gpu
@pytest.mark.parametrize("direct", ["1", "0"])
@pytest.mark.parametrize("seqlens_kind,pad", [("int", 0), ("array", 8), ("array", 4)])
def test_paged_chunk_inputs(monkeypatch, seqlens_kind, pad, direct):
    """The paged chunk route (forced here by CUFLASH_KVCACHE_FORWARD=1): on sm_90a the append kernel and
    the feature forward reading the pages in place (direct "1"; cuflash/_launch.py PagedKV), or
    (CUFLASH_PAGED_DIRECT=0, and other GPUs) the one gather launch (cuda_src/paged_gather.cu,
    chunk mode), with the inputs the other tests give contiguously: an int cache_seqlens (fixed_seqlen),
    new tokens k, v whose heads are padded (pad 8: strides the kernels read in place; pad 4: rows not
    16-byte aligned, which the gather copies first). The caches bit for bit and out against the float64
    reference (torch, 16-row pages, fp16)."""
    _skip_unusable("cuda", FP16)
    _kvcache_route(monkeypatch, "1")
    monkeypatch.setenv("CUFLASH_PAGED_DIRECT", direct)
    seed = _new_seed()
    rng = np.random.default_rng(seed)
    seqlens = {"int": [100] * 3, "array": [5, 150, 230]}[seqlens_kind]

    def make():
        case = make_case(rng, dtype=FP16, batch=3, seqlen_q=70, nheads=16, nheads_kv=2, head_dim=64,
                         layout="paged16", capacity=300, seqlen_new=70, seqlens=np.array(seqlens, np.int32))
        if seqlens_kind == "int":
            case.cache_seqlens = 100
        return case

    def padded(args):
        for n in ("k", "v"):
            x = args[n]
            big = torch.zeros(*x.shape[:-1], x.shape[-1] + pad, dtype=x.dtype, device=x.device)
            big[..., :x.shape[-1]] = x
            args[n] = big[..., :x.shape[-1]]

    _check(make, "cuda", True, {}, _ctx(seed, seqlens=seqlens_kind, pad=pad, direct=direct),
           adjust=padded if pad else None)


@pytest.mark.gpu
@pytest.mark.parametrize("route", ["1", "1-gather", "0"])
def test_paged_chunk_appends_past_the_capacity(monkeypatch, route):
    """A paged chunk whose appends run past the capacity (entry 1: cache_seqlens 280 + 70 new tokens in
    304 slots): on the GPU lengths are not read back, so tokens 0..23 go into slots 280..303, tokens
    24..69 are dropped (never written out of bounds) and the entry sees min(280 + 70, 304) = 304 keys,
    on the feature forward route (on sm_90a the append kernel and the forward reading the pages in
    place, "1"; the gather's chunk mode, "1-gather") as on the decode kernels ("0"). The
    caches bit for bit against that append, out against the float64 reference over those keys (torch,
    16-row pages, fp16, 16 query heads on 2 kv heads, 70 positions)."""
    from _kvcache_reference import logical_kv, slot

    from cuflash._reference import attention_reference

    _skip_unusable("cuda", FP16)
    _kvcache_route(monkeypatch, route[0])
    monkeypatch.setenv("CUFLASH_PAGED_DIRECT", "0" if route == "1-gather" else "1")
    seed = _new_seed()
    rng = np.random.default_rng(seed)
    case = make_case(rng, dtype=FP16, batch=3, seqlen_q=70, nheads=16, nheads_kv=2, head_dim=64, layout="paged16",
                     capacity=300, seqlen_new=70, seqlens=np.array([5, 280, 230], np.int32))
    cap, n = case.capacity, 70
    kc, vc = np.array(case.k_cache, copy=True), np.array(case.v_cache, copy=True)
    for b, s0 in enumerate(case.cache_seqlens.tolist()):
        for i in range(n):
            if s0 + i < cap:
                blk, r = slot(b, s0 + i, None, case.block_table, case.page_size)
                kc[blk, r], vc[blk, r] = case.k[b, i], case.v[b, i]
    lengths = [min(s0 + n, cap) for s0 in case.cache_seqlens.tolist()]
    assert lengths == [75, 304, 300] and cap == 304
    keys, values = logical_kv(kc, vc, lengths, None, case.block_table)
    kv_lengths = np.array(lengths, np.int64)
    want, _ = attention_reference(case.q, keys, values, True, None, kv_lengths=kv_lengths)
    naive, _ = attention_reference(case.q, keys, values, True, None, compute_dtype="input", kv_lengths=kv_lengths)
    args = {name: _to(x, "cuda") for name, x in case.args().items()}
    out = attention_with_kvcache(**args, causal=True)
    torch.cuda.synchronize()
    ctx = _ctx(seed, route=route)
    for name, want_cache in (("k_cache", kc), ("v_cache", vc)):
        assert _diff_count(_back(args[name]), want_cache) == 0, f"{name} after the append; {ctx}"
    ok, msg = check_close(_back(out), want, naive, factor=FWD_FACTOR, floor=FWD_FLOOR)
    assert ok, f"out: {msg}; {ctx}"


@pytest.mark.parametrize("device", DEVICES)
def test_long_cache_int_seqlens(device):
    _skip_unusable(device, BF16 if device != "cupy" else FP16)
    seed = _new_seed()
    rng = np.random.default_rng(seed)
    dtype = FP16 if device == "cupy" else BF16

    def make():
        case = make_case(rng, dtype=dtype, batch=2, seqlen_q=1, nheads=16, nheads_kv=2, head_dim=128,
                         layout="contig", capacity=8192 if device != "cpu" else 1024, seqlen_new=1,
                         seqlens=np.array([8191 if device != "cpu" else 1023] * 2, np.int32))
        case.cache_seqlens = int(case.cache_seqlens[0])  # the int form: the same length for every entry
        return case

    _check(make, device, True, {}, _ctx(seed, device=device))


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=pytest.mark.gpu)])
def test_gpu_lengths_past_the_cache_are_clamped(device):
    """cache_seqlens + seqlen_new past the cache: the GPU does not read lengths back; the writes past
    the cache are dropped and the kernels read at most seqlen_cache keys (no fault)."""
    _skip_unusable(device, FP16)
    seed = _new_seed()
    rng = np.random.default_rng(seed)
    case = make_case(rng, dtype=FP16, batch=2, seqlen_q=1, layout="contig", capacity=64, seqlen_new=2,
                     seqlens=np.array([10, 63], np.int32))  # 63 + 2 > 64; slots 0..62 hold keys
    args = {n: _to(x, device) for n, x in case.args().items()}
    out = attention_with_kvcache(**args, causal=True)
    torch.cuda.synchronize()
    assert np.isfinite(_back(out).astype(np.float32)).all(), _ctx(seed)
    kc = _back(args["k_cache"])
    assert _diff_count(kc[0, 10:12], case.k[0]) == 0, f"entry 0's append; {_ctx(seed)}"
    assert _diff_count(kc[1, :63], case.k_cache[1, :63]) == 0, f"entry 1's keys were overwritten; {_ctx(seed)}"
    # The decode kernels' append drops the write past the cache (position 64): slot 63 holds key 0.
    assert _diff_count(kc[1, 63], case.k[1, 0]) == 0, f"entry 1's last slot; {_ctx(seed)}"
    assert _diff_count(kc[2:], case.k_cache[2:]) == 0, f"a cache row no entry uses was written; {_ctx(seed)}"


# ------------------------------------------------------------------------------------------------
# The pooled check (CPU: torch CPU tensors take the NumPy path).

LAYOUTS_SEED = 185793632559966754  # test_layouts[1-paged256-jax], case 0: 8 rows checked alone


def _layouts_case0(rng):
    return make_case(rng, dtype=FP16, batch=4, seqlen_q=1, nheads=2, nheads_kv=2, head_dim=64, layout="paged256",
                     capacity=300, seqlen_new=1, table_garbage=True)


def test_few_rows_are_pooled():
    """The recorded seed: alone, its 8 rows break the rule by rounding luck (the NumPy path of the same
    algorithm gives the GPU's 6.62e-4); pooled with a repeat on fresh values, the rule holds."""
    rng = np.random.default_rng([LAYOUTS_SEED, 0])
    out, ref = _call_and_check(_layouts_case0(rng), "cpu", True, {}, None, "seed replay", 0)
    ok, msg = check_close(out, ref.out, ref.naive_out, factor=FWD_FACTOR, floor=FWD_FLOOR)
    assert not ok and "max|out-ref|=0.0006623" in msg, msg
    rng = np.random.default_rng([LAYOUTS_SEED, 0])
    calls = []

    def make():
        calls.append(None)
        return _layouts_case0(rng)

    _check(make, "cpu", True, {}, "seed replay pooled")
    assert len(calls) == 2  # 8 rows a call, each sees a key (the append)


@pytest.mark.parametrize("rep", [0, 1])
def test_pooled_check_sees_a_wrong_element(monkeypatch, rep):
    """One element of out in one of the pooled calls moved past what the rule allows: the check fails.

    The move is 4 float16 ulps of the element (at least 4 * 2^-10), or more where the two calls' naive
    float16 error lets the rule accept that much: 3x the pooled bound, FWD_FACTOR * max|naive - ref| +
    FWD_FLOOR. (A fixed 4 ulps was within the bound for 5 of 9400 seeds, e.g. seeds 1688 and 3018, where
    the naive computation erred by 0.00198 and the bound was 0.00396 > 0.0039: the check was right to
    pass, and the test wrong to expect a failure; CI, 2026-11-30.)"""
    import test_kvcache_device as mod

    seed = _new_seed()
    rng = np.random.default_rng(seed)
    cases = [_layouts_case0(rng) for _ in range(2)]  # what _check's two calls draw, drawn ahead
    naive_err = 0.0
    for case in cases:  # kvcache_reference leaves its inputs as they are
        ref = kvcache_reference(case.q, case.k_cache, case.v_cache, case.k, case.v, case.cache_seqlens,
                                case.cache_batch_idx, case.block_table, True, None)
        naive_err = max(naive_err, float(np.abs(ref.naive_out.astype(np.float64) - ref.out).max()))
    bound = FWD_FACTOR * naive_err + FWD_FLOOR
    real = mod.attention_with_kvcache
    calls = []

    moved = []

    def skewed(*args, **kw):
        out, lse = real(*args, **kw)
        calls.append(None)
        if len(calls) - 1 == rep:
            x = float(out[3, 0, 1, 5])
            moved.append(max(4 * 2.0 ** -10 * max(1.0, abs(x)), 3 * bound))
            out[3, 0, 1, 5] = x + moved[0]
        return out, lse

    monkeypatch.setattr(mod, "attention_with_kvcache", skewed)
    made = iter(cases)
    ctx = _ctx(seed, rep=rep)
    try:
        _check(lambda: next(made), "cpu", True, {}, ctx)
    except AssertionError as e:
        msg = str(e)
    else:
        pytest.fail(f"the check passed out with an element moved by {moved} (bound {bound:.3g}); {ctx}")
    assert msg.startswith("out: ") and "pooled over 2 calls" in msg and ctx in msg, msg
    assert len(calls) == 2
