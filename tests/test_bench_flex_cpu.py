"""bench/flex_variants.py (the FlexAttention provider of bench/bench_flex.py): each variant's Flex mask
and score_mod must compute the attention cuflash computes for the same option. On the CPU, in float64,
uncompiled Flex against cuflash's float64 reference (cuflash/_reference.py) with the option itself,
on fresh random inputs; and cuflash's own CPU path against Flex in bfloat16 (both through the
same layout conversion the bench uses). A wrong mask, sign or scale moves the float64 result by far
more than the 1e-9 allowed."""

import os
import sys
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
flex_mod = pytest.importorskip("torch.nn.attention.flex_attention")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import flex_variants as fv  # noqa: E402

import cuflash  # noqa: E402
from cuflash._reference import attention_reference  # noqa: E402

VARIANTS = ("window_40", "window_4096", "alibi", "softcap", "packed")


def _inputs(rng, variant, dtype):
    h, d = 3, 32
    if variant == "packed":
        lengths = [int(x) for x in rng.integers(1, 120, size=4)]
        shape = (sum(lengths), h, d)
    else:
        lengths = None
        shape = (2, int(rng.integers(100, 200)), h, d)
    q, k, v = (torch.from_numpy(rng.standard_normal(shape)).to(dtype) for _ in range(3))
    return q, k, v, lengths


def _reference(variant, q, k, v, lengths):
    """float64 out of cuflash's reference with the variant's cuflash options, cuflash layout."""
    a = [x.double().numpy() for x in (q, k, v)]
    if variant == "packed":
        outs, off = [], 0
        for n in lengths:
            sl = [x[None, off:off + n] for x in a]
            outs.append(attention_reference(*sl, causal=True)[0][0])
            off += n
        return np.concatenate(outs)
    kw = {}
    if variant.startswith("window_"):
        kw["window"] = (int(variant.split("_")[1]), 0)
    elif variant == "alibi":
        kw["alibi_slopes"] = fv.alibi_slopes(torch, q.shape[2], "cpu").numpy()
    elif variant == "softcap":
        kw["softcap"] = fv.SOFTCAP
    return attention_reference(*a, causal=True, **kw)[0]


def _flex(variant, q, k, v, lengths):
    pk = variant == "packed"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = fv.flex_call(torch, flex_mod.flex_attention, variant, fv.to_flex(q, pk), fv.to_flex(k, pk),
                           fv.to_flex(v, pk), lengths)()
    return fv.from_flex(out, pk)


@pytest.mark.parametrize("variant", VARIANTS)
def test_flex_variant_matches_reference_float64(variant):
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    q, k, v, lengths = _inputs(rng, variant, torch.bfloat16)
    q, k, v = (x.double() for x in (q, k, v))  # bf16-representable values, float64 arithmetic
    got = _flex(variant, q, k, v, lengths).numpy()
    want = _reference(variant, q, k, v, lengths)
    err = np.abs(got - want).max()
    assert np.isfinite(got).all() and err < 1e-9, f"seed {seed}: {variant} max |flex - reference| = {err}"


@pytest.mark.parametrize("variant", VARIANTS)
def test_cuflash_cpu_matches_flex_bf16(variant):
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    q, k, v, lengths = _inputs(rng, variant, torch.bfloat16)
    want = _reference(variant, q, k, v, lengths)
    got_cf = fv.cuflash_call(torch, cuflash, variant, q, k, v, lengths)().double().numpy()
    got_flex = _flex(variant, q, k, v, lengths).double().numpy()
    # Both in bf16: each within a few bf16 ulps of the float64 result (|out| <= max |v| < 6).
    for name, got in (("cuflash", got_cf), ("flex", got_flex)):
        err = np.abs(got - want).max()
        assert err < 0.05, f"seed {seed}: {variant} {name} max error {err}"


def test_bench_flex_runs_on_cpu():
    """bench/bench_flex.py's measuring loop end to end on the CPU (uncompiled Flex, a wall-clock
    timer, a tiny shape, the forward pass: Flex has no CPU backward): every variant measured, both
    providers' forwards agree, and the report states the target line."""
    import time

    import bench_flex

    args = bench_flex.parse_args(["--seqlens", "160", "--reps", "1"])

    def timer(torch_, fn, a):
        t = time.perf_counter()
        fn()
        ms = (time.perf_counter() - t) * 1e3
        return ms, ms, 1

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rows, checks = bench_flex.run(torch, cuflash, args, log=lambda *a, **k: None, device="cpu",
                                      shape=(2, 2, 32), compile_flex=False, timer=timer, passes=("fwd",),
                                      eager_timer=lambda torch_, fn, n: timer(torch_, fn, None))
    assert not [r for r in rows if "error" in r], [r["error"] for r in rows if "error" in r]
    assert len(rows) == len(fv.VARIANTS) * 2
    assert len(checks) == len(fv.VARIANTS)
    for c in checks:
        assert not c["nan"] and c["max_abs_diff"] < 0.05, c
    text = bench_flex.report(rows, checks)
    assert "target cuflash / Flex >= 1.0" in text and len(bench_flex.ratios(rows)) == len(fv.VARIANTS)
    assert len(bench_flex.ratios(rows, "tflops_eager")) == len(fv.VARIANTS)  # and single eager calls


@pytest.mark.parametrize("rounds", [1, 3])
def test_bench_flex_providers_take_turns(rounds):
    """bench_flex.run with --rounds: per variant and pass, cuflash and Flex take turns `rounds` times
    (GPU-time turns, then eager turns), each turn one timer call; each row keeps its provider's round
    figures. The provider is told apart by its output: Flex's is (batch, heads, seqlen, head_dim)."""
    import bench_flex

    args = bench_flex.parse_args(["--seqlens", "160", "--reps", "6", "--variants", "softcap", "packed",
                                  "--rounds", str(rounds)])
    order = []

    def who(out):
        return "flex" if out.dim() == 4 and out.shape[1] == 2 else "cuflash"

    def timer(torch_, fn, a):
        assert a.reps == -(-6 // rounds) and a.min_time == pytest.approx(args.min_time / rounds)
        p = who(fn())
        order.append(("gpu", p))
        ms = 1.0 if p == "cuflash" else 2.0
        return ms, ms, a.reps

    def eager_timer(torch_, fn, n):
        order.append(("eager", who(fn())))
        return 3.0, 3.0, n

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rows, _checks = bench_flex.run(torch, cuflash, args, log=lambda *a, **k: None, device="cpu",
                                       shape=(2, 2, 32), compile_flex=False, timer=timer, passes=("fwd",),
                                       eager_timer=eager_timer)
    assert not [r for r in rows if "error" in r]
    pair = lambda r: ("flex", "cuflash") if r % 2 else ("cuflash", "flex")  # noqa: E731 (serpentine)
    turns = [("gpu", p) for r in range(rounds) for p in pair(r)]
    turns += [("eager", p) for r in range(rounds) for p in pair(r)]
    assert order == turns * 2   # two variants
    for r in rows:
        assert r["rounds"] == rounds and len(r["ms_rounds"]) == rounds
        assert r["ms"] == (1.0 if r["provider"] == "cuflash" else 2.0)
        assert r["reps"] == rounds * -(-6 // rounds) and r["reps_eager"] == args.eager_reps
    assert [x for *_, x in bench_flex.ratios(rows)] == [2.0, 2.0]
