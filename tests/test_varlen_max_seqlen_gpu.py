"""attention_varlen on the GPU with sequences longer than the max_seqlen_q / max_seqlen_k the caller
passed: a broken promise the GPU path cannot check (the offsets stay on the device), found by the GPU
fuzzer (tests/test_fuzz_inputs.py, 'max_seqlen too_small': the rows past max_seqlen came back as
whatever the output allocation held). The kernels' grid covers each sequence's first max_seqlen
rows; cuda_src/varlen.cu fills the rest, after them, as it fills rows that belong to no sequence:
out 0, lse -inf, gradients 0. Checked with the allocator poisoned: the sizes of out, lse and the
gradients are first allocated NaN-filled and freed, so a row nothing writes reads NaN.

Marked gpu (torch). On the CPU the offsets are checked and such a call is a ValueError
(tests/test_fuzz_inputs.py covers that side)."""

import numpy as np
import pytest

import cuflash
from _cpu_helpers import _ctx, _new_seed

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu


def _poison(*shapes_dtypes):
    """Leaves NaN-filled blocks of these sizes in torch's caching allocator for the next allocations."""
    held = [torch.full(s, float("nan"), dtype=dt, device="cuda") for s, dt in shapes_dtypes]
    torch.cuda.synchronize()
    del held


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("option", [None, "window", "softcap"])
def test_rows_past_max_seqlen_are_filled(dtype, causal, option):
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    seed = _new_seed()
    g = torch.Generator(device="cpu").manual_seed(seed)
    h, hkv, d = 4, 2, 64
    lens_q, lens_k = [20, 3, 37, 0, 9], [25, 3, 40, 6, 9]
    max_q = max_k = 8  # every sequence but two is longer than the call says
    cu_q = torch.tensor(np.concatenate([[0], np.cumsum(lens_q)]), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor(np.concatenate([[0], np.cumsum(lens_k)]), dtype=torch.int32, device="cuda")
    tq, tk = sum(lens_q) + 2, sum(lens_k)  # two rows past the last sequence too
    q = torch.randn(tq, h, d, generator=g).to(dtype).cuda()
    k = torch.randn(tk, hkv, d, generator=g).to(dtype).cuda()
    v = torch.randn(tk, hkv, d, generator=g).to(dtype).cuda()
    dout = torch.randn(tq, h, d, generator=g).to(dtype).cuda()
    opts = {"window": (5, 0 if causal else 3)} if option == "window" else (
        {"softcap": 20.0} if option == "softcap" else {})
    ctx = _ctx(seed, dtype=str(dtype), causal=causal, option=option)

    _poison(((tq, h, d), dtype), ((h, tq), torch.float32))
    out, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, return_lse=True, **opts)
    _poison(((tq, h, d), dtype), ((tk, hkv, d), dtype), ((tk, hkv, d), dtype))
    dq, dk, dv = cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k,
                                                   causal=causal, **opts)[:3]
    torch.cuda.synchronize()
    for name, x in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert torch.isfinite(x.float()).all(), f"{name}: non-finite (a row nothing wrote?); {ctx}"
    assert not torch.isnan(lse).any() and not (lse == float("inf")).any(), f"lse: NaN or +inf; {ctx}"

    def past(lens, max_len, total):
        """Rows of each sequence at or past max_len, and rows past the last sequence."""
        rows, start = [], 0
        for n in lens:
            rows += range(start + min(n, max_len), start + n)
            start += n
        return rows + list(range(start, total))

    rq, rk = past(lens_q, max_q, tq), past(lens_k, max_k, tk)
    assert rq and rk
    assert (out[rq] == 0).all() and (lse[:, rq] == float("-inf")).all(), f"out / lse past max_seqlen_q; {ctx}"
    assert (dq[rq] == 0).all(), f"dq past max_seqlen_q; {ctx}"
    assert (dk[rk] == 0).all() and (dv[rk] == 0).all(), f"dk / dv past max_seqlen_k; {ctx}"
