// blocks.cuh: which part of the problem a thread block owns, shared by every kernel.
//
// Grids are 1-D (batch * heads is not bounded by the 65535 limit of grid y / z):
//   query-block kernels (forward, deterministic dQ): block = (b * nheads + h) * num_m_blocks
//     + (num_m_blocks - 1 - m_block), so within a head the longest causal blocks start first;
//   key-block kernels (dK / dV): block = (b * nheads_kv + h_kv) * num_n_blocks + n_block.
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

// Work tile k of block i on a persistent grid of G blocks (flash_fwd_sm90_ws.cu PERSISTENT), as a
// block index of query_block's mapping (bh * num_m + the query block counted from the last); n_work
// = num_m * bh_count once past the last. Tile t = k G + i, or k G + G - 1 - i in odd rounds (a snake:
// the blocks that took the longest tiles of one round take the shortest of the next). Tiles t run
// over groups of hg = ceil(G / num_m) heads (the blocks running together share K / V in L2), inside a
// group query block by query block from the last (the longest causal one), head by head.
__device__ __forceinline__ unsigned persistent_tile(int k, unsigned i, unsigned G, int num_m, unsigned bh_count) {
    const unsigned n_work = (unsigned)num_m * bh_count;
    const unsigned t = (unsigned)k * G + ((k & 1) ? G - 1 - i : i);
    if (t >= n_work) return n_work;
    const unsigned hg = max(1u, (G + (unsigned)num_m - 1) / (unsigned)num_m);
    const unsigned grp = t / (hg * num_m), w = t % (hg * num_m);
    const unsigned heads = min(hg, bh_count - grp * hg);
    return (grp * hg + w % heads) * num_m + w / heads;
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
// (batch, kv head)s are taken in groups of `group` (the last group may be smaller); inside a group,
// tile t is key block t / heads of (batch, kv head) first + t % heads. So the blocks running at one
// time share the Q and dO of a few heads (the host picks group * num_n_blocks near the SM count: their
// Q and dO stay in L2, read from memory once), and within a group every head's first key block comes
// first: under causal masking the longest (every query block sees it), so a persistent grid, which
// takes tiles t = blockIdx.x, + gridDim.x, ..., starts the longest work of each group first.
template <int BLOCK_M, int BLOCK_N, bool IS_CAUSAL>
__device__ __forceinline__ KeyBlock key_block_grouped(unsigned tile, int num_n_blocks, int nheads_kv, int batch,
                                                      int group, int sq, int sk) {
    const unsigned bh_count = (unsigned)batch * (unsigned)nheads_kv;
    const unsigned per_group = (unsigned)group * (unsigned)num_n_blocks;
    const unsigned gi = tile / per_group, first = gi * (unsigned)group;
    const unsigned heads = min((unsigned)group, bh_count - first);
    const unsigned within = tile - gi * per_group;
    const unsigned block = (first + within % heads) * (unsigned)num_n_blocks + within / heads;
    return key_block<BLOCK_M, BLOCK_N, IS_CAUSAL>(block, num_n_blocks, nheads_kv, sq, sk);
}

}  // namespace cuflash
