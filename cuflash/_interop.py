"""Array libraries: which one an array comes from, where it lives, and zero-copy views of it.

Device arrays reach the kernels as `DeviceTensor`s (pointer, shape, element strides):
  * torch CUDA tensors: read directly from the tensor (data_ptr, stride), which is what DLPack would
    hand over, without building a capsule per call. Outputs come from torch's caching allocator,
    and the kernel runs on torch.cuda.current_stream().
  * CuPy arrays: likewise from the array; outputs from CuPy's pool; CuPy's current stream.
  * JAX arrays (and anything else exposing __dlpack__ on a CUDA device): imported with
    cupy.from_dlpack, which hands our stream to the producer's __dlpack__(stream=...) so the data is
    ready on it; outputs are CuPy arrays exported back with jax.dlpack.from_dlpack.
CPU arrays (NumPy, torch CPU tensors, JAX CPU arrays) become NumPy arrays for the NumPy path.
"""

from __future__ import annotations

import numpy as np

from ._launch import DeviceTensor

LIBS = ("torch", "jax", "cupy", "numpy")


def library_of(x) -> str | None:
    mod = type(x).__module__.split(".", 1)[0]
    if mod == "torch":
        return "torch"
    if mod in ("jax", "jaxlib"):
        return "jax"
    if mod == "cupy":
        return "cupy"
    if isinstance(x, np.ndarray):
        return "numpy"
    return None


def is_jax_tracer(x) -> bool:
    mod = type(x).__module__
    if not mod.startswith(("jax", "jaxlib")):
        return False
    import jax

    return isinstance(x, jax.core.Tracer)


def dtype_name(x, lib: str) -> str:
    """'float16', 'bfloat16', 'float32', ... for any supported library."""
    if lib == "torch":
        return str(x.dtype).replace("torch.", "")
    return np.dtype(x.dtype).name


def device_of(x, lib: str) -> tuple[str, int]:
    """('cpu', 0) or ('cuda', ordinal)."""
    if lib == "numpy":
        return ("cpu", 0)
    if lib == "cupy":
        return ("cuda", x.device.id)
    if lib == "torch":
        d = x.device
        return ("cuda", d.index if d.index is not None else 0) if d.type == "cuda" else (d.type, 0)
    if lib == "jax":
        if is_jax_tracer(x):
            return ("traced", 0)  # a value being traced by a JAX transformation: no device yet
        devs = list(x.devices())
        dev = devs[0]
        plat = dev.platform
        if plat in ("gpu", "cuda"):
            return ("cuda", dev.local_hardware_id if getattr(dev, "local_hardware_id", None) is not None else dev.id)
        return (plat, dev.id)
    raise TypeError(lib)


def strides_elems(x, lib: str) -> tuple[int, ...]:
    if lib == "torch":
        return tuple(x.stride())
    return tuple(s // x.itemsize for s in x.strides)


# ---------------------------------------------------------------- CPU path

def to_numpy(x, lib: str) -> np.ndarray:
    if lib == "numpy":
        return x
    if lib == "torch":
        import torch

        if x.dtype == torch.bfloat16:
            import ml_dtypes

            return x.detach().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return x.detach().numpy()
    if lib == "jax":
        return np.asarray(x)
    raise TypeError(lib)


def from_numpy(a: np.ndarray, lib: str, like=None):
    if lib == "numpy":
        return a
    if lib == "torch":
        import torch

        if a.dtype.name == "bfloat16":
            return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(np.ascontiguousarray(a))
    if lib == "jax":
        import jax

        return jax.device_put(a, list(like.devices())[0]) if like is not None else jax.numpy.asarray(a)
    raise TypeError(lib)


# ---------------------------------------------------------------- GPU path

class GpuContext:
    """What one call needs on the device side: the stream to run on, views of the inputs, and an
    allocator that returns (caller-kind array, DeviceTensor) pairs."""

    def __init__(self, lib: str, device_id: int):
        self.lib = lib
        self.device_id = device_id
        self._keep = []  # imported arrays that must outlive the launch
        if lib == "torch":
            import torch

            self.stream_ptr = torch.cuda.current_stream(device_id).cuda_stream
        else:
            import cupy

            with cupy.cuda.Device(device_id):
                self.stream_ptr = cupy.cuda.get_current_stream().ptr

    def view(self, x) -> DeviceTensor:
        if self.lib == "torch":
            return DeviceTensor(x.data_ptr(), tuple(x.shape), tuple(x.stride()))
        if self.lib == "cupy":
            return DeviceTensor(x.data.ptr, x.shape, strides_elems(x, "cupy"))
        import cupy

        with cupy.cuda.Device(self.device_id):
            # CuPy passes its current stream to x.__dlpack__(stream=...): the producer makes the data
            # ready for that stream, which is the one the kernel then runs on.
            c = cupy.from_dlpack(x)
        self._keep.append(c)
        return DeviceTensor(c.data.ptr, c.shape, strides_elems(c, "cupy"))

    def contiguous(self, x):
        """A contiguous copy, made on the call's stream, in the caller's library where possible."""
        if self.lib == "torch":
            return x.contiguous()
        import cupy

        with cupy.cuda.Device(self.device_id):
            if self.lib == "cupy":
                return cupy.ascontiguousarray(x)
            c = cupy.ascontiguousarray(cupy.from_dlpack(x))
        self._keep.append(c)
        return c

    def empty(self, shape, dtype: str):
        if self.lib == "torch":
            import torch

            t = torch.empty(shape, dtype=getattr(torch, dtype), device=f"cuda:{self.device_id}")
            return t, DeviceTensor(t.data_ptr(), tuple(t.shape), tuple(t.stride()))
        import cupy

        with cupy.cuda.Device(self.device_id):
            if dtype == "bfloat16":
                import ml_dtypes

                c = cupy.empty(shape, dtype=ml_dtypes.bfloat16)
            else:
                c = cupy.empty(shape, dtype=dtype)
        return c, DeviceTensor(c.data.ptr, c.shape, strides_elems(c, "cupy"))

    def export(self, arr):
        """A freshly allocated output as the caller's kind of array."""
        if self.lib in ("torch", "cupy"):
            return arr
        import jax.dlpack

        return jax.dlpack.from_dlpack(arr)
