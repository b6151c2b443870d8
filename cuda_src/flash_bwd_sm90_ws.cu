// flash_bwd_sm90_ws.cu: the dK / dV / dQ kernel of the backward for Hopper (sm_90a),
// warp-specialized: a producer warp loads with TMA, two consumer warpgroups compute on wgmma, and
// each consumer adds its dQ part into the float scratch per query block: with DQ_RED (the default)
// each thread by red.global.add.v4.f32 straight from its registers, otherwise through sdQ with one
// bulk reduction (docs/hopper_plan.md steps 6-8). Non-deterministic dQ. DQ_RED keeps the dQ part out
// of shared memory, which the products' operand reads already keep busy: H200, session 38, 0.89-0.97
// of the bulk path's time (cuflash/_config.py BWD_WS_DQ_RED).
//
// FEAT (mask.cuh; sliding windows, sink tokens, sink logits, ALiBi; and with SEQS per-sequence lengths,
// padded or packed batches; the host sends no softcap here): a key block visits the query blocks of query_range, and a
// warp's (16 keys x BLOCK_M queries) tile pays for the element-wise mask only where a bound crosses
// it (needs_mask); ALiBi's slope follows the query head of each iteration, its key distance formed in
// float (MaskInfo::alibi_logit_log2). Rows that see no key (lse = -inf) lie only in tiles that need
// the mask, where their P is set to 0. Without SEQS every row of the tensors is a real row, and rows
// past them arrive as TMA's zeros, so no padding needs clearing. With SEQS the rows past a sequence
// arrive as they are in memory: each consumer zeroes them in shared memory (K, V once per tile; Q,
// dO per query block) before its products, the rows' P comes from the preprocess's lse * log2(e)
// (+inf past the sequence: P = 0), and a packed batch's maps see each array as one sequence of all
// its rows (bwd_ws_pipeline.cuh).
//
// Algorithm: that of flash_bwd_sm90.cu (read its header first): one block per (key block of 128
// keys, kv head, batch); K and V stay in shared memory, dK and dV in registers; the block loops over
// the query heads of its GQA group and the query blocks of BLOCK_M rows (64, or 128 at head_dim 64)
// that see its keys. Per query block, consumer c (keys [64 c, 64 c + 64) of the block) runs five
// wgmma products:
//   S^T = K_c Q^T, dP^T = V_c dO^T            (64 keys x BLOCK_M queries; both issued, then P =
//                                              exp2(...) computed while dP^T still runs)
//   dV_c += P^T dO                             (A from registers; runs across the dS barrier)
//   dQ part c = dS K                           (A = dS^T of both consumers from shared memory; part c:
//                                              BLOCK_M = 64: all rows, columns [c DQ_N, (c + 1) DQ_N),
//                                              DQ_N = HEAD_DIM / 2; BLOCK_M = 128: rows [64 c, 64 c +
//                                              64), all columns, DQ_N = HEAD_DIM)
//   dK_c += dS^T Q                             (A from registers; runs while dQ goes to shared memory)
// Nothing of size seqlen_q x seqlen_k reaches device memory.
//
// Warps: 384 threads, three warpgroups.
//   producer  (warpgroup 0; setmaxnreg.dec 24): warp 0 alone works. Lane 0 issues the TMA copies of K
//             and V once, then of Q_i and dO_i for each iteration i into a STAGES-deep ring; the 32
//             lanes copy the rows' lse (zero past seqlen_q) and delta into the stage beside them.
//             (The producer's other warps exit at once.)
//   consumers (warpgroups 1, 2; setmaxnreg.inc 240).
//
// Tiles: a tile is one key block of one (batch, kv head), in blocks.cuh key_block_grouped's order
// (p.tile_heads heads at a time, their longest causal key blocks first, then a last group of
// p.tail_heads heads; 0: none). Block b takes tiles b,
// b + gridDim.x, ...: one tile with a grid of one block per tile, several on a persistent grid of one
// block per SM (CUFLASH_BWD_WS_PERSISTENT=1).
// The ring's stages and phases run on across a block's tiles (gi = the block's iteration count).
//
// Barriers ("wait(b, n)": until phase n of mbarrier b has completed, parity n % 2):
//   kv_full     count 1: lane 0's expect_tx arrival; K's and V's bytes complete it; phase u for the
//               block's u-th tile.
//   kv_empty    count 8: lane 0 of each consumer warp once its epilogue has read its rows of sK and
//               sV out; the producer waits for phase u - 1 before loading the u-th tile's K and V.
//   full[s]     count 32: every producer lane arrives after storing its lse / delta rows of stage s
//               (lane 0 with the expect_tx of Q's and dO's bytes, before issuing their copies).
//   empty[s]    count 8: lane 0 of each consumer warp, once the products that read stage s (dV, dK)
//               have retired (its lse / delta were read before them).
// Iteration gi uses stage s = gi % STAGES; the producer's u-th fill of a stage (u = gi / STAGES)
// waits for phase u - 1 of empty[s]; a consumer waits for phase u of full[s].
//   named barrier 1 (256 consumer threads), once per iteration: "dS" after both consumers stored
//               dS^T of iteration gi into sdS[gi % 2] (and, without DQ_RED, for thread 0 of each
//               consumer, after its previous bulk reduction finished reading sdQ), before the dQ product; and once after
//               each tile's loop, before the epilogue writes dK and dV through sK and sV (the other
//               consumer's dQ products read all of sK).
//   named barrier 2 + c (128 threads of consumer c; without DQ_RED): its dQ part is in sdQ_c; then its
//               thread 0 issues the bulk reduction of sdQ_c into dq_accum. (With SEQS also around the
//               zeroing of rows past the sequence.)
// sdS is double-buffered: a consumer writes sdS[(gi + 1) % 2] while the other may still read sdS[gi %
// 2] in its dQ product; it cannot get two iterations ahead because of barrier 1.
//
// dq_accum layout (for this kernel; flash_bwd.cu's conversion kernel with DQ_PERM undoes it): per
// (batch, head, query block of BLOCK_M rows) the same BLOCK_M * HEAD_DIM floats as the row-major
// scratch, but ordered as the consumers hold them: consumer c's part (64 rows x DQ_N columns) at
// c * 64 * DQ_N, inside it float4 j of consumer thread u (0..127) at (j * 128 + u) * 4, holding
// rows g, g + 8 of warp u / 32's 16 and columns 8 j + 2 t, + 1 (g = lane / 4, t = lane % 4) as
// {(g, 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1)}. A warp's float4 stores to sdQ are then
// conflict-free, and each part is one contiguous bulk reduction; with DQ_RED, a warp's vector
// reduction covers 512 contiguous bytes.
//
// Shared memory: sK, sV (128 x HEAD_DIM), sQ[STAGES], sdO[STAGES] (BLOCK_M x HEAD_DIM), sdS[2] (128
// keys x BLOCK_M queries), all SW128 panels (wgmma_util.cuh); sdQ (BLOCK_M x HEAD_DIM floats, two
// parts; none with DQ_RED); then sLse[STAGES], sDelta[STAGES] (BLOCK_M floats each), then the mbarriers. The
// epilogue writes dV and dK out through sV and sK.
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

template <int HEAD_DIM, int BLOCK_M_, int STAGES, bool DQ_RED = false>
struct BwdWsTraits {
    static constexpr int BLOCK_M = BLOCK_M_, BLOCK_N = 128;
    static constexpr int THREADS = 384;
    // dQ of a query block is split between the consumers by columns (BLOCK_M = 64: each takes the 64
    // rows x HEAD_DIM / 2 columns) or by rows (BLOCK_M = 128: rows [64 c, 64 c + 64), all columns).
    static constexpr bool DQ_BY_ROWS = BLOCK_M == 128;
    static constexpr int DQ_N = DQ_BY_ROWS ? HEAD_DIM : HEAD_DIM / 2;  // dQ columns per consumer
    static constexpr int SKV_BYTES = BLOCK_N * HEAD_DIM * 2;
    static constexpr int SQ_BYTES = BLOCK_M * HEAD_DIM * 2;
    static constexpr int SDS_BYTES = BLOCK_N * BLOCK_M * 2;
    static constexpr int SDQ_BYTES = DQ_RED ? 0 : BLOCK_M * HEAD_DIM * 4;  // DQ_RED: no sdQ
    static constexpr int ROWS_BYTES = STAGES * 2 * BLOCK_M * 4;  // sLse[STAGES], sDelta[STAGES]
    static constexpr int BAR_BYTES = 8 * (2 + 2 * STAGES);
    // sK, sV, sQ[STAGES], sdO[STAGES], sdS[2], sdQ, the rows, the barriers, plus 1024 bytes of
    // alignment slack. Must equal cuflash/_config.py:bwd_ws_smem_bytes.
    static constexpr int SMEM_BYTES =
        2 * SKV_BYTES + 2 * STAGES * SQ_BYTES + 2 * SDS_BYTES + SDQ_BYTES + ROWS_BYTES + BAR_BYTES + 1024;
    static constexpr int PRODUCER_REGS = 24;
    static constexpr int CONSUMER_REGS = 240;

    static_assert(HEAD_DIM == 64 || HEAD_DIM == 128, "head_dim: 64 or 128");
    static_assert(BLOCK_M == 64 || BLOCK_M == 128, "query block: 64 or 128 rows");
    static_assert(STAGES >= 2, "stages");
    static_assert(DQ_N % 16 == 0, "dQ columns per consumer");
};

template <typename T, int HEAD_DIM, int BLOCK_M, bool IS_CAUSAL, bool IS_EVEN, int STAGES = 2, bool FEAT = false,
          bool SEQS = false, bool DQ_RED = false>
__global__ void __launch_bounds__(384, 1)
flash_bwd_sm90_ws_kernel(const __grid_constant__ BwdTmaParams p) {
    static_assert(!FEAT || (!IS_CAUSAL && !IS_EVEN), "FEAT: causal and the tails are the mask's");
    static_assert(!SEQS || FEAT, "SEQS: per-sequence lengths are an option of FEAT");
    using Tr = BwdWsTraits<HEAD_DIM, BLOCK_M, STAGES, DQ_RED>;
    using Ops = ElemOps<T>;
    constexpr int BLOCK_N = Tr::BLOCK_N, DQ_N = Tr::DQ_N;
    constexpr int Q_STEPS = BLOCK_M / 16, N_STEPS = BLOCK_N / 16;

    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const u32 raw_addr = smem_addr(smem_raw);
    const u32 sK = (raw_addr + 1023u) & ~1023u;
    const u32 sV = sK + Tr::SKV_BYTES;
    const u32 sQ = sV + Tr::SKV_BYTES;                 // [STAGES]
    const u32 sdO = sQ + STAGES * Tr::SQ_BYTES;        // [STAGES]
    const u32 sdS = sdO + STAGES * Tr::SQ_BYTES;       // [2]
    const u32 sdQ = sdS + 2 * Tr::SDS_BYTES;
    const u32 sRows = sdQ + Tr::SDQ_BYTES;             // sLse[STAGES][64], then sDelta[STAGES][64]
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
    const int cw = wg - 1;                                  // consumer 0 or 1: keys [64 cw, 64 cw + 64)
    const int tw = tid - 128 * wg;                          // thread index inside the consumer
    const int g = lane / 4, t = lane % 4;
    constexpr int DS_BAR = 1, DQ_BAR = 2;

    const int key_row0 = cw * 64 + (warp % 4) * 16;  // this warp's first key inside the block
    const u32 sK_wg = sK + cw * 64 * 128;
    const u32 sV_wg = sV + cw * 64 * 128;
    const u32 sdQ_wg = sdQ + cw * (Tr::SDQ_BYTES / 2);

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
        const int diag_base = 2 * t + sk - sq - n0 - key_row0 - g;

        float acc_dv[HEAD_DIM / 2], acc_dk[HEAD_DIM / 2];
#pragma unroll
        for (int i = 0; i < HEAD_DIM / 2; ++i) { acc_dv[i] = 0.f; acc_dk[i] = 0.f; }

        // K and V of this tile (also before the epilogue writes through sK / sV when no query block runs).
        mbar_wait(bars.kv_full(), tcount & 1);
        // K, V rows past the sequence's keys: zeros (bwd_ws_pipeline.cuh)
        if constexpr (SEQS) zero_rows_past<HEAD_DIM, BLOCK_N>(sK, sV, mi.sk - n0, tw, DQ_BAR + cw);
        for (int it = 0; it < iters; ++it) {
            const int gi = g_base + it;
            const int s = gi % STAGES;
            const int m0 = (m_begin + it % m_iters) * BLOCK_M;
            const u32 sQs = sQ + s * Tr::SQ_BYTES, sdOs = sdO + s * Tr::SQ_BYTES;
            const u32 sdSi = sdS + (gi % 2) * Tr::SDS_BYTES;
            mbar_wait(bars.full(s), (gi / STAGES) & 1);
            // Q, dO rows past the sequence: zeros
            if constexpr (SEQS) zero_rows_past<HEAD_DIM, BLOCK_M>(sQs, sdOs, mi.sq - m0, tw, DQ_BAR + cw);

            // ---- S^T = K Q^T, dP^T = V dO^T: (64 keys, 64 queries) ----
            float sc[BLOCK_M / 2], dp[BLOCK_M / 2];
            wgmma_fence();
            wgmma_ss_kmajor<T, BLOCK_M, HEAD_DIM, BLOCK_N, BLOCK_M>(sc, opaque(sK_wg), sQs);
            wgmma_commit();
            wgmma_ss_kmajor<T, BLOCK_M, HEAD_DIM, BLOCK_N, BLOCK_M>(dp, opaque(sV_wg), sdOs);
            wgmma_commit();
            wgmma_wait<1>();
            fence_regs(sc);

            // ---- P^T (while dP^T runs); mask only tiles that cross the causal diagonal or sk ----
            // Keys past seqlen_k need no mask: TMA fills their K and V rows with zeros, so their dS
            // reaches dQ multiplied by K = 0, and their dK, dV rows are never written.
            const bool diag = IS_CAUSAL && n0 + key_row0 + 15 > m0 + sk - sq;
            const u32 lse_s = bars.lse_row(s) + 2 * t * 4;
            const u32 dlt_s = bars.dlt_row(s) + 2 * t * 4;
            // Element (key n0 + key_row0 + g + 8 (e / 2), query m0 + 8 j + 2 t + e % 2) is above the
            // diagonal iff 8 (e / 2) - 8 j - e % 2 > diag_lim.
            const int diag_lim = m0 + diag_base;
            // The rows' lse and delta of n8 tile j (queries 8 j + 2 t, + 1): loaded per tile (BLOCK_M = 64),
            // or with BLOCK_M = 128, where 16 float2 each would hold 64 registers across the products,
            // loaded once as two float2 per thread (tiles g and g + 8) and passed around by shuffles from
            // lane 4 (j % 8) + t (register pressure; the non-causal even variant spilled otherwise).
            float2 lse_lo, lse_hi, dlt_lo, dlt_hi;
            if constexpr (BLOCK_M == 128) {
                lse_lo = ld_shared_f32x2(lse_s + 32 * g);
                lse_hi = ld_shared_f32x2(lse_s + 32 * (g + 8));
            }
            auto row_pair = [&](u32 base, const float2& lo, const float2& hi, int j) {
                if constexpr (BLOCK_M == 128) {
                    const float2& v = j < 8 ? lo : hi;
                    return make_float2(__shfl_sync(0xffffffffu, v.x, 4 * (j % 8) + t),
                                       __shfl_sync(0xffffffffu, v.y, 4 * (j % 8) + t));
                } else {
                    return ld_shared_f32x2(base + 32 * j);
                }
            };
            // FEAT: the mask and ALiBi facts of this warp's (16 keys x BLOCK_M queries) step.
            const WsFeatStep fs = ws_feat_step<FEAT>(p, mi, m0, BLOCK_M, n0 + key_row0, g, t, b,
                                                     h_kv * p.head_group + it / m_iters);
            const bool edge = fs.edge, alibi = fs.alibi;
            if (FEAT && (edge || alibi)) {
                // The options' loop, taken only by tiles a bound crosses or with ALiBi; the others run
                // the plain loop below at its own cost. ALiBi's exponent: fma(s, scale, -fma(A, |d|,
                // lse)); the mask's test is compiled into the loop only for tiles a bound crosses
                // (tested per element on every ALiBi tile, it cost the kernel 0.85 -> 0.99 of Flex
                // in flash_bwd_sm90.cu).
                auto p_of = [&](int i, int j, int e, float l2) {
                    const float r = alibi ? fmaf(mi.alibi_log2, fabsf(fs.d0[e / 2] + (float)(8 * j + e % 2)), l2) : l2;
                    return fast_exp2(fminf(fmaf(sc[i], p.scale_log2, -r), 0.f));  // P <= 1
                };
                // (One loop with the test under a runtime flag where BLOCK_M = 128: two spilled there.)
                if (BLOCK_M == 128 || edge) {
#pragma unroll
                    for (int j = 0; j < BLOCK_M / 8; ++j) {
                        float2 l2 = row_pair(lse_s, lse_lo, lse_hi, j);
                        l2.x *= CUFLASH_LOG2E;
                        l2.y *= CUFLASH_LOG2E;
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            const int i = 4 * j + e;
                            const float pv = p_of(i, j, e, e % 2 ? l2.y : l2.x);
                            sc[i] = !edge || fs.qs[e / 2].has(m0 + 8 * j + 2 * t + e % 2) ? pv : 0.f;
                        }
                    }
                } else {
#pragma unroll
                    for (int j = 0; j < BLOCK_M / 8; ++j) {
                        float2 l2 = row_pair(lse_s, lse_lo, lse_hi, j);
                        l2.x *= CUFLASH_LOG2E;
                        l2.y *= CUFLASH_LOG2E;
#pragma unroll
                        for (int e = 0; e < 4; ++e) sc[4 * j + e] = p_of(4 * j + e, j, e, e % 2 ? l2.y : l2.x);
                    }
                }
            } else {
#pragma unroll
                for (int j = 0; j < BLOCK_M / 8; ++j) {
                    // lse -> lse * log2(e); see flash_bwd_sm90.cu for rows with lse = -inf or past seqlen_q.
                    float2 l2 = row_pair(lse_s, lse_lo, lse_hi, j);
                    l2.x *= CUFLASH_LOG2E;
                    l2.y *= CUFLASH_LOG2E;
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int i = 4 * j + e;
                        float pv = fast_exp2(fminf(fmaf(sc[i], p.scale_log2, -(e % 2 ? l2.y : l2.x)), 0.f));  // P <= 1
                        if (IS_CAUSAL && diag && (e / 2) * 8 - 8 * j - (e % 2) > diag_lim) pv = 0.f;
                        sc[i] = pv;
                    }
                }
            }
            wgmma_wait<0>();
            fence_regs(dp);
            u32 pa[Q_STEPS][4], da[Q_STEPS][4];  // P^T and dS^T as wgmma A fragments, one per k16 step
            if constexpr (BLOCK_M == 128) {
                dlt_lo = ld_shared_f32x2(dlt_s + 32 * g);
                dlt_hi = ld_shared_f32x2(dlt_s + 32 * (g + 8));
            }
#pragma unroll
            for (int j = 0; j < BLOCK_M / 8; ++j) {
                const float2 dl = row_pair(dlt_s, dlt_lo, dlt_hi, j);
#pragma unroll
                for (int e = 0; e < 4; ++e) dp[4 * j + e] = sc[4 * j + e] * (dp[4 * j + e] - (e % 2 ? dl.y : dl.x));
                // n8 tile j is half of k16 step j / 2: registers 2 (j % 2) and 2 (j % 2) + 1 of it.
                const int kk = j / 2, r = 2 * (j % 2);
                pa[kk][r] = Ops::pack(sc[4 * j], sc[4 * j + 1]);
                pa[kk][r + 1] = Ops::pack(sc[4 * j + 2], sc[4 * j + 3]);
                da[kk][r] = Ops::pack(dp[4 * j], dp[4 * j + 1]);
                da[kk][r + 1] = Ops::pack(dp[4 * j + 2], dp[4 * j + 3]);
            }

            ds_to_smem<Q_STEPS, BLOCK_N>(sdSi, key_row0 + g, t, da);  // dS^T into sdS[it % 2] (keys x queries)

            // ---- dV += P^T dO (group A); dQ[:, cols of cw] = dS K (B); dK += dS^T Q (C) ----
            wgmma_fence();
            wgmma_rs_mnmajor<T, HEAD_DIM, Q_STEPS, BLOCK_M>(acc_dv, pa, sdOs);
            wgmma_commit();

            fence_proxy_async();                     // dS^T stores before the async proxy (wgmma) reads them
            if (!DQ_RED && tw == 0) bulk_wait_group_read<0>();  // the previous bulk reduction has read sdQ
            named_barrier_sync(DS_BAR, 256);         // all of dS^T is in sdS[it % 2]; sdQ is free; dV runs meanwhile

            float dq[DQ_N / 2];
            // A = dS, the queries of this consumer's rows: sdS's one panel (by columns) or panel cw (by
            // rows). B = K, columns [cw * DQ_N, ...) (a whole panel, or half of one: start 64 bytes in),
            // or all of them (by rows).
            const u32 ds_rows = Tr::DQ_BY_ROWS ? cw * BLOCK_N * 128 : 0;
            const u32 k_cols = Tr::DQ_BY_ROWS ? 0 : (cw * DQ_N / 64) * BLOCK_N * 128 + (cw * DQ_N % 64) * 2;
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < N_STEPS; ++kk)
                Wgmma<T, DQ_N>::template ss<1, 1>(dq, make_smem_desc(opaque(sdSi) + ds_rows + kk * 2048, BLOCK_N * 128, 1024),
                                                  make_smem_desc(opaque(sK) + k_cols + kk * 2048, BLOCK_N * 128, 1024),
                                                  kk > 0);
            wgmma_commit();
            wgmma_rs_mnmajor<T, HEAD_DIM, Q_STEPS, BLOCK_M>(acc_dk, da, sQs);
            wgmma_commit();
            wgmma_wait<1>();  // dV and dQ are done; dK runs while dQ goes to shared memory
            fence_regs(acc_dv);
            fence_regs(dq);
            // This consumer's part of the query block in dq_accum. The block's coordinates again from an
            // opaque iteration index (not held across the body); the row in 32 bits (the rows of all
            // heads: far below 2^31), widened once.
            auto dq_part = [&]() {
                const int oit = (int)opaque((u32)it);
                const int row = (b * p.nheads + h_kv * p.head_group + oit / m_iters) * p.seqlen_q_pad
                                + (m_begin + oit % m_iters) * BLOCK_M;
                return p.dq_accum + (i64)row * HEAD_DIM + cw * 64 * DQ_N;
            };
            if constexpr (DQ_RED) {
                // Each thread adds its float4s straight from registers (red.global.add.v4.f32), at the
                // offsets the bulk reduction's copy of sdQ would have had: no sdQ, no barrier.
                float* acc = dq_part() + 4 * tw;
#pragma unroll
                for (int j = 0; j < DQ_N / 8; ++j)
                    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};"
                                 :: "l"(acc + j * 512), "f"(dq[4 * j]), "f"(dq[4 * j + 1]), "f"(dq[4 * j + 2]),
                                    "f"(dq[4 * j + 3]) : "memory");
            } else {
                // This thread's float4 j at (j * 128 + tw) * 16 bytes of this consumer's part.
#pragma unroll
                for (int j = 0; j < DQ_N / 8; ++j)
                    asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};"
                                 :: "r"(sdQ_wg + (j * 128 + tw) * 16), "f"(dq[4 * j]), "f"(dq[4 * j + 1]), "f"(dq[4 * j + 2]),
                                    "f"(dq[4 * j + 3]) : "memory");
                fence_proxy_async();
                named_barrier_sync(DQ_BAR + cw, 128);  // this consumer's part of dQ is in sdQ
                if (tw == 0) {
                    bulk_reduce_add_f32(dq_part(), sdQ_wg, Tr::SDQ_BYTES / 2);
                    bulk_commit_group();
                }
            }
            wgmma_wait<0>();
            fence_regs(acc_dk);
            if (lane == 0) mbar_arrive(bars.empty(s));   // this warp is done with Q, dO, lse and delta of stage s
        }
        g_base += iters;
        named_barrier_sync(DS_BAR, 256);   // both consumers' dQ products (which read all of sK) are done

        // ---- epilogue: dV, dK = scale * dK, this warp's 16 keys, in the input dtype ----
        {
            // Coordinates again from opaque copies (nothing derived from them is held across the loop).
            const int tid = (int)opaque(threadIdx.x), lane = tid % 32, warp = tid / 32;
            const int g = lane / 4, t = lane % 4;
            const int key_row0 = (warp / 4 - 1) * 64 + (warp % 4) * 16;
            const KeyBlock eblk = key_block_grouped<BLOCK_M, BLOCK_N, IS_CAUSAL>(opaque((u32)tile), p.num_blocks, p.nheads_kv,
                                                                                 p.batch, p.tile_heads, p.tail_heads, p.seqlen_q,
                                                                                 p.seqlen_k);
            const int n0 = eblk.n0, h_kv = eblk.h_kv, b = eblk.b;
            dkdv_rows_to_smem<Ops, HEAD_DIM, BLOCK_N>(sK, sV, acc_dk, acc_dv, p.scale, key_row0, g, t);
            __syncwarp();
            // SEQS: the sequence's rows of dK / dV (a packed batch's from k_row0, as many as it has keys).
            i64 k_row0 = 0;
            int k_rows = p.seqlen_k;
            if constexpr (SEQS) {
                const SeqInfo esi = seq_info(p.mask, b, p.seqlen_q, p.seqlen_k);
                k_row0 = esi.k_row0;
                k_rows = esi.k_rows;
            }
            T* gdK = static_cast<T*>(p.dk) + b * p.dk_batch_stride + h_kv * p.dk_head_stride
                     + (k_row0 + n0) * p.dk_row_stride;
            T* gdV = static_cast<T*>(p.dv) + b * p.dv_batch_stride + h_kv * p.dv_head_stride
                     + (k_row0 + n0) * p.dv_row_stride;
            dkdv_rows_to_global<T, HEAD_DIM, BLOCK_N, IS_EVEN>(gdK, gdV, p.dk_row_stride, p.dv_row_stride, sK, sV,
                                                               key_row0, lane, n0, k_rows, p.d_cols);
            __syncwarp();
            if (lane == 0) mbar_arrive(bars.kv_empty());  // this warp's rows of sK / sV are read: the next K, V may land
        }
    }
    if (!DQ_RED && tw == 0) bulk_wait_group<0>();  // the reductions are done before the block retires
}

}  // namespace cuflash
