"""Loads a cuflash tree's package under a module name of its own, beside `cuflash` in one process
(bench/dev/fwd_ab_inproc.py, s27_energy.py). With torch, the extra package registers its
torch.library operators under its own namespace (ns), so each copy runs through the torch adapter in
eager mode. Each copy keeps its own plan cache, so a copy loaded from the same tree can run with
other CUFLASH_* choices, which plans read when they are made (EnvSet sets them around its calls;
plans are not keyed by them, so one copy per set of choices)."""
import importlib.util
import os
import sys

import torch


def load(name, root, ns):
    pkg = os.path.join(root, "cuflash")
    orig_lib, orig_fake = torch.library.Library, torch.library.register_fake

    def lib(n, kind, *a, **k):
        return orig_lib(ns if n == "cuflash" else n, kind, *a, **k)

    def fake(qualname, *a, **k):
        return orig_fake(qualname.replace("cuflash::", ns + "::"), *a, **k)

    torch.library.Library, torch.library.register_fake = lib, fake
    try:
        spec = importlib.util.spec_from_file_location(name, os.path.join(pkg, "__init__.py"), submodule_search_locations=[pkg])
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    finally:
        torch.library.Library, torch.library.register_fake = orig_lib, orig_fake
    assert name + "._adapters._torch" in sys.modules, f"{name}: the torch adapter did not load"
    return mod


class EnvSet:
    """Sets the variables of `pairs` ([name, value] lists) in os.environ while the block runs, and
    restores them after."""

    def __init__(self, pairs):
        self.pairs, self.old = pairs, {}

    def __enter__(self):
        for k, v in self.pairs:
            self.old[k] = os.environ.get(k)
            os.environ[k] = v
        return self

    def __exit__(self, *a):
        for k, _ in self.pairs:
            if self.old[k] is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = self.old[k]
        return False
