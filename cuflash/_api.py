"""The public entry points: argument checks first, then the GPU kernels or the NumPy path."""

from __future__ import annotations

import math

from . import _interop
from ._config import HEAD_DIMS
from ._features import FeatureArrays, Features, check_features

SUPPORTED_DTYPES = ("float16", "bfloat16")
_NAMES = ("q", "k", "v")


def _check_inputs(q, k, v, causal, softmax_scale):
    """Validates everything that does not need a device. Returns (lib, device, dtype, scale)."""
    libs = [_interop.library_of(x) for x in (q, k, v)]
    for name, x, lib in zip(_NAMES, (q, k, v), libs):
        if lib is None:
            raise TypeError(f"{name}: expected a torch.Tensor, jax.Array, cupy.ndarray or numpy.ndarray; "
                            f"got {type(x).__module__}.{type(x).__qualname__}")
    if len(set(libs)) != 1:
        got = ", ".join(f"{n} is {lib}" for n, lib in zip(_NAMES, libs))
        raise TypeError(f"q, k and v must come from one array library; got {got}")
    lib = libs[0]

    for name, x in zip(_NAMES, (q, k, v)):
        if len(x.shape) != 4:
            layout = "(batch, seqlen_q, nheads, head_dim)" if name == "q" else "(batch, seqlen_k, nheads_kv, head_dim)"
            raise ValueError(f"{name}: expected 4 dimensions {layout}; got shape {tuple(x.shape)}")

    dtypes = [_interop.dtype_name(x, lib) for x in (q, k, v)]
    for name, dt in zip(_NAMES, dtypes):
        if dt not in SUPPORTED_DTYPES:
            raise TypeError(f"{name}: dtype {dt} is not supported; expected float16 or bfloat16")
    if len(set(dtypes)) != 1:
        raise TypeError(f"q, k and v must have one dtype; got q {dtypes[0]}, k {dtypes[1]}, v {dtypes[2]}")

    b, sq, h, d = (int(s) for s in q.shape)
    bk, sk, hk, dk = (int(s) for s in k.shape)
    if tuple(k.shape) != tuple(v.shape):
        raise ValueError(f"v: expected the shape of k {tuple(k.shape)}; got {tuple(v.shape)}")
    if bk != b:
        raise ValueError(f"k: batch {bk} differs from q's batch {b} (q shape {tuple(q.shape)}, k shape {tuple(k.shape)})")
    if dk != d:
        raise ValueError(f"k: head_dim {dk} differs from q's head_dim {d} (q shape {tuple(q.shape)}, k shape {tuple(k.shape)})")
    if d not in HEAD_DIMS:
        raise ValueError(f"q: head_dim {d} is not supported; expected a multiple of 8 from 8 to 256 (q shape {tuple(q.shape)})")
    if hk < 1 or h % hk != 0:
        raise ValueError(f"k: nheads_kv {hk} must divide q's nheads {h} (MQA/GQA); q shape {tuple(q.shape)}, k shape {tuple(k.shape)}")
    for name, x in (("q", q), ("k", k)):
        if min(int(s) for s in x.shape) < 1:
            raise ValueError(f"{name}: every dimension must be at least 1; got shape {tuple(x.shape)}")

    devices = [_interop.device_of(x, lib) for x in (q, k, v)]
    # Under jax.grad only the differentiated arguments are traced: compare the concrete ones.
    concrete = [dv for dv in devices if dv[0] != "traced"]
    if len(set(concrete)) > 1:
        got = ", ".join(f"{n} on {dv[0]}:{dv[1]}" for n, dv in zip(_NAMES, devices))
        raise ValueError(f"q, k and v must be on one device; got {got}")
    device = devices[0]
    if device[0] == "traced" and lib == "jax":
        pass  # under a JAX transformation; cuflash/_jax.py decides what it supports
    elif device[0] not in ("cpu", "cuda"):
        raise ValueError(f"q: arrays on {device[0]} are not supported; expected a CUDA GPU or the CPU")

    if not isinstance(causal, bool) and type(causal).__name__ != "bool_":
        raise TypeError(f"causal: expected a bool; got {type(causal).__name__}")
    if softmax_scale is None:
        scale = 1.0 / math.sqrt(d)
    else:
        if isinstance(softmax_scale, (str, bytes, bool)) or not hasattr(softmax_scale, "__float__"):
            raise TypeError(f"softmax_scale: expected a float or None; got {type(softmax_scale).__name__}")
        scale = float(softmax_scale)
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"softmax_scale: expected a finite number > 0; got {softmax_scale!r}")
    return lib, device, dtypes[0], scale


def attention(q, k, v, causal: bool = False, softmax_scale: float | None = None, return_lse: bool = False,
              deterministic: bool = False, *, q_lengths=None, kv_lengths=None, window=None, num_sink_tokens: int = 0,
              sink_logits=None, alibi_slopes=None, softcap: float | None = None):
    """Exact attention, softmax(scale * Q K^T) V, computed FlashAttention-style: tiled, online softmax,
    no seqlen_q x seqlen_k matrix in memory.

    Args:
        q: (batch, seqlen_q, nheads, head_dim)
        k: (batch, seqlen_k, nheads_kv, head_dim)
        v: (batch, seqlen_k, nheads_kv, head_dim)
            float16 or bfloat16; head_dim a multiple of 8 from 8 to 256; nheads a multiple of
            nheads_kv (MQA / GQA: query head h uses kv head h // (nheads // nheads_kv)).
            torch tensors, JAX arrays, CuPy arrays or NumPy arrays, all of one kind and on one
            device. CUDA arrays run the tensor-core kernels on the caller's current stream; CPU
            arrays (NumPy, torch or JAX on the CPU) run the NumPy implementation.
            Any strides with a contiguous last dimension are used in place, e.g. a torch
            (batch, nheads, seqlen, head_dim) tensor passed as ``.transpose(1, 2)``. An input whose
            last dimension is not contiguous, or (on the GPU) whose pointer or strides are not
            16-byte aligned, is copied first.
        causal: mask aligned to the bottom-right corner, as in flash-attn >= 2.1: query row i sees
            key j iff j <= i + seqlen_k - seqlen_q. For seqlen_q = 2, seqlen_k = 5 (1 = kept)::

                1 1 1 1 0
                1 1 1 1 1

            and for seqlen_q = 5, seqlen_k = 2::

                0 0
                0 0
                0 0
                1 0
                1 1

            A row that sees no key gets out = 0 and lse = -inf.
        softmax_scale: multiplies Q K^T before the softmax; default 1 / sqrt(head_dim). Must be > 0.
        return_lse: also return lse.
        deterministic: passed to the backward pass (see `attention_backward`) when gradients are
            taken through this call.
        q_lengths, kv_lengths: int32 (batch,) arrays of q's library on q's device: the valid query
            rows and keys of each batch entry (a padded batch). Keys at or past kv_lengths[b] are
            masked; query rows at or past q_lengths[b] get out = 0, lse = -inf and zero gradients.
            Causal and window alignment use the valid lengths. `lengths_from_padding_mask` makes
            them from a (batch, seqlen) padding mask. Values on the GPU are not read back (that
            would stall the stream): the kernels clamp them to [0, seqlen]; CPU values are checked.
        window: (left, right): query row i sees keys [i' - left, i' + right], i' = i + sk - sq the
            bottom-right aligned position (as causal); -1 = unbounded on that side. causal=True
            is window right = 0 (a right > 0 with causal=True is a ValueError).
        num_sink_tokens: the first n keys stay visible to every query in addition to the window
            (StreamingLLM); they lift the left bound only, never causality / the right bound.
        sink_logits: float32 (nheads,), one learned logit per head (gpt-oss): exp(sink_logits[h])
            joins every row's softmax denominator without a value. Differentiable (torch autograd,
            JAX, and `attention_backward` returns its gradient).
        alibi_slopes: float32 (nheads,) or (batch, nheads): adds -slope * |i' - j| to the scores.
        softcap: c > 0: scores become c * tanh(scores / c) before the softmax (Gemma); None or 0
            is off.

    Gradients: torch tensors that require grad record an autograd node (saving q, k, v, out and
    lse, never the probabilities); the op is a torch.library custom op, so torch.compile traces it
    without a graph break. JAX arrays work with jax.grad / jax.vjp in eager mode (jax.custom_vjp);
    under jax.jit the call raises NotImplementedError. lse is not differentiable: no gradient flows
    back through it.

    Every combination of the options is accepted. Calls that use none of them (or only a window
    equivalent to plain / causal attention) run the plain kernels; the others run the feature
    kernels (mma.sync on every GPU, Hopper included), which visit only the tiles the mask leaves
    visible.

    Returns:
        out: q's shape and dtype, the caller's kind of array on q's device.
        lse (if return_lse): (batch, nheads, seqlen_q) float32, the natural-log logsumexp of each
            row of scaled, masked scores (the sink logit included).

    Raises:
        TypeError / ValueError naming the argument, before anything runs on the device.
    """
    lib, device, dtype, scale = _check_inputs(q, k, v, causal, softmax_scale)
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse: expected a bool; got {type(return_lse).__name__}")
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic: expected a bool; got {type(deterministic).__name__}")
    if _any_feature(q_lengths, kv_lengths, window, num_sink_tokens, sink_logits, alibi_slopes, softcap):
        feats, plain, arrays = _padded_features(q, k, lib, device, causal, q_lengths, kv_lengths, window,
                                                num_sink_tokens, sink_logits, alibi_slopes, softcap)
        if not plain:
            out, lse = _feature_forward(q, k, v, lib, device, dtype, scale, feats, arrays, None, deterministic)
            return (out, lse) if return_lse else out
        causal = feats.window_right == 0  # a window (-1, 0) is causal attention
    if lib == "torch":
        import torch

        from . import _torch  # noqa: F401  (registers torch.ops.cuflash.*)

        out, lse = torch.ops.cuflash.attention_fwd(q, k, v, bool(causal), scale, deterministic)
    elif lib == "jax":
        from . import _jax

        out, lse = _jax.attention(q, k, v, bool(causal), scale, deterministic)
    else:
        out, lse = forward_impl(q, k, v, lib, device, dtype, bool(causal), scale)
    return (out, lse) if return_lse else out


def forward_impl(q, k, v, lib, device, dtype, causal, scale):
    """The forward on validated, concrete arrays of one library: (out, lse)."""
    if device[0] == "cpu":
        return _attention_cpu(q, k, v, lib, causal, scale)
    return _attention_gpu(q, k, v, lib, device[1], dtype, causal, scale)


def _attention_cpu(q, k, v, lib, causal, scale):
    from ._cpu import attention_forward_numpy

    qn, kn, vn = (_interop.to_numpy(x, lib) for x in (q, k, v))
    out, lse = attention_forward_numpy(qn, kn, vn, causal, scale)
    return _interop.from_numpy(out, lib, like=q), _interop.from_numpy(lse, lib, like=q)


def _needs_copy(t) -> bool:
    """True when the kernel cannot read the array in place: the last dimension is not unit-stride,
    or a row / head / batch step or the base pointer is not 16-byte aligned (cp.async moves 16 B)."""
    return t.strides[3] != 1 or t.ptr % 16 != 0 or any(s % 8 != 0 for s in t.strides[:3])


def _attention_gpu(q, k, v, lib, device_id, dtype, causal, scale):
    from . import _launch
    from ._gpu import compute_capability

    ctx = _interop.GpuContext(lib, device_id)
    views = []
    for x in (q, k, v):
        t = ctx.view(x)
        if _needs_copy(t):
            t = ctx.view(ctx.contiguous(x))
        views.append(t)
    qv, kv, vv = views
    b, sq, h, d = qv.shape
    out, ov = ctx.empty((b, sq, h, d), dtype)
    lse, lv = ctx.empty((b, h, sq), "float32")
    _launch.launch_fwd(qv, kv, vv, ov, lv.ptr, dtype, causal, scale, device_id,
                       compute_capability(device_id), ctx.stream_ptr)
    return ctx.export(out), ctx.export(lse)


def _check_backward_inputs(dout, q, k, v, out, lse, causal, softmax_scale, deterministic):
    lib, device, dtype, scale = _check_inputs(q, k, v, causal, softmax_scale)
    for name, x in (("dout", dout), ("out", out), ("lse", lse)):
        xl = _interop.library_of(x)
        if xl != lib:
            raise TypeError(f"{name}: expected a {lib} array like q; got "
                            f"{type(x).__module__}.{type(x).__qualname__}")
        if _interop.device_of(x, lib) != device:
            dv = _interop.device_of(x, lib)
            raise ValueError(f"{name}: on {dv[0]}:{dv[1]}; expected q's device {device[0]}:{device[1]}")
    b, sq, h, d = (int(n) for n in q.shape)
    for name, x in (("dout", dout), ("out", out)):
        if tuple(x.shape) != (b, sq, h, d):
            raise ValueError(f"{name}: expected q's shape {(b, sq, h, d)}; got {tuple(x.shape)}")
        if _interop.dtype_name(x, lib) != dtype:
            raise TypeError(f"{name}: expected q's dtype {dtype}; got {_interop.dtype_name(x, lib)}")
    if tuple(lse.shape) != (b, h, sq):
        raise ValueError(f"lse: expected shape (batch, nheads, seqlen_q) = {(b, h, sq)}; got {tuple(lse.shape)}")
    if _interop.dtype_name(lse, lib) != "float32":
        raise TypeError(f"lse: expected float32; got {_interop.dtype_name(lse, lib)}")
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic: expected a bool; got {type(deterministic).__name__}")
    return lib, device, dtype, scale


def attention_backward(dout, q, k, v, out, lse, causal: bool = False, softmax_scale: float | None = None,
                       deterministic: bool = False, *, q_lengths=None, kv_lengths=None, window=None,
                       num_sink_tokens: int = 0, sink_logits=None, alibi_slopes=None, softcap: float | None = None):
    """Gradients of attention by recomputation: returns (dq, dk, dv).

    Args:
        dout: gradient of the loss with respect to out, q's shape and dtype.
        q, k, v, causal, softmax_scale and the feature options (q_lengths ... softcap): as given
            to `attention`.
        out, lse: what `attention(..., return_lse=True)` returned for them.
        deterministic: if True, dq, dk and dv are bitwise identical from run to run. dK and dV are
            always computed without atomics (a GQA group is summed inside one thread block). dQ has
            two implementations: float atomics inside the dK/dV kernel (run-to-run order varies), or
            a separate kernel over the forward's partition, which recomputes Q K^T and dO V^T but
            needs no atomics. On Hopper (sm_90a) at head_dim 64 and 128, the wgmma dK/dV kernel
            computes dQ from the dS it already holds and adds it with float atomics, and that is
            what deterministic=False runs; deterministic=True runs the separate pass instead (on
            an H100, bf16, batch 4, seqlen 4096, head_dim 128: 370 against 265 TFLOP/s, causal 311
            against 225; bench/NOTES.md). Elsewhere both settings run the separate pass, which
            measured faster there than the mma.sync kernel's atomics (cuflash/_config.py:
            BWD_ATOMIC_DQ), so deterministic=True costs nothing.

    Returns:
        dq, dk, dv with the shapes and dtype of q, k, v (dk and dv summed over the query heads of
        each GQA group), the caller's kind of array. Rows that see no key contribute zero gradient.
        With sink_logits, a fourth result: d sink_logits, float32 (nheads,).
    """
    lib, device, dtype, scale = _check_backward_inputs(dout, q, k, v, out, lse, causal, softmax_scale, deterministic)
    if device[0] == "traced":
        from ._jax import jit_error

        raise jit_error("attention_backward")
    if _any_feature(q_lengths, kv_lengths, window, num_sink_tokens, sink_logits, alibi_slopes, softcap):
        feats, plain, arrays = _padded_features(q, k, lib, device, causal, q_lengths, kv_lengths, window,
                                                num_sink_tokens, sink_logits, alibi_slopes, softcap)
        if not plain:
            grads = backward_feat_impl(dout, q, k, v, out, lse, lib, device, dtype, scale, feats, arrays, None,
                                       deterministic)
            return grads if sink_logits is not None else grads[:3]
        causal = feats.window_right == 0
    return backward_impl(dout, q, k, v, out, lse, lib, device, dtype, bool(causal), scale, deterministic)


def backward_impl(dout, q, k, v, out, lse, lib, device, dtype, causal, scale, deterministic):
    """The backward on validated, concrete arrays of one library: (dq, dk, dv)."""
    if device[0] == "cpu":
        from ._cpu_backward import attention_backward_numpy

        arrs = [_interop.to_numpy(x, lib) for x in (dout, q, k, v, out, lse)]
        grads = attention_backward_numpy(*arrs, causal, scale)
        return tuple(_interop.from_numpy(g, lib, like=q) for g in grads)
    return _attention_backward_gpu(dout, q, k, v, out, lse, lib, device[1], dtype, causal, scale, deterministic)


def _attention_backward_gpu(dout, q, k, v, out, lse, lib, device_id, dtype, causal, scale, deterministic):
    from . import _config, _launch
    from ._gpu import compute_capability

    ctx = _interop.GpuContext(lib, device_id)
    views = []
    for x in (dout, q, k, v, out):
        t = ctx.view(x)
        if _needs_copy(t):
            t = ctx.view(ctx.contiguous(x))
        views.append(t)
    dov, qv, kv, vv, ov = views
    lv = ctx.view(lse)
    b, sq, h, d = qv.shape
    if lv.strides != (h * sq, sq, 1):
        lv = ctx.view(ctx.contiguous(lse))
    dq, dqv = ctx.empty(tuple(qv.shape), dtype)
    dk, dkv = ctx.empty(tuple(kv.shape), dtype)
    dv, dvv = ctx.empty(tuple(vv.shape), dtype)
    cc = compute_capability(device_id)
    target = _config.compile_arch(*cc)
    atomic = _launch.bwd_uses_atomics(deterministic, target, d)
    n_rows, n_acc = _launch.bwd_scratch_sizes(b, h, sq, d, atomic, target)
    _rows_buf, rows = ctx.empty((n_rows,), "float32")
    acc_ptr = 0
    if n_acc:
        _acc_buf, acc = ctx.empty((n_acc,), "float32")
        acc_ptr = acc.ptr
    _launch.launch_bwd(dov, qv, kv, vv, ov, lv.ptr, dqv, dkv, dvv, rows.ptr, acc_ptr, dtype, causal, scale,
                       atomic, device_id, cc, ctx.stream_ptr)
    return ctx.export(dq), ctx.export(dk), ctx.export(dv)


# ------------------------------------------------------------------------------------------------
# The optional features (cuflash/_features.py): padded and packed batches, window, sinks, ALiBi,
# softcap. `packed` is (max_seqlen_q, max_seqlen_k) for attention_varlen, else None.
# ------------------------------------------------------------------------------------------------

def _any_feature(q_lengths, kv_lengths, window, num_sink_tokens, sink_logits, alibi_slopes, softcap) -> bool:
    """Whether any option is set: a plain call skips their checks (it is host time on every call)."""
    return not (q_lengths is None and kv_lengths is None and window is None and sink_logits is None
                and alibi_slopes is None and softcap is None and type(num_sink_tokens) is int
                and num_sink_tokens == 0)


def _padded_features(q, k, lib, device, causal, q_lengths, kv_lengths, window, num_sink_tokens, sink_logits,
                     alibi_slopes, softcap):
    """check_features for a padded (4-D) call: (Features, plain, FeatureArrays)."""
    b, sq, h, _ = (int(n) for n in q.shape)
    arrays = FeatureArrays(q_lengths=q_lengths, kv_lengths=kv_lengths, sink_logits=sink_logits,
                           alibi_slopes=alibi_slopes)
    feats, plain = check_features(lib, device, batch=b, nheads=h, seqlen_q=sq, seqlen_k=int(k.shape[1]),
                                  causal=bool(causal), window=window, num_sink_tokens=num_sink_tokens,
                                  softcap=softcap, arrays=arrays, packed=False)
    return feats, plain, arrays


def _check_varlen_inputs(q, k, v, causal, softmax_scale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    """Validates a packed call: 3-D q, k, v, then the checks of `attention` on their 4-D views."""
    for name, x in zip(_NAMES, (q, k, v)):
        if _interop.library_of(x) is not None and len(x.shape) != 3:
            layout = "(total_q, nheads, head_dim)" if name == "q" else "(total_k, nheads_kv, head_dim)"
            raise ValueError(f"{name}: expected 3 dimensions {layout} (a packed batch); got shape {tuple(x.shape)}")
    lib, device, dtype, scale = _check_inputs(*(x if _interop.library_of(x) is None else x[None] for x in (q, k, v)),
                                              causal, softmax_scale)
    mq = _feat_int("max_seqlen_q", max_seqlen_q)
    mk = _feat_int("max_seqlen_k", max_seqlen_k)
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if _interop.library_of(cu) is None:
            raise TypeError(f"{name}: expected an int32 {lib} array of shape (batch + 1,); got "
                            f"{type(cu).__module__}.{type(cu).__qualname__}")
        if len(cu.shape) != 1 or int(cu.shape[0]) < 2:
            raise ValueError(f"{name}: expected shape (batch + 1,) with batch >= 1; got {tuple(cu.shape)}")
    if int(cu_seqlens_q.shape[0]) != int(cu_seqlens_k.shape[0]):
        raise ValueError(f"cu_seqlens_k: expected the shape of cu_seqlens_q {tuple(cu_seqlens_q.shape)}; "
                         f"got {tuple(cu_seqlens_k.shape)}")
    return lib, device, dtype, scale, (mq, mk)


def _feat_int(name, x):
    from ._features import _check_int

    return _check_int(name, x, 0)


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                     causal: bool = False, softmax_scale: float | None = None, return_lse: bool = False,
                     deterministic: bool = False, *, window=None, num_sink_tokens: int = 0, sink_logits=None,
                     alibi_slopes=None, softcap: float | None = None):
    """Attention over a packed batch of sequences of different lengths (flash-attn's varlen form).

    Args:
        q: (total_q, nheads, head_dim); k, v: (total_k, nheads_kv, head_dim). Sequence b owns rows
            [cu_seqlens_q[b], cu_seqlens_q[b + 1]) of q and [cu_seqlens_k[b], cu_seqlens_k[b + 1])
            of k and v.
        cu_seqlens_q, cu_seqlens_k: int32 (batch + 1,) non-decreasing offsets, q's library and
            device. Sequences of length 0 are allowed. Rows past cu_seqlens[-1] belong to no
            sequence: out = 0, lse = -inf and zero gradients there.
        max_seqlen_q, max_seqlen_k: ints >= every sequence's length (they size the grid; values
            on the GPU are not read back, and a longer sequence is cut to them).
        causal, softmax_scale, deterministic, window, num_sink_tokens, sink_logits, alibi_slopes
            (float32 (nheads,) or (batch, nheads)), softcap: as for `attention`, per sequence.
    Returns:
        out (total_q, nheads, head_dim), and with return_lse lse (nheads, total_q) float32.
    Gradients flow as for `attention` (torch autograd, JAX eager); `attention_varlen_backward`
    computes them directly.
    """
    lib, device, dtype, scale, packed = _check_varlen_inputs(q, k, v, causal, softmax_scale, cu_seqlens_q,
                                                             cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    for name, x in (("return_lse", return_lse), ("deterministic", deterministic)):
        if not isinstance(x, bool):
            raise TypeError(f"{name}: expected a bool; got {type(x).__name__}")
    arrays = FeatureArrays(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, sink_logits=sink_logits,
                           alibi_slopes=alibi_slopes)
    feats, _ = check_features(lib, device, batch=int(cu_seqlens_q.shape[0]) - 1, nheads=int(q.shape[1]),
                              seqlen_q=packed[0], seqlen_k=packed[1], causal=bool(causal), window=window,
                              num_sink_tokens=num_sink_tokens, softcap=softcap, arrays=arrays, packed=True,
                              total_q=int(q.shape[0]), total_k=int(k.shape[0]))
    out, lse = _feature_forward(q, k, v, lib, device, dtype, scale, feats, arrays, packed, deterministic)
    return (out, lse) if return_lse else out


def attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int,
                              max_seqlen_k: int, causal: bool = False, softmax_scale: float | None = None,
                              deterministic: bool = False, *, window=None, num_sink_tokens: int = 0,
                              sink_logits=None, alibi_slopes=None, softcap: float | None = None):
    """Gradients of `attention_varlen`: (dq, dk, dv), plus d sink_logits (float32 (nheads,)) when
    sink_logits is given. dout and out are (total_q, nheads, head_dim), lse (nheads, total_q)."""
    lib, device, dtype, scale, packed = _check_varlen_inputs(q, k, v, causal, softmax_scale, cu_seqlens_q,
                                                             cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if device[0] == "traced":
        from ._jax import jit_error

        raise jit_error("attention_varlen_backward")
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic: expected a bool; got {type(deterministic).__name__}")
    _check_grad_arrays(dout, out, lse, q, lib, device, dtype, (int(q.shape[1]), int(q.shape[0])),
                       "(nheads, total_q)")
    arrays = FeatureArrays(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, sink_logits=sink_logits,
                           alibi_slopes=alibi_slopes)
    feats, _ = check_features(lib, device, batch=int(cu_seqlens_q.shape[0]) - 1, nheads=int(q.shape[1]),
                              seqlen_q=packed[0], seqlen_k=packed[1], causal=bool(causal), window=window,
                              num_sink_tokens=num_sink_tokens, softcap=softcap, arrays=arrays, packed=True,
                              total_q=int(q.shape[0]), total_k=int(k.shape[0]))
    grads = backward_feat_impl(dout, q, k, v, out, lse, lib, device, dtype, scale, feats, arrays, packed,
                               deterministic)
    return grads if sink_logits is not None else grads[:3]


def _check_grad_arrays(dout, out, lse, q, lib, device, dtype, lse_shape, lse_text):
    for name, x in (("dout", dout), ("out", out), ("lse", lse)):
        if _interop.library_of(x) != lib:
            raise TypeError(f"{name}: expected a {lib} array like q; got {type(x).__module__}.{type(x).__qualname__}")
        if _interop.device_of(x, lib) != device:
            dv = _interop.device_of(x, lib)
            raise ValueError(f"{name}: on {dv[0]}:{dv[1]}; expected q's device {device[0]}:{device[1]}")
    for name, x in (("dout", dout), ("out", out)):
        if tuple(x.shape) != tuple(q.shape):
            raise ValueError(f"{name}: expected q's shape {tuple(q.shape)}; got {tuple(x.shape)}")
        if _interop.dtype_name(x, lib) != dtype:
            raise TypeError(f"{name}: expected q's dtype {dtype}; got {_interop.dtype_name(x, lib)}")
    if tuple(lse.shape) != lse_shape:
        raise ValueError(f"lse: expected shape {lse_text} = {lse_shape}; got {tuple(lse.shape)}")
    if _interop.dtype_name(lse, lib) != "float32":
        raise TypeError(f"lse: expected float32; got {_interop.dtype_name(lse, lib)}")


def _feature_forward(q, k, v, lib, device, dtype, scale, feats: Features, arrays: FeatureArrays, packed,
                     deterministic):
    """Routes a feature call to the library's adapter (autograd) or straight to the implementation."""
    if lib == "torch":
        from . import _torch

        return _torch.attention_features(q, k, v, scale, feats, arrays, packed, deterministic)
    if lib == "jax":
        from . import _jax

        return _jax.attention_features(q, k, v, scale, feats, arrays, packed, deterministic)
    return forward_feat_impl(q, k, v, lib, device, dtype, scale, feats, arrays, packed)


def forward_feat_impl(q, k, v, lib, device, dtype, scale, feats: Features, arrays: FeatureArrays, packed):
    """The feature forward on validated, concrete arrays of one library: (out, lse)."""
    if device[0] == "cpu":
        return _forward_feat_cpu(q, k, v, lib, scale, feats, arrays, packed)
    return _forward_feat_gpu(q, k, v, lib, device[1], dtype, scale, feats, arrays, packed)


def backward_feat_impl(dout, q, k, v, out, lse, lib, device, dtype, scale, feats: Features, arrays: FeatureArrays,
                       packed, deterministic=False):
    """The feature backward: (dq, dk, dv, dsink), dsink None without sink logits."""
    if device[0] == "cpu":
        return _backward_feat_cpu(dout, q, k, v, out, lse, lib, scale, feats, arrays, packed)
    return _backward_feat_gpu(dout, q, k, v, out, lse, lib, device[1], dtype, scale, feats, arrays, packed,
                              deterministic)


# ---- CPU (NumPy): a packed batch runs one sequence at a time ----

def _np_arrays(arrays: FeatureArrays):
    return {n: (None if x is None else _interop.to_numpy(x, _interop.library_of(x))) for n, x in arrays.items()}


def _cpu_kwargs(feats: Features, a):
    return dict(window=(feats.window_left, feats.window_right), num_sink_tokens=feats.num_sink_tokens,
                softcap=feats.softcap, sink_logits=a["sink_logits"])


def _forward_feat_cpu(q, k, v, lib, scale, feats, arrays, packed):
    import numpy as np

    from ._cpu import attention_forward_numpy

    qn, kn, vn = (_interop.to_numpy(x, lib) for x in (q, k, v))
    a = _np_arrays(arrays)
    kw = _cpu_kwargs(feats, a)
    if packed is None:
        out, lse = attention_forward_numpy(qn, kn, vn, False, scale, q_lengths=a["q_lengths"],
                                           kv_lengths=a["kv_lengths"], alibi_slopes=a["alibi_slopes"], **kw)
    else:
        total_q, h, d = qn.shape
        out = np.zeros(qn.shape, dtype=qn.dtype)
        lse = np.full((h, total_q), -np.inf, dtype=np.float32)
        for b, (q0, q1, k0, k1) in enumerate(_segments(a)):
            if q1 == q0:
                continue
            if k1 == k0:  # rows that see no key: out 0, lse the sink logit (or -inf)
                if a["sink_logits"] is not None:
                    lse[:, q0:q1] = a["sink_logits"][:, None]
                continue
            o_b, l_b = attention_forward_numpy(qn[None, q0:q1], kn[None, k0:k1], vn[None, k0:k1], False, scale,
                                               alibi_slopes=_alibi_row(a, b), **kw)
            out[q0:q1] = o_b[0]
            lse[:, q0:q1] = l_b[0]
    return _interop.from_numpy(out, lib, like=q), _interop.from_numpy(lse, lib, like=q)


def _segments(a):
    cq, ck = (a[n].astype("int64") for n in ("cu_seqlens_q", "cu_seqlens_k"))
    return [(int(cq[b]), int(cq[b + 1]), int(ck[b]), int(ck[b + 1])) for b in range(len(cq) - 1)]


def _alibi_row(a, b):
    s = a["alibi_slopes"]
    return None if s is None else (s if s.ndim == 1 else s[b])


def _backward_feat_cpu(dout, q, k, v, out, lse, lib, scale, feats, arrays, packed):
    import numpy as np

    from ._cpu_backward import attention_backward_numpy

    don, qn, kn, vn, on, ln = (_interop.to_numpy(x, lib) for x in (dout, q, k, v, out, lse))
    a = _np_arrays(arrays)
    kw = _cpu_kwargs(feats, a)
    sink = a["sink_logits"] is not None
    if packed is None:
        grads = attention_backward_numpy(don, qn, kn, vn, on, ln, False, scale, q_lengths=a["q_lengths"],
                                         kv_lengths=a["kv_lengths"], alibi_slopes=a["alibi_slopes"], **kw)
        dq, dk, dv = grads[:3]
        dsink = grads[3] if sink else None
    else:
        dq, dk, dv = (np.zeros(x.shape, dtype=x.dtype) for x in (qn, kn, vn))
        dsink = np.zeros(qn.shape[1], dtype=np.float32) if sink else None
        for b, (q0, q1, k0, k1) in enumerate(_segments(a)):
            if q1 == q0 or k1 == k0:
                continue  # no score: nothing flows to q, k or v (nor to the sink: out = 0 there)
            g = attention_backward_numpy(don[None, q0:q1], qn[None, q0:q1], kn[None, k0:k1], vn[None, k0:k1],
                                         on[None, q0:q1], ln[None, :, q0:q1], False, scale,
                                         alibi_slopes=_alibi_row(a, b), **kw)
            dq[q0:q1] = g[0][0]
            dk[k0:k1] = g[1][0]
            dv[k0:k1] = g[2][0]
            if sink:
                dsink += g[3]
    res = [_interop.from_numpy(x, lib, like=q) for x in (dq, dk, dv)]
    res.append(None if dsink is None else _interop.from_numpy(dsink, lib, like=q))
    return tuple(res)


# ---- GPU ----

def _kernel_view(ctx, x):
    """A DeviceTensor the kernels can read in place (unit last stride, 16-byte aligned), copying x
    when needed; 3-D (packed) or 4-D."""
    t = ctx.view(x)
    if t.strides[-1] != 1 or t.ptr % 16 != 0 or any(s % 8 != 0 for s in t.strides[:-1]):
        t = ctx.view(ctx.contiguous(x))
    return t


def _small_view(ctx, x):
    """A small option array (lengths, offsets, slopes, sink logits) with a unit last stride."""
    t = ctx.view(x)
    if t.strides[-1] != 1 and t.shape[-1] > 1:
        t = ctx.view(ctx.contiguous(x))
    return t


def _packed4(t, batch: int, max_len: int):
    """(total, heads, d) -> the 4-D (batch, max_len, heads, d) view the kernels index, batch stride 0:
    each sequence adds its cu_seqlens offset itself."""
    from ._launch import DeviceTensor

    return DeviceTensor(t.ptr, (batch, max_len) + tuple(t.shape[1:]), (0,) + tuple(t.strides))


def _mask_args(ctx, feats: Features, arrays: FeatureArrays, total_q: int, total_k: int, dsink_rows: int = 0):
    from ._launch import MaskArgs

    ptrs = {}
    alibi_bs = 0
    for name, x in arrays.items():
        if x is None:
            ptrs[name] = 0
            continue
        t = _small_view(ctx, x)
        ptrs[name] = t.ptr
        if name == "alibi_slopes" and len(t.shape) == 2:
            alibi_bs = t.strides[0]
    return MaskArgs(alibi_batch_stride=alibi_bs, dsink_rows=dsink_rows, window_left=feats.window_left,
                    window_right=feats.window_right, num_sink_tokens=feats.num_sink_tokens,
                    softcap=feats.softcap, total_q=total_q, total_k=total_k, **ptrs)


_NEG_INF_BITS = 0xFF800000


def _forward_feat_gpu(q, k, v, lib, device_id, dtype, scale, feats, arrays, packed):
    from . import _launch
    from ._gpu import compute_capability

    ctx = _interop.GpuContext(lib, device_id)
    qv, kv, vv = (_kernel_view(ctx, x) for x in (q, k, v))
    cc = compute_capability(device_id)
    if packed is None:
        b, sq, h, d = qv.shape
        out, ov = ctx.empty((b, sq, h, d), dtype)
        lse, lv = ctx.empty((b, h, sq), "float32")
        m = _mask_args(ctx, feats, arrays, sq, kv.shape[1])
        _launch.launch_fwd(qv, kv, vv, ov, lv.ptr, dtype, False, scale, device_id, cc, ctx.stream_ptr, mask=m)
    else:
        total_q, h, d = qv.shape
        batch = int(arrays.cu_seqlens_q.shape[0]) - 1
        out, ov = ctx.empty((total_q, h, d), dtype)
        lse, lv = ctx.empty((h, total_q), "float32")
        m = _mask_args(ctx, feats, arrays, total_q, kv.shape[0])
        mq, mk = packed
        _launch.launch_fwd(_packed4(qv, batch, mq), _packed4(kv, batch, mk), _packed4(vv, batch, mk),
                           _packed4(ov, batch, mq), lv.ptr, dtype, False, scale, device_id, cc, ctx.stream_ptr,
                           mask=m)
        tail = m.cu_seqlens_q + 4 * batch  # &cu_seqlens_q[batch]
        _launch.launch_fill_tail(ov, tail, "u16", 0, device_id, cc, ctx.stream_ptr)
        lse_rows = _launch.DeviceTensor(lv.ptr, (total_q, h, 1), (1, total_q, 1))
        _launch.launch_fill_tail(lse_rows, tail, "u32", _NEG_INF_BITS, device_id, cc, ctx.stream_ptr)
    return ctx.export(out), ctx.export(lse)


def _backward_feat_gpu(dout, q, k, v, out, lse, lib, device_id, dtype, scale, feats, arrays, packed, deterministic):
    from . import _config, _launch
    from ._gpu import compute_capability

    ctx = _interop.GpuContext(lib, device_id)
    dov, qv, kv, vv, ov = (_kernel_view(ctx, x) for x in (dout, q, k, v, out))
    lv = ctx.view(lse)
    want = (lv.shape[1] * lv.shape[2], lv.shape[2], 1) if packed is None else (lv.shape[1], 1)
    if lv.strides != want:
        lv = ctx.view(ctx.contiguous(lse))
    dq, dqv = ctx.empty(tuple(qv.shape), dtype)
    dk, dkv = ctx.empty(tuple(kv.shape), dtype)
    dv, dvv = ctx.empty(tuple(vv.shape), dtype)
    cc = compute_capability(device_id)
    if packed is None:
        batch, sq, h, _ = qv.shape
        total_q, total_k = sq, kv.shape[1]
    else:
        batch = int(arrays.cu_seqlens_q.shape[0]) - 1
        sq, h = packed[0], qv.shape[1]
        total_q, total_k = qv.shape[0], kv.shape[0]
    pad = _launch.bwd_row_pad(sq)
    d = qv.shape[-1]
    # dQ by float atomics from sm_90a's wgmma dK/dV kernel where it fits, unless deterministic.
    atomic = _config.feat_bwd_uses_atomics(deterministic, _config.compile_arch(*cc), d)
    _rows_buf, rows = ctx.empty((max(1, 2 * batch * h * pad),), "float32")
    acc_ptr = 0
    if atomic:
        _acc_buf, acc = ctx.empty((max(1, batch * h * pad * d),), "float32")
        acc_ptr = acc.ptr
    dsink_rows = dsv = None
    if arrays.sink_logits is not None:
        dsink_rows, dsv = ctx.empty((batch, h, pad), "float32")
    m = _mask_args(ctx, feats, arrays, total_q, total_k, dsink_rows=dsv.ptr if dsv is not None else 0)
    if packed is None:
        views = (dov, qv, kv, vv, ov, dqv, dkv, dvv)
    else:
        mq, mk = packed
        views = (_packed4(dov, batch, mq), _packed4(qv, batch, mq), _packed4(kv, batch, mk), _packed4(vv, batch, mk),
                 _packed4(ov, batch, mq), _packed4(dqv, batch, mq), _packed4(dkv, batch, mk), _packed4(dvv, batch, mk))
    d4, q4, k4, v4, o4, dq4, dk4, dv4 = views
    _launch.launch_bwd(d4, q4, k4, v4, o4, lv.ptr, dq4, dk4, dv4, rows.ptr, acc_ptr, dtype, False, scale, atomic,
                       device_id, cc, ctx.stream_ptr, mask=m)
    if packed is not None:
        for t, cu in ((dqv, m.cu_seqlens_q), (dkv, m.cu_seqlens_k), (dvv, m.cu_seqlens_k)):
            _launch.launch_fill_tail(t, cu + 4 * batch, "u16", 0, device_id, cc, ctx.stream_ptr)
    dsink = None
    if dsink_rows is not None:
        dsink = ctx.export(_sum_rows(dsink_rows, lib, device_id))
    return ctx.export(dq), ctx.export(dk), ctx.export(dv), dsink


def _sum_rows(x, lib, device_id):
    """(batch, nheads, rows) -> (nheads,): the sum over batch and rows, on the call's stream."""
    if lib == "torch":
        return x.sum(dim=(0, 2))
    import cupy

    with cupy.cuda.Device(device_id):
        return x.sum(axis=(0, 2))
