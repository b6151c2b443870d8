"""The d sink_logits rule of the GPU feature tests (tests/test_gpu_features.py check_dsink), exercised on the CPU:
run_padded_case with the NumPy path in place of the CuPy one.

Two GPU seeds failed the rule as it stood (max|dsink - ref64| <= 3 x the naive's error + 1e-4 + 1 % of
max|ref|): d sink carries the rounding of the out the backward is handed (D = rowsum(dout * out), as
FlashAttention forms it), which the naive autograd's d sink does not. The NumPy path, exact for its inputs,
reproduces both; check_dsink now takes out the shift that out's deviation causes (dsink_out_shift) before the
rule. These tests replay the two seeds, and check that the rule still sees a wrong formula and a wrong sum.
"""

import types

import numpy as np
import pytest

import test_gpu_features as G

SEEDS = (3188955339975619768, 2287796830739956395)  # sessions 9 and 12, bf16 head_dim 256, 77 x 300 keys


@pytest.fixture
def numpy_case(monkeypatch):
    import cuflash

    monkeypatch.setattr(G, "_dev", np.asarray)
    monkeypatch.setattr(G, "_host", np.asarray)
    monkeypatch.setattr(G, "_cupy", lambda: types.SimpleNamespace(ndarray=np.ndarray))
    monkeypatch.setattr(G, "poison", lambda *a, **k: None)

    def run(seed):
        G.run_padded_case(cuflash, seed=seed, dtype="bfloat16", batch=2, sq=77, sk=300, h=4, hkv=1, d=256,
                          causal=False, deterministic=False, fs=G.FEATURES_BY_NAME["sinklogits"], label="numpy")

    return run


@pytest.mark.parametrize("seed", SEEDS)
def test_gpu_seeds_replayed_on_numpy(numpy_case, seed):
    numpy_case(seed)


@pytest.mark.parametrize("where", ["formula", "sum"])
def test_rule_sees_a_wrong_dsink(numpy_case, monkeypatch, where):
    """d sink off by 2 % of max|ref|: in the formula (the definition moves with it: rule (a) must fail), or
    in the sum alone (rule (b))."""
    real = G.check_dsink

    def skewed(dsink, ref, naive, self_val, self_abs, nheads, msg, shift):
        e = 0.02 * float(np.abs(ref).max())
        return real(dsink + np.float32(e), ref, naive, self_val + (e if where == "formula" else 0.0), self_abs,
                    nheads, msg, shift)

    monkeypatch.setattr(G, "check_dsink", skewed)
    want = "dsink - ref64 - shift" if where == "formula" else "differs from -sum exp"
    with pytest.raises(AssertionError, match=want):
        numpy_case(5)
