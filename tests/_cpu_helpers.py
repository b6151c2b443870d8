"""Helpers shared by the CPU tests: seeds that a failure message reports (CUFLASH_TEST_SEED
replays one), random inputs, which query rows see no key; and dq's error statistic below head_dim
32, which the GPU backward tests share; a recorder of fired launches."""

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


def _kvcache_route(monkeypatch, route):
    """CUFLASH_KVCACHE_FORWARD for one test: "rule" (unset: _config.kvcache_feature_forward decides), "0"
    (the decode kernels) or "1" (the feature forward above 64 rows); the decode plan caches emptied
    (_fresh_decode_plans), so that the test's calls are planned under it."""
    if route == "rule":
        monkeypatch.delenv("CUFLASH_KVCACHE_FORWARD", raising=False)
    else:
        monkeypatch.setenv("CUFLASH_KVCACHE_FORWARD", route)
    _fresh_decode_plans(monkeypatch)


def _fresh_decode_plans(monkeypatch):
    """Empties cuflash's decode plan caches for one test (restored after it), so that the plans made
    in it read the test's settings (environment switches, patched limits)."""
    from cuflash import _kvcache

    monkeypatch.setattr(_kvcache, "_DECODE_PLANS", {})
    monkeypatch.setattr(_kvcache, "_CHUNK_PLANS", {})
    monkeypatch.setattr(_kvcache, "_FAST_PLANS", {})


# dQ below head_dim 32: dS as hi + lo and D corrected (cuda_src/flash_bwd.cu DS_SPLIT_BELOW), checked by the CPU
# and GPU backward tests. Measured with the NumPy mirror over draws of (seqlen_q, seqlen_k) = (1, 300), (16, 300)
# and (64, 1024), 4 query heads on 1 kv head: the RMS error of dq against float64, over the RMS error of rounding
# the exact dq to the dtype, was 1.46-1.66 with dS rounded once, 1.04-1.13 with hi + lo alone, and 1.00-1.001
# with D's correction too (bf16 and fp16, head_dim 8 / 24); with keys that share a component (k + 2), 2.5-3.0
# with hi + lo alone and 1.00-1.001 with the correction.
DQ_SPLIT_RMS_LIMIT = 1.3


# dK below head_dim 32: its dS takes D* = D + E from the dQ kernel, which runs first (cuda_src/flash_bwd.cu,
# DS_SPLIT_BELOW), not D from the stored (rounded) O. With values that share a component (v = c + 0.05 noise: dP_j
# close to D, so dS small and D's error large beside it), the NumPy mirror's RMS error of dk against float64, over
# that of rounding the exact dk, was 38-64 with D from the rounded O (the naive computation in the dtype 40-49) and
# 1.40-1.52 with D* (bf16 and fp16, head_dim 8 / 16 / 24, (1, 300) and (64, 1024), 4 query heads on 1 kv head;
# session 66). dK keeps dS rounded once (about 1.5x the output's rounding).
DK_D_STAR_RMS_LIMIT = 2.0


def shared_component_values(rng, batch: int, seqlen_k: int, nheads_kv: int, head_dim: int) -> np.ndarray:
    """float64 values c + 0.05 noise, c (batch, 1, nheads_kv, head_dim) ~ 2 N(0, 1): every key's value close to
    one vector, so that dP_j = dO v_j is close to D = dO O for every key."""
    c = 2.0 * rng.standard_normal((batch, 1, nheads_kv, head_dim))
    return c + 0.05 * rng.standard_normal((batch, seqlen_k, nheads_kv, head_dim))


def dq_split_rms_ratio(dq, ref64, dtype) -> float:
    """RMS(dq - ref64) / RMS(round_dtype(ref64) - ref64): 1 is the rounding of the output alone."""
    dq, ref64 = np.asarray(dq, np.float64), np.asarray(ref64, np.float64)
    floor = np.sqrt(np.mean((ref64.astype(dtype).astype(np.float64) - ref64) ** 2))
    return float(np.sqrt(np.mean((dq - ref64) ** 2)) / floor)


def record_fired(monkeypatch, cls) -> list:
    """Patches cls.fire (cuflash._launch.Launch or one of its subclasses) to append each fired launch's
    kernel name to the returned list, then fire it."""
    names = []
    real = cls.fire

    def fire(self, stream, ptrs, pdl=True):
        names.append(self.name)
        return real(self, stream, ptrs, pdl)

    monkeypatch.setattr(cls, "fire", fire)
    return names
