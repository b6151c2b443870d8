"""bench/bench_decode.py --cpu-smoke end to end, in a subprocess with a time limit: torch CPU tensors and
tiny shapes (cuflash's NumPy path, SDPA's MATH backend as the peer), the JSON and the plot (when
matplotlib imports). Checks that the run completes, prints its targets last, and writes the keys the
next GPU run's analysis reads. No GPU needed."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "bench_decode.py"
TARGET_IDS = ["decode_vs_sdpa", "paged_vs_contiguous", "bandwidth", "host_time", "cuda_graph"]


def test_cpu_smoke_runs_and_writes_json(tmp_path):
    out, png = tmp_path / "bd.json", tmp_path / "bd.png"
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--cpu-smoke", "--json", str(out), "--plot", str(png)],
                          capture_output=True, text=True, timeout=60, cwd=str(ROOT), env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[-7].startswith("=== targets"), proc.stdout[-2000:]   # printed last: header, 5 targets, counts
    assert "met," in lines[-1] and "not measured" in lines[-1]

    data = json.loads(out.read_text())
    assert {"meta", "copy", "host", "points", "targets"} <= set(data)
    meta = data["meta"]
    for key in ("timestamp_utc", "device", "torch", "cudnn", "cuflash", "copy_gbps", "grid", "timing"):
        assert key in meta, key
    assert data["copy"]["gbps"] > 0

    host = {(r["impl"], r["layout"]): r for r in data["host"]["rows"]}
    for key in (("cuflash", "contiguous"), ("cuflash", "paged"), ("sdpa_flash", "contiguous")):
        assert host[key]["us_median"] > 0, host[key]
    assert host[("sdpa_cudnn", "contiguous")]["status"] == "error"   # no cuDNN on the CPU: recorded, not fatal

    pts = data["points"]
    measured = [r for r in pts if r.get("ms")]
    assert {(r["impl"], r["layout"]) for r in measured} == {("cuflash", "contiguous"), ("cuflash", "paged"),
                                                            ("sdpa_flash", "contiguous")}
    for r in measured:
        for key in ("gbps", "frac_copy", "eager_ms", "first_call_ms", "rounds_ms", "kv_bytes"):
            assert key in r, (key, r)
        assert r["max_abs_diff"] < 0.05, r   # each checked against SDPA on the logical (gathered) keys
    cf = [r for r in measured if r["impl"] == "cuflash"]
    assert all(r.get("x_best_sdpa") for r in cf if r["layout"] == "contiguous")
    assert all(r.get("x_contiguous") for r in cf if r["layout"] == "paged")
    assert any(r["status"] == "skipped" and r["message"].startswith("memory") for r in pts)   # the cap's skip

    assert meta["gauges"] is None and not any("rounds_sm_mhz" in r for r in pts)   # no NVML on the CPU

    assert [t["id"] for t in data["targets"]] == TARGET_IDS
    for t in data["targets"]:
        assert t["verdict"] in ("met", "missed", "not measured"), t
        assert t["text"]

    if importlib.util.find_spec("matplotlib") is None:
        assert "plot skipped: matplotlib" in proc.stdout
    else:
        assert png.stat().st_size > 1000


def test_gauges_recorded_per_round(tmp_path, monkeypatch, capsys):
    """Where NVML answers, every GPU-time round records the SM clock and power as it ends, one entry per
    round in each measured row, and the report prints their range (a stand-in reader on the CPU)."""
    spec = importlib.util.spec_from_file_location("bench_decode_gauges", SCRIPT)
    bd = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, bd)   # (its dataclasses look their module up)
    spec.loader.exec_module(bd)
    readings = iter(range(1000, 100000, 7))
    monkeypatch.setattr(bd.Clock, "gauges", lambda self: (next(readings), 650.5))
    out = tmp_path / "bd.json"
    assert bd.main(["--cpu-smoke", "--no-host", "--no-graph", "--eager-reps", "0", "--check-mib", "0",
                    "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["meta"]["gauges"].startswith("NVML")
    measured = [r for r in data["points"] if r.get("rounds_ms")]
    assert measured
    seen = []
    for r in measured:
        assert len(r["rounds_sm_mhz"]) == len(r["rounds_ms"]) == len(r["rounds_watts"]), r
        assert set(r["rounds_watts"]) == {650.5}
        seen += r["rounds_sm_mhz"]
    assert len(set(seen)) == len(seen)   # one reading per round, none shared
    text = capsys.readouterr().out
    assert "=== SM clock as the GPU-time rounds ended (NVML)" in text
    assert "power up to 650 W" in text


@pytest.mark.parametrize("sq", [1, 3])
def test_seqlen_q(tmp_path, monkeypatch, sq):
    """--seqlen-q N gives q N rows (speculative decoding): cuflash's calls get q of N rows and, with more
    than one, causal=False (as the peers, whose causal mask is top-left aligned: the same keys for all);
    one row keeps causal=True. The meta and every row record N; every output is checked against SDPA
    on the logical keys."""
    import cuflash

    spec = importlib.util.spec_from_file_location("bench_decode_sq", SCRIPT)
    bd = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, bd)   # (its dataclasses look their module up)
    spec.loader.exec_module(bd)
    calls = []
    real = cuflash.attention_with_kvcache

    def spy(q, *args, **kw):
        calls.append((q.shape[1], kw.get("causal")))
        return real(q, *args, **kw)

    monkeypatch.setattr(cuflash, "attention_with_kvcache", spy)
    out = tmp_path / "bd.json"
    argv = ["--cpu-smoke", "--no-host", "--no-graph", "--eager-reps", "0", "--json", str(out)]
    assert bd.main(argv + (["--seqlen-q", str(sq)] if sq != 1 else [])) == 0
    assert calls and set(calls) == {(sq, sq == 1)}, set(calls)
    data = json.loads(out.read_text())
    assert data["meta"]["seqlen_q"] == sq
    measured = [r for r in data["points"] if r.get("ms")]
    assert measured and all(r["seqlen_q"] == sq for r in data["points"])
    for r in measured:
        assert r["max_abs_diff"] < 0.05, r
    with pytest.raises(SystemExit):
        bd.parse_args(["--seqlen-q", "0"])
