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


def split_cover(sched, n_work, first, parts, chunk, num_n):
    """Every work tile's key tiles exactly once over the list: whole tiles below `first`, the parts
    of the split ones; and each block's whole tiles in the kernel's own order (k G + i) first."""
    G = sched.shape[1]
    seen = {}
    for i, lst in enumerate(S.block_lists(sched)):
        whole = [e for e in lst if e >> S.TILE_BITS == 0]
        assert whole == list(range(i, first, G)), "the whole waves keep the kernel's order"
        assert lst[:len(whole)] == whole, "a block's parts come after its whole tiles"
        for e in lst:
            tile, pm = e & ((1 << S.TILE_BITS) - 1), e >> S.TILE_BITS
            if pm == 0:
                rng = range(num_n)
            else:
                assert first <= tile < n_work and 1 <= pm <= parts
                lo = (pm - 1) * chunk
                rng = range(lo, min(lo + chunk, num_n))  # the kernel's range (flash_fwd_sm90_ws.cu work_of)
            for n in rng:
                assert (tile, n) not in seen, (tile, n)
                seen[(tile, n)] = i
    assert len(seen) == n_work * num_n


@pytest.mark.parametrize("n_work,G,num_n", [
    (2048, 132, 32),   # FlashAttention-2's grid, head_dim 128, 4k keys: 2048 tiles on 132 SMs
    (2048, 132, 128),  # 16k keys
    (2048, 132, 33),   # a ragged last part
    (300, 132, 40),    # two whole waves and a tail
    (4096, 132, 16),   # head_dim 64, 2k keys
    (100, 7, 20),
])
def test_split_schedule(n_work, G, num_n):
    got = S.split_schedule(n_work, G, num_n)
    assert got is not None
    sched, first, parts, chunk = got
    assert sched.dtype == np.int32 and sched.shape[1] == G and not sched.flags.writeable and (sched[-1] == -1).all()
    assert first == n_work // G * G and 2 <= parts <= S.MAX_PARTS and parts == -(-num_n // chunk)
    assert chunk >= S.MIN_CHUNK
    split_cover(sched, n_work, first, parts, chunk, num_n)
    # the model's busiest block gains at least MIN_SPLIT_GAIN over the kernel's own order
    whole = num_n + S.FIXED_TILES
    loads = [sum(whole if e >> S.TILE_BITS == 0 else
                 min(chunk, num_n - ((e >> S.TILE_BITS) - 1) * chunk) + S.FIXED_TILES + S.SPLIT_TILES for e in lst)
             for lst in S.block_lists(sched)]
    assert max(loads) <= -(-n_work // G) * whole * (1 - S.MIN_SPLIT_GAIN)


@pytest.mark.parametrize("n_work,G,num_n", [
    (2640, 132, 16),   # whole waves: nothing to split
    (2048, 132, 1),    # one key tile
    (2048, 132, 4),    # 512 keys: no cut gains
    (2048, 132, 16),   # 2k keys: parts would be under MIN_CHUNK
    (200, 132, 16),    # most of a wave in the tail: no cut gains
    (1 << 24, 132, 16),  # past the entries' 24 bits
])
def test_split_schedule_none(n_work, G, num_n):
    assert S.split_schedule(n_work, G, num_n) is None
