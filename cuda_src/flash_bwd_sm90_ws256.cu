// flash_bwd_sm90_ws256.cu: the dK / dV / dQ kernel of the backward for Hopper (sm_90a) at head_dim
// 256, warp-specialized: a producer warp loads with TMA, two consumer warpgroups compute on wgmma,
// and dQ goes to the float scratch by vector reductions from registers. Non-deterministic dQ. Plain
// calls (causal or not, any lengths, MQA / GQA) and (FEAT) windows, sinks, ALiBi, and (SEQS)
// per-sequence lengths and packed batches as in flash_bwd_sm90_ws.cu; softcap keeps the mma.sync
// backward.
//
// Why a kernel of its own: flash_bwd_sm90_ws.cu gives each consumer 64 keys and all of head_dim,
// so dK and dV of its keys take HEAD_DIM floats a thread, 256 at head_dim 256: more than the
// register file gives. Here the block holds 64 keys, and the consumers split the work otherwise:
//   - dK, dV by head_dim columns: consumer c accumulates columns [128 c, 128 c + 128) of all 64
//     keys (64 + 64 floats a thread);
//   - S^T and dP^T by queries: consumer c forms them for queries [32 c, 32 c + 32) of the query
//     block (64 keys x 32 queries, K = 256), and writes P^T and dS^T to shared memory, where both
//     consumers read all of them;
//   - dQ by columns: consumer c forms dQ[:, 128 c, 128 c + 128) = dS K[:, those columns].
//
// Algorithm: that of flash_bwd_sm90.cu (read its header first): one block per (key block of 64
// keys, kv head, batch); K and V stay in shared memory, dK and dV in registers; the block loops over
// the query heads of its GQA group and the query blocks of 64 rows that see its keys. Per query
// block, consumer c runs:
//   S^T_c = K Q_c^T, dP^T_c = V dO_c^T      (64 keys x 32 queries; both issued, then P computed while
//                                            dP^T still runs); P^T_c, dS^T_c = P (dP - delta) to sP, sdS
//   named barrier "P, dS": both halves stored
//   dQ_c = dS K[:, cols c]                   (A = sdS read MN-major, 64 queries x 128 columns)
//   dV_c += P^T dO[:, cols c], dK_c += dS^T Q[:, cols c]   (A = sP, sdS, K-major; 64 keys x 128)
//   dQ_c into dq_accum by red.global.add.v4.f32 while dV, dK run.
// Nothing of size seqlen_q x seqlen_k reaches device memory.
//
// Warps: 384 threads, three warpgroups.
//   producer  (warpgroup 0; setmaxnreg.dec 24): warp 0 alone works. Lane 0 issues the TMA copies of K
//             and V once per tile, then of Q_i and dO_i for each iteration i into a STAGES-deep ring;
//             the 32 lanes copy the rows' lse (zero past seqlen_q) and delta into the stage beside
//             them.
//   consumers (warpgroups 1, 2; setmaxnreg.inc 240).
//
// Tiles and the ring: as flash_bwd_sm90_ws.cu (blocks.cuh key_block_grouped's order; block b takes
// tiles b, b + gridDim.x, ...; the ring's stages and phases run on across a block's tiles).
//
// Barriers ("wait(b, n)": until phase n of mbarrier b has completed, parity n % 2):
//   kv_full     count 1: lane 0's expect_tx arrival; K's and V's bytes complete it; phase u for the
//               block's u-th tile.
//   kv_empty    count 8: lane 0 of each consumer warp once its epilogue has read its rows of sK and
//               sV out; the producer waits for phase u - 1 before loading the u-th tile's K and V.
//   full[s]     count 32: every producer lane after storing its lse / delta rows of stage s (lane 0
//               with the expect_tx of Q's and dO's bytes, before issuing their copies).
//   empty[s]    count 8: lane 0 of each consumer warp, once its products that read stage s retired.
//   named barrier 1 (256 consumer threads): "P, dS" once per iteration, after both consumers stored
//               their halves of P^T and dS^T into buffer gi % 2; and once after each tile's loop,
//               before the epilogue writes dK and dV through sK and sV (the other consumer's
//               products read all of sK and sV).
// sP and sdS are double-buffered: a consumer writes buffer (gi + 1) % 2 while the other may still
// read buffer gi % 2 in its products; it cannot get two iterations ahead because of barrier 1 (a
// consumer arrives at iteration gi's barrier only after its products of gi - 1 retired).
//
// dq_accum layout: flash_bwd_sm90_ws.cu's permuted one with DQ_N = 128 (per (batch, head, query
// block of 64 rows), consumer c's part of 64 rows x 128 columns at c * 64 * 128 floats, inside it
// float4 j of consumer thread u at (j * 128 + u) * 4); flash_bwd.cu's conversion kernel with
// DQ_PERM = 128 undoes it. A warp's 32 reductions of one j cover 512 contiguous bytes.
//
// Shared memory: sK, sV (64 x 256), sQ[STAGES], sdO[STAGES] (64 x 256), sP[2], sdS[2] (64 keys x 64
// queries), all SW128 panels (wgmma_util.cuh); sLse[STAGES], sDelta[STAGES] (64 floats each); the
// mbarriers. With STAGES = 2: 226 KiB + 1 KiB of alignment slack. The epilogue writes dV and dK out
// through sV and sK.
//
// Grid: 1-D, one block per tile, or (persistent) one per SM.
#include "blocks.cuh"
#include "bwd_sm90_steps.cuh"
#include "bwd_ws_pipeline.cuh"
#include "bwd_tma_params.cuh"
#include "common.cuh"
#include "params.cuh"
#include "tma.cuh"
#include "wgmma.cuh"
#include "wgmma_util.cuh"

namespace cuflash {

template <int STAGES>
struct BwdWs256Traits {
    static constexpr int HEAD_DIM = 256, BLOCK_M = 64, BLOCK_N = 64;
    static constexpr int THREADS = 384;
    static constexpr int COLS = HEAD_DIM / 2;                 // dK / dV / dQ columns per consumer
    static constexpr int PANEL = 64 * 128;                    // one SW128 panel of 64 rows
    static constexpr int SKV_BYTES = BLOCK_N * HEAD_DIM * 2;  // 4 panels
    static constexpr int SQ_BYTES = BLOCK_M * HEAD_DIM * 2;
    static constexpr int SPS_BYTES = BLOCK_N * BLOCK_M * 2;   // one panel
    static constexpr int ROWS_BYTES = STAGES * 2 * BLOCK_M * 4;
    static constexpr int BAR_BYTES = 8 * (2 + 2 * STAGES);
    // sK, sV, sQ[STAGES], sdO[STAGES], sP[2], sdS[2], the rows, the barriers, plus 1024 bytes of
    // alignment slack. Must equal cuflash/_config.py:bwd_ws_smem_bytes(256, ...).
    static constexpr int SMEM_BYTES =
        2 * SKV_BYTES + 2 * STAGES * SQ_BYTES + 4 * SPS_BYTES + ROWS_BYTES + BAR_BYTES + 1024;
    static constexpr int PRODUCER_REGS = 24;
    static constexpr int CONSUMER_REGS = 240;
    static_assert(STAGES >= 2, "stages");
};

template <typename T, bool IS_CAUSAL, bool IS_EVEN, int STAGES = 2, bool FEAT = false, bool SEQS = false>
__global__ void __launch_bounds__(384, 1)
flash_bwd_sm90_ws256_kernel(const __grid_constant__ BwdTmaParams p) {
    static_assert(!FEAT || (!IS_CAUSAL && !IS_EVEN), "FEAT: causal and the tails are the mask's");
    static_assert(!SEQS || FEAT, "SEQS: per-sequence lengths are an option of FEAT");
    using Tr = BwdWs256Traits<STAGES>;
    using Ops = ElemOps<T>;
    constexpr int HEAD_DIM = Tr::HEAD_DIM, BLOCK_M = Tr::BLOCK_M, BLOCK_N = Tr::BLOCK_N, COLS = Tr::COLS;
    constexpr int PANEL = Tr::PANEL;

    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const u32 raw_addr = smem_addr(smem_raw);
    const u32 sK = (raw_addr + 1023u) & ~1023u;
    const u32 sV = sK + Tr::SKV_BYTES;
    const u32 sQ = sV + Tr::SKV_BYTES;            // [STAGES]
    const u32 sdO = sQ + STAGES * Tr::SQ_BYTES;   // [STAGES]
    const u32 sP = sdO + STAGES * Tr::SQ_BYTES;   // [2]
    const u32 sdS = sP + 2 * Tr::SPS_BYTES;       // [2]
    const u32 sRows = sdS + 2 * Tr::SPS_BYTES;    // sLse[STAGES][64], then sDelta[STAGES][64]
    const BwdWsBars<STAGES, BLOCK_M> bars{sRows + Tr::ROWS_BYTES, sRows};

    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    if (tid == 0 && dynamic_smem_bytes() < (u32)Tr::SMEM_BYTES) __trap();

    const int sq = p.seqlen_q, sk = p.seqlen_k;
    const int num_tiles = p.batch * p.nheads_kv * p.num_blocks;

    if (tid == 0) bars.init();
    __syncthreads();  // barriers initialized: the warpgroups go their ways

    const int wg = warpgroup_index();
    if (wg == 0) {
        // ---------------- producer (bwd_ws_pipeline.cuh) ----------------
        setmaxnreg_dec<Tr::PRODUCER_REGS>();
        if (warp == 0)
            bwd_ws_produce<HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, IS_CAUSAL, FEAT, SEQS>(p, bars, lane, sK, sV, sQ, sdO);
        return;
    }

    // ---------------- consumers ----------------
    setmaxnreg_inc<Tr::CONSUMER_REGS>();
    const int cw = wg - 1;          // consumer 0 or 1: queries [32 cw, + 32) of S^T; columns [128 cw, + 128)
    const int tw = tid - 128 * wg;  // thread index inside the consumer
    const int g = lane / 4, t = lane % 4;
    constexpr int PDS_BAR = 1;

    const int key_row0 = (warp % 4) * 16;  // this warp's first key inside the block
    const u32 cols_off = (u32)(cw * 2 * PANEL);  // panels 2 cw, 2 cw + 1: this consumer's columns

    int g_base = 0, tcount = 0;
    for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x, ++tcount) {
        WsTile w = ws_tile<FEAT, SEQS, BLOCK_M, BLOCK_N, IS_CAUSAL>(p, tile);
        if (w.skip) {  // past a packed sequence's keys: skipped, as by the producer
            --tcount;
            continue;
        }
        const int h_kv = w.blk.h_kv, b = w.blk.b, n0 = w.blk.n0;
        const int m_begin = w.m_begin, m_iters = w.m_iters, iters = w.iters;
        MaskInfo& mi = w.mi;
        // Element (key n0 + key_row0 + g + 8 (e / 2), query m0 + 32 cw + 8 j + 2 t + e % 2) lies above
        // the causal diagonal iff 8 (e / 2) - 8 j - e % 2 > m0 + diag_base.
        const int diag_base = 32 * cw + 2 * t + sk - sq - n0 - key_row0 - g;

        float acc_dv[COLS / 2], acc_dk[COLS / 2];
#pragma unroll
        for (int i = 0; i < COLS / 2; ++i) { acc_dv[i] = 0.f; acc_dk[i] = 0.f; }

        mbar_wait(bars.kv_full(), tcount & 1);
        // K, V rows past the sequence's keys: zeros (bwd_ws_pipeline.cuh)
        if constexpr (SEQS) zero_rows_past<HEAD_DIM, BLOCK_N>(sK, sV, mi.sk - n0, tw, 2 + cw);
        for (int it = 0; it < iters; ++it) {
            const int gi = g_base + it;
            const int s = gi % STAGES;
            const int m0 = (m_begin + it % m_iters) * BLOCK_M;
            const u32 sQs = sQ + s * Tr::SQ_BYTES, sdOs = sdO + s * Tr::SQ_BYTES;
            const u32 sPi = sP + (gi % 2) * Tr::SPS_BYTES, sdSi = sdS + (gi % 2) * Tr::SPS_BYTES;
            mbar_wait(bars.full(s), (gi / STAGES) & 1);
            // Q, dO rows past the sequence: zeros
            if constexpr (SEQS) zero_rows_past<HEAD_DIM, BLOCK_M>(sQs, sdOs, mi.sq - m0, tw, 2 + cw);

            // ---- S^T_c = K Q_c^T, dP^T_c = V dO_c^T: (64 keys, 32 queries) ----
            float sc[16], dp[16];
            wgmma_fence();
            wgmma_ss_kmajor<T, 32, HEAD_DIM, BLOCK_N, BLOCK_M>(sc, opaque(sK), sQs + cw * 32 * 128);
            wgmma_commit();
            wgmma_ss_kmajor<T, 32, HEAD_DIM, BLOCK_N, BLOCK_M>(dp, opaque(sV), sdOs + cw * 32 * 128);
            wgmma_commit();
            wgmma_wait<1>();
            fence_regs(sc);

            // ---- P^T (while dP^T runs); the mask only on tiles the causal diagonal crosses ----
            // Keys past seqlen_k need no mask: TMA fills their K and V rows with zeros, so their dS
            // reaches dQ multiplied by K = 0, and their dK, dV rows are never written.
            const bool diag = IS_CAUSAL && n0 + key_row0 + 15 > m0 + 32 * cw + sk - sq;
            const int diag_lim = m0 + diag_base;
            const u32 lse_s = bars.lse_row(s) + (32 * cw + 2 * t) * 4;
            const u32 dlt_s = bars.dlt_row(s) + (32 * cw + 2 * t) * 4;
            // FEAT: the mask and ALiBi facts of this warp's (16 keys x 32 queries) step: the element-wise
            // mask only where a bound crosses it.
            const WsFeatStep fs = ws_feat_step<FEAT>(p, mi, m0 + 32 * cw, 32, n0 + key_row0, g, t, b,
                                                     h_kv * p.head_group + it / m_iters);
            const bool edge = fs.edge, alibi = fs.alibi;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                // lse -> lse * log2(e); see flash_bwd_sm90.cu for rows with lse = -inf or past seqlen_q.
                float2 l2 = ld_shared_f32x2(lse_s + 32 * j);
                l2.x *= CUFLASH_LOG2E;
                l2.y *= CUFLASH_LOG2E;
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int i = 4 * j + e;
                    float r = e % 2 ? l2.y : l2.x;
                    if (FEAT && alibi) r = fmaf(mi.alibi_log2, fabsf(fs.d0[e / 2] + (float)(8 * j + e % 2)), r);
                    float pv = fast_exp2(fminf(fmaf(sc[i], p.scale_log2, -r), 0.f));  // P <= 1
                    if (IS_CAUSAL && diag && (e / 2) * 8 - 8 * j - (e % 2) > diag_lim) pv = 0.f;
                    if (FEAT && edge && !fs.qs[e / 2].has(m0 + 32 * cw + 8 * j + 2 * t + e % 2)) pv = 0.f;
                    sc[i] = pv;
                }
            }
            wgmma_wait<0>();
            fence_regs(dp);
            // P^T and dS^T of this warp's 16 keys x the consumer's 32 queries into sP / sdS (keys x
            // queries, one panel): n8 tile j is 16-byte chunk 4 cw + j of rows g, g + 8.
            {
                const int row0 = (int)opaque((u32)(key_row0 + g));
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const float2 dl = ld_shared_f32x2(dlt_s + 32 * j);
#pragma unroll
                    for (int e = 0; e < 4; ++e) dp[4 * j + e] = sc[4 * j + e] * (dp[4 * j + e] - (e % 2 ? dl.y : dl.x));
#pragma unroll
                    for (int r = 0; r < 2; ++r) {
                        const u32 off = sw128_offset(row0 + 8 * r, 4 * cw + j, BLOCK_N) + 4 * t;
                        st_shared_u32(sPi + off, Ops::pack(sc[4 * j + 2 * r], sc[4 * j + 2 * r + 1]));
                        st_shared_u32(sdSi + off, Ops::pack(dp[4 * j + 2 * r], dp[4 * j + 2 * r + 1]));
                    }
                }
            }
            fence_proxy_async();                  // the stores before the async proxy (wgmma) reads them
            named_barrier_sync(PDS_BAR, 256);     // both halves of P^T and dS^T are in buffer gi % 2

            // ---- dQ_c = dS K[:, cols c]; dV_c += P^T dO[:, cols c]; dK_c += dS^T Q[:, cols c] ----
            float dq[COLS / 2];
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < BLOCK_N / 16; ++kk)
                Wgmma<T, COLS>::template ss<1, 1>(dq, make_smem_desc(opaque(sdSi) + kk * 2048, PANEL, 1024),
                                                  make_smem_desc(opaque(sK) + cols_off + kk * 2048, PANEL, 1024), kk > 0);
            wgmma_commit();
#pragma unroll
            for (int kk = 0; kk < BLOCK_M / 16; ++kk)
                Wgmma<T, COLS>::template ss<0, 1>(acc_dv, make_smem_desc(opaque(sPi) + kk * 32, 16, 1024),
                                                  make_smem_desc(sdOs + cols_off + kk * 2048, PANEL, 1024), 1);
            wgmma_commit();
#pragma unroll
            for (int kk = 0; kk < BLOCK_M / 16; ++kk)
                Wgmma<T, COLS>::template ss<0, 1>(acc_dk, make_smem_desc(opaque(sdSi) + kk * 32, 16, 1024),
                                                  make_smem_desc(sQs + cols_off + kk * 2048, PANEL, 1024), 1);
            wgmma_commit();
            wgmma_wait<2>();  // dQ is done; dV and dK run while it goes out
            fence_regs(dq);
            {
                // The block's coordinates again from an opaque iteration index (not held across the body).
                const int oit = (int)opaque((u32)it);
                const int ohq = h_kv * p.head_group + oit / m_iters, om0 = (m_begin + oit % m_iters) * BLOCK_M;
                float* acc = p.dq_accum + (((i64)b * p.nheads + ohq) * p.seqlen_q_pad + om0) * HEAD_DIM + cw * 64 * COLS
                             + tw * 4;
#pragma unroll
                for (int j = 0; j < COLS / 8; ++j)
                    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};"
                                 :: "l"(acc + j * 128 * 4), "f"(dq[4 * j]), "f"(dq[4 * j + 1]), "f"(dq[4 * j + 2]),
                                    "f"(dq[4 * j + 3]) : "memory");
            }
            wgmma_wait<0>();
            fence_regs(acc_dv);
            fence_regs(acc_dk);
            if (lane == 0) mbar_arrive(bars.empty(s));  // this warp is done with Q, dO, lse and delta of stage s
        }
        g_base += iters;
        named_barrier_sync(PDS_BAR, 256);  // both consumers' products (which read all of sK and sV) are done

        // ---- epilogue: dV, dK = scale * dK; this warp's 16 keys x this consumer's 128 columns ----
        {
            const int tid = (int)opaque(threadIdx.x), lane = tid % 32, warp = tid / 32;
            const int g = lane / 4, t = lane % 4;
            const int key_row0 = (warp % 4) * 16, cw = warp / 4 - 1;
            const KeyBlock eblk = key_block_grouped<BLOCK_M, BLOCK_N, IS_CAUSAL>(opaque((u32)tile), p.num_blocks, p.nheads_kv,
                                                                                 p.batch, p.tile_heads, p.tail_heads, p.seqlen_q,
                                                                                 p.seqlen_k);
            const int n0 = eblk.n0, h_kv = eblk.h_kv, b = eblk.b;
            const u32 off = (u32)(cw * 2 * PANEL);
            dkdv_rows_to_smem<Ops, COLS, BLOCK_N>(sK + off, sV + off, acc_dk, acc_dv, p.scale, key_row0, g, t);
            __syncwarp();
            i64 k_row0 = 0;  // SEQS: the sequence's rows of dK / dV
            int k_rows = p.seqlen_k;
            if constexpr (SEQS) {
                const SeqInfo esi = seq_info(p.mask, b, p.seqlen_q, p.seqlen_k);
                k_row0 = esi.k_row0;
                k_rows = esi.k_rows;
            }
            T* gdK = static_cast<T*>(p.dk) + b * p.dk_batch_stride + h_kv * p.dk_head_stride
                     + (k_row0 + n0) * p.dk_row_stride + cw * COLS;
            T* gdV = static_cast<T*>(p.dv) + b * p.dv_batch_stride + h_kv * p.dv_head_stride
                     + (k_row0 + n0) * p.dv_row_stride + cw * COLS;
            dkdv_rows_to_global<T, COLS, BLOCK_N, IS_EVEN>(gdK, gdV, p.dk_row_stride, p.dv_row_stride, sK + off,
                                                           sV + off, key_row0, lane, n0, k_rows, p.d_cols - cw * COLS);
            __syncwarp();
            if (lane == 0) mbar_arrive(bars.kv_empty());  // this warp's rows of sK / sV are read: the next K, V may land
        }
    }
}

}  // namespace cuflash
