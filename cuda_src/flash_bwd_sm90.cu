// flash_bwd_sm90.cu: the dK / dV (and dQ) kernel of the backward for Hopper (sm_90a), on wgmma.
//
// Same partition and notation as flash_bwd.cu's flash_bwd_dkdv_kernel (read that file's header
// first): one block per (key block, kv head, batch); K and V of its BLOCK_N keys stay in shared
// memory, dK and dV in registers; it loops over the query heads of its GQA group and the query
// blocks of BLOCK_M rows that see its keys, with Q, dO, lse and delta double-buffered by cp.async.
// The preprocess, dQ-conversion and deterministic dQ kernels of flash_bwd.cu are used unchanged.
//
// Warps. BLOCK_N / 64 warpgroups; warpgroup w owns keys [64 w, 64 w + 64) of the block. Per query
// block, each warpgroup runs five wgmma products (m64, k16 steps):
//   S^T  = K Q^T      n = BLOCK_M, A = K (K-major), B = Q (K-major), both from shared memory
//   dP^T = V dO^T     n = BLOCK_M, A = V, B = dO, likewise
//   P^T  = exp2(S^T * scale_log2 - lse[q] * log2(e)),  dS^T = P^T * (dP^T - delta[q])  (registers;
//          lse is read from the forward's array, not from the preprocess's lse_log2 rows)
//   dV  += P^T dO     n = HEAD_DIM, A = P^T from registers, B = dO read MN-major
//   dK  += dS^T Q     n = HEAD_DIM, A = dS^T from registers, B = Q read MN-major
// and with ATOMIC_DQ, after dS^T is stored to shared memory (sdS, keys x queries):
//   dQ_part = dS K    m = BLOCK_M queries, n = HEAD_DIM / warpgroups (warpgroup w takes columns
//                     [w n, w n + n)), A = dS read MN-major, B = K read MN-major; the result is added
//                     into the float scratch dq_accum with vector reductions (red.global.add.v2.f32).
// P and dS never leave registers for dV and dK; nothing of size seqlen_q x seqlen_k reaches device
// memory. dV / dK issue before the dQ product and run while the block meets at the barrier that
// publishes sdS.
//
// Shared memory, all in the SW128 panel layout of wgmma_util.cuh: sK, sV (BLOCK_N x HEAD_DIM),
// sQ[2], sdO[2] (BLOCK_M x HEAD_DIM), sdS (BLOCK_N x BLOCK_M), then sLse[2], sDelta[2] (BLOCK_M
// floats). The epilogue writes dV and dK out through sV and sK.
//
// Grid: 1-D, blockIdx.x = (b * nheads_kv + h_kv) * num_blocks + key block.
//
// TMA (template flag TMA, plain calls; CUFLASH_BWD_TMA=1, docs/hopper_plan.md; compile-gated, not
// yet run on a GPU when written): K, V, and each query block's Q and dO tiles come through TMA
// copies (tma.cuh) instead of cp.async from every thread; lse and delta rows stay on cp.async. The
// Params are then BwdTmaParams (the maps of Q and dO with BLOCK_M-row boxes, K and V with BLOCK_N
// rows; rows past the tensors arrive as zeros, as cp.async's zero-fill gave them). Three mbarriers
// follow sDelta: one for K and V, one per Q / dO stage. Thread 0 arms a stage's barrier with both
// tiles' bytes and issues one copy per 64-column panel right after the loop-top barrier that frees
// the stage; every thread waits on the stage's phase (iteration it: parity (it / 2) % 2) before that
// barrier, and on K and V's before the loop.
#include "blocks.cuh"
#include "bwd_sm90_steps.cuh"
#include "bwd_tma_params.cuh"
#include "common.cuh"
#include "params.cuh"
#include "tma.cuh"
#include "wgmma.cuh"
#include "wgmma_util.cuh"

namespace cuflash {

template <bool TMA> struct BwdSm90ParamsOf { using type = BwdParams; };
template <> struct BwdSm90ParamsOf<true> { using type = BwdTmaParams; };

template <int HEAD_DIM, int BLOCK_M, int BLOCK_N>
struct BwdSm90Traits {
    static constexpr int WARPGROUPS = BLOCK_N / 64;
    static constexpr int THREADS = WARPGROUPS * 128;
    static constexpr int DQ_N = HEAD_DIM / WARPGROUPS;  // dQ columns per warpgroup
    static constexpr int SKV_BYTES = BLOCK_N * HEAD_DIM * 2;
    static constexpr int SQ_BYTES = BLOCK_M * HEAD_DIM * 2;
    static constexpr int SDS_BYTES = BLOCK_N * BLOCK_M * 2;
    // sK, sV, sQ[2], sdO[2], sdS, sLse[2], sDelta[2], plus 1024 bytes of alignment slack.
    // Must equal cuflash/_config.py:bwd_smem_bytes for a wgmma config.
    static constexpr int SMEM_BYTES = 2 * SKV_BYTES + 4 * SQ_BYTES + SDS_BYTES + 4 * BLOCK_M * 4 + 1024;
    static constexpr int TMA_BAR_BYTES = 64;  // the TMA variant's three mbarriers, after sDelta

    static_assert(HEAD_DIM % 64 == 0 && HEAD_DIM <= 128, "head_dim: 64 or 128");
    // BLOCK_M = 64: one m64 tile of queries for dQ, split over the warpgroups by columns.
    static_assert(BLOCK_M == 64 && BLOCK_N % 64 == 0, "tile shape");
    static_assert(DQ_N % 16 == 0, "dQ columns per warpgroup");
};

// f(i, query, lse_log2, delta) for each score element i = 4 j + e of a warp's (16 keys, BLOCK_M
// queries) tile: query q0 + 8 j + e % 2, lse_log2 / delta of that query from shared memory.
template <int BLOCK_M, typename F>
__device__ __forceinline__ void each_score(u32 lse_s, u32 dlt_s, int q0, F&& f) {
#pragma unroll
    for (int j = 0; j < BLOCK_M / 8; ++j) {
        const float2 l2 = ld_shared_f32x2(lse_s + 32 * j);
        const float2 dl = ld_shared_f32x2(dlt_s + 32 * j);
#pragma unroll
        for (int e = 0; e < 4; ++e) f(4 * j + e, q0 + 8 * j + (e % 2), e % 2 ? l2.y : l2.x, e % 2 ? dl.y : dl.x);
    }
}

// The plain kernel's own expressions when !F (the FEAT additions then leave its code untouched).
template <bool F>
__device__ __forceinline__ i64 row_offset(i64 row0, int r) {
    if constexpr (F) return row0 + r;
    else return (i64)r;
}
template <bool F>
__device__ __forceinline__ int pick(int feat_value, int plain_value) {
    if constexpr (F) return feat_value;
    else return plain_value;
}

__device__ __forceinline__ void red_add_v2(float* addr, float a, float b) {
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" :: "l"(addr), "f"(a), "f"(b) : "memory");
}

template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, bool IS_CAUSAL, bool IS_EVEN, bool ATOMIC_DQ,
          bool FEAT = false, bool TMA = false>
__global__ void __launch_bounds__(BLOCK_N / 64 * 128, 1)
flash_bwd_dkdv_sm90_kernel(const __grid_constant__ typename BwdSm90ParamsOf<TMA>::type p) {
    using Tr = BwdSm90Traits<HEAD_DIM, BLOCK_M, BLOCK_N>;
    static_assert(!(TMA && FEAT), "the TMA variant serves plain calls (its maps know no sequence lengths)");
    using Ops = ElemOps<T>;
    constexpr int THREADS = Tr::THREADS;
    constexpr int Q_STEPS = BLOCK_M / 16, N_STEPS = BLOCK_N / 16;

    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const u32 raw_addr = smem_addr(smem_raw);
    const u32 sK = (raw_addr + 1023u) & ~1023u;
    const u32 sV = sK + Tr::SKV_BYTES;
    const u32 sQ = sV + Tr::SKV_BYTES;
    const u32 sdO = sQ + 2 * Tr::SQ_BYTES;
    const u32 sdS = sdO + 2 * Tr::SQ_BYTES;
    const u32 sRows = sdS + Tr::SDS_BYTES;  // sLse[2][BLOCK_M], then sDelta[2][BLOCK_M] (floats)
    // TMA: the mbarriers of K and V, and of Q / dO stages 0 and 1.
    const u32 bar_kv = sRows + 4 * BLOCK_M * 4;
    auto bar_q = [&](int stage) { return bar_kv + 8u + 8u * (u32)stage; };

    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int wg = warp / 4, g = lane / 4, t = lane % 4;
    if (tid == 0 && dynamic_smem_bytes() < (u32)(Tr::SMEM_BYTES + (TMA ? Tr::TMA_BAR_BYTES : 0))) __trap();

    const int sq = p.seqlen_q, sk = p.seqlen_k;
    const KeyBlock blk = key_block<BLOCK_M, BLOCK_N, IS_CAUSAL>(blockIdx.x, p.num_blocks, p.nheads_kv, sq, sk);
    const int h_kv = blk.h_kv, b = blk.b, n0 = blk.n0;
    int m_begin = blk.m_begin, m_iters = blk.m_iters;

    // With FEAT (mask.cuh): the sequence, its mask, and the query blocks
    // whose rows may see these keys. A block past its sequence runs no iteration and writes nothing
    // (no early return: a branch around the wgmma code would serialize it).
    SeqInfo si;
    MaskInfo mi;
    int q_valid = sq, k_valid = sk;
    bool score_mod = false;
    if constexpr (FEAT) {
        static_assert(!IS_CAUSAL && !IS_EVEN, "FEAT kernels: masks are run-time");
        si = seq_info(p.mask, b, sq, sk);
        mi.init(p.mask, si, b, h_kv * p.head_group);
        query_range<BLOCK_M, BLOCK_N>(p.mask, mi, n0, m_begin, m_iters);
        q_valid = si.sq;
        k_valid = si.sk;
        score_mod = p.mask.softcap > 0.f || p.mask.alibi_slopes != nullptr;
    } else {
        si.q_row0 = si.k_row0 = 0;
    }
    const int iters = m_iters * p.head_group;

    const u16* gK = static_cast<const u16*>(p.k) + b * p.k_batch_stride + h_kv * p.k_head_stride + row_offset<FEAT>(si.k_row0, n0) * p.k_row_stride;
    const u16* gV = static_cast<const u16*>(p.v) + b * p.v_batch_stride + h_kv * p.v_head_stride + row_offset<FEAT>(si.k_row0, n0) * p.v_row_stride;

    auto load_q_tiles = [&](int it) {
        const int hq = h_kv * p.head_group + it / m_iters;
        const int m0 = (m_begin + it % m_iters) * BLOCK_M;
        const int st = it % 2;
        const u16* gQ = static_cast<const u16*>(p.q) + b * p.q_batch_stride + hq * p.q_head_stride + row_offset<FEAT>(si.q_row0, m0) * p.q_row_stride;
        const u16* gdO = static_cast<const u16*>(p.dout) + b * p.do_batch_stride + hq * p.do_head_stride + row_offset<FEAT>(si.q_row0, m0) * p.do_row_stride;
        if constexpr (TMA) {
            // Q and dO by one thread's copies (both on the stage's barrier); the rows below as before.
            if (tid == 0) {
                mbar_arrive_expect_tx(bar_q(st), 2 * Tr::SQ_BYTES);
#pragma unroll
                for (int c = 0; c < HEAD_DIM / 64; ++c) {
                    tma_load_4d(sQ + st * Tr::SQ_BYTES + c * BLOCK_M * 128, &p.map_q, bar_q(st), c * 64, m0, hq, b);
                    tma_load_4d(sdO + st * Tr::SQ_BYTES + c * BLOCK_M * 128, &p.map_do, bar_q(st), c * 64, m0, hq, b);
                }
            }
        } else {
            load_tile_sw128<HEAD_DIM, BLOCK_M, THREADS, !IS_EVEN>(sQ + st * Tr::SQ_BYTES, gQ, p.q_row_stride, pick<FEAT>(q_valid, sq) - m0, tid);
            load_tile_sw128<HEAD_DIM, BLOCK_M, THREADS, !IS_EVEN>(sdO + st * Tr::SQ_BYTES, gdO, p.do_row_stride, pick<FEAT>(q_valid, sq) - m0, tid);
        }
        // lse straight from the forward's (batch, nheads, seqlen_q) array, 4 bytes a row, rows past
        // seqlen_q zero-filled; delta from the padded scratch, 16 bytes at a time. FEAT reads the
        // preprocess's lse * log2(e) scratch instead (+inf on padding rows: P = 0 there).
        const i64 bhq = (i64)b * p.nheads + hq;
        if (FEAT && tid < BLOCK_M / 4) {
            cp_async_16(sRows + (st * BLOCK_M + 4 * tid) * 4, p.lse_log2 + bhq * p.seqlen_q_pad + m0 + 4 * tid, 16);
        } else if (FEAT && tid >= BLOCK_M && tid < BLOCK_M + BLOCK_M / 4) {
            const int c = tid - BLOCK_M;
            cp_async_16(sRows + ((2 + st) * BLOCK_M + 4 * c) * 4, p.delta + bhq * p.seqlen_q_pad + m0 + 4 * c, 16);
        } else if (FEAT) {
        } else if (tid < BLOCK_M) {
            const bool ok = m0 + tid < sq;
            cp_async_4(sRows + (st * BLOCK_M + tid) * 4, p.lse + (ok ? bhq * sq + m0 + tid : 0), ok ? 4 : 0);
        } else if (tid < BLOCK_M + BLOCK_M / 4) {
            const int c = tid - BLOCK_M;
            cp_async_16(sRows + ((2 + st) * BLOCK_M + 4 * c) * 4, p.delta + bhq * p.seqlen_q_pad + m0 + 4 * c, 16);
        }
    };

    if constexpr (TMA) {
        if (tid == 0) {
            tma_prefetch_desc(&p.map_q);
            tma_prefetch_desc(&p.map_do);
            mbar_init(bar_kv, 1);
            mbar_init(bar_q(0), 1);
            mbar_init(bar_q(1), 1);
            fence_mbar_init();
        }
        __syncthreads();  // the barriers are initialized before anyone waits on them or a copy lands
        if (tid == 0) {
            mbar_arrive_expect_tx(bar_kv, 2 * Tr::SKV_BYTES);
#pragma unroll
            for (int c = 0; c < HEAD_DIM / 64; ++c) {
                tma_load_4d(sK + c * BLOCK_N * 128, &p.map_k, bar_kv, c * 64, n0, h_kv, b);
                tma_load_4d(sV + c * BLOCK_N * 128, &p.map_v, bar_kv, c * 64, n0, h_kv, b);
            }
        }
    } else {
        load_tile_sw128<HEAD_DIM, BLOCK_N, THREADS, !IS_EVEN>(sK, gK, p.k_row_stride, pick<FEAT>(k_valid, sk) - n0, tid);
        load_tile_sw128<HEAD_DIM, BLOCK_N, THREADS, !IS_EVEN>(sV, gV, p.v_row_stride, pick<FEAT>(k_valid, sk) - n0, tid);
    }
    if (iters > 0) load_q_tiles(0);
    cp_async_commit();
    // TMA: K and V are in before anything reads them, and before the epilogue writes dK / dV through
    // their tiles (also when no query block sees these keys).
    if constexpr (TMA) mbar_wait(bar_kv, 0);

    float acc_dv[HEAD_DIM / 2], acc_dk[HEAD_DIM / 2];
#pragma unroll
    for (int i = 0; i < HEAD_DIM / 2; ++i) { acc_dv[i] = 0.f; acc_dk[i] = 0.f; }

    const int key_row0 = wg * 64 + (warp % 4) * 16;  // this warp's first key inside the block
    const bool key_ok[2] = {n0 + key_row0 + g < sk, n0 + key_row0 + g + 8 < sk};
    const int diag_base = 2 * t + sk - sq - n0 - key_row0 - g;
    const u32 sK_wg = sK + wg * 64 * 128;
    const u32 sV_wg = sV + wg * 64 * 128;

    for (int it = 0; it < iters; ++it) {
        cp_async_wait<0>();
        fence_proxy_async();
        if constexpr (TMA) mbar_wait(bar_q(it % 2), (it >> 1) & 1);  // Q and dO of `it`
        __syncthreads();  // tiles of `it` landed; iteration it - 1 is finished everywhere
        if (it + 1 < iters) load_q_tiles(it + 1);
        cp_async_commit();
        const int st = it % 2;
        const int hq = h_kv * p.head_group + it / m_iters;
        const int m0 = (m_begin + it % m_iters) * BLOCK_M;
        const u32 sQs = sQ + st * Tr::SQ_BYTES, sdOs = sdO + st * Tr::SQ_BYTES;
        const u32 sK_it = opaque(sK_wg), sV_it = opaque(sV_wg);

        // ---- S^T = K Q^T, dP^T = V dO^T: (64 keys, BLOCK_M queries) per warpgroup ----
        float s[BLOCK_M / 2], dp[BLOCK_M / 2];
        wgmma_fence();
        wgmma_ss_kmajor<T, BLOCK_M, HEAD_DIM, BLOCK_N, BLOCK_M>(s, sK_it, sQs);
        wgmma_ss_kmajor<T, BLOCK_M, HEAD_DIM, BLOCK_N, BLOCK_M>(dp, sV_it, sdOs);
        wgmma_commit();
        wgmma_wait<0>();
        fence_regs(s);
        fence_regs(dp);

        // ---- P^T and dS^T, element-wise; mask only tiles that cross the causal diagonal or sk ----
        const bool tail = !IS_EVEN && n0 + BLOCK_N > sk;
        const bool diag = IS_CAUSAL && n0 + key_row0 + 15 > m0 + sk - sq;
        const u32 lse_s = sRows + (st * BLOCK_M + 2 * t) * 4;
        const u32 dlt_s = sRows + ((2 + st) * BLOCK_M + 2 * t) * 4;
        // Element (key n0 + key_row0 + g + 8 (e / 2), query m0 + 8 j + 2 t + e % 2) is masked iff its
        // key is past sk (key_ok) or 8 (e / 2) - 8 j - e % 2 > diag_lim (above the diagonal): the
        // per-element test is a compile-time constant against one register.
        const int diag_lim = m0 + diag_base;
        u32 pa[Q_STEPS][4], da[Q_STEPS][4];  // P^T and dS^T as wgmma A fragments, one per k16 step
        bool slow = false, edge = false;  // FEAT: this warp's 16 keys x BLOCK_M queries
        if constexpr (FEAT) {
            mi.set_head(p.mask, b, hq);
            edge = mi.needs_mask(p.mask, m0, BLOCK_M, n0 + key_row0, 16);
            slow = score_mod || edge;
        }
        QuerySpan qs[2];  // FEAT: the query spans of this thread's two keys (used on edge tiles)
        if constexpr (FEAT) {
            qs[0] = mi.query_span(p.mask, n0 + key_row0 + g);
            qs[1] = mi.query_span(p.mask, n0 + key_row0 + g + 8);
        }
        if constexpr (FEAT) {
            // One of three element loops, chosen once per tile: the plain one (no bound crosses
            // this warp's keys x queries and no softcap / ALiBi), the mask only, or logits in log2
            // units (softcap, ALiBi) and the mask. lse_log2 comes from the scratch (+inf for padding
            // rows: P = 0 there).
            const int q0 = m0 + 2 * t;
            if (!slow) {
                each_score<BLOCK_M>(lse_s, dlt_s, q0, [&](int i, int, float l2, float dl) {
                    s[i] = fast_exp2(fminf(fmaf(s[i], p.scale_log2, -l2), 0.f));  // P <= 1 (flash_bwd.cu)
                    dp[i] = s[i] * (dp[i] - dl);
                });
            } else if (!score_mod) {
                each_score<BLOCK_M>(lse_s, dlt_s, q0, [&](int i, int query, float l2, float dl) {
                    s[i] = qs[(i % 4) / 2].has(query) ? fast_exp2(fminf(fmaf(s[i], p.scale_log2, -l2), 0.f)) : 0.f;
                    dp[i] = s[i] * (dp[i] - dl);
                });
            } else if (p.mask.softcap == 0.f) {
                // ALiBi alone: distances from one conversion per key (mask.cuh alibi_logit_log2).
                const int d_key = q0 + mi.shift - (n0 + key_row0 + g);
                const float d0[2] = {(float)d_key, (float)(d_key - 8)};
                // The exponent s scale - A |d| - lse as fma(s, scale, -fma(A, |d|, lse)): three
                // instructions an element (|d| is an operand modifier), where mask.cuh's
                // alibi_logit_log2 followed by - lse takes four.
                // (The mask's test only on tiles a bound crosses: elsewhere it cost integer work per
                // element for nothing.)
                auto p_alibi = [&](int i, float l2) {
                    const float r = fmaf(mi.alibi_log2, fabsf(d0[(i % 4) / 2] + (float)(8 * (i / 4) + i % 2)), l2);
                    return fast_exp2(fminf(fmaf(s[i], p.scale_log2, -r), 0.f));
                };
                if (edge) {
                    each_score<BLOCK_M>(lse_s, dlt_s, q0, [&](int i, int query, float l2, float dl) {
                        s[i] = qs[(i % 4) / 2].has(query) ? p_alibi(i, l2) : 0.f;
                        dp[i] = s[i] * (dp[i] - dl);
                    });
                } else {
                    each_score<BLOCK_M>(lse_s, dlt_s, q0, [&](int i, int, float l2, float dl) {
                        s[i] = p_alibi(i, l2);
                        dp[i] = s[i] * (dp[i] - dl);
                    });
                }
            } else {
                each_score<BLOCK_M>(lse_s, dlt_s, q0, [&](int i, int query, float l2, float dl) {
                    const int key = n0 + key_row0 + g + ((i % 4) / 2) * 8;
                    float tanh_s;
                    const float x = mi.logit_log2(p.mask, p.scale_log2, s[i], query, key, tanh_s);
                    s[i] = (edge && !qs[(i % 4) / 2].has(query)) ? 0.f : fast_exp2(fminf(x - l2, 0.f));
                    // softcap: d logit / d s = 1 - tanh^2 (tanh_s = 0 without softcap)
                    dp[i] = s[i] * (dp[i] - dl) * (1.f - tanh_s * tanh_s);
                });
            }
#pragma unroll
            for (int j = 0; j < BLOCK_M / 8; ++j) {
                // n8 tile j is half of k16 step j / 2: registers 2 (j % 2) and 2 (j % 2) + 1 of it.
                const int kk = j / 2, r = 2 * (j % 2);
                pa[kk][r] = Ops::pack(s[4 * j], s[4 * j + 1]);
                pa[kk][r + 1] = Ops::pack(s[4 * j + 2], s[4 * j + 3]);
                da[kk][r] = Ops::pack(dp[4 * j], dp[4 * j + 1]);
                da[kk][r + 1] = Ops::pack(dp[4 * j + 2], dp[4 * j + 3]);
            }
        } else {
#pragma unroll
        for (int j = 0; j < BLOCK_M / 8; ++j) {
            // lse -> lse * log2(e). A query that sees no key (lse = -inf) exists only under causal
            // with seqlen_q > seqlen_k, and every tile holding it crosses the diagonal, where the
            // mask below overwrites its P (+inf here) with 0. Rows past seqlen_q read lse = 0 and have
            // Q = dO = 0, delta = 0: P = 1 but dS = 0, so they add nothing to dV (dO = 0) or dK, and
            // their dQ rows are scratch padding.
            float2 l2 = ld_shared_f32x2(lse_s + 32 * j);
            l2.x *= CUFLASH_LOG2E;
            l2.y *= CUFLASH_LOG2E;
            const float2 dl = ld_shared_f32x2(dlt_s + 32 * j);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int i = 4 * j + e;
                float pv = fast_exp2(fminf(fmaf(s[i], p.scale_log2, -(e % 2 ? l2.y : l2.x)), 0.f));  // P <= 1
                if (tail || diag) {
                    bool masked = !key_ok[e / 2];
                    if (IS_CAUSAL) masked = masked || (e / 2) * 8 - 8 * j - (e % 2) > diag_lim;
                    if (masked) pv = 0.f;
                }
                s[i] = pv;
                dp[i] = pv * (dp[i] - (e % 2 ? dl.y : dl.x));
            }
            // n8 tile j is half of k16 step j / 2: registers 2 (j % 2) and 2 (j % 2) + 1 of it.
            const int kk = j / 2, r = 2 * (j % 2);
            pa[kk][r] = Ops::pack(s[4 * j], s[4 * j + 1]);
            pa[kk][r + 1] = Ops::pack(s[4 * j + 2], s[4 * j + 3]);
            da[kk][r] = Ops::pack(dp[4 * j], dp[4 * j + 1]);
            da[kk][r + 1] = Ops::pack(dp[4 * j + 2], dp[4 * j + 3]);
        }
        }

        if (ATOMIC_DQ) {
            ds_to_smem<Q_STEPS, BLOCK_N>(sdS, key_row0 + g, t, da);  // dS^T into sdS (keys x queries)
        }

        // ---- dV += P^T dO, dK += dS^T Q ----
        wgmma_fence();
        wgmma_rs_mnmajor<T, HEAD_DIM, Q_STEPS, BLOCK_M>(acc_dv, pa, sdOs);
        wgmma_rs_mnmajor<T, HEAD_DIM, Q_STEPS, BLOCK_M>(acc_dk, da, sQs);
        wgmma_commit();

        if (ATOMIC_DQ) {
            fence_proxy_async();
            __syncthreads();  // all of dS^T is in sdS
            // dV / dK ran during the barrier; waiting for them here frees the P^T / dS^T registers
            // before the dQ accumulators go live (with both live, head_dim 128 spills).
            wgmma_wait<0>();
            fence_regs(acc_dv);
            fence_regs(acc_dk);
            float dq[Tr::DQ_N / 2];
            // B = K, columns [wg * DQ_N, ...): a whole panel, or half of one (start 64 bytes in).
            const u32 k_cols = (wg * Tr::DQ_N / 64) * BLOCK_N * 128 + (wg * Tr::DQ_N % 64) * 2;
#pragma unroll
            for (int kk = 0; kk < N_STEPS; ++kk)
                Wgmma<T, Tr::DQ_N>::template ss<1, 1>(dq, make_smem_desc(opaque(sdS) + kk * 2048, BLOCK_N * 128, 1024),
                                                      make_smem_desc(opaque(sK) + k_cols + kk * 2048, BLOCK_N * 128, 1024),
                                                      kk > 0);
            wgmma_commit();
            wgmma_wait<0>();
            fence_regs(dq);
            float* acc = p.dq_accum + (((i64)b * p.nheads + hq) * p.seqlen_q_pad + m0) * HEAD_DIM + wg * Tr::DQ_N;
            const int qrow = (warp % 4) * 16 + g;
#pragma unroll
            for (int j = 0; j < Tr::DQ_N / 8; ++j) {
                red_add_v2(acc + qrow * HEAD_DIM + 8 * j + 2 * t, dq[4 * j], dq[4 * j + 1]);
                red_add_v2(acc + (qrow + 8) * HEAD_DIM + 8 * j + 2 * t, dq[4 * j + 2], dq[4 * j + 3]);
            }
        } else {
            wgmma_wait<0>();
        }
        fence_regs(acc_dv);
        fence_regs(acc_dk);
    }
    cp_async_wait<0>();
    __syncthreads();  // every product is done: dV and dK go out through sV and sK

    // ---- epilogue: dV, dK = scale * dK, this warp's 16 keys, in the input dtype ----
    {
        // Thread coordinates again, from an opaque copy of the thread index: nothing derived from it
        // has to survive the main loop in a register (such values were spilled at head_dim 128).
        const int tid = (int)opaque(threadIdx.x), lane = tid % 32, warp = tid / 32;
        const int g = lane / 4, t = lane % 4;
        const int key_row0 = (warp / 4) * 64 + (warp % 4) * 16;
        // Likewise the block's coordinates (their 64-bit products with strides were held across the loop).
        const KeyBlock eblk = key_block<BLOCK_M, BLOCK_N, IS_CAUSAL>(opaque(blockIdx.x), p.num_blocks, p.nheads_kv,
                                                                     p.seqlen_q, p.seqlen_k);
        const int n0 = eblk.n0, h_kv = eblk.h_kv, b = eblk.b;
        i64 k_row0 = 0;
        int k_rows = p.seqlen_k;  // keys this block writes
        if constexpr (FEAT) {
            const SeqInfo esi = seq_info(p.mask, b, p.seqlen_q, p.seqlen_k);
            k_row0 = esi.k_row0;
            k_rows = esi.k_rows;
        }
        dkdv_rows_to_smem<Ops, HEAD_DIM, BLOCK_N>(sK, sV, acc_dk, acc_dv, p.scale, key_row0, g, t);
        __syncwarp();
        T* gdK = static_cast<T*>(p.dk) + b * p.dk_batch_stride + h_kv * p.dk_head_stride + row_offset<FEAT>(k_row0, n0) * p.dk_row_stride;
        T* gdV = static_cast<T*>(p.dv) + b * p.dv_batch_stride + h_kv * p.dv_head_stride + row_offset<FEAT>(k_row0, n0) * p.dv_row_stride;
        dkdv_rows_to_global<T, HEAD_DIM, BLOCK_N, IS_EVEN>(gdK, gdV, p.dk_row_stride, p.dv_row_stride, sK, sV, key_row0,
                                                           lane, n0, k_rows);
    }
}

}  // namespace cuflash
