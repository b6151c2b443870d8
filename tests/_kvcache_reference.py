"""The float64 reference of `cuflash.attention_with_kvcache`, built without cuflash/_kvcache.py.

The append and the gather are plain Python loops over the key positions t of each batch entry
b, through the block table (block block_table[b, t // page_size], row t % page_size) or
cache_batch_idx (row cache_batch_idx[b], position t), on COPIES of the caches. The logical keys
and values, zero past each entry's length, then go to cuflash._reference.attention_reference with
kv_lengths = cache_seqlens + seqlen_new: in float64 (the reference) and in the input dtype (the
naive computation that sets the accuracy bound, as in tests/test_cpu_features.py).
"""

from types import SimpleNamespace

import numpy as np

from cuflash._reference import attention_reference


def seqlens_array(cache_seqlens, batch, seqlen_cache):
    """cache_seqlens as a list of Python ints: an array, an int for every entry, or None (the whole cache)."""
    if cache_seqlens is None:
        return [int(seqlen_cache)] * batch
    if isinstance(cache_seqlens, (int, np.integer)):
        return [int(cache_seqlens)] * batch
    return [int(x) for x in np.asarray(cache_seqlens).reshape(-1)]


def slot(b, t, cache_batch_idx, block_table, page_size):
    """(index into dimension 0 of the cache, index into dimension 1) of entry b's key position t."""
    if block_table is not None:
        return int(block_table[b][t // page_size]), t % page_size
    return (b if cache_batch_idx is None else int(cache_batch_idx[b])), t


def appended_caches(k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx=None, block_table=None):
    """Copies of the caches with k[b, s], v[b, s] written at entry b's position cache_seqlens[b] + s."""
    kc, vc = np.array(k_cache, copy=True), np.array(v_cache, copy=True)
    if k is None:
        return kc, vc
    page_size = k_cache.shape[1]
    batch, seqlen_new = k.shape[0], k.shape[1]
    seqlens = seqlens_array(cache_seqlens, batch, k_cache.shape[1])
    for b in range(batch):
        for s in range(seqlen_new):
            i, r = slot(b, seqlens[b] + s, cache_batch_idx, block_table, page_size)
            kc[i, r] = k[b, s]
            vc[i, r] = v[b, s]
    return kc, vc


def logical_kv(k_cache, v_cache, lengths, cache_batch_idx=None, block_table=None):
    """(keys, values): (batch, max(1, max length), nheads_kv, head_dim), entry b's first lengths[b] keys
    gathered one position at a time, zeros after."""
    batch = len(lengths)
    shape = (batch, max(1, max(lengths))) + tuple(k_cache.shape[2:])
    keys, values = np.zeros(shape, k_cache.dtype), np.zeros(shape, v_cache.dtype)
    page_size = k_cache.shape[1]
    for b in range(batch):
        for t in range(lengths[b]):
            i, r = slot(b, t, cache_batch_idx, block_table, page_size)
            keys[b, t] = k_cache[i, r]
            values[b, t] = v_cache[i, r]
    return keys, values


def kvcache_reference(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, cache_batch_idx=None,
                      block_table=None, causal=False, softmax_scale=None, **feats):
    """What attention_with_kvcache must return and leave in the caches, for NumPy inputs (not modified).

    Returns a namespace: out, lse (float64 reference), naive_out (input dtype), k_cache, v_cache (the
    expected caches after the call), keys, values (the logical keys and values, zero-padded) and lengths
    (cache_seqlens + seqlen_new, a list)."""
    batch = q.shape[0]
    seqlen_new = 0 if k is None else k.shape[1]
    kc, vc = appended_caches(k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table)
    lengths = [n + seqlen_new for n in seqlens_array(cache_seqlens, batch, k_cache.shape[1])]
    keys, values = logical_kv(kc, vc, lengths, cache_batch_idx, block_table)
    kv_lengths = np.array(lengths, dtype=np.int64)
    out, lse = attention_reference(q, keys, values, causal, softmax_scale, kv_lengths=kv_lengths, **feats)
    naive, _ = attention_reference(q, keys, values, causal, softmax_scale, compute_dtype="input",
                                   kv_lengths=kv_lengths, **feats)
    return SimpleNamespace(out=out, lse=lse, naive_out=naive, k_cache=kc, v_cache=vc, keys=keys, values=values,
                           lengths=lengths)
