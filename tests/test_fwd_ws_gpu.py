"""The warp-specialized sm_90a forward (cuda_src/flash_fwd_sm90_ws.cu, CUFLASH_FWD_WS=1;
docs/hopper_plan.md steps 2 and 3) in both schedules, the consumers in their own time and pingpong,
and with three consumer warpgroups at head_dim 64: a TMA producer warpgroup and wgmma consumers
synchronized by mbarriers. Checked as the default
kernels are (tests/test_gpu_forward.py's run_and_check: float64 reference, 2x the naive error,
NaN-poisoned allocators) on tests/test_fwd_tma_gpu.py's cases (both dtypes, head_dim 64 / 128 / 256,
causal or not, ragged lengths, GQA, strided layouts) and on shapes that wrap the rings many times or
leave rows with no key. The launched kernel's name is checked, so a fallback cannot pass for it.
Marked gpu; skipped below sm_90."""

import pytest

from test_fwd_tma_gpu import CASES, record_tma_launches
from test_gpu_forward import fresh_seed, make_qkv, run_and_check

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu

MORE = [  # dtype, head_dim, causal, seqlen_q, seqlen_k, nheads, nheads_kv, layout
    ("float16", 64, False, 2048, 4096, 4, 4, "bshd"),     # 32 key tiles: the rings wrap 16 times
    ("bfloat16", 128, True, 2048, 512, 4, 1, "bshd"),     # bottom-right causal: early rows see no key
    ("bfloat16", 256, True, 1500, 1500, 2, 1, "bhsd"),
    ("float16", 128, False, 129, 1, 2, 2, "bshd"),        # one key
    # Several work tiles per block on the persistent grid (132 SMs), of different lengths (causal),
    # many with no key at all (bottom-right causal, seqlen_q >> seqlen_k).
    ("bfloat16", 64, True, 3000, 3000, 8, 2, "bshd"),
    ("float16", 128, False, 1000, 777, 16, 4, "bshd"),
    ("bfloat16", 64, True, 4096, 300, 16, 4, "bshd"),
    ("float16", 128, True, 2500, 2100, 12, 3, "bhsd"),
    # Many work tiles a block with one or two key tiles each (ragged): the persistent non-causal
    # pingpong grid crosses a tile boundary every one or two key tiles, so each tile's first and last
    # turns and its epilogue run back to back with the next tile's (added for session 41's chained
    # work tiles, which were measured and dropped; bench/NOTES.md).
    ("bfloat16", 128, False, 4000, 100, 16, 2, "bshd"),
    ("float16", 128, False, 3000, 250, 24, 8, "bhsd"),
    # Consumers that visit fewer key tiles than their block (flash_fwd_sm90_ws.cu TRIM: three consumers,
    # the "three" schedule at head_dim 64): a last query block of 70 rows (the second consumer with 6
    # rows, the third with none, releasing 20 key tiles unread); of 68 rows in a causal 4100 x 4100 (the
    # first consumer's tiles end a tile before the block's, the second has 4 rows, the third none);
    # bottom-right causal with more keys than rows (a block's first consumer needs fewer key tiles than
    # its last), at head_dim 64 and, on the kernels without TRIM, 256.
    ("bfloat16", 64, False, 70, 2500, 4, 2, "bshd"),
    ("bfloat16", 64, True, 4100, 4100, 2, 2, "bshd"),
    ("float16", 64, True, 200, 1000, 2, 1, "bhsd"),
    ("float16", 256, True, 200, 1000, 2, 1, "bhsd"),
]


@pytest.fixture(params=["plain", "pingpong", "three", "persistent", "persistent_pingpong", "persistent_pairs"])
def ws_on(request, monkeypatch):
    """The warp-specialized kernel in each schedule (CUFLASH_FWD_WS_PINGPONG=1 / 0, whatever the table
    chooses), with three consumer warpgroups (CUFLASH_FWD_WS_CONSUMERS=3: 192-row blocks at head_dim
    64, two consumers elsewhere), and on the persistent grid (CUFLASH_FWD_WS_PERSISTENT=1: at head_dim
    64 and 128, two consumers; unset: FWD_WS_PERSISTENT_DEFAULT's), causal calls there on their work
    lists (cuflash/_schedule.py) or, persistent_pairs (CUFLASH_FWD_SCHED=0), on the kernel's own pairs;
    yields (names of the TMA launches fired, pingpong, three, persistent, work lists)."""
    pp, three = request.param.endswith("pingpong"), request.param == "three"
    pers = request.param.startswith("persistent")
    sched = request.param != "persistent_pairs"
    names = record_tma_launches(monkeypatch, CUFLASH_FWD_WS="1", CUFLASH_FWD_TMA=None,
                                CUFLASH_FWD_WS_PINGPONG="1" if pp else "0",
                                CUFLASH_FWD_WS_CONSUMERS="3" if three else "2",
                                CUFLASH_FWD_WS_PERSISTENT="1" if pers else None,
                                CUFLASH_FWD_SCHED=None if sched else "0")
    yield names, pp, three, pers, sched
    from cuflash import _plan

    _plan.CACHE.clear()


@pytest.mark.parametrize("dtype,head_dim,causal,seqlen_q,seqlen_k,nheads,nheads_kv,layout", CASES + MORE)
def test_ws_forward(ws_on, dtype, head_dim, causal, seqlen_q, seqlen_k, nheads, nheads_kv, layout):
    import cuflash
    from cuflash import _tma

    seed = fresh_seed()
    torch.manual_seed(seed)
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, getattr(torch, dtype), layout)
    label = f"ws {dtype} d{head_dim} causal={causal} {seqlen_q}x{seqlen_k} h{nheads}/{nheads_kv} {layout}"
    names, pp, three, pers, sched = ws_on
    label += " pingpong" if pp else " three consumers" if three else ""
    label += " persistent" if pers else ""
    run_and_check(cuflash, q, k, v, causal=causal, seed=seed, label=label)
    rows_q = 192 if three and head_dim == 64 else 128
    from cuflash import _config

    # persistent: the table's entries (not head_dim 256, which spilled); otherwise the default's; causal
    # with an even count of query blocks a head only
    pers_grid = _config.fwd_ws_persistent_config(head_dim, causal, seqlen_k, seqlen_q) is not None
    assert pers_grid == (((head_dim, causal) in _config.FWD_WS_PERSISTENT_TABLE if pers else
                          _config.fwd_ws_persistent_default(head_dim, causal, seqlen_k))
                         and not (causal and -(-seqlen_q // 128) % 2)), label
    patched = all(_tma.layout_patch(tuple(t.shape), tuple(t.stride()), rows, dtype) is not None
                  for t, rows in ((q, rows_q), (k, 64 if head_dim > 128 else 128), (v, 64 if head_dim > 128 else 128)))
    if patched:
        # (a split kernel where the persistent grid's last wave is cut: test_ws_forward_split)
        base = [n.removesuffix("_split") for n in names]
        assert names and all(n.startswith("fwd90ws_") and n.removesuffix("_pers").endswith("_pp") == pp
                             and f"_m{rows_q}_" in n and n.endswith("_pers") == pers_grid
                             for n in base), (label, names)
    # Causal on the persistent grid: the work lists were copied and the Params point to them (or, with
    # CUFLASH_FWD_SCHED=0, there are none and the kernel pairs its query blocks).
    from cuflash import _launch, _plan

    lists = [L for plan in _plan.CACHE.values() for L in getattr(plan, "launches", ())
             if isinstance(L, _launch.ScheduledLaunch)]
    assert bool(lists) == (pers_grid and causal and sched and patched), (label, lists)
    assert all(L.armed is not None and int(L.words[L.table_word]) == L.tables[L.armed].ptr for L in lists), label


# The split tail of the persistent non-causal forward (cuflash/_schedule.py split_schedule): shapes
# whose last wave of work tiles the plan cuts along their key tiles on a 132-SM GPU (an H100's or an
# H200's), with ragged query and key lengths (the masked last key tile in a tile's last part), GQA,
# strided layouts, fewer tiles than SMs, and head_dim 64 (two consumers on the persistent grid).
CASES_SPLIT = [  # dtype, head_dim, seqlen_q, seqlen_k, nheads, nheads_kv, layout
    ("bfloat16", 128, 2048, 4096, 9, 3, "bshd"),    # 288 tiles: 2 waves and 24 tiles in 4 parts
    ("float16", 128, 1000, 3000, 10, 10, "bhsd"),   # ragged query and key tiles
    ("bfloat16", 128, 300, 4100, 23, 1, "bshd"),    # 138 tiles: 6 split; 33 key tiles (ragged)
    ("float16", 128, 700, 2500, 12, 3, "mixed"),
    ("bfloat16", 128, 512, 2222, 20, 5, "padded"),
    ("float16", 64, 1024, 3000, 9, 3, "bshd"),
    ("bfloat16", 64, 333, 2100, 24, 8, "bhsd"),
]


@pytest.mark.parametrize("dtype,head_dim,seqlen_q,seqlen_k,nheads,nheads_kv,layout", CASES_SPLIT)
def test_ws_forward_split(monkeypatch, dtype, head_dim, seqlen_q, seqlen_k, nheads, nheads_kv, layout):
    """Each case twice, with fresh inputs: a tile's parts merge by the last one's count, which must
    find the counters back at zero after the first call (an unmerged tile stays NaN: run_and_check
    poisons out)."""
    import cuflash
    from cuflash import _kvcache, _launch, _plan, _schedule

    names = record_tma_launches(monkeypatch, CUFLASH_FWD_WS=None, CUFLASH_FWD_TMA=None, CUFLASH_FWD_SPLIT=None,
                                CUFLASH_FWD_WS_PERSISTENT="1")
    try:
        label = f"ws split {dtype} d{head_dim} {seqlen_q}x{seqlen_k} h{nheads}/{nheads_kv} {layout}"
        for rep in range(2):
            seed = fresh_seed()
            torch.manual_seed(seed)
            q, k, v = make_qkv(2, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, getattr(torch, dtype), layout)
            run_and_check(cuflash, q, k, v, causal=False, seed=seed, label=f"{label} call {rep + 1}")
        n_work = 2 * nheads * -(-seqlen_q // 128)
        sms = _kvcache._sm_count(torch.cuda.current_device())
        G = min(n_work, sms)  # the persistent grid: a block per SM, or per tile where fewer
        want = _schedule.split_schedule(n_work, G, -(-seqlen_k // 128))
        splits = [L for plan in _plan.CACHE.values() for L in getattr(plan, "launches", ())
                  if isinstance(L, _launch.SplitLaunch)]
        if sms == 132:
            assert want is not None, label  # the cases are chosen to split on 132 SMs
        assert names and all(n.endswith("_pers_split" if want is not None else "_pers") for n in names), (label, names)
        assert len(splits) == (want is not None), (label, splits)
        for L in splits:
            first, parts, chunk = want[1:]
            assert L.armed is not None and int(L.words[L.table_word]) == L.tables[L.armed].ptr, label
            assert tuple(int(x) for x in L.ints[L.i_split:L.i_split + 3]) == (first, parts, chunk), label
    finally:
        _plan.CACHE.clear()


# Head_dim pad-up (cuflash/_config.py fwd_pad_head_dim): head dims between 64 and 256 run the kernel of
# 128 or 256 through maps whose columns past head_dim read as zeros, and write only their own columns
# of out (run_and_check NaN-poisons out, so a column left unwritten or a write past the row shows);
# plain calls at head_dim 24 to 56 run the kernel of 64 from _config.FWD_PAD_SMALL_MIN_SEQLEN_K's keys
# on, with its three consumers (192-row blocks), or inside FWD_PAD_SMALL_TMA_SEQLEN_K's spans the TMA
# variant of 64 (_config.fwd_pad_tma); every case below 64 here is at or past the first of those lengths.
CASES_PAD = [  # dtype, head_dim, causal, seqlen_q, seqlen_k, nheads, nheads_kv, layout
    ("bfloat16", 96, False, 1000, 1000, 4, 2, "bshd"),
    ("float16", 96, True, 513, 777, 4, 4, "bhsd"),
    ("bfloat16", 72, True, 300, 700, 4, 1, "padded"),
    ("float16", 120, False, 200, 130, 2, 2, "mixed"),
    ("bfloat16", 136, True, 1024, 1024, 4, 2, "bshd"),
    ("float16", 200, False, 700, 300, 2, 1, "bshd"),
    ("bfloat16", 248, True, 2048, 512, 2, 2, "bshd"),   # bottom-right causal: early rows see no key
    ("float16", 200, False, 129, 1, 2, 2, "bshd"),       # one key
    ("bfloat16", 24, False, 1000, 2048, 4, 2, "bshd"),
    ("float16", 40, True, 777, 4096, 4, 1, "bhsd"),
    ("bfloat16", 56, False, 2048, 3000, 2, 2, "padded"),
    ("float16", 32, True, 4096, 4096, 2, 2, "bshd"),
    ("bfloat16", 48, False, 129, 2500, 2, 1, "mixed"),
    ("float16", 48, False, 300, 600, 2, 2, "bshd"),
    ("bfloat16", 56, True, 1024, 1024, 4, 2, "bhsd"),
    ("float16", 40, False, 512, 512, 2, 1, "bshd"),
]


@pytest.mark.parametrize("dtype,head_dim,causal,seqlen_q,seqlen_k,nheads,nheads_kv,layout", CASES_PAD)
def test_padded_head_dim_forward(monkeypatch, dtype, head_dim, causal, seqlen_q, seqlen_k, nheads, nheads_kv, layout):
    import cuflash
    from cuflash import _config, _plan

    names = record_tma_launches(monkeypatch, CUFLASH_FWD_WS=None, CUFLASH_FWD_TMA=None, CUFLASH_FWD_PAD=None)
    try:
        seed = fresh_seed()
        torch.manual_seed(seed)
        q, k, v = make_qkv(2, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, getattr(torch, dtype), layout)
        label = f"ws pad-up {dtype} d{head_dim} causal={causal} {seqlen_q}x{seqlen_k} h{nheads}/{nheads_kv} {layout}"
        run_and_check(cuflash, q, k, v, causal=causal, seed=seed, label=label)
        pad = _config.fwd_pad_head_dim("sm_90a", head_dim, plain=True)
        mappable = all(t.stride(-1) == 1 and all(s > 0 and s % 8 == 0 for s in t.stride()[:3]) for t in (q, k, v))
        # (Inside FWD_PAD_SMALL_TMA_SEQLEN_K's spans the TMA variant of 64 goes first: _config.fwd_pad_tma.)
        kind = "fwd90" if _config.fwd_pad_tma("sm_90a", head_dim, causal, seqlen_k) else "fwd90ws"
        assert pad is not None and all(n.startswith(f"{kind}_{'bf16' if dtype == 'bfloat16' else 'f16'}_d{pad}_")
                                       for n in names), (label, names)
        if mappable:
            assert names, label
    finally:
        _plan.CACHE.clear()
