"""Dev ladder: backward smoke test (correctness against float64 autograd) and a first timing.

Run on the GPU machine: PYTHONPATH=. python bench/dev/smoke_bwd.py
"""
import math
import sys
import time

import torch

import cuflash
from cuflash import _config


class dq_path:
    """Selects the dQ implementation for the calls inside: atomic=True forces float atomics in the
    dK/dV kernel (deterministic=False calls only), False the separate dQ pass."""

    def __init__(self, atomic):
        self.atomic = atomic

    def __enter__(self):
        self.saved = _config.BWD_ATOMIC_DQ
        _config.BWD_ATOMIC_DQ = self.atomic

    def __exit__(self, *exc):
        _config.BWD_ATOMIC_DQ = self.saved


def naive(q, k, v, causal, scale, dtype):
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    qf, kf, vf = (x.to(dtype).transpose(1, 2) for x in (q, k, v))
    kf = kf.repeat_interleave(h // hk, 1)
    vf = vf.repeat_interleave(h // hk, 1)
    s = (qf @ kf.transpose(-1, -2)) * scale
    if causal:
        i = torch.arange(sq, device=q.device)[:, None]
        j = torch.arange(sk, device=q.device)[None, :]
        s = s.masked_fill(j > i + sk - sq, float("-inf"))
    p = torch.softmax(s.float(), -1).nan_to_num(0.0).to(dtype)
    return (p @ vf).transpose(1, 2)


def grads(q, k, v, dout, causal, scale, dtype):
    qq, kk, vv = (x.detach().to(dtype).requires_grad_() for x in (q, k, v))
    o = naive(qq, kk, vv, causal, scale, dtype)
    o.backward(dout.to(dtype))
    return [x.grad for x in (qq, kk, vv)]


fails = 0
cases = [
    (torch.bfloat16, 128, True, 2, 1023, 1024, 4, 4),
    (torch.float16, 64, False, 2, 113, 203, 4, 2),
    (torch.bfloat16, 40, True, 2, 300, 77, 4, 1),
    (torch.float16, 8, False, 1, 1, 1, 2, 2),
    (torch.bfloat16, 256, True, 2, 512, 2048, 2, 1),
    (torch.float16, 136, False, 2, 2048, 512, 2, 2),
    (torch.bfloat16, 200, True, 2, 1, 300, 4, 4),
    (torch.float16, 96, True, 2, 128, 128, 4, 4),
    # head_dims of the sm_90a wgmma dK/dV kernel: ragged, GQA, rows that see no key
    (torch.float16, 64, True, 2, 1000, 333, 8, 2),
    (torch.bfloat16, 128, False, 1, 1, 1, 2, 1),
    (torch.float16, 128, True, 3, 257, 129, 6, 3),
    (torch.bfloat16, 64, False, 2, 2048, 2048, 4, 4),
    (torch.bfloat16, 128, True, 1, 128, 1, 2, 2),
    (torch.float16, 64, False, 1, 77, 1500, 4, 1),
]
t0 = time.time()
for det in (False, True):
  with dq_path(not det):  # det=False rows exercise the atomic path, det=True the separate pass
    for dt, d, causal, b, sq, sk, h, hk in cases:
        q = torch.randn(b, sq, h, d, device="cuda", dtype=dt)
        k = torch.randn(b, sk, hk, d, device="cuda", dtype=dt)
        v = torch.randn(b, sk, hk, d, device="cuda", dtype=dt)
        dout = torch.randn(b, sq, h, d, device="cuda", dtype=dt)
        scale = 1 / math.sqrt(d)
        out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
        torch.empty(64 << 20, device="cuda").fill_(float("nan"))
        dq, dk, dv = cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=det)
        ref = grads(q, k, v, dout, causal, scale, torch.float64)
        nai = grads(q, k, v, dout, causal, scale, dt)
        msg = []
        ok = True
        for name, g, r, n in zip(("dq", "dk", "dv"), (dq, dk, dv), ref, nai):
            err = (g.double() - r).abs().max().item()
            nerr = (n.double() - r).abs().max().item()
            good = err <= 3 * nerr + 1e-4 and not g.isnan().any()
            ok &= good
            msg.append(f"{name} {err:.1e}/{nerr:.1e}{'' if good else '!'}")
        fails += not ok
        print(f"{'ok ' if ok else 'FAIL'} det={det!s:5s} {str(dt)[6:]:8s} d={d:3d} causal={causal!s:5s} b={b} sq={sq} sk={sk} h={h}/{hk}: " + " ".join(msg), flush=True)
print(f"backward correctness: {2 * len(cases) - fails}/{2 * len(cases)} ok, {time.time() - t0:.1f}s incl. compile")

# determinism: ten runs, bitwise
q, k, v, dout = (torch.randn(2, 2048, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4))
out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
first = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, deterministic=True)
same = all(all(torch.equal(a, b) for a, b in zip(first, cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, deterministic=True))) for _ in range(9))
with dq_path(True):
    atomic_same = all(all(torch.equal(a, b) for a, b in zip(cuflash.attention_backward(dout, q, k, v, out, lse, causal=True), cuflash.attention_backward(dout, q, k, v, out, lse, causal=True))) for _ in range(3))
print("deterministic bitwise over 10 runs:", same, "| atomic path bitwise over 3 pairs:", atomic_same)


def bench(fn, iters=20):
    for _ in range(3):
        fn()
    ts = []
    for _ in range(iters):
        s, e = torch.cuda.Event(True), torch.cuda.Event(True)
        s.record(); fn(); e.record(); e.synchronize()
        ts.append(s.elapsed_time(e))
    ts.sort()
    return ts[len(ts) // 2]


from torch.nn.attention import sdpa_kernel, SDPBackend
for d, causal in ((64, False), (64, True), (128, False), (128, True)):
    h = 2048 // d
    b, s = 4, 4096
    q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    flops = 2.5 * 4 * b * h * s * s * d / (2 if causal else 1)
    out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
    with dq_path(True):
        ms_at = bench(lambda: cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal))
    ms_det = bench(lambda: cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=True))
    qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        o = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
        dt_ = dout.transpose(1, 2)
        ms_fa = bench(lambda: torch.autograd.grad(o, (qt, kt, vt), dt_, retain_graph=True))
    print(f"bwd bf16 d{d} causal={causal}: cuflash atomic {flops / ms_at / 1e9:.0f} TFLOP/s, deterministic "
          f"{flops / ms_det / 1e9:.0f}, SDPA-flash {flops / ms_fa / 1e9:.0f}", flush=True)
if "--no-sweep" in sys.argv:
    sys.exit(1 if fails else 0)
# tile sweep of the dK/dV kernel, bf16, b4 s4096 hidden 2048, non-causal / causal. wgmma configs use
# the atomic dQ path (deterministic=False), mma.sync ones the separate dQ pass.
orig = _config.bwd_config_for_target
T = _config.TileConfig
cc = torch.cuda.get_device_capability()
sweep = {64: [T(64, 128, 8, True), T(64, 64, 4, True), T(64, 128, 8)],
         128: [T(64, 128, 8, True), T(64, 64, 4, True), T(32, 128, 8)],
         256: [T(32, 64, 8)]}
for d, cfgs in sweep.items():
    h = 2048 // d
    b, s = 4, 4096
    q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    for causal in (False, True):
        out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
        flops = 2.5 * 4 * b * h * s * s * d / (2 if causal else 1)
        row = []
        for c in cfgs:
            if c.wgmma and cc != (9, 0):
                continue
            label = f"{'wg' if c.wgmma else 'mma'}{c.block_m}x{c.block_n}x{c.warps}"
            _config.bwd_config_for_target = lambda tg, dd, dt, c=c: c
            try:
                ms = bench(lambda: cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal))
                row.append(f"{label}: {flops / ms / 1e9:.0f}")
            except Exception as e:
                row.append(f"{label}: {type(e).__name__} {str(e)[:200]}")
            _config.bwd_config_for_target = orig
        print(f"bwd sweep d{d} causal={causal}: " + ", ".join(row), flush=True)
sys.exit(1 if fails else 0)
