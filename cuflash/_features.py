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


@dataclass(frozen=True)
class FeatureArrays:
    """The array options, as the caller's arrays (None = absent)."""

    q_lengths: object = None
    kv_lengths: object = None
    cu_seqlens_q: object = None
    cu_seqlens_k: object = None
    sink_logits: object = None
    alibi_slopes: object = None

    def items(self):
        return [(n, getattr(self, n)) for n in ("q_lengths", "kv_lengths", "cu_seqlens_q", "cu_seqlens_k",
                                                 "sink_logits", "alibi_slopes")]


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
    from . import _interop

    xl = _interop.library_of(x)
    if xl != lib:
        got = f"{type(x).__module__}.{type(x).__qualname__}"
        raise TypeError(f"{name}: expected a {lib} array like q; got {got}")
    dt = _interop.dtype_name(x, lib)
    if dt != dtype:
        raise TypeError(f"{name}: expected dtype {dtype}; got {dt}")
    shape = tuple(int(s) for s in x.shape)
    if shape not in shapes:
        raise ValueError(f"{name}: expected shape {shape_text}; got {shape}")
    dv = _interop.device_of(x, lib)
    if dv != device and "traced" not in (dv[0], device[0]):
        raise ValueError(f"{name}: on {dv[0]}:{dv[1]}; expected q's device {device[0]}:{device[1]}")


def check_features(lib, device, *, batch, nheads, seqlen_q, seqlen_k, causal, window, num_sink_tokens,
                   softcap, arrays: FeatureArrays, packed: bool, total_q=None, total_k=None):
    """Validates the feature options of one call and normalizes them.

    seqlen_q / seqlen_k: the padded lengths, or max_seqlen_q / max_seqlen_k of a packed batch.
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
            _check_array(name, getattr(arrays, name), lib, device, "int32", {(batch + 1,)},
                         f"(batch + 1,) = ({batch + 1},), the same for cu_seqlens_q and cu_seqlens_k")
    for name in ("q_lengths", "kv_lengths"):
        x = getattr(arrays, name)
        if x is not None:
            _check_array(name, x, lib, device, "int32", shapes_b, f"(batch,) = ({batch},)")
    if arrays.sink_logits is not None:
        _check_array("sink_logits", arrays.sink_logits, lib, device, "float32", {(nheads,)},
                     f"(nheads,) = ({nheads},)")
    if arrays.alibi_slopes is not None:
        _check_array("alibi_slopes", arrays.alibi_slopes, lib, device, "float32", {(nheads,), (batch, nheads)},
                     f"(nheads,) = ({nheads},) or (batch, nheads) = ({batch}, {nheads})")

    if device[0] == "cpu":
        _check_values_cpu(arrays, packed, seqlen_q, seqlen_k, total_q, total_k)

    # Bounds that no row can reach are unbounded: j - i' <= seqlen_q - 1 and i' - j <= seqlen_k - 1.
    if left >= seqlen_k:
        left = -1
    if right >= seqlen_q:
        right = -1
    if left < 0:
        sinks = 0  # the sink tokens only ever lift the left bound
    has_lengths = packed or arrays.q_lengths is not None or arrays.kv_lengths is not None
    feats = Features(left, right, sinks, cap, has_lengths, arrays.sink_logits is not None,
                     arrays.alibi_slopes is not None)
    plain = not has_lengths and left < 0 and right in (-1, 0) and sinks == 0 and cap == 0 \
        and not feats.has_sink_logits and not feats.has_alibi
    return feats, plain


def _check_values_cpu(arrays: FeatureArrays, packed, seqlen_q, seqlen_k, total_q, total_k):
    """Values are checked where they live on the host (NumPy / CPU arrays). Device arrays are not
    read back, which would stall the caller's stream; the kernels clamp them instead."""
    import numpy as np

    from . import _interop

    def host(x):
        lib = _interop.library_of(x)
        return np.asarray(_interop.to_numpy(x, lib)).astype(np.int64)

    if packed:
        for name, total, maxlen in (("cu_seqlens_q", total_q, seqlen_q), ("cu_seqlens_k", total_k, seqlen_k)):
            cu = host(getattr(arrays, name))
            lens = np.diff(cu)
            if cu[0] < 0 or (lens < 0).any() or cu[-1] > total:
                raise ValueError(f"{name}: expected non-decreasing offsets from >= 0 to <= {total} (the rows of "
                                 f"{'q' if name.endswith('q') else 'k'}); got {cu.tolist()}")
            if lens.size and lens.max() > maxlen:
                which = "max_seqlen_q" if name.endswith("q") else "max_seqlen_k"
                raise ValueError(f"{name}: a sequence has length {int(lens.max())} > {which} = {maxlen}")
    for name, limit in (("q_lengths", seqlen_q), ("kv_lengths", seqlen_k)):
        x = getattr(arrays, name)
        if x is not None:
            v = host(x)
            if (v < 0).any() or (v > limit).any():
                raise ValueError(f"{name}: expected values in [0, {limit}]; got {v.tolist()}")


def lengths_from_padding_mask(mask):
    """Valid lengths from a boolean padding mask, the form transformers passes.

    Args:
        mask: (batch, seqlen) bool (or 0/1 integers), True / 1 where the token is real; each row
            must be right-padded: ones, then zeros. torch, JAX, CuPy or NumPy.
    Returns:
        int32 (batch,) lengths, the mask's kind of array on its device: pass them as q_lengths /
        kv_lengths.
    Raises:
        ValueError if a row is not right-padded (a 0 before a 1: left padding or a hole); this
        check reads one flag back from the device.
        TypeError for an unsupported array or dtype.
    """
    from . import _interop

    lib = _interop.library_of(mask)
    if lib is None:
        raise TypeError(f"mask: expected a torch.Tensor, jax.Array, cupy.ndarray or numpy.ndarray; got "
                        f"{type(mask).__module__}.{type(mask).__qualname__}")
    if len(mask.shape) != 2:
        raise ValueError(f"mask: expected 2 dimensions (batch, seqlen); got shape {tuple(mask.shape)}")
    dt = _interop.dtype_name(mask, lib)
    if dt != "bool" and not dt.startswith(("int", "uint")):
        raise TypeError(f"mask: expected a bool (or 0/1 integer) array; got dtype {dt}")
    if lib == "torch":
        import torch

        m = mask.to(torch.bool)
        lengths = m.sum(dim=1, dtype=torch.int32)
        pos = torch.arange(m.shape[1], device=m.device)
        ok = bool(torch.equal(m, pos[None, :] < lengths[:, None]))
    else:
        xp = _array_module(lib)
        m = xp.asarray(mask).astype(bool)
        lengths = m.sum(axis=1).astype(xp.int32)
        pos = xp.arange(m.shape[1])
        ok = bool(xp.all(m == (pos[None, :] < lengths[:, None])))
    if not ok:
        raise ValueError("mask: expected right padding (each row: True for the real tokens, then False); "
                         "a row has a False before a True (left padding or a hole)")
    return lengths


def _array_module(lib):
    if lib == "cupy":
        import cupy

        return cupy
    if lib == "jax":
        import jax.numpy as jnp

        return jnp
    import numpy

    return numpy
