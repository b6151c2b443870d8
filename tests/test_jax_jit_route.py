"""cuflash under jax.jit on a GPU, through buffer_callback (cuflash/_adapters/_jax.py), the default
route (CUFLASH_JAX_JIT_GPU=0 turns it off).

Under jit the same plans run as in eager mode, on XLA's stream and buffers, so the jitted forward,
gradients and attention_backward must equal the eager calls bit for bit: plain, with options
(lengths, window, sink logits, ALiBi, softcap), packed (attention_varlen), GQA, both dtypes; with
and without XLA command buffers (CUFLASH_JAX_JIT_CMD_BUFFER=1), where Python runs at capture only
and the same compiled function is called on new inputs (new buffer addresses). Also vmap under jit,
donation with ahead-of-time compilation, and a small transformer trained under jit whose losses
follow jax.nn.dot_product_attention's (XLA; and cuDNN on a GPU).
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
    monkeypatch.delenv("CUFLASH_JAX_JIT_GPU", raising=False)  # the default: on
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
            if name == "dsink":
                # Summed by jnp under jit, by the adapter eagerly: the same float32 terms
                # -exp(sink - lse) * sum_d(dout * out), in another order. Two orders differ by rounding
                # relative to the sum of the terms' magnitudes, not to the sum, which can cancel (seed
                # 1565925606, float16: 0.0168096 against 0.0168077 from terms of order 1).
                o64 = np.asarray(out_e.astype(jnp.float32), np.float64)
                rows = np.einsum("bshd,bshd->bhs", np.asarray(g, np.float64), o64)
                mag = np.abs(np.exp(np.asarray(sink, np.float64)[None, :, None] - np.asarray(lse_e, np.float64))
                             * rows).sum(axis=(0, 2))
                err = np.abs(np.asarray(c, np.float64) - np.asarray(a, np.float64))
                assert (err <= 1e-5 * mag + 1e-6).all(), f"dsink {np.asarray(c)} vs {np.asarray(a)}; {ctx}"
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


def test_jit_vmap_and_donation(jaxgpu):
    """vmap over a leading axis under jit (the callback runs once per element) and a jit that donates
    q and is compiled ahead of the call: each result equals the eager call's, bit for bit."""
    jax, dev = jaxgpu
    import warnings

    import cuflash

    seed = _seed()
    q, k, v = _arrays(jax, dev, seed, [(3, 2, 40, 4, 64), (2, 56, 2, 64), (2, 56, 2, 64)], "bfloat16")
    f = jax.jit(jax.vmap(lambda q, k, v: cuflash.attention(q, k, v, causal=True), in_axes=(0, None, None)))
    out = f(q, k, v)
    for i in range(3):
        assert _same(out[i], cuflash.attention(q[i], k, v, causal=True)), f"element {i}; seed={seed}"
    want = cuflash.attention(q[0], k, v, causal=True)
    g = jax.jit(lambda q, k, v: cuflash.attention(q, k, v, causal=True), donate_argnums=(0,))
    compiled = g.lower(q[0], k, v).compile()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a backend that cannot use the donated buffer says so
        got = compiled(jax.device_put(np.asarray(q[0]), dev), k, v)
    assert _same(got, want), f"donation; seed={seed}"


def test_small_transformer_trains_under_jit_like_jax(jaxgpu):
    """A pre-norm attention block with a linear head, trained for a few steps under jit with cuflash
    and with jax.nn.dot_product_attention (XLA everywhere, cuDNN on a GPU): the losses agree within
    bf16 noise, and cuflash's decrease."""
    jax, dev = jaxgpu
    import math

    import jax.numpy as jnp

    import cuflash

    seed = _seed()
    rng = np.random.default_rng(seed)
    batch, seqlen, heads, hd, vocab = 4, 64, 4, 64, 37
    dim = heads * hd
    params0 = {
        "emb": rng.standard_normal((vocab, dim)).astype(np.float32) * 0.3,
        "wqkv": rng.standard_normal((dim, 3 * dim)).astype(np.float32) / math.sqrt(dim),
        "wo": rng.standard_normal((dim, dim)).astype(np.float32) / math.sqrt(dim),
        "head": rng.standard_normal((dim, vocab)).astype(np.float32) / math.sqrt(dim),
    }
    tokens = jax.device_put(rng.integers(0, vocab, (batch, seqlen + 1)), dev)

    def model(p, x, y, attn):
        h = p["emb"][x]
        hn = (h - h.mean(-1, keepdims=True)) / jnp.sqrt(h.var(-1, keepdims=True) + 1e-5)
        qkv = (hn @ p["wqkv"]).astype(jnp.bfloat16).reshape(batch, seqlen, 3, heads, hd)
        a = attn(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]).astype(jnp.float32).reshape(batch, seqlen, dim)
        h = h + a @ p["wo"]
        logits = h @ p["head"]
        return -jnp.mean(jnp.sum(jax.nn.log_softmax(logits) * jax.nn.one_hot(y, vocab), -1))

    impls = {
        "cuflash": lambda q, k, v: cuflash.attention(q, k, v, causal=True),
        "xla": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla"),
    }
    if dev.platform == "gpu":
        impls["cudnn"] = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                                      implementation="cudnn")
    losses = {}
    for name, attn in impls.items():
        step = jax.jit(lambda p, x, y: jax.value_and_grad(model)(p, x, y, attn))
        p = {n: jax.device_put(a, dev) for n, a in params0.items()}
        seq = []
        for _ in range(8):
            loss, g = step(p, tokens[:, :-1], tokens[:, 1:])
            p = jax.tree_util.tree_map(lambda a, b: a - 0.5 * b, p, g)
            seq.append(float(loss))
        losses[name] = np.array(seq)
    a = losses["cuflash"]
    assert np.isfinite(a).all() and a[-1] < a[0] - 0.05, f"cuflash did not train: {a}; seed={seed}"
    for name, b in losses.items():
        assert np.abs(a - b).max() <= 0.02 * np.abs(b).max(), f"cuflash {a} vs {name} {b}; seed={seed}"
