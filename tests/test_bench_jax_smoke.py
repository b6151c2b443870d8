"""bench/bench_jax.py on the CPU: --cpu-smoke end to end in a subprocess (JSON written, keys present),
and its target logic on made-up rows (no JAX needed for that part)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "bench_jax.py"


def _module():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import bench_jax
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return bench_jax


def test_cpu_smoke_runs_and_writes_json(tmp_path):
    pytest.importorskip("jax")
    out = tmp_path / "bj.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("CUFLASH_JAX_JIT_GPU", None)
    r = subprocess.run([sys.executable, str(SCRIPT), "--cpu-smoke", "--json", str(out)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "=== summary" in r.stdout and r.stdout.rstrip().splitlines()[-1].startswith("json:")
    data = json.loads(out.read_text())
    for key in ("meta", "results", "checks", "targets", "summary", "markdown", "summary_text"):
        assert key in data, key
    meta = data["meta"]
    for key in ("jax", "jaxlib", "xla_flags", "cuflash", "env", "device", "grid", "timing"):
        assert key in meta, key
    assert meta["env"]["CUFLASH_JAX_JIT_GPU"] == "1" and meta["cpu_smoke"] is True
    res = data["results"]
    jit = [r for r in res if r["provider"] == "cuflash_jit"]
    xla = [r for r in res if r["provider"] == "jax_xla"]
    assert jit and all(r.get("ms", 0) > 0 and r.get("compile_s") is not None for r in jit), jit
    assert xla and all(r.get("ms", 0) > 0 for r in xla)
    assert {r["pass"] for r in jit} == {"fwd", "fwd+bwd"}
    assert all(r.get("unavailable") for r in res if r["provider"] == "jax_cudnn")
    torch_rows = [r for r in res if r["provider"] == "cuflash_torch"]
    assert torch_rows and all(r.get("ms") or r.get("unavailable") for r in torch_rows)
    assert all((r.get("memory") or {}).get("extra_bytes") for r in jit)
    for name in ("jit_vs_torch", "vs_xla", "memory", "vs_cudnn"):
        assert data["summary"][name] in ("met", "missed", "not measured", "met (partly measured)", "reported")
    assert data["summary"]["vs_cudnn"] == "not measured" and data["summary"]["vs_xla"] == "not measured"
    assert data["summary"]["memory"] == "met"
    assert "| cuflash-jit | cudnn | xla | cuflash-torch |" in data["markdown"]
    for c in data["checks"]:   # the same kernels from torch and under jit: the same numbers on the NumPy path
        if "fwd vs cuflash-torch" in c["check"]:
            assert c["check"]["fwd vs cuflash-torch"]["out"] == 0.0


def _row(prov, ps, seqlen, ms=None, **kw):
    r = {"dtype": "bfloat16", "head_dim": 64, "nheads": 32, "batch": 16384 // seqlen, "seqlen": seqlen,
         "causal": False, "provider": prov, "pass": ps}
    if ms is not None:
        r["ms"] = ms
    r.update(kw)
    return r


def test_targets_on_made_up_rows():
    bj = _module()
    mem = lambda s, per_row: {"extra_bytes": int(per_row * (16384 // s) * s * 32)}  # noqa: E731
    rows = []
    for s, jit_ms, xla_ms in ((1024, 1.0, 1.5), (4096, 2.0, 5.0), (16384, 4.0, None)):
        for ps in ("fwd", "fwd+bwd"):
            rows.append(_row("cuflash_jit", ps, s, jit_ms, memory=mem(s, 300)))
            rows.append(_row("cuflash_torch", ps, s, jit_ms / 1.02, ms_events=jit_ms / 1.1))
            rows.append(_row("jax_cudnn", ps, s, jit_ms * 0.8))
            if xla_ms is None:
                rows.append(_row("jax_xla", ps, s, oom=True, skipped="memory"))
            else:
                rows.append(_row("jax_xla", ps, s, xla_ms, memory=mem(s, 300 * s / 1024)))
    data = bj.finalize({"meta": {}, "results": rows})
    t = data["targets"]
    assert t["jit_vs_torch"]["status"] == "met" and abs(t["jit_vs_torch"]["passes"]["fwd"]["max"] - 1.02) < 1e-9
    assert t["vs_xla"]["status"] == "met" and t["vs_xla"]["passes"]["fwd"]["n"] == 1
    assert len(t["vs_xla"]["passes"]["fwd"]["xla_oom_points"]) == 1   # 16k: xla OOM, listed, not counted
    assert t["memory"]["status"] == "met" and t["memory"]["xla_max_growth"] > 3
    assert t["vs_cudnn"]["status"] == "reported" and abs(t["vs_cudnn"]["passes"]["fwd"]["geomean"] - 0.8) < 1e-9
    assert "| fwd | bf16 | 64 | off | 16k |" in data["markdown"] and "OOM" in data["markdown"]
    text = bj.format_summary(data)
    assert text.count("[MET]") == 3 and "[REPORTED]" in text

    # a slow jit point, xla barely slower at 4k, memory growing with seqlen: all three missed
    for r in rows:
        if r["provider"] == "cuflash_jit" and r["seqlen"] == 4096:
            r["ms"] = 3.0
        if r["provider"] == "cuflash_jit" and r["seqlen"] == 16384:
            r["memory"] = mem(16384, 3000)
    t = bj.finalize({"meta": {}, "results": rows})["targets"]
    assert t["jit_vs_torch"]["status"] == "missed" and t["vs_xla"]["status"] == "missed"
    assert t["memory"]["status"] == "missed"

    # nothing timed: not measured
    t = bj.finalize({"meta": {}, "results": [_row("cuflash_jit", "fwd", 512, error="NotImplementedError: x")]})["targets"]
    assert t["jit_vs_torch"]["status"] == "not measured" and t["vs_cudnn"]["status"] == "not measured"
