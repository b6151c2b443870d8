"""A stand-in Hopper for the decode planner, without a GPU: compute capability 9.0, a given SM count
and peak memory bandwidth, kernels and tensor maps stood in (every cache layout taken as one that tensor
maps describe), no programmatic dependent launch; and plans of bench_decode's layout made from
hand-made array descriptions through describe_kvcache and DecodePlan, as a call would make them. Used by
tests/test_kvcache_decode.py and bench/dev/decode_plans.py."""
from __future__ import annotations

import numpy as np


def install_stand_in(setattr_, sm_count: int = 132, bw: float = 4.8e12, clusters: tuple | None = None) -> None:
    """Patch the planner's questions to the device through setattr_(obj, name, value) (pytest's
    monkeypatch.setattr, or setattr). clusters: (4-warp, 8-warp) the most clusters of 8 blocks resident
    at once (an H200's driver: (30, 15)), for a stand-in with cluster launches (the cluster merge);
    None: no cluster launches."""
    from cuflash import _compile, _gpu, _kvcache, _launch, _tma

    class Loaded:
        ptr = 1

    setattr_(_gpu, "compute_capability", lambda device_id: (9, 0))
    setattr_(_gpu, "peak_memory_bandwidth", lambda device_id: bw)
    setattr_(_kvcache, "_sm_count", lambda device_id: sm_count)
    setattr_(_compile, "get_function", lambda spec, target, device_id, smem: Loaded())
    setattr_(_launch, "pdl_available", lambda cc: False)
    setattr_(_tma, "available", lambda: True)
    setattr_(_launch, "launch_ex_available", lambda: clusters is not None)
    if clusters is not None:
        setattr_(_launch, "cluster_fits", lambda launch: launch.grid // launch.cluster
                 <= clusters[launch.threads > 128] * 8 // launch.cluster)
    # The planner asks layout_patch whether a map's pointer word is known; a plan's maps are encoded
    # at its calls, which are never made here.
    patch = _tma.MapPatch(bytes(128), 1, 0, 4)  # a map's 16 words, its address word stood in
    setattr_(_tma, "layout_patch", lambda shape, strides, rows, dtype, panels=1, ilv=False, box_heads=1: patch)


def _info(shape, dtype="bfloat16"):
    from cuflash._call import ArrayInfo

    strides = tuple(int(np.prod(shape[i + 1:])) for i in range(len(shape)))
    return ArrayInfo("torch", tuple(shape), strides, dtype, ("cuda", 0), True, "torch.Tensor")


def stand_in_plan(batch: int, cache: int, gqa: int, paged: bool, nheads: int = 32, d: int = 128, page: int = 16,
                  seqlen_q: int = 1):
    """The DecodePlan of bench_decode's layout: bf16, q (batch, seqlen_q, nheads, d), caches (batch,
    cache, nheads // gqa, d) contiguous or in page-row pages with a block table, lengths on the device."""
    from cuflash import _kvcache

    hk = nheads // gqa
    q = _info((batch, seqlen_q, nheads, d))
    if paged:
        pages = -(-cache // page)
        kc, table = _info((batch * pages, page, hk, d)), _info((batch, pages), "int32")
    else:
        kc, table = _info((batch, cache, hk, d)), None
    seqlens = _info((batch,), "int32")
    c = _kvcache.describe_kvcache(q, kc, kc, None, None, seqlens, block_table=table)
    infos = dict(q=q, k_cache=kc, v_cache=kc, k=None, v=None, cache_batch_idx=None, block_table=table,
                 sink_logits=None, alibi_slopes=None, cache_seqlens=seqlens)
    return _kvcache.DecodePlan(c, infos, 0)


def decode_launch(variant):
    """(the decode kernel's launch, fused) of a plan variant (plan.eager or plan.graph)."""
    _splits, _scratch, main, fused = variant
    launches = fused if fused is not None else main
    return next(L for L in launches if L.name.startswith("decode_") and "combine" not in L.name
                and "append" not in L.name), fused is not None
