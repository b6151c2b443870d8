"""What a Python autograd node costs on its own (issue 11's grad host rows), on CPU tensors, no GPU:
torch.autograd.Function applied through the C++ apply (as cuflash's torch adapter does), with the
forward allocating out and lse from stride-0 templates as the adapter does, and saving 5 / 3
tensors, returning out alone, or nothing saved; beside the two allocations alone. µs per call,
median of 7 rounds of 20000. Usage: python bench/dev/autograd_node_cost.py"""
import statistics
import time

import torch

q, k, v = (torch.randn(1, 128, 2, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
tmpl_o = torch.empty((1,), dtype=torch.bfloat16).expand(1, 128, 2, 64)
tmpl_l = torch.empty((1,), dtype=torch.float32).expand(1, 2, 128)
E = torch.empty_like


def node(save: int | None, with_lse: bool = True):
    """A Function whose forward allocates out (and lse) and saves the first `save` of (q, k, v, out,
    lse) the way the adapter does (attribute stores); save=None: no ctx work at all."""

    def forward(ctx, plan, lse_seen, q, k, v):
        out = E(tmpl_o)
        lse = E(tmpl_l) if with_lse else None
        if save is not None:
            ctx.to_save = (q, k, v, out, lse)[:save]
            if with_lse:
                ctx.non_differentiable = (lse,)
            ctx.materialize_grads = False
            ctx.plan = plan
        return (out, lse) if with_lse else out

    def backward(ctx, dout, *rest):
        return None, None, dout, dout, dout

    cls = type("Node", (torch.autograd.Function,), {"forward": staticmethod(forward),
                                                     "backward": staticmethod(backward)})
    return torch._C._FunctionBase.__dict__["apply"].__get__(None, cls)


rows = {"save5": node(5), "save3": node(3), "out_only": node(4, with_lse=False), "bare": node(None),
        "alloc2": lambda *a: (E(tmpl_o), E(tmpl_l)), "alloc1": lambda *a: (E(tmpl_o),)}
res = {n: [] for n in rows}
for _ in range(7):
    for n, f in rows.items():
        t = time.perf_counter()
        for _ in range(20000):
            f(None, False, q, k, v)
        res[n].append((time.perf_counter() - t) / 20000 * 1e6)
for n in rows:
    print(f"{n:10s} {statistics.median(res[n]):.2f} us")
