#!/usr/bin/env python3
"""Plots of a bench/bench.py results file, in the style of the FlashAttention papers.

    python bench/plot.py results.json --out DIR [--dtype bfloat16]

Writes into DIR (made if missing):
    speed_fwd_<dtype>.png, speed_bwd_<dtype>.png, speed_fwd_bwd_<dtype>.png
        grouped bars: TFLOP/s by sequence length, one bar per provider; a 2 x 2 grid of panels
        (head_dim x causal), numbers on the bars.
    memory_<dtype>.png
        extra device memory of one forward + backward by sequence length, one line per provider
        (log scale), same 2 x 2 grid.
    vs_naive_<dtype>.png (when the naive PyTorch attention ran)
        the FlashAttention paper's headline: speedup over the naive attention (forward + backward
        time) and memory reduction (its extra memory / the provider's), by sequence length.

Needs matplotlib and nothing else (no GPU, no torch): a README plot can be re-made from the JSON
anywhere. bench/bench.py imports `make_plots` from here, so both draw the same figures.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

# Provider keys as bench.py writes them, in the order they are drawn, with labels and colours.
PROVIDER_ORDER = ("naive", "sdpa_efficient", "sdpa_flash", "flash_attn", "sdpa_cudnn", "cuflash")
LABELS = {
    "cuflash": "cuflash",
    "sdpa_flash": "SDPA flash (FlashAttention-2)",
    "sdpa_cudnn": "SDPA cuDNN",
    "sdpa_efficient": "SDPA memory-efficient",
    "flash_attn": "flash-attn (flash_attn_func)",
    "naive": "PyTorch (naive)",
}
COLORS = {
    "naive": "#8c8c8c",
    "sdpa_efficient": "#9ecae1",
    "sdpa_flash": "#3182bd",
    "flash_attn": "#756bb1",
    "sdpa_cudnn": "#31a354",
    "cuflash": "#e6550d",
}
MARKERS = {"naive": "o", "sdpa_efficient": "v", "sdpa_flash": "s", "flash_attn": "D", "sdpa_cudnn": "^",
           "cuflash": "o"}
VS_NAIVE_PROVIDERS = ("sdpa_flash", "cuflash")   # the FlashAttention paper's headline comparison
PASS_TITLES = {"fwd": "forward", "bwd": "backward", "fwd+bwd": "forward + backward"}
PASS_FILES = {"fwd": "fwd", "bwd": "bwd", "fwd+bwd": "fwd_bwd"}
SHORT_DTYPE = {"float16": "fp16", "bfloat16": "bf16"}


def seqlen_label(s: int) -> str:
    return f"{s // 1024}k" if s >= 1024 and s % 1024 == 0 else str(s)


def _providers_in(rows):
    present = {r["provider"] for r in rows}
    order = [p for p in PROVIDER_ORDER if p in present]
    return order + sorted(present - set(order))


def _gpu_name(data) -> str:
    return data.get("meta", {}).get("device") or "unknown GPU"


def _panel_keys(rows):
    """(head_dim, causal) pairs present, head_dim ascending, non-causal first."""
    return sorted({(r["head_dim"], bool(r["causal"])) for r in rows})


def _grid(plt, n_panels, width=7.0, height=4.2):
    ncols = 2 if n_panels > 1 else 1
    nrows = -(-n_panels // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(width * ncols, height * nrows + 0.9), squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax in flat[n_panels:]:
        ax.set_visible(False)
    return fig, flat[:n_panels]


def _bar_label(ax, x, y, text, rotate, fontsize=6.5):
    ax.annotate(text, (x, y), xytext=(0, 2), textcoords="offset points", ha="center", va="bottom",
                fontsize=fontsize, rotation=90 if rotate else 0)


def _missing_label(ax, x, text):
    ax.annotate(text, (x, 0), xytext=(0, 2), textcoords="offset points", ha="center", va="bottom",
                fontsize=6, rotation=90, color="#b00000")


def plot_speed(plt, data, pass_name, dtype, path) -> bool:
    rows = [r for r in data.get("results", []) if r["pass"] == pass_name and r["dtype"] == dtype]
    if not rows:
        return False
    panels = _panel_keys(rows)
    providers = _providers_in(rows)
    fig, axes = _grid(plt, len(panels))
    n = len(providers)
    width = 0.8 / n
    rotate = n >= 4
    ymax_all = 0.0
    for ax, (hd, causal) in zip(axes, panels):
        prow = [r for r in rows if r["head_dim"] == hd and bool(r["causal"]) == causal]
        seqlens = sorted({r["seqlen"] for r in prow})
        nheads = sorted({r["nheads"] for r in prow})
        for i, prov in enumerate(providers):
            for j, s in enumerate(seqlens):
                x = j + (i - (n - 1) / 2) * width
                match = [r for r in prow if r["provider"] == prov and r["seqlen"] == s]
                if not match:
                    continue
                r = match[0]
                if r.get("tflops") is not None:
                    ax.bar(x, r["tflops"], width, color=COLORS.get(prov, "#444444"), edgecolor="white",
                           linewidth=0.4, label=LABELS.get(prov, prov) if j == 0 else None)
                    _bar_label(ax, x, r["tflops"], f"{r['tflops']:.0f}", rotate)
                    ymax_all = max(ymax_all, r["tflops"])
                elif r.get("skipped"):
                    _missing_label(ax, x, "OOM" if "memory" in r["skipped"] else "skip")
                elif r.get("error"):
                    _missing_label(ax, x, "err")
        ax.set_xticks(range(len(seqlens)))
        ax.set_xticklabels([seqlen_label(s) for s in seqlens])
        ax.set_xlabel("Sequence length")
        ax.set_ylabel("Speed (TFLOP/s)")
        heads = "/".join(str(h) for h in nheads)
        ax.set_title(f"head dim {hd} ({heads} heads), {'causal' if causal else 'non-causal'}", fontsize=11)
        ax.grid(axis="y", alpha=0.3)
        ax.set_axisbelow(True)
    for ax in axes:
        ax.set_ylim(0, ymax_all * 1.18 if ymax_all > 0 else 1)
    _legend(fig, axes, providers)
    fig.suptitle(f"Attention {PASS_TITLES.get(pass_name, pass_name)} speed, {SHORT_DTYPE.get(dtype, dtype)} "
                 f"— {_gpu_name(data)}", fontsize=14, fontweight="bold")
    _footer(fig, data, "batch x seqlen = 16384 tokens, hidden 2048; " + _flop_note(data, pass_name))
    _save(fig, path)
    plt.close(fig)
    return True


def _flop_note(data, pass_name) -> str:
    base = "FLOPs = 4·batch·heads·seqlen²·head_dim (halved when causal)"
    mult = {"fwd": "", "bwd": " × 2.5", "fwd+bwd": " × 3.5"}.get(pass_name, "")
    return base + mult


def _legend(fig, axes, providers):
    handles, labels = [], []
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    if handles:
        fig.legend(handles, labels, loc="upper center", ncol=min(len(labels), 6), frameon=False,
                   bbox_to_anchor=(0.5, 0.96), fontsize=10)


def _footer(fig, data, text):
    meta = data.get("meta", {})
    bits = [text]
    if meta.get("torch"):
        bits.append(f"torch {meta['torch']}")
    if meta.get("cuflash"):
        bits.append(f"cuflash {meta['cuflash']}")
    if meta.get("timestamp_utc"):
        bits.append(meta["timestamp_utc"][:10])
    fig.text(0.5, 0.005, " | ".join(bits), ha="center", va="bottom", fontsize=8, color="#555555")


def _save(fig, path):
    fig.tight_layout(rect=(0, 0.025, 1, 0.925))
    fig.savefig(path, dpi=130)


def plot_memory(plt, data, dtype, path) -> bool:
    rows = [r for r in data.get("memory", []) if r["dtype"] == dtype]
    if not rows:
        return False
    panels = _panel_keys(rows)
    providers = _providers_in(rows)
    fig, axes = _grid(plt, len(panels))
    for ax, (hd, causal) in zip(axes, panels):
        prow = [r for r in rows if r["head_dim"] == hd and bool(r["causal"]) == causal]
        seqlens = sorted({r["seqlen"] for r in prow})
        for prov in providers:
            pts = sorted((r["seqlen"], r["extra_bytes"] / 2**30) for r in prow
                         if r["provider"] == prov and r.get("extra_bytes") is not None)
            if not pts:
                continue
            xs = [seqlens.index(s) for s, _ in pts]
            ax.plot(xs, [m for _, m in pts], marker=MARKERS.get(prov, "o"), color=COLORS.get(prov, "#444444"),
                    label=LABELS.get(prov, prov), linewidth=2.2 if prov == "cuflash" else 1.4,
                    linestyle="-" if prov in ("cuflash", "naive") else "--", markersize=6 if prov == "cuflash" else 5,
                    zorder=3 if prov == "cuflash" else 2)
            if prov in ("cuflash", "naive", "sdpa_flash"):   # the others usually sit on one of these lines
                for x, (_, m) in zip(xs, pts):
                    ax.annotate(_fmt_gib(m), (x, m), xytext=(0, -11 if prov == "cuflash" else 5),
                                textcoords="offset points", ha="center", fontsize=7,
                                color=COLORS.get(prov, "#444444"))
            missing = [r for r in prow if r["provider"] == prov and r.get("extra_bytes") is None
                       and (r.get("skipped") or r.get("error"))]
            for r in missing:
                ax.annotate("OOM" if "memory" in str(r.get("skipped", "")) else "err",
                            (seqlens.index(r["seqlen"]), 1), xycoords=("data", "axes fraction"),
                            xytext=(0, -12), textcoords="offset points", ha="center", fontsize=7,
                            color=COLORS.get(prov, "#444444"))
        ax.set_yscale("log")
        vals = [r["extra_bytes"] / 2**30 for r in prow if r.get("extra_bytes")]
        if vals:
            ax.set_ylim(min(vals) / 2.5, max(vals) * 2.5)
        ax.set_xticks(range(len(seqlens)))
        ax.set_xticklabels([seqlen_label(s) for s in seqlens])
        ax.set_xlabel("Sequence length")
        ax.set_ylabel("Extra memory, fwd + bwd (GiB)")
        ax.set_title(f"head dim {hd}, {'causal' if causal else 'non-causal'}", fontsize=11)
        ax.grid(alpha=0.3, which="both")
    _legend(fig, axes, providers)
    fig.suptitle(f"Attention memory (forward + backward), {SHORT_DTYPE.get(dtype, dtype)} — {_gpu_name(data)}",
                 fontsize=14, fontweight="bold")
    _footer(fig, data, "peak allocated during one forward + backward minus what was allocated before "
                       "(inputs and dout); includes dq, dk, dv")
    _save(fig, path)
    plt.close(fig)
    return True


def _fmt_gib(m: float) -> str:
    if m >= 1:
        return f"{m:.1f}G"
    return f"{m * 1024:.0f}M"


def find_row(rows, **kw):
    for r in rows:
        if all(r.get(k) == v for k, v in kw.items()):
            return r
    return None


def vs_naive_rows(data, providers=VS_NAIVE_PROVIDERS):
    """The FlashAttention paper's comparison, from a results dict: per (dtype, head_dim, causal, seqlen)
    and provider, speedup = naive fwd+bwd time / provider fwd+bwd time and memory_reduction = naive
    extra memory / provider extra memory (None where either side is missing)."""
    res, mem = data.get("results", []), data.get("memory", [])
    out = []
    keys = sorted({(r["dtype"], r["head_dim"], bool(r["causal"]), r["seqlen"]) for r in res + mem})
    for dt, hd, c, s in keys:
        sel = dict(dtype=dt, head_dim=hd, causal=c, seqlen=s)
        nt = find_row(res, provider="naive", **{"pass": "fwd+bwd"}, **sel)
        nm = find_row(mem, provider="naive", **sel)
        if not ((nt and nt.get("ms")) or (nm and nm.get("extra_bytes"))):
            continue
        for prov in providers:
            pt = find_row(res, provider=prov, **{"pass": "fwd+bwd"}, **sel)
            pm = find_row(mem, provider=prov, **sel)
            row = dict(sel, provider=prov, speedup=None, memory_reduction=None)
            if nt and nt.get("ms") and pt and pt.get("ms"):
                row["speedup"] = nt["ms"] / pt["ms"]
            if nm and nm.get("extra_bytes") and pm and pm.get("extra_bytes"):
                row["memory_reduction"] = nm["extra_bytes"] / pm["extra_bytes"]
            if row["speedup"] is not None or row["memory_reduction"] is not None:
                out.append(row)
    return out


def plot_vs_naive(plt, data, dtype, path) -> bool:
    vn = data.get("vs_naive")
    rows = [r for r in (vn if vn is not None else vs_naive_rows(data)) if r["dtype"] == dtype]
    if not rows:
        return False
    panels = _panel_keys(rows)
    providers = _providers_in(rows)
    ncols = len(panels)
    fig, axes = plt.subplots(2, ncols, figsize=(4.6 * ncols, 8.2), squeeze=False)
    n = len(providers)
    width = 0.8 / max(n, 1)
    for col, (hd, causal) in enumerate(panels):
        prow = [r for r in rows if r["head_dim"] == hd and bool(r["causal"]) == causal]
        seqlens = sorted({r["seqlen"] for r in prow})
        for row_i, (key, ylabel) in enumerate((("speedup", "Speedup over naive (fwd + bwd)"),
                                               ("memory_reduction", "Memory reduction vs naive"))):
            ax = axes[row_i][col]
            for i, prov in enumerate(providers):
                for j, s in enumerate(seqlens):
                    match = [r for r in prow if r["provider"] == prov and r["seqlen"] == s]
                    if not match or match[0].get(key) is None:
                        continue
                    x = j + (i - (n - 1) / 2) * width
                    val = match[0][key]
                    ax.bar(x, val, width, color=COLORS.get(prov, "#444444"), edgecolor="white", linewidth=0.4,
                           label=LABELS.get(prov, prov) if j == 0 else None)
                    _bar_label(ax, x, val, f"{val:.1f}x" if val < 10 else f"{val:.0f}x", rotate=False)
            ax.axhline(1.0, color="#444444", linewidth=0.8, linestyle="--")
            ax.set_xticks(range(len(seqlens)))
            ax.set_xticklabels([seqlen_label(s) for s in seqlens])
            ax.set_xlabel("Sequence length")
            if col == 0:
                ax.set_ylabel(ylabel)
            if key == "memory_reduction":
                ax.set_yscale("log")
                vals = [r[key] for r in prow if r.get(key)]
                if vals:
                    ax.set_ylim(min(0.8, min(vals) / 1.5), max(vals) * 3)
            else:
                top = max([r[key] for r in prow if r.get(key) is not None] or [1.0])
                ax.set_ylim(0, top * 1.2)
            ax.set_title(f"head dim {hd}, {'causal' if causal else 'non-causal'}", fontsize=11)
            ax.grid(axis="y", alpha=0.3, which="both")
            ax.set_axisbelow(True)
    _legend(fig, [ax for row in axes for ax in row], providers)
    fig.suptitle(f"Against the naive PyTorch attention, {SHORT_DTYPE.get(dtype, dtype)} — {_gpu_name(data)}",
                 fontsize=14, fontweight="bold")
    _footer(fig, data, "speedup = naive fwd+bwd time / provider fwd+bwd time; "
                       "memory reduction = naive extra memory / provider extra memory")
    _save(fig, path)
    plt.close(fig)
    return True


def make_plots(data, out_dir, dtype="bfloat16"):
    """Writes every figure that `data` (a bench.py results dict) has figures for; returns the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    short = SHORT_DTYPE.get(dtype, dtype)
    written = []
    passes = [p for p in ("fwd", "bwd", "fwd+bwd") if any(r["pass"] == p for r in data.get("results", []))]
    for p in passes:
        path = os.path.join(out_dir, f"speed_{PASS_FILES[p]}_{short}.png")
        if plot_speed(plt, data, p, dtype, path):
            written.append(path)
    path = os.path.join(out_dir, f"memory_{short}.png")
    if plot_memory(plt, data, dtype, path):
        written.append(path)
    path = os.path.join(out_dir, f"vs_naive_{short}.png")
    if plot_vs_naive(plt, data, dtype, path):
        written.append(path)
    return written


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("json", help="a results file written by bench/bench.py --json")
    p.add_argument("--out", default="plots", help="output directory (default ./plots)")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float16"],
                   help="dtype to plot (default: the file's plot dtype, else bfloat16)")
    args = p.parse_args(argv)
    with open(args.json) as f:
        data = json.load(f)
    dtype = args.dtype or data.get("meta", {}).get("plot_dtype") or "bfloat16"
    written = make_plots(data, args.out, dtype)
    if not written:
        print(f"plot: no {dtype} figures in {args.json}", file=sys.stderr)
        return 1
    for w in written:
        print(w)
    return 0


if __name__ == "__main__":
    sys.exit(main())
