#!/usr/bin/env python3
"""GPT-2 end to end: training-step and inference-forward time, peak memory and the loss curve with
each attention implementation (cuflash, torch SDPA's backends, the naive attention).

The model is GPT-2 written here in plain PyTorch (no HuggingFace): learned token and position
embeddings, pre-LayerNorm blocks (causal self-attention, then a 4x MLP with tanh GELU), a final
LayerNorm and an output projection tied to the token embedding; vocabulary 50257 padded to 50304
(a multiple of 128, for the tensor cores); no dropout; GPT-2's initialization (normal, std 0.02,
biases 0; the two residual projections of each block std 0.02 / sqrt(2 * n_layer)).
  124M   12 layers, 12 heads, hidden 768    default seqlen 1024, batch 8
  355M   24 layers, 16 heads, hidden 1024   default seqlen 4096, batch 2
  tiny    2 layers,  2 heads, hidden 64     vocabulary 1024; the CPU smoke's (seqlen 32, batch 2)
head_dim is 64 in both GPT-2 sizes. Position embeddings cover max(1024, seqlen) positions (GPT-2's
1024, more at seqlen 4096).

Attention implementations (--impls). c_attn makes qkv (B, T, 3C) and each gets it as:
  cuflash         cuflash.attention(q, k, v, causal=True) on zero-copy (B, T, H, D) views of qkv;
                  its output (B, T, H, D) is already the (B, T, C) layout c_proj reads
  sdpa_flash      F.scaled_dot_product_attention(q, k, v, is_causal=True) on the (B, H, T, D)
  sdpa_cudnn      transposes of the same views, forced to one backend by
  sdpa_efficient  torch.nn.attention.sdpa_kernel(SDPBackend...) around the whole cell
  sdpa_math       (not in the default set: the CPU smoke's second reference)
  naive           as HuggingFace's GPT-2: S = Q K^T * scale, masked_fill with a causal mask built
                  once, softmax in float32 (--naive-softmax input: in bf16), P V; every layer keeps
                  its (B, H, T, T) probabilities for the backward
The sdpa_* and naive outputs are transposed back to (B, T, C) (a copy where the layout needs one).

Per cell (model, seqlen, batch, mode, impl): a fresh model loaded with the same initial weights
(made once per model on the CPU from --seed), a fresh AdamW (fused=True where available; lr 6e-4,
reached linearly over --lr-warmup steps and then constant; betas 0.9/0.95; weight decay 0.1 on the
matrices and embeddings; gradient-norm clip 1.0), the same batches, torch.autocast(bfloat16).
  train  --steps training steps: forward with the loss, backward, clip, AdamW step,
         zero_grad(set_to_none=True). The first --warmup steps are untimed (the first compiles);
         each later step sits between two CUDA events and the host never waits for the device in
         between (losses are read at the end), so a step's time includes any time the GPU waits
         for the host. ms/step = median; tokens/s = batch * seqlen / median; peak = torch.cuda.
         max_memory_allocated over the timed steps (weights, gradients, AdamW state, activations).
  infer  the forward to logits under torch.inference_mode(): --infer-warmup untimed calls, then
         the median of --infer-reps CUDA-event-timed calls, and its own peak.
Modes (--modes): eager, and compile = torch.compile(fullgraph=True, dynamic=False) of each
transformer block (--compile-scope blocks, the default: the blocks are alike, so the first one's
compiled code serves all, and a cell compiles in seconds, not minutes) or of the whole model
(--compile-scope model). Compile time is the first step's (first call's) wall time minus the
median: reported on its own, never in ms/step. torch._dynamo.reset() before each compiled cell;
inductor's on-disk caches (FX graphs, Triton kernels) stay, so a second run on the same machine,
or a cell whose kernels an earlier cell already built, compiles faster. cuflash's kernels are
built (cuflash.precompile) before the first cell of each process that runs cuflash.

Processes (--isolate): by default every cell runs in a process of its own (`cell`): the script
starts itself again with sys.executable for that one cell and reads the cell's record back as
JSON. Cells that share a process do not measure alike: measured on an H100, GPT-2 124M compiled
training read 41.5 ms/step after the eager cells of the same process against 26.3 ms in a process
that ran compiled cells only (bench/NOTES.md). `mode` runs one process per (model, seqlen, batch,
mode), `none` everything in this process (the CPU smoke's default). The initial weights are made
once, here, and handed to the processes in a temporary file, so every cell starts from the same
bytes. A process costs its start-up (imports, CUDA context, cuflash's kernels from the disk cache,
and for compile cells the compiler's warm-up): recorded per cell under "process", outside the
cell's wall_s and its timings.

Loss curve: every step's loss, from the shared initial weights. Within each (model, seqlen,
batch, mode), max |loss - loss of sdpa_flash| over the steps. Its noise scale is the same figure
for sdpa_cudnn (else the next of sdpa_efficient, sdpa_math, naive that ran): two correct
implementations that differ only in bf16 rounding. cuflash is flagged when its difference exceeds
3 x noise + 0.02.

Data: a fixed random Markov chain over 512 of GPT-2's token ids (each id followed by one of 4
successors with probabilities 0.6, 0.25, 0.1, 0.05: about 1.0 nat per token), made once on the
CPU from --seed; every cell sees the same batches. The loss falls from ln(50304) = 10.8 as the
model learns which ids occur, then which follows which.

A failure (a backend that does not run here, out of memory, a compile error) is recorded for its
cell and phase, and the run goes on. --budget-s (default 520 s, --quick 140 s) skips the cells
predicted to end past it; they are listed as skipped, and --models / --modes / --impls / --phases
run a subset, so a full run can be split over calls and merged with --summarize.

Output: a progress line per cell; compile times and the loss curves; then, last, the summary
table (model, seqlen, batch, mode, impl, ms/step, tokens/s, peak GiB, infer ms, max|dloss| vs
sdpa_flash), the ratios cuflash / sdpa_flash, cuflash / sdpa_cudnn and naive / cuflash, and the
loss agreement. --json keeps every figure (each step's time and loss), the versions and the
config; --plot draws ms/step bars and the loss curves. Exit status: 0; 1 if a cuflash cell failed
or its loss curve was flagged; 2 without a CUDA device (except --cpu-smoke, --summarize, --dry-run).

Examples:
    python bench/gpt2.py --dry-run                    # the cells and a rough H100 time, no GPU
    python bench/gpt2.py --quick                      # about 2 minutes on an H100, a process per cell
    python bench/gpt2.py --json out/gpt2.json --plot out/gpt2.png       # < 9 minutes
    python bench/gpt2.py --models 355M --modes compile --json out/355m_compile.json   # a subset
    python bench/gpt2.py --summarize out/a.json out/b.json --plot out/gpt2.png        # merge, no GPU
    python bench/gpt2.py --cpu-smoke                  # tiny model on the CPU, cuflash's NumPy path
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
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

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if HERE not in sys.path:
    sys.path.insert(0, HERE)
if os.path.isdir(os.path.join(ROOT, "cuflash")) and ROOT not in sys.path:
    sys.path.insert(0, ROOT)   # benchmark the checkout this script belongs to

from bench_forward import nvidia_smi_info, write_json  # noqa: E402

T_START = time.perf_counter()

VOCAB = 50257
VOCAB_PADDED = 50304   # next multiple of 128: the output projection's N runs in whole tensor-core tiles
MODELS = {   # vocab: (token ids the data uses, rows of the embedding)
    "124M": {"n_layer": 12, "n_head": 12, "n_embd": 768, "seqlen": 1024, "batch": 8, "vocab": (VOCAB, VOCAB_PADDED)},
    "355M": {"n_layer": 24, "n_head": 16, "n_embd": 1024, "seqlen": 4096, "batch": 2, "vocab": (VOCAB, VOCAB_PADDED)},
    # the CPU smoke's: a small vocabulary, or the CPU spends the smoke's time in the output projection
    "tiny": {"n_layer": 2, "n_head": 2, "n_embd": 64, "seqlen": 32, "batch": 2, "vocab": (1000, 1024)},
}
IMPLS = ("cuflash", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "sdpa_math", "naive")
DEFAULT_IMPLS = ("cuflash", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "naive")
MODES = ("eager", "compile")
PHASES = ("train", "infer")
REFERENCE_ORDER = ("sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "sdpa_math", "naive")
FLAG_NOISE_FACTOR, FLAG_SLACK = 3.0, 0.02

# Presets; an explicit flag wins over them.
FULL = {"models": ["124M", "355M"], "impls": list(DEFAULT_IMPLS), "modes": list(MODES), "steps": 40, "warmup": 5,
        "infer_warmup": 3, "infer_reps": 20, "lr": 6e-4, "lr_warmup": 10, "budget_s": 520.0, "isolate": "cell"}
QUICK = {"models": ["124M"], "impls": ["cuflash", "sdpa_flash", "sdpa_cudnn", "naive"], "modes": list(MODES),
         "steps": 20, "warmup": 3, "infer_warmup": 10, "infer_reps": 20, "lr": 6e-4, "lr_warmup": 5,
         "budget_s": 140.0, "isolate": "cell"}
# The CPU smoke: cuflash's NumPy path on torch CPU tensors. A larger lr than GPT-2's, so that 16
# steps of 64 tokens move the loss well past the implementations' differences. sdpa_cudnn has no
# CPU kernel: it is there to show that a failing implementation is recorded and the run goes on.
SMOKE = {"models": ["tiny"], "impls": ["cuflash", "sdpa_flash", "sdpa_math", "sdpa_cudnn", "naive"],
         "modes": ["eager"], "steps": 16, "warmup": 2, "infer_warmup": 1, "infer_reps": 3, "lr": 3e-3,
         "lr_warmup": 2, "budget_s": 0.0, "isolate": "none"}
ISOLATION = ("cell", "mode", "none")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--quick", action="store_true",
                   help="about 2 minutes on an H100: 124M only, impls cuflash sdpa_flash sdpa_cudnn naive, eager and "
                        "compile, 20 steps (3 untimed), 10 inference calls, a process per cell")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="no GPU needed: the tiny model on the CPU in bf16 autocast (cuflash runs its NumPy path); "
                        "checks that cuflash's loss curve agrees with SDPA's and the naive one's")
    p.add_argument("--models", nargs="+", choices=list(MODELS), help="default: 124M 355M")
    p.add_argument("--seqlen", type=int, nargs="+", metavar="T",
                   help="sequence lengths, each run with every model (default: the model's own). Without --batch "
                        "the batch keeps the model's default tokens per step")
    p.add_argument("--batch", type=int, metavar="B", help="batch size for every configuration")
    p.add_argument("--modes", nargs="+", choices=MODES, help="default: eager compile")
    p.add_argument("--impls", nargs="+", choices=IMPLS,
                   help=f"default: {' '.join(DEFAULT_IMPLS)} (sdpa_flash is the loss reference)")
    p.add_argument("--phases", nargs="+", choices=PHASES, default=list(PHASES),
                   help="train (steps, loss curve) and/or infer (forward only); default both")
    p.add_argument("--steps", type=int, help="training steps per cell, the loss curve's length (default 40)")
    p.add_argument("--warmup", type=int, help="untimed training steps first, the compiling one included (default 5)")
    p.add_argument("--infer-warmup", type=int, help="untimed inference calls first (default 3)")
    p.add_argument("--infer-reps", type=int, help="timed inference calls (default 20)")
    p.add_argument("--compile-scope", choices=["blocks", "model"], default="blocks",
                   help="compile mode: torch.compile each transformer block (default) or the whole model")
    p.add_argument("--naive-softmax", choices=["fp32", "input"], default="fp32",
                   help="the naive attention's softmax: in float32 (default, as autocast would) or in bf16")
    p.add_argument("--lr", type=float, help="peak learning rate (default 6e-4)")
    p.add_argument("--lr-warmup", type=int, help="linear lr warm-up steps (default 10)")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0, help="gradient-norm clip, 0 = off (default 1.0)")
    p.add_argument("--seed", type=int, default=1337, help="initial weights and data (default 1337)")
    p.add_argument("--budget-s", type=float,
                   help="skip cells predicted to end past this many seconds from the start (default 520, for a "
                        "600 s device call; --quick: 140; 0 = no limit)")
    p.add_argument("--json", metavar="PATH", help="write every figure here (rewritten after each cell)")
    p.add_argument("--plot", metavar="PATH.png", help="draw ms/step bars and the loss curves here (matplotlib)")
    p.add_argument("--summarize", nargs="+", metavar="PATH",
                   help="print the report of earlier --json files (merged) and exit; with --plot, redraw")
    p.add_argument("--dry-run", action="store_true", help="list the cells and a rough H100 time; no GPU needed")
    p.add_argument("--isolate", choices=ISOLATION,
                   help="cell: a process per cell (default); mode: a process per (model, seqlen, batch, mode); "
                        "none: every cell in this process (the default of --cpu-smoke)")
    p.add_argument("--child", metavar="SPEC.json", help=argparse.SUPPRESS)   # internal: run the cells of SPEC
    args = p.parse_args(argv)
    if args.child:
        return args

    preset = SMOKE if args.cpu_smoke else QUICK if args.quick else FULL
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, list(value) if isinstance(value, list) else value)
    args.impls = [x for x in IMPLS if x in args.impls]
    args.modes = [x for x in MODES if x in args.modes]
    args.phases = [x for x in PHASES if x in args.phases]
    if args.steps < 2 or not 1 <= args.warmup < args.steps:
        p.error("need --steps >= 2 and 1 <= --warmup < --steps (the untimed steps come out of --steps)")
    if args.infer_warmup < 1 or args.infer_reps < 1:
        p.error("--infer-warmup and --infer-reps must be at least 1")
    if args.seqlen and min(args.seqlen) < 1 or args.batch is not None and args.batch < 1:
        p.error("--seqlen and --batch must be positive")
    return args


# ------------------------------------------------------------------------------------------ model

@dataclasses.dataclass(frozen=True)
class GPTConfig:
    n_layer: int
    n_head: int
    n_embd: int
    block_size: int = 1024   # learned positions
    vocab_size: int = VOCAB_PADDED


class SelfAttention(nn.Module):
    """c_attn -> attend(qkv, n_head) -> c_proj; `attend` is the implementation under test."""

    def __init__(self, cfg: GPTConfig, attend):
        super().__init__()
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.attend = attend

    def forward(self, x):                                       # (B, T, C)
        return self.c_proj(self.attend(self.c_attn(x), self.n_head))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))   # GPT-2's GELU


class Block(nn.Module):
    """Pre-LayerNorm: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig, attend):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = SelfAttention(cfg, attend)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig, attend):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg, attend) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self):
        self.lm_head.weight = self.wte.weight

    @torch.no_grad()
    def init_weights(self):
        """GPT-2's: normal(0, 0.02) for every matrix and embedding, zero biases, and std
        0.02 / sqrt(2 * n_layer) for the projections that write into the residual stream (two per
        block), so that its variance does not grow with depth."""
        std = 0.02
        for name, m in self.named_modules():
            if isinstance(m, nn.Linear):
                resid = name.endswith("c_proj")
                nn.init.normal_(m.weight, 0.0, std / math.sqrt(2 * self.cfg.n_layer) if resid else std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Embedding):   # lm_head shares wte's weight: same init either way
                nn.init.normal_(m.weight, 0.0, std)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, idx, targets=None):
        """idx (B, T) int64 -> logits (B, T, vocab), or the mean cross-entropy against targets."""
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        # float32 softmax over 50304 logits, as autocast would pick, stated so the CPU run matches
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def model_config(name, seqlen) -> GPTConfig:
    m = MODELS[name]
    return GPTConfig(m["n_layer"], m["n_head"], m["n_embd"], block_size=max(1024, seqlen), vocab_size=m["vocab"][1])


def build_model(cfg: GPTConfig, attend, device, state=None) -> GPT:
    """The model on `device` with `state`'s weights (or GPT-2's initialization from the current
    RNG). Built on the meta device first, so no default initialization is computed and then thrown
    away (seconds for 355M on the CPU)."""
    with torch.device("meta"):
        model = GPT(cfg, attend)
    model.to_empty(device=device)
    model.tie_weights()   # to_empty gives lm_head a tensor of its own
    if state is None:
        model.init_weights()
    else:
        model.load_state_dict(state)
    return model


def count_params(cfg: GPTConfig) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in GPT(cfg, None).parameters())   # the tied matrix counted once


# ------------------------------------------------------------------------------------------ attention
# Each takes qkv (B, T, 3C) from c_attn and returns (B, T, C) for c_proj.

def split_heads(qkv, n_head):
    """q, k, v as (B, T, H, D) views of qkv (B, T, 3C): no copy, strides (T*3C, 3C, D, 1)."""
    b, t, c3 = qkv.shape
    return qkv.view(b, t, 3, n_head, c3 // (3 * n_head)).unbind(2)


def make_attention(impl, seqlen, device, naive_softmax):
    """(attend, context manager to hold around the whole cell)."""
    if impl == "cuflash":
        import cuflash

        def attend(qkv, n_head):
            q, k, v = split_heads(qkv, n_head)
            return cuflash.attention(q, k, v, causal=True).flatten(2)   # (B, T, H, D) -> (B, T, C), a view
        return attend, contextlib.nullcontext()

    if impl.startswith("sdpa_"):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
                   "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION, "sdpa_math": SDPBackend.MATH}[impl]

        def attend(qkv, n_head):
            q, k, v = (x.transpose(1, 2) for x in split_heads(qkv, n_head))   # (B, H, T, D) views
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return y.transpose(1, 2).flatten(2)
        # Held around the cell, not inside attend: torch.compile then traces the one backend that
        # is allowed, and a backend that cannot run raises instead of falling back to another.
        return attend, sdpa_kernel(backend)

    if impl == "naive":
        masked = torch.ones(seqlen, seqlen, dtype=torch.bool, device=device).triu(1)   # (T, T), True = future key
        softmax_dtype = torch.float32 if naive_softmax == "fp32" else None

        def attend(qkv, n_head):
            q, k, v = (x.transpose(1, 2) for x in split_heads(qkv, n_head))   # (B, H, T, D)
            t = q.shape[2]
            s = torch.matmul(q, k.transpose(-2, -1)) * (q.shape[-1] ** -0.5)  # (B, H, T, T)
            s = s.masked_fill(masked[:t, :t], float("-inf"))                 # the diagonal is kept: no -inf row
            # An explicit dtype: autocast leaves it alone (without one, softmax runs in float32)
            p = torch.softmax(s, dim=-1, dtype=softmax_dtype or s.dtype).to(v.dtype)
            return torch.matmul(p, v).transpose(1, 2).flatten(2)
        return attend, contextlib.nullcontext()
    raise ValueError(impl)


# ------------------------------------------------------------------------------------------ data

MARKOV_STATES, MARKOV_PROBS = 512, (0.6, 0.25, 0.1, 0.05)


def make_data(steps, batch, seqlen, vocab, seed):
    """(inputs, targets), each (steps, batch, seqlen) int64 on the CPU: token sequences of a fixed
    random Markov chain over ids below `vocab`, one batch per step. Low entropy (about 1.0 nat per
    token after the first) and a small alphabet, so that tens of steps move the loss a long way."""
    rng = np.random.default_rng(seed)
    token_of = rng.choice(vocab, MARKOV_STATES, replace=False)             # which ids the chain uses
    successors = rng.integers(0, MARKOV_STATES, size=(MARKOV_STATES, len(MARKOV_PROBS)))
    rows = steps * batch
    pick = rng.choice(len(MARKOV_PROBS), size=(rows, seqlen), p=MARKOV_PROBS)   # which successor, per step
    states = np.empty((rows, seqlen + 1), dtype=np.int64)
    states[:, 0] = rng.integers(0, MARKOV_STATES, rows)
    for t in range(seqlen):                                                # all rows at once
        states[:, t + 1] = successors[states[:, t], pick[:, t]]
    tokens = torch.from_numpy(token_of[states]).view(steps, batch, seqlen + 1)
    return tokens[..., :-1].contiguous(), tokens[..., 1:].contiguous()


def data_key(cell):
    """What a cell's batches depend on: (batch, seqlen, vocab); the same for every impl and mode."""
    return cell["batch"], cell["seqlen"], MODELS[cell["model"]]["vocab"][0]


def lr_at(step, args) -> float:
    return args.lr * min(1.0, (step + 1) / max(1, args.lr_warmup))


# ------------------------------------------------------------------------------------------ measuring

class Device:
    """The few things that differ between the GPU run and the CPU smoke."""

    def __init__(self, kind):
        self.type = kind
        self.cuda = kind == "cuda"

    def autocast(self):
        return torch.autocast(self.type, dtype=torch.bfloat16)

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def reset_peak(self):
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()

    def peak_gib(self):
        return torch.cuda.max_memory_allocated() / 2**30 if self.cuda else None

    def peak_requested_gib(self):
        """The peak of the bytes tensors asked for: max_memory_allocated counts whole allocator blocks,
        which the caching allocator may hand out up to 1 MiB larger than asked (it does not split off
        a remainder below that), so two runs of equal tensors can differ there by allocation order."""
        if not self.cuda:
            return None
        return torch.cuda.memory_stats().get("requested_bytes.all.peak", 0) / 2**30

    def free(self):
        gc.collect()   # an exception's traceback may have held the tensors until just now
        if self.cuda:
            torch.cuda.empty_cache()

    def time_calls(self, fn, indices):
        """ms of each fn(i): CUDA events around each call, read once all are queued; the host clock
        on the CPU."""
        if not self.cuda:
            out = []
            for i in indices:
                t0 = time.perf_counter()
                fn(i)
                out.append((time.perf_counter() - t0) * 1e3)
            return out
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in indices]
        for (start, end), i in zip(events, indices):
            start.record()
            fn(i)
            end.record()
        torch.cuda.synchronize()
        return [start.elapsed_time(end) for start, end in events]


def make_optimizer(model, args):
    """AdamW as GPT-2 / nanoGPT train: decay on matrices and embeddings only. (optimizer, fused)."""
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": args.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    kw = {"lr": args.lr, "betas": (0.9, 0.95), "eps": 1e-8}
    try:
        return torch.optim.AdamW(groups, fused=True, **kw), True
    except (RuntimeError, TypeError, ValueError):   # no fused kernel for this device or dtype
        return torch.optim.AdamW(groups, **kw), False


def run_train(model, forward, data, args, dev):
    inputs, targets = data
    opt, fused = make_optimizer(model, args)
    params = list(model.parameters())
    losses = []

    def step(i):
        for group in opt.param_groups:
            group["lr"] = lr_at(i, args)
        with dev.autocast():
            loss = forward(inputs[i], targets[i])
        loss.backward()
        if args.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, args.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())   # not .item(): that would make the host wait every step

    t0 = time.perf_counter()
    step(0)
    dev.sync()
    first_s = time.perf_counter() - t0
    for i in range(1, args.warmup):
        step(i)
    dev.sync()
    dev.reset_peak()
    times = dev.time_calls(step, range(args.warmup, args.steps))
    peak, peak_req = dev.peak_gib(), dev.peak_requested_gib()
    loss_values = torch.stack(losses).float().cpu().tolist()
    med = statistics.median(times)
    tokens = inputs.shape[1] * inputs.shape[2]
    return {"ms": med, "ms_min": min(times), "ms_mean": statistics.fmean(times), "step_ms": times,
            "timed_steps": len(times), "tokens_per_s": tokens / (med / 1e3), "peak_gib": peak,
            "peak_requested_gib": peak_req,
            "first_step_s": first_s, "compile_s": max(0.0, first_s - med / 1e3), "losses": loss_values,
            "finite": all(math.isfinite(x) for x in loss_values), "fused_adamw": fused}


def run_infer(forward, inputs, args, dev):
    x = inputs[0]
    with torch.inference_mode(), dev.autocast():
        t0 = time.perf_counter()
        forward(x)
        dev.sync()
        first_s = time.perf_counter() - t0
        for _ in range(args.infer_warmup - 1):
            forward(x)
        dev.sync()
        dev.reset_peak()
        times = dev.time_calls(lambda i: forward(x), range(args.infer_reps))
        peak, peak_req = dev.peak_gib(), dev.peak_requested_gib()
    med = statistics.median(times)
    return {"ms": med, "ms_min": min(times), "call_ms": times, "reps": len(times),
            "tokens_per_s": x.numel() / (med / 1e3), "peak_gib": peak, "peak_requested_gib": peak_req, "first_call_s": first_s,
            "compile_s": max(0.0, first_s - med / 1e3)}


def _err(e) -> str:
    msg = str(e).strip()
    return f"{type(e).__name__}: {msg.splitlines()[0][:300] if msg else ''}"


def _is_oom(e) -> bool:
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()


def guarded(fn, dev):
    """fn()'s result, or {"error": ...}: one phase of one cell failing never stops the run."""
    try:
        return fn()
    except Exception as e:
        out = {"error": _err(e), "oom": _is_oom(e)}
        if not out["oom"]:
            out["traceback"] = traceback.format_exc()[-3000:]
    dev.free()   # after the except block: the traceback, and the tensors its frames held, are gone
    return out


def compile_model(model, scope):
    """The callable to train and run: the model with each block compiled, or the whole model."""
    if scope == "model":
        return torch.compile(model, fullgraph=True, dynamic=False)
    for block in model.blocks:
        block.compile(fullgraph=True, dynamic=False)   # in place; alike blocks share one compiled graph
    return model


def run_cell(cell, args, dev, init_states, datasets):
    """One (model, seqlen, batch, mode, impl): build, optionally compile, train, infer."""
    rec = dict(cell)
    compiled = cell["mode"] == "compile"
    if compiled:
        rec["compile_scope"] = args.compile_scope
        torch._dynamo.reset()   # every compiled cell pays its own compile, and no cache limit is reached
    model = forward = None
    t0 = time.perf_counter()
    try:
        cfg = model_config(cell["model"], cell["seqlen"])
        attend, context = make_attention(cell["impl"], cell["seqlen"], dev.type, args.naive_softmax)
        data = tuple(x.to(dev.type) for x in datasets[data_key(cell)])
        with context:
            model = build_model(cfg, attend, dev.type, init_states[(cell["model"], cfg.block_size)])
            forward = compile_model(model, args.compile_scope) if compiled else model
            if "train" in args.phases:
                rec["train"] = guarded(lambda: run_train(model, forward, data, args, dev), dev)
                model.zero_grad(set_to_none=True)   # a failed step may have left gradients
                dev.free()
            if "infer" in args.phases:
                rec["infer"] = guarded(lambda: run_infer(forward, data[0], args, dev), dev)
    except Exception as e:   # the cell could not even start (e.g. cuflash did not import)
        rec["error"] = _err(e)
        rec["traceback"] = traceback.format_exc()[-3000:]
    finally:
        model = forward = None   # the last references: the cell's memory goes back before the next
        if compiled:
            torch._dynamo.reset()
        dev.free()
    rec["wall_s"] = time.perf_counter() - t0
    return rec


def warm_up_compiler(dev):
    """Compile one small function first, so that the first compiled cell does not also pay for
    importing inductor and starting its compile workers."""
    t0 = time.perf_counter()
    fn = torch.compile(lambda x: F.gelu(x, approximate="tanh") * 2.0, dynamic=False)
    fn(torch.randn(64, device=dev.type))
    dev.sync()
    torch._dynamo.reset()
    return {"wall_s": time.perf_counter() - t0}


# ------------------------------------------------------------------------------------------ cells, estimate

def build_cells(args):
    cells = []
    for name in args.models:
        m = MODELS[name]
        for seqlen in args.seqlen or [m["seqlen"]]:
            if args.batch:
                batch = args.batch
            elif seqlen == m["seqlen"]:
                batch = m["batch"]
            else:   # keep the model's default tokens per step
                batch = max(1, m["batch"] * m["seqlen"] // seqlen)
            for mode in args.modes:
                for impl in args.impls:
                    cells.append({"model": name, "seqlen": seqlen, "batch": batch, "mode": mode, "impl": impl})
    return cells


# Assumed H100 rates, only for --dry-run and the budget guard's first guess (which it rescales by
# what it measures): dense TFLOP/s reached by a whole step, HBM bytes/s for the naive attention's
# score matrices, and compile seconds (train, infer) per cell.
EST_TFLOPS = {"eager": 250.0, "compile": 330.0}
EST_HBM = 3.0e12
# Block scope: the H100 runs of bench/results/gpt2_*.json measured 0.1 to 6.5 s (train, 3 s typical) and 0.2 to
# 3.6 s (infer, 1 s typical) per cell.
EST_COMPILE_S = {"blocks": (5.0, 2.0), "model": (20.0, 8.0)}   # model scope: + 2 s and 1 s per layer
EST_CELL_OVERHEAD_S = 2.5
# A process of its own (--isolate cell / mode): python and torch imports, the CUDA context, cuflash's
# kernels from the disk cache, the initial weights; with compiled cells also the compiler's warm-up.
EST_PROCESS_S = {"eager": 6.0, "compile": 13.0}


def est_ms(cell, phase) -> float:
    """Rough ms of one training step or inference forward."""
    m, b, t = MODELS[cell["model"]], cell["batch"], cell["seqlen"]
    n = count_params(model_config(cell["model"], t))
    dense = (6 if phase == "train" else 2) * n * b * t
    attn_fwd = 4 * b * t * t * m["n_embd"] * m["n_layer"]   # full (T, T) products
    if cell["impl"] == "naive":   # computes the masked half and moves every score through HBM
        flops = attn_fwd * (3 if phase == "train" else 1)
        scores = b * m["n_head"] * t * t * m["n_layer"]
        mem_ms = scores * (40 if phase == "train" else 14) / EST_HBM * 1e3
    else:
        flops = attn_fwd / 2 * (3.5 if phase == "train" else 1)
        mem_ms = 0.0
    return (dense + flops) / (EST_TFLOPS[cell["mode"]] * 1e12) * 1e3 + mem_ms


def est_cell_s(cell, args) -> float:
    s = EST_CELL_OVERHEAD_S
    if "train" in args.phases:
        s += args.steps * est_ms(cell, "train") / 1e3
    if "infer" in args.phases:
        s += (args.infer_warmup + args.infer_reps) * est_ms(cell, "infer") / 1e3
    if cell["mode"] == "compile":
        tr, inf = EST_COMPILE_S[args.compile_scope]
        if args.compile_scope == "model":
            layers = MODELS[cell["model"]]["n_layer"]
            tr, inf = tr + 2.0 * layers, inf + 1.0 * layers
        s += (tr if "train" in args.phases else 0) + (inf if "infer" in args.phases else 0)
    return s


def process_groups(cells, isolate):
    """The cells of each process: one per cell, one per (model, seqlen, batch, mode), or all in one."""
    if isolate == "cell":
        return [[c] for c in cells]
    if isolate == "none":
        return [list(cells)] if cells else []
    groups = {}
    for c in cells:
        groups.setdefault(group_key(c), []).append(c)
    return list(groups.values())


def est_process_s(group, args) -> float:
    """Rough start-up seconds of a process of its own for these cells (0 when they run in this one)."""
    if args.isolate == "none":
        return 0.0
    return EST_PROCESS_S["compile" if any(c["mode"] == "compile" for c in group) else "eager"]


def dry_run(args) -> int:
    cells = build_cells(args)
    print(f"gpt2.py --dry-run: {len(cells)} cells; phases {', '.join(args.phases)}; {args.steps} training steps "
          f"({args.warmup} untimed), {args.infer_warmup} + {args.infer_reps} inference calls; compile scope "
          f"{args.compile_scope}; processes: {args.isolate}")
    hdr = f"{'#':>3}  {'model':<6}{'params':>9}{'seqlen':>8}{'batch':>7}  {'mode':<9}{'impl':<16}{'est. s':>8}"
    print(hdr)
    print("-" * len(hdr))
    total = 0.0
    for i, c in enumerate(cells, 1):
        s = est_cell_s(c, args)
        total += s
        n = count_params(model_config(c["model"], c["seqlen"]))
        print(f"{i:>3}  {c['model']:<6}{n / 1e6:>8.1f}M{c['seqlen']:>8}{c['batch']:>7}  {c['mode']:<9}{c['impl']:<16}"
              f"{s:>8.1f}")
    groups = process_groups(cells, args.isolate)
    procs = sum(est_process_s(g, args) for g in groups)
    # torch import, CUDA context, cuflash kernels, initial weights on the CPU; with processes of their own,
    # this one only imports torch and makes the initial weights
    start = 20.0 if args.isolate == "none" else 8.0
    print(f"rough total on an H100: {total + procs + start:.0f} s ({total:.0f} s of cells"
          + (f" + {procs:.0f} s for {len(groups)} processes' start-up" if procs else "")
          + f" + ~{start:.0f} s start-up); budget guard {'off' if not args.budget_s else f'{args.budget_s:.0f} s'}")
    return 0


# ------------------------------------------------------------------------------------------ comparisons

def group_key(c):
    return (c["model"], c["seqlen"], c["batch"], c["mode"])


def _losses(c):
    t = c.get("train") or {}
    return t.get("losses") if not t.get("error") else None


def max_abs_diff(a, b):
    n = min(len(a), len(b))
    return max(abs(x - y) for x, y in zip(a[:n], b[:n])) if n else None


def compare_losses(cells):
    """Per (model, seqlen, batch, mode): the reference, the noise scale, each impl's max |dloss|,
    and whether cuflash is within FLAG_NOISE_FACTOR x noise + FLAG_SLACK."""
    groups = {}
    for c in cells:
        groups.setdefault(group_key(c), {})[c["impl"]] = c
    out = []
    for key, by_impl in groups.items():
        curves = {impl: _losses(c) for impl, c in by_impl.items() if _losses(c)}
        ref = next((r for r in REFERENCE_ORDER if r in curves), None)
        row = dict(zip(("model", "seqlen", "batch", "mode"), key), reference=ref, noise_impl=None, noise=None,
                   diffs={}, threshold=None, cuflash_ok=None)
        if ref is None:
            out.append(row)
            continue
        row["diffs"] = {impl: max_abs_diff(curves[impl], curves[ref]) for impl in curves if impl != ref}
        # bf16 noise: how far the other exact implementations drift from the reference. After a
        # few dozen steps two correct bf16 runs part ways by chance (a loss spike lands on one step
        # in one run and another in the next), so the envelope of all of them is the scale, not
        # any single pair (one pair measured 0.19 where another measured 1.5 in the same group).
        others = {impl: d for impl, d in row["diffs"].items() if impl != "cuflash"}
        row["noise_impl"] = max(others, key=others.get) if others else None
        row["noise"] = others[row["noise_impl"]] if others else None
        row["threshold"] = FLAG_NOISE_FACTOR * (row["noise"] or 0.0) + FLAG_SLACK
        if "cuflash" in curves:
            finite = (by_impl["cuflash"].get("train") or {}).get("finite", True)
            row["cuflash_ok"] = bool(finite and row["diffs"]["cuflash"] <= row["threshold"])
        out.append(row)
    return out


def find_cell(cells, **kw):
    for c in cells:
        if all(c.get(k) == v for k, v in kw.items()):
            return c
    return None


def _ms(c, phase):
    r = (c or {}).get(phase) or {}
    return r.get("ms") if not r.get("error") else None


def _peak(c, phase):
    r = (c or {}).get(phase) or {}
    return r.get("peak_gib") if not r.get("error") else None


def _ratio(a, b):
    return a / b if a and b else None


def ratio_rows(cells):
    out = []
    for key in dict.fromkeys(group_key(c) for c in cells):
        get = {impl: find_cell(cells, **dict(zip(("model", "seqlen", "batch", "mode"), key)), impl=impl)
               for impl in ("cuflash", "sdpa_flash", "sdpa_cudnn", "naive")}
        row = dict(zip(("model", "seqlen", "batch", "mode"), key))
        for phase in PHASES:
            row[f"cuflash/sdpa_flash {phase}"] = _ratio(_ms(get["cuflash"], phase), _ms(get["sdpa_flash"], phase))
            row[f"cuflash/sdpa_cudnn {phase}"] = _ratio(_ms(get["cuflash"], phase), _ms(get["sdpa_cudnn"], phase))
            row[f"naive/cuflash {phase}"] = _ratio(_ms(get["naive"], phase), _ms(get["cuflash"], phase))
        row["naive/cuflash train peak"] = _ratio(_peak(get["naive"], "train"), _peak(get["cuflash"], "train"))
        out.append(row)
    return out


def finalize(data):
    cells = [c for c in data["cells"] if not c.get("skipped")]
    data["comparisons"] = compare_losses(cells)
    data["ratios"] = ratio_rows(cells)
    data["cuflash_failures"] = sum(1 for c in cells if c["impl"] == "cuflash" and _failed(c))
    data["cuflash_flagged"] = sum(1 for r in data["comparisons"] if r["cuflash_ok"] is False)


def _failed(c):
    return bool(c.get("error")) or any((c.get(p) or {}).get("error") for p in PHASES)


# ------------------------------------------------------------------------------------------ report

def _f(x, fmt):
    return "-" if x is None else format(x, fmt)


def _tok(x):
    return "-" if x is None else f"{x / 1e3:.1f}k" if x < 1e6 else f"{x / 1e6:.2f}M"


def _phase_cell(c, phase, value):
    """A table cell: the value, or why there is none."""
    if c.get("skipped"):
        return "skipped"
    r = {"error": c["error"]} if c.get("error") else (c.get(phase) or {})
    if r.get("error"):
        return "OOM" if r.get("oom") else "error"
    return value(r) if r else "-"


def format_header(data) -> str:
    m = data["meta"]
    lines = [f"=== GPT-2 end to end: {m.get('device', '?')}",
             f"torch {m.get('torch')} (CUDA {m.get('torch_cuda')}, cuDNN {m.get('cudnn')}), "
             f"cuflash {m.get('cuflash')}, driver {m.get('driver') or '-'}, python {m.get('python')}"]
    cfg = m.get("config", {})
    if cfg:
        lines.append(f"{cfg.get('steps')} training steps per cell ({cfg.get('warmup')} untimed), "
                     f"{cfg.get('infer_warmup')} + {cfg.get('infer_reps')} inference calls, bf16 autocast, AdamW lr "
                     f"{cfg.get('lr')} (warm-up {cfg.get('lr_warmup')}), compile scope {cfg.get('compile_scope')}, "
                     f"naive softmax {cfg.get('naive_softmax')}, seed {cfg.get('seed')}")
    if m.get("cuflash_import_error"):
        lines.append(f"cuflash did not import: {m['cuflash_import_error']}")
    for key, what in (("cuflash_precompile", "cuflash kernels built (cuflash.precompile)"),
                      ("compiler_warmup", "torch.compile warmed up on a small function")):
        r = m.get(key)
        if r:
            lines.append(f"{what}: " + (f"error {r['error']}" if r.get("error") else f"{r['wall_s']:.1f} s"))
    return "\n".join(lines)


def format_details(data) -> str:
    cells = [c for c in data["cells"] if not c.get("skipped")]
    lines = ["--- first step / call and compile time (s): first wall time; compile = first minus the median"]
    for c in cells:
        parts = []
        for phase, first in (("train", "first_step_s"), ("infer", "first_call_s")):
            r = c.get(phase) or {}
            if r and not r.get("error"):
                comp = f", compile {r['compile_s']:.1f}" if c["mode"] == "compile" else ""
                parts.append(f"{phase} first {r[first]:.2f}{comp}")
        if parts:
            lines.append(f"  {_cell_name(c)}  " + ";  ".join(parts))
    lines.append("")
    lines.append("--- loss curves (every step's training loss)")
    for key in dict.fromkeys(group_key(c) for c in cells):
        group = [c for c in cells if group_key(c) == key and _losses(c)]
        if not group:
            continue
        n = max(len(_losses(c)) for c in group)
        steps = sorted(set(range(0, n, max(1, n // 8))) | {n - 1})
        lines.append(f"  {f'{key[0]} s{key[1]} b{key[2]} {key[3]}, step':<32}" + "".join(f"{s:>8}" for s in steps))
        for c in group:
            ls = _losses(c)
            cols = (f"{ls[s]:>8.3f}" if s < len(ls) else f"{'-':>8}" for s in steps)
            lines.append(f"    {c['impl']:<30}" + "".join(cols))
    errors = {}
    for c in data["cells"]:
        for phase in ("cell",) + PHASES:
            r = c if phase == "cell" else (c.get(phase) or {})
            if r.get("error"):
                errors.setdefault((c["impl"], r["error"]), []).append(f"{_cell_name(c).strip()} {phase}")
    if errors:
        lines.append("")
        lines.append("--- errors")
        for (impl, msg), where in sorted(errors.items()):
            lines.append(f"  {impl}: {msg}  [{len(where)}x: {'; '.join(where[:4])}{' ...' if len(where) > 4 else ''}]")
    return "\n".join(lines)


def _cell_name(c):
    return f"{c['model']:<5} s{c['seqlen']:<5} b{c['batch']:<3} {c['mode']:<8} {c['impl']:<15}"


def format_summary(data) -> str:
    cells = data["cells"]
    comps = {tuple(r[k] for k in ("model", "seqlen", "batch", "mode")): r for r in data["comparisons"]}
    lines = ["=== summary", "",
             "| model | seqlen | batch | mode | impl | ms/step | tokens/s | peak GiB | infer ms "
             "| max\\|dloss\\| vs sdpa_flash |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for c in cells:
        comp = comps.get(group_key(c)) or {}
        if c["impl"] == comp.get("reference"):
            dloss = "ref" if comp["reference"] == "sdpa_flash" else f"ref ({comp['reference']})"
        else:
            dloss = _f((comp.get("diffs") or {}).get(c["impl"]), ".4f")
        lines.append(f"| {c['model']} | {c['seqlen']} | {c['batch']} | {c['mode']} | {c['impl']} | "
                     f"{_phase_cell(c, 'train', lambda r: _f(r.get('ms'), '.2f'))} | "
                     f"{_phase_cell(c, 'train', lambda r: _tok(r.get('tokens_per_s')))} | "
                     f"{_phase_cell(c, 'train', lambda r: _f(r.get('peak_gib'), '.2f'))} | "
                     f"{_phase_cell(c, 'infer', lambda r: _f(r.get('ms'), '.2f'))} | {dloss} |")
    lines += ["", "ratios of times (train = ms/step, infer = ms/forward; < 1: the first is faster) and of training "
                  "peaks:",
              "| model | seqlen | batch | mode | cuflash/sdpa_flash train | infer | cuflash/sdpa_cudnn train | infer "
              "| naive/cuflash train | infer | peak |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in data["ratios"]:
        vals = [r[k] for k in ("cuflash/sdpa_flash train", "cuflash/sdpa_flash infer", "cuflash/sdpa_cudnn train",
                               "cuflash/sdpa_cudnn infer", "naive/cuflash train", "naive/cuflash infer",
                               "naive/cuflash train peak")]
        lines.append(f"| {r['model']} | {r['seqlen']} | {r['batch']} | {r['mode']} | "
                     + " | ".join(_f(v, ".2f") for v in vals) + " |")
    lines += ["", f"loss agreement: max |dloss| over the steps vs the reference; noise = the same for a second correct "
                  f"implementation; cuflash OK when <= {FLAG_NOISE_FACTOR:g} x noise + {FLAG_SLACK:g}"]
    for r in data["comparisons"]:
        name = f"  {r['model']} s{r['seqlen']} b{r['batch']} {r['mode']}:"
        if r["reference"] is None:
            lines.append(f"{name} no loss curve to compare against")
            continue
        noise = (f"noise {r['noise']:.4f} ({r['noise_impl']} vs {r['reference']})" if r["noise"] is not None
                 else "no second reference: noise taken as 0")
        verdict = ("-" if r["cuflash_ok"] is None else
                   f"cuflash {r['diffs']['cuflash']:.4f} vs limit {r['threshold']:.4f}: "
                   + ("OK" if r["cuflash_ok"] else "FLAG"))
        lines.append(f"{name} {noise}; {verdict}")
    skipped = [c for c in cells if c.get("skipped")]
    if skipped:
        lines.append(f"INCOMPLETE: {len(skipped)} cell(s) skipped ({skipped[0]['skipped']})")
    n_fail, n_flag = data["cuflash_failures"], data["cuflash_flagged"]
    lines.append(f"cuflash: {n_fail} failed cell(s), {n_flag} flagged loss curve(s)"
                 + (" -> exit status 1" if n_fail or n_flag or data["meta"].get("cuflash_import_error") else ""))
    if data["meta"].get("wall_s") is not None:
        lines.append(f"wall time {data['meta']['wall_s']:.0f} s")
    return "\n".join(lines)


def print_report(data):
    print()
    print(format_header(data))
    print()
    print(format_details(data))
    print()
    print(format_summary(data))


def progress_line(i, n, rec) -> str:
    parts = []
    if rec.get("skipped"):
        parts.append(f"skipped ({rec['skipped']})")
    elif rec.get("error"):
        parts.append(f"ERROR {rec['error']}")
    for phase in PHASES:
        r = rec.get(phase)
        if not r:
            continue
        if r.get("error"):
            parts.append(f"{phase} {'OOM' if r.get('oom') else 'ERROR'} {r['error'][:120]}")
        elif phase == "train":
            ls = r["losses"]
            peak = (f", peak {r['peak_gib']:.4f} GiB (requested {r.get('peak_requested_gib') or 0:.4f})"
                    if r["peak_gib"] is not None else "")
            comp = f", compile {r['compile_s']:.1f} s" if rec["mode"] == "compile" else ""
            parts.append(f"train {r['ms']:.2f} ms/step ({_tok(r['tokens_per_s'])} tok/s{peak}{comp}), "
                         f"loss {ls[0]:.3f} -> {ls[-1]:.3f}")
        else:
            peak = (f", peak {r['peak_gib']:.4f} GiB (requested {r.get('peak_requested_gib') or 0:.4f})"
                    if r["peak_gib"] is not None else "")
            comp = f", compile {r['compile_s']:.1f} s" if rec["mode"] == "compile" else ""
            parts.append(f"infer {r['ms']:.2f} ms{peak}{comp}")
    wall = f" [{rec['wall_s']:.1f} s]" if rec.get("wall_s") is not None else ""
    proc = rec.get("process") or {}
    if proc.get("wall_s") is not None:   # the cell's own process: its whole life, start-up included
        wall = f"{wall[:-1] if wall else ' ['}{'; ' if wall else ''}process {proc['wall_s']:.1f} s]"
    return f"[{i}/{n} {time.perf_counter() - T_START:4.0f}s] {_cell_name(rec)} " + " | ".join(parts) + wall


# ------------------------------------------------------------------------------------------ plot

IMPL_COLOR = {"cuflash": "tab:red", "sdpa_flash": "tab:blue", "sdpa_cudnn": "tab:green",
              "sdpa_efficient": "tab:purple", "sdpa_math": "tab:brown", "naive": "tab:gray"}


def make_plot(data, path):
    """One column per (model, seqlen, batch): ms per training step and per inference forward
    (bars per impl, grouped by mode), the loss curves, and each curve minus the reference's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = [c for c in data["cells"] if not c.get("skipped")]
    configs = list(dict.fromkeys((c["model"], c["seqlen"], c["batch"]) for c in cells))
    comps = {tuple(r[k] for k in ("model", "seqlen", "batch", "mode")): r for r in data["comparisons"]}
    fig, axes = plt.subplots(4, len(configs), figsize=(6.0 * len(configs), 15), squeeze=False)
    for j, conf in enumerate(configs):
        group = [c for c in cells if (c["model"], c["seqlen"], c["batch"]) == conf]
        modes = [m for m in MODES if any(c["mode"] == m for c in group)]
        impls = [i for i in IMPLS if any(c["impl"] == i for c in group)]
        title = f"GPT-2 {conf[0]}, seqlen {conf[1]}, batch {conf[2]}"
        width = 0.8 / max(1, len(impls))
        for row, (phase, what) in enumerate((("train", "ms per training step"), ("infer", "ms per inference forward"))):
            ax = axes[row][j]
            for k, impl in enumerate(impls):
                for mi, mode in enumerate(modes):
                    c = find_cell(group, mode=mode, impl=impl)
                    x = mi + (k - (len(impls) - 1) / 2) * width
                    v = _ms(c, phase)
                    if v is not None:
                        ax.bar(x, v, width, color=IMPL_COLOR[impl], label=impl if mi == 0 else None)
                        ax.text(x, v, f"{v:.1f}", ha="center", va="bottom", fontsize=7)
                    elif c is not None:
                        ax.text(x, 0, _phase_cell(c, phase, lambda r: "-"), ha="center", va="bottom", rotation=90,
                                fontsize=8)
            ax.set_xticks(range(len(modes)), modes)
            ax.set_ylabel("ms")
            ax.set_title(f"{title}\n{what} (lower is better)", fontsize=10)
            if row == 0:
                ax.legend(fontsize=7)
        ax, dax = axes[2][j], axes[3][j]
        for c in group:
            ls = _losses(c)
            if not ls:
                continue
            style = "-" if c["mode"] == "eager" else "--"
            ax.plot(range(len(ls)), ls, style, color=IMPL_COLOR[c["impl"]], label=f"{c['impl']} {c['mode']}", lw=1.2)
            comp = comps.get(group_key(c)) or {}
            ref = find_cell(group, mode=c["mode"], impl=comp.get("reference"))
            if ref is not None and ref is not c:
                rl = _losses(ref)
                n = min(len(ls), len(rl))
                dax.plot(range(n), [a - b for a, b in zip(ls[:n], rl[:n])], style, color=IMPL_COLOR[c["impl"]],
                         label=f"{c['impl']} {c['mode']}", lw=1.2)
        ax.set_title("training loss (solid: eager, dashed: compile)", fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.legend(fontsize=7)
        dax.axhline(0.0, color="black", lw=0.5)
        dax.set_title("loss minus the reference's at the same step (sdpa_flash where it ran)", fontsize=10)
        dax.set_xlabel("step")
        dax.set_ylabel("loss difference")
        if dax.lines[1:]:
            dax.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------------------ meta, json

# What a process that ran cells knows and the one that started it may not (it touches no GPU).
DEVICE_META = ("cudnn", "cupy", "device", "capability", "total_memory_gib")


def device_meta(dev) -> dict:
    if not dev.cuda:
        return {"cudnn": None, "cupy": getattr(sys.modules.get("cupy"), "__version__", None),
                "device": f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} threads)"}
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return {"cudnn": torch.backends.cudnn.version(), "cupy": getattr(sys.modules.get("cupy"), "__version__", None),
            "device": props.name, "capability": f"{props.major}.{props.minor}",
            "total_memory_gib": props.total_memory / 2**30}


def collect_meta(args, dev, cuflash_version, cuflash_error, query_device=True):
    """The run's metadata. query_device=False (the parent of --isolate processes): no CUDA call here;
    the device's fields come from the first process that ran a cell (the name from nvidia-smi until
    then)."""
    smi = nvidia_smi_info() if dev.cuda else None
    meta = {"timestamp_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "argv": sys.argv[1:], "python": platform.python_version(), "platform": platform.platform(),
            "torch": torch.__version__, "torch_cuda": torch.version.cuda,
            "cudnn": None, "numpy": np.__version__,
            "cuflash": cuflash_version, "cuflash_import_error": cuflash_error,
            "cupy": None, "nvidia_smi": smi,
            "driver": smi[0].split(",")[1].strip() if smi else None,
            "config": {k: v for k, v in vars(args).items()
                       if k not in ("summarize", "json", "plot", "dry_run", "child")},
            "data": f"Markov chain over {MARKOV_STATES} token ids, successor probabilities {list(MARKOV_PROBS)}, "
                    f"seed {args.seed}",
            "timing": "train: median of per-step CUDA-event times after --warmup untimed steps, every step "
                      "forward + backward + clip + AdamW + zero_grad(set_to_none); infer: median of per-call "
                      "CUDA-event times under inference_mode; compile_s = first wall time - median",
            "float32_matmul_precision": torch.get_float32_matmul_precision()}
    if query_device or not dev.cuda:
        meta.update(device_meta(dev))
    else:
        meta["device"] = smi[0].split(",")[0].strip() if smi else "CUDA device"
    meta["models"] = {name: dict(MODELS[name], n_params=count_params(model_config(name, 1024)))
                      for name in args.models}
    return meta


def load_merged(paths):
    """Earlier --json files as one: cells by (model, seqlen, batch, mode, impl), later files win."""
    merged, cells = None, {}
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        merged = merged or data
        for c in data["cells"]:
            cells[(c["model"], c["seqlen"], c["batch"], c["mode"], c["impl"])] = c
    merged["cells"] = list(cells.values())
    if len(paths) > 1:
        merged["meta"]["merged_from"] = list(paths)
        merged["meta"]["wall_s"] = None
    return merged


# ------------------------------------------------------------------------------------------ main

def prepare_cuflash(args, dev):
    """Import cuflash and, on a GPU, build its kernels for the head dims the run uses, so that
    no cell's first step pays an NVRTC compile. (version, import error, precompile record)."""
    if "cuflash" not in args.impls:
        return None, None, None
    try:
        import cuflash
    except Exception as e:
        traceback.print_exc()
        return None, _err(e), None
    record = None
    if dev.cuda:
        head_dims = sorted({MODELS[m]["n_embd"] // MODELS[m]["n_head"] for m in args.models})
        t0 = time.perf_counter()
        record = {"head_dims": head_dims}
        try:
            cuflash.precompile(head_dims=head_dims, dtypes=["bfloat16"], causal=[True],
                               device=torch.cuda.current_device())
        except Exception as e:   # the cells will try again, and record what fails
            record["error"] = _err(e)
        record["wall_s"] = time.perf_counter() - t0
    return cuflash.__version__, None, record


def make_initial_states(cells, args):
    """GPT-2's initial weights once per (model, positions), on the CPU from --seed."""
    states = {}
    for c in cells:
        cfg = model_config(c["model"], c["seqlen"])
        if (c["model"], cfg.block_size) not in states:
            torch.manual_seed(args.seed)
            states[(c["model"], cfg.block_size)] = build_model(cfg, None, "cpu").state_dict()
    return states


def make_datasets(cells, args):
    datasets = {}
    for c in cells:
        if data_key(c) not in datasets:
            datasets[data_key(c)] = make_data(args.steps, *data_key(c), args.seed)
    return datasets


def budget_skip(args, dev, est, scale):
    """The reason to skip work predicted to take est * scale seconds, or None to run it."""
    elapsed = time.perf_counter() - T_START
    if args.budget_s and dev.cuda and elapsed + est * scale > args.budget_s:
        return (f"time budget: {elapsed:.0f} s elapsed, ~{est * scale:.0f} s predicted, "
                f"budget {args.budget_s:.0f} s")
    return None


def run(args, dev) -> int:
    if args.isolate != "none":
        return run_isolated(args, dev)
    cuflash_version, cuflash_error, precompile = prepare_cuflash(args, dev)
    cells = build_cells(args)
    data = {"meta": collect_meta(args, dev, cuflash_version, cuflash_error), "cells": []}
    data["meta"]["cuflash_precompile"] = precompile
    data["meta"]["isolation"] = "none"
    print(f"gpt2.py: {len(cells)} cells ({', '.join(args.models)} x {', '.join(args.modes)} x "
          f"{', '.join(args.impls)}) on {data['meta']['device']}", flush=True)

    # initial weights, once per (model, positions), on the CPU; data once per (batch, seqlen, vocab)
    t0 = time.perf_counter()
    init_states, datasets = make_initial_states(cells, args), make_datasets(cells, args)
    data["meta"]["setup_s"] = time.perf_counter() - t0
    if "compile" in args.modes:
        data["meta"]["compiler_warmup"] = guarded(lambda: warm_up_compiler(dev), dev)
    write_json(args.json, data)

    est_done = act_done = 0.0
    try:
        for i, cell in enumerate(cells, 1):
            est = est_cell_s(cell, args) if dev.cuda else 0.0
            scale = max(0.5, act_done / est_done) if est_done > 10 else 1.0
            skip = budget_skip(args, dev, est, scale)
            if skip:
                rec = dict(cell, skipped=skip)
            else:
                rec = run_cell(cell, args, dev, init_states, datasets)
                act_done += rec["wall_s"]
                est_done += est
            data["cells"].append(rec)
            print(progress_line(i, len(cells), rec), flush=True)
            write_json(args.json, data)
    finally:
        data["meta"]["wall_s"] = time.perf_counter() - T_START
        finalize(data)
        write_json(args.json, data)

    plot_if_asked(data, args)
    print_report(data)
    return 1 if data["cuflash_failures"] or data["cuflash_flagged"] or cuflash_error else 0


# ------------------------------------------------------------------------------------------ processes

def run_isolated(args, dev) -> int:
    """--isolate cell / mode: each group of cells in a process of its own (see the docstring); this
    process makes the initial weights, starts the processes one after another, and reports."""
    cells = build_cells(args)
    groups = process_groups(cells, args.isolate)
    data = {"meta": collect_meta(args, dev, None, None, query_device=False), "cells": []}
    meta = data["meta"]
    meta["isolation"] = args.isolate
    print(f"gpt2.py: {len(cells)} cells ({', '.join(args.models)} x {', '.join(args.modes)} x "
          f"{', '.join(args.impls)}) on {meta['device']}, {len(groups)} process{'es' if len(groups) > 1 else ''} "
          f"(--isolate {args.isolate})",
          flush=True)
    tmp = tempfile.mkdtemp(prefix="cuflash_gpt2_")
    est_done = act_done = 0.0
    cuflash_error = None
    try:
        t0 = time.perf_counter()
        states = {}
        for (model, positions), state in make_initial_states(cells, args).items():
            path = os.path.join(tmp, f"init_{model}_{positions}.pt")
            torch.save(state, path)
            states[f"{model}|{positions}"] = path
        meta["setup_s"] = time.perf_counter() - t0
        write_json(args.json, data)
        for n, group in enumerate(groups):
            est = (sum(est_cell_s(c, args) for c in group) + est_process_s(group, args)) if dev.cuda else 0.0
            scale = max(0.5, act_done / est_done) if est_done > 10 else 1.0
            # A group of several cells runs when its first fits; the process skips those that do not.
            first = (est_cell_s(group[0], args) + est_process_s(group, args)) if dev.cuda else 0.0
            skip = budget_skip(args, dev, est if len(group) == 1 else first, scale)
            if skip:
                records = [dict(c, skipped=skip) for c in group]
            else:
                t1 = time.perf_counter()
                left = args.budget_s - (t1 - T_START) if args.budget_s and dev.cuda else 0.0
                records, child_meta = run_process(group, args, dev, states, os.path.join(tmp, f"p{n}"), left, scale)
                act_done += time.perf_counter() - t1
                est_done += est
                for key in DEVICE_META + ("cuflash",):
                    if child_meta.get(key) is not None and (meta.get(key) is None or key == "device"
                                                            and not meta.get("capability")):
                        meta[key] = child_meta[key]
                for key in ("cuflash_precompile", "compiler_warmup"):
                    if child_meta.get(key) and not meta.get(key):
                        meta[key] = child_meta[key]
                if child_meta.get("cuflash_import_error"):
                    cuflash_error = meta["cuflash_import_error"] = child_meta["cuflash_import_error"]
            for rec in records:
                data["cells"].append(rec)
                print(progress_line(len(data["cells"]), len(cells), rec), flush=True)
            write_json(args.json, data)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        meta["wall_s"] = time.perf_counter() - T_START
        finalize(data)
        write_json(args.json, data)

    plot_if_asked(data, args)
    print_report(data)
    return 1 if data["cuflash_failures"] or data["cuflash_flagged"] or cuflash_error else 0


def run_process(group, args, dev, states, stem, budget_left, scale):
    """Runs the cells of `group` in a new process (this script with --child): (records, its meta).
    A process that dies (a crash, the OOM killer, a timeout) leaves an error record for each cell
    it did not report, with the tail of its output."""
    spec = {"args": {k: v for k, v in vars(args).items() if k != "child"}, "device": dev.type, "cells": group,
            "states": states, "out": stem + ".out.json", "budget_left_s": budget_left, "scale": scale}
    with open(stem + ".spec.json", "w") as f:
        json.dump(spec, f)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", stem + ".spec.json"]
    # No output for a process stuck past the budget (a hang would otherwise hold the whole run).
    timeout = budget_left + 120.0 if budget_left > 0 else None
    t0 = time.perf_counter()
    status = None
    with open(stem + ".log", "w+") as log:
        try:
            status = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            status = f"timed out after {timeout:.0f} s"
        log.seek(0)
        output = log.read()
    wall = time.perf_counter() - t0
    if output.strip():   # the process's own messages (warnings, tracebacks), as they would have appeared here
        sys.stderr.write(output if output.endswith("\n") else output + "\n")
        sys.stderr.flush()
    try:
        with open(spec["out"]) as f:
            result = json.load(f)
    except (OSError, ValueError):
        result = {"meta": {}, "cells": []}
    records = result["cells"]
    for rec in records:
        rec.setdefault("process", {})["wall_s"] = wall
    if len(records) < len(group) or status != 0:
        why = f"the cell's process {'exited with status ' + str(status) if isinstance(status, int) else status}"
        last = next((line.strip() for line in reversed(output.splitlines()) if line.strip()), "")
        for cell in group[len(records):]:
            records.append(dict(cell, error=f"{why}{': ' + last[:300] if last else ''}", traceback=output[-3000:],
                                process={"wall_s": wall, "status": status}))
    return records, result["meta"]


def run_child(spec_path) -> int:
    """The process side of run_process: the cells of the spec, each record written back as it ends."""
    t_start = time.perf_counter()
    with open(spec_path) as f:
        spec = json.load(f)
    args = argparse.Namespace(**spec["args"], child=spec_path)
    dev = Device(spec["device"])
    cells = spec["cells"]
    args.impls = [x for x in IMPLS if any(c["impl"] == x for c in cells)]   # cuflash is prepared only if it runs
    args.modes = [x for x in MODES if any(c["mode"] == x for c in cells)]
    if dev.cuda:
        torch.set_float32_matmul_precision("high")
    cuflash_version, cuflash_error, precompile = prepare_cuflash(args, dev)
    meta = {"cuflash": cuflash_version, "cuflash_import_error": cuflash_error, "cuflash_precompile": precompile,
            "pid": os.getpid()}
    meta.update(device_meta(dev))
    init_states = {}
    for key, path in spec["states"].items():
        model, positions = key.split("|")
        init_states[(model, int(positions))] = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    datasets = make_datasets(cells, args)
    if "compile" in args.modes:
        meta["compiler_warmup"] = guarded(lambda: warm_up_compiler(dev), dev)
    startup = time.perf_counter() - t_start
    out = {"meta": meta, "cells": []}
    budget_left, scale = spec["budget_left_s"], spec["scale"]
    for i, cell in enumerate(cells):
        est = est_cell_s(cell, args) * scale if dev.cuda else 0.0
        elapsed = time.perf_counter() - t_start
        if i > 0 and budget_left > 0 and elapsed + est > budget_left:   # the first was checked by the caller
            rec = dict(cell, skipped=f"time budget: ~{est:.0f} s predicted, {budget_left - elapsed:.0f} s of the "
                                     f"budget left")
        else:
            rec = run_cell(cell, args, dev, init_states, datasets)
        rec["process"] = {"isolation": args.isolate, "pid": os.getpid(), "startup_s": startup,
                          "compiler_warmup_s": (meta.get("compiler_warmup") or {}).get("wall_s"),
                          "cuflash_precompile_s": (precompile or {}).get("wall_s"), "cells": len(cells)}
        out["cells"].append(rec)
        write_json(spec["out"], out)
    write_json(spec["out"], out)
    return 0


def plot_if_asked(data, args):
    """--plot; a figure that cannot be drawn (no matplotlib) never costs the report."""
    if args.plot:
        try:
            print(f"plot: {make_plot(data, args.plot)}")
        except Exception as e:
            print(f"plot failed: {_err(e)}", file=sys.stderr)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.summarize:
        data = load_merged(args.summarize)
        finalize(data)
        plot_if_asked(data, args)
        print_report(data)
        return 0
    if args.child:
        return run_child(args.child)
    if args.dry_run:
        return dry_run(args)
    if args.cpu_smoke:
        return run(args, Device("cpu"))
    if not torch.cuda.is_available():
        print("gpt2.py: no CUDA device visible to torch (--cpu-smoke runs a tiny model on the CPU)", file=sys.stderr)
        return 2
    torch.set_float32_matmul_precision("high")   # TF32 for any float32 matmul autocast leaves, as nanoGPT
    return run(args, Device("cuda"))


if __name__ == "__main__":
    sys.exit(main())
