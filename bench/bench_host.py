#!/usr/bin/env python3
"""Host time per call of cuflash, on a shape where the GPU work is negligible, against its peers.

At bf16, batch 1, seqlen 128, 2 heads, head_dim 64 (the default shape) a kernel runs a few
microseconds, so a stream of back-to-back calls is limited by the Python and driver work of each
call, not by the GPU: what a small model, a decode step or a CUDA-graph-less training loop waits for.

Method: each row's call is made --warmup times (compilation, caches and lazy initialisation stay
out); then --rounds rounds of N back-to-back calls, each ending with one device synchronize, are
timed round-robin (round 1 of every row, then round 2 of every row, ...), so that the host's drift
over the run falls on all rows alike; us/call = round wall time / N. The figure is the median over
the rounds, with the min beside it. N is --calls (500), lowered for slow calls so that a round
lasts about --max-round-s at most (a pilot of 20 calls sets it; the N used is reported). Each
call's result replaces the previous one, so outputs and autograd graphs are freed as in a loop
that uses them. Everything runs in one process; a row that raises records its error and the run
goes on.

Rows (id: what one call is). Option rows use the plain call plus the one option named.
  torch.fwd[.OPT]        cuflash.attention(q, k, v, causal=True[, OPT]) on torch tensors without grad
  torch.fwd_grad[.OPT]   the same with q, k, v requiring grad (the autograd node is recorded, as in
                         training); sink logits require grad too, ALiBi slopes and lengths do not
      OPT: window (window=(W, 0)), lengths (q_lengths = kv_lengths = int32 (batch,), full),
           sink_logits (float32 (nheads,)), alibi (float32 (nheads,)), softcap (30.0),
           sink_tokens (window=(W, 0), num_sink_tokens=4), varlen (attention_varlen on the
           batch packed into (batch * seqlen, heads, head_dim), one sequence per batch entry)
  torch.fwdbwd[.window]  out = cuflash.attention(q, k, v, causal=True[, window]);
                         torch.autograd.grad(out, (q, k, v), dout)
  torch.plan.fwd, torch.plan.fwd_grad
                         p = cuflash.plan(q, k, v, causal=True) once (its time is reported as
                         setup), then p(q, k, v) per call; an error if cuflash has no plan()
  sdpa_flash.fwd, .fwd_grad, .fwdbwd   torch SDPA under sdpa_kernel(FLASH_ATTENTION), is_causal=True
  sdpa_cudnn.fwd, .fwd_grad, .fwdbwd   the same under sdpa_kernel(CUDNN_ATTENTION)
                         SDPA gets .transpose(1, 2) views of the same tensors, made once outside
                         the timed call (so no view cost is in SDPA's figure); the backend context
                         is entered once around the round (it is a global setting, not per call)
  cupy.fwd               cuflash.attention on CuPy arrays (ml_dtypes.bfloat16 dtype for bf16)
  cupy.bwd               cuflash.attention_backward(dout, q, k, v, out, lse, causal=True) on CuPy
  cupy.plan.fwd          the plan API on CuPy arrays, as torch.plan.fwd
  jax.fwd                cuflash.attention on JAX arrays, eager
  jax.fwdbwd             jax.grad of sum(cuflash.attention(q, k, v, causal=True) * dout) with
                         respect to q, k, v, eager (cuflash raises under jax.jit)
  jax_cudnn.fwd          jax.nn.dot_product_attention(q, k, v, is_causal=True,
                         implementation="cudnn"), eager: JAX's own peer, where it runs
Rows whose library does not import or sees no GPU are skipped; JAX is told not to preallocate
GPU memory (XLA_PYTHON_CLIENT_PREALLOCATE=false unless set) so that torch and CuPy keep theirs.

Output: one line per row as it finishes (and with --profile, right after it, the cProfile top
functions by tottime over one more round of the row's calls); the errors; then the summary last:
the table (row, us/call median and min, calls per round, x sdpa-fa = median / the matching SDPA
flash row's, x plain = an option or plan row's median / the plain cuflash row's with the same grad
setting) and the targets, PASS or FAIL each (a report, not a test):
  forward <= 1.0x SDPA flash forward with the same grad setting (torch.fwd, torch.fwd_grad, the
      plan rows)
  forward with any one option <= 1.2x the plain cuflash forward with the same grad setting
  forward + backward <= 1.0x SDPA flash's forward + backward (torch.fwdbwd, torch.fwdbwd.window)
  CuPy forward <= 30 us (cupy.fwd, cupy.plan.fwd)
--markdown prints the table as Markdown (before the summary); --json keeps every round's figure,
the versions, the CPU and the GPU. Exit status: 0 (whatever the targets say), 2 without a CUDA
device.

A figure is a host time only while the host is slower than the GPU: if a row's kernels took longer
than its host work (a bigger --seqlen, say), the round would measure the GPU instead. At the
default shape every kernel here is well under the host time of a call.

Examples:
    python bench/bench_host.py                               # every row, ~2 minutes on an H100 host
    python bench/bench_host.py --rows 'torch.fwd*' 'sdpa_flash.*' --profile
    python bench/bench_host.py --json out/host.json --markdown
    python bench/bench_host.py --list                        # the rows, no GPU needed
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import datetime
import fnmatch
import gc
import io
import os
import platform
import pstats
import statistics
import sys
import time
import traceback
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

OPTIONS = ("window", "lengths", "sink_logits", "alibi", "softcap", "sink_tokens", "varlen")
FWD_LIMIT_VS_SDPA = 1.0       # forward: at most this x SDPA flash's forward
OPTION_LIMIT_VS_PLAIN = 1.2   # forward with one option: at most this x the plain cuflash forward
FWDBWD_LIMIT_VS_SDPA = 1.0    # forward + backward: at most this x SDPA flash's
CUPY_FWD_LIMIT_US = 30.0      # CuPy forward: at most this many us per call
PILOT_CALLS = 20
DEVICE = "cuda"   # torch inputs' device; only an offline check of this script's logic points it at "cpu"
T_START = time.perf_counter()


@dataclass
class Row:
    id: str
    lib: str        # the library the row needs: torch, cupy or jax
    kind: str       # fwd, fwd_grad, fwdbwd or bwd: which SDPA flash row it is compared with
    desc: str
    option: str | None = None   # the one cuflash option an option row adds
    result: dict = field(default_factory=dict)

    @property
    def sdpa_ref(self) -> str | None:
        return f"sdpa_flash.{self.kind}" if self.kind in ("fwd", "fwd_grad", "fwdbwd") else None

    @property
    def plain_ref(self) -> str | None:
        """The plain cuflash row an option row (or a plan row) is measured against."""
        if ".plan." in self.id:
            return f"{self.id.split('.plan.')[0]}.{self.kind}"
        return f"torch.{self.kind}" if self.option else None


def option_desc(opt, window) -> str:
    return {"window": f"window=({window}, 0)",
            "lengths": "q_lengths=kv_lengths=int32 (batch,) cuda",
            "sink_logits": "sink_logits=float32 (nheads,)",
            "alibi": "alibi_slopes=float32 (nheads,)",
            "softcap": "softcap=30.0",
            "sink_tokens": f"window=({window}, 0), num_sink_tokens=4",
            "varlen": "attention_varlen, packed (batch x seqlen, heads, d)"}[opt]


def build_rows(window) -> list[Row]:
    rows = []
    for kind, what in (("fwd", "no grad"), ("fwd_grad", "inputs require grad")):
        rows.append(Row(f"torch.{kind}", "torch", kind, f"cuflash.attention(causal=True), {what}"))
        for opt in OPTIONS:
            rows.append(Row(f"torch.{kind}.{opt}", "torch", kind, f"{option_desc(opt, window)}, {what}", opt))
    rows.append(Row("torch.fwdbwd", "torch", "fwdbwd", "cuflash.attention + torch.autograd.grad"))
    rows.append(Row("torch.fwdbwd.window", "torch", "fwdbwd",
                    f"window=({window}, 0): cuflash.attention + torch.autograd.grad", "window"))
    rows.append(Row("torch.plan.fwd", "torch", "fwd", "p = cuflash.plan(q, k, v, causal=True); p(q, k, v), no grad"))
    rows.append(Row("torch.plan.fwd_grad", "torch", "fwd_grad",
                    "p = cuflash.plan(q, k, v, causal=True); p(q, k, v), inputs require grad"))
    for prov, name in (("sdpa_flash", "flash"), ("sdpa_cudnn", "cuDNN")):
        rows.append(Row(f"{prov}.fwd", "torch", "fwd", f"SDPA {name}, is_causal=True, no grad"))
        rows.append(Row(f"{prov}.fwd_grad", "torch", "fwd_grad", f"SDPA {name}, is_causal=True, inputs require grad"))
        rows.append(Row(f"{prov}.fwdbwd", "torch", "fwdbwd", f"SDPA {name} + torch.autograd.grad"))
    rows.append(Row("cupy.fwd", "cupy", "fwd", "cuflash.attention(causal=True) on CuPy arrays"))
    rows.append(Row("cupy.bwd", "cupy", "bwd", "cuflash.attention_backward on CuPy arrays"))
    rows.append(Row("cupy.plan.fwd", "cupy", "fwd", "p = cuflash.plan(q, k, v, causal=True); p(q, k, v) on CuPy"))
    rows.append(Row("jax.fwd", "jax", "fwd", "cuflash.attention(causal=True) on JAX arrays, eager"))
    rows.append(Row("jax.fwdbwd", "jax", "fwdbwd", "jax.grad of sum(cuflash.attention(...) * dout), eager"))
    rows.append(Row("jax_cudnn.fwd", "jax", "fwd", 'jax.nn.dot_product_attention(implementation="cudnn"), eager'))
    return rows


def select_rows(rows, patterns):
    if not patterns:
        return rows
    return [r for r in rows if any(fnmatch.fnmatchcase(r.id, p) for p in patterns)]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--rows", nargs="+", metavar="GLOB", help="row ids to run, shell-style patterns "
                                                              "(e.g. 'torch.fwd*' 'sdpa_*'); default all")
    p.add_argument("--list", action="store_true", help="print the selected rows and exit (no GPU needed)")
    p.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seqlen", type=int, default=128)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--window", type=int, default=32, metavar="LEFT",
                   help="left size of the window rows' window=(LEFT, 0) (default 32; keep it below seqlen, "
                        "or the call reduces to plain causal attention)")
    p.add_argument("--calls", type=int, default=500, help="back-to-back calls per round (default 500)")
    p.add_argument("--rounds", type=int, default=15,
                   help="rounds per row (default 15), timed round-robin over the rows")
    p.add_argument("--warmup", type=int, default=50, help="untimed calls first (default 50)")
    p.add_argument("--max-round-s", type=float, default=0.5,
                   help="lower the calls per round so a round lasts about this long at most (default 0.5; "
                        "0 = always --calls)")
    p.add_argument("--profile", action="store_true",
                   help="after each row, cProfile one more round and print the top functions by tottime")
    p.add_argument("--profile-top", type=int, default=15, help="functions printed per profile (default 15)")
    p.add_argument("--json", metavar="PATH", help="write every figure, the versions and the devices here")
    p.add_argument("--markdown", action="store_true", help="also print the table as Markdown")
    args = p.parse_args(argv)
    for name in ("batch", "seqlen", "heads", "head_dim", "calls", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.warmup < 1:
        p.error("--warmup must be at least 1 (the first call compiles)")
    return args


# ------------------------------------------------------------------------------------ timing

def warm_up(call, sync, args) -> int:
    """Runs the warm-up calls and a pilot; returns the calls per round. `call` returns its result,
    which `sync` gets (JAX needs the last array to wait on it)."""
    out = None
    for _ in range(args.warmup):
        out = call()
    sync(out)
    t0 = time.perf_counter()
    for _ in range(PILOT_CALLS):
        out = call()
    sync(out)
    per_call = (time.perf_counter() - t0) / PILOT_CALLS
    n = args.calls
    if args.max_round_s > 0:
        n = max(min(PILOT_CALLS, n), min(n, int(args.max_round_s / max(per_call, 1e-7))))
    return n


def one_round(call, sync, n) -> float:
    """us per call over n back-to-back calls and one synchronize."""
    out = None
    gc.collect()   # a collection of earlier rows' garbage should not land in this round
    sync(None)
    t0 = time.perf_counter()
    for _ in range(n):
        out = call()
    sync(out)
    return (time.perf_counter() - t0) / n * 1e6


def profile_round(call, sync, n, top) -> str:
    out = None
    sync(None)
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        out = call()
    sync(out)
    pr.disable()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(top)
    return buf.getvalue()


def _err(e) -> str:
    msg = str(e).strip()
    first = msg.splitlines()[0][:300] if msg else ""
    return f"{type(e).__name__}: {first}"


# ------------------------------------------------------------------------------------ libraries

class Libs:
    """The array libraries, each imported at its first row (so JAX's client and threads stay out of
    the rows before its own), with why one is unusable."""

    def __init__(self):
        self.mods, self.why_not, self.device_name = {}, {}, None
        self.cuflash, self.cuflash_error = None, None

    def ensure(self, lib) -> bool:
        if lib not in self.mods and lib not in self.why_not:
            self._try(lib, getattr(self, f"_{lib}"))
        return lib in self.mods

    def load_cuflash(self):
        """Imported once a device is known to be there; a failure fails the cuflash rows only."""
        try:
            import cuflash

            self.cuflash = cuflash
        except Exception as e:
            self.cuflash_error = _err(e)
            traceback.print_exc()

    def _try(self, name, fn):
        try:
            self.mods[name] = fn()
        except Exception as e:
            self.why_not[name] = _err(e)

    def _torch(self):
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("torch sees no CUDA device")
        torch.cuda.init()
        self.device_name = self.device_name or torch.cuda.get_device_name()
        return torch

    def _cupy(self):
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError("CuPy sees no CUDA device")
        if self.device_name is None:
            name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"]
            self.device_name = name.decode() if isinstance(name, bytes) else str(name)
        return cupy

    def _jax(self):
        # JAX takes 75 % of the GPU's memory at its first array unless told otherwise
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        import jax

        gpus = [d for d in jax.devices() if d.platform in ("gpu", "cuda")]
        if not gpus:
            raise RuntimeError(f"JAX has no GPU device (backend {jax.default_backend()})")
        self.jax_device = gpus[0]
        self.device_name = self.device_name or getattr(gpus[0], "device_kind", None)
        return jax

    def usable(self, lib) -> str | None:
        """None, or why rows of `lib` cannot run."""
        return None if self.ensure(lib) else self.why_not[lib]

    def any_device(self, need) -> bool:
        """Whether a library the selected rows need sees a GPU; stops at the first that does."""
        return any(self.ensure(lib) for lib in ("torch", "cupy", "jax") if lib in need)

    def device_sync(self):
        """cudaDeviceSynchronize through whichever library is loaded (cuflash itself loads CuPy)."""
        if "torch" in self.mods:
            self.mods["torch"].cuda.synchronize()
            return
        cupy = self.mods.get("cupy") or sys.modules.get("cupy")
        if cupy is not None:
            cupy.cuda.runtime.deviceSynchronize()


# ------------------------------------------------------------------------------------ calls

def plan_call(cf, q, k, v):
    """The explicit plan API, which may not exist yet: p = cuflash.plan(q, k, v, causal=True) once
    (timed, reported as plan setup), then p(q, k, v) per call."""
    if not hasattr(cf, "plan"):
        raise RuntimeError("cuflash has no plan() (the plan API is not in this checkout)")
    t0 = time.perf_counter()
    p = cf.plan(q, k, v, causal=True)
    extra = {"plan_setup_us": (time.perf_counter() - t0) * 1e6}
    return (lambda: p(q, k, v)), contextlib.nullcontext, extra


def _sdpa_backend(torch, prov):
    from torch.nn.attention import SDPBackend

    return {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}[prov]


class TorchCalls:
    """Inputs made once; `make(row)` returns (call, context manager entered around the round,
    extra fields for the row)."""

    def __init__(self, torch, libs, args):
        self.torch, self.cf, self.cuflash_error, self.args = torch, libs.cuflash, libs.cuflash_error, args
        b, s, h, d = args.batch, args.seqlen, args.heads, args.head_dim
        dt = getattr(torch, args.dtype)
        mk = lambda *shape: torch.randn(*shape, device=DEVICE, dtype=dt)  # noqa: E731
        self.plain = [mk(b, s, h, d) for _ in range(3)]
        self.grad = [mk(b, s, h, d).requires_grad_(True) for _ in range(3)]
        self.dout = mk(b, s, h, d)
        self.lengths = torch.full((b,), s, dtype=torch.int32, device=DEVICE)
        self.sinks = torch.randn(h, device=DEVICE, dtype=torch.float32)
        self.sinks_grad = self.sinks.clone().requires_grad_(True)
        # ALiBi's usual geometric slopes, 2^(-8 i / h)
        self.slopes = torch.tensor([2.0 ** (-8.0 * (i + 1) / h) for i in range(h)], device=DEVICE,
                                   dtype=torch.float32)
        self.cu_seqlens = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device=DEVICE)
        self.packed_plain = [x.reshape(b * s, h, d) for x in self.plain]
        self.packed_grad = [mk(b * s, h, d).requires_grad_(True) for _ in range(3)]

    def option_kwargs(self, opt, grad):
        w = (self.args.window, 0)
        return {"window": {"window": w},
                "lengths": {"q_lengths": self.lengths, "kv_lengths": self.lengths},
                "sink_logits": {"sink_logits": self.sinks_grad if grad else self.sinks},
                "alibi": {"alibi_slopes": self.slopes},
                "softcap": {"softcap": 30.0},
                "sink_tokens": {"window": w, "num_sink_tokens": 4}}[opt]

    def make(self, row):
        torch, cf, args = self.torch, self.cf, self.args
        prov, kind = row.id.split(".")[0], row.kind
        grad = kind in ("fwd_grad", "fwdbwd")
        q, k, v = self.grad if grad else self.plain
        dout = self.dout
        if prov in ("sdpa_flash", "sdpa_cudnn"):
            from torch.nn.attention import sdpa_kernel
            import torch.nn.functional as F

            sdpa = F.scaled_dot_product_attention
            qt, kt, vt, dt_ = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dout.transpose(1, 2)
            ctx = lambda: sdpa_kernel(_sdpa_backend(torch, prov))  # noqa: E731
            if kind == "fwdbwd":
                def call():
                    return torch.autograd.grad(sdpa(qt, kt, vt, is_causal=True), (q, k, v), dt_)
                return call, ctx, {}
            return (lambda: sdpa(qt, kt, vt, is_causal=True)), ctx, {}
        if cf is None:
            raise RuntimeError(f"cuflash did not import: {self.cuflash_error}")
        if row.id.startswith("torch.plan."):
            return plan_call(cf, q, k, v)
        if kind == "fwdbwd":
            kw = {"window": (args.window, 0)} if row.option == "window" else {}

            def call():
                return torch.autograd.grad(cf.attention(q, k, v, causal=True, **kw), (q, k, v), dout)
            return call, contextlib.nullcontext, {}
        if row.option == "varlen":
            qp, kp, vp = self.packed_grad if grad else self.packed_plain
            cu, s = self.cu_seqlens, args.seqlen
            return (lambda: cf.attention_varlen(qp, kp, vp, cu, cu, s, s, causal=True)), contextlib.nullcontext, {}
        kw = self.option_kwargs(row.option, grad) if row.option else {}
        return (lambda: cf.attention(q, k, v, causal=True, **kw)), contextlib.nullcontext, {}


class CupyCalls:
    def __init__(self, cupy, libs, args):
        import numpy as np

        self.cupy, self.cf, self.cuflash_error, self.args = cupy, libs.cuflash, libs.cuflash_error, args
        b, s, h, d = args.batch, args.seqlen, args.heads, args.head_dim
        if args.dtype == "bfloat16":
            import ml_dtypes

            npdt = np.dtype(ml_dtypes.bfloat16)
        else:
            npdt = np.dtype(np.float16)
        rng = np.random.default_rng(0)

        def mk():
            host = rng.standard_normal((b, s, h, d), dtype=np.float32).astype(npdt)
            try:
                return cupy.asarray(host)
            except Exception:   # a CuPy that cannot copy this dtype from the host: copy the bits
                dev = cupy.empty(host.shape, dtype=npdt)
                dev.view(cupy.uint16)[...] = cupy.asarray(host.view(np.uint16))
                return dev

        self.q, self.k, self.v, self.dout = (mk() for _ in range(4))

    def make(self, row):
        cf, q, k, v = self.cf, self.q, self.k, self.v
        if cf is None:
            raise RuntimeError(f"cuflash did not import: {self.cuflash_error}")
        if row.id == "cupy.plan.fwd":
            return plan_call(cf, q, k, v)
        if row.kind == "bwd":
            out, lse = cf.attention(q, k, v, causal=True, return_lse=True)
            dout = self.dout
            return (lambda: cf.attention_backward(dout, q, k, v, out, lse, causal=True)), contextlib.nullcontext, {}
        return (lambda: cf.attention(q, k, v, causal=True)), contextlib.nullcontext, {}


class JaxCalls:
    def __init__(self, jax, device, libs, args):
        import jax.numpy as jnp

        self.jax, self.jnp, self.cf, self.cuflash_error, self.args = jax, jnp, libs.cuflash, libs.cuflash_error, args
        b, s, h, d = args.batch, args.seqlen, args.heads, args.head_dim
        jdt = getattr(jnp, args.dtype)
        keys = jax.random.split(jax.random.PRNGKey(0), 4)
        self.q, self.k, self.v, self.dout = (
            jax.device_put(jax.random.normal(kk, (b, s, h, d), dtype=jnp.float32).astype(jdt), device) for kk in keys)
        jax.block_until_ready((self.q, self.k, self.v, self.dout))

    def make(self, row):
        jax, jnp, cf = self.jax, self.jnp, self.cf
        q, k, v, dout = self.q, self.k, self.v, self.dout
        if row.id == "jax_cudnn.fwd":
            dpa = jax.nn.dot_product_attention
            return (lambda: dpa(q, k, v, is_causal=True, implementation="cudnn")), contextlib.nullcontext, {}
        if cf is None:
            raise RuntimeError(f"cuflash did not import: {self.cuflash_error}")
        if row.kind == "fwdbwd":
            def loss(q_, k_, v_):
                return jnp.sum(cf.attention(q_, k_, v_, causal=True) * dout)
            g = jax.grad(loss, argnums=(0, 1, 2))
            return (lambda: g(q, k, v)), contextlib.nullcontext, {}
        return (lambda: cf.attention(q, k, v, causal=True)), contextlib.nullcontext, {}


def make_sync(libs, lib):
    """The end-of-round wait: the whole device (cuflash on JAX arrays runs on CuPy's stream, so
    JAX's own wait on its last array is not enough alone)."""
    if lib == "jax":
        jax = libs.mods["jax"]

        def sync(out):
            if out is not None:
                jax.block_until_ready(out)
            libs.device_sync()
        return sync
    return lambda out: libs.device_sync()


# ------------------------------------------------------------------------------------ run

def run_rows(rows, libs, args):
    """Prepares every row (inputs, warm-up, the calls per round), then times the rounds
    round-robin: round r of every row, then round r + 1 of every row. The host's speed drifts
    over a run (other processes, clocks); interleaving spreads that drift over all rows alike
    instead of onto the rows timed last, so the ratios between rows hold."""
    makers, maker_errors = {}, {}

    def maker(lib):
        if lib in makers or lib in maker_errors:
            return makers.get(lib)
        try:
            if lib == "torch":
                makers[lib] = TorchCalls(libs.mods["torch"], libs, args)
            elif lib == "cupy":
                makers[lib] = CupyCalls(libs.mods["cupy"], libs, args)
            else:
                makers[lib] = JaxCalls(libs.mods["jax"], libs.jax_device, libs, args)
        except Exception as e:
            maker_errors[lib] = f"inputs: {_err(e)}"
            traceback.print_exc()
        return makers.get(lib)

    t_start = time.perf_counter()
    live = []
    for i, row in enumerate(rows, 1):
        prepared = _prepare_row(i, row, rows, libs, args, maker, maker_errors)
        if prepared is not None:
            live.append(prepared)
    for r in range(args.rounds):
        for entry in list(live):
            i, row, call, ctx, sync, n = entry
            try:
                with ctx():
                    row.result.setdefault("rounds_us", []).append(one_round(call, sync, n))
            except Exception as e:
                row.result["error"] = _err(e)
                print(f"[{i}/{len(rows)}] {row.id:<26} ERROR in round {r + 1}: {row.result['error']}", flush=True)
                live.remove(entry)
    for i, row, call, ctx, sync, n in live:
        res = row.result
        rounds = res["rounds_us"]
        med, mn = statistics.median(rounds), min(rounds)
        res.update(us_median=med, us_min=mn, calls=n)
        print(f"[{i}/{len(rows)} {time.perf_counter() - t_start:4.0f}s] {row.id:<26}{med:9.1f} us/call "
              f"(min {mn:.1f}, {n} calls x {len(rounds)} rounds)  {row.desc}"
              + (f"; plan setup {res['plan_setup_us']:.0f} us" if "plan_setup_us" in res else ""), flush=True)
        if args.profile:
            try:   # a failure here leaves the row's figures standing
                with ctx():
                    text = profile_round(call, sync, n, args.profile_top)
                res["profile"] = text
                print(f"--- cProfile of {row.id}: {n} calls + one sync, top {args.profile_top} by tottime ---")
                print(text.rstrip())
                print(f"--- end of {row.id} ---", flush=True)
            except Exception as e:
                res["profile_error"] = _err(e)
                print(f"    (profile of {row.id} failed: {res['profile_error']})", flush=True)
    live.clear()


def _prepare_row(i, row, rows, libs, args, maker, maker_errors):
    """(i, row, call, ctx, sync, calls per round) after the warm-up, or None (skipped / error)."""
    res = row.result
    res.update(id=row.id, lib=row.lib, kind=row.kind, desc=row.desc)
    why = libs.usable(row.lib)
    if why is not None:
        res["skipped"] = why
        print(f"[{i}/{len(rows)}] {row.id:<26} skipped: {why}", flush=True)
        return None
    m = maker(row.lib)
    if m is None:
        res["error"] = maker_errors[row.lib]
        print(f"[{i}/{len(rows)}] {row.id:<26} ERROR {res['error']}", flush=True)
        return None
    sync = make_sync(libs, row.lib)
    try:
        call, ctx, extra = m.make(row)
        res.update(extra)
        with ctx():
            n = warm_up(call, sync, args)
        return (i, row, call, ctx, sync, n)
    except Exception as e:
        res["error"] = _err(e)
        print(f"[{i}/{len(rows)}] {row.id:<26} ERROR {res['error']}", flush=True)
        traceback.print_exc()   # on stderr: where a half-written API (plan) broke
        try:
            sync(None)
        except Exception:
            pass
        return None


# ------------------------------------------------------------------------------------ report

def _find(results, rid):
    return next((r for r in results if r.get("id") == rid), None)


def _ratio(results, rid, ref):
    a, b = _find(results, rid), _find(results, ref) if ref else None
    if a and b and a.get("us_median") and b.get("us_median"):
        return a["us_median"] / b["us_median"]
    return None


def add_ratios(results, rows):
    by_id = {r.id: r for r in rows}
    for res in results:
        row = by_id.get(res["id"])
        if row is None:
            continue
        res["sdpa_ref"], res["plain_ref"] = row.sdpa_ref, row.plain_ref
        res["x_sdpa_flash"] = _ratio(results, row.id, row.sdpa_ref)
        res["x_plain"] = _ratio(results, row.id, row.plain_ref)


def evaluate_targets(results):
    """[{target, row, ref, value, limit, unit, pass}]; pass is None where a figure is missing."""
    out = []

    def add(target, rid, ref, limit, unit="x"):
        r = _find(results, rid)
        if r is None:   # the row was not selected
            return
        if unit == "us":
            value = r.get("us_median")
        else:
            value = _ratio(results, rid, ref)
        missing = None
        if value is None:
            missing = rid if not r.get("us_median") else ref
        out.append({"target": target, "row": rid, "ref": ref, "value": value, "limit": limit, "unit": unit,
                    "pass": None if value is None else value <= limit, "missing": missing})

    for rid in ("torch.fwd", "torch.fwd_grad", "torch.plan.fwd", "torch.plan.fwd_grad"):
        kind = rid.rsplit(".", 1)[1]
        add(f"forward <= {FWD_LIMIT_VS_SDPA:.1f}x SDPA flash", rid, f"sdpa_flash.{kind}", FWD_LIMIT_VS_SDPA)
    for kind in ("fwd", "fwd_grad"):
        for opt in OPTIONS:
            add(f"forward with an option <= {OPTION_LIMIT_VS_PLAIN:.1f}x plain cuflash", f"torch.{kind}.{opt}",
                f"torch.{kind}", OPTION_LIMIT_VS_PLAIN)
    for rid in ("torch.fwdbwd", "torch.fwdbwd.window"):
        add(f"fwd+bwd <= {FWDBWD_LIMIT_VS_SDPA:.1f}x SDPA flash", rid, "sdpa_flash.fwdbwd", FWDBWD_LIMIT_VS_SDPA)
    for rid in ("cupy.fwd", "cupy.plan.fwd"):
        add(f"CuPy forward <= {CUPY_FWD_LIMIT_US:.0f} us", rid, None, CUPY_FWD_LIMIT_US, unit="us")
    return out


def _status(r) -> str:
    if r.get("us_median") is not None:
        return ""
    if r.get("skipped"):
        return "skipped"
    if r.get("error"):
        return "ERR"
    return "-"


def _fmt(x, spec, width):
    return f"{format(x, spec) if x is not None else '-':>{width}}"


def format_table(data) -> str:
    res = data["results"]
    meta = data["meta"]
    lines = [f"=== summary: host time per call, {meta.get('shape_text')} on {meta.get('device', '?')} ===",
             f"us/call = wall time of a round of back-to-back calls / calls, median (min) over "
             f"{meta['timing']['rounds']} rounds; x sdpa-fa = median / the matching SDPA flash row's "
             "(fwd, fwd_grad, fwdbwd); x plain = an option or plan row / the plain cuflash row, same grad setting"]
    hdr = f"{'row':<26}{'median us':>10}{'min us':>9}{'calls':>7}{'x sdpa-fa':>11}{'x plain':>9}  note"
    lines += [hdr, "-" * len(hdr)]
    for r in res:
        note = _status(r)
        if r.get("plan_setup_us") is not None:
            note = (note + " " if note else "") + f"plan setup {r['plan_setup_us']:.0f} us"
        lines.append(f"{r['id']:<26}{_fmt(r.get('us_median'), '.1f', 10)}{_fmt(r.get('us_min'), '.1f', 9)}"
                     f"{_fmt(r.get('calls'), 'd', 7)}{_fmt(r.get('x_sdpa_flash'), '.2f', 11)}"
                     f"{_fmt(r.get('x_plain'), '.2f', 9)}  {note}")
    return "\n".join(lines)


def format_targets(data) -> str:
    t = data.get("targets") or []
    lines = ["targets (a report, not a test):"]
    if not t:
        lines.append("  none evaluated (no selected row has a target)")
        return "\n".join(lines)
    res = data["results"]
    w_target = max(len(x["target"]) for x in t)
    for x in t:
        if x["pass"] is None:
            miss = _find(res, x["missing"]) or {}
            verdict, val = "n/a ", f"no figure for {x['missing']} ({_status(miss) if miss else 'not run'})"
        else:
            verdict = "PASS" if x["pass"] else "FAIL"
            val = (f"{x['value']:.1f} us (limit {x['limit']:.0f} us)" if x["unit"] == "us"
                   else f"{x['value']:.2f}x {x['ref']} (limit {x['limit']:.1f}x)")
        lines.append(f"  {verdict}  {x['target']:<{w_target}}  {x['row']:<26} {val}")
    n_pass = sum(1 for x in t if x["pass"] is True)
    n_fail = sum(1 for x in t if x["pass"] is False)
    n_na = sum(1 for x in t if x["pass"] is None)
    lines.append(f"  {n_pass} PASS, {n_fail} FAIL, {n_na} n/a")
    return "\n".join(lines)


def format_markdown(data) -> str:
    meta = data["meta"]
    lines = [f"Host time per call, {meta.get('shape_text')}, {meta.get('device', '?')} "
             f"({meta.get('cpu', '?')}), torch {meta['versions'].get('torch')}, "
             f"`bench/bench_host.py`, median of {meta['timing']['rounds']} rounds:", "",
             "| row | call | µs / call | min | × SDPA flash | × plain |", "| --- | --- | --- | --- | --- | --- |"]
    for r in data["results"]:
        med = f"{r['us_median']:.1f}" if r.get("us_median") is not None else _status(r)
        mn = f"{r['us_min']:.1f}" if r.get("us_min") is not None else ""
        xs = f"{r['x_sdpa_flash']:.2f}" if r.get("x_sdpa_flash") is not None else ""
        xp = f"{r['x_plain']:.2f}" if r.get("x_plain") is not None else ""
        lines.append(f"| `{r['id']}` | {r['desc']} | {med} | {mn} | {xs} | {xp} |")
    return "\n".join(lines)


def format_errors(data) -> str:
    lines = []
    for r in data["results"]:
        if r.get("error"):
            lines.append(f"  {r['id']}: {r['error']}")
    return ("=== errors ===\n" + "\n".join(lines)) if lines else ""


# ------------------------------------------------------------------------------------ metadata

def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(mod_name):
    try:
        mod = __import__(mod_name, fromlist=["__version__"])
        return getattr(mod, "__version__", "?")
    except Exception:
        return None


def lib_versions(libs):
    versions = {"python": platform.python_version()}
    for name in ("numpy", "torch", "cupy", "jax", "jaxlib", "ml_dtypes", "cuda.bindings"):
        if name in ("jax", "jaxlib") and "jax" not in libs.mods:
            continue   # importing JAX only to read its version would start it
        versions[name] = _version(name)
    if libs.cuflash is not None:
        versions["cuflash"] = getattr(libs.cuflash, "__version__", None)
    return versions


def collect_meta(libs, args):
    versions = lib_versions(libs)
    meta = {"timestamp_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "argv": sys.argv[1:], "versions": versions, "cpu": _cpu_model(), "cpu_count": os.cpu_count(),
            "device": libs.device_name,
            "cuflash_path": os.path.dirname(os.path.abspath(libs.cuflash.__file__)) if libs.cuflash else None,
            "cuflash_import_error": libs.cuflash_error,
            "shape": {"dtype": args.dtype, "batch": args.batch, "seqlen": args.seqlen, "heads": args.heads,
                      "head_dim": args.head_dim, "window": args.window},
            "shape_text": (f"{args.dtype}, batch {args.batch}, seqlen {args.seqlen}, {args.heads} heads, "
                           f"head_dim {args.head_dim}"),
            "timing": {"warmup": args.warmup, "calls": args.calls, "rounds": args.rounds,
                       "max_round_s": args.max_round_s,
                       "statistic": "us per call = round wall time / calls (back-to-back calls, one device "
                                    "synchronize at the end); median and min over rounds"},
            "libraries_unusable": dict(libs.why_not)}
    if "torch" in libs.mods:
        torch = libs.mods["torch"]
        meta["torch_cuda"] = torch.version.cuda
        try:
            meta["capability"] = list(torch.cuda.get_device_capability())
        except Exception as e:
            meta["capability"] = _err(e)
    meta["nvidia_smi"] = nvidia_smi_info()  # (None where nvidia-smi fails)
    if "cupy" in libs.mods:
        try:
            meta["cuda_driver_version"] = libs.mods["cupy"].cuda.runtime.driverGetVersion()
        except Exception as e:
            meta["cuda_driver_version"] = _err(e)
    return meta


# ------------------------------------------------------------------------------------ main

def main(argv=None) -> int:
    args = parse_args(argv)
    rows = select_rows(build_rows(args.window), args.rows)
    if args.list:
        for r in rows:
            print(f"{r.id:<26} [{r.lib}] {r.desc}")
        return 0
    if not rows:
        print(f"bench_host.py: no row matches {args.rows} (--list shows them)", file=sys.stderr)
        return 1
    if args.window >= args.seqlen:
        print(f"note: --window {args.window} >= --seqlen {args.seqlen}: the window rows reduce to plain causal "
              "attention", file=sys.stderr)

    libs = Libs()
    if not libs.any_device({r.lib for r in rows}):
        print("bench_host.py: no CUDA device (" + "; ".join(f"{k}: {v}" for k, v in libs.why_not.items()) + ")",
              file=sys.stderr)
        return 2
    libs.load_cuflash()
    meta = collect_meta(libs, args)
    print(f"bench_host.py: {len(rows)} rows, {meta['shape_text']}, on {meta.get('device')} / {meta['cpu']}; "
          f"{args.warmup} warm-up calls, {args.rounds} rounds of up to {args.calls} calls", flush=True)
    for lib, why in libs.why_not.items():
        print(f"  ({lib} rows skipped: {why})")

    try:
        run_rows(rows, libs, args)
    finally:
        results = [r.result for r in rows if r.result]
        add_ratios(results, rows)
        # libraries are imported at their first row: their versions and failures are known only now
        meta.update(versions=lib_versions(libs), device=libs.device_name, libraries_unusable=dict(libs.why_not))
        meta["wall_s"] = time.perf_counter() - T_START
        data = {"meta": meta, "results": results, "targets": evaluate_targets(results)}
        write_json(args.json, data)

    print()
    err = format_errors(data)
    if err:
        print(err)
        print()
    if args.markdown:
        print(format_markdown(data))
        print()
    print(format_table(data))
    print(format_targets(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
