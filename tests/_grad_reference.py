"""Naive attention gradients for the backward tests: an exact float64 reference and an input-dtype emulation.

Layouts match the public API: dout and q (batch, seqlen_q, nheads, head_dim), k and v
(batch, seqlen_k, nheads_kv, head_dim); GQA / MQA by repeating each kv head nheads // nheads_kv times
in the forward, so the gradients of a kv head are sums over its group of query heads. Causal masking is
bottom-right aligned (cuflash._reference.causal_mask). A row that sees no key has P = 0 and contributes
no gradient (its dq row is 0), never NaN.

The analytic backward of O = softmax(scale * Q K^T, masked) V for a loss with dL/dO = dO::

    dV = P^T dO,  dP = dO V^T,  dS = P * (dP - rowsum(dP * P)),  dQ = scale dS K,  dK = scale dS^T Q
"""

import math

import numpy as np

from cuflash._reference import causal_mask

__all__ = ["attention_grad_reference"]


def _heads_first(x, repeat, acc):
    """(batch, seqlen, heads, d) -> acc (batch, heads * repeat, seqlen, d), each head repeated `repeat` times."""
    x = np.swapaxes(np.asarray(x), 1, 2).astype(acc)
    return np.repeat(x, repeat, axis=1) if repeat > 1 else x


def _softmax(s, visible):
    """Softmax over the last axis of s with hidden keys removed; rows without a visible key give 0 (no warnings)."""
    if visible is not None:
        s = np.where(visible, s, -np.inf).astype(s.dtype, copy=False)
    if s.shape[-1] == 0:
        return np.zeros_like(s)
    m = s.max(axis=-1, keepdims=True)
    m = np.where(m == -np.inf, 0, m).astype(s.dtype, copy=False)
    e = np.exp(s - m)
    denom = e.sum(axis=-1, keepdims=True)
    return e / np.where(denom > 0, denom, 1).astype(s.dtype, copy=False)


def _group_sum(x, nheads_kv, rnd):
    """(batch, nheads, seqlen, d) per-query-head gradients -> (batch, seqlen, nheads_kv, d), summed per group."""
    batch, nheads, seqlen, head_dim = x.shape
    x = rnd(x.reshape(batch, nheads_kv, nheads // nheads_kv, seqlen, head_dim).sum(axis=2))
    return np.ascontiguousarray(np.swapaxes(x, 1, 2))


def attention_grad_reference(dout, q, k, v, causal=False, softmax_scale=None, compute_dtype=None):
    """Gradients (dq, dk, dv) of sum(attention(q, k, v) * dout), computed naively (full score matrix).

    compute_dtype=None: exact, in float64 from the (upcast) inputs; returns float64 arrays.
    compute_dtype='input': emulates torch autograd of the naive attention in the input dtype (float16 or
      bfloat16) as on a GPU: every matmul accumulates in float32 and its output is rounded to the input
      dtype; the softmax and its backward run in float32 with outputs rounded to the input dtype. Forward as
      cuflash._reference.attention_reference(..., compute_dtype='input'): S = round(scale * Q K^T) (one op),
      P = round(softmax(S)). Backward, op by op:
        dV_h = round(P^T dO),  dP = round(dO V^T),  dS = round(P * (dP - rowsum(dP * P))),
        dQ = round(scale * dS K),  dK_h = round(scale * dS^T Q),
      and the GQA repeat's backward sums dK_h, dV_h over the group in float32, rounded once.
      Returns arrays in the input dtype.
    Shapes: dq like q, dk and dv like k (C-contiguous).
    """
    q, k, v, dout = (np.asarray(x) for x in (q, k, v, dout))
    dtype = q.dtype
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    group = nheads // nheads_kv
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_dim)
    visible = causal_mask(seqlen_q, seqlen_k) if causal else None

    if compute_dtype is None:
        acc = np.float64

        def rnd(x):
            return x
    elif compute_dtype == "input":
        acc = np.float32

        def rnd(x):
            return x.astype(dtype).astype(np.float32)
    else:
        raise ValueError(f"compute_dtype must be None or 'input', got {compute_dtype!r}")

    qh = _heads_first(q, 1, acc)
    kh = _heads_first(k, group, acc)
    vh = _heads_first(v, group, acc)
    doh = _heads_first(dout, 1, acc)
    scale = acc(softmax_scale)

    # Forward (what the backward needs of it): P.
    s = rnd(scale * np.matmul(qh, np.swapaxes(kh, -1, -2)))
    p = rnd(_softmax(s, visible))
    # Backward.
    dv_h = rnd(np.matmul(np.swapaxes(p, -1, -2), doh))
    dp = rnd(np.matmul(doh, np.swapaxes(vh, -1, -2)))
    ds = rnd(p * (dp - (dp * p).sum(axis=-1, keepdims=True)))
    dq = rnd(scale * np.matmul(ds, kh))
    dk_h = rnd(scale * np.matmul(np.swapaxes(ds, -1, -2), qh))

    dq = np.ascontiguousarray(np.swapaxes(dq, 1, 2))
    dk = _group_sum(dk_h, nheads_kv, rnd)
    dv = _group_sum(dv_h, nheads_kv, rnd)
    if compute_dtype == "input":
        dq, dk, dv = (x.astype(dtype) for x in (dq, dk, dv))
    return dq, dk, dv
