"""CPU: the GPU pipeline's wiring, checked without a GPU.

A fake device adapter serves NumPy arrays as if they lived on cuda:0 (pointers are their host
addresses); compute_capability, kernel loading and cuLaunchKernel are replaced by stand-ins that
record each launch: the kernel's readable name, grid, block, shared memory, stream, and the Params
bytes it would have received. The tests decode those bytes and check every pointer, stride and size
against the arrays of the call: that a plan built once and run again with other arrays patches
the new pointers in, that inputs the kernels cannot read in place are copied, that the backward's
scratch offsets do not overlap, and that the options reach MaskParams. The kernels themselves are
tested on the GPU (tests/test_gpu_*.py); this is the part between the API and cuLaunchKernel.
"""

from __future__ import annotations

import ctypes
import math

import ml_dtypes
import numpy as np
import pytest

from _cpu_helpers import _fresh_decode_plans, _kvcache_route

import cuflash
from cuflash import _adapters, _compile, _config, _gpu, _kvcache, _launch, _plan
from cuflash._adapters._numpy import NumpyAdapter
from cuflash._call import ArrayInfo

BF16 = np.dtype(ml_dtypes.bfloat16)


class Dev(np.ndarray):
    """A NumPy array standing in for a device array."""


class FakeCuda(NumpyAdapter):
    lib = "fakecuda"

    def __init__(self):
        self.allocs = []

    def info(self, x):
        return ArrayInfo("fakecuda", tuple(x.shape), tuple(s // x.itemsize for s in x.strides), x.dtype.name,
                         ("cuda", 0), x.ctypes.data % 16 == 0, "Dev")

    def sig(self, x):
        return (x.dtype, x.shape, x.strides, x.ctypes.data & 15)

    def ptr(self, x, keep):
        return x.ctypes.data

    def stream(self, device_id):
        return 77

    def empty(self, shape, dtype, device_id):
        dt = np.dtype(BF16 if dtype == "bfloat16" else dtype)
        # NaN where a float can hold it; an integer buffer (offsets, counters) gets a value no count or
        # offset takes: a signed type's minimum, an unsigned type's maximum
        fill = np.nan if dt.kind not in "iu" else np.iinfo(dt).min if dt.kind == "i" else np.iinfo(dt).max
        a = np.full(shape, fill, dtype=dt).view(Dev)
        self.allocs.append(a)
        return a

    def contiguous(self, x, device_id, keep):
        c = np.array(x, order="C", copy=True).view(Dev)  # a new allocation, as the real adapters make
        keep.append(c)
        self.copies.append(c)
        return c

    def dsink_sum(self, scratch, offset, shape, device_id):
        n = shape[0] * shape[1] * shape[2]
        return np.asarray(scratch[offset:offset + n]).reshape(shape).sum(axis=(0, 2))


def _int32_at(addr: int) -> int:
    return ctypes.c_int32.from_address(addr).value


def run_append_kernel(p) -> None:
    """cuda_src/flash_decode.cu's decode_append_kernel on the host, from its decoded DecodeParams (the
    stand-in runs it where a GPU would, on the arrays' memory): entry b's new token i into its cache
    position t = clamp(cache_seqlens[b], 0, capacity) + i where t < capacity (its row
    clamp(cache_batch_idx[b]) of a contiguous cache, or its block clamp(block_table[b, t // page_size])
    of a paged one), and with kv_lengths L_b = min(clamp(cache_seqlens[b], 0, capacity) + seqlen_new,
    capacity) into kv_lengths[b]. Head rows are copied whole (unit-stride last dimension)."""
    batch, n, cap, page, rows = (int(p[f]) for f in ("batch", "seqlen_new", "capacity", "page_size", "cache_rows"))
    hk, d = int(p["nheads_kv"]), int(p["head_dim"])
    for b in range(batch):
        s = _int32_at(int(p["cache_seqlens"]) + 4 * b) if int(p["cache_seqlens"]) else int(p["fixed_seqlen"])
        s = min(max(s, 0), cap)
        if int(p["kv_lengths"]):
            ctypes.c_int32.from_address(int(p["kv_lengths"]) + 4 * b).value = min(s + n, cap)
        for i in range(n):
            t = s + i
            if t >= cap:
                continue
            for x, new in (("k", "kn"), ("v", "vn")):
                if page:
                    blk = _int32_at(int(p["block_table"]) + 4 * (b * int(p["table_stride"]) + t // page))
                    off = min(max(blk, 0), rows - 1) * int(p[f"{x}_batch_stride"]) + (t % page) * int(p[f"{x}_row_stride"])
                else:
                    row = min(max(_int32_at(int(p["cache_batch_idx"]) + 4 * b), 0), rows - 1) if int(
                        p["cache_batch_idx"]) else b
                    off = row * int(p[f"{x}_batch_stride"]) + t * int(p[f"{x}_row_stride"])
                for h in range(hk):
                    src = int(p["k_new" if x == "k" else "v_new"]) + 2 * (
                        b * int(p[f"{new}_batch_stride"]) + i * int(p[f"{new}_row_stride"]) + h * int(p[f"{new}_head_stride"]))
                    ctypes.memmove(int(p[x]) + 2 * (off + h * int(p[f"{x}_head_stride"])), src, 2 * d)


def run_gather_kernel(p) -> None:
    """cuda_src/paged_gather.cu's paged_gather_kernel in its chunk mode (lengths_out set) on the host, from
    its decoded GatherParams, as run_append_kernel: entry b holds s = clamp(cache_seqlens[b], 0, capacity)
    keys and sees L = min(s + seqlen_new, capacity); L goes to lengths_out[b]; its keys and values t < L
    go to rows b * capacity + t of dst and dst_v, t < s from its pages (block clamp(block_table[b, t //
    page_size]), row t % page_size), t >= s from new token t - s, which is first written into its page
    slot. Other modes: nothing (the tests of attention_varlen's gather read only the parameters)."""
    if not int(p["lengths_out"]):
        return
    batch, cap, page, nblk = (int(p[f]) for f in ("batch", "max_seqlen_k", "page_size", "num_blocks"))
    hk, d, n = int(p["nheads_kv"]), int(p["head_dim"]), int(p["seqlen_new"])
    for b in range(batch):
        raw = _int32_at(int(p["cache_seqlens"]) + 4 * b) if int(p["cache_seqlens"]) else int(p["fixed_seqlen"])
        s = min(max(raw, 0), cap)
        length = min(s + n, cap)
        ctypes.c_int32.from_address(int(p["lengths_out"]) + 4 * b).value = length
        first_new = s if int(p["new_k"]) else cap
        for t in range(length):
            blk = min(max(_int32_at(int(p["block_table"]) + 4 * (b * int(p["table_stride"]) + t // page)), 0),
                      nblk - 1)
            for cache, pre, out, new, npre in ((p["src"], "src", p["dst"], p["new_k"], "newk"),
                                               (p["src_v"], "srcv", p["dst_v"], p["new_v"], "newv")):
                off = blk * int(p[f"{pre}_block_stride"]) + (t % page) * int(p[f"{pre}_row_stride"])
                for h in range(hk):
                    slot = int(cache) + 2 * (off + h * int(p[f"{pre}_head_stride"]))
                    if t >= first_new:
                        ctypes.memmove(slot, int(new) + 2 * (b * int(p[f"{npre}_batch_stride"]) + (t - s) * int(
                            p[f"{npre}_row_stride"]) + h * int(p[f"{npre}_head_stride"])), 2 * d)
                    ctypes.memmove(int(out) + 2 * ((b * cap + t) * int(p["dst_row_stride"])
                                                   + h * int(p["dst_head_stride"])), slot, 2 * d)


class LaunchConfig(ctypes.Structure):
    """cuda.h's CUlaunchConfig, written out here to check _launch.PdlConfig's offsets against."""
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_uint64), ("attrs", ctypes.c_uint64),
                ("numAttrs", ctypes.c_uint)]


class LaunchAttribute(ctypes.Structure):
    """cuda.h's CUlaunchAttribute: the id, padding to 8 bytes, a 64-byte value union (its first word)."""
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("allowed", ctypes.c_uint),
                ("rest", ctypes.c_char * 60)]


SIZES = {"fwd": _launch.FWD_PARAMS, "bwd": _launch.BWD_PARAMS, "varlen": _launch.TAIL_PARAMS,
         "decode": _launch.DECODE_PARAMS, "paged_gather": _launch.GATHER_PARAMS}


@pytest.fixture
def dev(monkeypatch):
    """(adapter, launches): launches collects (name, grid, threads, smem, stream, decoded params)."""
    ad = FakeCuda()
    ad.copies = []
    launched = []
    names = {}

    class Loaded:
        def __init__(self, ptr):
            self.ptr = ptr

    def get_function(spec, target, device_id, smem):
        fid = names.setdefault(spec.name, 1000 + len(names))
        names[fid] = spec.name
        return Loaded(fid)

    def launch_kernel(fn, gx, gy, gz, bx, by, bz, smem, stream, argv_ptr, extra):
        name = names[fn]
        if name.removesuffix("_m2").endswith(("_tma", "_tma_grp")):  # (the decode kernel's twin for 16-key groups)
            dtype = (_launch.FWD_TMA_PARAMS if name.startswith("fwd") else
                     _launch.DECODE_TMA_PARAMS if name.startswith("decode") else _launch.BWD_TMA_PARAMS)
        elif name.startswith("fwd90ws_"):
            dtype = _launch.FWD_WS_PARAMS
        else:
            dtype = next(d for prefix, d in SIZES.items() if name.startswith(prefix))
        params_ptr = ctypes.c_uint64.from_address(argv_ptr).value
        raw = ctypes.string_at(params_ptr, dtype.itemsize)
        p = np.frombuffer(raw, dtype=dtype)[0]
        launched.append(dict(name=name, grid=gx, threads=bx, smem=smem, stream=stream, p=p, pdl=False, cluster=1))
        if name == "decode_append" and run_appends[0]:
            run_append_kernel(p)
        if name == "paged_gather" and run_appends[0]:
            run_gather_kernel(p)
        if (name.startswith("decode_") and not name.startswith(("decode_append", "decode_combine"))
                and int(p["seq"]) and not held[0]):
            # The decode kernel's last block, begun at once (an idle GPU): the call's number into `started`
            ctypes.c_uint64.from_address(int(p["started"])).value = int(p["seq"])

    def launch_ex(cfg_ptr, fn, argv_ptr, extra):
        """cuLaunchKernelEx: the CUlaunchConfig read at cuda.h's offsets (LaunchConfig below)."""
        cfg_ptr, fn, argv_ptr = (x.value for x in (cfg_ptr, fn, argv_ptr))  # (ctypes.c_void_p, as ctypes passes)
        cfg = LaunchConfig.from_address(cfg_ptr)
        assert 1 <= cfg.numAttrs <= 2 and extra is None
        pdl, cluster = False, 1
        for i in range(cfg.numAttrs):
            attr = LaunchAttribute.from_address(cfg.attrs + i * ctypes.sizeof(LaunchAttribute))
            if attr.id == 6:  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
                assert attr.allowed == 1 and not pdl
                pdl = True
            else:
                assert attr.id == 4 and cluster == 1, attr.id  # CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
                cluster, cy, cz = (ctypes.c_uint * 3).from_address(ctypes.addressof(attr) + 8)
                assert cluster > 1 and (cy, cz) == (1, 1) and cfg.gridDimX % cluster == 0
        assert (cfg.gridDimY, cfg.gridDimZ, cfg.blockDimY, cfg.blockDimZ) == (1, 1, 1, 1)
        launch_kernel(fn, cfg.gridDimX, 1, 1, cfg.blockDimX, 1, 1, cfg.sharedMemBytes, cfg.hStream, argv_ptr, 0)
        launched[-1]["pdl"], launched[-1]["cluster"] = pdl, cluster
        return 0

    held = [False]  # True: decode kernels "have not begun" (a busy stream): they leave `started` alone
    # run_appends[0] True: the kernels that append run on the host as they are launched (run_append_kernel,
    # run_gather_kernel; the tests that read what they write set it)
    run_appends = [False]
    words = []

    def started_word(device_id):  # (mapped host memory on a GPU: a ctypes word here)
        words.append(ctypes.c_uint64(0))
        return words[-1], ctypes.addressof(words[-1])

    monkeypatch.setattr(_launch, "started_word", started_word)
    ad.held, ad.run_appends = held, run_appends
    monkeypatch.setattr(_gpu, "compute_capability", lambda device_id: (9, 0))
    monkeypatch.setattr(_compile, "get_function", get_function)
    monkeypatch.setattr(_launch, "_launch_kernel", launch_kernel)
    monkeypatch.setattr(_launch, "_launch_ex", launch_ex)  # (pdl_available: True on "sm_90")
    # Every cluster fits (the driver's occupancy query; test_kvcache_cluster_that_does_not_fit)
    monkeypatch.setattr(_launch, "_max_active_clusters", lambda fn, grid, threads, smem, cluster: 1 << 20)
    monkeypatch.setattr(_launch, "_CLUSTER_FITS", {})
    monkeypatch.delenv("CUFLASH_PDL", raising=False)
    # The backward's three-launch structure at every length; the one-launch backward of short calls
    # has its own tests (test_bwd_single_*), which set this back.
    monkeypatch.setenv("CUFLASH_BWD_SINGLE", "0")
    monkeypatch.setattr(_plan, "_current_device", lambda: 0)
    monkeypatch.setattr(_kvcache, "_sm_count", lambda device_id: 132)  # an H100's (persistent grids)
    monkeypatch.setitem(_adapters._BY_TYPE, Dev, ad)
    # The paged prefill's plans, made with this test's stand-ins
    for name in ("_PAGED_FAST", "_DIRECT_VARLEN_PLANS", "_GATHER_PLANS"):
        monkeypatch.setattr(_kvcache, name, {})
    # The fused decode combine's counters (cupy memory on a GPU): a fake pointer here.
    monkeypatch.setattr(_kvcache.DecodePlan, "_counters", lambda self, stream: 0xC0C000)
    # The persistent causal forward's work lists (a CuPy allocation, copied on the stream, on a GPU):
    # recorded, at a fake pointer; ad.capturing[0] True stands for a stream that captures a graph.
    ad.uploads, ad.capturing = [], [False]

    class Mem:
        ptr = 0x5C4ED000

    def upload_table(device_id, table, stream):
        if ad.capturing[0]:
            return None
        ad.uploads.append((device_id, table, stream))
        return Mem()

    monkeypatch.setattr(_launch, "_upload_table", upload_table)
    # The split forward's workspace (cupy memory, one a stream, on a GPU): recorded, at a fake pointer.
    ad.workspaces = []

    def split_workspace(device_id, stream, nbytes):
        if ad.capturing[0]:
            return 0
        ad.workspaces.append((device_id, stream, nbytes))
        return 0x5B117000

    monkeypatch.setattr(_launch, "split_workspace", split_workspace)
    # A decode plan's scratch for eager split calls (cupy memory, one a stream, on a GPU): recorded, at a
    # fake pointer.
    ad.scratches = []

    def plan_scratch(self, stream, nbytes):
        ad.scratches.append((self.device_id, stream, nbytes))
        return 0x5C7A000

    monkeypatch.setattr(_kvcache.DecodePlan, "_scratch", plan_scratch)
    # No driver for tensor maps, as on a machine without a GPU, where these tests are written for (a GPU
    # machine's libcuda would put the calls on the TMA kernels); fake_tma_driver puts a stand-in here.
    from cuflash import _tma

    def no_driver():
        raise OSError("libcuda: not on the fake device")

    monkeypatch.setattr(_tma, "_driver_encode", no_driver)
    monkeypatch.setattr(_tma, "_patches", {})
    _plan.CACHE.clear()
    yield ad, launched
    _plan.CACHE.clear()


def arr(rng, shape, dtype=np.float16):
    return rng.standard_normal(shape).astype(dtype).view(Dev)


def addr(x) -> int:
    return x.ctypes.data


def elem_strides(x):
    return tuple(s // x.itemsize for s in x.strides)


def check_tensor(p, prefix, x, pname=None):
    assert int(p[pname or prefix]) == addr(x), f"{prefix}: pointer"
    got = tuple(int(p[f"{prefix}_{s}_stride"]) for s in ("batch", "row", "head"))
    assert got == elem_strides(x)[:3], f"{prefix}: strides {got} != {elem_strides(x)[:3]}"


def test_forward_plain_repeat_patches_new_pointers(dev):
    ad, launched = dev
    rng = np.random.default_rng()
    for rep in range(3):  # the first call plans; the next ones must patch their own pointers
        q, k, v = arr(rng, (2, 100, 8, 64)), arr(rng, (2, 130, 2, 64)), arr(rng, (2, 130, 2, 64))
        out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
        (L,) = launched[rep:]
        p = L["p"]
        assert L["stream"] == 77 and L["name"].startswith("fwd90_f16_d64") and "causal" in L["name"]
        check_tensor(p, "q", q)
        check_tensor(p, "k", k)
        check_tensor(p, "v", v)
        check_tensor(p, "o", out)
        assert int(p["lse"]) == addr(lse) and lse.shape == (2, 8, 100) and out.shape == q.shape
        assert (int(p["batch"]), int(p["nheads"]), int(p["nheads_kv"]), int(p["head_group"])) == (2, 8, 2, 4)
        assert (int(p["seqlen_q"]), int(p["seqlen_k"])) == (100, 130)
        assert p["scale_log2"] == np.float32(64 ** -0.5 * _launch.LOG2E)
        assert L["grid"] == 2 * 8 * int(p["num_m_blocks"])
    assert len(_plan.CACHE) == 1


def test_forward_strided_and_misaligned_inputs(dev):
    ad, launched = dev
    rng = np.random.default_rng()
    q = arr(rng, (2, 8, 48, 32)).transpose(0, 2, 1, 3)            # (b, s, h, d) view of (b, h, s, d): in place
    kbuf = arr(rng, (2 * 48 * 8 * 32 + 1,))
    k = kbuf[1:].reshape(2, 48, 8, 32)                              # 2 bytes off: must be copied
    v = arr(rng, (2, 48, 8, 64))[..., ::2]                          # last stride 2: must be copied
    out = cuflash.attention(q, k, v)
    p = launched[-1]["p"]
    check_tensor(p, "q", q)
    assert len(ad.copies) == 2
    kc, vc = ad.copies
    assert addr(kc) % 16 == 0 and addr(vc) % 16 == 0, "a copy must be 16-byte aligned"
    check_tensor(p, "k", kc)
    check_tensor(p, "v", vc)
    np.testing.assert_array_equal(np.asarray(kc), np.asarray(k))
    np.testing.assert_array_equal(np.asarray(vc), np.asarray(v))
    check_tensor(p, "o", out)


def test_backward_scratch_and_grads(dev, monkeypatch):
    # The wgmma dK/dV kernel with its dQ kernel (where a driver offers TMA, the default is the
    # warp-specialized one: test_bwd_ws_wiring).
    monkeypatch.setenv("CUFLASH_BWD_WS", "0")
    ad, launched = dev
    rng = np.random.default_rng()
    for det in (False, True):
        q, k, v = arr(rng, (2, 70, 4, 128)), arr(rng, (2, 70, 2, 128)), arr(rng, (2, 70, 2, 128))
        out, lse = cuflash.attention(q, k, v, return_lse=True, deterministic=det)
        dout = arr(rng, q.shape)
        ad.allocs.clear()
        n0 = len(launched)
        dq, dk, dv = cuflash.attention_backward(dout, q, k, v, out, lse, deterministic=det)
        names = [L["name"] for L in launched[n0:]]
        assert names[0].startswith("bwd_pre") and names[1].startswith("bwd90_dkdv")
        assert ("atomic_dq" in names[1]) == (not det), names
        assert names[2].startswith("bwd_convert_dq" if not det else "bwd_dq_"), names
        scratch = next(a for a in ad.allocs if a.dtype == np.float32)
        rows = 2 * 4 * 128  # batch * nheads * seqlen_q padded to 128
        for L in launched[n0:]:
            p = L["p"]
            check_tensor(p, "q", q)
            check_tensor(p, "dq", dq)
            check_tensor(p, "dk", dk)
            check_tensor(p, "dv", dv)
            check_tensor(p, "do", dout, "dout")
            assert int(p["o"]) == addr(out) and int(p["lse"]) == addr(lse)
            assert int(p["delta"]) == addr(scratch)
            if det:  # the separate dQ pass reads lse * log2(e) from the scratch
                assert int(p["lse_log2"]) == addr(scratch) + 4 * rows and int(p["dq_accum"]) == 0
                assert scratch.size >= 2 * rows
            else:    # the wgmma kernel reads lse itself; dQ accumulates right after delta
                assert int(p["lse_log2"]) == 0 and int(p["dq_accum"]) == addr(scratch) + 4 * rows
                assert scratch.size >= rows + rows * 128
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape


@pytest.mark.parametrize("head_dim", [8, 24, 40])
def test_backward_small_head_dim_dq_first(dev, head_dim):
    """Below head_dim 32 (cuda_src/flash_bwd.cu DS_SPLIT_BELOW) the dQ kernel runs before the dK/dV kernel,
    both reading the one delta of the scratch (the dQ kernel leaves each row's corrected D there for dK's
    dS): preprocess, dQ, dK/dV, in that order. From 32 the dQ kernel comes last. Plain and feature
    (window) calls, both gradient paths of the mma.sync kernels (which take no atomics below 64)."""
    import pathlib
    import re

    from cuflash import _config

    ad, launched = dev
    rng = np.random.default_rng()
    src = (pathlib.Path(__file__).resolve().parents[1] / "cuda_src" / "flash_bwd.cu").read_text()
    assert re.findall(r"constexpr int DS_SPLIT_BELOW = (\d+);", src) == [str(_config.BWD_DS_SPLIT_BELOW)] == ["32"]
    for det, window in ((False, None), (True, None), (True, (20, 0))):
        q, k, v = arr(rng, (2, 70, 4, head_dim)), arr(rng, (2, 90, 2, head_dim)), arr(rng, (2, 90, 2, head_dim))
        kw = {} if window is None else {"window": window}
        out, lse = cuflash.attention(q, k, v, return_lse=True, deterministic=det, **kw)
        dout = arr(rng, q.shape)
        n0 = len(launched)
        cuflash.attention_backward(dout, q, k, v, out, lse, deterministic=det, **kw)
        names = [L["name"] for L in launched[n0:]]
        if head_dim == 40 and not det:  # (pad-up: the warp-specialized kernel of 64, its atomic dQ)
            continue
        assert len(names) == 3 and names[0].startswith("bwd_pre"), names
        order = [n.split("_")[1] for n in names[1:]]
        assert order == (["dq", "dkdv"] if head_dim < 32 else ["dkdv", "dq"]), names
        deltas = {int(L["p"]["delta"]) for L in launched[n0:]}
        assert len(deltas) == 1 and 0 not in deltas, names


def test_empty_packed_batch_sink_gradient(dev):
    """A packed batch of empty sequences with sink logits: attention_varlen_backward's d sink_logits is
    zeros of (nheads,), float32, as on the CPU, not None (the GPU fuzzer's case: its sink rows were
    none, so the plan kept no place for them); under jax.jit the same layout (dsink_offset)."""
    ad, launched = dev
    rng = np.random.default_rng()
    h, d = 2, 64
    q, k, v = arr(rng, (1, h, d)), arr(rng, (1, h, d)), arr(rng, (1, h, d))
    cu = np.zeros(13, np.int32).view(Dev)
    sink = rng.standard_normal(h).astype(np.float32).view(Dev)
    out, lse = cuflash.attention_varlen(q, k, v, cu, cu, 0, 0, sink_logits=sink, return_lse=True)
    res = cuflash.attention_varlen_backward(arr(rng, q.shape), q, k, v, out, lse, cu, cu, 0, 0, sink_logits=sink)
    assert len(res) == 4 and res[3] is not None
    dsink = np.asarray(res[3])
    assert dsink.shape == (h,) and dsink.dtype == np.float32 and not dsink.any(), dsink
    from cuflash import _plan

    bps = [bp for plan in _plan.CACHE.values() for bp in getattr(plan, "_backward", {}).values()]
    assert bps and all(bp.dsink_offset == bp.scratch_floats and bp.dsink_shape == (12, h, 0) for bp in bps)


def test_options_reach_maskparams(dev):
    ad, launched = dev
    rng = np.random.default_rng()
    b, s, h, d = 3, 90, 4, 64
    q, k, v = arr(rng, (b, s, h, d)), arr(rng, (b, s, 2, d)), arr(rng, (b, s, 2, d))
    lengths = np.array([90, 17, 0], np.int32).view(Dev)
    sink = rng.standard_normal(h).astype(np.float32).view(Dev)
    slopes = rng.random((b, h)).astype(np.float32).view(Dev)
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True, kv_lengths=lengths, window=(20, 0),
                                 num_sink_tokens=3, sink_logits=sink, alibi_slopes=slopes, softcap=7.0)
    p = launched[-1]["p"]
    assert "feat" in launched[-1]["name"]
    m = p["mask"]
    assert int(m["kv_lengths"]) == addr(lengths) and int(m["q_lengths"]) == 0
    assert int(m["sink_logits"]) == addr(sink) and int(m["alibi_slopes"]) == addr(slopes)
    assert int(m["alibi_batch_stride"]) == h
    assert (int(m["window_left"]), int(m["window_right"]), int(m["num_sink_tokens"])) == (20, 0, 3)
    assert m["softcap"] == np.float32(7.0)
    assert (int(m["lse_batch_stride"]), int(m["lse_head_stride"])) == (h * s, s)
    # the backward: dsink rows after delta and lse_log2, summed into (nheads,)
    dout = arr(rng, q.shape)
    ad.allocs.clear()
    n0 = len(launched)
    dq, dk, dv, dsink = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, kv_lengths=lengths,
                                                   window=(20, 0), num_sink_tokens=3, sink_logits=sink,
                                                   alibi_slopes=slopes, softcap=7.0)
    scratch = next(a for a in ad.allocs if a.dtype == np.float32 and a.ndim == 1)
    pad = 128
    rows = b * h * pad
    for L in launched[n0:]:
        m = L["p"]["mask"]
        assert int(m["sink_logits"]) == addr(sink)
        dsink_ptr = int(m["dsink_rows"])
        assert dsink_ptr >= addr(scratch) + 4 * 2 * rows  # after delta and lse_log2
        acc = int(L["p"]["dq_accum"])
        if acc:  # the atomic path's accumulator sits between them, without overlap
            assert acc == addr(scratch) + 4 * 2 * rows and dsink_ptr == acc + 4 * rows * d
        assert dsink_ptr + 4 * rows <= addr(scratch) + 4 * scratch.size
    assert dsink.shape == (h,)


def test_varlen_tail_fill_and_packed_views(dev):
    ad, launched = dev
    rng = np.random.default_rng()
    total, h, d = 50, 4, 64
    q, k, v = arr(rng, (total, h, d)), arr(rng, (total, h, d)), arr(rng, (total, h, d))
    cu = np.array([0, 13, 13, 40], np.int32).view(Dev)
    out, lse = cuflash.attention_varlen(q, k, v, cu, cu, 27, 27, causal=True, return_lse=True)
    fwd, tail_o, tail_lse = launched[-3:]
    p = fwd["p"]
    assert int(p["q_batch_stride"]) == 0 and int(p["q_row_stride"]) == h * d and int(p["seqlen_q"]) == 27
    assert int(p["mask"]["cu_seqlens_q"]) == addr(cu) and int(p["mask"]["lse_head_stride"]) == total
    assert tail_o["name"] == "varlen_fill_tail_u16" and tail_lse["name"] == "varlen_fill_tail_u32"
    for t in (tail_o, tail_lse):  # rows past cu[3], and rows of a sequence past max_seqlen_q (27)
        assert int(t["p"]["cu_seqlens"]) == addr(cu) and (int(t["p"]["batch"]), int(t["p"]["max_seqlen"])) == (3, 27)
        assert int(t["p"]["total_rows"]) == total and int(t["p"]["nheads"]) == h
    assert int(tail_o["p"]["ptr"]) == addr(out) and int(tail_o["p"]["row_elems"]) == d
    assert int(tail_lse["p"]["ptr"]) == addr(lse) and int(tail_lse["p"]["fill"]) == 0xFF800000
    assert out.shape == (total, h, d) and lse.shape == (h, total)


def fake_tma_driver(monkeypatch, word, record):
    """Replaces cuTensorMapEncodeTiled (cuflash/_tma.py) with a stand-in whose map word i is
    word(ptr, i, dims, box, strides), clears the learned patches, forces CUFLASH_FWD_TMA=1 and turns
    the warp-specialized kernel off (CUFLASH_FWD_WS=0).
    Returns the list of record(ptr, dims, rank, strides, box, swizzle) of every encode."""
    from cuflash import _tma

    calls = []

    def encode(out, dtype, rank, ptr, dims, strides, box, elem_strides, interleave, swizzle, l2, oob):
        calls.append(record(ptr.value, dims, rank, strides, box, swizzle))
        buf = (ctypes.c_uint64 * 16).from_address(out)
        for i in range(16):
            buf[i] = word(ptr.value, i, dims, box, strides) & (2**64 - 1)
        return 0

    monkeypatch.setattr(_tma, "_driver_encode", lambda: encode)
    monkeypatch.setattr(_tma, "_patches", {})
    monkeypatch.setenv("CUFLASH_FWD_TMA", "1")
    monkeypatch.setenv("CUFLASH_FWD_WS", "0")  # flash_fwd_sm90.cu's TMA variant, not the warp-specialized kernel
    monkeypatch.setenv("CUFLASH_BWD_WS", "0")  # likewise the backward's
    return calls


def test_fwd_tma_variant_wiring(dev, monkeypatch):
    """CUFLASH_FWD_TMA=1 (docs/hopper_plan.md step 1): a plain forward on sm_90 runs the wgmma kernel's
    TMA variant, whose Params are FwdParams unchanged, then the tensor maps of the call's k and v
    (cuflash/_tma.py kv_map), encoded once per pointer where the maps cannot be patched (this
    stand-in writes the address into every word); calls with options keep the cp.async kernel, and
    so does a call without the setting when the maps cannot be patched."""
    from cuflash import _config, _tma

    calls = fake_tma_driver(monkeypatch, lambda ptr, i, dims, box, strides: ptr + i,
                            lambda ptr, dims, rank, strides, box, swizzle: (
                                ptr, list(dims[:rank]), list(strides[:rank - 1]), list(box[:rank]), swizzle))
    ad, launched = dev
    rng = np.random.default_rng()
    q = arr(rng, (2, 200, 4, 128))
    k, v = arr(rng, (2, 300, 2, 128)), arr(rng, (2, 300, 2, 128))
    bn = _config.fwd_config_for_target("sm_90a", 128, "float16", True).block_n

    def maps_of(L):
        return [int(np.frombuffer(L["p"][f].tobytes(), np.uint64)[0]) for f in ("map_k", "map_v")]

    cuflash.attention(q, k, v, causal=True)
    L = launched[-1]
    assert L["name"].endswith("_tma") and "_d128_" in L["name"], L["name"]
    check_tensor(L["p"], "q", q)
    check_tensor(L["p"], "k", k)
    assert maps_of(L) == [addr(k), addr(v)]
    assert np.frombuffer(L["p"]["map_v"].tobytes(), np.uint64)[15] == addr(v) + 15
    assert [c for c in calls if c[0] == addr(k)][0] == (
        addr(k), [128, 300, 2, 2], [2 * 256, 2 * 128, 2 * 300 * 256], [64, bn, 1, 1], _tma.SWIZZLE_128B)
    n = len(calls)
    cuflash.attention(q, k, v, causal=True)  # the same pointers: the plan's maps, no new encode
    assert len(calls) == n and maps_of(launched[-1]) == [addr(k), addr(v)]
    k2, v2 = arr(rng, k.shape), arr(rng, v.shape)
    cuflash.attention(q, k2, v2, causal=True)
    assert len(calls) == n + 2 and maps_of(launched[-1]) == [addr(k2), addr(v2)]
    cuflash.attention(q, k, v, window=(8, 0))  # options: the feature kernel, with cp.async
    assert not launched[-1]["name"].endswith("_tma")
    monkeypatch.delenv("CUFLASH_FWD_TMA")
    _plan.CACHE.clear()
    cuflash.attention(q, k, v, causal=True)
    assert not launched[-1]["name"].endswith("_tma"), "the TMA variant by default, with unpatchable maps"


def test_fwd_tma_patched_maps_wiring(dev, monkeypatch):
    """Where the driver's maps follow the one-word rule (cuflash/_tma.py learn_patch), a call's maps
    are the learned template with the address word set: equal to the driver's own maps of the call's
    k and v, with no encode per call, new pointers included."""
    from cuflash import _tma

    calls = fake_tma_driver(monkeypatch, lambda ptr, i, dims, box, strides: (
        (ptr >> 4) | (7 << 60) if i == 1 else 1000 * i + dims[1] + box[1] + strides[0]),
        lambda ptr, *rest: ptr)
    ad, launched = dev
    rng = np.random.default_rng()
    q = arr(rng, (2, 200, 4, 64))
    bn = None
    for _ in range(3):
        k, v = arr(rng, (2, 300, 2, 64)), arr(rng, (2, 300, 2, 64))
        cuflash.attention(q, k, v)
        L = launched[-1]
        assert L["name"].endswith("_tma"), L["name"]
        n = len(calls)
        bn = bn or int(L["name"].split("_n")[1].split("_")[0])
        for field, t in (("map_k", k), ("map_v", v)):
            want = _tma.kv_map(addr(t), (2, 300, 2, 64), (300 * 128, 128, 64, 1), bn, "float16")
            assert L["p"][field].tobytes() == want, field
        del calls[n:]
    assert len(calls) == 6, f"expected only the 6 encodes that learn the layout, got {len(calls)}"
    # head_dim 256: the TMA variant's own tiles (128 x 64; the cp.async kernel's are 128 x 32), and
    # its maps' box has the tile's 64 rows.
    q, k, v = arr(rng, (1, 100, 2, 256)), arr(rng, (1, 300, 2, 256)), arr(rng, (1, 300, 2, 256))
    cuflash.attention(q, k, v, causal=True)
    assert "_d256_m128_n64_" in launched[-1]["name"] and launched[-1]["name"].endswith("_tma"), launched[-1]["name"]
    assert launched[-1]["p"]["map_k"].tobytes() == _tma.kv_map(addr(k), k.shape, (300 * 512, 512, 256, 1), 64,
                                                                "float16")
    monkeypatch.setenv("CUFLASH_FWD_TMA", "0")
    _plan.CACHE.clear()
    cuflash.attention(q, k, v, causal=True)
    assert "_d256_m128_n32_" in launched[-1]["name"] and not launched[-1]["name"].endswith("_tma")


def default_ws_kernels(dev, monkeypatch):
    """The default kernel choice on the fake sm_90 device with a stand-in tensor-map driver (the
    warp-specialized and persistent forwards where the tables put them): (ad, launched, rng)."""
    fake_tma_driver(monkeypatch, lambda ptr, i, dims, box, strides: (
        ptr if i == 0 else 77 * i + dims[1] + box[1] + strides[0]), lambda ptr, *rest: ptr)
    monkeypatch.delenv("CUFLASH_FWD_TMA")
    monkeypatch.delenv("CUFLASH_FWD_WS")
    ad, launched = dev
    return ad, launched, np.random.default_rng()


def test_fwd_sched_wiring(dev, monkeypatch):
    """The persistent causal forward's work lists (cuflash/_schedule.py): the plan's list for its
    shape and grid, copied once per plan, on the call's stream, at the first fire whose stream does
    not capture a graph (before that the kernel's pairs: sched 0); CUFLASH_FWD_SCHED=0: none."""
    from cuflash import _schedule

    ad, launched, rng = default_ws_kernels(dev, monkeypatch)
    q, k, v = arr(rng, (8, 2048, 4, 128)), arr(rng, (8, 2048, 2, 128)), arr(rng, (8, 2048, 2, 128))
    ad.capturing[0] = True
    cuflash.attention(q, k, v, causal=True)
    L = launched[-1]
    assert L["name"] == "fwd90ws_f16_d128_m128_n128_s2_causal_even_pp_pers" and L["grid"] == 132, L["name"]
    assert int(L["p"]["sched"]) == 0 and not ad.uploads
    ad.capturing[0] = False
    for _ in range(2):
        cuflash.attention(q, k, v, causal=True)
        assert int(launched[-1]["p"]["sched"]) == 0x5C4ED000
    assert len(ad.uploads) == 1, ad.uploads
    device_id, table, stream = ad.uploads[0]
    assert stream == launched[-1]["stream"]
    want = _schedule.causal_schedule(16, 8 * 4, 132, 128, 128, 2048, 2048)
    assert table.dtype == np.int32 and table.flags.c_contiguous and np.array_equal(table, want)
    lists = _schedule.block_lists(table)
    assert sorted(x for lst in lists for x in lst) == list(range(8 * 4 * 16))
    # another stream gets its own copy (no stream reads a copy another may still be making)
    monkeypatch.setattr(ad, "stream", lambda device_id: 78)
    cuflash.attention(q, k, v, causal=True)
    assert launched[-1]["stream"] == 78 and int(launched[-1]["p"]["sched"]) == 0x5C4ED000
    assert len(ad.uploads) == 2 and ad.uploads[1][2] == 78
    monkeypatch.setattr(ad, "stream", lambda device_id: 77)
    monkeypatch.setenv("CUFLASH_FWD_SCHED", "0")
    _plan.CACHE.clear()
    cuflash.attention(q, k, v, causal=True)
    assert launched[-1]["name"] == L["name"] and int(launched[-1]["p"]["sched"]) == 0
    assert len(ad.uploads) == 2


def test_fwd_split_wiring(dev, monkeypatch):
    """The persistent non-causal forward's split tail (cuflash/_schedule.py split_schedule): the plan's
    list for its shape and grid, with the split's first tile, parts and chunk and the stream's
    workspace in the Params, set at the first fire whose stream does not capture a graph (before that
    the kernel's own order: sched 0, parts 0); CUFLASH_FWD_SPLIT=0: none; a shape whose tiles fill
    whole waves: none."""
    from cuflash import _schedule

    ad, launched, rng = default_ws_kernels(dev, monkeypatch)
    # 4 x 16 heads x 32 query blocks = 2048 work tiles of 32 key tiles on 132 blocks (FlashAttention-2's
    # grid at 4k keys)
    q, k, v = arr(rng, (4, 4096, 16, 128)), arr(rng, (4, 4096, 4, 128)), arr(rng, (4, 4096, 4, 128))
    ad.capturing[0] = True
    cuflash.attention(q, k, v)
    L = launched[-1]
    assert L["name"] == "fwd90ws_f16_d128_m128_n128_s2_full_even_pp_pers_split" and L["grid"] == 132, L["name"]
    p = L["p"]
    assert int(p["sched"]) == 0 and int(p["split_parts"]) == 0 and int(p["split_ws"]) == 0
    assert not ad.uploads and not ad.workspaces
    ad.capturing[0] = False
    table, first, parts, chunk = _schedule.split_schedule(2048, 132, 32)
    for _ in range(2):
        cuflash.attention(q, k, v)
        p = launched[-1]["p"]
        assert int(p["sched"]) == 0x5C4ED000 and int(p["split_ws"]) == 0x5B117000
        assert (int(p["split_first"]), int(p["split_parts"]), int(p["split_chunk"])) == (first, parts, chunk)
    assert len(ad.uploads) == 1 and len(ad.workspaces) == 1, (ad.uploads, ad.workspaces)
    _, got, stream = ad.uploads[0]
    assert stream == launched[-1]["stream"] and ad.workspaces[0][1] == stream
    assert got.dtype == np.int32 and got.flags.c_contiguous and np.array_equal(got, table)
    assert ad.workspaces[0][2] == _launch.split_workspace_bytes(2048 - first, parts, 128, 8)
    # a new stream: the list copied there too, the Params pointing to that copy and workspace
    monkeypatch.setattr(ad, "stream", lambda device_id: 78)
    cuflash.attention(q, k, v)
    assert launched[-1]["stream"] == 78 and len(ad.uploads) == 2 and ad.uploads[1][2] == 78
    assert ad.workspaces[-1][1] == 78
    # CUFLASH_FWD_SPLIT=0: the persistent kernel without lists
    monkeypatch.setenv("CUFLASH_FWD_SPLIT", "0")
    _plan.CACHE.clear()
    cuflash.attention(q, k, v)
    assert launched[-1]["name"] == L["name"].removesuffix("_split") and len(ad.uploads) == 2
    monkeypatch.delenv("CUFLASH_FWD_SPLIT")
    # 2640 tiles: 20 whole waves, nothing to split; 2k keys: parts too short to gain
    for b, sq, sk in ((1, 165 * 128, 4096), (8, 2048, 2048)):
        cuflash.attention(arr(rng, (b, sq, 16, 128)), arr(rng, (b, sk, 4, 128)), arr(rng, (b, sk, 4, 128)))
        assert launched[-1]["name"].endswith("_pers"), launched[-1]["name"]


def test_fwd_ws_wiring(dev, monkeypatch):
    """CUFLASH_FWD_WS=1: a plain sm_90a forward whose q, k and v fit tensor maps runs the
    warp-specialized kernel (cuda_src/flash_fwd_sm90_ws.cu): 384 threads, one block per (batch, head,
    128 rows), FwdWsParams (FwdParams, then the maps of q with 128-row boxes and of k and v with
    BLOCK_N-row boxes, each the driver's map of the call's pointer) and its shared memory; calls with
    options keep the feature kernel."""
    from cuflash import _config, _tma

    fake_tma_driver(monkeypatch, lambda ptr, i, dims, box, strides: (
        ptr if i == 0 else 77 * i + dims[1] + box[1] + strides[0]), lambda ptr, *rest: ptr)
    monkeypatch.delenv("CUFLASH_FWD_TMA")
    monkeypatch.setenv("CUFLASH_FWD_WS", "1")
    ad, launched = dev
    rng = np.random.default_rng()
    # the table's (head_dim 64 causal: three consumers, 192-row blocks); at head_dim 128 three query
    # blocks a head, an odd count, keep causal calls off the persistent grid (_config.fwd_ws_persistent_config)
    for d, bn, stages, pp, c in ((64, 128, 2, "", 3), (128, 128, 2, "_pp", 2), (256, 64, 2, "", 2)):
        q = arr(rng, (2, 300, 4, d))
        k, v = arr(rng, (2, 600, 2, d)), arr(rng, (2, 600, 2, d))
        cuflash.attention(q, k, v, causal=True)
        L = launched[-1]
        assert L["name"] == f"fwd90ws_f16_d{d}_m{64 * c}_n{bn}_s{stages}_causal_ragged{pp}", L["name"]
        assert L["threads"] == 128 * (c + 1) and L["grid"] == 2 * 4 * -(-300 // (64 * c))
        assert L["smem"] == _config.fwd_ws_smem_bytes(d, bn, stages, c)
        check_tensor(L["p"], "q", q)
        check_tensor(L["p"], "k", k)
        for field, t, rows in (("map_q", q, 64 * c), ("map_k", k, bn), ("map_v", v, bn)):
            strides = tuple(x // t.itemsize for x in t.strides)
            assert L["p"][field].tobytes() == _tma.kv_map(addr(t), t.shape, strides, rows, "float16"), field
    # A call with options (FEAT): forced, even a narrow window takes the kernel's FEAT variant, whose
    # Params carry the mask.
    cuflash.attention(q, k, v, window=(8, 0))
    L = launched[-1]
    assert L["name"] == "fwd90ws_f16_d256_m128_n64_s2_feat", L["name"]
    assert int(L["p"]["mask"]["window_left"]) == 8 and int(L["p"]["mask"]["window_right"]) == 0, L["p"]["mask"]
    # Without the setting: the table (cuflash/_config.py FWD_WS_TABLE): head_dim 64 causal below 4096
    # keys keeps the TMA variant, head_dim 128 non-causal takes the warp-specialized kernel with 2
    # stages and the pingpong schedule (CUFLASH_FWD_WS_PINGPONG=0 turns it off).
    monkeypatch.delenv("CUFLASH_FWD_WS")
    _plan.CACHE.clear()
    q, k, v = arr(rng, (2, 256, 4, 64)), arr(rng, (2, 256, 2, 64)), arr(rng, (2, 256, 2, 64))
    cuflash.attention(q, k, v, causal=True)
    assert launched[-1]["name"] == "fwd90_f16_d64_m64_n64_causal_even_tma", launched[-1]["name"]
    # (On the persistent grid, _config.FWD_WS_PERSISTENT_DEFAULT: one block per SM, at most.)
    q, k, v = arr(rng, (2, 256, 4, 128)), arr(rng, (2, 256, 2, 128)), arr(rng, (2, 256, 2, 128))
    cuflash.attention(q, k, v)
    assert launched[-1]["name"] == "fwd90ws_f16_d128_m128_n128_s2_full_even_pp_pers", launched[-1]["name"]
    assert launched[-1]["grid"] == 2 * 4 * 2, launched[-1]["grid"]  # 16 query blocks, fewer than 132 SMs
    q2 = arr(rng, (2, 4096, 4, 128))
    cuflash.attention(q2, k, v)
    assert launched[-1]["name"].endswith("_pers") and launched[-1]["grid"] == 132, launched[-1]
    # Non-causal persistent at every length, causal up to 2048 keys (_config.FWD_WS_PERSISTENT_DEFAULT);
    # past that a block per query block.
    k1, v1 = arr(rng, (2, 1024, 2, 128)), arr(rng, (2, 1024, 2, 128))
    cuflash.attention(q2, k1, v1)
    assert launched[-1]["name"] == "fwd90ws_f16_d128_m128_n128_s2_full_even_pp_pers", launched[-1]["name"]
    cuflash.attention(q2, k1, v1, causal=True)
    assert launched[-1]["name"] == "fwd90ws_f16_d128_m128_n128_s2_causal_even_pp_pers", launched[-1]["name"]
    k5, v5 = arr(rng, (2, 4096, 2, 128)), arr(rng, (2, 4096, 2, 128))
    cuflash.attention(q2, k5, v5, causal=True)
    assert launched[-1]["name"] == "fwd90ws_f16_d128_m128_n128_s2_causal_even_pp", launched[-1]["name"]
    k2, v2 = arr(rng, (2, 2048, 2, 128)), arr(rng, (2, 2048, 2, 128))
    cuflash.attention(q2, k2, v2)
    assert launched[-1]["name"] == "fwd90ws_f16_d128_m128_n128_s2_full_even_pp_pers", launched[-1]["name"]
    k3, v3 = arr(rng, (1, 16384, 2, 128)), arr(rng, (1, 16384, 2, 128))
    cuflash.attention(arr(rng, (1, 16384, 4, 128)), k3, v3)
    assert launched[-1]["name"] == "fwd90ws_f16_d128_m128_n128_s2_full_even_pp_pers", launched[-1]["name"]
    assert launched[-1]["grid"] == 132, launched[-1]["grid"]
    k4, v4 = arr(rng, (2, 600, 2, 128)), arr(rng, (2, 600, 2, 128))
    cuflash.attention(q2, k4, v4, causal=True)
    assert launched[-1]["name"] == "fwd90ws_f16_d128_m128_n128_s2_causal_ragged_pp_pers", launched[-1]["name"]
    # Causal on the persistent grid pairs a head's query blocks (cuda_src/blocks.cuh persistent_tile):
    # an even count only; 3 query blocks a head take a block per query block.
    for sq, pers in ((512, True), (384, False), (500, True), (257, False)):
        qc, kc, vc = arr(rng, (2, sq, 4, 128)), arr(rng, (2, 512, 2, 128)), arr(rng, (2, 512, 2, 128))
        cuflash.attention(qc, kc, vc, causal=True)
        assert launched[-1]["name"].endswith("_pers") == pers, (sq, launched[-1]["name"])
    # Causal persistent grids run on work lists (cuflash/_schedule.py), copied at the first fire;
    # non-causal ones and a block per query block have none.
    assert all(int(L["p"]["sched"]) == (0x5C4ED000 if L["name"].endswith("causal_even_pp_pers")
                                        or L["name"].endswith("causal_ragged_pp_pers") else 0) for L in launched
               if L["name"].startswith("fwd90ws_")), [(L["name"], int(L["p"]["sched"])) for L in launched]
    monkeypatch.setenv("CUFLASH_FWD_WS_PINGPONG", "0")  # the plain schedule: same Params, its own kernel
    _plan.CACHE.clear()
    cuflash.attention(q, k, v)
    assert launched[-1]["name"] == "fwd90ws_f16_d128_m128_n128_s2_full_even_pers", launched[-1]["name"]
    monkeypatch.setenv("CUFLASH_FWD_WS_PERSISTENT", "0")  # one block per query block
    _plan.CACHE.clear()
    cuflash.attention(q2, k, v)
    assert launched[-1]["name"] == "fwd90ws_f16_d128_m128_n128_s2_full_even", launched[-1]["name"]
    assert launched[-1]["grid"] == 2 * 4 * 32, launched[-1]["grid"]
    monkeypatch.delenv("CUFLASH_FWD_WS_PERSISTENT")
    # head_dim 64: three consumers (192-row blocks) from seqlen_k 2048 (non-causal) and 4096 (causal),
    # the TMA variant below (_config.FWD_WS_MIN_SEQLEN_K; causal in 64 x 128 tiles from 2048 keys).
    for sk, causal, want in ((512, False, "fwd90_f16_d64_m64_n128_full_even_tma"),
                             (2048, False, "fwd90ws_f16_d64_m192_n128_s3_full_ragged"),
                             (1024, True, "fwd90_f16_d64_m64_n64_causal_even_tma"),
                             (2048, True, "fwd90_f16_d64_m64_n128_causal_even_tma"),
                             (4096, True, "fwd90ws_f16_d64_m192_n128_s2_causal_ragged")):
        q, k, v = arr(rng, (1, 256, 4, 64)), arr(rng, (1, sk, 2, 64)), arr(rng, (1, sk, 2, 64))
        cuflash.attention(q, k, v, causal=causal)
        assert launched[-1]["name"] == want, (sk, causal, launched[-1]["name"])
    # ... and causal from 2304 keys (FWD_WS_WHOLE_BLOCKS_MIN_SEQLEN_K) where seqlen_q fills 192-row blocks.
    assert _config.FWD_WS_WHOLE_BLOCKS_MIN_SEQLEN_K[(64, True)] == 2304
    for sq, sk, want in ((2304, 2304, "fwd90ws_f16_d64_m192_n128_s2_causal_even"),
                         (3072, 3072, "fwd90ws_f16_d64_m192_n128_s2_causal_even"),
                         (192, 3000, "fwd90ws_f16_d64_m192_n128_s2_causal_ragged"),
                         (2112, 2112, "fwd90_f16_d64_m64_n128_causal_ragged_tma"),  # whole blocks, fewer keys
                         (2560, 2560, "fwd90_f16_d64_m64_n128_causal_even_tma"),    # 13 1/3 blocks
                         (3136, 3136, "fwd90_f16_d64_m64_n128_causal_ragged_tma")):  # 16 1/3
        q, k, v = arr(rng, (1, sq, 4, 64)), arr(rng, (1, sk, 2, 64)), arr(rng, (1, sk, 2, 64))
        cuflash.attention(q, k, v, causal=True)
        assert launched[-1]["name"] == want, (sq, sk, launched[-1]["name"])
    assert _config.fwd_ws_config(64, True, 3072) is None            # seqlen_q unknown: the length rule alone
    assert _config.fwd_ws_config(64, True, 3072, 3072) == _config.FWD_WS_TABLE[(64, True)]
    assert _config.fwd_ws_config(64, False, 1024, 1152) is None     # non-causal: FWD_WS_MIN_SEQLEN_K alone
    # Options: the FEAT variant (_config.FWD_WS_FEAT_TABLE), except narrow windows (NARROW_WINDOW).
    monkeypatch.delenv("CUFLASH_FWD_WS_PINGPONG")
    _plan.CACHE.clear()
    q, k, v = arr(rng, (1, 1300, 2, 128)), arr(rng, (1, 1300, 1, 128)), arr(rng, (1, 1300, 1, 128))
    for kw, want in (({"window": (1100, 0)}, "fwd90ws_f16_d128_m128_n128_s2_feat_pp"),
                     ({"softcap": 5.0, "causal": True}, "fwd90ws_f16_d128_m128_n128_s2_feat_pp"),
                     ({"window": (64, 0)}, "fwd90_f16_d128_m64_n64_feat")):
        cuflash.attention(q, k, v, **kw)
        assert launched[-1]["name"] == want, (kw, launched[-1]["name"])
    # A packed batch: the maps describe each array as one sequence of all its rows (batch 1).
    qp, kp, vp = arr(rng, (300, 2, 128)), arr(rng, (260, 1, 128)), arr(rng, (260, 1, 128))
    cu_q, cu_k = np.array([0, 100, 290], np.int32).view(Dev), np.array([0, 60, 250], np.int32).view(Dev)
    n0 = len(launched)
    cuflash.attention_varlen(qp, kp, vp, cu_q, cu_k, 190, 190, causal=True, return_lse=True)
    L = next(L for L in reversed(launched) if L["name"].startswith("fwd90"))
    assert L["name"] == "fwd90ws_f16_d128_m128_n128_s2_feat_pp", L["name"]
    # ... which fills the rows no sequence owns itself (mask.cuh fill_packed_tail): one launch, no
    # varlen_fill_tail kernels, out and lse included.
    assert [x["name"] for x in launched[n0:]] == [L["name"]], [x["name"] for x in launched[n0:]]
    for field, t, rows in (("map_q", qp, 128), ("map_k", kp, 128), ("map_v", vp, 128)):
        n, h = t.shape[:2]
        want_map = _tma.kv_map(addr(t), (1, n, h, 128), (n * h * 128, h * 128, 128, 1), rows, "float16")
        assert L["p"][field].tobytes() == want_map, field
    q, k, v = arr(rng, (2, 256, 4, 128)), arr(rng, (2, 256, 2, 128)), arr(rng, (2, 256, 2, 128))
    monkeypatch.setenv("CUFLASH_FWD_WS", "0")
    _plan.CACHE.clear()
    cuflash.attention(q, k, v)
    assert launched[-1]["name"] == "fwd90_f16_d128_m128_n128_full_even_tma", launched[-1]["name"]
    cuflash.attention(q, k, v, softcap=5.0)
    assert not launched[-1]["name"].startswith("fwd90ws_"), launched[-1]["name"]


def check_padded_launch(launched, rng, batch, d, sk, causal, want):
    """A plain forward of head_dim d (256 query rows, sk keys) ran kernel `want` with d_cols d, the
    call's q and the maps of its own tensors (K and V: the tile's keys a box; Q, on the
    warp-specialized kernel: its block's rows), or with want None a kernel of its own head_dim."""
    from cuflash import _tma

    q, k, v = arr(rng, (batch, 256, 4, d)), arr(rng, (batch, sk, 2, d)), arr(rng, (batch, sk, 2, d))
    cuflash.attention(q, k, v, causal=causal)
    L = launched[-1]
    if want is None:
        assert not L["name"].startswith("fwd90") and f"_d{d}_" in L["name"], (d, sk, causal, L["name"])
        return
    assert L["name"] == want, (d, sk, causal, L["name"])
    assert int(L["p"]["d_cols"]) == d, L["p"]
    check_tensor(L["p"], "q", q)
    ws = want.startswith("fwd90ws_")
    kv_rows = int(want.split("_n")[1].split("_")[0])  # the tile's keys
    maps = (("map_k", k, kv_rows), ("map_v", v, kv_rows)) + ((("map_q", q, int(want.split("_m")[1].split("_")[0])),)
                                                            if ws else ())
    for field, t, rows in maps:
        strides = tuple(x // t.itemsize for x in t.strides)
        assert L["p"][field].tobytes() == _tma.kv_map(addr(t), t.shape, strides, rows, "float16"), field


def padup_settings(monkeypatch):
    """The pad-up wiring tests' setting: a stand-in map encoder and the tree's own rules (no
    CUFLASH_FWD_TMA / _WS / _PAD)."""
    fake_tma_driver(monkeypatch, lambda ptr, i, dims, box, strides: (
        ptr if i == 0 else 77 * i + dims[1] + box[1] + strides[0]), lambda ptr, *rest: ptr)
    monkeypatch.delenv("CUFLASH_FWD_TMA")
    monkeypatch.delenv("CUFLASH_FWD_WS", raising=False)
    monkeypatch.delenv("CUFLASH_FWD_PAD", raising=False)


def test_fwd_padup_below_64_wiring(dev, monkeypatch):
    """Plain forwards at head_dim 24 to 56 pad up to the warp-specialized kernel of 64
    (_config.fwd_pad_head_dim, plain=True) from FWD_PAD_SMALL_MIN_SEQLEN_K's keys on: the maps
    describe the call's own head_dim (TMA's zeros past it) and d_cols is the call's; shorter calls,
    head_dim 16 and CUFLASH_FWD_PAD=0 keep the mma.sync kernel of their head_dim; CUFLASH_FWD_WS=1
    pads at every length. (Calls with options: test_fwd_padup_below_64_feat_wiring.)"""
    from cuflash import _config

    padup_settings(monkeypatch)
    ad, launched = dev
    rng = np.random.default_rng()
    assert [_config.fwd_pad_head_dim("sm_90a", d, plain=True) for d in (8, 16, 24, 40, 56, 64, 72)] == [
        None, None, 64, 64, 64, None, 128]
    assert [_config.fwd_pad_head_dim("sm_90a", d) for d in (24, 56)] == [None, None]  # neither plain nor feat
    assert _config.fwd_pad_head_dim("sm_80", 40, plain=True) is None
    table = _config.FWD_PAD_SMALL_MIN_SEQLEN_K
    for (d, causal), least in table.items():
        assert _config.fwd_pad_head_dim("sm_90a", d, True, causal, least) == 64, (d, causal)
        assert _config.fwd_pad_head_dim("sm_90a", d, True, causal, least - 1) is None, (d, causal)
    assert sorted({d for d, _ in table}) == [24, 32, 40, 48, 56]
    for d, sk, causal, want in ((40, 2048, False, "fwd90ws_f16_d64_m192_n128_s3_full_ragged"),
                                (24, 4096, True, "fwd90ws_f16_d64_m192_n128_s2_causal_ragged"),
                                (56, 2048, True, "fwd90ws_f16_d64_m192_n128_s2_causal_ragged"),
                                (24, 2048, True, None),     # causal head_dim 24 below 4096 keys
                                (32, 448, False, None),     # head_dim 32 below 2048 keys (and below
                                #                             the TMA variant's span, fwd_pad_tma)
                                (16, 4096, False, None)):   # head_dim 16 does not pad
        check_padded_launch(launched, rng, 1, d, sk, causal, want)
    q, k, v = arr(rng, (1, 256, 4, 40)), arr(rng, (1, 2048, 2, 40)), arr(rng, (1, 2048, 2, 40))
    monkeypatch.setenv("CUFLASH_FWD_PAD", "0")
    _plan.CACHE.clear()
    cuflash.attention(q, k, v)
    assert not launched[-1]["name"].startswith("fwd90ws_"), launched[-1]["name"]
    monkeypatch.delenv("CUFLASH_FWD_PAD")
    monkeypatch.setenv("CUFLASH_FWD_WS", "1")
    _plan.CACHE.clear()
    q, k, v = arr(rng, (1, 256, 4, 32)), arr(rng, (1, 1024, 2, 32)), arr(rng, (1, 1024, 2, 32))
    cuflash.attention(q, k, v)
    assert launched[-1]["name"] == "fwd90ws_f16_d64_m192_n128_s3_full_ragged", launched[-1]["name"]


def test_fwd_padup_tma_below_64_wiring(dev, monkeypatch):
    """Plain forwards at head_dim 24 to 56 on the TMA variant of 64 (_config.fwd_pad_tma): forced
    (CUFLASH_FWD_PAD_TMA=1) at every length, even where the warp-specialized kernel's pad-up would
    take the call; FwdTmaParams.d_cols is the call's head_dim, the maps describe the call's k and v
    (BLOCK_N-row boxes), q is the call's. Head_dim 16, CUFLASH_FWD_PAD_TMA=0 and CUFLASH_FWD_PAD=0
    keep the mma.sync kernel; a head_dim 64 call's d_cols is 64. Without the setting: the table."""
    from cuflash import _config

    padup_settings(monkeypatch)
    ad, launched = dev
    rng = np.random.default_rng()

    def run(d, sk, causal, want):
        check_padded_launch(launched, rng, 2, d, sk, causal, want)

    monkeypatch.setenv("CUFLASH_FWD_PAD_TMA", "1")
    assert all(_config.fwd_pad_tma("sm_90a", d, c, 1 << 16) for d in (24, 32, 40, 48, 56) for c in (False, True))
    assert not any(_config.fwd_pad_tma(t, d, False) for t, d in (("sm_90a", 16), ("sm_90a", 64), ("sm_80", 40)))
    run(40, 1000, True, "fwd90_f16_d64_m128_n64_causal_ragged_tma")  # (FWD_PAD_SMALL_TMA_TILE's tiles)
    run(24, 512, False, "fwd90_f16_d64_m64_n128_full_even_tma")      # (head_dim 64's)
    run(56, 4100, False, "fwd90_f16_d64_m128_n64_full_ragged_tma")   # (the other pad-up's length)
    run(32, 1000, True, "fwd90_f16_d64_m64_n64_causal_ragged_tma")
    run(16, 1000, False, None)
    monkeypatch.setenv("CUFLASH_FWD_PAD_TMA", "0")
    _plan.CACHE.clear()
    run(40, 1000, True, None)
    monkeypatch.setenv("CUFLASH_FWD_PAD_TMA", "1")
    monkeypatch.setenv("CUFLASH_FWD_PAD", "0")
    _plan.CACHE.clear()
    run(40, 1000, True, None)
    monkeypatch.delenv("CUFLASH_FWD_PAD")
    monkeypatch.delenv("CUFLASH_FWD_PAD_TMA")
    _plan.CACHE.clear()
    run(64, 1000, True, "fwd90_f16_d64_m64_n64_causal_ragged_tma")
    run(64, _config.FWD_TMA_CAUSAL_WIDE_SEQLEN_K - 1, True, "fwd90_f16_d64_m64_n64_causal_ragged_tma")
    run(64, _config.FWD_TMA_CAUSAL_WIDE_SEQLEN_K, True, "fwd90_f16_d64_m64_n128_causal_even_tma")
    run(64, 3000, True, "fwd90_f16_d64_m64_n128_causal_ragged_tma")
    # The table: (from, below) per (head_dim, causal); inside the span it goes before the
    # warp-specialized kernel's pad-up, past it that pad-up (or mma.sync) serves the call.
    table = _config.FWD_PAD_SMALL_TMA_SEQLEN_K
    assert table and all(24 <= d < 64 for d, _ in table)
    for (d, causal), (lo, hi) in table.items():
        assert _config.fwd_pad_tma("sm_90a", d, causal, lo) and not _config.fwd_pad_tma("sm_90a", d, causal, lo - 1)
        assert _config.fwd_pad_tma("sm_90a", d, causal, hi - 1) and not _config.fwd_pad_tma("sm_90a", d, causal, hi)
    ws_least = _config.FWD_PAD_SMALL_MIN_SEQLEN_K[(32, True)]
    assert table[(32, True)][0] < ws_least < table[(32, True)][1]
    wide = _config.FWD_TMA_CAUSAL_WIDE_SEQLEN_K  # causal: 64 x 128 tiles from here on (64 x 64 below)
    assert ws_least == wide
    run(32, wide - 8, True, "fwd90_f16_d64_m64_n64_causal_ragged_tma")
    run(32, ws_least, True, "fwd90_f16_d64_m64_n128_causal_even_tma")  # the TMA variant first
    run(32, table[(32, True)][1], True, "fwd90ws_f16_d64_m192_n128_s2_causal_ragged")  # then the other
    run(48, table[(48, False)][0] - 8, False, None)                     # (shorter: mma.sync)
    run(24, 1000, False, None)                                          # not in the table
    # precompile(head_dims=[...]) builds the kernels of 64 they pad to, in their tiles; 24 pads to none.
    for d, tiles in ((48, ((64, 128, "full"), (64, 64, "causal"))), (40, ((128, 64, "full"), (128, 64, "causal"))),
                     (32, ((64, 128, "full"), (64, 64, "causal"), (64, 128, "causal"))),
                     (64, ((64, 128, "full"), (64, 64, "causal"), (64, 128, "causal")))):
        names = {spec.name for spec, _ in _launch.all_fwd_tma_specializations("sm_90a", [d], ["float16"])}
        assert names == {f"fwd90_f16_d64_m{m}_n{n}_{c}_{e}_tma" for m, n, c in tiles for e in ("even", "ragged")}, names
    assert _launch.all_fwd_tma_specializations("sm_90a", [24], ["float16"]) == []
    assert _config.fwd_pad_tma_config("sm_90a", 56, "float16", False) == _config.TileConfig(128, 64, 8, wgmma=True)
    assert _config.fwd_pad_tma_config("sm_90a", 48, "float16", True) == _config.fwd_tma_config_for_target(
        "sm_90a", 64, "float16", True)


def test_fwd_padup_below_64_feat_wiring(dev, monkeypatch):
    """Forwards with options at head_dim 24 to 56 pad up to the warp-specialized feature kernel of 64
    (_config.fwd_pad_head_dim, feat=): from FWD_PAD_SMALL_SCORES_MIN_SEQLEN_K's keys on where softcap,
    ALiBi or sink logits are among the options, from FWD_PAD_SMALL_MASK_MIN_SEQLEN_K's where there are
    only masks (lengths, packed batches, windows); causal: the window's right edge is 0; the length
    read is the keys a row can see (a window's width where narrower). The maps describe the call's
    own head_dim (a packed batch's as one sequence), d_cols is the call's, the mask is in the Params.
    Shorter calls, head dims a table lacks, narrow windows, head_dim 16 and CUFLASH_FWD_PAD=0 keep the
    feature kernel of their head_dim; CUFLASH_FWD_WS=1 pads at every length and option."""
    from cuflash import _config, _tma

    padup_settings(monkeypatch)
    ad, launched = dev
    rng = np.random.default_rng()
    scores, masks = _config.FWD_PAD_SMALL_SCORES_MIN_SEQLEN_K, _config.FWD_PAD_SMALL_MASK_MIN_SEQLEN_K
    assert sorted(scores) == sorted((d, c) for d in (24, 32, 40, 48, 56) for c in (False, True))
    assert set(masks) < set(scores) and (24, False) not in masks and (24, True) not in masks
    for feat, table in (("scores", scores), ("mask", masks)):
        for (d, causal), least in table.items():
            assert _config.fwd_pad_head_dim("sm_90a", d, causal=causal, seqlen_k=least, feat=feat) == 64
            assert _config.fwd_pad_head_dim("sm_90a", d, causal=causal, seqlen_k=least - 1, feat=feat) is None
            assert _config.fwd_pad_head_dim("sm_80", d, causal=causal, seqlen_k=least, feat=feat) is None
    assert _config.fwd_pad_head_dim("sm_90a", 24, seqlen_k=1 << 16, feat="mask") is None  # not in the table
    assert _config.fwd_pad_head_dim("sm_90a", 16, seqlen_k=1 << 16, feat="scores") is None
    ws = "fwd90ws_f16_d64_m128_n128_s2_feat"

    def run(d, sk, want, sq=200, **kw):
        q, k, v = arr(rng, (2, sq, 4, d)), arr(rng, (2, sk, 2, d)), arr(rng, (2, sk, 2, d))
        cuflash.attention(q, k, v, **kw)
        L = launched[-1]
        if not want:
            assert not L["name"].startswith("fwd90ws_") and f"_d{d}_" in L["name"], (d, sk, kw, L["name"])
            return L
        assert L["name"] == ws, (d, sk, kw, L["name"])
        assert int(L["p"]["d_cols"]) == d, L["p"]
        for field, t in (("map_q", q), ("map_k", k), ("map_v", v)):
            strides = tuple(x // t.itemsize for x in t.strides)
            assert L["p"][field].tobytes() == _tma.kv_map(addr(t), t.shape, strides, 128, "float16"), field
        return L

    slopes = rng.random(4).astype(np.float32).view(Dev)
    sinks = rng.standard_normal(4).astype(np.float32).view(Dev)
    for i, ((d, causal), least) in enumerate(scores.items()):
        kw = ({"softcap": 5.0}, {"alibi_slopes": slopes}, {"sink_logits": sinks})[i % 3]
        for sk, want in ((least, True), (least - 8, False)):
            L = run(d, sk, want, causal=causal, **kw)
            assert int(L["p"]["mask"]["window_right"]) == (0 if causal else -1), L["p"]["mask"]
    for (d, causal), least in masks.items():
        lens = np.full(2, least - 7, np.int32).view(Dev)
        run(d, least, True, causal=causal, kv_lengths=lens)
        run(d, least - 8, False, causal=causal, kv_lengths=np.full(2, least - 15, np.int32).view(Dev))
        run(d, least, True, causal=causal, kv_lengths=lens, softcap=5.0)  # scores: the lower table
    run(24, 8192, False, kv_lengths=np.full(2, 8000, np.int32).view(Dev))  # masks only at 24: never
    # A window is causal in the table's sense when its right edge is 0, and is as long as it is wide:
    # (1100, 0) at 8192 keys reads 1101: below the mask entry of 56 and the scores entry of 24, above
    # the scores entry of 40; a narrow window keeps the feature kernel of 40 with options too.
    assert masks[(56, True)] > 1101 and scores[(24, True)] > 1101 and scores[(40, True)] <= 1101
    run(56, 8192, False, window=(1100, 0))
    run(24, 8192, False, window=(1100, 0), softcap=5.0)
    L = run(40, 8192, True, window=(1100, 0), softcap=5.0)
    assert (int(L["p"]["mask"]["window_left"]), int(L["p"]["mask"]["window_right"])) == (1100, 0)
    run(40, 8192, False, window=(256, 0), softcap=5.0)
    # A packed batch: max_seqlen_k is the length the table reads; the maps are one sequence of all rows.
    least = masks[(56, True)]
    qp, kp, vp = arr(rng, (least + 100, 2, 56)), arr(rng, (least + 60, 1, 56)), arr(rng, (least + 60, 1, 56))
    cu_q = np.array([0, 100, least + 100], np.int32).view(Dev)
    cu_k = np.array([0, 60, least + 60], np.int32).view(Dev)
    for mk, want in ((least, True), (least - 1, False)):
        cuflash.attention_varlen(qp, kp, vp, cu_q, cu_k, least, mk, causal=True)
        L = next(L for L in reversed(launched) if L["name"].startswith("fwd"))
        if not want:
            assert not L["name"].startswith("fwd90ws_"), L["name"]
            continue
        assert L["name"] == ws and int(L["p"]["d_cols"]) == 56, L["name"]
        for field, t in (("map_q", qp), ("map_k", kp), ("map_v", vp)):
            n, h = t.shape[:2]
            want_map = _tma.kv_map(addr(t), (1, n, h, 56), (n * h * 56, h * 56, 56, 1), 128, "float16")
            assert L["p"][field].tobytes() == want_map, field
    # Off, and forced at every length and option.
    monkeypatch.setenv("CUFLASH_FWD_PAD", "0")
    _plan.CACHE.clear()
    run(56, 4096, False, softcap=5.0)
    monkeypatch.delenv("CUFLASH_FWD_PAD")
    monkeypatch.setenv("CUFLASH_FWD_WS", "1")
    _plan.CACHE.clear()
    run(24, 300, True, causal=True, kv_lengths=np.full(2, 290, np.int32).view(Dev))
    run(16, 300, False, softcap=5.0)


def test_bwd_tma_wiring(dev, monkeypatch):
    """CUFLASH_BWD_TMA=1: a plain backward on sm_90a runs the dK/dV kernel's TMA variant, whose Params
    are BwdParams unchanged, then the maps of q and dout (BLOCK_M-row boxes) and k and v (BLOCK_N
    rows), each the driver's map of the call's pointer; the preprocess and dQ launches are the usual
    ones; without the setting nothing changes."""
    from cuflash import _config, _tma

    fake_tma_driver(monkeypatch, lambda ptr, i, dims, box, strides: (
        ptr if i == 0 else 31 * i + dims[1] + box[1] + strides[0]), lambda ptr, *rest: ptr)
    monkeypatch.setenv("CUFLASH_BWD_TMA", "1")
    ad, launched = dev
    rng = np.random.default_rng()
    cfg = _config.bwd_config_for_target("sm_90a", 128, "float16")
    for det in (False, True):
        q, k, v = arr(rng, (2, 70, 4, 128)), arr(rng, (2, 90, 2, 128)), arr(rng, (2, 90, 2, 128))
        out, lse = cuflash.attention(q, k, v, return_lse=True, deterministic=det, causal=True)
        dout = arr(rng, q.shape)
        n0 = len(launched)
        dq, dk, dv = cuflash.attention_backward(dout, q, k, v, out, lse, deterministic=det, causal=True)
        names = [L["name"] for L in launched[n0:]]
        assert names[1].startswith("bwd90_dkdv") and names[1].endswith("_tma"), names
        assert not names[0].endswith("_tma") and not names[2].endswith("_tma"), names
        p = launched[n0 + 1]["p"]
        check_tensor(p, "q", q)
        check_tensor(p, "dk", dk)
        check_tensor(p, "do", dout, "dout")
        for field, t, rows in (("map_q", q, cfg.block_m), ("map_do", dout, cfg.block_m), ("map_k", k, cfg.block_n),
                               ("map_v", v, cfg.block_n)):
            strides = tuple(x // t.itemsize for x in t.strides)
            assert p[field].tobytes() == _tma.kv_map(addr(t), t.shape, strides, rows, "float16"), field
    monkeypatch.delenv("CUFLASH_BWD_TMA")
    _plan.CACHE.clear()
    n0 = len(launched)
    cuflash.attention_backward(dout, q, k, v, out, lse, causal=True)
    assert not any(L["name"].endswith("_tma") for L in launched[n0:])


def test_bwd_ws_wiring(dev, monkeypatch):
    """The warp-specialized backward (cuda_src/flash_bwd_sm90_ws.cu): a plain non-deterministic
    backward at head_dim 64 / 128 on sm_90a runs the zeroing preprocess, the kernel with 384 threads,
    one block per (128 keys, kv head, batch) and BwdTmaParams holding the maps of q and dout (boxes of
    BLOCK_M rows: 128 at head_dim 64, 64 at 128) and k and v (128 rows) of the call's pointers, then
    the permuted dQ conversion; the
    deterministic backward and CUFLASH_BWD_WS=0 keep the other kernels. Head_dim 96 pads up to the
    kernel of 128 (the preprocess reads 96 columns and zeroes 128-wide accumulator rows, the maps see
    96 columns, d_cols = 96, the conversion writes 96) unless CUFLASH_BWD_PAD=0; 24 does not pad."""
    from cuflash import _config, _tma

    fake_tma_driver(monkeypatch, lambda ptr, i, dims, box, strides: (
        ptr if i == 0 else 31 * i + dims[1] + box[1] + strides[0]), lambda ptr, *rest: ptr)
    from cuflash import _kvcache

    monkeypatch.setenv("CUFLASH_BWD_WS", "1")
    monkeypatch.setattr(_kvcache, "_sm_count", lambda dev: 5)
    ad, launched = dev
    rng = np.random.default_rng()
    for d, det, want, nopad in ((128, False, True, None), (64, False, True, None), (128, True, False, None),
                                (96, False, True, None), (96, False, False, "0"), (24, False, False, None)):
        if nopad:
            monkeypatch.setenv("CUFLASH_BWD_PAD", nopad)
        else:
            monkeypatch.delenv("CUFLASH_BWD_PAD", raising=False)
        _plan.CACHE.clear()
        q, k, v = arr(rng, (2, 70, 4, d)), arr(rng, (2, 300, 2, d)), arr(rng, (2, 300, 2, d))
        out, lse = cuflash.attention(q, k, v, return_lse=True, deterministic=det, causal=True)
        dout = arr(rng, q.shape)
        n0 = len(launched)
        dq, dk, dv = cuflash.attention_backward(dout, q, k, v, out, lse, deterministic=det, causal=True)
        names = [L["name"] for L in launched[n0:]]
        assert any(n.startswith("bwd90ws_") for n in names) == want, (d, det, names)
        if not want:
            continue
        m = 128 if d == 64 else 64  # query rows per iteration (_config.BWD_WS_BLOCK_M)
        if d == 96:
            assert names == ["bwd_pre_f16_d96_zero_dq128", "bwd90ws_f16_d128_m64_s2_causal_ragged_red_tma",
                             "bwd_convert_dq_f16_d128_perm64_to96"], names
        else:
            assert names == [f"bwd_pre_f16_d{d}_zero_dq", f"bwd90ws_f16_d{d}_m{m}_s2_causal_ragged_red_tma",
                             f"bwd_convert_dq_f16_d{d}_perm{m}"], names
        L = launched[n0 + 1]
        assert L["threads"] == 384 and L["grid"] == 2 * 2 * 3, L
        p = L["p"]
        assert int(p["d_cols"]) == d, p
        # Tile groups of ceil(5 SMs / 3 key blocks) = 2 of the 4 (batch, kv head)s.
        assert int(p["tile_heads"]) == 2 and int(p["num_blocks"]) == 3, p
        # Causal: a tail group of BWD_CAUSAL_TAIL_WAVES (1) x 5 SMs / 3 key blocks -> 2 heads.
        assert _config.BWD_CAUSAL_TAIL_WAVES == 1 and int(p["tail_heads"]) == 2, p
        check_tensor(p, "q", q)
        check_tensor(p, "dk", dk)
        check_tensor(p, "do", dout, "dout")
        for field, t, rows in (("map_q", q, m), ("map_do", dout, m), ("map_k", k, 128), ("map_v", v, 128)):
            strides = tuple(x // t.itemsize for x in t.strides)
            assert p[field].tobytes() == _tma.kv_map(addr(t), t.shape, strides, rows, "float16"), field
    # A persistent grid (CUFLASH_BWD_WS_PERSISTENT=1): one block per SM (here 5) for 1 x 3 x 6 tiles.
    monkeypatch.setenv("CUFLASH_BWD_WS_PERSISTENT", "1")
    _plan.CACHE.clear()
    q, k, v = arr(rng, (1, 64, 6, 128)), arr(rng, (1, 700, 3, 128)), arr(rng, (1, 700, 3, 128))
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    n0 = len(launched)
    cuflash.attention_backward(arr(rng, q.shape), q, k, v, out, lse)
    ws = [L for L in launched[n0:] if L["name"].startswith("bwd90ws_")]
    assert len(ws) == 1 and ws[0]["grid"] == 5 and int(ws[0]["p"]["num_blocks"]) == 6, ws
    assert int(ws[0]["p"]["tile_heads"]) == 1 and int(ws[0]["p"]["tail_heads"]) == 0, ws  # (not causal: no tail)
    # Causal: the tail group covers BWD_CAUSAL_TAIL_WAVES waves of tiles (one: 5 / 6 -> 1 head of the
    # 3; two: 10 / 6 -> 2); 0 waves: none.
    for waves, want in ((None, 1), ("0", 0), ("2", 2)):
        if waves is None:
            monkeypatch.delenv("CUFLASH_BWD_TAIL_WAVES", raising=False)
        else:
            monkeypatch.setenv("CUFLASH_BWD_TAIL_WAVES", waves)
        _plan.CACHE.clear()
        out, lse = cuflash.attention(q, k, v, return_lse=True, causal=True)
        n0 = len(launched)
        cuflash.attention_backward(arr(rng, q.shape), q, k, v, out, lse, causal=True)
        ws = [L for L in launched[n0:] if L["name"].startswith("bwd90ws_")]
        assert len(ws) == 1 and int(ws[0]["p"]["tail_heads"]) == want, (waves, ws)
    monkeypatch.delenv("CUFLASH_BWD_TAIL_WAVES", raising=False)
    monkeypatch.delenv("CUFLASH_BWD_WS_PERSISTENT")
    # Options (by default; CUFLASH_BWD_WS_FEAT=0 turns it off): windows, sinks, ALiBi take the kernel's FEAT variant after the
    # feature preprocess; lengths (and packed batches) its SEQS variant with the FEAT conversion
    # (CUFLASH_BWD_WS_SEQS=0: the cp.async kernels); softcap keeps the cp.async kernels.
    monkeypatch.delenv("CUFLASH_BWD_WS_FEAT", raising=False)
    _plan.CACHE.clear()
    q, k, v = arr(rng, (2, 70, 4, 128)), arr(rng, (2, 300, 2, 128)), arr(rng, (2, 300, 2, 128))
    for kw, want in (({"window": (40, 0)}, True), ({"alibi_slopes": np.full(4, 0.1, np.float32).view(Dev)}, True),
                     ({"kv_lengths": np.array([300, 17], np.int32).view(Dev)}, "seqs"), ({"softcap": 20.0}, False)):
        out, lse = cuflash.attention(q, k, v, return_lse=True, **kw)
        n0 = len(launched)
        cuflash.attention_backward(arr(rng, q.shape), q, k, v, out, lse, **kw)
        names = [L["name"] for L in launched[n0:]]
        if want == "seqs":
            assert names == ["bwd_pre_f16_d128_zero_dq_feat", "bwd90ws_f16_d128_m64_s2_feat_seqs_red_tma",
                             "bwd_convert_dq_f16_d128_perm64_feat"], (kw, names)
        elif want:
            assert names == ["bwd_pre_f16_d128_zero_dq_feat", "bwd90ws_f16_d128_m64_s2_feat_red_tma",
                             "bwd_convert_dq_f16_d128_perm64"], (kw, names)
            p = launched[n0 + 1]["p"]
            assert int(p["mask"]["window_left"]) == kw.get("window", (-1, -1))[0], (kw, p["mask"])
            # A window (left, 0) is causal on its right: the tail group as for causal calls (5 SMs, 3
            # key blocks of the 4 (batch, kv head)s: groups of 2, the tail group one of them).
            assert (int(p["tile_heads"]), int(p["tail_heads"])) == ((2, 2) if "window" in kw else (2, 0)), (kw, p)
        else:
            assert not any(n.startswith("bwd90ws_") for n in names), (kw, names)
    monkeypatch.setenv("CUFLASH_BWD_WS_FEAT", "0")  # off: the options keep the cp.async kernel
    _plan.CACHE.clear()
    out, lse = cuflash.attention(q, k, v, return_lse=True, window=(40, 0))
    n0 = len(launched)
    cuflash.attention_backward(arr(rng, q.shape), q, k, v, out, lse, window=(40, 0))
    assert not any(L["name"].startswith("bwd90ws_") for L in launched[n0:]), launched[n0:]
    monkeypatch.delenv("CUFLASH_BWD_WS_FEAT")
    monkeypatch.setenv("CUFLASH_BWD_WS", "0")
    _plan.CACHE.clear()
    q, k, v = arr(rng, (2, 70, 4, 128)), arr(rng, (2, 300, 2, 128)), arr(rng, (2, 300, 2, 128))
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    n0 = len(launched)
    cuflash.attention_backward(arr(rng, q.shape), q, k, v, out, lse)
    assert not any(L["name"].startswith("bwd90ws_") for L in launched[n0:])


def test_explicit_plan_rejects_other_signature(dev):
    ad, launched = dev
    rng = np.random.default_rng()
    q, k, v = arr(rng, (1, 64, 2, 64)), arr(rng, (1, 64, 2, 64)), arr(rng, (1, 64, 2, 64))
    p = cuflash.plan(q, k, v, causal=True)
    q2, k2, v2 = arr(rng, (1, 64, 2, 64)), arr(rng, (1, 64, 2, 64)), arr(rng, (1, 64, 2, 64))
    out = p(q2, k2, v2)
    check_tensor(launched[-1]["p"], "q", q2)
    check_tensor(launched[-1]["p"], "o", out)
    n = len(launched)
    with pytest.raises(ValueError, match=r"q, k, v: this plan was made for"):
        p(arr(rng, (1, 65, 2, 64)), k2, v2)
    assert len(launched) == n


def test_explicit_plan_options_lse_and_varlen(dev):
    """An explicit plan with option arrays: later calls pass them again by keyword in any order, as
    other arrays of the same signatures (two arrays where the example had one array twice), and
    their pointers reach MaskParams; lse is written only with return_lse; a missing, extra or
    differently shaped option array is a ValueError before any launch. plan_varlen: the offsets
    are passed again and patched in."""
    ad, launched = dev
    rng = np.random.default_rng()
    b, s, h, d = 2, 48, 4, 64
    q, k, v = arr(rng, (b, s, h, d)), arr(rng, (b, s, 2, d)), arr(rng, (b, s, 2, d))
    lengths = np.array([48, 5], np.int32).view(Dev)
    p = cuflash.plan(q, k, v, causal=True, q_lengths=lengths, kv_lengths=lengths, window=(9, 0))
    ql, kl = np.array([40, 7], np.int32).view(Dev), np.array([30, 48], np.int32).view(Dev)
    q2, k2, v2 = arr(rng, q.shape), arr(rng, k.shape), arr(rng, v.shape)
    out = p(q2, k2, v2, kv_lengths=kl, q_lengths=ql)
    L = launched[-1]
    check_tensor(L["p"], "q", q2)
    check_tensor(L["p"], "o", out)
    m = L["p"]["mask"]
    assert int(m["q_lengths"]) == addr(ql) and int(m["kv_lengths"]) == addr(kl)
    assert (int(m["window_left"]), int(m["window_right"])) == (9, 0)
    assert int(L["p"]["lse"]) == 0, "lse written though not asked for"
    out, lse = p(q2, k2, v2, q_lengths=ql, kv_lengths=kl, return_lse=True)
    assert int(launched[-1]["p"]["lse"]) == addr(lse) and lse.shape == (b, h, s)
    n = len(launched)
    for kw in (dict(q_lengths=ql), dict(q_lengths=ql, kv_lengths=kl, alibi_slopes=arr(rng, (h,), np.float32)),
               dict(q_lengths=ql, kv_lengths=np.array([1, 2, 3], np.int32).view(Dev)),
               dict(q_lengths=ql, kv_lengths=None)):
        with pytest.raises(ValueError, match=r"q, k, v: this plan was made for"):
            p(q2, k2, v2, **kw)
    p0 = cuflash.plan(q, k, v)
    with pytest.raises(ValueError, match=r"this plan was made for"):
        p0(q2, k2, v2, kv_lengths=kl)
    assert len(launched) == n
    total = 50
    q, k, v = arr(rng, (total, h, d)), arr(rng, (total, h, d)), arr(rng, (total, h, d))
    cu = np.array([0, 13, 50], np.int32).view(Dev)
    pv = cuflash.plan_varlen(q, k, v, cu, cu, 37, 37, causal=True)
    cq, ck = np.array([0, 20, 50], np.int32).view(Dev), np.array([0, 9, 50], np.int32).view(Dev)
    out = pv(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck)
    fwd = launched[n]
    assert int(fwd["p"]["mask"]["cu_seqlens_q"]) == addr(cq) and int(fwd["p"]["mask"]["cu_seqlens_k"]) == addr(ck)
    assert int(fwd["p"]["lse"]) == 0 and out.shape == (total, h, d)
    with pytest.raises(ValueError, match=r"this plan was made for"):
        pv(q, k, v, cu_seqlens_q=cq)


def test_bad_input_never_launches(dev):
    ad, launched = dev
    rng = np.random.default_rng()
    q, k, v = arr(rng, (1, 64, 2, 64)), arr(rng, (1, 64, 2, 64)), arr(rng, (1, 64, 2, 64))
    cuflash.attention(q, k, v)
    n = len(launched)
    for kw, err in ((dict(causal=1), TypeError), (dict(softmax_scale=float("nan")), ValueError),
                    (dict(window=(1.0, 0)), TypeError), (dict(window=[3, -2]), ValueError)):
        with pytest.raises(err):
            cuflash.attention(q, k, v, **kw)
    with pytest.raises(ValueError, match="k: head_dim 32 differs"):
        cuflash.attention(q, arr(rng, (1, 64, 2, 32)), arr(rng, (1, 64, 2, 32)))
    assert len(launched) == n


def test_forward_without_lse_writes_none(dev):
    """A call that wants out alone passes lse = 0 (the kernels then write none) and skips the packed
    batch's lse tail fill; asking for lse passes the buffer."""
    ad, launched = dev
    rng = np.random.default_rng()
    q, k, v = arr(rng, (1, 64, 2, 64)), arr(rng, (1, 64, 2, 64)), arr(rng, (1, 64, 2, 64))
    cuflash.attention(q, k, v, causal=True)
    assert int(launched[-1]["p"]["lse"]) == 0
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    assert int(launched[-1]["p"]["lse"]) == addr(lse)
    total, h, d = 40, 2, 64
    q, k, v = arr(rng, (total, h, d)), arr(rng, (total, h, d)), arr(rng, (total, h, d))
    cu = np.array([0, 7, 40], np.int32).view(Dev)
    n = len(launched)
    cuflash.attention_varlen(q, k, v, cu, cu, 33, 33)
    assert [L["name"] for L in launched[n:]] == [launched[n]["name"], "varlen_fill_tail_u16"]
    assert int(launched[n]["p"]["lse"]) == 0


@pytest.fixture
def torch_dev(dev, monkeypatch):
    """The torch adapter's GPU path on CPU tensors: they report cuda:0, outputs come from CPU
    templates, and the stream is a stand-in; the launches are recorded by `dev`."""
    torch = pytest.importorskip("torch")
    from cuflash._adapters import _torch as adapter

    real_info = adapter.TorchAdapter.info

    def info(self, x):
        i = real_info(self, x)
        return ArrayInfo(i.lib, i.shape, i.strides, i.dtype, ("cuda", 0), i.aligned, i.type_name)

    class CpuState(adapter._State):
        def __init__(self, plan):
            c = plan.call
            self.device = torch.device("cpu")
            dt = getattr(torch, c.dtype)
            self.out = adapter._like(plan.out_shape, dt, self.device)
            self.lse = adapter._like(plan.lse_shape, torch.float32, self.device)
            kv = (c.total_k, c.nheads_kv, c.head_dim) if c.packed else (c.batch, c.seqlen_k, c.nheads_kv, c.head_dim)
            self.kv = adapter._like(kv, dt, self.device)

    monkeypatch.setattr(adapter.TorchAdapter, "info", info)
    monkeypatch.setattr(adapter, "_State", CpuState)
    monkeypatch.setattr(adapter, "_raw_stream", lambda device_id: 77)
    return torch, dev[1]


def test_torch_hot_path_wiring(torch_dev):
    """Through torch's own hot path (the key, the inference route without lse, the autograd route
    with the C++ apply, copies of inputs it cannot read in place, the backward's allocations)."""
    torch, launched = torch_dev
    qbuf = torch.randn(2 * 50 * 4 * 64 + 1, dtype=torch.bfloat16)
    qm = qbuf[1:].view(2, 50, 4, 64)                          # contiguous, 2 bytes off: a new copy
    out = cuflash.attention(qm, qm, qm)
    p = launched[-1]["p"]
    assert all(int(p[n]) % 16 == 0 and int(p[n]) != qm.data_ptr() for n in ("q", "k", "v")), "misaligned input passed"
    q = torch.randn(2, 50, 4, 64, dtype=torch.bfloat16)
    kbig = torch.randn(2, 60, 2, 128, dtype=torch.bfloat16)
    k = kbig[..., ::2]                                        # last stride 2: copied
    v = torch.randn(2, 4, 60, 64, dtype=torch.bfloat16).transpose(1, 2)[:, :, :2]  # strided, read in place
    out = cuflash.attention(q, k, v, causal=True)
    p = launched[-1]["p"]
    assert int(p["lse"]) == 0 and int(p["q"]) == q.data_ptr() and int(p["o"]) == out.data_ptr()
    assert int(p["k"]) != k.data_ptr() and tuple(int(p[f"k_{s}_stride"]) for s in ("batch", "row", "head")) == (60 * 2 * 64, 2 * 64, 64)
    assert int(p["v"]) == v.data_ptr() and int(p["v_row_stride"]) == v.stride(1)
    for x in (q, k, v):
        x.requires_grad_(True)
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    assert type(out.grad_fn).__name__ == "_AttentionBackward"
    p = launched[-1]["p"]
    assert int(p["lse"]) == lse.data_ptr() and int(p["o"]) == out.data_ptr()
    n = len(launched)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    names = [L["name"] for L in launched[n:]]
    assert len(names) == 3 and names[0].startswith("bwd_pre"), names
    for i, L in enumerate(launched[n:]):
        p = L["p"]
        # The preprocess goes out before the gradients are allocated (it reads none of them); the
        # launches after it, the one that shares its Params buffer included, see all three.
        grads = (0, 0, 0) if i == 0 else (dq.data_ptr(), dk.data_ptr(), dv.data_ptr())
        assert (int(p["dq"]), int(p["dk"]), int(p["dv"])) == grads, (names[i], grads)
        assert int(p["o"]) == out.data_ptr() and int(p["lse"]) == lse.data_ptr() and int(p["q"]) == q.data_ptr()
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    # options: the sink logit's gradient comes back; lengths reach MaskParams
    sink = torch.randn(4, requires_grad=True)
    lengths = torch.tensor([50, 9], dtype=torch.int32)
    out = cuflash.attention(q, k, v, window=(7, 0), sink_logits=sink, kv_lengths=lengths)
    m = launched[-1]["p"]["mask"]
    assert int(m["sink_logits"]) == sink.data_ptr() and int(m["kv_lengths"]) == lengths.data_ptr()
    g = torch.autograd.grad(out, (q, k, v, sink), torch.randn_like(out))
    assert g[3].shape == (4,)


def test_huge_bounds_fit_the_kernels_int32(dev):
    """max_seqlen beyond the rows and num_sink_tokens beyond the keys change nothing; they are
    normalized before they reach the kernels' int32 fields (the GPU fuzzer's OverflowError)."""
    ad, launched = dev
    rng = np.random.default_rng()
    total, h, d = 40, 2, 64
    q, k, v = arr(rng, (total, h, d)), arr(rng, (total, h, d)), arr(rng, (total, h, d))
    cu = np.array([0, 7, 40], np.int32).view(Dev)
    out, lse = cuflash.attention_varlen(q, k, v, cu, cu, 2**31, 2**40, return_lse=True)
    p = launched[-3]["p"]
    assert (int(p["seqlen_q"]), int(p["seqlen_k"])) == (total, total)
    cuflash.attention_varlen_backward(arr(rng, q.shape), q, k, v, out, lse, cu, cu, 2**31, 2**40)
    qq, kk, vv = arr(rng, (1, 30, 2, 64)), arr(rng, (1, 30, 2, 64)), arr(rng, (1, 30, 2, 64))
    cuflash.attention(qq, kk, vv, window=(3, 0), num_sink_tokens=2**40)
    assert int(launched[-1]["p"]["mask"]["num_sink_tokens"]) == 30


def test_packed_backward_with_no_rows_plans_and_launches_no_key_grid(dev, monkeypatch):
    """A packed batch whose one sequence is empty (cu_seqlens [0, 0], max_seqlen 0 and 0, one row of
    the arrays past it): the backward plans no key blocks and launches no dK / dV grid. The GPU
    property test met a ZeroDivisionError here (session 20: Problem(seed=0, seq_q=[0], seq_k=[0],
    tail_q=1, tail_k=1, head_dim 32, bf16): the grouping of the warp-specialized backward's tiles
    divided by the key blocks)."""
    ad, launched = dev
    fake_tma_driver(monkeypatch, lambda ptr, i, dims, box, strides: (  # maps with the one-word address patch
        (ptr >> 4) | (7 << 60) if i == 1 else 1000 * i + dims[1] + box[1] + strides[0]), lambda *a: None)
    for name in ("CUFLASH_FWD_TMA", "CUFLASH_FWD_WS", "CUFLASH_BWD_WS"):
        monkeypatch.delenv(name)  # the table's kernels, as on a GPU: the warp-specialized backward
    ws_plans = []
    real = _launch.bwd_ws_specializations
    monkeypatch.setattr(_launch, "bwd_ws_specializations", lambda *a, **kw: ws_plans.append(a) or real(*a, **kw))
    rng = np.random.default_rng()
    for hd in (32, 64, 128):
        for max_q, max_k in ((0, 0), (3, 0)):
            q, k, v = arr(rng, (1, 2, hd)), arr(rng, (1, 2, hd)), arr(rng, (1, 2, hd))
            cu = np.array([0, 0], np.int32).view(Dev)
            out, lse = cuflash.attention_varlen(q, k, v, cu, cu, max_q, max_k, return_lse=True)
            n = len(launched)
            cuflash.attention_varlen_backward(arr(rng, q.shape), q, k, v, out, lse, cu, cu, max_q, max_k)
            names = [L["name"] for L in launched[n:]]
            assert not any("dkdv" in name for name in names), (hd, max_q, max_k, names)
    assert len(ws_plans) == 6, ws_plans  # every call planned the warp-specialized kernel


def test_bwd_ws_dq_red_wiring(dev, monkeypatch):
    """The warp-specialized backward adds dQ from registers (DQ_RED: the name's "_red", no sdQ in its
    shared memory) at head_dim 64 and 128 by default; CUFLASH_BWD_DQ_RED=0 goes back to the bulk
    reductions through sdQ; head_dim 64 with per-sequence lengths keeps the bulk path (ptxas spills
    there with DQ_RED); at head_dim 64, 3 stages (CUFLASH_BWD_WS_STAGES=3) fit only without sdQ."""
    ad, launched = dev
    fake_tma_driver(monkeypatch, lambda ptr, i, dims, box, strides: (
        (ptr >> 4) | (7 << 60) if i == 1 else 1000 * i + dims[1] + box[1] + strides[0]), lambda *a: None)
    for name in ("CUFLASH_FWD_TMA", "CUFLASH_FWD_WS", "CUFLASH_BWD_WS"):
        monkeypatch.delenv(name)
    rng = np.random.default_rng()

    def ws_launch(hd, lengths=False):
        q, k, v = arr(rng, (2, 256, 2, hd)), arr(rng, (2, 256, 2, hd)), arr(rng, (2, 256, 2, hd))
        kw = {}
        if lengths:
            kw = dict(q_lengths=np.array([200, 256], np.int32).view(Dev),
                      kv_lengths=np.array([256, 100], np.int32).view(Dev))
        out, lse = cuflash.attention(q, k, v, return_lse=True, **kw)
        n = len(launched)
        cuflash.attention_backward(arr(rng, q.shape), q, k, v, out, lse, **kw)
        ws = [L for L in launched[n:] if L["name"].startswith("bwd90ws_")]
        assert len(ws) == 1, [L["name"] for L in launched[n:]]
        return ws[0]["name"], ws[0]["smem"]

    for env, stages in ((None, None), ("0", None), ("1", None), (None, "3"), ("0", "3")):
        for var, val in (("CUFLASH_BWD_DQ_RED", env), ("CUFLASH_BWD_WS_STAGES", stages)):
            if val is None:
                monkeypatch.delenv(var, raising=False)
            else:
                monkeypatch.setenv(var, val)
        _plan.CACHE.clear()
        for hd, lengths in ((64, False), (128, False), (64, True), (128, True)):
            name, smem = ws_launch(hd, lengths)
            red = env != "0" and not (hd == 64 and lengths)
            assert _config.bwd_ws_dq_red(hd, lengths) == red
            m = 128 if hd == 64 else 64
            # 3 stages where they fit: with sdQ only at head_dim 128 (232000 bytes), without it at both.
            st = 3 if stages == "3" and (red or hd == 128) else 2
            assert name.endswith("_red_tma") == red and f"_d{hd}_m{m}_s{st}_" in name, (env, stages, hd, lengths, name)
            assert smem == _config.bwd_ws_smem_bytes(hd, st, m, red), (name, smem)
            assert smem <= _config.SMEM_LIMIT["sm90"]
    assert not _config.bwd_ws_dq_red(256)
    assert _config.bwd_ws_smem_bytes(128, 2, 64, False) - _config.bwd_ws_smem_bytes(128, 2, 64, True) == 64 * 128 * 4
    _plan.CACHE.clear()


def _refuse_launches(monkeypatch):
    """Makes every launch fail as the driver does when a kernel asks too much; returns the recorder
    it replaced, to put back."""
    record = _launch._launch_kernel

    def refuse(*args):
        raise RuntimeError("CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES: too many resources requested for launch")

    monkeypatch.setattr(_launch, "_launch_kernel", refuse)
    monkeypatch.setattr(_launch, "_launch_ex", refuse)  # (PDL launches: cuLaunchKernelEx)
    return record


def test_launch_failure_names_kernel_and_shape(dev, monkeypatch):
    """A launch the driver refuses raises cuflash.LaunchError naming the specialization, its launch
    shape and the call; the plan stays usable (its lock released) for the next call."""
    ad, launched = dev
    rng = np.random.default_rng()
    q, k, v = arr(rng, (2, 100, 8, 64)), arr(rng, (2, 130, 2, 64)), arr(rng, (2, 130, 2, 64))
    cuflash.attention(q, k, v, causal=True)
    record = _refuse_launches(monkeypatch)
    with pytest.raises(cuflash.LaunchError, match=r"launching fwd90_f16_d64_\w+ failed \(grid \d+, 256 threads.*"
                                                  r"float16 q \(2, 100, 8, 64\), k/v \(2, 130, 2, 64\), causal=True.*"
                                                  r"LAUNCH_OUT_OF_RESOURCES"):
        cuflash.attention(q, k, v, causal=True)
    monkeypatch.setattr(_launch, "_launch_kernel", record)
    n = len(launched)
    cuflash.attention(q, k, v, causal=True)
    assert len(launched) == n + 1


def test_out_of_memory_is_the_libraries_own(torch_dev, monkeypatch):
    """An allocation that fails inside a call (out, lse, the backward's scratch) raises torch's own
    OutOfMemoryError before any launch, and the next call works; JAX calls get JAX's own error."""
    torch, launched = torch_dev
    from cuflash._adapters import _torch as adapter

    q, k, v = (torch.randn(1, 64, 2, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    real = adapter._empty_like
    for fail_at in (1, 2):  # the forward's out, then its lse
        calls = []

        def empty_like(t, fail_at=fail_at, calls=calls):
            calls.append(t)
            if len(calls) == fail_at:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            return real(t)

        monkeypatch.setattr(adapter, "_empty_like", empty_like)
        n = len(launched)
        with pytest.raises(torch.OutOfMemoryError):
            cuflash.attention(q, k, v, causal=True, return_lse=True)
        assert len(launched) == n, "a launch ran after the allocation failed"
        monkeypatch.setattr(adapter, "_empty_like", real)
        out = cuflash.attention(q, k, v, causal=True)   # the next call works
        assert out.shape == q.shape
    out = cuflash.attention(q, k, v, causal=True)
    calls = []

    def fail_scratch(t):
        calls.append(t)
        if t.dtype == torch.float32 and t.dim() == 1:  # the backward's scratch
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
        return real(t)

    monkeypatch.setattr(adapter, "_empty_like", fail_scratch)
    with pytest.raises(torch.OutOfMemoryError):
        torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    monkeypatch.setattr(adapter, "_empty_like", real)
    out = cuflash.attention(q, k, v, causal=True)

    def fail_grad(t):  # a gradient (bf16); the scratch before it is allocated
        if t.dtype == torch.bfloat16:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(t)

    # The preprocess goes out before the gradients are allocated (BackwardPlan.launch_split): when one
    # fails, it is the only launch, it wrote cuflash's own scratch alone, and the plan's lock is free.
    monkeypatch.setattr(adapter, "_empty_like", fail_grad)
    n = len(launched)
    with pytest.raises(torch.OutOfMemoryError):
        torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert [L["name"][:8] for L in launched[n:]] == ["bwd_pre_"]
    monkeypatch.setattr(adapter, "_empty_like", real)
    out = cuflash.attention(q, k, v, causal=True)
    assert all(g.shape == x.shape for g, x in zip(torch.autograd.grad(out, (q, k, v), torch.randn_like(out)), (q, k, v)))


def test_bwd_single_wiring(torch_dev, monkeypatch):
    """The one-launch backward of short calls (flash_bwd.cu's dK/dV kernel with SINGLE): where a plain
    call's keys fit one block of its tiles (1 <= seqlen_k <= BLOCK_N: 128 at head_dim 64, 64 at 88-128),
    head_dim >= 32 and batch * nheads * seqlen_q <= BWD_SINGLE_MAX_ROWS, the backward is that one kernel, one block per
    (batch, kv head), on the forward's lse, with no scratch allocated; beyond either bound, or with
    CUFLASH_BWD_SINGLE=0, the three launches; CUFLASH_BWD_SINGLE=1 takes it at any row count."""
    torch, launched = torch_dev
    from cuflash._adapters import _torch as adapter

    real, allocs = adapter._empty_like, []
    monkeypatch.setattr(adapter, "_empty_like", lambda t: allocs.append(t.dtype) or real(t))

    def backward(b, sq, sk, h, hkv, d, causal=True, det=False, env=None):
        if env is None:
            monkeypatch.delenv("CUFLASH_BWD_SINGLE", raising=False)
        else:
            monkeypatch.setenv("CUFLASH_BWD_SINGLE", env)
        _plan.CACHE.clear()
        q = torch.randn(b, sq, h, d, dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(b, sk, hkv, d, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True, deterministic=det)
        n = len(launched)
        del allocs[:]
        if det:
            grads = cuflash.attention_backward(torch.randn_like(out), q, k, v, out, lse, causal=causal,
                                               deterministic=True)
        else:
            grads = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
        return launched[n:], grads, lse, list(allocs)

    # bench_host's shape: one launch, one block per (batch, kv head), no scratch
    ls, (dq, dk, dv), lse, allocs_made = backward(1, 128, 128, 2, 2, 64)
    assert [L["name"] for L in ls] == ["bwd_single_bf16_d64_m64_n128_w8_causal_even"]
    p = ls[0]["p"]
    assert ls[0]["grid"] == 1 * 2 and ls[0]["threads"] == 256 and int(p["num_blocks"]) == 1
    assert int(p["lse"]) == lse.data_ptr() and int(p["delta"]) == int(p["dq_accum"]) == int(p["lse_log2"]) == 0
    assert (int(p["dq"]), int(p["dk"]), int(p["dv"])) == (dq.data_ptr(), dk.data_ptr(), dv.data_ptr())
    assert torch.float32 not in allocs_made, "the one-launch backward allocated a scratch"
    # GQA, ragged, sq > sk; deterministic calls too
    ls, *_ = backward(2, 77, 50, 8, 2, 64, det=True)
    assert [L["name"] for L in ls] == ["bwd_single_bf16_d64_m64_n128_w8_causal_ragged"] and ls[0]["grid"] == 4
    # head_dim 128: 64-key blocks
    assert [L["name"] for L in backward(1, 64, 64, 2, 1, 128, causal=False)[0]] == [
        "bwd_single_bf16_d128_m32_n64_w8_full_even"]
    assert len(backward(1, 64, 65, 2, 1, 128)[0]) == 3
    # below head_dim 32 the separate dQ kernel's split dS: the three launches
    assert len(backward(1, 64, 64, 2, 2, 24, det=True)[0]) == 3
    # beyond the key block, or the row bound: the three launches
    assert len(backward(1, 128, 129, 2, 2, 64)[0]) == 3
    rows = _config.BWD_SINGLE_MAX_ROWS
    assert len(backward(1, rows // 64, 64, 64, 64, 64)[0]) == 1
    assert len(backward(1, rows // 64 + 1, 64, 64, 64, 64)[0]) == 3
    assert len(backward(1, rows // 64 + 1, 64, 64, 64, 64, env="1")[0]) == 1
    ls, _, _, allocs_made = backward(1, 128, 128, 2, 2, 64, env="0")
    assert len(ls) == 3 and ls[0]["name"].startswith("bwd_pre_") and torch.float32 in allocs_made


def test_backward_split_on_a_device_not_current(torch_dev, monkeypatch):
    """BackwardPlan.launch_split where the plan's device is not the current one: the gradients are
    allocated first and every launch goes out under the device switch (run_launches), each with the
    gradients' pointers; on the current device the preprocess goes first with none."""
    import sys
    import types

    torch, launched = torch_dev
    entered = []

    class Device:
        def __init__(self, i):
            self.i = i

        def __enter__(self):
            entered.append(self.i)

        def __exit__(self, *exc):
            return False

    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=types.SimpleNamespace(Device=Device)))
    q, k, v = (torch.randn(2, 70, 2, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    for current in (0, 1):
        monkeypatch.setattr(_plan, "_current_device", lambda: 0)
        out = cuflash.attention(q, k, v, causal=True)
        monkeypatch.setattr(_plan, "_current_device", lambda current=current: current)
        n = len(launched)
        del entered[:]
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
        names = [L["name"] for L in launched[n:]]
        assert len(names) == 3 and names[0].startswith("bwd_pre_"), names
        assert entered == ([0] if current else [])
        for i, L in enumerate(launched[n:]):
            p = L["p"]
            grads = (0, 0, 0) if i == 0 and not current else (dq.data_ptr(), dk.data_ptr(), dv.data_ptr())
            assert (int(p["dq"]), int(p["dk"]), int(p["dv"])) == grads, (current, names[i])


def test_jax_out_of_memory_is_jaxs_own(monkeypatch):
    jax = pytest.importorskip("jax")
    cupy = pytest.importorskip("cupy")
    from cuflash._adapters import _cupy, _jax

    def oom(shape, dtype, device_id):
        raise cupy.cuda.memory.OutOfMemoryError(2 << 30, 1 << 30)

    monkeypatch.setattr(_cupy.ADAPTER, "empty", oom)
    with pytest.raises(jax.errors.JaxRuntimeError, match="RESOURCE_EXHAUSTED"):
        _jax.ADAPTER.empty((4, 4), "float32", 0)


class _Buffer:
    """Stands in for jax.experimental.buffer_callback.Buffer: a device pointer with a shape."""

    def __init__(self, a):
        self.a, self.shape, self.dtype = a, a.shape, a.dtype
        self.__cuda_array_interface__ = {"data": (a.ctypes.data, False), "shape": a.shape, "version": 3}


class _Ctx:
    stream = 91


def _flat(p, prefix="") -> dict:
    """A Params record as {"field" / "mask.field": value} (not its bytes: a record's padding is arbitrary)."""
    out = {}
    for name in p.dtype.names:
        x = p[name]
        if x.dtype.names:
            out.update(_flat(x, prefix + name + "."))
        else:
            out[prefix + name] = x.tobytes() if x.shape else x.item()  # a tensor map: its bytes
    return out


@pytest.mark.parametrize("options", [False, True])
def test_jax_jit_gpu_callbacks_launch_what_eager_launches(dev, monkeypatch, options):
    """JAX under jit on a GPU (cuflash/_adapters/_jax.py, CUFLASH_JAX_JIT_GPU=1): the buffer_callback
    functions, run here against the fake device, launch the same kernels with the same Params as the
    eager call, except that the pointers are XLA's buffers and the stream is XLA's."""
    pytest.importorskip("jax")
    from cuflash._adapters import _jax as J
    from cuflash._plan import scratch_layout

    monkeypatch.setenv("CUFLASH_JAX_JIT_GPU", "1")
    ad, launched = dev
    rng = np.random.default_rng()
    b, s, h, hkv, d = 2, 70, 4, 2, 64
    q, k, v = arr(rng, (b, s, h, d)), arr(rng, (b, s, hkv, d)), arr(rng, (b, s, hkv, d))
    opts, scalars = {}, {}
    if options:
        opts = {"kv_lengths": np.array([70, 9], np.int32).view(Dev),
                "sink_logits": rng.standard_normal(h).astype(np.float32).view(Dev)}
        scalars = {"window": (11, 0), "softcap": 5.0}
    kw = dict(opts, **scalars)
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True, **kw)
    eager_fwd = launched[-1]
    dout = arr(rng, q.shape)
    ad.allocs.clear()
    n0 = len(launched)
    cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, **kw)
    eager_bwd = launched[n0:]
    eager_scratch = next(a for a in ad.allocs if a.dtype == np.float32 and a.ndim == 1)

    names = list(opts)
    arrays = [opts[n] for n in names]
    plans = J._JitPlans(q, k, v, names, arrays, scalars, (True, None, False, True), None)
    # forward: out and lse are XLA's buffers
    x_out, x_lse = np.empty_like(out), np.empty_like(lse)
    n0 = len(launched)
    J.forward_callback(plans)(_Ctx(), (_Buffer(x_out), _Buffer(x_lse)), *map(_Buffer, (q, k, v, *arrays)))
    (jf,) = launched[n0:]
    assert (jf["name"], jf["grid"], jf["threads"], jf["smem"], jf["stream"]) == \
        (eager_fwd["name"], eager_fwd["grid"], eager_fwd["threads"], eager_fwd["smem"], 91)
    fj, fe = _flat(jf["p"]), _flat(eager_fwd["p"])
    assert (fj.pop("o"), fj.pop("lse")) == (addr(x_out), addr(x_lse))
    fe.pop("o"), fe.pop("lse")
    assert fj == fe, "forward Params differ beyond the output pointers"

    # backward: dq, dk, dv and the scratch are XLA's buffers, laid out as scratch_layout says at trace time
    call, _ = plans.call(0)
    _, n_rows, n_acc, n_sink = scratch_layout(call, "sm_90a", options)
    x_dq, x_dk, x_dv = np.empty_like(q), np.empty_like(k), np.empty_like(v)
    x_scratch = np.empty(max(1, n_rows + n_acc + n_sink), np.float32)
    assert x_scratch.size >= eager_scratch.size
    cb = J.backward_callback(plans, x_scratch.size, n_rows + n_acc if options else None)
    n0 = len(launched)
    cb(_Ctx(), tuple(map(_Buffer, (x_dq, x_dk, x_dv, x_scratch))), *map(_Buffer, (dout, q, k, v, out, lse, *arrays)))
    jb = launched[n0:]
    assert [L["name"] for L in jb] == [L["name"] for L in eager_bwd]
    base_e, base_j = addr(eager_scratch), addr(x_scratch)
    for lj, le in zip(jb, eager_bwd):
        assert (lj["grid"], lj["threads"], lj["smem"], lj["stream"]) == (le["grid"], le["threads"], le["smem"], 91)
        fj, fe = _flat(lj["p"]), _flat(le["p"])
        for name, x in (("dq", x_dq), ("dk", x_dk), ("dv", x_dv)):
            assert fj.pop(name) == addr(x), name
            fe.pop(name)
        for name in ("delta", "lse_log2", "dq_accum", "mask.dsink_rows"):  # same offsets into the scratch
            e, j = fe.pop(name), fj.pop(name)
            assert (e == 0) == (j == 0) and (e == 0 or e - base_e == j - base_j), name
        assert fj == fe, f"{lj['name']}: Params differ beyond the moved pointers"


def test_jax_jit_gpu_lowering(monkeypatch):
    """With CUFLASH_JAX_JIT_GPU=1, lowering for 'cuda' builds the forward and the backward into XLA
    buffer callbacks (the CPU still runs the NumPy path); without it, lowering raises."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    q = jnp.ones((2, 16, 4, 64), jnp.bfloat16)
    k = jnp.ones((2, 16, 2, 64), jnp.bfloat16)
    sink = jnp.ones(4, jnp.float32)

    def loss(q, k, v, s):
        return jnp.sum(cuflash.attention(q, k, v, causal=True, sink_logits=s, window=(3, 0)).astype(jnp.float32))

    def lower():  # a new jit each time: the setting is read at trace time, and jit caches its traces
        return jax.jit(jax.grad(loss, argnums=(0, 3))).trace(q, k, k, sink).lower(lowering_platforms=("cuda",))

    monkeypatch.setenv("CUFLASH_JAX_JIT_GPU", "1")
    assert lower().as_text().count("xla_buffer_python_gpu_callback") == 2, "forward and backward callbacks"
    # vmap over a leading axis: the callback runs once per element (vmap_method="sequential")
    qs = jnp.stack([q, q])
    batched = jax.jit(jax.vmap(jax.grad(lambda q: loss(q, q[..., :2, :], q[..., :2, :], sink))))
    assert batched.trace(qs).lower(lowering_platforms=("cuda",)).as_text().count("xla_buffer_python_gpu_callback") == 2
    monkeypatch.setenv("CUFLASH_JAX_JIT_GPU", "0")  # the switch that turns the route off
    with pytest.raises(NotImplementedError, match="'cuda'"):
        lower()


@pytest.mark.parametrize("seqlens_kind", ["array", "int"])
def test_kvcache_prefill_path_wiring(dev, monkeypatch, seqlens_kind):
    """attention_with_kvcache on a GPU, contiguous cache, more than 64 packed query rows per kv head on
    the feature forward (a prefill chunk: cuflash/_kvcache.py ChunkPlan; forced here by
    CUFLASH_KVCACHE_FORWARD=1, the rule's own choice in test_kvcache_forward_route): the append kernel
    (run here by the stand-in, run_append_kernel) writes the new tokens at cache_seqlens (clamped to
    the cache: positions past it dropped) and each entry's L_b = min(cache_seqlens + seqlen_new,
    seqlen_cache) into a fresh int32 array, and the feature forward reads rows [0, batch) of the caches
    in place with kv_lengths = that array; no decode kernel, no decode plan. The second call (new
    tokens, other lengths) takes the fast path and the same launches."""
    _kvcache_route(monkeypatch, "1")
    ad, launched = dev
    ad.run_appends[0] = True
    rng = np.random.default_rng()
    b, cap, h, hkv, d, n = 2, 96, 8, 2, 64, 17  # 17 * 4 = 68 rows per kv head
    q = arr(rng, (b, n, h, d))
    k_cache, v_cache = arr(rng, (b + 1, cap, hkv, d)), arr(rng, (b + 1, cap, hkv, d))
    for starts in ([5, 85], [40, 0]) if seqlens_kind == "array" else ([40, 40],):
        k_new, v_new = arr(rng, (b, n, hkv, d)), arr(rng, (b, n, hkv, d))
        before_k, before_v = k_cache.copy(), v_cache.copy()
        seqlens = np.array(starts, np.int32).view(Dev) if seqlens_kind == "array" else starts[0]
        n0 = len(launched)
        cuflash.attention_with_kvcache(q, k_cache, v_cache, k_new, v_new, seqlens, causal=True)
        untouched = np.ones((b + 1, cap), bool)
        for i, s0 in enumerate(starts):
            for t in range(n):
                if s0 + t < cap:  # 85 + 17 > 96: the tokens past the cache are dropped
                    assert np.array_equal(np.asarray(k_cache[i, s0 + t]), np.asarray(k_new[i, t])), (i, t)
                    assert np.array_equal(np.asarray(v_cache[i, s0 + t]), np.asarray(v_new[i, t])), (i, t)
            untouched[i, s0:min(s0 + n, cap)] = False
        assert np.array_equal(np.asarray(k_cache)[untouched], np.asarray(before_k)[untouched]), "writes outside"
        assert np.array_equal(np.asarray(v_cache)[untouched], np.asarray(before_v)[untouched]), "writes outside"
        got = launched[n0:]
        assert [L["name"] for L in got][0] == "decode_append" and len(got) == 2, [L["name"] for L in got]
        a, L = got[0]["p"], got[1]
        assert "feat" in L["name"], L["name"]
        assert (int(a["k"]), int(a["v"]), int(a["k_new"]), int(a["v_new"])) == (
            addr(k_cache), addr(v_cache), addr(k_new), addr(v_new))
        if seqlens_kind == "array":
            assert int(a["cache_seqlens"]) == addr(seqlens)
        else:
            assert int(a["cache_seqlens"]) == 0 and int(a["fixed_seqlen"]) == 40
        p = L["p"]
        assert int(p["k"]) == addr(k_cache) and int(p["v"]) == addr(v_cache), "the caches are read in place"
        assert int(p["batch"]) == b and int(p["seqlen_k"]) == cap
        lengths = next(x for x in reversed(ad.allocs) if addr(x) == int(a["kv_lengths"]))
        assert lengths.dtype == np.int32 and lengths.shape == (b,)
        assert int(p["mask"]["kv_lengths"]) == addr(lengths)
        assert np.asarray(lengths).tolist() == [min(s0 + n, cap) for s0 in starts]
        assert int(p["mask"]["window_right"]) == 0, "causal"
    assert not _kvcache._DECODE_PLANS and len(_kvcache._CHUNK_PLANS) == 1 and len(_kvcache._FAST_PLANS) == 1
    # Caches that share memory: refused before any launch, after calls whose caches passed the check
    # (ChunkPlan keeps the pointers that passed: these are others), nothing written.
    before, n0 = k_cache.copy(), len(launched)
    with pytest.raises(ValueError, match="^k_cache: expected k_cache and v_cache in separate memory"):
        cuflash.attention_with_kvcache(q, k_cache, k_cache, k_new, v_new, seqlens, causal=True)
    assert len(launched) == n0 and np.array_equal(np.asarray(k_cache), np.asarray(before))


def test_kvcache_forward_rule(monkeypatch):
    """_config.kvcache_feature_forward (session 69's measurements on an H200, 132 SMs): never at 64 packed
    rows a kv head or fewer; from 65, the forward where seqlen_q >= 64 and the share of the GPU its tiles
    keep busy, min(tiles, SMs) / SMs x seqlen_q / (128 x ceil(seqlen_q / 128)), is at least 0.3 (a paged
    cache: and at least 512 rows), else the decode kernels; CUFLASH_KVCACHE_FORWARD=0 / 1 force either
    above 64 rows."""
    from cuflash import _config

    monkeypatch.delenv("CUFLASH_KVCACHE_FORWARD", raising=False)
    rule = _config.kvcache_feature_forward
    assert _config.KVCACHE_FORWARD_MIN_FILL == 0.3 and _config.KVCACHE_FORWARD_MIN_SEQLEN_Q == 64
    assert not rule(8, 64, 64, 32, 132)  # 64 rows: the decode kernels, whatever the batch
    assert not rule(16, 128, 256, 32, 132) and not rule(32, 256, 16, 32, 132)  # short chunks
    assert not rule(63, 504, 64, 32, 132)  # (a full GPU, but fewer than 64 positions)
    # share 64 / 132 x 0.5 and 32 / 132 x 1: 0.24 (measured: the decode kernels, 0.95-1.42 faster)
    assert not rule(64, 512, 2, 32, 132) and not rule(128, 1024, 1, 32, 132) and not rule(64, 256, 2, 32, 132)
    # share 96 / 132 x 0.5 = 0.36, 64 / 132 x 1 = 0.48, 128 / 132 x 0.5 = 0.48
    assert rule(64, 512, 3, 32, 132) and rule(128, 1024, 2, 32, 132) and rule(64, 512, 4, 32, 132)
    assert rule(256, 2048, 1, 32, 132) and rule(128, 1024, 4, 32, 132)
    assert rule(192, 1536, 1, 32, 132)  # 64 tiles of which each head's second is half full: 0.48 x 0.75
    assert rule(128, 128, 16, 32, 132) and not rule(128, 128, 1, 32, 132)  # GQA 1: 128 rows
    assert rule(64, 512, 3, 32, 160) and not rule(64, 512, 3, 32, 161)  # share 0.3, exactly (96 / 160 x 0.5)
    assert rule(80, 640, 2, 32, 132) and not rule(78, 624, 2, 32, 132)  # shares 0.303 and 0.295
    assert rule(64, 512, 4, 32, 132, paged=True) and not rule(64, 256, 4, 32, 132, paged=True)
    assert rule(128, 128, 16, 32, 132) and not rule(128, 128, 16, 32, 132, paged=True)
    monkeypatch.setenv("CUFLASH_KVCACHE_FORWARD", "1")
    assert rule(9, 72, 1, 16, 132) and not rule(8, 64, 1, 16, 132)
    monkeypatch.setenv("CUFLASH_KVCACHE_FORWARD", "0")
    assert not rule(512, 4096, 64, 32, 132)


@pytest.mark.parametrize("sq,route", [(17, "rule"), (17, "1"), (80, "rule"), (130, "rule"), (200, "rule"),
                                      (200, "0")])
def test_kvcache_forward_route(dev, monkeypatch, sq, route):
    """Which GPU path a contiguous call of more than 64 packed rows a kv head takes
    (_config.kvcache_feature_forward; 132 SMs; batch 2, 16 query heads on 4 kv heads, GQA 4): 17
    positions (68 rows): the decode kernels; 80 positions: still the decode kernels (32 query tiles:
    a share of the GPU of 32 / 132 x 80 / 128 = 0.15); 130 positions: 64 tiles, each head's second
    with 2 rows (share 64 / 132 x 130 / 256 = 0.25), the decode kernels; 200 positions (0.38): the
    feature forward, with the append kernel for the lengths, and no decode plan.
    CUFLASH_KVCACHE_FORWARD forces either."""
    from cuflash import _config, _kvcache

    _kvcache_route(monkeypatch, route)
    ad, launched = dev
    rng = np.random.default_rng()
    b, cap, h, hkv, d = 2, 256, 16, 4, 64
    q = arr(rng, (b, sq, h, d))
    k_cache, v_cache = arr(rng, (b, cap, hkv, d)), arr(rng, (b, cap, hkv, d))
    seqlens = np.array([100, 150], np.int32).view(Dev)
    n0 = len(launched)
    cuflash.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, causal=True)
    names = [L["name"] for L in launched[n0:]]
    forward = route == "1" or (route == "rule" and _config.kvcache_feature_forward(sq, sq * 4, b, h, 132))
    assert forward == (route == "1" or (route == "rule" and sq == 200))
    if forward:
        assert any("feat" in n for n in names) and names[0] == "decode_append", names
        assert not any(n.startswith("decode_") and n != "decode_append" for n in names), names
        assert not _kvcache._DECODE_PLANS and _kvcache._CHUNK_PLANS
    else:
        (dec,) = [L for L in launched[n0:] if L["name"].startswith("decode_") and "combine" not in L["name"]]
        assert int(dec["p"]["rows"]) == sq * 4 and int(dec["p"]["seqlen_q"]) == sq
        assert not any("feat" in n for n in names), names


@pytest.mark.parametrize("layout", ["contig", "contig_idx", "paged"])
@pytest.mark.parametrize("splits", [1, 5])
@pytest.mark.parametrize("warps", ["", "4", "8"])
@pytest.mark.parametrize("cluster", ["0", "1"])
def test_kvcache_decode_wiring(dev, monkeypatch, layout, splits, warps, cluster):
    """attention_with_kvcache on a GPU through the decode kernels (cuda_src/flash_decode.cu): the
    append, decode and combine launches read the caller's caches, index arrays and new tokens in place,
    with their strides; the split scratch holds o_part then lse_part; the heuristic is not asked when
    num_splits is forced. The decode kernel has 8 warps (256 threads, 3 stages at head_dim 64) where
    the grid leaves SMs one block at most and the call is unsplit (6 blocks here), or as
    CUFLASH_DECODE_WARPS forces; else 4. With the cluster merge (the default on sm_90; cluster "1")
    a split call is one decode launch in clusters of num_splits blocks, cluster_merge set, no
    scratch and no combine kernel; CUFLASH_DECODE_CLUSTER=0 keeps the combine kernel."""
    from cuflash import _kvcache

    monkeypatch.setattr(_kvcache, "_sm_count", lambda device_id: 132)
    monkeypatch.setenv("CUFLASH_DECODE_FUSED_COMBINE", "0")  # the combine kernel's path
    monkeypatch.setenv("CUFLASH_DECODE_CLUSTER", cluster)
    monkeypatch.setenv("CUFLASH_DECODE_WARPS", warps)
    _fresh_decode_plans(monkeypatch)  # plans made here read the settings above
    ad, launched = dev
    rng = np.random.default_rng()
    b, h, hkv, d, n, sq = 3, 8, 2, 64, 2, 2
    q = arr(rng, (b, sq, h, d))
    if layout == "paged":
        k_cache, v_cache = arr(rng, (10, 32, hkv, d)), arr(rng, (10, 32, hkv, d))
        extra = dict(block_table=np.arange(12, dtype=np.int32).reshape(b, 4)[:, ::1].copy().view(Dev) % 10)
        cap, rows, step = 128, 10, 32 * hkv * d
    else:
        k_cache, v_cache = arr(rng, (b + 2, 100, hkv, d)), arr(rng, (b + 2, 100, hkv, d))
        extra = dict(cache_batch_idx=np.array([4, 0, 2], np.int32).view(Dev)) if layout == "contig_idx" else {}
        cap, rows, step = 100, b + 2, 100 * hkv * d
    k_new, v_new = arr(rng, (b, n, hkv, d)), arr(rng, (b, n, hkv, d))
    seqlens = np.array([3, 0, 50], np.int32).view(Dev)
    cuflash.attention_with_kvcache(q, k_cache, v_cache, k_new, v_new, seqlens, causal=True, num_splits=splits,
                                   softcap=5.0, **extra)
    names = [L["name"] for L in launched]
    wide = warps == "8" or (warps == "" and splits == 1)
    kernel = "decode_f16_d64_s3_w8" if wide else "decode_f16_d64_s4"
    clustered = cluster == "1" and splits > 1
    assert names == ["decode_append", kernel] + (["decode_combine_f16_d64"] if splits > 1 and not clustered else [])
    assert [L["cluster"] for L in launched] == [1, splits if clustered else 1] + [1] * (len(launched) - 2)
    for L in launched:
        p = L["p"]
        assert int(p["k"]) == addr(k_cache) and int(p["v"]) == addr(v_cache), "the caches, in place"
        assert int(p["k_batch_stride"]) == step and int(p["k_row_stride"]) == hkv * d and int(p["k_head_stride"]) == d
        check_tensor(p, "q", q)
        assert int(p["cache_seqlens"]) == addr(seqlens)
        assert int(p["k_new"]) == addr(k_new) and int(p["v_new"]) == addr(v_new)
        assert tuple(int(p[f"kn_{s}_stride"]) for s in ("batch", "row", "head")) == elem_strides(k_new)[:3]
        assert int(p["cache_batch_idx"]) == (addr(extra["cache_batch_idx"]) if layout == "contig_idx" else 0)
        assert int(p["block_table"]) == (addr(extra["block_table"]) if layout == "paged" else 0)
        assert int(p["table_stride"]) == (4 if layout == "paged" else 0)
        assert (int(p["page_size"]), int(p["capacity"]), int(p["cache_rows"])) == (32 if layout == "paged" else 0, cap,
                                                                                  rows)
        assert (int(p["seqlen_new"]), int(p["rows"]), int(p["num_row_tiles"]), int(p["num_splits"])) == (n, 8, 1,
                                                                                                         splits)
        assert int(p["mask"]["window_right"]) == 0 and float(p["mask"]["softcap"]) == 5.0
        out = next(a for a in ad.allocs if a.shape == q.shape)
        assert int(p["o"]) == addr(out)
        assert int(p["cluster_merge"]) == int(clustered)
        # An eager call's partials: the plan's scratch for the stream (DecodePlan._scratch), no allocation.
        assert not any(a.dtype == np.float32 and a.ndim == 1 for a in ad.allocs), "no scratch allocated"
        if splits > 1 and not clustered:
            assert ad.scratches[-1] == (0, 77, 4 * splits * b * h * sq * (d + 1))
            assert int(p["o_part"]) == 0x5C7A000
            assert int(p["lse_part"]) == 0x5C7A000 + 4 * splits * b * h * sq * d
        else:
            assert int(p["o_part"]) == 0 and int(p["lse_part"]) == 0
            assert not ad.scratches, "no scratch"
    assert launched[1]["grid"] == b * hkv * 1 * splits and launched[1]["threads"] == (256 if wide else 128)
    # an eager call: plain launches (PDL only in a graph capture: test_decode_pdl_launches)
    assert not any(L["pdl"] for L in launched) and all(L["stream"] == 77 for L in launched)


@pytest.mark.parametrize("fit", [7, 8])
def test_kvcache_cluster_that_does_not_fit(dev, monkeypatch, fit):
    """The cluster merge only where every cluster of the grid is resident at once (_launch.cluster_fits,
    the driver's cuOccupancyMaxActiveClusters, asked once per function, block, shared memory and
    cluster size): 8 clusters of 5 blocks against room for 7 take the combine kernel (no fused
    combine here) with its scratch; room for 8, the cluster launch."""
    from cuflash import _launch

    asked = []
    monkeypatch.setattr(_launch, "_max_active_clusters",
                        lambda fn, grid, threads, smem, cluster: asked.append((grid, cluster)) or fit)
    monkeypatch.setenv("CUFLASH_DECODE_FUSED_COMBINE", "0")
    monkeypatch.delenv("CUFLASH_DECODE_CLUSTER", raising=False)
    _fresh_decode_plans(monkeypatch)
    ad, launched = dev
    rng = np.random.default_rng()
    b, h, hkv, d = 4, 8, 2, 64
    q = arr(rng, (b, 1, h, d))
    k_cache, v_cache = arr(rng, (b, 400, hkv, d)), arr(rng, (b, 400, hkv, d))
    seqlens = np.array([3, 0, 50, 399], np.int32).view(Dev)
    for _ in range(2):
        cuflash.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, num_splits=5)
    assert asked == [(b * hkv * 5, 5)], asked  # once: the answer is cached
    names = [L["name"] for L in launched[-2:] if L["name"].startswith("decode_")]
    if fit == 8:
        assert [L["cluster"] for L in launched] == [5, 5] and "decode_combine_f16_d64" not in names
        assert not any(a.dtype == np.float32 and a.ndim == 1 for a in ad.allocs), "no scratch"
    else:
        assert [L["cluster"] for L in launched] == [1] * 4 and names[-1] == "decode_combine_f16_d64"
        assert int(launched[0]["p"]["cluster_merge"]) == 0 and int(launched[0]["p"]["o_part"]) != 0


def _small_append_call(b, h, hkv, d):
    """(q, k_cache, v_cache, k, v, cache_seqlens) of a small decode call with one appended token: a
    64-key cache, lengths 3 and 40."""
    rng = np.random.default_rng()
    return (arr(rng, (b, 1, h, d)), arr(rng, (b, 64, hkv, d)), arr(rng, (b, 64, hkv, d)), arr(rng, (b, 1, hkv, d)),
            arr(rng, (b, 1, hkv, d)), np.array([3, 40], np.int32).view(Dev))


@pytest.mark.parametrize("case", ["capturing", "eager", "off", "sm_80", "capturing_cluster", "eager_cluster"])
def test_decode_pdl_launches(dev, monkeypatch, case):
    """Programmatic dependent launch: on sm_90, in a stream that is being captured into a CUDA graph,
    the decode kernels after a call's first (decode and combine after the append: each calls pdl_wait
    before its first read and write, cuda_src/flash_decode.cu) launch through cuLaunchKernelEx with
    the attribute, with the grid, block and shared memory of the plain launch (DecodePlan.run); the
    first kernel, eager calls, CUFLASH_PDL=0 and devices before sm_90 keep cuLaunchKernel; the
    forward's kernels (no pdl_wait) never take it. With the cluster merge (the "_cluster" cases) the
    decode kernel is one cluster launch, always through cuLaunchKernelEx: in a capture with both
    attributes (PDL and the cluster's size), eagerly with the cluster's alone.
    The config's bytes are read back through ctypes structures written from cuda.h (the fake
    cuLaunchKernelEx of the fixture)."""
    from cuflash import _kvcache

    assert ctypes.sizeof(LaunchConfig) == 56 and LaunchConfig.hStream.offset == 32
    assert LaunchConfig.attrs.offset == 40 and LaunchConfig.numAttrs.offset == 48
    assert ctypes.sizeof(LaunchAttribute) == 72 and LaunchAttribute.allowed.offset == 8
    if case == "off":
        monkeypatch.setenv("CUFLASH_PDL", "0")
    if case == "sm_80":
        monkeypatch.setattr(_gpu, "compute_capability", lambda device_id: (8, 0))
    monkeypatch.setattr(_kvcache, "stream_capturing", lambda stream: case != "eager")
    _fresh_decode_plans(monkeypatch)
    monkeypatch.setenv("CUFLASH_DECODE_FUSED_COMBINE", "0")
    cluster = case.endswith("_cluster")
    case = case.removesuffix("_cluster")
    monkeypatch.setenv("CUFLASH_DECODE_CLUSTER", "1" if cluster else "0")
    ad, launched = dev
    b, h, hkv, d = 2, 8, 2, 64
    q, k_cache, v_cache, k_new, v_new, seqlens = _small_append_call(b, h, hkv, d)
    cuflash.attention_with_kvcache(q, k_cache, v_cache, k_new, v_new, seqlens, num_splits=3)
    if cluster:
        assert [L["name"].split("_")[1] for L in launched] == ["append", "f16"]
        assert [L["pdl"] for L in launched] == [False, case == "capturing"]
        assert [L["cluster"] for L in launched] == [1, 3] and int(launched[1]["p"]["cluster_merge"]) == 1
    else:
        assert [L["name"].split("_")[1] for L in launched] == ["append", "f16", "combine"]
        assert [L["pdl"] for L in launched] == [False] + [case == "capturing"] * 2  # (the call's first: plain)
        assert launched[2]["grid"] == b * h and [L["cluster"] for L in launched] == [1, 1, 1]
    assert launched[1]["grid"] == b * hkv * 3
    assert [L["threads"] for L in launched] == [256, 128, 128][:len(launched)] and launched[1]["smem"] > 0
    n0 = len(launched)
    rng = np.random.default_rng()
    cuflash.attention(arr(rng, (1, 64, 2, 64)), arr(rng, (1, 64, 2, 64)), arr(rng, (1, 64, 2, 64)))
    assert launched[n0:] and not any(L["pdl"] for L in launched[n0:])


@pytest.mark.parametrize("cluster", [False, True])
@pytest.mark.parametrize("case", ["idle", "busy", "busy_capturing", "off", "pdl_off", "sm_80"])
def test_decode_eager_pdl_when_busy(dev, monkeypatch, case, cluster):
    """Eager decode calls on sm_90 launch every kernel as a programmatic dependent where the stream
    is busy, none where it may be idle (DecodePlan.run). Busy: the previous call's decode kernel has
    not begun, so its number is not yet in the plan's `started` word, which its last block writes as
    it starts (DecodeParams::started, seq). The fake kernels write it at the launch unless held.
    Each eager call's decode kernel carries the call's number (1, 2, 3) and the word's address; a
    captured call carries 0 (it writes nothing) and keeps its first launch plain;
    CUFLASH_DECODE_EAGER_PDL=0, CUFLASH_PDL=0 and sm_80 give no word and plain eager launches."""
    from cuflash import _kvcache

    if case == "off":
        monkeypatch.setenv("CUFLASH_DECODE_EAGER_PDL", "0")
    if case == "pdl_off":
        monkeypatch.setenv("CUFLASH_PDL", "0")
    if case == "sm_80":
        monkeypatch.setattr(_gpu, "compute_capability", lambda device_id: (8, 0))
    capturing = [False]
    monkeypatch.setattr(_kvcache, "stream_capturing", lambda stream: capturing[0])
    _fresh_decode_plans(monkeypatch)
    monkeypatch.setenv("CUFLASH_DECODE_FUSED_COMBINE", "0")
    monkeypatch.setenv("CUFLASH_DECODE_CLUSTER", "1" if cluster else "0")
    ad, launched = dev
    b, h, hkv, d = 2, 8, 2, 64
    q, k_cache, v_cache, k_new, v_new, seqlens = _small_append_call(b, h, hkv, d)
    cluster = cluster and case != "sm_80"  # (no clusters before sm_90)
    n_kernels = 2 if cluster else 3  # append, decode (+ combine)

    def call():
        n0 = len(launched)
        cuflash.attention_with_kvcache(q, k_cache, v_cache, k_new, v_new, seqlens, num_splits=3)
        got = launched[n0:]
        assert len(got) == n_kernels and got[1]["cluster"] == (3 if cluster else 1)
        return got

    first = call()  # nothing before it: plain
    assert not any(L["pdl"] for L in first)
    word = int(first[1]["p"]["started"])
    if case in ("off", "pdl_off", "sm_80"):
        assert word == 0 and int(first[1]["p"]["seq"]) == 0
        ad.held[0] = True
        assert not any(L["pdl"] for L in call())
        return
    assert word != 0 and int(first[1]["p"]["seq"]) == 1
    assert ctypes.c_uint64.from_address(word).value == 1  # (the fake decode kernel began)
    if case == "idle":
        again = call()
        assert not any(L["pdl"] for L in again) and int(again[1]["p"]["seq"]) == 2
        assert ctypes.c_uint64.from_address(word).value == 2
        return
    ad.held[0] = True  # from here the decode kernels have not begun when the next call comes
    second = call()  # the previous one began: plain; this one does not begin
    assert not any(L["pdl"] for L in second) and int(second[1]["p"]["seq"]) == 2
    if case == "busy":
        third = call()  # call 2's kernel has not begun: every launch PDL
        assert all(L["pdl"] for L in third) and int(third[1]["p"]["seq"]) == 3
        assert int(third[1]["p"]["started"]) == word
        ad.held[0] = False
        fourth = call()
        assert all(L["pdl"] for L in fourth)  # call 3's had not begun either; this one does
        assert not any(L["pdl"] for L in call())
    else:  # a capture: the first launch plain, the others PDL; the kernels write nothing (seq 0)
        capturing[0] = True
        cap = call()
        assert [L["pdl"] for L in cap] == [False] + [True] * (n_kernels - 1)
        assert int(cap[1]["p"]["seq"]) == 0
        capturing[0] = False
        ad.held[0] = False
        assert all(L["pdl"] for L in call())  # call 2's kernel had still not begun


@pytest.mark.parametrize("merge", ["fused", "kernel", "kernel_no_pdl"])
def test_kvcache_split_scratch_eager_and_captured(dev, monkeypatch, merge):
    """A split decode's partials (o_part, then lse_part): an eager call points them at the plan's
    scratch for its stream (DecodePlan._scratch, asked for the call's bytes) and allocates none; a call
    made while the stream captures a graph allocates its own (the graph's pool keeps it) and leaves the
    plan's scratch alone. With CUFLASH_PDL=0 the plan makes no PDL choice, and asks whether the stream
    captures for the scratch alone."""
    from cuflash import _kvcache

    monkeypatch.setattr(_kvcache, "_sm_count", lambda device_id: 132)
    monkeypatch.setenv("CUFLASH_DECODE_FUSED_COMBINE", "1" if merge == "fused" else "0")
    monkeypatch.setenv("CUFLASH_DECODE_CLUSTER", "0")
    if merge == "kernel_no_pdl":
        monkeypatch.setenv("CUFLASH_PDL", "0")
    capturing = [False]
    monkeypatch.setattr(_kvcache, "stream_capturing", lambda stream: capturing[0])
    _fresh_decode_plans(monkeypatch)
    ad, launched = dev
    rng = np.random.default_rng()
    b, h, hkv, d, splits = 3, 8, 2, 64, 3
    q = arr(rng, (b, 1, h, d))
    k_cache, v_cache = arr(rng, (b, 100, hkv, d)), arr(rng, (b, 100, hkv, d))
    seqlens = np.array([3, 0, 50], np.int32).view(Dev)
    floats = splits * b * h * (d + 1)

    def decode_p():
        return next(L["p"] for L in launched[::-1] if L["name"].startswith("decode_f16") and "combine" not in L["name"])

    def scratch_allocs():
        return [a for a in ad.allocs if a.dtype == np.float32 and a.ndim == 1]

    for _ in range(2):
        cuflash.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, num_splits=splits)
        p = decode_p()
        assert int(p["o_part"]) == 0x5C7A000 and int(p["lse_part"]) == 0x5C7A000 + 4 * splits * b * h * d
        assert ad.scratches[-1] == (0, 77, 4 * floats) and not scratch_allocs()
    (pl,) = [x for x in _kvcache._DECODE_PLANS.values() if x.out_shape == (b, 1, h, d)]
    assert pl.pdl == (merge != "kernel_no_pdl") and pl.graph is pl.eager and (pl.started is None) == (not pl.pdl)
    asked = len(ad.scratches)
    capturing[0] = True
    cuflash.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, num_splits=splits)
    (own,) = scratch_allocs()
    assert own.size == floats and len(ad.scratches) == asked
    p = decode_p()
    assert int(p["o_part"]) == addr(own) and int(p["lse_part"]) == addr(own) + 4 * splits * b * h * d


@pytest.mark.parametrize("counters", [0xABC000, 0])
def test_kvcache_fused_combine_wiring(dev, monkeypatch, counters):
    """CUFLASH_DECODE_FUSED_COMBINE=1: a split decode launches no combine kernel; the decode kernel's
    Params carry the plan's counters for the stream (DecodePlan._counters). Without counters (a graph
    capture that met none yet: 0), or with more rows x splits than DECODE_FUSED_MAX_PARTS, the call
    keeps the combine kernel and passes no counters."""
    from cuflash import _kvcache

    monkeypatch.setattr(_kvcache, "_sm_count", lambda device_id: 132)
    monkeypatch.setattr(_kvcache.DecodePlan, "_counters", lambda self, stream: counters)
    _fresh_decode_plans(monkeypatch)  # plans made here read the setting below
    monkeypatch.setenv("CUFLASH_DECODE_FUSED_COMBINE", "1")
    monkeypatch.setenv("CUFLASH_DECODE_CLUSTER", "0")  # the paths without the cluster merge
    ad, launched = dev
    rng = np.random.default_rng()
    b, h, hkv, d = 3, 8, 2, 64
    q = arr(rng, (b, 1, h, d))
    k_cache, v_cache = arr(rng, (b, 100, hkv, d)), arr(rng, (b, 100, hkv, d))
    seqlens = np.array([3, 0, 50], np.int32).view(Dev)
    for splits in (5, 1, 40):
        n0 = len(launched)
        cuflash.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, num_splits=splits)
        names = [L["name"] for L in launched[n0:]]
        # 4 rows a tile x 40 splits is past _config.DECODE_FUSED_MAX_PARTS: the combine kernel.
        fused = splits > 1 and counters != 0 and 4 * splits <= 64
        kernel = "decode_f16_d64_s4" if splits > 1 else "decode_f16_d64_s3_w8"  # (unsplit: 6 blocks, 8 warps)
        assert names == [kernel] + (["decode_combine_f16_d64"] if splits > 1 and not fused else []), names
        assert int(launched[n0]["p"]["split_counters"]) == (counters if fused else 0)


def test_kvcache_repeat_call_takes_the_fast_path(dev, monkeypatch):
    """A repeated signature skips describe_kvcache (its plan is found by the signature) and patches the new
    call's own pointers; a bad value of a scalar (a new signature) still gets its error."""
    from cuflash import _kvcache

    monkeypatch.setattr(_kvcache, "_sm_count", lambda device_id: 132)
    monkeypatch.setenv("CUFLASH_DECODE_FUSED_COMBINE", "0")  # the combine kernel's path
    monkeypatch.setenv("CUFLASH_DECODE_CLUSTER", "0")  # the paths without the cluster merge
    ad, launched = dev
    rng = np.random.default_rng()
    calls = []
    real = _kvcache.describe_kvcache
    monkeypatch.setattr(_kvcache, "describe_kvcache", lambda *a, **k: calls.append(1) or real(*a, **k))
    for rep in range(3):
        q = arr(rng, (2, 1, 8, 64))
        kc, vc = arr(rng, (2, 64, 2, 64)), arr(rng, (2, 64, 2, 64))
        kn, vn = arr(rng, (2, 1, 2, 64)), arr(rng, (2, 1, 2, 64))
        seqlens = np.array([3, 9], np.int32).view(Dev)
        cuflash.attention_with_kvcache(q, kc, vc, kn, vn, seqlens, causal=True, num_splits=2)
        for L in launched[-3:]:
            p = L["p"]
            assert (int(p["q"]), int(p["k"]), int(p["v"]), int(p["k_new"]), int(p["cache_seqlens"])) == (
                addr(q), addr(kc), addr(vc), addr(kn), addr(seqlens)), rep
    assert len(calls) == 1, "the repeated calls were validated again"
    with pytest.raises(ValueError, match="^num_splits: "):
        cuflash.attention_with_kvcache(q, kc, vc, kn, vn, seqlens, causal=True, num_splits=-2)
    with pytest.raises(ValueError, match="^k_cache: expected k_cache and v_cache in separate memory"):
        cuflash.attention_with_kvcache(q, kc, kc, kn, vn, seqlens, causal=True, num_splits=2)
    # The plan keeps the pointers that last passed the check (DecodePlan.apart): those pass again, others
    # are checked.
    cuflash.attention_with_kvcache(q, kc, vc, kn, vn, seqlens, causal=True, num_splits=2)
    with pytest.raises(ValueError, match="^k_cache: expected k_cache and v_cache in separate memory"):
        cuflash.attention_with_kvcache(q, vc, vc, kn, vn, seqlens, causal=True, num_splits=2)


@pytest.mark.parametrize("fused", [False, True])
def test_kvcache_graph_capture_takes_its_own_split_count(dev, monkeypatch, fused):
    """With num_splits=0 and the combine kernel (CUFLASH_DECODE_FUSED_COMBINE=0) a short cache is not
    split in eager calls (host-bound: a split adds a launch) but is split while the stream is captured
    into a CUDA graph, where GPU time alone counts (cuflash/_config.py decode_num_splits,
    host_bound_rule); the plan holds both and asks the stream. With the fused combine (the default;
    8 rows x 8 splits is within DECODE_FUSED_MAX_PARTS) a split adds no launch, and eager calls split
    too, fused; the captured call runs the same 8 splits with the combine kernel (64 parts are past
    DECODE_GRAPH_FUSED_MAX_PARTS, 32). A forced count is the same in both (3 splits: 24 parts, fused
    in both)."""
    from cuflash import _config, _kvcache

    assert _config.DECODE_GRAPH_FUSED_MAX_PARTS < 8 * 8 <= _config.DECODE_FUSED_MAX_PARTS

    monkeypatch.setattr(_kvcache, "_sm_count", lambda device_id: 132)
    monkeypatch.setenv("CUFLASH_DECODE_FUSED_COMBINE", "1" if fused else "0")
    monkeypatch.setenv("CUFLASH_DECODE_CLUSTER", "0")  # the paths without the cluster merge
    _fresh_decode_plans(monkeypatch)
    ad, launched = dev
    rng = np.random.default_rng()
    q = arr(rng, (1, 1, 8, 64))
    kc, vc = arr(rng, (1, 512, 1, 64)), arr(rng, (1, 512, 1, 64))
    seqlens = np.array([500], np.int32).view(Dev)
    capturing = []
    monkeypatch.setattr(_kvcache, "stream_capturing", lambda stream: bool(capturing))
    eager = 8 if fused else 1
    for capture, forced, want in ((False, 0, eager), (True, 0, 8), (False, 0, eager), (True, 3, 3), (False, 3, 3)):
        capturing[:] = [1] if capture else []
        del launched[:]
        cuflash.attention_with_kvcache(q, kc, vc, cache_seqlens=seqlens, causal=True, num_splits=forced)
        names = [L["name"] for L in launched]
        # (the fixture's plans always have counters for the stream)
        combine = want > 1 and (not fused or 8 * want > (_config.DECODE_GRAPH_FUSED_MAX_PARTS if capture
                                                        else _config.DECODE_FUSED_MAX_PARTS))
        kernel = "decode_f16_d64_s4" if want > 1 else "decode_f16_d64_s3_w8"  # (unsplit: 1 block, 8 warps)
        assert names == [kernel] + (["decode_combine_f16_d64"] if combine else []), (capture, names)
        assert int(launched[0]["p"]["num_splits"]) == want and launched[0]["grid"] == want, (capture, forced)
        if want > 1:
            assert int(launched[0]["p"]["o_part"]) != 0


def test_kvcache_fused_cap_instead_of_no_split(dev, monkeypatch):
    """Where the split count GPU time asks for is past the fused combine's limit (rows x splits >
    DECODE_FUSED_MAX_PARTS) and the eager rule would not split (a short cache), an eager call takes the
    best count the fused combine serves: batch 1, GQA 8 (8 rows), 1024 keys -> 8 splits, 4 warps, no
    combine kernel; with the combine kernel (CUFLASH_DECODE_FUSED_COMBINE=0) it stays unsplit (8 warps)."""
    from cuflash import _kvcache

    monkeypatch.setattr(_kvcache, "_sm_count", lambda device_id: 132)
    monkeypatch.setattr(_kvcache, "stream_capturing", lambda stream: False)
    ad, launched = dev
    rng = np.random.default_rng()
    q = arr(rng, (1, 1, 8, 64))
    kc, vc = arr(rng, (1, 1024, 1, 64)), arr(rng, (1, 1024, 1, 64))
    seqlens = np.array([1000], np.int32).view(Dev)
    for fused, want in (("1", ["decode_f16_d64_s4"]), ("0", ["decode_f16_d64_s3_w8"])):
        monkeypatch.setenv("CUFLASH_DECODE_FUSED_COMBINE", fused)
        monkeypatch.setenv("CUFLASH_DECODE_CLUSTER", "0")  # the paths without the cluster merge
        _fresh_decode_plans(monkeypatch)
        del launched[:]
        cuflash.attention_with_kvcache(q, kc, vc, cache_seqlens=seqlens)
        assert [L["name"] for L in launched] == want
        assert int(launched[0]["p"]["num_splits"]) == (8 if fused == "1" else 1)


def test_kvcache_cluster_instead_of_many_fused_splits(dev, monkeypatch):
    """On sm_90a at head_dim 128 (the TMA kernel, one block per SM), where the split count asks for more
    splits than a cluster holds and the fused combine would merge them, a cluster's worth of splits
    (8) runs instead, merged in clusters: batch 1, 2048 keys, 8 kv heads, GQA 4 (16 fused splits
    before). Not where the combine kernel serves the count (GQA 8: 16 splits, 8 rows each), nor with
    CUFLASH_DECODE_CLUSTER=0, nor for a forced count, nor in a CUDA graph (16 splits and the combine
    kernel there)."""
    from cuflash import _kvcache

    fake_tma_driver(monkeypatch, lambda ptr, i, dims, box, strides: (
        ptr if i == 0 else 31 * i + dims[1] + box[1] + strides[0]), lambda ptr, *rest: ptr)
    monkeypatch.setattr(_kvcache, "stream_capturing", lambda stream: False)
    monkeypatch.delenv("CUFLASH_DECODE_FUSED_COMBINE", raising=False)
    ad, launched = dev
    rng = np.random.default_rng()
    kc, vc = arr(rng, (1, 2048, 8, 128)), arr(rng, (1, 2048, 8, 128))
    seqlens = np.array([2000], np.int32).view(Dev)
    for gqa, cluster, forced, want in ((4, "1", 0, (8, 8)), (4, "0", 0, (16, 1)), (8, "1", 0, (16, 1)),
                                       (4, "1", 16, (16, 1))):
        monkeypatch.setenv("CUFLASH_DECODE_CLUSTER", cluster)
        _fresh_decode_plans(monkeypatch)
        cuflash.attention_with_kvcache(arr(rng, (1, 1, 8 * gqa, 128)), kc, vc, cache_seqlens=seqlens,
                                       num_splits=forced)
        (pl,) = _kvcache._DECODE_PLANS.values()
        dec = next(L for L in pl.eager[2] if "combine" not in L.name)
        assert pl.tma and dec.name.endswith("_tma"), dec.name
        assert (pl.eager[0], dec.cluster) == want, (gqa, cluster, forced, pl.eager[0], dec.cluster)
        # a graph keeps the 16 splits, merged by the combine kernel (a programmatic dependent there)
        assert pl.graph[0] == 16 and pl.graph[2][-1].name.startswith("decode_combine"), (gqa, cluster, forced)


def _decode_tma_setup(monkeypatch, capturing):
    """The decode plans' TMA maps on the fake device (encodable, with the one-word address patch),
    the stream's capture state from capturing[0], the fused combine and the cluster merge on."""
    from cuflash import _kvcache

    fake_tma_driver(monkeypatch, lambda ptr, i, dims, box, strides: (
        ptr if i == 0 else 31 * i + dims[1] + box[1] + strides[0]), lambda ptr, *rest: ptr)
    monkeypatch.setattr(_kvcache, "stream_capturing", lambda stream: capturing[0])
    monkeypatch.delenv("CUFLASH_DECODE_FUSED_COMBINE", raising=False)
    monkeypatch.setenv("CUFLASH_DECODE_CLUSTER", "1")


@pytest.mark.parametrize("case", ["cluster", "fused", "long", "paged", "off"])
def test_decode_idle_variant(dev, monkeypatch, case):
    """On sm_90a at head_dim 128, a plan whose eager call merges its splits in a combine kernel (batch 1,
    GQA 8: 16-32 splits of 8 rows) keeps a one-launch variant for eager calls on an idle stream
    (DecodePlan.idle): 8 splits on 8 warps, merged in clusters where a split sees at most
    DECODE_CLUSTER_KEYS keys (2048 keys), else by the fused combine (8192 keys). run() takes it where
    the previous call's decode kernel has begun (its number in `started`), and the eager variant (the
    combine kernel, PDL launches) where it has not; a capture takes the graph variant. None for splits
    of more than DECODE_IDLE_SPLIT_KEYS keys (32768 keys), for a paged cache, or with
    CUFLASH_DECODE_IDLE=0: every eager call runs the combine kernel there."""
    from cuflash import _kvcache

    capturing = [False]
    _decode_tma_setup(monkeypatch, capturing)
    if case == "off":
        monkeypatch.setenv("CUFLASH_DECODE_IDLE", "0")
    _fresh_decode_plans(monkeypatch)
    ad, launched = dev
    rng = np.random.default_rng()
    keys = {"fused": 8192, "long": 32768}.get(case, 2048)
    kc, vc = arr(rng, (1, keys, 4, 128)), arr(rng, (1, keys, 4, 128))
    kw = {}
    if case == "paged":
        kc, vc = kc.reshape(keys // 16, 16, 4, 128), vc.reshape(keys // 16, 16, 4, 128)
        kw["block_table"] = np.arange(keys // 16, dtype=np.int32).reshape(1, -1).view(Dev)
    seqlens = np.array([keys - 37], np.int32).view(Dev)
    q = arr(rng, (1, 1, 32, 128))

    def call():
        n0 = len(launched)
        cuflash.attention_with_kvcache(q, kc, vc, cache_seqlens=seqlens, **kw)
        got = launched[n0:]
        dec = next(L for L in got if L["name"].startswith("decode_") and "combine" not in L["name"])
        return got, dec

    def is_idle(got, dec):
        """The idle variant's launch (checked whole), or False for the eager variant's."""
        if len(got) == 2:
            assert got[1]["name"].startswith("decode_combine") and int(dec["p"]["split_counters"]) == 0
            return False
        assert len(got) == 1 and dec["name"] == "decode_f16_d128_s3_w8_tma" and int(dec["p"]["num_splits"]) == 8
        assert not dec["pdl"], "an idle stream's call launches plainly"
        if case == "cluster":
            assert dec["cluster"] == 8 and int(dec["p"]["cluster_merge"]) == 1
        else:
            assert dec["cluster"] == 1 and int(dec["p"]["split_counters"]) == 0xC0C000
        return True

    has_idle = case in ("cluster", "fused")
    first = call()  # nothing before it: an idle stream
    assert is_idle(*first) == has_idle
    (pl,) = _kvcache._DECODE_PLANS.values()
    assert (pl.idle is not pl.eager) == has_idle
    assert pl.scratch_bytes == 4 * max(pl.eager[1], pl.idle[1])
    ad.held[0] = True  # from here the decode kernels have not begun when the next call comes
    assert is_idle(*call()) == has_idle  # the previous call's kernel began: idle
    busy, dec = call()  # call 2's kernel has not begun: the eager variant, every launch PDL
    assert not is_idle(busy, dec) and all(L["pdl"] for L in busy)
    ad.held[0] = False
    assert not is_idle(*call())  # call 3's had not begun either
    assert is_idle(*call()) == has_idle  # call 4's began
    capturing[0] = True  # a capture: the graph variant (the combine kernel)
    cap, dec = call()
    assert not is_idle(cap, dec) and int(dec["p"]["seq"]) == 0
    capturing[0] = False


@pytest.mark.parametrize("case", ["24rows", "40rows", "paged", "warps8", "16rows", "off", "rule_short", "rule_long"])
def test_decode_two_tiles_plan(dev, monkeypatch, case):
    """On sm_90a (TMA, head_dim 128), a kv head with more than 16 packed rows (seqlen_q x GQA group)
    runs the decode kernel with two m16 tiles a warp ("_m2", _config.decode_two_tiles) where it is
    forced (CUFLASH_DECODE_TWO_TILES=1) or the rule takes it (rule_long: 16384 keys; not rule_short:
    1024 keys of 2 x 4 kv heads): 32 rows a block, so the grid has ceil(rows / 32) row tiles per kv
    head where the 16-row kernel had ceil(rows / 16); 4 warps even where CUFLASH_DECODE_WARPS=8 asks
    for 8 (the kernel is built on 4); no cluster merge (its buffer holds 16 rows): a split merges by
    the fused combine or the combine kernel. A paged cache of 16-row pages takes the 16-key-group
    twin. 16 rows or fewer, or CUFLASH_DECODE_TWO_TILES=0: the 16-row kernel."""
    _decode_tma_setup(monkeypatch, [False])
    if case == "off":
        monkeypatch.setenv("CUFLASH_DECODE_TWO_TILES", "0")
    elif case.startswith("rule"):
        monkeypatch.delenv("CUFLASH_DECODE_TWO_TILES", raising=False)
    else:
        monkeypatch.setenv("CUFLASH_DECODE_TWO_TILES", "1")
    if case == "warps8":
        monkeypatch.setenv("CUFLASH_DECODE_WARPS", "8")
    _fresh_decode_plans(monkeypatch)
    ad, launched = dev
    rng = np.random.default_rng()
    sq = {"40rows": 5, "16rows": 2}.get(case, 3)
    rows = 8 * sq
    batch, hk, keys = 2, 4, 16384 if case == "rule_long" else 1024
    kc, vc = arr(rng, (batch, keys, hk, 128)), arr(rng, (batch, keys, hk, 128))
    kw = {}
    if case == "paged":
        kc, vc = kc.reshape(batch * keys // 16, 16, hk, 128), vc.reshape(batch * keys // 16, 16, hk, 128)
        kw["block_table"] = np.arange(batch * keys // 16, dtype=np.int32).reshape(batch, -1).view(Dev)
    seqlens = np.array([keys - 37, 500], np.int32).view(Dev)
    q = arr(rng, (batch, sq, 8 * hk, 128))
    for splits in (0, 1, 4, 6):
        n0 = len(launched)
        cuflash.attention_with_kvcache(q, kc, vc, cache_seqlens=seqlens, causal=True, num_splits=splits, **kw)
        got = launched[n0:]
        (dec,) = [L for L in got if L["name"].startswith("decode_") and "combine" not in L["name"]]
        two = case not in ("16rows", "off", "rule_short")
        assert dec["name"].endswith("_m2") == two, dec["name"]
        assert ("_tma_grp" in dec["name"]) == (case == "paged") and "_tma" in dec["name"], dec["name"]
        tile = 32 if two else 16
        n = int(dec["p"]["num_splits"])
        assert splits == 0 or n == splits
        assert int(dec["p"]["num_row_tiles"]) == -(-rows // tile) and int(dec["p"]["rows"]) == rows
        assert dec["grid"] == batch * hk * -(-rows // tile) * n
        if two:
            assert dec["threads"] == 128 and dec["cluster"] == 1 and int(dec["p"]["cluster_merge"]) == 0
            merged = int(dec["p"]["split_counters"]) != 0 or any(L["name"].startswith("decode_combine") for L in got)
            assert n == 1 or merged
        elif 1 < n <= 8 and keys == 1024:  # the 16-row kernel: splits of at most DECODE_CLUSTER_KEYS keys merge in clusters
            assert dec["cluster"] == n


def test_paged_prefill_gpu_wiring(dev):
    """attention_varlen with a block_table on a GPU: two
    gathers copy the pages to packed arrays (batch * max_seqlen_k rows) and write the rebased offsets,
    and the varlen forward reads those arrays and offsets; q, the caches and the table in place."""
    ad, launched = dev
    rng = np.random.default_rng()
    q = arr(rng, (20, 8, 64))
    k, v = arr(rng, (12, 16, 2, 64)), arr(rng, (12, 16, 2, 64))
    table = np.arange(12, dtype=np.int32).reshape(3, 4).copy().view(Dev)
    cu_q = np.array([0, 5, 12, 20], np.int32).view(Dev)
    cu_k = np.array([4, 30, 40, 64], np.int32).view(Dev)  # offsets give lengths only: 26, 10, 24
    cuflash.attention_varlen(q, k, v, cu_q, cu_k, 8, 32, causal=True, block_table=table)
    gathers = [L for L in launched if L["name"] == "paged_gather"]
    assert len(gathers) == 2, [L["name"] for L in launched]
    kg, vg = (next(a for a in ad.allocs if addr(a) == int(L["p"]["dst"])) for L in gathers)
    assert kg.shape == vg.shape == (3 * 32, 2, 64)
    cu_out = next(a for a in ad.allocs if addr(a) == int(gathers[0]["p"]["cu_out"]))
    assert cu_out.shape == (4,) and cu_out.dtype == np.int32
    for L, src in zip(gathers, (k, v)):
        p = L["p"]
        assert int(p["src"]) == addr(src) and int(p["block_table"]) == addr(table) and int(p["cu_seqlens_k"]) == addr(cu_k)
        assert (int(p["src_block_stride"]), int(p["src_row_stride"]), int(p["src_head_stride"])) == elem_strides(src)[:3]
        assert (int(p["dst_row_stride"]), int(p["dst_head_stride"])) == (128, 64)
        assert (int(p["table_stride"]), int(p["batch"]), int(p["max_seqlen_k"]), int(p["num_blocks"]),
                int(p["page_size"]), int(p["total_rows"]), int(p["tiles"])) == (4, 3, 32, 12, 16, 96, 2)
        assert L["grid"] == 3 * 2
    fwd = next(L for L in launched if "feat" in L["name"])
    p = fwd["p"]
    assert int(p["q"]) == addr(q) and int(p["k"]) == addr(kg) and int(p["v"]) == addr(vg)
    assert int(p["mask"]["cu_seqlens_k"]) == addr(cu_out) and int(p["mask"]["cu_seqlens_q"]) == addr(cu_q)
    assert int(p["mask"]["total_k"]) == 96


# (page_size, head_dim, CUFLASH_PAGED_DIRECT, whether the pages are read in place): by the rule from 32-row
# boxes (_config.paged_direct; 96-row pages: gcd(96, 128) = 32), gathered below but where 16-row boxes are
# copied as whole rows (head_dim 128: _launch.paged_interleaved) for fewer than 2048 packed query rows a kv
# head (the tests' calls: 480 and 1600); forced either way.
PAGED_DIRECT_CASES = [(32, 64, "rule", True), (96, 128, "rule", True), (256, 128, "rule", True),
                      (16, 64, "rule", False), (16, 128, "rule", True), (48, 128, "1", True), (64, 64, "0", False)]


def test_paged_direct_rule(monkeypatch):
    """_config.paged_direct: in place from 32-row boxes, at any box with small_ok, and for 16-row boxes copied
    as whole rows below PAGED_WHOLE_ROWS_GATHER packed query rows a kv head; CUFLASH_PAGED_DIRECT forces."""
    monkeypatch.delenv("CUFLASH_PAGED_DIRECT", raising=False)
    g = _config.PAGED_WHOLE_ROWS_GATHER
    assert g == 2048
    assert _config.paged_direct(32) and _config.paged_direct(128) and not _config.paged_direct(16)
    assert _config.paged_direct(16, small_ok=True) and _config.paged_direct(16, False, g - 1)
    assert not _config.paged_direct(16, False, g) and not _config.paged_direct(16, False, None)
    assert _config.paged_direct(16, True, g) and _config.paged_direct(32, False, 10 * g)
    monkeypatch.setenv("CUFLASH_PAGED_DIRECT", "0")
    assert not _config.paged_direct(128, True, 1)
    monkeypatch.setenv("CUFLASH_PAGED_DIRECT", "1")
    assert _config.paged_direct(16, False, None)


def _paged_direct_mode(monkeypatch, mode):
    """The paged tests' setting: tensor maps with the one-word address patch (a stand-in driver), the
    table's kernels (the warp-specialized forward), and CUFLASH_PAGED_DIRECT `mode` ("rule": unset)."""
    fake_tma_driver(monkeypatch, lambda ptr, i, dims, box, strides: (
        (ptr >> 4) | (7 << 60) if i == 1 else 1000 * i + dims[1] + box[1] + strides[0]), lambda *a: None)
    for name in ("CUFLASH_FWD_TMA", "CUFLASH_FWD_WS"):
        monkeypatch.delenv(name)
    if mode == "rule":
        monkeypatch.delenv("CUFLASH_PAGED_DIRECT", raising=False)
    else:
        monkeypatch.setenv("CUFLASH_PAGED_DIRECT", mode)


@pytest.mark.parametrize("page,hd,mode,direct", PAGED_DIRECT_CASES)
def test_paged_prefill_direct_wiring(dev, monkeypatch, page, hd, mode, direct):
    """attention_varlen with a block_table on sm_90a with patchable tensor maps (a stand-in driver), where
    the boxes have enough rows (_config.paged_direct): one launch, the warp-specialized feature kernel with
    PAGED reading the pages in place (cuflash/_kvcache.py _paged_varlen_plan): q and its offsets as the
    varlen call's, the caches' pointers, K / V maps of the pages with boxes of gcd(page_size, 128) rows,
    the table's pointer, stride and columns, the page count; out and lse allocated as attention_varlen's;
    no gather. A second call reuses the plan (no new plan, the new arrays' pointers). Otherwise (16-row
    boxes, or CUFLASH_PAGED_DIRECT=0): the two gathers and the kernel without PAGED."""
    from cuflash import _features, _kvcache, _plan, _tma

    _paged_direct_mode(monkeypatch, mode)
    monkeypatch.setattr(_kvcache, "_DIRECT_VARLEN_PLANS", {})
    assert _kvcache._PAGED_TABLE == _plan.FWD_OPT + len(_features.ARRAY_OPTIONS)
    ad, launched = dev
    rng = np.random.default_rng()
    width = -(-512 // page)
    q = arr(rng, (300, 8, hd))
    k, v = arr(rng, (3 * width + 2, page, 2, hd)), arr(rng, (3 * width + 2, page, 2, hd))
    table = rng.permutation(3 * width + 2)[:3 * width].astype(np.int32).reshape(3, width).copy().view(Dev)
    cu_q = np.array([0, 100, 180, 300], np.int32).view(Dev)
    cu_k = np.array([4, 300, 400, 500], np.int32).view(Dev)  # offsets give lengths only: 296, 100, 100
    n0 = len(launched)
    out, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, 120, 512, causal=True, block_table=table,
                                        return_lse=True)
    names = [L["name"] for L in launched[n0:]]
    if not direct:
        assert names.count("paged_gather") == 2 and not names[-1].endswith("_paged"), names
        assert list(_kvcache._DIRECT_VARLEN_PLANS.values()) == [False]
        return
    box = math.gcd(page, 128)
    ilv = hd >= 128 and box == 16  # (pages that follow one another) boxes of whole rows: _launch.paged_interleaved
    assert names == [f"fwd90ws_f16_d{hd}_m128_n128_s2_feat{'_pp' if hd == 128 else ''}_paged{'_ilv' * ilv}"], names
    p = launched[-1]["p"]
    assert (int(p["q"]), int(p["o"]), int(p["lse"])) == (addr(q), addr(out), addr(lse))
    assert out.shape == q.shape and lse.shape == (8, 300) and lse.dtype == np.float32
    assert int(p["mask"]["cu_seqlens_q"]) == addr(cu_q) and int(p["mask"]["cu_seqlens_k"]) == addr(cu_k)
    assert (int(p["page_size"]), int(p["page_box"]), int(p["table_stride"]), int(p["table_cols"]),
            int(p["num_pages"]), int(p["block_table"])) == (page, box, width, width, 3 * width + 2, addr(table))
    assert int(p["seqlen_q"]) == 120 and int(p["seqlen_k"]) == 512 and int(p["mask"]["window_right"]) == 0
    assert p["map_k"].tobytes() == _tma.kv_map(addr(k), k.shape, elem_strides(k), box, "float16", ilv=ilv)
    assert p["map_v"].tobytes() == _tma.kv_map(addr(v), v.shape, elem_strides(v), 16 if ilv else box, "float16",
                                               panels=hd // 64 if ilv else 1)
    assert not ad.copies
    (plan,) = _kvcache._DIRECT_VARLEN_PLANS.values()
    # A repeated signature skips the checks (_kvcache._PAGED_FAST): no describe_paged_varlen.
    described = []
    real_describe = _kvcache.describe_paged_varlen
    monkeypatch.setattr(_kvcache, "describe_paged_varlen", lambda *a, **kw: described.append(1) or real_describe(*a, **kw))
    k2, v2, q2 = arr(rng, k.shape), arr(rng, v.shape), arr(rng, q.shape)
    out2, lse2 = cuflash.attention_varlen(q2, k2, v2, cu_q, cu_k, 120, 512, causal=True, block_table=table,
                                          return_lse=True)
    (again,) = _kvcache._DIRECT_VARLEN_PLANS.values()
    p = launched[-1]["p"]
    assert again is plan and (int(p["q"]), int(p["o"]), int(p["lse"])) == (addr(q2), addr(out2), addr(lse2))
    assert p["map_k"].tobytes() == _tma.kv_map(addr(k2), k.shape, elem_strides(k), box, "float16", ilv=ilv)
    assert not described, "the repeated signature was checked again"
    out3 = cuflash.attention_varlen(q2, k2, v2, cu_q, cu_k, 120, 512, causal=True, block_table=table)
    p = launched[-1]["p"]  # (without lse: its own plan, no lse written)
    assert len(_kvcache._DIRECT_VARLEN_PLANS) == 2 and (int(p["o"]), int(p["lse"])) == (addr(out3), 0)
    assert described == [1], "a new signature is checked"
    with pytest.raises(TypeError, match="^cu_seqlens_k: "):  # another type than q's: the full path's error
        cuflash.attention_varlen(q2, k2, v2, cu_q, np.asarray(cu_k), 120, 512, causal=True, block_table=table)


@pytest.mark.parametrize("case", ["follow", "ilv_off", "gaps", "pad_up", "rows32", "k_refused", "v_refused"])
def test_paged_prefill_layout_wiring(dev, monkeypatch, case):
    """Which layout the paged forward copies the pages into (cuflash/_launch.py paged_interleaved): at
    head_dim 128 on 16-row pages that follow one another in memory, boxes of whole rows ("_paged_ilv": K's
    map 5-D (64, 8, panels, 8-row groups, heads), V's boxes of 16 rows and both panels); one box a 64-column
    panel ("_paged", session 70's maps) where CUFLASH_PAGED_ILV=0, where the pages lie apart (a view with a
    gap after each page), where the call's head_dim pads up (96: a row's box would read past its columns),
    where the boxes have 32 rows (32-row pages), and where the driver refuses the whole-row layout's K map
    or V map (_launch._use_tma_ilv: its maps' patches are asked for, not the panels')."""
    from cuflash import _kvcache, _tma

    _paged_direct_mode(monkeypatch, "1")
    if case in ("k_refused", "v_refused"):  # the stand-in driver refuses K's interleaved map or V's 16-row boxes
        inner = _tma._driver_encode()       # of both panels (both 5-D: box {64, 8, 2, 2, 1} / {64, 16, 2, 1, 1})

        def encode(out, dtype, rank, ptr, dims, strides, box, *rest):
            if rank == 5 and box[1] == (8 if case == "k_refused" else 16):
                return 1  # CUDA_ERROR_INVALID_VALUE
            return inner(out, dtype, rank, ptr, dims, strides, box, *rest)

        monkeypatch.setattr(_tma, "_driver_encode", lambda: encode)
    monkeypatch.setattr(_kvcache, "_DIRECT_VARLEN_PLANS", {})
    if case == "ilv_off":
        monkeypatch.setenv("CUFLASH_PAGED_ILV", "0")
    else:
        monkeypatch.delenv("CUFLASH_PAGED_ILV", raising=False)
    ad, launched = dev
    rng = np.random.default_rng()
    page, hd = 32 if case == "rows32" else 16, 96 if case == "pad_up" else 128
    width, n = 512 // page, 3 * 512 // page + 2
    q = arr(rng, (300, 8, hd))
    if case == "gaps":  # pages 16 rows apart more than their own rows
        k, v = (arr(rng, (n, 2 * page, 2, hd))[:, :page] for _ in range(2))
    else:
        k, v = arr(rng, (n, page, 2, hd)), arr(rng, (n, page, 2, hd))
    table = rng.permutation(n)[:3 * width].astype(np.int32).reshape(3, width).copy().view(Dev)
    cu_q = np.array([0, 100, 180, 300], np.int32).view(Dev)
    cu_k = np.array([0, 300, 400, 500], np.int32).view(Dev)
    n0 = len(launched)
    cuflash.attention_varlen(q, k, v, cu_q, cu_k, 120, 512, causal=True, block_table=table)
    names = [L["name"] for L in launched[n0:]]
    ilv = case == "follow"
    assert names == [f"fwd90ws_f16_d128_m128_n128_s2_feat_pp_paged{'_ilv' * ilv}"], names
    p = launched[-1]["p"]
    assert int(p["page_box"]) == page and int(p["page_size"]) == page and int(p["num_pages"]) == n
    assert p["map_k"].tobytes() == _tma.kv_map(addr(k), k.shape, elem_strides(k), page, "float16", ilv=ilv)
    assert p["map_v"].tobytes() == _tma.kv_map(addr(v), v.shape, elem_strides(v), page, "float16",
                                               panels=2 if ilv else 1)
    # The interleaved map: 8-row groups numbered across the pages, each group's two panels together;
    # refused where the pages lie apart or head_dim is not whole panels.
    if case in ("gaps", "pad_up"):
        with pytest.raises(ValueError, match="pages one after another"):
            _tma.kv_map_args(0, k.shape, elem_strides(k), 16, "float16", ilv=True)
    else:
        rs, hs = elem_strides(k)[1:3]
        assert _tma.kv_map_args(0, k.shape, elem_strides(k), page, "float16", ilv=True) == (
            (64, 8, 2, n * page // 8, 2), (2 * rs, 128, 16 * rs, 2 * hs), (64, 8, 2, page // 8, 1))


@pytest.mark.parametrize("appends,route", [(True, "rule"), (False, "rule"), (True, "0")])
def test_kvcache_paged_forward_wiring(dev, monkeypatch, appends, route):
    """attention_with_kvcache on a GPU, paged cache, a long chunk (200 positions x GQA 8, batch 2, 16 query
    heads: 64 query tiles, a share of the GPU of 0.38; _config.kvcache_feature_forward with paged;
    cuflash/_kvcache.py ChunkPlan): one gather launch (cuda_src/paged_gather.cu, chunk mode; run here by
    the stand-in, run_gather_kernel) writes the new tokens into the pages, each entry's length into a
    fresh int32 array, and its keys and values t < length to rows b * capacity + t of the two halves of
    one padded allocation; the feature forward reads those with kv_lengths = that array; no decode
    kernel, no append kernel, and no decode plan made. CUFLASH_KVCACHE_FORWARD=0: the decode kernels, no
    gather."""
    _kvcache_route(monkeypatch, route)
    ad, launched = dev
    ad.run_appends[0] = True
    rng = np.random.default_rng()
    b, sq, h, hk, d, page, width = 2, 200, 16, 2, 64, 16, 16
    cap = page * width
    q = arr(rng, (b, sq, h, d))
    kc, vc = arr(rng, (b * width, page, hk, d)), arr(rng, (b * width, page, hk, d))
    before_k, before_v = kc.copy(), vc.copy()
    table = rng.permutation(b * width).astype(np.int32).reshape(b, width).copy().view(Dev)
    seqlens = np.array([20, 50], np.int32).view(Dev)
    kw = dict(k=arr(rng, (b, sq, hk, d)), v=arr(rng, (b, sq, hk, d))) if appends else {}
    n0 = len(launched)
    cuflash.attention_with_kvcache(q, kc, vc, cache_seqlens=seqlens, block_table=table, causal=True, **kw)
    got = launched[n0:]
    names = [L["name"] for L in got]
    if route == "0":
        assert not any(n == "paged_gather" or "feat" in n for n in names), names
        assert any(n.startswith("decode_") and n != "decode_append" for n in names), names
        return
    assert names[0] == "paged_gather" and len(names) == 2 and "feat" in names[1], names
    assert not _kvcache._DECODE_PLANS and _kvcache._CHUNK_PLANS
    g = got[0]["p"]
    assert (int(g["src"]), int(g["src_v"]), int(g["block_table"]), int(g["cache_seqlens"])) == (
        addr(kc), addr(vc), addr(table), addr(seqlens))
    assert int(g["cu_seqlens_k"]) == 0 and int(g["cu_out"]) == 0
    assert (int(g["batch"]), int(g["max_seqlen_k"]), int(g["num_blocks"]), int(g["page_size"]),
            int(g["total_rows"]), int(g["tiles"])) == (b, cap, b * width, page, b * cap, cap // 16)
    assert int(g["seqlen_new"]) == (sq if appends else 0)
    if appends:
        assert int(g["new_k"]) == addr(kw["k"]) and int(g["new_v"]) == addr(kw["v"])
    else:
        assert int(g["new_k"]) == 0 and int(g["new_v"]) == 0
    (both,) = [x for x in ad.allocs if addr(x) == int(g["dst"])]  # one allocation, two halves
    assert both.shape == (2, b, cap, hk, d) and int(g["dst_v"]) == addr(both[1])
    kg, vg = both[0], both[1]
    (lengths,) = [x for x in ad.allocs if addr(x) == int(g["lengths_out"])]
    assert lengths.dtype == np.int32 and np.asarray(lengths).tolist() == ([20 + sq, 50 + sq] if appends else [20, 50])
    for i, s0 in enumerate((20, 50)):
        for t in (0, 1, s0 - 1):  # cached keys: copied from their pages, the pages untouched
            blk, row = int(table[i, t // page]), t % page
            assert np.array_equal(np.asarray(kg[i, t]), np.asarray(before_k[blk, row])), (i, t)
            assert np.array_equal(np.asarray(vg[i, t]), np.asarray(before_v[blk, row])), (i, t)
        for t in (0, 1, sq // 2, sq - 1) if appends else ():  # new tokens: into their pages and the copy
            blk, row = int(table[i, (s0 + t) // page]), (s0 + t) % page
            for cache, copy_, new in ((kc, kg, kw["k"]), (vc, vg, kw["v"])):
                assert np.array_equal(np.asarray(cache[blk, row]), np.asarray(new[i, t])), (i, t)
                assert np.array_equal(np.asarray(copy_[i, s0 + t]), np.asarray(new[i, t])), (i, t)
    if not appends:
        assert np.array_equal(np.asarray(kc), np.asarray(before_k)) and np.array_equal(np.asarray(vc), np.asarray(before_v))
    (fwd,) = [L for L in got if "feat" in L["name"]]
    p = fwd["p"]
    assert int(p["q"]) == addr(q) and int(p["k"]) == addr(kg) and int(p["v"]) == addr(vg)
    assert int(p["mask"]["kv_lengths"]) == addr(lengths) and int(p["seqlen_k"]) == cap and int(p["batch"]) == b


@pytest.mark.parametrize("page,hd,mode,direct", PAGED_DIRECT_CASES)
def test_kvcache_paged_direct_wiring(dev, monkeypatch, page, hd, mode, direct):
    """On sm_90a with patchable tensor maps (a stand-in driver), a paged chunk that the rule gives the feature
    forward (200 positions x GQA 8, batch 2) reads the pages in place (cuflash/_launch.py PagedKV) where its
    boxes have enough rows (_config.paged_direct): the append kernel (the new tokens into the pages, each
    entry's L_b into a fresh int32 array), then the warp-specialized feature kernel with PAGED (its name's
    "_paged"), whose Params carry the page size, the box rows gcd(page_size, 128), the table's row stride
    and columns, the page count and the table's pointer, kv_lengths = that array, and whose K / V maps are
    the driver's maps of the caches' pages with boxes of those rows; no gather, no copy of the caches.
    Otherwise (16-row boxes, or CUFLASH_PAGED_DIRECT=0): the gather's one launch and the kernel without
    PAGED, reading the copy."""
    from cuflash import _kvcache, _tma

    _kvcache_route(monkeypatch, "rule")
    _paged_direct_mode(monkeypatch, mode)
    ad, launched = dev
    ad.run_appends[0] = True
    rng = np.random.default_rng()
    b, sq, h, hk, width = 2, 200, 16, 2, -(-1024 // page)
    q = arr(rng, (b, sq, h, hd))
    kc, vc = arr(rng, (b * width + 3, page, hk, hd)), arr(rng, (b * width + 3, page, hk, hd))
    # a table wider than it need be, read through a strided view (row stride width + 5)
    table = rng.permutation(b * width + 3)[:b * (width + 5)].astype(np.int32)
    table = np.resize(table, (b, width + 5)).copy().view(Dev)[:, :width + 2]
    seqlens = np.array([20, 50], np.int32).view(Dev)
    k, v = arr(rng, (b, sq, hk, hd)), arr(rng, (b, sq, hk, hd))
    n0 = len(launched)
    out = cuflash.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens, block_table=table, causal=True)
    got = launched[n0:]
    names = [L["name"] for L in got]
    (plan,) = _kvcache._CHUNK_PLANS.values()
    assert plan.direct == direct and not _kvcache._DECODE_PLANS
    if not direct:
        assert names[0] == "paged_gather" and len(names) == 2 and names[1].startswith("fwd90ws_"), names
        assert not names[1].endswith("_paged") and int(got[1]["p"]["k"]) != addr(kc), names
        return
    ilv = hd >= 128 and math.gcd(page, 128) == 16  # boxes of whole rows: _launch.paged_interleaved
    assert names == ["decode_append",
                     f"fwd90ws_f16_d{hd}_m128_n128_s2_feat{'_pp' if hd == 128 else ''}_paged{'_ilv' * ilv}"], names
    a, p = got[0]["p"], got[1]["p"]
    assert (int(a["k"]), int(a["v"]), int(a["block_table"]), int(a["page_size"]), int(a["table_stride"])) == (
        addr(kc), addr(vc), addr(table), page, width + 5)
    assert (int(a["k_new"]), int(a["v_new"]), int(a["seqlen_new"])) == (addr(k), addr(v), sq)
    (lengths,) = [x for x in ad.allocs if addr(x) == int(a["kv_lengths"])]
    assert np.asarray(lengths).tolist() == [20 + sq, 50 + sq]
    for i, s0 in enumerate((20, 50)):  # the new tokens in their pages
        for t in (0, sq - 1):
            blk, row = int(table[i, (s0 + t) // page]), (s0 + t) % page
            assert np.array_equal(np.asarray(kc[blk, row]), np.asarray(k[i, t])), (i, t)
    box = math.gcd(page, 128)
    assert (int(p["page_size"]), int(p["page_box"]), int(p["table_stride"]), int(p["table_cols"]),
            int(p["num_pages"]), int(p["block_table"])) == (page, box, width + 5, width + 2, b * width + 3, addr(table))
    assert int(p["q"]) == addr(q) and int(p["mask"]["kv_lengths"]) == addr(lengths)
    assert (int(p["seqlen_k"]), int(p["batch"]), int(p["mask"]["total_k"])) == (page * (width + 2), b, page * (width + 2))
    assert int(p["o"]) == addr(out) and out.shape == q.shape
    assert p["map_k"].tobytes() == _tma.kv_map(addr(kc), kc.shape, elem_strides(kc), box, "float16", ilv=ilv)
    assert p["map_v"].tobytes() == _tma.kv_map(addr(vc), vc.shape, elem_strides(vc), 16 if ilv else box, "float16",
                                               panels=hd // 64 if ilv else 1)
    assert not ad.copies, "nothing copied"


@pytest.mark.parametrize("mode", ["rule", "0"])
def test_kvcache_paged_short_chunk_small_boxes(dev, monkeypatch, mode):
    """A paged chunk with fewer rows a kv head than the gather route takes (64 positions x GQA 4 = 256 <
    _config.KVCACHE_PAGED_FORWARD_MIN_ROWS; batch 6 x 16 query heads: a share of 0.36, the contiguous
    rule's forward) on 16-row pages: the forward reads the pages in place with 16-row boxes all the same
    (_config.paged_direct's small_ok: there is no gather to fall back on), after the append kernel.
    CUFLASH_PAGED_DIRECT=0: the decode kernels (no gather either)."""
    from cuflash import _kvcache

    _kvcache_route(monkeypatch, "rule")
    _paged_direct_mode(monkeypatch, mode)
    assert 64 * 4 < _config.KVCACHE_PAGED_FORWARD_MIN_ROWS
    ad, launched = dev
    rng = np.random.default_rng()
    b, sq, h, hk, page, width = 6, 64, 16, 4, 16, 32
    q = arr(rng, (b, sq, h, 128))
    kc, vc = arr(rng, (b * width, page, hk, 128)), arr(rng, (b * width, page, hk, 128))
    table = rng.permutation(b * width).astype(np.int32).reshape(b, width).view(Dev)
    seqlens = np.full(b, 100, np.int32).view(Dev)
    k, v = arr(rng, (b, sq, hk, 128)), arr(rng, (b, sq, hk, 128))
    n0 = len(launched)
    cuflash.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens, block_table=table, causal=True)
    names = [L["name"] for L in launched[n0:]]
    assert "paged_gather" not in names, names
    if mode == "0":
        assert not _kvcache._CHUNK_PLANS or not any(p.direct for p in _kvcache._CHUNK_PLANS.values())
        assert any(n.startswith("decode_") and n != "decode_append" for n in names), names
        return
    assert names == ["decode_append", "fwd90ws_f16_d128_m128_n128_s2_feat_pp_paged_ilv"], names
    assert int(launched[-1]["p"]["page_box"]) == 16 and int(launched[-1]["p"]["page_size"]) == 16


def test_kvcache_decode_layout_checks(dev, monkeypatch):
    """The decode plan reads q through a copy when the kernels cannot read it in place (here a strided
    last dimension), but never copies a cache (it is written in place): a cache the kernels cannot read
    in place is a ValueError naming it, raised before anything runs or is written."""
    from cuflash import _kvcache

    monkeypatch.setattr(_kvcache, "_sm_count", lambda device_id: 132)
    ad, launched = dev
    rng = np.random.default_rng()
    q_big = arr(rng, (2, 1, 8, 128))
    q = q_big[..., ::2]  # head_dim 64 with element stride 2
    kc, vc = arr(rng, (2, 64, 2, 64)), arr(rng, (2, 64, 2, 64))
    seqlens = np.array([3, 9], np.int32).view(Dev)
    cuflash.attention_with_kvcache(q, kc, vc, cache_seqlens=seqlens, causal=True)
    (L,) = [L for L in launched if L["name"].startswith("decode_f16")]
    assert ad.copies and int(L["p"]["q"]) == addr(ad.copies[-1]), "q read through its copy"
    assert int(L["p"]["k"]) == addr(kc)
    launched.clear()
    odd = arr(rng, (2, 64, 2, 68))[..., :64]  # heads 68 elements apart: not 16-byte aligned strides
    before = np.array(odd, copy=True)
    kn = arr(rng, (2, 1, 2, 64))
    with pytest.raises(ValueError, match="^k_cache: expected a cache the GPU kernels can read in place"):
        cuflash.attention_with_kvcache(arr(rng, (2, 1, 8, 64)), odd, vc, kn, kn, seqlens, causal=True)
    assert not launched and np.array_equal(np.asarray(odd), before)


def test_kvcache_launch_failure_names_kernel_and_call(dev, monkeypatch):
    """A decode launch the driver refuses raises cuflash.LaunchError naming the kernel, its launch shape and
    the attention_with_kvcache call; the plan stays usable for the next call."""
    from cuflash import _kvcache

    monkeypatch.setattr(_kvcache, "_sm_count", lambda device_id: 132)
    monkeypatch.setenv("CUFLASH_DECODE_FUSED_COMBINE", "0")  # the combine kernel's path
    monkeypatch.setenv("CUFLASH_DECODE_CLUSTER", "0")  # the paths without the cluster merge
    ad, launched = dev
    rng = np.random.default_rng()
    q, kc, vc = arr(rng, (2, 1, 8, 64)), arr(rng, (2, 64, 2, 64)), arr(rng, (2, 64, 2, 64))
    seqlens = np.array([3, 9], np.int32).view(Dev)
    cuflash.attention_with_kvcache(q, kc, vc, cache_seqlens=seqlens, num_splits=3)
    ex = _launch._launch_ex
    record = _refuse_launches(monkeypatch)
    with pytest.raises(cuflash.LaunchError, match=r"launching decode_f16_d64_s4 failed \(grid 12, 128 threads.*"
                                                  r"attention_with_kvcache float16 q \(2, 1, 8, 64\), cache capacity "
                                                  r"64, paged=False, num_splits 3.*LAUNCH_OUT_OF_RESOURCES"):
        cuflash.attention_with_kvcache(q, kc, vc, cache_seqlens=seqlens, num_splits=3)
    monkeypatch.setattr(_launch, "_launch_kernel", record)
    monkeypatch.setattr(_launch, "_launch_ex", ex)
    n = len(launched)
    cuflash.attention_with_kvcache(q, kc, vc, cache_seqlens=seqlens, num_splits=3)
    assert len(launched) == n + 2  # decode and combine


def test_forward_causal_tail_heads(dev, monkeypatch):
    """FwdParams.tail_heads (blocks.cuh causal_block_order): causal calls, plain or with options whose
    window is (left, 0), end on about FWD_CAUSAL_TAIL_WAVES waves of blocks taken query block by
    query block (waves * SMs * blocks an SM, in whole (batch, head)s); CUFLASH_FWD_TAIL_BLOCKS sets the
    blocks (0: off); non-causal calls, other windows and one-block heads keep 0."""
    from cuflash import _config

    ad, launched = dev
    rng = np.random.default_rng()
    monkeypatch.delenv("CUFLASH_FWD_TAIL_BLOCKS", raising=False)
    monkeypatch.delenv("CUFLASH_FWD_TAIL_WAVES", raising=False)

    def tail_of(**kw):
        _plan.CACHE.clear()
        q, k, v = arr(rng, (8, 1000, 32, 64)), arr(rng, (8, 1000, 2, 64)), arr(rng, (8, 1000, 2, 64))
        cuflash.attention(q, k, v, **kw)
        L = launched[-1]
        return int(L["p"]["tail_heads"]), int(L["p"]["num_m_blocks"]), L

    for kw in ({"causal": True}, {"window": (64, 0)}, {"window": (-1, 0), "softcap": 30.0}):
        tail, num_m, L = tail_of(**kw)
        # The stand-in kernel has no register count: threads and shared memory decide the blocks an SM.
        per_sm = max(1, min(2048 // L["threads"], 228 * 1024 // (L["smem"] + 1024), 32))
        want = -(-int(_config.FWD_CAUSAL_TAIL_WAVES * 132 * per_sm) // num_m)
        assert num_m >= 8 and tail == want and 0 < tail < 8 * 32, (kw, tail, want, per_sm, L["name"])
        assert ("feat" in L["name"]) == ("window" in kw), L["name"]
    assert tail_of(causal=False)[0] == 0
    assert tail_of(window=(64, 64))[0] == 0
    monkeypatch.setenv("CUFLASH_FWD_TAIL_BLOCKS", "20")
    assert tail_of(causal=True)[0] == 3
    monkeypatch.setenv("CUFLASH_FWD_TAIL_BLOCKS", "0")
    assert tail_of(causal=True)[0] == 0
    monkeypatch.setenv("CUFLASH_FWD_TAIL_BLOCKS", "100000")
    assert tail_of(causal=True)[0] == 8 * 32
    _plan.CACHE.clear()
    q, k, v = arr(rng, (4, 100, 8, 64)), arr(rng, (4, 100, 2, 64)), arr(rng, (4, 100, 2, 64))
    cuflash.attention(q, k, v, causal=True)
    assert int(launched[-1]["p"]["num_m_blocks"]) == 1 and int(launched[-1]["p"]["tail_heads"]) == 0


def test_head_dim_64_tma_tiles_keep_their_blocks_per_sm():
    """The sm_90a forward's head_dim 64 tiles (the TMA variant, flash_fwd_sm90.cu) fit as many blocks
    per SM as their registers allow (ptxas, NVRTC 13.0: 64 x 128 163 registers -> three blocks of
    128 threads; 64 x 64 115 -> four). The 2 KB of ones rows that make lp columns of P V hold the
    TMA barriers in their unread bytes for this: with the barriers after them, 64 x 128 would fit
    only two (bench/NOTES.md, session 25)."""
    from cuflash import _config

    per_sm, reserved = 233472, 1024  # an H100's / H200's shared memory per SM; 1 KB a block for the system
    wide = _config.FWD_TMA_CAUSAL_WIDE_SEQLEN_K
    for causal, sk, want in ((False, None, 3), (True, None, 4), (True, wide - 1, 4), (True, wide, 3)):
        cfg = _config.fwd_tma_config_for_target("sm_90a", 64, "bfloat16", causal, sk)
        smem = _config.fwd_smem_bytes(64, cfg) + _config.fwd_tma_bar_bytes(64)
        assert per_sm // (smem + reserved) >= want, (causal, cfg, smem)


def test_head_dim_64_tma_tile_override(monkeypatch):
    """CUFLASH_FWD_TMA_TILE (tuning runs, session 27) replaces head_dim 64's TMA tiles, with one warp
    per 16 query rows, and touches no other head_dim; unset, the table's 64 x 128 / 64 x 64 stand (causal:
    64 x 128 from FWD_TMA_CAUSAL_WIDE_SEQLEN_K keys)."""
    from cuflash import _config

    tiles = lambda c: (c.block_m, c.block_n, c.warps)  # noqa: E731
    assert tiles(_config.fwd_tma_config_for_target("sm_90a", 64, "bfloat16", False)) == (64, 128, 4)
    assert tiles(_config.fwd_tma_config_for_target("sm_90a", 64, "bfloat16", True)) == (64, 64, 4)
    wide = _config.FWD_TMA_CAUSAL_WIDE_SEQLEN_K  # causal 64 x 128 from here on
    assert tiles(_config.fwd_tma_config_for_target("sm_90a", 64, "bfloat16", True, wide - 1)) == (64, 64, 4)
    assert tiles(_config.fwd_tma_config_for_target("sm_90a", 64, "bfloat16", True, wide)) == (64, 128, 4)
    assert tiles(_config.fwd_tma_config_for_target("sm_90a", 64, "bfloat16", False, 512)) == (64, 128, 4)
    monkeypatch.setenv("CUFLASH_FWD_TMA_TILE", "128x64")
    for causal, sk in ((False, None), (True, None), (True, wide)):
        cfg = _config.fwd_tma_config_for_target("sm_90a", 64, "float16", causal, sk)
        assert (cfg.block_m, cfg.block_n, cfg.warps, cfg.wgmma) == (128, 64, 8, True)
    assert _config.fwd_tma_config_for_target("sm_90a", 128, "bfloat16", False) == \
        _config.fwd_config_for_target("sm_90a", 128, "bfloat16", False)
    for bad in ("128", "96x64", "128x"):
        monkeypatch.setenv("CUFLASH_FWD_TMA_TILE", bad)
        with pytest.raises(ValueError, match="CUFLASH_FWD_TMA_TILE"):
            _config.fwd_tma_config_for_target("sm_90a", 64, "bfloat16", False)
