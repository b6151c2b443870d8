"""Property-based tests of the CUDA kernels through the public API on torch CUDA tensors (marked
gpu: skipped without a GPU), with hypothesis.

The problems of tests/test_property_cpu.py (shapes, GQA, dtypes, causal, scales and every
combination of the options; padded batches and attention_varlen), with torch layouts: contiguous,
a (batch, nheads, seqlen, head_dim) tensor passed as .transpose(1, 2), a slice of a wider last
dimension 8 bytes into it (not 16-byte aligned: the copy path), and every other batch entry of a
larger tensor. `deterministic` is drawn too. Before every call the GPU memory pools are refilled
with NaN bytes (tests/test_gpu_features.py's poison), so an output element the kernels forget to
write shows up. Results are checked against the float64 references with the rules of
tests/test_gpu_features.py (out within 2x the naive input-dtype error + 1e-5; dq, dk, dv within 3x
+ 1e-4, after the allowance of tests/test_cpu_features.py for the error of D; lse to 1e-3
relative; dsink against the reference and against its definition), on calls pooled as in the CPU
file (at least 16 batch entries below seqlen 64). Inputs are never modified.

A bounded number of examples (CUFLASH_HYPOTHESIS_SCALE multiplies it); each failure prints
hypothesis's reproduction blob and the data seed (`seed=...`).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

pytest.importorskip("hypothesis")
from hypothesis import example, given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from test_property_cpu import (ONE_KEY_FP16, ONE_KEY_SINK, ONE_KEY_SOFTCAP, Problem,  # noqa: E402
                               check_forward_backward, make_arrays, padded_problems, pool, prop_settings, repeats,
                               unpack, varlen_arrays, varlen_problems)

pytestmark = pytest.mark.gpu

BF16 = np.dtype(ml_dtypes.bfloat16)
# The CPU file's layouts, as torch allows them (no negative strides: "reversed" becomes a batch stride).
GPU_LAYOUT = {"contiguous": "contiguous", "bhsd": "bhsd", "sliced": "sliced", "reversed": "every_other"}


@pytest.fixture(scope="module")
def torch():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    return torch


def to_cuda(torch, x: np.ndarray, layout: str = "contiguous"):
    """A host array as a torch CUDA tensor with the given strides (same values)."""
    a = np.ascontiguousarray(x)
    t = (torch.from_numpy(a.view(np.int16)).view(torch.bfloat16) if a.dtype == BF16 else torch.from_numpy(a)).cuda()
    if layout == "bhsd":
        return t.transpose(1, 2).contiguous().transpose(1, 2)
    if layout == "sliced":
        big = torch.zeros(t.shape[:-1] + (t.shape[-1] + 12,), dtype=t.dtype, device=t.device)
        big[..., 4:4 + t.shape[-1]] = t
        return big[..., 4:4 + t.shape[-1]]
    if layout == "every_other":
        big = torch.zeros((2 * t.shape[0],) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
        big[::2] = t
        return big[::2]
    return t


def to_host(torch, t) -> np.ndarray:
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(BF16)
    return t.numpy()


def _poison(nbytes):
    from test_gpu_features import poison

    poison(nbytes)


def _untouched(torch, pairs, ctx):
    for name, t, c in pairs:
        assert torch.equal(t.detach().contiguous().view(-1).view(torch.uint8) if t.dim() else t.view(1),
                           c.contiguous().view(-1).view(torch.uint8) if c.dim() else c.view(1)), \
            f"{name} was modified by the call; {ctx}"


def _snap(torch, named):
    """Copies of every tensor passed, and of the tensor a view was cut from (its padding included)."""
    snap = []
    for n, t in named.items():
        if isinstance(t, torch.Tensor):
            snap.append((n, t, t.detach().clone()))
            if t._base is not None:
                snap.append((n + ".base", t._base, t._base.detach().clone()))
    return snap


def run_padded_gpu(torch, p: Problem, rep: int, deterministic: bool):
    import cuflash

    q, k, v, dout, api, ref = make_arrays(p, rep)
    ctx = f"{p.ctx()} deterministic={deterministic} repeat={rep}"
    tq, tk, tv, tdo = (to_cuda(torch, x, GPU_LAYOUT[lay]) for x, lay in zip((q, k, v, dout), p.layouts))
    tapi = {n: to_cuda(torch, x) if isinstance(x, np.ndarray) else x for n, x in api.items()}
    snap = _snap(torch, {"q": tq, "k": tk, "v": tv, "dout": tdo, **tapi})
    nbytes = sum(x.nbytes for x in (q, k, v, dout))
    _poison(nbytes)
    out, lse = cuflash.attention(tq, tk, tv, causal=p.causal, softmax_scale=p.scale, return_lse=True,
                                 deterministic=deterministic, **tapi)
    assert out.is_cuda and lse.is_cuda, ctx
    _poison(nbytes)
    grads = cuflash.attention_backward(tdo, tq, tk, tv, out, lse, causal=p.causal, softmax_scale=p.scale,
                                       deterministic=deterministic, **tapi)
    torch.cuda.synchronize()
    _untouched(torch, snap, ctx)
    res = {"out": to_host(torch, out), "lse": to_host(torch, lse), "grads": [to_host(torch, g) for g in grads],
           "alibi_slopes": ref.get("alibi_slopes")}
    return (q, k, v, dout), ref, res


@prop_settings(40)
@given(p=padded_problems(), deterministic=st.booleans())
@example(p=ONE_KEY_SOFTCAP, deterministic=False)  # rows that see one key: D's correction (test_property_cpu)
@example(p=ONE_KEY_SOFTCAP, deterministic=True)
@example(p=ONE_KEY_FP16, deterministic=False)
@example(p=ONE_KEY_SINK, deterministic=True)
def test_attention_cuda(torch, p, deterministic):
    reps = repeats(p)
    calls = [run_padded_gpu(torch, p, r, deterministic) for r in range(reps)]
    pp, q, k, v, dout, ref, out, lse, grads = pool(p, reps, calls[0][1], [c[0] for c in calls],
                                                   [c[2] for c in calls])
    check_forward_backward(pp, q, k, v, dout, ref, out, lse, grads, backend="gpu",
                           ctx=f"{p.ctx()} deterministic={deterministic} repeats={reps}")


def run_varlen_gpu(torch, p: Problem, rep: int, deterministic: bool):
    import cuflash

    (qp, kp, vp, dop), cq, ck, padded, api, ref, pad = varlen_arrays(p, rep)
    ctx = f"{p.ctx()} deterministic={deterministic} repeat={rep}"
    mq, mk = p.seqlen_q + p.max_extra[0], p.seqlen_k + p.max_extra[1]
    tq, tk, tv, tdo, tcq, tck = (to_cuda(torch, x) for x in (qp, kp, vp, dop, cq, ck))
    tapi = {n: to_cuda(torch, x) if isinstance(x, np.ndarray) else x for n, x in api.items()}
    snap = _snap(torch, {"q": tq, "k": tk, "v": tv, "dout": tdo, "cu_seqlens_q": tcq, "cu_seqlens_k": tck, **tapi})
    nbytes = sum(x.nbytes for x in (qp, kp, vp, dop))
    _poison(nbytes)
    out, lse = cuflash.attention_varlen(tq, tk, tv, tcq, tck, mq, mk, causal=p.causal, softmax_scale=p.scale,
                                        return_lse=True, deterministic=deterministic, **tapi)
    _poison(nbytes)
    grads = cuflash.attention_varlen_backward(tdo, tq, tk, tv, out, lse, tcq, tck, mq, mk, causal=p.causal,
                                              softmax_scale=p.scale, deterministic=deterministic, **tapi)
    torch.cuda.synchronize()
    _untouched(torch, snap, ctx)
    out, lse = to_host(torch, out), to_host(torch, lse)
    grads = [to_host(torch, g) for g in grads]
    assert out.shape == qp.shape and lse.shape == (p.nheads, qp.shape[0]), ctx
    tq_, tk_ = int(cq[-1]), int(ck[-1])
    assert (out[tq_:].astype(np.float32) == 0).all() and np.isneginf(lse[:, tq_:]).all(), \
        f"rows past the last sequence; {ctx}"
    assert (grads[0][tq_:].astype(np.float32) == 0).all(), f"dq past the last sequence; {ctx}"
    assert all((g[tk_:].astype(np.float32) == 0).all() for g in grads[1:3]), f"dk, dv past the last sequence; {ctx}"
    sq, sk = padded[0].shape[1], padded[1].shape[1]
    res = {"out": unpack(out, cq, sq, 0), "lse": unpack(lse.T, cq, sq, -np.inf).transpose(0, 2, 1).copy(),
           "grads": [unpack(grads[0], cq, sq, 0), unpack(grads[1], ck, sk, 0), unpack(grads[2], ck, sk, 0)]
           + grads[3:], "alibi_slopes": ref.get("alibi_slopes")}
    return padded, ref, res


# Session 20's failure (a ZeroDivisionError while planning the warp-specialized backward of a packed
# batch with no keys; tests/test_plan_wiring.py has its CPU twin).
EMPTY_PACKED = Problem(seed=0, dtype="bfloat16", batch=1, seqlen_q=0, seqlen_k=0, nheads_kv=1, group=1, head_dim=32,
                       causal=False, scale=None, layouts=("contiguous",) * 4, seq_q=[0], seq_k=[0], tail_q=1,
                       tail_k=1)


@prop_settings(20)
@given(p=varlen_problems(), deterministic=st.booleans())
@example(p=EMPTY_PACKED, deterministic=False)
def test_attention_varlen_cuda(torch, p, deterministic):
    pad = varlen_arrays(p)[6]
    reps = repeats(pad)
    calls = [run_varlen_gpu(torch, p, r, deterministic) for r in range(reps)]
    pp, q, k, v, dout, ref, out, lse, grads = pool(pad, reps, calls[0][1], [c[0] for c in calls],
                                                   [c[2] for c in calls])
    check_forward_backward(pp, q, k, v, dout, ref, out, lse, grads, backend="gpu",
                           ctx=f"{p.ctx()} deterministic={deterministic} repeats={reps}")
