"""Helpers shared by the CPU tests: seeds that a failure message reports (CUFLASH_TEST_SEED
replays one), random inputs, and which query rows see no key."""

import os

import numpy as np

from cuflash._reference import causal_mask


def _new_seed():
    env = os.environ.get("CUFLASH_TEST_SEED")
    if env:
        return int(env)
    return int(np.random.SeedSequence().entropy % (1 << 63))


def _randn(rng, shape, dtype, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(dtype)


def _batch_for(seqlen_q):
    """Enough rows that the max error is a stable statistic (a single query row per head is noisy)."""
    return 2 if seqlen_q >= 64 else 16


def _no_key_rows(seqlen_q, seqlen_k, causal):
    """Boolean (seqlen_q,) mask of query rows that see no key."""
    if not causal:
        return np.full(seqlen_q, seqlen_k == 0)
    return ~causal_mask(seqlen_q, seqlen_k).any(axis=1)


def _ctx(seed, **kw):
    parts = ", ".join(f"{key}={val}" for key, val in kw.items())
    return f"seed={seed} ({parts})"


def _fresh_decode_plans(monkeypatch):
    """Empties cuflash's decode plan caches for one test (restored after it), so that the plans made
    in it read the test's settings (environment switches, patched limits)."""
    from cuflash import _kvcache

    monkeypatch.setattr(_kvcache, "_DECODE_PLANS", {})
    monkeypatch.setattr(_kvcache, "_FAST_PLANS", {})
