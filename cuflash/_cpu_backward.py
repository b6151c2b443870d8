"""NumPy CPU implementation of the FlashAttention-2 backward pass.

This is the readable statement of the algorithm that ``cuda_src/flash_bwd.cu`` runs on the GPU, and
the path cuflash takes where there is no GPU. It mirrors the kernels step by step and in the same
precisions (with the ``ATOMIC_DQ`` partition of the dK/dV kernel, where dQ is accumulated in float32
scratch while the key blocks are visited), so it can be read as a commentary on them. Only the loops
over tiles and over the query heads of a GQA group are written out; each tile step is vectorized
over batch and kv heads.

Layouts
-------
    q, dout, out  (batch, seqlen_q, nheads,    head_dim)   float16 or bfloat16 (any strides)
    k, v          (batch, seqlen_k, nheads_kv, head_dim)   same dtype as q
    lse           (batch, nheads, seqlen_q)                float32, natural log, as the forward returns it
    dq            like q; dk, dv like k (C-contiguous, in the input dtype)

Query head ``h`` reads kv head ``h // (nheads // nheads_kv)``; dk and dv of a kv head are the sums
over the query heads of its group. Causal masking is aligned bottom-right: query row i sees key j
when ``j <= i + seqlen_k - seqlen_q``. A row that sees no key (lse = -inf) contributes no gradient
and its dq row is exactly 0.

Notation (per batch and query head; S = scale * Q K^T, masked)::

    P  = softmax(S)                 recomputed from the forward's lse, never stored
    dV = P^T dO        dP = dO V^T        dS = P * (dP - D),  D = rowsum(dO * O)
    dQ = scale * dS K  dK = scale * dS^T Q

Algorithm
---------
1. Preprocess (``flash_bwd_preprocess_kernel``), per query row, in float32 from the upcast inputs::

       D        = rowsum(dO * O)
       lse_log2 = lse * log2(e), or +inf where lse == -inf (so that P = exp2(s - inf) = 0 there)

2. dK, dV (``flash_bwd_dkdv_kernel``): one GPU thread block per key block of BLOCK_N keys, here the
   outer loop. K_j and V_j stay resident, dK_j and dV_j are float32 accumulators::

       dK_j = dV_j = 0
       for each query head of the kv head's group:
           for each query block Q_i of BLOCK_M rows that can see a key of block j
           (with causal masking, query blocks wholly before the diagonal are skipped):
               S   = Q_i K_j^T                                          float32
               P   = exp2(S * scale * log2(e) - lse_log2_i)             0 where masked
               dP  = dO_i V_j^T                                         float32
               dS  = P * (dP - D_i)                                     float32 P, as the GPU
               dV_j += round(P)^T dO_i                                  P^T stored as 16-bit
               dK_j += round(dS)^T Q_i                                  dS^T stored as 16-bit
               dQ_i += round2(dS) K_j                                   float32 accumulator; round2 and
                                                                        D's correction below
       dk_j = round(scale * dK_j), dv_j = round(dV_j)

3. dq = round(scale * dQ) (``flash_bwd_convert_dq_kernel``).

``round`` is rounding to the input dtype (float16 or bfloat16, round to nearest even): the GPU writes
P^T and dS^T to shared memory as 16-bit values and feeds them (and dS, for dQ) to 16-bit tensor-core
MMAs that accumulate in float32. dQ mirrors the GPU's dQ kernel (``flash_bwd_dq_kernel``, the default
dQ path), which computes the same products in the forward's partition (one query block, looping over
key blocks) and differs from step 2's dQ only in the float32 summation order. ``round2(dS)`` is
round(dS) at head_dim 32 and above, and below (``DS_SPLIT_BELOW``, as cuda_src/flash_bwd.cu) the two
16-bit operands round(dS) + round(dS - round(dS)) that kernel feeds to two MMAs, about twice the input
dtype's precision; dK keeps round(dS). Below head_dim 32 dQ also corrects D, which step 1 forms from
the stored (rounded) O: per query row, with the float32 E = sum_j P_ij (dP_ij - D_i) over the keys it
sees (and the sink, whose dP is 0: its term -P_sink D_i is the row's d sink term of step 1) and
B = sum_j round(W_j) K_j (W = P, times 1 - t^2 with a softcap)::

       dQ_i -= E_i * B_i

and the dK/dV step (which the GPU then runs after the dQ kernel, and this mirror after its own dQ pass)
forms its dS with D* = D + E in place of D: dK keeps round(dS), but no longer the rounded O's error in
D (session 66: dK 1.06x its test bound at head_dim 8, one query row, 300 keys, from D's rounding).

(dS with the exact D* = sum_j P*_j dP_j is dS - W (D* - D), and E = (D* - D) (1 + delta) where the
recomputed P = P* (1 + delta) sums to 1 + delta over the keys and the sink. The form sum_j P_j dP_j - D
would carry delta D* instead: with one visible key and large scores, the lse's float32 rounding
(delta ~ 3e-6) times dP ~ 16 gave dq 1.4e-4 where the exact dq is 0, CI's draw in session 34.)

Features
--------
With the optional features of cuflash/_features.py (visibility rule, lengths and tile bookkeeping as in
cuflash._cpu, whose module docstring states them; batch entries with equal valid lengths sq, sk share the
loops):

* Step 1 also sets lse_log2 = +inf on the padded rows i >= sq (whatever lse says there), and, with sink
  logits, computes their gradient from D and lse alone, in float32::

      dsink[h] = -sum over b and rows i < sq of exp2(min(sink[h] * log2(e) - lse_log2, 0)) * D

  (the sink is an extra key with value 0: its dP is 0, so its dS is -P_sink * D; P_sink <= 1 as the keys' P).
* Step 2 visits the key blocks of [0, sk) only (dK = dV = 0 for keys past sk), and for each only the query
  blocks of rows [0, sq) that can see one of its keys: rows from max(0, n_start - (sk - sq) - right)
  (0 when right < 0) up to min(sq, n_end + left - (sk - sq)) (sq when left < 0 or the block holds sink
  keys). The elementwise mask is applied only on tiles that need it, as in the forward.
* The exponent is the forward's score in log2 units, softcap and ALiBi included::

      t   = tanh(S * (scale / c))                                          softcap c > 0
      P   = exp2((c ? t * (c * log2 e) : S * scale * log2 e) - slope * log2 e * |i' - j| - lse_log2_i)
      dS  = P * (dP - D_i), times (1 - t^2) with a softcap (the derivative of c * tanh(x / c))

  and dQ = scale * dS K, dK = scale * dS^T Q as before. Rows i >= sq keep dq = 0.
"""

import math

import numpy as np

from . import _config
from ._cpu import _alibi_distance, _Feat, _query_tiles, _tile_needs_mask, _tile_visible

__all__ = ["attention_backward_numpy"]

_LOG2E = math.log2(math.e)

def _heads_first_f32(x, nheads_kv):
    """(batch, seqlen, nheads, d) in any strides -> float32 (batch, nheads_kv, nheads // nheads_kv, seqlen, d).

    Query head h = kvh * group + g lands at [:, kvh, g]: the group axis lines up the query heads that share
    kv head kvh.
    """
    batch, seqlen, nheads, head_dim = x.shape
    xf = np.ascontiguousarray(x.transpose(0, 2, 1, 3), dtype=np.float32)
    return xf.reshape(batch, nheads_kv, nheads // nheads_kv, seqlen, head_dim)


def attention_backward_numpy(dout, q, k, v, out, lse, causal: bool, softmax_scale: float,
                             block_m: int = 64, block_n: int = 64, *, q_lengths=None, kv_lengths=None,
                             window=(-1, -1), num_sink_tokens: int = 0, sink_logits=None, alibi_slopes=None,
                             softcap: float = 0.0):
    """FlashAttention-2 backward on the CPU (recomputation, see the module docstring).

    dout, q, out: (batch, seqlen_q, nheads, head_dim); k, v: (batch, seqlen_k, nheads_kv, head_dim); numpy
    arrays of dtype numpy.float16 or ml_dtypes.bfloat16 (arbitrary strides allowed), nheads % nheads_kv == 0.
    lse: float32 (batch, nheads, seqlen_q), the natural-log logsumexp returned by the forward (-inf for a row
    that sees no key). Inputs are assumed already validated by the caller. The feature keywords are those of
    cuflash._cpu.attention_forward_numpy and must be the forward's.

    -> (dq, dk, dv) with the shapes and dtypes of q, k, v (C-contiguous); with sink_logits,
    (dq, dk, dv, dsink) with dsink float32 (nheads,).
    """
    dtype = q.dtype
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    group = nheads // nheads_kv
    block_m = int(block_m)
    block_n = int(block_n)
    feat = _Feat(batch, nheads, seqlen_q, seqlen_k, causal, q_lengths, kv_lengths, window, num_sink_tokens,
                 sink_logits, alibi_slopes, softcap)

    # Load (upcast) to float32 in heads-first slabs: q, dout, out -> (b, hkv, group, seqlen_q, d),
    # k, v -> (b, hkv, seqlen_k, d).
    qf = _heads_first_f32(q, nheads_kv)
    dof = _heads_first_f32(dout, nheads_kv)
    of = _heads_first_f32(out, nheads_kv)
    kf = _heads_first_f32(k, nheads_kv)[:, :, 0]
    vf = _heads_first_f32(v, nheads_kv)[:, :, 0]

    # ---- 1. preprocess: D = rowsum(dO * O); lse in log2 units, +inf where the row sees no key ----
    delta = (dof * of).sum(axis=-1)  # (b, hkv, group, seqlen_q), float32
    lse = np.asarray(lse, dtype=np.float32).reshape(batch, nheads_kv, group, seqlen_q)
    lse_log2 = np.where(lse == -np.inf, np.float32(np.inf), lse * np.float32(_LOG2E))
    padded = np.arange(seqlen_q)[None, :] >= feat.sq[:, None]  # (b, seqlen_q): rows i >= q_lengths[b]
    if padded.any():
        lse_log2 = np.where(padded[:, None, None, :], np.float32(np.inf), lse_log2)
    dsink = None
    if feat.sink_log2 is not None:
        # d sink[h] = -sum over b and valid rows of exp(sink[h] - lse) * D (P_sink = 0 where lse_log2 = +inf),
        # P_sink capped at 1 as the keys' P (sink <= lse for the lse of the same call; a stale lse under a huge
        # sink logit made it inf, and dQ's D correction then NaN: tests/test_cpu_features.py).
        sink_log2 = feat.sink_log2.reshape(1, nheads_kv, group, 1)
        sink_rows = -(np.exp2(np.minimum(sink_log2 - lse_log2, 0)) * delta)  # each row's term, -P_sink * D
        dsink = sink_rows.sum(axis=(0, 3), dtype=np.float32).reshape(nheads)
    else:
        sink_rows = np.zeros_like(delta)

    dq_accum = np.zeros((batch, nheads_kv, group, seqlen_q, head_dim), dtype=np.float32)
    dk = np.zeros((batch, nheads_kv, seqlen_k, head_dim), dtype=np.float32)
    dv = np.zeros((batch, nheads_kv, seqlen_k, head_dim), dtype=np.float32)
    slope_log2 = None if feat.slope_log2 is None else feat.slope_log2.reshape(batch, nheads_kv, group)

    # ---- 2. the dK/dV "kernel", per set of batch entries with equal valid lengths (all of them without lengths) ----
    for idx, sq, sk in feat.groups():
        if isinstance(idx, slice):
            views = (qf, dof, kf, vf, delta, lse_log2, sink_rows, dq_accum, dk, dv)
        else:
            views = tuple(x[idx] for x in (qf, dof, kf, vf, delta, lse_log2, sink_rows, dq_accum, dk, dv))
        _dkdv_tiles(*views, sq, sk, feat, softmax_scale, None if slope_log2 is None else slope_log2[idx],
                    dtype, block_m, block_n)
        if not isinstance(idx, slice):
            dq_accum[idx], dk[idx], dv[idx] = views[7], views[8], views[9]

    # ---- 3. dq = scale * dQ; everything back to (batch, seqlen, heads, head_dim) in the input dtype ----
    scale = np.float32(softmax_scale)
    dq = (dq_accum * scale).reshape(batch, nheads, seqlen_q, head_dim).transpose(0, 2, 1, 3)
    dq = np.ascontiguousarray(dq.astype(dtype))
    dk = np.ascontiguousarray(dk.astype(dtype).transpose(0, 2, 1, 3))
    dv = np.ascontiguousarray(dv.astype(dtype).transpose(0, 2, 1, 3))
    if dsink is None:
        return dq, dk, dv
    return dq, dk, dv, dsink


def _dkdv_tiles(qf, dof, kf, vf, delta, lse_log2, sink_rows, dq_accum, dk, dv, sq, sk, feat, softmax_scale,
                slope_log2, dtype, block_m, block_n):
    """Step 2 for batch entries with valid lengths sq, sk: accumulates into dq_accum and writes dk, dv (in place).

    qf, dof (b, hkv, group, seqlen_q, d), kf, vf (b, hkv, seqlen_k, d), delta, lse_log2, sink_rows (each row's
    -P_sink * D, 0 without sink logits) (b, hkv, group, seqlen_q), float32; slope_log2 (b, hkv, group) or None.
    """
    group = qf.shape[2]
    left, right, nsink, softcap = feat.left, feat.right, feat.nsink, feat.softcap
    scale = np.float32(softmax_scale)
    # Scale folded into exp2: P = exp2(S * scale_log2 - lse_log2); with a softcap c the exponent's score is
    # tanh(S * (scale / c)) * (c * log2(e)), as in the forward.
    scale_log2 = np.float32(softmax_scale * _LOG2E)
    if softcap > 0:
        scale_over_cap = np.float32(softmax_scale / softcap)
        cap_log2 = np.float32(softcap * _LOG2E)
    # Bottom-right alignment (causal, window, ALiBi): query i is aligned with key i + diag_offset.
    diag_offset = sk - sq

    def tile(k_blk, v_blk, g, m_start, m_end, n_start, n_end):
        """(q_blk, do_blk, P, dP, t (softcap's tanh or None)) of group head g's rows [m_start, m_end) and
        keys [n_start, n_end), float32."""
        q_blk = qf[:, :, g, m_start:m_end]  # (b, hkv, rows, d)
        do_blk = dof[:, :, g, m_start:m_end]
        # Recompute S = Q K^T (float32) and P from the forward's lse; rows that see no key have lse_log2 =
        # +inf, so P = exp2(-inf) = 0 on them. (Every tile of such a row also crosses the causal diagonal,
        # so the mask below zeroes it as well; the kernel needs the +inf for its padding rows past
        # seqlen_q too.)
        s = np.matmul(q_blk, k_blk.swapaxes(-1, -2))  # (b, hkv, rows, cols)
        # (The kernel forms the exponent with one fused multiply-add; here it is rounded twice.)
        t = None
        if softcap > 0:
            t = np.tanh(s * scale_over_cap)
            x = t * cap_log2
        else:
            x = s * scale_log2
        if slope_log2 is not None:  # ALiBi: - slope * log2(e) * |i' - j|
            x -= slope_log2[:, :, g, None, None] * _alibi_distance(m_start, m_end, n_start, n_end, diag_offset)
        x = x - lse_log2[:, :, g, m_start:m_end, None]
        # Mask, only on tiles where some key is hidden from some row: P = 0 where the key is hidden. The
        # kernel zeroes P after the exp2; here the exponent is set to -inf before it, which gives the same
        # P without the overflow warning a hidden key with a huge score would raise.
        if _tile_needs_mask(m_start, m_end, n_start, n_end, diag_offset, left, right, nsink):
            x[..., ~_tile_visible(m_start, m_end, n_start, n_end, diag_offset, left, right, nsink)] = -np.inf
        p = np.exp2(x)
        dp = np.matmul(do_blk, v_blk.swapaxes(-1, -2))  # dP = dO V^T
        return q_blk, do_blk, p, dp, t

    # Below DS_SPLIT_BELOW the dQ "kernel" runs first, in the forward's partition's sums: dQ from dS = P (dP - D)
    # as hi + lo, and per query row E = sum_j P_j (dP_j - D) (float32, starting from the sink's term) and
    # B = sum_j W_j K_j (W = P, times 1 - t^2 with a softcap; rounded to the dtype), for its correction of D at
    # the end (see the module docstring); it leaves D* = D + E for the dK/dV pass's dS.
    split = kf.shape[-1] < _config.BWD_DS_SPLIT_BELOW
    delta_k = delta  # the D of the dK/dV pass's dS
    if split:
        pdp_sum = sink_rows.astype(np.float32, copy=True)
        b_acc = np.zeros(dq_accum.shape, dtype=np.float32)
        for n_start in range(0, sk, block_n):
            n_end = min(n_start + block_n, sk)
            k_blk, v_blk = kf[:, :, n_start:n_end], vf[:, :, n_start:n_end]
            for g in range(group):
                for m_start, m_end in _query_tiles(n_start, n_end, diag_offset, sq, left, right, nsink, block_m):
                    _q, _do, p, dp, t = tile(k_blk, v_blk, g, m_start, m_end, n_start, n_end)
                    ds = p * (dp - delta[:, :, g, m_start:m_end, None])
                    pdp_sum[:, :, g, m_start:m_end] += ds.sum(axis=-1, dtype=np.float32)
                    w = p
                    if t is not None:
                        ds *= 1 - t * t
                        w = p * (1 - t * t)
                    b_acc[:, :, g, m_start:m_end] += np.matmul(w.astype(dtype).astype(np.float32), k_blk)
                    ds_r = ds.astype(dtype).astype(np.float32)
                    ds_q = ds_r + (ds - ds_r).astype(dtype).astype(np.float32)  # hi + lo
                    dq_accum[:, :, g, m_start:m_end] += np.matmul(ds_q, k_blk)
        delta_k = (delta + pdp_sum).astype(np.float32)

    # One "thread block" per key block of [0, sk): dK, dV accumulate over the group heads and query blocks.
    for n_start in range(0, sk, block_n):
        # The last key block may be partial; the slice simply ends at sk (the kernel masks keys >= sk instead).
        n_end = min(n_start + block_n, sk)
        k_blk = kf[:, :, n_start:n_end]  # (b, hkv, cols, d)
        v_blk = vf[:, :, n_start:n_end]

        # The query blocks with a row that sees a key of this block (causal / window / sinks); the others see none
        # of these keys and are skipped.
        m_tiles = _query_tiles(n_start, n_end, diag_offset, sq, left, right, nsink, block_m)

        acc_dk = np.zeros(k_blk.shape, dtype=np.float32)
        acc_dv = np.zeros_like(acc_dk)

        for g in range(group):
            for m_start, m_end in m_tiles:
                q_blk, do_blk, p, dp, t = tile(k_blk, v_blk, g, m_start, m_end, n_start, n_end)
                # dS = P * (dP - D) with the float32 P; through the softcap, dS *= 1 - t^2.
                ds = p * (dp - delta_k[:, :, g, m_start:m_end, None])
                if t is not None:
                    ds *= 1 - t * t

                # P^T and dS^T go through 16-bit shared memory into the MMAs: round them to the input dtype.
                p_r = p.astype(dtype).astype(np.float32)
                ds_r = ds.astype(dtype).astype(np.float32)

                # dV += P^T dO, dK += dS^T Q (float32 accumulators of this key block).
                acc_dv += np.matmul(p_r.swapaxes(-1, -2), do_blk)
                acc_dk += np.matmul(ds_r.swapaxes(-1, -2), q_blk)
                if not split:  # dQ += dS K, into the float32 scratch (the kernel's atomics into dq_accum)
                    dq_accum[:, :, g, m_start:m_end] += np.matmul(ds_r, k_blk)

        # dK, dV of this key block are written once, complete: the group sum happened in the accumulators.
        dk[:, :, n_start:n_end] = acc_dk * scale
        dv[:, :, n_start:n_end] = acc_dv

    if split:  # dQ's D correction: dq -= E * B, per query row
        dq_accum -= pdp_sum[..., None] * b_acc
