"""CPU: the two torch routes agree. In eager mode cuflash.attention runs through an
autograd.Function (cuflash/_adapters/_torch.py:_Attention, less host time); under torch.compile
through _CompiledAttention / _CompiledFeatAttention, whose forward and backward are the torch.library
operators. Both must give bitwise the same out and gradients (to q, k, v
and sink_logits), since they run the same plans. Torch CPU tensors take cuflash's NumPy path, so
this runs without a GPU. Fresh random inputs each run (seed in the message)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")


def _run(cf, compiled: bool, monkeypatch, inputs, kw, packed):
    with monkeypatch.context() as m:
        if compiled:  # what torch.compile's tracing reports: the custom op route
            from cuflash._adapters import _torch as adapter

            m.setattr(torch.compiler, "is_compiling", lambda: True)
            m.setattr(adapter, "_is_compiling", lambda: True)
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
    assert fn_e == "_AttentionBackward", f"{msg}: eager call went through {fn_e}"
    assert fn_c == "_CompiledFeatAttentionBackward", f"{msg}: traced call went through {fn_c}"
    assert torch.equal(out_e, out_c), f"{msg}: out differs"
    for name, a, b in zip(("dq", "dk", "dv", "dsink"), g_e, g_c):
        assert a is not None and torch.isfinite(a.float()).all(), f"{msg}: {name} missing or not finite"
        assert torch.equal(a, b), f"{msg}: {name} differs between the eager and the custom-op route"


def test_plain_eager_function_matches_custom_op(monkeypatch):
    """The same for a plain causal call (no options): torch.ops.cuflash.attention_fwd under tracing."""
    import cuflash as cf

    seed = int(np.random.SeedSequence().entropy % (1 << 31))
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(s, generator=gen).to(torch.float16) for s in ((2, 23, 4, 16), (2, 31, 2, 16), (2, 31, 2, 16)))
    res = []
    for compiled in (False, True):
        with monkeypatch.context() as m:
            if compiled:
                from cuflash._adapters import _torch as adapter

                m.setattr(adapter, "_is_compiling", lambda: True)
            qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
            out = cf.attention(qq, kk, vv, causal=True)
            g = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(out.dtype)
            res.append((out, torch.autograd.grad(out, (qq, kk, vv), g), type(out.grad_fn).__name__))
    (o_e, g_e, fn_e), (o_c, g_c, fn_c) = res
    msg = f"seed={seed}"
    assert fn_e == "_AttentionBackward", f"{msg}: eager call went through {fn_e}"
    assert fn_c == "_CompiledAttentionBackward", f"{msg}: traced call went through {fn_c}"
    assert torch.equal(o_e, o_c), f"{msg}: out differs"
    for name, a, b in zip(("dq", "dk", "dv"), g_e, g_c):
        assert torch.isfinite(a.float()).all(), f"{msg}: {name} not finite"
        assert torch.equal(a, b), f"{msg}: {name} differs between the eager and the custom-op route"


@pytest.mark.parametrize("options", [False, True])
def test_torch_compile_traces_without_graph_break(options):
    """torch.compile (AOTAutograd, no code generation: runs on the CPU) traces cuflash.attention into
    the graph with no break, and its out and gradients equal the eager call's bitwise."""
    import cuflash as cf

    seed = int(np.random.SeedSequence().entropy % (1 << 31))
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(s, generator=gen).to(torch.bfloat16) for s in ((2, 19, 4, 16), (2, 27, 2, 16), (2, 27, 2, 16)))
    sink = torch.randn(4, generator=gen)
    kw = dict(window=(5, 0), sink_logits=sink) if options else {}

    def f(q, k, v):
        return cf.attention(q, k, v, causal=True, **kw)

    explanation = torch._dynamo.explain(f)(q, k, v)
    assert explanation.graph_break_count == 0, f"seed={seed}: {explanation.break_reasons}"
    text = "\n".join(str(m.graph) for g in explanation.graphs for _, m in g.named_modules()
                     if isinstance(m, torch.fx.GraphModule))
    op = "attention_feat_fwd" if options else "attention_fwd"
    assert f"cuflash.{op}" in text, f"seed={seed}: torch.ops.cuflash.{op} is not in the traced graph"
    g = torch.randn((2, 19, 4, 16), generator=gen).to(torch.bfloat16)
    res = []
    for fn in (f, torch.compile(f, backend="aot_eager", fullgraph=True)):
        qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
        out = fn(qq, kk, vv)
        res.append((out, torch.autograd.grad(out, (qq, kk, vv), g)))
    (o1, g1), (o2, g2) = res
    assert torch.equal(o1, o2), f"seed={seed}: out differs under torch.compile"
    for name, a, b in zip(("dq", "dk", "dv"), g1, g2):
        assert torch.equal(a, b), f"seed={seed}: {name} differs under torch.compile"


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("varlen", [False, True])
def test_torch_compile_checks_once_at_trace_time(monkeypatch, dynamic, varlen):
    """With static shapes the checks run at trace time through `_checked` (a constant to Dynamo: no
    guards from the validation code), not through the traced checks; symbolic shapes take the traced
    checks. Both give the eager results bitwise, with options."""
    import cuflash as cf
    from cuflash._adapters import _torch as T

    traced_checks = []

    def spy(real):
        def wrapper(*a, **kw):
            traced_checks.append(real.__name__)
            return real(*a, **kw)
        return wrapper

    for name in ("_traced_attention_checks", "_traced_varlen_checks"):
        monkeypatch.setattr(T, name, spy(getattr(T, name)))
    seed = int(np.random.SeedSequence().entropy % (1 << 31))
    gen = torch.Generator().manual_seed(seed)
    alibi = torch.rand(4, generator=gen) * 0.3

    def f(q, k, v, cu):
        if varlen:
            return cf.attention_varlen(q, k, v, cu, cu, 24, 24, causal=True, window=(6, 0), alibi_slopes=alibi)
        return cf.attention(q, k, v, causal=True, window=(6, 0), alibi_slopes=alibi)

    torch._dynamo.reset()
    g = torch.compile(f, backend="aot_eager", fullgraph=True, dynamic=dynamic)
    for s in (16, 24):  # a second length re-traces (and is checked again)
        shape = (2 * s, 4, 16) if varlen else (2, s, 4, 16)
        q, k, v = (torch.randn(shape, generator=gen).to(torch.bfloat16) for _ in range(3))
        cu = torch.tensor([0, s, 2 * s], dtype=torch.int32)
        assert torch.equal(g(q, k, v, cu), f(q, k, v, cu)), f"seed={seed}: seqlen {s}"
    if dynamic:
        assert traced_checks, "symbolic shapes should take the traced checks"
    else:
        assert not traced_checks, "static shapes should be checked by _checked, not traced"


@pytest.mark.parametrize("fullgraph", [False, True])
def test_torch_compile_bad_input(fullgraph):
    """Bad input under torch.compile: without fullgraph Dynamo runs the frame eagerly and the eager
    ValueError reaches the caller; with fullgraph Dynamo refuses to compile a frame that raises, and
    its error carries ours. Either way nothing runs."""
    import cuflash as cf

    q = torch.randn(1, 16, 2, 12).to(torch.bfloat16)  # head_dim 12: not a multiple of 8
    torch._dynamo.reset()
    g = torch.compile(lambda q: cf.attention(q, q, q, causal=True), backend="aot_eager", fullgraph=fullgraph)
    if fullgraph:
        with pytest.raises(Exception, match="q: head_dim 12 is not supported"):
            g(q)
    else:
        with pytest.raises(ValueError, match="q: head_dim 12 is not supported"):
            g(q)
