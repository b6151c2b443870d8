"""CPU: the two torch routes of the feature options agree. In eager mode cuflash.attention runs
through an autograd.Function (cuflash/_torch.py:_FeatFunction, less host time); under torch.compile
through the torch.library custom op. Both must give bitwise the same out and gradients (to q, k, v
and sink_logits), since they run the same implementation. Torch CPU tensors take cuflash's NumPy
path, so this runs without a GPU. Fresh random inputs each run (seed in the message)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")


def _run(cf, compiled: bool, monkeypatch, inputs, kw, packed):
    with monkeypatch.context() as m:
        if compiled:  # what torch.compile's tracing reports: the custom op route
            m.setattr(torch.compiler, "is_compiling", lambda: True)
        q, k, v, sink = (x.detach().clone().requires_grad_() for x in inputs)
        if packed:
            out = cf.attention_varlen(q, k, v, *packed, sink_logits=sink, **kw)
        else:
            out = cf.attention(q, k, v, sink_logits=sink, **kw)
        g = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out.dtype)
        grads = torch.autograd.grad(out, (q, k, v, sink), g)
    return out, grads, type(out.grad_fn).__name__


@pytest.mark.parametrize("packed", [False, True])
def test_eager_function_matches_custom_op(monkeypatch, packed):
    import cuflash as cf

    seed = int(np.random.SeedSequence().entropy % (1 << 31))
    gen = torch.Generator().manual_seed(seed)
    h, d = 4, 16
    kw = dict(causal=True, window=(9, 0), num_sink_tokens=2, alibi_slopes=torch.rand(h, generator=gen),
              softcap=5.0)
    if packed:
        cu = torch.tensor([0, 13, 13, 50], dtype=torch.int32)
        shape_q = shape_k = (53, h, d)
        packed_args = (cu, cu, 37, 37)
    else:
        shape_q, shape_k = (2, 41, h, d), (2, 41, 2, d)
        kw["kv_lengths"] = torch.tensor([41, 29], dtype=torch.int32)
        packed_args = None
    inputs = [torch.randn(s, generator=gen).to(torch.bfloat16) for s in (shape_q, shape_k, shape_k)]
    inputs.append(torch.randn(h, generator=gen))
    out_e, g_e, fn_e = _run(cf, False, monkeypatch, inputs, kw, packed_args)
    out_c, g_c, fn_c = _run(cf, True, monkeypatch, inputs, kw, packed_args)
    msg = f"seed={seed} packed={packed}"
    assert fn_e == "_FeatFunctionBackward", f"{msg}: eager call went through {fn_e}"
    assert "attention_feat_fwd" in fn_c, f"{msg}: traced call went through {fn_c}"
    assert torch.equal(out_e, out_c), f"{msg}: out differs"
    for name, a, b in zip(("dq", "dk", "dv", "dsink"), g_e, g_c):
        assert a is not None and torch.isfinite(a.float()).all(), f"{msg}: {name} missing or not finite"
        assert torch.equal(a, b), f"{msg}: {name} differs between the eager and the custom-op route"
