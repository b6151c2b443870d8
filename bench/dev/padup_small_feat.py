"""Head_dim pad-up below 64 for calls with options, measured (session 37).

Session 36 took the forward's pad-up at head_dim 24 to 56 for plain calls (_config.FWD_PAD_SMALL_MIN_SEQLEN_K)
and left calls with options on the mma.sync feature kernels there, not measured. Here, one process
per variant (native, pad, native, pad):
  native  CUFLASH_FWD_PAD=0: the feature kernels of the call's head_dim;
  pad     CUFLASH_FWD_WS=1: the warp-specialized feature kernel of 64 at every length
          (_config.fwd_pad_head_dim, feat=True), narrow windows included.
Per shape: GPU time (CUDA events around each call, 5 warm-up calls, median of 25 back-to-back calls)
and single eager calls (synchronize, events around one call, median of 10), forward only, 16k tokens
(seqlen 512 to 4k), heads 2048 // head_dim, fresh random inputs per shape, bf16 and fp16. The
options: softcap 30 and ALiBi (causal off and on), windows (256, 0) and (1024, 0) (the second from
2k keys, where it is not plain causal), lengths (q and kv lengths drawn from [seqlen / 2, seqlen],
causal off and on), sink logits, and a packed causal batch (attention_varlen, lengths drawn the
same way).

  python bench/dev/padup_small_feat.py                  # on the GPU (--variants rule native rule native:
                                                        # the tree's rule in place of pad)
  python bench/dev/padup_small_feat.py --summarize LOG  # the tables again, from a run's log
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from padup_small import run_variants, timed  # noqa: E402

HEAD_DIMS = (24, 32, 40, 48, 56)
SEQLENS = (512, 1024, 2048, 4096)
DTYPES = ("bfloat16", "float16")
VARIANTS = ("native", "pad", "native", "pad")  # --variants rule native ...: "rule" is the tree's own rule
ENVS = {"native": {"CUFLASH_FWD_PAD": "0"}, "pad": {"CUFLASH_FWD_WS": "1"}, "rule": {}}
# name -> (causal in the sense of the pad table: the window's right edge is 0, the least seqlen)
OPTIONS = {"softcap": (False, 0), "softcap causal": (True, 0), "alibi": (False, 0), "alibi causal": (True, 0),
           "window (256, 0)": (True, 0), "window (1024, 0)": (True, 2048), "lengths": (False, 0),
           "lengths causal": (True, 0), "sinks": (False, 0), "packed causal": (True, 0),
           # masks with per-score options (the rule: the scores table, a window's width as its length)
           "lengths+softcap causal": (True, 0), "packed+alibi causal": (True, 0),
           "window (1024, 0)+softcap": (True, 2048)}


def call(torch, cuflash, name, q, k, v, gen):
    """The forward of option set `name` on q, k, v, as a function of no arguments. A name with "+":
    a mask and one per-score option together."""
    b, s, h = q.shape[0], q.shape[1], q.shape[2]
    kw = {"causal": name.endswith("causal")}
    for part in name.replace(" causal", "").split("+"):
        if part == "softcap":
            kw["softcap"] = 30.0
        elif part == "alibi":
            kw["alibi_slopes"] = torch.rand(h, device="cuda", generator=gen) * 0.1
        elif part.startswith("window"):
            kw["window"] = (int(part.split("(")[1].split(",")[0]), 0)
        elif part == "lengths":
            kw["q_lengths"], kw["kv_lengths"] = (
                torch.randint(s // 2, s + 1, (b,), device="cuda", dtype=torch.int32, generator=gen) for _ in range(2))
        elif part == "sinks":
            kw["sink_logits"] = torch.randn(h, device="cuda", generator=gen)
        else:
            assert part == "packed", name
    if "packed" not in name:
        return lambda: cuflash.attention(q, k, v, **kw)
    lens = torch.randint(s // 2, s + 1, (b,), device="cuda", dtype=torch.int32, generator=gen)
    cu = torch.zeros(b + 1, device="cuda", dtype=torch.int32)
    cu[1:] = torch.cumsum(lens, 0)
    total = int(cu[-1])
    qp, kp, vp = (t.reshape(-1, t.shape[2], t.shape[3])[:total] for t in (q, k, v))
    return lambda: cuflash.attention_varlen(qp, kp, vp, cu, cu, s, s, **kw)


def run_one(variant):
    os.environ.update(ENVS[variant])
    import torch

    import cuflash

    gen = torch.Generator(device="cuda")
    gen.manual_seed(37)
    for dtype in DTYPES:
        tdt = getattr(torch, dtype)
        for d in HEAD_DIMS:
            for s in SEQLENS:
                b, h = 16384 // s, 2048 // d
                q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=tdt, generator=gen) for _ in range(3))
                for name, (causal, least) in OPTIONS.items():
                    if s < least:
                        continue
                    f = call(torch, cuflash, name, q, k, v, gen)
                    gpu, eager = timed(torch, f)
                    print(json.dumps({"variant": variant, "dtype": dtype, "d": d, "s": s, "option": name,
                                      "causal": causal, "ms": gpu, "eager_ms": eager}), flush=True)
                del q, k, v


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--one":
        run_one(sys.argv[2])
        return
    if len(sys.argv) > 2 and sys.argv[1] == "--summarize":
        summarize([json.loads(ln) for ln in open(sys.argv[2]) if ln.startswith("{")])
        return
    variants = sys.argv[2:] if len(sys.argv) > 2 and sys.argv[1] == "--variants" else VARIANTS
    summarize(run_variants(__file__, variants))


def summarize(rows):
    """Per point, pad / native: GPU time (min of each variant's runs) and eager (min of the medians).
    Then per (head_dim, causal), the worst ratio over options and dtypes at each length (narrow
    windows apart: the rule does not pad them), and the first length from which every longer one
    wins on GPU time."""
    def ratio(sel, key):
        n = [r[key] for r in sel if r["variant"] == "native"]
        p = [r[key] for r in sel if r["variant"] in ("pad", "rule")]
        return min(p) / min(n) if n and p else None

    points = {}
    for r in rows:
        points.setdefault((r["option"], r["causal"], r["d"], r["s"], r["dtype"]), []).append(r)
    print("pad / native: GPU | eager")
    for opt in OPTIONS:
        for d in HEAD_DIMS:
            cells = []
            for s in SEQLENS:
                for dt in DTYPES:
                    sel = points.get((opt, OPTIONS[opt][0], d, s, dt))
                    if sel:
                        g, e = ratio(sel, "ms"), ratio(sel, "eager_ms")
                        if g is not None:
                            cells.append(f"{s // 512 * 0.5:g}k {dt[:2]} {g:.2f}|{e:.2f}")
            print(f"{opt:17s} d{d:<3d} " + "  ".join(cells))
    allr = sorted(((ratio(sel, "ms"), ratio(sel, "eager_ms"), key) for key, sel in points.items()
                   if ratio(sel, "ms") is not None), key=lambda x: x[0])
    if allr:
        print(f"\nall points: GPU {allr[0][0]:.2f}-{allr[-1][0]:.2f}, eager "
              f"{min(x[1] for x in allr):.2f}-{max(x[1] for x in allr):.2f}; GPU over 1.02:",
              "; ".join(f"{k[0]} d{k[2]} {k[3]} {k[4][:2]} {g:.2f}|{e:.2f}" for g, e, k in allr if g > 1.02) or "none")
    print("\nworst over options (narrow windows apart) and dtypes, GPU | eager; first winning length")
    for causal in (False, True):
        for d in HEAD_DIMS:
            worst = {}
            for (opt, c, dd, s, dt), sel in points.items():
                if c != causal or dd != d or opt == "window (256, 0)":
                    continue
                g, e = ratio(sel, "ms"), ratio(sel, "eager_ms")
                if g is None:
                    continue
                wg, we = worst.get(s, (0.0, 0.0))
                worst[s] = (max(wg, g), max(we, e))
            lens = sorted(worst)
            first = next((s for i, s in enumerate(lens) if all(worst[t][0] < 1.0 for t in lens[i:])), None)
            print(f"{'causal' if causal else 'full  '} d{d:<3d} "
                  + "  ".join(f"{s}: {worst[s][0]:.2f}|{worst[s][1]:.2f}" for s in lens) + f"   from {first}")


if __name__ == "__main__":
    main()
