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
               dQ_i += round(dS) K_j                                    float32 accumulator
       dk_j = round(scale * dK_j), dv_j = round(dV_j)

3. dq = round(scale * dQ) (``flash_bwd_convert_dq_kernel``).

``round`` is rounding to the input dtype (float16 or bfloat16, round to nearest even): the GPU writes
P^T and dS^T to shared memory as 16-bit values and feeds them (and dS, for dQ) to 16-bit tensor-core
MMAs that accumulate in float32. The deterministic dQ kernel (``flash_bwd_dq_kernel``) computes the
same products in the forward's partition (one query block, looping over key blocks); it differs from
step 2's dQ only in the float32 summation order.
"""

import math

import numpy as np

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
                             block_m: int = 64, block_n: int = 64):
    """FlashAttention-2 backward on the CPU (recomputation, see the module docstring).

    dout, q, out: (batch, seqlen_q, nheads, head_dim); k, v: (batch, seqlen_k, nheads_kv, head_dim); numpy
    arrays of dtype numpy.float16 or ml_dtypes.bfloat16 (arbitrary strides allowed), nheads % nheads_kv == 0.
    lse: float32 (batch, nheads, seqlen_q), the natural-log logsumexp returned by the forward (-inf for a row
    that sees no key). Inputs are assumed already validated by the caller.

    -> (dq, dk, dv) with the shapes and dtypes of q, k, v (C-contiguous).
    """
    dtype = q.dtype
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    group = nheads // nheads_kv
    block_m = int(block_m)
    block_n = int(block_n)

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

    scale = np.float32(softmax_scale)
    # Scale folded into exp2: P = exp2(S * scale_log2 - lse_log2).
    scale_log2 = np.float32(softmax_scale * _LOG2E)
    # Bottom-right causal alignment: row i sees key j iff j <= i + diag_offset.
    diag_offset = seqlen_k - seqlen_q
    num_m_blocks = -(-seqlen_q // block_m)

    dq_accum = np.zeros((batch, nheads_kv, group, seqlen_q, head_dim), dtype=np.float32)
    dk = np.zeros((batch, nheads_kv, seqlen_k, head_dim), dtype=np.float32)
    dv = np.zeros((batch, nheads_kv, seqlen_k, head_dim), dtype=np.float32)

    # ---- 2. one "thread block" per key block: dK, dV accumulate over the group heads and query blocks ----
    for n_start in range(0, seqlen_k, block_n):
        # The last key block may be partial; the slice simply ends at seqlen_k (the kernel masks
        # keys >= seqlen_k instead).
        n_end = min(n_start + block_n, seqlen_k)
        k_blk = kf[:, :, n_start:n_end]  # (b, hkv, cols, d)
        v_blk = vf[:, :, n_start:n_end]

        # First query block that sees a key of this block: query i sees key n_start iff
        # i >= n_start - diag_offset. Earlier query blocks see none of these keys and are skipped.
        m_begin = 0
        if causal:
            first_q = n_start - diag_offset
            m_begin = 0 if first_q <= 0 else min(num_m_blocks, first_q // block_m)

        acc_dk = np.zeros((batch, nheads_kv, n_end - n_start, head_dim), dtype=np.float32)
        acc_dv = np.zeros_like(acc_dk)

        for g in range(group):
            for m_block in range(m_begin, num_m_blocks):
                m_start = m_block * block_m
                m_end = min(m_start + block_m, seqlen_q)
                q_blk = qf[:, :, g, m_start:m_end]  # (b, hkv, rows, d)
                do_blk = dof[:, :, g, m_start:m_end]

                # Recompute S = Q K^T (float32) and P from the forward's lse; rows that see no key have
                # lse_log2 = +inf, so P = exp2(-inf) = 0 on them. (Every tile of such a row also crosses the
                # causal diagonal, so the mask below zeroes it as well; the kernel needs the +inf for its
                # padding rows past seqlen_q too.)
                s = np.matmul(q_blk, k_blk.swapaxes(-1, -2))  # (b, hkv, rows, cols)
                # (The kernel forms the exponent with one fused multiply-add; here it is rounded twice.)
                x = s * scale_log2 - lse_log2[:, :, g, m_start:m_end, None]

                # Causal mask, only on tiles that cross the diagonal (some key of the block lies beyond
                # what the first row of the query block may see): P = 0 where the key is hidden. The kernel
                # zeroes P after the exp2; here the exponent is set to -inf before it, which gives the same
                # P without the overflow warning a hidden key with a huge score would raise.
                if causal and n_end - 1 > m_start + diag_offset:
                    row_idx = np.arange(m_start, m_end)[:, None]
                    col_idx = np.arange(n_start, n_end)[None, :]
                    x[..., col_idx > row_idx + diag_offset] = -np.inf
                p = np.exp2(x)

                # dP = dO V^T, dS = P * (dP - D) with the float32 P.
                dp = np.matmul(do_blk, v_blk.swapaxes(-1, -2))
                ds = p * (dp - delta[:, :, g, m_start:m_end, None])

                # P^T and dS^T go through 16-bit shared memory into the MMAs: round them to the input dtype.
                p_r = p.astype(dtype).astype(np.float32)
                ds_r = ds.astype(dtype).astype(np.float32)

                # dV += P^T dO, dK += dS^T Q (float32 accumulators of this key block).
                acc_dv += np.matmul(p_r.swapaxes(-1, -2), do_blk)
                acc_dk += np.matmul(ds_r.swapaxes(-1, -2), q_blk)
                # dQ += dS K, into the float32 scratch (the kernel's atomics into dq_accum).
                dq_accum[:, :, g, m_start:m_end] += np.matmul(ds_r, k_blk)

        # dK, dV of this key block are written once, complete: the group sum happened in the accumulators.
        dk[:, :, n_start:n_end] = acc_dk * scale
        dv[:, :, n_start:n_end] = acc_dv

    # ---- 3. dq = scale * dQ; everything back to (batch, seqlen, heads, head_dim) in the input dtype ----
    dq = (dq_accum * scale).reshape(batch, nheads, seqlen_q, head_dim).transpose(0, 2, 1, 3)
    dq = np.ascontiguousarray(dq.astype(dtype))
    dk = np.ascontiguousarray(dk.astype(dtype).transpose(0, 2, 1, 3))
    dv = np.ascontiguousarray(dv.astype(dtype).transpose(0, 2, 1, 3))
    return dq, dk, dv
