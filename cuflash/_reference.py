"""Naive attention references and error helpers, used by the tests and the self-check.

Layouts match the public API: q (batch, seqlen_q, nheads, head_dim), k and v
(batch, seqlen_k, nheads_kv, head_dim), out like q, lse (batch, nheads, seqlen_q).
Causal masking is aligned bottom-right (see :func:`causal_mask`). A row that sees
no key gets out = 0 and lse = -inf, never NaN.
"""

import math

import ml_dtypes
import numpy as np

__all__ = ["attention_reference", "causal_mask", "max_abs_err", "check_close"]

_BF16 = np.dtype(ml_dtypes.bfloat16)
_SUPPORTED = (np.dtype(np.float16), _BF16, np.dtype(np.float32), np.dtype(np.float64))


def causal_mask(seqlen_q, seqlen_k):
    """Boolean (seqlen_q, seqlen_k) array, True where query row i sees key j: j <= i + seqlen_k - seqlen_q."""
    rows = np.arange(seqlen_q)[:, None]
    cols = np.arange(seqlen_k)[None, :]
    return cols <= rows + (seqlen_k - seqlen_q)


def _heads_first(x, repeat):
    """(batch, seqlen, heads, d) -> (batch, heads * repeat, seqlen, d), each head repeated `repeat` times."""
    x = np.swapaxes(x, 1, 2)
    if repeat > 1:
        x = np.repeat(x, repeat, axis=1)
    return x


def _masked_softmax(s, visible):
    """Softmax over the last axis of s (float32 or float64) with the keys where `visible` is False removed.

    Returns (p, lse) in s's dtype; rows with no visible key get p = 0 and lse = -inf, without warnings.
    """
    if visible is not None:
        s = np.where(visible, s, -np.inf).astype(s.dtype, copy=False)
    if s.shape[-1] == 0:
        return np.zeros_like(s), np.full(s.shape[:-1], -np.inf, dtype=s.dtype)
    m = s.max(axis=-1, keepdims=True)
    m_safe = np.where(m == -np.inf, 0, m).astype(s.dtype, copy=False)
    e = np.exp(s - m_safe)
    denom = e.sum(axis=-1, keepdims=True)
    has_key = denom > 0
    denom_safe = np.where(has_key, denom, 1).astype(s.dtype, copy=False)
    p = e / denom_safe
    lse = np.where(has_key, m_safe + np.log(denom_safe), -np.inf).astype(s.dtype, copy=False)
    return p, lse[..., 0]


def attention_reference(q, k, v, causal=False, softmax_scale=None, compute_dtype=None):
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
    """
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
    visible = causal_mask(seqlen_q, seqlen_k) if causal else None

    if compute_dtype is None:
        qh = _heads_first(q, 1).astype(np.float64)
        kh = _heads_first(k, group).astype(np.float64)
        vh = _heads_first(v, group).astype(np.float64)
        s = softmax_scale * np.matmul(qh, np.swapaxes(kh, -1, -2))
        p, lse = _masked_softmax(s, visible)
        out = np.matmul(p, vh)
    elif compute_dtype == "input":
        acc = np.float64 if dtype == np.float64 else np.float32
        qh = _heads_first(q, 1).astype(acc)
        kh = _heads_first(k, group).astype(acc)
        vh = _heads_first(v, group).astype(acc)
        # Scores: float32-accumulated GEMM, scaled in float32, rounded once to the input dtype.
        s = (np.matmul(qh, np.swapaxes(kh, -1, -2)) * acc(softmax_scale)).astype(dtype)
        # Softmax in float32 from the rounded scores; P rounded to the input dtype.
        p, lse = _masked_softmax(s.astype(acc), visible)
        p = p.astype(dtype).astype(acc)
        out = np.matmul(p, vh).astype(dtype)
    else:
        raise ValueError(f"compute_dtype must be None or 'input', got {compute_dtype!r}")

    out = np.ascontiguousarray(np.swapaxes(out, 1, 2))
    return out, lse


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
