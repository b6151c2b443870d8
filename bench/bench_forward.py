#!/usr/bin/env python3
"""Forward benchmark: cuflash against torch SDPA (flash, cuDNN and memory-efficient backends).

Shapes: 16384 tokens (batch * seqlen) of hidden size 2048, i.e. head_dim 64 -> 32 heads and
head_dim 128 -> 16 heads, seqlen in {1024, 4096} (batch 16 and 4), fp16 and bf16, causal off and
on. The headline shape is bf16, head_dim 128, seqlen 4096, batch 4, 16 heads (marked * in the table).

Both providers see the same data: tensors are made in cuflash's (batch, seqlen, heads, head_dim)
layout and SDPA gets `.transpose(1, 2)` views of them (zero copy). Shapes are square
(seqlen_q == seqlen_k), where SDPA's top-left causal mask and cuflash's bottom-right one agree.

Timing: CUDA events around each call on the current stream, after warm-up; the median of
max(--min-reps, enough runs for --min-time seconds) runs. The first cuflash call of each kernel
compiles it (or loads it from the disk cache, $CUFLASH_CACHE_DIR): it is timed on its own, with a
host clock and a device synchronize, and reported as "first call". --cold points the cache at a
fresh temporary directory so that it is a real compile.

FLOPs = 4 * batch * heads * seqlen_q * seqlen_k * head_dim, halved when causal.

Usage:
    python bench/bench_forward.py [--quick] [--seqlens 1024 4096] [--json out.json]
    python bench/bench_forward.py --summarize out.json        # print the table of an earlier run
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

TOKENS = 16384
HIDDEN = 2048
HEADLINE = {"dtype": "bfloat16", "head_dim": 128, "seqlen": 4096, "batch": 4, "nheads": 16}
PROVIDERS = ("cuflash", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient")
SHORT = {"float16": "fp16", "bfloat16": "bf16"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--json", metavar="PATH", help="write the results (and device, driver, versions) here")
    p.add_argument("--quick", action="store_true", help="only the headline shape (causal off and on)")
    p.add_argument("--seqlens", type=int, nargs="+", metavar="N", default=[1024, 4096],
                   help="sequence lengths (batch = 16384 // seqlen); default 1024 4096")
    p.add_argument("--dtypes", nargs="+", choices=["bfloat16", "float16"], default=["bfloat16", "float16"])
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128], metavar="D",
                   help="head dims (heads = 2048 // head_dim); default 64 128")
    p.add_argument("--causal", choices=["both", "off", "on"], default="both")
    p.add_argument("--providers", nargs="+", choices=PROVIDERS, default=list(PROVIDERS))
    p.add_argument("--warmup", type=int, default=5, help="untimed calls before timing (default 5)")
    p.add_argument("--min-reps", type=int, default=30, help="at least this many timed runs (default 30)")
    p.add_argument("--max-reps", type=int, default=2000)
    p.add_argument("--min-time", type=float, default=0.25,
                   help="seconds of timed work per provider and shape, at least (default 0.25)")
    p.add_argument("--cold", action="store_true",
                   help="use a fresh, temporary CUFLASH_CACHE_DIR so the first call is a real compile")
    p.add_argument("--no-headline", action="store_true", help="do not add the headline shape")
    p.add_argument("--summarize", metavar="PATH", help="print the table of an earlier --json file and exit")
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------

def build_configs(args):
    shapes = []
    if args.quick:
        shapes.append(dict(HEADLINE))
    else:
        for dtype in args.dtypes:
            for d in args.head_dims:
                for s in args.seqlens:
                    shapes.append({"dtype": dtype, "head_dim": d, "seqlen": s,
                                   "batch": max(1, TOKENS // s), "nheads": max(1, HIDDEN // d)})
        if not args.no_headline and dict(HEADLINE) not in shapes:
            shapes.append(dict(HEADLINE))
    causals = {"both": [False, True], "off": [False], "on": [True]}[args.causal]
    configs = []
    for sh in shapes:
        for c in causals:
            cfg = dict(sh, causal=c)
            cfg["headline"] = all(sh[k] == v for k, v in HEADLINE.items())
            configs.append(cfg)
    return configs


def flops(cfg) -> float:
    f = 4.0 * cfg["batch"] * cfg["nheads"] * cfg["seqlen"] * cfg["seqlen"] * cfg["head_dim"]
    return f / 2 if cfg["causal"] else f


def nvidia_smi_info():
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                            "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        if r.returncode == 0 and r.stdout.strip():
            return r.stdout.strip().splitlines()
    except Exception:
        pass
    return None


def collect_meta(torch, args, cuflash, cuflash_error):
    meta = {
        "timestamp_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "argv": sys.argv[1:],
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "nvidia_smi": nvidia_smi_info(),
        "cuflash_cache_dir": os.environ.get("CUFLASH_CACHE_DIR"),
        "cold_cache": bool(args.cold),
        "cuflash": getattr(cuflash, "__version__", None) if cuflash is not None else None,
        "cuflash_import_error": cuflash_error,
        "timing": {"warmup": args.warmup, "min_reps": args.min_reps, "min_time_s": args.min_time,
                   "statistic": "median of per-call CUDA-event times"},
    }
    try:
        meta["cudnn"] = torch.backends.cudnn.version()
    except Exception:
        meta["cudnn"] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        meta["device"] = torch.cuda.get_device_name(0)
        meta["capability"] = list(torch.cuda.get_device_capability(0))
        meta["sm_count"] = props.multi_processor_count
        meta["memory_gib"] = round(props.total_memory / 2**30, 1)
    try:
        import cupy

        meta["cupy"] = cupy.__version__
        meta["cuda_driver_version"] = cupy.cuda.runtime.driverGetVersion()
        meta["cuda_runtime_version_cupy"] = cupy.cuda.runtime.runtimeGetVersion()
    except Exception as e:
        meta["cupy"] = f"unavailable: {type(e).__name__}"
    try:
        from importlib.metadata import version

        meta["jax"] = version("jax")
    except Exception:
        meta["jax"] = None
    import numpy

    meta["numpy"] = numpy.__version__
    return meta


# ---------------------------------------------------------------------------------------------

def time_cuda(torch, fn, warmup, min_reps, max_reps, min_time):
    """Median / min milliseconds per call with CUDA events on the current stream."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    est = max(start.elapsed_time(end), 1e-3)
    reps = int(min(max_reps, max(min_reps, math.ceil(min_time * 1e3 / est))))
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for s, e in events:
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    times = [s.elapsed_time(e) for s, e in events]
    return statistics.median(times), min(times), reps


def run_config(torch, cuflash, cfg, args):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dt = {"float16": torch.float16, "bfloat16": torch.bfloat16}[cfg["dtype"]]
    b, s, h, d, causal = cfg["batch"], cfg["seqlen"], cfg["nheads"], cfg["head_dim"], cfg["causal"]
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=dt) for _ in range(3))   # (b, s, h, d)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))                             # (b, h, s, d) views
    fl = flops(cfg)
    results = []
    outputs = {}
    backends = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
                "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION}
    for prov in args.providers:
        r = {"provider": prov}
        try:
            if prov == "cuflash":
                if cuflash is None:
                    raise RuntimeError("cuflash is not importable")

                def fn():
                    return cuflash.attention(q, k, v, causal=causal)

                torch.cuda.synchronize()
                t0 = time.perf_counter()
                out = fn()
                torch.cuda.synchronize()
                r["first_call_s"] = time.perf_counter() - t0
                outputs[prov] = out
                med, mn, reps = time_cuda(torch, fn, args.warmup, args.min_reps, args.max_reps, args.min_time)
            else:
                def fn():
                    return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

                with sdpa_kernel(backends[prov]):
                    outputs[prov] = fn().transpose(1, 2)
                    med, mn, reps = time_cuda(torch, fn, args.warmup, args.min_reps, args.max_reps, args.min_time)
            r.update(ms_median=med, ms_min=mn, reps=reps, tflops=fl / (med * 1e-3) / 1e12)
        except Exception as e:
            r["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
        results.append(r)
    # sanity: cuflash against the first SDPA backend that ran
    if "cuflash" in outputs:
        for prov in ("sdpa_flash", "sdpa_cudnn", "sdpa_efficient"):
            if prov in outputs:
                diff = (outputs["cuflash"].float() - outputs[prov].float()).abs().max().item()
                for r in results:
                    if r["provider"] == "cuflash":
                        r["max_abs_diff_vs"] = {"provider": prov, "value": diff}
                break
    del q, k, v, qt, kt, vt, outputs
    torch.cuda.empty_cache()
    return results


# ---------------------------------------------------------------------------------------------

def _tf(row, prov):
    r = row["providers"].get(prov)
    if not r or "tflops" not in r:
        return None
    return r["tflops"]


def format_table(data) -> str:
    meta = data.get("meta", {})
    rows = data.get("results", [])
    lines = []
    dev = meta.get("device", "?")
    drv = ""
    if meta.get("nvidia_smi"):
        drv = " | nvidia-smi: " + "; ".join(meta["nvidia_smi"])
    lines.append(f"device: {dev} | torch {meta.get('torch')} (CUDA {meta.get('torch_cuda')}, cuDNN "
                 f"{meta.get('cudnn')}) | cuflash {meta.get('cuflash')}{drv}")
    if meta.get("cuflash_import_error"):
        lines.append(f"cuflash import error: {meta['cuflash_import_error']}")
    hdr = (f"{'shape b x s x h x d':<22}{'causal':<7}{'dtype':<6}{'cuflash':>9}{'sdpa-fa':>9}{'cudnn':>9}"
           f"{'mem-eff':>9}{'cf/fa':>7}{'cf/cudnn':>9}{'1st call':>10}{'maxdiff':>9}")
    lines.append("TFLOP/s (median); cf/fa = cuflash / SDPA flash, cf/cudnn = cuflash / SDPA cuDNN; "
                 "1st call = compile (or cache load) + first run; * = headline shape")
    lines.append(hdr)
    lines.append("-" * len(hdr))

    def num(x, w, fmt="{:.1f}"):
        return f"{fmt.format(x) if x is not None else '-':>{w}}"

    errors = {}   # (provider, message) -> number of rows
    for row in rows:
        c = row["config"]
        shape = f"{c['batch']}x{c['seqlen']}x{c['nheads']}x{c['head_dim']}" + (" *" if c.get("headline") else "")
        cf, fa, cu, me = (_tf(row, p) for p in PROVIDERS)
        r_fa = cf / fa if cf and fa else None
        r_cu = cf / cu if cf and cu else None
        cfr = row["providers"].get("cuflash", {})
        first = cfr.get("first_call_s")
        md = cfr.get("max_abs_diff_vs", {}).get("value")
        lines.append(f"{shape:<22}{('on' if c['causal'] else 'off'):<7}{SHORT[c['dtype']]:<6}"
                     f"{num(cf, 9)}{num(fa, 9)}{num(cu, 9)}{num(me, 9)}{num(r_fa, 7, '{:.2f}')}"
                     f"{num(r_cu, 9, '{:.2f}')}{num(first, 9, '{:.2f}')}{'s' if first is not None else ' '}"
                     f"{num(md, 9, '{:.1e}')}")
        for p, r in row["providers"].items():
            if "error" in r:
                errors[(p, r["error"])] = errors.get((p, r["error"]), 0) + 1
    if errors:
        lines.append("provider errors (shown as '-'):")
        for (p, msg), n in errors.items():
            lines.append(f"  {p} ({n} of {len(rows)} rows): {msg}")
    return "\n".join(lines)


def write_json(path, data, default=None):
    """data as JSON at path (none: nothing), through a temporary file so that a reader never sees half
    of it; default as json.dump's (bench_jax: str). The benchmark scripts share this one."""
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, default=default)
    os.replace(tmp, path)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.summarize:
        with open(args.summarize) as f:
            print(format_table(json.load(f)))
        return 0

    cold_dir = None
    if args.cold:
        cold_dir = tempfile.mkdtemp(prefix="cuflash_bench_cold_")
        os.environ["CUFLASH_CACHE_DIR"] = cold_dir   # before cuflash is imported

    import torch

    if not torch.cuda.is_available():
        print("bench_forward: no CUDA device visible to torch", file=sys.stderr)
        return 2

    cuflash, cuflash_error = None, None
    try:
        import cuflash  # noqa: F811
    except Exception as e:
        cuflash_error = f"{type(e).__name__}: {e}"
        traceback.print_exc()
        print("bench_forward: cuflash failed to import; benchmarking SDPA only", file=sys.stderr)

    configs = build_configs(args)
    data = {"meta": collect_meta(torch, args, cuflash, cuflash_error), "results": []}
    print(f"bench_forward: {len(configs)} configs x {len(args.providers)} providers on {data['meta'].get('device')}",
          flush=True)
    cuflash_failed = cuflash is None and "cuflash" in args.providers
    t_start = time.perf_counter()
    try:
        for cfg in configs:
            res = run_config(torch, cuflash, cfg, args)
            row = {"config": cfg, "flops": flops(cfg), "providers": {r["provider"]: r for r in res}}
            data["results"].append(row)
            parts = []
            for r in res:
                if "tflops" in r:
                    extra = f" (1st {r['first_call_s']:.2f}s)" if "first_call_s" in r else ""
                    parts.append(f"{r['provider']} {r['tflops']:.1f}{extra}")
                else:
                    parts.append(f"{r['provider']} ERR")
                    if r["provider"] == "cuflash":
                        cuflash_failed = True
            c = cfg
            print(f"  {SHORT[c['dtype']]} b{c['batch']} s{c['seqlen']} h{c['nheads']} d{c['head_dim']} "
                  f"causal={c['causal']}: " + ", ".join(parts), flush=True)
            write_json(args.json, data)   # after every config: a run cut short still leaves its results
    finally:
        data["meta"]["wall_s"] = round(time.perf_counter() - t_start, 1)
        write_json(args.json, data)
        if cold_dir:
            shutil.rmtree(cold_dir, ignore_errors=True)
    print()
    print(format_table(data))
    return 1 if cuflash_failed else 0


if __name__ == "__main__":
    sys.exit(main())
