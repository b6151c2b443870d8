// bwd_sm90_steps.cuh: steps the two sm_90a backward kernels share (flash_bwd_sm90.cu,
// flash_bwd_sm90_ws.cu). Fragment layouts are those of wgmma accumulators: a warp holds 16 keys
// (rows key_row0 + g and + 8, g = lane / 4) and, per 8-column tile j, columns 8 j + 2 t, + 1 (t =
// lane % 4). Shared tiles are SW128 panels (wgmma_util.cuh) of BLOCK_N rows.
#pragma once
#include "common.cuh"
#include "wgmma_util.cuh"

namespace cuflash {

// dS^T (this warp's 16 keys x the query block, as the wgmma A fragments da[k16 step][4]) into sdS
// (keys x queries): registers r = 0, 1 are chunk 2 kk, rows g, g + 8; r = 2, 3 chunk 2 kk + 1.
// The row comes through an opaque move: otherwise all 4 * Q_STEPS addresses are hoisted out of the
// caller's loop and held in registers (which spilled at head_dim 128).
template <int Q_STEPS, int BLOCK_N>
__device__ __forceinline__ void ds_to_smem(u32 sdS, int key_row, int t, const u32 (&da)[Q_STEPS][4]) {
    const int row0 = (int)opaque((u32)key_row);
    const u32 base = sdS + 4 * t;
#pragma unroll
    for (int kk = 0; kk < Q_STEPS; ++kk)
#pragma unroll
        for (int r = 0; r < 4; ++r)
            st_shared_u32(base + sw128_offset(row0 + (r % 2) * 8, 2 * kk + r / 2, BLOCK_N), da[kk][r]);
}

// Epilogue, first half: this warp's 16 keys of dV and dK = scale * acc_dk, in the input dtype, into
// their rows of sV and sK (the caller's K and V tiles, free once every product has retired).
template <typename Ops, int HEAD_DIM, int BLOCK_N>
__device__ __forceinline__ void dkdv_rows_to_smem(u32 sK, u32 sV, const float (&acc_dk)[HEAD_DIM / 2],
                                                  const float (&acc_dv)[HEAD_DIM / 2], float scale, int key_row0,
                                                  int g, int t) {
#pragma unroll
    for (int dt = 0; dt < HEAD_DIM / 8; ++dt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = key_row0 + g + r * 8;
            const u32 off = sw128_offset(row, dt, BLOCK_N) + 4 * t;
            st_shared_u32(sV + off, Ops::pack(acc_dv[4 * dt + 2 * r], acc_dv[4 * dt + 2 * r + 1]));
            st_shared_u32(sK + off, Ops::pack(acc_dk[4 * dt + 2 * r] * scale, acc_dk[4 * dt + 2 * r + 1] * scale));
        }
}

// Epilogue, second half (after __syncwarp): the warp's 16 rows of sK / sV to dK / dV (gdK, gdV: the
// block's first key row), 16 bytes a lane; rows with n0 + row >= k_rows are skipped unless IS_EVEN,
// and columns from `cols` on (head_dim pad-up: the call's head_dim is below the kernel's).
template <typename T, int HEAD_DIM, int BLOCK_N, bool IS_EVEN, typename Stride>
__device__ __forceinline__ void dkdv_rows_to_global(T* gdK, T* gdV, Stride dk_row_stride, Stride dv_row_stride, u32 sK,
                                                    u32 sV, int key_row0, int lane, int n0, int k_rows,
                                                    int cols = HEAD_DIM) {
    constexpr int D_TILES = HEAD_DIM / 8;
#pragma unroll
    for (int i = 0; i < 16 * D_TILES / 32; ++i) {
        const int c = lane + i * 32;
        const int row = key_row0 + c / D_TILES, chunk = c % D_TILES;
        if ((IS_EVEN || n0 + row < k_rows) && chunk * 8 < cols) {
            const u32 off = sw128_offset(row, chunk, BLOCK_N);
            *reinterpret_cast<uint4*>(gdK + row * dk_row_stride + chunk * 8) = ld_shared_u128(sK + off);
            *reinterpret_cast<uint4*>(gdV + row * dv_row_stride + chunk * 8) = ld_shared_u128(sV + off);
        }
    }
}

}  // namespace cuflash
