"""Why cuflash's contiguous decode reads slower in alternate GPU-time rounds of bench_decode.py at
bandwidth-bound shapes (sessions 51-53: at 16 x 128k x 4 and 4 x 128k x 1 the rounds in which cuflash
runs last read 2-9 % slower than those in which it runs first; cuDNN's rounds are steady).

One shape (--shape BxLxG, bench_decode's q / cache / lengths and its calls, made by its Runner), its
implementations timed as bench_decode times them (CUDA events around N back-to-back calls behind a
sleep kernel), in several orders of turns, each order --rounds rounds:
  serp        bench_decode's order: as listed in even rounds, reversed in odd ones
  first       as listed every round (cuflash first, after the previous round's last)
  last        reversed every round (cuflash last)
  alone       cuflash only
  after_X     X then cuflash, every round (X each other implementation)
  vars        with --variants: each cuflash variant alone, then after each peer (X then the variant)
--variants NAME=SPLITS[:WARPS] ... adds cuflash calls of the contiguous cache with num_splits forced
(and CUFLASH_DECODE_WARPS set while their plan is made); each needs a split count of its own, since
the library keeps one plan per split count and reads CUFLASH_DECODE_WARPS only when it makes one.
Each turn's wall-clock start and end are recorded, so that a caller's nvidia-smi samples (clocks,
power, throttle reasons) can be matched to it. Prints, per order and implementation, the rounds' ms
per call and their median.

Usage: PYTHONPATH=. python bench/dev/decode_rounds.py --shape 16x131072x4 [--rounds 10] [--json PATH]"""
import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import bench_decode as BD  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="16x131072x4")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--orders", nargs="+", default=["serp", "first", "last", "alone", "after"])
    p.add_argument("--variants", nargs="*", default=[], metavar="NAME=SPLITS[:WARPS]")
    p.add_argument("--json")
    p.add_argument("--cpu-smoke", action="store_true", help="bench_decode's CPU smoke mode (checks this script)")
    a = p.parse_args(argv)
    b, L, g = (int(x) for x in a.shape.split("x"))
    args = BD.parse_args(["--batches", str(b), "--caches", str(L), "--gqa", str(g), "--no-host", "--no-graph",
                          "--eager-reps", "0", "--check-mib", "0"] + (["--cpu-smoke", "--heads", "8"] if a.cpu_smoke else []))
    import torch

    mods = BD.load_modules(args, torch)
    clock = BD.Clock(torch, args.cuda)
    run = BD.Runner(torch, args, clock, mods)
    (s,) = BD.build_shapes(args)
    keys = [k for k in BD.selected_keys(args, mods["flash_attn"] is not None) if k[0] != "flash_attn"]
    T = BD.Tensors(torch, "cuda" if args.cuda else "cpu", args, s)
    base = {k: s[k] for k in ("batch", "cache", "gqa", "nheads", "nheads_kv", "head_dim", "dtype", "kv_bytes")}
    rows, live = run.open_all(keys, T, base)
    calls = {c.key: c for c in live}
    cf = ("cuflash", "contiguous")
    names = {k: f"{k[0]}/{k[1][:5]}" for k in calls}
    others = [k for k in calls if k != cf]
    variants = []
    counts = [spec.partition("=")[2].partition(":")[0] for spec in a.variants]
    if len(set(counts)) < len(counts):  # the library keeps one plan per split count (warps read as it is made)
        p.error(f"--variants need split counts of their own: got {counts}")
    for spec in a.variants:
        name, _, rest = spec.partition("=")
        splits, _, warps = rest.partition(":")
        key = ("cuflash", "var:" + name)
        f, q, kc, vc, cs = mods["cuflash"].attention_with_kvcache, T.q, T.k, T.v, T.seqlens
        c = BD.Call(key, lambda n=int(splits): f(q, kc, vc, cache_seqlens=cs, causal=True, num_splits=n))
        old = os.environ.get("CUFLASH_DECODE_WARPS")
        os.environ["CUFLASH_DECODE_WARPS"] = warps or "0"
        try:
            c.fn()
        finally:
            if old is None:
                del os.environ["CUFLASH_DECODE_WARPS"]
            else:
                os.environ["CUFLASH_DECODE_WARPS"] = old
        run.calibrate(c)
        calls[key] = c
        names[key] = "cf/" + name
        variants.append(key)
    orders = []
    for o in a.orders:
        if o == "after":
            orders += [(f"after_{names[k]}", [k, cf]) for k in others]
        elif o == "vars":
            for vk in variants:
                orders.append((f"alone_{names[vk]}", [vk]))
                orders += [(f"after_{names[k]}>{names[vk]}", [k, vk]) for k in others]
        else:
            orders.append((o, [k for k in calls if k not in variants]))
    try:  # the SM clock (MHz) and power (W) as each turn ends, where NVML's binding imports
        import pynvml

        pynvml.nvmlInit()
        nv = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())

        def gauges():
            return (pynvml.nvmlDeviceGetClockInfo(nv, pynvml.NVML_CLOCK_SM),
                    pynvml.nvmlDeviceGetPowerUsage(nv) / 1000.0)
    except Exception:
        def gauges():
            return (None, None)
    turns = []
    t_origin = time.time()
    for name, seq in orders:
        for rnd in range(a.rounds):
            if name == "serp":
                order = seq if rnd % 2 == 0 else seq[::-1]
            elif name == "last":
                order = seq[::-1]
            elif name == "alone":
                order = [cf]
            else:
                order = seq
            for k in order:
                c = calls[k]
                t0 = time.time()
                with c.ctx():
                    ms, host = clock.per_call_ms(c.fn, c.n, c.lead_ms)
                sm, watts = gauges()
                turns.append(dict(order=name, round=rnd, impl=names[k], ms=ms, n=c.n, lead_ms=c.lead_ms,
                                  t0=t0, t1=time.time(), sm_mhz=sm, watts=watts))
    print(f"shape {a.shape}: calls per round " + ", ".join(f"{names[k]} {calls[k].n}" for k in calls))
    print(f"{'order':24s} {'impl':18s} {'median':>8s}  rounds (us per call)")
    for name, _ in orders:
        for k in calls:
            ts = [t for t in turns if t["order"] == name and t["impl"] == names[k]]
            if ts:
                xs = [t["ms"] * 1e3 for t in ts]
                mhz = [t["sm_mhz"] for t in ts if t["sm_mhz"]]
                clk = f" [SM {min(mhz)}-{max(mhz)} MHz]" if mhz else ""
                print(f"{name:24s} {names[k]:18s} {statistics.median(xs):8.1f}  " + " ".join(f"{x:.0f}" for x in xs)
                      + clk)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(shape=a.shape, t_origin=t_origin, turns=turns), f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
