"""Dev probe: host and total time per call at GPT-2 124M's attention shape (bf16, 8 x 1024, 12 heads, head_dim
64, causal): cuflash eager, its torch.library operator called directly, SDPA, and both under
torch.compile (a one-call graph). Run on the GPU machine: PYTHONPATH=. python bench/dev/compiled_call_probe.py"""
import time, torch, cuflash
from cuflash import _plan
q = torch.randn(8, 1024, 12, 64, device="cuda", dtype=torch.bfloat16)
k, v = torch.randn_like(q), torch.randn_like(q)
def t(fn, n=300):
    for _ in range(20): fn()
    torch.cuda.synchronize(); a = time.perf_counter()
    for _ in range(n): fn()
    h = time.perf_counter() - a
    torch.cuda.synchronize(); b = time.perf_counter() - a
    return h / n * 1e6, b / n * 1e6
with torch.no_grad():
    print("eager attention       host/total us", t(lambda: cuflash.attention(q, k, v, causal=True)))
    op = torch.ops.cuflash.attention_fwd
    print("op attention_fwd      host/total us", t(lambda: op(q, k, v, True, 0.125, False)))
    n0 = len(_plan.CACHE) if hasattr(_plan.CACHE, "__len__") else -1
    op(q, k, v, True, 0.125, False)
    print("cache size", n0, len(_plan.CACHE) if hasattr(_plan.CACHE, "__len__") else -1)
    import torch.nn.functional as F
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    print("sdpa                  host/total us", t(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)))
    f = torch.compile(lambda q, k, v: cuflash.attention(q, k, v, causal=True))
    print("compiled cuflash      host/total us", t(lambda: f(q, k, v)))
    g = torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    print("compiled sdpa         host/total us", t(lambda: g(qt, kt, vt)))
