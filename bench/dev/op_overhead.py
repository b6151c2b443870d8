"""Host cost of the routes a torch call can take into cuflash (bf16, batch 1, seqlen 128, 2 heads,
head_dim 64: negligible GPU work), to choose how the torch.library ops are registered.

  eager            cuflash.attention (the adapter's hot path)
  custom_op        torch.ops.cuflash.attention_fwd (torch.library.custom_op: dispatcher, CustomOpDef
                   wrappers, the Python autograd kernel of register_autograd)
  custom_op/inf    the same under torch.inference_mode (no autograd keys)
  library_op       an op defined with torch.library.Library + impl("CUDA") calling the same
                   implementation (dispatcher -> Python function, nothing else)
  compiled         torch.compile of a function that calls cuflash.attention (the op in the graph)
  compiled sdpa    torch.compile of SDPA-flash, for comparison
Method: rounds of 1000 back-to-back calls and one synchronize, round-robin over the routes, median
of 15 rounds (us per call). Prints a table."""
import statistics
import time

import torch
import torch.nn.functional as F

import cuflash
from cuflash._adapters import _torch as T

q, k, v = (torch.randn(1, 128, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
scale = 64 ** -0.5

lib = torch.library.Library("cuflash_dev", "DEF")
lib.define("fwd(Tensor q, Tensor k, Tensor v, bool causal, float scale, bool det) -> (Tensor, Tensor)")


def _impl(q, k, v, causal, scale, det):
    plan = T.ADAPTER.forward_plan(q, k, v, causal, scale, det, False, None)
    return T._forward(plan, q, k, v, {})


lib.impl("fwd", _impl, "CUDA")

f_c = torch.compile(lambda q, k, v: cuflash.attention(q, k, v, causal=True), fullgraph=True, dynamic=False)
f_s = torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True), fullgraph=True, dynamic=False)


def inf(fn):
    def g():
        with torch.inference_mode():
            return fn()
    return g


routes = {
    "eager": lambda: cuflash.attention(q, k, v, causal=True),
    "custom_op": lambda: torch.ops.cuflash.attention_fwd(q, k, v, True, scale, False),
    "custom_op/inf": inf(lambda: torch.ops.cuflash.attention_fwd(q, k, v, True, scale, False)),
    "library_op": lambda: torch.ops.cuflash_dev.fwd(q, k, v, True, scale, False),
    "compiled": lambda: f_c(q, k, v),
    "compiled sdpa": lambda: f_s(q, k, v),
    "eager sdpa": lambda: F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True),
}
for fn in routes.values():
    for _ in range(30):
        fn()
torch.cuda.synchronize()
res = {n: [] for n in routes}
for _ in range(15):
    for n, fn in routes.items():
        t = time.perf_counter()
        for _ in range(1000):
            fn()
        torch.cuda.synchronize()
        res[n].append((time.perf_counter() - t) * 1e3)
print(f"{'route':<16}{'median us':>10}{'min us':>8}")
for n, r in res.items():
    print(f"{n:<16}{statistics.median(r):10.1f}{min(r):8.1f}")
