"""Dev: device memory an attention layer holds and peaks at, cuflash against SDPA's backends, at GPT-2's
shape (q, k, v as views of one qkv projection, bf16, causal). Explains the peak-memory line of
bench/gpt2.py (issue 11).

PYTHONPATH=. python bench/dev/attn_mem.py [--batch 8 --seqlen 1024 --heads 12 --head-dim 64]
"""
import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import cuflash

p = argparse.ArgumentParser()
p.add_argument("--batch", type=int, default=8)
p.add_argument("--seqlen", type=int, default=1024)
p.add_argument("--heads", type=int, default=12)
p.add_argument("--head-dim", type=int, default=64)
a = p.parse_args()
B, T, H, D = a.batch, a.seqlen, a.heads, a.head_dim
MiB = 2.0 ** 20


def run_cuflash(qkv):
    q, k, v = qkv.view(B, T, 3, H, D).unbind(2)
    return cuflash.attention(q, k, v, causal=True).flatten(2)


def make_sdpa(backend):
    def run(qkv):
        q, k, v = (x.transpose(1, 2) for x in qkv.view(B, T, 3, H, D).unbind(2))
        with sdpa_kernel(backend):
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return y.transpose(1, 2).flatten(2)
    return run


impls = {"cuflash": run_cuflash, "sdpa_flash": make_sdpa(SDPBackend.FLASH_ATTENTION),
         "sdpa_cudnn": make_sdpa(SDPBackend.CUDNN_ATTENTION)}
unit = B * H * T * 4 / MiB
print(f"B{B} T{T} H{H} D{D} bf16 causal; one (B, H, T) float32 buffer = {unit:.3f} MiB; "
      f"one (B, T, H*D) bf16 = {B * T * H * D * 2 / MiB:.3f} MiB")
for name, fn in impls.items():
    for rep in range(3):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        qkv = torch.randn(B, T, 3 * H * D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn(B, T, H * D, device="cuda", dtype=torch.bfloat16)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        y = fn(qkv)
        torch.cuda.synchronize()
        after_fwd = torch.cuda.memory_allocated() - base
        peak_fwd = torch.cuda.max_memory_allocated() - base
        out_bytes = y.untyped_storage().nbytes()
        torch.cuda.reset_peak_memory_stats()
        y.backward(g)
        torch.cuda.synchronize()
        peak_bwd = torch.cuda.max_memory_allocated() - base
        after_bwd = torch.cuda.memory_allocated() - base
        del y
        if rep == 2:
            print(f"{name:11s} held after fwd {after_fwd / MiB:8.3f} MiB (output {out_bytes / MiB:.3f}, other "
                  f"{(after_fwd - out_bytes) / MiB:.3f} = {(after_fwd - out_bytes) / MiB / unit:.2f} units); "
                  f"fwd peak {peak_fwd / MiB:8.3f}; bwd peak {peak_bwd / MiB:8.3f} (over the fwd's hold "
                  f"{(peak_bwd - after_fwd) / MiB:.3f}); after bwd {after_bwd / MiB:.3f}")
        del qkv, g

# A stack of GPT-2 attention blocks (c_attn -> attention -> c_proj, bf16 autocast, fp32 weights) as
# bench/gpt2.py builds them: memory held after the forward and the step's peak, per implementation.
import torch.nn as nn  # noqa: E402

C = H * D


class Block(nn.Module):
    def __init__(self, attend):
        super().__init__()
        self.c_attn, self.c_proj, self.attend = nn.Linear(C, 3 * C), nn.Linear(C, C), attend

    def forward(self, x):
        return x + self.c_proj(self.attend(self.c_attn(x)))


for name, fn in impls.items():
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(fn) for _ in range(12)]).cuda()
    x = torch.randn(B, T, C, device="cuda")
    for rep in range(3):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = model(x)
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - base
        y.float().square().mean().backward()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        del y
        model.zero_grad(set_to_none=True)
    print(f"12 blocks {name:11s} held after fwd {held / MiB:9.3f} MiB; step peak {peak / MiB:9.3f} MiB")
