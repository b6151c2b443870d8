"""Naive attention gradients for the backward tests: an exact float64 reference and an input-dtype emulation.

Layouts match the public API: dout and q (batch, seqlen_q, nheads, head_dim), k and v
(batch, seqlen_k, nheads_kv, head_dim); GQA / MQA by repeating each kv head nheads // nheads_kv times
in the forward, so the gradients of a kv head are sums over its group of query heads. Causal masking is
bottom-right aligned (cuflash._reference.causal_mask). A row that sees no key has P = 0 and contributes
no gradient (its dq row is 0), never NaN.

The analytic backward of O = softmax(scale * Q K^T, masked) V for a loss with dL/dO = dO::

    dV = P^T dO,  dP = dO V^T,  dS = P * (dP - rowsum(dP * P)),  dQ = scale dS K,  dK = scale dS^T Q

With the features of cuflash/_features.py (the forward is cuflash._reference.attention_reference's, with the
dense mask and ALiBi bias of feature_mask_bias):

* the mask and the ALiBi bias change P only (the bias is a constant: slopes get no gradient);
* softcap c: S = c * tanh(S_raw / c), so dS_raw = dS * (1 - tanh(S_raw / c)^2) before the two products;
* sink logits: the sink is an extra key with logit sink[h] and value 0; its dP is 0, so its dS is
  -P_sink * rowsum(dP * P) = -exp(sink - lse) * D with D = rowsum(dO * O), and
  d sink[h] = sum over batch and rows of that;
* padded rows (i >= q_len) and keys past kv_len have P = 0: zero dq rows and zero dk / dv rows.
"""

import numpy as np

from cuflash._reference import _NaiveForward

__all__ = ["attention_grad_reference"]


def _group_sum(x, nheads_kv, rnd):
    """(batch, nheads, seqlen, d) per-query-head gradients -> (batch, seqlen, nheads_kv, d), summed per group."""
    batch, nheads, seqlen, head_dim = x.shape
    x = rnd(x.reshape(batch, nheads_kv, nheads // nheads_kv, seqlen, head_dim).sum(axis=2))
    return np.ascontiguousarray(np.swapaxes(x, 1, 2))


def attention_grad_reference(dout, q, k, v, causal=False, softmax_scale=None, compute_dtype=None, *, q_lengths=None,
                             kv_lengths=None, window=(-1, -1), num_sink_tokens=0, sink_logits=None,
                             alibi_slopes=None, softcap=0.0, delta_out=None):
    """Gradients (dq, dk, dv) of sum(attention(q, k, v) * dout), computed naively (full score matrix).

    delta_out (exact mode only; q's shape): D = rowsum(dO * delta_out) in float64 in place of rowsum(dP *
    P), as FlashAttention's backward forms D from the out it is handed; with the out an implementation
    returned (rounded to the input dtype), the exact gradients that implementation's algorithm aims at.

    compute_dtype=None: exact, in float64 from the (upcast) inputs; returns float64 arrays.
    compute_dtype='input': emulates torch autograd of the naive attention in the input dtype (float16 or
      bfloat16) as on a GPU: every matmul accumulates in float32 and its output is rounded to the input
      dtype; the softmax and its backward run in float32 with outputs rounded to the input dtype. Forward as
      cuflash._reference.attention_reference(..., compute_dtype='input'): S = round(scale * Q K^T) (one op),
      P = round(softmax(S)). Backward, op by op:
        dV_h = round(P^T dO),  dP = round(dO V^T),  dS = round(P * (dP - rowsum(dP * P))),
        [softcap: dS = round(dS * (1 - t^2)), t = the forward's float32 tanh]
        dQ = round(scale * dS K),  dK_h = round(scale * dS^T Q),
      and the GQA repeat's backward sums dK_h, dV_h over the group in float32, rounded once.
      Returns arrays in the input dtype.
    Feature keywords as attention_reference's (see the module docstring for their gradients).
    Shapes: dq like q, dk and dv like k (C-contiguous).
    -> (dq, dk, dv), or (dq, dk, dv, dsink) when sink_logits is given: dsink (nheads,), float64 in exact mode,
    float32 in 'input' mode (there: -sum exp(sink - lse) * rowsum(dO * out) in float32 from the naive input-dtype
    forward's out and float32 lse, i.e. the formula of cuflash/_features.py evaluated on the naive forward).
    """
    dtype = np.asarray(q).dtype
    nheads_kv = np.asarray(k).shape[2]
    fw = _NaiveForward(q, k, v, causal, softmax_scale, compute_dtype, q_lengths, kv_lengths, window,
                       num_sink_tokens, sink_logits, alibi_slopes, softcap)
    rnd, scale, p = fw.rnd, fw.scale, fw.p
    doh = np.swapaxes(np.asarray(dout), 1, 2).astype(fw.acc)

    dv_h = rnd(np.matmul(np.swapaxes(p, -1, -2), doh))
    dp = rnd(np.matmul(doh, np.swapaxes(fw.vh, -1, -2)))
    d_row = (dp * p).sum(axis=-1, keepdims=True)  # = rowsum(dO * O): the sink's value is 0
    if delta_out is not None:
        assert compute_dtype is None, "delta_out: exact mode"
        d_row = (doh * np.swapaxes(np.asarray(delta_out), 1, 2).astype(np.float64)).sum(axis=-1, keepdims=True)
    ds = rnd(p * (dp - d_row))
    if fw.tanh is not None:
        ds = rnd(ds * (1 - fw.tanh * fw.tanh))  # through c * tanh(s / c)
    dq = rnd(scale * np.matmul(ds, fw.kh))
    dk_h = rnd(scale * np.matmul(np.swapaxes(ds, -1, -2), fw.qh))

    dq = np.ascontiguousarray(np.swapaxes(dq, 1, 2))
    dk = _group_sum(dk_h, nheads_kv, rnd)
    dv = _group_sum(dv_h, nheads_kv, rnd)
    if compute_dtype == "input":
        dq, dk, dv = (x.astype(dtype) for x in (dq, dk, dv))
    if sink_logits is None:
        return dq, dk, dv
    # The sink column of dS is -P_sink * D; its sum over batch and rows is d sink[h]. Exact mode: D = rowsum(dP * P)
    # (= rowsum(dO * O)). 'input' mode: the formula of cuflash/_features.py on the naive input-dtype forward,
    # D = rowsum(dO * out) with out rounded to the input dtype, P_sink = exp(sink - lse) from its float32 lse, in
    # float32 (as any implementation that computes D from the returned out, FlashAttention's included, does).
    if compute_dtype == "input":
        d_row = (doh * rnd(np.matmul(p, fw.vh))).sum(axis=-1, keepdims=True)
    dsink = -(fw.p_sink * d_row[..., 0]).sum(axis=(0, 2))
    return dq, dk, dv, dsink
