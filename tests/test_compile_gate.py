"""Compile gate (CPU, runs in CI): every kernel specialization the dispatcher can select compiles for
sm_80 and sm_90a through the NVRTC path used at run time, with no register spill, no stack frame,
and shared memory within the target's limit. Also the Params layout and the disk-cache key."""

import json
import os
import re

import pytest

from cuflash import _compile, _config, _launch
from cuflash._gpu import compile_many

pytest.importorskip("cupy_backends.cuda.libs.nvrtc")

TARGETS = ("sm_80", "sm_90a")


def _ptxas_problems(name, smem, log, target):
    """What is wrong with one kernel's ptxas report, as a list of strings."""
    problems = []
    frames = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if not frames:
        return [f"{name}: no ptxas resource report in the log"]
    for frame, st, ld in frames:
        if int(frame) or int(st) or int(ld):
            problems.append(f"{name} ({target}): {frame} B stack frame, {st} B spill stores, {ld} B spill loads")
    if "wgmma.mma_async instructions are serialized" in log:  # ptxas C7519 and kin: a silent slowdown
        problems.append(f"{name} ({target}): ptxas serializes its wgmma instructions")
    static = sum(int(x) for x in re.findall(r"(\d+) bytes smem", log))
    limit = _config.SMEM_LIMIT[_config.family_of_target(target)]
    if static + smem > limit:
        problems.append(f"{name} ({target}): {static} B static + {smem} B dynamic shared memory > {limit} B")
    return problems


def _all_specs(kind, target):
    if kind == "feat":
        # The feature kernels (lengths, packed batches, window, sinks, ALiBi, softcap): per (dtype,
        # head_dim) the forward, preprocess, dK/dV and dQ; on sm_90a the wgmma forward as well where
        # it serves the head_dim (narrow windows take 64-row tiles); the two tail fills.
        # With the wgmma dK/dV kernel, also its atomic dQ path (preprocess zeroing dQ, dK/dV, conversion).
        specs = _launch.all_feat_specializations(target)
        wgmma = 0 if target != "sm_90a" else len(_config.WGMMA_FWD_HEAD_DIMS) + 3 * len(_config.FEAT_ATOMIC_DQ_HEAD_DIMS)
        assert len(specs) == len(_config.DTYPES) * (len(_config.HEAD_DIMS) * 4 + wgmma) + 2
        assert len({spec.name for spec, _ in specs}) == len(specs)
        return specs
    if kind == "decode":
        # attention_with_kvcache: the decode kernel and the split combine per (dtype, head_dim) (every
        # head_dim fits on sm_80 and sm_90a), the 8-warp decode kernel per (dtype, head_dim 64, 80,
        # 96, 112, 128), the append, and the paged prefill's gather.
        # On sm_90a, both decode kernels of head_dim 64 and 128 also in their TMA variant, and the
        # 4-warp TMA kernel of head_dim 128 also with 4 stages (_config.decode_deep_tma) and with 2
        # (_config.decode_shallow_tma); each TMA kernel also as its twin for a paged cache's 16-key
        # groups ("_tma_grp": _config.decode_group_kernel). Each 4-warp TMA kernel (every depth, both
        # twins) also with two m16 tiles a warp ("_m2": _config.decode_two_tiles). The 4-warp TMA kernel of
        # head_dim 128 at 2, 3 and 4 stages and the 8-warp one also serving 2 and 4 kv heads a block ("_h2",
        # "_h4": _config.decode_heads).
        specs = _launch.all_decode_specializations(target)
        wide = [d for d in _config.HEAD_DIMS if _config.decode_wide_supported(d)]
        assert len(wide) == 5
        n_tma = (2 * len(_config.DECODE_TMA_HEAD_DIMS) + 2) if target == "sm_90a" else 0
        n_m2 = (len(_config.DECODE_TMA_HEAD_DIMS) + 2) if target == "sm_90a" else 0  # (head_dim 128: 3 depths)
        n_heads = 8 if target == "sm_90a" else 0
        assert len(specs) == len(_config.DTYPES) * (len(_config.HEAD_DIMS) * 2 + len(wide) + 2 * n_tma + 2 * n_m2
                                                    + n_heads) + 2
        for h in (2, 4):
            want = [f"decode_{t}_d128_{k}_tma_h{h}" for t in ("bf16", "f16") for k in ("s2", "s3", "s4", "s3_w8")]
            assert sorted(spec.name for spec, _ in specs if spec.name.endswith(f"_tma_h{h}")) == sorted(
                want if n_heads else [])
        assert sum(spec.name.endswith("_w8") for spec, _ in specs) == len(_config.DTYPES) * len(wide)
        assert sum(spec.name.endswith("_tma") for spec, _ in specs) == len(_config.DTYPES) * n_tma
        assert sum(spec.name.endswith("_tma_grp") for spec, _ in specs) == len(_config.DTYPES) * n_tma
        assert sum(spec.name.endswith("_tma_m2") for spec, _ in specs) == len(_config.DTYPES) * n_m2
        assert sum(spec.name.endswith("_tma_grp_m2") for spec, _ in specs) == len(_config.DTYPES) * n_m2
        return specs
    if kind == "tma":
        # The TMA probe (cuda_src/tma_probe.cu, docs/hopper_plan.md step 1): sm_90a only.
        from cuflash import _tma

        specs = _tma.all_probe_specializations(target)
        assert len(specs) == (len(_tma.PROBE_SHAPES) if target == "sm_90a" else 0)
        # ... and the forward's TMA variant (plain calls on sm_90a): every plain wgmma forward, with its
        # tiles; head_dim 64 causal in 64 x 128 tiles too (from FWD_TMA_CAUSAL_WIDE_SEQLEN_K keys);
        # and head_dim 64's in the tiles of the head dims that pad up to it where they differ from its
        # own (cuflash/_config.py fwd_pad_tma_config; even and ragged, each dtype).
        tma_fwd = _launch.all_fwd_tma_specializations(target)
        n_wgmma = sum(spec.name.startswith("fwd90_") for spec, _ in _launch.all_fwd_specializations(target))
        wide = _config.FWD_TMA_CAUSAL_WIDE_SEQLEN_K
        own = {(c, _config.fwd_tma_config_for_target(target, 64, "float16", c, sk))
               for c in (False, True) for sk in (1, wide)}
        assert len(own) == (3 if target == "sm_90a" else 2), own  # causal: 64 x 64, 64 x 128
        extra_own = len(own) - 2  # past the plain wgmma forward's one tile per (head_dim 64, causal)
        pad_tiles = {(c, _config.fwd_pad_tma_config(target, d, "float16", c, lo))
                     for (d, c), (lo, _) in _config.FWD_PAD_SMALL_TMA_SEQLEN_K.items()
                     if _config.fwd_pad_tma(target, d, c, lo)} - own
        assert len(pad_tiles) == (2 if target == "sm_90a" else 0), pad_tiles  # 128 x 64, causal and not
        assert len(tma_fwd) == n_wgmma + len(_config.DTYPES) * 2 * (len(pad_tiles) + extra_own)
        assert all(spec.name.endswith("_tma") for spec, _ in tma_fwd)
        # ... and the warp-specialized forward: every (head_dim, causal) of its table, even and ragged,
        # in both schedules (pingpong: CUFLASH_FWD_WS_PINGPONG=1), on both grids (persistent:
        # CUFLASH_FWD_WS_PERSISTENT). (Three consumer warpgroups have no pingpong schedule.)
        ws_fwd = _launch.all_fwd_ws_specializations(target, pingpong=(False, True), persistent=(False, True))
        n_three = sum(cfg[3] == 3 for cfg in _config.FWD_WS_TABLE.values())
        n_three_p = sum(cfg[3] == 3 for cfg in _config.FWD_WS_PERSISTENT_TABLE.values())
        # ... the persistent non-causal ones once more as split kernels (cuflash/_schedule.py
        # split_schedule), with two FEAT kernels per head_dim of FWD_WS_FEAT_TABLE (contiguous, and paged
        # caches read through a block table: _launch.PagedKV), and from head_dim 128 a third (paged, in
        # boxes of whole rows: the interleaved layout, "_paged_ilv").
        n_split = sum(4 if cfg[3] == 2 else 2 for (d, c), cfg in _config.FWD_WS_PERSISTENT_TABLE.items() if not c)
        n_ilv = sum(d >= 128 for d in _config.FWD_WS_FEAT_TABLE)
        assert n_ilv == 2
        assert len(ws_fwd) == (len(_config.DTYPES) * (len(_config.FWD_WS_TABLE) * 4 - 2 * n_three
                                                      + len(_config.FWD_WS_PERSISTENT_TABLE) * 4 - 2 * n_three_p
                                                      + n_split + 2 * len(_config.FWD_WS_FEAT_TABLE) + n_ilv)
                               if target == "sm_90a" else 0)
        assert sum(spec.name.endswith("_split") for spec, _ in ws_fwd) == (len(_config.DTYPES) * n_split
                                                                          if target == "sm_90a" else 0)
        assert sum(spec.name.endswith("_paged") for spec, _ in ws_fwd) == (
            len(_config.DTYPES) * len(_config.FWD_WS_FEAT_TABLE) if target == "sm_90a" else 0)
        assert sum(spec.name.endswith("_paged_ilv") for spec, _ in ws_fwd) == (
            len(_config.DTYPES) * n_ilv if target == "sm_90a" else 0)
        assert len({spec.name for spec, _ in ws_fwd}) == len(ws_fwd)
        # ... and the dK/dV kernel's TMA variant (CUFLASH_BWD_TMA=1).
        tma_bwd = _launch.all_bwd_tma_specializations(target)
        assert all(spec.name.endswith("_tma") for spec, _ in tma_bwd)
        assert bool(tma_bwd) == (target == "sm_90a")
        # ... and the warp-specialized backward: per (dtype, head_dim) its kernel for causal x even x
        # (BLOCK_M, ring depth, dQ path) where it fits, dQ from registers (red) and, for tuning, by bulk
        # reductions through sdQ (head_dim 64: 128 x 2 red and bulk, 128 x 3 red; 64 x 2 and 64 x 3, red
        # and bulk; head_dim 128: 64 x 2 and 64 x 3, red and bulk; head_dim 256: 64 x 2), the zeroing
        # preprocess and the permuted dQ conversions; its FEAT and SEQS kernels (red and bulk, except
        # head_dim 64's SEQS, bulk only, and 256's, one path) with the feature preprocess and the SEQS
        # conversion; and per head_dim that pads up (_config.bwd_pad_head_dim) a zeroing and a feature
        # preprocess, a conversion (plain and FEAT) and a SEQS conversion.
        ws_bwd = _launch.all_bwd_ws_specializations(target, stages=(2, 3), tuning=True)
        n_pad = sum(_config.bwd_pad_head_dim(target, d) is not None for d in _config.HEAD_DIMS)
        assert len(ws_bwd) == (len(_config.DTYPES) * ((7 * 4 + 3) + (4 * 4 + 2) + (4 + 2) + (5 + 6 + 4) + 4 * n_pad)
                               if target == "sm_90a" else 0)
        assert len({spec.name for spec, _ in ws_bwd}) == len(ws_bwd)
        return specs + tma_fwd + ws_fwd + tma_bwd + ws_bwd
    if kind == "fwd":
        specs = _launch.all_fwd_specializations(target)
        # One specialization per (dtype, head_dim, causal, even): nothing may be left out.
        assert len(specs) == len(_config.DTYPES) * len(_config.HEAD_DIMS) * 4
        wgmma = [spec.name for spec, _ in specs if spec.name.startswith("fwd90_")]
        assert len(wgmma) == (len(_config.DTYPES) * len(_config.WGMMA_FWD_HEAD_DIMS) * 4 if target == "sm_90a" else 0)
    else:
        # The deterministic dQ path always; the atomic one where the dispatcher selects it.
        specs = _launch.all_bwd_specializations(target)
        # Per (dtype, head_dim): preprocess, 4 dK/dV (causal x even), 4 dQ [+ the atomic path's
        # zeroing preprocess, 4 dK/dV and the conversion].
        expected = sum(9 + (6 if len(_launch.bwd_atomic_choices(target, d)) == 2 else 0) for d in _config.HEAD_DIMS)
        assert len(specs) == len(_config.DTYPES) * expected
        if target == "sm_90a":  # the wgmma kernels are among them
            names = [spec.name for spec, _ in specs]
            for d in _config.WGMMA_BWD_HEAD_DIMS:
                assert sum(n.startswith(f"bwd90_dkdv_bf16_d{d}_") for n in names) == 8, d
        # ... and the one-launch backward of short calls: per (dtype, head_dim from 32), causal x even.
        single = _launch.all_bwd_single_specializations(target)
        n_dims = sum(d >= _config.BWD_SINGLE_MIN_HEAD_DIM for d in _config.HEAD_DIMS)
        assert n_dims == len(_config.HEAD_DIMS) - 3 and len(single) == len(_config.DTYPES) * n_dims * 4
        assert len({spec.name for spec, _ in single}) == len(single)
        assert all(spec.name.startswith("bwd_single_") for spec, _ in single)
        specs = specs + single
    return specs


@pytest.mark.parametrize("kind", ["fwd", "bwd", "feat", "decode", "tma"])
@pytest.mark.parametrize("target", TARGETS)
def test_every_specialization_compiles_clean(kind, target, tmp_path, monkeypatch):
    specs = _all_specs(kind, target)
    if not specs:
        assert kind == "tma" and target != "sm_90a"
        return  # TMA exists on sm_90 only: nothing to build for this target
    smem_of = {spec.name: smem for spec, smem in specs}
    # The run-time path (NVRTC via the disk cache, in worker processes), into an empty cache.
    monkeypatch.setenv("CUFLASH_CACHE_DIR", str(tmp_path))
    results = compile_many([spec for spec, _ in specs], target, return_logs=True)
    assert all(seconds > 0 for _, seconds, _ in results), "a kernel came from a cache instead of NVRTC"
    problems = [p for name, _, log in results for p in _ptxas_problems(name, smem_of[name], log, target)]
    assert not problems, "\n".join(problems)


def _wgmma_specs():
    """Every sm_90a specialization with wgmma in it (the fwd90 and bwd90 families), each once."""
    seen, out = set(), []
    for kind in ("fwd", "bwd", "feat", "tma"):
        for spec, smem in _all_specs(kind, "sm_90a"):
            if spec.name.startswith(("fwd90", "bwd90")) and spec.name not in seen:
                seen.add(spec.name)
                out.append((spec, smem))
    return out


@pytest.mark.skipif(not os.environ.get("CUFLASH_GATE_NVRTC_LIB"),
                    reason="CUFLASH_GATE_NVRTC_LIB unset: no second NVRTC to build the wgmma kernels with (.ci/run sets it)")
def test_wgmma_kernels_compile_clean_with_the_device_nvrtc(tmp_path, monkeypatch):
    """The wgmma kernels again, with the GPU machine's NVRTC (CUFLASH_GATE_NVRTC_LIB, a libnvrtc of version
    CUFLASH_GATE_NVRTC_VERSION, default 13.0) loaded into the worker processes in place of the installed one.
    ptxas versions differ in when they serialize wgmma: in session 18 a forward that NVRTC 13.5 built clean had
    every wgmma serialized (C7513) by the device's 13.0, and the gate above, which runs 13.5, said nothing."""
    lib = os.environ["CUFLASH_GATE_NVRTC_LIB"]
    want = os.environ.get("CUFLASH_GATE_NVRTC_VERSION", "13.0")
    assert os.path.isfile(lib), f"CUFLASH_GATE_NVRTC_LIB: {lib!r} is not a file"
    specs = _wgmma_specs()
    assert len(specs) > 100
    smem_of = {spec.name: smem for spec, smem in specs}
    monkeypatch.setenv("CUFLASH_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("LD_PRELOAD", lib)
    monkeypatch.setenv("LD_LIBRARY_PATH", os.path.dirname(lib) + os.pathsep + os.environ.get("LD_LIBRARY_PATH", ""))
    # Worker processes only (one worker would compile in this process, with the installed NVRTC).
    results = compile_many([spec for spec, _ in specs], "sm_90a", workers=max(2, os.cpu_count() or 2), return_logs=True)
    assert all(seconds > 0 for _, seconds, _ in results), "a kernel came from a cache instead of NVRTC"
    built_with = {json.loads(f.read_text())["nvrtc"] for f in tmp_path.glob("*.json")}
    assert built_with == {want}, f"the workers' NVRTC was {sorted(built_with)}, expected {want}"
    problems = [p for name, _, log in results for p in _ptxas_problems(name, smem_of[name], log, "sm_90a")]
    assert not problems, "\n".join(problems)


def test_gate_detects_spills_and_smem():
    """The log parser must flag a spill, a stack frame and too much shared memory."""
    good = "ptxas . 0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\nUsed 100 registers"
    assert _ptxas_problems("x", 1000, good, "sm_80") == []
    bad = "ptxas . 16 bytes stack frame, 8 bytes spill stores, 8 bytes spill loads"
    assert _ptxas_problems("x", 1000, bad, "sm_80")
    assert _ptxas_problems("x", 170000, good, "sm_80")          # > 163 KB
    assert not _ptxas_problems("x", 170000, good, "sm_90a")     # < 227 KB
    assert _ptxas_problems("x", 1000, "no report", "sm_80")
    serial = good + "\nptxas info    : (C7519) Potential Performance Loss: wgmma.mma_async instructions are serialized"
    assert _ptxas_problems("x", 1000, serial, "sm_90a")


def test_params_layout_matches_numpy_mirror():
    """sizeof and every field offset of FwdParams, BwdParams, MaskParams (nested in both), TailParams,
    DecodeParams, GatherParams and TmaProbeParams equal the NumPy dtypes' (static_assert in C++)."""
    cfg = _config.feat_fwd_config("sm_90a", 64, "float16")
    spec, _ = _launch.fwd_specialization("float16", 64, cfg, False, False, feat=True)
    checks = "\n".join(_compile.params_layout_checks("cuflash", name, dt, offsets=True) for name, dt in (
        ("FwdParams", _launch.FWD_PARAMS), ("BwdParams", _launch.BWD_PARAMS), ("MaskParams", _launch.MASK_PARAMS)))
    spec = _compile.Specialization(spec.source, spec.expression, spec.name, checks)
    _compile.nvrtc_compile(spec, "sm_90a")
    tail = _launch.tail_specialization("u16")
    checks = _compile.params_layout_checks("cuflash", "TailParams", _launch.TAIL_PARAMS, offsets=True)
    _compile.nvrtc_compile(_compile.Specialization(tail.source, tail.expression, tail.name, checks), "sm_90a")
    # attention_with_kvcache's DecodeParams (MaskParams nested) and the paged prefill's GatherParams
    # ... and the TMA probe's TmaProbeParams (a 64-byte aligned tensor map first)
    from cuflash import _tma

    for spec, name, dt in ((_launch.decode_append_specialization(), "DecodeParams", _launch.DECODE_PARAMS),
                           (_launch.gather_specialization(), "GatherParams", _launch.GATHER_PARAMS),
                           (_tma.probe_specialization(64, 1), "TmaProbeParams", _tma.PROBE_PARAMS)):
        checks = _compile.params_layout_checks("cuflash", name, dt, offsets=True)
        _compile.nvrtc_compile(_compile.Specialization(spec.source, spec.expression, spec.name, checks), "sm_90a")


def test_params_layout_check_can_fail():
    """A mirror with a field in the wrong place must not compile."""
    import numpy as np

    names = list(_launch.FWD_PARAMS.names)
    wrong = np.dtype([(n, _launch.FWD_PARAMS.fields[n][0]) for n in [names[1], names[0]] + names[2:]], align=True)
    cfg = _config.fwd_config("sm90", 64, "float16")
    spec, _ = _launch.fwd_specialization("float16", 64, cfg, False, True)
    checks = _compile.params_layout_checks("cuflash", "FwdParams", wrong, offsets=True)
    with pytest.raises(_compile.CompileError, match="offset differs"):
        _compile.nvrtc_compile(_compile.Specialization(spec.source, spec.expression, spec.name, checks), "sm_90a")


def test_smem_formula_mismatch_fails_to_compile():
    cfg = _config.fwd_config("sm90", 128, "bfloat16")
    spec, smem = _launch.fwd_specialization("bfloat16", 128, cfg, True, False)
    bad = spec.checks.replace(f"== {smem}", f"== {smem + 16}")
    with pytest.raises(_compile.CompileError, match="shared memory size differs"):
        _compile.nvrtc_compile(_compile.Specialization(spec.source, spec.expression, spec.name, bad), "sm_80")


@pytest.mark.parametrize("kind", ["fwd", "bwd"])
def test_wgmma_smem_formula_mismatch_fails_to_compile(kind):
    if kind == "fwd":
        cfg = _config.fwd_config_for_target("sm_90a", 128, "bfloat16", True)
        spec, smem = _launch.fwd_specialization("bfloat16", 128, cfg, True, False)
    else:
        (_, _, _), (spec, smem, cfg), _ = _launch.bwd_specializations("float16", 64, "sm_90a", False, True, True, True)
    assert cfg.wgmma
    bad = spec.checks.replace(f"== {smem}", f"== {smem - 1024}")
    with pytest.raises(_compile.CompileError, match="shared memory size differs"):
        _compile.nvrtc_compile(_compile.Specialization(spec.source, spec.expression, spec.name, bad), "sm_90a")


def test_cache_key_covers_headers_options_and_target(tmp_path, monkeypatch):
    import shutil

    src = tmp_path / "cuda_src"
    shutil.copytree(_compile.cuda_src_dir(), src)
    monkeypatch.setattr(_compile, "_SRC_CANDIDATES", (src,))
    monkeypatch.setattr(_compile, "_sources_cache", None)
    cfg = _config.fwd_config("sm90", 64, "float16")
    spec, _ = _launch.fwd_specialization("float16", 64, cfg, False, True)
    opts = _compile.base_options("sm_90a")
    k0 = _compile.cache_key(spec, "sm_90a", opts)
    assert _compile.cache_key(spec, "sm_80", _compile.base_options("sm_80")) != k0
    assert _compile.cache_key(spec, "sm_90a", opts + ["-lineinfo"]) != k0
    # A change in a header that the main file includes changes the key.
    (src / "softmax.cuh").write_text((src / "softmax.cuh").read_text() + "\n// changed\n")
    monkeypatch.setattr(_compile, "_sources_cache", None)
    assert _compile.cache_key(spec, "sm_90a", opts) != k0


def test_decode_timeline_probe_is_opt_in(monkeypatch):
    """CUFLASH_DECODE_TIMELINE=1 compiles the decode kernel's timeline probe in (its own cache key);
    without it the kernel carries no probe: the normal cubin has no trace of the probe's buffer."""
    spec = next(s for s, _ in _launch.all_decode_specializations("sm_90a", head_dims=[128], dtypes=["bfloat16"])
                if s.name == "decode_bf16_d128_s3_w8_tma")
    monkeypatch.delenv("CUFLASH_DECODE_TIMELINE", raising=False)
    plain = _compile.base_options("sm_90a")
    assert not any("TIMELINE" in o for o in plain)
    assert b"cuflash_decode_timeline" not in _compile.nvrtc_compile(spec, "sm_90a", plain).cubin
    monkeypatch.setenv("CUFLASH_DECODE_TIMELINE", "1")
    probe = _compile.base_options("sm_90a")
    assert "-DCUFLASH_DECODE_TIMELINE=1" in probe
    assert _compile.cache_key(spec, "sm_90a", probe) != _compile.cache_key(spec, "sm_90a", plain)
    assert b"cuflash_decode_timeline" in _compile.nvrtc_compile(spec, "sm_90a", probe).cubin


def test_disk_cache_roundtrip(tmp_path, monkeypatch):
    monkeypatch.setenv("CUFLASH_CACHE_DIR", str(tmp_path))
    cfg = _config.fwd_config("sm90", 32, "bfloat16")
    spec, _ = _launch.fwd_specialization("bfloat16", 32, cfg, True, False)
    first = _compile.compile_cached(spec, "sm_90a")
    assert first.compile_seconds > 0 and first.cubin_path is not None and first.cubin_path.is_file()
    again = _compile.compile_cached(spec, "sm_90a")
    assert again.compile_seconds == 0.0 and again.cubin == first.cubin
    assert again.lowered_name == first.lowered_name
    assert spec.name in first.cubin_path.name
