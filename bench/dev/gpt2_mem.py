"""Dev: where GPT-2 124M's training-step memory differs between cuflash and SDPA-flash (issue 11's
peak-memory target): memory_allocated after each block's forward and backward, and the peaks of the
forward, the backward and the optimizer step, for each implementation, same weights and data.

PYTHONPATH=. python bench/dev/gpt2_mem.py
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import gpt2  # noqa: E402

MiB = 2.0 ** 20
B, T = 8, 1024
cfg = gpt2.model_config("124M", T)
torch.manual_seed(0)
inputs = torch.randint(0, 50257, (3, B, T), device="cuda")
targets = torch.randint(0, 50257, (3, B, T), device="cuda")
state = None
lines = {}
order = ("cuflash", "sdpa_flash", "cuflash")
for run, impl in enumerate(order):
    m0 = torch.cuda.memory_allocated()
    attend, ctx = gpt2.make_attention(impl, T, "cuda", "fp32")
    torch.manual_seed(1)
    model = gpt2.build_model(cfg, attend, "cuda", state)
    if state is None:
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    m1 = torch.cuda.memory_allocated()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    rec = []
    bases = []
    hooks = []
    for i, blk in enumerate(model.blocks):
        hooks.append(blk.register_forward_hook(lambda m, a, o, i=i: rec.append((f"fwd {i}", torch.cuda.memory_allocated()))))
        hooks.append(blk.register_full_backward_hook(lambda m, gi, go, i=i: rec.append((f"bwd {i}", torch.cuda.memory_allocated()))))
    with ctx:
        for step in range(3):
            rec.clear()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            bases.append(base)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(inputs[step], targets[step])
            rec.append(("loss", torch.cuda.memory_allocated()))
            pf = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            loss.backward()
            rec.append(("after bwd", torch.cuda.memory_allocated()))
            pb = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            opt.step()
            opt.zero_grad(set_to_none=True)
            po = torch.cuda.max_memory_allocated()
            del loss
    print(f"run {run} {impl}: allocated before the model {m0 / MiB:.3f} MiB, after it {m1 / MiB:.3f}, at each "
          f"step's start {[round(x / MiB, 3) for x in bases]}, after the run {torch.cuda.memory_allocated() / MiB:.3f}")
    lines[impl] = [(k, (v - base) / MiB) for k, v in rec] + [("peak fwd", (pf - base) / MiB), ("peak bwd", (pb - base) / MiB),
                                                             ("peak opt", (po - base) / MiB), ("base", base / MiB)]
    for h in hooks:
        h.remove()
    del model, opt
    torch.cuda.empty_cache()
    print(f"run {run} {impl}: after deleting the model {torch.cuda.memory_allocated() / MiB:.3f} MiB")
a, b = lines["cuflash"], lines["sdpa_flash"]
print(f"{'point':12s} {'cuflash':>12s} {'sdpa_flash':>12s} {'diff MiB':>10s}")
for (k, x), (k2, y) in zip(a, b):
    print(f"{k:12s} {x:12.3f} {y:12.3f} {x - y:10.3f}")
