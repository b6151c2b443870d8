"""NumPy CPU implementation of the FlashAttention-2 forward pass.

This is the readable statement of the algorithm that ``cuda_src/flash_fwd.cu``
runs on the GPU, and the path cuflash takes where there is no GPU. It performs
the same steps as the kernel, tile by tile and in the same precisions, so it
can be read as a commentary on the kernel. Only the loop over tiles is
written out; each tile step is vectorized over batch and heads.

Layouts
-------
    q     (batch, seqlen_q, nheads,    head_dim)   float16 or bfloat16
    k, v  (batch, seqlen_k, nheads_kv, head_dim)   same dtype as q
    out   (batch, seqlen_q, nheads,    head_dim)   q's dtype, C-contiguous
    lse   (batch, nheads, seqlen_q)                float32, natural log

Query head ``h`` reads kv head ``h // (nheads // nheads_kv)`` (MHA when
nheads_kv == nheads, GQA in between, MQA when nheads_kv == 1). Internally
the query heads are viewed as (nheads_kv, group), so every query head of a
group is matched against its shared kv head by broadcasting, with no copy.

Causal masking is aligned bottom-right: query row i sees key j when
``j <= i + seqlen_k - seqlen_q``. A row that sees no key (possible when
seqlen_q > seqlen_k) gets out = 0 and lse = -inf.

Algorithm (for one block of BLOCK_M query rows; the GPU runs one such block
per thread block, and the blocks are independent). Scores are kept in log2
units, so the softmax scale and log2(e) are folded into a single multiply and
``exp`` becomes ``exp2``::

    m = -inf, l = 0, lp = 0, O = 0                       float32, per row
    for each block K_j, V_j of BLOCK_N keys, up to the last block any row
    of the query block can see (later blocks are skipped entirely):
        S  = (Q_i K_j^T) * (softmax_scale * log2 e)      fp32 scores
        S  = -inf where the causal rule hides the key
        m' = max(m, rowmax(S))                           row max
        a  = exp2(m - m')                                rescale factor
        P  = exp2(S - m')
        Pr = round_to_input_dtype(P)
        l  = a * l + rowsum(P)                           row sum (fp32 P)
        lp = a * lp + rowsum(Pr)                         row sum (rounded P)
        O  = a * O + Pr @ V_j                            PV product, fp32 acc
        m  = m'
    O   = O / lp                                         finalize
    lse = (m + log2 l) * ln 2                            natural-log lse
    out = round_to_input_dtype(O)

P is rounded to the input dtype before the PV product because the kernel
feeds it to a 16-bit tensor-core MMA. O is divided by the sum lp of those
rounded values, so that its weights are an exact convex combination of them:
a rounding error of P_j then moves O by its share of (V_j - O), not of V_j,
which matters where the scores are nearly equal
(tests/test_near_equal_scores.py). The lse uses the sum l of the unrounded
float32 P. The GPU kernels do the same (cuda_src/softmax.cuh). While a row has
seen no visible key its max is still -inf, and ``-inf - -inf`` would be NaN,
so 0 is used as the subtraction base for such rows (then P = 0 and a = 0, and
nothing becomes NaN).

Features
--------
The optional features of cuflash/_features.py (which states their meaning; the
float64 reference is cuflash._reference.attention_reference) change the
algorithm above as follows, as in the feature kernels. For batch entry b,
sq = q_lengths[b] and sk = kv_lengths[b] (the array lengths when not given;
integers past the array length are clamped to it, negative ones to 0),
i' = i + sk - sq, and (left, right) is the window (-1: unbounded; causal sets
right = 0)::

    visible(i, j) = i < sq and j < sk and (right < 0 or j <= i' + right)
                    and (left < 0 or j >= i' - left or j < num_sink_tokens)

* Batch entries with the same (sq, sk) are processed together (the same tile
  loops); the query blocks cover rows [0, sq) only.
* Key tiles visited by a query block with valid rows [i0, i1): only those that
  can hold a visible key. With hi = min(sk, i1 - 1 + (sk - sq) + right + 1)
  (sk when right < 0) and lo = max(0, i0 + (sk - sq) - left) (0 when
  left < 0), these are the sink tiles [0, ceil(min(num_sink_tokens, hi) /
  BLOCK_N)) (when left >= 0) and the window's tiles [lo // BLOCK_N,
  ceil(hi / BLOCK_N)), in increasing order, each clipped to sk; every other
  tile is fully masked and skipped. The elementwise mask is applied only on a
  tile where some (row, key) pair of the tile is hidden (:func:`_tile_needs_mask`).
* Scores in log2 units::

      S = (softcap ? c * tanh(S * (scale / c)) : S * scale) * log2 e
          - slope[b, h] * log2 e * |i' - j|                     (ALiBi)
      S = -inf where not visible

  (the softcap as tanh(S * (scale / c)) * (c * log2 e), all in float32).
* Sink logits: the sink is an extra key with value 0, joined once the keys
  are done: m' = max(m, sink[h] * log2 e), O and l rescaled by exp2(m - m'),
  l += exp2(sink[h] * log2 e - m'), and lp likewise (the sink's weight is
  not rounded: its value 0 takes no part in P V). It is part of l and of the
  lse, and a row with no visible key gets out = 0 and lse = sink[h]. Joining
  it last keeps P relative to the keys' own max, so the largest key's P is
  exactly 1 before the rounding to the input dtype.
* Rows i >= sq of a padded batch entry are not computed: out = 0, lse = -inf.
"""

import math

import numpy as np

__all__ = ["attention_forward_numpy"]

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)


# --------------------------------------------------------------------------------------------------------------
# Features: argument normalization and the tile bookkeeping, shared with cuflash._cpu_backward.


class _Feat:
    """The normalized feature arguments of one call (see the module docstring).

    left, right: the window bounds (-1 unbounded; causal folded into right = 0); nsink: num_sink_tokens;
    sq, sk: int64 (batch,) valid lengths, clamped to [0, seqlen]; sink_log2: float32 (nheads,) sink logits times
    log2(e), or None; slope_log2: float32 (batch, nheads) ALiBi slopes times log2(e), or None; softcap: float
    (0: off).
    """

    def __init__(self, batch, nheads, seqlen_q, seqlen_k, causal, q_lengths=None, kv_lengths=None,
                 window=(-1, -1), num_sink_tokens=0, sink_logits=None, alibi_slopes=None, softcap=0.0):
        left, right = (-1, -1) if window is None else (int(window[0]), int(window[1]))
        if causal:
            right = 0
        self.left = left if left >= 0 else -1
        self.right = right if right >= 0 else -1
        self.nsink = max(0, int(num_sink_tokens or 0))
        self.sq = _lengths(q_lengths, batch, seqlen_q)
        self.sk = _lengths(kv_lengths, batch, seqlen_k)
        self.sink_log2 = None
        if sink_logits is not None:
            sink = np.asarray(sink_logits, dtype=np.float32).reshape(nheads)
            self.sink_log2 = sink * np.float32(_LOG2E)
        self.slope_log2 = None
        if alibi_slopes is not None:
            slopes = np.asarray(alibi_slopes, dtype=np.float32)
            if slopes.ndim == 1:
                slopes = np.broadcast_to(slopes.reshape(1, nheads), (batch, nheads))
            self.slope_log2 = slopes.reshape(batch, nheads) * np.float32(_LOG2E)
        self.softcap = float(softcap or 0.0)
        if not self.softcap > 0:
            self.softcap = 0.0

    def groups(self):
        """[(index, sq, sk)]: the batch entries sharing valid lengths (index a slice when it is the whole batch)."""
        batch = len(self.sq)
        key = self.sq * (int(self.sk.max(initial=0)) + 1) + self.sk
        keys = np.unique(key)
        if len(keys) <= 1:
            return [(slice(None), int(self.sq[0]) if batch else 0, int(self.sk[0]) if batch else 0)]
        out = []
        for kv in keys:
            idx = np.nonzero(key == kv)[0]
            out.append((idx, int(self.sq[idx[0]]), int(self.sk[idx[0]])))
        return out


def _lengths(lengths, batch, seqlen):
    """None -> seqlen for every entry; otherwise the integers clamped to [0, seqlen] (as the GPU kernel does)."""
    if lengths is None:
        return np.full(batch, seqlen, dtype=np.int64)
    return np.clip(np.asarray(lengths).astype(np.int64).reshape(batch), 0, seqlen)


def _key_tiles(i0, i1, off, sk, left, right, nsink, block_n):
    """Key tiles [(n0, n1)] that valid query rows [i0, i1) visit, increasing: those that can hold a visible key.

    off = sk - sq. Keys past sk are never visited (the last tile is clipped to sk).
    """
    hi = sk if right < 0 else min(sk, i1 - 1 + off + right + 1)  # one past the last key any row may see
    if hi <= 0:
        return []
    lo = 0 if left < 0 else max(0, i0 + off - left)  # the first key the first row sees past the sinks
    tiles = set()
    if left >= 0 and nsink > 0:
        tiles.update(range(0, -(-min(nsink, hi) // block_n)))
    if lo < hi:
        tiles.update(range(lo // block_n, -(-hi // block_n)))
    return [(t * block_n, min((t + 1) * block_n, sk)) for t in sorted(tiles)]


def _query_tiles(n0, n1, off, sq, left, right, nsink, block_m):
    """Query tiles [(m0, m1)] whose valid rows can see a key of [n0, n1) (n1 <= sk), increasing (the backward's)."""
    lo = 0 if right < 0 else max(0, n0 - off - right)  # the first row whose right bound reaches key n0
    if left < 0 or n0 < nsink:
        hi = sq
    else:
        hi = min(sq, n1 - 1 + left - off + 1)  # one past the last row whose left bound reaches key n1 - 1
    if lo >= hi:
        return []
    return [(t * block_m, min((t + 1) * block_m, sq)) for t in range(lo // block_m, -(-hi // block_m))]


def _tile_needs_mask(i0, i1, n0, n1, off, left, right, nsink):
    """Whether some key of [n0, n1) is hidden from some row of [i0, i1) (all valid rows and keys)."""
    if right >= 0 and n1 - 1 > i0 + off + right:  # the first row cannot see the last key
        return True
    if left >= 0:
        c0 = max(n0, nsink)  # the first key of the tile that is not a sink
        if c0 < n1 and c0 < i1 - 1 + off - left:  # the last row cannot see it
            return True
    return False


def _tile_visible(i0, i1, n0, n1, off, left, right, nsink):
    """bool (i1 - i0, n1 - n0): the visibility rule on a tile of valid rows and keys."""
    row = np.arange(i0, i1)[:, None] + off  # i'
    col = np.arange(n0, n1)[None, :]
    vis = np.ones((i1 - i0, n1 - n0), dtype=bool)
    if right >= 0:
        vis &= col <= row + right
    if left >= 0:
        vis &= (col >= row - left) | (col < nsink)
    return vis


def _alibi_distance(i0, i1, n0, n1, off):
    """float32 (i1 - i0, n1 - n0): |i' - j|."""
    return np.abs(np.arange(i0, i1)[:, None] + off - np.arange(n0, n1)[None, :]).astype(np.float32)


def attention_forward_numpy(q, k, v, causal: bool, softmax_scale: float, block_m: int = 64, block_n: int = 64, *,
                            q_lengths=None, kv_lengths=None, window=(-1, -1), num_sink_tokens: int = 0,
                            sink_logits=None, alibi_slopes=None, softcap: float = 0.0):
    """FlashAttention-2 forward on the CPU (tiled online softmax, see the module docstring).

    q: (batch, seqlen_q, nheads, head_dim), k, v: (batch, seqlen_k, nheads_kv, head_dim); numpy arrays of
    dtype numpy.float16 or ml_dtypes.bfloat16 (arbitrary strides allowed), nheads % nheads_kv == 0.
    Inputs are assumed already validated by the caller (cuflash._api).

    Features (cuflash/_features.py; all off by default): q_lengths, kv_lengths: integer arrays (batch,);
    window: (left, right), -1 unbounded; num_sink_tokens: int; sink_logits: float32 (nheads,);
    alibi_slopes: float32 (nheads,) or (batch, nheads); softcap: float, 0 = off.

    Returns (out, lse): out has q's shape and dtype (C-contiguous); lse is float32 (batch, nheads, seqlen_q),
    the natural-log logsumexp of each row of scaled scores (-inf for a row that sees no key and has no sink
    logit, and for padded rows i >= q_lengths[b]).
    """
    dtype = q.dtype
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    group = nheads // nheads_kv
    block_m = int(block_m)
    block_n = int(block_n)
    feat = _Feat(batch, nheads, seqlen_q, seqlen_k, causal, q_lengths, kv_lengths, window, num_sink_tokens,
                 sink_logits, alibi_slopes, softcap)

    # Load (upcast) to float32 in heads-first slabs:
    #   q -> (batch, nheads_kv, group, seqlen_q, d), k, v -> (batch, nheads_kv, 1, seqlen_k, d).
    # Query head h = kvh * group + g, so h // group == kvh: the size-1 axis broadcasts kv head kvh
    # over its group of query heads (GQA / MQA without repeating k and v).
    qf = np.ascontiguousarray(q.transpose(0, 2, 1, 3), dtype=np.float32)
    qf = qf.reshape(batch, nheads_kv, group, seqlen_q, head_dim)
    kf = np.ascontiguousarray(k.transpose(0, 2, 1, 3), dtype=np.float32)[:, :, None]
    vf = np.ascontiguousarray(v.transpose(0, 2, 1, 3), dtype=np.float32)[:, :, None]

    out_acc = np.zeros((batch, nheads_kv, group, seqlen_q, head_dim), dtype=np.float32)
    lse = np.full((batch, nheads_kv, group, seqlen_q), -np.inf, dtype=np.float32)
    sink_log2 = None if feat.sink_log2 is None else feat.sink_log2.reshape(nheads_kv, group)
    slope_log2 = None if feat.slope_log2 is None else feat.slope_log2.reshape(batch, nheads_kv, group)

    # The batch entries with equal valid lengths share the tile loops (all of them without q/kv lengths).
    for idx, sq, sk in feat.groups():
        _forward_tiles(qf[idx], kf[idx], vf[idx], out_acc, lse, idx, sq, sk, feat, softmax_scale,
                       sink_log2, None if slope_log2 is None else slope_log2[idx], dtype, block_m, block_n)

    # Back to (batch, seqlen_q, nheads, head_dim), rounded to the input dtype.
    out = out_acc.reshape(batch, nheads, seqlen_q, head_dim).transpose(0, 2, 1, 3)
    out = np.ascontiguousarray(out.astype(dtype))
    return out, lse.reshape(batch, nheads, seqlen_q)


def _forward_tiles(qf, kf, vf, out_acc, lse, idx, sq, sk, feat, softmax_scale, sink_log2, slope_log2, dtype,
                   block_m, block_n):
    """The tile loops for batch entries `idx` (valid lengths sq, sk): writes out_acc[idx] and lse[idx].

    qf (nb, hkv, g, seqlen_q, d), kf, vf (nb, hkv, 1, seqlen_k, d) float32; sink_log2 (hkv, g) or None;
    slope_log2 (nb, hkv, g) or None. Rows >= sq are left as they are (out 0, lse -inf).
    """
    nb, nheads_kv, group, _, head_dim = qf.shape
    left, right, nsink, softcap = feat.left, feat.right, feat.nsink, feat.softcap

    # Scale folded into exp2: scores are multiplied once by softmax_scale * log2(e). With a softcap c the score
    # is c * tanh(scale * s / c) * log2(e): tanh(s * (scale / c)) * (c * log2(e)).
    scale_log2 = np.float32(softmax_scale * _LOG2E)
    if softcap > 0:
        scale_over_cap = np.float32(softmax_scale / softcap)
        cap_log2 = np.float32(softcap * _LOG2E)
    # Bottom-right alignment (causal, window, ALiBi): query i is aligned with key i + diag_offset.
    diag_offset = sk - sq

    for m_start in range(0, sq, block_m):
        m_end = min(m_start + block_m, sq)
        rows = m_end - m_start
        q_blk = qf[..., m_start:m_end, :]  # (b, hkv, g, rows, d)

        # Running row max (log2 units) and row sum over the keys (a sink logit joins after the last tile).
        m_i = np.full((nb, nheads_kv, group, rows), -np.inf, dtype=np.float32)
        l_i = np.zeros((nb, nheads_kv, group, rows), dtype=np.float32)
        lp_i = np.zeros((nb, nheads_kv, group, rows), dtype=np.float32)  # the same of P rounded (O's divisor)
        acc = np.zeros((nb, nheads_kv, group, rows, head_dim), dtype=np.float32)  # unnormalized O

        # Only the key tiles that can hold a key visible to a row of this block (causal / window / sinks): the
        # others are fully masked and skipped. Keys past sk are never visited (the last tile is clipped to sk;
        # the kernel masks keys >= sk instead).
        for n_start, n_end in _key_tiles(m_start, m_end, diag_offset, sk, left, right, nsink, block_n):
            k_blk = kf[..., n_start:n_end, :]  # (b, hkv, 1, cols, d)
            v_blk = vf[..., n_start:n_end, :]

            # S = Q K^T in float32, scaled (and softcapped) into log2 units.
            s = np.matmul(q_blk, k_blk.swapaxes(-1, -2))  # (b, hkv, g, rows, cols)
            if softcap > 0:
                s = np.tanh(s * scale_over_cap) * cap_log2
            else:
                s *= scale_log2
            # ALiBi: - slope * log2(e) * |i' - j|.
            if slope_log2 is not None:
                s -= slope_log2[..., None, None] * _alibi_distance(m_start, m_end, n_start, n_end, diag_offset)

            # Mask, only on tiles where some key is hidden from some row (the causal / window diagonals, and the
            # tiles where the sinks end).
            if _tile_needs_mask(m_start, m_end, n_start, n_end, diag_offset, left, right, nsink):
                hidden = ~_tile_visible(m_start, m_end, n_start, n_end, diag_offset, left, right, nsink)
                s[..., hidden] = -np.inf

            # Row max: m_new = max(m_old, rowmax(S)).
            m_new = np.maximum(m_i, s.max(axis=-1))
            # Guard: a row with no visible key so far has m_new = -inf; subtract 0 instead so that
            # exp2(-inf - 0) = 0 rather than exp2(-inf - -inf) = NaN.
            m_base = np.where(m_new == -np.inf, np.float32(0.0), m_new)

            # Rescale: alpha = exp2(m_old - m_new) shrinks the running sum and accumulator as the max grows.
            alpha = np.exp2(m_i - m_base)
            p = np.exp2(s - m_base[..., None])

            # Row sums: of the float32 P (for lse), and of P rounded to the input dtype (O's divisor).
            p_rounded = p.astype(dtype).astype(np.float32)
            l_i = l_i * alpha + p.sum(axis=-1)
            lp_i = lp_i * alpha + p_rounded.sum(axis=-1)

            # O = alpha * O + P @ V, with P rounded to the input dtype (as fed to the tensor-core MMA)
            # and accumulated in float32.
            acc *= alpha[..., None]
            acc += np.matmul(p_rounded, v_blk)

            m_i = m_new

        if sink_log2 is not None:
            # The sink: a key of value 0 with logit sink * log2(e), seen last. The same guard as above for a row
            # whose max stays -inf (no visible key and a -inf sink).
            sink = sink_log2[None, :, :, None]
            m_new = np.maximum(m_i, sink)
            m_base = np.where(m_new == -np.inf, np.float32(0.0), m_new)
            alpha = np.exp2(m_i - m_base)
            p_sink = np.exp2(sink - m_base)
            l_i = l_i * alpha + p_sink
            lp_i = lp_i * alpha + p_sink
            acc *= alpha[..., None]
            m_i = m_new

        # Finalize: O /= l once; lse = (m + log2 l) * ln 2. Rows that saw no key (and have no sink) have l = 0 and
        # acc = 0: they keep out = 0 and lse = -inf (divide by 1 instead of 0 so no warning is raised).
        has_key = l_i > 0
        l_safe = np.where(has_key, l_i, np.float32(1.0))
        blk_out = acc / np.where(has_key, lp_i, np.float32(1.0))[..., None]
        blk_lse = np.where(has_key, (m_i + np.log2(l_safe)) * np.float32(_LN2), -np.inf)
        if isinstance(idx, slice):
            out_acc[..., m_start:m_end, :] = blk_out
            lse[..., m_start:m_end] = blk_lse
        else:
            out_acc[idx, ..., m_start:m_end, :] = blk_out
            lse[idx, ..., m_start:m_end] = blk_lse
