// flash_fwd.cu: exact attention forward, FlashAttention-2 structure, on mma.sync tensor cores.
//
// Algorithm. One thread block owns BLOCK_M query rows of one (batch, head). It stages its Q tile in
// shared memory once, then walks the K/V tiles of BLOCK_N keys that the rows can see. For each tile:
//   S = Q K^T                 (BLOCK_M x BLOCK_N, float, in registers; mma m16n8k16 over head_dim)
//   mask S only on tiles that cross the causal diagonal or the end of the keys
//   online softmax: running row max / row sum, P = exp2(S * scale_log2 - m), O rescaled by alpha
//   O += P V                  (P re-packed from the S accumulators as the A operand, no smem trip)
// At the end O /= lp (the sum of the rounded P, softmax.cuh), O goes out through shared memory as
// 16-byte stores, and lse is written (unless p.lse is null: a call that wants O alone skips its
// allocation).
// Nothing of size seqlen_q x seqlen_k ever reaches device memory.
//
// Pipeline. K and V have two shared-memory stages. At the top of iteration j the tile j copy is
// waited for and a block barrier is passed; then the cp.async copy of tile j + 1 is issued into the
// other stage (which every warp finished reading in iteration j - 1) and runs while tile j computes.
//
// Warps. WARPS warps split the BLOCK_M rows: warp w owns rows [w * BLOCK_M / WARPS, ...), i.e.
// M_TILES m16 tiles, and computes all BLOCK_N columns of them. A warp only ever reads its own rows
// of sQ, which lets the epilogue reuse sQ per warp without a block barrier.
//
// Shared memory. Each row of sQ / sK / sV holds HEAD_DIM elements followed by padding so that the
// row pitch is an odd number of 16-byte chunks: the 8 row addresses of one ldmatrix phase then fall
// into 8 distinct 16-byte bank groups, with no conflicts, for every head_dim (multiple of 8).
//
// head_dim. HEAD_DIM is any multiple of 8 up to 256. Q K^T contracts over head_dim in k16 steps
// plus, when HEAD_DIM % 16 == 8, one m16n8k8 step; P V produces head_dim in n8 tiles. No padding of
// head_dim in memory or in arithmetic.
//
// Causal (bottom-right). Query row i sees key j iff j <= i + seqlen_k - seqlen_q. Tiles wholly
// above the diagonal are never loaded. A row that sees no key gets O = 0 and lse = -inf.
//
// Features (FEAT = true; mask.cuh): per-sequence lengths of padded or packed batches, sliding
// window, sink tokens and logits, ALiBi and softcap. The block's key tiles come from key_tiles (sink
// tiles, then the window's), scores become log2-unit logits with the window / length mask on the
// tiles that cross a bound, and a sink logit joins the online softmax after the last tile as a key
// of value 0 (softmax.cuh: finalize with a sink). With FEAT = false none of this code exists: the
// plain kernel is unchanged.
//
// Grid. 1-D: block = (b * nheads + h) * num_m_blocks + (num_m_blocks - 1 - m_block), so the grid
// is not bounded by the 65535 limit of y/z, and within a head the longest causal blocks start first;
// causal plain calls and feature calls with a window (left, 0) run thread block i as block
// blocks.cuh causal_block_order(i) (the grid's last p.tail_heads heads query block by query block,
// so that it ends on short blocks).
#include "common.cuh"
#include "blocks.cuh"
#include "params.cuh"
#include "softmax.cuh"

namespace cuflash {

template <int HEAD_DIM, int BLOCK_M, int BLOCK_N, int WARPS>
struct FwdTraits {
    static constexpr int THREADS = WARPS * 32;
    static constexpr int ROWS_PER_WARP = BLOCK_M / WARPS;
    static constexpr int M_TILES = ROWS_PER_WARP / 16;   // m16 tiles per warp
    static constexpr int N_TILES = BLOCK_N / 8;          // n8 tiles of S per m16 tile
    static constexpr int K16 = HEAD_DIM / 16;            // full k16 steps of Q K^T
    static constexpr bool K8_TAIL = (HEAD_DIM % 16) != 0;
    static constexpr int D_TILES = HEAD_DIM / 8;         // n8 tiles of O
    static constexpr int CHUNKS = HEAD_DIM / 8;          // 16-byte chunks per row
    static constexpr int PITCH = padded_pitch(HEAD_DIM);
    static constexpr int SQ_ELEMS = BLOCK_M * PITCH;
    static constexpr int SKV_ELEMS = BLOCK_N * PITCH;
    // sQ, then sK[2], then sV[2]. Must equal cuflash/_config.py:fwd_smem_bytes.
    static constexpr int SMEM_BYTES = (SQ_ELEMS + 4 * SKV_ELEMS) * 2;

    static_assert(HEAD_DIM % 8 == 0 && HEAD_DIM >= 8 && HEAD_DIM <= 256, "head_dim: multiple of 8 in [8, 256]");
    static_assert(BLOCK_M % (16 * WARPS) == 0, "each warp owns whole m16 tiles");
    static_assert(BLOCK_N % 16 == 0, "P is re-used as an A operand in k16 steps");
};

template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int WARPS, bool IS_CAUSAL, bool IS_EVEN, bool FEAT = false>
__global__ void __launch_bounds__(WARPS * 32, 1)
flash_fwd_kernel(const __grid_constant__ FwdParams p) {
    using Tr = FwdTraits<HEAD_DIM, BLOCK_M, BLOCK_N, WARPS>;
    using Ops = ElemOps<T>;
    constexpr int THREADS = Tr::THREADS, M_TILES = Tr::M_TILES, N_TILES = Tr::N_TILES;
    constexpr int PITCH = Tr::PITCH, K16 = Tr::K16, D_TILES = Tr::D_TILES;

    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* sQ = reinterpret_cast<T*>(smem_raw);                          // (BLOCK_M, PITCH)
    T* sK = sQ + Tr::SQ_ELEMS;                                       // 2 x (BLOCK_N, PITCH)
    T* sV = sK + 2 * Tr::SKV_ELEMS;                                  // 2 x (BLOCK_N, PITCH)

    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int g = lane / 4, t = lane % 4;

    // A launch with less dynamic shared memory than this specialization needs is a host bug.
    if (tid == 0 && dynamic_smem_bytes() < (u32)Tr::SMEM_BYTES) __trap();

    // ---- which (batch, head, query block) this block owns, and its key tiles [0, n_blocks) ----
    const int sq = p.seqlen_q, sk = p.seqlen_k;
    const QueryBlock blk = query_block<BLOCK_M, BLOCK_N, IS_CAUSAL>(fwd_block_index<IS_CAUSAL || FEAT>(p), p.num_m_blocks, p.nheads, p.head_group, sq, sk);
    const int h = blk.h, b = blk.b, h_kv = blk.h_kv, m0 = blk.m0;
    int n_blocks = blk.n_blocks;

    // With FEAT: the sequence's rows, its valid lengths, its mask and the key tiles to visit.
    int q_valid = sq, k_valid = sk;  // rows / keys past these are zero-filled in shared memory
    const QueryFeat qf = query_setup<FEAT, BLOCK_M, BLOCK_N>(p.mask, b, h, m0, sq, sk, n_blocks, q_valid, k_valid);
    if constexpr (FEAT) {
        if (qf.past_end) return;
    }
    auto tile_of = [&](int it) { if constexpr (FEAT) return qf.kt.tile(it); else return it; };

    const T* gQ = static_cast<const T*>(p.q) + b * p.q_batch_stride + h * p.q_head_stride + (qf.si.q_row0 + m0) * p.q_row_stride;
    const T* gK = static_cast<const T*>(p.k) + b * p.k_batch_stride + h_kv * p.k_head_stride + qf.si.k_row0 * p.k_row_stride;
    const T* gV = static_cast<const T*>(p.v) + b * p.v_batch_stride + h_kv * p.v_head_stride + qf.si.k_row0 * p.v_row_stride;

    load_tile_async<T, HEAD_DIM, PITCH, BLOCK_M, THREADS, !IS_EVEN>(sQ, gQ, p.q_row_stride, q_valid - m0, tid);
    cp_async_commit();
    if (n_blocks > 0) {
        const int n_first = tile_of(0) * BLOCK_N;
        load_tile_async<T, HEAD_DIM, PITCH, BLOCK_N, THREADS, !IS_EVEN>(
            sK, gK + (i64)n_first * p.k_row_stride, p.k_row_stride, k_valid - n_first, tid);
        load_tile_async<T, HEAD_DIM, PITCH, BLOCK_N, THREADS, !IS_EVEN>(
            sV, gV + (i64)n_first * p.v_row_stride, p.v_row_stride, k_valid - n_first, tid);
        cp_async_commit();
    }

    float acc_o[M_TILES][D_TILES][4];  // (ROWS_PER_WARP, HEAD_DIM) of this warp, float
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
        for (int dt = 0; dt < D_TILES; ++dt)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_o[mt][dt][e] = 0.f;
    OnlineSoftmax<Ops, M_TILES, N_TILES, LP_QUAD> softmax;
    softmax.init();

    const int warp_row0 = warp * Tr::ROWS_PER_WARP;
    // ldmatrix lane offsets (see common.cuh for the fragment layouts):
    //   A of Q (x4):      row lane % 16,                      col (lane / 16) * 8
    //   B of K (x4):      key (lane / 16) * 8 + lane % 8,     col ((lane / 8) % 2) * 8
    //   B of V (x4.trans) key lane % 16,                      col (lane / 16) * 8
    const u32 sQ_lane = smem_addr(sQ + (warp_row0 + lane % 16) * PITCH + (lane / 16) * 8);
    const int k_lane_off = ((lane / 16) * 8 + lane % 8) * PITCH + ((lane / 8) % 2) * 8;
    const int k8_lane_off = (lane % 16) * PITCH;  // x2 of two 8-key groups at the k8 tail
    const int v_lane_off = (lane % 16) * PITCH + (lane / 16) * 8;

    for (int j = 0; j < n_blocks; ++j) {
        cp_async_wait<0>();
        __syncthreads();  // tile j is in smem for all; everyone is done with stage (j + 1) % 2
        if (j + 1 < n_blocks) {
            const int st = (j + 1) % 2;
            const i64 n1 = (i64)tile_of(j + 1) * BLOCK_N;
            load_tile_async<T, HEAD_DIM, PITCH, BLOCK_N, THREADS, !IS_EVEN>(
                sK + st * Tr::SKV_ELEMS, gK + n1 * p.k_row_stride, p.k_row_stride, k_valid - (int)n1, tid);
            load_tile_async<T, HEAD_DIM, PITCH, BLOCK_N, THREADS, !IS_EVEN>(
                sV + st * Tr::SKV_ELEMS, gV + n1 * p.v_row_stride, p.v_row_stride, k_valid - (int)n1, tid);
            cp_async_commit();
        }
        const T* sKj = sK + (j % 2) * Tr::SKV_ELEMS;
        const T* sVj = sV + (j % 2) * Tr::SKV_ELEMS;
        const int n0 = tile_of(j) * BLOCK_N;

        // ---- S = Q K^T: (ROWS_PER_WARP, BLOCK_N) per warp ----
        float s[M_TILES][N_TILES][4];
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
            for (int nt = 0; nt < N_TILES; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[mt][nt][e] = 0.f;

        const u32 sK_lane = smem_addr(sKj + k_lane_off);
#pragma unroll
        for (int kc = 0; kc < K16; ++kc) {
            u32 a[M_TILES][4];
#pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt)
                ldmatrix_x4(a[mt], sQ_lane + (mt * 16 * PITCH + kc * 16) * 2);
#pragma unroll
            for (int np = 0; np < N_TILES / 2; ++np) {
                u32 bk[4];  // {b0, b1} of n-tile 2np, then of 2np + 1
                ldmatrix_x4(bk, sK_lane + (np * 16 * PITCH + kc * 16) * 2);
#pragma unroll
                for (int mt = 0; mt < M_TILES; ++mt) {
                    Ops::mma16816(s[mt][2 * np], a[mt], bk[0], bk[1]);
                    Ops::mma16816(s[mt][2 * np + 1], a[mt], bk[2], bk[3]);
                }
            }
        }
        if (Tr::K8_TAIL) {
            const int kcol = K16 * 16;
            u32 a[M_TILES][2];
#pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt)
                ldmatrix_x2(a[mt][0], a[mt][1], smem_addr(sQ + (warp_row0 + mt * 16 + lane % 16) * PITCH + kcol));
            const u32 sK8_lane = smem_addr(sKj + k8_lane_off + kcol);
#pragma unroll
            for (int np = 0; np < N_TILES / 2; ++np) {
                u32 b0, b1;  // keys np*16 + 0..7 and + 8..15
                ldmatrix_x2(b0, b1, sK8_lane + np * 16 * PITCH * 2);
#pragma unroll
                for (int mt = 0; mt < M_TILES; ++mt) {
                    Ops::mma1688(s[mt][2 * np], a[mt][0], a[mt][1], b0);
                    Ops::mma1688(s[mt][2 * np + 1], a[mt][0], a[mt][1], b1);
                }
            }
        }

        // ---- mask, only on tiles that need it; then online softmax: s becomes p, O rescaled ----
        float alpha[M_TILES][2];
        u32 pp[M_TILES][N_TILES][2];  // P, rounded and packed (softmax.cuh)
        if constexpr (FEAT) {
            // Tiles inside every bound, without softcap or ALiBi, take the plain kernel's path. The
            // others: scores become log2-unit logits (softcap, ALiBi), then are masked where a
            // bound crosses the tile (each row's key span worked out once).
            float sc = p.scale_log2;
            if (qf.score_mod) {
#pragma unroll
                for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
                    for (int nt = 0; nt < N_TILES; ++nt)
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            const int row = m0 + warp_row0 + mt * 16 + g + (e / 2) * 8;
                            const int col = n0 + nt * 8 + 2 * t + (e % 2);
                            float tanh_s;
                            s[mt][nt][e] = qf.mi.logit_log2(p.mask, p.scale_log2, s[mt][nt][e], row, col, tanh_s);
                        }
                sc = 1.f;  // already in log2 units
            }
            if (qf.mi.needs_mask(p.mask, m0, BLOCK_M, n0, BLOCK_N)) {
                // Key spans relative to this thread's first column, so each element compares with
                // an immediate.
                const int base = n0 + 2 * t;
                const int sink_rel = p.mask.num_sink_tokens - base;
#pragma unroll
                for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
                    for (int r = 0; r < 2; ++r) {
                        const KeySpan ks = qf.mi.key_span(p.mask, m0 + warp_row0 + mt * 16 + g + r * 8);
                        const int lo = ks.lo - base, hi = ks.hi - base;
#pragma unroll
                        for (int nt = 0; nt < N_TILES; ++nt)
#pragma unroll
                            for (int c = 0; c < 2; ++c) {
                                const int d = nt * 8 + c;
                                if (!(d < hi && (d >= lo || d < sink_rel))) s[mt][nt][2 * r + c] = -CUFLASH_INF;
                            }
                    }
            }
            softmax.prepare(s, sc, alpha, pp);
        } else {
            const bool tail = !IS_EVEN && n0 + BLOCK_N > sk;
            const bool diag = IS_CAUSAL && n0 + BLOCK_N - 1 > m0 + sk - sq;
            if (tail || diag) {
#pragma unroll
                for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
                    for (int nt = 0; nt < N_TILES; ++nt)
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            const int row = m0 + warp_row0 + mt * 16 + g + (e / 2) * 8;
                            const int col = n0 + nt * 8 + 2 * t + (e % 2);
                            bool masked = col >= sk;
                            if (IS_CAUSAL) masked = masked || col > row + sk - sq;
                            if (masked) s[mt][nt][e] = -CUFLASH_INF;
                        }
            }
            softmax.prepare(s, p.scale_log2, alpha, pp);
        }
        scale_rows(acc_o, alpha);

        // ---- O += P V: P (ROWS_PER_WARP, BLOCK_N) from registers, V (BLOCK_N, HEAD_DIM) ----
        const u32 sV_lane = smem_addr(sVj + v_lane_off);
#pragma unroll
        for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
            u32 pa[M_TILES][4];  // the C fragments of n-tiles 2kk, 2kk+1 are the A fragment of keys kk*16..
#pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt) {
                pa[mt][0] = pp[mt][2 * kk][0];
                pa[mt][1] = pp[mt][2 * kk][1];
                pa[mt][2] = pp[mt][2 * kk + 1][0];
                pa[mt][3] = pp[mt][2 * kk + 1][1];
            }
#pragma unroll
            for (int dp = 0; dp < D_TILES / 2; ++dp) {
                u32 bv[4];  // {b0, b1} of d-tile 2dp, then of 2dp + 1
                ldmatrix_x4_trans(bv, sV_lane + (kk * 16 * PITCH + dp * 16) * 2);
#pragma unroll
                for (int mt = 0; mt < M_TILES; ++mt) {
                    Ops::mma16816(acc_o[mt][2 * dp], pa[mt], bv[0], bv[1]);
                    Ops::mma16816(acc_o[mt][2 * dp + 1], pa[mt], bv[2], bv[3]);
                }
            }
            if (D_TILES % 2) {
                u32 b0, b1;  // last d-tile: keys kk*16 + 0..7, + 8..15
                ldmatrix_x2_trans(b0, b1, smem_addr(sVj + (kk * 16 + lane % 16) * PITCH + (D_TILES - 1) * 8));
#pragma unroll
                for (int mt = 0; mt < M_TILES; ++mt) Ops::mma16816(acc_o[mt][D_TILES - 1], pa[mt], b0, b1);
            }
        }
        softmax.commit(alpha, pp);  // with P V issued
    }

    // ---- epilogue: O /= lp, lse, and O out through this warp's rows of sQ ----
    cp_async_wait<0>();  // with n_blocks == 0 the Q copy may still be in flight
    __syncthreads();
    float inv_l[M_TILES][2], lse[M_TILES][2];
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
        for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
            for (int r = 0; r < 2; ++r)
                if (m0 + warp_row0 + mt * 16 + g + r * 8 >= qf.si.sq) {
                    inv_l[mt][r] = 0.f;
                    lse[mt][r] = -CUFLASH_INF;
                }
    }

#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
        for (int dt = 0; dt < D_TILES; ++dt)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int row = warp_row0 + mt * 16 + g + r * 8;
                const u32 v = Ops::pack(acc_o[mt][dt][2 * r] * inv_l[mt][r], acc_o[mt][dt][2 * r + 1] * inv_l[mt][r]);
                *reinterpret_cast<u32*>(sQ + row * PITCH + dt * 8 + 2 * t) = v;
            }

    // Rows this block writes: [m0, q_rows) of the sequence (FEAT), or of seqlen_q.
    const int q_rows = FEAT ? qf.si.q_rows : sq;
    // lse == nullptr: the caller wants only O (an eager forward with no gradient and no lse).
    if (t == 0 && p.lse != nullptr) {
        float* g_lse = FEAT ? p.lse + b * p.mask.lse_batch_stride + h * p.mask.lse_head_stride + qf.si.q_row0
                            : p.lse + ((i64)b * p.nheads + h) * sq;
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int row = m0 + warp_row0 + mt * 16 + g + r * 8;
                if (IS_EVEN || row < q_rows) g_lse[row] = lse[mt][r];
            }
    }
    __syncwarp();

    T* gO = static_cast<T*>(p.o) + b * p.o_batch_stride + h * p.o_head_stride + (qf.si.q_row0 + m0) * p.o_row_stride;
    constexpr int CHUNKS = Tr::CHUNKS;
    constexpr int WARP_CHUNKS = Tr::ROWS_PER_WARP * CHUNKS;
#pragma unroll
    for (int i = 0; i < (WARP_CHUNKS + 31) / 32; ++i) {
        const int c = lane + i * 32;
        if (WARP_CHUNKS % 32 == 0 || c < WARP_CHUNKS) {
            const int row = warp_row0 + c / CHUNKS;
            const int col = (c % CHUNKS) * 8;
            if (IS_EVEN || m0 + row < q_rows) {
                const uint4 v = *reinterpret_cast<const uint4*>(sQ + row * PITCH + col);
                *reinterpret_cast<uint4*>(gO + row * p.o_row_stride + col) = v;
            }
        }
    }
}

}  // namespace cuflash
