// flash_bwd.cu: exact attention backward by recomputation, FlashAttention-2 partition.
//
// Notation (per (batch, query head), scaled scores S = scale * Q K^T, masked):
//   P  = exp2(S * log2(e) - lse * log2(e))      recomputed from the forward's lse; never stored
//   dV = P^T dO          dP = dO V^T          dS = P * (dP - D),  D = rowsum(dO * O)
//   dK = scale * dS^T Q  dQ = scale * dS K
// Nothing of size seqlen_q x seqlen_k reaches device memory; the scratch is O(seqlen).
//
// Kernels, in launch order:
//   1. flash_bwd_preprocess_kernel: rows (batch, head, query row) padded to seqlen_q_pad, a row's
//      16-byte chunks on consecutive lanes (RowLanes): delta = rowsum(dO * O), lse_log2 = lse *
//      log2(e) (+inf where the row sees no key or does not exist, so that P = exp2(s - inf) = 0
//      there; skipped when lse_log2 is null, as for the sm_90a kernel of flash_bwd_sm90.cu, which
//      converts lse itself), and zeroes the row of dq_accum when dQ is accumulated by atomics.
//   2. flash_bwd_dkdv_kernel: one block per (key block, kv head, batch). K and V of its BLOCK_N keys
//      stay in shared memory; dK and dV stay in registers. It loops over every query head of its
//      GQA group and every query block that can see its keys (bottom-right causal), with Q, dO, lse
//      and delta tiles double-buffered by cp.async. Each iteration has three phases:
//        A. warps split (keys x queries): S^T = K Q^T and dP^T = V dO^T, then P^T and dS^T, written
//           to shared memory as 16-bit values;
//        B. warps split (keys x head_dim), two m16 key tiles per warp where possible: dV += P^T dO,
//           dK += dS^T Q (accumulated in registers);
//        C. with ATOMIC_DQ, warps split (queries x head_dim): dQ_part = dS K, added with float
//           atomics into dq_accum.
//      dK and dV are written once, at the end, in the input dtype: summing the GQA group inside the
//      block needs no scratch and no atomics, so dK and dV are deterministic.
//      SINGLE (plain calls whose keys fit one block: seqlen_k <= BLOCK_N): the whole backward in this
//      one launch, for calls so short that launches cost more than the work. Each iteration forms
//      its rows' lse * log2(e) from the forward's lse and D = rowsum(dO * O) from the landed dO tile
//      and O (global) itself, where the preprocess would have; phase C writes dQ = scale * dS K in the
//      input dtype directly (the block holds every key, so a row's dQ is complete within one
//      iteration); and the query rows before the first block that sees a key (causal, seqlen_q >
//      seqlen_k) get dq = 0. No scratch, no atomics: deterministic.
//   3a. (ATOMIC_DQ) flash_bwd_convert_dq_kernel: dq = scale * dq_accum, in the input dtype.
//   3b. (deterministic) flash_bwd_dq_kernel: one block per (query block, head, batch), the forward's
//      partition: recomputes S and dP for its rows over the visible key tiles and accumulates
//      dQ = dS K in registers; no atomics, so dq is bitwise reproducible. It redoes Q K^T and dO V^T
//      (two of the five products) on top of the dK/dV kernel. Below DS_SPLIT_BELOW it runs before
//      the dK/dV kernel (2 and 3b swap) and writes each row's corrected D back into delta (below).
//
// Below head_dim 32 (DS_SPLIT_BELOW) the dQ kernel computes dQ to about the input dtype's rounding:
//   - it feeds dS to its MMAs as two 16-bit operands, its rounding (hi) and the rounding of the
//     residual (lo): dS K = hi K + lo K with float32 accumulation, so dS keeps about 16 bits instead of
//     bf16's 8;
//   - it corrects D, which the preprocess forms from the stored (rounded) O: with the exact
//     D* = sum_j P_j dP_j, dS*_j = dS_j - W_j (D* - D), so dQ* = dS K - E B with B = sum_j W_j K_j
//     (W = P, times the softcap's 1 - tanh^2; one more MMA, W rounded once: E is small) and
//     E = sum_j P_j (dP_j - D) - P_sink D, a row's float32 sum over the keys it sees plus the sink's
//     term, which the preprocess wrote to dsink_rows (the sink's dP is 0). The recomputed P sums to
//     1 + delta (the lse's float32 rounding), so E = (D* - D)(1 + delta); the form sum_j P_j dP_j - D
//     would carry delta D* into dQ, 1.4e-4 with one visible key where the exact dQ is 0 (session 34).
// dQ of a query row is a sum over keys that cancels (sum_j dS_j = 0); with a peaked softmax a few large
// terms dominate it. Their rounding, then D from the rounded O, made dq 4.3x the naive bf16
// computation's error (head_dim 8, one query, 300 keys, seed 10361418856339468297; the naive
// computation rounds dS too, but forms D from its own P and dP). Below head_dim 32 the extra MMAs are
// cheap (bench/NOTES.md, session 17). dK keeps the rounded dS (as the naive computation does): the
// split in the dK/dV kernel, through a second dS^T tile, cost 24-55 %. But not the rounded O's D:
// below head_dim 32 the host launches the dQ kernel before the dK/dV kernel, and the dQ kernel leaves
// D* = D + E in delta for it (dK 1.06x its test bound from D's rounding alone: head_dim 8, one query
// row, 300 keys, GQA 2, seed 14363466586248944331; bench/NOTES.md, session 66). The dK/dV kernel's
// atomic dQ (a tuning switch, _config.BWD_ATOMIC_DQ) uses the rounded dS and D.
//
// Features (FEAT = true; mask.cuh). Each kernel finds its sequence (seq_info) and walks only the
// tiles the mask leaves visible: the dK/dV kernel the query blocks of query_range, the dQ kernel the
// key tiles of key_tiles. Scores become log2-unit logits as in the forward (softcap, ALiBi), and
// with softcap dS is multiplied by the derivative 1 - tanh^2. The preprocess reads lse through the
// mask's strides (lse of a packed batch is (nheads, total_q)); the per-row scratch stays
// (batch, nheads, seqlen_q_pad) with seqlen_q = max_seqlen_q, so its tiles stay aligned. With sink
// logits it also writes each row's term of d sink = -sum_i exp(sink - lse_i) D_i, which the host
// sums. The atomic dQ path with FEAT is the sm_90a wgmma kernel's (flash_bwd_sm90.cu), whose
// conversion kernel then also finds each row's sequence. With FEAT, P = exp2(min(s - lse, 0)): with
// the lse of the same call s - lse <= 0 anyway (up to rounding), but an lse from a call with other
// lengths or offsets would otherwise make P (and dQ, dK) overflow; so P <= 1 always, and the
// sink's P_sink = exp2(min(sink - lse, 0)) likewise.
//
// Grids are 1-D: blockIdx.x enumerates (batch, head, block along the sequence), so batch * nheads
// is not bounded by the 65535 limit of grid y / z.
// Shared-memory rows use padded_pitch (conflict-free ldmatrix); see flash_fwd.cu for layouts.
#include "blocks.cuh"
#include "common.cuh"
#include "params.cuh"
#include "warp_gemm.cuh"

namespace cuflash {

// dS as hi + lo in the dQ kernel below this head_dim; see the file comment.
constexpr int DS_SPLIT_BELOW = 32;

// ------------------------------------------------------------------------------------------------
// 1. preprocess
// ------------------------------------------------------------------------------------------------
// The two row-wise kernels (preprocess, dq conversion) give a row's HEAD_DIM / 8 chunks of 8
// elements (16 bytes of a 16-bit row) to TPR consecutive lanes, TPR the next power of two, so a
// warp serves 32 / TPR rows at once; each thread takes PASSES rows, spaced a pass apart, and issues
// all their loads before using any (bytes in flight: these kernels are memory-bound). One warp per
// row left three quarters of the lanes idle at head_dim 64 and ran at about half the bandwidth.
template <int HEAD_DIM>
struct RowLanes {
    static constexpr int CHUNKS = HEAD_DIM / 8;
    static constexpr int TPR = CHUNKS <= 1 ? 1 : CHUNKS <= 2 ? 2 : CHUNKS <= 4 ? 4 : CHUNKS <= 8 ? 8 : CHUNKS <= 16 ? 16 : 32;
    static constexpr int THREADS = 256;
    static constexpr int ROWS_PER_PASS = THREADS / TPR;
    static constexpr int PASSES = 4;
    static constexpr int ROWS_PER_BLOCK = ROWS_PER_PASS * PASSES;  // cuflash/_config.py:ROW_KERNEL_ROWS
    static_assert(HEAD_DIM % 8 == 0 && CHUNKS <= 32, "head_dim: multiple of 8 up to 256");
};

// Sum over the TPR lanes of a row (aligned groups of consecutive lanes).
template <int TPR>
__device__ __forceinline__ float row_group_sum(float x) {
#pragma unroll
    for (int o = TPR / 2; o > 0; o /= 2) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

// Row row_id of (batch, head, row) with `rows` rows per head.
struct RowOf {
    int i, h, b;
    i64 bh;
    __device__ __forceinline__ RowOf(i64 row_id, int rows, int nheads) {
        i = (int)(row_id % rows);
        bh = row_id / rows;
        h = (int)(bh % nheads);
        b = (int)(bh / nheads);
    }
};

// ACC_DIM: the width of dq_accum's rows, HEAD_DIM unless the dK/dV kernel runs at a larger head_dim
// than the call's (head_dim pad-up: cuflash/_config.py bwd_pad_head_dim).
template <typename T, int HEAD_DIM, bool ZERO_DQ, bool FEAT = false, int ACC_DIM = HEAD_DIM>
__global__ void __launch_bounds__(256)
flash_bwd_preprocess_kernel(const __grid_constant__ BwdParams p) {
    using Ops = ElemOps<T>;
    using L = RowLanes<HEAD_DIM>;
    constexpr int PASSES = L::PASSES;
    const int sub = threadIdx.x % L::TPR;  // this thread's chunk of the row
    const i64 total = (i64)p.batch * p.nheads * p.seqlen_q_pad;
    const i64 first = (i64)blockIdx.x * L::ROWS_PER_BLOCK + threadIdx.x / L::TPR;

    // Every load of the thread's rows (O, dO, and lse for the row's first lane) and the zeroing of
    // their dq_accum rows are issued before any loaded value is used: the kernel is memory-bound, and
    // the stores depend on nothing loaded.
    // lse is read only where a row's lse * log2(e) is written (lse_log2, or sink logits' d sink terms).
    bool need_lse = p.lse_log2 != nullptr;
    if constexpr (FEAT) need_lse = need_lse || p.mask.dsink_rows != nullptr;
    uint4 ov[PASSES], dv[PASSES];
    float lv[PASSES];
    i64 q_row0[PASSES];
    int sq[PASSES], rh[PASSES];
#pragma unroll
    for (int k = 0; k < PASSES; ++k) {
        // row_id runs over (batch, head, padded row)
        const i64 row_id = first + k * L::ROWS_PER_PASS;
        const RowOf ro(row_id, p.seqlen_q_pad, p.nheads);
        const int i = ro.i, h = ro.h, b = ro.b;
        rh[k] = h;
        q_row0[k] = 0;
        sq[k] = p.seqlen_q;
        if constexpr (FEAT) {
            if (row_id < total) {
                const SeqInfo si = seq_info(p.mask, b, p.seqlen_q, p.seqlen_k);
                q_row0[k] = si.q_row0;
                sq[k] = si.sq;
            }
        }
        ov[k] = make_uint4(0u, 0u, 0u, 0u);
        dv[k] = ov[k];
        lv[k] = -CUFLASH_INF;
        if (row_id < total && i < sq[k]) {
            const i64 r = q_row0[k] + i;
            if (sub < L::CHUNKS) {
                const T* o = static_cast<const T*>(p.o) + b * p.o_batch_stride + r * p.o_row_stride + h * p.o_head_stride;
                const T* dO = static_cast<const T*>(p.dout) + b * p.do_batch_stride + r * p.do_row_stride + h * p.do_head_stride;
                ov[k] = *reinterpret_cast<const uint4*>(o + sub * 8);
                dv[k] = *reinterpret_cast<const uint4*>(dO + sub * 8);
            }
            if (sub == 0 && need_lse)
                lv[k] = FEAT ? p.lse[b * p.mask.lse_batch_stride + h * p.mask.lse_head_stride + q_row0[k] + i]
                             : p.lse[ro.bh * p.seqlen_q + i];
        }
        if (row_id < total) {
            if constexpr (ZERO_DQ && ACC_DIM == HEAD_DIM) {
                if (sub < L::CHUNKS) {
                    float4* acc = reinterpret_cast<float4*>(p.dq_accum + row_id * HEAD_DIM);
                    acc[sub] = make_float4(0.f, 0.f, 0.f, 0.f);
                    acc[sub + L::CHUNKS] = make_float4(0.f, 0.f, 0.f, 0.f);
                }
            } else if constexpr (ZERO_DQ) {
                float4* acc = reinterpret_cast<float4*>(p.dq_accum + row_id * ACC_DIM);
#pragma unroll
                for (int c = sub; c < ACC_DIM / 4; c += L::TPR) acc[c] = make_float4(0.f, 0.f, 0.f, 0.f);
            }
        }
    }
#pragma unroll
    for (int k = 0; k < PASSES; ++k) {
        const i64 row_id = first + k * L::ROWS_PER_PASS;
        const u16* oe = reinterpret_cast<const u16*>(&ov[k]);
        const u16* de = reinterpret_cast<const u16*>(&dv[k]);
        float d = 0.f;
#pragma unroll
        for (int e = 0; e < 8; ++e) d += Ops::to_float(oe[e]) * Ops::to_float(de[e]);
        d = row_group_sum<L::TPR>(d);
        if (row_id >= total || sub != 0) continue;
        p.delta[row_id] = d;
        // lse * log2(e); +inf where the row sees no key (lse -inf) or does not exist (lv stays -inf)
        const float l2 = lv[k] != -CUFLASH_INF ? lv[k] * CUFLASH_LOG2E : CUFLASH_INF;
        if (p.lse_log2 != nullptr) p.lse_log2[row_id] = l2;  // null when no kernel of the call reads it
        if constexpr (FEAT) {
            // This row's term of d sink_logits[h] = -sum_i exp(sink - lse_i) * D_i (0 for padding). P_sink is
            // capped at 1 as the keys' P is (file comment): with the lse of the same call sink <= lse anyway,
            // but a stale lse under a huge sink logit made it inf, and the dQ kernel's D correction then
            // multiplied it by a zero B (NaN dq; tests/test_fuzz_inputs.py REGRESSIONS).
            if (p.mask.dsink_rows != nullptr)
                p.mask.dsink_rows[row_id] = -fast_exp2(fminf(p.mask.sink_logits[rh[k]] * CUFLASH_LOG2E - l2, 0.f)) * d;
        }
    }
}

// ------------------------------------------------------------------------------------------------
// 2. dK, dV (and dQ by atomics)
// ------------------------------------------------------------------------------------------------
template <int HEAD_DIM, int BLOCK_M, int BLOCK_N, int WARPS>
struct BwdTraits {
    static constexpr int THREADS = WARPS * 32;
    static constexpr int PITCH = padded_pitch(HEAD_DIM);   // rows of K, V, Q, dO tiles
    static constexpr int PPITCH = padded_pitch(BLOCK_M);   // rows of the P^T, dS^T tiles (BLOCK_N x BLOCK_M)
    static constexpr int D_TILES = HEAD_DIM / 8;
    // phase A: warps as (BLOCK_N / 16 key groups) x (query column groups)
    static constexpr int KEY_GROUPS = BLOCK_N / 16;
    static constexpr int A_COL_GROUPS = WARPS / KEY_GROUPS;
    static constexpr int A_COLS = BLOCK_M / A_COL_GROUPS;                     // queries per warp
    static constexpr int A_TILES = A_COLS / 8;
    // phase B: warps as (key groups of B_MT m16 tiles) x (head_dim column groups). Two m16 tiles
    // per warp where the warps allow it: each dO / Q fragment then serves two mma.
    static constexpr int B_MT = (BLOCK_N % 32 == 0 && WARPS % (BLOCK_N / 32) == 0) ? 2 : 1;
    static constexpr int B_KEY_GROUPS = BLOCK_N / (16 * B_MT);
    static constexpr int B_COL_GROUPS = WARPS / B_KEY_GROUPS;
    static constexpr int B_TILES = (D_TILES + B_COL_GROUPS - 1) / B_COL_GROUPS;  // head_dim tiles per warp
    // phase C: warps as (BLOCK_M / 16 query groups) x (head_dim column groups)
    static constexpr int Q_GROUPS = BLOCK_M / 16;
    static constexpr int C_COL_GROUPS = WARPS / Q_GROUPS;
    static constexpr int C_TILES = (D_TILES + C_COL_GROUPS - 1) / C_COL_GROUPS;

    static constexpr int SK_ELEMS = BLOCK_N * PITCH;
    static constexpr int SQ_ELEMS = BLOCK_M * PITCH;
    static constexpr int SP_ELEMS = BLOCK_N * PPITCH;
    // sK, sV, sQ[2], sdO[2], sPt, sdSt (16-bit), then sLse[2], sDelta[2] (float).
    // Must equal cuflash/_config.py:bwd_smem_bytes.
    static constexpr int SMEM_BYTES = (2 * SK_ELEMS + 4 * SQ_ELEMS + 2 * SP_ELEMS) * 2 + 4 * BLOCK_M * 4;

    static_assert(HEAD_DIM % 8 == 0 && HEAD_DIM >= 8 && HEAD_DIM <= 256, "head_dim: multiple of 8 in [8, 256]");
    static_assert(BLOCK_N % 16 == 0 && KEY_GROUPS <= WARPS && WARPS % KEY_GROUPS == 0, "phase A/B warp grid");
    static_assert(A_COLS % 8 == 0 && A_COLS * A_COL_GROUPS == BLOCK_M, "phase A columns");
    static_assert(BLOCK_M % 16 == 0 && Q_GROUPS <= WARPS && WARPS % Q_GROUPS == 0, "phase C warp grid");
    static_assert(BLOCK_M % 8 == 0 && (BLOCK_M * 4) % 16 == 0, "lse / delta tiles move in 16-byte chunks");
};

// BLOCK_M floats from global to shared memory, 16 bytes a thread.
template <int BLOCK_M, int THREADS>
__device__ __forceinline__ void load_row_floats_async(float* s_dst, const float* g_src, int tid) {
    for (int c = tid; c < BLOCK_M / 4; c += THREADS) cp_async_16(smem_addr(s_dst + 4 * c), g_src + 4 * c, 16);
}

template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int WARPS, bool IS_CAUSAL, bool IS_EVEN, bool ATOMIC_DQ,
          bool FEAT = false, bool SINGLE = false>
__global__ void __launch_bounds__(WARPS * 32, 1)
flash_bwd_dkdv_kernel(const __grid_constant__ BwdParams p) {
    using Tr = BwdTraits<HEAD_DIM, BLOCK_M, BLOCK_N, WARPS>;
    constexpr int THREADS = Tr::THREADS, PITCH = Tr::PITCH, PPITCH = Tr::PPITCH, D_TILES = Tr::D_TILES;
    constexpr int A_TILES = Tr::A_TILES, B_TILES = Tr::B_TILES, C_TILES = Tr::C_TILES, B_MT = Tr::B_MT;
    static_assert(!(SINGLE && (ATOMIC_DQ || FEAT)), "SINGLE: plain calls; dQ is written, not accumulated");
    // SINGLE: the threads of a query row when D is formed (consecutive lanes of one warp).
    constexpr int ROW_TPR = THREADS / BLOCK_M;
    static_assert(!SINGLE || (THREADS % BLOCK_M == 0 && (ROW_TPR & (ROW_TPR - 1)) == 0 && ROW_TPR <= 32),
                  "SINGLE: a power-of-two number of a warp's lanes per query row");

    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* sK = reinterpret_cast<T*>(smem_raw);        // (BLOCK_N, PITCH)
    T* sV = sK + Tr::SK_ELEMS;                     // (BLOCK_N, PITCH)
    T* sQ = sV + Tr::SK_ELEMS;                     // 2 x (BLOCK_M, PITCH)
    T* sdO = sQ + 2 * Tr::SQ_ELEMS;                // 2 x (BLOCK_M, PITCH)
    T* sPt = sdO + 2 * Tr::SQ_ELEMS;               // (BLOCK_N, PPITCH): P^T
    T* sdSt = sPt + Tr::SP_ELEMS;                  // (BLOCK_N, PPITCH): dS^T
    float* sLse = reinterpret_cast<float*>(sdSt + Tr::SP_ELEMS);  // 2 x BLOCK_M
    float* sDelta = sLse + 2 * BLOCK_M;                            // 2 x BLOCK_M

    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int g = lane / 4, t = lane % 4;
    if (tid == 0 && dynamic_smem_bytes() < (u32)Tr::SMEM_BYTES) __trap();

    const int sq = p.seqlen_q, sk = p.seqlen_k;
    // Keys [n0, n0 + BLOCK_N) of kv head h_kv; the query blocks that see at least one of them.
    const KeyBlock blk = key_block<BLOCK_M, BLOCK_N, IS_CAUSAL>(blockIdx.x, p.num_blocks, p.nheads_kv, sq, sk);
    const int h_kv = blk.h_kv, b = blk.b, n0 = blk.n0;
    int m_begin = blk.m_begin, m_iters = blk.m_iters;

    // With FEAT: the sequence, its mask, and the query blocks whose rows may see these keys.
    SeqInfo si;
    MaskInfo mi;
    int q_valid = sq, k_valid = sk;  // rows / keys past these are zero-filled in shared memory
    if constexpr (FEAT) {
        static_assert(!ATOMIC_DQ && !IS_CAUSAL && !IS_EVEN, "FEAT kernels: masks are run-time");
        si = seq_info(p.mask, b, sq, sk);
        if (n0 >= si.k_rows) return;  // packed batch: the block lies past its sequence
        mi.init(p.mask, si, b, h_kv * p.head_group);
        query_range<BLOCK_M, BLOCK_N>(p.mask, mi, n0, m_begin, m_iters);
        q_valid = si.sq;
        k_valid = si.sk;
    } else {
        si.q_row0 = si.k_row0 = 0;
    }
    const int iters = m_iters * p.head_group;
    bool score_mod = false;  // softcap or ALiBi: every tile's scores are modified
    if constexpr (FEAT) score_mod = p.mask.softcap > 0.f || p.mask.alibi_slopes != nullptr;

    const T* gK = static_cast<const T*>(p.k) + b * p.k_batch_stride + h_kv * p.k_head_stride + (si.k_row0 + n0) * p.k_row_stride;
    const T* gV = static_cast<const T*>(p.v) + b * p.v_batch_stride + h_kv * p.v_head_stride + (si.k_row0 + n0) * p.v_row_stride;

    // Issues the copies of iteration `it` (query head, query block) into stage it % 2.
    auto load_q_tiles = [&](int it) {
        const int hq = h_kv * p.head_group + it / m_iters;
        const int m0 = (m_begin + it % m_iters) * BLOCK_M;
        const int st = it % 2;
        const T* gQ = static_cast<const T*>(p.q) + b * p.q_batch_stride + hq * p.q_head_stride + (si.q_row0 + m0) * p.q_row_stride;
        const T* gdO = static_cast<const T*>(p.dout) + b * p.do_batch_stride + hq * p.do_head_stride + (si.q_row0 + m0) * p.do_row_stride;
        load_tile_async<T, HEAD_DIM, PITCH, BLOCK_M, THREADS, !IS_EVEN>(sQ + st * Tr::SQ_ELEMS, gQ, p.q_row_stride, q_valid - m0, tid);
        load_tile_async<T, HEAD_DIM, PITCH, BLOCK_M, THREADS, !IS_EVEN>(sdO + st * Tr::SQ_ELEMS, gdO, p.do_row_stride, q_valid - m0, tid);
        if constexpr (!SINGLE) {  // (SINGLE forms them once the tiles have landed)
            const i64 row = ((i64)b * p.nheads + hq) * p.seqlen_q_pad + m0;
            load_row_floats_async<BLOCK_M, THREADS>(sLse + st * BLOCK_M, p.lse_log2 + row, tid);
            load_row_floats_async<BLOCK_M, THREADS>(sDelta + st * BLOCK_M, p.delta + row, tid);
        }
    };

    if (iters > 0) {
        load_tile_async<T, HEAD_DIM, PITCH, BLOCK_N, THREADS, !IS_EVEN>(sK, gK, p.k_row_stride, k_valid - n0, tid);
        load_tile_async<T, HEAD_DIM, PITCH, BLOCK_N, THREADS, !IS_EVEN>(sV, gV, p.v_row_stride, k_valid - n0, tid);
        load_q_tiles(0);
        cp_async_commit();
    }

    // Phase A warp coordinates: key group (16 keys) and query column group.
    const int kg = warp % Tr::KEY_GROUPS, cg = warp / Tr::KEY_GROUPS;
    // Phase B: key group (16 * B_MT keys) and head_dim column group.
    const int kgb = warp % Tr::B_KEY_GROUPS, cgb = warp / Tr::B_KEY_GROUPS;
    const int b_tile0 = cgb * B_TILES, b_count = min(B_TILES, D_TILES - b_tile0);
    // Phase C: query group (16 queries) and head_dim column group.
    const int qg = warp % Tr::Q_GROUPS, cgc = warp / Tr::Q_GROUPS;
    const int c_tile0 = cgc * C_TILES, c_count = min(C_TILES, D_TILES - c_tile0);

    if constexpr (SINGLE) {
        // Rows before the first query block that sees a key (causal, seqlen_q > seqlen_k: they see
        // none): dq = 0, for every query head of the group (here, before the loop's registers are live).
        const int zero_rows = min(m_begin * BLOCK_M, sq);
        constexpr int CH = HEAD_DIM / 8;
        for (int x = tid; x < p.head_group * zero_rows * CH; x += THREADS) {
            const int hq = h_kv * p.head_group + x / (zero_rows * CH), rc = x % (zero_rows * CH);
            T* dst = static_cast<T*>(p.dq) + b * p.dq_batch_stride + hq * p.dq_head_stride + (rc / CH) * p.dq_row_stride;
            *reinterpret_cast<uint4*>(dst + (rc % CH) * 8) = make_uint4(0u, 0u, 0u, 0u);
        }
    }

    float acc_dk[B_MT][B_TILES][4], acc_dv[B_MT][B_TILES][4];  // (16 * B_MT keys, B_TILES * 8 of head_dim) per warp
#pragma unroll
    for (int mt = 0; mt < B_MT; ++mt) {
        zero_acc(acc_dk[mt]);
        zero_acc(acc_dv[mt]);
    }

    for (int it = 0; it < iters; ++it) {
        cp_async_wait<0>();
        __syncthreads();  // tiles of `it` landed; every warp is done with iteration it - 1
        if (it + 1 < iters) {
            load_q_tiles(it + 1);
            cp_async_commit();
        }
        const int st = it % 2;
        const int hq = h_kv * p.head_group + it / m_iters;
        const int m0 = (m_begin + it % m_iters) * BLOCK_M;
        const T* sQs = sQ + st * Tr::SQ_ELEMS;
        const T* sdOs = sdO + st * Tr::SQ_ELEMS;

        if constexpr (SINGLE) {
            // The preprocess's rows, here: lse * log2(e) (+inf past seqlen_q or where the row sees no
            // key, so P = 0 there) and D = rowsum(dO * O), ROW_TPR threads a row, dO from the tile
            // (zero past seqlen_q), O from global memory in 16-byte chunks.
            const int r = tid / ROW_TPR, part = tid % ROW_TPR, row = m0 + r;
            const bool valid = row < sq;
            float d = 0.f;
            if (valid) {
                const T* o = static_cast<const T*>(p.o) + b * p.o_batch_stride + hq * p.o_head_stride + row * p.o_row_stride;
#pragma unroll 1
                for (int c = part * 8; c < HEAD_DIM; c += ROW_TPR * 8) {
                    const uint4 ov = *reinterpret_cast<const uint4*>(o + c);
                    const uint4 dv = *reinterpret_cast<const uint4*>(sdOs + r * PITCH + c);
                    const u16* oe = reinterpret_cast<const u16*>(&ov);
                    const u16* de = reinterpret_cast<const u16*>(&dv);
#pragma unroll
                    for (int e = 0; e < 8; ++e) d += ElemOps<T>::to_float(oe[e]) * ElemOps<T>::to_float(de[e]);
                }
            }
#pragma unroll
            for (int o = ROW_TPR / 2; o > 0; o /= 2) d += __shfl_xor_sync(0xffffffffu, d, o);
            if (part == 0) {
                const float l = valid ? p.lse[((i64)b * p.nheads + hq) * sq + row] : -CUFLASH_INF;
                sDelta[st * BLOCK_M + r] = d;
                sLse[st * BLOCK_M + r] = l != -CUFLASH_INF ? l * CUFLASH_LOG2E : CUFLASH_INF;
            }
            __syncthreads();
        }

        // ---- A: S^T = K Q^T and dP^T = V dO^T, (16 keys, A_COLS queries) per warp ----
        {
            float s[A_TILES][4], dp[A_TILES][4];
            zero_acc(s);
            zero_acc(dp);
            warp_mma<T, HEAD_DIM, A_TILES, false, false>(s, sK + kg * 16 * PITCH, PITCH, sQs + cg * Tr::A_COLS * PITCH, PITCH, A_TILES, lane);
            warp_mma<T, HEAD_DIM, A_TILES, false, false>(dp, sV + kg * 16 * PITCH, PITCH, sdOs + cg * Tr::A_COLS * PITCH, PITCH, A_TILES, lane);
            const bool tail = !IS_EVEN && n0 + BLOCK_N > sk;
            const bool diag = IS_CAUSAL && n0 + BLOCK_N - 1 > m0 + sk - sq;
            // FEAT: tiles inside every bound, without softcap or ALiBi, take the plain path below.
            bool slow = false, edge = false;
            if constexpr (FEAT) {
                mi.set_head(p.mask, b, hq);
                edge = mi.needs_mask(p.mask, m0, BLOCK_M, n0, BLOCK_N);
                slow = score_mod || edge;
            }
            if (slow) {
                QuerySpan qs[2];  // the query spans of this thread's two keys (used on edge tiles)
                if constexpr (FEAT) {
                    qs[0] = mi.query_span(p.mask, n0 + kg * 16 + g);
                    qs[1] = mi.query_span(p.mask, n0 + kg * 16 + g + 8);
                }
                if (score_mod) {
#pragma unroll
                    for (int nt = 0; nt < A_TILES; ++nt)
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            const int kl = kg * 16 + g + (e / 2) * 8;
                            const int ql = cg * Tr::A_COLS + nt * 8 + 2 * t + (e % 2);
                            const int key = n0 + kl, query = m0 + ql;
                            float tanh_s;
                            const float x = mi.logit_log2(p.mask, p.scale_log2, s[nt][e], query, key, tanh_s);
                            const float pv = (edge && !qs[e / 2].has(query)) ? 0.f : fast_exp2(fminf(x - sLse[st * BLOCK_M + ql], 0.f));
                            s[nt][e] = pv;
                            // softcap: d logit / d s = 1 - tanh^2 (tanh_s = 0 without softcap)
                            dp[nt][e] = pv * (dp[nt][e] - sDelta[st * BLOCK_M + ql]) * (1.f - tanh_s * tanh_s);
                        }
                } else {  // an edge tile without softcap / ALiBi
#pragma unroll
                    for (int nt = 0; nt < A_TILES; ++nt)
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            const int ql = cg * Tr::A_COLS + nt * 8 + 2 * t + (e % 2);
                            const float pv = qs[e / 2].has(m0 + ql)
                                                 ? fast_exp2(fminf(fmaf(s[nt][e], p.scale_log2, -sLse[st * BLOCK_M + ql]), 0.f)) : 0.f;
                            s[nt][e] = pv;
                            dp[nt][e] = pv * (dp[nt][e] - sDelta[st * BLOCK_M + ql]);
                        }
                }
            } else {
#pragma unroll
            for (int nt = 0; nt < A_TILES; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int kl = kg * 16 + g + (e / 2) * 8;              // key within the block
                    const int ql = cg * Tr::A_COLS + nt * 8 + 2 * t + (e % 2);  // query within the block
                    // lse_log2 is +inf for queries that see nothing or lie past seqlen_q: P = 0.
                    // P <= 1 (clamped: the forward's rounded max and lse make the exact exponent
                    // slightly positive for logits far beyond 2^24; unclamped it overflows).
                    float pv = fast_exp2(fminf(fmaf(s[nt][e], p.scale_log2, -sLse[st * BLOCK_M + ql]), 0.f));
                    if (tail || diag) {
                        const int key = n0 + kl, query = m0 + ql;
                        bool masked = key >= sk;
                        if (IS_CAUSAL) masked = masked || key > query + sk - sq;
                        if (masked) pv = 0.f;
                    }
                    s[nt][e] = pv;
                    dp[nt][e] = pv * (dp[nt][e] - sDelta[st * BLOCK_M + ql]);
                }
            }
            store_acc_smem<T, A_TILES>(sPt + kg * 16 * PPITCH + cg * Tr::A_COLS, PPITCH, s, A_TILES, lane);
            store_acc_smem<T, A_TILES>(sdSt + kg * 16 * PPITCH + cg * Tr::A_COLS, PPITCH, dp, A_TILES, lane);
        }
        __syncthreads();

        // ---- B: dV += P^T dO, dK += dS^T Q, (16 * B_MT keys, B_TILES * 8 of head_dim) per warp ----
        const int krow = kgb * 16 * B_MT;
        warp_mma_mt<T, BLOCK_M, B_MT, B_TILES, false, true>(acc_dv, sPt + krow * PPITCH, PPITCH, sdOs + b_tile0 * 8, PITCH, b_count, lane);
        warp_mma_mt<T, BLOCK_M, B_MT, B_TILES, false, true>(acc_dk, sdSt + krow * PPITCH, PPITCH, sQs + b_tile0 * 8, PITCH, b_count, lane);

        // ---- C: dQ_part = dS K, (16 queries, C_TILES * 8 of head_dim) per warp: added into dq_accum
        // (ATOMIC_DQ), or, where this block holds every key (SINGLE), the rows' whole dQ = scale * dS K
        // written in the input dtype. In chunks of C_CHUNK tiles, so that only 4 * C_CHUNK accumulators
        // are live here on top of dK and dV (one tile at a time for SINGLE from head_dim 104: two put
        // ptxas over the register file there).
        if constexpr (ATOMIC_DQ || SINGLE) {
            float* acc = ATOMIC_DQ ? p.dq_accum + (((i64)b * p.nheads + hq) * p.seqlen_q_pad + m0 + qg * 16) * HEAD_DIM
                                   : nullptr;
            const int row = m0 + qg * 16 + g;  // (SINGLE) rows g and g + 8 of the warp's 16
            T* dq0 = nullptr;
            if constexpr (SINGLE)
                dq0 = static_cast<T*>(p.dq) + b * p.dq_batch_stride + hq * p.dq_head_stride + row * p.dq_row_stride;
            const bool ok0 = IS_EVEN || row < sq, ok1 = IS_EVEN || row + 8 < sq;
            constexpr int C_CHUNK = C_TILES < 2 || (SINGLE && HEAD_DIM > 96) ? 1 : 2;
#pragma unroll
            for (int c0 = 0; c0 < C_TILES; c0 += C_CHUNK) {
                const int tile0 = c_tile0 + c0, count = min(C_CHUNK, c_count - c0);
                if (count > 0) {
                    float dq[C_CHUNK][4];
                    zero_acc(dq);
                    warp_mma<T, BLOCK_N, C_CHUNK, true, true>(dq, sdSt + qg * 16, PPITCH, sK + tile0 * 8, PITCH, count, lane);
#pragma unroll
                    for (int i = 0; i < C_CHUNK; ++i)
                        if (i < count) {
                            const int col = (tile0 + i) * 8 + 2 * t;
                            if constexpr (ATOMIC_DQ) {
                                atomicAdd(acc + g * HEAD_DIM + col, dq[i][0]);
                                atomicAdd(acc + g * HEAD_DIM + col + 1, dq[i][1]);
                                atomicAdd(acc + (g + 8) * HEAD_DIM + col, dq[i][2]);
                                atomicAdd(acc + (g + 8) * HEAD_DIM + col + 1, dq[i][3]);
                            } else {
                                if (ok0) *reinterpret_cast<u32*>(dq0 + col) = ElemOps<T>::pack(dq[i][0] * p.scale, dq[i][1] * p.scale);
                                if (ok1) *reinterpret_cast<u32*>(dq0 + 8 * p.dq_row_stride + col) =
                                    ElemOps<T>::pack(dq[i][2] * p.scale, dq[i][3] * p.scale);
                            }
                        }
                }
            }
        }
    }
    cp_async_wait<0>();

    // ---- dK = scale * dK, dV: this warp's 16 * B_MT keys, B_TILES * 8 columns, in the input dtype ----
    T* gdK = static_cast<T*>(p.dk) + b * p.dk_batch_stride + h_kv * p.dk_head_stride + si.k_row0 * p.dk_row_stride;
    T* gdV = static_cast<T*>(p.dv) + b * p.dv_batch_stride + h_kv * p.dv_head_stride + si.k_row0 * p.dv_row_stride;
    const int k_rows = FEAT ? si.k_rows : sk;  // keys this block writes
#pragma unroll
    for (int mt = 0; mt < B_MT; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int key = n0 + kgb * 16 * B_MT + mt * 16 + g + r * 8;
            if (IS_EVEN || key < k_rows) {
#pragma unroll
                for (int i = 0; i < B_TILES; ++i)
                    if (i < b_count) {
                        const int col = (b_tile0 + i) * 8 + 2 * t;
                        *reinterpret_cast<u32*>(gdK + key * p.dk_row_stride + col) =
                            ElemOps<T>::pack(acc_dk[mt][i][2 * r] * p.scale, acc_dk[mt][i][2 * r + 1] * p.scale);
                        *reinterpret_cast<u32*>(gdV + key * p.dv_row_stride + col) =
                            ElemOps<T>::pack(acc_dv[mt][i][2 * r], acc_dv[mt][i][2 * r + 1]);
                    }
            }
        }
}

// ------------------------------------------------------------------------------------------------
// 3a. dq = scale * dq_accum (atomic path); rows (batch, head, query row) as the preprocess's (RowLanes)
// ------------------------------------------------------------------------------------------------
// DQ_PERM = 0: dq_accum is row-major (batch, nheads, seqlen_q_pad, HEAD_DIM). DQ_PERM = n > 0: each
// block of PERM_ROWS rows is in flash_bwd_sm90_ws.cu's order: parts of 64 rows x n columns (part
// (r / 64) * (HEAD_DIM / n) + column / n for row r of the block), each held as that kernel's consumer
// threads hold them (its header); the row's 8 columns of chunk c are then the float2 halves (hi =
// r % 16 / 8) of four consecutive float4s. OUT_DIM: the columns of dq (head_dim pad-up: the
// accumulator is HEAD_DIM wide, the call's dq OUT_DIM; HEAD_DIM otherwise).
template <typename T, int HEAD_DIM, bool FEAT = false, int DQ_PERM = 0, int PERM_ROWS = 64, int OUT_DIM = HEAD_DIM>
__global__ void __launch_bounds__(256)
flash_bwd_convert_dq_kernel(const __grid_constant__ BwdParams p) {
    using L = RowLanes<HEAD_DIM>;
    constexpr int PASSES = L::PASSES;
    const int c = threadIdx.x % L::TPR;  // this thread's chunk of 8 columns
    const i64 total = (i64)p.batch * p.nheads * p.seqlen_q;
    const i64 first = (i64)blockIdx.x * L::ROWS_PER_BLOCK + threadIdx.x / L::TPR;  // over (batch, head, row < seqlen_q)

    float4 x[PASSES], y[PASSES];
    T* dst[PASSES];
#pragma unroll
    for (int k = 0; k < PASSES; ++k) {
        const i64 row_id = first + k * L::ROWS_PER_PASS;
        const RowOf ro(row_id, p.seqlen_q, p.nheads);
        const int i = ro.i, h = ro.h, b = ro.b;
        const i64 bh = ro.bh;
        bool ok = row_id < total && c < L::CHUNKS && c < OUT_DIM / 8;
        T* dq = static_cast<T*>(p.dq) + b * p.dq_batch_stride + i * p.dq_row_stride + h * p.dq_head_stride;
        if constexpr (FEAT) {
            // The row among the sequence's own rows (packed: offset by cu_seqlens_q; rows past it are
            // another sequence's). Padding rows of a padded batch get 0 (nothing was added to them).
            if (ok) {
                const SeqInfo si = seq_info(p.mask, b, p.seqlen_q, p.seqlen_k);
                ok = i < si.q_rows;
                dq += si.q_row0 * p.dq_row_stride;
            }
        }
        dst[k] = ok ? dq + c * 8 : nullptr;
        x[k] = make_float4(0.f, 0.f, 0.f, 0.f);
        y[k] = x[k];
        if (!ok) continue;
        const float* acc = p.dq_accum + (bh * p.seqlen_q_pad + i) * HEAD_DIM;
        if constexpr (DQ_PERM > 0) {
            static_assert(HEAD_DIM % DQ_PERM == 0 && PERM_ROWS % 64 == 0, "the permuted layout");
            const int rb = i % PERM_ROWS, r = rb % 64;
            const int part = (rb / 64) * (HEAD_DIM / DQ_PERM) + 8 * c / DQ_PERM, j = (8 * c % DQ_PERM) / 8;
            const int u0 = (r / 16) * 32 + (r % 8) * 4;  // consumer thread of t = 0
            const float2* blk2 = reinterpret_cast<const float2*>(acc - (i64)rb * HEAD_DIM + part * 64 * DQ_PERM) + (r % 16) / 8;
            const float2 a0 = blk2[2 * (j * 128 + u0)], a1 = blk2[2 * (j * 128 + u0 + 1)];
            const float2 a2 = blk2[2 * (j * 128 + u0 + 2)], a3 = blk2[2 * (j * 128 + u0 + 3)];
            x[k] = make_float4(a0.x, a0.y, a1.x, a1.y);
            y[k] = make_float4(a2.x, a2.y, a3.x, a3.y);
        } else {
            x[k] = reinterpret_cast<const float4*>(acc)[2 * c];
            y[k] = reinterpret_cast<const float4*>(acc)[2 * c + 1];
        }
    }
#pragma unroll
    for (int k = 0; k < PASSES; ++k) {
        if (dst[k] == nullptr) continue;
        uint4 out;
        out.x = ElemOps<T>::pack(x[k].x * p.scale, x[k].y * p.scale);
        out.y = ElemOps<T>::pack(x[k].z * p.scale, x[k].w * p.scale);
        out.z = ElemOps<T>::pack(y[k].x * p.scale, y[k].y * p.scale);
        out.w = ElemOps<T>::pack(y[k].z * p.scale, y[k].w * p.scale);
        *reinterpret_cast<uint4*>(dst[k]) = out;
    }
}

// ------------------------------------------------------------------------------------------------
// 3b. dQ without atomics (deterministic): the forward's partition
// ------------------------------------------------------------------------------------------------
template <int HEAD_DIM, int BLOCK_M, int BLOCK_N, int WARPS>
struct BwdDqTraits {
    static constexpr int THREADS = WARPS * 32;
    static constexpr int PITCH = padded_pitch(HEAD_DIM);
    static constexpr int N_TILES = BLOCK_N / 8;
    static constexpr int D_TILES = HEAD_DIM / 8;
    static constexpr int SQ_ELEMS = BLOCK_M * PITCH;
    static constexpr int SK_ELEMS = BLOCK_N * PITCH;
    // sQ, sdO, then sK[2], sV[2]. Must equal cuflash/_config.py:bwd_dq_smem_bytes.
    static constexpr int SMEM_BYTES = (2 * SQ_ELEMS + 4 * SK_ELEMS) * 2;
    static_assert(BLOCK_M == 16 * WARPS, "one m16 tile of query rows per warp");
    static_assert(BLOCK_N % 16 == 0, "dS is re-used as an A operand in k16 steps");
};

template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int WARPS, bool IS_CAUSAL, bool IS_EVEN, bool FEAT = false>
__global__ void __launch_bounds__(WARPS * 32, 1)
flash_bwd_dq_kernel(const __grid_constant__ BwdParams p) {
    using Tr = BwdDqTraits<HEAD_DIM, BLOCK_M, BLOCK_N, WARPS>;
    using Ops = ElemOps<T>;
    constexpr int THREADS = Tr::THREADS, PITCH = Tr::PITCH, N_TILES = Tr::N_TILES, D_TILES = Tr::D_TILES;

    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* sQ = reinterpret_cast<T*>(smem_raw);  // (BLOCK_M, PITCH)
    T* sdO = sQ + Tr::SQ_ELEMS;              // (BLOCK_M, PITCH)
    T* sK = sdO + Tr::SQ_ELEMS;              // 2 x (BLOCK_N, PITCH)
    T* sV = sK + 2 * Tr::SK_ELEMS;           // 2 x (BLOCK_N, PITCH)

    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int g = lane / 4, t = lane % 4;
    if (tid == 0 && dynamic_smem_bytes() < (u32)Tr::SMEM_BYTES) __trap();

    const int sq = p.seqlen_q, sk = p.seqlen_k;
    const QueryBlock blk = query_block<BLOCK_M, BLOCK_N, IS_CAUSAL>(blockIdx.x, p.num_blocks, p.nheads, p.head_group, sq, sk);
    const int h = blk.h, b = blk.b, h_kv = blk.h_kv, m0 = blk.m0;
    int n_blocks = blk.n_blocks;

    // With FEAT: the sequence, its mask and the key tiles to visit (as in the forward).
    int q_valid = sq, k_valid = sk;  // rows / keys past these are zero-filled in shared memory
    const QueryFeat qf = query_setup<FEAT, BLOCK_M, BLOCK_N>(p.mask, b, h, m0, sq, sk, n_blocks, q_valid, k_valid);
    if constexpr (FEAT) {
        if (qf.past_end) return;
    }
    auto tile_of = [&](int it) { if constexpr (FEAT) return qf.kt.tile(it); else return it; };

    const T* gQ = static_cast<const T*>(p.q) + b * p.q_batch_stride + h * p.q_head_stride + (qf.si.q_row0 + m0) * p.q_row_stride;
    const T* gdO = static_cast<const T*>(p.dout) + b * p.do_batch_stride + h * p.do_head_stride + (qf.si.q_row0 + m0) * p.do_row_stride;
    const T* gK = static_cast<const T*>(p.k) + b * p.k_batch_stride + h_kv * p.k_head_stride + qf.si.k_row0 * p.k_row_stride;
    const T* gV = static_cast<const T*>(p.v) + b * p.v_batch_stride + h_kv * p.v_head_stride + qf.si.k_row0 * p.v_row_stride;

    load_tile_async<T, HEAD_DIM, PITCH, BLOCK_M, THREADS, !IS_EVEN>(sQ, gQ, p.q_row_stride, q_valid - m0, tid);
    load_tile_async<T, HEAD_DIM, PITCH, BLOCK_M, THREADS, !IS_EVEN>(sdO, gdO, p.do_row_stride, q_valid - m0, tid);
    if (n_blocks > 0) {
        const int n_first = tile_of(0) * BLOCK_N;
        load_tile_async<T, HEAD_DIM, PITCH, BLOCK_N, THREADS, !IS_EVEN>(
            sK, gK + (i64)n_first * p.k_row_stride, p.k_row_stride, k_valid - n_first, tid);
        load_tile_async<T, HEAD_DIM, PITCH, BLOCK_N, THREADS, !IS_EVEN>(
            sV, gV + (i64)n_first * p.v_row_stride, p.v_row_stride, k_valid - n_first, tid);
    }
    cp_async_commit();

    // This thread's two rows (g and g + 8 of the warp's 16): lse in log2 units and delta.
    const i64 row_base = ((i64)b * p.nheads + h) * p.seqlen_q_pad + m0 + warp * 16;
    const float lse2[2] = {p.lse_log2[row_base + g], p.lse_log2[row_base + g + 8]};
    const float dlt[2] = {p.delta[row_base + g], p.delta[row_base + g + 8]};

    float acc_dq[D_TILES][4];  // (16 rows, HEAD_DIM) per warp
    zero_acc(acc_dq);
    // DS_SPLIT: D's correction (file comment): B = sum_j W_j K_j in acc_b, and this thread's part of
    // E = sum_j P_j (dP_j - D) for its two rows in pdp; W_j = P_j (times 1 - tanh^2 with a softcap) in pw.
    constexpr bool DS_SPLIT = HEAD_DIM < DS_SPLIT_BELOW;
    float acc_b[D_TILES][4];
    zero_acc(acc_b);
    float pdp[2] = {0.f, 0.f};

    for (int j = 0; j < n_blocks; ++j) {
        cp_async_wait<0>();
        __syncthreads();
        if (j + 1 < n_blocks) {
            const int st = (j + 1) % 2;
            const i64 n1 = (i64)tile_of(j + 1) * BLOCK_N;
            load_tile_async<T, HEAD_DIM, PITCH, BLOCK_N, THREADS, !IS_EVEN>(
                sK + st * Tr::SK_ELEMS, gK + n1 * p.k_row_stride, p.k_row_stride, k_valid - (int)n1, tid);
            load_tile_async<T, HEAD_DIM, PITCH, BLOCK_N, THREADS, !IS_EVEN>(
                sV + st * Tr::SK_ELEMS, gV + n1 * p.v_row_stride, p.v_row_stride, k_valid - (int)n1, tid);
            cp_async_commit();
        }
        const T* sKj = sK + (j % 2) * Tr::SK_ELEMS;
        const T* sVj = sV + (j % 2) * Tr::SK_ELEMS;
        const int n0 = tile_of(j) * BLOCK_N;

        // S = Q K^T, dP = dO V^T: (16 rows, BLOCK_N) per warp
        float s[N_TILES][4], dp[N_TILES][4];
        zero_acc(s);
        zero_acc(dp);
        float pw[N_TILES][4];  // DS_SPLIT: W_j, the A operand of B's MMA
        // dS = P (dP - D) w, w = 1 or the softcap's 1 - tanh^2; with DS_SPLIT also W and sum P (dP - D).
        auto set_ds = [&](int nt, int e, float pv, float w) {
            const float pd = pv * (dp[nt][e] - dlt[e / 2]);
            if constexpr (DS_SPLIT) {
                pdp[e / 2] += pd;
                pw[nt][e] = pv * w;
            }
            dp[nt][e] = pd * w;
        };
        warp_mma<T, HEAD_DIM, N_TILES, false, false>(s, sQ + warp * 16 * PITCH, PITCH, sKj, PITCH, N_TILES, lane);
        warp_mma<T, HEAD_DIM, N_TILES, false, false>(dp, sdO + warp * 16 * PITCH, PITCH, sVj, PITCH, N_TILES, lane);

        const bool tail = !IS_EVEN && n0 + BLOCK_N > sk;
        const bool diag = IS_CAUSAL && n0 + BLOCK_N - 1 > m0 + sk - sq;
        // FEAT: tiles inside every bound, without softcap or ALiBi, take the plain path below.
        bool slow = false, edge = false;
        if constexpr (FEAT) {
            edge = qf.mi.needs_mask(p.mask, m0, BLOCK_M, n0, BLOCK_N);
            slow = qf.score_mod || edge;
        }
        if (slow) {
            KeySpan ks[2];  // the key spans of this thread's two rows (used on edge tiles)
            if constexpr (FEAT) {
                ks[0] = qf.mi.key_span(p.mask, m0 + warp * 16 + g);
                ks[1] = qf.mi.key_span(p.mask, m0 + warp * 16 + g + 8);
            }
            if (qf.score_mod && p.mask.softcap == 0.f) {  // ALiBi alone: distances from one conversion a row
                const int d_row = m0 + warp * 16 + g + qf.mi.shift - n0 - 2 * t;
                const float d0[2] = {(float)d_row, (float)(d_row + 8)};
#pragma unroll
                for (int nt = 0; nt < N_TILES; ++nt)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int col = n0 + nt * 8 + 2 * t + (e % 2);
                        const float x = qf.mi.alibi_logit_log2(p.scale_log2, s[nt][e], d0[e / 2] - (float)(nt * 8 + e % 2));
                        const float pv = (edge && !ks[e / 2].has(p.mask, col)) ? 0.f : fast_exp2(fminf(x - lse2[e / 2], 0.f));
                        set_ds(nt, e, pv, 1.f);
                    }
            } else if (qf.score_mod) {
#pragma unroll
                for (int nt = 0; nt < N_TILES; ++nt)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int row = m0 + warp * 16 + g + (e / 2) * 8;
                        const int col = n0 + nt * 8 + 2 * t + (e % 2);
                        float tanh_s;
                        const float x = qf.mi.logit_log2(p.mask, p.scale_log2, s[nt][e], row, col, tanh_s);
                        const float pv = (edge && !ks[e / 2].has(p.mask, col)) ? 0.f : fast_exp2(fminf(x - lse2[e / 2], 0.f));
                        set_ds(nt, e, pv, 1.f - tanh_s * tanh_s);
                    }
            } else {  // an edge tile without softcap / ALiBi
#pragma unroll
                for (int nt = 0; nt < N_TILES; ++nt)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int col = n0 + nt * 8 + 2 * t + (e % 2);
                        const float pv = ks[e / 2].has(p.mask, col) ? fast_exp2(fminf(fmaf(s[nt][e], p.scale_log2, -lse2[e / 2]), 0.f)) : 0.f;
                        set_ds(nt, e, pv, 1.f);
                    }
            }
        } else {
#pragma unroll
        for (int nt = 0; nt < N_TILES; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float pv = fast_exp2(fminf(fmaf(s[nt][e], p.scale_log2, -lse2[e / 2]), 0.f));  // P <= 1
                if (tail || diag) {
                    const int row = m0 + warp * 16 + g + (e / 2) * 8;
                    const int col = n0 + nt * 8 + 2 * t + (e % 2);
                    bool masked = col >= sk;
                    if (IS_CAUSAL) masked = masked || col > row + sk - sq;
                    if (masked) pv = 0.f;
                }
                set_ds(nt, e, pv, 1.f);
            }
        }

        // dQ += dS K: dS from registers as the A operand, K (BLOCK_N, HEAD_DIM) as B (k = key); below
        // DS_SPLIT_BELOW dS as hi + lo, two MMAs on one B fragment, and B += W K on the same fragment.
#pragma unroll
        for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
            u32 a[4], al[4], aw[4];
            if constexpr (DS_SPLIT) {
                a[0] = pack_hi_lo<T>(dp[2 * kk][0], dp[2 * kk][1], al[0]);
                a[1] = pack_hi_lo<T>(dp[2 * kk][2], dp[2 * kk][3], al[1]);
                a[2] = pack_hi_lo<T>(dp[2 * kk + 1][0], dp[2 * kk + 1][1], al[2]);
                a[3] = pack_hi_lo<T>(dp[2 * kk + 1][2], dp[2 * kk + 1][3], al[3]);
                aw[0] = Ops::pack(pw[2 * kk][0], pw[2 * kk][1]);
                aw[1] = Ops::pack(pw[2 * kk][2], pw[2 * kk][3]);
                aw[2] = Ops::pack(pw[2 * kk + 1][0], pw[2 * kk + 1][1]);
                aw[3] = Ops::pack(pw[2 * kk + 1][2], pw[2 * kk + 1][3]);
            } else {
                a[0] = Ops::pack(dp[2 * kk][0], dp[2 * kk][1]);
                a[1] = Ops::pack(dp[2 * kk][2], dp[2 * kk][3]);
                a[2] = Ops::pack(dp[2 * kk + 1][0], dp[2 * kk + 1][1]);
                a[3] = Ops::pack(dp[2 * kk + 1][2], dp[2 * kk + 1][3]);
            }
#pragma unroll
            for (int dp2 = 0; dp2 < D_TILES / 2; ++dp2) {
                u32 bk[4];
                load_b_pair_k16<true>(bk, sKj, PITCH, kk * 16, dp2 * 16, lane);
                Ops::mma16816(acc_dq[2 * dp2], a, bk[0], bk[1]);
                Ops::mma16816(acc_dq[2 * dp2 + 1], a, bk[2], bk[3]);
                if constexpr (DS_SPLIT) {
                    Ops::mma16816(acc_dq[2 * dp2], al, bk[0], bk[1]);
                    Ops::mma16816(acc_dq[2 * dp2 + 1], al, bk[2], bk[3]);
                    Ops::mma16816(acc_b[2 * dp2], aw, bk[0], bk[1]);
                    Ops::mma16816(acc_b[2 * dp2 + 1], aw, bk[2], bk[3]);
                }
            }
            if (D_TILES % 2) {
                u32 b0, b1;
                load_b_one_k16<true>(b0, b1, sKj, PITCH, kk * 16, (D_TILES - 1) * 8, lane);
                Ops::mma16816(acc_dq[D_TILES - 1], a, b0, b1);
                if constexpr (DS_SPLIT) {
                    Ops::mma16816(acc_dq[D_TILES - 1], al, b0, b1);
                    Ops::mma16816(acc_b[D_TILES - 1], aw, b0, b1);
                }
            }
        }
    }
    cp_async_wait<0>();

    if constexpr (DS_SPLIT) {  // D's correction: dQ -= E B, E = sum_j P_j (dP_j - D) - P_sink D, per row (a quad holds a row)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            pdp[r] += __shfl_xor_sync(0xffffffffu, pdp[r], 1);
            pdp[r] += __shfl_xor_sync(0xffffffffu, pdp[r], 2);
            float dd = pdp[r];
            if constexpr (FEAT) {  // the sink's -P_sink D, the per-row term the preprocess wrote
                if (p.mask.dsink_rows != nullptr) dd += p.mask.dsink_rows[row_base + g + 8 * r];
            }
            // D* = D + E for the dK/dV kernel, which runs after this one below DS_SPLIT_BELOW (file
            // comment): its dS = P (dP - D*) then carries no error of the rounded O. One lane a row.
            if (t == 0) p.delta[row_base + g + 8 * r] = dlt[r] + dd;
#pragma unroll
            for (int i = 0; i < D_TILES; ++i) {
                acc_dq[i][2 * r] = fmaf(-dd, acc_b[i][2 * r], acc_dq[i][2 * r]);
                acc_dq[i][2 * r + 1] = fmaf(-dd, acc_b[i][2 * r + 1], acc_dq[i][2 * r + 1]);
            }
        }
    }

    T* gdQ = static_cast<T*>(p.dq) + b * p.dq_batch_stride + h * p.dq_head_stride + qf.si.q_row0 * p.dq_row_stride;
    const int q_rows = FEAT ? qf.si.q_rows : sq;  // rows this block writes
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = m0 + warp * 16 + g + r * 8;
        if (IS_EVEN || row < q_rows) {
#pragma unroll
            for (int i = 0; i < D_TILES; ++i)
                *reinterpret_cast<u32*>(gdQ + row * p.dq_row_stride + i * 8 + 2 * t) =
                    Ops::pack(acc_dq[i][2 * r] * p.scale, acc_dq[i][2 * r + 1] * p.scale);
        }
    }
}

}  // namespace cuflash
