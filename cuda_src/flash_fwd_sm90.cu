// flash_fwd_sm90.cu: exact attention forward for Hopper (sm_90a), on wgmma tensor cores.
//
// Algorithm: the same online-softmax tiling as flash_fwd.cu (FlashAttention-2), with the two
// products issued as warpgroup MMAs:
//   S = Q K^T   wgmma m64n{BLOCK_N}k16, Q and K both read from shared memory (K-major)
//   O += P V    wgmma m64n{HEAD_DIM}k16, P from registers (re-packed S accumulators), V read from
//               shared memory MN-major (V's head_dim is contiguous)
// Nothing of size seqlen_q x seqlen_k ever reaches device memory.
//
// Warps. BLOCK_M / 64 warpgroups; warpgroup w owns query rows [64 w, 64 w + 64) of the block and
// computes all BLOCK_N columns of S and all HEAD_DIM columns of O for them. Every thread also takes
// part in the cp.async copies.
//
// Pipeline. K and V each have two shared-memory stages; V runs one tile behind K. Iteration j:
//   wait for {K_j, V_(j-1)}; barrier; start copying {K_(j+1), V_j} into the other stages
//   issue S_j = Q K_j^T and O += P_(j-1) V_(j-1) back to back (two wgmma groups)
//   wait for S_j only; mask and online softmax on S_j while the P V product still runs (each p one
//   fma: softmax.cuh prepare_in_place)
//   wait for P V; rescale O by alpha_j (only in a warp where a row's max moved: softmax.cuh LAZY); pack P_j
// and after the loop O += P_(n-1) V_(n-1). The softmax of one tile so overlaps the tensor cores'
// work on the previous one inside each warpgroup (FlashAttention-3's intra-warpgroup pipelining).
// Iteration 0 issues S_0 alone (there is no previous tile): it runs peeled before the loop, since a
// wgmma inside a branch in the loop makes ptxas serialize every wgmma of the kernel (warning C7519,
// which the compile gate rejects).
//
// Shared memory: sQ (BLOCK_M x HEAD_DIM), sK[2], sV[2] (BLOCK_N x HEAD_DIM), all in the SW128 panel
// layout of wgmma_util.cuh. HEAD_DIM is a multiple of 64. The epilogue writes O through sQ.
// At head_dim 64 (ONES_PV) 16 rows of ones follow the V stages (2048 bytes, 1024-aligned): P V is
// one m64n72 product a k16 step whose columns 64-71 are P x ones, the row sums of the rounded P (lp,
// softmax.cuh LP_TENSOR), rescaled with O (wgmma_util.cuh wgmma_rs_mnmajor_ones). The product reads
// only one 16-byte chunk of each of those rows, so the TMA variant's mbarriers sit in bytes 32-63 of
// the first, which the fill skips.
//
// TMA (plain calls whose layout fits a tensor map: cuflash/_config.py fwd_tma_mode; the default
// at head_dim 64 below the warp-specialized kernel's lengths): K and V tiles come through TMA copies
// instead of cp.async from every thread. The Params are then FwdTmaParams, FwdParams plus a tensor
// map for K and one for V (cuflash/_tma.py kv_map: box {64 columns, BLOCK_N rows}, 128-byte
// swizzle, so each copy fills one SW128 panel; rows past seqlen_k arrive as zeros, as cp.async's
// zero-fill gave them). Pad-up (cuflash/_config.py fwd_pad_tma): a call of head_dim 24 to 56 runs
// the variant of 64 with maps of its own head_dim, whose columns past it arrive as zeros;
// FwdTmaParams::d_cols (the call's head_dim) zero-fills Q's columns past it and keeps O's from
// being written. Four mbarriers (K and V, two stages each) follow the V stages in shared
// memory (at head_dim 64 they sit inside the ones rows, above). Thread 0 arms a stage's barrier
// with the tile's bytes and issues one copy per panel, right after the loop-top barrier that says
// every warpgroup is done with that stage; every thread waits on a stage's barrier before that
// loop-top barrier. Stage s's u-th load completes phase u, so K_j is waited with parity (j / 2) % 2
// and V_(j-1) with ((j - 1) / 2) % 2 (from j = 1 on: iteration 0 reads no V). Q still comes by
// cp.async.
//
// Causal alignment, the empty-row convention, the grid mapping and FwdParams are those of
// flash_fwd.cu, and so is FEAT (the optional features of mask.cuh): the key tiles of key_tiles,
// masks on the tiles a bound crosses, log2-unit logits for softcap / ALiBi, a sink logit joining the
// softmax after the last tile. A block that lies past its sequence in a packed batch runs no iteration and writes nothing
// (no early return: any branch around the wgmma code would serialize it).
#include "blocks.cuh"
#include "common.cuh"
#include "fwd_sm90_steps.cuh"
#include "params.cuh"
#include "softmax.cuh"
#include "tma.cuh"
#include "wgmma.cuh"
#include "wgmma_util.cuh"

namespace cuflash {

// The TMA variant's Params: FwdParams, then the tensor maps of K and V (64-byte aligned). Must
// match cuflash/_launch.py FWD_TMA_PARAMS.
struct FwdTmaParams : FwdParams {
    int d_cols;  // the call's head_dim: Q's and O's columns (below HEAD_DIM under pad-up; HEAD_DIM 64 only)
    TmaDesc map_k;
    TmaDesc map_v;
};
template <bool TMA> struct FwdSm90ParamsOf { using type = FwdParams; };
template <> struct FwdSm90ParamsOf<true> { using type = FwdTmaParams; };

template <int HEAD_DIM, int BLOCK_M, int BLOCK_N>
struct FwdSm90Traits {
    static constexpr int WARPGROUPS = BLOCK_M / 64;
    static constexpr int THREADS = WARPGROUPS * 128;
    static constexpr int N_TILES = BLOCK_N / 8;
    static constexpr int D_TILES = HEAD_DIM / 8;
    static constexpr int SQ_BYTES = BLOCK_M * HEAD_DIM * 2;
    static constexpr int SKV_BYTES = BLOCK_N * HEAD_DIM * 2;
    // ONES_PV (head_dim 64): lp as 8 more columns of P V, over 16 rows of ones after sV (header).
    static constexpr bool ONES_PV = HEAD_DIM == 64;
    static constexpr int ONES_REGION_BYTES = ONES_PV ? ONES_PV_BYTES : 0;
    static constexpr int PV_N = HEAD_DIM + (ONES_PV ? 8 : 0);
    // sQ, sK[2], sV[2], the ones, plus 1024 bytes to align the start to 1024. Must equal
    // cuflash/_config.py:fwd_smem_bytes. The TMA variant adds its four mbarriers, unless they sit in
    // the ones rows' unread bytes (ONES_PV: cuflash/_config.py fwd_tma_bar_bytes).
    static constexpr int SMEM_BYTES = SQ_BYTES + 4 * SKV_BYTES + ONES_REGION_BYTES + 1024;
    static constexpr int TMA_BAR_BYTES = ONES_PV ? 0 : 64;

    static_assert(HEAD_DIM % 64 == 0 && HEAD_DIM <= 256, "head_dim: a multiple of 64 up to 256");
    static_assert(BLOCK_M % 64 == 0 && BLOCK_N % 16 == 0 && BLOCK_N <= 256, "tile shape");
};

template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, bool IS_CAUSAL, bool IS_EVEN, bool FEAT = false,
          bool TMA = false>
__global__ void __launch_bounds__(BLOCK_M / 64 * 128, 1)
flash_fwd_sm90_kernel(const __grid_constant__ typename FwdSm90ParamsOf<TMA>::type p) {
    using Tr = FwdSm90Traits<HEAD_DIM, BLOCK_M, BLOCK_N>;
    static_assert(!(TMA && FEAT), "the TMA variant serves plain calls (its maps know no sequence lengths)");
    using Ops = ElemOps<T>;
    constexpr int THREADS = Tr::THREADS, N_TILES = Tr::N_TILES;
    constexpr int PV_STEPS = BLOCK_N / 16;

    extern __shared__ __align__(1024) unsigned char smem_raw[];
    constexpr int LP = fwd_sm90_lp<HEAD_DIM>();  // where the sum of the rounded P comes from
    constexpr bool ONES_PV = Tr::ONES_PV;
    constexpr int PV_N = Tr::PV_N;
    static_assert(!ONES_PV || LP == LP_TENSOR, "the ones columns of P V are LP_TENSOR's lp");
    u32 s_ones = 0;  // B of P x ones (lp) as its own product: LP_TENSOR above head_dim 64
    if constexpr (LP == LP_TENSOR && !ONES_PV) {
        __shared__ __align__(128) unsigned char s_ones_raw[ONES_BYTES];
        s_ones = smem_addr(s_ones_raw);
    }
    unsigned char* sQ_ptr;
    const u32 sQ = smem_aligned_1024(smem_raw, sQ_ptr);
    const u32 sK = sQ + Tr::SQ_BYTES;
    const u32 sV = sK + 2 * Tr::SKV_BYTES;
    const u32 s_ones_pv = sV + 2 * Tr::SKV_BYTES;  // ONES_PV: the 16 rows of ones (1024-aligned)
    // TMA: mbarriers of K stages 0, 1 and V stages 0, 1, 8 bytes each (ONES_PV: in the ones rows).
    const u32 s_bar = ONES_PV ? s_ones_pv + ONES_PV_BAR_OFFSET : sV + 2 * Tr::SKV_BYTES;
    auto bar_k = [&](int stage) { return s_bar + 8u * (u32)stage; };
    auto bar_v = [&](int stage) { return s_bar + 16u + 8u * (u32)stage; };

    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int wg = warp / 4, g = lane / 4, t = lane % 4;
    if (tid == 0 && dynamic_smem_bytes() < (u32)(Tr::SMEM_BYTES + (TMA ? Tr::TMA_BAR_BYTES : 0))) __trap();

    const int sq = p.seqlen_q, sk = p.seqlen_k;
    const QueryBlock blk = query_block<BLOCK_M, BLOCK_N, IS_CAUSAL>(fwd_block_index<IS_CAUSAL || FEAT>(p), p.num_m_blocks, p.nheads, p.head_group, sq, sk);
    const int h = blk.h, b = blk.b, h_kv = blk.h_kv, m0 = blk.m0;
    int n_blocks = blk.n_blocks;

    // With FEAT: the sequence's rows, its valid lengths, its mask and the key tiles to visit.
    // past_end: no tile (no early return here: see the header).
    int q_valid = sq, k_valid = sk;
    const QueryFeat qf = query_setup<FEAT, BLOCK_M, BLOCK_N>(p.mask, b, h, m0, sq, sk, n_blocks, q_valid, k_valid);
    const int q_rows = FEAT ? qf.si.q_rows : sq;  // rows past q_rows are not written
    auto tile_of = [&](int it) { if constexpr (FEAT) return qf.kt.tile(it); else return it; };

    const u16* gQ = static_cast<const u16*>(p.q) + b * p.q_batch_stride + h * p.q_head_stride + (qf.si.q_row0 + m0) * p.q_row_stride;
    const u16* gK = static_cast<const u16*>(p.k) + b * p.k_batch_stride + h_kv * p.k_head_stride + qf.si.k_row0 * p.k_row_stride;
    const u16* gV = static_cast<const u16*>(p.v) + b * p.v_batch_stride + h_kv * p.v_head_stride + qf.si.k_row0 * p.v_row_stride;

    // TMA: one copy per 64-column panel of a BLOCK_N-row tile starting at key row n, into dst.
    auto tma_tile = [&](u32 dst, const TmaDesc* map, u32 bar, int n) {
        if constexpr (TMA) {
            mbar_arrive_expect_tx(bar, Tr::SKV_BYTES);
#pragma unroll
            for (int c = 0; c < HEAD_DIM / 64; ++c) tma_load_4d(dst + c * BLOCK_N * 128, map, bar, c * 64, n, h_kv, b);
        }
    };
    const TmaDesc* map_k = nullptr;
    const TmaDesc* map_v = nullptr;
    if constexpr (TMA) {
        map_k = &p.map_k;
        map_v = &p.map_v;
        if (tid == 0) {
            tma_prefetch_desc(map_k);
            tma_prefetch_desc(map_v);
#pragma unroll
            for (int i = 0; i < 4; ++i) mbar_init(s_bar + 8u * i, 1);
            fence_mbar_init();
        }
    }

    // The call's columns (pad-up: a smaller head_dim on the TMA variant of 64, whose maps read K's and
    // V's columns past it as zeros; Q's are zero-filled here, O's are not written).
    int d_cols = HEAD_DIM;
    if constexpr (TMA) d_cols = p.d_cols;
    load_tile_sw128<HEAD_DIM, BLOCK_M, THREADS, !IS_EVEN>(sQ, gQ, p.q_row_stride, q_valid - m0, tid, d_cols);
    if constexpr (TMA) {
        __syncthreads();  // the barriers are initialized before anyone waits on them or a copy lands
        if (tid == 0 && n_blocks > 0) tma_tile(sK, map_k, bar_k(0), tile_of(0) * BLOCK_N);
    } else {
        if (n_blocks > 0) {
            const int n_first = tile_of(0) * BLOCK_N;
            load_tile_sw128<HEAD_DIM, BLOCK_N, THREADS, !IS_EVEN>(sK, gK + (i64)n_first * p.k_row_stride,
                                                                  p.k_row_stride, k_valid - n_first, tid);
        }
    }
    cp_async_commit();

    // O, and (ONES_PV) after its HEAD_DIM / 2 floats P x ones: lp of rows g, g + 8 in elements
    // HEAD_DIM / 2 and HEAD_DIM / 2 + 2 (softmax.cuh LP_TENSOR).
    float acc_o[PV_N / 2];
#pragma unroll
    for (int i = 0; i < PV_N / 2; ++i) acc_o[i] = 0.f;
    float acc_lp[4] = {0.f, 0.f, 0.f, 0.f};  // LP_TENSOR above head_dim 64: P x ones, lp of rows g, g + 8
    OnlineSoftmax<Ops, 1, N_TILES, LP, true> softmax;  // LAZY: O's rescale only where a max moved
    if constexpr (ONES_PV) {
        fill_ones_pv<T>(s_ones_pv, tid, THREADS);
        fence_proxy_async();  // before the loop's first barrier, which precedes every wgmma
    } else if constexpr (LP == LP_TENSOR) {
        fill_ones<T>(s_ones, tid, THREADS);
        fence_proxy_async();
    }
    softmax.init();
    u32 pa[PV_STEPS][4];  // P of the previous tile, as wgmma A fragments (one per k16 step of keys)
#pragma unroll
    for (int kk = 0; kk < PV_STEPS; ++kk) pa[kk][0] = pa[kk][1] = pa[kk][2] = pa[kk][3] = 0u;

    // This warp's first query row inside the block, and its warpgroup's rows of sQ.
    const int warp_row0 = wg * 64 + (warp % 4) * 16;
    const u32 sQ_wg = sQ + wg * 64 * 128;

    // O += P V from the V stage at sVp, with lp (LP_TENSOR): the ones columns, or their own product.
    auto pv_product = [&](u32 sVp) {
        if constexpr (ONES_PV) {
            wgmma_rs_mnmajor_ones<T, PV_STEPS, BLOCK_N>(acc_o, pa, sVp, s_ones_pv);
        } else {
            wgmma_rs_mnmajor<T, HEAD_DIM, PV_STEPS, BLOCK_N>(acc_o, pa, sVp);
            if constexpr (LP == LP_TENSOR) wgmma_rs_rowsum<T, PV_STEPS>(acc_lp, pa, s_ones);
        }
    };

    // Key tile j: S_j with O += P_(j-1) V_(j-1), then the softmax of S_j. Both flags are constants at
    // each call, which the compiler folds. first (j == 0): S_0 alone, since there is no previous
    // tile. It runs peeled before the loop, so that no branch around a product enters the loop (a
    // branch there makes ptxas serialize every wgmma, C7519). masked (the TMA variant): the tile may
    // need the causal or tail mask for some row of the block; the tiles of mask_free_tiles need none, and
    // their loop carries no mask code. (FEAT tiles take feat_logits_and_mask, which masks only tiles
    // a bound crosses.)
    auto key_tile = [&](int j, bool first, bool masked) {
        cp_async_wait<0>();
        fence_proxy_async();
        if constexpr (TMA) {
            mbar_wait(bar_k(j % 2), (j >> 1) & 1);                                 // K_j
            if (!first) mbar_wait(bar_v((j + 1) % 2), ((j - 1) >> 1) & 1);  // V_(j-1)
        }
        __syncthreads();  // K_j and V_(j-1) are in; stages (j + 1) % 2 of K and j % 2 of V are free
        if constexpr (TMA) {
            if (tid == 0) {
                if (j + 1 < n_blocks) tma_tile(sK + ((j + 1) % 2) * Tr::SKV_BYTES, map_k, bar_k((j + 1) % 2),
                                               tile_of(j + 1) * BLOCK_N);
                tma_tile(sV + (j % 2) * Tr::SKV_BYTES, map_v, bar_v(j % 2), tile_of(j) * BLOCK_N);
            }
        } else {
            const i64 n1 = (i64)tile_of(j + 1) * BLOCK_N;
            if (j + 1 < n_blocks)
                load_tile_sw128<HEAD_DIM, BLOCK_N, THREADS, !IS_EVEN>(
                    sK + ((j + 1) % 2) * Tr::SKV_BYTES, gK + n1 * p.k_row_stride, p.k_row_stride, k_valid - (int)n1, tid);
            const i64 n0 = (i64)tile_of(j) * BLOCK_N;
            load_tile_sw128<HEAD_DIM, BLOCK_N, THREADS, !IS_EVEN>(
                sV + (j % 2) * Tr::SKV_BYTES, gV + n0 * p.v_row_stride, p.v_row_stride, k_valid - (int)n0, tid);
            cp_async_commit();
        }
        const u32 sKj = sK + (j % 2) * Tr::SKV_BYTES;
        const u32 sVp = sV + ((j + 1) % 2) * Tr::SKV_BYTES;  // V_(j-1)

        float s[BLOCK_N / 2];
        wgmma_fence();
        wgmma_ss_kmajor<T, BLOCK_N, HEAD_DIM, BLOCK_M, BLOCK_N>(s, sQ_wg, sKj);
        wgmma_commit();
        if (!first) {
            pv_product(sVp);
            wgmma_commit();
        }
        if constexpr (LP == LP_THREAD) {
            if (!first) softmax.add_rounded(*reinterpret_cast<const u32(*)[1][N_TILES][2]>(&pa));  // P_(j-1), as the product reads it
        }
        if (first) wgmma_wait<0>(); else wgmma_wait<1>();
        fence_regs(s);

        // ---- mask, only on tiles that need it ----
        const int n0 = tile_of(j) * BLOCK_N;
        float sc = p.scale_log2;
        if constexpr (FEAT) {
            // As flash_fwd.cu: logits in log2 units (softcap, ALiBi) and the mask, where needed.
            sc = feat_logits_and_mask<BLOCK_N>(s, p.mask, qf, p.scale_log2, n0, m0 + warp_row0, g, t);
        } else {
            if (masked) mask_plain_tile<BLOCK_N, IS_CAUSAL, IS_EVEN>(s, n0, m0 + warp_row0, g, t, sq, sk);
        }

        float alpha[1][2];
        softmax.prepare_in_place(*reinterpret_cast<float(*)[1][N_TILES][4]>(&s), sc, alpha);

        if (!first) {
            wgmma_wait<0>();
            fence_regs(acc_o);
            if constexpr (LP == LP_TENSOR && !ONES_PV) fence_regs(acc_lp);
            fence_regs(pa);
        }
        const bool rescale = !first && warp_needs_rescale(alpha);  // iteration 0: O and lp are still 0
        rescale_and_pack<Ops, PV_N, BLOCK_N>(acc_o, alpha, pa, s, rescale);  // ONES_PV: lp with O
        if constexpr (LP == LP_TENSOR && !ONES_PV) {
            if (rescale) rescale_lp(acc_lp, alpha);
        }
    };
    if (n_blocks > 0) key_tile(0, true, true);
    int n_mid = 1;
    if constexpr (TMA) {
        // The tiles no row of the block needs masked (the cp.async variant keeps one loop: a third
        // copy of the tile's code spills at head_dim 128).
        n_mid = max(1, mask_free_tiles<BLOCK_N, IS_CAUSAL, IS_EVEN>(n_blocks, m0, sq, sk));
        for (int j = 1; j < n_mid; ++j) key_tile(j, false, false);
    }
    for (int j = n_mid; j < n_blocks; ++j) key_tile(j, false, true);

    cp_async_wait<0>();
    fence_proxy_async();
    if constexpr (TMA) {
        if (n_blocks > 0) mbar_wait(bar_v((n_blocks - 1) % 2), ((n_blocks - 1) >> 1) & 1);
    }
    __syncthreads();  // V_(n-1) is in (and with n_blocks == 0, the Q copy is done)
    if (n_blocks > 0) {
        const u32 sVp = sV + ((n_blocks - 1) % 2) * Tr::SKV_BYTES;
        wgmma_fence();
        pv_product(sVp);
        wgmma_commit();
        if constexpr (LP == LP_THREAD) softmax.add_rounded(*reinterpret_cast<const u32(*)[1][N_TILES][2]>(&pa));
        wgmma_wait<0>();
        fence_regs(acc_o);
        if constexpr (LP == LP_TENSOR && !ONES_PV) fence_regs(acc_lp);
    }
    __syncthreads();  // every warpgroup is done reading sQ: O goes out through it

    // ---- epilogue: O /= lp, lse, O through this warp's 16 rows of sQ ----
    float inv_l[1][2], lse[1][2];
    if constexpr (ONES_PV) {
        softmax.take_lp(*reinterpret_cast<const float(*)[4]>(&acc_o[HEAD_DIM / 2]));
    } else if constexpr (LP == LP_TENSOR) {
        softmax.take_lp(acc_lp);
    }
    if constexpr (FEAT) {
        // A sink logit joins here, after the last key tile (softmax.cuh); -inf: none.
        const float* sink = p.mask.sink_logits;
        softmax.finalize(inv_l, lse, sink != nullptr ? sink[h] * CUFLASH_LOG2E : -CUFLASH_INF);
    } else {
        softmax.finalize(inv_l, lse);
    }
    if constexpr (FEAT) {
        // Rows past the sequence's valid length (padding of a padded batch): out = 0, lse = -inf.
#pragma unroll
        for (int r = 0; r < 2; ++r)
            if (m0 + warp_row0 + g + r * 8 >= qf.si.sq) {
                inv_l[0][r] = 0.f;
                lse[0][r] = -CUFLASH_INF;
            }
    }
    const float(&o_acc)[HEAD_DIM / 2] = *reinterpret_cast<const float(*)[HEAD_DIM / 2]>(&acc_o[0]);
    if constexpr (HEAD_DIM > 128)  // fwd_sm90_steps.cuh: head_dim 256 keeps the word stores
        o_rows_to_smem_words<Ops, HEAD_DIM, BLOCK_M>(sQ_ptr, o_acc, inv_l, warp_row0, g, t);
    else
        o_rows_to_smem<Ops, HEAD_DIM, BLOCK_M>(sQ, o_acc, inv_l, warp_row0, lane);
    // lse == nullptr: the caller wants only O (an eager forward with no gradient and no lse).
    if (t == 0 && p.lse != nullptr) {
        float* g_lse = FEAT ? p.lse + b * p.mask.lse_batch_stride + h * p.mask.lse_head_stride + qf.si.q_row0
                            : p.lse + ((i64)b * p.nheads + h) * sq;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = m0 + warp_row0 + g + r * 8;
            if (IS_EVEN || row < q_rows) g_lse[row] = lse[0][r];
        }
    }
    __syncwarp();

    T* gO = static_cast<T*>(p.o) + b * p.o_batch_stride + h * p.o_head_stride + (qf.si.q_row0 + m0) * p.o_row_stride;
    if constexpr (HEAD_DIM > 128)
        o_rows_to_global_chunks<T, HEAD_DIM, BLOCK_M, IS_EVEN>(gO, p.o_row_stride, sQ_ptr, warp_row0, lane, m0, q_rows);
    else
        o_rows_to_global<T, HEAD_DIM, BLOCK_M, IS_EVEN>(gO, p.o_row_stride, sQ, warp_row0, lane, m0, q_rows, d_cols);
}

}  // namespace cuflash
