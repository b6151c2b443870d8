"""attention_with_kvcache's chunks on a paged cache read in place by the warp-specialized feature forward
(cuflash/_kvcache.py ChunkPlan with cuflash/_launch.py PagedKV; cuda_src/flash_fwd_sm90_ws.cu, PAGED: each
key tile's rows in boxes of gcd(page_size, BLOCK_N) rows, each from the page the block table names; ILV:
16-row boxes of whole rows), on an sm_90a GPU. Each case runs the chunk route (CUFLASH_KVCACHE_FORWARD=1) and is checked

- against the float64 reference as tests/test_kvcache_device.py checks every layout (the caches bit for
  bit after the append, slots that hold no key NaN, out within 2x the naive input-dtype error + 1e-5,
  lse), with the plan asserted to read the pages in place where the warp-specialized feature kernel
  serves the call;
- bit for bit against the gather route (CUFLASH_PAGED_DIRECT=0: the pages copied into a padded
  array first, then the same kernel without PAGED) on the same inputs, the pages read in place at any box
  size (CUFLASH_PAGED_DIRECT=1): out, lse and the caches after the append.
"""

from __future__ import annotations

import numpy as np
import pytest

from _cpu_helpers import _ctx, _fresh_decode_plans, _new_seed
from test_kvcache_cpu import BF16, FP16, make_case
from test_kvcache_device import _back, _check, _skip_unusable, _to

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu


def _sm90():
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the paged feature forward is an sm_90a kernel (other GPUs gather the pages)")


def _options(rng, name, batch, nheads):
    sinks = (rng.standard_normal(nheads) * 1.5 + 0.5).astype(np.float32)
    return {
        "none": {},
        "sinklogit": dict(sink_logits=sinks),
        "alibi_bh": dict(alibi_slopes=rng.uniform(0.0, 1.0, (batch, nheads)).astype(np.float32)),
        "softcap": dict(softcap=5.0),
        "scale": dict(softmax_scale=0.3),
        # a window wide enough for the warp-specialized kernel (_config.NARROW_WINDOW), with sink tokens
        "window": dict(window=(1100, 0), num_sink_tokens=3),
        # narrow: the cp.async feature kernel, so the gather route (the plan must not read in place)
        "narrow": dict(window=(20, 0)),
    }[name]


# (layout, head_dim, dtype, query heads, kv heads, options, causal, seqlen_q, capacity, garbage table entries,
# CUFLASH_PAGED_DIRECT for the first part: "rule" (in place from 32-row boxes, _config.paged_direct) or "1"
# (in place at any box: 16-row boxes of 16- and 48-row pages, which the rule gathers)
CASES = [
    ("paged16", 128, BF16, 32, 4, "none", True, 70, 300, False, "1"),
    ("paged16", 64, FP16, 16, 2, "none", True, 129, 700, True, "rule"),
    ("paged32", 64, FP16, 16, 2, "none", True, 129, 700, True, "rule"),
    ("paged48", 128, FP16, 16, 16, "sinklogit", True, 77, 500, True, "1"),
    ("paged96", 128, BF16, 16, 2, "sinklogit", True, 77, 500, True, "rule"),
    ("paged64", 256, BF16, 8, 1, "none", False, 65, 400, False, "rule"),
    ("paged256", 128, BF16, 16, 2, "alibi_bh", True, 100, 1100, True, "rule"),
    ("paged256", 64, FP16, 32, 4, "softcap", True, 90, 600, False, "rule"),
    ("paged64", 96, BF16, 16, 4, "scale", True, 70, 300, False, "rule"),  # head_dim pad-up to 128
    ("paged64", 128, FP16, 16, 8, "window", True, 70, 1500, True, "rule"),
    ("paged256", 128, BF16, 16, 2, "narrow", True, 70, 300, False, "1"),
    ("paged16", 256, BF16, 16, 2, "softcap", True, 70, 400, True, "1"),  # 16-row boxes of whole rows at 256
    ("paged16", 128, FP16, 16, 4, "none", True, 100, 600, True, "rule"),  # whole rows, 400 rows: in place
]


def _in_place(layout, head_dim, opts, mode, rows) -> bool:
    """Whether the case's plan reads the pages in place: the warp-specialized feature kernel serves it (not a
    narrow window) and its boxes, gcd(page_size, the kernel's 128-key tiles, 64 at head_dim 256), have 32
    rows or more, or 16 copied as whole rows (head_dim 128 / 256) for fewer than 2048 packed query rows a kv
    head (rows), or CUFLASH_PAGED_DIRECT=1."""
    import math

    box = math.gcd(int(layout.removeprefix("paged")), 64 if head_dim == 256 else 128)
    whole = box == 16 and head_dim in (128, 256) and rows < 2048
    return opts != "narrow" and (mode == "1" or box >= 32 or whole)


def _route(monkeypatch, mode: str):
    monkeypatch.setenv("CUFLASH_KVCACHE_FORWARD", "1")
    if mode == "rule":
        monkeypatch.delenv("CUFLASH_PAGED_DIRECT", raising=False)
    else:
        monkeypatch.setenv("CUFLASH_PAGED_DIRECT", mode)
    _fresh_decode_plans(monkeypatch)


@pytest.mark.parametrize("layout,head_dim,dtype,nheads,nheads_kv,opts,causal,seqlen_q,capacity,garbage,mode", CASES,
                         ids=[f"{c[0]}-d{c[1]}-{'bf16' if c[2] == BF16 else 'fp16'}-h{c[3]}kv{c[4]}-{c[5]}"
                              f"{'-causal' if c[6] else ''}-q{c[7]}-cap{c[8]}{'-garbage' if c[9] else ''}-{c[10]}"
                              for c in CASES])
def test_paged_direct(monkeypatch, layout, head_dim, dtype, nheads, nheads_kv, opts, causal, seqlen_q, capacity,
                      garbage, mode):
    from cuflash import _kvcache

    _sm90()
    _skip_unusable("cuda", dtype)
    seed = _new_seed()
    rng = np.random.default_rng(seed)
    options = _options(rng, opts, 3, nheads)
    ctx = _ctx(seed, layout=layout, head_dim=head_dim, opts=opts)

    def make():
        return make_case(rng, dtype=dtype, batch=3, seqlen_q=seqlen_q, nheads=nheads, nheads_kv=nheads_kv,
                         head_dim=head_dim, layout=layout, capacity=capacity, seqlen_new=seqlen_q,
                         seqlens=np.array([0, capacity // 3, capacity - seqlen_q - 1], np.int32),
                         table_garbage=garbage)

    # 1. Against the float64 reference, in place where the kernel serves the call with big enough boxes.
    _route(monkeypatch, mode)
    _check(make, "cuda", causal, options, ctx)
    plans = list(_kvcache._CHUNK_PLANS.values())
    assert plans and not _kvcache._DECODE_PLANS, ctx
    rows = seqlen_q * (nheads // nheads_kv)
    in_place = _in_place(layout, head_dim, opts, mode, rows)
    assert all(p.direct == in_place for p in plans), ([p.direct for p in plans], ctx)

    # 2. Bit for bit against the gather route, the same inputs (each route appends into its own copy).
    case = make()
    scale = options.get("softmax_scale")
    dev_opts = {n: (_to(x, "cuda") if isinstance(x, np.ndarray) else x) for n, x in options.items()
                if n != "softmax_scale"}
    got = {}
    for direct in (True, False):
        _route(monkeypatch, "1" if direct else "0")
        args = {n: _to(x, "cuda") for n, x in case.args().items()}
        out, lse = _kvcache.attention_with_kvcache(**args, causal=causal, softmax_scale=scale, return_lse=True,
                                                   **dev_opts)
        torch.cuda.synchronize()
        (plan,) = _kvcache._CHUNK_PLANS.values()
        assert plan.direct == (direct and _in_place(layout, head_dim, opts, "1", rows)), ctx
        got[direct] = (_back(out), _back(lse), _back(args["k_cache"]), _back(args["v_cache"]))
    for i, name in enumerate(("out", "lse", "k_cache", "v_cache")):
        a, b = (np.asarray(got[d][i]) for d in (True, False))
        assert a.shape == b.shape and np.array_equal(a.view(f"u{a.dtype.itemsize}"), b.view(f"u{b.dtype.itemsize}")), (
            f"{name}: the paged forward differs from the gather route's at "
            f"{int(np.count_nonzero(a.view(f'u{a.dtype.itemsize}') != b.view(f'u{b.dtype.itemsize}')))} elements; {ctx}")


@pytest.mark.parametrize("dtype", [FP16, BF16], ids=["fp16", "bf16"])
def test_paged_short_chunk_small_boxes(monkeypatch, dtype):
    """A chunk of fewer rows a kv head than the gather route takes (64 positions x GQA 4 = 256), on 16-row
    pages, by the library's own rules (no switch forced): the contiguous rule gives it the forward, and
    with no gather to fall back on the forward reads the pages in place with 16-row boxes
    (_config.paged_direct's small_ok). Against the float64 reference (batch 6, 16 query heads, head_dim
    128, causal, garbage table entries past each entry's pages)."""
    from cuflash import _kvcache

    _sm90()
    _skip_unusable("cuda", dtype)
    monkeypatch.delenv("CUFLASH_KVCACHE_FORWARD", raising=False)
    monkeypatch.delenv("CUFLASH_PAGED_DIRECT", raising=False)
    _fresh_decode_plans(monkeypatch)
    seed = _new_seed()
    rng = np.random.default_rng(seed)

    def make():
        return make_case(rng, dtype=dtype, batch=6, seqlen_q=64, nheads=16, nheads_kv=4, head_dim=128,
                         layout="paged16", capacity=600, seqlen_new=64,
                         seqlens=np.array([0, 7, 100, 300, 500, 535], np.int32), table_garbage=True)

    _check(make, "cuda", True, {}, _ctx(seed, dtype=dtype.name))
    plans = list(_kvcache._CHUNK_PLANS.values())
    assert plans and all(p.direct for p in plans) and not _kvcache._DECODE_PLANS, (plans, seed)


# (layout, head_dim, dtype, variant): 16-row boxes (16- and 48-row pages) into SW128 panels, one box a
# 64-column panel (cuflash/_launch.py paged_interleaved: CUFLASH_PAGED_ILV=0, "panels", or pages that lie
# apart in memory, "gaps": a view with a NaN-filled gap after each page), rather than in boxes of whole rows
# (K interleaved, V group-major), which such boxes take at head_dim 128 and 256 in the cases above.
LAYOUT_CASES = [("paged16", 128, BF16, "panels"), ("paged48", 256, FP16, "panels"), ("paged16", 128, FP16, "gaps"),
                ("paged48", 256, BF16, "gaps")]


@pytest.mark.parametrize("layout,head_dim,dtype,variant", LAYOUT_CASES,
                         ids=[f"{c[0]}-d{c[1]}-{'bf16' if c[2] == BF16 else 'fp16'}-{c[3]}" for c in LAYOUT_CASES])
def test_paged_layouts(monkeypatch, layout, head_dim, dtype, variant):
    """The same chunk (batch 3, 70 positions, 16 query heads, 2 kv heads, causal, the tokens appended) read in
    place into SW128 panels (the variant), read in place into the interleaved layout (the caches' pages
    following one another), and through the gather route: out, lse and the caches after the append bit for
    bit equal across the three, and each plan's forward the kernel of its layout ("_paged" / "_paged_ilv")."""
    from cuflash import _kvcache

    _sm90()
    _skip_unusable("cuda", dtype)
    seed = _new_seed()
    rng = np.random.default_rng(seed)
    ctx = _ctx(seed, layout=layout, head_dim=head_dim, variant=variant)
    case = make_case(rng, dtype=dtype, batch=3, seqlen_q=70, nheads=16, nheads_kv=2, head_dim=head_dim,
                     layout=layout, capacity=400, seqlen_new=70, seqlens=np.array([0, 133, 329], np.int32))

    def gapped(t):
        g = torch.full((t.shape[0], 2 * t.shape[1]) + tuple(t.shape[2:]), float("nan"), dtype=t.dtype, device=t.device)
        g[:, :t.shape[1]] = t
        return g[:, :t.shape[1]]

    got = {}
    for route in ("variant", "ilv", "gather"):
        _route(monkeypatch, "0" if route == "gather" else "1")
        if route == "variant" and variant == "panels":
            monkeypatch.setenv("CUFLASH_PAGED_ILV", "0")
        else:
            monkeypatch.delenv("CUFLASH_PAGED_ILV", raising=False)
        args = {n: _to(x, "cuda") for n, x in case.args().items()}
        if route != "ilv" and variant == "gaps":
            args["k_cache"], args["v_cache"] = gapped(args["k_cache"]), gapped(args["v_cache"])
        out, lse = _kvcache.attention_with_kvcache(**args, causal=True, return_lse=True)
        torch.cuda.synchronize()
        (plan,) = _kvcache._CHUNK_PLANS.values()
        assert plan.direct == (route != "gather"), ctx
        if plan.direct:
            name = plan.launches[-1].name
            assert name.endswith("_paged_ilv" if route == "ilv" else "_paged"), (name, ctx)
        got[route] = (_back(out), _back(lse), _back(args["k_cache"]), _back(args["v_cache"]))
    for i, name in enumerate(("out", "lse", "k_cache", "v_cache")):
        a = np.asarray(got["gather"][i])
        a = a.view(f"u{a.dtype.itemsize}")
        for route in ("variant", "ilv"):
            b = np.asarray(got[route][i])
            b = b.view(f"u{b.dtype.itemsize}")
            assert a.shape == b.shape and np.array_equal(a, b), (
                f"{name}: {route} differs from the gather route's at {int(np.count_nonzero(a != b))} elements; {ctx}")
