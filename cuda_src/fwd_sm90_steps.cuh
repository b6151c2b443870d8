// fwd_sm90_steps.cuh: the per-tile steps shared by the sm_90a forwards (flash_fwd_sm90.cu and the
// warp-specialized flash_fwd_sm90_ws.cu), for one warp of a warpgroup that owns 64 query rows.
//
// Fragment layout (wgmma m64nNk16 accumulators, as mma.sync's): thread (g = lane / 4, t = lane % 4)
// of a warp whose first row is row0 holds, for element i of a BLOCK_N-column tile, row
// row0 + g + ((i % 4) / 2) * 8 and column (i / 4) * 8 + 2 t + (i % 2); O's elements follow the same
// pattern over HEAD_DIM columns.
#pragma once
#include "common.cuh"
#include "mask.cuh"
#include "softmax.cuh"
#include "wgmma_util.cuh"

namespace cuflash {

// The dynamic shared memory's first 1024-byte aligned byte (SW128 panels start on such boundaries),
// as a shared-window address; ptr gets it as a generic pointer.
__device__ __forceinline__ u32 smem_aligned_1024(unsigned char* raw, unsigned char*& ptr) {
    const u32 raw_addr = smem_addr(raw);
    const u32 a = (raw_addr + 1023u) & ~1023u;
    ptr = raw + (a - raw_addr);
    return a;
}

// Masks a plain call's score tile (keys n0 .. n0 + BLOCK_N of rows from row0): keys past seqlen_k
// (only a tile that reaches past it) and, causal, keys right of the bottom-right-aligned diagonal
// (only a tile the diagonal crosses for these 16 rows). Masked scores become -inf.
template <int BLOCK_N, bool IS_CAUSAL, bool IS_EVEN>
__device__ __forceinline__ void mask_plain_tile(float (&s)[BLOCK_N / 2], int n0, int row0, int g, int t, int sq,
                                                int sk) {
    const bool tail = !IS_EVEN && n0 + BLOCK_N > sk;
    const bool diag = IS_CAUSAL && n0 + BLOCK_N - 1 > row0 + sk - sq;
    if (tail || diag) {
#pragma unroll
        for (int i = 0; i < BLOCK_N / 2; ++i) {
            const int row = row0 + g + ((i % 4) / 2) * 8;
            const int col = n0 + (i / 4) * 8 + 2 * t + (i % 2);
            bool masked = col >= sk;
            if (IS_CAUSAL) masked = masked || col > row + sk - sq;
            if (masked) s[i] = -CUFLASH_INF;
        }
    }
}

// The key tiles [0, n) that need no mask for any row of a block starting at query row m0 (a plain
// call): every key is below seqlen_k and (causal) at or left of the bottom-right-aligned diagonal for
// the block's first row. The kernels run them in a loop without mask code.
template <int BLOCK_N, bool IS_CAUSAL, bool IS_EVEN>
__device__ __forceinline__ int mask_free_tiles(int n_blocks, int m0, int sq, int sk) {
    int n = n_blocks;
    if constexpr (!IS_EVEN) n = min(n, sk / BLOCK_N);
    if constexpr (IS_CAUSAL) {
        const int seen0 = m0 + sk - sq + 1;  // keys the block's first row sees
        n = min(n, seen0 <= 0 ? 0 : seen0 / BLOCK_N);
    }
    return n;
}

// Split work tiles (flash_fwd_sm90_ws.cu PERSISTENT, non-causal): the host may cut the grid's last
// work tiles into `parts` ranges of key tiles, each run by a different block, so that the last wave
// ends evenly. Each part's warps leave their rows' O (normalized by the part's own sum, fp32) and
// lse in the workspace, and the warp that counts last on its (tile, warp) counter merges them:
// O = sum_s exp(lse_s - lse) O_s with lse = log sum_s exp(lse_s). Workspace (cuflash/_launch.py
// split_workspace): SPLIT_COUNTERS int32 counters, [split tile][WARPS] from the first, zero between
// calls (the merging warp sets its counter back; a workspace is shared by the calls on its stream);
// then floats, per (split tile, part, warp) PART_FLOATS:
// each lane's lse of rows g, g + 8 (float2 at lane), then O as float2 i * 32 + lane, i = 2 dt + r
// (O elements 4 dt + 2 r, + 1: row g + 8 r, fwd_sm90_steps.cuh's fragment layout), so that each of
// a warp's stores and loads covers 256 contiguous bytes.
constexpr int SPLIT_COUNTERS = 4096;  // must equal cuflash/_launch.py SPLIT_COUNTERS
template <int HEAD_DIM>
struct SplitLayout {
    static constexpr int PART_FLOATS = 64 + 16 * HEAD_DIM;
};

// This warp's part of split tile `slot` (0 .. split tiles - 1): stores it, counts it, and where it
// is the last of the parts, merges all of them into acc_o (normalized: inv_l = 1) and lse and
// returns true (the warp writes the tile's rows then); false: another part's warp will.
template <int HEAD_DIM, int WARPS>
__device__ __forceinline__ bool split_part_merge(float* ws, int parts, int slot, int part, int warp,
                                                 int lane, float (&acc_o)[HEAD_DIM / 2], float (&inv_l)[1][2],
                                                 float (&lse)[1][2]) {
    constexpr int PF = SplitLayout<HEAD_DIM>::PART_FLOATS;
    int* counter = reinterpret_cast<int*>(ws) + slot * WARPS + warp;
    const float* first = ws + SPLIT_COUNTERS;
    auto part_at = [&](int s) { return const_cast<float*>(first) + ((i64)(slot * parts + s) * WARPS + warp) * PF; };
    float* mine = part_at(part);
    reinterpret_cast<float2*>(mine)[lane] = make_float2(lse[0][0], lse[0][1]);
#pragma unroll
    for (int i = 0; i < HEAD_DIM / 4; ++i)
        reinterpret_cast<float2*>(mine + 64)[i * 32 + lane] =
            make_float2(acc_o[2 * i] * inv_l[0][i % 2], acc_o[2 * i + 1] * inv_l[0][i % 2]);
    __threadfence();  // this lane's part is visible device-wide before the warp counts it
    __syncwarp();
    int last = 0;
    if (lane == 0) last = atomicAdd(counter, 1) == parts - 1;
    if (!__shfl_sync(0xffffffffu, last, 0)) return false;
    __threadfence();  // the parts counted before this one are visible
    float mx[2] = {-CUFLASH_INF, -CUFLASH_INF};
    for (int s = 0; s < parts; ++s) {
        const float2 l = __ldcg(reinterpret_cast<const float2*>(part_at(s)) + lane);
        mx[0] = fmaxf(mx[0], l.x);
        mx[1] = fmaxf(mx[1], l.y);
    }
#pragma unroll
    for (int i = 0; i < HEAD_DIM / 2; ++i) acc_o[i] = 0.f;
    float sum[2] = {0.f, 0.f};
    for (int s = 0; s < parts; ++s) {
        const float* ps = part_at(s);
        const float2 l = __ldcg(reinterpret_cast<const float2*>(ps) + lane);
        const float w0 = mx[0] == -CUFLASH_INF ? 0.f : __expf(l.x - mx[0]);
        const float w1 = mx[1] == -CUFLASH_INF ? 0.f : __expf(l.y - mx[1]);
        sum[0] += w0;
        sum[1] += w1;
        // In chunks of 8 loads (a compiler barrier between them): all of a part's 32 in flight at
        // once, with O's 64 accumulators, spilled at the consumers' 240 registers.
#pragma unroll
        for (int c = 0; c < HEAD_DIM / 4; c += 4) {
            float2 o[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) o[i] = __ldcg(reinterpret_cast<const float2*>(ps + 64) + (c + i) * 32 + lane);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const float wr = ((c + i) % 2) ? w1 : w0;
                acc_o[2 * (c + i)] = fmaf(wr, o[i].x, acc_o[2 * (c + i)]);
                acc_o[2 * (c + i) + 1] = fmaf(wr, o[i].y, acc_o[2 * (c + i) + 1]);
            }
            asm volatile("" ::: "memory");
        }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        inv_l[0][r] = sum[r] > 0.f ? 1.f / sum[r] : 0.f;
        lse[0][r] = sum[r] > 0.f ? mx[r] + __logf(sum[r]) : -CUFLASH_INF;
    }
    if (lane == 0) *counter = 0;  // zero for the next call (kernels on a stream run one after another)
    return true;
}

// A FEAT call's score tile (keys n0 .. n0 + BLOCK_N of the 16 rows from row0, mask.cuh): logits in
// log2 units where a score modification applies (softcap, ALiBi), then the mask where a bound
// crosses the tile. Returns the scale the online softmax still has to apply: scale_log2, or 1 when
// the logits are already in log2 units.
template <int BLOCK_N>
__device__ __forceinline__ float feat_logits_and_mask(float (&s)[BLOCK_N / 2], const MaskParams& m, const QueryFeat& qf,
                                                      float scale_log2, int n0, int row0, int g, int t) {
    float sc = scale_log2;
    if (qf.score_mod) {
        if (m.softcap > 0.f) {
#pragma unroll
            for (int i = 0; i < BLOCK_N / 2; ++i) {
                const int row = row0 + g + ((i % 4) / 2) * 8;
                const int col = n0 + (i / 4) * 8 + 2 * t + (i % 2);
                float tanh_s;
                s[i] = qf.mi.logit_log2(m, scale_log2, s[i], row, col, tanh_s);
            }
        } else {
            // ALiBi alone: the distance i + shift - j from one conversion per row (mask.cuh).
            const int d_row = row0 + g + qf.mi.shift - n0 - 2 * t;
            const float d0[2] = {(float)d_row, (float)(d_row + 8)};
#pragma unroll
            for (int i = 0; i < BLOCK_N / 2; ++i)
                s[i] = qf.mi.alibi_logit_log2(scale_log2, s[i], d0[(i % 4) / 2] - (float)((i / 4) * 8 + (i % 2)));
        }
        sc = 1.f;
    }
    if (qf.mi.needs_mask(m, row0, 16, n0, BLOCK_N)) {
        const KeySpan ks[2] = {qf.mi.key_span(m, row0 + g), qf.mi.key_span(m, row0 + g + 8)};
#pragma unroll
        for (int i = 0; i < BLOCK_N / 2; ++i)
            if (!ks[(i % 4) / 2].has(m, n0 + (i / 4) * 8 + 2 * t + (i % 2))) s[i] = -CUFLASH_INF;
    }
    return sc;
}

// After the P V product of the previous tile has retired: O *= alpha (the online softmax's rescale)
// and this tile's probabilities packed as the next P V product's A fragments (one per k16 step).
// Where the online softmax is LAZY (softmax.cuh; not in the pingpong kernel), alpha is exactly 1 for a
// row that kept its max, and a warp whose 16 rows all did skips the rescale (rescale = false; with
// lp's, rescale_lp). No wgmma is in flight here, so the branch leaves ptxas's wgmma pipeline alone.
__device__ __forceinline__ bool warp_needs_rescale(const float (&alpha)[1][2]) {
    return __any_sync(0xffffffffu, alpha[0][0] != 1.f || alpha[0][1] != 1.f);
}
template <typename Ops, int HEAD_DIM, int BLOCK_N>
__device__ __forceinline__ void rescale_and_pack(float (&acc_o)[HEAD_DIM / 2], const float (&alpha)[1][2],
                                                 u32 (&pa)[BLOCK_N / 16][4], const float (&s)[BLOCK_N / 2],
                                                 bool rescale = true) {
    if (rescale) {
#pragma unroll
        for (int i = 0; i < HEAD_DIM / 2; ++i) acc_o[i] *= alpha[0][(i % 4) / 2];
    }
#pragma unroll
    for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
        pa[kk][0] = Ops::pack(s[8 * kk + 0], s[8 * kk + 1]);
        pa[kk][1] = Ops::pack(s[8 * kk + 2], s[8 * kk + 3]);
        pa[kk][2] = Ops::pack(s[8 * kk + 4], s[8 * kk + 5]);
        pa[kk][3] = Ops::pack(s[8 * kk + 6], s[8 * kk + 7]);
    }
}

// How the wgmma forwards sum the rounded P (softmax.cuh): on the tensor cores (LP_TENSOR) up to
// head_dim 128; on the ALU after the P V issue (LP_THREAD) at 256, whose 32-key tiles make the two
// extra wgmmas a tile a longer wait than the adds. Against the previous kernels on an H100, in one
// process (bench/NOTES.md, session 19): tensor cores d64 1.03-1.05, d128 1.03-1.07, d256 1.05-1.11;
// ALU d64 1.07-1.13, d128 1.05-1.07, d256 0.98-1.08. The warp-specialized kernel (session 25) makes
// the row sum 8 more columns of its P V product instead of its own wgmmas: 0.966 of the time (d64 and
// d128, 40 rows, 0.93-1.01).
template <int HEAD_DIM> __host__ __device__ constexpr int fwd_sm90_lp() { return HEAD_DIM <= 128 ? LP_TENSOR : LP_THREAD; }

// The accumulator of P times ones (wgmma_rs_rowsum: lp of rows g, g + 8) rescaled with O.
__device__ __forceinline__ void rescale_lp(float (&acc_lp)[4], const float (&alpha)[1][2]) {
    acc_lp[0] *= alpha[0][0];
    acc_lp[1] *= alpha[0][0];
    acc_lp[2] *= alpha[0][1];
    acc_lp[3] *= alpha[0][1];
}

// Epilogue, first half: O / lp of this warp's 16 rows (block rows warp_row0 ..) into a SW128 tile of
// ROWS rows at shared address tile (the consumed Q tile; no wgmma may still read these rows). The
// accumulator's fragment of rows g, g + 8 and columns 8 dt + 2t, + 1 is ldmatrix's 8 x 8 fragment,
// so each stmatrix.x4 stores 16 rows x 16 columns: matrices (dt, rows 0-7), (dt, rows 8-15), (dt + 1,
// rows 0-7), (dt + 1, rows 8-15); lane l gives the address of row l % 8 of matrix l / 8: HEAD_DIM / 16
// stores with one address each (32-bit stores took HEAD_DIM / 4, each with its own address).
template <typename Ops, int HEAD_DIM, int ROWS>
__device__ __forceinline__ void o_rows_to_smem(u32 tile, const float (&acc_o)[HEAD_DIM / 2], const float (&inv_l)[1][2],
                                               int warp_row0, int lane) {
    const int mi = lane / 8;                              // the matrix this lane addresses
    const int row = warp_row0 + (mi & 1) * 8 + lane % 8;  // its row
    // Store q writes chunk 2q + mi / 2 (its 8 columns) of that row: panel q / 4, and inside the panel
    // the swizzled 16 bytes ((2q) & 7) ^ x with x = (mi / 2) ^ (row & 7) (2q is even, so the low bit is
    // mi / 2's). One xor with a constant per store.
    const u32 row_base = tile + (u32)row * 128u;
    const u32 x16 = (u32)(((mi >> 1) ^ (row & 7)) << 4);
#pragma unroll
    for (int q = 0; q < HEAD_DIM / 16; ++q) {
        u32 v[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int dt = 2 * q + j / 2, r = j % 2;
            v[j] = Ops::pack(acc_o[4 * dt + 2 * r] * inv_l[0][r], acc_o[4 * dt + 2 * r + 1] * inv_l[0][r]);
        }
        stmatrix_x4(row_base + (u32)((q >> 2) * ROWS * 128) + (x16 ^ (u32)(((2 * q) & 7) << 4)), v[0], v[1], v[2], v[3]);
    }
}

// Epilogue, second half (after __syncwarp): the warp's 16 rows from the tile to gO (the block's first
// row, m0 of the sequence) in 16-byte stores; rows at or past q_rows are not written, nor columns from
// `cols` on (head_dim pad-up: the call's head_dim is below the kernel's). A lane keeps one 16-byte
// chunk of the row and takes rows a, a + RSTEP, ... (a = lane / D_TILES): the swizzle of row
// a + i RSTEP is a ^ ((i RSTEP) & 7) (a < RSTEP, a power of two), so each store's shared address is one
// xor with a constant, and its global one an add.
template <typename T, int HEAD_DIM, int ROWS, bool IS_EVEN>
__device__ __forceinline__ void o_rows_to_global(T* gO, i64 o_row_stride, u32 tile, int warp_row0, int lane, int m0,
                                                 int q_rows, int cols = HEAD_DIM) {
    constexpr int D_TILES = HEAD_DIM / 8;
    static_assert(D_TILES <= 32 && 32 % D_TILES == 0, "a lane keeps one chunk");
    constexpr int RSTEP = 32 / D_TILES;  // rows a pass
    const int chunk = lane % D_TILES, a = lane / D_TILES;
    if (chunk * 8 >= cols) return;
    const u32 s0 = tile + (u32)((chunk >> 3) * ROWS * 128 + (warp_row0 + a) * 128);
    const u32 x16 = (u32)(((chunk & 7) ^ a) << 4);
    T* g = gO + (i64)(warp_row0 + a) * o_row_stride + chunk * 8;
    const int rows_left = q_rows - m0 - warp_row0 - a;  // rows of this lane's sequence left from row a
#pragma unroll
    for (int i = 0; i < 16 / RSTEP; ++i) {
        if (IS_EVEN || i * RSTEP < rows_left) {
            uint4 v;
            asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];"
                         : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                         : "r"(s0 + (u32)(i * RSTEP * 128) + (x16 ^ (u32)(((i * RSTEP) & 7) << 4))));
            *reinterpret_cast<uint4*>(g + (i64)i * RSTEP * o_row_stride) = v;
        }
    }
}

// Head_dim 256 keeps the epilogue before stmatrix (session 26): 32-bit stores of the rows into the
// tile, then each lane's 16-byte chunks c = lane + 32 i out to gO. With the functions above, ptxas
// scheduled the main loop of the head_dim 256 kernels differently (same instructions, another
// order), and bf16 took 1.05-1.14x the time on an H100.
template <typename Ops, int HEAD_DIM, int ROWS>
__device__ __forceinline__ void o_rows_to_smem_words(unsigned char* tile, const float (&acc_o)[HEAD_DIM / 2],
                                                     const float (&inv_l)[1][2], int warp_row0, int g, int t) {
#pragma unroll
    for (int dt = 0; dt < HEAD_DIM / 8; ++dt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = warp_row0 + g + r * 8;
            const u32 v = Ops::pack(acc_o[4 * dt + 2 * r] * inv_l[0][r], acc_o[4 * dt + 2 * r + 1] * inv_l[0][r]);
            *reinterpret_cast<u32*>(tile + sw128_offset(row, dt, ROWS) + 4 * t) = v;
        }
}

template <typename T, int HEAD_DIM, int ROWS, bool IS_EVEN>
__device__ __forceinline__ void o_rows_to_global_chunks(T* gO, i64 o_row_stride, const unsigned char* tile,
                                                        int warp_row0, int lane, int m0, int q_rows,
                                                        int cols = HEAD_DIM) {
    constexpr int D_TILES = HEAD_DIM / 8;
    constexpr int WARP_CHUNKS = 16 * D_TILES;
#pragma unroll
    for (int i = 0; i < WARP_CHUNKS / 32; ++i) {
        const int c = lane + i * 32;
        const int row = warp_row0 + c / D_TILES;
        const int chunk = c % D_TILES;
        if ((IS_EVEN || m0 + row < q_rows) && chunk * 8 < cols) {
            const uint4 v = *reinterpret_cast<const uint4*>(tile + sw128_offset(row, chunk, ROWS));
            *reinterpret_cast<uint4*>(gO + row * o_row_stride + chunk * 8) = v;
        }
    }
}

}  // namespace cuflash
