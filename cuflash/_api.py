"""The public entry points: argument checks first, then the GPU kernels or the NumPy path."""

from __future__ import annotations

import math

from . import _interop
from ._config import HEAD_DIMS

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
    if len(set(devices)) != 1:
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
              deterministic: bool = False):
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

    Gradients: torch tensors that require grad record an autograd node (saving q, k, v, out and
    lse, never the probabilities); the op is a torch.library custom op, so torch.compile traces it
    without a graph break. JAX arrays work with jax.grad / jax.vjp in eager mode (jax.custom_vjp);
    under jax.jit the call raises NotImplementedError. lse is not differentiable: no gradient flows
    back through it.

    Returns:
        out: q's shape and dtype, the caller's kind of array on q's device.
        lse (if return_lse): (batch, nheads, seqlen_q) float32, the natural-log logsumexp of each
            row of scaled, masked scores.

    Raises:
        TypeError / ValueError naming the argument, before anything runs on the device.
    """
    lib, device, dtype, scale = _check_inputs(q, k, v, causal, softmax_scale)
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse: expected a bool; got {type(return_lse).__name__}")
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic: expected a bool; got {type(deterministic).__name__}")
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
                       deterministic: bool = False):
    """Gradients of attention by recomputation: returns (dq, dk, dv).

    Args:
        dout: gradient of the loss with respect to out, q's shape and dtype.
        q, k, v, causal, softmax_scale: as given to `attention`.
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
    """
    lib, device, dtype, scale = _check_backward_inputs(dout, q, k, v, out, lse, causal, softmax_scale, deterministic)
    if device[0] == "traced":
        from ._jax import jit_error

        raise jit_error("attention_backward")
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
