"""The optional features of attention: lengths, packed batches, window, sinks, ALiBi, softcap.

This module states what each feature means (every implementation follows it: the CUDA kernels, the
NumPy path and the float64 reference in cuflash/_reference.py) and validates the arguments.

Semantics, for batch entry b and query head h (kv head h // (nheads // nheads_kv)):

  lengths   sq_b = q_lengths[b] (default seqlen_q), sk_b = kv_lengths[b] (default seqlen_k). In a
            packed batch (attention_varlen) sq_b = cu_seqlens_q[b+1] - cu_seqlens_q[b], and rows
            cu_seqlens_q[b] + i are the sequence's row i. Query i in [0, sq_b), key j in [0, sk_b).
  alignment i' = i + sk_b - sq_b  (bottom-right, as causal; uses the valid lengths)
  window    (left, right), -1 = unbounded on that side; causal=True sets right = 0.
  visible   visible(i, j) = (right < 0 or j <= i' + right)
                          and (left < 0 or j >= i' - left or j < num_sink_tokens)
            i.e. the first num_sink_tokens keys are exempt from the left bound only: they stay
            subject to causality / the right bound, as in FlexAttention's StreamingLLM mask.
  score     s = softmax_scale * q_i . k_j
            softcap c > 0:  s = c * tanh(s / c)
            ALiBi:          s = s - slope[b, h] * |i' - j|   (slopes (nheads,) or (batch, nheads))
  softmax   denominator_i = sum over visible j of exp(s_ij)  (+ exp(sink_logits[h]) with sink_logits)
            lse_i = log(denominator_i)   (the sink is part of it)
            out_i = sum over visible j of exp(s_ij - lse_i) v_j
            An empty denominator (no visible key and no sink logit) gives out_i = 0, lse_i = -inf.
  padding   rows i >= sq_b of a padded batch: out = 0, lse = -inf, dq = 0; keys j >= sk_b: dk = dv = 0.
            Rows of a packed tensor that belong to no sequence (past cu_seqlens[-1]): out = 0,
            lse = -inf and zero gradients.
  gradient  d sink_logits[h] = -sum over b and valid rows i of exp(sink_logits[h] - lse_i) * D_i,
            D_i = sum_d dout_i * out_i. ALiBi slopes and lengths get no gradient.

Layouts: lse is (batch, nheads, seqlen_q) for `attention`, (nheads, total_q) for
`attention_varlen`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Features:
    """The scalar options, validated and normalized (causal folded into window_right)."""

    window_left: int = -1
    window_right: int = -1
    num_sink_tokens: int = 0
    softcap: float = 0.0  # 0: off
    has_lengths: bool = False  # q_lengths or kv_lengths given, or a packed batch
    has_sink_logits: bool = False
    has_alibi: bool = False


# The array options, in the order of their pointer slots (cuflash/_plan.py) and of every adapter.
ARRAY_OPTIONS = ("q_lengths", "kv_lengths", "cu_seqlens_q", "cu_seqlens_k", "sink_logits", "alibi_slopes")


def _is_int(x) -> bool:
    import numbers

    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _check_int(name, x, minimum):
    if not _is_int(x):
        raise TypeError(f"{name}: expected an int; got {type(x).__name__}")
    if int(x) < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}; got {int(x)}")
    return int(x)


def _check_array(name, x, lib, device, dtype, shapes, shape_text):
    """x: the ArrayInfo of an option array (cuflash/_call.py), or a Foreign for anything else."""
    if x.lib != lib:
        raise TypeError(f"{name}: expected a {lib} array like q; got {x.type_name}")
    if x.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {dtype}; got {x.dtype}")
    if x.shape not in shapes:
        raise ValueError(f"{name}: expected shape {shape_text}; got {x.shape}")
    dv = x.device
    if dv != device and "traced" not in (dv[0], device[0]):
        raise ValueError(f"{name}: on {dv[0]}:{dv[1]}; expected q's device {device[0]}:{device[1]}")


def check_features(lib, device, *, batch, nheads, seqlen_q, seqlen_k, causal, window, num_sink_tokens,
                   softcap, arrays: dict, packed: bool):
    """Validates the feature options of one call and normalizes them.

    arrays: option name -> ArrayInfo (or Foreign) for the array options given (absent ones are left
    out). seqlen_q / seqlen_k: the padded lengths, or max_seqlen_q / max_seqlen_k of a packed batch.
    Only what the call's signature fixes is checked here (types, shapes, dtypes, devices); the
    values of CPU arrays are checked by `check_values_cpu` when the NumPy path runs, and values on
    the GPU are never read back (the kernels clamp them).
    Returns (Features, plain): plain is True when the call is exactly a plain (maybe causal)
    attention, which then takes the plain kernels unchanged (causal = features.window_right == 0).
    """
    if window is None:
        left, right = -1, -1
    else:
        if not isinstance(window, (tuple, list)) or len(window) != 2:
            raise TypeError(f"window: expected a pair (left, right) of ints, -1 for unbounded; got {window!r}")
        left, right = window
        for side, x in (("left", left), ("right", right)):
            if not _is_int(x):
                raise TypeError(f"window: {side} must be an int; got {type(x).__name__} in {window!r}")
            if int(x) < -1:
                raise ValueError(f"window: {side} must be >= 0, or -1 for unbounded; got {int(x)} in {tuple(window)!r}")
        left, right = int(left), int(right)
    if causal:
        if right > 0:
            raise ValueError(f"window: right = {right} conflicts with causal=True, which means right = 0; "
                             f"pass causal=False with window=({left}, {right}) instead")
        right = 0
    sinks = _check_int("num_sink_tokens", num_sink_tokens, 0)
    if softcap is None:
        cap = 0.0
    else:
        if isinstance(softcap, (str, bytes, bool)) or not hasattr(softcap, "__float__"):
            raise TypeError(f"softcap: expected a float > 0 or None; got {type(softcap).__name__}")
        cap = float(softcap)
        if not (math.isfinite(cap) and cap >= 0):
            raise ValueError(f"softcap: expected a finite number > 0 (or None / 0 for off); got {softcap!r}")

    shapes_b = {(batch,)}
    if packed:
        for name in ("cu_seqlens_q", "cu_seqlens_k"):
            _check_array(name, arrays[name], lib, device, "int32", {(batch + 1,)},
                         f"(batch + 1,) = ({batch + 1},), the same for cu_seqlens_q and cu_seqlens_k")
    for name in ("q_lengths", "kv_lengths"):
        x = arrays.get(name)
        if x is not None:
            _check_array(name, x, lib, device, "int32", shapes_b, f"(batch,) = ({batch},)")
    if "sink_logits" in arrays:
        _check_array("sink_logits", arrays["sink_logits"], lib, device, "float32", {(nheads,)},
                     f"(nheads,) = ({nheads},)")
    if "alibi_slopes" in arrays:
        _check_array("alibi_slopes", arrays["alibi_slopes"], lib, device, "float32", {(nheads,), (batch, nheads)},
                     f"(nheads,) = ({nheads},) or (batch, nheads) = ({batch}, {nheads})")

    # Bounds that no row can reach are unbounded: j - i' <= seqlen_q - 1 and i' - j <= seqlen_k - 1.
    if left >= seqlen_k:
        left = -1
    if right >= seqlen_q:
        right = -1
    if left < 0:
        sinks = 0  # the sink tokens only ever lift the left bound
    sinks = min(sinks, seqlen_k)  # beyond the keys there are no more sinks (and the kernels' field is int32)
    has_lengths = packed or "q_lengths" in arrays or "kv_lengths" in arrays
    feats = Features(left, right, sinks, cap, has_lengths, "sink_logits" in arrays, "alibi_slopes" in arrays)
    plain = not has_lengths and left < 0 and right in (-1, 0) and sinks == 0 and cap == 0 \
        and not feats.has_sink_logits and not feats.has_alibi
    return feats, plain


def check_values_cpu(arrays: dict, packed, seqlen_q, seqlen_k, total_q, total_k):
    """Values are checked where they live on the host (NumPy arrays of the NumPy path; name ->
    array). Device arrays are not read back, which would stall the caller's stream; the kernels
    clamp them instead."""
    import numpy as np

    def host(x):
        return np.asarray(x).astype(np.int64)

    if packed:
        for name, total, maxlen in (("cu_seqlens_q", total_q, seqlen_q), ("cu_seqlens_k", total_k, seqlen_k)):
            cu = host(arrays[name])
            lens = np.diff(cu)
            if cu[0] < 0 or (lens < 0).any() or cu[-1] > total:
                raise ValueError(f"{name}: expected non-decreasing offsets from >= 0 to <= {total} (the rows of "
                                 f"{'q' if name.endswith('q') else 'k'}); got {cu.tolist()}")
            if lens.size and lens.max() > maxlen:
                which = "max_seqlen_q" if name.endswith("q") else "max_seqlen_k"
                raise ValueError(f"{name}: a sequence has length {int(lens.max())} > {which} = {maxlen}")
    for name, limit in (("q_lengths", seqlen_q), ("kv_lengths", seqlen_k)):
        x = arrays.get(name)
        if x is not None:
            v = host(x)
            if (v < 0).any() or (v > limit).any():
                raise ValueError(f"{name}: expected values in [0, {limit}]; got {v.tolist()}")
