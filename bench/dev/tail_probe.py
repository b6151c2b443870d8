"""How much the last wave of equal work tiles costs the non-causal forward (issue 12's lead).

At FlashAttention-2's grid (16k tokens, hidden 2048) head_dim 128 gives 2048 work tiles of 128 query
rows at every length, 15.5 a block on 132 SMs: the busiest blocks take 16, so a perfectly parallel
kernel would idle 3 % of the time. This times one forward (batch 1, H heads, seqlen 2048 or SEQ,
head_dim 128, non-causal) at head counts on both sides of a whole number of waves, for cuflash and
SDPA's cuDNN backend, and prints the GPU time per head: with no tail cost it is flat in H; with the
full cost it follows ceil(tiles / SMs) / H.
Env: SEQ (2048), HEADS ("120 123 124 128 132"), DTYPE (bfloat16), REPS (50), ROUNDS (5)."""
import math
import os
import statistics as st

import torch
import torch.nn.functional as F

import cuflash

seq = int(os.environ.get("SEQ", "2048"))
heads = [int(h) for h in os.environ.get("HEADS", "120 123 124 128 132").split()]
dtype = getattr(torch, os.environ.get("DTYPE", "bfloat16"))
reps, rounds = int(os.environ.get("REPS", "50")), int(os.environ.get("ROUNDS", "5"))
sms = torch.cuda.get_device_properties(0).multi_processor_count
d = 128


def gpu_ms(f):
    for _ in range(3):
        f()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, b in ev:
        a.record()
        f()
        b.record()
    torch.cuda.synchronize()
    return st.median(a.elapsed_time(b) for a, b in ev)


def cudnn(q, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        return F.scaled_dot_product_attention(q, k, v)


print(f"{torch.cuda.get_device_name(0)}, {sms} SMs, seqlen {seq}, head_dim {d}, {dtype}, non-causal")
rows = []
for h in heads:
    q, k, v = (torch.randn(1, seq, h, d, device="cuda", dtype=dtype) for _ in range(3))
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    t_cf, t_dn = [], []
    for _ in range(rounds):
        t_cf.append(gpu_ms(lambda: cuflash.attention(q, k, v)))
        t_dn.append(gpu_ms(lambda: cudnn(qt, kt, vt)))
    tiles = h * math.ceil(seq / 128)
    rows.append((h, tiles, st.median(t_cf), st.median(t_dn)))
base = rows[0]
print("heads tiles waves(model)  cuflash ms  per-head(rel)  cudnn ms  per-head(rel)  model per-head(rel)")
for h, tiles, a, b in rows:
    model = math.ceil(tiles / sms) / h / (math.ceil(base[1] / sms) / base[0])
    print(f"{h:5d} {tiles:5d} {tiles / sms:6.2f}     {a:9.4f}  {a / h / (base[2] / base[0]):8.4f}     "
          f"{b:8.4f}  {b / h / (base[3] / base[0]):8.4f}     {model:8.4f}")
