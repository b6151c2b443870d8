"""Naive attention references and error helpers, used by the tests and the self-check.

Layouts match the public API: q (batch, seqlen_q, nheads, head_dim), k and v
(batch, seqlen_k, nheads_kv, head_dim), out like q, lse (batch, nheads, seqlen_q).
Causal masking is aligned bottom-right (see :func:`causal_mask`). A row that sees
no key gets out = 0 and lse = -inf, never NaN.

The optional features (per-batch lengths, sliding window, sink tokens, sink logits,
ALiBi, softcap) follow cuflash/_features.py to the letter: :func:`feature_mask_bias`
builds the explicit dense visibility mask and ALiBi bias from that module's formulas,
and :func:`attention_reference` applies them to the full score matrix.
"""

import math

import ml_dtypes
import numpy as np

__all__ = ["attention_reference", "causal_mask", "feature_mask_bias", "max_abs_err", "check_close"]

_BF16 = np.dtype(ml_dtypes.bfloat16)
_SUPPORTED = (np.dtype(np.float16), _BF16, np.dtype(np.float32), np.dtype(np.float64))


def causal_mask(seqlen_q, seqlen_k):
    """Boolean (seqlen_q, seqlen_k) array, True where query row i sees key j: j <= i + seqlen_k - seqlen_q."""
    rows = np.arange(seqlen_q)[:, None]
    cols = np.arange(seqlen_k)[None, :]
    return cols <= rows + (seqlen_k - seqlen_q)


def _clamped_lengths(lengths, batch, seqlen):
    """Per-batch valid lengths as int64 (batch,): None -> seqlen; values clamped to [0, seqlen]."""
    if lengths is None:
        return np.full(batch, seqlen, dtype=np.int64)
    lengths = np.asarray(lengths).astype(np.int64).reshape(batch)
    return np.clip(lengths, 0, seqlen)


def _window_bounds(causal, window):
    """(left, right) from the window and causal (causal sets right = 0); any negative bound means unbounded (-1)."""
    left, right = (-1, -1) if window is None else (int(window[0]), int(window[1]))
    if causal:
        right = 0
    return (left if left >= 0 else -1), (right if right >= 0 else -1)


def _slopes_per_batch(alibi_slopes, batch, nheads):
    """ALiBi slopes (nheads,) or (batch, nheads) -> float32 (batch, nheads)."""
    slopes = np.asarray(alibi_slopes, dtype=np.float32)
    if slopes.shape == (nheads,):
        slopes = np.broadcast_to(slopes, (batch, nheads))
    elif slopes.shape != (batch, nheads):
        raise ValueError(f"alibi_slopes must have shape ({nheads},) or ({batch}, {nheads}), got {slopes.shape}")
    return slopes


def _alignment(batch, seqlen_q, seqlen_k, q_lengths, kv_lengths):
    """(sq, sk, ip, j): clamped lengths (batch,), aligned query index i' = i + sk - sq as (batch, seqlen_q, 1),
    key index j as (1, 1, seqlen_k)."""
    sq = _clamped_lengths(q_lengths, batch, seqlen_q)
    sk = _clamped_lengths(kv_lengths, batch, seqlen_k)
    i = np.arange(seqlen_q)[None, :, None]
    j = np.arange(seqlen_k)[None, None, :]
    ip = i + (sk - sq)[:, None, None]
    return sq, sk, ip, j


def feature_mask_bias(batch, nheads, seqlen_q, seqlen_k, causal, q_lengths=None, kv_lengths=None, window=(-1, -1),
                      num_sink_tokens=0, alibi_slopes=None, bias_dtype=np.float64):
    """The dense visibility mask and ALiBi bias of cuflash/_features.py.

    For batch entry b with valid lengths sq = q_lengths[b], sk = kv_lengths[b] (None: the full seqlen; clamped to
    [0, seqlen]), aligned query index i' = i + sk - sq, and (left, right) = window (-1 unbounded; causal sets
    right = 0): query i sees key j iff i < sq, j < sk, (right < 0 or j <= i' + right) and
    (left < 0 or j >= i' - left or j < num_sink_tokens).

    Returns (visible, bias): visible is bool (batch, 1, seqlen_q, seqlen_k) (the same for every head); bias is the
    ALiBi term -slope[b, h] * |i' - j| as (batch, nheads, seqlen_q, seqlen_k) in bias_dtype (float64 by
    default; float32 gives the float32 product of the float32 slope and distance), or None without alibi_slopes.
    alibi_slopes: float32 (nheads,) or (batch, nheads).
    """
    left, right = _window_bounds(causal, window)
    sq, sk, ip, j = _alignment(batch, seqlen_q, seqlen_k, q_lengths, kv_lengths)
    i = np.arange(seqlen_q)[None, :, None]
    visible = (i < sq[:, None, None]) & (j < sk[:, None, None])
    if right >= 0:
        visible = visible & (j <= ip + right)
    if left >= 0:
        visible = visible & ((j >= ip - left) | (j < int(num_sink_tokens)))
    visible = visible[:, None]
    bias = None
    if alibi_slopes is not None:
        slopes = _slopes_per_batch(alibi_slopes, batch, nheads).astype(bias_dtype)
        dist = np.abs(ip - j).astype(bias_dtype)  # (batch, seqlen_q, seqlen_k)
        bias = -(slopes[:, :, None, None] * dist[:, None])
    return visible, bias


def _heads_first(x, repeat):
    """(batch, seqlen, heads, d) -> (batch, heads * repeat, seqlen, d), each head repeated `repeat` times."""
    x = np.swapaxes(x, 1, 2)
    if repeat > 1:
        x = np.repeat(x, repeat, axis=1)
    return x


def _masked_softmax(s, visible, sink=None):
    """Softmax over the last axis of s (float32 or float64) with the keys where `visible` is False removed.

    sink: None, or logits broadcastable to s.shape[:-1] + (1,) that join every row's denominator as an extra
    key (whose probability is not returned). Returns (p, lse) in s's dtype; rows with no visible key and no
    sink get p = 0 and lse = -inf, without warnings.
    """
    if visible is not None:
        s = np.where(visible, s, -np.inf).astype(s.dtype, copy=False)
    if sink is None and s.shape[-1] == 0:
        return np.zeros_like(s), np.full(s.shape[:-1], -np.inf, dtype=s.dtype)
    if s.shape[-1] == 0:
        m = np.full(s.shape[:-1] + (1,), -np.inf, dtype=s.dtype)
    else:
        m = s.max(axis=-1, keepdims=True)
    if sink is not None:
        m = np.maximum(m, sink).astype(s.dtype, copy=False)
    m_safe = np.where(m == -np.inf, 0, m).astype(s.dtype, copy=False)
    e = np.exp(s - m_safe)
    denom = e.sum(axis=-1, keepdims=True)
    if sink is not None:
        denom = denom + np.exp(sink - m_safe)
    has_key = denom > 0
    denom_safe = np.where(has_key, denom, 1).astype(s.dtype, copy=False)
    p = e / denom_safe
    lse = np.where(has_key, m_safe + np.log(denom_safe), -np.inf).astype(s.dtype, copy=False)
    return p, lse[..., 0]


def _has_features(q_lengths, kv_lengths, window, num_sink_tokens, sink_logits, alibi_slopes, softcap):
    left, right = _window_bounds(False, window)
    return (q_lengths is not None or kv_lengths is not None or left >= 0 or right >= 0 or num_sink_tokens > 0
            or sink_logits is not None or alibi_slopes is not None or softcap > 0)


class _NaiveForward:
    """The naive forward's intermediates, shared with the gradient reference (tests/_grad_reference.py).

    Attributes: acc (accumulation dtype), rnd (rounding to the input dtype in 'input' mode, identity otherwise),
    scale (acc), qh (batch, nheads, seqlen_q, d), kh, vh (batch, nheads, seqlen_k, d) with kv heads repeated,
    p (batch, nheads, seqlen_q, seqlen_k) (rounded in 'input' mode), lse (batch, nheads, seqlen_q),
    tanh (the softcap's tanh(s / c) in acc, or None), p_sink (exp(sink - lse) as (batch, nheads, seqlen_q), 0 on
    padded rows and rows with lse = -inf; None without sink logits), pad (bool (batch, 1, seqlen_q): rows >= q_len).
    """

    def __init__(self, q, k, v, causal, softmax_scale, compute_dtype, q_lengths=None, kv_lengths=None,
                 window=(-1, -1), num_sink_tokens=0, sink_logits=None, alibi_slopes=None, softcap=0.0):
        q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
        dtype = q.dtype
        if dtype not in _SUPPORTED:
            raise TypeError(f"unsupported dtype {dtype}")
        if k.dtype != dtype or v.dtype != dtype:
            raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
        batch, seqlen_q, nheads, head_dim = q.shape
        seqlen_k, nheads_kv = k.shape[1], k.shape[2]
        if nheads % nheads_kv != 0:
            raise ValueError(f"nheads {nheads} is not a multiple of nheads_kv {nheads_kv}")
        group = nheads // nheads_kv
        if softmax_scale is None:
            softmax_scale = 1.0 / math.sqrt(head_dim)
        softcap = float(softcap or 0.0)
        if compute_dtype is None:
            acc = np.float64

            def rnd(x):
                return x
        elif compute_dtype == "input":
            acc = np.float64 if dtype == np.float64 else np.float32

            def rnd(x):
                return x.astype(dtype).astype(acc)
        else:
            raise ValueError(f"compute_dtype must be None or 'input', got {compute_dtype!r}")
        self.acc, self.rnd, self.scale = acc, rnd, acc(softmax_scale)

        bias = None
        if _has_features(q_lengths, kv_lengths, window, num_sink_tokens, sink_logits, alibi_slopes, softcap):
            visible, bias = feature_mask_bias(batch, nheads, seqlen_q, seqlen_k, causal, q_lengths, kv_lengths,
                                              window, num_sink_tokens, alibi_slopes, bias_dtype=acc)
            sq = _clamped_lengths(q_lengths, batch, seqlen_q)
            self.pad = np.arange(seqlen_q)[None, None, :] >= sq[:, None, None]
        else:
            visible = causal_mask(seqlen_q, seqlen_k) if causal else None
            self.pad = None
        sink = None
        if sink_logits is not None:
            # float32 sink logits (float64 ones are kept as they are in exact mode, for finite differences).
            sink = np.asarray(sink_logits)
            if compute_dtype is not None or sink.dtype != np.float64:
                sink = sink.astype(np.float32)
            sink = sink.reshape(1, nheads, 1, 1).astype(acc)

        self.qh = _heads_first(q, 1).astype(acc)
        self.kh = _heads_first(k, group).astype(acc)
        self.vh = _heads_first(v, group).astype(acc)
        # Scores: a GEMM accumulated in acc, scaled, rounded once to the input dtype ('input' mode).
        s = rnd(np.matmul(self.qh, np.swapaxes(self.kh, -1, -2)) * self.scale)
        self.tanh = None
        if softcap > 0:
            # Softcap c * tanh(s / c) in acc from the (rounded) score, rounded again.
            self.tanh = np.tanh(s / acc(softcap))
            s = rnd(acc(softcap) * self.tanh)
        if bias is not None:
            s = s + bias  # ALiBi, added in acc
        p, lse = _masked_softmax(s, visible, sink)
        if self.pad is not None:
            lse = np.where(self.pad, -np.inf, lse).astype(acc, copy=False)  # padded rows: lse -inf even with a sink
        self.p = rnd(p)
        self.lse = lse
        self.p_sink = None
        if sink is not None:
            finite = np.isfinite(lse)
            self.p_sink = np.where(finite, np.exp(sink[..., 0] - np.where(finite, lse, 0)), 0).astype(acc)


def attention_reference(q, k, v, causal=False, softmax_scale=None, compute_dtype=None, *, q_lengths=None,
                        kv_lengths=None, window=(-1, -1), num_sink_tokens=0, sink_logits=None, alibi_slopes=None,
                        softcap=0.0):
    """Naive attention: S = scale * Q K^T, masked (bottom-right causal), softmax, O = P V.

    Accepts numpy arrays (float16, ml_dtypes.bfloat16, float32, float64; all three of the same dtype),
    q (batch, seqlen_q, nheads, head_dim), k, v (batch, seqlen_k, nheads_kv, head_dim); GQA/MQA by
    repeating each kv head nheads // nheads_kv times. softmax_scale None means 1/sqrt(head_dim).

    compute_dtype=None: compute in float64; returns (out float64, lse float64).
    compute_dtype='input': emulate the naive computation in the input dtype as torch does it on a GPU:
      S = round(scale * Q K^T) (matmul accumulated in float32, one rounding to the input dtype);
      softmax in float32 from the rounded scores, P rounded to the input dtype; out = round(P V)
      (accumulated in float32). Returns (out in input dtype, lse float32). For float64 inputs the
      accumulation is float64 and lse is float64.
    Rows that see no key: out 0, lse -inf in both modes.

    Features (cuflash/_features.py; all off by default, and then the result is exactly the plain one):
      q_lengths, kv_lengths: int arrays (batch,) of valid lengths (clamped to [0, seqlen]);
      window=(left, right), num_sink_tokens: the visibility rule (see feature_mask_bias);
      sink_logits: float32 (nheads,), an extra key per row with that logit and value 0 (in the lse);
        float64 logits are used unrounded in exact mode;
      alibi_slopes: float32 (nheads,) or (batch, nheads): bias -slope * |i' - j| added to the scores;
      softcap c > 0: scores c * tanh(s / c).
    In 'input' mode the softcap runs in float32 on the rounded score and is rounded again; the ALiBi bias is
    added in float32; the sink joins the float32 softmax. Rows with no visible key and no sink: out 0,
    lse -inf; with a sink: out 0, lse = sink. Padded rows (i >= q_len): out 0 and lse -inf, even with a sink.
    """
    dtype = np.asarray(q).dtype
    fw = _NaiveForward(q, k, v, causal, softmax_scale, compute_dtype, q_lengths, kv_lengths, window,
                       num_sink_tokens, sink_logits, alibi_slopes, softcap)
    out = np.matmul(fw.p, fw.vh)
    if compute_dtype == "input":
        out = out.astype(dtype)
    out = np.ascontiguousarray(np.swapaxes(out, 1, 2))
    return out, fw.lse


def max_abs_err(a, b):
    """max |a - b| over elements, in float64.

    Equal infinities (e.g. lse -inf vs -inf) count as 0 error; a NaN on either side, or an infinity against
    anything else, counts as inf. Empty arrays give 0.
    """
    a = np.asarray(a).astype(np.float64)
    b = np.asarray(b).astype(np.float64)
    if a.shape != b.shape:
        raise ValueError(f"shape mismatch {a.shape} vs {b.shape}")
    if a.size == 0:
        return 0.0
    with np.errstate(invalid="ignore"):
        diff = np.abs(a - b)
    diff = np.where(a == b, 0.0, diff)
    diff = np.where(np.isnan(diff), np.inf, diff)
    return float(diff.max())


def check_close(out, ref64, naive, factor=2.0, floor=1e-5):
    """Accuracy criterion: err(out) <= factor * err(naive) + floor, errors measured against ref64.

    `naive` is the naive computation in the input dtype (attention_reference(..., compute_dtype='input')).
    Returns (ok, message); ok is False whenever out's error is not finite (e.g. out has NaN).
    """
    err_out = max_abs_err(out, ref64)
    err_naive = max_abs_err(naive, ref64)
    bound = factor * err_naive + floor
    ok = bool(np.isfinite(err_out) and err_out <= bound)
    msg = (f"max|out-ref|={err_out:.4g}, max|naive-ref|={err_naive:.4g}, "
           f"bound={bound:.4g} ({factor} * naive + {floor:g})")
    return ok, msg
