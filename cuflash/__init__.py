"""cuflash: exact, IO-aware attention (FlashAttention) as a pure-Python package.

CUDA kernels in cuda_src/ are compiled at run time by NVRTC (through CuPy) and called zero-copy on
torch, JAX and CuPy arrays; NumPy arrays run a NumPy implementation of the same tiled algorithm.
"""

from ._api import attention, attention_backward, attention_varlen, attention_varlen_backward
from ._features import lengths_from_padding_mask
from ._gpu import precompile
from ._version import __version__

__all__ = ["attention", "attention_backward", "attention_varlen", "attention_varlen_backward",
           "lengths_from_padding_mask", "precompile", "__version__"]
