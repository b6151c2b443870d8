"""bench/gpt2.py runs each cell in a process of its own (--isolate cell, the default on a GPU): checked
on the CPU smoke's tiny model. Every cell reports back through its process, from the same initial
weights as an in-process run (the loss curves are equal), with its process recorded apart from
its own figures; a process that dies leaves an error record naming its exit status."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "gpt2.py")
ARGS = ["--cpu-smoke", "--impls", "cuflash", "sdpa_math", "--steps", "3", "--warmup", "1", "--infer-reps", "1"]


def _run(tmp_path, name, *extra):
    path = tmp_path / f"{name}.json"
    r = subprocess.run([sys.executable, SCRIPT, *ARGS, *extra, "--json", str(path)], capture_output=True, text=True,
                       timeout=600, env=dict(os.environ, OPENBLAS_NUM_THREADS="1"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(path.read_text()), r.stdout


def test_process_per_cell_matches_in_process_run(tmp_path):
    iso, out = _run(tmp_path, "cell", "--isolate", "cell")
    ref, _ = _run(tmp_path, "none", "--isolate", "none")
    assert iso["meta"]["isolation"] == "cell" and ref["meta"]["isolation"] == "none"
    assert iso["meta"]["cuflash"] == ref["meta"]["cuflash"] and iso["meta"]["device"] == ref["meta"]["device"]
    assert [c["impl"] for c in iso["cells"]] == [c["impl"] for c in ref["cells"]] == ["cuflash", "sdpa_math"]
    pids = set()
    for a, b in zip(iso["cells"], ref["cells"]):
        assert not a.get("error") and not a["train"].get("error") and not a["infer"].get("error"), a
        assert a["train"]["losses"] == b["train"]["losses"], a["impl"]   # the same initial weights and data
        proc = a["process"]
        assert proc["isolation"] == "cell" and proc["cells"] == 1 and proc["wall_s"] >= a["wall_s"]
        pids.add(proc["pid"])
        assert "process" not in b
    assert len(pids) == 2 and os.getpid() not in pids
    assert "process" in out and iso["cuflash_failures"] == 0


def test_a_process_that_dies_leaves_an_error_record(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    try:
        import gpt2
    finally:
        sys.path.pop(0)
    args = gpt2.parse_args(ARGS + ["--impls", "cuflash"])
    cells = gpt2.build_cells(args)
    records, meta = gpt2.run_process(cells, args, gpt2.Device("cpu"), {"tiny|1024": str(tmp_path / "missing.pt")},
                                     str(tmp_path / "p0"), 0.0, 1.0)
    assert len(records) == 1 and meta == {}
    rec = records[0]
    assert rec["impl"] == "cuflash" and "exited with status 1" in rec["error"] and "missing.pt" in rec["error"]
    assert gpt2._failed(rec)
