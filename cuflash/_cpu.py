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

    m = -inf, l = 0, O = 0                               float32, per row
    for each block K_j, V_j of BLOCK_N keys, up to the last block any row
    of the query block can see (later blocks are skipped entirely):
        S  = (Q_i K_j^T) * (softmax_scale * log2 e)      fp32 scores
        S  = -inf where the causal rule hides the key
        m' = max(m, rowmax(S))                           row max
        a  = exp2(m - m')                                rescale factor
        P  = exp2(S - m')
        l  = a * l + rowsum(P)                           row sum (fp32 P)
        O  = a * O + round_to_input_dtype(P) @ V_j       PV product, fp32 acc
        m  = m'
    O   = O / l                                          finalize
    lse = (m + log2 l) * ln 2                            natural-log lse
    out = round_to_input_dtype(O)

P is rounded to the input dtype before the PV product because the kernel
feeds it to a 16-bit tensor-core MMA; the row sum l uses the unrounded
float32 P, as the kernel does. While a row has seen no visible key its max is
still -inf, and ``-inf - -inf`` would be NaN, so 0 is used as the subtraction
base for such rows (then P = 0 and a = 0, and nothing becomes NaN).
"""

import math

import numpy as np

__all__ = ["attention_forward_numpy"]

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)


def attention_forward_numpy(q, k, v, causal: bool, softmax_scale: float, block_m: int = 64, block_n: int = 64):
    """FlashAttention-2 forward on the CPU (tiled online softmax, see the module docstring).

    q: (batch, seqlen_q, nheads, head_dim), k, v: (batch, seqlen_k, nheads_kv, head_dim); numpy arrays of
    dtype numpy.float16 or ml_dtypes.bfloat16 (arbitrary strides allowed), nheads % nheads_kv == 0.
    Inputs are assumed already validated by the caller (cuflash._api).

    Returns (out, lse): out has q's shape and dtype (C-contiguous); lse is float32 (batch, nheads, seqlen_q),
    the natural-log logsumexp of each row of scaled scores (-inf for a row that sees no key).
    """
    dtype = q.dtype
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    group = nheads // nheads_kv
    block_m = int(block_m)
    block_n = int(block_n)

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

    # Scale folded into exp2: scores are multiplied once by softmax_scale * log2(e).
    scale_log2 = np.float32(softmax_scale * _LOG2E)
    # Bottom-right causal alignment: row i sees key j iff j <= i + diag_offset.
    diag_offset = seqlen_k - seqlen_q

    for m_start in range(0, seqlen_q, block_m):
        m_end = min(m_start + block_m, seqlen_q)
        rows = m_end - m_start
        q_blk = qf[..., m_start:m_end, :]  # (b, hkv, g, rows, d)

        # Key range this query block visits. With causal masking the last row of the block,
        # m_end - 1, sees keys up to m_end - 1 + diag_offset; key blocks past that are skipped.
        n_stop = seqlen_k
        if causal:
            n_stop = max(0, min(seqlen_k, m_end + diag_offset))

        m_i = np.full((batch, nheads_kv, group, rows), -np.inf, dtype=np.float32)  # running row max (log2 units)
        l_i = np.zeros((batch, nheads_kv, group, rows), dtype=np.float32)  # running row sum
        acc = np.zeros((batch, nheads_kv, group, rows, head_dim), dtype=np.float32)  # unnormalized O

        for n_start in range(0, n_stop, block_n):
            # The last key block may be partial; the slice simply ends at seqlen_k (the kernel masks
            # keys >= seqlen_k instead).
            n_end = min(n_start + block_n, seqlen_k)
            k_blk = kf[..., n_start:n_end, :]  # (b, hkv, 1, cols, d)
            v_blk = vf[..., n_start:n_end, :]

            # S = Q K^T in float32, scaled into log2 units.
            s = np.matmul(q_blk, k_blk.swapaxes(-1, -2))  # (b, hkv, g, rows, cols)
            s *= scale_log2

            # Causal mask, only on key blocks that cross the diagonal of this query block
            # (some key in the block lies beyond what the first row of the block may see).
            if causal and n_end - 1 > m_start + diag_offset:
                row_idx = np.arange(m_start, m_end)[:, None]
                col_idx = np.arange(n_start, n_end)[None, :]
                s[..., col_idx > row_idx + diag_offset] = -np.inf

            # Row max: m_new = max(m_old, rowmax(S)).
            m_new = np.maximum(m_i, s.max(axis=-1))
            # Guard: a row with no visible key so far has m_new = -inf; subtract 0 instead so that
            # exp2(-inf - 0) = 0 rather than exp2(-inf - -inf) = NaN.
            m_base = np.where(m_new == -np.inf, np.float32(0.0), m_new)

            # Rescale: alpha = exp2(m_old - m_new) shrinks the running sum and accumulator as the max grows.
            alpha = np.exp2(m_i - m_base)
            p = np.exp2(s - m_base[..., None])

            # Row sum with the float32 P.
            l_i = l_i * alpha + p.sum(axis=-1)

            # O = alpha * O + P @ V, with P rounded to the input dtype (as fed to the tensor-core MMA)
            # and accumulated in float32.
            p_rounded = p.astype(dtype).astype(np.float32)
            acc *= alpha[..., None]
            acc += np.matmul(p_rounded, v_blk)

            m_i = m_new

        # Finalize: O /= l once; lse = (m + log2 l) * ln 2. Rows that saw no key have l = 0 and acc = 0:
        # they keep out = 0 and lse = -inf (divide by 1 instead of 0 so no warning is raised).
        has_key = l_i > 0
        l_safe = np.where(has_key, l_i, np.float32(1.0))
        out_acc[..., m_start:m_end, :] = acc / l_safe[..., None]
        lse[..., m_start:m_end] = np.where(has_key, (m_i + np.log2(l_safe)) * np.float32(_LN2), -np.inf)

    # Back to (batch, seqlen_q, nheads, head_dim), rounded to the input dtype.
    out = out_acc.reshape(batch, nheads, seqlen_q, head_dim).transpose(0, 2, 1, 3)
    out = np.ascontiguousarray(out.astype(dtype))
    return out, lse.reshape(batch, nheads, seqlen_q)
