"""Tensor maps for Hopper's TMA copies (cuda_src/tma.cuh): step 1 of docs/hopper_plan.md.

A tensor map is 128 opaque bytes that the driver's cuTensorMapEncodeTiled builds from a tensor's
address, shape and strides, the box one copy moves, and the shared-memory swizzle. A kernel gets it
by value inside its Params (a `TmaDesc` field, 64-byte aligned). It depends on the pointer, so a
plan keeps maps per pointer (`MapCache`) and a call with a new pointer pays one encode.

The driver function is called through ctypes on libcuda (no new dependency): the driver library is
on every machine that has a GPU, and this module is only used where there is one.

`kv_map` describes a (batch, seqlen, heads, head_dim) tensor of 16-bit elements as the 4-D
(head_dim, seqlen, heads, batch) with a {64, rows, 1, 1} box and the 128-byte swizzle: one copy
fills one SW128 panel (cuda_src/wgmma_util.cuh) of `rows` rows, rows past the tensor's end as zeros.
Nothing in cuflash's default paths uses it yet: cuda_src/tma_probe.cu checks it on the GPU
(tests/test_tma_gpu.py, bench/dev/tma_probe.py).
"""

from __future__ import annotations

import ctypes
import functools
import threading

import numpy as np

# cuda.h's enums (CUDA 12 and 13 agree).
DTYPE_UINT16 = 1
DTYPE_FLOAT16 = 6
DTYPE_BFLOAT16 = 9
INTERLEAVE_NONE = 0
SWIZZLE_128B = 3
L2_PROMOTION_128B = 2
OOB_FILL_ZEROS = 0  # CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE: elements outside the tensor arrive as zeros

MAP_BYTES = 128
SWIZZLE_BYTES = 128  # the inner box dimension of a 128-byte-swizzled map is at most this many bytes
_DTYPES = {"float16": DTYPE_FLOAT16, "bfloat16": DTYPE_BFLOAT16, "uint16": DTYPE_UINT16}

_encode_fn = None
_encode_lock = threading.Lock()


class TmaError(RuntimeError):
    """The driver refused a tensor map (its CUresult and the arguments are in the message)."""


class TmaNoContext(TmaError):
    """cuTensorMapEncodeTiled returned CUDA_ERROR_INVALID_CONTEXT: the calling thread has no current
    CUDA context (a thread the process made itself, such as the autograd engine's). A fact about the
    thread, not about the layout: ensure_context first."""


CUDA_ERROR_INVALID_CONTEXT = 201


def _driver_encode():
    """cuTensorMapEncodeTiled from libcuda, with its argument types."""
    global _encode_fn
    with _encode_lock:
        if _encode_fn is None:
            lib = ctypes.CDLL("libcuda.so.1")
            fn = lib.cuTensorMapEncodeTiled
            u32p, u64p = ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint64)
            fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p, u64p, u32p, u32p,
                           ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
            fn.restype = ctypes.c_int
            _encode_fn = fn
    return _encode_fn


def available() -> bool:
    """Whether the driver's encode function can be loaded (False on a machine without libcuda)."""
    try:
        _driver_encode()
    except (OSError, AttributeError):
        return False
    return True


def encode_tiled(ptr: int, dtype: str, dims, strides_bytes, box, swizzle: int = SWIZZLE_128B,
                 l2: int = L2_PROMOTION_128B, oob: int = OOB_FILL_ZEROS) -> bytes:
    """The 128 bytes of a tiled tensor map. dims: innermost first; strides_bytes: of dims[1:], in
    bytes; box: elements per copy along each dim. The documented limits are checked here so that a
    bad map is a ValueError naming them, not a driver error code."""
    rank = len(dims)
    if not 1 <= rank <= 5 or len(strides_bytes) != rank - 1 or len(box) != rank:
        raise ValueError(f"tensor map: expected rank 1..5 with rank - 1 strides and rank box sizes; got dims {dims}, "
                         f"strides {strides_bytes}, box {box}")
    if ptr % 16:
        raise ValueError(f"tensor map: expected a 16-byte aligned address; got {ptr:#x}")
    if any(not 1 <= d <= 2**32 for d in dims):
        raise ValueError(f"tensor map: expected sizes in [1, 2^32]; got {dims}")
    if any(s % 16 or not 0 < s < 2**40 for s in strides_bytes):
        raise ValueError(f"tensor map: expected strides that are positive multiples of 16 bytes below 2^40; got "
                         f"{strides_bytes}")
    if any(not 1 <= b <= 256 for b in box):
        raise ValueError(f"tensor map: expected box sizes in [1, 256]; got {box}")
    elem = 2
    if (box[0] * elem) % 16 or (swizzle == SWIZZLE_128B and box[0] * elem > SWIZZLE_BYTES):
        raise ValueError(f"tensor map: the inner box must be a multiple of 16 bytes and, with the 128-byte swizzle, "
                         f"at most 128 bytes; got {box[0]} elements of {elem} bytes")
    out = (ctypes.c_uint64 * 16)()
    dims_a = (ctypes.c_uint64 * rank)(*dims)
    strides_a = (ctypes.c_uint64 * max(1, rank - 1))(*strides_bytes)
    box_a = (ctypes.c_uint32 * rank)(*box)
    ones = (ctypes.c_uint32 * rank)(*([1] * rank))
    res = _driver_encode()(ctypes.addressof(out), _DTYPES[dtype], rank, ctypes.c_void_p(ptr), dims_a, strides_a,
                           box_a, ones, INTERLEAVE_NONE, swizzle, l2, oob)
    if res != 0:
        err = TmaNoContext if res == CUDA_ERROR_INVALID_CONTEXT else TmaError
        raise err(f"cuTensorMapEncodeTiled returned CUresult {res} for {dtype} at {ptr:#x}, dims {tuple(dims)}, "
                  f"strides {tuple(strides_bytes)} bytes, box {tuple(box)}, swizzle {swizzle}")
    return bytes(out)


@functools.lru_cache(maxsize=1)
def _libcuda():
    """The driver library (None without one)."""
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


def ensure_context(device_id: int) -> None:
    """Makes device_id's primary context current in the calling thread if the thread has none. Plans
    are made where a call first arrives, and a backward's first call arrives on the autograd engine's
    thread, which may have no current context: there the driver refuses every tensor map (CUresult
    201), and a layout found unpatchable that way would have kept the TMA kernels off for the
    process. Costs two driver calls; made once per plan, never per call."""
    lib = _libcuda()
    if lib is None:
        return
    ctx = ctypes.c_void_p()
    if lib.cuCtxGetCurrent(ctypes.byref(ctx)) == 0 and ctx.value:
        return
    dev = ctypes.c_int()
    if lib.cuDeviceGet(ctypes.byref(dev), ctypes.c_int(device_id)) != 0:
        return
    if lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0:  # the runtime's context, already alive
        lib.cuCtxSetCurrent(ctx)


def kv_map_args(ptr: int, shape, strides, rows: int, dtype: str, panels: int = 1, ilv: bool = False,
                box_heads: int = 1):
    """(dims, strides in bytes, box) of `kv_map`'s encode: a (batch, seqlen, heads, head_dim) tensor
    with element strides (batch, row, head, 1) as 4-D (head_dim, seqlen, heads, batch), box {64, rows,
    1, 1}. head_dim must be a multiple of 8; a kernel copies one 64-column panel at a time, and where
    head_dim is not a multiple of 64 (head_dim pad-up) the columns past it arrive as zeros.
    panels > 1 (head_dim = 64 * panels): 5-D (64, seqlen, panels, heads, batch), box {64, rows,
    panels, 1, 1}: one copy fills the `panels` SW128 panels of `rows` rows, one after another (the
    paged decode's 16-key groups, cuda_src/flash_decode.cu).
    ilv (a paged cache (num_pages, page_size, heads, head_dim) whose pages follow one another, batch
    stride = page_size x row stride; head_dim a multiple of 64, rows of 8): 5-D (64, 8, head_dim / 64,
    num_pages * page_size / 8, heads), box {64, 8, head_dim / 64, rows / 8, 1}, the rows numbered
    across the pages in 8-row groups: one copy fills `rows` whole rows with each 8-row group's panels
    together (the interleaved layout of the paged forward, cuda_src/flash_fwd_sm90_ws.cu ILV); the
    coordinate of page p's row r is (0, 0, 0, (p * page_size + r) / 8, head).
    box_heads > 1 (the 4-D layout only): box {64, rows, box_heads, 1}, that many adjacent heads' rows one after
    another (the decode kernel's blocks of several kv heads, cuda_src/flash_decode.cu Heads)."""
    batch, seqlen, heads, head_dim = shape
    bs, rs, hs, es = strides
    if es != 1:
        raise ValueError(f"tensor map: expected a unit-stride last dimension; got strides {tuple(strides)}")
    if head_dim % 8:
        raise ValueError(f"tensor map: expected head_dim a multiple of 8 (rows of whole 16-byte chunks; a "
                         f"kernel's columns past it read as zeros); got {head_dim}")
    if dtype not in _DTYPES:
        raise ValueError(f"tensor map: expected a 16-bit dtype {sorted(_DTYPES)}; got {dtype}")
    if box_heads != 1 and (ilv or panels > 1 or not 1 <= box_heads <= min(heads, 256)):
        raise ValueError(f"tensor map: a box of {box_heads} heads needs the 4-D layout and at most the tensor's "
                         f"{heads} heads; got panels {panels}, ilv {ilv}")
    if ilv:
        if head_dim % 64 or rows % 8 or seqlen % 8 or bs != seqlen * rs:
            raise ValueError(f"tensor map: the interleaved layout needs head_dim a multiple of 64, rows and the "
                             f"page a multiple of 8, pages one after another (batch stride page_size x row "
                             f"stride); got shape {tuple(shape)}, strides {tuple(strides)}, rows {rows}")
        p = head_dim // 64
        return (64, 8, p, batch * seqlen // 8, heads), (2 * rs, 128, 16 * rs, 2 * hs), (64, 8, p, rows // 8, 1)
    if panels > 1:
        if head_dim != 64 * panels:
            raise ValueError(f"tensor map: expected head_dim {64 * panels} for {panels} panels in one box; got "
                             f"{head_dim}")
        return (64, seqlen, panels, heads, batch), (2 * rs, 128, 2 * hs, 2 * bs), (64, rows, panels, 1, 1)
    return (head_dim, seqlen, heads, batch), (2 * rs, 2 * hs, 2 * bs), (64, rows, box_heads, 1)


def kv_map(ptr: int, shape, strides, rows: int, dtype: str, panels: int = 1, ilv: bool = False,
           box_heads: int = 1) -> bytes:
    """The tensor map of a K- or V-like tensor for panel-wise TMA loads (see the module docstring)."""
    dims, strides_bytes, box = kv_map_args(ptr, shape, strides, rows, dtype, panels, ilv, box_heads)
    return encode_tiled(ptr, dtype, dims, strides_bytes, box)


# ---- one word per call: the pointer patched into a map learned once per layout ----
#
# A map's 128 bytes are opaque, but for a fixed layout they depend on the address alone, and an
# encode costs ~15 µs through ctypes (H100 host, bench/dev/tma_probe.py): too much for every eager
# call with new tensors. So each layout's dependence on the address is *learned* from the driver, and
# taken only if it is the simplest one: every byte that changes with the address lies in one 8-byte
# word, and that word equals (constant + (address >> shift)) for shift 0 or 4, modulo 2^64. The rule
# is then checked against the driver at pointers that set low, middle and high address bits; any
# miss (a driver that stores the address another way, or refuses the probe pointers) leaves the
# layout on the encode-per-new-pointer path. So a wrong guess costs speed, never a wrong map.

_PROBE_PTRS = (0x7F1234560000, 0x300000001230, 0x10, 0x7FFFFFFFFFF0, 0x7F1234560010, 0x1000000000)
_MASK64 = 2**64 - 1
_patches: dict = {}
_patches_lock = threading.Lock()


class MapPatch:
    """How one layout's map depends on the address: `template` (a map's 16 words) with word `word`
    replaced by (const + (address >> shift)) mod 2^64."""

    __slots__ = ("template", "word", "const", "shift")

    def __init__(self, template, word: int, const: int, shift: int):
        self.template, self.word, self.const, self.shift = template, word, const, shift

    def word_value(self, ptr: int) -> int:
        return (self.const + (ptr >> self.shift)) & _MASK64

    def map(self, ptr: int) -> bytes:
        words = np.frombuffer(self.template, dtype=np.uint64).copy()
        words[self.word] = self.word_value(ptr)
        return words.tobytes()


def learn_patch(encode) -> MapPatch | None:
    """The MapPatch of the layout that `encode(ptr) -> 128 bytes` describes, or None if its maps do
    not follow the one-word rule (see above) at every probe pointer."""
    try:
        maps = [np.frombuffer(encode(ptr), dtype=np.uint64) for ptr in _PROBE_PTRS]
    except TmaNoContext:
        raise  # not the layout's fault: layout_patch must not remember it
    except (TmaError, ValueError):
        return None
    a, pa = maps[0], _PROBE_PTRS[0]
    differ = sorted({int(i) for m in maps[1:] for i in np.nonzero(m != a)[0]})
    if len(differ) != 1:
        return None
    w = differ[0]
    for shift in (0, 4):
        const = (int(a[w]) - (pa >> shift)) & _MASK64
        patch = MapPatch(a.tobytes(), w, const, shift)
        if all(patch.map(ptr) == m.tobytes() for ptr, m in zip(_PROBE_PTRS, maps)):
            return patch
    return None


def layout_patch(shape, strides, rows: int, dtype: str, panels: int = 1, ilv: bool = False,
                 box_heads: int = 1) -> MapPatch | None:
    """learn_patch for kv_map's layout, learned once per process and layout."""
    key = (tuple(shape), tuple(strides), rows, dtype, panels, ilv, box_heads)
    with _patches_lock:
        if key in _patches:
            return _patches[key]
    dims, strides_bytes, box = kv_map_args(16, shape, strides, rows, dtype, panels, ilv, box_heads)
    try:
        patch = learn_patch(lambda ptr: encode_tiled(ptr, dtype, dims, strides_bytes, box))
    except TmaNoContext:
        return None  # this call goes without; the layout is learned where a context is current
    with _patches_lock:
        _patches[key] = patch
    return patch


class MapCache:
    """Tensor maps of one plan, by pointer: equal shapes and strides are the plan's, so the pointer is
    the key. Where the layout's MapPatch is known (`patch`), a map is the template with one word set;
    otherwise each new pointer costs an encode, and the cache keeps the most recent `size` maps (a
    training loop's activations come with ever new pointers)."""

    def __init__(self, shape, strides, rows: int, dtype: str, size: int = 8, panels: int = 1, ilv: bool = False,
                 box_heads: int = 1):
        self.shape, self.strides, self.rows, self.dtype, self.size = tuple(shape), tuple(strides), rows, dtype, size
        self.panels, self.ilv, self.box_heads = panels, ilv, box_heads
        # (the layout's errors now, not at the first call)
        kv_map_args(16, shape, strides, rows, dtype, panels, ilv, box_heads)
        self.patch = layout_patch(shape, strides, rows, dtype, panels, ilv, box_heads)
        self._maps: dict[int, bytes] = {}

    def get(self, ptr: int) -> bytes:
        if self.patch is not None:
            return self.patch.map(ptr)
        m = self._maps.get(ptr)
        if m is None:
            m = kv_map(ptr, self.shape, self.strides, self.rows, self.dtype, self.panels, self.ilv, self.box_heads)
            if len(self._maps) >= self.size:
                self._maps.pop(next(iter(self._maps)))
            self._maps[ptr] = m
        return m


# ---- the probe kernel (cuda_src/tma_probe.cu) ----

# Mirror of cuflash::TmaProbeParams: the map at offset 0, the struct 64-byte aligned.
PROBE_PARAMS = np.dtype({"names": ["map", "out", "row0", "head", "batch"],
                         "formats": [np.dtype((np.uint8, MAP_BYTES)), np.uint64, np.int32, np.int32, np.int32],
                         "offsets": [0, 128, 136, 140, 144], "itemsize": 192})


def probe_specialization(rows: int, panels: int):
    from . import _compile

    checks = _compile.params_layout_checks("cuflash", "TmaProbeParams", PROBE_PARAMS)
    return _compile.Specialization("tma_probe.cu", f"cuflash::tma_probe_kernel<{rows}, {panels}>",
                                   f"tma_probe_r{rows}_p{panels}", checks)


PROBE_SHAPES = ((64, 1), (128, 2), (128, 4))  # (rows, panels): head_dim 64, 128, 256 tiles


def all_probe_specializations(target: str) -> list:
    """(spec, dynamic smem) of every probe shape: sm_90a only (TMA is Hopper's)."""
    if not target.startswith("sm_90"):
        return []
    return [(probe_specialization(r, c), probe_smem_bytes(r, c)) for r, c in PROBE_SHAPES]


def probe_smem_bytes(rows: int, panels: int) -> int:
    """Dynamic shared memory of the probe: the tile plus 1024 bytes to align it to 1024."""
    return rows * panels * 128 + 1024


def expected_tile(x: np.ndarray, row0: int, rows: int, head: int, batch: int) -> np.ndarray:
    """The bytes the probe must write for one tile: rows [row0, row0 + rows) of x[batch, :, head, :]
    (zeros past the end) in the SW128 panel layout (cuda_src/wgmma_util.cuh: chunk k of row r at
    chunk k ^ (r % 8), panels of 64 columns one after the other)."""
    seqlen, head_dim = x.shape[1], x.shape[3]
    tile = np.zeros((rows, head_dim), dtype=np.uint16)
    lo, hi = max(row0, 0), min(row0 + rows, seqlen)
    if hi > lo:
        tile[lo - row0:hi - row0] = x[batch, lo:hi, head, :].view(np.uint16)
    out = np.zeros((head_dim // 64, rows, 8, 8), dtype=np.uint16)  # (panel, row, chunk slot, element)
    for r in range(rows):
        for k in range(head_dim // 8):
            out[k // 8, r, (k % 8) ^ (r % 8)] = tile[r, 8 * k:8 * k + 8]
    return out.reshape(-1).view(np.uint8)
