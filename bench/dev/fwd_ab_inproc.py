"""Forward GPU time of several cuflash trees in one process, interleaved (no order or process bias).

TREES="main=.oldtree/main18 c=.oldtree/c new=." loads each tree's package under its own module name
(the first tree is the baseline; this checkout should be last, as `cuflash`). With torch, each
extra package registers its torch.library operators under its own namespace (cuflash_<tag>), so
bfloat16 and float16 both run through the torch adapter in eager mode. Per configuration the trees
alternate ROUNDS times, each a median of REPS CUDA-event timings of one forward call after a
warm-up; the per-round ratios to the baseline are reported by their median, then single eager
calls (host included: synchronize, call, synchronize; wall time, median of REPS) at 1024 tokens.
With DECODE=1, decode steps (attention_with_kvcache, one query per entry, full caches) instead:
batch x cache length x GQA group at head_dim 128, GPU time and single eager calls.
Env: ROUNDS (7), REPS (20), HDS ("64 96 128 256"), SEQS ("1024 4096"), DTYPES ("bfloat16 float16"),
PASS ("fwd"; "bwd": attention_backward instead, from the baseline tree's out and lse),
DECODE (0); OPTS (e.g. "window=256 softcap=30 alibi kvlen=0.9 sink"): instead of the plain grid, a
forward with each option (bench_flex's shape: batch 2, 16 heads, head_dim 128, causal, OPT_SEQS keys,
default "8192 16384"); TREE_ENV ("tag:VAR=VAL,VAR=VAL tag2:..."): variables set for that tree
(the same tree may be loaded twice under two tags, e.g. to time one environment switch against
another; plans read such switches when they are made, at a tree's first call, so they are set around
the warm-up calls only unless TREE_ENV_EVERY=1)."""
import os
import statistics as st
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from treeload import load  # noqa: E402

pairs = [t.split("=") for t in os.environ.get("TREES", "main=.oldtree/main18 new=.").split()]
mods = {}
for i, (tag, root) in enumerate(pairs):
    last = i == len(pairs) - 1
    mods[tag] = load("cuflash" if last else f"cuflash_{tag}", root, "cuflash" if last else f"cuflash_{tag}")
    print(tag, "from", mods[tag].__file__)
tags = [t for t, _ in pairs]
tree_env = {}
for item in os.environ.get("TREE_ENV", "").split():
    tag, _, assigns = item.partition(":")
    tree_env[tag] = dict(a.split("=", 1) for a in assigns.split(",") if a)


def with_env(tag, f):
    """f, with tag's TREE_ENV variables set around each call."""
    env = tree_env.get(tag)
    if not env:
        return f

    def g():
        old = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            return f()
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    return g
base = tags[0]
ROUNDS, REPS = int(os.environ.get("ROUNDS", "7")), int(os.environ.get("REPS", "20"))


def gpu_ms(f):
    ts = []
    for _ in range(REPS):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        f()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1))
    return st.median(ts)


def eager_ms(f):
    ts = []
    for _ in range(REPS):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        f()
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - t0) * 1e3)
    return st.median(ts)


ratios = {t: [] for t in tags[1:]}
eager = {t: [] for t in tags[1:]}
torch.manual_seed(0)


def compare(label, fs, with_eager):
    """Alternates the trees' calls ROUNDS times; one line of ratios to the baseline. TREE_ENV's
    variables are set around each tree's warm-up calls only, where its plans are made (they read the
    switches then): set around every timed call, their host time (putenv) fell inside short calls'
    GPU time and slowed that tree by 1-5 % at 512-2k keys (session 39). TREE_ENV_EVERY=1: around
    every call (for a switch read per call)."""
    warm = {t: with_env(t, f) for t, f in fs.items()}
    fs = warm if os.environ.get("TREE_ENV_EVERY") == "1" else dict(fs)
    for _ in range(2):
        for t in tags:
            warm[t]()
    torch.cuda.synchronize()
    per = {t: [] for t in tags}
    for _ in range(ROUNDS):
        for t in tags:
            per[t].append(gpu_ms(fs[t]))
    line = f"{label}: {base} {st.median(per[base]):.4f} ms"
    for t in tags[1:]:
        r = st.median(a / c for a, c in zip(per[t], per[base]))
        ratios[t].append(r)
        line += f"  {t}/{base} {r:.3f}"
    if with_eager:
        ev = {t: [] for t in tags}
        for _ in range(3):
            for t in tags:
                ev[t].append(eager_ms(fs[t]))
        line += f" | eager {base} {st.median(ev[base]):.4f} ms"
        for t in tags[1:]:
            r = st.median(a / c for a, c in zip(ev[t], ev[base]))
            eager[t].append(r)
            line += f"  {t}/{base} {r:.3f}"
    print(line, flush=True)


if os.environ.get("DECODE", "0") == "1":
    for dt in os.environ.get("DTYPES", "bfloat16 float16").split():
        dtype = getattr(torch, dt)
        for b, n, g in ((1, 2048, 8), (8, 8192, 4), (64, 4096, 8), (256, 2048, 4)):
            kc = torch.randn(b, n, 32 // g, 128, device="cuda", dtype=dtype)
            vc = torch.randn_like(kc)
            qd = torch.randn(b, 1, 32, 128, device="cuda", dtype=dtype)
            lens = torch.full((b,), n, device="cuda", dtype=torch.int32)
            fs = {t: (lambda m=mods[t]: m.attention_with_kvcache(qd, kc, vc, cache_seqlens=lens)) for t in tags}
            compare(f"decode {dt:8s} b{b} n{n} h32/{32 // g} d128", fs, True)
            del kc, vc
    os.environ["HDS"] = ""
def option_kwargs(opt, b, h, s):
    """attention() keyword arguments of one OPTS item at batch b, h heads, s keys."""
    name, _, val = opt.partition("=")
    if name == "window":
        return {"window": (int(val), 0)}
    if name == "softcap":
        return {"softcap": float(val)}
    if name == "alibi":
        return {"alibi_slopes": torch.tensor([2.0 ** (-8 * (i + 1) / h) for i in range(h)], device="cuda")}
    if name == "kvlen":
        return {"kv_lengths": torch.full((b,), int(s * float(val)), device="cuda", dtype=torch.int32)}
    if name == "sink":
        return {"sink_logits": torch.zeros(h, device="cuda")}
    raise SystemExit(f"OPTS: unknown option {opt!r}")


if os.environ.get("OPTS"):
    for dt in os.environ.get("DTYPES", "bfloat16 float16").split():
        dtype = getattr(torch, dt)
        for s in [int(x) for x in os.environ.get("OPT_SEQS", "8192 16384").split()]:
            b, h = 2, 16
            q, k, v = (torch.randn(b, s, h, 128, device="cuda", dtype=dtype) for _ in range(3))
            for opt in os.environ["OPTS"].split():
                kw = option_kwargs(opt, b, h, s)
                if os.environ.get("PASS", "fwd") == "bwd":
                    dout = torch.randn_like(q)
                    res = mods[base].attention(q, k, v, causal=True, return_lse=True, **kw)
                    out, lse = res[0], res[1]
                    fs = {t: (lambda m=mods[t], kw=kw: m.attention_backward(dout, q, k, v, out, lse, causal=True, **kw))
                          for t in tags}
                    compare(f"bwd {dt:8s} d128 b{b} s{s} h{h} causal=1 {opt}", fs, False)
                    del dout, out, lse, res
                    continue
                fs = {t: (lambda m=mods[t], kw=kw: m.attention(q, k, v, causal=True, **kw)) for t in tags}
                compare(f"{dt:8s} d128 b{b} s{s} h{h} causal=1 {opt}", fs, False)
            del q, k, v
    os.environ["HDS"] = ""
for dt in os.environ.get("DTYPES", "bfloat16 float16").split():
    dtype = getattr(torch, dt)
    for hd in [int(x) for x in os.environ.get("HDS", "64 96 128 256").split()]:
        h = max(1, 2048 // hd)
        for s in [int(x) for x in os.environ.get("SEQS", "1024 4096").split()]:
            b = max(1, 16384 // s)
            q, k, v = (torch.randn(b, s, h, hd, device="cuda", dtype=dtype) for _ in range(3))
            for causal in (False, True):
                if os.environ.get("PASS", "fwd") == "bwd":
                    # The backward alone, from the baseline tree's out and lse (the same in every tree).
                    dout = torch.randn_like(q)
                    out, lse = mods[base].attention(q, k, v, causal=causal, return_lse=True)
                    fs = {t: (lambda m=mods[t]: m.attention_backward(dout, q, k, v, out, lse, causal=causal)) for t in tags}
                    compare(f"bwd {dt:8s} d{hd:<3d} b{b} s{s} h{h} causal={int(causal)}", fs, s == 1024 and hd in (64, 128))
                    del dout, out, lse
                    continue
                fs = {t: (lambda m=mods[t]: m.attention(q, k, v, causal=causal)) for t in tags}
                compare(f"{dt:8s} d{hd:<3d} b{b} s{s} h{h} causal={int(causal)}", fs, s == 1024 and hd in (64, 128))
            del q, k, v
for t in tags[1:]:
    line = f"geomean {t}/{base}: GPU time {st.geometric_mean(ratios[t]):.4f} over {len(ratios[t])} rows"
    if eager[t]:
        line += f"; eager {st.geometric_mean(eager[t]):.4f} over {len(eager[t])} rows"
    print(line)
