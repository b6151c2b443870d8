// tma.cuh: Hopper's tensor memory accelerator (TMA) and the mbarriers that count its bytes, for
// sm_90a kernels.
//
// A TMA copy moves a box of a global tensor into shared memory in one instruction issued by one
// thread; the tensor's shape, strides, the box and the shared-memory swizzle are fixed in a
// 128-byte tensor map that the host encodes (cuTensorMapEncodeTiled, cuflash/_tma.py) and the kernel
// receives inside its __grid_constant__ Params. Elements of the box outside the tensor arrive as
// zeros. The copy completes on an mbarrier: a thread arms it with the number of bytes to expect
// (arrive.expect_tx), each copy adds its box's bytes when it lands (complete_tx), and waiters spin on
// the barrier's phase parity. Each use of a barrier flips its phase: wait for parity 0 the first
// time, 1 the second, and so on.
//
// Layout used with wgmma: a map with box {64 columns, ROWS rows, 1, 1} of 16-bit elements and the
// 128-byte swizzle writes one SW128 panel of wgmma_util.cuh (row r's 16-byte chunk k at chunk k ^
// (r % 8), 128 bytes a row), so a HEAD_DIM-wide tile is HEAD_DIM / 64 copies, one per panel, to
// panel-aligned (1024-byte) addresses.
#pragma once
#include "common.cuh"

namespace cuflash {

// CUtensorMap's bytes (opaque; 64-byte alignment is what the copy instruction requires of it).
struct alignas(64) TmaDesc {
    unsigned long long opaque[16];
};

__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(count) : "memory");
}

// Orders an mbarrier's initialization before its use by the async proxy (the TMA unit).
__device__ __forceinline__ void fence_mbar_init() {
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// This thread's arrival, announcing `bytes` more to come from async copies in this phase.
__device__ __forceinline__ void mbar_arrive_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
}

// This thread's plain arrival (a consumer releasing a stage to the producer).
__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(bar) : "memory");
}

__device__ __forceinline__ bool mbar_try_wait(u32 bar, u32 parity) {
    u32 done;
    asm volatile(
        "{\n"
        "  .reg .pred ready;\n"
        "  mbarrier.try_wait.parity.shared::cta.b64 ready, [%1], %2;\n"
        "  selp.u32 %0, 1, 0, ready;\n"
        "}\n"
        : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    return done != 0;
}

// Waits until the barrier's phase with this parity has completed.
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    while (!mbar_try_wait(bar, parity)) {
    }
}

__device__ __forceinline__ void tma_prefetch_desc(const TmaDesc* map) {
    asm volatile("prefetch.tensormap [%0];" :: "l"(reinterpret_cast<unsigned long long>(map)) : "memory");
}

// Box at coordinates (c0 innermost .. c3) of a 4-D map into shared memory at dst, completing on bar.
__device__ __forceinline__ void tma_load_4d(u32 dst, const TmaDesc* map, u32 bar, int c0, int c1, int c2, int c3) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], [%2];"
        :: "r"(dst), "l"(reinterpret_cast<unsigned long long>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
        : "memory");
}

// The same for a 5-D map (c0 innermost .. c4).
__device__ __forceinline__ void tma_load_5d(u32 dst, const TmaDesc* map, u32 bar, int c0, int c1, int c2, int c3,
                                            int c4) {
    asm volatile(
        "cp.async.bulk.tensor.5d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6, %7}], [%2];"
        :: "r"(dst), "l"(reinterpret_cast<unsigned long long>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4)
        : "memory");
}

// Bulk reduction (no tensor map): adds `bytes` (a multiple of 16, both addresses 16-byte aligned)
// of float32 from shared memory into global memory, element by element, in L2. Tracked per thread in
// bulk groups: commit after issuing; wait_group_read<N> returns once at most N of this thread's
// groups still read their shared source (the buffer may then be rewritten), wait_group<N> once at
// most N are incomplete (their writes done).
__device__ __forceinline__ void bulk_reduce_add_f32(float* gdst, u32 ssrc, u32 bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;"
                 :: "l"(gdst), "r"(ssrc), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_commit_group() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
template <int N> __device__ __forceinline__ void bulk_wait_group_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;" :: "n"(N) : "memory");
}
template <int N> __device__ __forceinline__ void bulk_wait_group() {
    asm volatile("cp.async.bulk.wait_group %0;" :: "n"(N) : "memory");
}

// Warp specialization (sm_90a): a warpgroup gives registers back (the producer) or takes them (the
// consumers). Every thread of the warpgroup must execute the same instruction.
template <int N> __device__ __forceinline__ void setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" :: "n"(N));
}
template <int N> __device__ __forceinline__ void setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" :: "n"(N));
}

// A barrier among `threads` threads (a multiple of 32) on named barrier `id` (1..15; 0 is
// __syncthreads').
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;" :: "r"(id), "r"(threads) : "memory");
}

// This warp's arrival at named barrier `id` among `threads` threads, without waiting for it.
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;" :: "r"(id), "r"(threads) : "memory");
}

// threadIdx.x / 128 as a value the compiler knows is the same across the warp (a shuffle from lane
// 0), so that a branch on it is visibly warp-uniform.
__device__ __forceinline__ int warpgroup_index() {
    return __shfl_sync(0xffffffffu, (int)(threadIdx.x / 128), 0);
}

}  // namespace cuflash
