"""cuflash: exact, IO-aware attention (FlashAttention) as a pure-Python package.

CUDA kernels in cuda_src/ are compiled at run time by NVRTC (through CuPy) and called zero-copy on
torch, JAX and CuPy arrays; NumPy arrays run a NumPy implementation of the same tiled algorithm.
"""

from ._api import attention, attention_backward
from ._gpu import precompile
from ._version import __version__

__all__ = ["attention", "attention_backward", "precompile", "__version__"]
