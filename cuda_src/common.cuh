// common.cuh: element types and the tensor-core building blocks (mma.sync, ldmatrix, cp.async).
//
// No CUDA header is included anywhere under cuda_src/: half and bfloat16 values are carried as raw
// 16-bit patterns and converted with PTX cvt instructions. That keeps run-time compilation
// independent of where (or whether) cuda_fp16.h / cuda_bf16.h are installed: NVRTC alone suffices.
//
// Fragment layouts are the ones the PTX ISA gives for mma.m16n8k16 (and m16n8k8) with .row.col:
//   lane = 4 * g + t  (g = lane / 4 in 0..7, t = lane % 4 in 0..3)
//   A (16 x 16, row-major): a0 = A[g][2t..2t+1]      a1 = A[g+8][2t..2t+1]
//                           a2 = A[g][2t+8..2t+9]    a3 = A[g+8][2t+8..2t+9]
//   B (16 x 8, "col"):      b0 = B[2t..2t+1][g]      b1 = B[2t+8..2t+9][g]
//   C (16 x 8, float):      c0,c1 = C[g][2t..2t+1]   c2,c3 = C[g+8][2t..2t+1]
// ldmatrix.x4 returns four 8x8 b16 matrices; lanes 8i..8i+7 give the row addresses of matrix i.
#pragma once

typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;
typedef unsigned long long u64;

#define CUFLASH_INF __int_as_float(0x7f800000)
#define CUFLASH_LOG2E 1.4426950408889634f
#define CUFLASH_LN2 0.6931471805599453f

namespace cuflash {

// Element type tags. Only their size and the conversion / mma spelling matter.
struct f16 { u16 bits; };
struct bf16 { u16 bits; };

template <typename T> struct ElemOps;

template <> struct ElemOps<f16> {
    // Two floats -> one register of two halves, round to nearest even; lo goes to the low 16 bits.
    static __device__ __forceinline__ u32 pack(float lo, float hi) {
        u32 r;
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
        return r;
    }
    static __device__ __forceinline__ float to_float(u16 x) {
        float f;
        asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
        return f;
    }
    // The halves of a packed register as floats (exact).
    static __device__ __forceinline__ float lo(u32 x) { return to_float((u16)(x & 0xffffu)); }
    static __device__ __forceinline__ float hi(u32 x) { return to_float((u16)(x >> 16)); }
    static constexpr u32 ONES2 = 0x3c003c00u;  // two halves of 1.0
    // D = A * B + D, m16n8k16, float accumulators.
    static __device__ __forceinline__ void mma16816(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
            "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
    // D = A * B + D, m16n8k8: the tail of a head_dim that is an odd multiple of 8.
    static __device__ __forceinline__ void mma1688(float (&d)[4], u32 a0, u32 a1, u32 b0) {
        asm volatile(
            "mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 "
            "{%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a0), "r"(a1), "r"(b0));
    }
};

template <> struct ElemOps<bf16> {
    static __device__ __forceinline__ u32 pack(float lo, float hi) {
        u32 r;
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
        return r;
    }
    static __device__ __forceinline__ float to_float(u16 x) { return __uint_as_float(((u32)x) << 16); }
    static __device__ __forceinline__ float lo(u32 x) { return __uint_as_float(x << 16); }
    static __device__ __forceinline__ float hi(u32 x) { return __uint_as_float(x & 0xffff0000u); }
    static constexpr u32 ONES2 = 0x3f803f80u;  // two bfloat16 of 1.0
    static __device__ __forceinline__ void mma16816(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
            "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
    static __device__ __forceinline__ void mma1688(float (&d)[4], u32 a0, u32 a1, u32 b0) {
        asm volatile(
            "mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 "
            "{%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a0), "r"(a1), "r"(b0));
    }
};

// Generic pointer -> 32-bit shared-window address, as ldmatrix and cp.async want it.
__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// stmatrix.x4: the inverse of ldmatrix_x4 (register i of each lane into matrix i; lanes 8i..8i+7
// give the row addresses of matrix i). sm_90.
__device__ __forceinline__ void stmatrix_x4(u32 addr, u32 r0, u32 r1, u32 r2, u32 r3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1,%2,%3,%4};"
                 :: "r"(addr), "r"(r0), "r"(r1), "r"(r2), "r"(r3) : "memory");
}

__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x2(u32& r0, u32& r1, u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];"
                 : "=r"(r0), "=r"(r1) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x2_trans(u32& r0, u32& r1, u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];"
                 : "=r"(r0), "=r"(r1) : "r"(addr));
}

// 16-byte global -> shared copy that bypasses L1. src_bytes = 0 writes 16 zero bytes instead:
// rows past the end of a sequence land as zeros, so P * V never meets uninitialised memory.
__device__ __forceinline__ void cp_async_16(u32 dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(dst), "l"(src), "r"(src_bytes));
}
// With an L2 prefetch size hint: the L2 fills PREFETCH (64, 128 or 256) bytes around the request
// from memory at once.
template <int PREFETCH>
__device__ __forceinline__ void cp_async_16_l2(u32 dst, const void* src, int src_bytes) {
    static_assert(PREFETCH == 64 || PREFETCH == 128 || PREFETCH == 256, "L2 prefetch sizes: 64, 128, 256 bytes");
    if constexpr (PREFETCH == 256)
        asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;" :: "r"(dst), "l"(src), "r"(src_bytes));
    else if constexpr (PREFETCH == 128)
        asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;" :: "r"(dst), "l"(src), "r"(src_bytes));
    else
        asm volatile("cp.async.cg.shared.global.L2::64B [%0], [%1], 16, %2;" :: "r"(dst), "l"(src), "r"(src_bytes));
}
// 4-byte variant (through L1; .cg takes only 16): src_bytes = 0 writes 4 zero bytes.
__device__ __forceinline__ void cp_async_4(u32 dst, const void* src, int src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" :: "r"(dst), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" :: "n"(N));
}

// Row pitch (elements) of a shared-memory tile of 16-bit values with `cols` columns (a multiple of
// 8): an odd number of 16-byte chunks, so the 8 rows read by one ldmatrix phase land in 8 distinct
// 16-byte bank groups.
__host__ __device__ constexpr int padded_pitch(int cols) { return ((cols / 8) % 2 == 1) ? cols : cols + 8; }

// Copies `rows` rows (of HEAD_DIM elements, row stride `row_stride` elements) from global memory to
// shared memory with 16-byte cp.async; rows at or past `valid_rows` are zero-filled.
template <typename T, int HEAD_DIM, int PITCH, int ROWS, int THREADS, bool CHECK>
__device__ __forceinline__ void load_tile_async(T* s_dst, const T* g_src, i64 row_stride, int valid_rows, int tid) {
    constexpr int CHUNKS = HEAD_DIM / 8;
    constexpr int TOTAL = ROWS * CHUNKS;
#pragma unroll
    for (int i = 0; i < (TOTAL + THREADS - 1) / THREADS; ++i) {
        const int c = tid + i * THREADS;
        if (TOTAL % THREADS == 0 || c < TOTAL) {
            const int row = c / CHUNKS;
            const int col = (c % CHUNKS) * 8;
            const bool ok = !CHECK || row < valid_rows;
            // An out-of-range row still needs a valid address: point it at the tile's first row.
            const T* src = g_src + (ok ? row * row_stride : 0) + col;
            cp_async_16(smem_addr(s_dst + row * PITCH + col), src, ok ? 16 : 0);
        }
    }
}

__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));  // ex2(-inf) = +0
    return y;
}
__device__ __forceinline__ float fast_log2(float x) {
    float y;
    asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ u32 dynamic_smem_bytes() {
    u32 r;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(r));
    return r;
}

// Programmatic dependent launch (sm_90; no-ops before it). A kernel launched with the programmatic
// stream-serialization attribute (cuflash/_launch.py) may start while the kernel before it in the
// stream still runs, once that one has called pdl_launch_dependents in every block (or finished):
// it must call pdl_wait, which returns when the previous grid has completed and its writes are
// visible, before any global read of what an earlier kernel wrote and before any global write.
// Launched without the attribute, pdl_wait returns at once and the stream orders kernels as always.
__device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_launch_dependents() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}


// Thread block clusters (sm_90; the host launches a cluster with cuLaunchKernelEx's cluster
// attribute). cluster_sync: every thread of every block of the cluster arrives, then waits for the
// others, with release / acquire order on shared memory (each block's writes before it are seen by
// the others' reads after it). cluster_map: the address in block `rank`'s shared memory that matches
// `addr` in this block's (distributed shared memory), read with ld_cluster_*.
#if __CUDA_ARCH__ >= 900
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__device__ __forceinline__ u32 cluster_map(u32 addr, int rank) {
    u32 r;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(addr), "r"(rank));
    return r;
}
__device__ __forceinline__ float ld_cluster_f32(u32 addr) {
    float x;
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(x) : "r"(addr) : "memory");
    return x;
}
__device__ __forceinline__ float4 ld_cluster_v4(u32 addr) {
    float4 x;
    asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(x.x), "=f"(x.y), "=f"(x.z), "=f"(x.w) : "r"(addr) : "memory");
    return x;
}
#endif

}  // namespace cuflash
