"""Packaging (CPU, runs in CI): a non-editable wheel ships cuda_src/ inside the package and the
installed package finds it there; the README's test command is the one CI runs."""

import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_readme_test_command_is_what_ci_runs():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    m = re.search(r'^(python -m pip install -q "\.\[cuda13,test\]" && python -m pytest tests -q -rs)( |$)', ci, re.M)
    assert m, ".ci/run no longer runs the expected test command"
    assert m.group(1) in readme, "README must show the exact test command that CI runs"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(ROOT)],
                       capture_output=True, text=True)
    if r.returncode != 0 and "No matching distribution found for hatchling" in r.stderr:
        pytest.fail("cannot build the wheel: hatchling is not reachable\n" + r.stderr)
    assert r.returncode == 0, r.stderr
    (whl,) = out.glob("cuflash-*.whl")
    return whl


def test_wheel_ships_every_cuda_source(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = sorted(p.name for p in (ROOT / "cuda_src").iterdir() if p.suffix in (".cu", ".cuh"))
    assert sources, "no CUDA sources in the checkout"
    missing = [s for s in sources if f"cuflash/cuda_src/{s}" not in names]
    assert not missing, f"not in the wheel: {missing}"


def test_installed_package_finds_its_sources(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True)
    code = ("import cuflash._compile as c; d = c.cuda_src_dir(); print(d); "
            "files, fp = c.sources(); assert 'flash_fwd.cu' in files and len(fp) == 64")
    env = dict(os.environ, PYTHONPATH=str(target))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip()) == target / "cuflash" / "cuda_src"


def test_generated_wgmma_header_is_current():
    """cuda_src/wgmma.cuh is the output of scripts/gen_wgmma.py, byte for byte."""
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_wgmma.py"), "--check"], capture_output=True)
    assert r.returncode == 0, "cuda_src/wgmma.cuh differs from scripts/gen_wgmma.py's output; rerun the script"
