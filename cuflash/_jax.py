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
