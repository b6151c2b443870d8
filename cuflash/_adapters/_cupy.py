"""CuPy adapter: device pointers and strides straight from the arrays, outputs from CuPy's memory
pool, kernels on CuPy's current stream of the array's device."""

from __future__ import annotations

import cupy

from .._call import ArrayInfo
from ._base import Adapter

_get_stream = cupy.cuda.get_current_stream
_get_device = cupy.cuda.runtime.getDevice


def np_dtype(name: str):
    if name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return name


def _ptr(x) -> int:
    return x.data.ptr


class CupyAdapter(Adapter):
    lib = "cupy"
    ptr_fn = staticmethod(_ptr)

    def info(self, x) -> ArrayInfo:
        return ArrayInfo("cupy", tuple(x.shape), tuple(s // x.itemsize for s in x.strides), x.dtype.name,
                         ("cuda", x.device.id), x.data.ptr % 16 == 0, "cupy.ndarray")

    def sig(self, x) -> tuple:
        return (x.dtype, x.shape, x.strides, x.device.id, x.data.ptr & 15)

    def ptr(self, x, keep) -> int:
        return _ptr(x)

    def stream(self, device_id: int) -> int:
        if _get_device() == device_id:
            return _get_stream().ptr
        with cupy.cuda.Device(device_id):
            return _get_stream().ptr

    def empty(self, shape, dtype: str, device_id: int):
        if _get_device() == device_id:
            return cupy.empty(shape, dtype=np_dtype(dtype))
        with cupy.cuda.Device(device_id):
            return cupy.empty(shape, dtype=np_dtype(dtype))

    def contiguous(self, x, device_id: int, keep):
        # Always a new allocation: ascontiguousarray returns a C-contiguous array as it is, and its
        # pointer may be the misaligned one that made the plan ask for a copy.
        with cupy.cuda.Device(device_id):
            return x.copy(order="C")

    def dsink_sum(self, scratch, offset, shape, device_id):
        n = shape[0] * shape[1] * shape[2]
        with cupy.cuda.Device(device_id):
            return scratch[offset:offset + n].reshape(shape).sum(axis=(0, 2))

    def lengths_from_padding_mask(self, mask):
        m = mask.astype(bool)
        lengths = m.sum(axis=1).astype(cupy.int32)
        return lengths, bool(cupy.all(m == (cupy.arange(m.shape[1])[None, :] < lengths[:, None])))


ADAPTER = CupyAdapter()
