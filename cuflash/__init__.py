"""cuflash: exact, IO-aware attention (FlashAttention) as a pure-Python package.

CUDA kernels in cuda_src/ are compiled at run time by NVRTC (through CuPy) and called zero-copy on
torch, JAX and CuPy arrays; NumPy arrays run a NumPy implementation of the same tiled algorithm.
"""

from ._api import attention
from ._gpu import precompile
from ._version import __version__

__all__ = ["attention", "precompile", "__version__"]
