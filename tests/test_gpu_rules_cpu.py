"""The accuracy rules of the GPU feature tests (tests/test_gpu_features.py run_padded_case: dq / dk, and
check_dsink), exercised on the CPU: run_padded_case with the NumPy path in place of the CuPy one.

Every backward forms D = rowsum(dout * out) from the out it is handed, rounded to the input dtype (as
FlashAttention forms it); the naive autograd's D does not pass through out. Where one row's D error is the
largest term (a row with one query and a sink logit or a steep ALiBi slope), that rounding alone put dq or dk
outside the rule (3x the naive's error + 1e-4) in five GPU runs of sessions 8 and 9; d sink, one sum over every
row of the batch, carries it too, and put d sink outside its rule in sessions 9 and 12. The NumPy path, exact
for its inputs, reproduces each of those failures to the printed digits. So run_padded_case holds a dq or dk
outside the rule, with the same bound, against the exact gradients of the given out, and check_dsink takes
out the shift that out's deviation causes. These tests replay the seeds, and check that an error the
rounding of out does not explain still fails.
"""

import types

import numpy as np
import pytest

import test_gpu_features as G

# (feature, dtype, causal, head_dim, seqlen_q, seqlen_k, nheads, nheads_kv, deterministic, batch, seed)
GRAD_SEEDS = [
    ("lens+sinklogits", "float16", False, 96, 1, 300, 4, 1, True, "lengths", 5749519082516743148),   # dq
    ("lens+sinklogits", "float16", False, 96, 1, 300, 4, 1, True, "lengths", 127345327228258926),    # dk
    ("lens+sinklogits", "float16", False, 96, 128, 333, 4, 4, False, "lengths", 2675218138546244751),  # dk
    ("alibi_h", "bfloat16", True, 64, 1, 300, 4, 1, False, 2, 196078417100779651),                  # dk
    ("lens+sinklogits", "float16", True, 128, 1, 300, 4, 1, False, "lengths", 6481226003996618711),  # dq
]
# test_ws_feat_backward[sinklogits-bfloat16-full-d256-q77k300-h4kv1], sessions 9 and 12
DSINK_SEEDS = [("sinklogits", "bfloat16", False, 256, 77, 300, 4, 1, False, 2, seed)
               for seed in (3188955339975619768, 2287796830739956395)]


@pytest.fixture
def numpy_case(monkeypatch):
    import cuflash

    monkeypatch.setattr(G, "_dev", np.asarray)
    monkeypatch.setattr(G, "_host", np.asarray)
    monkeypatch.setattr(G, "_cupy", lambda: types.SimpleNamespace(ndarray=np.ndarray))
    monkeypatch.setattr(G, "poison", lambda *a, **k: None)

    def run(feature, dtype, causal, d, sq, sk, h, hkv, det, batch, seed):
        G.run_padded_case(cuflash, seed=seed, dtype=dtype, batch=G.LENGTHS_BATCH if batch == "lengths" else batch,
                          sq=sq, sk=sk, h=h, hkv=hkv, d=d, causal=causal, deterministic=det,
                          fs=G.FEATURES_BY_NAME[feature], label="numpy")

    return run


@pytest.mark.parametrize("case", GRAD_SEEDS + DSINK_SEEDS, ids=[str(c[-1]) for c in GRAD_SEEDS + DSINK_SEEDS])
def test_gpu_seeds_replayed_on_numpy(numpy_case, case):
    numpy_case(*case)


@pytest.mark.parametrize("name", ["dq", "dk", "dv"])
def test_grad_rule_sees_other_errors(numpy_case, monkeypatch, name):
    """The largest element of dq, dk or dv moved by 0.02-0.05 (tens of times the bound) at the first seed:
    the check fails, on both yardsticks for dq and dk."""
    import cuflash

    real = cuflash.attention_backward
    which = ("dq", "dk", "dv").index(name)

    def skewed(*args, **kw):
        grads = list(real(*args, **kw))
        flat = grads[which].reshape(-1)
        i = int(np.argmax(np.abs(flat.astype(np.float32))))
        flat[i] = flat[i] + flat.dtype.type(0.02 if name != "dv" else 0.05)
        return tuple(grads)

    monkeypatch.setattr(cuflash, "attention_backward", skewed)
    want = f"{name}: .*" + ("and against the exact gradients of the given out" if name != "dv" else "")
    with pytest.raises(AssertionError, match=want):
        numpy_case(*GRAD_SEEDS[0])


@pytest.mark.parametrize("where", ["formula", "sum"])
def test_dsink_rule_sees_a_wrong_dsink(numpy_case, monkeypatch, where):
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
        numpy_case(*DSINK_SEEDS[0][:-1], 5)
