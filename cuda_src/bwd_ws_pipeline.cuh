// bwd_ws_pipeline.cuh: what the two warp-specialized sm_90a backward kernels share
// (flash_bwd_sm90_ws.cu, flash_bwd_sm90_ws256.cu): the mbarriers' places and initialization, the
// query blocks a key block visits, and the producer warp. The barrier protocol is described at the
// top of flash_bwd_sm90_ws.cu; both kernels follow it.
//
// Barriers at s_bar (8 bytes each): kv_full, kv_empty, full[STAGES], empty[STAGES]. Rows at sRows:
// sLse[STAGES][BLOCK_M], then sDelta[STAGES][BLOCK_M] (floats). Shared tiles are SW128 panels
// (wgmma_util.cuh): K and V of BLOCK_N rows, each stage's Q and dO of BLOCK_M rows.
#pragma once
#include "blocks.cuh"
#include "bwd_tma_params.cuh"
#include "common.cuh"
#include "params.cuh"
#include "tma.cuh"
#include "wgmma_util.cuh"

namespace cuflash {

template <int STAGES, int BLOCK_M>
struct BwdWsBars {
    u32 s_bar, s_rows;
    __device__ __forceinline__ u32 kv_full() const { return s_bar; }
    __device__ __forceinline__ u32 kv_empty() const { return s_bar + 8u; }
    __device__ __forceinline__ u32 full(int s) const { return s_bar + 8u * (u32)(2 + s); }
    __device__ __forceinline__ u32 empty(int s) const { return s_bar + 8u * (u32)(2 + STAGES + s); }
    __device__ __forceinline__ u32 lse_row(int s) const { return s_rows + (u32)(s * BLOCK_M) * 4u; }
    __device__ __forceinline__ u32 dlt_row(int s) const { return s_rows + (u32)((STAGES + s) * BLOCK_M) * 4u; }

    // Thread 0: kv_full (count 1), kv_empty (8: a consumer warp each), full[s] (32: the producer's
    // lanes), empty[s] (8). The caller synchronizes the block afterwards.
    __device__ __forceinline__ void init() const {
        mbar_init(kv_full(), 1);
        mbar_init(kv_empty(), 8);
#pragma unroll
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(full(s), 32);
            mbar_init(empty(s), 8);
        }
        fence_mbar_init();
    }
};

// The query blocks [m_begin, m_begin + m_iters) a key block visits: the causal range of key_block, or
// with FEAT those whose rows may see one of its keys (query_range); mi gets the (sequence, kv head)'s
// mask (a padded batch's entry b with no lengths: the whole tensors).
template <bool FEAT, int BLOCK_M, int BLOCK_N>
__device__ __forceinline__ void ws_query_blocks(const BwdTmaParams& p, const KeyBlock& blk, int& m_begin, int& m_iters,
                                                MaskInfo& mi, SeqInfo& si) {
    m_begin = blk.m_begin;
    m_iters = blk.m_iters;
    si.q_row0 = si.k_row0 = 0;
    if constexpr (FEAT) {
        si = seq_info(p.mask, blk.b, p.seqlen_q, p.seqlen_k);
        mi.init(p.mask, si, blk.b, blk.h_kv * p.head_group);
        query_range<BLOCK_M, BLOCK_N>(p.mask, mi, blk.n0, m_begin, m_iters);
    }
}

// One tile of the warp-specialized backwards (blocks.cuh key_block_grouped's order), as the producer
// and both consumers see it: the key block, the query blocks it visits (ws_query_blocks; iters =
// m_iters x the query heads of its GQA group), the mask and the sequence. skip (SEQS): a packed
// batch's key block past its sequence's keys, which has nothing to compute or write; producer and
// consumers skip it by this same test, so their tile counts stay in step.
struct WsTile {
    KeyBlock blk;
    int m_begin, m_iters, iters;
    MaskInfo mi;
    SeqInfo si;
    bool skip;
};

template <bool FEAT, bool SEQS, int BLOCK_M, int BLOCK_N, bool IS_CAUSAL>
__device__ __forceinline__ WsTile ws_tile(const BwdTmaParams& p, int tile) {
    WsTile w;
    w.blk = key_block_grouped<BLOCK_M, BLOCK_N, IS_CAUSAL>(tile, p.num_blocks, p.nheads_kv, p.batch, p.tile_heads, p.tail_heads,
                                                          p.seqlen_q, p.seqlen_k);
    ws_query_blocks<FEAT, BLOCK_M, BLOCK_N>(p, w.blk, w.m_begin, w.m_iters, w.mi, w.si);
    w.iters = w.m_iters * p.head_group;
    w.skip = SEQS && w.blk.n0 >= w.si.k_rows;
    return w;
}

// FEAT, one consumer warp's step over keys [key0, key0 + 16) and queries [q0, q0 + rows): whether a
// mask bound crosses that tile (edge: the element-wise mask is needed), the queries that see the
// thread's two keys key0 + g and key0 + g + 8 (qs), and with ALiBi the slope of the step's query head
// (set in mi) and the key distances of query q0 + 2 t (d0; the element's adds 8 j + e % 2). Formed at
// each step, not held across the products (registers).
struct WsFeatStep {
    bool edge, alibi;
    QuerySpan qs[2];
    float d0[2];
};

template <bool FEAT>
__device__ __forceinline__ WsFeatStep ws_feat_step(const BwdTmaParams& p, MaskInfo& mi, int q0, int rows, int key0,
                                                   int g, int t, int b, int head) {
    WsFeatStep f;
    f.edge = f.alibi = false;
    f.d0[0] = f.d0[1] = 0.f;
    if constexpr (FEAT) {
        f.edge = mi.needs_mask(p.mask, q0, rows, key0, 16);
        f.qs[0] = mi.query_span(p.mask, key0 + g);
        f.qs[1] = mi.query_span(p.mask, key0 + g + 8);
        f.alibi = p.mask.alibi_slopes != nullptr;
        if (f.alibi) {
            mi.set_head(p.mask, b, head);
            const int d = q0 + 2 * t + mi.shift - (key0 + g);
            f.d0[0] = (float)d;
            f.d0[1] = (float)(d - 8);
        }
    }
    return f;
}

// SEQS: rows [valid, ROWS) of two SW128 tiles (K and V, or Q and dO) set to zero by one consumer's
// 128 threads (tw = the thread's index in it), fenced for the async proxy and synchronized on the
// consumer's named barrier `bar`. Rows past a sequence arrive as they are in memory (another
// sequence's, padding, a packed batch's tail: anything, NaN included); zeroed, the masked products
// multiply zeros. Both consumers write the same zeros, each before its own products.
template <int HEAD_DIM, int ROWS>
__device__ __forceinline__ void zero_rows_past(u32 a, u32 b, int valid, int tw, int bar) {
    if (valid >= ROWS) return;
    const int from = max(valid, 0);
    zero_rows_sw128<HEAD_DIM, ROWS>(a, from, tw, 128);
    zero_rows_sw128<HEAD_DIM, ROWS>(b, from, tw, 128);
    fence_proxy_async();
    named_barrier_sync(bar, 128);
}

// The producer: warp 0 of warpgroup 0 (lane = its lane). Per tile (blocks.cuh key_block_grouped's
// order, tiles blockIdx.x, + gridDim.x, ...): lane 0 loads K and V once (after the previous tile's
// epilogue released them: kv_empty), then for each iteration (query head, query block) waits for
// its stage to be empty, the 32 lanes copy the rows' lse (0 past seqlen_q) and delta beside it, and
// lane 0 issues Q's and dO's copies. The ring's stages and phases run on across the block's tiles.
// SEQS (with FEAT: per-sequence lengths, a padded or a packed batch): the sequence's rows start at
// its q_row0 / k_row0 (a packed batch's maps see each array as one sequence of all its rows, batch
// coordinate 0), and the lse comes from the preprocess's lse * log2(e) rows, +inf on rows past the
// sequence (so P = 0 there: the forward's lse of a padded row is -inf).
template <int HEAD_DIM, int BLOCK_M, int BLOCK_N, int STAGES, bool IS_CAUSAL, bool FEAT, bool SEQS = false>
__device__ __forceinline__ void bwd_ws_produce(const BwdTmaParams& p, const BwdWsBars<STAGES, BLOCK_M>& bars, int lane,
                                               u32 sK, u32 sV, u32 sQ, u32 sdO) {
    constexpr int SKV_BYTES = BLOCK_N * HEAD_DIM * 2, SQ_BYTES = BLOCK_M * HEAD_DIM * 2;
    const int sq = p.seqlen_q;
    const int num_tiles = p.batch * p.nheads_kv * p.num_blocks;
    if (lane == 0) {
        tma_prefetch_desc(&p.map_q);
        tma_prefetch_desc(&p.map_do);
    }
    int g_base = 0, tcount = 0;
    for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x, ++tcount) {
        const WsTile w = ws_tile<FEAT, SEQS, BLOCK_M, BLOCK_N, IS_CAUSAL>(p, tile);
        if (w.skip) {
            --tcount;
            continue;
        }
        const int h_kv = w.blk.h_kv, b = w.blk.b, n0 = w.blk.n0;
        const int m_begin = w.m_begin, m_iters = w.m_iters, iters = w.iters;
        const SeqInfo& si = w.si;
        const int bmap = SEQS && p.mask.cu_seqlens_q != nullptr ? 0 : b;  // the maps' batch coordinate
        const int q_row0 = SEQS ? (int)si.q_row0 : 0, k_row0 = SEQS ? (int)si.k_row0 : 0;
        // K and V of this tile go where the previous tile's epilogue wrote dK and dV out.
        if (tcount > 0) mbar_wait(bars.kv_empty(), (tcount - 1) & 1);
        if (lane == 0) {
            mbar_arrive_expect_tx(bars.kv_full(), 2 * SKV_BYTES);
#pragma unroll
            for (int c = 0; c < HEAD_DIM / 64; ++c) {
                tma_load_4d(sK + c * BLOCK_N * 128, &p.map_k, bars.kv_full(), c * 64, k_row0 + n0, h_kv, bmap);
                tma_load_4d(sV + c * BLOCK_N * 128, &p.map_v, bars.kv_full(), c * 64, k_row0 + n0, h_kv, bmap);
            }
        }
        for (int it = 0; it < iters; ++it) {
            const int gi = g_base + it;
            const int s = gi % STAGES, u = gi / STAGES;
            if (u > 0) mbar_wait(bars.empty(s), (u - 1) & 1);
            const int hq = h_kv * p.head_group + it / m_iters;
            const int m0 = (m_begin + it % m_iters) * BLOCK_M;
            // lse from the forward's (batch, nheads, seqlen_q) array, 0 past seqlen_q; delta from the
            // padded scratch. Lane l: rows R l .. R l + R - 1, R = BLOCK_M / 32.
            constexpr int R = BLOCK_M / 32;
            const i64 bhq = (i64)b * p.nheads + hq;
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const int row = m0 + R * lane + r;
                float l;
                if constexpr (SEQS)
                    l = p.lse_log2[bhq * p.seqlen_q_pad + row] * CUFLASH_LN2;  // +inf past the sequence
                else
                    l = row < sq ? p.lse[bhq * sq + row] : 0.f;
                const float d = p.delta[bhq * p.seqlen_q_pad + row];
                asm volatile("st.shared.f32 [%0], %1;" :: "r"(bars.lse_row(s) + (R * lane + r) * 4), "f"(l) : "memory");
                asm volatile("st.shared.f32 [%0], %1;" :: "r"(bars.dlt_row(s) + (R * lane + r) * 4), "f"(d) : "memory");
            }
            if (lane == 0) {
                mbar_arrive_expect_tx(bars.full(s), 2 * SQ_BYTES);
#pragma unroll
                for (int c = 0; c < HEAD_DIM / 64; ++c) {
                    tma_load_4d(sQ + s * SQ_BYTES + c * BLOCK_M * 128, &p.map_q, bars.full(s), c * 64, q_row0 + m0, hq,
                                bmap);
                    tma_load_4d(sdO + s * SQ_BYTES + c * BLOCK_M * 128, &p.map_do, bars.full(s), c * 64, q_row0 + m0,
                                hq, bmap);
                }
            } else {
                mbar_arrive(bars.full(s));
            }
        }
        g_base += iters;
    }
}

}  // namespace cuflash
