"""Framework adapters: the first stage of the pipeline.

    adapter (this package)  ->  Call (_call.py)  ->  Plan (_plan.py)  ->  run

One module per array library: `_torch` (autograd, torch.library custom ops, caching allocator,
current stream), `_jax` (jax.custom_vjp, DLPack), `_cupy`, `_numpy` (the CPU path). Each turns its
arrays into `ArrayInfo`s for validation, builds a cheap signature key from them for the plan
cache, and runs a plan: allocates the outputs in its library, reads the pointers and the
caller's stream, and hands them to the plan. The core modules never import this package.
"""

from __future__ import annotations

from ._base import Adapter, info_of

_BY_TYPE: dict = {}
_TORCH = None  # the torch adapter, once imported


def adapter_for(x) -> Adapter | None:
    """The adapter of x's library, or None if x is not an array cuflash knows."""
    global _TORCH
    t = type(x)
    # torch first, by module name and without the type map: torch.compile traces this function,
    # and Dynamo cannot guard a dict lookup keyed by a class. Plain import statements, not
    # importlib: Dynamo runs import statements but refuses importlib.import_module.
    mod = t.__module__
    if mod == "torch" or mod.startswith("torch."):
        if _TORCH is None:
            from ._torch import ADAPTER as _TORCH
        return _TORCH
    ad = _BY_TYPE.get(t)
    if ad is not None:
        return ad
    mod = mod.split(".", 1)[0]
    if mod in ("jax", "jaxlib"):
        from ._jax import ADAPTER as ad
    elif mod == "cupy":
        from ._cupy import ADAPTER as ad
    else:
        import numpy as np

        if not isinstance(x, np.ndarray):
            return None
        from ._numpy import ADAPTER as ad
    _BY_TYPE[t] = ad
    return ad


__all__ = ["Adapter", "adapter_for", "info_of"]
