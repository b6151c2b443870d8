"""CPU: the torch adapter's eager hot path of a repeat call (issue 11, host time per call), on the
fake device of tests/test_plan_wiring.py (torch CPU tensors that report cuda:0, launches recorded
with their decoded Params).

A repeat call only builds the signature key, reads pointers, allocates the outputs and launches:
the option arrays travel as a tuple in the plan's order and land on their pointer slots
(consecutive or not), attention_varlen keys cu_seqlens_k by a marker when it is cu_seqlens_q, and
an autograd node whose lse the caller does not get leaves out the packed batch's lse tail fill.
These tests check that each of those still puts the right pointers in the right places, forward
and backward, and that bad input on a repeat signature still raises the same errors before any
launch.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import cuflash  # noqa: E402
from test_plan_wiring import dev, torch_dev  # noqa: E402,F401  (fixtures, used by name)

TOTAL, H, D = 50, 4, 64
CU = (0, 13, 13, 40)   # a sequence of 13, an empty one, one of 27; rows 40..49 belong to none


def _packed(grad=False):
    return [torch.randn(TOTAL, H, D, dtype=torch.bfloat16).requires_grad_(grad) for _ in range(3)]


def _cu():
    return torch.tensor(CU, dtype=torch.int32)


def _names(launches):
    return [L["name"] for L in launches]


def test_varlen_repeat_calls_patch_their_own_pointers(torch_dev):
    """Calls of one signature, with cu_seqlens_k the very tensor cu_seqlens_q is (the key's marker)
    or another tensor of the same signature: each launch gets that call's offsets and output."""
    torch, launched = torch_dev
    q, k, v = _packed()
    for i in range(4):
        cu_q = _cu()
        cu_k = cu_q if i % 2 == 0 else _cu()
        n = len(launched)
        out = cuflash.attention_varlen(q, k, v, cu_q, cu_k, 27, 27, causal=True)
        assert _names(launched[n:])[1:] == ["varlen_fill_tail_u16"], _names(launched[n:])
        fwd, tail = launched[n]["p"], launched[n + 1]["p"]
        assert int(fwd["mask"]["cu_seqlens_q"]) == cu_q.data_ptr()
        assert int(fwd["mask"]["cu_seqlens_k"]) == cu_k.data_ptr()
        assert int(fwd["q"]) == q.data_ptr() and int(fwd["o"]) == out.data_ptr() and int(fwd["lse"]) == 0
        assert int(tail["ptr"]) == out.data_ptr() and int(tail["cu_seqlens"]) == cu_q.data_ptr()
    # return_lse: the lse buffer and its tail fill
    n = len(launched)
    out, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_q, 27, 27, causal=True, return_lse=True)
    assert _names(launched[n:])[1:] == ["varlen_fill_tail_u16", "varlen_fill_tail_u32"]
    assert int(launched[n]["p"]["lse"]) == lse.data_ptr() and int(launched[n + 2]["p"]["ptr"]) == lse.data_ptr()


def test_varlen_repeat_call_bad_input_raises_before_any_launch(torch_dev):
    """After a call of a signature has been planned (its plan cached), calls that differ from it in
    one argument raise the error a first call would, every time, and launch nothing; the good call
    still runs after them."""
    torch, launched = torch_dev
    q, k, v = _packed()
    cu = _cu()
    good = dict(q=q, k=k, v=v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=27, max_seqlen_k=27, causal=True)
    for _ in range(2):
        cuflash.attention_varlen(**good)
    n = len(launched)
    cases = [
        (dict(cu_seqlens_q=cu.long(), cu_seqlens_k=cu.long()), TypeError, "cu_seqlens_q: expected dtype int32"),
        (dict(cu_seqlens_k=cu.long()), TypeError, "cu_seqlens_k: expected dtype int32"),
        (dict(cu_seqlens_k=_cu()[:3]), ValueError, "cu_seqlens_k: expected the shape of cu_seqlens_q"),
        (dict(cu_seqlens_q=cu.numpy(), cu_seqlens_k=cu.numpy()), TypeError, "cu_seqlens_q: expected a torch array"),
        (dict(cu_seqlens_k=list(CU)), TypeError, "cu_seqlens_k"),
        (dict(cu_seqlens_q=None), TypeError, "cu_seqlens_q"),
        (dict(max_seqlen_q=27.0), TypeError, "max_seqlen_q: expected an int"),
        (dict(max_seqlen_k=-1), ValueError, "max_seqlen_k: expected an int >= 0"),
        (dict(causal=1), TypeError, "causal: expected a bool"),
        (dict(softmax_scale=float("nan")), ValueError, "softmax_scale"),
        (dict(q=q.float()), TypeError, "q: dtype float32 is not supported"),
        (dict(k=k[:, :3], v=v[:, :3]), ValueError, "k: nheads_kv 3 must divide"),
        (dict(q=q[None]), ValueError, "q: expected 3 dimensions"),
        (dict(window=(1.5, 0)), TypeError, "window: left must be an int"),
        (dict(alibi_slopes=torch.ones(H, dtype=torch.float64)), TypeError, "alibi_slopes: expected dtype float32"),
    ]
    for change, err, match in cases:
        for _ in range(2):  # a refused call is never cached: the second one raises as well
            with pytest.raises(err, match=match):
                cuflash.attention_varlen(**dict(good, **change))
    assert len(launched) == n, _names(launched[n:])
    out = cuflash.attention_varlen(**good)
    assert len(launched) == n + 2 and int(launched[n]["p"]["o"]) == out.data_ptr()


def test_varlen_autograd_node_leaves_out_the_lse_tail_only_when_lse_is_unseen(torch_dev):
    """With inputs that require grad and no return_lse, the node's lse is written by the attention
    kernel (the backward reads it there) but its tail fill is left out: two launches, as without
    grad. The backward reads that lse and fills dq / dk / dv's tails. With return_lse the caller's
    lse gets its tail fill."""
    torch, launched = torch_dev
    q, k, v = _packed(grad=True)
    cu = _cu()
    for _ in range(2):
        n = len(launched)
        out = cuflash.attention_varlen(q, k, v, cu, cu, 27, 27, causal=True)
        assert type(out.grad_fn).__name__ == "_AttentionBackward"
        assert _names(launched[n:])[1:] == ["varlen_fill_tail_u16"], _names(launched[n:])
        lse_ptr = int(launched[n]["p"]["lse"])
        assert lse_ptr != 0 and int(launched[n]["p"]["o"]) == out.data_ptr()
        n = len(launched)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
        bwd = [L for L in launched[n:] if not L["name"].startswith("varlen_fill_tail")]
        assert bwd and all(int(L["p"]["lse"]) == lse_ptr for L in bwd), _names(launched[n:])
        tails = [int(L["p"]["ptr"]) for L in launched[n:] if L["name"] == "varlen_fill_tail_u16"]
        assert tails == [dq.data_ptr(), dk.data_ptr(), dv.data_ptr()]
        assert int(bwd[0]["p"]["mask"]["cu_seqlens_q"]) == cu.data_ptr()
    n = len(launched)
    out, lse = cuflash.attention_varlen(q, k, v, cu, cu, 27, 27, causal=True, return_lse=True)
    assert _names(launched[n:])[1:] == ["varlen_fill_tail_u16", "varlen_fill_tail_u32"]
    assert int(launched[n]["p"]["lse"]) == lse.data_ptr() == int(launched[n + 2]["p"]["ptr"])
    assert not lse.requires_grad and out.requires_grad


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("options", ["sink", "alibi", "sink+alibi"])
def test_varlen_options_on_their_slots(torch_dev, options, grad):
    """The option arrays' pointers on their MaskParams fields, forward and backward: offsets and sink
    logits take consecutive slots (written in order after a pad), offsets and ALiBi slopes do not
    (written one by one). The sink logits' gradient comes back."""
    torch, launched = torch_dev
    q, k, v = _packed(grad=grad)
    cu = _cu()
    kw = {}
    if "sink" in options:
        kw["sink_logits"] = torch.randn(H).requires_grad_(grad)
    if "alibi" in options:
        kw["alibi_slopes"] = torch.rand(H)
    for _ in range(2):
        n = len(launched)
        out = cuflash.attention_varlen(q, k, v, cu, cu, 27, 27, causal=True, window=(5, 0), **kw)
        m = launched[n]["p"]["mask"]
        assert int(m["cu_seqlens_q"]) == cu.data_ptr() == int(m["cu_seqlens_k"])
        assert int(m["q_lengths"]) == 0 == int(m["kv_lengths"])
        for name in ("sink_logits", "alibi_slopes"):
            assert int(m[name]) == (kw[name].data_ptr() if name in kw else 0), name
        if not grad:
            continue
        n = len(launched)
        g = torch.autograd.grad(out, (q, k, v) + ((kw["sink_logits"],) if "sink_logits" in kw else ()),
                                torch.randn_like(out))
        assert len(g) == (4 if "sink_logits" in kw else 3) and g[0].shape == q.shape
        for L in launched[n:]:
            if L["name"].startswith("varlen_fill_tail"):
                continue
            m = L["p"]["mask"]
            assert int(m["cu_seqlens_q"]) == cu.data_ptr() == int(m["cu_seqlens_k"]), L["name"]
            for name in ("sink_logits", "alibi_slopes"):
                assert int(m[name]) == (kw[name].data_ptr() if name in kw else 0), (L["name"], name)


def test_padded_options_on_their_slots(torch_dev):
    """The same for padded calls: kv_lengths alone (one slot after a pad), q_lengths with ALiBi (apart),
    with grad through the backward."""
    torch, launched = torch_dev
    q, k, v = (torch.randn(2, 40, H, D, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    lengths = torch.tensor([40, 9], dtype=torch.int32)
    slopes = torch.rand(2, H)
    for kw in (dict(kv_lengths=lengths), dict(q_lengths=lengths, alibi_slopes=slopes)):
        for _ in range(2):
            n = len(launched)
            out = cuflash.attention(q, k, v, causal=True, **kw)
            g = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
            assert g[0].shape == q.shape
            for L in launched[n:]:
                m = L["p"]["mask"]
                for name in ("q_lengths", "kv_lengths", "alibi_slopes", "sink_logits", "cu_seqlens_q"):
                    assert int(m[name]) == (kw[name].data_ptr() if name in kw else 0), (L["name"], name)


def test_padded_lengths_same_tensor_marker(torch_dev):
    """The options key marks kv_lengths as "the previous option array" when it is the very tensor
    q_lengths is: calls alternating between one tensor for both and two tensors (of the same or of
    another signature) each put their own pointers on the slots, and a kv_lengths that differs from
    q_lengths in dtype, shape or device still raises on a repeat signature, launching nothing."""
    torch, launched = torch_dev
    q, k, v = (torch.randn(2, 40, H, D, dtype=torch.bfloat16) for _ in range(3))
    for i in range(6):
        ql = torch.tensor([40, 9 + i], dtype=torch.int32)
        kl = ql if i % 2 == 0 else torch.tensor([31, 40], dtype=torch.int32)
        n = len(launched)
        cuflash.attention(q, k, v, causal=True, q_lengths=ql, kv_lengths=kl)
        assert len(launched) > n
        for L in launched[n:]:
            m = L["p"]["mask"]
            assert int(m["q_lengths"]) == ql.data_ptr() and int(m["kv_lengths"]) == kl.data_ptr(), L["name"]
    ql = torch.tensor([40, 9], dtype=torch.int32)
    n = len(launched)
    for bad, err, text in ((ql.long(), TypeError, "kv_lengths: expected dtype int32"),
                           (torch.tensor([40, 9, 3], dtype=torch.int32), ValueError, "kv_lengths"),
                           (ql[:1], ValueError, "kv_lengths")):
        for _ in range(2):
            with pytest.raises(err, match=text):
                cuflash.attention(q, k, v, causal=True, q_lengths=ql, kv_lengths=bad)
    assert len(launched) == n


@pytest.mark.parametrize("grad", [False, True])
def test_explicit_plan_torch_route(torch_dev, grad):
    """cuflash.plan on torch tensors: without grad a call writes no lse unless asked for; with
    inputs that require grad it records the autograd node (lse kept for the backward) and
    autograd's backward launches with the plan's forward pointers; p.backward runs the backward
    directly. Calls with another signature raise before any launch."""
    torch, launched = torch_dev
    mk = lambda *s: torch.randn(*s, dtype=torch.bfloat16).requires_grad_(grad)  # noqa: E731
    q, k, v = mk(2, 40, 4, 64), mk(2, 56, 2, 64), mk(2, 56, 2, 64)
    p = cuflash.plan(q, k, v, causal=True)
    q2, k2, v2 = mk(2, 40, 4, 64), mk(2, 56, 2, 64), mk(2, 56, 2, 64)
    out = p(q2, k2, v2)
    fwd = launched[-1]["p"]
    assert int(fwd["q"]) == q2.data_ptr() and int(fwd["k"]) == k2.data_ptr() and int(fwd["o"]) == out.data_ptr()
    if not grad:
        assert out.grad_fn is None and int(fwd["lse"]) == 0
    else:
        assert type(out.grad_fn).__name__ == "_AttentionBackward" and int(fwd["lse"]) != 0
        n = len(launched)
        dq, dk, dv = torch.autograd.grad(out, (q2, k2, v2), torch.randn_like(out))
        assert len(launched) - n == 3
        for i, L in enumerate(launched[n:]):
            assert int(L["p"]["o"]) == out.data_ptr() and int(L["p"]["lse"]) == int(fwd["lse"])
            # (the preprocess, first, goes out before the gradients exist: BackwardPlan.launch_split)
            grads = (0, 0) if i == 0 else (dq.data_ptr(), dk.data_ptr())
            assert (int(L["p"]["dq"]), int(L["p"]["dk"])) == grads
    with torch.no_grad():
        out, lse = p(q2, k2, v2, return_lse=True)
        assert int(launched[-1]["p"]["lse"]) == lse.data_ptr() and lse.shape == (2, 4, 40)
        n = len(launched)
        dq, dk, dv = p.backward(torch.randn_like(out), q2, k2, v2, out, lse)
        assert int(launched[n]["p"]["lse"]) == lse.data_ptr() and dk.shape == k2.shape
    n = len(launched)
    for bad in ((mk(2, 41, 4, 64), k2, v2), (q2.float(), k2, v2), (q2, k2.transpose(1, 2), v2)):
        with pytest.raises(ValueError, match=r"q, k, v: this plan was made for"):
            p(*bad)
    assert len(launched) == n


# ---- attention_with_kvcache's torch key and its repeat calls (DecodePlan.run_fast) ----

def _kv_args(**over):
    """attention_with_kvcache's arguments in _fast_key's order (CPU tensors: the keys only read
    metadata), with `over` replacing some."""
    g = torch.Generator().manual_seed(0)
    a = dict(q=torch.randn(2, 1, 8, 64, generator=g, dtype=torch.bfloat16),
             k_cache=torch.randn(2, 48, 2, 64, generator=g, dtype=torch.bfloat16),
             v_cache=torch.randn(2, 48, 2, 64, generator=g, dtype=torch.bfloat16), k=None, v=None,
             cache_seqlens=torch.tensor([5, 48], dtype=torch.int32), cache_batch_idx=None, block_table=None,
             causal=False, softmax_scale=None, return_lse=False, window=None, num_sink_tokens=0, sink_logits=None,
             alibi_slopes=None, softcap=None, num_splits=0)
    a.update(over)
    return tuple(a.values())


def _misaligned(shape, dtype=torch.bfloat16):
    """A tensor of `shape` whose data starts 2 bytes past a 16-byte boundary."""
    n = math.prod(shape)
    return torch.zeros(n + 8, dtype=dtype)[1:n + 1].view(shape)


def test_kvcache_torch_key_has_the_generic_keys_facts():
    """The torch adapter's kvcache_key (one flat tuple) against _fast_key over the adapter's sig (the
    generic key): for each pair of calls, the two keys are equal exactly when the generic ones are.
    The pairs change one fact each (dtype, shape, strides, pointer alignment of each array, an option
    array's presence or layout, a scalar's value or type) or none (fresh tensors of the same layout),
    and calls the generic key refuses (arrays of mixed classes) the torch key refuses too."""
    from cuflash import _kvcache
    from cuflash._adapters import _torch as adapter
    from cuflash._adapters._base import window_key

    generic = functools.partial(_kvcache._fast_key, adapter.ADAPTER.sig, window_key)
    fast = adapter.ADAPTER.kvcache_key
    assert _kvcache._keyer(torch.zeros(1)) is fast
    table = torch.zeros(2, 3, dtype=torch.int32)
    cases = {
        "same layout": _kv_args(),
        "q fp16": _kv_args(q=torch.zeros(2, 1, 8, 64, dtype=torch.float16)),
        "q shape": _kv_args(q=torch.zeros(2, 2, 8, 64, dtype=torch.bfloat16)),
        "q strides": _kv_args(q=torch.zeros(2, 8, 1, 64, dtype=torch.bfloat16).transpose(1, 2)),
        "q misaligned": _kv_args(q=_misaligned((2, 1, 8, 64))),
        "k_cache misaligned": _kv_args(k_cache=_misaligned((2, 48, 2, 64))),
        "v_cache misaligned": _kv_args(v_cache=_misaligned((2, 48, 2, 64))),
        "k_cache strides": _kv_args(k_cache=torch.zeros(2, 2, 48, 64, dtype=torch.bfloat16).transpose(1, 2)),
        "v_cache shape": _kv_args(v_cache=torch.zeros(2, 40, 2, 64, dtype=torch.bfloat16)),
        "v_cache fp16": _kv_args(v_cache=torch.zeros(2, 48, 2, 64, dtype=torch.float16)),
        "seqlens int64": _kv_args(cache_seqlens=torch.zeros(2, dtype=torch.int64)),
        "seqlens misaligned": _kv_args(cache_seqlens=_misaligned((2,), torch.int32)),
        "seqlens int": _kv_args(cache_seqlens=48),
        "seqlens other int": _kv_args(cache_seqlens=40),
        "seqlens None": _kv_args(cache_seqlens=None),
        "block_table": _kv_args(block_table=table),
        "block_table strides": _kv_args(block_table=torch.zeros(3, 2, dtype=torch.int32).t()),
        "new tokens": _kv_args(k=torch.zeros(2, 1, 2, 64, dtype=torch.bfloat16),
                               v=torch.zeros(2, 1, 2, 64, dtype=torch.bfloat16)),
        "alibi": _kv_args(alibi_slopes=torch.zeros(8)),
        "sink_logits": _kv_args(sink_logits=torch.zeros(8)),
        "causal": _kv_args(causal=True),
        "causal as int": _kv_args(causal=1),
        "scale": _kv_args(softmax_scale=0.125),
        "scale as int": _kv_args(softmax_scale=1),
        "scale as float": _kv_args(softmax_scale=1.0),
        "return_lse": _kv_args(return_lse=True),
        "window": _kv_args(window=(16, 0)),
        "window as list": _kv_args(window=[16, 0]),
        "sink tokens": _kv_args(num_sink_tokens=4),
        "softcap": _kv_args(softcap=30.0),
        "num_splits": _kv_args(num_splits=2),
    }
    keys = {n: (generic(*a), fast(*a)) for n, a in cases.items()}
    assert generic(*_kv_args()) == keys["same layout"][0] and fast(*_kv_args()) == keys["same layout"][1]
    names = list(keys)
    for i, a in enumerate(names):
        for b in names[i:]:
            same_generic = keys[a][0] == keys[b][0]
            assert (keys[a][1] == keys[b][1]) == same_generic, (a, b)
            assert same_generic == (a == b), (a, b)  # (each case changes a fact the generic key holds)
    mixed = {"k_cache": torch.nn.Parameter(torch.zeros(2, 48, 2, 64, dtype=torch.bfloat16), requires_grad=False),
             "cache_seqlens": np.zeros(2, np.int32), "block_table": np.zeros((2, 3), np.int32)}
    for name, x in mixed.items():
        a = _kv_args(**{name: x})
        for key in (generic, fast):
            with pytest.raises(TypeError):
                key(*a)


def test_kvcache_torch_repeat_calls_patch_their_own_pointers(torch_dev, monkeypatch):
    """attention_with_kvcache on torch tensors (the fake device): the first call of a signature plans
    through the full path, repeat calls take the torch key and DecodePlan.run_fast without
    describe_kvcache; each call's decode launch reads its own q and lengths, the caches in place, and
    writes a fresh out (and lse with return_lse, which is its own signature). A repeat signature with
    one fact changed (q's strides) goes through the full path again, and a bad value on a repeat
    signature still raises before any launch."""
    from _cpu_helpers import _fresh_decode_plans

    from cuflash import _kvcache
    from cuflash._adapters import _torch as adapter

    def allocator(self, cache, shape, dtype, device_id):
        return functools.partial(torch.empty, shape, dtype=getattr(torch, dtype))

    monkeypatch.setattr(adapter.TorchAdapter, "allocator", allocator)
    monkeypatch.setattr(adapter.TorchAdapter, "empty_from",
                        lambda self, cache, shape, dtype, device_id: torch.empty(shape, dtype=getattr(torch, dtype)))
    monkeypatch.setattr(_kvcache, "_sm_count", lambda device_id: 132)
    _fresh_decode_plans(monkeypatch)
    described = []
    real = _kvcache.describe_kvcache
    monkeypatch.setattr(_kvcache, "describe_kvcache", lambda *a, **k: described.append(1) or real(*a, **k))
    _, launched = torch_dev
    g = torch.Generator().manual_seed(0)
    kc, vc = (torch.randn(2, 48, 2, 64, generator=g, dtype=torch.bfloat16) for _ in range(2))

    def decode_params():
        (p,) = [L["p"] for L in launched if L["name"].startswith("decode_") and "combine" not in L["name"]]
        launched.clear()
        return p

    outs = []
    for i in range(3):
        q = torch.randn(2, 1, 8, 64, generator=g, dtype=torch.bfloat16)
        seqlens = torch.tensor([5 + i, 48], dtype=torch.int32)
        for lse_seen in (False, True):
            res = cuflash.attention_with_kvcache(q, kc, vc, cache_seqlens=seqlens, return_lse=lse_seen)
            out, lse = res if lse_seen else (res, None)
            p = decode_params()
            assert int(p["q"]) == q.data_ptr() and int(p["cache_seqlens"]) == seqlens.data_ptr()
            assert int(p["k"]) == kc.data_ptr() and int(p["v"]) == vc.data_ptr()
            assert out.shape == q.shape and out.dtype == q.dtype and int(p["o"]) == out.data_ptr()
            if lse_seen:
                assert lse.shape == (2, 8, 1) and lse.dtype == torch.float32 and int(p["lse"]) == lse.data_ptr()
            else:
                assert int(p["lse"]) == 0
            outs.append(out)
    assert len(described) == 2, "planned once per signature; the repeats took the fast path"
    assert len({o.data_ptr() for o in outs}) == len(outs), "a fresh out per call"
    q_t = torch.randn(2, 8, 1, 64, generator=g, dtype=torch.bfloat16).transpose(1, 2)
    cuflash.attention_with_kvcache(q_t, kc, vc, cache_seqlens=seqlens)
    assert len(described) == 3, "another q layout: the full path"
    decode_params()
    with pytest.raises(ValueError, match="num_splits"):
        cuflash.attention_with_kvcache(q, kc, vc, cache_seqlens=seqlens, num_splits=-1)
    assert not launched


@pytest.mark.parametrize("lse_seen", [False, True])
def test_kvcache_spare_outputs(torch_dev, monkeypatch, lse_seen):
    """A repeat decode call launches into the outputs the previous eager call on its stream allocated
    after its launch (DecodePlan._make_spare), and allocates the next call's after its own launch:
    nothing is allocated between a repeat call's start and its launch. Each call still returns
    outputs of its own (never another call's). Not while the stream captures a graph (the spare is
    dropped, the call allocates its own before the launch and leaves no spare), not on another
    stream, not over _SPARE_MAX_BYTES, not with CUFLASH_DECODE_SPARE=0."""
    from _cpu_helpers import _fresh_decode_plans

    from cuflash import _kvcache
    from cuflash._adapters import _torch as adapter

    _, launched = torch_dev
    allocated = []  # (launches so far, the tensor) of each output allocation

    def empty(shape, dtype):
        t = torch.empty(shape, dtype=getattr(torch, dtype))
        allocated.append((len(launched), t))
        return t

    monkeypatch.setattr(adapter.TorchAdapter, "allocator",
                        lambda self, cache, shape, dtype, device_id: functools.partial(empty, shape, dtype))
    monkeypatch.setattr(_kvcache, "_sm_count", lambda device_id: 132)
    capturing = [False]
    monkeypatch.setattr(_kvcache, "stream_capturing", lambda stream: capturing[0])
    g = torch.Generator().manual_seed(0)
    kc, vc = (torch.randn(2, 48, 2, 64, generator=g, dtype=torch.bfloat16) for _ in range(2))
    per_call = 2 if lse_seen else 1  # allocations of one set of outputs

    def call():
        """(out, lse or None, the outputs it allocated before its decode launch, those after it)."""
        q = torch.randn(2, 1, 8, 64, generator=g, dtype=torch.bfloat16)
        n, a = len(launched), len(allocated)
        res = cuflash.attention_with_kvcache(q, kc, vc, cache_seqlens=torch.tensor([5, 48], dtype=torch.int32),
                                             return_lse=lse_seen)
        out, lse = res if lse_seen else (res, None)
        (p,) = [L["p"] for L in launched[n:] if L["name"].startswith("decode_") and "combine" not in L["name"]]
        assert int(p["o"]) == out.data_ptr() and int(p["lse"]) == (lse.data_ptr() if lse_seen else 0)
        new = allocated[a:]
        return out, lse, [t for k, t in new if k == n], [t for k, t in new if k > n]

    def ptrs_of(outs):
        return [t.data_ptr() for t in outs]

    _fresh_decode_plans(monkeypatch)
    out1, lse1, before, after = call()
    assert ptrs_of(before) == [x.data_ptr() for x in (out1, lse1) if x is not None]
    assert len(after) == per_call, "the first call leaves a spare"
    kept = [(out1, lse1)]
    for _ in range(3):
        spare = after
        out, lse, before, after = call()
        assert not before, "a repeat call allocates nothing before its launch"
        assert ptrs_of(spare) == [x.data_ptr() for x in (out, lse) if x is not None], "it takes the spare"
        assert len(after) == per_call
        kept.append((out, lse))
    ptrs = [x.data_ptr() for pair in kept for x in pair if x is not None]
    assert len(set(ptrs)) == len(ptrs), "every call returns outputs of its own"

    capturing[0] = True  # a graph capture: the eager spare stays out of it, and none is made
    spare = after
    out, lse, before, after = call()
    assert len(before) == per_call and not after
    assert out.data_ptr() not in ptrs_of(spare)
    capturing[0] = False
    out, lse, before, after = call()  # (no spare: allocates first, then leaves one)
    assert len(before) == per_call and len(after) == per_call

    monkeypatch.setattr(adapter, "_raw_stream", lambda device_id: 78)  # another stream: its own
    spare77 = ptrs_of(after)
    out, lse, before, after = call()
    assert len(before) == per_call and out.data_ptr() not in spare77
    monkeypatch.setattr(adapter, "_raw_stream", lambda device_id: 77)  # back: stream 77's spare
    out, lse, before, after = call()
    assert not before and out.data_ptr() == spare77[0]

    for setting in ("env", "size"):
        _fresh_decode_plans(monkeypatch)
        with monkeypatch.context() as m:
            if setting == "env":
                m.setenv("CUFLASH_DECODE_SPARE", "0")
            else:
                m.setattr(_kvcache, "_SPARE_MAX_BYTES", 2 * 8 * 64 * 2 - 1)  # one byte short of out's
            for _ in range(2):
                out, lse, before, after = call()
                assert len(before) == per_call and not after, setting
