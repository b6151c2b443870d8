"""Argument checks (CPU, runs in CI): every bad input raises ValueError or TypeError naming the
argument, what it got and what was expected, before anything runs."""

import numpy as np
import pytest

import cuflash
from cuflash import _plan


@pytest.fixture(autouse=True)
def no_compute(monkeypatch):
    """Any check that lets a bad call through to the compute paths fails loudly: the NumPy path and
    the GPU launches both run through a Plan."""
    def boom(*a, **k):
        raise AssertionError("a compute path ran for invalid input")
    monkeypatch.setattr(_plan.Plan, "forward_numpy", boom)
    monkeypatch.setattr(_plan, "run_launches", boom)


def qkv(b=2, sq=5, sk=7, h=4, hk=2, d=16, dtype=np.float16):
    rng = np.random.default_rng()
    return (rng.standard_normal((b, sq, h, d)).astype(dtype), rng.standard_normal((b, sk, hk, d)).astype(dtype),
            rng.standard_normal((b, sk, hk, d)).astype(dtype))


def test_valid_input_reaches_compute():
    with pytest.raises(AssertionError, match="compute path ran"):
        cuflash.attention(*qkv())


@pytest.mark.parametrize("which", [0, 1, 2])
def test_wrong_ndim(which):
    args = list(qkv())
    args[which] = args[which][0]
    name = "qkv"[which]
    with pytest.raises(ValueError, match=rf"^{name}: expected 4 dimensions .* got shape \(5, 4, 16\)|^{name}: expected 4 dimensions .* got shape \(7, 2, 16\)"):
        cuflash.attention(*args)


def test_batch_mismatch():
    q, _, _ = qkv(b=2)
    _, k, v = qkv(b=3)
    with pytest.raises(ValueError, match=r"k: batch 3 differs from q's batch 2"):
        cuflash.attention(q, k, v)


def test_head_dim_mismatch():
    q, _, _ = qkv(d=16)
    _, k, v = qkv(d=24)
    with pytest.raises(ValueError, match=r"k: head_dim 24 differs from q's head_dim 16"):
        cuflash.attention(q, k, v)


def test_k_v_shape_mismatch():
    q, k, _ = qkv()
    _, _, v = qkv(sk=9)
    with pytest.raises(ValueError, match=r"v: expected the shape of k \(2, 7, 2, 16\); got \(2, 9, 2, 16\)"):
        cuflash.attention(q, k, v)


@pytest.mark.parametrize("h,hk", [(4, 3), (3, 2), (2, 4)])
def test_nheads_not_multiple(h, hk):
    q, _, _ = qkv(h=h)
    _, k, v = qkv(hk=hk)
    with pytest.raises(ValueError, match=rf"k: nheads_kv {hk} must divide q's nheads {h}"):
        cuflash.attention(q, k, v)


@pytest.mark.parametrize("d", [4, 12, 20, 264, 512])
def test_head_dim_unsupported(d):
    with pytest.raises(ValueError, match=rf"q: head_dim {d} is not supported; expected a multiple of 8 from 8 to 256"):
        cuflash.attention(*qkv(d=d))


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int8])
def test_dtype_unsupported(dtype):
    with pytest.raises(TypeError, match=rf"q: dtype {np.dtype(dtype).name} is not supported; expected float16 or bfloat16"):
        cuflash.attention(*qkv(dtype=dtype))


def test_dtype_mixed():
    import ml_dtypes

    q, k, _ = qkv()
    _, _, v = qkv(dtype=ml_dtypes.bfloat16)
    with pytest.raises(TypeError, match=r"q, k and v must have one dtype; got q float16, k float16, v bfloat16"):
        cuflash.attention(q, k, v)


def test_zero_length():
    with pytest.raises(ValueError, match=r"k: every dimension must be at least 1; got shape \(2, 0, 2, 16\)"):
        cuflash.attention(*qkv(sk=0))
    with pytest.raises(ValueError, match=r"q: every dimension must be at least 1"):
        cuflash.attention(*qkv(sq=0))


def test_not_an_array():
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"k: expected a torch.Tensor, jax.Array, cupy.ndarray or numpy.ndarray; got builtins.list"):
        cuflash.attention(q, k.tolist(), v)


def test_mixed_libraries():
    torch = pytest.importorskip("torch")
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"one array library; got q is numpy, k is torch, v is numpy"):
        cuflash.attention(q, torch.from_numpy(k), v)


def test_different_devices():
    torch = pytest.importorskip("torch")
    q, k, v = (torch.from_numpy(x) for x in qkv())
    with pytest.raises(ValueError, match=r"one device; got q on cpu:0, k on meta:0, v on cpu:0"):
        cuflash.attention(q, k.to("meta"), v)


@pytest.mark.parametrize("scale", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_softmax_scale(scale):
    with pytest.raises(ValueError, match=r"softmax_scale: expected a finite number > 0"):
        cuflash.attention(*qkv(), softmax_scale=scale)


@pytest.mark.parametrize("scale", [1000.5, 1e30])
def test_softmax_scale_too_large(scale):
    with pytest.raises(ValueError, match=r"softmax_scale: expected a number in \(0, 1000\]; got "):
        cuflash.attention(*qkv(), softmax_scale=scale)


def test_softmax_scale_type():
    with pytest.raises(TypeError, match=r"softmax_scale: expected a float or None; got str"):
        cuflash.attention(*qkv(), softmax_scale="0.1")


def test_causal_type():
    with pytest.raises(TypeError, match=r"causal: expected a bool; got str"):
        cuflash.attention(*qkv(), causal="yes")


def test_inputs_untouched_by_a_real_call(monkeypatch):
    monkeypatch.undo()  # this one runs the NumPy path for real
    q, k, v = qkv()
    copies = [x.copy() for x in (q, k, v)]
    cuflash.attention(q, k, v, causal=True)
    for x, c in zip((q, k, v), copies):
        assert np.array_equal(x.view(np.uint16), c.view(np.uint16))
