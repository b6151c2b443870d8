// decode_read_bw.cu: how fast can a decode-shaped kernel read a KV cache? (bench/dev/decode_read_bw.py)
//
// Algorithm: no attention, only the decode kernel's reads. Block (b, h) streams keys [0, seqlen) of
// kv head h of entry b from K and V, tile by tile, through a STAGES-deep ring in shared memory, and
// touches one element of each tile (so the copies cannot be dropped); the sum goes to sink[block].
//   read_cpasync: the decode kernel's copies (cuda_src/flash_decode.cu, LANE_ROWS): 128 threads; a
//                 thread keeps one 16-byte column chunk and walks rows tid / CHUNKS + 8 i of each
//                 BN-key tile; cp.async.cg with the L2::256B hint; tile it + STAGES - 1 issued after
//                 the barrier of tile it.
//   read_tma_rows: the same ring filled by the TMA unit, completing on the stage's mbarrier (every
//                 thread waits on it); SW128 maps (cuflash/_tma.py kv_map). With ROWS = BN and MODE 0
//                 ("read_tma"), lane 0 issues, per tile, one 4-D box {64 columns, BN rows, 1, 1} per
//                 64-column panel of K and of V. Otherwise boxes of ROWS rows, as the paged decode
//                 issues them (one box per 16-key group and panel: a group never straddles a page):
//                 lane g < BN / ROWS of warp 0 issues group g's boxes, after lane 0 armed the
//                 barrier. MODE 0: one 4-D box per
//                 panel. MODE 1 and 2: one 5-D box for both panels (the map sees head_dim as 2 x 64),
//                 half the boxes, the tile group-major: MODE 1 dims (64, seqlen, 2, heads_kv, batch),
//                 box {64, ROWS, 2, 1, 1}: [group][panel][ROWS rows][64] (strides not increasing);
//                 MODE 2 dims (64, 2, heads_kv, seqlen, batch), box {64, 2, 1, ROWS, 1}: [group][ROWS
//                 rows][panel][64] (increasing strides; the panels of a row interleave). Rows are
//                 consecutive (no page table): the question is what the box count costs.
//                 MODE 4 and 5: whole BN-row boxes as MODE 0, but block x starts its walk at tile rot
//                 and wraps (tile (it + rot) % n_tiles), rot = x * 37 % n_tiles (MODE 4) or a hash
//                 of x (MODE 5): the blocks that run at once read different key offsets, not the same
//                 ones at power-of-two distances (does a contiguous cache's regular layout cost what
//                 random 64-row pages gained in session 63: 1836 against 1846 us?).
//   read_tma_persist: a persistent reader (gridDim.x blocks, a few per SM): block x streams items x,
//                 x + gridDim.x, ... (item = b * heads_kv + h) as one sequence of BN-key tiles through
//                 its ring, so the ring never drains between items and no block starts after the first
//                 wave (what a grid of many short blocks pays at each block's start and end).
//   read_tma_dyn: a persistent reader that takes its next item from a global counter (block x first
//                 reads item x, then gridDim.x + atomicAdd(counter, 1), ..., each fetched as the item
//                 before it starts): the ring never drains between
//                 items, as in read_tma_persist, and the items read at once stay consecutive, as the
//                 hardware's block scheduler keeps them (read_tma_persist's fixed strides let its blocks
//                 drift apart). The last block to finish sets the counters back to 0.
//   read_tma_tail: a block an item as read_tma<BN, STAGES>, except the last tail_items items, each read
//                 by tail_splits blocks of equal key ranges (grid items - tail_items + tail_items *
//                 tail_splits): the blocks the scheduler places last are shorter, so that the grid's end,
//                 where too few blocks remain to keep the memory busy, is shorter (issue 13's many-wave
//                 decodes; what the split tail of the forward does for its last wave).
//   read_tma_heads: block (b, h0) streams HEADS adjacent kv heads h0.. at once: one 4-D box {64, BN,
//                 HEADS, 1} per panel of K and of V, so each key row's bytes of the HEADS heads (adjacent
//                 in memory) arrive together ([head][row][64] per panel); grid batch * heads_kv / HEADS.
//   read_tma_heads_split: read_tma_heads with each block's keys one of tail_splits equal ranges; grid
//                 batch * heads_kv / HEADS * tail_splits, block = (b * groups + g) * splits + s (so
//                 that HEADS heads a block still make as many blocks as one head a block does).
//   read_tma_stamp: read_tma_rows<BN, STAGES, BN, 0>'s walk (a kv head a block) through ring_loop's order,
//                 thread 0 writing the block's SM, and %globaltimer at its start, when half its tiles have
//                 landed and at its end, to stamps (where each block runs, and when it ends).
// Layout: K, V (batch, seqlen, heads_kv, 128) 16-bit, element strides (batch_stride, row_stride,
// 128, 1). Grid: 1-D, block = b * heads_kv + h; 128 threads.
#include "common.cuh"
#include "tma.cuh"

namespace cuflash {

struct ReadBwParams {
    TmaDesc kmap;  // offset 0
    TmaDesc vmap;  // offset 128
    const u16* k;
    const u16* v;
    float* sink;
    i64 batch_stride;
    i64 row_stride;
    int seqlen;
    int heads_kv;
    const int* table;  // MODE 3: (batch, seqlen / 16) 16-row pages of (num_blocks, 16, heads_kv, 128)
    int items;         // read_tma_persist / read_tma_dyn: batch * heads_kv
    int* counter;      // read_tma_dyn: [0, 1] zero before a launch and after it; [2] += the tiles read
    int tail_items;    // read_tma_tail: the last tail_items items, each read in tail_splits blocks
    int tail_splits;
    unsigned long long* stamps;  // read_tma_stamp: 4 a block (SM id, start, half the tiles landed, end; ns)
};

constexpr int RB_D = 128;
constexpr int RB_PITCH = RB_D + 8;

template <int BN, int STAGES>
__global__ void __launch_bounds__(128) read_cpasync(const __grid_constant__ ReadBwParams p) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    u16* sK = reinterpret_cast<u16*>(smem_raw);
    u16* sV = sK + STAGES * BN * RB_PITCH;
    const int tid = threadIdx.x;
    const int b = blockIdx.x / p.heads_kv, h = blockIdx.x % p.heads_kv;
    constexpr int CHUNKS = RB_D / 8, RPP = 128 / CHUNKS, PASSES = BN / RPP;
    const int my_row = tid / CHUNKS, my_col = (tid % CHUNKS) * 8;
    const u16* gK = p.k + b * p.batch_stride + h * RB_D + my_col + my_row * p.row_stride;
    const u16* gV = p.v + b * p.batch_stride + h * RB_D + my_col + my_row * p.row_stride;
    const u32 dK0 = smem_addr(sK + my_row * RB_PITCH + my_col), dV0 = smem_addr(sV + my_row * RB_PITCH + my_col);
    const int n_tiles = p.seqlen / BN;
    auto load = [&](int it) {
        const int st = it % STAGES;
        const u16* k = gK + (i64)it * BN * p.row_stride;
        const u16* v = gV + (i64)it * BN * p.row_stride;
#pragma unroll
        for (int i = 0; i < PASSES; ++i) {
            cp_async_16_l2<256>(dK0 + 2u * (st * BN * RB_PITCH + i * RPP * RB_PITCH), k, 16);
            cp_async_16_l2<256>(dV0 + 2u * (st * BN * RB_PITCH + i * RPP * RB_PITCH), v, 16);
            k += RPP * p.row_stride;
            v += RPP * p.row_stride;
        }
    };
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < n_tiles) load(s);
        cp_async_commit();
    }
    float acc = 0.f;
    for (int it = 0; it < n_tiles; ++it) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();
        if (it + STAGES - 1 < n_tiles) load(it + STAGES - 1);
        cp_async_commit();
        const int st = it % STAGES;
        acc += (float)sK[st * BN * RB_PITCH + (tid % BN) * RB_PITCH + tid % 64]
             + (float)sV[st * BN * RB_PITCH + (tid % BN) * RB_PITCH + tid % 64];
    }
    cp_async_wait<0>();
    if (tid == 0) p.sink[blockIdx.x] = acc;
}

// The TMA readers' start: the maps prefetched and the stages' barriers made, by thread 0, then a block barrier.
template <int STAGES>
__device__ __forceinline__ void init_ring(const ReadBwParams& p, unsigned long long* bars) {
    if (threadIdx.x == 0) {
        tma_prefetch_desc(&p.kmap);
        tma_prefetch_desc(&p.vmap);
        for (int s = 0; s < STAGES; ++s) mbar_init(smem_addr(&bars[s]), 1);
        fence_mbar_init();
    }
    __syncthreads();
}

template <int BN, int STAGES, int ROWS, int MODE>
__global__ void __launch_bounds__(128) read_tma_rows(const __grid_constant__ ReadBwParams p) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    __shared__ alignas(8) unsigned long long bars[STAGES];
    constexpr int GROUPS = BN / ROWS;
    static_assert(GROUPS <= 32 && BN % ROWS == 0, "a lane per group");
    static_assert(ROWS * 128 % 1024 == 0, "SW128 panels of whole 8-row atoms");
    constexpr u32 PANEL = BN * 128;
    constexpr u32 TILE = 2 * PANEL;
    constexpr u32 STAGE_BYTES = 2 * TILE;
    const u32 base = (smem_addr(smem_raw) + 1023u) & ~1023u;
    const int tid = threadIdx.x, lane = tid % 32;
    const int b = blockIdx.x / p.heads_kv, h = blockIdx.x % p.heads_kv;
    const int n_tiles = p.seqlen / BN;
    init_ring<STAGES>(p, bars);
    auto load = [&](int it) {  // by warp 0
        const int st = it % STAGES;
        const u32 bar = smem_addr(&bars[st]);
        const u32 dst = base + st * STAGE_BYTES;
        if (lane == 0) mbar_arrive_expect_tx(bar, STAGE_BYTES);
        __syncwarp();
        if (lane < GROUPS) {
            const int row = it * BN + lane * ROWS;
            if constexpr (MODE == 1) {
                const u32 off = lane * ROWS * 256;
                tma_load_5d(dst + off, &p.kmap, bar, 0, row, 0, h, b);
                tma_load_5d(dst + TILE + off, &p.vmap, bar, 0, row, 0, h, b);
            } else if constexpr (MODE == 2) {
                const u32 off = lane * ROWS * 256;
                tma_load_5d(dst + off, &p.kmap, bar, 0, 0, h, row, b);
                tma_load_5d(dst + TILE + off, &p.vmap, bar, 0, 0, h, row, b);
            } else if constexpr (MODE == 3) {  // 16-row pages through the table, one box per panel
                static_assert(ROWS == 16, "a box per page");
                const u32 off = lane * ROWS * 128;
                const int blk = p.table[b * (p.seqlen / 16) + row / 16];
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    tma_load_4d(dst + c * PANEL + off, &p.kmap, bar, 64 * c, 0, h, blk);
                    tma_load_4d(dst + TILE + c * PANEL + off, &p.vmap, bar, 64 * c, 0, h, blk);
                }
            } else if constexpr (MODE == 4 || MODE == 5) {
                static_assert(ROWS == BN, "whole tiles");
                const u32 x = blockIdx.x;
                const u32 rot = MODE == 4 ? x * 37u % n_tiles : ((x * 2654435761u) >> 9) % n_tiles;
                const int r = (int)((it + rot) % n_tiles) * BN;
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    tma_load_4d(dst + c * PANEL, &p.kmap, bar, 64 * c, r, h, b);
                    tma_load_4d(dst + TILE + c * PANEL, &p.vmap, bar, 64 * c, r, h, b);
                }
            } else {
                const u32 off = lane * ROWS * 128;
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    tma_load_4d(dst + c * PANEL + off, &p.kmap, bar, 64 * c, row, h, b);
                    tma_load_4d(dst + TILE + c * PANEL + off, &p.vmap, bar, 64 * c, row, h, b);
                }
            }
        }
    };
    if (tid < 32)
        for (int s = 0; s < STAGES - 1 && s < n_tiles; ++s) load(s);
    float acc = 0.f;
    for (int it = 0; it < n_tiles; ++it) {
        __syncthreads();
        if (tid < 32 && it + STAGES - 1 < n_tiles) load(it + STAGES - 1);
        const int st = it % STAGES;
        mbar_wait(smem_addr(&bars[st]), (it / STAGES) & 1);
        u32 x;
        asm volatile("ld.shared.b32 %0, [%1];" : "=r"(x) : "r"(base + st * STAGE_BYTES + 4 * (tid * 33 % (STAGE_BYTES / 4))));
        acc += __uint_as_float(x);
    }
    if (tid == 0) p.sink[blockIdx.x] = acc;
}

// The loop of the readers whose thread 0 issues: tile j + STAGES - 1 issued (load), tile j waited for and one
// word of it read by each thread; returns the sum of those words.
template <int STAGES, u32 STAGE_BYTES, class Load>
__device__ __forceinline__ float ring_loop(u32 base, unsigned long long* bars, int total, Load load) {
    const int tid = threadIdx.x;
    if (tid == 0)
        for (int s = 0; s < STAGES - 1 && s < total; ++s) load(s);
    float acc = 0.f;
    for (int j = 0; j < total; ++j) {
        __syncthreads();
        if (tid == 0 && j + STAGES - 1 < total) load(j + STAGES - 1);
        const int st = j % STAGES;
        mbar_wait(smem_addr(&bars[st]), (j / STAGES) & 1);
        u32 x;
        asm volatile("ld.shared.b32 %0, [%1];" : "=r"(x) : "r"(base + st * STAGE_BYTES + 4 * (tid * 33 % (STAGE_BYTES / 4))));
        acc += __uint_as_float(x);
    }
    return acc;
}

// One whole BN-key tile of item (b, h) from key row `row`, K then V, into stage st of the ring at base
// (by one thread; the stage's barrier armed for its bytes): the persistent and stream-K readers' load.
template <int BN, int STAGES>
__device__ __forceinline__ void load_whole_tile(const ReadBwParams& p, unsigned long long* bars, u32 base, int st,
                                                int b, int h, int row) {
    constexpr u32 PANEL = BN * 128;
    constexpr u32 TILE = 2 * PANEL;
    const u32 bar = smem_addr(&bars[st]);
    const u32 dst = base + st * 2 * TILE;
    mbar_arrive_expect_tx(bar, 2 * TILE);
#pragma unroll
    for (int c = 0; c < 2; ++c) {
        tma_load_4d(dst + c * PANEL, &p.kmap, bar, 64 * c, row, h, b);
        tma_load_4d(dst + TILE + c * PANEL, &p.vmap, bar, 64 * c, row, h, b);
    }
}

template <int BN, int STAGES>
__global__ void __launch_bounds__(128) read_tma_persist(const __grid_constant__ ReadBwParams p) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    __shared__ alignas(8) unsigned long long bars[STAGES];
    constexpr u32 STAGE_BYTES = 4 * BN * 128;  // K and V, two 64-column panels each
    const u32 base = (smem_addr(smem_raw) + 1023u) & ~1023u;
    const int tid = threadIdx.x;
    const int n_tiles = p.seqlen / BN;
    const int my_items = (p.items - (int)blockIdx.x + (int)gridDim.x - 1) / (int)gridDim.x;
    const int total = my_items * n_tiles;
    init_ring<STAGES>(p, bars);
    auto load = [&](int j) {  // by thread 0: tile j of this block's sequence
        const int item = (int)blockIdx.x + (j / n_tiles) * (int)gridDim.x;
        load_whole_tile<BN, STAGES>(p, bars, base, j % STAGES, item / p.heads_kv, item % p.heads_kv, (j % n_tiles) * BN);
    };
    const float acc = ring_loop<STAGES, STAGE_BYTES>(base, bars, total, load);
    if (tid == 0) p.sink[blockIdx.x] = acc;
}

template <int BN, int STAGES>
__global__ void __launch_bounds__(128) read_tma_dyn(const __grid_constant__ ReadBwParams p) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    __shared__ alignas(8) unsigned long long bars[STAGES];
    __shared__ int stage_item[STAGES];  // the item of the tile in each stage; -1: the end
    constexpr u32 STAGE_BYTES = 4 * BN * 128;  // K and V, two 64-column panels each
    const u32 base = (smem_addr(smem_raw) + 1023u) & ~1023u;
    const int tid = threadIdx.x;
    const int n_tiles = p.seqlen / BN;
    init_ring<STAGES>(p, bars);
    // Work units: unit u is part u / items of item u % items (tail_splits parts an item, each n_tiles /
    // parts tiles; the parts of all items in turn, so that the blocks running at once read the same
    // key offsets). Thread 0's: the next tile to issue, and the unit after this one, fetched as this
    // one's first tile is issued (the atomic's latency off the issue path).
    const int parts = p.tail_splits, per = n_tiles / parts, units = p.items * parts;
    int unit = blockIdx.x, tile = 0, next = 0;
    auto issue = [&](int j) {  // by thread 0: the next tile into stage j % STAGES, or the end mark
        const int st = j % STAGES;
        if (unit < units) {
            if (tile == 0) next = (int)gridDim.x + atomicAdd(p.counter, 1);
            const int item = unit % p.items, part = unit / p.items;
            stage_item[st] = item;
            load_whole_tile<BN, STAGES>(p, bars, base, st, item / p.heads_kv, item % p.heads_kv, (part * per + tile) * BN);
            if (++tile == per) {
                tile = 0;
                unit = next;
            }
        } else {
            stage_item[st] = -1;
            mbar_arrive(smem_addr(&bars[st]));
        }
    };
    bool ended = false;  // thread 0's: the end mark issued
    if (tid == 0)
        for (int s = 0; s < STAGES - 1 && !ended; ++s) {
            ended = unit >= units;
            issue(s);
        }
    float acc = 0.f;
    int j = 0;
    for (;; ++j) {
        __syncthreads();
        if (tid == 0 && !ended) {
            ended = unit >= units;
            issue(j + STAGES - 1);
        }
        const int st = j % STAGES;
        mbar_wait(smem_addr(&bars[st]), (j / STAGES) & 1);
        if (stage_item[st] < 0) break;
        u32 x;
        asm volatile("ld.shared.b32 %0, [%1];" : "=r"(x) : "r"(base + st * STAGE_BYTES + 4 * (tid * 33 % (STAGE_BYTES / 4))));
        acc += __uint_as_float(x);
    }
    if (tid == 0) {
        p.sink[blockIdx.x] = acc;
        atomicAdd(p.counter + 2, j);  // (the check: every item's tiles read once in all)
        if (atomicAdd(p.counter + 1, 1) == (int)gridDim.x - 1) {  // the last block: every fetch is done
            p.counter[0] = 0;
            p.counter[1] = 0;
        }
    }
}

// read_tma_streamk: the items' tiles as one sequence (item-major, item = b * heads_kv + h), cut into
// gridDim.x equal ranges, block x streaming range x through its ring (crossing an item boundary where its
// range does): every SM gets the same number of tiles whatever the item count (128 items on 132 SMs:
// 124-125 tiles each instead of 128 on 128 SMs and 4 SMs idle).
template <int BN, int STAGES>
__global__ void __launch_bounds__(128) read_tma_streamk(const __grid_constant__ ReadBwParams p) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    __shared__ alignas(8) unsigned long long bars[STAGES];
    constexpr u32 STAGE_BYTES = 4 * BN * 128;  // K and V, two 64-column panels each
    const u32 base = (smem_addr(smem_raw) + 1023u) & ~1023u;
    const int tid = threadIdx.x;
    const int n_tiles = p.seqlen / BN;
    const i64 all = (i64)p.items * n_tiles;
    const int j0 = (int)(all * blockIdx.x / gridDim.x), j1 = (int)(all * (blockIdx.x + 1) / gridDim.x);
    init_ring<STAGES>(p, bars);
    auto load = [&](int j) {  // by thread 0: tile j0 + j of the sequence
        const int jj = j0 + j, item = jj / n_tiles;
        load_whole_tile<BN, STAGES>(p, bars, base, j % STAGES, item / p.heads_kv, item % p.heads_kv, (jj % n_tiles) * BN);
    };
    const float acc = ring_loop<STAGES, STAGE_BYTES>(base, bars, j1 - j0, load);
    if (tid == 0) p.sink[blockIdx.x] = acc;
}

template <int BN, int STAGES>
__global__ void __launch_bounds__(128) read_tma_tail(const __grid_constant__ ReadBwParams p) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    __shared__ alignas(8) unsigned long long bars[STAGES];
    constexpr u32 STAGE_BYTES = 4 * BN * 128;  // K and V, two 64-column panels each
    const u32 base = (smem_addr(smem_raw) + 1023u) & ~1023u;
    const int tid = threadIdx.x;
    const int n_tiles = p.seqlen / BN;
    const int whole = p.items - p.tail_items;
    int item = blockIdx.x, t0 = 0, t1 = n_tiles;
    if (item >= whole) {
        const int j = item - whole, s = j % p.tail_splits;
        item = whole + j / p.tail_splits;
        t0 = n_tiles * s / p.tail_splits;
        t1 = n_tiles * (s + 1) / p.tail_splits;
    }
    init_ring<STAGES>(p, bars);
    auto load = [&](int j) {  // by thread 0: tile t0 + j of the item
        load_whole_tile<BN, STAGES>(p, bars, base, j % STAGES, item / p.heads_kv, item % p.heads_kv, (t0 + j) * BN);
    };
    const float acc = ring_loop<STAGES, STAGE_BYTES>(base, bars, t1 - t0, load);
    if (tid == 0) p.sink[blockIdx.x] = acc;
}

// HEADS adjacent kv heads h0.. of batch entry b, tiles first .. first + count - 1 (read_tma_heads and
// read_tma_heads_split): one 4-D box {64, BN, HEADS, 1} per panel of K and of V a tile.
template <int BN, int STAGES, int HEADS>
__device__ __forceinline__ void heads_ring(const ReadBwParams& p, int b, int h0, int first, int count) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    __shared__ alignas(8) unsigned long long bars[STAGES];
    constexpr u32 PANEL = HEADS * BN * 128;
    constexpr u32 TILE = 2 * PANEL;
    constexpr u32 STAGE_BYTES = 2 * TILE;
    const u32 base = (smem_addr(smem_raw) + 1023u) & ~1023u;
    init_ring<STAGES>(p, bars);
    auto load = [&](int it) {  // by thread 0
        const int st = it % STAGES;
        const u32 bar = smem_addr(&bars[st]);
        const u32 dst = base + st * STAGE_BYTES;
        mbar_arrive_expect_tx(bar, STAGE_BYTES);
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            tma_load_4d(dst + c * PANEL, &p.kmap, bar, 64 * c, (first + it) * BN, h0, b);
            tma_load_4d(dst + TILE + c * PANEL, &p.vmap, bar, 64 * c, (first + it) * BN, h0, b);
        }
    };
    const float acc = ring_loop<STAGES, STAGE_BYTES>(base, bars, count, load);
    if (threadIdx.x == 0) p.sink[blockIdx.x] = acc;
}

template <int BN, int STAGES, int HEADS>
__global__ void __launch_bounds__(128) read_tma_heads(const __grid_constant__ ReadBwParams p) {
    const int groups = p.heads_kv / HEADS;
    heads_ring<BN, STAGES, HEADS>(p, blockIdx.x / groups, blockIdx.x % groups * HEADS, 0, p.seqlen / BN);
}

template <int BN, int STAGES, int HEADS>
__global__ void __launch_bounds__(128) read_tma_heads_split(const __grid_constant__ ReadBwParams p) {
    const int groups = p.heads_kv / HEADS, splits = p.tail_splits;
    const int s = blockIdx.x % splits, item = blockIdx.x / splits;
    const int per = p.seqlen / BN / splits;
    heads_ring<BN, STAGES, HEADS>(p, item / groups, item % groups * HEADS, s * per, per);
}

__device__ __forceinline__ unsigned long long global_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

template <int BN, int STAGES>
__global__ void __launch_bounds__(128) read_tma_stamp(const __grid_constant__ ReadBwParams p) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    __shared__ alignas(8) unsigned long long bars[STAGES];
    constexpr u32 STAGE_BYTES = 4 * BN * 128;
    const u32 base = (smem_addr(smem_raw) + 1023u) & ~1023u;
    const int tid = threadIdx.x;
    const unsigned long long t0 = global_ns();
    const int b = blockIdx.x / p.heads_kv, h = blockIdx.x % p.heads_kv;
    const int n_tiles = p.seqlen / BN;
    init_ring<STAGES>(p, bars);
    auto load = [&](int it) { load_whole_tile<BN, STAGES>(p, bars, base, it % STAGES, b, h, it * BN); };
    if (tid == 0)
        for (int s = 0; s < STAGES - 1 && s < n_tiles; ++s) load(s);
    float acc = 0.f;
    unsigned long long t_half = 0;
    for (int j = 0; j < n_tiles; ++j) {
        __syncthreads();
        if (tid == 0 && j + STAGES - 1 < n_tiles) load(j + STAGES - 1);
        const int st = j % STAGES;
        mbar_wait(smem_addr(&bars[st]), (j / STAGES) & 1);
        if (j == n_tiles / 2) t_half = global_ns();
        u32 x;
        asm volatile("ld.shared.b32 %0, [%1];" : "=r"(x) : "r"(base + st * STAGE_BYTES + 4 * (tid * 33 % (STAGE_BYTES / 4))));
        acc += __uint_as_float(x);
    }
    __syncthreads();
    if (tid == 0) {
        u32 sm;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
        unsigned long long* out = p.stamps + 4 * blockIdx.x;
        out[0] = sm;
        out[1] = t0;
        out[2] = t_half;
        out[3] = global_ns();
        p.sink[blockIdx.x] = acc;
    }
}

}  // namespace cuflash
