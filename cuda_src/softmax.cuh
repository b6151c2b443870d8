// softmax.cuh: online softmax on mma accumulator fragments, in the log2 domain.
//
// A warp's score tile is M_TILES x (16 rows) by N_TILES x (8 columns). Thread (g, t) holds, for
// m-tile mt, row g in elements 0,1 of every n-tile and row g + 8 in elements 2,3; the 4 threads of
// a quad (same g) together hold a whole row, so row reductions are two xor-shuffles.
//
// Per row we keep m (running max of scaled scores, log2 units) and l (this thread's part of the
// running sum of exp2(s - m)). On each new tile:
//   m_new = max(m, rowmax(s * scale_log2))
//   p     = exp2(s * scale_log2 - m_new)
//   alpha = exp2(m - m_new)            O and l are rescaled by alpha
//   l     = l * alpha + rowsum(p)
// At the end O /= l and lse = (m + log2 l) * ln 2. softmax_scale > 0 is required by the host, so
// rowmax(s) * scale_log2 == rowmax(s * scale_log2).
// The product s * scale_log2 is rounded (__fmul_rn, never contracted into an fma) before m is
// subtracted, the same rounding as m's own: the row's largest score then gives exactly exp2(0) = 1
// and every other at most 1. With an fma, the exact product minus the rounded m is the rounding
// error of m, up to half an ulp of |m|: 128 for logits near 2^31 (huge q and k values), and exp2 of
// it overflows to inf, then NaN.
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

template <int M_TILES, int N_TILES>
struct OnlineSoftmax {
    float row_m[M_TILES][2];  // running max, log2 units
    float row_l[M_TILES][2];  // this thread's share of the running sum

    __device__ __forceinline__ void init() {
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
            for (int r = 0; r < 2; ++r) { row_m[mt][r] = -CUFLASH_INF; row_l[mt][r] = 0.f; }
    }

    // Turns scores s into probabilities p in place and returns the factor alpha by which each row's
    // output accumulator must be rescaled.
    __device__ __forceinline__ void update(float (&s)[M_TILES][N_TILES][4], float scale_log2,
                                           float (&alpha)[M_TILES][2]) {
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                float mx = -CUFLASH_INF;
#pragma unroll
                for (int nt = 0; nt < N_TILES; ++nt)
                    mx = fmaxf(mx, fmaxf(s[mt][nt][2 * r], s[mt][nt][2 * r + 1]));
                const float m_new = fmaxf(row_m[mt][r], __fmul_rn(quad_max(mx), scale_log2));
                const float base = exp_base(m_new);
                alpha[mt][r] = fast_exp2(row_m[mt][r] - base);
                row_m[mt][r] = m_new;
                float sum = 0.f;
#pragma unroll
                for (int nt = 0; nt < N_TILES; ++nt) {
#pragma unroll
                    for (int e = 2 * r; e < 2 * r + 2; ++e) {
                        s[mt][nt][e] = fast_exp2(__fmul_rn(s[mt][nt][e], scale_log2) - base);
                        sum += s[mt][nt][e];
                    }
                }
                row_l[mt][r] = row_l[mt][r] * alpha[mt][r] + sum;
            }
        }
    }

    // Completes the row sums across the quad. Returns 1/l (0 for a row that saw no key, whose
    // output is then exactly 0) and the natural-log logsumexp (-inf for such a row).
    __device__ __forceinline__ void finalize(float (&inv_l)[M_TILES][2], float (&lse)[M_TILES][2]) {
        const float LN2 = 0.6931471805599453f;
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const float l = quad_sum(row_l[mt][r]);
                const bool empty = (l == 0.f);
                inv_l[mt][r] = empty ? 0.f : 1.f / l;
                lse[mt][r] = empty ? -CUFLASH_INF : (row_m[mt][r] + fast_log2(l)) * LN2;
            }
    }

    // finalize with a sink logit (log2 units; -inf: none, and then the same as finalize): a key of
    // value 0 joined after the last tile, so that P stays relative to the keys' own max and the
    // largest key's P is exactly 1 before its rounding for P V. With m' = max(m, sink):
    //   l' = l * exp2(m - m') + exp2(sink - m'),   O' = O * exp2(m - m') / l',   lse = m' + log2 l'
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
                const float l = quad_sum(row_l[mt][r]) * alpha + fast_exp2(sink_log2 - base);
                const bool empty = (l == 0.f);
                inv_l[mt][r] = empty ? 0.f : alpha / l;
                lse[mt][r] = empty ? -CUFLASH_INF : (m_new + fast_log2(l)) * LN2;
            }
    }
};

}  // namespace cuflash
