"""GPU tests of cuflash inside torch training code: torch.compile, CUDA graphs, streams.
Every test here is marked ``gpu`` (skipped without a GPU).

* torch.compile(fullgraph=True) of a small two-layer transformer (bf16, causal, MHA then GQA 4->2)
  whose attention calls cuflash.attention on (b, s, h, d) views: no graph break, and the compiled
  forward and parameter gradients are as accurate as the eager ones (criterion below).
* CUDA graph capture and replay of forward + backward (cuflash allocates from torch's caching
  allocator and launches on torch's current stream, so the calls record into the graph).
* A forward + backward step on a non-default stream behind a delayed producer.

Model accuracy criterion, per compared tensor (the output and each parameter gradient):
    max |x - x64| <= 3 * max |x_naive - x64| + 1e-3 * max |x64| + 1e-5
where x64 comes from the same model, parameters and input in float64 with float64 attention,
and x_naive from the model run eagerly in bf16 with the naive attention in bf16 (S and P V in bf16,
softmax in float32): the error a plain bf16 implementation makes. The small relative term covers
tensors that the bf16 baseline happens to get exact.

Helpers (seeds, inputs, poison, references) come from tests/test_gpu_forward.py and
tests/test_gpu_backward.py (tests/ is on sys.path under pytest's default import mode).
"""

from __future__ import annotations

import copy
import math

import pytest

torch = pytest.importorskip("torch")

from test_gpu_backward import (  # noqa: E402
    _max_err,
    assert_grads_close,
    attention_ref,
    grad_bounds,
    make_dout,
)
from test_gpu_forward import (  # noqa: E402
    SLEEP_CYCLES,
    cf,  # noqa: F401  (fixture)
    fresh_seed,
    make_qkv,
    seed_msg,
)

pytestmark = pytest.mark.gpu

nn = torch.nn


# ---------------------------------------------------------------------------------------------
# A small transformer whose attention is pluggable
# ---------------------------------------------------------------------------------------------

class Block(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention (nheads query heads, nheads_kv kv
    heads, head_dim 64) and a GELU MLP. The attention function gets q (b, s, h, d) and k, v
    (b, s, hkv, d) as views of the projections (k and v are strided: every other slot of one
    (b, s, 2, hkv, d) tensor) and returns (b, s, h, d)."""

    def __init__(self, dim: int, nheads: int, nheads_kv: int, attn):
        super().__init__()
        self.nheads, self.nheads_kv, self.head_dim = nheads, nheads_kv, dim // nheads
        self.attn = attn
        self.ln1 = nn.LayerNorm(dim)
        self.wq = nn.Linear(dim, nheads * self.head_dim)
        self.wkv = nn.Linear(dim, 2 * nheads_kv * self.head_dim)
        self.wo = nn.Linear(nheads * self.head_dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        b, s, _ = x.shape
        h = self.ln1(x)
        q = self.wq(h).view(b, s, self.nheads, self.head_dim)
        kv = self.wkv(h).view(b, s, 2, self.nheads_kv, self.head_dim)
        k, v = kv[:, :, 0], kv[:, :, 1]
        a = self.attn(q, k, v)
        x = x + self.wo(a.reshape(b, s, self.nheads * self.head_dim))
        return x + self.mlp(self.ln2(x))


class TwoLayer(nn.Module):
    def __init__(self, attn, dim=256, nheads=4):
        super().__init__()
        self.blocks = nn.ModuleList([Block(dim, nheads, nheads, attn),        # MHA
                                     Block(dim, nheads, nheads // 2, attn)])  # GQA 4 -> 2
        self.ln_f = nn.LayerNorm(dim)

    def forward(self, x):
        for blk in self.blocks:
            x = blk(x)
        return self.ln_f(x)

    def set_attn(self, attn):
        for blk in self.blocks:
            blk.attn = attn
        return self


def _cuflash_attn(cf_mod, deterministic=False):
    def attn(q, k, v):
        return cf_mod.attention(q, k, v, causal=True, deterministic=deterministic)
    return attn


def _ref_attn_f64(q, k, v):
    return attention_ref(q, k, v, True, 1.0 / math.sqrt(q.shape[-1]), upcast=True)


def _ref_attn_in_dtype(q, k, v):
    return attention_ref(q, k, v, True, 1.0 / math.sqrt(q.shape[-1]), upcast=False)


def _run(model, x, w):
    """Forward + backward of sum(model(x) * w) (in float64 for a float64 model, else float32).
    Returns (out, {param name: grad})."""
    model.zero_grad(set_to_none=True)
    out = model(x)
    acc = torch.float64 if out.dtype == torch.float64 else torch.float32
    (out.to(acc) * w.to(acc)).sum().backward()
    plain = getattr(model, "_orig_mod", model)   # a torch.compile'd module's names carry "_orig_mod."
    return out.detach(), {n: p.grad.detach().clone() for n, p in plain.named_parameters()}


def _model_bound(naive, ref):
    return 3.0 * _max_err(naive, ref) + 1e-3 * ref.abs().max().item() + 1e-5


def _assert_model_close(label, out, grads, ref, naive, msg):
    out_ref, grads_ref = ref
    out_naive, grads_naive = naive
    items = [("output", out, out_ref, out_naive)] + [(f"grad {n}", grads[n], grads_ref[n], grads_naive[n])
                                                     for n in grads_ref]
    for name, x, r, n in items:
        assert not torch.isnan(x).any().item(), f"{msg}: {label}: {name} has NaN"
        err, bound = _max_err(x, r), _model_bound(n, r)
        assert err <= bound, (f"{msg}: {label}: {name}: max|x-ref64|={err:.4g} > bound {bound:.4g} "
                              f"(bf16 naive error {_max_err(n, r):.4g}, max|ref64|={r.abs().max().item():.4g})")


# ---------------------------------------------------------------------------------------------
# torch.compile
# ---------------------------------------------------------------------------------------------

def test_torch_compile_two_layer_transformer(cf):
    """torch.compile(fullgraph=True) traces the model, cuflash's operators included, into one graph
    (fullgraph raises on a graph break; dynamo.explain counts 0 breaks and finds the op in the
    graph); the compiled forward + backward match float64 as well as the eager cuflash model and a
    plain bf16 model do."""
    import torch._dynamo

    seed = fresh_seed()
    msg = seed_msg(seed, "torch.compile two-layer transformer")
    b, s, dim = 2, 256, 256
    model = TwoLayer(_cuflash_attn(cf)).to(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(b, s, dim, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(b, s, dim, device="cuda", dtype=torch.bfloat16)

    # references: float64 with float64 attention, and a plain bf16 model (naive attention in bf16)
    model64 = copy.deepcopy(model).to(torch.float64).set_attn(_ref_attn_f64)
    ref = _run(model64, x.to(torch.float64), w)
    naive = _run(copy.deepcopy(model).set_attn(_ref_attn_in_dtype), x, w)

    eager = _run(model, x, w)
    _assert_model_close("eager cuflash", *eager, ref, naive, msg)

    torch._dynamo.reset()
    explanation = torch._dynamo.explain(model)(x)
    assert explanation.graph_break_count == 0, (
        f"{msg}: {explanation.graph_break_count} graph breaks: {explanation.break_reasons}")
    # The op sits in the forward subgraph of the autograd.Function that cuflash.attention applies
    # under tracing (its backward subgraph holds attention_bwd): look through every submodule.
    graph_text = "\n".join(str(m.graph) for g in explanation.graphs for _, m in g.named_modules()
                            if isinstance(m, torch.fx.GraphModule))
    assert "cuflash" in graph_text and "attention_fwd" in graph_text, (
        f"{msg}: torch.ops.cuflash.attention_fwd is not in the traced graph")

    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    out_c, grads_c = _run(compiled, x, w)
    _assert_model_close("compiled cuflash", out_c, grads_c, ref, naive, msg)
    # a second step on new data reuses the compiled graph (no recompilation error, still right)
    x2 = torch.randn_like(x)
    ref2 = _run(model64, x2.to(torch.float64), w)
    naive2 = _run(copy.deepcopy(model).set_attn(_ref_attn_in_dtype), x2, w)
    _assert_model_close("compiled cuflash, second input", *_run(compiled, x2, w), ref2, naive2, msg)
    torch._dynamo.reset()


# ---------------------------------------------------------------------------------------------
# CUDA graphs
# ---------------------------------------------------------------------------------------------

def _warm_up_on_side_stream(fn, n=3):
    """Per the torch CUDA graph docs: warm-up iterations on a side stream before capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(n):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()


@pytest.mark.parametrize("det", [True, False])
def test_cuda_graph_attention_forward_backward(cf, det):
    """Capture out = attention(q, k, v); (out * w).sum().backward() with static leaf q, k, v, w;
    copy new data into the statics, replay, compare q.grad, k.grad, v.grad (static tensors) with an
    eager step on the same data: bitwise equal with deterministic=True, else both within the
    backward tolerance of the float64 reference. Nothing but cuflash and elementwise ops runs,
    so bitwise equality depends on cuflash alone."""
    seed = fresh_seed()
    b, s, h, hkv, d = 2, 640, 8, 2, 128
    dt = torch.bfloat16
    msg = seed_msg(seed, f"CUDA graph, attention forward + backward, deterministic={det}")
    q, k, v = (x.requires_grad_(True) for x in make_qkv(b, s, s, h, hkv, d, dt))
    w = torch.randn(b, s, h, d, device="cuda", dtype=dt)

    def step():
        out = cf.attention(q, k, v, causal=True, deterministic=det)
        (out * w).sum().backward()
        return out

    def zero():
        for x in (q, k, v):
            x.grad = None

    def run_warm():
        zero()
        step()

    _warm_up_on_side_stream(run_warm)
    zero()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_out = step()
    static_grads = (q.grad, k.grad, v.grad)
    ptrs = [t.data_ptr() for t in static_grads]

    checks = []
    for it in range(2):
        new = make_qkv(b, s, s, h, hkv, d, dt)
        new_w = torch.randn_like(w)
        with torch.no_grad():
            for dst, src in zip((q, k, v, w), (*new, new_w)):
                dst.copy_(src)
        g.replay()
        torch.cuda.synchronize()
        assert [t.data_ptr() for t in (q.grad, k.grad, v.grad)] == ptrs, f"{msg}: grads moved"
        replayed = tuple(t.clone() for t in static_grads)
        out_replayed = static_out.detach().clone()
        checks.append((tuple(t.detach().clone() for t in (q, k, v)), w.clone(), replayed, out_replayed))

    for it, (inputs, w_i, replayed, out_replayed) in enumerate(checks):
        # eager step on the same data, outside the graph
        qe, ke, ve = (t.clone().requires_grad_(True) for t in inputs)
        out_e = cf.attention(qe, ke, ve, causal=True, deterministic=det)
        (out_e * w_i).sum().backward()
        eager = (qe.grad, ke.grad, ve.grad)
        label = f"{msg} (replay {it})"
        assert torch.equal(out_replayed, out_e.detach()), f"{label}: replayed forward output != eager"
        assert_grads_close(replayed, *inputs, w_i, True, d ** -0.5, label + " replayed")
        if det:
            for name, a, e in zip(("dq", "dk", "dv"), replayed, eager):
                assert torch.equal(a, e), (f"{label}: deterministic=True: replayed {name} differs from eager in "
                                           f"{int((a != e).sum().item())} elements")
        else:
            assert_grads_close(eager, *inputs, w_i, True, d ** -0.5, label + " eager")


def test_cuda_graph_training_step(cf):
    """Capture a full step of a small model (qkv projection -> cuflash attention (GQA, causal) ->
    output projection) with grads into static .grad tensors; replay on new data in the static input
    and compare the parameter gradients with an eager step: within tolerance (cuBLAS may choose
    differently on the capture stream), and two replays on the same data are bitwise equal
    (deterministic=True)."""
    seed = fresh_seed()
    msg = seed_msg(seed, "CUDA graph training step")
    b, s, dim, h, hkv, d = 2, 384, 512, 8, 4, 64
    dt = torch.bfloat16

    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.wqkv = nn.Linear(dim, (h + 2 * hkv) * d)
            self.wo = nn.Linear(h * d, dim)

        def forward(self, x):
            qkv = self.wqkv(x)
            q = qkv[..., :h * d].view(b, s, h, d)
            k = qkv[..., h * d:(h + hkv) * d].view(b, s, hkv, d)
            v = qkv[..., (h + hkv) * d:].view(b, s, hkv, d)
            a = cf.attention(q, k, v, causal=True, deterministic=True)
            return self.wo(a.reshape(b, s, h * d))

    model = Attn().to(device="cuda", dtype=dt)
    model_eager = copy.deepcopy(model)
    params = list(model.parameters())
    static_x = torch.randn(b, s, dim, device="cuda", dtype=dt)
    static_w = torch.randn(b, s, dim, device="cuda", dtype=dt)

    def step():
        (model(static_x).float() * static_w.float()).sum().backward()

    def run_warm():
        model.zero_grad(set_to_none=True)
        step()

    _warm_up_on_side_stream(run_warm)
    model.zero_grad(set_to_none=True)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    ptrs = [p.grad.data_ptr() for p in params]

    new_x = torch.randn_like(static_x)
    new_w = torch.randn_like(static_w)
    static_x.copy_(new_x)
    static_w.copy_(new_w)
    g.replay()
    torch.cuda.synchronize()
    first = [p.grad.clone() for p in params]
    g.replay()
    torch.cuda.synchronize()
    assert [p.grad.data_ptr() for p in params] == ptrs, f"{msg}: .grad tensors are not static"
    for (name, _), a, p in zip(model.named_parameters(), first, params):
        assert torch.equal(a, p.grad), f"{msg}: two replays on the same data differ in grad {name}"

    model_eager.zero_grad(set_to_none=True)
    (model_eager(new_x).float() * new_w.float()).sum().backward()
    for (name, p), pe in zip(model.named_parameters(), model_eager.parameters()):
        assert not torch.isnan(p.grad).any().item(), f"{msg}: grad {name} has NaN"
        err = _max_err(p.grad, pe.grad)
        tol = 2e-2 * pe.grad.abs().max().item() + 1e-5
        assert err <= tol, f"{msg}: grad {name}: replay vs eager max diff {err:.4g} > {tol:.4g}"


# ---------------------------------------------------------------------------------------------
# Streams
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("causal,det", [(True, False), (False, True)])
def test_stream_forward_backward_delayed_producer(cf, causal, det):
    """A forward + backward (through autograd) on a non-default stream:
    spin, then write the inputs, run, read the grads and compute their errors on the stream. No
    synchronization until the host reads; the inputs hold NaN until the delayed copies land."""
    seed = fresh_seed()
    b, sq, sk, h, hkv, d = 2, 768, 1024, 8, 2, 64
    dt = torch.bfloat16
    msg = seed_msg(seed, f"stream forward+backward, delayed producer, causal={causal} deterministic={det}")
    src = make_qkv(b, sq, sk, h, hkv, d, dt)
    src_do = make_dout(b, sq, h, d, dt)
    ref, bounds = grad_bounds(*src, src_do, causal, d ** -0.5)
    warm = [t.clone().requires_grad_(True) for t in src]          # compile outside the stream section
    (cf.attention(*warm, causal=causal, deterministic=det) * src_do).sum().backward()
    torch.cuda.synchronize()

    st = torch.cuda.Stream()
    with torch.cuda.stream(st):
        q, k, v = (torch.full_like(t, float("nan")).requires_grad_(True) for t in src)
        dout = torch.full_like(src_do, float("nan"))
    st.synchronize()
    with torch.cuda.stream(st):
        torch.cuda._sleep(SLEEP_CYCLES)
        with torch.no_grad():
            for dst, t in zip((q, k, v, dout), (*src, src_do)):
                dst.copy_(t)
        out = cf.attention(q, k, v, causal=causal, deterministic=det)
        (out * dout).sum().backward()
        pending = not st.query()
        errs = [(g.to(torch.float64) - r).abs().max() for g, r in zip((q.grad, k.grad, v.grad), ref)]
        nans = sum(torch.isnan(g).sum() for g in (q.grad, k.grad, v.grad))
    torch.cuda.synchronize()
    assert int(nans.item()) == 0, f"{msg}: {int(nans.item())} NaN in the grads: wrong stream"
    for name, e, bound in zip(("dq", "dk", "dv"), errs, bounds):
        assert e.item() <= bound, f"{msg}: {name} max err {e.item():.4g} > {bound:.4g}: wrong stream or race"
    assert pending, f"{msg}: the stream had drained when backward() returned (host synchronization?)"

