"""Smoke test of the feature kernels (lengths, packed batches, window, sinks, ALiBi, softcap) on CuPy
arrays, forward and backward, against a small float64 dense reference written here from the rules in
cuflash/_features.py (independent of cuflash/_reference.py, so the two cross-check each other).

Usage: PYTHONPATH=. python bench/dev/smoke_feat.py [--json PATH]. Prints one line per case and a
summary last; exits 1 on any failure. Error bound per output: 2 * (naive fp32-softmax error on the
input-dtype-rounded scores) + floor is too elaborate here; it checks max error <= tol relative to the
output's scale (smoke level: the tests in tests/test_gpu_features.py hold the real criterion).
"""

import argparse
import json
import sys
import time

import numpy as np


def dense_reference(q, k, v, scale, q_len, k_len, left, right, sinks, slopes, cap, sink, dout):
    """float64 out, lse, dq, dk, dv, dsink for one padded batch; q (b, sq, h, d), k/v (b, sk, hk, d)."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    grp = h // hk
    qf, kf, vf, dof = (x.astype(np.float64) for x in (q, k, v, dout))
    out = np.zeros((b, sq, h, d))
    lse = np.full((b, h, sq), -np.inf)
    dq, dk, dv = np.zeros_like(qf), np.zeros_like(kf), np.zeros_like(vf)
    dsink = np.zeros(h)
    for bi in range(b):
        ql, kl = int(q_len[bi]), int(k_len[bi])
        i = np.arange(sq)[:, None]
        j = np.arange(sk)[None, :]
        ip = i + kl - ql
        vis = (j < kl) & (i < ql)
        if right >= 0:
            vis &= j <= ip + right
        if left >= 0:
            vis &= (j >= ip - left) | (j < sinks)
        for hi in range(h):
            kh = hi // grp
            x = scale * qf[bi, :, hi] @ kf[bi, :, kh].T
            t = np.tanh(x / cap) if cap > 0 else np.zeros_like(x)
            s = cap * t if cap > 0 else x
            if slopes is not None:
                sl = slopes[hi] if slopes.ndim == 1 else slopes[bi, hi]
                s = s - sl * np.abs(ip - j)
            s = np.where(vis, s, -np.inf)
            m = s.max(axis=1, keepdims=True)
            if sink is not None:
                m = np.maximum(m, sink[hi])
            m = np.where(np.isfinite(m), m, 0)
            e = np.where(vis, np.exp(s - m), 0)
            den = e.sum(axis=1, keepdims=True) + (np.exp(sink[hi] - m) if sink is not None else 0)
            valid = (den[:, 0] > 0) & (np.arange(sq) < ql)
            den_safe = np.where(den > 0, den, 1)
            p = e / den_safe
            p[~valid] = 0
            o = p @ vf[bi, :, kh]
            out[bi, :, hi] = o
            lse[bi, hi] = np.where(valid, (m + np.log(den_safe))[:, 0], -np.inf)
            do = dof[bi, :, hi]
            dp = do @ vf[bi, :, kh].T
            delta = (do * o).sum(axis=1, keepdims=True)
            ds = p * (dp - delta)
            if cap > 0:
                ds = ds * (1 - t * t)
            dq[bi, :, hi] = scale * ds @ kf[bi, :, kh]
            dk[bi, :, kh] += scale * ds.T @ qf[bi, :, hi]
            dv[bi, :, kh] += p.T @ do
            if sink is not None:
                psink = np.where(valid, np.exp(sink[hi] - lse[bi, hi]), 0)
                dsink[hi] -= (psink * delta[:, 0]).sum()
    return out, lse, dq, dk, dv, dsink


def main():
    import cupy as cp
    import ml_dtypes

    import cuflash

    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    BF16 = np.dtype(ml_dtypes.bfloat16)
    cases = [
        # (dtype, d, b, sq, sk, h, hk, causal, q_len, k_len, window, sinks, alibi, cap, sink)
        ("bfloat16", 64, 2, 200, 200, 4, 2, True, None, None, (37, 0), 0, None, 0, False),
        ("float16", 128, 2, 130, 257, 4, 4, False, None, [200, 0], None, 0, None, 0, False),
        ("bfloat16", 64, 3, 77, 77, 2, 1, True, [0, 1, 77], [77, 5, 40], None, 0, None, 0, False),
        ("float16", 64, 1, 300, 300, 2, 2, True, None, None, (64, 0), 4, None, 0, False),
        ("bfloat16", 96, 2, 150, 150, 4, 2, False, None, None, None, 0, "h", 0, False),
        ("float16", 128, 2, 150, 180, 4, 2, True, None, None, None, 0, "bh", 0, False),
        ("bfloat16", 64, 2, 128, 128, 2, 2, False, None, None, None, 0, None, 5.0, False),
        ("float16", 256, 1, 100, 100, 2, 1, True, None, None, None, 0, None, 0, True),
        ("bfloat16", 40, 2, 190, 190, 4, 2, False, None, None, (5, 7), 0, None, 0, False),
        ("float16", 128, 2, 140, 140, 4, 2, True, [140, 33], [140, 60], (20, 0), 3, "h", 10.0, True),
        ("bfloat16", 128, 1, 64, 300, 2, 2, False, None, None, (-1, 3), 0, None, 0, True),
        ("float16", 64, 1, 300, 64, 2, 1, True, None, None, (3, -1), 0, None, 0, False),
    ]
    results, fails = [], 0
    for case in cases:
        dt, d, b, sq, sk, h, hk, causal, ql, kl, window, sinks, alibi, cap, use_sink = case
        npdt = BF16 if dt == "bfloat16" else np.float16
        q = rng.standard_normal((b, sq, h, d)).astype(npdt)
        k = rng.standard_normal((b, sk, hk, d)).astype(npdt)
        v = rng.standard_normal((b, sk, hk, d)).astype(npdt)
        dout = rng.standard_normal((b, sq, h, d)).astype(npdt)
        q_len = np.array(ql if ql is not None else [sq] * b, dtype=np.int32)
        k_len = np.array(kl if kl is not None else [sk] * b, dtype=np.int32)
        slopes = None
        if alibi == "h":
            slopes = rng.uniform(0.01, 0.5, h).astype(np.float32)
        elif alibi == "bh":
            slopes = rng.uniform(0.01, 0.5, (b, h)).astype(np.float32)
        sink = rng.standard_normal(h).astype(np.float32) * 2 if use_sink else None
        left, right = window if window is not None else (-1, -1)
        if causal:
            right = 0
        scale = 1 / np.sqrt(d)
        ref = dense_reference(q, k, v, scale, q_len, k_len, left, right, sinks, slopes, cap, sink, dout)
        kw = dict(causal=causal, window=window, num_sink_tokens=sinks, softcap=cap or None,
                  q_lengths=cp.asarray(q_len) if ql is not None else None,
                  kv_lengths=cp.asarray(k_len) if kl is not None else None,
                  alibi_slopes=None if slopes is None else cp.asarray(slopes),
                  sink_logits=None if sink is None else cp.asarray(sink))
        qg, kg, vg, dog = (cp.asarray(x) for x in (q, k, v, dout))
        t0 = time.perf_counter()
        out, lse = cuflash.attention(qg, kg, vg, return_lse=True, **kw)
        grads = cuflash.attention_backward(dog, qg, kg, vg, out, lse, **kw)
        cp.cuda.Device().synchronize()
        secs = time.perf_counter() - t0
        got = [out, lse] + list(grads)
        names = ["out", "lse", "dq", "dk", "dv"] + (["dsink"] if use_sink else [])
        errs = {}
        ok = True
        for name, g, r in zip(names, got, ref):
            g = cp.asnumpy(g).astype(np.float64)
            r = np.asarray(r, dtype=np.float64)
            if name == "lse":
                fin = np.isfinite(r)
                if not np.array_equal(fin, np.isfinite(g)):
                    ok = False
                    errs[name] = "inf pattern differs"
                    continue
                g, r = g[fin], r[fin]
            if np.isnan(g).any():
                ok = False
                errs[name] = "NaN"
                continue
            scale_r = max(1.0, float(np.abs(r).max()) if r.size else 1.0)
            err = float(np.abs(g - r).max()) / scale_r if r.size else 0.0
            tol = 0.03 if dt == "bfloat16" else 0.01
            errs[name] = round(err, 5)
            if err > tol:
                ok = False
        fails += not ok
        print(("PASS" if ok else "FAIL"), case, errs, f"{secs:.2f}s", flush=True)
        results.append({"case": repr(case), "ok": ok, "errs": errs})

    # packed == padded, per sequence
    lens_q = [0, 1, 37, 130, 64]
    lens_k = [5, 0, 50, 130, 200]
    h, hk, d = 4, 2, 64
    cq = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    tq, tk = int(cq[-1]) + 3, int(ck[-1]) + 2  # rows past the last sequence
    q = cp.asarray(rng.standard_normal((tq, h, d)).astype(np.float16))
    k = cp.asarray(rng.standard_normal((tk, hk, d)).astype(np.float16))
    v = cp.asarray(rng.standard_normal((tk, hk, d)).astype(np.float16))
    dout = cp.asarray(rng.standard_normal((tq, h, d)).astype(np.float16))
    sink = cp.asarray(rng.standard_normal(h).astype(np.float32))
    out, lse = cuflash.attention_varlen(q, k, v, cp.asarray(cq), cp.asarray(ck), max(lens_q), max(lens_k), causal=True,
                                        return_lse=True, sink_logits=sink, window=(40, 0))
    dq, dk, dv, ds = cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cp.asarray(cq), cp.asarray(ck),
                                                       max(lens_q), max(lens_k), causal=True, sink_logits=sink,
                                                       window=(40, 0))
    ok = True
    ds_sum = cp.zeros(h, dtype=cp.float32)
    for bi in range(len(lens_q)):
        q0, q1, k0, k1 = int(cq[bi]), int(cq[bi + 1]), int(ck[bi]), int(ck[bi + 1])
        if q1 == q0 or k1 == k0:
            continue
        o1, l1 = cuflash.attention(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], causal=True, return_lse=True,
                                   sink_logits=sink, window=(40, 0))
        g1 = cuflash.attention_backward(dout[None, q0:q1], q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], o1, l1,
                                        causal=True, sink_logits=sink, window=(40, 0))
        ds_sum += g1[3]
        for a, bb in ((out[q0:q1], o1[0]), (lse[:, q0:q1], l1[0]), (dq[q0:q1], g1[0][0]), (dk[k0:k1], g1[1][0]),
                      (dv[k0:k1], g1[2][0])):
            if not bool(cp.array_equal(a, bb)):
                ok = False
                print("packed/padded mismatch in sequence", bi, float(cp.abs(a.astype(cp.float32) - bb.astype(cp.float32)).max()))
    tail_ok = bool((out[int(cq[-1]):] == 0).all()) and bool(cp.isneginf(lse[:, int(cq[-1]):]).all()) \
        and bool((dq[int(cq[-1]):] == 0).all()) and bool((dk[int(ck[-1]):] == 0).all())
    # sequence 1 has 1 query and 0 keys: out 0, lse = sink
    empty_ok = bool((out[int(cq[1]):int(cq[2])] == 0).all()) and bool(cp.allclose(lse[:, int(cq[1])], sink))
    ds_ok = bool(cp.allclose(ds, ds_sum, rtol=1e-4, atol=1e-4))
    print("packed vs padded:", "PASS" if ok else "FAIL", "tail:", tail_ok, "empty-k:", empty_ok, "dsink:", ds_ok)
    fails += not (ok and tail_ok and empty_ok and ds_ok)
    results.append({"case": "packed", "ok": ok and tail_ok and empty_ok and ds_ok})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print(f"SUMMARY smoke_feat: {len(results) - fails}/{len(results)} passed")
    sys.exit(1 if fails else 0)


if __name__ == "__main__":
    main()
