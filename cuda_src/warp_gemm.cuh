// warp_gemm.cuh: one warp computes C (16 x 8*TILES, float C fragments) += A (16 x K) * B (K x 8*TILES)
// with both operands in shared memory, through ldmatrix and mma.sync (warp_mma_mt: MT such tiles
// of A, stacked along m, sharing every B fragment).
//
// The backward pass multiplies the same tiles in several orientations (S^T = K Q^T, dV += P^T dO,
// dQ += dS K, ...), so the operand layout is a template choice instead of being hand-written for
// each product:
//   A_T = false: A[m][k] is stored at sA[m * a_pitch + k]   (row-major; ldmatrix)
//   A_T = true:  A[m][k] is stored at sA[k * a_pitch + m]   (the tile is stored transposed; ldmatrix.trans)
//   B_KN = false: B[k][n] is stored at sB[n * b_pitch + k]  (like K for Q K^T; ldmatrix)
//   B_KN = true:  B[k][n] is stored at sB[k * b_pitch + n]  (like V for P V;  ldmatrix.trans)
// K is any multiple of 8: k16 steps, then one m16n8k8 step when K % 16 == 8. Only the first `count`
// n8 tiles are computed (count is warp-uniform), which lets warps split a dimension that is not a
// multiple of their number, e.g. head_dim 136 = 17 tiles over 2 warps.
// Fragment layouts: see common.cuh. Pitches are in elements; sA / sB point at element (0, 0).
#pragma once
#include "common.cuh"

namespace cuflash {

__device__ __forceinline__ void ldmatrix_x1(u32& r0, u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];" : "=r"(r0) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x1_trans(u32& r0, u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16 {%0}, [%1];" : "=r"(r0) : "r"(addr));
}

// A, 16 x 16 at column k0.
template <bool A_T, typename T>
__device__ __forceinline__ void load_a_k16(u32 (&a)[4], const T* sA, int pitch, int k0, int lane) {
    if (!A_T) {
        ldmatrix_x4(a, smem_addr(sA + (lane % 16) * pitch + k0 + (lane / 16) * 8));
    } else {  // matrix i = lane / 8 holds k rows k0 + (i / 2) * 8.., m columns (i % 2) * 8..
        const int i = lane / 8;
        ldmatrix_x4_trans(a, smem_addr(sA + (k0 + (i / 2) * 8 + lane % 8) * pitch + (i % 2) * 8));
    }
}

// A, 16 x 8 at column k0 (the k8 tail): a0 = rows 0-7, a1 = rows 8-15.
template <bool A_T, typename T>
__device__ __forceinline__ void load_a_k8(u32& a0, u32& a1, const T* sA, int pitch, int k0, int lane) {
    if (!A_T) {
        ldmatrix_x2(a0, a1, smem_addr(sA + (lane % 16) * pitch + k0));
    } else {
        ldmatrix_x2_trans(a0, a1, smem_addr(sA + (k0 + lane % 8) * pitch + ((lane / 8) % 2) * 8));
    }
}

// B, two n8 tiles (n0, n0 + 8) of a k16 step: {b0, b1} of tile n0, then of tile n0 + 8.
template <bool B_KN, typename T>
__device__ __forceinline__ void load_b_pair_k16(u32 (&b)[4], const T* sB, int pitch, int k0, int n0, int lane) {
    const int i = lane / 8;
    if (!B_KN) {
        ldmatrix_x4(b, smem_addr(sB + (n0 + (i / 2) * 8 + lane % 8) * pitch + k0 + (i % 2) * 8));
    } else {
        ldmatrix_x4_trans(b, smem_addr(sB + (k0 + (i % 2) * 8 + lane % 8) * pitch + n0 + (i / 2) * 8));
    }
}

// B, one n8 tile of a k16 step.
template <bool B_KN, typename T>
__device__ __forceinline__ void load_b_one_k16(u32& b0, u32& b1, const T* sB, int pitch, int k0, int n0, int lane) {
    if (!B_KN) {
        ldmatrix_x2(b0, b1, smem_addr(sB + (n0 + lane % 8) * pitch + k0 + ((lane / 8) % 2) * 8));
    } else {
        ldmatrix_x2_trans(b0, b1, smem_addr(sB + (k0 + lane % 16) * pitch + n0));
    }
}

// B, two n8 tiles of the k8 tail: b of tile n0, then of tile n0 + 8.
template <bool B_KN, typename T>
__device__ __forceinline__ void load_b_pair_k8(u32& b0, u32& b1, const T* sB, int pitch, int k0, int n0, int lane) {
    if (!B_KN) {
        ldmatrix_x2(b0, b1, smem_addr(sB + (n0 + lane % 16) * pitch + k0));
    } else {
        ldmatrix_x2_trans(b0, b1, smem_addr(sB + (k0 + lane % 8) * pitch + n0 + ((lane / 8) % 2) * 8));
    }
}

// B, one n8 tile of the k8 tail.
template <bool B_KN, typename T>
__device__ __forceinline__ void load_b_one_k8(u32& b0, const T* sB, int pitch, int k0, int n0, int lane) {
    if (!B_KN) {
        ldmatrix_x1(b0, smem_addr(sB + (n0 + lane % 8) * pitch + k0));
    } else {
        ldmatrix_x1_trans(b0, smem_addr(sB + (k0 + lane % 8) * pitch + n0));
    }
}

// MT m16 tiles at once (rows mt * 16 of A): every B fragment is loaded once and used MT times,
// which is what cuts shared-memory traffic per mma.
template <typename T, int K, int MT, int TILES, bool A_T, bool B_KN>
__device__ __forceinline__ void warp_mma_mt(float (&acc)[MT][TILES][4], const T* sA, int a_pitch, const T* sB,
                                            int b_pitch, int count, int lane) {
    using Ops = ElemOps<T>;
    const int a_step = A_T ? 16 : 16 * a_pitch;  // from one m16 tile of A to the next
#pragma unroll
    for (int kc = 0; kc < K / 16; ++kc) {
        u32 a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) load_a_k16<A_T>(a[mt], sA + mt * a_step, a_pitch, kc * 16, lane);
#pragma unroll
        for (int p = 0; p < TILES / 2; ++p) {
            if (2 * p + 1 < count) {
                u32 b[4];
                load_b_pair_k16<B_KN>(b, sB, b_pitch, kc * 16, 16 * p, lane);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    Ops::mma16816(acc[mt][2 * p], a[mt], b[0], b[1]);
                    Ops::mma16816(acc[mt][2 * p + 1], a[mt], b[2], b[3]);
                }
            } else if (2 * p < count) {
                u32 b0, b1;
                load_b_one_k16<B_KN>(b0, b1, sB, b_pitch, kc * 16, 16 * p, lane);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) Ops::mma16816(acc[mt][2 * p], a[mt], b0, b1);
            }
        }
        if (TILES % 2 == 1 && TILES - 1 < count) {
            u32 b0, b1;
            load_b_one_k16<B_KN>(b0, b1, sB, b_pitch, kc * 16, 8 * (TILES - 1), lane);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) Ops::mma16816(acc[mt][TILES - 1], a[mt], b0, b1);
        }
    }
    if (K % 16 == 8) {
        constexpr int k0 = K - 8;
        u32 a0[MT], a1[MT];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) load_a_k8<A_T>(a0[mt], a1[mt], sA + mt * a_step, a_pitch, k0, lane);
#pragma unroll
        for (int p = 0; p < TILES / 2; ++p) {
            if (2 * p + 1 < count) {
                u32 b0, b1;
                load_b_pair_k8<B_KN>(b0, b1, sB, b_pitch, k0, 16 * p, lane);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    Ops::mma1688(acc[mt][2 * p], a0[mt], a1[mt], b0);
                    Ops::mma1688(acc[mt][2 * p + 1], a0[mt], a1[mt], b1);
                }
            } else if (2 * p < count) {
                u32 b0;
                load_b_one_k8<B_KN>(b0, sB, b_pitch, k0, 16 * p, lane);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) Ops::mma1688(acc[mt][2 * p], a0[mt], a1[mt], b0);
            }
        }
        if (TILES % 2 == 1 && TILES - 1 < count) {
            u32 b0;
            load_b_one_k8<B_KN>(b0, sB, b_pitch, k0, 8 * (TILES - 1), lane);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) Ops::mma1688(acc[mt][TILES - 1], a0[mt], a1[mt], b0);
        }
    }
}

template <typename T, int K, int TILES, bool A_T, bool B_KN>
__device__ __forceinline__ void warp_mma(float (&acc)[TILES][4], const T* sA, int a_pitch, const T* sB, int b_pitch,
                                         int count, int lane) {
    warp_mma_mt<T, K, 1, TILES, A_T, B_KN>(reinterpret_cast<float (&)[1][TILES][4]>(acc), sA, a_pitch, sB, b_pitch,
                                           count, lane);
}

template <int TILES>
__device__ __forceinline__ void zero_acc(float (&acc)[TILES][4]) {
#pragma unroll
    for (int i = 0; i < TILES; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[i][e] = 0.f;
}

// x rounded to T (nearest even) and back to float.
template <typename T>
__device__ __forceinline__ float round_trip(float x) {
    return ElemOps<T>::to_float((u16)(ElemOps<T>::pack(x, 0.f) & 0xffffu));
}

// Two floats as a 16-bit pair (hi, returned) and the pair of their rounding residuals (lo): hi + lo
// carries x and y to about twice T's precision through two MMAs that share the B fragment.
template <typename T>
__device__ __forceinline__ u32 pack_hi_lo(float x, float y, u32& lo) {
    lo = ElemOps<T>::pack(x - round_trip<T>(x), y - round_trip<T>(y));
    return ElemOps<T>::pack(x, y);
}

// Stores a warp's C fragments (16 x 8*TILES, first `count` tiles) to shared memory as T.
template <typename T, int TILES>
__device__ __forceinline__ void store_acc_smem(T* s, int pitch, const float (&acc)[TILES][4], int count, int lane) {
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int i = 0; i < TILES; ++i) {
        if (i < count) {
            *reinterpret_cast<u32*>(s + g * pitch + 8 * i + 2 * t) = ElemOps<T>::pack(acc[i][0], acc[i][1]);
            *reinterpret_cast<u32*>(s + (g + 8) * pitch + 8 * i + 2 * t) = ElemOps<T>::pack(acc[i][2], acc[i][3]);
        }
    }
}

}  // namespace cuflash
