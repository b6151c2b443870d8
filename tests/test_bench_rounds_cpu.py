"""bench/bench.py's interleaved timing (--rounds): on the CPU, with a stand-in for torch's CUDA events
whose clock advances by each call's simulated duration. The providers must alternate round by
round, each row must get its provider's own times (median, minimum, runs, one median per round),
and a provider that fails in a later round must not take the others' figures with it."""

import argparse
import contextlib
import importlib.util
import os

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "bench.py")


def _load_bench():
    spec = importlib.util.spec_from_file_location("cuflash_bench_grid", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


bench = _load_bench()


class _Clock:
    t = 0.0


class _Event:
    def __init__(self, enable_timing=True):
        self.t = None

    def record(self):
        self.t = _Clock.t

    def elapsed_time(self, other):
        return other.t - self.t


class _Cuda:
    Event = _Event

    @staticmethod
    def synchronize():
        pass


class _Torch:
    cuda = _Cuda


def _args(rounds, passes=("fwd",), order="serpentine"):
    return argparse.Namespace(rounds=rounds, warmup=3, reps=20, max_reps=300, min_time=0.2, eager_reps=30,
                              passes=list(passes), order=order)


def _runner(args):
    r = object.__new__(bench.Runner)
    r.torch, r.args = _Torch, args
    return r


def _prep(name, ms, log, fail_after=None):
    calls = {"n": 0}

    def fwd():
        calls["n"] += 1
        if fail_after is not None and calls["n"] > fail_after:
            raise RuntimeError(f"{name} failed")
        log.append(name)
        _Clock.t += ms

    @contextlib.contextmanager
    def ctx():   # one use only, as SDPA's sdpa_kernel(backend) is
        yield

    row = {"provider": name, "pass": "fwd", "flops": 1e12}
    return (fwd, None, ctx, {"fwd": row}, None), row


@pytest.mark.parametrize("order", ["serpentine", "fixed"])
@pytest.mark.parametrize("rounds", [1, 3, 4])
def test_rounds_alternate_and_rows_get_their_own_times(rounds, order):
    log = []
    pa, ra = _prep("a", 1.0, log)
    pb, rb = _prep("b", 2.5, log)
    _runner(_args(rounds, order=order)).time_pass("fwd", {"a": pa, "b": pb}, None, None, None)
    for row, ms in ((ra, 1.0), (rb, 2.5)):
        assert "error" not in row
        assert row["ms"] == pytest.approx(ms) and row["ms_min"] == pytest.approx(ms)
        assert row["rounds"] == rounds and len(row["ms_rounds"]) == rounds
        assert row["ms_eager"] == pytest.approx(ms)
        assert row["tflops"] == pytest.approx(1e12 / (ms * 1e-3) / 1e12)
    # the GPU-time runs, as one stretch would have made them (--min-time's worth, at least --reps)
    assert ra["reps"] == 200 and rb["reps"] == 80
    # the log, compressed to runs of one provider: the GPU-time rounds, then the eager rounds; a
    # before b in every round (fixed), or in even rounds and after it in odd ones (serpentine)
    blocks = [p for i, p in enumerate(log) if i == 0 or log[i - 1] != p]
    turns = [p for _phase in range(2) for r in range(rounds)
             for p in (("b", "a") if order == "serpentine" and r % 2 else ("a", "b"))]
    assert blocks == [p for i, p in enumerate(turns) if i == 0 or turns[i - 1] != p]
    if order == "fixed":
        assert blocks == ["a", "b"] * (2 * rounds)


def test_turn_order_serpentine_puts_both_ends_after_the_middle_equally():
    provs = ["cuflash", "sdpa_flash", "sdpa_cudnn"]
    assert bench.turn_order(provs, 0) == provs and bench.turn_order(provs, 1) == provs[::-1]
    assert bench.turn_order(provs, 3, "fixed") == provs
    seq = [p for r in range(4) for p in bench.turn_order(provs, r)]
    follows = {}
    for prev, cur in zip(seq, seq[1:]):
        follows.setdefault(cur, []).append(prev)
    # over the rounds, cuDNN follows SDPA flash no more often than cuflash does
    assert follows["sdpa_cudnn"].count("sdpa_flash") == follows["cuflash"].count("sdpa_flash") == 2
    assert bench.parse_args([]).order == "serpentine"
    assert bench.parse_args(["--order", "fixed"]).order == "fixed"


def test_a_failure_in_a_later_round_keeps_the_other_provider():
    log = []
    pa, ra = _prep("a", 1.0, log)
    pb, rb = _prep("b", 2.0, log, fail_after=60)   # 29 calls in round 0, 28 in round 1: fails in round 2
    _runner(_args(4)).time_pass("fwd", {"a": pa, "b": pb}, None, None, None)
    assert "b failed" in rb["error"] and "ms" not in rb and "ms_eager" not in rb
    assert ra["ms"] == pytest.approx(1.0) and ra["rounds"] == 4 and "ms_eager" in ra
    assert log.count("b") == 60


@pytest.mark.parametrize("total,rounds", [(1, 1), (7, 3), (200, 4), (3, 4), (301, 7)])
def test_split_runs(total, rounds):
    runs = bench.split_runs(total, rounds)
    assert len(runs) == rounds and min(runs) >= 1
    assert sum(runs) == max(total, rounds)
    assert max(runs) - min(runs) <= 1


def test_rounds_argument():
    assert bench.parse_args([]).rounds == 4
    assert bench.parse_args(["--rounds", "1"]).rounds == 1
    with pytest.raises(SystemExit):
        bench.parse_args(["--rounds", "0"])


def test_an_eager_failure_keeps_the_gpu_time():
    log = []
    pa, ra = _prep("a", 1.0, log)
    pb, rb = _prep("b", 2.0, log, fail_after=120)   # 113 GPU-time calls, then fails in its eager runs
    _runner(_args(4)).time_pass("fwd", {"a": pa, "b": pb}, None, None, None)
    assert "b failed" in rb["eager_error"] and "error" not in rb and "ms_eager" not in rb
    assert rb["ms"] == pytest.approx(2.0) and rb["reps"] == 100
    assert ra["ms_eager"] == pytest.approx(1.0)


def test_one_stretch_timers_for_the_other_benches():
    """bench_flex.py and bench_features.py import time_cuda / time_eager from bench.py: one provider,
    one stretch, the same run count rule."""
    log = []
    (fwd, _g, _ctx, _by, _m), _row = _prep("a", 2.0, log)
    med, mn, reps = bench.time_cuda(_Torch, fwd, _args(1))
    assert (med, mn, reps) == (pytest.approx(2.0), pytest.approx(2.0), 100)
    assert len(log) == 2 + 2 + 100   # first call, the estimate, two warm-up calls, the runs
    assert bench.time_eager(_Torch, fwd, 7) == (pytest.approx(2.0), pytest.approx(2.0), 7)


def test_bench_features_imports_its_timer():
    """bench_features.py imports time_cuda from bench.py when it loads (no torch needed for that)."""
    path = os.path.join(os.path.dirname(BENCH), "bench_features.py")
    spec = importlib.util.spec_from_file_location("cuflash_bench_features", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.time_cuda.__name__ == "time_cuda"
