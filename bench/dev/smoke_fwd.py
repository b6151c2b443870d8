"""Dev ladder step 1: correctness smoke test of the forward kernel and a tile-config sweep.

Run on the GPU machine: PYTHONPATH=. python bench/dev/smoke_fwd.py
"""
import itertools
import json
import math
import os
import sys
import time

import torch

import cuflash
from cuflash import _config, _launch


def ref(q, k, v, causal, scale):
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    qf, kf, vf = (x.double().transpose(1, 2) for x in (q, k, v))
    kf = kf.repeat_interleave(h // hk, 1)
    vf = vf.repeat_interleave(h // hk, 1)
    s = qf @ kf.transpose(-1, -2) * scale
    if causal:
        i = torch.arange(sq, device=q.device)[:, None]
        j = torch.arange(sk, device=q.device)[None, :]
        s = s.masked_fill(j > i + sk - sq, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return (p @ vf).transpose(1, 2), lse


def naive(q, k, v, causal, scale):
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    qf, kf, vf = (x.transpose(1, 2) for x in (q, k, v))
    kf = kf.repeat_interleave(h // hk, 1)
    vf = vf.repeat_interleave(h // hk, 1)
    s = (qf @ kf.transpose(-1, -2)) * scale
    if causal:
        i = torch.arange(sq, device=q.device)[:, None]
        j = torch.arange(sk, device=q.device)[None, :]
        s = s.masked_fill(j > i + sk - sq, float("-inf"))
    p = torch.softmax(s.float(), -1).nan_to_num(0.0).to(q.dtype)
    return (p @ vf).transpose(1, 2)


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
    # head_dims of the sm_90a wgmma kernel: ragged, GQA, rows that see no key, single rows
    (torch.float16, 64, True, 2, 1000, 333, 8, 2),
    (torch.bfloat16, 128, False, 1, 1, 1, 2, 1),
    (torch.float16, 128, True, 3, 257, 129, 6, 3),
    (torch.bfloat16, 64, False, 2, 4096, 4096, 4, 4),
    (torch.float16, 256, False, 2, 200, 1111, 2, 2),
    (torch.bfloat16, 128, True, 1, 128, 1, 2, 2),
]
t0 = time.time()
for dt, d, causal, b, sq, sk, h, hk in cases:
    q = torch.randn(b, sq, h, d, device="cuda", dtype=dt)
    k = torch.randn(b, sk, hk, d, device="cuda", dtype=dt)
    v = torch.randn(b, sk, hk, d, device="cuda", dtype=dt)
    scale = 1 / math.sqrt(d)
    torch.empty(64 << 20, device="cuda").fill_(float("nan"))  # poison the caching allocator
    out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
    r, rl = ref(q, k, v, causal, scale)
    n = naive(q, k, v, causal, scale)
    err = (out.double() - r).abs().max().item()
    nerr = (n.double() - r).abs().max().item()
    fin = torch.isfinite(rl)
    lerr = (lse.double()[fin] - rl[fin]).abs().max().item() if fin.any() else 0.0
    ok = err <= 2 * nerr + 1e-5 and not out.isnan().any() and bool((lse[~fin] == float("-inf")).all()) and lerr < 1e-3
    fails += not ok
    print(f"{'ok ' if ok else 'FAIL'} {str(dt)[6:]:8s} d={d:3d} causal={causal!s:5s} b={b} sq={sq} sk={sk} h={h}/{hk}: err {err:.2e} naive {nerr:.2e} lse {lerr:.1e}")
print(f"correctness: {len(cases) - fails}/{len(cases)} ok, {time.time() - t0:.1f}s incl. compile")


def bench(fn, iters=30):
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
results = []
T = _config.TileConfig
sweep = {
    64: [T(128, 64, 4), T(128, 128, 8, True), T(128, 64, 8, True), T(128, 192, 8, True), T(192, 64, 12, True)],
    128: [T(128, 32, 4), T(64, 64, 4), T(128, 128, 8, True), T(128, 64, 8, True), T(192, 64, 12, True)],
    256: [T(128, 32, 8), T(128, 64, 8, True), T(128, 32, 8, True)],
}
cc = torch.cuda.get_device_capability()
for d, causal in itertools.product((64, 128, 256), (False, True)):
    h = 2048 // d
    b, s = 4, 4096
    q = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
    k, v = torch.randn_like(q), torch.randn_like(q)
    flops = 4 * b * h * s * s * d / (2 if causal else 1)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        ms_fa = bench(lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal))
    row = {"d": d, "causal": causal, "sdpa_flash_tflops": flops / ms_fa / 1e9}
    for cfg in sweep[d]:
        if cfg.wgmma and cc != (9, 0):
            continue
        if _config.fwd_smem_bytes(d, cfg) > _config.SMEM_LIMIT[_config.arch_family(*cc)]:
            continue
        o = torch.empty_like(q)
        lse = torch.empty(b, h, s, device="cuda", dtype=torch.float32)
        V = lambda x: _launch.DeviceTensor(x.data_ptr(), tuple(x.shape), tuple(x.stride()))
        st = torch.cuda.current_stream().cuda_stream
        f = lambda: _launch.launch_fwd(V(q), V(k), V(v), V(o), lse.data_ptr(), "bfloat16", causal, d ** -0.5, 0, cc, st, cfg)
        t1 = time.time(); f(); torch.cuda.synchronize(); ct = time.time() - t1
        ms = bench(f)
        row[f"{'wg' if cfg.wgmma else 'mma'}_m{cfg.block_m}_n{cfg.block_n}_w{cfg.warps}"] = flops / ms / 1e9
    results.append(row)
    print(json.dumps(row))
out = os.environ.get("OUT", ".")
json.dump(results, open(os.path.join(out, "smoke_sweep.json"), "w"), indent=1)
sys.exit(1 if fails else 0)
