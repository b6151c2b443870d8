// tma_probe.cu: a check of the TMA plumbing (cuflash/_tma.py's tensor maps, tma.cuh's copies and
// mbarriers) before any attention kernel relies on it: step 1 of docs/hopper_plan.md.
//
// Algorithm: one thread block loads one K-like tile with TMA exactly as a kernel would (one elected
// thread arms an mbarrier with the tile's bytes and issues one 4-D copy per 64-column panel; every
// thread waits on the barrier's phase 0) and writes the shared-memory bytes out unchanged. The host
// (tests/test_tma_gpu.py, bench/dev/tma_probe.py) compares them with the SW128 panel layout of
// wgmma_util.cuh filled from the tensor, rows past the tensor's end as zeros.
//
// Layouts: the tensor (batch, seqlen, heads, head_dim) with element strides (any multiple of 8, the
// last dimension unit-stride), described by the map as 4-D (head_dim, seqlen, heads, batch), box
// {64, ROWS, 1, 1}, 128-byte swizzle. out: (grid, PANELS * ROWS * 128) bytes, block i's tile at
// rows [row0 + i * ROWS, ...) of (head, batch).
//
// Grid: 1-D, one tile per block; 128 threads.
#include "common.cuh"
#include "tma.cuh"
#include "wgmma_util.cuh"

namespace cuflash {

struct TmaProbeParams {
    TmaDesc map;   // offset 0
    void* out;
    int row0;      // the first tile's first row
    int head;
    int batch;
};

template <int ROWS, int PANELS>
__global__ void __launch_bounds__(128)
tma_probe_kernel(const __grid_constant__ TmaProbeParams p) {
    constexpr u32 BYTES = ROWS * PANELS * 128;
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    __shared__ alignas(8) unsigned long long bar_storage;
    const u32 base = (smem_addr(smem_raw) + 1023u) & ~1023u;
    const u32 bar = smem_addr(&bar_storage);
    if (threadIdx.x == 0) {
        tma_prefetch_desc(&p.map);
        mbar_init(bar, 1);
        fence_mbar_init();
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        mbar_arrive_expect_tx(bar, BYTES);
#pragma unroll
        for (int c = 0; c < PANELS; ++c)
            tma_load_4d(base + c * ROWS * 128, &p.map, bar, c * 64, p.row0 + (int)blockIdx.x * ROWS, p.head, p.batch);
    }
    mbar_wait(bar, 0);
    uint4* out = reinterpret_cast<uint4*>(static_cast<unsigned char*>(p.out) + (size_t)blockIdx.x * BYTES);
    for (u32 i = threadIdx.x; i < BYTES / 16; i += blockDim.x) out[i] = ld_shared_u128(base + 16 * i);
}

}  // namespace cuflash
