"""The persistent causal forward's work lists (cuflash/_schedule.py), on the CPU."""
import numpy as np
import pytest

from cuflash import _schedule as S


def pairs_makespan(num_m, bh, G, tiles):
    """The cost model's busiest block under the kernel's own order (blocks.cuh persistent_tile)."""
    half = num_m // 2
    cost = tiles + S.FIXED_TILES
    loads = np.zeros(G)
    for pr in range(bh * half):
        j = pr % half
        loads[pr % G] += cost[j] + cost[num_m - 1 - j]
    return loads.max()


@pytest.mark.parametrize("num_m,bh,G,sq,sk", [
    (16, 128, 132, 2048, 2048),   # FlashAttention-2's grid, 2k keys, head_dim 128
    (4, 512, 132, 512, 512),      # 512 keys
    (8, 256, 132, 1024, 1024),
    (16, 3, 48, 2048, 2048),      # fewer query blocks than SMs
    (6, 7, 5, 700, 900),          # seqlen_q < seqlen_k (bottom-right), ragged last block
    (2, 1, 2, 200, 130),          # seqlen_q > seqlen_k: the first rows see no key
    (32, 2, 132, 4096, 4096),
])
def test_causal_schedule(num_m, bh, G, sq, sk):
    block = 128
    sched = S.causal_schedule(num_m, bh, G, block, block, sq, sk)
    assert sched.dtype == np.int32 and sched.ndim == 2 and sched.shape[1] == G and not sched.flags.writeable
    assert (sched[-1] == -1).all(), "every block must find its end"
    lists = S.block_lists(sched)
    # every query block exactly once, and nothing after a block's -1
    assert sorted(x for lst in lists for x in lst) == list(range(bh * num_m))
    for i, lst in enumerate(lists):
        assert (sched[len(lst):, i] == -1).all()
    tiles = S.causal_key_tiles(num_m, block, block, sq, sk)
    # the tiles model query_block's causal bound
    for r in range(num_m):
        m0 = (num_m - 1 - r) * block
        visible = m0 + block + sk - sq
        want = min(-(-sk // block), 0 if visible <= 0 else -(-visible // block))
        assert tiles[r] == want
    # never worse than the pairs alone (T = 0 is a candidate), and within one query block of the
    # average where there is work for every block
    ms = S.makespan(sched, num_m, tiles)
    assert ms <= pairs_makespan(num_m, bh, G, tiles) + 1e-9
    cost = tiles + S.FIXED_TILES
    if bh * num_m >= 4 * G:
        assert ms <= cost.sum() * bh / G + cost.max()


def test_causal_schedule_gains_at_the_grid():
    """At FlashAttention-2's grid (16k tokens, 16 heads, head_dim 128, 132 SMs) the pairs alone leave
    the busiest block 3 % over the average; the list brings it within 1.5 %."""
    G = 132
    for s in (512, 1024, 2048):
        num_m, bh = s // 128, (16384 // s) * 16
        tiles = S.causal_key_tiles(num_m, 128, 128, s, s)
        avg = (tiles + S.FIXED_TILES).sum() * bh / G
        assert pairs_makespan(num_m, bh, G, tiles) / avg > 1.03
        assert S.makespan(S.causal_schedule(num_m, bh, G, 128, 128, s, s), num_m, tiles) / avg < 1.015


def test_causal_schedule_odd():
    with pytest.raises(ValueError, match="num_m must be even"):
        S.causal_schedule(3, 4, 8, 128, 128, 384, 384)
