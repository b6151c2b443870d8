"""Work lists of the persistent causal forward (cuda_src/flash_fwd_sm90_ws.cu, PERSISTENT and causal).

A persistent grid of G blocks walks the query blocks of every (batch, head); under causal masking
the j-th query block counted from the last sees about num_m - j key tiles, so the blocks' work
differs. Without a list, the kernel takes pairs of a head's j-th longest and j-th shortest query
block (blocks.cuh persistent_tile: equal work a pair) in turn, head by head. That balances to a
pair: with P pairs on G blocks, ceil(P / G) pairs on some and floor on the others. At FlashAttention-2's
grid (16k tokens) P = 1024 and G = 132, 7.76 pairs a block: 8 pairs against an average of 7.76, so
the grid's last blocks idle for 3 % of the time.

The list here keeps those pairs, in the same order, for all heads but the last T, and hands the last
T heads' query blocks out one at a time, the longest first, each to the block that is then least
loaded (longest-processing-time list scheduling): the short blocks at the end fill in where the
pairs left gaps. T is picked to minimize the modelled time of the busiest block, a query block
costing its key tiles plus FIXED_TILES (the work of a query block that does not grow with its key
tiles: the first product and the last, the epilogue). The blocks running together still share the
K / V of a few heads in L2 (the T heads' work is about a wave or two).

Layout of the list (int32, what the kernel reads through FwdWsParams.sched): a (rows, G) array whose
row k holds each block's k-th work tile, -1 past a block's last (one row of -1 at least, so that
every block finds its end): one load a tile, and no offsets to hold in the producer's 24 registers.
A work tile is a block index of blocks.cuh query_block's mapping, (batch * nheads + head) * num_m +
(num_m - 1 - query block).
"""
from __future__ import annotations

import heapq
from functools import lru_cache

import numpy as np

# The work of a query block besides its key tiles, in key tiles (the cost model's constant).
FIXED_TILES = 1.0
# The most tail candidates tried (the list is computed once per plan).
MAX_CANDIDATES = 12


def causal_key_tiles(num_m: int, block_m: int, block_n: int, seqlen_q: int, seqlen_k: int) -> np.ndarray:
    """Key tiles of each query block, indexed from the last query block (blocks.cuh query_block:
    bottom-right causal alignment)."""
    m0 = (num_m - 1 - np.arange(num_m)) * block_m
    visible = m0 + block_m + seqlen_k - seqlen_q
    full = -(-seqlen_k // block_n)
    return np.minimum(full, np.where(visible <= 0, 0, -(-visible // block_n))).astype(np.int64)


def _tail_loads(loads: np.ndarray, singles: np.ndarray, costs: np.ndarray):
    """LPT: each single (in order) to the least loaded block. Returns (loads, owner of each single)."""
    heap = [(float(x), i) for i, x in enumerate(loads)]
    heapq.heapify(heap)
    owner = np.empty(len(singles), dtype=np.int64)
    for n, c in enumerate(costs):
        load, i = heapq.heappop(heap)
        owner[n] = i
        heapq.heappush(heap, (load + c, i))
    out = np.empty(len(loads))
    for load, i in heap:
        out[i] = load
    return out, owner


def _plan(num_m: int, bh: int, G: int, tiles: np.ndarray, T: int):
    """(makespan, bulk pair count, tail singles in order, their owners) for T tail heads."""
    half = num_m // 2
    cost = tiles + FIXED_TILES
    pair_cost = cost[:half] + cost[num_m - 1 - np.arange(half)]
    n_pairs = (bh - T) * half
    loads = np.zeros(G)
    if n_pairs:
        idx = np.arange(n_pairs)
        loads += np.bincount(idx % G, weights=pair_cost[idx % half], minlength=G)
    # The tail heads' query blocks, longest first (r = 0 first), head by head within a length.
    r = np.repeat(np.arange(num_m), T)
    heads = np.tile(np.arange(bh - T, bh), num_m)
    order = np.argsort(-cost[r], kind="stable")
    r, heads = r[order], heads[order]
    loads, owner = _tail_loads(loads, heads * num_m + r, cost[r])
    return float(loads.max()), n_pairs, heads * num_m + r, owner


@lru_cache(maxsize=256)
def causal_schedule(num_m: int, bh: int, G: int, block_m: int, block_n: int, seqlen_q: int,
                    seqlen_k: int) -> np.ndarray:
    """The work list of a persistent causal forward of bh (batch, head)s of num_m query blocks (even)
    on G blocks, int32 (module docstring's layout). Read-only."""
    if num_m % 2:
        raise ValueError(f"causal_schedule: num_m must be even (the pairs), got {num_m}")
    tiles = causal_key_tiles(num_m, block_m, block_n, seqlen_q, seqlen_k)
    # Candidates: up to about four singles a block on average (a wave or two of work), at most
    # MAX_CANDIDATES values of T spread over that range, and T = 0 (the pairs alone).
    t_max = min(bh, max(1, (4 * G) // num_m))
    step = max(1, -(-t_max // MAX_CANDIDATES))
    best = None
    for T in sorted({0, *range(step, t_max + 1, step), t_max}):
        plan = _plan(num_m, bh, G, tiles, T)
        if best is None or plan[0] < best[0] - 1e-9:
            best = plan
    _, n_pairs, singles, owner = best
    half = num_m // 2
    lists = [[] for _ in range(G)]
    for pr in range(n_pairs):
        j = pr % half
        base = (pr // half) * num_m
        lists[pr % G] += (base + j, base + num_m - 1 - j)
    for item, i in zip(singles.tolist(), owner.tolist()):
        lists[i].append(item)
    out = np.full((max(map(len, lists)) + 1, G), -1, dtype=np.int32)
    for i, lst in enumerate(lists):
        out[:len(lst), i] = lst
    out.setflags(write=False)
    return out


# Split tails of the persistent non-causal forward: its work tiles are alike (num_n key tiles each),
# so with n_work tiles on G blocks the first n_work % G blocks take one more than the others, and the
# grid's last wave runs on part of the GPU (at FlashAttention-2's grid, 2048 tiles on 132 SMs: 16
# against an average of 15.5, 3 % of the time). The list keeps the tiles of the whole waves in the
# kernel's own order (tile k G + i to block i) and cuts each of the last n_work % G tiles into parts
# of `chunk` key tiles (the last part the rest), each part to the least loaded block, the longest
# first; the kernel merges a tile's parts by their lse (cuda_src/fwd_sm90_steps.cuh
# split_part_merge). A part costs its key tiles plus FIXED_TILES plus SPLIT_TILES (its partial
# result out to memory, and for the last one the merge).
SPLIT_TILES = 0.5
# The most parts a tile is cut into (the last reads them all back to merge), and the least modelled
# gain (a fraction of the busiest block's time) for which a split is taken.
MAX_PARTS = 4
MIN_SPLIT_GAIN = 0.005
# The fewest key tiles a part: at 2k keys (16 key tiles, parts of 6) the split measured no gain, from
# 4k (parts of 11) 1-2 % (H200, session 40, bench/dev/fwd_ab_inproc.py).
MIN_CHUNK = 8
# A list entry: the tile in bits 0-23, (part + 1) in bits 24-31 for a part of a split tile, 0 for a
# whole one (split_schedule makes no list from 2^24 work tiles on).
TILE_BITS = 24


@lru_cache(maxsize=256)
def split_schedule(n_work: int, G: int, num_n: int):
    """The persistent non-causal forward's list for n_work tiles of num_n key tiles on G blocks, with
    its last n_work % G tiles split (the comment above): (table, split_first, parts, chunk), table
    laid out as causal_schedule's with entries as TILE_BITS says; None where no split gains
    MIN_SPLIT_GAIN, and from 2^TILE_BITS work tiles on (then the unsplit kernel, in its own order: the
    split kernels, which read the tile from an entry's low bits, run only on a list of this). Read-only."""
    full, tail = divmod(n_work, G)
    if tail == 0 or num_n < 2 or n_work >= 1 << TILE_BITS:
        return None
    whole = num_n + FIXED_TILES
    base = full * whole
    best = (base + whole, None)  # no split: the busiest blocks take one more whole tile
    seen = set()
    for s in range(2, min(MAX_PARTS, num_n) + 1):
        chunk = -(-num_n // s)
        parts = -(-num_n // chunk)
        if parts < 2 or chunk < MIN_CHUNK or chunk in seen:
            continue
        seen.add(chunk)
        sizes = [min(chunk, num_n - p * chunk) for p in range(parts)]
        items = sorted(((sizes[p] + FIXED_TILES + SPLIT_TILES, t, p) for t in range(tail) for p in range(parts)),
                       key=lambda x: -x[0])
        loads, owner = _tail_loads(np.full(G, base), items, [c for c, _, _ in items])
        span = float(loads.max())
        if span < (base + whole) * (1 - MIN_SPLIT_GAIN) and span < best[0] - 1e-9:
            best = (span, (chunk, parts, items, owner))
    if best[1] is None:
        return None
    chunk, parts, items, owner = best[1]
    first = full * G
    lists = [[k * G + i for k in range(full)] for i in range(G)]
    for (_, t, p), i in zip(items, owner.tolist()):
        lists[i].append((first + t) | ((p + 1) << TILE_BITS))
    out = np.full((max(map(len, lists)) + 1, G), -1, dtype=np.int32)
    for i, lst in enumerate(lists):
        out[:len(lst), i] = np.asarray(lst, dtype=np.int64).astype(np.int32)
    out.setflags(write=False)
    return out, first, parts, chunk


def block_lists(sched: np.ndarray) -> list:
    """Each block's work tiles in order, from a list as causal_schedule lays it out (tests and tools)."""
    return [col[:int(np.argmax(col < 0))].tolist() for col in sched.T]


def makespan(sched: np.ndarray, num_m: int, tiles: np.ndarray) -> float:
    """The cost model's time of a list's busiest block (tests and tools)."""
    cost = tiles + FIXED_TILES
    return max(float(cost[np.asarray(lst, dtype=np.int64) % num_m].sum()) for lst in block_lists(sched))
