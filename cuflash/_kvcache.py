"""Attention against a KV cache, with the new tokens appended in place (flash-attn's
`flash_attn_with_kvcache`): decoding, speculative decoding and chunked prefill.

    attention_with_kvcache  ->  KVCacheCall (describe_kvcache)  ->  values checked  ->  append  ->  forward

The cache is contiguous, (batch_cache, seqlen_cache, nheads_kv, head_dim) with batch entry b in
row b (or row cache_batch_idx[b]), or paged, (num_blocks, page_size, nheads_kv, head_dim) with a
block table: the logical key position t of entry b lives at

    block block_table[b, t // page_size], row t % page_size

    logical keys of entry b:   | 0 .. page_size-1 | page_size .. 2*page_size-1 | ...
    block_table[b]:            [        7         ,             2              , ...]
    k_cache:                   block 2 = keys page_size.., block 7 = keys 0.., other blocks: other entries

The call validates everything first (`describe_kvcache`: what the signature fixes; then the
values of the index arrays, which live on the host on the CPU path), writes k and v into the
caches at [cache_seqlens[b], cache_seqlens[b] + seqlen_new), gathers each entry's logical keys
into a padded (batch, max_len, nheads_kv, head_dim) array and runs the tiled NumPy forward of
cuflash/_cpu.py on it with kv_lengths = cache_seqlens + seqlen_new. So the masks, windows, sinks,
ALiBi and softcap mean exactly what they mean for `cuflash.attention` with those kv_lengths
(cuflash/_features.py): bottom-right alignment on the valid lengths.

The same paged layout serves a prefill: `attention_varlen(..., block_table=...)` (flash-attn's varlen
call with a block table) reads each sequence's keys from the pages, cu_seqlens_k giving only their
lengths, gathers them into the packed (total_k, nheads_kv, head_dim) layout and runs the NumPy varlen
forward of cuflash/_plan.py on them (`attention_varlen_paged`, at the end of this module). Forward
only for now.

On the GPU (`_gpu_kvcache`) the call runs the decode kernels of cuda_src/flash_decode.cu through a
`DecodePlan` (append, split-KV decode with GQA packing, combine), cached by the call's signature so
that a repeated decode step skips the checks; the lengths and indices stay on the device. A chunk of
more than 64 packed query rows per kv head (chunked prefill, a long speculative step) takes the training
forward with kv_lengths instead where that is the faster (_config.kvcache_feature_forward), through a
`ChunkPlan`: the append kernel writes the new tokens and each entry's length, then the forward reads a
contiguous cache whose row b is entry b in place, or on sm_90a a paged one in place through its block
table (the warp-specialized feature kernel with _launch.PagedKV, where its boxes have enough rows, or
16-row boxes copied as whole rows for fewer than 2048 query rows a kv head: _config.paged_direct), else a
paged one's keys gathered into a padded contiguous copy (the append done
on the way, one launch); cached by signature as the decode plans are. The paged prefill on the GPU
reads the pages in place the same way (`_PagedVarlenPlan`), else (`GatherPlan`,
cuda_src/paged_gather.cu) gathers each sequence's keys from the pages into packed arrays on the device
and runs attention_varlen on them; a repeated signature skips the checks (`_PAGED_FAST`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

from ._call import MAX_SOFTMAX_SCALE, SUPPORTED_DTYPES, ArrayInfo, _check_bool
from ._config import HEAD_DIMS
from ._features import ARRAY_OPTIONS, Features, _is_int, check_features
from ._launch import stream_capturing
from ._plan import FWD_OPT, Plan, run_launches

# A paged prefill plan's block table (_PagedVarlenPlan): the slot after the forward's option slots.
_PAGED_TABLE = FWD_OPT + len(ARRAY_OPTIONS)

__all__ = ["attention_with_kvcache", "describe_kvcache", "KVCacheCall"]

PAGE_MULTIPLE = 16  # a page holds whole 16-row tiles (the GPU kernels will load K/V tiles of 16 rows)
_ARRAYS = "a torch.Tensor, jax.Array, cupy.ndarray or numpy.ndarray"


@dataclass(frozen=True)
class KVCacheCall:
    """A validated call of `attention_with_kvcache`: what its signature fixes."""

    lib: str
    device: tuple
    dtype: str
    batch: int
    seqlen_q: int
    nheads: int
    nheads_kv: int
    head_dim: int
    scale: float
    feats: Features          # causal folded into window_right (cuflash/_features.py)
    return_lse: bool
    paged: bool
    page_size: int           # rows per block of a paged cache; 0 for a contiguous one
    cache_rows: int          # batch_cache (contiguous) or num_blocks (paged)
    capacity: int            # keys an entry can hold: seqlen_cache or max_blocks_per_seq * page_size
    seqlen_new: int          # tokens appended per entry; 0: nothing is appended
    fixed_seqlen: int | None  # cache_seqlens given as an int (or None: capacity); None when it is an array
    has_batch_idx: bool
    arrays: tuple = ()       # the option arrays given: "sink_logits", "alibi_slopes"

    @property
    def appends(self) -> bool:
        return self.seqlen_new > 0


def _refuse_gpu(q: ArrayInfo, what: str = "attention_with_kvcache",
                instead: str = "or call cuflash.attention with kv_lengths on the gathered keys") -> None:
    """The one place that keeps CUDA arrays out until the kernels exist (the call runs on q's device;
    any other array elsewhere is a device mismatch, a ValueError). what: the call refused; instead:
    what to do meanwhile."""
    if q.device[0] == "cuda":
        raise NotImplementedError(
            f"{what} on the GPU is not built yet; its kernels come in a later release. "
            f"q is a {q.lib} array on cuda:{q.device[1]}. Pass CPU arrays (NumPy, torch or JAX on the CPU) "
            f"for the NumPy implementation, {instead}.")


def _check_page_size(name, shape) -> None:
    """Dimension 1 of a paged cache (num_blocks, page_size, nheads_kv, head_dim): whole 16-row tiles."""
    if shape[1] % PAGE_MULTIPLE != 0:
        raise ValueError(f"{name}: expected a page_size (dimension 1 of a paged cache (num_blocks, page_size, "
                         f"nheads_kv, head_dim)) that is a multiple of {PAGE_MULTIPLE}; got {shape[1]} (shape "
                         f"{shape})")


def _shape_text(names, values) -> str:
    return "(" + ", ".join(names) + ") = (" + ", ".join(str(v) for v in values) + ")"


def _check_index(name, x, lib, device, shape, shape_text):
    """An int32 index array of q's library and device with the given shape."""
    if x.lib is None:
        raise TypeError(f"{name}: expected an int32 {lib} array of shape {shape_text}; got {x.type_name}")
    if x.lib != lib:
        raise TypeError(f"{name}: expected a {lib} array like q; got {x.type_name}")
    if x.dtype != "int32":
        raise TypeError(f"{name}: expected dtype int32; got {x.dtype}")
    if len(x.shape) != len(shape) or any(want is not None and got != want for got, want in zip(x.shape, shape)):
        raise ValueError(f"{name}: expected shape {shape_text}; got {x.shape}")
    if x.device != device:
        raise ValueError(f"{name}: on {x.device[0]}:{x.device[1]}; expected q's device {device[0]}:{device[1]}")


def _check_q_and_cache(q, k, v, k_name: str, v_name: str) -> None:
    """q (..., nheads, head_dim) against a cache k (rows, seq, nheads_kv, head_dim) and v: no empty
    dimension, a supported head_dim, GQA, v shaped like k (the shapes' lengths are checked before)."""
    h, d = q.shape[-2], q.shape[-1]
    hk, dk = k.shape[2], k.shape[3]
    if min(q.shape) < 1:
        raise ValueError(f"q: expected every dimension >= 1; got shape {q.shape}")
    if d not in HEAD_DIMS:
        raise ValueError(f"q: expected a head_dim that is a multiple of 8 from 8 to 256; got {d} (q shape {q.shape})")
    if min(k.shape) < 1:
        raise ValueError(f"{k_name}: expected every dimension >= 1; got shape {k.shape}")
    if dk != d:
        raise ValueError(f"{k_name}: expected q's head_dim {d} in its last dimension; got head_dim {dk} (q shape "
                         f"{q.shape}, {k_name} shape {k.shape})")
    if h % hk != 0:
        raise ValueError(f"{k_name}: expected nheads_kv dividing q's nheads {h} (MQA/GQA); got nheads_kv {hk} "
                         f"(q shape {q.shape}, {k_name} shape {k.shape})")
    if v.shape != k.shape:
        raise ValueError(f"{v_name}: expected {k_name}'s shape {k.shape}; got {v.shape}")


def describe_kvcache(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, *, cache_batch_idx=None,
                     block_table=None, causal=False, softmax_scale=None, return_lse=False, window=None,
                     num_sink_tokens=0, sink_logits=None, alibi_slopes=None, softcap=None) -> KVCacheCall:
    """Validates what the signature of a call fixes. Arrays are ArrayInfo / Foreign / None;
    cache_seqlens may also be an int. Every error names the argument, what it got and what was
    expected. Values of the index arrays are checked later (`_check_values`)."""
    arrays = dict(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, sink_logits=sink_logits,
                  alibi_slopes=alibi_slopes)
    if q.lib is None:
        raise TypeError(f"q: expected {_ARRAYS}; got {q.type_name}")
    lib = q.lib
    for name in ("k_cache", "v_cache", "k", "v"):
        x = arrays[name]
        if x is not None and x.lib != lib:
            raise TypeError(f"{name}: expected a {lib} array like q; got {x.type_name}")
    device = q.device
    if device[0] not in ("cpu", "cuda"):
        raise ValueError(f"q: expected an array on the CPU or a CUDA GPU; got one on {device[0]}")
    for name in ("k_cache", "v_cache", "k", "v"):
        x = arrays[name]
        if x is not None and x.device != device:
            raise ValueError(f"{name}: on {x.device[0]}:{x.device[1]}; expected q's device {device[0]}:{device[1]}")

    # ---- shapes and dtypes of q and the caches
    for name, layout in (("q", "(batch, seqlen_q, nheads, head_dim)"),
                         ("k_cache", "(batch_cache, seqlen_cache, nheads_kv, head_dim) or paged "
                                     "(num_blocks, page_size, nheads_kv, head_dim)"),
                         ("v_cache", "k_cache's shape")):
        if len(arrays[name].shape) != 4:
            raise ValueError(f"{name}: expected 4 dimensions {layout}; got shape {arrays[name].shape}")
    if q.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"q: expected dtype float16 or bfloat16; got {q.dtype}")
    for name in ("k_cache", "v_cache"):
        if arrays[name].dtype != q.dtype:
            raise TypeError(f"{name}: expected q's dtype {q.dtype}; got {arrays[name].dtype}")
    b, sq, h, d = q.shape
    rows, seq, hk, dk = k_cache.shape
    _check_q_and_cache(q, k_cache, v_cache, "k_cache", "v_cache")

    # ---- paged or contiguous
    paged = block_table is not None
    if paged:
        _check_index("block_table", block_table, lib, device, (b, None), f"(batch, max_blocks_per_seq) = ({b}, *)")
        if block_table.shape[1] < 1:
            raise ValueError(f"block_table: expected at least one block per sequence; got shape {block_table.shape}")
        _check_page_size("k_cache", k_cache.shape)
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx: expected None with block_table (the table already says where each "
                             "entry's keys are); got an array as well")
        if cache_seqlens is None:
            raise ValueError("cache_seqlens: expected an int32 array (batch,) or an int with block_table (how many "
                             "keys each entry holds); got None")
        capacity = block_table.shape[1] * seq
    else:
        if cache_batch_idx is not None:
            _check_index("cache_batch_idx", cache_batch_idx, lib, device, (b,), f"(batch,) = ({b},)")
        elif rows < b:
            raise ValueError(f"k_cache: expected batch_cache >= q's batch {b} (without cache_batch_idx entry b "
                             f"uses cache row b); got batch_cache {rows} (shape {k_cache.shape})")
        capacity = seq

    # ---- the new tokens
    if (k is None) != (v is None):
        given, missing = ("k", "v") if v is None else ("v", "k")
        raise ValueError(f"{missing}: expected {missing} with {given} (both or neither: the tokens to append); got "
                         f"{given} and {missing}=None")
    seqlen_new = 0
    if k is not None:
        for name in ("k", "v"):
            x = arrays[name]
            if len(x.shape) != 4:
                raise ValueError(f"{name}: expected 4 dimensions (batch, seqlen_new, nheads_kv, head_dim); "
                                 f"got shape {x.shape}")
            if x.dtype != q.dtype:
                raise TypeError(f"{name}: expected q's dtype {q.dtype}; got {x.dtype}")
        kb, seqlen_new, khk, kd = k.shape
        if (kb, khk, kd) != (b, hk, d):
            raise ValueError(f"k: expected shape (batch, seqlen_new, nheads_kv, head_dim) = ({b}, *, {hk}, {d}) "
                             f"(q's batch, the cache's heads and head_dim); got {k.shape}")
        if seqlen_new < 1:
            raise ValueError(f"k: expected seqlen_new >= 1 (pass k=None, v=None to append nothing); got shape "
                             f"{k.shape}")
        if v.shape != k.shape:
            raise ValueError(f"v: expected k's shape {k.shape}; got {v.shape}")
        if lib == "jax":
            raise TypeError("k: expected None for JAX arrays, which are immutable: k and v cannot be appended into "
                            "k_cache / v_cache in place; got a jax array. Write them yourself (k_cache.at[...].set(k) "
                            "or dynamic_update_slice) and call with k=None, v=None and cache_seqlens counting them")

    # ---- the cache lengths
    fixed = None
    if cache_seqlens is None:
        fixed = capacity
        if seqlen_new:
            raise ValueError(f"cache_seqlens: expected how many keys each entry holds before the append; got None, "
                             f"which means the whole cache (seqlen_cache = {capacity}) is filled and leaves no room "
                             "for k and v")
    elif _is_int(cache_seqlens):
        fixed = int(cache_seqlens)
        if fixed < 0 or fixed + seqlen_new > capacity:
            raise ValueError(f"cache_seqlens: expected an int in [0, {capacity - seqlen_new}] (capacity {capacity} "
                             f"minus seqlen_new {seqlen_new}); got {fixed}")
    elif cache_seqlens.lib is None:
        raise TypeError(f"cache_seqlens: expected an int32 {lib} array of shape (batch,) = ({b},), an int or None; "
                        f"got {cache_seqlens.type_name}")
    else:
        _check_index("cache_seqlens", cache_seqlens, lib, device, (b,), f"(batch,) = ({b},)")

    # ---- the scalars and the options
    _check_bool("causal", causal)
    _check_bool("return_lse", return_lse)
    scale = _check_scale(softmax_scale, d)
    options = {n: arrays[n] for n in ("sink_logits", "alibi_slopes") if arrays[n] is not None}
    feats, _ = check_features(lib, device, batch=b, nheads=h, seqlen_q=sq, seqlen_k=capacity, causal=bool(causal),
                              window=window, num_sink_tokens=num_sink_tokens, softcap=softcap, arrays=options,
                              packed=False)
    return KVCacheCall(lib=lib, device=device, dtype=q.dtype, batch=b, seqlen_q=sq, nheads=h, nheads_kv=hk,
                       head_dim=d, scale=scale, feats=feats, return_lse=bool(return_lse), paged=paged,
                       page_size=seq if paged else 0, cache_rows=rows, capacity=capacity, seqlen_new=seqlen_new,
                       fixed_seqlen=fixed, has_batch_idx=cache_batch_idx is not None, arrays=tuple(options))


MAX_SPLITS = 128


def _check_num_splits(num_splits) -> int:
    """num_splits: 0 (the heuristic) or a forced split count for the GPU decode kernel."""
    if not _is_int(num_splits):
        raise TypeError(f"num_splits: expected an int (0: chosen from the shape and the GPU); got "
                        f"{type(num_splits).__name__}")
    if not 0 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits: expected an int in [0, {MAX_SPLITS}] (0: chosen from the shape and the GPU); "
                         f"got {num_splits}")
    return int(num_splits)


def _check_scale(softmax_scale, head_dim) -> float:
    """The softmax scale of `cuflash.attention` (cuflash/_call.py states the bound)."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(softmax_scale, (str, bytes, bool)) or not hasattr(softmax_scale, "__float__"):
        raise TypeError(f"softmax_scale: expected a float or None; got {type(softmax_scale).__name__}")
    scale = float(softmax_scale)
    if not (math.isfinite(scale) and 0 < scale <= MAX_SOFTMAX_SCALE):
        raise ValueError(f"softmax_scale: expected a number in (0, {MAX_SOFTMAX_SCALE:g}]; got {softmax_scale!r}")
    return scale


# --------------------------------------------------------------------------------------------------------------
# The NumPy path: values, append, gather, forward.


def _show(values, limit=8) -> str:
    values = [int(x) for x in values]
    text = ", ".join(str(x) for x in values[:limit])
    return f"[{text}{', ...' if len(values) > limit else ''}]"


@dataclass
class _Where:
    """Where each entry's keys live, from the checked index arrays (int64 NumPy arrays)."""

    lengths: object       # (batch,) keys each entry sees: cache_seqlens + seqlen_new
    cache_seqlens: object  # (batch,)
    rows: object = None   # (batch,) cache rows of a contiguous cache
    table: object = None  # (batch, max_blocks_per_seq) block table, entries past those an entry uses set to 0


def _check_values(c: KVCacheCall, cache_seqlens, cache_batch_idx, block_table) -> _Where:
    """Checks the values of the index arrays (NumPy) against the call, before anything is written."""
    import numpy as np

    b, new = c.batch, c.seqlen_new
    if c.fixed_seqlen is not None:
        cs = np.full(b, c.fixed_seqlen, dtype=np.int64)
    else:
        cs = np.asarray(cache_seqlens).astype(np.int64).reshape(b)
        bad = (cs < 0) | (cs + new > c.capacity)
        if bad.any():
            i = int(np.argmax(bad))
            room = f"capacity {c.capacity} minus seqlen_new {new}" if new else f"capacity {c.capacity}"
            raise ValueError(f"cache_seqlens: expected values in [0, {c.capacity - new}] ({room}); got "
                             f"cache_seqlens[{i}] = {int(cs[i])} in {_show(cs)}")
    where = _Where(lengths=cs + new, cache_seqlens=cs)
    if c.paged:
        _check_table(c, np.asarray(block_table).astype(np.int64), where)
    else:
        if cache_batch_idx is None:
            where.rows = np.arange(b, dtype=np.int64)
        else:
            rows = np.asarray(cache_batch_idx).astype(np.int64).reshape(b)
            bad = (rows < 0) | (rows >= c.cache_rows)
            if bad.any():
                i = int(np.argmax(bad))
                raise ValueError(f"cache_batch_idx: expected values in [0, {c.cache_rows}) (the rows of k_cache); got "
                                 f"cache_batch_idx[{i}] = {int(rows[i])} in {_show(rows)}")
            if c.appends:
                uniq, counts = np.unique(rows, return_counts=True)
                if (counts > 1).any():
                    r = int(uniq[np.argmax(counts > 1)])
                    i, j = np.nonzero(rows == r)[0][:2]
                    raise ValueError(f"cache_batch_idx: expected distinct rows when k and v are appended (each entry "
                                     f"appends into its own row); got entries {i} and {j} both in row {r}: "
                                     f"{_show(rows)}")
            where.rows = rows
    return where


def _check_blocks(table, lengths, page_size, num_blocks, cache: str, who: str):
    """The block table's entries that are read, the first ceil(lengths[b] / page_size) of row b, must name
    blocks of the cache, [0, num_blocks); the others are not read and may hold anything. Returns the
    table (int64) with the unread entries set to 0. cache, who: the cache's argument name and what a
    row of the table serves ("entry", "sequence"), for the message."""
    import numpy as np

    used = np.arange(table.shape[1])[None, :] < -(-lengths // page_size)[:, None]  # (batch, max_blocks)
    bad = used & ((table < 0) | (table >= num_blocks))
    if bad.any():
        i, j = (int(x) for x in np.argwhere(bad)[0])
        raise ValueError(f"block_table: expected block numbers in [0, {num_blocks}) (num_blocks of {cache}); got "
                         f"block_table[{i}, {j}] = {int(table[i, j])}, which {who} {i} uses for its keys "
                         f"{j * page_size}..{min((j + 1) * page_size, int(lengths[i])) - 1} (length "
                         f"{int(lengths[i])})")
    return np.where(used, table, 0)


def _check_table(c: KVCacheCall, table, where: _Where) -> None:
    """The block table: the entries an entry uses (its first ceil(length / page_size)) must name blocks of
    k_cache; the others are not read. When appending, every position written must be a cache slot no other
    position of the call reads or writes (two writers, or a write under another entry's keys, would make
    the result depend on the order)."""
    import numpy as np

    ps, lengths = c.page_size, where.lengths
    table = where.table = _check_blocks(table, lengths, ps, c.cache_rows, "k_cache", "entry")
    if not c.appends:
        return
    # Every (entry, position) the call touches, as a cache slot block * page_size + row.
    t = np.arange(max(1, int(lengths.max())))
    valid = t[None, :] < lengths[:, None]
    slot = np.take_along_axis(table, np.broadcast_to(t // ps, valid.shape), axis=1) * ps + t % ps
    written = valid & (t[None, :] >= where.cache_seqlens[:, None])
    uniq, counts = np.unique(slot[valid], return_counts=True)
    shared = counts[np.searchsorted(uniq, slot[written])] > 1
    if shared.any():
        bi, ti = (int(x) for x in np.argwhere(written)[np.argmax(shared)])
        s = slot[bi, ti]
        bj, tj = next((int(x), int(y)) for x, y in np.argwhere(valid & (slot == s)) if (x, y) != (bi, ti))
        raise ValueError(f"block_table: expected every slot an entry appends into to be its own; got entry {bi} "
                         f"appending its key {ti} into block {s // ps} row {s % ps}, which entry {bj} also uses for "
                         f"its key {tj}")


def _check_writable(name, a, other) -> None:
    import numpy as np

    if not a.flags.writeable:
        raise ValueError(f"{name}: expected a writable array to append k and v into in place; got a read-only one "
                         "(pass a writable array, or k=None, v=None)")
    too_hard = getattr(np, "exceptions", np).TooHardError
    try:
        overlap = np.shares_memory(a, other, max_work=1 << 20)
    except too_hard:  # an overlap too costly to decide exactly: assume the worst
        overlap = True
    if overlap:
        raise ValueError(f"{name}: expected k_cache and v_cache in separate memory to append into; got caches that "
                         "share memory (appending v would overwrite k)")


def append_numpy(c: KVCacheCall, where: _Where, k_cache, v_cache, k, v) -> None:
    """Writes k and v into the caches (NumPy views of the caller's arrays) at each entry's positions
    [cache_seqlens[b], cache_seqlens[b] + seqlen_new)."""
    import numpy as np

    pos = where.cache_seqlens[:, None] + np.arange(c.seqlen_new)[None, :]  # (batch, seqlen_new)
    if c.paged:
        blocks = np.take_along_axis(where.table, pos // c.page_size, axis=1)
        index = (blocks, pos % c.page_size)
    else:
        index = (where.rows[:, None], pos)
    k_cache[index] = k
    v_cache[index] = v


def gather_numpy(c: KVCacheCall, where: _Where, cache):
    """Each entry's logical keys (or values) as a padded (batch, max_len, nheads_kv, head_dim) array
    (a view of the cache when entry b is row b; positions past an entry's length hold whatever the cache
    holds there, and the forward never reads them)."""
    max_len = max(1, int(where.lengths.max()))
    if c.paged:
        blocks = where.table[:, :-(-max_len // c.page_size)]
        g = cache[blocks]  # (batch, blocks, page_size, nheads_kv, head_dim)
        return g.reshape(c.batch, -1, c.nheads_kv, c.head_dim)[:, :max_len]
    if not c.has_batch_idx:
        return cache[:c.batch, :max_len]
    return cache[where.rows, :max_len]


def forward_numpy(c: KVCacheCall, where: _Where, q, k_cache, v_cache, options: dict):
    """(out, lse): the tiled NumPy forward on the gathered keys with kv_lengths = cache_seqlens + seqlen_new."""
    from ._cpu import attention_forward_numpy
    from ._plan import _cpu_kwargs

    keys, values = gather_numpy(c, where, k_cache), gather_numpy(c, where, v_cache)
    return attention_forward_numpy(q, keys, values, False, c.scale, kv_lengths=where.lengths,
                                   alibi_slopes=options.get("alibi_slopes"), **_cpu_kwargs(c, options))


# --------------------------------------------------------------------------------------------------------------
# The entry point.


@functools.lru_cache(maxsize=None)
def _sm_count(device_id: int) -> int:
    import cupy

    return int(cupy.cuda.runtime.getDeviceProperties(device_id)["multiProcessorCount"])


# Pointer slots of a decode plan's launches.
_D_Q, _D_KC, _D_VC, _D_OUT, _D_LSE, _D_SCRATCH, _D_SEQLENS, _D_BIDX, _D_TABLE, _D_K, _D_V, _D_ALIBI, _D_SINK = range(13)
_D_COUNTERS = 13  # the fused combine's counters: the plan's own buffer, not an array of the call
_D_SEQ = 14       # the call's number (DecodePlan.run; DecodeParams::seq), not a pointer
_D_KVLEN = 15     # ChunkPlan's lengths (DecodeParams::kv_lengths, the append kernel's)
_D_ARRAYS = ("q", "k_cache", "v_cache", "out", "lse", "scratch", "cache_seqlens", "cache_batch_idx", "block_table",
             "k", "v", "alibi_slopes", "sink_logits")
# DecodePlan's spare outputs (_make_spare): the largest (out + lse bytes) kept between calls, and the most
# streams a plan keeps one for.
_SPARE_MAX_BYTES = 8 << 20
_SPARE_STREAMS = 8
# The arrays of a call as DecodePlan.run reads them (a tuple in this order; attention_with_kvcache's
# fast path passes its arguments so, with no dict).
_RUN_ARRAYS = ("q", "k_cache", "v_cache", "k", "v", "cache_seqlens", "cache_batch_idx", "block_table",
               "sink_logits", "alibi_slopes")


class DecodePlan:
    """What one signature of attention_with_kvcache runs on the GPU (cuda_src/flash_decode.cu): the
    append, the decode kernel with its split count, the combine; prepared once, then each call only
    allocates out (lse, scratch), reads pointers and fires. `copy`: the arrays the kernels cannot
    read in place (q, index and option arrays; never the caches, which are written in place)."""

    def __init__(self, c: KVCacheCall, infos: dict, num_splits: int):
        import threading

        from . import _config, _gpu, _launch
        from ._launch import DecodeArgs, DeviceTensor, MaskArgs, Slot
        from ._plan import _small_needs_copy, contiguous_strides, needs_copy

        self.call = c
        self.device_id = dev = c.device[1]
        self.ad = None  # the adapter that runs the plan (set by its maker)
        self.cache_layouts = {n: infos[n] for n in ("k_cache", "v_cache")}
        self.apart = None  # the cache pointers _check_caches_apart last passed
        self._lock = threading.Lock()
        cc = _gpu.compute_capability(dev)
        _check_caches_in_place(infos)
        copy = []
        if needs_copy(infos["q"]):
            copy.append("q")
        for name in ("cache_seqlens", "cache_batch_idx", "block_table", "alibi_slopes", "sink_logits"):
            if infos.get(name) is not None and _small_needs_copy(infos[name]):
                copy.append(name)
        self.copy = tuple(copy)

        def tensor(name, slot):
            x = infos[name]
            strides = contiguous_strides(x.shape) if name in copy else x.strides
            return DeviceTensor(Slot(slot), x.shape, strides)

        b, sq, h, d = c.batch, c.seqlen_q, c.nheads, c.head_dim
        self.out_shape = (b, sq, h, d)
        self.lse_shape = (b, h, sq)
        rows = sq * (h // c.nheads_kv)
        blocks = b * c.nheads_kv * -(-rows // _config.DECODE_ROWS)
        f = c.feats
        keys = c.capacity if f.window_left < 0 else min(c.capacity, f.window_left + sq + max(f.window_right, 0)
                                                         + f.num_sink_tokens)
        self.fused = _config.decode_fused_combine() and d >= 16  # (flash_decode.cu: not at head_dim 8)
        # The cluster merge (sm_90: a row tile's splits, at most DECODE_CLUSTER_MAX, are one cluster),
        # which serves the counts it can in place of the fused combine and the combine kernel.
        self.cluster = cc >= (9, 0) and d >= 16 and _config.decode_cluster() and _launch.launch_ex_available()
        self.tile_rows = min(rows, _config.DECODE_ROWS)
        self.keys = keys  # the most keys one block may see
        self.counter_count = blocks
        self.counters = {}  # stream -> the fused combine's counters (cupy memory, zeroed once)
        self.scratches = {}  # stream -> the eager split calls' partials (cupy memory; _scratch)
        # Eager calls on sm_90 launch as programmatic dependents where the stream is busy: where the
        # decode kernel of this plan's previous call has not begun when the next call is made (its
        # last block writes the call's number into this word of host memory as it starts; run()).
        self.started, started_ptr = None, 0
        if _launch.pdl_available(cc) and _config.decode_eager_pdl():
            self.started, started_ptr = _launch.started_word(dev)
        self.seq = 0
        self.templates = {}  # adapter lib -> its empty_from cache
        forced = num_splits != 0
        target = _config.compile_arch(*cc)
        self.tma = _launch.use_decode_tma(tensor("k_cache", _D_KC), tensor("v_cache", _D_VC), c.dtype, target, c.paged,
                                          f.num_sink_tokens, f.window_left)
        # The bytes between a contiguous cache's consecutive keys (the larger of K's and V's; 16-bit
        # elements, the TMA kernels' only ones): _config.decode_late_issue's span.
        row_bytes = 2 * max(abs(tensor(n, s).strides[1]) for n, s in (("k_cache", _D_KC), ("v_cache", _D_VC)))
        # Two m16 row tiles a warp (_config.decode_two_tiles): a block packs 32 rows, so that 17-32 rows
        # of a kv head (speculative decoding at GQA 4-8) read each K/V tile once, 33-64 twice (not 3-4
        # times). Its blocks merge their splits by the fused combine or the combine kernel (the
        # kernel's cluster merge holds 16 rows). With two row tiles a kv head (33-64 rows) they split
        # as the cp.async kernel's do (two blocks per SM: one_per_sm below), with one as the 16-row TMA
        # kernel's. H200, session 65 (bench_decode.py --seqlen-q 4 / 8, GPU us per step): two row
        # tiles, 16 x 8k x GQA 8 x 8 positions 114 one per SM against 90 two, 16 x 32k 433 against 322;
        # one row tile, 16 x 8k x GQA 4 x 8 positions 125 against 136, 1 x 32k x GQA 8 x 4 positions 27
        # against 30.
        kv_bytes = b * c.nheads_kv * keys * d * 4  # K and V, 2-byte elements
        self.mt = 2 if self.tma and _config.decode_two_tiles(target, d, rows, keys, kv_bytes) else 1
        if self.mt > 1:
            blocks = b * c.nheads_kv * -(-rows // (_config.DECODE_ROWS * self.mt))
            self.tile_rows = min(rows, _config.DECODE_ROWS * self.mt)
            self.counter_count = blocks
            self.cluster = False
        # A paged cache read through TMA splits as a contiguous one does (_config.decode_num_splits);
        # the cp.async kernel's per-tile offset tables give paged calls their own rule.
        paged_copies = c.paged and not self.tma
        # The TMA kernel at the head dims where it was measured: at most one block per SM
        # (_config.decode_num_splits, decode_warps_and_splits: one_per_sm).
        one = self.tma and d in _config.DECODE_ONE_PER_SM_HEAD_DIMS and (self.mt == 1 or rows <= self.tile_rows)
        if not forced:
            # Two blocks per SM for the cp.async kernel: one alone keeps too few bytes in flight to
            # draw the SM's share of the memory bandwidth (measured: 48 % of the copy bandwidth at 1
            # block per SM); the TMA kernel at head_dim 128 keeps one (one_per_sm). An eager
            # call and one captured in a CUDA graph may get different counts (decode_num_splits'
            # host_bound_rule): run() picks by the stream's capture state. With the fused combine a
            # split costs an eager call no extra launch, and GPU time decides there too.
            graph_splits = _config.decode_num_splits(blocks, keys, _sm_count(dev), 2, host_bound_rule=False,
                                                     paged=paged_copies, one_per_sm=one)
            cap = _config.DECODE_CLUSTER_MAX
            if one and graph_splits > cap and self._fusable(graph_splits) and self._clustered(cap):
                # Eager calls: rather than the fused combine over more splits than a cluster holds, a
                # cluster's worth where its splits stay short. H200, session 31 (bench/dev/decode_splits.py,
                # GPU us per step): 1 x 2048 x 4 (8 blocks, 4 rows) 16 fused splits 11.2, 8 in clusters
                # 10.5 (16-row pages 11.6 / 11.0). (Not in place of the combine kernel: 1 x 2048 x 8,
                # 16 splits 10.2-10.3, 8 in clusters 10.7.) A graph keeps its count, which it merges in
                # the combine kernel, a programmatic dependent there: 1 x 2048 x 4 replayed in 9.3 us
                # (session 31's grid) against 10.5 in clusters (session 32's).
                num_splits = cap
            elif self._merged(graph_splits):
                num_splits = graph_splits
            else:
                num_splits = _config.decode_num_splits(blocks, keys, _sm_count(dev), 2, host_bound_rule=True,
                                                       paged=paged_copies, one_per_sm=one)
                fusable_max = max(_config.DECODE_FUSED_MAX_PARTS // self.tile_rows if self.fused else 0,
                                  _config.DECODE_CLUSTER_MAX if self.cluster else 0)
                if num_splits == 1 and fusable_max >= 2:
                    # The count GPU time asks for is past the fused combine's (and the cluster
                    # merge's) limit, and the eager rule would not split at all (a combine kernel's
                    # launch): the best count they serve instead. H200, session 11: batch 1, 1024
                    # keys, GQA 8 ran unsplit at 21.4 us, where 8 splits of 512 keys took 9.7.
                    num_splits = _config.decode_num_splits(blocks, keys, _sm_count(dev), 2, host_bound_rule=False,
                                                           paged=paged_copies, max_splits=fusable_max,
                                                           one_per_sm=one)
            if one and _config.decode_resident_unsplit(target, d, blocks, _sm_count(dev),
                                                       _gpu.peak_memory_bandwidth(dev)):
                num_splits = graph_splits = 1
            elif one:
                # Long caches on 2-8 blocks per SM: split into 2-stage blocks (_config.decode_long_splits),
                # where the plan can merge the splits without a second kernel. A graph captured on a stream
                # that has no fused-combine counters yet (torch.cuda.graph's own) merges them in the
                # combine kernel (run()): its replays read 0.976-1.011 of the faster peer's at the six
                # points of bench_decode's grid this rule splits (H200, session 55).
                long = _config.decode_long_splits(target, d, blocks, keys, _sm_count(dev),
                                                  _gpu.peak_memory_bandwidth(dev))
                if long > 1 and self._merged(long):
                    num_splits = graph_splits = long
        else:
            graph_splits = num_splits
        # Paged 16-key groups through TMA on few blocks: two blocks per SM on 2 stages
        # (_config.decode_paged_fill_splits) for graphs, and for eager calls where the split merges
        # without a second kernel or the step is long enough to hide its launch. With two m16 tiles a
        # warp, on up to one block per SM: two splits (decode_paged_two_tile_splits).
        fill = None
        if (not forced and one and c.paged and not _config.decode_warps_forced()
                and not _config.decode_page_tiles(c.page_size, _config.DECODE_BLOCK_N)):
            fill = _config.decode_paged_fill_splits(target, d, blocks, keys, _sm_count(dev),
                                                    _gpu.peak_memory_bandwidth(dev))
            if fill is not None:
                graph_splits = fill
                if self._merged(fill) or kv_bytes >= _config.DECODE_PAGED_FILL_EAGER_BYTES:
                    num_splits = fill
            elif self.mt > 1 and num_splits == graph_splits:
                # Two m16 tiles a warp in 16-key groups, one block per SM: two splits
                # (_config.decode_paged_two_tile_splits).
                num_splits = graph_splits = _config.decode_paged_two_tile_splits(blocks, num_splits, keys,
                                                                                 _sm_count(dev))
        # Several kv heads a block (_config.decode_heads_rule): where its one-wave grid of 8-warp blocks serves
        # the call, the plan is unsplit (variant() then takes 8 warps, launches() the heads).
        plain = (sq == 1 and f.window_left < 0 and f.num_sink_tokens == 0 and not f.softcap and not f.has_alibi
                 and not f.has_sink_logits)
        heads_wide = (not forced and self.tma and self.mt == 1 and not _config.decode_warps_forced()
                      and _config.decode_heads_wide(target, d, blocks, 1, keys, _sm_count(dev), c.paged, self.mt,
                                                    rows, c.nheads_kv, plain, _gpu.peak_memory_bandwidth(dev)))
        if heads_wide:
            num_splits = graph_splits = 1
        table = infos.get("block_table")
        table_stride = 0
        if table is not None:
            table_stride = table.shape[1] if "block_table" in copy else table.strides[0]
        alibi = infos.get("alibi_slopes")
        alibi_bs = 0
        if alibi is not None and len(alibi.shape) == 2:
            alibi_bs = alibi.shape[1] if "alibi_slopes" in copy else alibi.strides[0]
        mask = MaskArgs(alibi_slopes=Slot(_D_ALIBI) if alibi is not None else 0, alibi_batch_stride=alibi_bs,
                        sink_logits=Slot(_D_SINK) if infos.get("sink_logits") is not None else 0,
                        window_left=f.window_left, window_right=f.window_right, num_sink_tokens=f.num_sink_tokens,
                        softcap=f.softcap)
        args0 = DecodeArgs(lse=Slot(_D_LSE), scratch=Slot(_D_SCRATCH),
                          cache_seqlens=Slot(_D_SEQLENS) if c.fixed_seqlen is None else 0,
                          cache_batch_idx=Slot(_D_BIDX) if c.has_batch_idx else 0,
                          block_table=Slot(_D_TABLE) if c.paged else 0, table_stride=table_stride,
                          k_new=tensor("k", _D_K) if c.appends else None,
                          v_new=tensor("v", _D_V) if c.appends else None,
                          cache_rows=c.cache_rows, capacity=c.capacity, page_size=c.page_size,
                          fixed_seqlen=c.fixed_seqlen or 0, num_splits=num_splits,
                          started=started_ptr, seq=Slot(_D_SEQ) if started_ptr else 0)
        used = {"q", "k_cache", "v_cache", "out"}
        used.update(n for n, on in (("lse", c.return_lse), ("scratch", max(num_splits, graph_splits) > 1),
                                    ("cache_seqlens", c.fixed_seqlen is None), ("cache_batch_idx", c.has_batch_idx),
                                    ("block_table", c.paged), ("k", c.appends), ("v", c.appends),
                                    ("alibi_slopes", alibi is not None),
                                    ("sink_logits", infos.get("sink_logits") is not None)) if on)
        self.used = frozenset(used)
        self.zero_ptrs = [0] * (len(_D_ARRAYS) + 2)  # + the counters' and the call number's slots
        # run()'s reads: (Params slot, position in _RUN_ARRAYS) of each array the kernels read, and
        # the positions of the arrays it copies first.
        self.input_positions = tuple((i, _RUN_ARRAYS.index(n)) for i, n in enumerate(_D_ARRAYS)
                                     if n in used and n not in ("out", "lse", "scratch"))
        self.copy_positions = tuple(_RUN_ARRAYS.index(n) for n in copy)
        self.appends, self.return_lse = c.appends, c.return_lse
        self.allocs = {}  # adapter lib -> (out, lse) allocators (_allocators)
        # (lib, stream) -> the next eager call's (out, lse), allocated after a launch (_make_spare);
        # only for outputs of at most _SPARE_MAX_BYTES, and not with CUFLASH_DECODE_SPARE=0.
        self.spares = {}
        out_bytes = 2 * math.prod(self.out_shape) + (4 * math.prod(self.lse_shape) if c.return_lse else 0)
        self.spare_ok = out_bytes <= _SPARE_MAX_BYTES and _config.decode_spare_outputs()

        wide_ok = _config.decode_wide_stages(target, d) is not None
        cluster_keys = _config.decode_cluster_split_keys(target, d, _sm_count(dev), _gpu.peak_memory_bandwidth(dev))
        forced_warps = _config.decode_warps_forced()

        def warps_and_splits(splits, wide=False):
            """The decode kernel's warps and split count for the 4-warp kernel's split count: 8 warps
            where that kernel is built and the grid leaves each SM one block
            (_config.decode_warps_and_splits; with `wide`, wherever blocks x splits fit the SMs), or as
            CUFLASH_DECODE_WARPS forces."""
            if not wide_ok or splits == fill or self.mt > 1:  # (the paged fill's count, two m-tiles: 4 warps)
                return 4, splits
            if forced_warps:
                return forced_warps, splits
            if wide and blocks * splits <= _sm_count(dev):
                return 8, splits
            warps, splits = _config.decode_warps_and_splits(blocks, splits, _sm_count(dev), forced, paged_copies,
                                                            keys, one_per_sm=one,
                                                            cluster=_config.DECODE_CLUSTER_MAX if self.cluster else 0,
                                                            cluster_keys=cluster_keys)
            if (warps == 4 and one and c.paged and not forced
                    and not _config.decode_page_tiles(c.page_size, _config.DECODE_BLOCK_N)
                    and _config.decode_paged_groups_wide(blocks, splits, keys, _sm_count(dev))):
                warps = 8  # 16-key groups of a paged cache (TMA): the 8-warp kernel at the same count
            if (warps == 4 and splits == 1 and one and not forced
                    and _config.decode_mid_wide(target, d, blocks, keys, _sm_count(dev), c.paged,
                                                _gpu.peak_memory_bandwidth(dev))):
                warps = 8  # 6-12 blocks per SM unsplit, contiguous (_config.decode_mid_wide)
            return warps, splits

        def variant(splits, fused_max_parts, wide=False):
            """(num_splits, scratch floats, launches, launches with the fused combine or None) of the
            4-warp kernel's split count `splits` (the 8-warp kernel's own count where it runs); the
            fused combine where rows x splits <= fused_max_parts. wide: warps_and_splits'."""
            out_t = DeviceTensor(Slot(_D_OUT), self.out_shape, contiguous_strides(self.out_shape))
            warps, splits = warps_and_splits(splits, wide)
            if heads_wide and warps == 4 and splits == 1:
                warps = 8  # several kv heads a block on the 8-warp kernel (_config.decode_heads_rule; launches())
            clustered = self._clustered(splits)

            def depth(warps):
                """The 4-warp TMA kernel's depth where a rule picks one (None: decode_stages')."""
                if self.tma and warps == 4 and not forced_warps:
                    bw = _gpu.peak_memory_bandwidth(dev)
                    if _config.decode_deep_tma(target, d, blocks * splits, -(-keys // splits), _sm_count(dev),
                                               c.paged, bw):
                        return 4
                    if _config.decode_shallow_tma(target, d, blocks * splits, _sm_count(dev), bw, -(-keys // splits)):
                        return 2
                return None

            def launches(counters, cluster=False, n_splits=None, tail_first=0):
                """The launches at `splits` (or n_splits: the split tail's count, tail_first its first block)."""
                n = splits if n_splits is None else n_splits
                depth_ = _launch.decode_depth(target, d, warps, stages)
                per_block = -(-keys // n)
                # Several kv heads a block (_config.decode_heads): the grid has 1 / heads of the blocks. The rule's
                # case (8 warps) is one query position and no mask or score modification (plain, above);
                # CUFLASH_DECODE_HEADS forces it on the plan's own warps at any split count, merged as the
                # one-head plan's are (a block's row tile is all its heads' rows, so the fused combine needs
                # fewer of the plan's counters), but not with the split tail.
                heads = 1
                if self.tma and not tail_first:
                    heads = _config.decode_heads(target, d, blocks, n, per_block, _sm_count(dev), c.paged, warps,
                                                 depth_, self.mt, rows, c.nheads_kv, plain,
                                                 _gpu.peak_memory_bandwidth(dev))
                grid = (tail_first + (blocks - tail_first) * n) // heads
                late = self.tma and _config.decode_late_issue(target, d, grid, per_block, _sm_count(dev), c.paged,
                                                              warps, depth_, _gpu.peak_memory_bandwidth(dev), self.mt,
                                                              per_block * row_bytes)
                args = dataclasses.replace(args0, num_splits=n, split_counters=counters, cluster=cluster,
                                           tail_first=tail_first, late_issue=late, heads=heads)
                return _launch.decode_launches(tensor("q", _D_Q), tensor("k_cache", _D_KC), tensor("v_cache", _D_VC),
                                               out_t, args, c.dtype, c.scale, mask, dev, cc, warps, self.tma, stages,
                                               self.mt)
            stages = depth(warps)
            main = launches(0, True) if clustered else None
            if clustered and not _launch.cluster_fits(main[-1]):  # (the decode launch: no combine follows)
                clustered, main = False, None
                if (warps == 8 and not forced_warps and not self._fusable(splits, fused_max_parts)
                        and _config.decode_narrow_clusters()):
                    # The 8-warp blocks' clusters do not all fit (one block per SM: 15 clusters of 8 on
                    # an H200), and the splits would merge in a combine kernel: the 4-warp kernel's
                    # clusters instead (two blocks per SM), one launch (_config.decode_narrow_clusters).
                    warps = 4
                    stages = depth(warps)
                    main = launches(0, True)
                    clustered = _launch.cluster_fits(main[-1])
                    if not clustered:
                        warps, main = 8, None
                        stages = depth(warps)
            if main is None:
                main = launches(0)
            # The split tail (_config.decode_split_tail): an unsplit 4-warp TMA plan of many blocks per SM
            # reads its last row tiles in splits, merged by the fused combine, where it has counters (run());
            # main, without, stays unsplit.
            tail = None
            if splits == 1 and warps == 4 and self.tma and self.fused and not clustered and self.mt == 1:
                tail = _config.decode_split_tail(target, d, blocks, -(-keys // splits), _sm_count(dev), c.paged,
                                                 _gpu.peak_memory_bandwidth(dev))
            if tail is not None:
                fused = launches(Slot(_D_COUNTERS), n_splits=tail[1], tail_first=blocks - tail[0])
                return splits, _launch.decode_scratch_floats(b, h, sq, d, tail[1]), main, fused
            fusable = not clustered and self._fusable(splits, fused_max_parts)
            fused = launches(Slot(_D_COUNTERS)) if fusable else None
            return splits, _launch.decode_scratch_floats(b, h, sq, d, splits, clustered), main, fused

        # A CUDA graph fuses fewer parts than an eager call (_config.DECODE_GRAPH_FUSED_MAX_PARTS).
        graph_max = _config.DECODE_GRAPH_FUSED_MAX_PARTS
        self.eager = variant(num_splits, _config.DECODE_FUSED_MAX_PARTS)
        same = graph_splits == num_splits and self._fusable(num_splits) == self._fusable(num_splits, graph_max)
        self.graph = self.eager if same else variant(graph_splits, graph_max)
        self.pdl = any(L.pdl is not None for L in self.graph[2][1:])  # (_launch.as_pdl: calls of 2-3 kernels)
        self.num_splits, self.scratch_floats, self.launches = self.eager[:3]  # the eager variant's
        # Eager calls on an idle stream (the previous call's decode kernel has begun, or there was none:
        # a single call, or a loop whose host is the slower side), where the eager variant merges its
        # splits in a combine kernel: the most splits, at most DECODE_CLUSTER_MAX, that merge in the
        # decode kernel itself (clusters, or the fused combine), each seeing at most
        # _config.DECODE_IDLE_SPLIT_KEYS keys, on 8 warps where the grid fits the SMs. There the host's
        # part of a call is the longer one, and the combine's launch costs it more than the fewer
        # splits cost the GPU; back to back (a busy stream) the eager variant's GPU time decides. Only
        # where the plan can tell (`started`: eager PDL on sm_90), for contiguous caches (measured
        # there). run() picks.
        self.idle = self.eager
        if (not forced and one and not c.paged and self.started is not None and num_splits > 1
                and self.eager[3] is None and not self._merged(num_splits) and _config.decode_idle_variant()):
            for s in range(min(_config.DECODE_CLUSTER_MAX, num_splits - 1), 1, -1):
                if self._merged(s) and -(-keys // s) <= _config.DECODE_IDLE_SPLIT_KEYS:
                    v = variant(s, _config.DECODE_FUSED_MAX_PARTS, wide=True)
                    if v[3] is not None or any(L.cluster > 1 for L in v[2]):  # (its clusters fit the GPU)
                        self.idle = v
                    break
        # The eager split calls' scratch for a stream (_scratch) serves both eager variants.
        self.scratch_bytes = 4 * max(self.eager[1], self.idle[1])

    def _clustered(self, splits: int) -> bool:
        """Whether the cluster merge serves `splits` (sm_90, 2 to DECODE_CLUSTER_MAX splits, each seeing
        at most DECODE_CLUSTER_KEYS keys; variant() then checks that the grid's clusters all fit)."""
        from . import _config

        return (self.cluster and 1 < splits <= _config.DECODE_CLUSTER_MAX
                and -(-self.keys // splits) <= _config.DECODE_CLUSTER_KEYS)

    def _merged(self, splits: int, max_parts: int | None = None) -> bool:
        """Whether `splits` are merged without a second kernel (the cluster merge or the fused combine)."""
        return self._clustered(splits) or self._fusable(splits, max_parts)

    def _fusable(self, splits: int, max_parts: int | None = None) -> bool:
        """Whether the fused combine serves `splits` (rows x splits <= max_parts, by default
        _config.DECODE_FUSED_MAX_PARTS): one block merges a row tile's splits alone, so only where
        they are few."""
        from . import _config

        limit = _config.DECODE_FUSED_MAX_PARTS if max_parts is None else max_parts
        return self.fused and splits > 1 and self.tile_rows * splits <= limit

    def run_call(self, names: dict):
        """One call: the checks that depend on the arrays' values or identity (a torch cache that
        requires grad, caches that share memory), the run, and the return value of the call."""
        c, ad = self.call, self.ad
        if c.appends:
            _check_append(self, names, ad)
        out, lse = self.run(ad, tuple(names.get(n) for n in _RUN_ARRAYS))
        if c.appends and c.lib == "torch":
            _mark_written(names)
        return (out, lse) if c.return_lse else out

    def run_fast(self, arrays: tuple):
        """run_call for a call whose signature was seen (attention_with_kvcache's fast path): the
        arrays in _RUN_ARRAYS order. A call that appends takes run_call, for its checks."""
        if self.appends:
            return self.run_call(dict(zip(_RUN_ARRAYS, arrays)))
        out, lse = self.run(self.ad, arrays)
        return (out, lse) if self.return_lse else out

    def _what(self, splits: int) -> str:
        c = self.call
        return (f"attention_with_kvcache {c.dtype} q {self.out_shape}, cache capacity {c.capacity}, "
                f"paged={c.paged}, num_splits {splits}")

    def _allocators(self, ad):
        """(out, lse or None) allocators of this plan for adapter `ad`: functions of no argument
        (Adapter.allocator), made at its first call."""
        c, tmpl = self.call, self.templates.setdefault(ad.lib, {})
        allocs = self.allocs[ad.lib] = (
            ad.allocator(tmpl, self.out_shape, c.dtype, self.device_id),
            ad.allocator(tmpl, self.lse_shape, "float32", self.device_id) if c.return_lse else None)
        return allocs

    def run(self, ad, arrays: tuple):
        """(out, lse or None) as the caller's arrays; appends first when the call has k and v.
        arrays: the call's arrays in _RUN_ARRAYS order (None where absent)."""
        dev = self.device_id
        keep = []
        ptr = ad.ptr_fn  # a pointer read that needs no `keep` (None: the adapter's ptr with it)
        if ptr is None:
            def ptr(x):
                return ad.ptr(x, keep)
        if self.copy:
            arrays = list(arrays)
            for i in self.copy_positions:
                arrays[i] = ad.contiguous(arrays[i], dev, keep)
        stream = ad.stream(dev)
        # The outputs: the spare that the previous eager call on this stream allocated after its launch
        # (below), or allocated now. A spare made eagerly never goes into a graph: where one is taken,
        # the stream's capture state is asked first (and then known below).
        capturing = None
        spare = self.spares.pop((ad.lib, stream), None) if self.spare_ok else None
        if spare is not None:
            capturing = stream_capturing(stream)
            if capturing:
                spare = None
        if spare is None:
            allocs = self.allocs.get(ad.lib) or self._allocators(ad)
            out = allocs[0]()
            lse = allocs[1]() if allocs[1] is not None else None
        else:
            out, lse = spare
        ptrs = self.zero_ptrs.copy()
        ptrs[_D_OUT] = ptr(out)
        if lse is not None:
            ptrs[_D_LSE] = ptr(lse)
        variant = self.eager
        # Programmatic dependent launch (_launch.PdlConfig). In a CUDA graph, between the call's own
        # kernels (append -> decode -> combine): each starts while the one before it finishes (H100,
        # session 15: a replay 0.3-1.8 us faster where a call has two or three kernels). Eager calls:
        # every kernel where the stream is busy, none where it may be idle. Back to back, PDL ran
        # 1.1-2.2 us a call faster, but a single call on an idle GPU 3.0-5.3 us slower (H200, session
        # 32; cudaStreamQuery as the test cost more than it saved, session 15). The test here costs
        # no CUDA call: the stream counts as busy while the previous call's decode kernel has not
        # begun (its number is not yet in `started`), which holds where the host runs ahead of the GPU.
        started = self.started
        busy = started is not None and started.value != self.seq
        # An idle stream's eager call takes the plan's idle variant (one launch; __init__), where it
        # has one.
        idle = not busy and self.idle is not variant
        # Whether the stream captures a graph, asked only where the answer changes a launch (PDL, the
        # graph's or the idle variant) or a spare was taken; the scratch below asks for itself otherwise.
        asked = capturing is not None or self.pdl or busy or idle or self.graph is not variant
        if capturing is None:
            capturing = asked and stream_capturing(stream)
        if capturing:
            variant = self.graph
        elif idle:
            variant = self.idle
        splits, scratch_floats, launches, fused = variant
        pdl = self.pdl and capturing or busy and not capturing
        if started is not None and not capturing:
            self.seq += 1  # (a captured call writes nothing: seq 0)
            ptrs[_D_SEQ] = self.seq
        if fused is not None:
            counters = self._counters(stream)
            if counters:  # (none yet while a capture is running: the combine kernel then)
                launches = fused
                ptrs[_D_COUNTERS] = counters
        if scratch_floats:
            # The partials of a split without a cluster merge. An eager call takes the plan's scratch for
            # its stream (_scratch), no allocation: H200, session 51 (bench/dev/eager_splits.py --alloc,
            # one process), a torch allocation a call made single eager calls 4.6-13 us longer at 1 x 8k x 1,
            # 1 x 32k x 4 / 8 and paged 16 x 2k x 8. A graph capture allocates its own, which the graph's
            # memory pool keeps for its replays.
            if capturing if asked else stream_capturing(stream):
                scratch = ad.empty_from(self.templates.setdefault(ad.lib, {}), (scratch_floats,), "float32", dev)
                ptrs[_D_SCRATCH] = ptr(scratch)
            else:
                ptrs[_D_SCRATCH] = self._scratch(stream, 4 * scratch_floats)
        for slot, i in self.input_positions:
            ptrs[slot] = ptr(arrays[i])
        run_launches(self, stream, ptrs, launches, functools.partial(self._what, splits), pdl, not capturing)
        if self.spare_ok and not (capturing if asked else stream_capturing(stream)):
            self._make_spare(ad, stream)
        if lse is None:
            return ad.export(out), None
        return ad.export(out), ad.export(lse)

    def _make_spare(self, ad, stream: int) -> None:
        """The next eager call's outputs on this stream, allocated now, while this call's kernels run:
        off the next call's path to its launch. H200, session 63 (bench/dev/eager_parts.py, 300 single
        calls): the output's torch allocation took 3.9-5.5 us (median) of a single call's host time
        before its launch, 2 us back to back; with the spare, single eager calls against the faster
        peer's at 27 shapes (batch 1-16, 2k-32k keys, GQA 1-8; 200 calls each) went from geomean 1.005,
        worst 1.098 (4 x 8k x 8) to 0.980, worst 1.101 (1 x 2k x 8, two launches a call then: session
        64's idle variant runs one there; 4 x 8k x 8 1.031). The memory is the stream's, as an
        allocation at the next call's start would be (stream-ordered); a call on another stream, or in
        a graph capture, allocates its own. At most _SPARE_STREAMS streams' spares are kept."""
        allocs = self.allocs.get(ad.lib) or self._allocators(ad)
        spares = self.spares
        if len(spares) >= _SPARE_STREAMS:
            spares.clear()
        spares[(ad.lib, stream)] = (allocs[0](), allocs[1]() if allocs[1] is not None else None)

    def _scratch(self, stream: int, nbytes: int) -> int:
        """The address of this plan's scratch for eager split calls on this stream (o_part, lse_part of
        nbytes, at least the larger of the two eager variants' (eager, idle); made at its first use,
        kept with the plan). A call's kernels write
        the partials and read them back before the stream's next call of this plan begins: the plan's
        lock keeps a call's launches together, and a programmatic dependent waits for the grid before
        it ahead of its first write. Not shared between plans: another plan's call, from another
        thread on the same stream, may land between a decode kernel and its combine kernel."""
        mem = self.scratches.get(stream)
        if mem is None:
            import cupy

            with self._lock:  # (two threads' first calls on one stream: one allocation, kept)
                mem = self.scratches.get(stream)
                if mem is None:
                    with cupy.cuda.Device(self.device_id):  # (sized for both eager variants)
                        mem = self.scratches[stream] = cupy.cuda.memory.alloc(max(nbytes, self.scratch_bytes))
        return mem.ptr

    def _counters(self, stream: int) -> int:
        """The fused combine's counters for this stream (one int per row tile, zero between calls:
        the last block of a tile sets its counter back), made and cleared on the stream at its first
        use; 0 while the stream is capturing a graph and has none yet (no allocation then). Per
        stream, so that calls on two streams at once never share one."""
        mem = self.counters.get(stream)
        if mem is None:
            if stream_capturing(stream):
                return 0
            import cupy

            nbytes = 4 * self.counter_count
            with cupy.cuda.Device(self.device_id):
                mem = cupy.cuda.memory.alloc(nbytes)
                cupy.cuda.runtime.memsetAsync(mem.ptr, 0, nbytes, stream)
            self.counters[stream] = mem
        return mem.ptr


_DECODE_PLANS: dict = {}
_CHUNK_PLANS: dict = {}  # ChunkPlan by the same key


def _gpu_decode_available(c: KVCacheCall) -> bool:
    from . import _config
    from ._gpu import compute_capability

    return _config.decode_stages(_config.compile_arch(*compute_capability(c.device[1])), c.head_dim) is not None


def _gpu_kvcache(c: KVCacheCall, ad, infos: dict, names: dict, num_splits: int, fast_key=None, options=None):
    """The GPU path: the decode kernels for every layout (a DecodePlan); a chunk of more than 64 packed
    rows a kv head that _config.kvcache_feature_forward gives the feature forward takes a ChunkPlan
    instead: a contiguous cache whose row b is entry b; a paged one that the forward reads in place
    (ChunkPlan.direct) by the same rule, or, gathered, by the rule's paged clause where the padded copy
    fits _config.KVCACHE_GATHER_MAX_BYTES. options: the call's scalar options for the forward (ChunkPlan)."""
    from . import _config

    rows = c.seqlen_q * (c.nheads // c.nheads_kv)
    plain_rows = not c.paged and not c.has_batch_idx
    available = _gpu_decode_available(c)
    sm = _sm_count(c.device[1])
    chunk = plain_rows and (not available or _config.kvcache_feature_forward(c.seqlen_q, rows, c.batch, c.nheads, sm))
    plan_key = (c, tuple(infos.get(n) for n in _D_ARRAYS), num_splits)
    if c.paged and available and _config.kvcache_feature_forward(c.seqlen_q, rows, c.batch, c.nheads, sm):
        # A paged chunk: the contiguous cache's rule where the forward reads the pages in place (a
        # ChunkPlan with `direct`); after the gather only with paged=True's rows and where the copy fits.
        # Where the gather would not be taken, boxes smaller than _config.PAGED_DIRECT_MIN_BOX are too
        # (and 16-row boxes copied as whole rows below _config.PAGED_WHOLE_ROWS_GATHER rows: fwd_launches).
        gather = (_config.kvcache_feature_forward(c.seqlen_q, rows, c.batch, c.nheads, sm, paged=True)
                  and 4 * c.batch * c.capacity * c.nheads_kv * c.head_dim <= _config.KVCACHE_GATHER_MAX_BYTES)
        plan = _CHUNK_PLANS.get(plan_key)
        if plan is None:
            plan = ChunkPlan(c, infos, options, small_ok=not gather)
            plan.ad = ad
            if len(_CHUNK_PLANS) > 1024:
                _CHUNK_PLANS.clear()
            _CHUNK_PLANS[plan_key] = plan
        chunk = plan.direct or gather
    if not available and not chunk:
        _refuse_gpu(infos["q"], f"attention_with_kvcache at head_dim {c.head_dim} on this GPU (too little shared "
                                "memory for the decode kernel) with " + ("block_table" if c.paged else
                                                                         "cache_batch_idx"),
                    "or a contiguous cache whose row b is entry b (cache_batch_idx=None, block_table=None)")
    plans = _CHUNK_PLANS if chunk else _DECODE_PLANS
    plan = plans.get(plan_key)
    if plan is None:
        plan = ChunkPlan(c, infos, options) if chunk else DecodePlan(c, infos, num_splits)
        plan.ad = ad
        if len(plans) > 1024:
            plans.clear()
        plans[plan_key] = plan
    out = plan.run_call(names)
    if fast_key is not None:  # the call went through: its signature may skip the checks from now on
        if len(_FAST_PLANS) > 1024:
            _FAST_PLANS.clear()
        _FAST_PLANS[fast_key] = plan
    return out


_FAST_PLANS: dict = {}


def _fast_key(sig, wkey, q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, causal,
              softmax_scale, return_lse, window, num_sink_tokens, sink_logits, alibi_slopes, softcap,
              num_splits) -> tuple:
    """The signature of a call: equal for two calls only when validation and planning give the same
    result (the arrays' signatures from q's adapter, `sig`, every scalar with its type; the window
    by `wkey`). Raises (so that the call takes the full path) for anything it cannot key, e.g. arrays
    of another type than q's. An adapter may supply its own function of the same facts
    (Adapter.kvcache_key)."""
    t = q.__class__
    # Optional arrays: None, or q's type (anything else raises: the full path names the argument).
    opt = []
    for x in (k, v, cache_batch_idx, block_table, sink_logits, alibi_slopes):
        if x is None:
            opt.append(None)
        elif x.__class__ is t:
            opt.append(sig(x))
        else:
            raise TypeError("mixed array types")
    if cache_seqlens is None or cache_seqlens.__class__ is int:
        seqlens = (cache_seqlens.__class__, cache_seqlens)
    elif cache_seqlens.__class__ is t:
        seqlens = sig(cache_seqlens)
    else:
        raise TypeError("mixed array types")
    if k_cache.__class__ is not t or v_cache.__class__ is not t:
        raise TypeError("mixed array types")
    return (t, sig(q), sig(k_cache), sig(v_cache), seqlens, *opt, causal.__class__, causal, softmax_scale.__class__,
            softmax_scale, return_lse.__class__, return_lse, wkey(window), num_sink_tokens.__class__,
            num_sink_tokens, softcap.__class__, softcap, num_splits.__class__, num_splits)


_KEYERS: dict = {}  # array type -> the key function of its calls (_keyer)


def _keyer(q):
    """The key function of calls whose q has q's type (made once per type): its adapter's
    kvcache_key, else _fast_key with its adapter's sig. Raises TypeError for a type no adapter
    takes (the full path then names the argument)."""
    from ._adapters import adapter_for
    from ._adapters._base import window_key

    ad = adapter_for(q)
    fn = ad.kvcache_key or functools.partial(_fast_key, ad.sig, window_key)
    _KEYERS[q.__class__] = fn
    return fn


def _check_caches_in_place(infos: dict) -> None:
    """A cache is read and written in place, never copied: the kernels must be able to read it (a
    ValueError naming it otherwise, before anything runs)."""
    from ._plan import needs_copy

    for name in ("k_cache", "v_cache"):
        x = infos[name]
        if needs_copy(x):
            raise ValueError(f"{name}: expected a cache the GPU kernels can read in place: a unit-stride last "
                             f"dimension and a 16-byte aligned base pointer and strides (multiples of 8 elements); "
                             f"got strides {x.strides}{'' if x.aligned else ' at an unaligned pointer'} (a cache is "
                             "read and written in place, never copied)")


def _check_append(plan, names: dict, ad) -> None:
    """The checks of a call that appends (DecodePlan, ChunkPlan) that depend on its arrays' values or
    identity: a torch cache that requires grad cannot be written in place; the caches must not share
    memory (_check_caches_apart)."""
    if plan.call.lib == "torch":
        for name in ("k_cache", "v_cache"):
            if names[name].requires_grad:
                raise ValueError(f"{name}: expected a tensor that does not require grad, to write in place; got one "
                                 f"that requires grad (pass {name}.detach(), which shares the storage)")
    _check_caches_apart(plan, names, ad)


def _mark_written(names: dict) -> None:
    """torch caches written by a kernel, behind autograd's back: their version counters bumped."""
    import torch

    for name in ("k_cache", "v_cache"):
        torch.autograd.graph.increment_version(names[name])


def _check_caches_apart(plan, names: dict, ad) -> None:
    """Appending needs k_cache and v_cache in separate memory (else writing v overwrites k): their
    byte extents (plan.cache_layouts at the caches' pointers) must not overlap. The pointers a check
    passed are kept on the plan (plan.apart): a call with the same ones (a serving loop's caches)
    skips the sums."""
    ptrs = (ad.ptr(names["k_cache"], []), ad.ptr(names["v_cache"], []))
    if ptrs == plan.apart:
        return
    spans = []
    for name, base in zip(("k_cache", "v_cache"), ptrs):
        x = plan.cache_layouts[name]
        lo = base + 2 * sum(min(0, (n - 1) * st) for n, st in zip(x.shape, x.strides))
        hi = base + 2 * sum(max(0, (n - 1) * st) for n, st in zip(x.shape, x.strides)) + 2
        spans.append((lo, hi))
    (a0, a1), (b0, b1) = spans
    if a0 < b1 and b0 < a1:
        raise ValueError("k_cache: expected k_cache and v_cache in separate memory to append into; got caches that "
                         "share memory (appending v would overwrite k)")
    plan.apart = ptrs


def attention_with_kvcache(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, *, cache_batch_idx=None,
                           block_table=None, causal: bool = False, softmax_scale: float | None = None,
                           return_lse: bool = False, window=None, num_sink_tokens: int = 0, sink_logits=None,
                           alibi_slopes=None, softcap: float | None = None, num_splits: int = 0):
    """Attention of new queries against a KV cache, appending the new keys and values to the cache
    in place first (flash-attn's ``flash_attn_with_kvcache``): one decoding step (seqlen_q = 1),
    speculative decoding or chunked prefill (seqlen_q > 1). Inference only: there is no backward,
    and torch outputs carry no autograd history.

    Args:
        q: (batch, seqlen_q, nheads, head_dim), float16 or bfloat16; head_dim a multiple of 8 from
            8 to 256; nheads a multiple of nheads_kv (query head h uses kv head
            h // (nheads // nheads_kv)).
        k_cache, v_cache: q's dtype and library, one of two layouts:
            contiguous (batch_cache, seqlen_cache, nheads_kv, head_dim): entry b's key t is
                k_cache[cache_batch_idx[b], t] (k_cache[b, t] without cache_batch_idx; then
                batch_cache >= batch, and rows past batch are neither read nor written);
            paged (num_blocks, page_size, nheads_kv, head_dim), with block_table: entry b's key t
                is k_cache[block_table[b, t // page_size], t % page_size]; page_size any multiple
                of 16. Blocks may be shared between entries for reading (a common prefix).
            Any strides. Written in place when k and v are given.
        k, v: (batch, seqlen_new, nheads_kv, head_dim), q's dtype, or None (both or neither): the
            new tokens, written into the caches at entry b's positions
            [cache_seqlens[b], cache_seqlens[b] + seqlen_new) before the attention, which then
            sees them. Not for JAX arrays, which cannot be written in place (TypeError): write
            them with ``.at[].set`` and pass cache_seqlens counting them.
        cache_seqlens: how many keys each entry's cache holds before the append: an int32
            (batch,) array of q's library, an int (the same for every entry), or None (the whole
            seqlen_cache of a contiguous cache; not allowed with block_table or with k, v).
            cache_seqlens[b] + seqlen_new must fit in the capacity: seqlen_cache, or
            max_blocks_per_seq * page_size when paged.
        cache_batch_idx: int32 (batch,) cache rows of a contiguous cache, or None (entry b uses
            row b). When k and v are appended the rows must differ; without k and v they may
            repeat. Not allowed with block_table.
        block_table: int32 (batch, max_blocks_per_seq), or None for a contiguous cache. Only the
            blocks an entry uses are read (its first ceil((cache_seqlens[b] + seqlen_new) /
            page_size) entries: they must be in [0, num_blocks)); the rest may hold anything.
            When appending, no position written may be a slot that another key of the call
            also uses.
        causal, softmax_scale, return_lse, window, num_sink_tokens, sink_logits, alibi_slopes,
            softcap: as for `cuflash.attention` with kv_lengths = cache_seqlens + seqlen_new (see
            cuflash/_features.py): entry b sees keys [0, L_b), L_b = cache_seqlens[b] +
            seqlen_new, and the masks align to the bottom-right corner of those valid keys:
            query row i stands at key position i' = i + L_b - seqlen_q, and causal lets it see
            keys j <= i'. For seqlen_q = 2, cache_seqlens = 3, seqlen_new = 2 (keys 0..2 were
            cached, 3..4 are the new ones; 1 = kept)::

                1 1 1 1 0
                1 1 1 1 1

            A row that sees no key (L_b = 0, or causal with L_b < seqlen_q) gets out = 0 and
            lse = -inf (lse = the sink logit with sink_logits).

    Returns:
        out: q's shape and dtype, the caller's kind of array; and with return_lse lse
        (batch, nheads, seqlen_q) float32, the natural-log logsumexp of each row.

    Raises:
        TypeError / ValueError naming the argument, what it got and what was expected, before
            anything is written: wrong types, dtypes (the index arrays are int32), shapes,
            libraries or devices; k without v; a page_size that is not a multiple of 16;
            cache_seqlens < 0 or past the capacity; cache_batch_idx or used block_table entries
            out of range; two entries appending into one cache row or slot; a read-only cache
            (or k_cache and v_cache sharing memory, or a torch cache that requires grad) when
            appending. The CPU path reads the index arrays' values to check them.
        NotImplementedError for JAX tracers (jax.jit).

    On the GPU the lengths and indices are never read back: values out of range are clamped into
    the cache (writes past the capacity are dropped), so they cannot read or write out of bounds,
    and a decode step can be captured in a CUDA graph and replayed with new cache_seqlens.
    num_splits: 0 (the default) lets a heuristic choose how many chunks the keys are split into
    (split-KV, from the shape and the SM count); n in [1, 128] forces n. The CPU path ignores it.
    """
    # A repeated signature (decoding calls the same shapes again and again) goes straight to its GPU
    # plan: every check that depends only on the signature passed when the plan was made.
    try:
        key = (_KEYERS.get(q.__class__) or _keyer(q))(
            q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, causal, softmax_scale, return_lse,
            window, num_sink_tokens, sink_logits, alibi_slopes, softcap, num_splits)
        plan = _FAST_PLANS.get(key)
    except Exception:  # cannot be keyed: the full path checks (and raises)
        key = plan = None
    if plan is not None:
        return plan.run_fast((q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, sink_logits,
                              alibi_slopes))

    from ._adapters import adapter_for, info_of

    names = dict(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, cache_batch_idx=cache_batch_idx,
                 block_table=block_table, sink_logits=sink_logits, alibi_slopes=alibi_slopes)
    seqlens_is_int = _is_int(cache_seqlens) or cache_seqlens is None
    if not seqlens_is_int:
        names["cache_seqlens"] = cache_seqlens
    infos = {n: (None if x is None else info_of(x)) for n, x in names.items()}
    for n, x in infos.items():
        if isinstance(x, ArrayInfo) and x.device[0] == "traced":
            raise NotImplementedError(f"cuflash.attention_with_kvcache does not support jax.jit (or other JAX "
                                      f"transformations that trace values): {n} is a tracer. Call it outside jit")
    num_splits = _check_num_splits(num_splits)
    call = describe_kvcache(infos["q"], infos["k_cache"], infos["v_cache"], infos["k"], infos["v"],
                            cache_seqlens if seqlens_is_int else infos["cache_seqlens"],
                            cache_batch_idx=infos["cache_batch_idx"], block_table=infos["block_table"], causal=causal,
                            softmax_scale=softmax_scale, return_lse=return_lse, window=window,
                            num_sink_tokens=num_sink_tokens, sink_logits=infos["sink_logits"],
                            alibi_slopes=infos["alibi_slopes"], softcap=softcap)
    ad = adapter_for(q)
    if call.device[0] == "cuda":
        if not seqlens_is_int:
            names["cache_seqlens"] = cache_seqlens
        return _gpu_kvcache(call, ad, infos, names, num_splits, key,
                            dict(causal=causal, softmax_scale=softmax_scale, window=window,
                                 num_sink_tokens=num_sink_tokens, softcap=softcap))
    host = {n: (None if x is None else ad.to_numpy(x)) for n, x in names.items()}
    if call.appends:
        for name, other in (("k_cache", "v_cache"), ("v_cache", "k_cache")):
            if getattr(names[name], "requires_grad", False):
                raise ValueError(f"{name}: expected a tensor that does not require grad, to write in place; got one "
                                 f"that requires grad (pass {name}.detach(), which shares the storage)")
            _check_writable(name, host[name], host[other])
    where = _check_values(call, host.get("cache_seqlens"), host["cache_batch_idx"], host["block_table"])
    qn = host["q"]
    if call.appends:
        import numpy as np

        # The new tokens (and q) may be views of the caches: read them before writing.
        kn, vn = np.array(host["k"]), np.array(host["v"])
        if any(np.may_share_memory(qn, host[n]) for n in ("k_cache", "v_cache")):
            qn = np.array(qn)
        append_numpy(call, where, host["k_cache"], host["v_cache"], kn, vn)
        if call.lib == "torch":
            import torch

            for t in (k_cache, v_cache):  # written through NumPy views, behind autograd's back
                torch.autograd.graph.increment_version(t)
    options = {n: host[n] for n in call.arrays}
    out, lse = forward_numpy(call, where, qn, host["k_cache"], host["v_cache"], options)
    out = ad.from_numpy(out, q)
    return (out, ad.from_numpy(lse, q)) if call.return_lse else out


# --------------------------------------------------------------------------------------------------------------
# Paged prefill: `attention_varlen(..., block_table=...)` (flash-attn's varlen call with a block table).
#
#     attention_varlen  ->  attention_varlen_paged  ->  PagedVarlenCall (describe_paged_varlen)  ->  values checked
#                       ->  each sequence's keys gathered into a packed (total_k, nheads_kv, head_dim) array
#                       ->  the NumPy varlen forward of cuflash/_plan.py (Plan.forward_numpy), unchanged
#
# k and v are paged caches (num_blocks, page_size, nheads_kv, head_dim); sequence b's keys are its logical
# positions t in [0, cu_seqlens_k[b+1] - cu_seqlens_k[b]), at block block_table[b, t // page_size], row
# t % page_size. cu_seqlens_k only says how many keys each sequence has (its differences); q, out and lse are
# packed as for any attention_varlen call. Forward only and eager only, for now.

_PAGED = "attention_varlen with block_table"


@dataclass(frozen=True)
class PagedVarlenCall:
    """A validated call of `attention_varlen` with a block_table: what its signature fixes."""

    lib: str
    device: tuple
    dtype: str
    batch: int
    total_q: int
    nheads: int
    nheads_kv: int
    head_dim: int
    page_size: int
    num_blocks: int
    capacity: int            # keys a sequence can hold: max_blocks_per_seq * page_size
    max_seqlen_q: int
    max_seqlen_k: int
    causal: bool
    scale: float
    return_lse: bool
    window: object           # the scalar options as given (validated); the varlen forward normalizes them
    num_sink_tokens: int
    softcap: object
    arrays: tuple = ()       # the option arrays given: "sink_logits", "alibi_slopes"


def describe_paged_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False,
                          softmax_scale=None, return_lse=False, deterministic=False, *, block_table, window=None,
                          num_sink_tokens=0, sink_logits=None, alibi_slopes=None, softcap=None) -> PagedVarlenCall:
    """Validates what the signature of a paged varlen call fixes. Arrays are ArrayInfo / Foreign / None.
    Every error names the argument, what it got and what was expected; values are checked later
    (`_check_paged_values`)."""
    from ._features import _check_int

    arrays = dict(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, block_table=block_table,
                  sink_logits=sink_logits, alibi_slopes=alibi_slopes)
    if q.lib is None:
        raise TypeError(f"q: expected {_ARRAYS}; got {q.type_name}")
    lib = q.lib
    for name in ("k", "v"):
        if arrays[name].lib != lib:
            raise TypeError(f"{name}: expected a {lib} array like q; got {arrays[name].type_name}")
    device = q.device
    if device[0] not in ("cpu", "cuda"):
        raise ValueError(f"q: expected an array on the CPU or a CUDA GPU; got one on {device[0]}")
    for name in ("k", "v"):
        x = arrays[name]
        if x.device != device:
            raise ValueError(f"{name}: on {x.device[0]}:{x.device[1]}; expected q's device {device[0]}:{device[1]}")

    # ---- q and the paged caches
    if len(q.shape) != 3:
        raise ValueError(f"q: expected 3 dimensions (total_q, nheads, head_dim) (a packed batch); got shape {q.shape}")
    for name in ("k", "v"):
        if len(arrays[name].shape) != 4:
            raise ValueError(f"{name}: expected 4 dimensions (num_blocks, page_size, nheads_kv, head_dim) with "
                             f"block_table (a paged cache); got shape {arrays[name].shape}")
    if q.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"q: expected dtype float16 or bfloat16; got {q.dtype}")
    for name in ("k", "v"):
        if arrays[name].dtype != q.dtype:
            raise TypeError(f"{name}: expected q's dtype {q.dtype}; got {arrays[name].dtype}")
    total_q, h, d = q.shape
    num_blocks, page, hk, dk = k.shape
    _check_q_and_cache(q, k, v, "k", "v")
    _check_page_size("k", k.shape)

    # ---- offsets and the block table
    x = cu_seqlens_q
    if x.lib is None:
        raise TypeError(f"cu_seqlens_q: expected an int32 {lib} array of shape (batch + 1,); got {x.type_name}")
    _check_index("cu_seqlens_q", x, lib, device, (None,), "(batch + 1,)")
    if x.shape[0] < 2:
        raise ValueError(f"cu_seqlens_q: expected shape (batch + 1,) with batch >= 1; got {x.shape}")
    b = x.shape[0] - 1
    _check_index("cu_seqlens_k", cu_seqlens_k, lib, device, (b + 1,), f"(batch + 1,) = ({b + 1},), cu_seqlens_q's")
    _check_index("block_table", block_table, lib, device, (b, None),
                 f"(batch, max_blocks_per_seq) = ({b}, *), batch = len(cu_seqlens_q) - 1")
    if block_table.shape[1] < 1:
        raise ValueError(f"block_table: expected at least one block per sequence; got shape {block_table.shape}")
    capacity = block_table.shape[1] * page

    # ---- the scalars and the options
    mq = _check_int("max_seqlen_q", max_seqlen_q, 0)
    mk = _check_int("max_seqlen_k", max_seqlen_k, 0)
    _check_bool("causal", causal)
    _check_bool("return_lse", return_lse)
    _check_bool("deterministic", deterministic)
    scale = _check_scale(softmax_scale, d)
    options = {n: arrays[n] for n in ("sink_logits", "alibi_slopes") if arrays[n] is not None}
    check_features(lib, device, batch=b, nheads=h, seqlen_q=min(mq, total_q), seqlen_k=min(mk, capacity),
                   causal=bool(causal), window=window, num_sink_tokens=num_sink_tokens, softcap=softcap,
                   arrays=dict(options, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k), packed=True)
    return PagedVarlenCall(lib=lib, device=device, dtype=q.dtype, batch=b, total_q=total_q, nheads=h, nheads_kv=hk,
                           head_dim=d, page_size=page, num_blocks=num_blocks, capacity=capacity, max_seqlen_q=mq,
                           max_seqlen_k=mk, causal=bool(causal), scale=scale, return_lse=bool(return_lse),
                           window=window, num_sink_tokens=num_sink_tokens, softcap=softcap, arrays=tuple(options))


def _check_paged_values(c: PagedVarlenCall, cu_seqlens_q, cu_seqlens_k, block_table):
    """Checks the values of the offsets and the block table (NumPy). Returns (key lengths int64 (batch,),
    the block table int64 with the entries no sequence reads set to 0)."""
    import numpy as np

    cq = np.asarray(cu_seqlens_q).astype(np.int64)
    lq = np.diff(cq)
    if cq[0] < 0 or (lq < 0).any() or cq[-1] > c.total_q:
        raise ValueError(f"cu_seqlens_q: expected non-decreasing offsets from >= 0 to <= {c.total_q} (the rows of "
                         f"q); got {_show(cq)}")
    if lq.max() > c.max_seqlen_q:
        i = int(np.argmax(lq))
        raise ValueError(f"cu_seqlens_q: expected sequence lengths <= max_seqlen_q = {c.max_seqlen_q}; got "
                         f"sequence {i} of length {int(lq[i])} in {_show(cq)}")
    ck = np.asarray(cu_seqlens_k).astype(np.int64)
    lk = np.diff(ck)
    if (lk < 0).any():
        i = int(np.argmax(lk < 0))
        raise ValueError(f"cu_seqlens_k: expected non-decreasing offsets (their differences are the sequences' key "
                         f"lengths); got cu_seqlens_k[{i + 1}] = {int(ck[i + 1])} < cu_seqlens_k[{i}] = "
                         f"{int(ck[i])} in {_show(ck)}")
    for limit, what in ((c.max_seqlen_k, f"max_seqlen_k = {c.max_seqlen_k}"),
                        (c.capacity, f"max_blocks_per_seq * page_size = {c.capacity // c.page_size} * "
                                     f"{c.page_size} = {c.capacity}, what block_table holds")):
        if lk.max() > limit:
            i = int(np.argmax(lk))
            raise ValueError(f"cu_seqlens_k: expected key lengths (cu_seqlens_k[b + 1] - cu_seqlens_k[b]) <= {what}; "
                             f"got sequence {i} with {int(lk[i])} keys in {_show(ck)}")
    table = _check_blocks(np.asarray(block_table).astype(np.int64), lk, c.page_size, c.num_blocks, "k", "sequence")
    return lk, table


def gather_packed_numpy(table, lengths, page_size, k, v):
    """Each sequence's logical keys and values, packed one sequence after the other: (total_k, nheads_kv,
    head_dim) copies with total_k = sum(lengths) (one row of zeros when that is 0), and their int32
    offsets (batch + 1,) from 0."""
    import numpy as np

    total = int(lengths.sum())
    cu = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=cu[1:])
    if total == 0:
        zero = np.zeros((1,) + k.shape[2:], dtype=k.dtype)
        return zero, zero.copy(), cu
    seq = np.repeat(np.arange(len(lengths)), lengths)           # the sequence of each packed row
    t = np.arange(total) - np.repeat(cu[:-1].astype(np.int64), lengths)  # its logical key position
    blocks, rows = table[seq, t // page_size], t % page_size
    return k[blocks, rows], v[blocks, rows], cu


def paged_varlen_forward_numpy(c: PagedVarlenCall, q, k, v, cu_seqlens_q, lengths, table, options: dict):
    """(out, lse): the keys gathered, then the NumPy varlen forward that attention_varlen runs on a packed
    batch (the same Call and Plan path, so the result is that of attention_varlen on the gathered keys)."""
    from ._adapters._numpy import ADAPTER
    from ._call import describe_varlen
    from ._plan import Plan

    keys, values, cu_k = gather_packed_numpy(table, lengths, c.page_size, k, v)
    infos = [ADAPTER.info(x) for x in (q, keys, values)]
    call = describe_varlen(infos, ADAPTER.info(cu_seqlens_q), ADAPTER.info(cu_k), c.max_seqlen_q, c.max_seqlen_k,
                           c.causal, c.scale, False, c.return_lse, window=c.window,
                           num_sink_tokens=c.num_sink_tokens, softcap=c.softcap,
                           **{n: ADAPTER.info(options[n]) for n in c.arrays})
    arrays = dict(options, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_k)
    return Plan(call, {}).forward_numpy(q, keys, values, arrays)


def attention_varlen_paged(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False,
                           softmax_scale=None, return_lse=False, deterministic=False, *, block_table, window=None,
                           num_sink_tokens=0, sink_logits=None, alibi_slopes=None, softcap=None):
    """`cuflash.attention_varlen` with a block_table (its docstring states the call): validation, then
    the NumPy path. Forward only: torch inputs that require grad (with grad mode on) and JAX tracers
    (jax.jit, jax.grad, vmap) raise NotImplementedError before anything runs."""
    from ._adapters import adapter_for, info_of

    names = dict(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, block_table=block_table,
                 sink_logits=sink_logits, alibi_slopes=alibi_slopes)
    # A repeated signature on the GPU goes straight to its route: every check that depends only on the
    # signature passed when it was first seen (tensors that require grad take the full path, which raises).
    try:
        fast_key = _paged_fast_key(names, max_seqlen_q, max_seqlen_k, causal, softmax_scale, return_lse,
                                   deterministic, window, num_sink_tokens, softcap)
        fast = _PAGED_FAST.get(fast_key)
    except Exception:  # cannot be keyed: the full path checks (and raises)
        fast_key = fast = None
    if fast is not None and not any(getattr(x, "requires_grad", False) for x in (q, k, v, sink_logits)):
        call, infos = fast
        return _gpu_paged_varlen(call, adapter_for(q), infos, names, causal, softmax_scale, return_lse,
                                 deterministic, window, num_sink_tokens, softcap)
    infos = {n: (None if x is None else info_of(x)) for n, x in names.items()}
    for n, x in infos.items():
        if isinstance(x, ArrayInfo) and x.device[0] == "traced":
            raise NotImplementedError(
                f"block_table: {_PAGED} runs eagerly and forward only for now: expected concrete arrays; got a "
                f"JAX tracer for {n} (jax.jit, jax.grad, jax.vmap or another transformation). Call it outside "
                "them, or gather the keys and call attention_varlen without block_table")
    call = describe_paged_varlen(infos["q"], infos["k"], infos["v"], infos["cu_seqlens_q"], infos["cu_seqlens_k"],
                                 max_seqlen_q, max_seqlen_k, causal, softmax_scale, return_lse, deterministic,
                                 block_table=infos["block_table"], window=window, num_sink_tokens=num_sink_tokens,
                                 sink_logits=infos["sink_logits"], alibi_slopes=infos["alibi_slopes"],
                                 softcap=softcap)
    if call.lib == "torch":
        import torch

        if torch.is_grad_enabled():
            for n in ("q", "k", "v", "sink_logits"):
                if getattr(names[n], "requires_grad", False):
                    raise NotImplementedError(
                        f"block_table: {_PAGED} is forward only for now (no backward): expected tensors that do "
                        f"not require grad; got {n} with requires_grad=True. Call it under torch.no_grad() or "
                        f"torch.inference_mode(), or pass {n}.detach()")
    ad = adapter_for(q)
    if call.device[0] == "cuda":
        out = _gpu_paged_varlen(call, ad, infos, names, causal, softmax_scale, return_lse, deterministic, window,
                                num_sink_tokens, softcap)
        if fast_key is not None:  # the call went through: its signature may skip the checks from now on
            if len(_PAGED_FAST) > 1024:
                _PAGED_FAST.clear()
            _PAGED_FAST[fast_key] = (call, infos)
        return out
    host = {n: (None if x is None else ad.to_numpy(x)) for n, x in names.items()}
    lengths, table = _check_paged_values(call, host["cu_seqlens_q"], host["cu_seqlens_k"], host["block_table"])
    options = {n: host[n] for n in call.arrays}
    out, lse = paged_varlen_forward_numpy(call, host["q"], host["k"], host["v"], host["cu_seqlens_q"], lengths,
                                          table, options)
    out = ad.from_numpy(out, q)
    return (out, ad.from_numpy(lse, q)) if call.return_lse else out


_PAGED_FAST: dict = {}  # attention_varlen_paged's GPU calls by signature (_paged_fast_key)


def _paged_fast_key(names: dict, *scalars) -> tuple:
    """The signature of a paged prefill call: equal for two calls only when validation and planning give
    the same result (the arrays' signatures from q's adapter, each scalar with its type, the window by
    window_key). Raises for anything it cannot key (arrays of another type than q's: the full path names
    the argument)."""
    from ._adapters._base import window_key

    q = names["q"]
    t = q.__class__
    sig = (_SIGS.get(t) or _sig_of(q))
    key = [t]
    for n, x in names.items():
        if x is None:
            key.append(None)
        elif x.__class__ is t:
            key.append(sig(x))
        else:
            raise TypeError(f"{n}: not q's array type")
    *rest, window, num_sink_tokens, softcap = scalars
    for x in rest + [num_sink_tokens, softcap]:
        key += (x.__class__, x)
    key.append(window_key(window))
    return tuple(key)


_SIGS: dict = {}  # array type -> its adapter's sig


def _sig_of(q):
    from ._adapters import adapter_for

    fn = _SIGS[q.__class__] = adapter_for(q).sig
    return fn


# Pointer slots of a gather plan.
_G_K, _G_V, _G_TABLE, _G_CU_K, _G_KG, _G_VG, _G_CU_OUT = range(7)
_GATHER_PLANS: dict = {}


class GatherPlan:
    """The paged prefill's gather on the GPU (cuda_src/paged_gather.cu): each sequence's keys and values
    copied from the paged caches to rows cu_seqlens_k[b] - cu_seqlens_k[0] + t of packed
    (batch * max_seqlen_k, nheads_kv, head_dim) arrays, with those offsets, which attention_varlen then
    reads as any packed batch (the same kernels, so the result is attention_varlen's on the gathered
    keys). Every valid batch fits (each length <= max_seqlen_k); the device clamps the offsets to the
    arrays otherwise, as the forward does."""

    def __init__(self, c: PagedVarlenCall, infos: dict):
        import threading

        from . import _launch
        from ._gpu import compute_capability
        from ._launch import DeviceTensor, Slot
        from ._plan import _small_needs_copy, contiguous_strides, needs_copy

        self.call = c
        self.device_id = dev = c.device[1]
        self._lock = threading.Lock()
        for name in ("k", "v"):
            x = infos[name]
            if needs_copy(x):
                raise ValueError(f"{name}: expected a paged cache the GPU kernels can read in place: a unit-stride "
                                 f"last dimension and a 16-byte aligned base pointer and strides (multiples of 8 "
                                 f"elements); got strides {x.strides}{'' if x.aligned else ' at an unaligned pointer'}")
        self.copy = tuple(n for n in ("block_table", "cu_seqlens_k") if _small_needs_copy(infos[n]))
        self.rows = max(1, c.batch * c.max_seqlen_k)
        self.packed_shape = (self.rows, c.nheads_kv, c.head_dim)
        dst = contiguous_strides(self.packed_shape)
        table = infos["block_table"]
        table_t = DeviceTensor(Slot(_G_TABLE), table.shape,
                               contiguous_strides(table.shape) if "block_table" in self.copy else table.strides)
        cc = compute_capability(dev)
        self.launches = []
        for src, dst_slot, name in ((_G_K, _G_KG, "k"), (_G_V, _G_VG, "v")):
            self.launches += _launch.gather_launches(
                DeviceTensor(Slot(src), infos[name].shape, infos[name].strides),
                DeviceTensor(Slot(dst_slot), self.packed_shape, dst), table_t, Slot(_G_CU_K), Slot(_G_CU_OUT),
                c.batch, c.max_seqlen_k, dev, cc)

    def run(self, ad, names: dict):
        """(packed keys, packed values, their offsets) as the caller's arrays, on the caller's stream."""
        dev, c = self.device_id, self.call
        keep = []
        arrays = {n: names[n] for n in ("k", "v", "block_table", "cu_seqlens_k")}
        for n in self.copy:
            arrays[n] = ad.contiguous(arrays[n], dev, keep)
        kg = ad.empty(self.packed_shape, c.dtype, dev)
        vg = ad.empty(self.packed_shape, c.dtype, dev)
        cu = ad.empty((c.batch + 1,), "int32", dev)
        ptrs = [ad.ptr(arrays["k"], keep), ad.ptr(arrays["v"], keep), ad.ptr(arrays["block_table"], keep),
                ad.ptr(arrays["cu_seqlens_k"], keep), ad.ptr(kg, keep), ad.ptr(vg, keep), ad.ptr(cu, keep)]
        run_launches(self, ad.stream(dev), ptrs, self.launches,
                     lambda: f"{_PAGED}'s gather, {c.dtype} k {self.packed_shape} from pages")
        return kg, vg, cu


_DIRECT_VARLEN_PLANS: dict = {}


class _NotServed(Exception):
    """_PagedVarlenPlan: the warp-specialized feature kernel does not serve the call."""


class _PagedVarlenPlan(Plan):
    """The paged prefill read in place: the Plan of attention_varlen's Call on the packed keys the gather
    would make (_paged_varlen_plan), whose forward launches the warp-specialized feature kernel with
    PagedKV: its K and V slots take the paged caches, one more slot (_PAGED_TABLE) the block table."""

    def __init__(self, call, plan_infos: dict, pages: dict, table_stride: int, table_copy: bool):
        self.pages, self.table_stride, self.table_copy = pages, table_stride, table_copy
        super().__init__(call, plan_infos)

    def _gpu_forward(self, infos):
        from . import _launch
        from ._launch import DeviceTensor, PagedKV, Slot
        from ._plan import LSE, OUT, Q, K, V, _cc, _mask_args, _packed4, contiguous_strides

        c = self.call
        qt, kt, vt = (self._layout(infos, n, s) for n, s in (("q", Q), ("k", K), ("v", V)))
        o = DeviceTensor(Slot(OUT), self.out_shape, contiguous_strides(self.out_shape))
        table = self.pages["block_table"]
        b, (mq, mk) = c.batch, c.packed
        pages = PagedKV(*(DeviceTensor(Slot(slot), self.pages[n].shape, self.pages[n].strides) for n, slot in
                          (("k", K), ("v", V))), Slot(_PAGED_TABLE), self.table_stride, table.shape[1],
                        rows=mq * (c.nheads // c.nheads_kv))
        launches = _launch.fwd_launches(_packed4(qt, b, mq), _packed4(kt, b, mk), _packed4(vt, b, mk),
                                        _packed4(o, b, mq), Slot(LSE), c.dtype, False, c.scale, self.device_id,
                                        _cc(self.device_id), mask=_mask_args(c, self.copy, infos, FWD_OPT),
                                        paged=pages)
        if launches is None:
            raise _NotServed
        return launches


def _paged_varlen_plan(c: PagedVarlenCall, infos: dict, causal, softmax_scale, window, num_sink_tokens, softcap):
    """The paged prefill's plan that reads the pages in place (_PagedVarlenPlan, sm_90a), or None where the
    warp-specialized feature kernel does not serve the call or its boxes would be too small
    (_config.paged_direct): the gather route then. Its Call is attention_varlen's on the packed
    (batch * max_seqlen_k, nheads_kv, head_dim) keys the gather would make, so that the kernel, its
    tiles and options are that route's."""
    from . import _call
    from ._plan import _small_needs_copy, needs_copy

    for name in ("k", "v"):
        if needs_copy(infos[name]):
            return None  # (the gather route names the layout in its error)
    q = infos["q"]
    packed = ArrayInfo(q.lib, (max(1, c.batch * c.max_seqlen_k), c.nheads_kv, c.head_dim),
                       (c.nheads_kv * c.head_dim, c.head_dim, 1), q.dtype, q.device, True, q.type_name)
    opts = {n: infos[n] for n in ("sink_logits", "alibi_slopes") if infos.get(n) is not None}
    call = _call.describe_varlen([q, packed, packed], infos["cu_seqlens_q"], infos["cu_seqlens_k"], c.max_seqlen_q,
                                 c.max_seqlen_k, causal, softmax_scale, False, c.return_lse, window=window,
                                 num_sink_tokens=num_sink_tokens, softcap=softcap, **opts)
    table = infos["block_table"]
    copy = _small_needs_copy(table)
    plan_infos = dict(q=q, k=packed, v=packed, cu_seqlens_q=infos["cu_seqlens_q"], cu_seqlens_k=infos["cu_seqlens_k"],
                      **opts)
    try:
        return _PagedVarlenPlan(call, plan_infos, {n: infos[n] for n in ("k", "v", "block_table")},
                                table.shape[1] if copy else table.strides[0], copy)
    except _NotServed:
        return None


def _run_paged_varlen(plan, ad, names: dict, return_lse: bool):
    """A direct paged prefill plan's call: its option arrays and the block table (copied where the kernels
    cannot read them in place), the outputs allocated, the launch on the caller's stream."""
    dev, keep = plan.device_id, []
    arrays = {n: names[n] for n in ("q", "k", "v", "block_table") + plan.options}
    for n in plan.copy:
        arrays[n] = ad.contiguous(arrays[n], dev, keep)
    if plan.table_copy:
        arrays["block_table"] = ad.contiguous(arrays["block_table"], dev, keep)
    out = ad.empty(plan.out_shape, plan.call.dtype, dev)
    lse = ad.empty(plan.lse_shape, "float32", dev) if return_lse else None
    ptrs = [ad.ptr(arrays["q"], keep), ad.ptr(arrays["k"], keep), ad.ptr(arrays["v"], keep), ad.ptr(out, keep),
            0 if lse is None else ad.ptr(lse, keep)]
    ptrs += [ad.ptr(arrays[n], keep) if n in arrays else 0 for n in ARRAY_OPTIONS]
    ptrs.append(ad.ptr(arrays["block_table"], keep))
    plan.launch(ad.stream(dev), ptrs)
    out = ad.export(out)
    return (out, ad.export(lse)) if return_lse else out


def _gpu_paged_varlen(c: PagedVarlenCall, ad, infos, names, causal, softmax_scale, return_lse, deterministic,
                      window, num_sink_tokens, softcap):
    """The paged prefill on the GPU: on sm_90a where the warp-specialized feature kernel serves the call,
    that kernel reading the pages in place (_paged_varlen_plan); otherwise gather, then attention_varlen on
    the packed keys."""
    from ._api import attention_varlen

    key = (c, tuple(infos.get(n) for n in ("q", "k", "v", "block_table", "cu_seqlens_q", "cu_seqlens_k",
                                           "sink_logits", "alibi_slopes")), causal, softmax_scale,
           window if window is None else tuple(window), num_sink_tokens, softcap)
    try:
        direct = _DIRECT_VARLEN_PLANS.get(key)
    except TypeError:  # an unhashable option value: the slow path
        key = direct = None
    if direct is None:
        direct = _paged_varlen_plan(c, infos, causal, softmax_scale, window, num_sink_tokens, softcap) or False
        if key is not None:
            if len(_DIRECT_VARLEN_PLANS) > 256:
                _DIRECT_VARLEN_PLANS.clear()
            _DIRECT_VARLEN_PLANS[key] = direct
    if direct:
        return _run_paged_varlen(direct, ad, names, return_lse)
    key = (c, tuple(infos.get(n) for n in ("k", "v", "block_table", "cu_seqlens_k")))
    plan = _GATHER_PLANS.get(key)
    if plan is None:
        plan = GatherPlan(c, infos)
        if len(_GATHER_PLANS) > 256:
            _GATHER_PLANS.clear()
        _GATHER_PLANS[key] = plan
    kg, vg, cu_k = plan.run(ad, names)
    return attention_varlen(names["q"], ad.export(kg), ad.export(vg), names["cu_seqlens_q"], ad.export(cu_k),
                            c.max_seqlen_q, c.max_seqlen_k, causal, softmax_scale, return_lse, deterministic,
                            window=window, num_sink_tokens=num_sink_tokens, sink_logits=names["sink_logits"],
                            alibi_slopes=names["alibi_slopes"], softcap=softcap)


_D_KG, _D_VG = 16, 17  # ChunkPlan's padded copies of a paged cache's keys and values


class ChunkPlan:
    """attention_with_kvcache's chunks on the feature forward (_gpu_kvcache, where
    _config.kvcache_feature_forward takes the forward over the decode kernels), prepared once per
    signature and kept on its fast path as a DecodePlan is. A call first launches, for a contiguous
    cache, the append kernel of cuda_src/flash_decode.cu (the new tokens into the cache; and each
    entry's length L_b = min(cache_seqlens + seqlen_new, capacity), every value clamped as the decode
    kernels clamp it, into a fresh int32 array: nothing read back); for a paged one the gather of
    cuda_src/paged_gather.cu in its chunk mode (one launch: the new tokens into the pages, each entry's
    keys and values t < L_b into the two halves of one padded (2, batch, capacity, nheads_kv,
    head_dim) allocation, and L_b). Then the feature forward of cuflash/_plan.py with kv_lengths = L_b
    on rows [0, batch) of the contiguous cache or on the copy: its Plan made at the first call, then
    run directly (no autograd history: attention_with_kvcache is inference only)."""

    def __init__(self, c: KVCacheCall, infos: dict, options: dict, small_ok: bool = False):
        import threading

        from . import _gpu, _launch
        from ._launch import DecodeArgs, DeviceTensor, GatherChunk, MaskArgs, Slot
        from ._plan import _small_needs_copy, contiguous_strides, needs_copy

        self.call = c
        self.device_id = dev = c.device[1]
        self.ad = None  # the adapter that runs the plan (set by its maker)
        self.options = options
        self.cache_layouts = {n: infos[n] for n in ("k_cache", "v_cache")}
        self.apart = None  # the cache pointers _check_caches_apart last passed
        self._lock = threading.Lock()
        _check_caches_in_place(infos)
        copy = [n for n in ("cache_seqlens", "block_table") if infos.get(n) is not None and _small_needs_copy(infos[n])]
        # The gather reads the new tokens 16 bytes at a time (the append kernel element by element).
        copy += [n for n in ("k", "v") if c.paged and c.appends and needs_copy(infos[n])]

        def tensor(name, slot):
            x = infos[name]
            return DeviceTensor(Slot(slot), x.shape, contiguous_strides(x.shape) if name in copy else x.strides)

        table = infos.get("block_table")
        table_stride = 0
        if table is not None:
            table_stride = table.shape[1] if "block_table" in copy else table.strides[0]
        cc = _gpu.compute_capability(dev)
        seqlens = Slot(_D_SEQLENS) if c.fixed_seqlen is None else 0
        self.padded_shape = (c.batch, c.capacity, c.nheads_kv, c.head_dim)
        self.out_shape = (c.batch, c.seqlen_q, c.nheads, c.head_dim)
        self.lse_shape = (c.batch, c.nheads, c.seqlen_q)
        # A paged cache read in place by the warp-specialized feature forward (sm_90a; PagedKV), where
        # that kernel serves the call: the append kernel (new tokens into the pages, and L_b), then the
        # forward; otherwise the gather below.
        direct = None
        if c.paged:
            extra = ["q"] if needs_copy(infos["q"]) else []
            extra += [n for n in ("alibi_slopes", "sink_logits") if infos.get(n) is not None
                      and _small_needs_copy(infos[n])]
            copy += extra
            direct = self._paged_forward(infos, tensor, table, table_stride, dev, cc, small_ok)
            if direct is None:
                del copy[len(copy) - len(extra):]
        self.direct = direct is not None
        if self.direct:
            args = DecodeArgs(lse=0, scratch=0, cache_seqlens=seqlens, cache_batch_idx=0, block_table=Slot(_D_TABLE),
                              table_stride=table_stride, k_new=tensor("k", _D_K) if c.appends else None,
                              v_new=tensor("v", _D_V) if c.appends else None, cache_rows=c.cache_rows,
                              capacity=c.capacity, page_size=c.page_size, fixed_seqlen=c.fixed_seqlen or 0,
                              num_splits=1, kv_lengths=Slot(_D_KVLEN))
            q = tensor("q", _D_Q)
            self.launches = _launch.decode_launches(q, tensor("k_cache", _D_KC), tensor("v_cache", _D_VC), q, args,
                                                    c.dtype, 1.0, MaskArgs(), dev, cc, append_only=True) + direct
        elif c.paged:
            flat = (c.batch * c.capacity, c.nheads_kv, c.head_dim)
            self.launches = _launch.gather_launches(
                tensor("k_cache", _D_KC), DeviceTensor(Slot(_D_KG), flat, contiguous_strides(flat)),
                DeviceTensor(Slot(_D_TABLE), table.shape, (table_stride, 1)), 0, 0, c.batch, c.capacity, dev, cc,
                GatherChunk(src_v=tensor("v_cache", _D_VC), dst_v=Slot(_D_VG), cache_seqlens=seqlens,
                            fixed_seqlen=c.fixed_seqlen or 0, new_k=tensor("k", _D_K) if c.appends else None,
                            new_v=tensor("v", _D_V) if c.appends else None, lengths_out=Slot(_D_KVLEN)))
        else:
            args = DecodeArgs(lse=0, scratch=0, cache_seqlens=seqlens, cache_batch_idx=0, block_table=0,
                              table_stride=0, k_new=tensor("k", _D_K) if c.appends else None,
                              v_new=tensor("v", _D_V) if c.appends else None, cache_rows=c.cache_rows,
                              capacity=c.capacity, page_size=0, fixed_seqlen=c.fixed_seqlen or 0, num_splits=1,
                              kv_lengths=Slot(_D_KVLEN))
            q = tensor("q", _D_Q)
            self.launches = _launch.decode_launches(q, tensor("k_cache", _D_KC), tensor("v_cache", _D_VC), q, args,
                                                    c.dtype, 1.0, MaskArgs(), dev, cc, append_only=True)
        used = {"k_cache", "v_cache"} | {n for n, on in (("cache_seqlens", c.fixed_seqlen is None),
                                                          ("block_table", c.paged), ("k", c.appends),
                                                          ("v", c.appends)) if on}
        if self.direct:  # (the forward's own inputs: otherwise the forward Plan takes them)
            used |= {"q"} | {n for n in ("alibi_slopes", "sink_logits") if infos.get(n) is not None}
        self.zero_ptrs = [0] * (_D_VG + 1)
        self.input_positions = tuple((i, _RUN_ARRAYS.index(n)) for i, n in enumerate(_D_ARRAYS) if n in used)
        self.copy_positions = tuple(_RUN_ARRAYS.index(n) for n in copy)
        self.forward = None  # the feature forward's Plan (its first call makes it)

    def _paged_forward(self, infos, tensor, table, table_stride, dev, cc, small_ok):
        """The feature forward's launches on the paged caches in place (cuflash/_launch.py PagedKV), or
        None where the warp-specialized feature kernel does not serve the call or its boxes would be too
        small (_config.paged_direct; small_ok: the plan's maker would not gather): its query, key and
        output layouts those of the padded copy the gather would make (batch, capacity, nheads_kv,
        head_dim), kv_lengths the append kernel's L_b."""
        from . import _config, _launch
        from ._launch import DeviceTensor, MaskArgs, PagedKV, Slot
        from ._plan import _small_needs_copy, contiguous_strides

        c, f = self.call, self.call.feats
        if _config.compile_arch(*cc) != "sm_90a":
            return None
        alibi = infos.get("alibi_slopes")
        alibi_bs = 0
        if alibi is not None and len(alibi.shape) == 2:
            alibi_bs = contiguous_strides(alibi.shape)[0] if _small_needs_copy(alibi) else alibi.strides[0]
        mask = MaskArgs(kv_lengths=Slot(_D_KVLEN), alibi_slopes=Slot(_D_ALIBI) if alibi is not None else 0,
                        alibi_batch_stride=alibi_bs,
                        sink_logits=Slot(_D_SINK) if infos.get("sink_logits") is not None else 0,
                        window_left=f.window_left, window_right=f.window_right, num_sink_tokens=f.num_sink_tokens,
                        softcap=f.softcap, total_q=c.seqlen_q, total_k=c.capacity)
        logical = DeviceTensor(Slot(_D_KC), self.padded_shape, contiguous_strides(self.padded_shape))
        paged = PagedKV(tensor("k_cache", _D_KC), tensor("v_cache", _D_VC), Slot(_D_TABLE), table_stride,
                        table.shape[1], small_ok, c.seqlen_q * (c.nheads // c.nheads_kv))
        o = DeviceTensor(Slot(_D_OUT), self.out_shape, contiguous_strides(self.out_shape))
        return _launch.fwd_launches(tensor("q", _D_Q), logical, logical, o, Slot(_D_LSE), c.dtype, False, c.scale,
                                    dev, cc, mask=mask, paged=paged)

    def _what(self) -> str:
        c = self.call
        return (f"attention_with_kvcache's {'gather' if c.paged else 'append'}, {c.dtype} k "
                f"{(c.batch, c.seqlen_new, c.nheads_kv, c.head_dim)}, cache capacity {c.capacity}, paged={c.paged}")

    def run_call(self, names: dict):
        """One call (names: the call's arrays by name): the checks that depend on the arrays' values
        or identity (as DecodePlan.run_call), the launches, and the return value of the call."""
        c, ad, dev = self.call, self.ad, self.device_id
        if c.appends:
            _check_append(self, names, ad)
        keep = []
        arrays = [names.get(n) for n in _RUN_ARRAYS]
        for i in self.copy_positions:
            arrays[i] = ad.contiguous(arrays[i], dev, keep)
        lengths = ad.empty((c.batch,), "int32", dev)
        ptrs = self.zero_ptrs.copy()
        for slot, i in self.input_positions:
            ptrs[slot] = ad.ptr(arrays[i], keep)
        ptrs[_D_KVLEN] = ad.ptr(lengths, keep)
        if self.direct:
            out = ad.empty(self.out_shape, c.dtype, dev)
            lse = ad.empty(self.lse_shape, "float32", dev) if c.return_lse else None
            ptrs[_D_OUT] = ad.ptr(out, keep)
            if lse is not None:
                ptrs[_D_LSE] = ad.ptr(lse, keep)
            run_launches(self, ad.stream(dev), ptrs, self.launches, self._what, False)
            if c.appends and c.lib == "torch":
                _mark_written(names)
            out = ad.export(out)
            return (out, ad.export(lse)) if c.return_lse else out
        if c.paged:
            both = ad.empty((2,) + self.padded_shape, c.dtype, dev)
            k, v = both[0], both[1]
            ptrs[_D_KG], ptrs[_D_VG] = ad.ptr(k, keep), ad.ptr(v, keep)
            k, v = ad.export(k), ad.export(v)
        else:
            k, v = names["k_cache"], names["v_cache"]
            if c.cache_rows != c.batch:
                k, v = k[:c.batch], v[:c.batch]
        run_launches(self, ad.stream(dev), ptrs, self.launches, self._what, False)
        if c.appends and c.lib == "torch":
            _mark_written(names)
        opts = {"kv_lengths": ad.export(lengths)}
        for n in ("sink_logits", "alibi_slopes"):
            if names.get(n) is not None:
                opts[n] = names[n]
        q, o = names["q"], self.options
        if self.forward is None:
            from ._api import _options

            full = _options(None, opts["kv_lengths"], o["window"], o["num_sink_tokens"], opts.get("sink_logits"),
                            opts.get("alibi_slopes"), o["softcap"])
            self.forward = ad.forward_plan(q, k, v, o["causal"], o["softmax_scale"], False, c.return_lse, full)
        out, lse = ad.run_forward(self.forward, q, k, v, opts, c.return_lse)
        return (out, lse) if c.return_lse else out

    def run_fast(self, arrays: tuple):
        """run_call for a call whose signature was seen (attention_with_kvcache's fast path): the
        arrays in _RUN_ARRAYS order."""
        return self.run_call(dict(zip(_RUN_ARRAYS, arrays)))


def refuse_paged_backward(what: str = "attention_varlen_backward"):
    """The error of a backward asked for with a block_table (forward only for now)."""
    return NotImplementedError(f"block_table: {what} with block_table is not built yet ({_PAGED} is forward only "
                               "for now); expected block_table=None with packed k, v (total_k, nheads_kv, "
                               "head_dim); got a block_table")
