// bwd_tma_params.cuh: the Params of the sm_90a backward kernels that load through TMA
// (flash_bwd_sm90.cu's TMA variant, flash_bwd_sm90_ws.cu): BwdParams, the warp-specialized kernel's
// tile group, then the tensor maps of Q and dO (boxes of BLOCK_M rows) and of K and V (BLOCK_N rows),
// 64-byte aligned. Must match
// cuflash/_launch.py BWD_TMA_PARAMS.
#pragma once
#include "params.cuh"
#include "tma.cuh"

namespace cuflash {

struct BwdTmaParams : BwdParams {
    int tile_heads;  // flash_bwd_sm90_ws.cu: (batch, kv head)s per group of its tile order (blocks.cuh)
    int d_cols;      // the warp-specialized kernels: the call's head_dim (below the kernel's under pad-up)
    int tail_heads;  // flash_bwd_sm90_ws.cu: (batch, kv head)s of the last group of its tile order (0: none)
    TmaDesc map_q;
    TmaDesc map_do;
    TmaDesc map_k;
    TmaDesc map_v;
};

}  // namespace cuflash
