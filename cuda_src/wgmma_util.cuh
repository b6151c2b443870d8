// wgmma_util.cuh: what the sm_90a kernels need around wgmma: shared-memory descriptors, the
// 128-byte-swizzled tile layout and its cp.async loader, and the fences of the async proxy.
//
// Tile layout ("SW128 panels"). A tile of ROWS rows by COLS 16-bit columns (COLS a multiple of 64)
// is stored as COLS / 64 panels, one after the other; panel c holds columns [64 c, 64 c + 64) of
// every row, 128 bytes a row, rows contiguous. Inside a panel the 16-byte chunk k of row r is
// stored at chunk position k ^ (r % 8): the 128-byte swizzle wgmma reads natively. Panels start on
// 1024-byte boundaries (8 rows x 128 bytes), which the swizzle pattern assumes.
//
// The same layout serves both operand majors (PTX ISA, "matrix descriptor" canonical layouts):
//   K-major (rows = M or N, columns = K): SBO = 1024 (next 8 rows); LBO unused. A k16 step moves
//     the start address 32 bytes inside the panel, or to the next panel every 4 steps.
//   MN-major (rows = K, columns = M or N): SBO = 1024 (next 8 K rows), LBO = the panel size (next
//     64 M or N columns). A k16 step moves the start address 16 rows = 2048 bytes.
#pragma once
#include "common.cuh"
#include "wgmma.cuh"

namespace cuflash {

// Byte offset of 16-byte chunk `chunk` (of 8 elements) of row `row` in a SW128 tile of `rows` rows.
__device__ __forceinline__ u32 sw128_offset(int row, int chunk, int rows) {
    return (u32)((chunk >> 3) * rows * 128 + row * 128 + (((chunk & 7) ^ (row & 7)) << 4));
}

// Shared-memory matrix descriptor, 128-byte swizzle.
__device__ __forceinline__ u64 make_smem_desc(u32 addr, u32 lbo_bytes, u32 sbo_bytes) {
    u64 d = (u64)((addr & 0x3FFFF) >> 4);
    d |= (u64)((lbo_bytes >> 4) & 0x3FFF) << 16;
    d |= (u64)((sbo_bytes >> 4) & 0x3FFF) << 32;
    d |= (u64)1 << 62;
    return d;
}

// The descriptor of the address `bytes` (a multiple of 16) past d's. Shared-window addresses are below
// 2^18, so the start-address field (bits 0-13: address / 16) takes bytes / 16 without carrying into
// the next field, and only the low word changes.
__device__ __forceinline__ u64 desc_plus(u64 d, u32 bytes) {
    u32 lo, hi;
    asm("mov.b64 {%0, %1}, %2;" : "=r"(lo), "=r"(hi) : "l"(d));
    lo += bytes >> 4;
    u64 r;
    asm("mov.b64 %0, {%1, %2};" : "=l"(r) : "r"(lo), "r"(hi));
    return r;
}

// Returns x through an opaque move. Descriptors built from the result are recomputed where they are
// used instead of being hoisted out of a loop and held in registers for its whole length (which
// costs two registers per descriptor and made the backward spill).
__device__ __forceinline__ u32 opaque(u32 x) {
    u32 y;
    asm volatile("mov.b32 %0, %1;" : "=r"(y) : "r"(x));
    return y;
}

// Shared-memory accesses through 32-bit shared-window addresses (a generic pointer costs two
// registers).
__device__ __forceinline__ float2 ld_shared_f32x2(u32 addr) {
    float2 v;
    asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "r"(addr));
    return v;
}
__device__ __forceinline__ void st_shared_u32(u32 addr, u32 v) {
    asm volatile("st.shared.b32 [%0], %1;" :: "r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ uint4 ld_shared_u128(u32 addr) {
    uint4 v;
    asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
    return v;
}

// The row sums of a register A operand on the tensor cores: acc (m64n8) += A x ones(16 x 8), one
// k16 step per fragment, so every column of acc holds the row sums (rows g, g + 8 in elements 0-1
// and 2-3, as wgmma.cuh's D layout). ones is a shared-memory block of ONES_BYTES bytes of 1.0 in T
// (fill_ones, then fence_proxy_async and a barrier before the first use); its descriptor is the
// unswizzled K-major layout (two 8 x 16-byte core matrices 128 bytes apart), which all-ones data
// satisfies whatever the order. Issue it with the P V product, in its commit group: it adds 8 /
// HEAD_DIM to that product's tensor work and nothing to the ALU's.
constexpr int ONES_BYTES = 256;
__device__ __forceinline__ u64 ones_desc(u32 addr) {
    return (u64)((addr & 0x3FFFF) >> 4) | ((u64)(128 >> 4) << 16) | ((u64)(256 >> 4) << 32);
}
template <typename T> __device__ __forceinline__ void fill_ones(u32 ones, int i, int nthreads) {
    for (int c = i; c < ONES_BYTES / 4; c += nthreads) st_shared_u32(ones + 4 * c, ElemOps<T>::ONES2);
}
// bytes (a multiple of 16) of 1.0 in T from ones on, by nthreads threads (this one number i).
template <typename T> __device__ __forceinline__ void fill_ones_bytes(u32 ones, int bytes, int i, int nthreads) {
    for (int c = i; c < bytes / 16; c += nthreads)
        asm volatile("st.shared.v4.b32 [%0], {%1, %1, %1, %1};" :: "r"(ones + 16 * c), "r"(ElemOps<T>::ONES2) : "memory");
}
// The ones of P V at head_dim 64 (flash_fwd_sm90.cu ONES_PV): 16 rows of a SW128 panel (2048 bytes,
// 1024-aligned) that an m64n72 MN-major product reads as its columns 64-71 (one 16-byte chunk a
// row: chunk r % 8 of row r), whatever V stage and k16 step it is on (wgmma_rs_mnmajor_ones). Bytes
// ONES_PV_BAR_OFFSET to + 32 of the first row are never read: the caller's mbarriers may live there,
// and fill_ones_pv leaves them alone.
constexpr int ONES_PV_BYTES = 2048, ONES_PV_BAR_OFFSET = 32;
template <typename T> __device__ __forceinline__ void fill_ones_pv(u32 ones, int i, int nthreads) {
    for (int c = i; c < ONES_PV_BYTES / 16; c += nthreads)
        if (c != ONES_PV_BAR_OFFSET / 16 && c != ONES_PV_BAR_OFFSET / 16 + 1)
            asm volatile("st.shared.v4.b32 [%0], {%1, %1, %1, %1};" :: "r"(ones + 16 * c), "r"(ElemOps<T>::ONES2) : "memory");
}
template <typename T, int K_STEPS>
__device__ __forceinline__ void wgmma_rs_rowsum(float (&acc)[4], const u32 (&a)[K_STEPS][4], u32 ones) {
#pragma unroll
    for (int kk = 0; kk < K_STEPS; ++kk) Wgmma<T, 8>::template rs<0>(acc, a[kk], ones_desc(ones), 1);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N> __device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(N) : "memory");
}
// Ordinary shared-memory writes (st.shared, cp.async) become visible to wgmma's reads only after
// this fence in the writing thread, followed by a barrier.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// Keeps the compiler from moving reads or writes of accumulator registers across a wgmma issue or
// wait: each register is an in-out operand of an empty asm.
template <int N> __device__ __forceinline__ void fence_regs(float (&r)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i]) :: "memory");
}
template <int N> __device__ __forceinline__ void fence_regs(u32 (&r)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(r[i][e]) :: "memory");
}

// The two product shapes of the attention kernels, each a whole loop of k16 steps (T = element type,
// N = the instruction's n, Wgmma<T, N>):
//   acc = A B^T over K = K_DIM, A (64 rows at a_base, inside a tile of A_ROWS rows) and B (N rows, a
//       tile of B_ROWS rows) both K-major SW128 tiles: Q K^T, K Q^T, V dO^T;
//   acc += A B, A from registers (one fragment per k16 step), B an MN-major SW128 tile of B_ROWS
//       rows (= K) starting at b_base: P V, P^T dO, dS^T Q.
// Each step's descriptors are the first step's plus the byte offset / 16 in the start-address field
// (desc_plus), so a step costs one 32-bit add where make_smem_desc's mask and shift cost four.
// B_PANEL / B_GROUP: the bytes between B's 64-column panels and between its 8-row groups, and (MN-major)
// B_STEP between its k16 steps (16 rows); by default those of the SW128 panel layout above (B_ROWS *
// 128, 1024, 2048). The paged forward's layouts (flash_fwd_sm90_ws.cu ILV) keep a few rows' panels
// together: K interleaved (an 8-row group's panels side by side: B_PANEL 1024, B_GROUP 1024 x the
// panels), V group-major (a 16-row group's panels one after another: B_PANEL 2048, B_STEP the group's
// bytes).
template <typename T, int N, int K_DIM, int A_ROWS, int B_ROWS, int B_PANEL = B_ROWS * 128, int B_GROUP = 1024>
__device__ __forceinline__ void wgmma_ss_kmajor(float (&acc)[N / 2], u32 a_base, u32 b_base) {
    const u64 da = make_smem_desc(a_base, 16, 1024), db = make_smem_desc(b_base, 16, B_GROUP);
#pragma unroll
    for (int kk = 0; kk < K_DIM / 16; ++kk)
        Wgmma<T, N>::template ss<0, 0>(acc, desc_plus(da, (kk / 4) * A_ROWS * 128 + (kk % 4) * 32),
                                       desc_plus(db, (kk / 4) * B_PANEL + (kk % 4) * 32), kk > 0);
}
template <typename T, int N, int K_STEPS, int B_ROWS, int B_PANEL = B_ROWS * 128, int B_GROUP = 1024,
          int B_STEP = 2 * B_GROUP>
__device__ __forceinline__ void wgmma_rs_mnmajor(float (&acc)[N / 2], const u32 (&a)[K_STEPS][4], u32 b_base) {
    const u64 db = make_smem_desc(b_base, B_PANEL, B_GROUP);
#pragma unroll
    for (int kk = 0; kk < K_STEPS; ++kk) Wgmma<T, N>::template rs<1>(acc, a[kk], desc_plus(db, kk * B_STEP), 1);
}

// O (64 columns) and its row sums: acc[0..31] += P V, acc[32..35] += P x ones, one m64n72k16
// product a step. B is V's single SW128 panel (B_ROWS rows from b_base, MN-major) and, LBO bytes on,
// the next 64 columns: LBO = ones - (the step's start), so that every step's columns 64-71 are the
// same 16 rows of ones (fill_ones_pv) wherever the stage is. A step moves the start 2048 bytes on
// and LBO as much back: one add to the descriptor's low word (as desc_plus; ones lies past every V
// stage, so LBO stays positive).
template <typename T, int K_STEPS, int B_ROWS>
__device__ __forceinline__ void wgmma_rs_mnmajor_ones(float (&acc)[36], const u32 (&a)[K_STEPS][4], u32 b_base,
                                                      u32 ones) {
    static_assert(K_STEPS * 16 == B_ROWS, "one k16 step per 16 rows of V");
    const u64 db = make_smem_desc(b_base, ones - b_base, 1024);
    u32 lo, hi;
    asm("mov.b64 {%0, %1}, %2;" : "=r"(lo), "=r"(hi) : "l"(db));
#pragma unroll
    for (int kk = 0; kk < K_STEPS; ++kk) {
        constexpr u32 STEP = 16 * 128 / 16;  // 2048 bytes, in the 16-byte units of both fields
        const u32 lo_k = lo + (u32)kk * STEP - (((u32)kk * STEP) << 16);
        u64 d;
        asm("mov.b64 %0, {%1, %2};" : "=l"(d) : "r"(lo_k), "r"(hi));
        Wgmma<T, 72>::template rs<1>(acc, a[kk], d, 1);
    }
}

// Rows [row_from, ROWS) of a SW128 tile (all HEAD_DIM / 64 panels) set to zero by nthreads threads
// (this one is number i); the caller fences them for the async proxy. GROUP16 != 0: the group-major
// layout (16-row groups GROUP16 bytes apart, each group's panels 2048 bytes apart; wgmma_rs_mnmajor).
template <int HEAD_DIM, int ROWS, int GROUP16 = 0>
__device__ __forceinline__ void zero_rows_sw128(u32 tile, int row_from, int i, int nthreads) {
    constexpr int CHUNKS = HEAD_DIM / 8;
    for (int c = i; c < (ROWS - row_from) * CHUNKS; c += nthreads) {
        const int row = row_from + c / CHUNKS, chunk = c % CHUNKS;
        const u32 off = GROUP16 ? (u32)((row >> 4) * GROUP16 + (chunk >> 3) * 2048 + (row & 15) * 128 +
                                        (((chunk & 7) ^ (row & 7)) << 4))
                                : sw128_offset(row, chunk, ROWS);
        asm volatile("st.shared.v4.b32 [%0], {%1, %1, %1, %1};" :: "r"(tile + off), "r"(0u) : "memory");
    }
}

// cp.async copy of ROWS x COLS (16-bit) from global memory (row stride in elements) into a SW128
// tile at shared address s_base. Rows at or past valid_rows are zero-filled, and so are the columns
// at or past valid_cols (a multiple of 8: a call of a smaller head_dim on a larger kernel, pad-up).
template <int COLS, int ROWS, int THREADS, bool CHECK>
__device__ __forceinline__ void load_tile_sw128(u32 s_base, const u16* g, i64 row_stride, int valid_rows, int tid,
                                                int valid_cols = COLS) {
    constexpr int CHUNKS = COLS / 8;
    constexpr int RPP = THREADS / CHUNKS;  // rows per pass
    static_assert(COLS % 64 == 0 && THREADS % CHUNKS == 0, "SW128 tile split");
    const int chunk = tid % CHUNKS;  // fixed per thread
    const int row0 = tid / CHUNKS;
    const bool col_ok = chunk * 8 < valid_cols;
#pragma unroll
    for (int i = 0; i < (ROWS + RPP - 1) / RPP; ++i) {
        const int row = row0 + i * RPP;
        if (ROWS % RPP == 0 || row < ROWS) {
            const bool ok = (!CHECK || row < valid_rows) && col_ok;
            const u16* src = g + (ok ? row * row_stride : 0) + chunk * 8;  // (not read where !ok)
            cp_async_16(s_base + sw128_offset(row, chunk, ROWS), src, ok ? 16 : 0);
        }
    }
}

}  // namespace cuflash
