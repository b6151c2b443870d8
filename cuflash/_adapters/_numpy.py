"""NumPy adapter: arrays on the CPU run the NumPy implementation of the tiled algorithm."""

from __future__ import annotations

import numpy as np

from .._call import ArrayInfo
from ._base import Adapter


class NumpyAdapter(Adapter):
    lib = "numpy"

    def info(self, x) -> ArrayInfo:
        return ArrayInfo("numpy", tuple(x.shape), tuple(s // x.itemsize for s in x.strides), x.dtype.name,
                         ("cpu", 0), True, "numpy.ndarray")

    def sig(self, x) -> tuple:
        return (x.dtype, x.shape, x.strides)

    def to_numpy(self, x):
        return x

    def from_numpy(self, a, like):
        return a

    def lengths_from_padding_mask(self, mask):
        m = np.asarray(mask).astype(bool)
        lengths = m.sum(axis=1).astype(np.int32)
        return lengths, bool(np.all(m == (np.arange(m.shape[1])[None, :] < lengths[:, None])))


ADAPTER = NumpyAdapter()
