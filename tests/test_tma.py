"""cuflash/_tma.py on the CPU: the tensor-map arguments for a K/V-like tensor, the checks made before
the driver is called, the per-pointer cache, and the reference SW128 layout the GPU probe is compared
with (tests/test_tma_gpu.py runs the probe). The driver function is replaced by a recorder here (no
libcuda on a machine without a GPU)."""

import ctypes

import numpy as np
import pytest

from cuflash import _tma


@pytest.fixture
def driver(monkeypatch):
    """A stand-in for cuTensorMapEncodeTiled: records its arguments, writes a recognizable map."""
    calls = []

    def encode(out, dtype, rank, ptr, dims, strides, box, elem_strides, interleave, swizzle, l2, oob):
        calls.append(dict(dtype=dtype, rank=rank, ptr=ptr.value, dims=list(dims[:rank]),
                          strides=list(strides[:rank - 1]), box=list(box[:rank]),
                          elem_strides=list(elem_strides[:rank]), interleave=interleave, swizzle=swizzle,
                          l2=l2, oob=oob))
        buf = (ctypes.c_uint64 * 16).from_address(out)
        for i in range(16):
            buf[i] = (ptr.value + i) & (2**64 - 1)
        return 0

    monkeypatch.setattr(_tma, "_driver_encode", lambda: encode)
    monkeypatch.setattr(_tma, "_patches", {})
    return calls


def linear_driver(monkeypatch, store):
    """A stand-in driver whose map is fixed words that depend on the layout, and word 3 replaced by
    store(address, old word 3); returns the list of encoded pointers."""
    ptrs = []

    def encode(out, dtype, rank, ptr, dims, strides, box, elem_strides, interleave, swizzle, l2, oob):
        ptrs.append(ptr.value)
        buf = (ctypes.c_uint64 * 16).from_address(out)
        for i in range(16):
            buf[i] = (0x9E3779B97F4A7C15 * (i + 1) + dims[1] * 1000 + box[1]) & (2**64 - 1)
        buf[3] = store(ptr.value, buf[3]) & (2**64 - 1)
        return 0

    monkeypatch.setattr(_tma, "_driver_encode", lambda: encode)
    monkeypatch.setattr(_tma, "_patches", {})
    return ptrs


LAYOUT = ((2, 300, 3, 128), (300 * 384, 384, 128, 1), 128, "bfloat16")


@pytest.mark.parametrize("store", [
    lambda a, w: a,                                # the address itself
    lambda a, w: (a >> 4) | (0x5A << 56),          # in 16-byte units, flags in the top byte
    lambda a, w: (w & ~(2**60 - 1)) + (a >> 4),    # added onto the layout's own bits
])
def test_patch_is_learned_and_equals_the_driver_everywhere(monkeypatch, store):
    """The one-word rule: learned from the driver, then a map per pointer is the template with one
    word set, equal to the driver's map at pointers it was not learned from; no encode per call."""
    ptrs = linear_driver(monkeypatch, store)
    cache = _tma.MapCache(*LAYOUT)
    assert cache.patch is not None and cache.patch.word == 3
    learned = len(ptrs)
    rng = np.random.default_rng()
    tests = [int(x) * 16 for x in rng.integers(1, 2**43, size=20)]
    got = [cache.get(p) for p in tests]
    assert len(ptrs) == learned, "a patched cache called the driver"
    want = [_tma.kv_map(p, *LAYOUT) for p in tests]
    assert got == want
    assert _tma.MapCache(*LAYOUT).patch is cache.patch and len(ptrs) == learned + len(tests), "relearned"


@pytest.mark.parametrize("store", [
    lambda a, w: a ^ (a >> 7),                     # not (const + address >> shift)
    lambda a, w: (a * 3) >> 4,
    "two words",
    "refused",
])
def test_patch_refused_when_the_rule_fails(monkeypatch, store):
    """A driver that stores the address any other way, or refuses a probe pointer, leaves the layout
    on encode-per-pointer, with the driver's own maps."""
    if store == "two words":
        ptrs = linear_driver(monkeypatch, lambda a, w: a)
        inner = _tma._driver_encode()

        def encode(out, *args):
            inner(out, *args)
            buf = (ctypes.c_uint64 * 16).from_address(out)
            buf[5] = args[2].value >> 32
            return 0

        monkeypatch.setattr(_tma, "_driver_encode", lambda: encode)
    elif store == "refused":
        ptrs = linear_driver(monkeypatch, lambda a, w: a)
        inner = _tma._driver_encode()
        monkeypatch.setattr(_tma, "_driver_encode",
                            lambda: (lambda out, *a: 1 if a[2].value == 0x10 else inner(out, *a)))
    else:
        ptrs = linear_driver(monkeypatch, store)
    cache = _tma.MapCache(*LAYOUT)
    assert cache.patch is None
    n = len(ptrs)
    m = cache.get(0x7F0000001230)
    assert len(ptrs) == n + 1 and m == _tma.kv_map(0x7F0000001230, *LAYOUT)


def test_no_context_is_not_remembered_as_the_layouts_fault(monkeypatch):
    """A thread with no current CUDA context (the autograd engine's, where a backward's plan is made)
    gets CUresult 201 for every map: layout_patch answers None for that call but must not remember
    it, or the layout would stay unpatched, and its TMA kernels off, for the rest of the process."""
    linear_driver(monkeypatch, lambda a, w: a)
    inner = _tma._driver_encode()
    ctx = {"current": False}
    monkeypatch.setattr(_tma, "_driver_encode",
                        lambda: (lambda out, *a: inner(out, *a) if ctx["current"] else _tma.CUDA_ERROR_INVALID_CONTEXT))
    with pytest.raises(_tma.TmaNoContext, match="CUresult 201"):
        _tma.kv_map(0x7F0000001230, *LAYOUT)
    assert _tma.layout_patch(*LAYOUT) is None
    assert not _tma._patches, "a thread's missing context was cached as the layout's verdict"
    ctx["current"] = True
    patch = _tma.layout_patch(*LAYOUT)
    assert patch is not None and patch.map(0x7F0000001230) == _tma.kv_map(0x7F0000001230, *LAYOUT)


def test_kv_map_describes_the_tensor_as_4d(driver):
    # (batch 2, seqlen 300, heads 3, head_dim 128), rows of 3 heads: element strides (300*384, 384, 128, 1)
    m = _tma.kv_map(0x10000, (2, 300, 3, 128), (300 * 384, 384, 128, 1), 128, "bfloat16")
    assert len(m) == 128 and np.frombuffer(m, np.uint64)[0] == 0x10000
    (c,) = driver
    assert c["rank"] == 4 and c["dtype"] == _tma.DTYPE_BFLOAT16 and c["ptr"] == 0x10000
    assert c["dims"] == [128, 300, 3, 2]
    assert c["strides"] == [2 * 384, 2 * 128, 2 * 300 * 384]
    assert c["box"] == [64, 128, 1, 1] and c["elem_strides"] == [1, 1, 1, 1]
    assert (c["swizzle"], c["oob"], c["interleave"]) == (_tma.SWIZZLE_128B, _tma.OOB_FILL_ZEROS, 0)


def test_kv_map_two_panels_in_one_box(driver):
    # panels=2 (the paged decode's 16-key groups at head_dim 128): 5-D (64, seqlen, 2 panels, heads,
    # batch), the panel dimension 128 bytes apart, box {64, rows, 2, 1, 1}; head_dim must be 128.
    m = _tma.kv_map(0x10000, (5, 16, 3, 128), (16 * 384, 384, 128, 1), 16, "float16", panels=2)
    assert len(m) == 128
    (c,) = driver
    assert c["rank"] == 5 and c["dims"] == [64, 16, 2, 3, 5]
    assert c["strides"] == [2 * 384, 128, 2 * 128, 2 * 16 * 384]
    assert c["box"] == [64, 16, 2, 1, 1] and c["swizzle"] == _tma.SWIZZLE_128B
    with pytest.raises(ValueError, match="head_dim 128 for 2 panels"):
        _tma.kv_map(0x10000, (5, 16, 3, 64), (16 * 192, 192, 64, 1), 16, "float16", panels=2)
    assert len(driver) == 1


@pytest.mark.parametrize("shape, strides, dtype, match", [
    ((2, 64, 4, 100), (64 * 400, 400, 100, 1), "float16", "head_dim a multiple of 8"),
    ((2, 64, 4, 64), (64 * 512, 512, 128, 2), "float16", "unit-stride last dimension"),
    ((2, 64, 4, 64), (64 * 256, 256, 64, 1), "float32", "16-bit dtype"),
])
def test_kv_map_layout_errors(driver, shape, strides, dtype, match):
    with pytest.raises(ValueError, match=match):
        _tma.kv_map(0x10000, shape, strides, 64, dtype)
    assert driver == [], "the driver was called with a layout it cannot take"


@pytest.mark.parametrize("kw, match", [
    (dict(ptr=0x10008), "16-byte aligned address"),
    (dict(strides=(136, 2048, 4096)), "multiples of 16 bytes"),  # a row of 68 elements
    (dict(box=(128, 64, 1, 1)), "at most 128 bytes"),            # 256 bytes: wider than the swizzle
    (dict(box=(64, 300, 1, 1)), "box sizes in"),
    (dict(dims=(64, 0, 1, 1)), "sizes in"),
])
def test_encode_checks_before_the_driver(driver, kw, match):
    args = dict(ptr=0x10000, dims=(64, 128, 2, 2), strides=(128, 128 * 128, 128 * 128 * 2), box=(64, 64, 1, 1))
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        _tma.encode_tiled(args["ptr"], "float16", args["dims"], args["strides"], args["box"])
    assert driver == []


def test_driver_refusal_is_an_error_naming_the_map(monkeypatch):
    monkeypatch.setattr(_tma, "_driver_encode", lambda: (lambda *a: 1))
    with pytest.raises(_tma.TmaError, match=r"CUresult 1 .*box \(64, 64, 1, 1\)"):
        _tma.encode_tiled(0x10000, "float16", (64, 128, 2, 2), (128, 16384, 32768), (64, 64, 1, 1))


def test_map_cache_encodes_once_per_pointer_and_stays_bounded(driver):
    # (this driver writes the address into every word: no patch, so one encode per new pointer)
    cache = _tma.MapCache((1, 256, 2, 64), (256 * 128, 128, 64, 1), 64, "float16", size=3)
    assert cache.patch is None
    del driver[:]
    a = cache.get(0x1000)
    assert cache.get(0x1000) is a and len(driver) == 1
    for p in (0x2000, 0x3000, 0x4000):
        cache.get(p)
    assert len(driver) == 4
    cache.get(0x1000)  # evicted by the fourth pointer: encoded again
    assert len(driver) == 5 and [c["ptr"] for c in driver][-1] == 0x1000
    with pytest.raises(ValueError, match="head_dim a multiple of 8"):
        _tma.MapCache((1, 256, 2, 76), (256 * 152, 152, 76, 1), 64, "float16")


def test_expected_tile_is_the_sw128_panel_layout():
    """The reference layout, against an independent element-wise formula: element (r, c) of the tile
    at byte panel * rows * 128 + r * 128 + (((c % 64) // 8) ^ (r % 8)) * 16 + (c % 8) * 2; rows past
    the tensor are zeros; x[batch, :, head] is the source."""
    rng = np.random.default_rng()
    for head_dim, rows, row0 in ((64, 64, 0), (128, 128, 100), (256, 128, -3)):
        x = rng.integers(1, 2**16, size=(2, 170, 3, head_dim), dtype=np.uint16)
        got = _tma.expected_tile(x, row0, rows, 2, 1)
        assert got.dtype == np.uint8 and got.size == rows * head_dim * 2
        want = np.zeros(rows * head_dim * 2, np.uint8)
        for r in range(rows):
            src = row0 + r
            if not 0 <= src < 170:
                continue
            for c in range(head_dim):
                off = (c // 64) * rows * 128 + r * 128 + (((c % 64) // 8) ^ (r % 8)) * 16 + (c % 8) * 2
                want[off:off + 2] = np.frombuffer(x[1, src, 2, c].tobytes(), np.uint8)
        assert np.array_equal(got, want), (head_dim, rows, row0)


def test_probe_params_mirror_the_c_struct():
    """TmaProbeParams: the 64-byte aligned map first, then out, row0, head, batch; 192 bytes (the size
    is also a static_assert in every compile of the probe, cuflash/_compile.params_layout_checks)."""
    d = _tma.PROBE_PARAMS
    assert d.itemsize == 192 and d.fields["map"][1] == 0 and d.fields["map"][0].itemsize == 128
    assert [d.fields[n][1] for n in ("out", "row0", "head", "batch")] == [128, 136, 140, 144]
    assert "static_assert(sizeof(TmaProbeParams) == 192" in _tma.probe_specialization(64, 1).checks
    assert _tma.all_probe_specializations("sm_80") == []
    assert [s.name for s, _ in _tma.all_probe_specializations("sm_90a")] == [
        "tma_probe_r64_p1", "tma_probe_r128_p2", "tma_probe_r128_p4"]
