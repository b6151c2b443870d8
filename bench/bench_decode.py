#!/usr/bin/env python3
"""Decode: time per step and achieved K+V read bandwidth of cuflash.attention_with_kvcache against its peers.

One decode step: q (batch, 1, 32 heads, head_dim 128) attends to a KV cache whose every row holds L
keys (cache_seqlens = L, an int32 CUDA tensor, as in a serving loop; nothing is appended), bf16. The
work is a read of the cache: K+V bytes = batch * L * nheads_kv * head_dim * 2 tensors * 2 bytes, so
the figure of merit is the achieved read bandwidth, K+V bytes / time, set against the MEASURED
device-to-device copy bandwidth of the same GPU (torch copy_ of a >= 1 GiB buffer, bytes read +
written / time, median of rounds, measured once per run).

--seqlen-q N (default 1) gives q N rows, as speculative decoding does; then every implementation runs
non-causal (SDPA's causal mask is top-left aligned), so all see the same keys: N - 1 more per row than
a bottom-right causal call would.

Implementations (rows; each a call on torch CUDA tensors, the same random cache):
  cuflash            cuflash.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, causal=True)
                     on the contiguous cache (batch, L, nheads_kv, head_dim)
  cuflash/paged      the same with block_table: the contiguous cache's storage seen as pages
                     (num_blocks, --page-size, nheads_kv, head_dim) and a random permutation of all
                     the blocks as the block table, so each entry's pages are scattered (zero copy:
                     every layout of a shape reads the same bytes; the paged entries' logical keys
                     are a scrambled version of the contiguous ones, so outputs are checked against
                     a reference on the gathered keys, not against the contiguous rows)
  sdpa-fa, cudnn     torch.nn.functional.scaled_dot_product_attention under
                     sdpa_kernel(FLASH_ATTENTION / CUDNN_ATTENTION), q (b, h, 1, d), k/v (b, hkv, L, d),
                     is_causal=False (all L keys are visible to the one query; SDPA's causal mask is
                     top-left aligned and would leave it one key), enable_gqa=True when nheads_kv <
                     nheads. If a backend refuses enable_gqa (--sdpa-gqa auto), K and V are expanded
                     once with repeat_interleave OUTSIDE the timed call (the kernel then reads
                     group x the bytes; the row's note says so). --sdpa-layout view (default) gives
                     SDPA transposed views of the same cache (zero copy); contiguous gives it its own
                     (b, hkv, L, d) copy.
  flash-attn[/paged] flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=..., causal=True
                     [, block_table=...]) when `import flash_attn` works; if it refuses --page-size,
                     its paged row retries with 256-row pages (noted).
An implementation that raises NotImplementedError (cuflash on the GPU for paged caches today) is
recorded as "not built" with its message; any other failure as an error (OOM separately); the run
goes on either way, so the peer columns and the copy bandwidth are useful on their own.

Grid: --batches (1 4 16 64 256) x --caches (512 2048 8192 32768 131072) x --gqa group sizes (1 4 8;
nheads_kv = 32 / group) x --layouts (contiguous paged). Each shape gets a fresh random cache
(torch.randn, not zeros). Shapes run from the smallest cache to the largest; one whose memory need
(caches, SDPA copies, reference gathers, a margin) exceeds the free device memory is skipped (and an
OOM at run time is caught and recorded), one predicted to end past --budget-s is skipped, and the
run ends with what it has.

Timing per shape, the implementations round-robin (round 1 of each, then round 2, ...):
  first call   timed alone (synchronize, call, synchronize; host clock): compilation, module loads
               and lazy initialisation land here and are reported separately, never in a figure.
  ms/step      GPU time: CUDA events around N back-to-back calls, after --warmup calls; a sleep
               kernel is queued first so the host runs ahead, so the figure is the GPU's time per
               step, launch gaps included, host stalls not (N from a pilot, so that a round is about
               --round-ms); median (and min) over --rounds rounds, the implementations taking
               turns in serpentine order (reversed in odd rounds). Where NVML's binding imports, the
               SM clock and board power are read as each round ends (rounds_sm_mhz, rounds_watts in
               the JSON; their range is printed): under the power cap a turn starts at the clock the
               turn before it left.
  eager ms     one call with the host included: synchronize, start event, call, end event;
               median of --eager-reps, the implementations' calls taken in turn.
  graph        one decode step captured in torch.cuda.CUDAGraph (after two warm-up calls on a
               side stream) and replayed: whether capture and replay work, whether the replay's
               output equals an eager call's, whether a replay after cache_seqlens.fill_(L // 2)
               follows the new lengths (calls that take cache_seqlens), and the replay time per
               step (events around N replays, median of --graph-rounds).
  check        max |out - reference| on the first entries (as many as --check-mib of gathered K/V
               allow): the reference is SDPA (torch's own backend choice) on those entries' logical
               keys, in the input dtype.
Host time per call (bench_host.py's method): batch 1, cache 512 (--host-batch, --host-cache), the
first --gqa group: after --host-warmup calls, rounds of N back-to-back calls and one synchronize,
timed round-robin over the implementations; us/call = round wall time / N; median of
--host-rounds.

Targets (a report, not a test), in the summary printed last as met / missed / not measured:
  1. decode time <= 1.0x the faster of SDPA flash and cuDNN at every contiguous grid point
  2. paged time <= 1.1x contiguous time at the same shape
  3. K+V read bandwidth >= 80% of the measured copy bandwidth at batch >= 8 and cache >= 4096
  4. host time per decode call <= SDPA flash's
  5. the decode step captures and replays in a CUDA graph (and follows cache_seqlens)
A point where cuflash raised NotImplementedError is "not measured"; one where it failed otherwise,
while a peer ran, counts as missed.

Output: the copy bandwidth, the host-time table, one progress line per shape, then the table of
every shape (ms/step and fraction of the copy bandwidth per implementation, cuflash / best SDPA,
paged / contiguous, graph replay), the first-call times, the errors, and the targets last.
--json keeps the meta (GPU, driver, torch, cuDNN, cuflash and flash_attn versions, copy bandwidth,
timestamp) and every row (rewritten after each shape); --plot draws the achieved bandwidth (as a
fraction of the copy bandwidth) against the cache length, one panel per batch and GQA group, one
line per implementation (matplotlib; without it the plot is skipped with a message).
--summarize JSON reprints the report of an earlier run (and --plot redraws its figure), no GPU.

--cpu-smoke runs the same code on torch CPU tensors and tiny shapes (the cuflash NumPy path; SDPA's
MATH backend stands in for flash, cuDNN fails as it must on the CPU; time.perf_counter instead of
CUDA events; no CUDA graph) to exercise every path end to end, the JSON and the plot included.

Examples:
    python bench/bench_decode.py --dry-run                    # the grid, memory needs, no GPU
    python bench/bench_decode.py --quick --json out/decode.json --plot out/decode.png   # < 2 minutes
    python bench/bench_decode.py --json out/decode.json --plot out/decode.png           # the grid, <= 540 s
    python bench/bench_decode.py --summarize out/decode.json --plot out/decode.png      # offline
    python bench/bench_decode.py --cpu-smoke --json /tmp/bd.json --plot /tmp/bd.png     # no GPU
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if HERE not in sys.path:
    sys.path.insert(0, HERE)
if os.environ.get("CUFLASH_BENCH_PATH"):  # measure another checkout (an earlier version, say)
    sys.path.insert(0, os.environ["CUFLASH_BENCH_PATH"])
elif os.path.isdir(os.path.join(ROOT, "cuflash")) and ROOT not in sys.path:
    sys.path.insert(0, ROOT)   # measure the checkout this script belongs to

from bench_forward import nvidia_smi_info, write_json  # noqa: E402

T_START = time.perf_counter()

# (implementation, layout) in table order; the label is the column name
KEYS = (("cuflash", "contiguous"), ("cuflash", "paged"), ("sdpa_flash", "contiguous"), ("sdpa_cudnn", "contiguous"),
        ("flash_attn", "contiguous"), ("flash_attn", "paged"))
LABEL = {("cuflash", "contiguous"): "cuflash", ("cuflash", "paged"): "cuflash/paged",
         ("sdpa_flash", "contiguous"): "sdpa-fa", ("sdpa_cudnn", "contiguous"): "cudnn",
         ("flash_attn", "contiguous"): "flash-attn", ("flash_attn", "paged"): "flash-attn/paged"}
IMPLS = ("cuflash", "sdpa_flash", "sdpa_cudnn", "flash_attn")
LAYOUTS = ("contiguous", "paged")
PEERS = ("sdpa_flash", "sdpa_cudnn")

DECODE_LIMIT = 1.0      # cuflash time / min(SDPA flash, cuDNN) time, every contiguous point
PAGED_LIMIT = 1.1       # paged time / contiguous time, same shape
BW_FRACTION = 0.8       # achieved K+V read bandwidth / measured copy bandwidth ...
BW_MIN_BATCH = 8        # ... at batch >= this
BW_MIN_CACHE = 4096     # ... and cache >= this
HOST_LIMIT = 1.0        # cuflash host time per call / SDPA flash's
CHECK_TOL = 0.05        # max |out - reference| above this is flagged (bf16/fp16 outputs are averages, |x| < 1)

DEFAULTS = dict(batches=[1, 4, 16, 64, 256], caches=[512, 2048, 8192, 32768, 131072], gqa=[1, 4, 8],
                heads=32, head_dim=128, rounds=7, round_ms=20.0, warmup=3, eager_reps=20, graph_rounds=5,
                host_rounds=11, host_calls=300, host_warmup=30, host_max_round_s=0.2, host_cache=512, copy_gib=1.0,
                copy_rounds=9, mem_margin_mib=512.0, budget_s=540.0)
QUICK = dict(batches=[1, 16, 64], caches=[512, 8192], gqa=[1, 8], rounds=5, round_ms=10.0, eager_reps=10,
             graph_rounds=3, host_rounds=7, host_calls=200, host_warmup=20, host_max_round_s=0.1, copy_rounds=5)
SMOKE = dict(batches=[1, 2, 4], caches=[64, 512], gqa=[1, 2], heads=4, head_dim=64, rounds=3, round_ms=2.0,
             warmup=1, eager_reps=3, graph_rounds=2, host_rounds=3, host_calls=20, host_warmup=2,
             host_max_round_s=0.02, host_cache=64, copy_gib=1 / 32, copy_rounds=3, mem_margin_mib=0.0,
             mem_cap_mib=4.0, budget_s=60.0)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--quick", action="store_true",
                   help="a handful of points, < 2 minutes: batch 1 16 64, cache 512 8192, GQA 1 8, both layouts, "
                        "fewer rounds")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="torch CPU tensors, tiny shapes, perf_counter timing: exercises the code paths, no GPU")
    p.add_argument("--batches", type=int, nargs="+", metavar="B", help="default 1 4 16 64 256")
    p.add_argument("--caches", type=int, nargs="+", metavar="L",
                   help="keys in every cache row (cache_seqlens); default 512 2048 8192 32768 131072")
    p.add_argument("--gqa", type=int, nargs="+", metavar="G",
                   help="query heads per kv head (nheads_kv = heads / G); default 1 4 8")
    p.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    p.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS),
                   help="default all (flash_attn only if it imports)")
    p.add_argument("--heads", type=int, help="query heads (default 32)")
    p.add_argument("--seqlen-q", type=int, default=1,
                   help="query rows per entry (default 1: a decode step; 2-8: speculative decoding, every "
                        "implementation non-causal)")
    p.add_argument("--head-dim", type=int, help="default 128")
    p.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    p.add_argument("--page-size", type=int, default=16, help="rows per page of the paged layout (default 16)")
    p.add_argument("--sdpa-layout", choices=["view", "contiguous"], default="view",
                   help="SDPA's k/v: transposed views of the cache (default, zero copy) or a contiguous "
                        "(b, hkv, L, d) copy")
    p.add_argument("--sdpa-gqa", choices=["auto", "native", "repeat"], default="auto",
                   help="GQA for SDPA: enable_gqa=True, falling back to K/V expanded once by repeat_interleave "
                        "outside the timed call (auto, default), or only one of the two")
    p.add_argument("--rounds", type=int, help="timed rounds per implementation and shape (default 7)")
    p.add_argument("--round-ms", type=float, help="GPU time a round aims at; sets the calls per round (default 20)")
    p.add_argument("--max-calls", type=int, default=100, help="calls per round at most (default 100)")
    p.add_argument("--warmup", type=int, help="untimed calls after the first (default 3)")
    p.add_argument("--eager-reps", type=int, help="eager single calls per implementation and shape (default 20; "
                                                  "0 = none)")
    p.add_argument("--graph-rounds", type=int, help="timed rounds of graph replays (default 5)")
    p.add_argument("--no-graph", action="store_true", help="skip the CUDA graph check")
    p.add_argument("--check-mib", type=float, default=256.0,
                   help="K/V bytes (MiB) the output check may gather for its reference (default 256; 0 = no check)")
    p.add_argument("--host-batch", type=int, default=1, help="batch of the host-time section (default 1)")
    p.add_argument("--host-cache", type=int, help="cache length of the host-time section (default 512)")
    p.add_argument("--host-rounds", type=int, help="host-time rounds, round-robin (default 11)")
    p.add_argument("--host-calls", type=int, help="back-to-back calls per host-time round at most (default 300)")
    p.add_argument("--host-warmup", type=int, help="untimed calls before the host-time rounds (default 30)")
    p.add_argument("--host-max-round-s", type=float, help="a host-time round lasts about this at most (default 0.2)")
    p.add_argument("--no-host", action="store_true", help="skip the host-time section")
    p.add_argument("--copy-gib", type=float, help="size of the copy-bandwidth buffer, GiB (default 1; >= 1 on a GPU)")
    p.add_argument("--copy-rounds", type=int, help="copy-bandwidth rounds (default 9)")
    p.add_argument("--mem-margin-mib", type=float, help="free memory kept beyond a shape's estimated need "
                                                         "(default 512)")
    p.add_argument("--mem-cap-mib", type=float, help="treat free memory as at most this (testing the skip path)")
    p.add_argument("--budget-s", type=float,
                   help="skip shapes predicted to end past this many seconds from the start (default 540, for a "
                        "600 s device call; 0 = no limit)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="write the meta and every row here (rewritten after each shape)")
    p.add_argument("--plot", metavar="PATH", help="write the bandwidth figure here (PNG, matplotlib)")
    p.add_argument("--dry-run", action="store_true", help="list the shapes, their memory and a time estimate; no GPU")
    p.add_argument("--summarize", metavar="PATH", help="print the report of an earlier --json file (and --plot it)")
    args = p.parse_args(argv)

    presets = [DEFAULTS] + ([QUICK] if args.quick else []) + ([SMOKE] if args.cpu_smoke else [])
    merged = {}
    for preset in presets:
        merged.update(preset)
    for name, value in merged.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    for name in ("batches", "caches", "gqa"):
        if any(x < 1 for x in getattr(args, name)):
            p.error(f"--{name} must be positive")
    for g in args.gqa:
        if args.heads % g:
            p.error(f"--gqa {g} does not divide --heads {args.heads}")
    if args.head_dim % 8 or not 8 <= args.head_dim <= 256:
        p.error("--head-dim must be a multiple of 8 from 8 to 256")
    if args.page_size < 1:
        p.error("--page-size must be positive")
    if args.seqlen_q < 1:
        p.error("--seqlen-q must be positive")
    for name in ("rounds", "graph_rounds", "host_rounds", "host_calls", "copy_rounds", "max_calls"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.warmup < 0 or args.eager_reps < 0:
        p.error("--warmup and --eager-reps must be 0 or more")
    args.cuda = not args.cpu_smoke
    return args


# ------------------------------------------------------------------------------------ small helpers

def _err(e) -> str:
    msg = str(e).strip()
    first = msg.splitlines()[0][:400] if msg else ""
    return f"{type(e).__name__}: {first}"


class SkipMemory(Exception):
    """A row left out because what it needs would not fit in the free memory."""


def _is_oom(e) -> bool:
    return type(e).__name__ == "OutOfMemoryError" or "out of memory" in str(e).lower()


def _median(xs):
    return statistics.median(xs) if xs else None


def _geomean(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def cache_label(n) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def shape_text(s) -> str:
    sq = s.get("seqlen_q", 1)
    return f"b{s['batch']} L{cache_label(s['cache'])} g{s['gqa']}" + (f" sq{sq}" if sq != 1 else "")


def kv_bytes(batch, cache, nheads_kv, head_dim, elt=2) -> int:
    """Bytes of K and V a step reads: batch * L * nheads_kv * head_dim * 2 tensors * elt bytes."""
    return batch * cache * nheads_kv * head_dim * 2 * elt


def size_text(n) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def build_shapes(args):
    """Every (batch, cache, gqa) of the grid, smallest K+V first (so a budget stop drops the largest)."""
    out = []
    for g in args.gqa:
        for b in args.batches:
            for L in args.caches:
                hkv = args.heads // g
                out.append({"batch": b, "cache": L, "gqa": g, "seqlen_q": args.seqlen_q, "nheads": args.heads,
                            "nheads_kv": hkv,
                            "head_dim": args.head_dim, "dtype": args.dtype,
                            "kv_bytes": kv_bytes(b, L, hkv, args.head_dim)})
    out.sort(key=lambda s: (s["kv_bytes"], s["gqa"], s["batch"]))
    return out


def row_base(s) -> dict:
    """The shape's fields every row of it carries."""
    return {k: s[k] for k in ("batch", "cache", "gqa", "seqlen_q", "nheads", "nheads_kv", "head_dim", "dtype",
                              "kv_bytes")}


def selected_keys(args, fa_ok=True):
    return [k for k in KEYS if k[0] in args.impls and k[1] in args.layouts and (k[0] != "flash_attn" or fa_ok)]


# ------------------------------------------------------------------------------------ clocks

class Clock:
    """CUDA events (the GPU) or time.perf_counter (--cpu-smoke)."""

    def __init__(self, torch, cuda, mem_cap=None):
        self.torch, self.cuda, self.mem_cap = torch, cuda, mem_cap
        self.cycles_per_ms = None
        if cuda and hasattr(torch.cuda, "_sleep"):
            try:
                self._calibrate()
            except Exception:
                self.cycles_per_ms = None
        self.nvml = self._open_nvml() if cuda else None

    def _open_nvml(self):
        """(pynvml, handle) of the current GPU, or None where NVML's binding does not import or open."""
        try:
            import pynvml

            pynvml.nvmlInit()
            dev = self.torch.cuda.current_device()
            props = self.torch.cuda.get_device_properties(dev)
            try:  # by PCI address: NVML numbers every GPU, CUDA only the visible ones
                bus = f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
                return pynvml, pynvml.nvmlDeviceGetHandleByPciBusId(bus)
            except Exception:
                return pynvml, pynvml.nvmlDeviceGetHandleByIndex(dev)
        except Exception:
            return None

    def gauges(self):
        """(SM clock in MHz, board power in W) now, from NVML; None without it. Under the GPU's power
        cap the clock a turn runs at depends on the turns before it, and a kernel with one warp per
        scheduler slows with the clock (bench/NOTES.md, session 53): the GPU-time rounds record it."""
        if self.nvml is None:
            return None
        nv, handle = self.nvml
        try:
            return nv.nvmlDeviceGetClockInfo(handle, nv.NVML_CLOCK_SM), nv.nvmlDeviceGetPowerUsage(handle) / 1000.0
        except Exception:
            return None

    def _ev(self):
        return self.torch.cuda.Event(enable_timing=True)

    def _calibrate(self):
        torch = self.torch
        torch.cuda._sleep(100_000)
        s, e = self._ev(), self._ev()
        s.record()
        torch.cuda._sleep(10_000_000)
        e.record()
        e.synchronize()
        self.cycles_per_ms = 10_000_000 / max(s.elapsed_time(e), 1e-3)

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def lead(self, ms):
        """Keep the GPU busy for about ms so that the host runs ahead of it."""
        if self.cuda and self.cycles_per_ms and ms > 0:
            self.torch.cuda._sleep(int(min(ms, 200.0) * self.cycles_per_ms))

    def per_call_ms(self, fn, n, lead_ms=0.0):
        """(ms per call over n back-to-back calls, host ms to enqueue them). GPU: events around the
        calls, behind a sleep kernel of lead_ms so the queue never runs dry; CPU: wall time."""
        if not self.cuda:
            t0 = time.perf_counter()
            for _ in range(n):
                out = fn()
            dt = (time.perf_counter() - t0) * 1e3
            del out
            return dt / n, dt
        s, e = self._ev(), self._ev()
        self.lead(lead_ms)
        t0 = time.perf_counter()
        s.record()
        for _ in range(n):
            out = fn()
        e.record()
        host = (time.perf_counter() - t0) * 1e3
        e.synchronize()
        del out
        return s.elapsed_time(e) / n, host

    def eager_ms(self, fn):
        """One call on an idle device, the host's work before the first kernel included."""
        if not self.cuda:
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
        torch = self.torch
        s, e = self._ev(), self._ev()
        torch.cuda.synchronize()
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        return s.elapsed_time(e)

    def wall_us(self, fn, n):
        """bench_host.py's round: us per call over n back-to-back calls and one synchronize."""
        gc.collect()
        self.sync()
        t0 = time.perf_counter()
        for _ in range(n):
            out = fn()
        self.sync()
        del out
        return (time.perf_counter() - t0) / n * 1e6

    def free_bytes(self):
        if self.cuda:
            self.torch.cuda.empty_cache()
            free = self.torch.cuda.mem_get_info()[0]
        else:
            free = 8 << 30
            try:
                with open("/proc/meminfo") as f:
                    for line in f:
                        if line.startswith("MemAvailable:"):
                            free = int(line.split()[1]) * 1024
            except OSError:
                pass
        return free if self.mem_cap is None else min(free, self.mem_cap)


# ------------------------------------------------------------------------------------ one shape's tensors

@dataclass
class Paged:
    page_size: int
    k: object
    v: object
    table: object   # int32 (batch, L / page_size)


class Tensors:
    """A shape's inputs: q, a fresh random cache (batch, L, nheads_kv, head_dim), the lengths, and
    the views / copies the layouts and SDPA need, made on first use."""

    def __init__(self, torch, device, args, s):
        self.torch, self.args, self.s = torch, args, s
        dt = getattr(torch, args.dtype)
        b, L, h, hkv, d = s["batch"], s["cache"], s["nheads"], s["nheads_kv"], s["head_dim"]
        self.q = torch.randn(b, s.get("seqlen_q", 1), h, d, device=device, dtype=dt)
        self.k = torch.randn(b, L, hkv, d, device=device, dtype=dt)
        self.v = torch.randn(b, L, hkv, d, device=device, dtype=dt)
        self.seqlens = torch.full((b,), L, dtype=torch.int32, device=device)
        self.device = device
        self._paged, self._sdpa, self._expanded, self._refs = {}, None, None, {}

    def paged(self, page_size):
        """The cache's storage as pages, the blocks in a random order."""
        if page_size not in self._paged:
            torch, s = self.torch, self.s
            b, L, hkv, d = s["batch"], s["cache"], s["nheads_kv"], s["head_dim"]
            if L % page_size:
                raise ValueError(f"cache length {L} is not a multiple of the page size {page_size}")
            nb = b * L // page_size
            perm = torch.randperm(nb, device=self.device)
            table = perm.view(b, L // page_size).to(torch.int32)
            self._paged[page_size] = Paged(page_size, self.k.view(nb, page_size, hkv, d),
                                           self.v.view(nb, page_size, hkv, d), table)
        return self._paged[page_size]

    def sdpa_kv(self):
        if self._sdpa is None:
            k4, v4 = self.k.transpose(1, 2), self.v.transpose(1, 2)
            if self.args.sdpa_layout == "contiguous":
                k4, v4 = k4.contiguous(), v4.contiguous()
            self._sdpa = (k4, v4)
        return self._sdpa

    def expanded(self):
        """SDPA's K/V with every kv head repeated group times (made once, outside the timed calls)."""
        if self._expanded is None:
            k4, v4 = self.sdpa_kv()
            g = self.s["gqa"]
            self._expanded = (k4.repeat_interleave(g, dim=1), v4.repeat_interleave(g, dim=1))
        return self._expanded

    def reference(self, paged):
        """(reference out (E, seqlen_q, h, d), E) for the first E entries, E as --check-mib allows, or (None, 0).
        The reference is SDPA (torch's backend choice) on those entries' logical keys."""
        key = None if paged is None else paged.page_size
        if key in self._refs:
            return self._refs[key]
        s = self.s
        import torch.nn.functional as F

        entry = kv_bytes(1, s["cache"], s["nheads_kv"], s["head_dim"])
        e = min(s["batch"], int(self.args.check_mib * 2**20 // entry)) if self.args.check_mib > 0 else 0
        ref = None
        if e > 0:
            if paged is None:
                k, v = self.k[:e], self.v[:e]
            else:
                rows = paged.table[:e].long()
                shp = (e, s["cache"], s["nheads_kv"], s["head_dim"])
                k, v = paged.k[rows].reshape(shp), paged.v[rows].reshape(shp)
            q4, k4, v4 = self.q[:e].transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            g = s["gqa"]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                try:
                    ref = F.scaled_dot_product_attention(q4, k4, v4, **({"enable_gqa": True} if g > 1 else {}))
                except Exception:
                    ref = F.scaled_dot_product_attention(q4, k4.repeat_interleave(g, dim=1),
                                                         v4.repeat_interleave(g, dim=1))
            ref = ref.transpose(1, 2)
            del k, v, k4, v4
        self._refs[key] = (ref, e if ref is not None else 0)
        return self._refs[key]


@dataclass
class Call:
    key: tuple
    fn: object                  # () -> out
    ctx: object = contextlib.nullcontext   # () -> context manager, entered around rounds (SDPA's backend)
    bshd: object = None         # out -> (b, seqlen_q, h, d)
    uses_seqlens: bool = False
    note: str = ""
    paged: object = None        # the Paged the call reads, for the reference
    n: int = 1
    lead_ms: float = 0.0
    row: dict = field(default_factory=dict)
    out: object = None          # the first call's output, for the check


# ------------------------------------------------------------------------------------ the runner

class Runner:
    def __init__(self, torch, args, clock, mods):
        self.torch, self.args, self.clock = torch, args, clock
        self.cf, self.cf_error = mods["cuflash"], mods["cuflash_error"]
        self.fa, self.fa_error = mods["flash_attn"], mods["flash_attn_error"]
        self.device = "cuda" if args.cuda else "cpu"
        self.sdpa_repeat_seen = False

    # -------------------------------------------------------------------- making calls

    def _sdpa_backend(self, impl):
        from torch.nn.attention import SDPBackend

        if impl == "sdpa_flash":
            if self.args.cuda:
                return SDPBackend.FLASH_ATTENTION, ""
            return SDPBackend.MATH, "cpu-smoke: SDPA's MATH backend stands in for flash"
        return SDPBackend.CUDNN_ATTENTION, ""

    def _first(self, call):
        """Runs the first call (synchronized, host clock); returns its ms. Warnings (SDPA's reasons
        for refusing a backend) are added to the error's message."""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                with call.ctx():
                    self.clock.sync()
                    t0 = time.perf_counter()
                    call.out = call.fn()
                    self.clock.sync()
                    return (time.perf_counter() - t0) * 1e3
            except Exception as e:
                why = "; ".join(dict.fromkeys(str(w.message).strip().splitlines()[0][:200] for w in caught
                                              if str(w.message).strip()))
                if why and not isinstance(e, NotImplementedError):
                    raise type(e)(f"{e} [warnings: {why}]") if type(e) in (RuntimeError, ValueError) else e
                raise

    def open_call(self, key, T):
        """(Call, first-call ms): the call made and run once; raises what its first call raised."""
        impl, layout = key
        args, s = self.args, T.s
        q, cs = T.q, T.seqlens
        ident = lambda o: o  # noqa: E731
        # causal=True at one query row is no mask (bottom-right aligned: the row sees every key). With more
        # rows, every implementation runs non-causal (SDPA's causal mask is top-left aligned): the same
        # keys for all, seqlen_q - 1 more per row than a causal call would see.
        causal = s.get("seqlen_q", 1) == 1
        if impl == "cuflash":
            if self.cf is None:
                raise RuntimeError(f"cuflash did not import: {self.cf_error}")
            f = self.cf.attention_with_kvcache
            if layout == "contiguous":
                k, v = T.k, T.v
                call = Call(key, lambda: f(q, k, v, cache_seqlens=cs, causal=causal), bshd=ident, uses_seqlens=True)
            else:
                P = T.paged(args.page_size)
                call = Call(key, lambda: f(q, P.k, P.v, cache_seqlens=cs, block_table=P.table, causal=causal),
                            bshd=ident, uses_seqlens=True, paged=P, note=f"page_size {P.page_size}")
            return call, self._first(call)
        if impl in PEERS:
            import torch.nn.functional as F
            from torch.nn.attention import sdpa_kernel

            backend, note = self._sdpa_backend(impl)
            sdpa = F.scaled_dot_product_attention
            q4 = q.transpose(1, 2)
            k4, v4 = T.sdpa_kv()
            g = s["gqa"]
            layout_note = ("k/v (b, hkv, L, d) contiguous copies" if args.sdpa_layout == "contiguous"
                           else "k/v transposed views of the cache")
            modes = ["plain"] if g == 1 else (["native", "repeat"] if args.sdpa_gqa == "auto" else [args.sdpa_gqa])
            errors = []

            def attempts():
                for mode in modes:
                    if mode == "repeat":
                        need = g * s["kv_bytes"] + self.args.mem_margin_mib * 2**20
                        if T._expanded is None and need > self.clock.free_bytes():
                            errors.append(f"memory: repeat_interleave fallback needs ~{size_text(need)} (K/V "
                                          f"expanded {g}x), {size_text(self.clock.free_bytes())} free")
                            raise SkipMemory("; ".join(errors))
                        kx, vx = T.expanded()
                        fn = (lambda kx=kx, vx=vx: sdpa(q4, kx, vx))
                        mnote = (f"GQA by repeat_interleave outside the timed call (the kernel reads {g}x the "
                                 "K/V bytes)")
                    elif mode == "native":
                        fn = (lambda: sdpa(q4, k4, v4, enable_gqa=True))
                        mnote = "enable_gqa=True"
                    else:
                        fn = (lambda: sdpa(q4, k4, v4))
                        mnote = ""
                    yield mode, Call(key, fn, ctx=(lambda b=backend: sdpa_kernel(b)),
                                     bshd=lambda o: o.transpose(1, 2),
                                     note="; ".join(x for x in (note, layout_note, mnote) if x))

            mode, call, ms = self._first_working(attempts(), errors, "enable_gqa")
            if mode == "repeat":
                self.sdpa_repeat_seen = True
            return call, ms
        if impl == "flash_attn":
            if self.fa is None:
                raise RuntimeError(f"flash_attn did not import: {self.fa_error}")
            f = self.fa
            if layout == "contiguous":
                k, v = T.k, T.v
                call = Call(key, lambda: f(q, k, v, cache_seqlens=cs, causal=causal), bshd=ident, uses_seqlens=True)
                return call, self._first(call)
            sizes = [args.page_size] + ([256] if args.page_size != 256 and s["cache"] % 256 == 0 else [])

            def attempts():
                for ps in sizes:
                    P = T.paged(ps)
                    yield f"page_size {ps}", Call(
                        key, lambda P=P: f(q, P.k, P.v, cache_seqlens=cs, block_table=P.table, causal=causal),
                        bshd=ident, uses_seqlens=True, paged=P, note=f"page_size {ps}")

            _, call, ms = self._first_working(attempts(), [], f"page_size {args.page_size}")
            return call, ms
        raise ValueError(impl)

    def _first_working(self, attempts, errors, refused):
        """(label, call, first-call ms) of the first of attempts ((label, Call) pairs) whose first call
        runs. An out-of-memory error ends the search at once; any other failure is recorded in errors
        as "label: error" and the next attempt is tried. When an earlier attempt failed, the working
        call's note says "(<refused> refused: <its error>)". RuntimeError with every error when none
        works."""
        for label, call in attempts:
            try:
                ms = self._first(call)
            except Exception as e:
                if _is_oom(e):
                    raise
                errors.append(f"{label}: {_err(e)}")
                self.clock.sync()
                continue
            if errors:
                call.note += f" ({refused} refused: {errors[-1][:200]})"
            return label, call, ms
        raise RuntimeError("; ".join(errors))

    # -------------------------------------------------------------------- status of a failure

    @staticmethod
    def fail(row, e):
        if isinstance(e, NotImplementedError):
            row.update(status="not built", message=_err(e))
        elif isinstance(e, SkipMemory):
            row.update(status="skipped", message=str(e))
        elif _is_oom(e) or isinstance(e, MemoryError):
            row.update(status="oom", message=_err(e))
        else:
            row.update(status="error", message=_err(e))

    def _recover(self):
        try:
            self.clock.sync()
        except Exception:
            pass
        if self.args.cuda:
            try:
                self.torch.cuda.empty_cache()
            except Exception:
                pass

    # -------------------------------------------------------------------- one shape

    def open_all(self, keys, T, base):
        """Rows for every key, and the live calls (first call done, warm-up done, calls per round set)."""
        args = self.args
        rows, live = [], []
        for key in keys:
            row = dict(base, impl=key[0], layout=key[1], label=LABEL[key], status="ok")
            rows.append(row)
            if key[1] == "paged" and T.s["cache"] % args.page_size:
                row.update(status="skipped", message=f"cache {T.s['cache']} is not a multiple of the page size "
                                                     f"{args.page_size}")
                continue
            try:
                call, ms = self.open_call(key, T)
                call.row = row
                row["first_call_ms"] = ms
                if call.note:
                    row["note"] = call.note
                if call.paged is not None:
                    row["page_size"] = call.paged.page_size
                host = self.calibrate(call)
                row.update(calls=call.n, host_ms_per_call=host)
                live.append(call)
            except Exception as e:
                self.fail(row, e)
                self._recover()
        return rows, live

    def calibrate(self, call) -> float:
        """Warms a call up and sets its calls per round (call.n, about --round-ms of GPU time) and
        the sleep ahead of a round (call.lead_ms); returns the host ms per call."""
        args, clock = self.args, self.clock
        with call.ctx():
            for _ in range(args.warmup):
                call.fn()
            clock.sync()
            t0 = time.perf_counter()
            for _ in range(10):
                call.fn()
            host = (time.perf_counter() - t0) * 1e3 / 10
            clock.sync()
            wall = (time.perf_counter() - t0) * 1e3 / 10
        call.n = max(1, min(args.max_calls, math.ceil(args.round_ms / max(wall, 1e-4))))
        call.lead_ms = 2.0 * call.n * host + 0.2
        return host

    def measure_shape(self, s, keys):
        """Every row of one shape."""
        args, clock, torch = self.args, self.clock, self.torch
        base = row_base(s)
        T = None
        rows, live = [dict(base, impl=k[0], layout=k[1], label=LABEL[k]) for k in keys], []
        try:
            T = Tensors(torch, self.device, args, s)
            rows, live = self.open_all(keys, T, base)
            # GPU time, round-robin in serpentine order (as listed in even rounds, reversed in odd
            # ones): under the GPU's power cap a turn starts at the clock the one before it left, and
            # this way no implementation always follows the same one (bench/bench.py turn_order)
            for rnd in range(args.rounds):
                for c in (list(live) if rnd % 2 == 0 else list(live)[::-1]):
                    try:
                        with c.ctx():
                            ms, host = clock.per_call_ms(c.fn, c.n, c.lead_ms)
                        if clock.cuda and clock.cycles_per_ms and host > c.lead_ms:
                            c.row["lead_short"] = c.row.get("lead_short", 0) + 1
                            c.lead_ms = 1.5 * host + 0.2
                        c.row.setdefault("rounds_ms", []).append(ms)
                        g = clock.gauges()
                        if g is not None:  # read as the round ends
                            c.row.setdefault("rounds_sm_mhz", []).append(g[0])
                            c.row.setdefault("rounds_watts", []).append(g[1])
                    except Exception as e:
                        self.fail(c.row, e)
                        live.remove(c)
                        self._recover()
            for c in live:
                r = c.row
                r.update(ms=_median(r["rounds_ms"]), ms_min=min(r["rounds_ms"]), rounds=len(r["rounds_ms"]),
                         lead_ms=c.lead_ms)
                r["gbps"] = s["kv_bytes"] / (r["ms"] * 1e-3) / 1e9
            # eager single calls, round-robin as the GPU time's rounds (serpentine): one call of each
            # implementation in turn (its context entered outside the events), so that no
            # implementation's calls all fall in one stretch of the host's state (clocks, other load)
            if args.eager_reps:
                eager = {id(c): [] for c in live}
                for rep in range(args.eager_reps):
                    for c in (list(live) if rep % 2 == 0 else list(live)[::-1]):
                        if "eager_error" in c.row:
                            continue
                        try:
                            with c.ctx():
                                eager[id(c)].append(clock.eager_ms(c.fn))
                        except Exception as e:
                            c.row["eager_error"] = _err(e)
                            self._recover()
                for c in live:
                    t = eager[id(c)]
                    if t and "eager_error" not in c.row:
                        c.row.update(eager_ms=_median(t), eager_ms_min=min(t), eager_reps=len(t))
            # output check
            for c in live:
                try:
                    ref, n_ref = T.reference(c.paged)
                    if ref is not None and c.out is not None:
                        got = c.bshd(c.out)[:n_ref]
                        c.row.update(max_abs_diff=(got.float() - ref.float()).abs().max().item(),
                                     checked_entries=n_ref)
                    else:
                        c.row["checked_entries"] = 0
                except Exception as e:
                    c.row["check_error"] = _err(e)
                    self._recover()
                c.out = None
            # CUDA graph
            for c in live:
                if not args.cuda:
                    c.row["graph"] = {"ok": None, "why": "no CUDA (cpu-smoke)"}
                elif args.no_graph:
                    c.row["graph"] = {"ok": None, "why": "--no-graph"}
                else:
                    c.row["graph"] = self.graph_check(c, T)
        except Exception as e:   # the inputs themselves did not fit, say: every row not yet measured gets it
            for r in rows:
                if r.get("ms") is None and r.get("status") in (None, "ok"):
                    self.fail(r, e)
            if not _is_oom(e):
                traceback.print_exc()
        finally:
            for c in live:
                c.out = None
            live = None
            T = None
            gc.collect()
            self._recover()
        for r in rows:
            r.setdefault("status", "ok")
        return rows

    def graph_check(self, c, T):
        """Capture one step in a CUDA graph, replay it, compare with eager calls, time the replays."""
        torch, clock, args = self.torch, self.clock, self.args
        res = {"ok": False}
        g = out = None
        try:
            with c.ctx():
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(2):
                        c.fn()
                torch.cuda.current_stream().wait_stream(side)
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    out = c.fn()
                g.replay()
                torch.cuda.synchronize()
                ref = c.fn()
                torch.cuda.synchronize()
                res["diff_vs_eager"] = (out.float() - ref.float()).abs().max().item()
                times = []
                for _ in range(args.graph_rounds):
                    ms, host = clock.per_call_ms(g.replay, c.n, c.lead_ms)
                    times.append(ms)
                res.update(replay_ms=_median(times), replay_ms_min=min(times), rounds=len(times), calls=c.n)
                if c.uses_seqlens:
                    L = T.s["cache"]
                    before = out.clone()
                    T.seqlens.fill_(max(1, L // 2))
                    g.replay()
                    half = c.fn()
                    torch.cuda.synchronize()
                    d_new = (out.float() - half.float()).abs().max().item()
                    d_change = (before.float() - half.float()).abs().max().item()
                    res.update(diff_after_seqlens_change=d_new, change_from_seqlens=d_change,
                               follows_seqlens=bool(d_new <= max(1e-3, 0.1 * d_change)))
                    T.seqlens.fill_(L)
                    torch.cuda.synchronize()
            res["ok"] = True
            # cuflash may split the keys differently under capture (decode_num_splits' host_bound_rule):
            # the two results then differ by rounding, up to an ulp or two of the largest output.
            res["eager_amax"] = ref.float().abs().max().item()
            res["matches_eager"] = bool(res["diff_vs_eager"] <= max(1e-3, 2.0 ** -6 * res["eager_amax"]))
        except Exception as e:
            res["error"] = _err(e)
            self._recover()
            try:
                T.seqlens.fill_(T.s["cache"])
            except Exception:
                pass
        finally:
            del g, out
        return res

    # -------------------------------------------------------------------- host time per call

    def host_section(self, keys):
        args, clock = self.args, self.clock
        g = args.gqa[0]
        s = {"batch": args.host_batch, "cache": args.host_cache, "gqa": g, "seqlen_q": args.seqlen_q,
             "nheads": args.heads, "nheads_kv": args.heads // g, "head_dim": args.head_dim, "dtype": args.dtype}
        s["kv_bytes"] = kv_bytes(s["batch"], s["cache"], s["nheads_kv"], s["head_dim"])
        res = {"shape": s, "rows": [],
               "method": "after --host-warmup calls, rounds of N back-to-back calls and one synchronize, timed "
                         "round-robin over the implementations; us/call = round wall time / N; median (min) over "
                         "rounds"}
        T = None
        live = []
        try:
            T = Tensors(self.torch, self.device, args, s)
            for key in keys:
                row = {"impl": key[0], "layout": key[1], "label": LABEL[key], "status": "ok"}
                res["rows"].append(row)
                try:
                    call, ms = self.open_call(key, T)
                    call.row = row
                    row["first_call_ms"] = ms
                    if call.note:
                        row["note"] = call.note
                    with call.ctx():
                        for _ in range(args.host_warmup):
                            call.fn()
                        per = clock.wall_us(call.fn, 20) * 1e-6
                    call.n = max(min(20, args.host_calls), min(args.host_calls, int(args.host_max_round_s /
                                                                                   max(per, 1e-7))))
                    live.append(call)
                except Exception as e:
                    self.fail(row, e)
                    self._recover()
                call = None
            for _ in range(args.host_rounds):
                for c in list(live):
                    try:
                        with c.ctx():
                            c.row.setdefault("rounds_us", []).append(clock.wall_us(c.fn, c.n))
                    except Exception as e:
                        self.fail(c.row, e)
                        live.remove(c)
                        self._recover()
            for c in live:
                r = c.row
                r.update(us_median=_median(r["rounds_us"]), us_min=min(r["rounds_us"]), calls=c.n,
                         rounds=len(r["rounds_us"]))
        except Exception as e:
            res["error"] = _err(e)
            traceback.print_exc()
        finally:
            for c in live:
                c.out = None
            live = T = None
            gc.collect()
            self._recover()
        return res

    # -------------------------------------------------------------------- copy bandwidth

    def copy_bandwidth(self):
        """torch copy_ of a --copy-gib buffer: (bytes read + written) / time, median of rounds."""
        torch, args, clock = self.torch, self.args, self.clock
        n = int(args.copy_gib * 2**30) // 16 * 16
        res = {"bytes": n, "method": "dst.copy_(src), same-size uint8 buffers; GB/s = 2 * bytes (read + written) "
                                     "/ time per copy; median over rounds of back-to-back copies"}
        src = dst = fn = None
        try:
            src = torch.empty(n, dtype=torch.uint8, device=self.device).fill_(7)
            dst = torch.empty_like(src)
            fn = lambda: dst.copy_(src)  # noqa: E731
            for _ in range(3):
                fn()
            clock.sync()
            t0 = time.perf_counter()
            fn()
            clock.sync()
            est = max((time.perf_counter() - t0) * 1e3, 1e-3)
            calls = max(1, min(20, math.ceil(50.0 / est)))
            gbps = []
            for _ in range(args.copy_rounds):
                ms, _host = clock.per_call_ms(fn, calls, lead_ms=1.0)
                gbps.append(2 * n / (ms * 1e-3) / 1e9)
            res.update(gbps=_median(gbps), gbps_min=min(gbps), gbps_max=max(gbps), rounds=len(gbps), calls=calls)
        except Exception as e:
            res["error"] = _err(e)
        finally:
            src = dst = fn = None
            self._recover()
        return res


# ------------------------------------------------------------------------------------ time estimate

def estimate_shape_s(s, n_keys, args, bw_gbps):
    """Rough seconds to measure one shape (for the budget; rescaled by what the run measures)."""
    bw = (bw_gbps or 2000.0) * 0.6e9 if args.cuda else 2e9
    t = s["kv_bytes"] / bw * 1e3 + (0.02 if args.cuda else 1.0)   # ms per call
    rnd = max(args.round_ms, t)
    per_key = (0.02 + (args.warmup + 11) * t / 1e3
               + args.rounds * (2 * rnd) / 1e3
               + args.eager_reps * (t + 0.1) / 1e3)
    if args.cuda and not args.no_graph:
        per_key += 0.05 + args.graph_rounds * (2 * rnd) / 1e3 + 3 * t / 1e3
    setup = 0.2 + (3 * s["kv_bytes"] / 200e9 if args.cuda else 0.0)
    return setup + n_keys * per_key


def need_bytes(s, keys, args):
    """Device memory one shape needs, estimated before anything is allocated. An SDPA row that falls back
    to repeat_interleave checks its own need when it gets there (and only that row is skipped)."""
    kv = s["kv_bytes"]
    need = kv + 2 * s["batch"] * s["nheads"] * s["head_dim"] * 2 * (len(keys) + 2)
    sdpa = any(k[0] in PEERS for k in keys)
    if sdpa and args.sdpa_layout == "contiguous":
        need += kv
    if args.check_mib > 0:
        need += min(kv, int(args.check_mib * 2**20)) * (2 if any(k[1] == "paged" for k in keys) else 1)
    return int(need + args.mem_margin_mib * 2**20)


# ------------------------------------------------------------------------------------ analysis

def _find(points, s, impl, layout):
    for r in points:
        if (r["batch"], r["cache"], r["gqa"], r["impl"], r["layout"]) == (s["batch"], s["cache"], s["gqa"], impl,
                                                                            layout):
            return r
    return None


def shapes_of(points):
    seen = {}
    for r in points:
        seen.setdefault((r["batch"], r["cache"], r["gqa"]), r)
    return [{"batch": b, "cache": L, "gqa": g, "kv_bytes": r["kv_bytes"], "nheads_kv": r["nheads_kv"]}
            for (b, L, g), r in sorted(seen.items(), key=lambda x: (x[0][2], x[0][0], x[0][1]))]


def best_peer(points, s, key="ms"):
    vals = [(r[key], r["impl"]) for r in (_find(points, s, p, "contiguous") for p in PEERS) if r and r.get(key)]
    return min(vals) if vals else (None, None)


def finalize(data):
    """Per-row derived figures (fraction of the copy bandwidth, ratios) and the targets, from the rows."""
    points = data.get("points", [])
    copy = (data.get("copy") or {}).get("gbps")
    for r in points:
        if r.get("gbps") and copy:
            r["frac_copy"] = r["gbps"] / copy
        if r.get("ms"):
            if r["impl"] not in PEERS:
                peer, _ = best_peer(points, r)
                r["x_best_sdpa"] = r["ms"] / peer if peer else None
                ge = (r.get("graph") or {}).get("replay_ms")
                gp = [x for x in ((_find(points, r, p, "contiguous") or {}).get("graph") for p in PEERS) if x]
                gp = [x["replay_ms"] for x in gp if x.get("replay_ms")]
                r["x_best_sdpa_graph"] = ge / min(gp) if ge and gp else None
                ep, _ = best_peer(points, r, "eager_ms")
                r["x_best_sdpa_eager"] = r["eager_ms"] / ep if ep and r.get("eager_ms") else None
            if r["layout"] == "paged":
                c = _find(points, r, r["impl"], "contiguous")
                r["x_contiguous"] = r["ms"] / c["ms"] if c and c.get("ms") else None
    data["targets"] = evaluate_targets(data)


def _status_text(rows):
    """'not built: NotImplementedError: ...' for the commonest failure among rows."""
    msgs = {}
    for r in rows:
        if r.get("status") not in (None, "ok"):
            k = f"{r['status']}" + (f": {r['message']}" if r.get("message") else "")
            msgs[k] = msgs.get(k, 0) + 1
    if not msgs:
        return ""
    k = max(msgs, key=msgs.get)
    return k[:240] + (f" (and {len(msgs) - 1} other kinds)" if len(msgs) > 1 else "")


def _verdict(n_counted, n_bad):
    if n_counted == 0:
        return "not measured"
    return "missed" if n_bad else "met"


def evaluate_targets(data):
    points = data.get("points", [])
    shapes = shapes_of(points)
    out = []

    # 1. decode <= 1.0x the faster SDPA, every contiguous point
    ratios, failed, not_built, no_peer, skipped = [], [], [], 0, 0
    for s in shapes:
        cf = _find(points, s, "cuflash", "contiguous")
        if cf is None:
            continue
        if cf.get("status") == "skipped":
            skipped += 1
            continue
        peer, which = best_peer(points, s)
        if peer is None:
            no_peer += 1
            continue
        if cf.get("ms"):
            ratios.append((cf["ms"] / peer, s, which, cf))
        elif cf.get("status") == "not built":
            not_built.append(cf)
        elif cf.get("status") in ("error", "oom"):
            failed.append(cf)
    over = [x for x in ratios if x[0] > DECODE_LIMIT]
    t = {"id": "decode_vs_sdpa", "target": f"decode time <= {DECODE_LIMIT:.1f}x min(SDPA flash, cuDNN), every "
                                          "contiguous point", "limit": DECODE_LIMIT,
         "verdict": _verdict(len(ratios) + len(failed), len(over) + len(failed)), "n": len(ratios)}
    if ratios:
        worst = max(ratios, key=lambda x: x[0])
        t.update(worst=worst[0], worst_at=shape_text(worst[1]), worst_peer=worst[2],
                 geomean=_geomean([x[0] for x in ratios]), n_over=len(over))
        gr = [x[3]["x_best_sdpa_graph"] for x in ratios if x[3].get("x_best_sdpa_graph")]
        er = [x[3]["x_best_sdpa_eager"] for x in ratios if x[3].get("x_best_sdpa_eager")]
        text = (f"worst {worst[0]:.2f}x ({shape_text(worst[1])}, vs {LABEL[(worst[2], 'contiguous')]}); "
                f"{len(over)} of {len(ratios)} points over; geomean {t['geomean']:.2f}")
        if gr:
            text += f"; graph replay worst {max(gr):.2f}x"
        if er:
            text += f"; eager worst {max(er):.2f}x"
    else:
        text = "no point with both cuflash and an SDPA figure"
    if failed:
        text += f"; cuflash failed at {len(failed)} points ({_status_text(failed)})"
    if not_built:
        text += f"; not built at {len(not_built)} points ({_status_text(not_built)})"
    if no_peer:
        text += f"; {no_peer} points without an SDPA figure"
    if skipped:
        text += f"; {skipped} shapes skipped (memory / budget)"
    t["text"] = text
    out.append(t)

    # 2. paged <= 1.1x contiguous
    ratios, failed, not_built = [], [], []
    for s in shapes:
        pg, cf = _find(points, s, "cuflash", "paged"), _find(points, s, "cuflash", "contiguous")
        if pg is None or cf is None or not cf.get("ms"):
            continue
        if pg.get("ms"):
            ratios.append((pg["ms"] / cf["ms"], s))
        elif pg.get("status") == "not built":
            not_built.append(pg)
        elif pg.get("status") in ("error", "oom"):
            failed.append(pg)
    over = [x for x in ratios if x[0] > PAGED_LIMIT]
    t = {"id": "paged_vs_contiguous", "target": f"paged time <= {PAGED_LIMIT:.1f}x contiguous, same shape",
         "limit": PAGED_LIMIT, "verdict": _verdict(len(ratios) + len(failed), len(over) + len(failed)),
         "n": len(ratios)}
    if ratios:
        worst = max(ratios, key=lambda x: x[0])
        t.update(worst=worst[0], worst_at=shape_text(worst[1]), geomean=_geomean([x[0] for x in ratios]),
                 n_over=len(over))
        text = (f"worst {worst[0]:.2f}x ({shape_text(worst[1])}); {len(over)} of {len(ratios)} shapes over; "
                f"geomean {t['geomean']:.2f}")
    else:
        text = "no shape with both cuflash layouts measured"
    if failed:
        text += f"; paged failed at {len(failed)} shapes ({_status_text(failed)})"
    if not_built:
        text += f"; paged {_status_text(not_built)}"
    t["text"] = text
    out.append(t)

    # 3. bandwidth >= 80% of copy at batch >= 8, cache >= 4k
    copy = (data.get("copy") or {}).get("gbps")
    fr, failed, not_built = [], [], []
    for s in shapes:
        if s["batch"] < BW_MIN_BATCH or s["cache"] < BW_MIN_CACHE:
            continue
        cf = _find(points, s, "cuflash", "contiguous")
        if cf is None:
            continue
        if cf.get("frac_copy"):
            fr.append((cf["frac_copy"], s))
        elif cf.get("status") == "not built":
            not_built.append(cf)
        elif cf.get("status") in ("error", "oom"):
            failed.append(cf)
    low = [x for x in fr if x[0] < BW_FRACTION]
    t = {"id": "bandwidth", "target": f"K+V read bandwidth >= {BW_FRACTION:.0%} of copy, batch >= {BW_MIN_BATCH}, "
                                     f"cache >= {cache_label(BW_MIN_CACHE)}", "limit": BW_FRACTION,
         "verdict": _verdict(len(fr) + len(failed), len(low) + len(failed)) if copy else "not measured",
         "n": len(fr), "copy_gbps": copy}
    if not copy:
        text = "no copy bandwidth measured"
    elif fr:
        lo = min(fr, key=lambda x: x[0])
        t.update(min=lo[0], min_at=shape_text(lo[1]), n_low=len(low))
        text = (f"min {lo[0]:.0%} ({shape_text(lo[1])}, {lo[0] * copy:.0f} of {copy:.0f} GB/s); "
                f"{len(low)} of {len(fr)} points below")
        pg = [(_find(points, s, "cuflash", "paged") or {}).get("frac_copy") for _, s in fr]
        pg = [x for x in pg if x]
        if pg:
            text += f"; paged min {min(pg):.0%}"
        peers = [(_find(points, s, p, "contiguous") or {}).get("frac_copy") for _, s in fr for p in PEERS]
        peers = [x for x in peers if x]
        if peers:
            text += f"; SDPA best {max(peers):.0%}"
    else:
        text = "no point at batch >= 8, cache >= 4k with a cuflash figure"
    if failed:
        text += f"; cuflash failed at {len(failed)} points ({_status_text(failed)})"
    if not_built:
        text += f"; not built at {len(not_built)} points"
    t["text"] = text
    out.append(t)

    # 4. host time per call <= SDPA flash's
    host = data.get("host") or {}
    hrows = host.get("rows") or []
    get = lambda impl, layout: next((r for r in hrows if r["impl"] == impl and r["layout"] == layout), None)  # noqa: E731
    cf, fa, pg = get("cuflash", "contiguous"), get("sdpa_flash", "contiguous"), get("cuflash", "paged")
    t = {"id": "host_time", "target": f"host time per call <= {HOST_LIMIT:.1f}x SDPA flash's", "limit": HOST_LIMIT}
    if cf and fa and cf.get("us_median") and fa.get("us_median"):
        x = cf["us_median"] / fa["us_median"]
        t.update(verdict="met" if x <= HOST_LIMIT else "missed", ratio=x, cuflash_us=cf["us_median"],
                 sdpa_flash_us=fa["us_median"])
        text = f"cuflash {cf['us_median']:.1f} us vs SDPA flash {fa['us_median']:.1f} us ({x:.2f}x)"
        if pg and pg.get("us_median"):
            text += f"; paged {pg['us_median']:.1f} us ({pg['us_median'] / fa['us_median']:.2f}x)"
        elif pg:
            text += f"; paged {_status_text([pg]) or 'no figure'}"
        t["text"] = text
    elif cf and cf.get("us_median") is None and cf.get("status") not in (None, "ok", "not built") and fa \
            and fa.get("us_median"):
        t.update(verdict="missed", text=f"cuflash failed: {_status_text([cf])}")
    else:
        why = ("host section not run" if not hrows else
               "; ".join(f"{r['label']}: {_status_text([r]) or 'no figure'}" for r in (cf, fa) if r and
                         not r.get("us_median")) or "no figures")
        t.update(verdict="not measured", text=why)
    out.append(t)

    # 5. CUDA graph
    ok, bad, nb, nm = [], [], [], 0
    for r in points:
        if r["impl"] != "cuflash" or not r.get("ms"):
            if r["impl"] == "cuflash" and r.get("status") == "not built":
                nb.append(r)
            continue
        gr = r.get("graph") or {}
        if gr.get("ok") is None:
            nm += 1
            continue
        good = gr.get("ok") and gr.get("matches_eager") and gr.get("follows_seqlens") is not False
        (ok if good else bad).append((r, gr))
    t = {"id": "cuda_graph", "target": "decode step captures and replays in a CUDA graph (and follows "
                                       "cache_seqlens)", "verdict": _verdict(len(ok) + len(bad), len(bad)),
         "n": len(ok) + len(bad), "n_bad": len(bad)}
    if ok or bad:
        text = f"{len(ok)} of {len(ok) + len(bad)} cuflash rows captured, replayed and matched eager"
        if bad:
            r, gr = bad[0]
            why = gr.get("error") or ("replay differs from eager" if not gr.get("matches_eager") else
                                      "replay ignores a change of cache_seqlens")
            text += f"; first failure {LABEL[(r['impl'], r['layout'])]} {shape_text(r)}: {why[:200]}"
    else:
        text = "no cuflash row with a graph check" + (" (no CUDA)" if nm else "")
    if nb:
        text += f"; {len(nb)} rows not built"
    t["text"] = text
    out.append(t)
    return out


# ------------------------------------------------------------------------------------ printing

def _cell(r, w):
    if r is None:
        return f"{'':>{w}}"
    if r.get("ms"):
        frac = f"{r['frac_copy']:.0%}" if r.get("frac_copy") else f"{r['gbps']:.0f}G"
        txt = f"{r['ms']:.3f} {frac}" if r["ms"] < 100 else f"{r['ms']:.1f} {frac}"
        return f"{txt:>{w}}"
    st = r.get("status") or "-"
    st = {"not built": "not built", "error": "ERR", "oom": "OOM", "skipped": "skip"}.get(st, st)
    if r.get("status") == "skipped" and "budget" in (r.get("message") or ""):
        st = "budget"
    elif r.get("status") == "skipped" and "memory" in (r.get("message") or ""):
        st = "mem skip"
    return f"{st:>{w}}"


def _x(v, w, d=2):
    return f"{(f'{v:.{d}f}' if v else '-'):>{w}}"


def format_header(data):
    m = data.get("meta", {})
    c = data.get("copy") or {}
    lines = [f"device: {m.get('device', '?')} (driver {m.get('driver', '?')}) | torch {m.get('torch')} (CUDA "
             f"{m.get('torch_cuda')}, cuDNN {m.get('cudnn')}) | cuflash {m.get('cuflash')} | flash_attn "
             f"{m.get('flash_attn') or 'not installed'} | {m.get('timestamp_utc', '')}"]
    if m.get("cuflash_import_error"):
        lines.append(f"cuflash import error: {m['cuflash_import_error']}")
    if c.get("gbps"):
        lines.append(f"device-to-device copy bandwidth: {c['gbps']:.0f} GB/s (read + written; {c['bytes'] / 2**30:.2f} "
                     f"GiB buffer, torch copy_, median of {c['rounds']} rounds, range {c['gbps_min']:.0f}.."
                     f"{c['gbps_max']:.0f})")
    else:
        lines.append(f"device-to-device copy bandwidth: not measured ({c.get('error', 'no figure')})")
    return "\n".join(lines)


def format_host(data):
    h = data.get("host")
    if not h:
        return "=== host time per call: not run ==="
    s = h.get("shape", {})
    lines = [f"=== host time per call: b{s.get('batch')} L{s.get('cache')} g{s.get('gqa')} (tiny GPU work); us/call "
             "= round wall time / N back-to-back calls (one synchronize), median (min) over rounds, round-robin ==="]
    if h.get("error"):
        lines.append(f"ERROR {h['error']}")
    fa = next((r for r in h.get("rows", []) if r["impl"] == "sdpa_flash" and r.get("us_median")), None)
    for r in h.get("rows", []):
        if r.get("us_median"):
            x = f"  {r['us_median'] / fa['us_median']:.2f}x sdpa-fa" if fa else ""
            lines.append(f"  {r['label']:<18}{r['us_median']:9.1f} ({r['us_min']:.1f}) us, {r['calls']} calls x "
                         f"{r['rounds']} rounds{x}")
        else:
            lines.append(f"  {r['label']:<18}{_status_text([r]) or '-'}")
    return "\n".join(lines)


def format_table(data):
    points = data.get("points", [])
    if not points:
        return "=== no decode points ==="
    keys = [k for k in KEYS if any((r["impl"], r["layout"]) == k for r in points)]
    w = 16
    lines = ["=== time per decode step: ms (GPU time of back-to-back calls, median) and K+V read bandwidth as a "
             "fraction of the copy bandwidth ===",
             "x sdpa = cuflash / the faster of sdpa-fa and cudnn (GPU time; in brackets: CUDA-graph replay); "
             "paged/c = cuflash paged / contiguous; graph = cuflash replay ms per step"]
    hdr = (f"{'g':>2}{'hkv':>4}{'b':>5}{'L':>6}{'KV MiB':>9} " + "".join(f"{LABEL[k]:>{w}}" for k in keys)
           + f"{'x sdpa':>15}{'paged/c':>9}{'graph':>9}")
    lines += [hdr, "-" * len(hdr)]
    for s in shapes_of(points):
        cells = "".join(_cell(_find(points, s, *k), w) for k in keys)
        cf = _find(points, s, "cuflash", "contiguous") or {}
        pg = _find(points, s, "cuflash", "paged") or {}
        xs = _x(cf.get("x_best_sdpa"), 6)
        xg = cf.get("x_best_sdpa_graph")
        xs += f" ({xg:.2f})" if xg else f"{'':>7}"
        gr = (cf.get("graph") or {})
        gtxt = f"{gr['replay_ms']:.3f}" if gr.get("replay_ms") else ("FAIL" if gr.get("error") else "-")
        lines.append(f"{s['gqa']:>2}{s['nheads_kv']:>4}{s['batch']:>5}{cache_label(s['cache']):>6}"
                     f"{s['kv_bytes'] / 2**20:>9.1f} {cells}{xs:>15}{_x(pg.get('x_contiguous'), 9)}{gtxt:>9}")
    return "\n".join(lines)


def format_notes(data):
    """First-call times, notes (SDPA's GQA mode), flagged checks, and the failures, once per kind."""
    points = data.get("points", [])
    lines = ["=== first calls (compilation, module loads, lazy init; kept out of every figure), per implementation "
             "==="]
    for k in KEYS:
        rows = [r for r in points if (r["impl"], r["layout"]) == k and r.get("first_call_ms") is not None]
        if rows:
            big = max(rows, key=lambda r: r["first_call_ms"])
            lines.append(f"  {LABEL[k]:<18}max {big['first_call_ms']:9.1f} ms ({shape_text(big)}), median "
                         f"{_median([r['first_call_ms'] for r in rows]):.2f} ms, sum "
                         f"{sum(r['first_call_ms'] for r in rows) / 1e3:.1f} s over {len(rows)} shapes")
    notes = {}
    for r in points:
        if r.get("note"):
            notes.setdefault((r["label"], r["note"]), []).append(r)
    if notes:
        lines.append("=== notes ===")
        for (label, note), rows in notes.items():
            lines.append(f"  {label}: {note} ({len(rows)} shapes)")
    clocks = [(r, mhz) for r in points for mhz in r.get("rounds_sm_mhz") or ()]
    if clocks:
        lines.append("=== SM clock as the GPU-time rounds ended (NVML), per implementation ===")
        for k in KEYS:
            mhz = [m for r, m in clocks if (r["impl"], r["layout"]) == k]
            watts = [w for r in points if (r["impl"], r["layout"]) == k for w in r.get("rounds_watts") or ()]
            if mhz:
                lines.append(f"  {LABEL[k]:<18}{min(mhz)}-{max(mhz)} MHz, median {_median(mhz):.0f}; power up to "
                             f"{max(watts):.0f} W")
    flagged = [r for r in points if r.get("max_abs_diff") is not None and r["max_abs_diff"] > CHECK_TOL]
    checked = [r for r in points if r.get("max_abs_diff") is not None]
    lines.append(f"=== output check: {len(checked)} rows checked against SDPA on the logical keys; "
                 f"{len(flagged)} over {CHECK_TOL} ===")
    if checked:
        worst = max(checked, key=lambda r: r["max_abs_diff"])
        lines.append(f"  largest max|d| {worst['max_abs_diff']:.2e} ({worst['label']}, {shape_text(worst)})")
    for r in flagged[:10]:
        lines.append(f"  CHECK {r['label']} {shape_text(r)}: max|d| {r['max_abs_diff']:.3g} on "
                     f"{r['checked_entries']} entries")
    fails, skipped = {}, {}
    for r in points:
        if r.get("status") == "skipped":
            skipped.setdefault(r.get("message", ""), {}).setdefault(shape_text(r), []).append(r["label"])
        elif r.get("status") not in (None, "ok"):
            fails.setdefault((r["label"], r["status"], r.get("message", "")), []).append(r)
        for extra in ("eager_error", "check_error"):
            if r.get(extra):
                fails.setdefault((r["label"], extra, r[extra]), []).append(r)
        gr = r.get("graph") or {}
        if gr.get("error"):
            fails.setdefault((r["label"], "graph", gr["error"]), []).append(r)
    if skipped:
        lines.append("=== skipped ===")
        for msg, by_shape in skipped.items():
            labels = sorted({x for v in by_shape.values() for x in v})
            lines.append(f"  {len(by_shape)} shape(s) ({', '.join(list(by_shape)[:6])}"
                         f"{', ...' if len(by_shape) > 6 else ''}), rows {', '.join(labels)}: {msg[:300]}")
    if fails:
        lines.append("=== failures (each kind once) ===")
        for (label, status, msg), rows in fails.items():
            lines.append(f"  {label}: {status} at {len(rows)} shape(s), e.g. {shape_text(rows[0])}: {msg[:300]}")
    return "\n".join(lines)


def format_targets(data):
    t = data.get("targets") or []
    lines = ["=== targets (a report, not a test) ==="]
    w = max([len(x["target"]) for x in t] + [10])
    for x in t:
        lines.append(f"  {x['verdict'].upper():<13}{x['target']:<{w}}  {x.get('text', '')}")
    counts = {v: sum(1 for x in t if x["verdict"] == v) for v in ("met", "missed", "not measured")}
    lines.append(f"  {counts['met']} met, {counts['missed']} missed, {counts['not measured']} not measured")
    return "\n".join(lines)


def print_report(data):
    print()
    print(format_header(data))
    print()
    print(format_host(data))
    print()
    print(format_table(data))
    print()
    print(format_notes(data))
    print()
    print(format_targets(data))


def progress_line(i, n, s, rows, elapsed):
    parts = []
    for r in rows:
        if r.get("ms"):
            frac = f" {r['frac_copy']:.0%}" if r.get("frac_copy") else f" {r['gbps']:.0f} GB/s"
            gr = r.get("graph") or {}
            g = " graph ok" if gr.get("ok") and gr.get("matches_eager") else (" graph FAIL" if gr.get("ok") is False
                                                                             else "")
            d = (f" CHECK max|d| {r['max_abs_diff']:.2g}" if (r.get("max_abs_diff") or 0) > CHECK_TOL else "")
            parts.append(f"{r['label']} {r['ms']:.3f} ms{frac}{g}{d}")
        else:
            parts.append(f"{r['label']} {r.get('status')}")
    return (f"[{i}/{n} {elapsed:4.0f}s] {shape_text(s)} (hkv {s['nheads_kv']}, KV {s['kv_bytes'] / 2**20:.1f} MiB): "
            + " | ".join(parts))


# ------------------------------------------------------------------------------------ plot

def make_plot(data, path):
    """Achieved K+V bandwidth / copy bandwidth against the cache length: a panel per (GQA group, batch),
    a line per implementation. Returns the path, or None with a message when it cannot draw."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:
        print(f"plot skipped: matplotlib is not importable ({_err(e)})")
        return None
    points = [r for r in data.get("points", []) if r.get("frac_copy")]
    if not points:
        print("plot skipped: no point with a bandwidth figure (no copy bandwidth, or nothing measured)")
        return None
    gqas = sorted({r["gqa"] for r in points})
    batches = sorted({r["batch"] for r in points})
    keys = [k for k in KEYS if any((r["impl"], r["layout"]) == k for r in points)]
    styles = {("cuflash", "contiguous"): ("C0", "o", "-"), ("cuflash", "paged"): ("C0", "s", "--"),
              ("sdpa_flash", "contiguous"): ("C1", "^", "-"), ("sdpa_cudnn", "contiguous"): ("C2", "v", "-"),
              ("flash_attn", "contiguous"): ("C3", "D", "-"), ("flash_attn", "paged"): ("C3", "d", "--")}
    fig, axes = plt.subplots(len(gqas), len(batches), figsize=(2.9 * len(batches) + 0.6, 2.4 * len(gqas) + 1.0),
                             squeeze=False, sharex=True, sharey=True)
    handles = {}
    top = max([r["frac_copy"] for r in points] + [1.0])
    for gi, g in enumerate(gqas):
        for bi, b in enumerate(batches):
            ax = axes[gi][bi]
            for k in keys:
                pts = sorted((r["cache"], r["frac_copy"]) for r in points
                             if (r["impl"], r["layout"]) == k and r["gqa"] == g and r["batch"] == b)
                if pts:
                    color, marker, ls = styles[k]
                    (h,) = ax.plot([x for x, _ in pts], [y for _, y in pts], color=color, marker=marker, ls=ls,
                                   lw=1.2, ms=4)
                    handles[LABEL[k]] = h
            ax.axhline(BW_FRACTION, color="gray", lw=0.8, ls=":")
            ax.set_xscale("log", base=2)
            ticks = sorted({r["cache"] for r in points})
            ax.set_xticks(ticks)
            ax.set_xticklabels([cache_label(x) for x in ticks])
            ax.minorticks_off()
            ax.set_ylim(0, top * 1.08)
            ax.grid(True, alpha=0.3)
            hkv = next((r["nheads_kv"] for r in points if r["gqa"] == g), "?")
            ax.set_title(f"batch {b}, GQA {g} (kv heads {hkv})", fontsize=8)
            if gi == len(gqas) - 1:
                ax.set_xlabel("cache length (keys)", fontsize=8)
            if bi == 0:
                ax.set_ylabel("K+V read / copy BW", fontsize=8)
            ax.tick_params(labelsize=7)
    m = data.get("meta", {})
    copy = (data.get("copy") or {}).get("gbps")
    fig.suptitle(f"decode step: achieved K+V read bandwidth / measured copy bandwidth ({copy:.0f} GB/s)\n"
                 f"{m.get('device', '?')}, {m.get('dtype', '')}, {m.get('nheads', '')} query heads, head_dim "
                 f"{m.get('head_dim', '')}; dotted line: the {BW_FRACTION:.0%} target", fontsize=9)
    fig.legend(list(handles.values()), list(handles.keys()), loc="lower center", ncol=len(handles), fontsize=8,
               frameon=False)
    fig.tight_layout(rect=(0, 0.05, 1, 0.93))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------------ meta

def collect_meta(torch, args, mods):
    meta = {"timestamp_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "argv": sys.argv[1:], "python": platform.python_version(), "torch": torch.__version__,
            "torch_cuda": torch.version.cuda, "cpu_smoke": bool(args.cpu_smoke), "quick": bool(args.quick),
            "cuflash": getattr(mods["cuflash"], "__version__", None) if mods["cuflash"] else None,
            "cuflash_path": (os.path.dirname(os.path.abspath(mods["cuflash"].__file__)) if mods["cuflash"]
                             else None),
            "cuflash_import_error": mods["cuflash_error"], "flash_attn": mods["flash_attn_version"],
            "flash_attn_import_error": mods["flash_attn_error"],
            "dtype": args.dtype, "nheads": args.heads, "seqlen_q": args.seqlen_q, "head_dim": args.head_dim,
            "page_size": args.page_size,
            "grid": {"batches": args.batches, "caches": args.caches, "gqa": args.gqa, "layouts": args.layouts,
                     "impls": args.impls},
            "sdpa": {"layout": args.sdpa_layout, "gqa": args.sdpa_gqa, "is_causal": False},
            "timing": {"rounds": args.rounds, "round_ms": args.round_ms, "max_calls": args.max_calls,
                       "warmup": args.warmup, "eager_reps": args.eager_reps, "graph_rounds": args.graph_rounds,
                       "ms": "GPU time per step: CUDA events around N back-to-back calls queued behind a sleep "
                             "kernel; median over rounds, implementations round-robin",
                       "eager_ms": "synchronize, start event, one call, end event; median",
                       "first_call_ms": "the first call at the shape, synchronized, host clock (compile / load)"},
            "bandwidth": "K+V bytes = batch * L * nheads_kv * head_dim * 2 * 2 bytes; GB/s = bytes / ms per step; "
                         "frac_copy = GB/s / the measured copy GB/s",
            "budget_s": args.budget_s}
    try:
        meta["cudnn"] = torch.backends.cudnn.version()
    except Exception:
        meta["cudnn"] = None
    if args.cuda:
        props = torch.cuda.get_device_properties(0)
        meta["device"] = torch.cuda.get_device_name(0)
        meta["capability"] = list(torch.cuda.get_device_capability(0))
        meta["sm_count"] = props.multi_processor_count
        meta["memory_gib"] = round(props.total_memory / 2**30, 1)
        meta["nvidia_smi"] = nvidia_smi_info()  # (None where nvidia-smi fails)
        if meta.get("nvidia_smi"):
            parts = [x.strip() for x in meta["nvidia_smi"][0].split(",")]
            if len(parts) > 1:
                meta["driver"] = parts[1]
        try:
            import cupy

            meta["cupy"] = cupy.__version__
            meta["cuda_driver_version"] = cupy.cuda.runtime.driverGetVersion()
        except Exception as e:
            meta["cupy"] = f"unavailable: {type(e).__name__}"
    else:
        meta["device"] = f"CPU ({platform.processor() or platform.machine()}), --cpu-smoke"
        meta["driver"] = None
    return meta


def load_modules(args, torch):
    mods = {"cuflash": None, "cuflash_error": None, "flash_attn": None, "flash_attn_version": None,
            "flash_attn_error": None}
    if "cuflash" in args.impls:
        try:
            import cuflash

            mods["cuflash"] = cuflash
        except Exception as e:
            mods["cuflash_error"] = _err(e)
            traceback.print_exc()
    if "flash_attn" in args.impls:
        try:
            import flash_attn
            from flash_attn import flash_attn_with_kvcache

            mods["flash_attn"] = flash_attn_with_kvcache
            mods["flash_attn_version"] = getattr(flash_attn, "__version__", "?")
        except Exception as e:
            mods["flash_attn_error"] = _err(e)
    return mods


# ------------------------------------------------------------------------------------ dry run

def dry_run(args):
    shapes = build_shapes(args)
    keys = selected_keys(args)
    mem = 80.0 if args.cuda else (args.mem_cap_mib or 8192) / 1024
    print(f"bench_decode.py --dry-run: {len(shapes)} shapes x {len(keys)} rows ({', '.join(LABEL[k] for k in keys)}; "
          f"flash_attn only if it imports), {args.dtype}, {args.heads} query heads, head_dim {args.head_dim}, "
          f"page_size {args.page_size}")
    hdr = f"{'#':>4}{'g':>3}{'hkv':>5}{'b':>5}{'L':>7}{'KV GiB':>9}{'need GiB':>10}{'fits 80G':>9}{'est s':>7}"
    print(hdr)
    print("-" * len(hdr))
    total = 0.0
    for i, s in enumerate(shapes, 1):
        need = need_bytes(s, keys, args) / 2**30
        fits = need <= 0.95 * mem
        est = estimate_shape_s(s, len(keys), args, None) if fits else 0.0
        total += est
        print(f"{i:>4}{s['gqa']:>3}{s['nheads_kv']:>5}{s['batch']:>5}{cache_label(s['cache']):>7}"
              f"{s['kv_bytes'] / 2**30:>9.2f}{need:>10.2f}{('yes' if fits else 'no'):>9}{est:>7.1f}")
    print(f"rough measuring time {total:.0f} s (+ start-up, copy bandwidth, host section, first-call compiles); "
          f"budget {args.budget_s:.0f} s (shapes predicted past it are skipped)")
    return 0


# ------------------------------------------------------------------------------------ main

def run(args):
    import torch

    if args.cuda:
        if not torch.cuda.is_available():
            print("bench_decode.py: no CUDA device visible to torch (--cpu-smoke runs on the CPU)", file=sys.stderr)
            return 2
        torch.cuda.init()
    torch.manual_seed(args.seed)
    mods = load_modules(args, torch)
    keys = selected_keys(args, fa_ok=mods["flash_attn"] is not None)
    clock = Clock(torch, args.cuda, None if args.mem_cap_mib is None else int(args.mem_cap_mib * 2**20))
    runner = Runner(torch, args, clock, mods)
    meta = collect_meta(torch, args, mods)
    meta["sleep_calibrated"] = clock.cycles_per_ms is not None
    meta["gauges"] = ("NVML: the SM clock (MHz) and board power (W) read as each GPU-time round ends "
                      "(rounds_sm_mhz, rounds_watts)" if clock.gauges() is not None else None)
    data = {"meta": meta, "copy": None, "host": None, "points": [], "targets": []}
    shapes = build_shapes(args)
    print(f"bench_decode.py: {len(shapes)} shapes x {len(keys)} rows ({', '.join(LABEL[k] for k in keys)}) on "
          f"{meta.get('device')}; {args.dtype}, {args.heads} query heads, head_dim {args.head_dim}, "
          f"page_size {args.page_size}; budget {args.budget_s:.0f} s", flush=True)
    if mods["flash_attn_error"] and "flash_attn" in args.impls:
        print(f"  (flash_attn not benchmarked: {mods['flash_attn_error']})")
    if mods["cuflash_error"]:
        print(f"  (cuflash did not import: {mods['cuflash_error']})")
    if args.cuda and clock.cycles_per_ms is None:
        print("  (torch.cuda._sleep unavailable: at tiny shapes the host may leak into the GPU-time figures)")

    try:
        data["copy"] = runner.copy_bandwidth()
        c = data["copy"]
        meta["copy_gbps"] = c.get("gbps")
        print(f"copy bandwidth: {c['gbps']:.0f} GB/s (read + written, {c['bytes'] / 2**30:.2f} GiB)" if c.get("gbps")
              else f"copy bandwidth: ERROR {c.get('error')}", flush=True)
        write_json(args.json, data)
        if not args.no_host:
            data["host"] = runner.host_section(keys)
            print(format_host(data), flush=True)
            write_json(args.json, data)

        est_done = act_done = 0.0
        for i, s in enumerate(shapes, 1):
            elapsed = time.perf_counter() - T_START
            est = estimate_shape_s(s, len(keys), args, (data["copy"] or {}).get("gbps"))
            scale = max(0.5, act_done / est_done) if est_done > 2 else 1.0
            base = row_base(s)
            why = None
            if args.budget_s and elapsed + est * scale > args.budget_s:
                why = (f"time budget: {elapsed:.0f} s elapsed, ~{est * scale:.1f} s predicted, budget "
                       f"{args.budget_s:g} s")
            else:
                need, free = need_bytes(s, keys, args), clock.free_bytes()
                if need > 0.95 * free:
                    why = f"memory: needs ~{size_text(need)}, over 95% of the {size_text(free)} free"
            if why:
                rows = [dict(base, impl=k[0], layout=k[1], label=LABEL[k], status="skipped", message=why) for k in keys]
                data["points"] += rows
                print(f"[{i}/{len(shapes)} {elapsed:4.0f}s] {shape_text(s)}: skipped ({why})", flush=True)
                continue
            t0 = time.perf_counter()
            rows = runner.measure_shape(s, keys)
            # first calls (compilation) are one-off: left out of the rate that rescales the predictions
            act_done += max(0.0, time.perf_counter() - t0 - sum(r.get("first_call_ms") or 0 for r in rows) / 1e3)
            est_done += est
            data["points"] += rows
            finalize(data)
            print(progress_line(i, len(shapes), s, rows, time.perf_counter() - T_START), flush=True)
            write_json(args.json, data)
    finally:
        data["meta"]["wall_s"] = time.perf_counter() - T_START
        finalize(data)
        write_json(args.json, data)

    if args.plot:
        try:
            if make_plot(data, args.plot):
                print(f"plot: {args.plot}")
                data["meta"]["plot"] = args.plot
        except Exception as e:
            print(f"plot failed: {_err(e)}", file=sys.stderr)
            data["meta"]["plot_error"] = _err(e)
        write_json(args.json, data)
    print_report(data)
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.summarize:
        with open(args.summarize) as f:
            data = json.load(f)
        finalize(data)
        if args.plot:
            if make_plot(data, args.plot):
                print(f"plot: {args.plot}")
        print_report(data)
        return 0
    if args.dry_run:
        return dry_run(args)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
