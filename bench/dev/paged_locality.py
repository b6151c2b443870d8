"""Dev (branch paged-tma-tiles): is the paged decode's gap to a contiguous cache the kernel's or the
memory's? One decode step (bench_decode's cache: (batch, cache, nheads_kv, 128) bf16, 32 query heads,
full lengths) timed as a contiguous cache, as pages in order (block_table = arange: the same bytes at
the same addresses, only the table lookups added) and as pages in a random order (bench_decode's
paged layout). GPU time per step: CUDA events over back-to-back calls, median of rounds, the three
layouts taking turns in serpentine order. `--ncu`: one call of each layout inside the profiler range
(torch.cuda.profiler.start / stop), for Nsight Compute.

python3 bench/dev/paged_locality.py [--pages 16 256] [--shapes 1x32768x1 16x32768x8 ...] [--ncu]
"""
import argparse
import statistics

import torch

import cuflash

p = argparse.ArgumentParser()
p.add_argument("--pages", type=int, nargs="+", default=[16, 256])
p.add_argument("--shapes", nargs="+", default=["1x32768x1", "1x32768x8", "16x32768x8", "16x2048x8", "64x32768x8"])
p.add_argument("--rounds", type=int, default=9)
p.add_argument("--calls", type=int, default=50)
p.add_argument("--ncu", action="store_true")
args = p.parse_args()
h, d = 32, 128
torch.manual_seed(0)
print(f"{torch.cuda.get_device_name()}; GPU us per step, median of {args.rounds} rounds of {args.calls} calls")
print(f"{'shape':>12} {'page':>5} {'contig':>8} {'in order':>9} {'random':>8}  in-order/c  random/c")
for shape in args.shapes:
    b, L, g = (int(x) for x in shape.split("x"))
    hk = h // g
    q = torch.randn(b, 1, h, d, device="cuda", dtype=torch.bfloat16)
    kc, vc = (torch.randn(b, L, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    lens = torch.full((b,), L, device="cuda", dtype=torch.int32)
    for ps in args.pages:
        nb = b * L // ps
        kp, vp = kc.view(nb, ps, hk, d), vc.view(nb, ps, hk, d)
        tables = {"in order": torch.arange(nb, device="cuda", dtype=torch.int32).view(b, L // ps),
                  "random": torch.randperm(nb, device="cuda").to(torch.int32).view(b, L // ps)}
        calls = {"contig": lambda: cuflash.attention_with_kvcache(q, kc, vc, cache_seqlens=lens)}
        for name, t in tables.items():
            calls[name] = lambda t=t: cuflash.attention_with_kvcache(q, kp, vp, cache_seqlens=lens, block_table=t)
        # The same values up to a few bf16 roundings of the largest: a paged cache may take another plan than the
        # contiguous one (16-row pages: the 8-warp kernel where _config.decode_paged_groups_wide
        # says so), which sums in another order.
        ref = calls["contig"]()
        got = calls["in order"]()
        err = (got.float() - ref.float()).abs().max().item()
        assert err <= 2 ** -6 * ref.float().abs().max().item() + 1e-5, (shape, ps, err)
        t = tables["random"].long()  # the random table's logical cache, gathered: the same result
        ref_r = cuflash.attention_with_kvcache(q, kp[t].view(b, L, hk, d), vp[t].view(b, L, hk, d), cache_seqlens=lens)
        err = (calls["random"]().float() - ref_r.float()).abs().max().item()
        assert err <= 2 ** -6 * ref_r.float().abs().max().item() + 1e-5, (shape, ps, "random", err)
        del ref_r
        if args.ncu:
            torch.cuda.synchronize()
            torch.cuda.profiler.start()
            for f in calls.values():
                f()
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
            continue
        names = list(calls)
        times = {n: [] for n in names}
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        for f in calls.values():
            for _ in range(5):
                f()
        for r in range(args.rounds):
            for n in (names if r % 2 == 0 else names[::-1]):
                ev[0].record()
                for _ in range(args.calls):
                    calls[n]()
                ev[1].record()
                ev[1].synchronize()
                times[n].append(ev[0].elapsed_time(ev[1]) * 1000 / args.calls)
        m = {n: statistics.median(v) for n, v in times.items()}
        print(f"{shape:>12} {ps:5d} {m['contig']:8.1f} {m['in order']:9.1f} {m['random']:8.1f}"
              f"  {m['in order'] / m['contig']:10.3f} {m['random'] / m['contig']:9.3f}", flush=True)
