"""cuflash: exact, IO-aware attention (FlashAttention) as a pure-Python package.

CUDA kernels in cuda_src/ are compiled at run time by NVRTC (through CuPy) and called zero-copy on
torch, JAX and CuPy arrays; NumPy arrays run a NumPy implementation of the same tiled algorithm.
"""

from ._api import (AttentionPlan, attention, attention_backward, attention_varlen, attention_varlen_backward,
                   lengths_from_padding_mask, plan, plan_varlen)
from ._gpu import precompile
from ._kvcache import attention_with_kvcache
from ._plan import LaunchError
from ._version import __version__


def _load_torch_adapter():
    """With torch already imported, its adapter (and the torch.library ops) load now: a model that
    is torch.compile'd before its first eager call then finds them registered."""
    import sys

    if "torch" in sys.modules:
        try:
            from ._adapters import _torch  # noqa: F401  (registers the adapter and the torch.library operators)
        except Exception:  # a broken torch install must not break `import cuflash` for other libraries
            pass


_load_torch_adapter()

__all__ = ["attention", "attention_backward", "attention_varlen", "attention_varlen_backward", "attention_with_kvcache",
           "lengths_from_padding_mask", "plan", "plan_varlen", "AttentionPlan", "LaunchError", "precompile",
           "__version__"]
