"""cuflash under jax.jit, vmap and jax.grad on the CPU (runs in CI).

Under jit the call is built into the traced program (cuflash/_adapters/_jax.py): on the CPU a
jax.pure_callback runs the NumPy path; compiling for another platform raises NotImplementedError
at lowering, which these tests reach on the CPU with `.lower(lowering_platforms=("cuda",))`.

Checks: the jitted forward against the float64 reference (the accuracy rule of
tests/test_cpu_features.py); jitted gradients (through jax.custom_vjp) and jitted
attention_backward bit-identical to the eager NumPy path, which tests/test_cpu_backward.py and
tests/test_cpu_features.py check against the reference; vmap against a loop of eager calls;
validation at trace time. The small transformer trained under jit against
jax.nn.dot_product_attention is in tests/test_jax_jit_route.py (its CPU variant runs here too).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import cuflash  # noqa: E402
from _cpu_helpers import _new_seed, _randn  # noqa: E402
from cuflash._reference import attention_reference, check_close  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = {"float16": np.dtype(np.float16), "bfloat16": BF16}


def _cpu():
    return jax.devices("cpu")[0]


def _put(x):
    return jax.device_put(x, _cpu())


def _np(x):
    return np.asarray(x)


def _inputs(seed, dtype, batch, sq, sk, h, hkv, d):
    rng = np.random.default_rng(seed)
    dt = DTYPES[dtype]
    q = _randn(rng, (batch, sq, h, d), dt)
    k = _randn(rng, (batch, sk, hkv, d), dt)
    v = _randn(rng, (batch, sk, hkv, d), dt)
    dout = _randn(rng, (batch, sq, h, d), dt)
    return rng, q, k, v, dout


def _options(name, rng, batch, h, sk):
    if name == "plain":
        return {}
    if name == "lengths":
        return {"kv_lengths": rng.integers(0, sk + 1, batch).astype(np.int32),
                "q_lengths": rng.integers(0, 20, batch).astype(np.int32)}
    if name == "window":
        return {"window": (7, 0), "num_sink_tokens": 2}
    if name == "sink":
        return {"sink_logits": (rng.standard_normal(h) + 0.5).astype(np.float32)}
    if name == "alibi":
        return {"alibi_slopes": rng.uniform(0.0, 0.5, (batch, h)).astype(np.float32)}
    if name == "softcap":
        return {"softcap": 5.0}
    raise AssertionError(name)


def _split(opts):
    """(array options as JAX CPU arrays, scalar options)."""
    arrays = {n: _put(x) for n, x in opts.items() if isinstance(x, np.ndarray)}
    return arrays, {n: x for n, x in opts.items() if n not in arrays}


OPTIONS = ("plain", "lengths", "window", "sink", "alibi", "softcap")


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("option", OPTIONS)
def test_jit_forward_against_reference(dtype, causal, option):
    seed = _new_seed()
    batch, sq, sk, h, hkv, d = 16, 19, 27, 4, 2, 32
    rng, q, k, v, _ = _inputs(seed, dtype, batch, sq, sk, h, hkv, d)
    opts = _options(option, rng, batch, h, sk)
    if causal and option == "window":
        opts["window"] = (7, 0)
    arrays, scalars = _split(opts)
    ctx = f"seed={seed} dtype={dtype} causal={causal} option={option}"

    # Array options are traced arguments; the scalar ones (window, softcap, ...) trace-time constants.
    f = jax.jit(lambda q, k, v, a: cuflash.attention(q, k, v, causal=causal, return_lse=True, **a, **scalars))
    out, lse = f(_put(q), _put(k), _put(v), arrays)
    out, lse = _np(out), _np(lse)
    assert out.dtype == q.dtype and out.shape == q.shape, ctx
    assert lse.dtype == np.float32 and lse.shape == (batch, h, sq), ctx
    ref, ref_lse = attention_reference(q, k, v, causal, None, **opts)
    naive, _ = attention_reference(q, k, v, causal, None, compute_dtype="input", **opts)
    ok, msg = check_close(out, ref, naive)
    assert ok, f"{msg}; {ctx}"
    fin = np.isfinite(ref_lse)
    assert np.array_equal(np.isneginf(lse), ~fin), ctx
    assert np.abs(lse[fin] - ref_lse[fin]).max(initial=0) <= 1e-3 * (1 + np.abs(ref_lse[fin]).max(initial=0)), ctx
    # The jitted call is the eager NumPy path, bit for bit.
    e_out, e_lse = cuflash.attention(q, k, v, causal=causal, return_lse=True, **opts)
    assert np.array_equal(out.view(np.uint16), e_out.view(np.uint16)), ctx
    assert np.array_equal(lse, e_lse), ctx


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("option", OPTIONS)
def test_jit_grad_equals_eager_numpy(dtype, option):
    seed = _new_seed()
    batch, sq, sk, h, hkv, d = 4, 23, 31, 4, 1, 16
    rng, q, k, v, dout = _inputs(seed, dtype, batch, sq, sk, h, hkv, d)
    opts = _options(option, rng, batch, h, sk)
    sink = opts.pop("sink_logits", None)
    jopts, scalars = _split(opts)
    ctx = f"seed={seed} dtype={dtype} option={option}"
    jdout = _put(dout)

    def loss(q, k, v, s, o):
        extra = {} if s is None else {"sink_logits": s}
        out = cuflash.attention(q, k, v, causal=True, **o, **scalars, **extra)
        return jnp.sum(out.astype(jnp.float32) * jdout.astype(jnp.float32))

    argnums = (0, 1, 2) if sink is None else (0, 1, 2, 3)
    grads = jax.jit(jax.grad(loss, argnums=argnums))(_put(q), _put(k), _put(v),
                                                     None if sink is None else _put(sink), jopts)
    extra = {} if sink is None else {"sink_logits": sink}
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True, **opts, **extra)
    want = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, **opts, **extra)
    assert len(grads) == len(want), ctx
    for name, g, w in zip(("dq", "dk", "dv", "dsink"), grads, want):
        g = _np(g)
        assert g.dtype == w.dtype and g.shape == w.shape, f"{name}; {ctx}"
        assert np.isfinite(g.astype(np.float32)).all(), f"{name} not finite; {ctx}"
        assert np.array_equal(g.astype(np.float32), w.astype(np.float32)), f"{name} differs from eager; {ctx}"
    # and the eager jax.grad (concrete custom_vjp rules) agrees too
    eager = jax.grad(loss, argnums=argnums)(_put(q), _put(k), _put(v), None if sink is None else _put(sink), jopts)
    for name, g, e in zip(("dq", "dk", "dv", "dsink"), grads, eager):
        assert np.array_equal(_np(g).astype(np.float32), _np(e).astype(np.float32)), f"{name} eager grad; {ctx}"


def test_jit_backward_functions_equal_eager():
    seed = _new_seed()
    rng, q, k, v, dout = _inputs(seed, "bfloat16", 2, 17, 17, 2, 2, 64)
    sink = rng.standard_normal(2).astype(np.float32)
    out, lse = cuflash.attention(q, k, v, return_lse=True, sink_logits=sink)
    want = cuflash.attention_backward(dout, q, k, v, out, lse, sink_logits=sink)
    got = jax.jit(lambda *a: cuflash.attention_backward(*a[:6], sink_logits=a[6]))(
        *map(_put, (dout, q, k, v, out, lse, sink)))
    assert len(got) == 4
    for g, w in zip(got, want):
        assert np.array_equal(_np(g).astype(np.float32), w.astype(np.float32)), f"seed={seed}"


def test_jit_varlen_forward_and_grad():
    seed = _new_seed()
    rng = np.random.default_rng(seed)
    lens_q, lens_k = [5, 0, 13, 9], [7, 3, 13, 20]
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    tq, tk, h, hkv, d = int(cu_q[-1]) + 2, int(cu_k[-1]), 4, 2, 32
    q, k, v, dout = (_randn(rng, (n, hh, d), BF16) for n, hh in ((tq, h), (tk, hkv), (tk, hkv), (tq, h)))
    args = (max(lens_q), max(lens_k))
    ctx = f"seed={seed}"

    def fwd(q, k, v, cq, ck):
        return cuflash.attention_varlen(q, k, v, cq, ck, *args, causal=True, return_lse=True, window=(4, 0))

    out, lse = jax.jit(fwd)(*map(_put, (q, k, v, cu_q, cu_k)))
    e_out, e_lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, *args, causal=True, return_lse=True, window=(4, 0))
    assert np.array_equal(_np(out).astype(np.float32), e_out.astype(np.float32)), ctx
    assert np.array_equal(_np(lse), e_lse), ctx
    assert _np(lse).shape == (h, tq), ctx

    jd = _put(dout)

    def loss(q, k, v, cq, ck):
        return jnp.sum(fwd(q, k, v, cq, ck)[0].astype(jnp.float32) * jd.astype(jnp.float32))

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*map(_put, (q, k, v, cu_q, cu_k)))
    want = cuflash.attention_varlen_backward(dout, q, k, v, e_out, e_lse, cu_q, cu_k, *args, causal=True,
                                             window=(4, 0))
    for g, w in zip(grads, want):
        assert np.array_equal(_np(g).astype(np.float32), w.astype(np.float32)), ctx
    got = jax.jit(lambda *a: cuflash.attention_varlen_backward(*a, *args, causal=True, window=(4, 0)))(
        *map(_put, (dout, q, k, v, e_out, e_lse, cu_q, cu_k)))
    for g, w in zip(got, want):
        assert np.array_equal(_np(g).astype(np.float32), w.astype(np.float32)), ctx


@pytest.mark.parametrize("jit", [False, True])
def test_vmap_over_a_leading_axis(jit):
    seed = _new_seed()
    rng, q, k, v, _ = _inputs(seed, "float16", 2, 9, 12, 2, 1, 16)
    qs = np.stack([q, (q.astype(np.float32) * 0.5).astype(q.dtype), -q])
    f = jax.vmap(lambda q, k, v: cuflash.attention(q, k, v, causal=True), in_axes=(0, None, None))
    if jit:
        f = jax.jit(f)
    out = _np(f(_put(qs), _put(k), _put(v)))
    assert out.shape == qs.shape
    for i in range(len(qs)):
        want = cuflash.attention(qs[i], k, v, causal=True)
        assert np.array_equal(out[i].view(np.uint16), want.view(np.uint16)), f"element {i}; seed={seed}"


def test_vmap_grad_under_jit():
    seed = _new_seed()
    rng, q, k, v, dout = _inputs(seed, "bfloat16", 1, 8, 8, 2, 2, 16)
    qs = np.stack([q, -q])

    def loss(q):
        return jnp.sum(cuflash.attention(q, _put(k), _put(v)).astype(jnp.float32))

    g = _np(jax.jit(jax.vmap(jax.grad(loss)))(_put(qs)))
    for i in range(2):
        want = _np(jax.grad(loss)(_put(qs[i])))
        assert np.array_equal(g[i].astype(np.float32), want.astype(np.float32)), f"element {i}; seed={seed}"


def test_jit_with_donation_and_compile_ahead():
    seed = _new_seed()
    _, q, k, v, _ = _inputs(seed, "float16", 2, 16, 16, 2, 2, 32)
    want = cuflash.attention(q, k, v, causal=True)
    f = jax.jit(lambda q, k, v: cuflash.attention(q, k, v, causal=True), donate_argnums=(0,))
    compiled = f.lower(_put(q), _put(k), _put(v)).compile()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the CPU backend may not use a donated buffer, and says so
        out = compiled(_put(q), _put(k), _put(v))
    assert np.array_equal(_np(out).view(np.uint16), want.view(np.uint16)), f"seed={seed}"


def test_validation_at_trace_time():
    _, q, k, v, _ = _inputs(0, "float16", 1, 8, 8, 4, 2, 32)
    k3 = np.concatenate([k, k[..., :1, :]], axis=2)  # 3 kv heads for 4 query heads
    with pytest.raises(ValueError, match="nheads"):
        jax.jit(lambda q, k, v: cuflash.attention(q, k, v))(_put(q), _put(k3), _put(k3))
    with pytest.raises(ValueError, match="^v: expected the shape of k"):
        jax.jit(lambda q, k, v: cuflash.attention(q, k, v))(_put(q), _put(k[..., :1, :]), _put(v))
    with pytest.raises(TypeError, match="dtype"):
        jax.jit(lambda q, k, v: cuflash.attention(q, k, v))(_put(q.astype(np.float32)), _put(k), _put(v))
    with pytest.raises(ValueError, match="window"):
        jax.jit(lambda q, k, v: cuflash.attention(q, k, v, causal=True, window=(2, 3)))(_put(q), _put(k), _put(v))


@pytest.mark.parametrize("what", ["forward", "grad", "backward", "varlen", "vmap"])
def test_compiling_for_a_gpu_raises_at_lowering(what, monkeypatch):
    """A platform without a route (here CUDA with CUFLASH_JAX_JIT_GPU=0): NotImplementedError from the
    lowering, naming jit and the platform."""
    monkeypatch.setenv("CUFLASH_JAX_JIT_GPU", "0")
    _, q, k, v, dout = _inputs(0, "bfloat16", 2, 8, 8, 2, 2, 32)
    args = tuple(map(_put, (q, k, v)))
    if what == "forward":
        fn = lambda q, k, v: cuflash.attention(q, k, v, causal=True)  # noqa: E731
    elif what == "grad":
        fn = jax.grad(lambda q, k, v: jnp.sum(cuflash.attention(q, k, v).astype(jnp.float32)))
    elif what == "backward":
        out, lse = cuflash.attention(q, k, v, return_lse=True)
        fn = lambda *a: cuflash.attention_backward(*a)  # noqa: E731
        args = tuple(map(_put, (dout, q, k, v, out, lse)))
    elif what == "vmap":
        fn = jax.vmap(lambda q, k, v: cuflash.attention(q, k, v), in_axes=(0, None, None))
        args = (_put(np.stack([q, q])), args[1], args[2])
    else:
        cu = _put(np.array([0, 5, 8], np.int32))
        fn = lambda q, k, v: cuflash.attention_varlen(q[0], k[0], v[0], cu, cu, 5, 5)  # noqa: E731
    traced = jax.jit(fn).trace(*args)
    with pytest.raises(NotImplementedError, match=r"jax\.jit.*'cuda'"):
        traced.lower(lowering_platforms=("cuda",))
    traced.lower(lowering_platforms=("cpu",))  # the CPU lowering of the same trace works


_SHARD_MAP_SCRIPT = r"""
import sys
import numpy as np, jax, jax.numpy as jnp, cuflash
from jax.sharding import Mesh, PartitionSpec as P

assert len(jax.devices()) == 2, jax.devices()
mesh = Mesh(np.array(jax.devices()), ("x",))
rng = np.random.default_rng(int(sys.argv[1]))
q = jnp.asarray(rng.standard_normal((4, 32, 4, 32)).astype(np.float16))
k = jnp.asarray(rng.standard_normal((4, 40, 2, 32)).astype(np.float16))
v = jnp.asarray(rng.standard_normal((4, 40, 2, 32)).astype(np.float16))
s = jnp.asarray(rng.standard_normal(4).astype(np.float32))

def f(q, k, v, s):
    return cuflash.attention(q, k, v, causal=True, sink_logits=s, window=(5, 0))

def loss(q, k, v, s):
    return jnp.sum(f(q, k, v, s).astype(jnp.float32))

want_out = np.asarray(f(q, k, v, s))
want = jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, s)
# over batch (sink logits replicated: their gradient is the sum of the shards'), and over heads
for name, spec, sspec in (("batch", P("x"), P()), ("heads", P(None, None, "x"), P("x"))):
    fwd = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(spec,) * 3 + (sspec,), out_specs=spec))
    assert np.array_equal(np.asarray(fwd(q, k, v, s)).view(np.uint16), want_out.view(np.uint16)), name
    grad = jax.jit(jax.shard_map(jax.grad(loss, argnums=(0, 1, 2, 3)), mesh=mesh,
                                 in_specs=(spec,) * 3 + (sspec,), out_specs=(spec,) * 3 + (sspec,)))
    got = grad(q, k, v, s)
    for gname, a, b in zip(("dq", "dk", "dv"), got, want):
        assert np.array_equal(np.asarray(a).astype(np.float32), np.asarray(b).astype(np.float32)), (name, gname)
    np.testing.assert_allclose(np.asarray(got[3]), np.asarray(want[3]), rtol=1e-5, atol=1e-6, err_msg=name)
print("ok")
"""


def test_shard_map_over_batch_and_heads():
    """jax.shard_map over batch or heads on two CPU devices (a subprocess: the device count is fixed when
    JAX starts): forward and gradients equal the unsharded call; a replicated sink logit's gradient is
    the sum over the shards."""
    import os
    import subprocess
    import sys

    seed = _new_seed()
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-c", _SHARD_MAP_SCRIPT, str(seed % (1 << 31))], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), f"seed={seed}\n{r.stdout}\n{r.stderr[-3000:]}"
