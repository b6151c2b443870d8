#!/usr/bin/env python3
"""How often the near-equal-scores criterion fails, per setting: tests/test_near_equal_scores.py's draws
(16 x 2 query rows, 4 heads over 2 kv heads, scores ~1e-3 apart: tiny queries or a 1e-3 softcap), many
more of them than a test run makes, through the NumPy forward (--path numpy) or cuflash.attention on the
GPU (--path gpu, CuPy arrays). Per setting: the draws, how many exceed the bound (max|out - ref| > 2 x
max|naive - ref| + 1e-5, against the float64 reference), the worst ratio err / bound, and the seed (the
draws replay from it: numpy.random.default_rng(seed), the test's _draw in order).

Usage: python bench/dev/near_equal_rate.py [--path gpu] [--draws 4000] [--head-dims 16 64 128]
       [--keys 8] [--modes tiny_q] [--dtypes bf16] [--seed S] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import numpy as np  # noqa: E402

from cuflash._reference import attention_reference, max_abs_err  # noqa: E402
from test_near_equal_scores import BF16, FACTOR, FLOOR, _draw  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--path", choices=["numpy", "gpu"], default="gpu")
    ap.add_argument("--draws", type=int, default=4000)
    ap.add_argument("--head-dims", type=int, nargs="+", default=[16, 64, 128])
    ap.add_argument("--keys", type=int, nargs="+", default=[8])
    ap.add_argument("--modes", nargs="+", default=["tiny_q"], choices=["tiny_q", "softcap"])
    ap.add_argument("--dtypes", nargs="+", default=["bf16"], choices=["bf16", "fp16"])
    ap.add_argument("--seed", type=int)
    ap.add_argument("--json")
    args = ap.parse_args()
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
    if args.path == "gpu":
        import cuflash
        from test_gpu_features import _dev, _host
    else:
        from cuflash._cpu import attention_forward_numpy
    rows = []
    for dname in args.dtypes:
        dtype = BF16 if dname == "bf16" else np.dtype(np.float16)
        for mode in args.modes:
            for keys in args.keys:
                for d in args.head_dims if args.path == "gpu" else [16]:
                    rng = np.random.default_rng(seed)
                    over, worst, worst_i, t0 = 0, 0.0, -1, time.perf_counter()
                    for i in range(args.draws):
                        q, k, v, opts = _draw(rng, dtype, keys, mode, head_dim=d)
                        scale = 1.0 / math.sqrt(d)
                        if args.path == "gpu":
                            out = _host(cuflash.attention(_dev(q), _dev(k), _dev(v), **opts))
                        else:
                            out, _ = attention_forward_numpy(q, k, v, False, scale, 64, 64, **opts)
                        ref, _ = attention_reference(q, k, v, False, scale, **opts)
                        naive, _ = attention_reference(q, k, v, False, scale, compute_dtype="input", **opts)
                        bound = FACTOR * max_abs_err(naive, ref) + FLOOR
                        r = max_abs_err(np.asarray(out), ref) / bound
                        over += r > 1
                        if r > worst:
                            worst, worst_i = r, i
                    row = dict(path=args.path, dtype=dname, mode=mode, keys=keys, head_dim=d, draws=args.draws,
                               over=int(over), worst=worst, worst_draw=worst_i, seed=seed,
                               seconds=time.perf_counter() - t0)
                    rows.append(row)
                    print(f"{args.path} {dname} {mode:7s} {keys} keys d{d:<3d}: {over} of {args.draws} over the "
                          f"bound, worst {worst:.3f} (draw {worst_i}), seed {seed}, {row['seconds']:.0f} s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
