"""Shared pytest setup for cuflash's tests.

* ``has_gpu()``: True when CuPy imports and sees at least one CUDA device. Any failure (CuPy
  missing, no driver, driver too old, no device) counts as "no GPU".
* Tests marked ``gpu`` are skipped with reason "no CUDA GPU" when there is none, so the whole
  suite collects and runs on a machine without a GPU.
* The pytest header names the GPU when there is one.

The markers ``gpu`` and ``slow`` are registered in pyproject.toml. ``xdist_group`` is
pytest-xdist's marker, used by
tests/test_gpu_forward.py to keep the tests of one kernel on one worker (``--dist loadgroup``); it
is registered here for runs without pytest-xdist installed.
"""

from __future__ import annotations

import functools
import os

# OpenBLAS threads spin-wait on each other when the CPU is shared (measured: the CPU tests took
# 163 s instead of 77 s of CPU time on a loaded 2-core machine); one thread is enough for these sizes.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import pytest  # noqa: E402

# JAX grabs 75% of the GPU memory at its first use unless told not to; the GPU tests run JAX,
# torch and CuPy in one process (and several pytest-xdist workers on one GPU).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


@functools.lru_cache(maxsize=None)
def has_gpu() -> bool:
    """True when CuPy imports and ``cupy.cuda.runtime.getDeviceCount() > 0``; never raises."""
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount()) > 0
    except Exception:
        return False


def _gpu_names() -> list[str]:
    try:
        import cupy

        names = []
        for i in range(int(cupy.cuda.runtime.getDeviceCount())):
            name = cupy.cuda.runtime.getDeviceProperties(i)["name"]
            names.append(name.decode() if isinstance(name, bytes) else str(name))
        return names
    except Exception as e:  # a header must never break the run
        return [f"<name unavailable: {type(e).__name__}: {e}>"]


def pytest_configure(config):
    config.addinivalue_line("markers", "xdist_group(name): pytest-xdist --dist loadgroup keeps a group on one worker")


def pytest_report_header(config):
    if not has_gpu():
        return "cuflash: no CUDA GPU (tests marked gpu are skipped)"
    names = _gpu_names()
    lines = [f"cuflash: GPU {i}: {n}" for i, n in enumerate(names)]
    lines.append(f"cuflash: CUFLASH_CACHE_DIR={os.environ.get('CUFLASH_CACHE_DIR', '<default>')}")
    return lines


def pytest_collection_modifyitems(config, items):
    if has_gpu():
        return
    skip = pytest.mark.skip(reason="no CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
