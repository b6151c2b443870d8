"""Where a compiled GPT-2 forward spends its time with each attention: torch.profiler over a few
inference forwards of the 124M model (seqlen 1024, batch 8, blocks compiled as bench/gpt2.py does),
the top ops by self CPU time and by device time, and the wall time per forward.

Usage: python bench/dev/gpt2_profile.py [impl ...]   (default: cuflash sdpa_flash)"""
import statistics
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 2)[0])
import gpt2  # noqa: E402

impls = sys.argv[1:] or ["cuflash", "sdpa_flash"]
dev = torch.device("cuda")
cfg = gpt2.model_config("124M", 1024)
torch.manual_seed(0)
x = torch.randint(0, 50257, (8, 1024), device=dev)
for impl in impls:
    attend, ctx = gpt2.make_attention(impl, 1024, dev, "fp32")
    with ctx:
        model = gpt2.build_model(cfg, attend, dev)
        model = gpt2.compile_model(model, "blocks")
        with torch.inference_mode(), torch.autocast("cuda", dtype=torch.bfloat16):
            for _ in range(5):
                model(x)
            torch.cuda.synchronize()
            ts = []
            for _ in range(20):
                t = time.perf_counter()
                model(x)
                torch.cuda.synchronize()
                ts.append((time.perf_counter() - t) * 1e3)
            print(f"=== {impl}: {statistics.median(ts):.2f} ms per forward (median of 20, synchronized)")
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    model(x)
                torch.cuda.synchronize()
            ka = prof.key_averages()
            print(ka.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))
            print(ka.table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))
    del model
    torch.cuda.empty_cache()
