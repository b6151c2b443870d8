#!/usr/bin/env python3
"""Benchmarks of cuflash's optional features (cuflash/_features.py): sliding windows, packed batches,
and what each feature path costs against plain attention.

Sections (all bf16 by default, 16 heads, head_dim 128, through torch tensors on the GPU):
  window   window (256, 0) with causal=True against full causal attention at seqlen 16384 (batch 2;
           --quick: batch 1), forward and backward; the speedup (full time / window time) per pass,
           target >= 10x.
  varlen   a packed batch of mixed lengths 64..4096 (a fixed seeded list, about 32k tokens; printed
           and kept in the JSON) through attention_varlen, against its padded equivalent (batch =
           number of sequences, seqlen = the longest) through attention(..., q_lengths=,
           kv_lengths=), and plain attention on the padded batch (which computes the padding too),
           causal off and on, forward and backward.
  cost     each feature alone at seqlen 4096 (batch 4) against plain attention, causal off and on:
           softcap 30, ALiBi slopes (nheads,), sink_logits (which then requires grad, so the backward
           also computes d sink_logits), kv_lengths = the full length (the lengths path, masking
           nothing). The ratio feature time / plain time is the cost of the feature path.

  flex     (only when named in --sections) each option against torch.compile(flex_attention) with
           the equivalent block mask and score_mod: bench/bench_flex.py's measurement (window (256,
           0) and (4096, 0), ALiBi, softcap, a packed batch; batch 2, seqlen 8k and 16k, causal;
           forward and forward + backward), its table and the >= 1.0x target in the report.

Timing, as bench/bench.py (its time_cuda is used): CUDA events around each call on the current
stream, after a first call and a warm-up; the median of max(--reps, enough runs for --min-time
seconds) runs.
  fwd   the forward call (inputs require grad, as in training)
  bwd   torch.autograd.grad(out, inputs, dout, retain_graph=True) after one forward; inputs are q, k,
        v (and sink_logits when it is given)
The first call of each variant and pass compiles its kernels (or loads them from the disk cache,
$CUFLASH_CACHE_DIR): timed on its own (host clock, device synchronize) and reported in the compile
section, never in the timings. --cold-cache points the cache at a fresh temporary directory (and
turns off NVRTC's own cache) so that those first calls are real compiles.

FLOPs (bench/bench.py's convention): forward = 4 * heads * head_dim * (query, key) pairs, with
batch * seqlen_q * seqlen_k pairs for full attention, halved when causal; backward = 2.5 x forward.
  window: the exact number of visible pairs, sum over rows of min(i, left) + 1.
  varlen: real tokens only, sum over sequences of L^2 (halved when causal), for all three variants,
          so that their TFLOP/s compare useful work (plain padded attention does more).
  cost:   the plain count for every variant (the features do not change the work).

Output: one progress line per measurement, then the compile section, then one table per section,
then a summary (window speedups against the 10x target, varlen against padded, the cost of each
feature). --json PATH keeps every figure, the lengths and the versions. Exit status: 0; 1 if any
measurement failed; 2 without a CUDA device.

Examples:
    python bench/bench_features.py --dry-run              # the configurations and FLOPs; no GPU needed
    python bench/bench_features.py --quick                # a minute or two on an H100, plus first compiles
    python bench/bench_features.py --json out/features.json
    python bench/bench_features.py --summarize out/features.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import random
import shutil
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if HERE not in sys.path:
    sys.path.insert(0, HERE)
if os.path.isdir(os.path.join(ROOT, "cuflash")) and ROOT not in sys.path:
    sys.path.insert(0, ROOT)   # benchmark the checkout this script belongs to

from bench import time_cuda  # noqa: E402
from bench_forward import nvidia_smi_info, write_json  # noqa: E402

SECTIONS = ("window", "varlen", "cost")
OPT_IN_SECTIONS = ("flex",)  # run only when named in --sections (torch.compile of each Flex variant takes minutes)
PASSES = ("fwd", "bwd")
PASS_FACTOR = {"fwd": 1.0, "bwd": 2.5}
FLOP_CONVENTION = ("forward FLOPs = 4 * heads * head_dim * visible (query, key) pairs (full: batch * seqlen^2, "
                   "halved when causal; window: exact pair count; varlen: real tokens only); backward = 2.5 x "
                   "forward; TFLOP/s = FLOPs / median time")
WINDOW_TARGET = 10.0
SHORT = {"float16": "fp16", "bfloat16": "bf16"}
INPUT_SEED = 1234

NHEADS, HEAD_DIM = 16, 128
WINDOW = {"seqlen": 16384, "batch": 2, "batch_quick": 1, "window": (256, 0)}
VARLEN = {"tokens": 32768, "min_len": 64, "max_len": 4096, "seed": 20261121}
COST = {"seqlen": 4096, "batch": 4, "softcap": 30.0}
COST_FEATURES = ("plain", "softcap", "alibi", "sink_logits", "kv_lengths_full")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--quick", action="store_true",
                   help="a minute or two: window at batch 1, varlen and cost with causal on only, 10 reps, "
                        "0.05 s per measurement")
    p.add_argument("--sections", nargs="+", choices=SECTIONS + OPT_IN_SECTIONS,
                   help="default: window varlen cost; flex (cuflash's options against torch.compile(flex_attention), "
                        "bench/bench_flex.py) only when named")
    p.add_argument("--dtype", choices=sorted(SHORT), default="bfloat16")
    p.add_argument("--causal", choices=["both", "off", "on"],
                   help="for varlen and cost (window is always causal); default both, --quick: on")
    p.add_argument("--reps", type=int, help="at least this many timed runs per measurement (default 20, quick 10)")
    p.add_argument("--min-time", type=float, help="seconds of timed work per measurement, at least "
                                                  "(default 0.2, quick 0.05)")
    p.add_argument("--max-reps", type=int, default=300, help="at most this many timed runs (default 300)")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls before timing, at most ~50 ms worth")
    p.add_argument("--cold-cache", action="store_true",
                   help="compile into a fresh temporary cache (first-call times are real NVRTC compiles)")
    p.add_argument("--json", metavar="PATH", help="write every figure here (rewritten after each measurement)")
    p.add_argument("--dry-run", action="store_true", help="list the configurations and FLOPs; needs no GPU")
    p.add_argument("--summarize", metavar="PATH", help="print the tables of an earlier --json file and exit")
    args = p.parse_args(argv)
    q = args.quick
    args.flex = "flex" in (args.sections or ())
    args.sections = [s for s in SECTIONS if s in (args.sections or SECTIONS)]
    args.causal = args.causal or ("on" if q else "both")
    args.causals = {"both": [False, True], "off": [False], "on": [True]}[args.causal]
    args.reps = args.reps if args.reps is not None else (10 if q else 20)
    args.min_time = args.min_time if args.min_time is not None else (0.05 if q else 0.2)
    if args.reps < 1:
        p.error("--reps must be at least 1")
    return args


# ------------------------------------------------------------------------------------ FLOPs

def full_pairs(batch, seqlen_q, seqlen_k, causal) -> float:
    pairs = float(batch) * seqlen_q * seqlen_k
    return pairs / 2 if causal else pairs


def window_pairs(batch, seqlen, left) -> float:
    """Visible (i, j) pairs of a causal window (left, 0) on a square sequence: sum_i min(i, left) + 1."""
    n = 0
    if seqlen > left:
        n = (left + 1) * (seqlen - left) + left * (left + 1) // 2
    else:
        n = seqlen * (seqlen + 1) // 2
    return float(batch) * n


def varlen_pairs(lengths, causal) -> float:
    return sum(float(n) * n / (2 if causal else 1) for n in lengths)


def fwd_flops(pairs) -> float:
    return 4.0 * NHEADS * HEAD_DIM * pairs


def varlen_lengths(tokens=VARLEN["tokens"], lo=VARLEN["min_len"], hi=VARLEN["max_len"], seed=VARLEN["seed"]):
    """A fixed list of lengths summing to `tokens`: hi and lo first (both ends of the range are in the
    batch), then log-uniform draws in [lo, hi], shuffled; the last draw is trimmed (or dropped and the
    one before extended) so that every length stays in [lo, hi]."""
    rng = random.Random(seed)
    out = [hi, lo]
    while sum(out) < tokens:
        out.append(int(round(math.exp(rng.uniform(math.log(lo), math.log(hi))))))
    excess = sum(out) - tokens
    if out[-1] - excess >= lo:
        out[-1] -= excess
    else:
        out.pop()
        out[-1] = min(hi, out[-1] + tokens - sum(out))
    first, rest = out[:2], out[2:]
    rest.insert(len(rest) // 3, first[0])
    rest.insert(2 * len(rest) // 3, first[1])
    return rest


# ------------------------------------------------------------------------------------ configurations

def build_measurements(args):
    """[(section, variant, causal, config dict)] in run order; each is timed for fwd and bwd."""
    ms = []
    if "window" in args.sections:
        b = WINDOW["batch_quick"] if args.quick else WINDOW["batch"]
        s = WINDOW["seqlen"]
        left = WINDOW["window"][0]
        ms.append(("window", "causal_full", True, {"batch": b, "seqlen": s, "pairs": full_pairs(b, s, s, True)}))
        ms.append(("window", f"window_{left}_0", True,
                   {"batch": b, "seqlen": s, "window": WINDOW["window"], "pairs": window_pairs(b, s, left)}))
    if "varlen" in args.sections:
        lens = varlen_lengths()
        for c in args.causals:
            base = {"lengths": lens, "batch": len(lens), "seqlen": max(lens), "tokens": sum(lens),
                    "pairs": varlen_pairs(lens, c)}
            for variant in ("varlen", "padded_lengths", "padded_plain"):
                ms.append(("varlen", variant, c, dict(base)))
    if "cost" in args.sections:
        b, s = COST["batch"], COST["seqlen"]
        for c in args.causals:
            for f in COST_FEATURES:
                ms.append(("cost", f, c, {"batch": b, "seqlen": s, "pairs": full_pairs(b, s, s, c)}))
    return ms


def meas_name(section, variant, causal, cfg) -> str:
    return f"{section}/{variant} {'causal' if causal else 'full'} b{cfg['batch']} s{cfg['seqlen']}"


# ------------------------------------------------------------------------------------ running

class Bench:
    def __init__(self, torch, cuflash, args):
        self.torch, self.cf, self.args = torch, cuflash, args
        self.dtype = getattr(torch, args.dtype)

    def _randn(self, *shape, grad=True):
        t = self.torch.randn(*shape, device="cuda", dtype=self.dtype)
        return t.requires_grad_(True) if grad else t

    def build(self, section, variant, causal, cfg):
        """(forward callable, differentiable inputs, dout). Allocates the inputs."""
        torch, cf = self.torch, self.cf
        h, d = NHEADS, HEAD_DIM
        if section == "window":
            b, s = cfg["batch"], cfg["seqlen"]
            q, k, v = (self._randn(b, s, h, d) for _ in range(3))
            dout = self._randn(b, s, h, d, grad=False)
            kw = {"window": tuple(cfg["window"])} if "window" in cfg else {}
            return (lambda: cf.attention(q, k, v, causal=causal, **kw)), (q, k, v), dout
        if section == "varlen":
            lens = cfg["lengths"]
            total, bsz, mx = sum(lens), len(lens), max(lens)
            q, k, v = (self._randn(total, h, d) for _ in range(3))
            dout = self._randn(total, h, d, grad=False)
            if variant == "varlen":
                cu = [0]
                for n in lens:
                    cu.append(cu[-1] + n)
                cu_t = torch.tensor(cu, dtype=torch.int32, device="cuda")
                return (lambda: cf.attention_varlen(q, k, v, cu_t, cu_t, mx, mx, causal=causal)), (q, k, v), dout
            # the padded equivalent: the same tokens, zeros in the padding
            with torch.no_grad():
                pads = []
                for x in (q, k, v, dout):
                    p = torch.zeros(bsz, mx, h, d, device="cuda", dtype=self.dtype)
                    off = 0
                    for i, n in enumerate(lens):
                        p[i, :n] = x[off:off + n]
                        off += n
                    pads.append(p)
            qp, kp, vp, dp = pads
            for x in (qp, kp, vp):
                x.requires_grad_(True)
            if variant == "padded_lengths":
                lt = torch.tensor(lens, dtype=torch.int32, device="cuda")
                return ((lambda: cf.attention(qp, kp, vp, causal=causal, q_lengths=lt, kv_lengths=lt)),
                        (qp, kp, vp), dp)
            return (lambda: cf.attention(qp, kp, vp, causal=causal)), (qp, kp, vp), dp
        if section == "cost":
            b, s = cfg["batch"], cfg["seqlen"]
            q, k, v = (self._randn(b, s, h, d) for _ in range(3))
            dout = self._randn(b, s, h, d, grad=False)
            inputs = (q, k, v)
            kw = {}
            if variant == "softcap":
                kw["softcap"] = COST["softcap"]
            elif variant == "alibi":
                kw["alibi_slopes"] = (2.0 ** (-8.0 * (torch.arange(h, device="cuda", dtype=torch.float32) + 1) / h))
            elif variant == "sink_logits":
                sink = torch.randn(h, device="cuda", dtype=torch.float32).requires_grad_(True)
                kw["sink_logits"] = sink
                inputs = (q, k, v, sink)
            elif variant == "kv_lengths_full":
                kw["kv_lengths"] = torch.full((b,), s, dtype=torch.int32, device="cuda")
            elif variant != "plain":
                raise ValueError(variant)
            return (lambda: cf.attention(q, k, v, causal=causal, **kw)), inputs, dout
        raise ValueError(section)

    def run(self, section, variant, causal, cfg):
        """Rows for fwd and bwd, compile (first-call) records, and the forward output (for the checks)."""
        torch, args = self.torch, self.args
        rows, compiles, keep = [], [], None
        base = {"section": section, "variant": variant, "causal": causal, "dtype": args.dtype,
                "batch": cfg["batch"], "seqlen": cfg["seqlen"], "nheads": NHEADS, "head_dim": HEAD_DIM,
                "pairs": cfg["pairs"]}
        if "window" in cfg:
            base["window"] = list(cfg["window"])
        fwd = inputs = dout = out = None
        try:
            torch.manual_seed(INPUT_SEED)
            fwd, inputs, dout = self.build(section, variant, causal, cfg)
            torch.cuda.synchronize()
            # first calls: compile (or load) every kernel of this variant, timed on their own
            t0 = time.perf_counter()
            out = fwd()
            torch.cuda.synchronize()
            compiles.append(dict(base, **{"pass": "fwd"}, first_call_s=time.perf_counter() - t0))
            t0 = time.perf_counter()
            torch.autograd.grad(out, inputs, dout, retain_graph=True)
            torch.cuda.synchronize()
            compiles.append(dict(base, **{"pass": "bwd"}, first_call_s=time.perf_counter() - t0))
            keep = out.detach()
            for ps in PASSES:
                row = dict(base, **{"pass": ps}, flops=fwd_flops(cfg["pairs"]) * PASS_FACTOR[ps])
                try:
                    if ps == "fwd":
                        fn = fwd
                    else:
                        o = fwd()
                        fn = lambda: torch.autograd.grad(o, inputs, dout, retain_graph=True)  # noqa: E731
                    med, mn, reps = time_cuda(torch, fn, args)
                    row.update(ms=med, ms_min=mn, reps=reps, tflops=row["flops"] / (med * 1e-3) / 1e12)
                except Exception as e:
                    row["error"] = _err(e)
                    traceback.print_exc()
                finally:
                    fn = o = None
                    torch.cuda.synchronize()
                rows.append(row)
        except Exception as e:
            msg = _err(e)
            traceback.print_exc()
            done = {r["pass"] for r in rows}
            rows += [dict(base, **{"pass": ps}, flops=fwd_flops(cfg["pairs"]) * PASS_FACTOR[ps], error=msg)
                     for ps in PASSES if ps not in done]
        finally:
            fwd = inputs = dout = out = None
            torch.cuda.empty_cache()
        return rows, compiles, keep


def _err(e) -> str:
    msg = str(e).strip()
    return f"{type(e).__name__}: {msg.splitlines()[0][:300] if msg else ''}"


class CrossChecks:
    """Forward outputs that must agree, on identical inputs (every variant's inputs are drawn after
    torch.manual_seed(INPUT_SEED), and the varlen variants share their packed tokens): attention_varlen
    against attention(..., q_lengths=, kv_lengths=) on the real tokens, and kv_lengths = full against
    plain. Also counts NaN in every forward output. Results: data["checks"]."""

    def __init__(self, torch, checks: dict):
        self.torch, self.checks, self.ref = torch, checks, {}

    def add(self, section, variant, causal, cfg, out):
        torch = self.torch
        tag = f"{section}/{variant} {'causal' if causal else 'full'}"
        n_nan = int(torch.isnan(out).sum().item())
        self.checks[f"{tag}: NaN in out"] = n_nan
        key = (section, causal)
        if section == "varlen":
            if variant == "varlen":
                self.ref[key] = out
            elif variant == "padded_lengths" and key in self.ref:
                packed = torch.cat([out[i, :n] for i, n in enumerate(cfg["lengths"])])
                self.checks[f"{tag}: max|out - varlen out|"] = float((packed.float() - self.ref[key].float())
                                                                     .abs().max().item())
        elif section == "cost":
            if variant == "plain":
                self.ref[key] = out
            elif variant == "kv_lengths_full" and key in self.ref:
                self.checks[f"{tag}: max|out - plain out|"] = float((out.float() - self.ref[key].float())
                                                                    .abs().max().item())
        return n_nan

    def end_section(self, section):
        self.ref = {k: v for k, v in self.ref.items() if k[0] == section}


# ------------------------------------------------------------------------------------ report

def find(rows, **kw):
    for r in rows:
        if all(r.get(k) == v for k, v in kw.items()):
            return r
    return None


def _ms(r):
    return f"{r['ms']:.3f}" if r and r.get("ms") is not None else ("err" if r and r.get("error") else "-")


def _tf(r):
    return f"{r['tflops']:.1f}" if r and r.get("tflops") is not None else "-"


def _ratio(a, b):
    """a's time / b's time."""
    if a and b and a.get("ms") and b.get("ms"):
        return a["ms"] / b["ms"]
    return None


def _fmt_ratio(x, suffix="x"):
    return f"{x:.2f}{suffix}" if x is not None else "-"


def summarize(data):
    rows = data["results"]
    s = {}
    for r in [r for r in rows if r["section"] == "window" and r["variant"] != "causal_full"]:
        full = find(rows, section="window", variant="causal_full", **{"pass": r["pass"]})
        x = _ratio(full, r)
        if x is not None:
            s[f"window {r['pass']} speedup"] = x
    for c in (False, True):
        for ps in PASSES:
            v = find(rows, section="varlen", variant="varlen", causal=c, **{"pass": ps})
            for other in ("padded_lengths", "padded_plain"):
                x = _ratio(find(rows, section="varlen", variant=other, causal=c, **{"pass": ps}), v)
                if x is not None:
                    s[f"varlen {'causal' if c else 'full'} {ps}: {other} / varlen time"] = x
    for c in (False, True):
        for ps in PASSES:
            for f in COST_FEATURES[1:]:
                x = _ratio(find(rows, section="cost", variant=f, causal=c, **{"pass": ps}),
                           find(rows, section="cost", variant="plain", causal=c, **{"pass": ps}))
                if x is not None:
                    s[f"cost {'causal' if c else 'full'} {ps}: {f} / plain time"] = x
    data["summary"] = s
    data["summary_errors"] = sum(1 for r in rows if r.get("error"))
    return s


def format_compile(data) -> str:
    comp = data.get("compile") or []
    if not comp:
        return "first calls: none recorded"
    cache = data["meta"].get("cache")
    lines = [f"=== first calls (compile or disk-cache load; {cache}) — not in any timing ==="]
    if data.get("init_s") is not None:
        lines.append(f"initialisation before them (import, CUDA context, a head_dim-8 kernel): {data['init_s']:.2f} s")
    lines.append(f"{'measurement':<46}{'fwd s':>8}{'bwd s':>8}")
    seen = []
    for r in comp:
        key = (r["section"], r["variant"], r["causal"])
        if key not in seen:
            seen.append(key)
    total = 0.0
    for key in seen:
        f = next((r for r in comp if (r["section"], r["variant"], r["causal"]) == key and r["pass"] == "fwd"), None)
        b = next((r for r in comp if (r["section"], r["variant"], r["causal"]) == key and r["pass"] == "bwd"), None)
        name = f"{key[0]}/{key[1]} {'causal' if key[2] else 'full'}"
        fs = f"{f['first_call_s']:.2f}" if f else "-"
        bs = f"{b['first_call_s']:.2f}" if b else "-"
        total += (f["first_call_s"] if f else 0) + (b["first_call_s"] if b else 0)
        lines.append(f"{name:<46}{fs:>8}{bs:>8}")
    lines.append(f"{'total':<46}{total:>16.2f}")
    return "\n".join(lines)


def format_tables(data) -> str:
    rows = data["results"]
    out = []
    meta = data["meta"]
    dt = SHORT.get(meta.get("dtype"), meta.get("dtype"))
    w = [r for r in rows if r["section"] == "window"]
    if w:
        r0 = w[0]
        out.append(f"=== window: {dt}, batch {r0['batch']}, seqlen {r0['seqlen']}, {NHEADS} heads, head_dim "
                   f"{HEAD_DIM}, causal; ms (median) and TFLOP/s (visible pairs) ===")
        out.append(f"{'variant':<18}{'pass':<6}{'ms':>10}{'TFLOP/s':>10}{'speedup':>10}")
        for r in w:
            full = find(rows, section="window", variant="causal_full", **{"pass": r["pass"]})
            sp = _ratio(full, r) if r["variant"] != "causal_full" else None
            out.append(f"{r['variant']:<18}{r['pass']:<6}{_ms(r):>10}{_tf(r):>10}{_fmt_ratio(sp):>10}")
        out.append("")
    v = [r for r in rows if r["section"] == "varlen"]
    if v:
        lens = data.get("varlen_lengths") or v[0].get("lengths") or []
        out.append(f"=== varlen: {dt}, {len(lens)} sequences, {sum(lens)} tokens (lengths {min(lens)}..{max(lens)}), "
                   f"padded to {max(lens)}; TFLOP/s on real tokens; ratio = time / varlen time ===")
        out.append(f"{'causal':<8}{'pass':<6}{'variant':<16}{'ms':>10}{'TFLOP/s':>10}{'ratio':>9}")
        for r in v:
            base = find(rows, section="varlen", variant="varlen", causal=r["causal"], **{"pass": r["pass"]})
            out.append(f"{('on' if r['causal'] else 'off'):<8}{r['pass']:<6}{r['variant']:<16}{_ms(r):>10}{_tf(r):>10}"
                       f"{_fmt_ratio(_ratio(r, base)):>9}")
        out.append("")
    c = [r for r in rows if r["section"] == "cost"]
    if c:
        r0 = c[0]
        out.append(f"=== feature cost: {dt}, batch {r0['batch']}, seqlen {r0['seqlen']}, {NHEADS} heads, head_dim "
                   f"{HEAD_DIM}; ratio = time / plain time ===")
        out.append(f"{'causal':<8}{'pass':<6}{'feature':<18}{'ms':>10}{'TFLOP/s':>10}{'ratio':>9}")
        for r in c:
            base = find(rows, section="cost", variant="plain", causal=r["causal"], **{"pass": r["pass"]})
            out.append(f"{('on' if r['causal'] else 'off'):<8}{r['pass']:<6}{r['variant']:<18}{_ms(r):>10}"
                       f"{_tf(r):>10}{_fmt_ratio(_ratio(r, base)):>9}")
        out.append("")
    errors = {}
    for r in rows:
        if r.get("error"):
            errors.setdefault(r["error"], []).append(f"{r['section']}/{r['variant']}/{r['pass']}")
    if errors:
        out.append("errors:")
        for msg, where in errors.items():
            out.append(f"  {msg}  ({', '.join(where)})")
        out.append("")
    return "\n".join(out).rstrip()


def format_summary(data) -> str:
    s = data.get("summary") or summarize(data)
    meta = data["meta"]
    lines = ["=== summary ===", f"{meta.get('device', '?')}; {FLOP_CONVENTION}"]
    for ps in PASSES:
        x = s.get(f"window {ps} speedup")
        if x is not None:
            lines.append(f"window {tuple(WINDOW['window'])} vs full causal, {ps}: {x:.1f}x "
                         f"({'meets' if x >= WINDOW_TARGET else 'BELOW'} the {WINDOW_TARGET:.0f}x target)")
    for key, x in s.items():
        if key.startswith("varlen") or key.startswith("cost"):
            lines.append(f"{key}: {x:.2f}")
    for key, x in (data.get("checks") or {}).items():
        if "NaN" in key:
            if x:
                lines.append(f"{key}: {x}")
        else:
            lines.append(f"check {key}: {x:.3g}")
    n_err = data.get("summary_errors", 0)
    lines.append(f"errors: {n_err} measurement(s)" + (" -> exit status 1" if n_err else ""))
    if meta.get("wall_s") is not None:
        lines.append(f"wall time {meta['wall_s']:.0f} s")
    return "\n".join(lines)


def print_report(data):
    print()
    print(format_compile(data))
    print()
    print(format_summary(data))
    print()
    print(format_tables(data))
    if "flex" in data:
        import bench_flex

        print()
        print("cuflash against FlexAttention (bench/bench_flex.py):")
        print(bench_flex.report(data["flex"]["results"], data["flex"]["checks"]))


# ------------------------------------------------------------------------------------ meta, dry run, main

def collect_meta(torch, cuflash, args, cache):
    meta = {"timestamp_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "argv": sys.argv[1:], "python": platform.python_version(), "torch": torch.__version__,
            "torch_cuda": torch.version.cuda, "nvidia_smi": nvidia_smi_info(),
            "cuflash": getattr(cuflash, "__version__", None),
            "cuflash_path": os.path.dirname(os.path.abspath(cuflash.__file__)),
            "dtype": args.dtype, "nheads": NHEADS, "head_dim": HEAD_DIM, "flop_convention": FLOP_CONVENTION,
            "timing": {"statistic": "median of per-call CUDA-event times (ms); first call and warm-up untimed",
                       "min_reps": args.reps, "max_reps": args.max_reps, "min_time_s": args.min_time,
                       "warmup": args.warmup, "fwd": "forward call, inputs require grad",
                       "bwd": "torch.autograd.grad(out, inputs, dout, retain_graph=True) after one forward"},
            "cache": cache, "quick": bool(args.quick), "sections": args.sections,
            "window": WINDOW, "varlen": VARLEN, "cost": COST}
    if torch.cuda.is_available():
        meta["device"] = torch.cuda.get_device_name(0)
        meta["capability"] = list(torch.cuda.get_device_capability(0))
    try:
        import cupy

        meta["cupy"] = cupy.__version__
    except Exception as e:
        meta["cupy"] = f"unavailable: {type(e).__name__}"
    return meta


def dry_run(args) -> int:
    ms = build_measurements(args)
    print(f"bench_features.py --dry-run: {len(ms)} variants x passes {', '.join(PASSES)}; {args.dtype}, "
          f"{NHEADS} heads, head_dim {HEAD_DIM}")
    print(FLOP_CONVENTION)
    if "varlen" in args.sections:
        lens = varlen_lengths()
        print(f"varlen lengths ({len(lens)} sequences, {sum(lens)} tokens, padded batch {len(lens)} x {max(lens)} = "
              f"{len(lens) * max(lens)} tokens): {lens}")
    print(f"{'#':>3}  {'measurement':<46}{'fwd GFLOP':>12}")
    for i, (sec, var, c, cfg) in enumerate(ms, 1):
        print(f"{i:>3}  {meas_name(sec, var, c, cfg):<46}{fwd_flops(cfg['pairs']) / 1e9:>12.1f}")
    if "window" in args.sections:
        w = [cfg for sec, var, c, cfg in ms if sec == "window"]
        print(f"window: ideal speedup (pairs ratio) {w[0]['pairs'] / w[1]['pairs']:.1f}x")
    if args.flex:
        import bench_flex

        print("flex (bench/bench_flex.py), each with cuflash and torch.compile(flex_attention), passes "
              + ", ".join(bench_flex.PASSES) + ":")
        return bench_flex.main(["--dry-run"] + (["--quick"] if args.quick else []))
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.summarize:
        with open(args.summarize) as f:
            data = json.load(f)
        summarize(data)
        print_report(data)
        return 0
    if args.dry_run:
        return dry_run(args)

    t_start = time.perf_counter()
    cold_dir = None
    cache = f"disk cache {os.environ.get('CUFLASH_CACHE_DIR', '~/.cache/cuflash')} as found"
    if args.cold_cache:
        cold_dir = tempfile.mkdtemp(prefix="cuflash_features_cold_")
        os.environ["CUFLASH_CACHE_DIR"] = cold_dir
        os.environ["CUDA_CACHE_DISABLE"] = "1"
        cache = "cold: a fresh temporary cache, NVRTC cache off"

    import torch

    if not torch.cuda.is_available():
        print("bench_features.py: no CUDA device visible to torch", file=sys.stderr)
        return 2
    torch.cuda.init()
    import cuflash

    ms = build_measurements(args)
    data = {"meta": collect_meta(torch, cuflash, args, cache), "compile": [], "results": [], "checks": {}}
    if "varlen" in args.sections:
        data["varlen_lengths"] = varlen_lengths()
    print(f"bench_features.py: {len(ms)} variants x {', '.join(PASSES)} on {data['meta'].get('device')} "
          f"({args.dtype}; {cache})", flush=True)
    # one-off initialisation (torch op registration, CUDA context, module loading), kept out of the
    # first-call figures: a tiny forward + backward at head_dim 8, which no measurement uses
    t0 = time.perf_counter()
    try:
        x = torch.randn(1, 8, 1, 8, device="cuda", dtype=getattr(torch, args.dtype)).requires_grad_(True)
        torch.autograd.grad(cuflash.attention(x, x, x).float().sum(), (x,))
        torch.cuda.synchronize()
        data["init_s"] = time.perf_counter() - t0
    except Exception as e:
        data["init_error"] = _err(e)
        traceback.print_exc()
    bench = Bench(torch, cuflash, args)
    checks = CrossChecks(torch, data["checks"])
    n_nan = 0
    try:
        for i, (sec, var, c, cfg) in enumerate(ms, 1):
            checks.end_section(sec)
            rows, comp, out = bench.run(sec, var, c, cfg)
            data["results"] += rows
            data["compile"] += comp
            if out is not None:
                n_nan += checks.add(sec, var, c, cfg, out)
                del out
            first = " ".join(f"{r['pass']} {r['first_call_s']:.2f}s" for r in comp)
            parts = " | ".join(f"{r['pass']} {_ms(r)} ms {_tf(r)} TFLOP/s" for r in rows)
            print(f"[{i}/{len(ms)} {time.perf_counter() - t_start:5.0f}s] {meas_name(sec, var, c, cfg)}: {parts}"
                  + (f" (first calls: {first})" if first else ""), flush=True)
            write_json(args.json, data)
        if args.flex:
            import bench_flex

            fargs = bench_flex.parse_args(["--quick"] if args.quick else [])
            fargs.reps, fargs.min_time, fargs.max_reps, fargs.warmup = args.reps, args.min_time, args.max_reps, args.warmup
            rows, fchecks = bench_flex.run(torch, cuflash, fargs)
            data["flex"] = {"results": rows, "checks": fchecks}
            n_nan += sum(c["nan"] for c in fchecks)
            write_json(args.json, data)
    finally:
        data["meta"]["wall_s"] = time.perf_counter() - t_start
        summarize(data)
        write_json(args.json, data)
        if cold_dir:
            shutil.rmtree(cold_dir, ignore_errors=True)
    if n_nan:
        print(f"NaN in forward outputs: {[k for k, v in data['checks'].items() if 'NaN' in k and v]}",
              file=sys.stderr)
        data["summary_errors"] += 1
    print_report(data)
    return 1 if data["summary_errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
