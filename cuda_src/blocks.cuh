// blocks.cuh: which part of the problem a thread block owns, shared by every kernel.
//
// Grids are 1-D (batch * heads is not bounded by the 65535 limit of grid y / z):
//   query-block kernels (forward, deterministic dQ): block = (b * nheads + h) * num_m_blocks
//     + (num_m_blocks - 1 - m_block), so within a head the longest causal blocks start first;
//     causal forwards run thread block i as block causal_block_order(i), whose last heads go query
//     block by query block (longest first) across them;
//   key-block kernels (dK / dV): block = (b * nheads_kv + h_kv) * num_n_blocks + n_block; the
//     warp-specialized backward takes tiles in key_block_grouped's order.
// Causal is bottom-right aligned: query i sees key j iff j <= i + seqlen_k - seqlen_q.
#pragma once
#include "common.cuh"

namespace cuflash {

struct QueryBlock {
    int b, h, h_kv;
    int m0;        // first query row
    int n_blocks;  // key tiles [0, n_blocks) of BLOCK_N keys hold every key these rows see
};

template <int BLOCK_M, int BLOCK_N, bool IS_CAUSAL>
__device__ __forceinline__ QueryBlock query_block(unsigned block, int num_m_blocks, int nheads, int head_group,
                                                  int sq, int sk) {
    QueryBlock r;
    const int m_block = num_m_blocks - 1 - (int)(block % (unsigned)num_m_blocks);
    const int bh = (int)(block / (unsigned)num_m_blocks);
    r.h = bh % nheads;
    r.b = bh / nheads;
    r.h_kv = r.h / head_group;
    r.m0 = m_block * BLOCK_M;
    r.n_blocks = (sk + BLOCK_N - 1) / BLOCK_N;
    if (IS_CAUSAL) {
        // The block's last row sees keys [0, m0 + BLOCK_M + sk - sq).
        const int visible = r.m0 + BLOCK_M + sk - sq;
        r.n_blocks = min(r.n_blocks, visible <= 0 ? 0 : (visible + BLOCK_N - 1) / BLOCK_N);
    }
    return r;
}

// The block of query_block's mapping that thread block i of a causal grid runs. The first (batch,
// head)s keep that mapping: head by head, each head's longest block first, so that the blocks running
// together share their K / V in L2. The last tail_heads (batch, head)s go query block by query block
// across those heads, the longest first, so that the grid ends on short blocks only: head by head, a
// head's longest block would start among the grid's last and keep its SM busy while the others go
// idle (a list-scheduling model of the hardware's block dispatch put that tail at 4-7 % of a causal
// forward's time at 1k-8k keys). The host picks tail_heads to cover about one wave of blocks
// (cuflash/_config.py FWD_CAUSAL_TAIL_WAVES).
__device__ __forceinline__ unsigned causal_block_order(unsigned i, int num_m, unsigned bh_count, int tail_heads) {
    const unsigned hl = min((unsigned)max(tail_heads, 0), bh_count);
    const unsigned first = (bh_count - hl) * (unsigned)num_m;
    if (i < first) return i;
    const unsigned w = i - first;
    return (bh_count - hl + w % hl) * (unsigned)num_m + w / hl;
}

// A forward kernel's block in query_block's mapping: causal_block_order's where ORDERED (the causal
// plain kernels and the feature kernels, whose host sets tail_heads for windows (left, 0), causal
// included), else blockIdx.x. P: FwdParams or a struct deriving from it.
template <bool ORDERED, typename P>
__device__ __forceinline__ unsigned fwd_block_index(const P& p) {
    if constexpr (ORDERED)
        return causal_block_order(blockIdx.x, p.num_m_blocks, (unsigned)p.batch * (unsigned)p.nheads, p.tail_heads);
    else
        return blockIdx.x;
}

// Work tile k of block i on a persistent grid of G blocks (flash_fwd_sm90_ws.cu PERSISTENT), as a
// block index of query_block's mapping (bh * num_m + the query block counted from the last); n_work
// = num_m * bh_count once past the last. Non-causal (all tiles alike): tile k G + i, the order in which
// a grid of a block per tile runs them (the G blocks running together take consecutive query blocks
// of a few heads, whose K / V stay in L2). CAUSAL: pairs of a head's j-th longest and j-th shortest
// query block (their causal lengths add up to about num_m + 1 key tiles, the same for every pair),
// pair p = (k / 2) G + i, its longest block at even k and its shortest at odd k; the pairs run head by
// head, so the blocks running together share the K / V of a few heads. The host takes this grid for
// an even num_m only: with an odd one the middle block of each head would be its own pair's both
// halves, computed twice (the same result written twice).
template <bool CAUSAL>
__device__ __forceinline__ unsigned persistent_tile(int k, unsigned i, unsigned G, int num_m, unsigned bh_count) {
    const unsigned n_work = (unsigned)num_m * bh_count;
    if constexpr (!CAUSAL) return min((unsigned)k * G + i, n_work);
    const unsigned half = (unsigned)(num_m + 1) / 2;
    const unsigned pr = (unsigned)(k / 2) * G + i;
    if (pr >= half * bh_count) return n_work;
    const unsigned j = pr % half;  // the pair's longest block is the j-th from the last
    return (pr / half) * (unsigned)num_m + ((k & 1) ? (unsigned)num_m - 1 - j : j);
}

struct KeyBlock {
    int b, h_kv;
    int n0;       // first key
    int m_begin;  // first query block (of BLOCK_M rows) that sees one of the block's keys
    int m_iters;  // query blocks [m_begin, m_begin + m_iters) per query head
};

template <int BLOCK_M, int BLOCK_N, bool IS_CAUSAL>
__device__ __forceinline__ KeyBlock key_block(unsigned block, int num_n_blocks, int nheads_kv, int sq, int sk) {
    KeyBlock r;
    const int bh = (int)(block / (unsigned)num_n_blocks);
    r.h_kv = bh % nheads_kv;
    r.b = bh / nheads_kv;
    r.n0 = (int)(block % (unsigned)num_n_blocks) * BLOCK_N;
    const int num_m_blocks = (sq + BLOCK_M - 1) / BLOCK_M;
    r.m_begin = 0;
    if (IS_CAUSAL) {
        // The first query that sees key n0 is n0 - (sk - sq).
        const int first_q = r.n0 - (sk - sq);
        r.m_begin = first_q <= 0 ? 0 : min(num_m_blocks, first_q / BLOCK_M);
    }
    r.m_iters = num_m_blocks - r.m_begin;
    return r;
}

// The warp-specialized backward's tile order (flash_bwd_sm90_ws.cu). The BH = batch * nheads_kv
// (batch, kv head)s are taken in groups of `group`, but for the last `tail` of them, which form one
// group of their own (0: none; the last group of `group` may then be smaller); inside a group, tile t
// is key block t / heads of (batch, kv head) first + t % heads. So the blocks running at one time
// share the Q and dO of a few heads (the host picks group * num_n_blocks near the SM count: their Q
// and dO stay in L2, read from memory once), and within a group every head's first key block comes
// first: under causal masking the longest (every query block sees it), so a persistent grid, which
// takes tiles t = blockIdx.x, + gridDim.x, ..., starts the longest work of each group first. The
// tail group (causal calls: at least a group, about one wave of tiles) makes the grid end on short
// tiles, where a small last group would start its long tiles among the grid's last
// (causal_block_order's reason).
template <int BLOCK_M, int BLOCK_N, bool IS_CAUSAL>
__device__ __forceinline__ KeyBlock key_block_grouped(unsigned tile, int num_n_blocks, int nheads_kv, int batch,
                                                      int group, int tail, int sq, int sk) {
    const unsigned bh_count = (unsigned)batch * (unsigned)nheads_kv;
    const unsigned tail_h = min((unsigned)max(tail, 0), bh_count);
    const unsigned grouped = bh_count - tail_h;  // the (batch, kv head)s in groups of `group`
    unsigned first, heads, within;
    if (tile >= grouped * (unsigned)num_n_blocks) {
        first = grouped;
        heads = tail_h;
        within = tile - grouped * (unsigned)num_n_blocks;
    } else {
        const unsigned per_group = (unsigned)group * (unsigned)num_n_blocks;
        const unsigned gi = tile / per_group;
        first = gi * (unsigned)group;
        heads = min((unsigned)group, grouped - first);
        within = tile - gi * per_group;
    }
    const unsigned block = (first + within % heads) * (unsigned)num_n_blocks + within / heads;
    return key_block<BLOCK_M, BLOCK_N, IS_CAUSAL>(block, num_n_blocks, nheads_kv, sq, sk);
}

}  // namespace cuflash
