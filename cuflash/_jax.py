"""JAX adapter: gradients through jax.custom_vjp, in eager mode.

The kernels are launched from Python on concrete device arrays exchanged through DLPack, so they
cannot be staged into a jaxpr: under jax.jit (or any transformation that traces abstract values)
the call raises NotImplementedError rather than crashing or copying to the host. Eager jax.grad and
jax.vjp hand the custom_vjp rules concrete arrays, and work.
"""

from __future__ import annotations

from functools import partial

import jax

from . import _api, _interop


def jit_error(what: str = "attention") -> NotImplementedError:
    return NotImplementedError(
        f"cuflash.{what} does not support jax.jit (or other JAX transformations that trace abstract "
        "values, such as vmap) yet: its kernels run from Python on concrete arrays. Call it outside "
        "jit; jax.grad and jax.vjp work in eager mode.")


def _concrete(*xs):
    if any(_interop.is_jax_tracer(x) for x in xs):
        raise jit_error()


def _forward(q, k, v, causal, scale):
    _concrete(q, k, v)
    lib, device, dtype, _ = _api._check_inputs(q, k, v, causal, scale)
    return _api.forward_impl(q, k, v, lib, device, dtype, causal, scale)


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _attention(q, k, v, causal, scale, deterministic):
    return _forward(q, k, v, causal, scale)


def _attention_fwd(q, k, v, causal, scale, deterministic):
    out, lse = _forward(q, k, v, causal, scale)
    return (out, lse), (q, k, v, out, lse)


def _attention_bwd(causal, scale, deterministic, residuals, cotangents):
    q, k, v, out, lse = residuals
    dout, _ = cotangents  # lse is not differentiable
    _concrete(q, k, v, out, lse, dout)
    lib, device, dtype, _ = _api._check_inputs(q, k, v, causal, scale)
    return _api.backward_impl(dout, q, k, v, out, lse, lib, device, dtype, causal, scale, deterministic)


_attention.defvjp(_attention_fwd, _attention_bwd)


def attention(q, k, v, causal: bool, scale: float, deterministic: bool):
    return _attention(q, k, v, causal, scale, deterministic)


def attention_features(q, k, v, scale, feats, arrays, packed, deterministic):
    """The feature forward with gradients to q, k, v and sink_logits (jax.custom_vjp, eager).

    The option arrays that get no gradient (lengths, offsets, ALiBi slopes) and the scalars are
    closed over: a custom_vjp function is built per call, which costs nothing in eager mode."""
    from dataclasses import replace

    def fwd_impl(q, k, v, sink):
        # Here, inside the custom_vjp, eager jax.grad hands over concrete primals; jax.jit tracers.
        a = replace(arrays, sink_logits=sink)  # the primal sink, not the caller's (maybe traced) one
        _concrete(q, k, v, *(x for _, x in a.items() if x is not None))
        lib, device, dtype, _ = _api._check_inputs(*(x if q.ndim == 4 else x[None] for x in (q, k, v)), False, scale)
        return _api.forward_feat_impl(q, k, v, lib, device, dtype, scale, feats, a, packed)

    def bwd_impl(res, cts):
        q, k, v, sink, out, lse = res
        dout, _ = cts  # lse is not differentiable
        _concrete(q, k, v, out, lse, dout)
        a = replace(arrays, sink_logits=sink)
        lib, device, dtype, _ = _api._check_inputs(*(x if q.ndim == 4 else x[None] for x in (q, k, v)), False, scale)
        dq, dk, dv, dsink = _api.backward_feat_impl(dout, q, k, v, out, lse, lib, device, dtype, scale, feats, a,
                                                    packed, deterministic)
        return dq, dk, dv, dsink

    @jax.custom_vjp
    def f(q, k, v, sink):
        return fwd_impl(q, k, v, sink)

    def f_fwd(q, k, v, sink):
        out, lse = fwd_impl(q, k, v, sink)
        return (out, lse), (q, k, v, sink, out, lse)

    f.defvjp(f_fwd, bwd_impl)
    if arrays.sink_logits is None:
        # No sink: a function of q, k, v only (None is not a valid custom_vjp primal).
        @jax.custom_vjp
        def g(q, k, v):
            return fwd_impl(q, k, v, None)

        def g_fwd(q, k, v):
            out, lse = fwd_impl(q, k, v, None)
            return (out, lse), (q, k, v, None, out, lse)

        def g_bwd(res, cts):
            return bwd_impl(res, cts)[:3]

        g.defvjp(g_fwd, g_bwd)
        return g(q, k, v)
    return f(q, k, v, arrays.sink_logits)
