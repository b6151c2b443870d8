"""cuflash under jax.jit on a GPU, through buffer_callback (cuflash/_adapters/_jax.py), with
CUFLASH_JAX_JIT_GPU=1 (the route is off by default until these tests have passed on a GPU).

Under jit the same plans run as in eager mode, on XLA's stream and buffers, so the jitted forward,
gradients and attention_backward must equal the eager calls bit for bit: plain, with options
(lengths, window, sink logits, ALiBi, softcap), packed (attention_varlen), GQA, both dtypes; with
and without XLA command buffers (CUFLASH_JAX_JIT_CMD_BUFFER=1), where Python runs at capture only
and the same compiled function is called on new inputs (new buffer addresses).
"""

from __future__ import annotations

import numpy as np
import pytest


@pytest.fixture(params=["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def jaxgpu(request, monkeypatch):
    """(jax, device). The CPU variant runs the same checks on the NumPy path (pure_callback under jit),
    which keeps this file's own logic tested where there is no GPU."""
    jax = pytest.importorskip("jax")
    try:
        dev = jax.devices(request.param)[0]
    except Exception as e:
        pytest.skip(f"JAX has no {request.param} backend: {e}")
    monkeypatch.setenv("CUFLASH_JAX_JIT_GPU", "1")
    return jax, dev


def _seed():
    return int(np.random.SeedSequence().entropy % (1 << 31))


def _arrays(jax, dev, seed, shapes, dtype):
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.PRNGKey(seed), len(shapes))
    return [jax.device_put(jax.random.normal(kk, s, jnp.float32).astype(dtype), dev) for kk, s in zip(keys, shapes)]


def _same(a, b) -> bool:
    import jax.numpy as jnp

    return bool(np.array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)),
                               equal_nan=True))


OPTIONS = ["plain", "window_softcap", "lengths_sink_alibi"]


@pytest.mark.parametrize("cmd_buffer", [False, True])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("option", OPTIONS)
def test_jit_forward_and_grad_equal_eager(jaxgpu, monkeypatch, cmd_buffer, dtype, option):
    jax, dev = jaxgpu
    import jax.numpy as jnp

    if cmd_buffer:
        monkeypatch.setenv("CUFLASH_JAX_JIT_CMD_BUFFER", "1")
    import cuflash

    seed = _seed()
    b, s, h, hkv, d = (2, 300, 8, 2, 128) if dev.platform != "cpu" else (2, 70, 4, 2, 32)
    dt = getattr(jnp, dtype)
    arrays, scalars = {}, {}
    if option == "window_softcap":
        scalars = {"window": (64, 0), "softcap": 20.0}
    elif option == "lengths_sink_alibi":
        arrays = {"kv_lengths": jax.device_put(jnp.array([s, 17], jnp.int32), dev),
                  "sink_logits": jax.device_put(jnp.linspace(-1.0, 1.0, h, dtype=jnp.float32), dev),
                  "alibi_slopes": jax.device_put(jnp.full((h,), 0.05, jnp.float32), dev)}
    ctx = f"seed={seed} dtype={dtype} option={option} cmd_buffer={cmd_buffer}"

    sink = arrays.pop("sink_logits", None)

    def fwd(q, k, v, sink, a):
        extra = {} if sink is None else {"sink_logits": sink}
        return cuflash.attention(q, k, v, causal=True, return_lse=True, **a, **extra, **scalars)

    def loss(q, k, v, sink, a, g):
        return jnp.sum(fwd(q, k, v, sink, a)[0].astype(jnp.float32) * g)

    argnums = (0, 1, 2, 3) if sink is not None else (0, 1, 2)
    jit_fwd = jax.jit(fwd)
    jit_grad = jax.jit(jax.grad(loss, argnums=argnums))
    for rep in range(2):  # the second call: new buffers (a command buffer must follow them)
        q, k, v, g = _arrays(jax, dev, seed + rep, [(b, s, h, d), (b, s, hkv, d), (b, s, hkv, d), (b, s, h, d)], dt)
        g = g.astype(jnp.float32)
        out_e, lse_e = fwd(q, k, v, sink, arrays)
        out_j, lse_j = jit_fwd(q, k, v, sink, arrays)
        assert _same(out_e, out_j), f"out; rep {rep}; {ctx}"
        assert _same(lse_e, lse_j), f"lse; rep {rep}; {ctx}"
        ge = jax.grad(loss, argnums=argnums)(q, k, v, sink, arrays, g)
        gj = jit_grad(q, k, v, sink, arrays, g)
        for name, a, c in zip(("dq", "dk", "dv", "dsink"), ge, gj):
            assert np.isfinite(np.asarray(c.astype(jnp.float32))).all(), f"{name} not finite; {ctx}"
            if name == "dsink":  # summed by jnp under jit, by the adapter eagerly: same terms, other order
                np.testing.assert_allclose(np.asarray(c), np.asarray(a), rtol=1e-5, atol=1e-6, err_msg=ctx)
            else:
                assert _same(a, c), f"{name}; rep {rep}; {ctx}"


def test_jit_varlen_and_backward_function(jaxgpu):
    jax, dev = jaxgpu
    import jax.numpy as jnp

    import cuflash

    seed = _seed()
    lens = [130, 0, 257, 64] if dev.platform != "cpu" else [13, 0, 25, 6]
    cu = jax.device_put(jnp.array(np.concatenate([[0], np.cumsum(lens)]), jnp.int32), dev)
    total, h, d = sum(lens) + 5, 4, 64
    q, k, v, dout = _arrays(jax, dev, seed, [(total, h, d)] * 4, jnp.bfloat16)

    m = max(lens)

    def fwd(q, k, v, cu):
        return cuflash.attention_varlen(q, k, v, cu, cu, m, m, causal=True, return_lse=True, window=(40, 0))

    out_e, lse_e = fwd(q, k, v, cu)
    out_j, lse_j = jax.jit(fwd)(q, k, v, cu)
    assert _same(out_e, out_j) and _same(lse_e, lse_j), f"seed={seed}"
    bwd = jax.jit(lambda *a: cuflash.attention_varlen_backward(*a, m, m, causal=True, window=(40, 0)))
    ge = cuflash.attention_varlen_backward(dout, q, k, v, out_e, lse_e, cu, cu, m, m, causal=True, window=(40, 0))
    gj = bwd(dout, q, k, v, out_e, lse_e, cu, cu)
    for name, a, c in zip(("dq", "dk", "dv"), ge, gj):
        assert _same(a, c), f"{name}; seed={seed}"
