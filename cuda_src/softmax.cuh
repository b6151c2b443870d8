// softmax.cuh: online softmax on mma accumulator fragments, in the log2 domain.
//
// A warp's score tile is M_TILES x (16 rows) by N_TILES x (8 columns). Thread (g, t) holds, for
// m-tile mt, row g in elements 0,1 of every n-tile and row g + 8 in elements 2,3; the 4 threads of
// a quad (same g) together hold a whole row, so row reductions are two xor-shuffles.
//
// Per row we keep m (running max of scaled scores, log2 units; in every thread of the quad), and
// this thread's shares of l (the running sum of p) and lp (the running sum of p as rounded to the
// element type for P V). On each new tile:
//   m_new = max(m, rowmax(s * scale_log2))
//   p     = exp2(s * scale_log2 - m_new), rounded to the element type (Ops) and packed as the P V
//           product reads it
//   alpha = exp2(m - m_new)            O, l and lp are rescaled by alpha
//   l     = l * alpha + rowsum(p)
//   lp    = lp * alpha + rowsum(p rounded)
// At the end O /= lp and lse = (m + log2 l) * ln 2. softmax_scale > 0 is required by the host, so
// rowmax(s) * scale_log2 == rowmax(s * scale_log2). With LAZY (below) m_new stays m unless the tile's
// max exceeds m by more than LAZY_LOG2.
// Why two sums: O = sum_j round(p_j) v_j / sum_j round(p_j) weights the values by an exact convex
// combination of the rounded probabilities, so a rounding error of p_j moves O by
// round_err_j * (v_j - O) / lp, where dividing by the exact l gave round_err_j * v_j / l. The
// difference is the weighted mean of the rounding errors times O; dropping it helps most where the
// rounded weights err alike: nearly equal scores (the largest p is exactly 1, the others just below
// it) or values with a common offset. The naive computation rounds the normalized P, whose values
// land near 1/n; dividing by l, the tiled one erred up to 2.2x more than it on a few keys with a
// tiny softcap (tests/test_fuzz_inputs.py, seed 260855508; tests/test_near_equal_scores.py). lse
// keeps the unrounded l: it is a property of the scores alone, and the backward recomputes P from it.
// The product s * scale_log2 is rounded (__fmul_rn, never contracted into an fma) before m is
// subtracted, the same rounding as m's own: the row's largest score then gives exactly exp2(0) = 1
// and every other at most 1. With an fma, the exact product minus the rounded m is the rounding
// error of m, up to half an ulp of |m|: 128 for logits near 2^31 (huge q and k values), and exp2 of
// it overflows to inf, then NaN. (LAZY lets p reach 2^LAZY_LOG2, never more: still far from it.)
// prepare_in_place (the wgmma forwards but the pingpong kernel) takes the fma after all while every
// |m| of the warp is below FMA_EXP_LIMIT, where that error is at most 2^-8 (below), and this form
// otherwise.
#pragma once
#include "common.cuh"

namespace cuflash {

__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// A row that has seen no key yet has m == -inf. Subtracting -inf from -inf would give NaN, so such
// a row uses 0 as its base: every p and alpha is then exp2(-inf) = 0, which is exactly right.
__device__ __forceinline__ float exp_base(float m) { return m == -CUFLASH_INF ? 0.f : m; }

// Where lp comes from (LP):
//   LP_THREAD (the wgmma forwards at head_dim 256): this thread's shares of l and lp of both rows;
//     lp takes each tile in add_rounded, from the packed P, once the tile's P V is issued.
//   LP_QUAD (the mma.sync forward and the decode kernel, which have no 2 registers per m-tile to
//     spare: ptxas spilled): one register per m-tile, lanes t = 0, 1 of the quad hold l of row
//     g + 8t and lanes 2, 3 lp of row g + 8(t - 2), each summed over the quad; each tile goes in
//     by commit (a reduce-scatter, 3 shuffles).
//   LP_TENSOR (the wgmma forwards up to head_dim 128): lp is the caller's: P times ones on the
//     tensor cores, an accumulator rescaled with O (flash_fwd_sm90.cu: wgmma_rs_rowsum; the warp-
//     specialized kernel: 8 more columns of its P V product, over a ones panel after each V
//     stage); take_lp hands it over before finalize.
// Summing the rounded P costs the forward about 4 to 6 % of its GPU time on an H100, in any of
// these forms (bench/NOTES.md, session 19): the kernels are bound by their ALU work and by the
// latency of each tile's chain, so neither pipe takes it for free; fwd_sm90_steps.cuh says which
// form each wgmma forward uses.
constexpr int LP_THREAD = 0, LP_QUAD = 1, LP_TENSOR = 2;
// LAZY (the wgmma forwards): a row's max moves only when a tile's max exceeds it by more than
// LAZY_LOG2 (log2 units); otherwise the tile's p are taken against the kept max, up to 2^LAZY_LOG2,
// and alpha is exactly 1, so a warp whose rows all kept theirs skips O's rescale (rescale_and_pack).
// Every p, l and lp stays relative to the same kept m, so O / lp and m + log2 l are unchanged in
// exact arithmetic; the rounding of p to the element type is relative, so it errs alike at any
// scale, and p <= 256, l <= 256 x seqlen_k are far from overflow in float32, fp16 and bf16. The row's
// largest p is still >= 1 (the key that set the kept max gave exactly 1, or within 2^-8 of it in log2
// where p takes one fma: prepare_in_place), as finalize assumes.
// (FlashAttention-4's conditional rescaling, with its threshold 8.)
constexpr float LAZY_LOG2 = 8.f;
template <typename Ops, int M_TILES, int N_TILES, int LP = LP_THREAD, bool LAZY = false>
struct OnlineSoftmax {
    static constexpr bool COMPACT = LP == LP_QUAD;
    float row_m[M_TILES][2];   // running max, log2 units
    float row_l[M_TILES][2];   // !COMPACT: this thread's share of the running sum of p
    // LP_THREAD: this thread's share of the running sum of p as rounded; LP_TENSOR: the whole row's
    // (take_lp)
    float row_lp[M_TILES][2];
    float sums[M_TILES];       // COMPACT: l or lp of one row, as above
    float tile_l[M_TILES][2];  // COMPACT, from prepare to commit: this thread's share of the tile's l

    __device__ __forceinline__ void init() {
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt) {
            sums[mt] = 0.f;
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                row_m[mt][r] = -CUFLASH_INF;
                row_l[mt][r] = row_lp[mt][r] = 0.f;
            }
        }
    }

    // Row g + 8r of m-tile mt takes this tile: its running max (LAZY: kept unless the tile's max exceeds
    // it by more than LAZY_LOG2; a row with no key yet, m = -inf, takes any finite max, and alpha is
    // then exactly 1) and alpha. Returns the base the tile's p are taken against (exp_base).
    __device__ __forceinline__ float new_max(const float (&s)[M_TILES][N_TILES][4], int mt, int r, float scale_log2,
                                             float (&alpha)[M_TILES][2]) {
        float mx = -CUFLASH_INF;
#pragma unroll
        for (int nt = 0; nt < N_TILES; ++nt) mx = fmaxf(mx, fmaxf(s[mt][nt][2 * r], s[mt][nt][2 * r + 1]));
        float m_new = fmaxf(row_m[mt][r], __fmul_rn(quad_max(mx), scale_log2));
        if constexpr (LAZY) {
            if (!(m_new > row_m[mt][r] + LAZY_LOG2)) m_new = row_m[mt][r];
        }
        const float base = exp_base(m_new);
        alpha[mt][r] = (LAZY && m_new == row_m[mt][r]) ? 1.f : fast_exp2(row_m[mt][r] - base);
        row_m[mt][r] = m_new;
        return base;
    }
    // l of that row takes the tile's sum of p (this thread's part), after the rescale by alpha.
    __device__ __forceinline__ void add_sum(int mt, int r, float sum, const float (&alpha)[M_TILES][2]) {
        if constexpr (COMPACT) {
            tile_l[mt][r] = sum;
        } else {
            row_l[mt][r] = row_l[mt][r] * alpha[mt][r] + sum;
            if constexpr (LP == LP_THREAD) row_lp[mt][r] *= alpha[mt][r];
        }
    }

    // The running max and alpha of this tile, l (and lp rescaled by alpha); emit gets each pair of p.
    // p = exp2(s * scale_log2 - base) with base the row's new max (exp_base).
    template <typename F>
    __device__ __forceinline__ void tile_exp(const float (&s)[M_TILES][N_TILES][4], float scale_log2,
                                             float (&alpha)[M_TILES][2], F&& emit) {
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const float base = new_max(s, mt, r, scale_log2, alpha);
                float sum = 0.f;  // this thread's part of the tile's row sum
#pragma unroll
                for (int nt = 0; nt < N_TILES; ++nt) {
                    const float p0 = fast_exp2(__fmul_rn(s[mt][nt][2 * r], scale_log2) - base);
                    const float p1 = fast_exp2(__fmul_rn(s[mt][nt][2 * r + 1], scale_log2) - base);
                    emit(mt, nt, r, p0, p1);
                    sum += p0;
                    sum += p1;
                }
                add_sum(mt, r, sum, alpha);
            }
        }
    }

    // Turns scores s into probabilities p, rounded to the element type and packed two to a register
    // as P V's A operand reads them: pp[mt][nt][r] holds this thread's two columns of n-tile nt in
    // row g + 8r (elements 2r, 2r + 1 of s[mt][nt]). Returns the factor alpha by which each row's
    // output accumulator must be rescaled. (Packed, P takes half the registers that float P did.)
    // lp takes the tile in add_rounded(pp) (LP_QUAD: l and lp, in commit(alpha, pp)).
    __device__ __forceinline__ void prepare(const float (&s)[M_TILES][N_TILES][4], float scale_log2,
                                            float (&alpha)[M_TILES][2], u32 (&pp)[M_TILES][N_TILES][2]) {
        tile_exp(s, scale_log2, alpha, [&](int mt, int nt, int r, float p0, float p1) { pp[mt][nt][r] = Ops::pack(p0, p1); });
    }

    // The same with p left in s as float32, for the wgmma kernels: they pack P (rescale_and_pack)
    // only once the previous P V product has retired, since ptxas serializes every wgmma (C7513)
    // when an instruction defines registers that an in-flight wgmma reads.
    // Here each p takes one fma, exp2(fma(s, scale_log2, -base)), not tile_exp's rounded product and
    // subtraction: the exact product minus base errs from tile_exp's value only for the row's largest
    // keys, by up to the rounding error of base = round(max * scale_log2), half an ulp of |base|. While
    // every |base| of the warp is below FMA_EXP_LIMIT that is at most 2^-8, so the p of the key that
    // set the base is within 0.3 % of 1 (O / lp and lse use the same p, so they stay consistent); the
    // ulp is reached only by logits of 2^16 log2 units and more, and then (a warp vote) the tile is
    // first scaled in place with rounded products, and the fma with 1 is tile_exp's subtraction exactly.
    // (Every wgmma forward takes this form. The pingpong kernel kept tile_exp's until session 41, when
    // the fma form measured 0.92-0.99x its time at head_dim 128 on an H200: its softmax is bound by the
    // instructions it issues, and the fma drops one an element; bench/NOTES.md.)
    static constexpr float FMA_EXP_LIMIT = 65536.f;
    __device__ __forceinline__ void prepare_in_place(float (&s)[M_TILES][N_TILES][4], float scale_log2,
                                                     float (&alpha)[M_TILES][2]) {
        float base[M_TILES][2];
        bool far = false;
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                base[mt][r] = new_max(s, mt, r, scale_log2, alpha);
                far = far || !(fabsf(base[mt][r]) < FMA_EXP_LIMIT);  // NaN too
            }
        float sc = scale_log2;
        if (__any_sync(0xffffffffu, far)) {
#pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
                for (int nt = 0; nt < N_TILES; ++nt)
#pragma unroll
                    for (int e = 0; e < 4; ++e) s[mt][nt][e] = __fmul_rn(s[mt][nt][e], scale_log2);
            sc = 1.f;
        }
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                float sum = 0.f;
#pragma unroll
                for (int nt = 0; nt < N_TILES; ++nt) {
                    const float p0 = fast_exp2(fmaf(s[mt][nt][2 * r], sc, -base[mt][r]));
                    const float p1 = fast_exp2(fmaf(s[mt][nt][2 * r + 1], sc, -base[mt][r]));
                    s[mt][nt][2 * r] = p0;
                    s[mt][nt][2 * r + 1] = p1;
                    sum += p0;
                    sum += p1;
                }
                add_sum(mt, r, sum, alpha);
            }
        }
    }

    // The sum of the rounded P of row g + 8r in this thread's registers of pp (two conversions and two
    // adds per register).
    static __device__ __forceinline__ float rounded_sum(const u32 (&pp)[N_TILES][2], int r) {
        float lo = 0.f, hi = 0.f;
#pragma unroll
        for (int nt = 0; nt < N_TILES; ++nt) {
            lo += Ops::lo(pp[nt][r]);
            hi += Ops::hi(pp[nt][r]);
        }
        return lo + hi;
    }

    // LP_THREAD: adds the tile of prepare, P as packed (pp), to lp. Call it once the tile's P V
    // product is issued: the adds then overlap the tensor cores' work instead of delaying it.
    __device__ __forceinline__ void add_rounded(const u32 (&pp)[M_TILES][N_TILES][2]) {
        static_assert(LP == LP_THREAD, "add_rounded: LP_THREAD");
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
            for (int r = 0; r < 2; ++r) row_lp[mt][r] += rounded_sum(pp[mt], r);
    }

    // LP_QUAD: adds the tile of prepare (its packed P and alpha) to the sums: per row, lanes t < 2
    // gather l's parts and t >= 2 lp's (xor 2); then even lanes keep row g's, odd lanes row g + 8's.
    // Call it once the tile's P V product is issued.
    __device__ __forceinline__ void commit(const float (&alpha)[M_TILES][2], const u32 (&pp)[M_TILES][N_TILES][2]) {
        static_assert(COMPACT, "commit: LP_QUAD");
        const int t = threadIdx.x & 3;
        const bool want_l = t < 2, odd = t & 1;
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt) {
            float k[2];
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const float sum_p = rounded_sum(pp[mt], r), sum = tile_l[mt][r];
                k[r] = (want_l ? sum : sum_p) + __shfl_xor_sync(0xffffffffu, want_l ? sum_p : sum, 2);
            }
            const float mine = (odd ? k[1] : k[0]) + __shfl_xor_sync(0xffffffffu, odd ? k[0] : k[1], 1);
            sums[mt] = sums[mt] * (odd ? alpha[mt][1] : alpha[mt][0]) + mine;
        }
    }

    // LP_TENSOR: lp of rows g, g + 8 from the caller's accumulator of P times ones (m64n8: elements 0
    // and 2; every column holds the row sum).
    __device__ __forceinline__ void take_lp(const float (&acc)[4]) {
        static_assert(LP == LP_TENSOR && M_TILES == 1, "take_lp: LP_TENSOR");
        row_lp[0][0] = acc[0];
        row_lp[0][1] = acc[2];
    }
    // ... of each m-tile's accumulator.
    __device__ __forceinline__ void take_lp(const float (&acc)[M_TILES][4]) {
        static_assert(LP == LP_TENSOR, "take_lp: LP_TENSOR");
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt) {
            row_lp[mt][0] = acc[mt][0];
            row_lp[mt][1] = acc[mt][2];
        }
    }

    // l and lp of row g + 8r of m-tile mt (every lane of the warp must call).
    __device__ __forceinline__ float l_of(int mt, int r) const {
        if constexpr (COMPACT) return __shfl_sync(0xffffffffu, sums[mt], (threadIdx.x & 28) | r);
        else return quad_sum(row_l[mt][r]);
    }
    __device__ __forceinline__ float lp_of(int mt, int r) const {
        if constexpr (COMPACT) return __shfl_sync(0xffffffffu, sums[mt], (threadIdx.x & 28) | (2 + r));
        else if constexpr (LP == LP_TENSOR) return row_lp[mt][r];
        else return quad_sum(row_lp[mt][r]);
    }

    // Returns 1/lp (0 for a row that saw no key, whose output is then exactly 0) and the
    // natural-log logsumexp (-inf for such a row). A row that saw a key has lp >= 1 (>= 2^(-2^-8) where
    // p takes one fma: prepare_in_place): its largest key's p is 1 (within that), and no later alpha
    // shrinks it.
    __device__ __forceinline__ void finalize(float (&inv_l)[M_TILES][2], float (&lse)[M_TILES][2]) {
        const float LN2 = 0.6931471805599453f;
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const float l = l_of(mt, r);
                const float lp = lp_of(mt, r);
                const bool empty = (l == 0.f);
                inv_l[mt][r] = empty ? 0.f : 1.f / lp;
                lse[mt][r] = empty ? -CUFLASH_INF : (row_m[mt][r] + fast_log2(l)) * LN2;
            }
    }

    // finalize with a sink logit (log2 units; -inf: none, and then the same as finalize): a key of
    // value 0 joined after the last tile, so that P stays relative to the keys' own max and the
    // largest key's P is 1 (within 2^-8 in log2 where p takes one fma) before its rounding for P V.
    // With m' = max(m, sink):
    //   l' = l * exp2(m - m') + exp2(sink - m'),   lse = m' + log2 l',
    //   O' = O * exp2(m - m') / (lp * exp2(m - m') + exp2(sink - m'))  (the sink's weight unrounded)
    // (no term exceeds 1, so nothing overflows whatever the sink). A row with no visible key and a
    // finite sink gets O = 0 and lse = sink; with no sink either, O = 0 and lse = -inf.
    __device__ __forceinline__ void finalize(float (&inv_l)[M_TILES][2], float (&lse)[M_TILES][2],
                                             float sink_log2) {
        const float LN2 = 0.6931471805599453f;
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const float m = row_m[mt][r];
                const float m_new = fmaxf(m, sink_log2);
                const float base = exp_base(m_new);
                const float alpha = fast_exp2(m - base);
                const float ps = fast_exp2(sink_log2 - base);
                const float l = l_of(mt, r) * alpha + ps;
                const float lp = lp_of(mt, r) * alpha + ps;
                const bool empty = (l == 0.f);
                inv_l[mt][r] = empty ? 0.f : alpha / lp;
                lse[mt][r] = empty ? -CUFLASH_INF : (m_new + fast_log2(l)) * LN2;
            }
    }
};

// An O accumulator of M_TILES x D_TILES mma fragments rescaled row by row, as the online softmax's
// maximum moved: rows g (elements 0, 1) and g + 8 (elements 2, 3) of m-tile mt by alpha[mt][0] and
// alpha[mt][1].
template <int M_TILES, int D_TILES>
__device__ __forceinline__ void scale_rows(float (&acc)[M_TILES][D_TILES][4], const float (&alpha)[M_TILES][2]) {
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
        for (int dt = 0; dt < D_TILES; ++dt) {
            acc[mt][dt][0] *= alpha[mt][0];
            acc[mt][dt][1] *= alpha[mt][0];
            acc[mt][dt][2] *= alpha[mt][1];
            acc[mt][dt][3] *= alpha[mt][1];
        }
}

}  // namespace cuflash
