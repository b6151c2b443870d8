"""The disk cache under faults (CPU, runs in CI; NVRTC compiles without a GPU).

Every way an entry can go bad (a truncated, overwritten, empty or missing cubin; metadata that is
garbage, for another key, with the wrong digest; a cubin that the driver refuses) must end in a
correct kernel, the entry rewritten, and exactly one warning on the `cuflash` logger per process.
A cache that cannot be written (a regular file, a read-only directory, a full disk) must cost a
warning, never the call. Then `python -m cuflash cache [--clear]`, and processes that build one
entry at once.

NVRTC's cubins are not byte-for-byte reproducible: internal symbol names carry a hash that changes
from one compile to the next (`_INTERNAL_..._flash_fwd_cu_<8 hex>_<n>`). Compiles are therefore
compared with that hash masked (`_same_build`).
"""

import errno
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("cupy_backends.cuda.libs.nvrtc")

from cuflash import _compile  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TARGET = "sm_80"


@functools.lru_cache(maxsize=None)
def _specs():
    """Two small specializations (built on first use, not at collection, while _launch may be changing)."""
    from cuflash import _config, _launch

    cfg = _config.fwd_config("sm80", 64, "float16")
    return tuple(_launch.fwd_specialization("float16", 64, cfg, causal, True)[0] for causal in (False, True))


def spec_a():
    return _specs()[0]


def spec_b():
    return _specs()[1]


def _masked(cubin: bytes) -> bytes:
    return re.sub(rb"_cu_[0-9a-f]{8}_[0-9]+", b"_cu_", cubin)


def _same_build(a: bytes, b: bytes) -> bool:
    """The same kernel, compiled twice: equal bytes up to NVRTC's per-compile symbol hash."""
    return len(a) > 1000 and _masked(a) == _masked(b)


@pytest.fixture(scope="module")
def clean():
    """Clean NVRTC builds of spec_a() and spec_b(), to compare with."""
    return {s.name: _compile.nvrtc_compile(s, TARGET) for s in (spec_a(), spec_b())}


@pytest.fixture(scope="module")
def golden(tmp_path_factory, clean):
    """A cache directory filled by compile_cached with spec_a() and spec_b() (copied into each test's own)."""
    d = tmp_path_factory.mktemp("golden")
    mp = pytest.MonkeyPatch()
    mp.setenv("CUFLASH_CACHE_DIR", str(d))
    try:
        for s in (spec_a(), spec_b()):
            ck = _compile.compile_cached(s, TARGET)
            assert ck.compile_seconds > 0 and ck.cubin_path is not None
            assert _same_build(ck.cubin, clean[s.name].cubin)
    finally:
        mp.undo()
    return d


@pytest.fixture
def fresh_process(monkeypatch):
    """Each test starts as a new process would: no warning given yet, nothing loaded."""
    monkeypatch.setattr(_compile, "_warned", set())
    monkeypatch.setattr(_compile, "_loaded", {})
    monkeypatch.setattr(_compile, "_build_locks", {})


@pytest.fixture
def cache(tmp_path, monkeypatch, golden, fresh_process):
    """A private copy of the golden cache, as CUFLASH_CACHE_DIR."""
    d = tmp_path / "cache"
    shutil.copytree(golden, d)
    monkeypatch.setenv("CUFLASH_CACHE_DIR", str(d))
    return d


@pytest.fixture
def logs(caplog):
    caplog.set_level(logging.INFO, logger="cuflash")
    return caplog


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "cuflash" and r.levelno >= logging.WARNING]


def _paths(spec):
    e = _compile._entry(spec, TARGET)
    return e.cubin, e.meta


def _assert_entry_good(spec, clean):
    """The entry on disk is complete, names its key, matches its digest and holds a real build."""
    e = _compile._entry(spec, TARGET)
    meta = json.loads(e.meta.read_text())
    cubin = e.cubin.read_bytes()
    assert meta["key"] == e.key and meta["format"] == _compile._META_FORMAT
    assert meta["cubin_sha256"] == hashlib.sha256(cubin).hexdigest() and meta["cubin_bytes"] == len(cubin)
    assert meta["lowered_name"] == clean[spec.name].lowered_name
    assert _same_build(cubin, clean[spec.name].cubin)
    return cubin


# ------------------------------------------------------------------------------------------------
# Bad entries


def _rewrite_meta(path, **changes):
    meta = json.loads(path.read_text())
    for k, v in changes.items():
        if v is None:
            meta.pop(k, None)
        else:
            meta[k] = v
    path.write_text(json.dumps(meta))


# name -> (damage(cubin_path, meta_path), the file the warning must name)
DAMAGE = {
    "cubin_truncated": (lambda c, m: c.write_bytes(c.read_bytes()[:100]), "cubin"),
    "cubin_random": (lambda c, m: c.write_bytes(os.urandom(len(c.read_bytes()))), "cubin"),
    "cubin_empty": (lambda c, m: c.write_bytes(b""), "cubin"),
    "cubin_one_bit": (lambda c, m: c.write_bytes(bytes([c.read_bytes()[0] ^ 1]) + c.read_bytes()[1:]), "cubin"),
    "cubin_missing": (lambda c, m: c.unlink(), "cubin"),
    "json_garbage": (lambda c, m: m.write_bytes(b"\x00\xffnot json {"), "json"),
    "json_truncated": (lambda c, m: m.write_bytes(m.read_bytes()[: len(m.read_bytes()) // 2]), "json"),
    "json_not_object": (lambda c, m: m.write_text("[1, 2, 3]"), "json"),
    "json_wrong_key": (lambda c, m: _rewrite_meta(m, key="0" * 64), "json"),
    "json_wrong_digest": (lambda c, m: _rewrite_meta(m, cubin_sha256=hashlib.sha256(b"x").hexdigest()), "cubin"),
    "json_no_digest": (lambda c, m: _rewrite_meta(m, cubin_sha256=None), "cubin"),
    "json_old_format": (lambda c, m: _rewrite_meta(m, format=None), "json"),
    "json_no_lowered_name": (lambda c, m: _rewrite_meta(m, lowered_name=None), "json"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_bad_entry_is_rebuilt_with_one_warning(damage, cache, clean, logs):
    cubin_path, meta_path = _paths(spec_a())
    damage_fn, bad_file = DAMAGE[damage]
    damage_fn(cubin_path, meta_path)

    ck = _compile.compile_cached(spec_a(), TARGET)
    assert ck.compile_seconds > 0 and not ck.from_disk, "the bad entry was used instead of rebuilt"
    assert _same_build(ck.cubin, clean[spec_a().name].cubin)
    assert ck.lowered_name == clean[spec_a().name].lowered_name
    assert ck.cubin_path == cubin_path
    assert _assert_entry_good(spec_a(), clean) == ck.cubin, "the bad entry was not replaced"

    warns = _warnings(logs)
    assert len(warns) == 1, warns
    named = cubin_path if bad_file == "cubin" else meta_path
    assert str(named) in warns[0] and spec_a().name in warns[0], warns[0]

    # The rewritten entry is a plain hit, with no further warning; the other entry was not touched.
    again = _compile.compile_cached(spec_a(), TARGET)
    assert again.compile_seconds == 0.0 and again.from_disk and again.cubin == ck.cubin
    other = _compile.compile_cached(spec_b(), TARGET)
    assert other.compile_seconds == 0.0
    assert len(_warnings(logs)) == 1


def test_cubin_without_metadata_is_a_silent_miss(cache, clean, logs):
    """A .cubin without its .json is a write cut short (the .json is written last): rebuilt, no warning."""
    cubin_path, meta_path = _paths(spec_a())
    meta_path.unlink()
    cubin_path.write_bytes(b"half a kernel")
    ck = _compile.compile_cached(spec_a(), TARGET)
    assert ck.compile_seconds > 0
    _assert_entry_good(spec_a(), clean)
    assert _warnings(logs) == []


def test_warning_once_per_process(cache, clean, logs):
    """Two bad entries in one process: one warning, the second at INFO; both rebuilt."""
    for spec in (spec_a(), spec_b()):
        cubin_path, _ = _paths(spec)
        cubin_path.write_bytes(cubin_path.read_bytes()[:100])
    for spec in (spec_a(), spec_b()):
        assert _compile.compile_cached(spec, TARGET).compile_seconds > 0
        _assert_entry_good(spec, clean)
    assert len(_warnings(logs)) == 1
    infos = [r.getMessage() for r in logs.records if r.levelno == logging.INFO and "bad kernel cache entry" in
             r.getMessage()]
    assert len(infos) == 1 and spec_b().name in infos[0], infos


def test_bad_entry_in_a_read_only_cache(cache, clean, logs, monkeypatch):
    """A bad entry that cannot be rewritten: the call still gets a correct kernel (two warnings: the
    bad entry and the failed write)."""
    cubin_path, _ = _paths(spec_a())
    cubin_path.write_bytes(b"\0" * 100)

    def read_only(path, data):
        raise OSError(errno.EROFS, "Read-only file system", str(path))
    monkeypatch.setattr(_compile, "_write_atomic", read_only)
    ck = _compile.compile_cached(spec_a(), TARGET)
    assert _same_build(ck.cubin, clean[spec_a().name].cubin) and ck.cubin_path is None
    warns = _warnings(logs)
    assert len(warns) == 2 and "bad kernel cache entry" in warns[0] and "could not write" in warns[1], warns


# ------------------------------------------------------------------------------------------------
# A cubin that passes its digest check but that the driver refuses (get_function's load step)


class _FlakyLoader:
    """Stands in for _compile._load_kernel: refuses the first `failures` loads as the driver does a
    damaged image, then succeeds."""

    def __init__(self, failures):
        self.failures, self.calls = failures, []

    def __call__(self, ck, device_id):
        self.calls.append((ck.cubin, ck.from_disk, ck.compile_seconds))
        if len(self.calls) <= self.failures:
            raise RuntimeError("CUDA_ERROR_INVALID_IMAGE: device kernel image is invalid")
        return _compile.LoadedKernel(1234, None, None)


def test_driver_refusing_a_cached_cubin_rebuilds_it(cache, clean, logs, monkeypatch):
    loader = _FlakyLoader(failures=1)
    monkeypatch.setattr(_compile, "_load_kernel", loader)
    cubin_before = _paths(spec_a())[0].read_bytes()

    fn = _compile.get_function(spec_a(), TARGET, 0, 0)
    assert fn.ptr == 1234
    assert len(loader.calls) == 2
    (first, first_disk, _), (second, second_disk, second_secs) = loader.calls
    assert first == cubin_before and first_disk, "the first load must be the cached cubin"
    assert not second_disk and second_secs > 0, "the retry must load a fresh compile"
    assert _same_build(second, clean[spec_a().name].cubin)
    assert _assert_entry_good(spec_a(), clean) == second, "the refused entry was not rewritten"
    warns = _warnings(logs)
    assert len(warns) == 1 and "driver could not load" in warns[0] and "CUDA_ERROR_INVALID_IMAGE" in warns[0]
    assert _compile.get_function(spec_a(), TARGET, 0, 0) is fn and len(loader.calls) == 2  # memoized


def test_driver_refusing_a_fresh_build_raises(cache, logs, monkeypatch):
    """A load failure that a rebuild does not cure is an error, raised after one rebuild (no loop)."""
    loader = _FlakyLoader(failures=10)
    monkeypatch.setattr(_compile, "_load_kernel", loader)
    with pytest.raises(RuntimeError, match="CUDA_ERROR_INVALID_IMAGE"):
        _compile.get_function(spec_a(), TARGET, 0, 0)
    assert len(loader.calls) == 2  # the cached cubin, then one fresh build

    shutil.rmtree(cache)  # nothing cached: the fresh build's failure is raised at once
    loader.calls.clear()
    with pytest.raises(RuntimeError, match="CUDA_ERROR_INVALID_IMAGE"):
        _compile.get_function(spec_b(), TARGET, 0, 0)
    assert len(loader.calls) == 1


def test_load_from_memory_when_the_cache_is_unwritable(tmp_path, monkeypatch, clean, fresh_process):
    """With no cache file, _load_kernel loads the cubin from a private temporary file and removes it."""
    cupy = pytest.importorskip("cupy")
    import contextlib

    seen = []

    class FakeModule:
        def __init__(self, path):
            seen.append((path, Path(path).read_bytes()))

        def get_function(self, name):
            assert name == clean[spec_a().name].lowered_name
            kernel = type("K", (), {})()
            kernel.kernel = type("F", (), {"ptr": 99})()
            return kernel

    monkeypatch.setattr(cupy, "RawModule", FakeModule)
    monkeypatch.setattr(cupy.cuda, "Device", lambda i: contextlib.nullcontext())
    ck = clean[spec_a().name]
    fn = _compile._load_kernel(_compile.CompiledKernel(spec_a(), TARGET, ck.cubin, ck.lowered_name, "", 1.0), 0)
    assert fn.ptr == 99 and len(seen) == 1
    path, data = seen[0]
    assert data == ck.cubin and not Path(path).exists(), "temporary cubin left behind"


# ------------------------------------------------------------------------------------------------
# Write errors: the call works, with one warning


def _no_tmp_left(d):
    return [p.name for p in Path(d).iterdir() if p.name.endswith(".tmp")] if Path(d).is_dir() else []


@pytest.mark.parametrize("where", ["dir_is_file", "parent_is_file"])
def test_cache_dir_not_a_directory(where, tmp_path, monkeypatch, clean, logs, fresh_process):
    f = tmp_path / "cachefile"
    f.write_bytes(b"not a directory")
    d = f if where == "dir_is_file" else f / "sub"
    monkeypatch.setenv("CUFLASH_CACHE_DIR", str(d))
    for spec in (spec_a(), spec_b()):
        ck = _compile.compile_cached(spec, TARGET)
        assert ck.compile_seconds > 0 and ck.cubin_path is None
        assert _same_build(ck.cubin, clean[spec.name].cubin)
    warns = _warnings(logs)
    assert len(warns) == 1 and "could not write the kernel cache" in warns[0] and str(d) in warns[0], warns
    assert f.read_bytes() == b"not a directory"


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root ignores directory permissions")
def test_cache_dir_read_only(tmp_path, monkeypatch, clean, logs, fresh_process):
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o555)
    try:
        monkeypatch.setenv("CUFLASH_CACHE_DIR", str(d))
        ck = _compile.compile_cached(spec_a(), TARGET)
        assert _same_build(ck.cubin, clean[spec_a().name].cubin) and ck.cubin_path is None
        assert len(_warnings(logs)) == 1
        assert list(d.iterdir()) == []
    finally:
        d.chmod(0o755)


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EACCES])
def test_write_error(err, tmp_path, monkeypatch, clean, logs, fresh_process):
    """Any OSError from the write helper (full disk, permission, I/O) leaves the call working."""
    d = tmp_path / "cache"
    monkeypatch.setenv("CUFLASH_CACHE_DIR", str(d))

    def fail(path, data):
        raise OSError(err, os.strerror(err), str(path))
    monkeypatch.setattr(_compile, "_write_atomic", fail)
    for spec in (spec_a(), spec_b()):
        ck = _compile.compile_cached(spec, TARGET)
        assert _same_build(ck.cubin, clean[spec.name].cubin) and ck.cubin_path is None
    warns = _warnings(logs)
    assert len(warns) == 1 and os.strerror(err) in warns[0], warns


@pytest.mark.parametrize("which", ["cubin", "json"])
def test_disk_full_in_the_middle_of_a_write(which, tmp_path, monkeypatch, clean, logs, fresh_process):
    """ENOSPC after part of a file was written: no temporary file is left, no entry is committed, and the
    next process (with space again) writes a good entry."""
    d = tmp_path / "cache"
    monkeypatch.setenv("CUFLASH_CACHE_DIR", str(d))
    real = _compile._write_file

    def half_then_enospc(path, data):
        if path.name.split(".")[-4] == which:  # .<stem>.<cubin|json>.<pid>.<thread>.tmp
            real(path, data[: len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real(path, data)
    monkeypatch.setattr(_compile, "_write_file", half_then_enospc)
    ck = _compile.compile_cached(spec_a(), TARGET)
    assert _same_build(ck.cubin, clean[spec_a().name].cubin) and ck.cubin_path is None
    assert _no_tmp_left(d) == []
    assert not _paths(spec_a())[1].exists()
    assert len(_warnings(logs)) == 1 and "No space left" in _warnings(logs)[0]

    monkeypatch.setattr(_compile, "_write_file", real)
    again = _compile.compile_cached(spec_a(), TARGET)
    assert again.compile_seconds > 0 and again.cubin_path is not None
    _assert_entry_good(spec_a(), clean)
    assert len(_warnings(logs)) == 1


# ------------------------------------------------------------------------------------------------
# Processes building one entry at once


_WORKER = textwrap.dedent("""
    import json, logging, os, sys, time
    from pathlib import Path
    barrier, n, me = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    records = []
    class Keep(logging.Handler):
        def emit(self, r): records.append((r.levelname, r.getMessage()))
    logging.getLogger("cuflash").addHandler(Keep())
    logging.getLogger("cuflash").setLevel(logging.INFO)
    from cuflash import _compile, _config, _launch
    spec, _ = _launch.fwd_specialization("float16", 64, _config.fwd_config("sm80", 64, "float16"), False, True)
    (barrier / me).touch()
    t0 = time.time()
    while len(list(barrier.iterdir())) < n and time.time() - t0 < 60:
        time.sleep(0.005)
    ck = _compile.compile_cached(spec, "sm_80")
    print(json.dumps({"seconds": ck.compile_seconds, "records": records,
                      "sha": __import__("hashlib").sha256(ck.cubin).hexdigest()}))
""")


def test_processes_build_one_entry_once(tmp_path, clean):
    """4 processes on one cold cache: all get the kernel, one compiles it, the others wait on the entry's
    lock and read it; no warning, and the entry is consistent."""
    n = 4
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    env = dict(os.environ, CUFLASH_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(ROOT))
    procs = [subprocess.Popen([sys.executable, "-c", _WORKER, str(barrier), str(n), str(i)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(n)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    compiled = [r for r in results if r["seconds"] > 0]
    assert len(compiled) == 1, [r["seconds"] for r in results]
    assert len({r["sha"] for r in results}) == 1
    assert not [rec for r in results for rec in r["records"] if rec[0] == "WARNING"]
    meta = json.loads(next((tmp_path / "cache").glob("*.json")).read_text())
    cubin = next((tmp_path / "cache").glob("*.cubin")).read_bytes()
    assert meta["cubin_sha256"] == hashlib.sha256(cubin).hexdigest() == results[0]["sha"]
    assert _same_build(cubin, clean[spec_a().name].cubin)


# ------------------------------------------------------------------------------------------------
# python -m cuflash cache [--clear]


def _cli(capsys, *argv):
    from cuflash import __main__ as cli

    rc = cli.main(list(argv))
    return rc, capsys.readouterr().out


def test_cli_cache_shows_and_clears_only_cuflash_files(cache, capsys):
    # Someone else's files, which a shared directory may hold: never counted, never deleted.
    strangers = {"package.json": b"{}", "model.cubin": b"x" * 10, "notes.txt": b"hi",
                 ".hidden.tmp": b"t", "fwd_x-sm_80-zz.json": b"{}"}
    for name, data in strangers.items():
        (cache / name).write_bytes(data)
    (cache / "subdir").mkdir()
    (cache / "subdir" / f"{_paths(spec_a())[0].name}").write_bytes(b"nested")
    # Leftovers of cuflash's own: a temporary file and a .cubin without its .json.
    stem_a = _paths(spec_a())[0].stem
    (cache / f".{stem_a}.cubin.123.456.tmp").write_bytes(b"t" * 7)
    orphan = _compile._entry(spec_a(), "sm_90a").cubin
    orphan.write_bytes(b"o" * 5)

    entry_bytes = sum(p.stat().st_size for s in (spec_a(), spec_b()) for p in _paths(s))
    st = _compile.cache_stats()
    assert (st.entries, st.entry_bytes, st.partial, st.partial_bytes) == (2, entry_bytes, 2, 12)
    assert st.by_target == {TARGET: 2}

    rc, out = _cli(capsys, "cache")
    assert rc == 0
    assert str(cache) in out and "2 kernels" in out and f"{entry_bytes:,} bytes" in out, out
    assert "sm_80: 2" in out and "2 incomplete" in out, out

    rc, out = _cli(capsys, "cache", "--clear")
    assert rc == 0 and "removed" in out, out
    left = sorted(p.name for p in cache.iterdir())
    assert left == sorted(list(strangers) + ["subdir"]), left
    assert (cache / "subdir" / _paths(spec_a())[0].name).read_bytes() == b"nested"
    for name, data in strangers.items():
        assert (cache / name).read_bytes() == data

    rc, out = _cli(capsys, "cache")
    assert rc == 0 and "0 kernels" in out, out


def test_cli_cache_missing_and_not_a_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CUFLASH_CACHE_DIR", str(tmp_path / "nothing"))
    rc, out = _cli(capsys, "cache")
    assert rc == 0 and "does not exist" in out, out
    rc, out = _cli(capsys, "cache", "--clear")
    assert rc == 0 and "nothing to clear" in out, out
    assert not (tmp_path / "nothing").exists()

    f = tmp_path / "afile.json"
    f.write_bytes(b"{}")
    monkeypatch.setenv("CUFLASH_CACHE_DIR", str(f))
    rc, out = _cli(capsys, "cache")
    assert rc == 1 and "not a directory" in out, out
    rc, out = _cli(capsys, "cache", "--clear")
    assert rc == 1 and f.read_bytes() == b"{}", out


def test_cli_no_arguments_runs_the_self_check(monkeypatch, capsys):
    from cuflash import __main__ as cli

    ran = []
    monkeypatch.setattr(cli, "_gpu_available", lambda: None)
    monkeypatch.setattr(cli, "_check_cpu", lambda: ran.append(1) or True)
    rc, out = _cli(capsys)
    assert rc == 0 and ran == [1] and "self-check: PASSED" in out, out


def test_cli_entry_point(cache):
    """`python -m cuflash cache` in a new process, as a user types it."""
    env = dict(os.environ, CUFLASH_CACHE_DIR=str(cache), PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "cuflash", "cache"], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert str(cache) in r.stdout and "2 kernels" in r.stdout, r.stdout
