"""JAX adapter: eager calls, with gradients through jax.custom_vjp.

JAX arrays reach the kernels through DLPack: `cupy.from_dlpack` hands CuPy's current stream to the
array's __dlpack__(stream=...), so JAX makes the data ready for that stream, which the kernels then
run on; outputs are CuPy arrays exported back with jax.dlpack.from_dlpack (zero copy). DLPack is
the only route that also carries that stream handshake, so it stays even though it is most of a
JAX call's host time (bench/bench_host.py).

A call on concrete arrays runs the plan directly. A call on tracers (jax.grad / jax.vjp in eager
mode, which trace the primal) goes through a jax.custom_vjp whose rules receive concrete arrays
and run the forward and backward plans. Under jax.jit (or any transformation that hands the rules
abstract values) the rules raise NotImplementedError rather than crash or copy to the host.
"""

from __future__ import annotations

from functools import partial

import jax

from .. import _call
from .._call import ArrayInfo
from .._plan import contiguous_strides
from ._base import Adapter, info_of, option_infos

_Tracer = jax.core.Tracer


def jit_error(what: str = "attention") -> NotImplementedError:
    return NotImplementedError(
        f"cuflash.{what} does not support jax.jit (or other JAX transformations that trace abstract "
        "values, such as vmap) yet: its kernels run from Python on concrete arrays. Call it outside "
        "jit; jax.grad and jax.vjp work in eager mode.")


def _concrete(*xs):
    if any(isinstance(x, _Tracer) for x in xs):
        raise jit_error()


def _device(x):
    if isinstance(x, _Tracer):
        return ("traced", 0)
    dev = next(iter(x.devices()))
    if dev.platform in ("gpu", "cuda"):
        hw = getattr(dev, "local_hardware_id", None)
        return ("cuda", hw if hw is not None else dev.id)
    return (dev.platform, dev.id)


class JaxAdapter(Adapter):
    lib = "jax"

    def info(self, x) -> ArrayInfo:
        import numpy as np

        shape = tuple(int(n) for n in x.shape)
        return ArrayInfo("jax", shape, contiguous_strides(shape), np.dtype(x.dtype).name, _device(x), True,
                         f"{type(x).__module__}.{type(x).__qualname__}")

    def sig(self, x) -> tuple:
        # JAX arrays are dense and row-major, and their buffers aligned: dtype, shape and device
        # say everything validation and planning read.
        return (type(x), x.dtype, x.shape, _device(x))

    # ---- primitives: CuPy views through DLPack ----
    def ptr(self, x, keep) -> int:
        if type(x).__module__.startswith("cupy"):
            return x.data.ptr
        import cupy

        c = cupy.from_dlpack(x)  # CuPy passes its current stream: the producer makes x ready on it
        keep.append(c)
        return c.data.ptr

    def stream(self, device_id: int) -> int:
        from . import _cupy

        return _cupy.ADAPTER.stream(device_id)

    def empty(self, shape, dtype, device_id):
        import cupy

        from . import _cupy

        try:
            return _cupy.ADAPTER.empty(shape, dtype, device_id)
        except cupy.cuda.memory.OutOfMemoryError as e:
            # JAX's own error for an allocation that does not fit, as a JAX op would raise it.
            raise jax.errors.JaxRuntimeError(f"RESOURCE_EXHAUSTED: cuflash could not allocate {shape} {dtype} "
                                             f"on GPU {device_id}: {e}") from e

    def contiguous(self, x, device_id, keep):
        import cupy

        with cupy.cuda.Device(device_id):
            c = cupy.from_dlpack(x).copy(order="C")  # always a new, aligned allocation
        keep.append(c)
        return c

    def export(self, x):
        return jax.dlpack.from_dlpack(x)

    def dsink_sum(self, scratch, offset, shape, device_id):
        from . import _cupy

        return _cupy.ADAPTER.dsink_sum(scratch, offset, shape, device_id)

    def to_numpy(self, x):
        import numpy as np

        return np.asarray(x)

    def from_numpy(self, a, like):
        return jax.device_put(a, next(iter(like.devices())))

    # ---- entry points ----
    def attention(self, q, k, v, causal, softmax_scale, return_lse, deterministic, opts):
        opts = opts or {}
        plan_args = (causal, softmax_scale, deterministic, return_lse)
        return self._entry(q, k, v, opts, plan_args, None, return_lse)

    def attention_varlen(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                         softmax_scale, return_lse, deterministic, opts):
        packed = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        opts = dict(opts, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
        return self._entry(q, k, v, opts, (causal, softmax_scale, deterministic, return_lse), packed, return_lse)

    def _plan(self, q, k, v, opts, plan_args, packed):
        causal, scale, det, ret = plan_args
        if packed is None:
            return self.forward_plan(q, k, v, causal, scale, det, ret, opts)
        rest = {n: x for n, x in opts.items() if n not in ("cu_seqlens_q", "cu_seqlens_k")}
        return self.varlen_plan(q, k, v, *packed, causal, scale, det, ret, rest)

    def _entry(self, q, k, v, opts, plan_args, packed, return_lse):
        arrays = [q, k, v] + [x for x in opts.values() if x is not None and hasattr(x, "shape")]
        if not any(isinstance(x, _Tracer) for x in arrays):
            # Concrete arrays: nothing differentiates this call, so no custom_vjp around it.
            plan = self._plan(q, k, v, opts, plan_args, packed)
            out, lse = self.run_forward(plan, q, k, v, opts, return_lse)
        else:
            self._validate(q, k, v, opts, plan_args, packed)
            out, lse = self._differentiable(q, k, v, opts, plan_args, packed)
        return (out, lse) if return_lse else out

    def _validate(self, q, k, v, opts, plan_args, packed):
        """The checks of a call on tracers (each call: tracers' devices are unknown)."""
        causal, scale, det, ret = plan_args
        infos = [info_of(x) for x in (q, k, v)]
        rest = {n: x for n, x in opts.items() if n not in ("cu_seqlens_q", "cu_seqlens_k")}
        if packed is None:
            _call.describe_forward(infos, causal, scale, det, ret, **option_infos(rest))
        else:
            cu_q, cu_k, mq, mk = packed
            _call.describe_varlen(infos, info_of(cu_q), info_of(cu_k), mq, mk, causal, scale, det, ret,
                                  **option_infos(rest))

    def _differentiable(self, q, k, v, opts, plan_args, packed):
        """Forward with gradients to q, k, v and sink_logits (jax.custom_vjp). The option arrays that get
        no gradient (lengths, offsets, ALiBi slopes) and the scalars are closed over."""
        sink = opts.get("sink_logits")
        if sink is None and not [n for n, x in opts.items() if x is not None and hasattr(x, "shape")]:
            return _plain(q, k, v, self, plan_args, packed)

        def run(q, k, v, sink):
            a = dict(opts, sink_logits=sink) if sink is not None else opts
            _concrete(q, k, v, *(x for x in a.values() if x is not None and hasattr(x, "shape")))
            plan = self._plan(q, k, v, a, plan_args, packed)
            return plan, a

        def fwd_impl(q, k, v, sink):
            plan, a = run(q, k, v, sink)
            return self.run_forward(plan, q, k, v, a)

        def bwd_impl(res, cts):
            q, k, v, sink, out, lse = res
            dout, _ = cts  # lse is not differentiable
            _concrete(dout)
            plan, a = run(q, k, v, sink)
            return self.backward(plan, dout, q, k, v, out, lse, a)

        @jax.custom_vjp
        def f(q, k, v, sink):
            return fwd_impl(q, k, v, sink)

        def f_fwd(q, k, v, sink):
            out, lse = fwd_impl(q, k, v, sink)
            return (out, lse), (q, k, v, sink, out, lse)

        f.defvjp(f_fwd, bwd_impl)
        if sink is None:
            # No sink: a function of q, k, v only (None is not a valid custom_vjp primal).
            @jax.custom_vjp
            def g(q, k, v):
                return fwd_impl(q, k, v, None)

            def g_fwd(q, k, v):
                out, lse = fwd_impl(q, k, v, None)
                return (out, lse), (q, k, v, None, out, lse)

            g.defvjp(g_fwd, lambda res, cts: bwd_impl(res, cts)[:3])
            return g(q, k, v)
        return f(q, k, v, sink)

    def backward(self, plan, dout, q, k, v, out, lse, opts):
        bp = self.backward_plan(plan, dout, out, lse)
        return self.run_backward(plan, bp, dout, q, k, v, out, lse, opts)

    def lengths_from_padding_mask(self, mask):
        import jax.numpy as jnp

        m = jnp.asarray(mask).astype(bool)
        lengths = m.sum(axis=1).astype(jnp.int32)
        return lengths, bool(jnp.all(m == (jnp.arange(m.shape[1])[None, :] < lengths[:, None])))


ADAPTER = JaxAdapter()


# The plain call's custom_vjp, built once: the adapter and the scalars are static arguments.
@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _plain(q, k, v, ad, plan_args, packed):
    return _plain_fwd(q, k, v, ad, plan_args, packed)[0]


def _plain_fwd(q, k, v, ad, plan_args, packed):
    _concrete(q, k, v)
    plan = ad._plan(q, k, v, {}, plan_args, packed)
    out, lse = ad.run_forward(plan, q, k, v, {})
    return (out, lse), (q, k, v, out, lse)


def _plain_bwd(ad, plan_args, packed, residuals, cotangents):
    q, k, v, out, lse = residuals
    dout, _ = cotangents  # lse is not differentiable
    _concrete(q, k, v, out, lse, dout)
    plan = ad._plan(q, k, v, {}, plan_args, packed)
    return ad.backward(plan, dout, q, k, v, out, lse, {})[:3]


_plain.defvjp(_plain_fwd, _plain_bwd)
