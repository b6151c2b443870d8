"""attention_varlen with a block_table on the GPU (the paged prefill: on sm_90a, where the warp-specialized
feature kernel serves the call, that kernel reading the pages in place, cuflash/_kvcache.py
_paged_varlen_plan; otherwise, and with CUFLASH_PAGED_DIRECT=0, GatherPlan + cuda_src/paged_gather.cu,
then attention_varlen on the gathered keys).

Marked gpu: torch CUDA, CuPy and JAX. Each case (tests/test_paged_varlen_cpu.py's make_case: random block
tables, slots no sequence reads NaN-poisoned, unused table entries out of range, offsets of
cu_seqlens_k starting anywhere) must give out and lse bit for bit equal to attention_varlen on the GPU
with the keys gathered here one position at a time (packed, without block_table) — those kernels are
checked against the float64 reference by the GPU varlen tests — and be finite everywhere. The CPU
variant of each case runs the NumPy path the same way (bit-equal to attention_varlen on the gathered
keys), so the file's own logic is tested without a GPU."""

import numpy as np
import pytest

import cuflash
from _cpu_helpers import _ctx, _new_seed
from test_kvcache_cpu import _features
from test_kvcache_device import _back, _skip_unusable as _skip, _to
from test_paged_varlen_cpu import BF16, FP16, _cu, _same_bits, logical_keys, make_case

torch = pytest.importorskip("torch")

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu), pytest.param("cupy", marks=pytest.mark.gpu),
           pytest.param("jax", marks=pytest.mark.gpu)]


def _check(case, device, causal, opts, ctx):
    dev_opts = {n: (_to(x, device) if isinstance(x, np.ndarray) else x) for n, x in opts.items()}
    args = {n: (_to(x, device) if isinstance(x, np.ndarray) else x) for n, x in case.args().items()}
    out, lse = cuflash.attention_varlen(**args, causal=causal, return_lse=True, **dev_opts)
    keys = logical_keys(case)
    kp = np.concatenate([k for k, _ in keys] or [np.zeros((0,) + case.k.shape[2:], case.k.dtype)])
    vp = np.concatenate([v for _, v in keys] or [np.zeros((0,) + case.v.shape[2:], case.v.dtype)])
    if len(kp) == 0:
        kp = vp = np.zeros((1,) + case.k.shape[2:], case.k.dtype)
    want, want_lse = cuflash.attention_varlen(_to(case.q, device), _to(kp, device), _to(vp, device),
                                              _to(case.cu_q, device), _to(_cu(case.seq_k), device), case.max_q,
                                              case.max_k, causal=causal, return_lse=True, **dev_opts)
    out, lse, want, want_lse = (_back(x) for x in (out, lse, want, want_lse))
    assert np.isfinite(out.astype(np.float32)).all(), f"non-finite out (a poisoned slot was read?); {ctx}"
    assert _same_bits(out, want), f"out differs from attention_varlen on the gathered keys; {ctx}"
    assert np.array_equal(lse, want_lse), f"lse differs; {ctx}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("page", [16, 48, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("direct", ["1", "0"])
def test_paged_prefill(monkeypatch, device, page, causal, direct):
    """direct "1": the pages read in place where the kernel serves the call (on an sm_90a GPU the plan
    must have done so for at least one case), "0": the gather route (CUFLASH_PAGED_DIRECT=0)."""
    from cuflash import _kvcache

    _skip(device, FP16)
    monkeypatch.setenv("CUFLASH_PAGED_DIRECT", direct)
    monkeypatch.setattr(_kvcache, "_DIRECT_VARLEN_PLANS", {})
    seed = _new_seed()
    for i, (dtype, d, gqa, start) in enumerate([(FP16, 64, 4, 0), (BF16, 128, 1, 7), (FP16, 96, 2, 3)]):
        if device == "cupy" and dtype == BF16:
            continue
        rng = np.random.default_rng([seed, i])
        case = make_case(rng, seq_q=[7, 20, 1, 0, 9], seq_k=[40, 20, 17, 0, 300], page=page, dtype=dtype,
                         nheads=2 * gqa, nheads_kv=2, head_dim=d, tail_q=2, cu_k_start=start, max_extra=(1, 5),
                         shared=1 if page == 16 else 0)
        _check(case, device, causal, {}, _ctx(seed, device=device, case=i, page=page, causal=causal, direct=direct))
    if device != "cpu" and torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
        made = list(_kvcache._DIRECT_VARLEN_PLANS.values())
        assert any(made) == (direct == "1"), made


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["win5_2", "sinktok", "sinklogit", "alibi_h", "softcap", "all"])
@pytest.mark.parametrize("direct", ["1", "0"])
def test_paged_prefill_options(monkeypatch, device, name, direct):
    """direct "1": the pages read in place wherever the warp-specialized feature kernel serves the options
    (not the narrow windows), "0": the gather route."""
    from cuflash import _kvcache

    _skip(device, FP16)
    monkeypatch.setenv("CUFLASH_PAGED_DIRECT", direct)
    monkeypatch.setattr(_kvcache, "_DIRECT_VARLEN_PLANS", {})
    seed = _new_seed()
    rng = np.random.default_rng(seed)
    opts, qk_scale = _features(rng, name, 3, 8)
    case = make_case(rng, seq_q=[12, 5, 30], seq_k=[50, 5, 70], page=16, nheads=8, nheads_kv=2, head_dim=64,
                     qk_scale=qk_scale)
    _check(case, device, name != "win5_2", opts, _ctx(seed, device=device, option=name, direct=direct))
    if device != "cpu" and torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
        made = list(_kvcache._DIRECT_VARLEN_PLANS.values())
        assert any(made) == (direct == "1" and name in ("sinklogit", "alibi_h", "softcap")), (made, name)


@pytest.mark.gpu
def test_paged_prefill_repeated_signature_checks_grad():
    """A signature seen before skips the checks (cuflash/_kvcache.py _PAGED_FAST), but not the refusal of
    tensors that require grad: after a plain call, the same shapes with q, k, v or sink_logits requiring
    grad raise NotImplementedError naming block_table (no silent missing gradient); under torch.no_grad()
    the call runs and matches the plain one bit for bit (torch CUDA)."""
    _skip("cuda", FP16)
    seed = _new_seed()
    rng = np.random.default_rng(seed)
    case = make_case(rng, seq_q=[3, 5], seq_k=[20, 5], page=16, nheads=8, nheads_kv=2, head_dim=64)
    sinks = torch.zeros(8, device="cuda")

    def args():
        return {n: (_to(x, "cuda") if isinstance(x, np.ndarray) else x) for n, x in case.args().items()}

    want = _back(cuflash.attention_varlen(**args(), causal=True, sink_logits=sinks))
    for name in ("q", "k", "v", "sink_logits"):
        t = dict(args(), sink_logits=sinks.clone())
        t[name] = t[name].clone().requires_grad_(True)
        with pytest.raises(NotImplementedError, match=f"^block_table: .*forward only.* got {name} with requires_grad"):
            cuflash.attention_varlen(**t, causal=True)
        with torch.no_grad():
            out = cuflash.attention_varlen(**t, causal=True)
        assert not out.requires_grad and _same_bits(_back(out), want), (name, _ctx(seed))
