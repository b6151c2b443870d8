// flash_fwd_sm90_ws.cu: exact attention forward for Hopper (sm_90a), warp-specialized: one producer
// warpgroup loads with TMA, two consumer warpgroups compute on wgmma (docs/hopper_plan.md step 2).
//
// Algorithm: the online-softmax tiling of flash_fwd_sm90.cu, with the same products and the same
// overlap inside each consumer warpgroup (S_j = Q K_j^T is issued with O += P_(j-1) V_(j-1); the
// softmax of tile j runs while the P V product still runs). Each p takes one fma (softmax.cuh
// prepare_in_place). The online softmax is LAZY (softmax.cuh: a warp rescales O only where a row's max
// moved by more than LAZY_LOG2) without pingpong, and with it in the causal kernels of a block per query
// block; the other pingpong kernels rescale O at every tile (LAZY measured slower there). Nothing of
// size seqlen_q x seqlen_k ever reaches device memory.
//
// FEAT (the optional features of mask.cuh; padded and packed batches): as in flash_fwd_sm90.cu,
// the key tiles of key_tiles, masks on the tiles a bound crosses, log2-unit logits for softcap /
// ALiBi, a sink logit joining the softmax after the last tile; causal is the window's right bound.
// TMA reads whole tensors, so rows past a sequence's valid lengths arrive as they are in memory
// (where the cp.async kernels zero-fill them): their scores are masked, the V rows past the
// sequence's keys in the last tile (the only one that can reach past them) are zeroed in shared
// memory before their product (0 * NaN would be NaN), and the outputs of query rows past q_lengths
// are set to 0, not scaled by 0. A packed batch's maps describe its arrays as one sequence of all
// rows (batch 1); a block loads from its sequence's first row on and writes only its rows.
//
// Grid: one block per (batch, head, BLOCK_M = 64 CONSUMERS query rows), the 1-D mapping of
// blocks.cuh (longest causal blocks first; causal calls, and FEAT ones with a window (left, 0), in
// causal_block_order, whose last p.tail_heads heads go query block by query block); or (PERSISTENT,
// plain calls) one block per SM walking query blocks ("work tiles"), so that a block's setup
// (barriers, descriptors, the pipeline's fill) is paid once per SM rather than once per work tile,
// and the next tile's Q and first K / V copies run under the current tile's last products and
// epilogue. Work tile order (persistent_tile): non-causal, round k's gridDim.x tiles in the order of
// a grid of one block per tile (consecutive query blocks of a few heads, whose K / V stay in L2);
// causal, pairs of a head's longest and shortest remaining query blocks (the same work a pair), the
// pairs in turn to the blocks, head by head (the host takes this grid for an even count of query
// blocks a head only); or, where the host gives p.sched, each block's own list of work tiles
// (cuflash/_schedule.py: those pairs for most heads, then the last heads' query blocks one by one,
// the longest first, each to the least loaded block, so that the grid's blocks end together).
// Non-causal on a list (SPLIT kernels): the whole waves in the order above, then the last wave's work
// tiles cut into parts of split_chunk key tiles, each part a work tile of its own on some block; a
// part's warps leave their rows' O and lse in a workspace, and the warp that comes last on its counter
// merges the parts and writes the rows (fwd_sm90_steps.cuh split_part_merge), so that the grid's
// blocks end together where the last wave would have run on part of the GPU.
// CONSUMERS = 2 (384 threads) or 3 (512 threads, at head_dim 64, as FlashAttention-3 does there: the
// K / V tiles serve 192 rows), one producer warpgroup:
//   producer  (warpgroup 0): gives registers back (setmaxnreg.dec 24; 40 in SPLIT kernels, whose
//             consumers take 232); one thread issues every TMA
//             copy: Q once, then K_j and V_j for j = 0 .. n_blocks - 1, into STAGES-deep rings;
//   consumers (warpgroups 1 .. CONSUMERS): take registers (setmaxnreg.inc 240 with two, 160 with
//             three); consumer c owns query rows
//             [64 c, 64 c + 64) of the block and runs the loop of flash_fwd_sm90.cu on them, with no
//             block-wide barrier: each waits for its tiles on mbarriers and releases them on others.
//
// Barrier protocol (mbarriers in shared memory after the V ring; "wait(b, n)" = wait until phase n of
// b has completed, i.e. parity n % 2):
//   q_full          count 1: the producer's expect_tx arrival; Q's bytes complete it (phase 0 only).
//   k_full[s]       count 1: the producer arms it with a K tile's bytes before the copies.
//   v_full[s]       count 1: likewise for V.
//   k_empty[s]      count 4 CONSUMERS: lane 0 of each consumer warp arrives once its wgmma that read
//                   the K tile of stage s has retired (after wgmma_wait<1> in iteration j).
//   v_empty[s]      count 4 CONSUMERS: likewise after the P V product that read stage s (wgmma_wait<0>).
//   (Three consumers: a consumer whose rows need fewer of the block's key tiles (rows past seqlen_q, or
//   causal rows that see fewer keys: TRIM in the kernel) arrives for each tile it does not read once
//   that tile's full barrier has completed, so every phase still counts all 4 CONSUMERS warps.)
// K_j and V_j go to stage s = j % STAGES. Iteration j of a consumer reads K_j and, from j = 1 on,
// V_(j-1), whose stage is (j - 1) mod STAGES; iteration 0 issues no P V product (there is no previous
// tile), and the final product after the loop reads V_(n-1). So each V stage is used (and released)
// once per fill, and the producer, before its u-th load into a stage (u counting from 0), waits for
// phase u - 1 of that stage's empty barrier. The producer runs at most STAGES tiles ahead; a
// consumer's wait on a full barrier for tile j is phase j / STAGES.
// PERSISTENT: j counts the block's key tiles over all its work tiles (the rings run on across them),
// and u its work tiles; a work tile's last V stage is released after its final
// product. Q is double-buffered: work tile u uses sQ[u % 2] and q_full[u % 2] (phase u / 2); one
// more pair of barriers:
//   q_empty[b]      count 4 CONSUMERS: lane 0 of each consumer warp once its epilogue has read its
//                   rows of O back out of sQ[b]; before Q of work tile u the producer waits for phase
//                   u / 2 - 1 of q_empty[u % 2] (from u = 2 on), so Q of tile u + 1 lands while tile
//                   u computes.
//
// Pingpong (template flag PINGPONG; docs/hopper_plan.md step 3): the two consumers take turns at the
// tensor cores, so that one's softmax runs while the other's products do. Named barrier 3 + c is
// consumer c's turn (256 threads: its own 128 wait with bar.sync, the other's 128 arrive with
// bar.arrive). Before issuing its products of a tile (S_j with P V, or the final P V) a consumer
// waits for its turn; right after issuing them it opens the other's. Consumer 1 opens consumer 0's
// first turn before the loop, and does not open a turn after its own final product, so each barrier
// sees as many arrivals as waits (n_blocks + 1 each); a block with no key tile uses none. PERSISTENT:
// consumer 1 opens consumer 0's first turn once, before the block's first products, and its final
// product of each work tile opens consumer 0's turn in the next (one arrival is left unmatched when
// the block exits), so the turns alternate across work tiles.
//
// PAGED (FEAT kernels; cuflash/_launch.py PagedKV): K and V are paged caches (num_pages, page_size,
// nheads_kv, head_dim), key t of entry (or packed sequence) b at row t % page_size of page
// block_table[b, t / page_size], the column and the page clamped into the table and the cache; a packed
// batch's key lengths come from cu_seqlens_k's differences alone (mask.cuh seq_info<PAGED_KEYS>). The
// maps describe the pages, with boxes of page_box = gcd(page_size, BLOCK_N) rows: the producer's whole
// first warp runs its loop, lane g looking up the page of the tile's g-th box (before the stage's empty
// barrier is waited for) and copying that box into its rows of each panel; lane 0 arms the barriers and
// loads Q. The producer and consumers then split the registers as the SPLIT kernels do (40 / 232).
// ILV (PAGED, head_dim 128 or 256; the host takes it for boxes of 16 rows on pages that follow one another
// in memory, cuflash/_launch.py paged_interleaved): a copy a 16-row box for all of the row's panels, not one
// a panel. K goes interleaved (each 8-row group's panels side by side, 1024 bytes apart: K's map counts
// 8-row groups across the pages, a box {64, 8, panels, 2}), so that the S product still steps its 8-row
// groups at one stride; V goes group-major (each 16-row group's panels one after another, then at 128 a panel of
// ones: a box {64, 16, panels} of one page), so that P V stays one m64n(HEAD_DIM + 8) product whose last 8
// columns read that group's ones. The stages keep their sizes.
//
// Shared memory: sQ[1, or 2 PERSISTENT] (BLOCK_M x HEAD_DIM), sK[STAGES], sV[STAGES] (BLOCK_N x
// HEAD_DIM), all SW128 panels (wgmma_util.cuh) filled by TMA (tma.cuh; box {64 columns, rows}: one
// copy per panel, rows past the tensor's end as zeros), then the barriers. Up to head_dim 128
// (ONES_PV) each V stage is followed by one more panel, of ones, written once at the start: P V is
// then one m64n(HEAD_DIM + 8) product whose last 8 columns are P x ones, the row sums of the rounded
// P (lp, softmax.cuh LP_TENSOR), rescaled with O; the 8 columns it reads past V's are ones whatever
// the swizzle, since the whole panel is. Each consumer writes its O rows out through its own rows of
// sQ. Causal alignment, the empty-row convention, FwdParams and the grid mapping are those of
// flash_fwd.cu.
#include "blocks.cuh"
#include "common.cuh"
#include "fwd_sm90_steps.cuh"
#include "params.cuh"
#include "softmax.cuh"
#include "tma.cuh"
#include "wgmma.cuh"
#include "wgmma_util.cuh"

namespace cuflash {

// FwdParams, then the tensor maps of Q (box rows 128), K and V (box rows BLOCK_N). Must match
// cuflash/_launch.py FWD_WS_PARAMS.
struct FwdWsParams : FwdParams {
    int d_cols;  // the call's head_dim: O's columns to write (below HEAD_DIM under pad-up)
    // SPLIT (persistent, non-causal) with a list: work tiles from split_first on are cut into split_parts
    // ranges of split_chunk key tiles (the last one the rest; a list entry: tile | (part + 1) << 24),
    // merged through split_ws (fwd_sm90_steps.cuh split_part_merge); split_parts 0: none.
    int split_first;
    int split_parts;
    int split_chunk;
    // PAGED: K and V are paged caches (num_pages, page_size, nheads_kv, head_dim), and key t of batch entry
    // (or packed sequence) b is row t % page_size of page block_table[b * table_stride + t / page_size]
    // (the index clamped to [0, table_cols), the page to [0, num_pages)); the maps' boxes are page_box
    // rows (a divisor of page_size and BLOCK_N: cuflash/_launch.py paged_box_rows).
    int page_size;
    int page_box;
    int table_stride;
    int table_cols;
    int num_pages;
    // PERSISTENT: the blocks' work lists (cuflash/_schedule.py), row k holding each block's k-th work
    // tile (-1 past a block's last); nullptr: persistent_tile's order.
    const int* sched;
    float* split_ws;
    const int* block_table;  // PAGED
    TmaDesc map_q;
    TmaDesc map_k;
    TmaDesc map_v;
};

template <int HEAD_DIM, int BLOCK_N, int STAGES, int CONSUMERS = 2, bool PERSISTENT = false>
struct FwdWsTraits {
    static constexpr int BLOCK_M = 64 * CONSUMERS;
    static constexpr int THREADS = 128 * (1 + CONSUMERS);
    static constexpr int N_TILES = BLOCK_N / 8;
    static constexpr int D_TILES = HEAD_DIM / 8;
    static constexpr int SQ_BYTES = BLOCK_M * HEAD_DIM * 2;
    static constexpr int SKV_BYTES = BLOCK_N * HEAD_DIM * 2;
    // ONES_PV (the row sum lp on the tensor cores, head_dim <= 128: fwd_sm90_lp): each V stage is
    // followed by a panel of ones, so that P V as one m64n(HEAD_DIM + 8) product also yields P x ones.
    static constexpr bool ONES_PV = HEAD_DIM <= 128;
    static constexpr int ONES_PANEL_BYTES = ONES_PV ? BLOCK_N * 128 : 0;
    static constexpr int SV_BYTES = SKV_BYTES + ONES_PANEL_BYTES;
    static constexpr int PV_N = HEAD_DIM + (ONES_PV ? 8 : 0);
    static constexpr int QBUF = PERSISTENT ? 2 : 1;  // Q buffers
    static constexpr int BAR_BYTES = 8 * (QBUF + 4 * STAGES + (PERSISTENT ? 2 : 0));
    // sQ[QBUF], sK[STAGES], sV[STAGES] (each with its ones panel), the barriers, plus 1024 bytes to
    // align the start to 1024. Must equal cuflash/_config.py:fwd_ws_smem_bytes.
    static constexpr int SMEM_BYTES = QBUF * SQ_BYTES + STAGES * (SKV_BYTES + SV_BYTES) + BAR_BYTES + 1024;
    // The register file (64K) split: 24 a producer thread, the rest among the consumers' (a
    // multiple of 8): 240 with two consumers, 160 with three.
    static constexpr int PRODUCER_REGS = 24;
    static constexpr int CONSUMER_REGS = CONSUMERS == 2 ? 240 : 160;
    // SPLIT_* (SPLIT kernels, whose producer also takes a split tile's range of key tiles; PAGED ones too):
    // 40 and 232 with two consumers, the same total ((168 - 40) 128 = (232 - 168) 256); at 24 the
    // producer spilled 4 bytes (one barrier address). The consumers' loops fit 232 as well.
    static constexpr int SPLIT_PRODUCER_REGS = CONSUMERS == 2 ? 40 : PRODUCER_REGS;
    static constexpr int SPLIT_CONSUMER_REGS = CONSUMERS == 2 ? 232 : CONSUMER_REGS;

    static_assert(CONSUMERS == 2 || CONSUMERS == 3, "two or three consumer warpgroups");
    static_assert(HEAD_DIM % 64 == 0 && HEAD_DIM <= 256, "head_dim: a multiple of 64 up to 256");
    static_assert(BLOCK_N % 16 == 0 && BLOCK_N <= 256 && STAGES >= 2, "tile shape");
};

template <typename T, int HEAD_DIM, int BLOCK_N, int STAGES, bool IS_CAUSAL, bool IS_EVEN, bool PINGPONG = false,
          int CONSUMERS = 2, bool FEAT = false, bool PERSISTENT = false, bool SPLIT = false, bool PAGED = false,
          bool ILV = false>
__global__ void __launch_bounds__(128 * (1 + CONSUMERS), 1)
flash_fwd_sm90_ws_kernel(const __grid_constant__ FwdWsParams p) {
    using Tr = FwdWsTraits<HEAD_DIM, BLOCK_N, STAGES, CONSUMERS, PERSISTENT>;
    static_assert(!PINGPONG || CONSUMERS == 2, "pingpong alternates two consumers");
    static_assert(!(PERSISTENT && FEAT), "persistent: plain calls");
    using Ops = ElemOps<T>;
    constexpr int BLOCK_M = Tr::BLOCK_M, N_TILES = Tr::N_TILES;
    constexpr int PV_STEPS = BLOCK_N / 16;
    static_assert(!SPLIT || (PERSISTENT && !IS_CAUSAL), "split tiles: the persistent non-causal grid's");
    static_assert(!PAGED || FEAT, "paged caches: the feature kernels (their lengths bound each sequence's keys)");
    static_assert(!ILV || (PAGED && HEAD_DIM >= 128), "the paged layouts of whole rows: two or more panels");
    // The K / V stages' layouts (wgmma_util.cuh): SW128 panels, panel after panel; or (ILV) K interleaved,
    // each 8-row group's panels side by side (as a TMA box of whole rows over 8-row groups lays them out:
    // K_PANEL bytes between panels, K_GROUP between 8-row groups), and V group-major, each 16-row group's
    // panels one after another and (ONES_PV) a panel of ones after them (a 5-D box of 16 rows and every
    // panel: V_PANEL bytes between panels, V_STEP between 16-row groups), so that P V is still one
    // m64n(HEAD_DIM + 8) product whose last 8 columns read ones. A V stage keeps its bytes: 16-row groups
    // of (HEAD_DIM / 64 + 1) x 2048 bytes are SKV_BYTES + ONES_PANEL_BYTES.
    constexpr int K_PANEL = ILV ? 1024 : BLOCK_N * 128;
    constexpr int K_GROUP = ILV ? HEAD_DIM * 16 : 1024;
    constexpr int V_PANEL = ILV ? 2048 : BLOCK_N * 128;
    constexpr int V_STEP = ILV ? (HEAD_DIM / 64 + (Tr::ONES_PV ? 1 : 0)) * 2048 : 2048;
    static_assert(!ILV || (BLOCK_N / 16) * V_STEP == Tr::SV_BYTES, "the group-major V stage");
    // Each consumer visits only its own rows' key tiles (below, at n_mine): the three-consumer kernels
    // (head_dim 64) of a block per query block, without FEAT (whose tiles and rows come from the options'
    // masks). (Pingpong pairs two consumers' products tile by tile. At head_dim 256, two consumers
    // without pingpong, it read 0.98-1.08x the time at 2k-16k keys, bf16 and fp16, by how ptxas laid out
    // the loops: H200, session 57.)
    constexpr bool TRIM = CONSUMERS == 3 && !PERSISTENT && !FEAT;

    extern __shared__ __align__(1024) unsigned char smem_raw[];
    constexpr int LP = fwd_sm90_lp<HEAD_DIM>();  // where the sum of the rounded P comes from
    static_assert(Tr::ONES_PV == (LP == LP_TENSOR), "lp on the tensor cores: the ones panel after V");
    unsigned char* sQ_ptr;
    const u32 sQ = smem_aligned_1024(smem_raw, sQ_ptr);
    constexpr int QB = Tr::QBUF;
    const u32 sK = sQ + QB * Tr::SQ_BYTES;
    const u32 sV = sK + STAGES * Tr::SKV_BYTES;
    const u32 s_bar = sV + STAGES * Tr::SV_BYTES;
    auto bar_q = [&](int b) { return s_bar + 8u * (u32)b; };
    auto k_full = [&](int s) { return s_bar + 8u * (u32)(QB + s); };
    auto v_full = [&](int s) { return s_bar + 8u * (u32)(QB + STAGES + s); };
    auto k_empty = [&](int s) { return s_bar + 8u * (u32)(QB + 2 * STAGES + s); };
    auto v_empty = [&](int s) { return s_bar + 8u * (u32)(QB + 3 * STAGES + s); };
    auto q_empty = [&](int b) { return s_bar + 8u * (u32)(QB + 4 * STAGES + b); };  // PERSISTENT only

    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int g = lane / 4, t = lane % 4;
    if (tid == 0 && dynamic_smem_bytes() < (u32)Tr::SMEM_BYTES) __trap();

    static_assert(!FEAT || (!IS_CAUSAL && !IS_EVEN), "FEAT: causal and the tails are the mask's");
    const int sq = p.seqlen_q, sk = p.seqlen_k;
    // The block's work tiles: its own query block, or (PERSISTENT) tile persistent_tile(k) for k = 0, 1,
    // ... while below n_work.
    const unsigned n_work = (unsigned)p.batch * p.nheads * p.num_m_blocks;
    auto tile_at = [&](int k) {
        if constexpr (!PERSISTENT) {
            return k == 0 ? fwd_block_index<IS_CAUSAL || FEAT>(p) : n_work;
        } else {
            // Work tile k of this block: row k of the lists (-1 past its last), else the pairs. Both
            // computed and one selected, with the load made from a valid address either way: with a
            // branch between the two, ptxas moved every descriptor of the key-tile loops through
            // vector registers (48 R2UR, 620 instructions in the mask-free loop against 572).
            const unsigned pairs = persistent_tile<IS_CAUSAL>(k, blockIdx.x, gridDim.x, p.num_m_blocks,
                                                              (unsigned)p.batch * p.nheads);
            if constexpr (!IS_CAUSAL && !SPLIT) return pairs;
            const bool listed = p.sched != nullptr;
            const int* at = listed ? p.sched + k * gridDim.x + blockIdx.x : static_cast<const int*>(p.q);
            const unsigned loaded = (unsigned)__ldg(at);
            return listed ? loaded : pairs;
        }
    };

    // A list entry's work tile (non-causal lists: tile | (part + 1) << 24; cuflash/_schedule.py makes
    // such lists only for fewer than 2^24 work tiles, so that -1 and n_work read as past the end).
    constexpr unsigned TILE_BITS = 0xFFFFFFu;
    auto entry_tile = [&](unsigned e) { return SPLIT ? (e & TILE_BITS) : e; };

    // One work tile: its query block and (FEAT) the sequence's valid lengths, its mask and the key
    // tiles to visit (padded batches: the rows of the sequence start at row 0 of entry b). A packed
    // batch's maps see its arrays as one sequence (batch 1) of all rows: a sequence's tiles start at
    // its first row there. Rows past q_rows are not written.
    // A split work tile (PERSISTENT, non-causal, a list entry's part): key tiles [n_lo, n_lo +
    // n_blocks) of the part, and its split slot (-1: not split).
    struct Work {
        QueryBlock blk;
        int n_blocks, q_valid, k_valid, tb, q_row0, k_row0, q_rows, n_lo, split;
        QueryFeat qf;
    };
    auto work_of = [&](unsigned entry) {
        Work w;
        const unsigned tile = entry_tile(entry);
        // A part's key tiles (non-causal: every query block sees all key tiles).
        int n_lo = 0, n_cnt = (sk + BLOCK_N - 1) / BLOCK_N, split = -1;
        if constexpr (SPLIT) {
            const int pm = (int)(entry >> 24);  // 0: a whole tile; else its part + 1
            if (pm != 0) {
                n_lo = (pm - 1) * p.split_chunk;
                n_cnt = min(p.split_chunk, n_cnt - n_lo);
                split = ((int)tile - p.split_first) * p.split_parts + pm - 1;
            }
        }
        w.blk = query_block<BLOCK_M, BLOCK_N, IS_CAUSAL>(tile, p.num_m_blocks, p.nheads, p.head_group, sq, sk);
        w.n_blocks = SPLIT ? n_cnt : w.blk.n_blocks;
        w.n_lo = n_lo;
        w.split = split;
        w.q_valid = sq;
        w.k_valid = sk;
        w.qf = query_setup<FEAT, BLOCK_M, BLOCK_N, PAGED>(p.mask, w.blk.b, w.blk.h, w.blk.m0, sq, sk, w.n_blocks,
                                                          w.q_valid, w.k_valid);
        const bool packed = FEAT && p.mask.cu_seqlens_q != nullptr;
        w.tb = packed ? 0 : w.blk.b;
        w.q_row0 = (int)w.qf.si.q_row0;
        w.k_row0 = (int)w.qf.si.k_row0;
        w.q_rows = FEAT ? w.qf.si.q_rows : sq;
        return w;
    };

    if (tid == 0) {
#pragma unroll
        for (int b = 0; b < QB; ++b) mbar_init(bar_q(b), 1);
#pragma unroll
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(k_full(s), 1);
            mbar_init(v_full(s), 1);
            mbar_init(k_empty(s), 4 * CONSUMERS);
            mbar_init(v_empty(s), 4 * CONSUMERS);
        }
        if (PERSISTENT) {
            mbar_init(q_empty(0), 4 * CONSUMERS);
            mbar_init(q_empty(1), 4 * CONSUMERS);
        }
        fence_mbar_init();
    }
    if constexpr (Tr::ONES_PV) {
        // every stage's ones panel (all 64 columns, so the swizzle may put column 0 anywhere); ILV: each
        // 16-row group's, after its panels
        for (int st = 0; st < STAGES; ++st) {
            if constexpr (ILV) {
                for (int g16 = 0; g16 < BLOCK_N / 16; ++g16)
                    fill_ones_bytes<T>(sV + st * Tr::SV_BYTES + g16 * V_STEP + V_STEP - 2048, 2048, tid, Tr::THREADS);
            } else {
                fill_ones_bytes<T>(sV + st * Tr::SV_BYTES + Tr::SKV_BYTES, Tr::ONES_PANEL_BYTES, tid, Tr::THREADS);
            }
        }
        fence_proxy_async();
    }
    __syncthreads();  // barriers initialized, the ones written: the warpgroups go their ways

    const int wg = warpgroup_index();
    if (wg == 0) {
        // ---------------- producer ----------------
        setmaxnreg_dec<(SPLIT || PAGED) ? Tr::SPLIT_PRODUCER_REGS : Tr::PRODUCER_REGS>();
        // One thread issues every copy; PAGED: the whole first warp runs the loop, lane g looking up and
        // copying the tile's g-th box of page_box rows (lane 0 alone the rest).
        if (PAGED ? warp == 0 : tid == 0) {
            if (!PAGED || lane == 0) {
                tma_prefetch_desc(&p.map_q);
                tma_prefetch_desc(&p.map_k);
                tma_prefetch_desc(&p.map_v);
            }
            int j0 = 0;  // key tiles of the block's earlier work tiles: the rings' position
            for (int u = 0;; ++u) {
                const unsigned entry = tile_at(u);
                if (entry_tile(entry) >= n_work) break;
                const Work w = work_of(entry);
                const int qb = u % QB;
                if (PERSISTENT && u >= 2) mbar_wait(q_empty(qb), (u / 2 - 1) & 1);  // tile u - 2's O is out of it
                if (!PAGED || lane == 0) {
                    mbar_arrive_expect_tx(bar_q(qb), Tr::SQ_BYTES);
#pragma unroll
                    for (int c = 0; c < HEAD_DIM / 64; ++c)
                        tma_load_4d(sQ + qb * Tr::SQ_BYTES + c * BLOCK_M * 128, &p.map_q, bar_q(qb), c * 64,
                                    w.q_row0 + w.blk.m0, w.blk.h, w.tb);
                }
                // One K or V tile of key row n into its stage: after the stage's previous use (phase
                // use - 1 of its empty barrier), armed with the tile's bytes.
                auto load_kv = [&](u32 dst, const TmaDesc* map, u32 full, u32 empty, int use, int n) {
                    if (use > 0) mbar_wait(empty, (use - 1) & 1);
                    mbar_arrive_expect_tx(full, Tr::SKV_BYTES);
#pragma unroll
                    for (int c = 0; c < HEAD_DIM / 64; ++c)
                        tma_load_4d(dst + c * BLOCK_N * 128, map, full, c * 64, w.k_row0 + w.n_lo * BLOCK_N + n,
                                    w.blk.h_kv, w.tb);
                };
                // PAGED: the tile's rows in BLOCK_N / page_box boxes of page_box rows, box g (lane g) from
                // the page of key n + g page_box, looked up before the stage is free (the table read's
                // latency under the wait) and serving the K and the V copy; lane 0 arms the barrier, then
                // the lanes issue their boxes, which land at their rows of the stage's panels (the SW128
                // pattern, 1024-byte atoms of 8 rows, lays them out as one tile-sized box would). ILV: lane g
                // looks up the page of keys [16 g, 16 g + 16) of the tile; V, a box of those 16 rows' panels,
                // (columns, rows, panels, head, page), at its 16-row group; K, where a box of page_box rows
                // starts, a box of whole rows over 8-row groups numbered across the pages, (columns, 8 rows,
                // panels, 8-row groups, head), at its rows (one copy a page of the tile, not one a panel).
                const int* table_row = PAGED ? p.block_table + (i64)w.blk.b * p.table_stride : nullptr;
                auto load_paged = [&](u32 dst, const TmaDesc* map, u32 full, u32 empty, int use, int page, int row,
                                      bool is_v) {
                    if (use > 0) mbar_wait(empty, (use - 1) & 1);
                    if (lane == 0) mbar_arrive_expect_tx(full, Tr::SKV_BYTES);
                    __syncwarp();
                    if (ILV ? lane < BLOCK_N / 16 && (is_v || (lane * 16) % p.page_box == 0)
                            : lane * p.page_box < BLOCK_N) {
                        if constexpr (ILV) {
                            if (is_v)
                                tma_load_5d(dst + lane * V_STEP, map, full, 0, row, 0, w.blk.h_kv, page);
                            else
                                tma_load_5d(dst + lane * 16 * HEAD_DIM * 2, map, full, 0, 0, 0,
                                            page * (p.page_size >> 3) + (row >> 3), w.blk.h_kv);
                        } else {
#pragma unroll
                            for (int c = 0; c < HEAD_DIM / 64; ++c)
                                tma_load_4d(dst + c * BLOCK_N * 128 + lane * p.page_box * 128, map, full, c * 64, row,
                                            w.blk.h_kv, page);
                        }
                    }
                };
                for (int j = 0; j < w.n_blocks; ++j) {
                    const int jj = j0 + j, s = jj % STAGES, uk = jj / STAGES;
                    const int n = (FEAT ? w.qf.kt.tile(j) : j) * BLOCK_N;
                    if constexpr (PAGED) {
                        const int t = n + min(lane * (ILV ? 16 : p.page_box), BLOCK_N - 1), pg = t / p.page_size;
                        const int page = min(max(__ldg(table_row + min(pg, p.table_cols - 1)), 0), p.num_pages - 1);
                        const int row = t - pg * p.page_size;
                        load_paged(sK + s * Tr::SKV_BYTES, &p.map_k, k_full(s), k_empty(s), uk, page, row, false);
                        load_paged(sV + s * Tr::SV_BYTES, &p.map_v, v_full(s), v_empty(s), uk, page, row, true);
                    } else {
                        load_kv(sK + s * Tr::SKV_BYTES, &p.map_k, k_full(s), k_empty(s), uk, n);
                        load_kv(sV + s * Tr::SV_BYTES, &p.map_v, v_full(s), v_empty(s), uk, n);
                    }
                }
                j0 += w.n_blocks;
                if constexpr (!PERSISTENT) break;  // one work tile: let the compiler see it
            }
        }
        return;
    }

    // ---------------- consumers ----------------
    setmaxnreg_inc<(SPLIT || PAGED) ? Tr::SPLIT_CONSUMER_REGS : Tr::CONSUMER_REGS>();
    if constexpr (FEAT) {
        // A packed batch's rows that belong to no sequence: out 0, lse -inf (mask.cuh; what
        // varlen.cu's kernel does after the other forward kernels, here without its launch).
        if (p.mask.cu_seqlens_q != nullptr)
            fill_packed_tail(p.mask, static_cast<u16*>(p.o), p.o_row_stride, p.o_head_stride, p.lse, p.batch, p.nheads,
                             p.seqlen_q, p.d_cols, (int)threadIdx.x - 128, Tr::THREADS - 128);
    }
    const int cw = wg - 1;                                  // consumer cw: rows [64 cw, 64 cw + 64)
    // LAZY (softmax.cuh): O's rescale only in a warp where a row's max moved. Without pingpong (head
    // dims 64 and 256) it took 0.88-0.99x the time (H100, session 21). With pingpong (head_dim 128, H200,
    // session 41, p by fma both ways) it took 0.98-1.00x at causal 4k-16k keys on a block per query
    // block, and 0.99-1.03x in the persistent kernels (every non-causal length, causal up to 2k).
    constexpr bool LAZY = !PINGPONG || (IS_CAUSAL && !PERSISTENT);
    constexpr int PP_BAR = 3;                               // pingpong: named barriers 3 (consumer 0's turn), 4
    const int warp_row0 = cw * 64 + (warp % 4) * 16;        // this warp's first row in the block

    int j0 = 0;  // key tiles of the block's earlier work tiles: the rings' position
    bool pp_open = false;  // PERSISTENT pingpong: consumer 1 has opened consumer 0's first turn
    unsigned next_entry = SPLIT ? tile_at(0) : 0u;
    for (int u = 0;; ++u) {
        const unsigned entry = SPLIT ? next_entry : tile_at(u);
        if (entry_tile(entry) >= n_work) break;
        const Work w = work_of(entry);
        // SPLIT: the next work tile's entry, loaded now and taken after this tile (read at the tile's
        // start, the list's load held the consumers there for its latency: 2-5 % of the time of the
        // non-causal grid at 512-16k keys, H200, session 40).
        if constexpr (SPLIT) next_entry = tile_at(u + 1);
        const int qb = u % QB;
        const u32 sQ_wg = sQ + qb * Tr::SQ_BYTES + cw * 64 * 128;
        const int h = w.blk.h, b = w.blk.b, m0 = w.blk.m0, n_blocks = w.n_blocks;
        const QueryFeat& qf = w.qf;
        // TRIM: this consumer's own key tiles [0, n_mine) of the block's n_blocks: none where its 64
        // rows all lie past seqlen_q (the last query block, where BLOCK_M does not divide it: at 192 rows
        // a block, 4096 = 21 x 192 + 64 leaves two of three consumers idle), and, causal, only those that
        // hold a key its own last row sees (the block's count is its last consumer's). The rest it
        // releases unread (below), so the producer's protocol is unchanged, and its tensor-core and
        // softmax time goes to the block's other consumers. Its mask-free tiles count from its own first
        // row (c0), which sees more keys than the block's first.
        const int c0 = TRIM ? m0 + cw * 64 : m0;
        int n_mine = n_blocks;
        if constexpr (TRIM) {
            if (c0 >= sq) {
                n_mine = 0;
            } else if constexpr (IS_CAUSAL) {
                const int visible = min(c0 + 64, sq) + sk - sq;  // keys [0, visible) reach its last row
                n_mine = min(n_blocks, visible <= 0 ? 0 : (visible + BLOCK_N - 1) / BLOCK_N);
            }
        }
        auto tile_of = [&](int it) { if constexpr (FEAT) return qf.kt.tile(it); else return w.n_lo + it; };

        // O, and (ONES_PV) after its HEAD_DIM / 2 floats P x ones: lp of rows g, g + 8 in elements
        // HEAD_DIM / 2 and HEAD_DIM / 2 + 2 (softmax.cuh LP_TENSOR).
        constexpr int PV_N = Tr::PV_N;
        float acc_o[PV_N / 2];
#pragma unroll
        for (int i = 0; i < PV_N / 2; ++i) acc_o[i] = 0.f;
        OnlineSoftmax<Ops, 1, N_TILES, LP, LAZY> softmax;
        softmax.init();
        u32 pa[PV_STEPS][4];  // P of the previous tile, as wgmma A fragments (one per k16 step of keys)
#pragma unroll
        for (int kk = 0; kk < PV_STEPS; ++kk) pa[kk][0] = pa[kk][1] = pa[kk][2] = pa[kk][3] = 0u;
        // O += P V from the V stage sp (ONES_PV: with P x ones in acc_o's last 4 floats).
        auto pv_product = [&](int sp) {
            wgmma_rs_mnmajor<T, PV_N, PV_STEPS, BLOCK_N, V_PANEL, 1024, V_STEP>(acc_o, pa, sV + sp * Tr::SV_BYTES);
        };

        // Pingpong: consumer 0 issues first (consumer 1's arrival opens its turn; none without a tile).
        // On the persistent grid only before the block's first products: from then on consumer 1's
        // final product of a work tile opens consumer 0's turn in the next, so that consumer 0's first
        // products run under consumer 1's epilogue.
        if constexpr (PINGPONG) {
            if (cw == 1 && n_blocks > 0 && !pp_open) named_barrier_arrive(PP_BAR, 256);
            pp_open = PERSISTENT && (pp_open || n_blocks > 0);
        }
        mbar_wait(bar_q(qb), (u / QB) & 1);
        // Key tile j: S_j with O += P_(j-1) V_(j-1), then the softmax of S_j. Both flags are constants
        // at each call, which the compiler folds. first (j == 0): S_0 alone, since there is no
        // previous tile; it runs peeled before the loop, so that no branch around a product enters the
        // loop (a branch there makes ptxas serialize every wgmma). masked (plain calls): the tile may
        // need the causal or tail mask for some row of the block; the tiles of mask_free_tiles need none,
        // and their loop carries no mask code. (FEAT tiles take feat_logits_and_mask, which masks
        // only tiles a bound crosses.)
        auto key_tile = [&](int j, bool first, bool masked) {
            const int jj = j0 + j;
            const int s = jj % STAGES;
            const int sp = (jj + STAGES - 1) % STAGES;  // V_(j-1)'s stage
            mbar_wait(k_full(s), (jj / STAGES) & 1);
            if (!first) mbar_wait(v_full(sp), ((jj - 1) / STAGES) & 1);

            float sc_[BLOCK_N / 2];
            if constexpr (PINGPONG) named_barrier_sync(PP_BAR + cw, 256);  // this consumer's turn
            wgmma_fence();
            wgmma_ss_kmajor<T, BLOCK_N, HEAD_DIM, BLOCK_M, BLOCK_N, K_PANEL, K_GROUP>(sc_, sQ_wg,
                                                                                  sK + s * Tr::SKV_BYTES);
            wgmma_commit();
            if (!first) {
                pv_product(sp);
                wgmma_commit();
            }
            if constexpr (PINGPONG) named_barrier_arrive(PP_BAR + 1 - cw, 256);  // the other's turn
            if constexpr (LP == LP_THREAD) {
                if (!first) softmax.add_rounded(*reinterpret_cast<const u32(*)[1][N_TILES][2]>(&pa));  // P_(j-1), as the product reads it
            }
            if (first) wgmma_wait<0>(); else wgmma_wait<1>();
            fence_regs(sc_);
            if (lane == 0) mbar_arrive(k_empty(s));  // this warp is done with K_j

            // ---- mask, only on tiles that need it ----
            float scale = p.scale_log2;
            if constexpr (FEAT) {
                scale = feat_logits_and_mask<BLOCK_N>(sc_, p.mask, qf, p.scale_log2, tile_of(j) * BLOCK_N, m0 + warp_row0,
                                                      g, t);
            } else {
                if (masked)
                    mask_plain_tile<BLOCK_N, IS_CAUSAL, IS_EVEN>(sc_, tile_of(j) * BLOCK_N, m0 + warp_row0, g, t, sq, sk);
            }

            float alpha[1][2];
            softmax.prepare_in_place(*reinterpret_cast<float(*)[1][N_TILES][4]>(&sc_), scale, alpha);

            if (!first) {
                wgmma_wait<0>();
                fence_regs(acc_o);
                fence_regs(pa);
                if (lane == 0) mbar_arrive(v_empty(sp));  // this warp is done with V_(j-1)
            }
            const bool rescale = !first && (!LAZY || warp_needs_rescale(alpha));  // iteration 0: O and lp are still 0
            rescale_and_pack<Ops, PV_N, BLOCK_N>(acc_o, alpha, pa, sc_, rescale);  // lp with O
        };
        if (n_mine > 0) key_tile(0, true, true);
        int n_mid = 1;
        if constexpr (!FEAT) {
            // The tiles no row of the consumer's block (TRIM: of the consumer) needs masked (a split
            // part: of its own range).
            const int free_end = mask_free_tiles<BLOCK_N, IS_CAUSAL, IS_EVEN>(w.n_lo + n_blocks, c0, sq, sk);
            n_mid = max(1, min(n_mine, free_end - w.n_lo));
            for (int j = 1; j < n_mid; ++j) key_tile(j, false, false);
        }
        for (int j = n_mid; j < n_mine; ++j) key_tile(j, false, true);

        // TRIM: the block's count again, in another form, rather than n_blocks kept through the loops
        // (kept, it took a register there, and ptxas re-made wgmma descriptors' constants in the mask-free
        // loop: 7 instructions a key tile more, H200 session 57: d64 causal 16k 1 % slower).
        int n_all = n_blocks;
        if constexpr (TRIM && IS_CAUSAL) {
            const int v = min(m0 + BLOCK_M + sk - sq, sk);
            n_all = v <= 0 ? 0 : (v + BLOCK_N - 1) / BLOCK_N;
        }
        if (n_mine > 0) {
            const int jl = j0 + n_mine - 1;
            const int sp = jl % STAGES;
            mbar_wait(v_full(sp), (jl / STAGES) & 1);
            if constexpr (FEAT) {
                // V rows past the sequence's keys (kv_lengths, or the next sequence of a packed batch, or
                // memory past its last: rows the call does not vouch for) as zeros: both consumers write
                // the same zeros, each before its own product.
                const int n_last = tile_of(n_blocks - 1) * BLOCK_N;
                if (n_last + BLOCK_N > w.k_valid) {
                    zero_rows_sw128<HEAD_DIM, BLOCK_N, ILV ? V_STEP : 0>(sV + sp * Tr::SV_BYTES,
                                                                         max(w.k_valid - n_last, 0), tid % 128, 128);
                    fence_proxy_async();
                    named_barrier_sync(1 + cw, 128);
                }
            }
            if constexpr (PINGPONG) named_barrier_sync(PP_BAR + cw, 256);
            wgmma_fence();
            pv_product(sp);
            wgmma_commit();
            // Consumer 1 goes last: nothing waits for a turn after its final product, but (PERSISTENT)
            // consumer 0's first products of the next work tile (after the block's last work tile the
            // arrival is left unmatched, as the block exits).
            if constexpr (PINGPONG) {
                if (cw == 0) named_barrier_arrive(PP_BAR + 1, 256);
                else if (PERSISTENT) named_barrier_arrive(PP_BAR, 256);
            }
            if constexpr (LP == LP_THREAD) softmax.add_rounded(*reinterpret_cast<const u32(*)[1][N_TILES][2]>(&pa));
            wgmma_wait<0>();
            fence_regs(acc_o);
            // The stage's next fill may come (PERSISTENT), or (TRIM) the block's later tiles need it.
            if ((PERSISTENT || n_mine < n_all) && lane == 0) mbar_arrive(v_empty(sp));
        }
        if constexpr (TRIM) {
            // Tiles [n_mine, n_all): each warp releases K_j and (but the block's last, whose stage no
            // fill waits for) V_j as if it had read them, each after its fill has landed: an arrival
            // made sooner could count toward the stage's previous phase, which the other consumers may
            // not have released yet (the fill of K_j completes only after that phase has).
            if (lane == 0) {
                for (int j = n_mine; j < n_all; ++j) {
                    const int jj = j0 + j, s = jj % STAGES;
                    mbar_wait(k_full(s), (jj / STAGES) & 1);
                    mbar_arrive(k_empty(s));
                    if (j + 1 < n_all) {
                        mbar_wait(v_full(s), (jj / STAGES) & 1);
                        mbar_arrive(v_empty(s));
                    }
                }
            }
            __syncwarp();
        }
        // This consumer's four warps are done reading its rows of sQ: O goes out through them.
        named_barrier_sync(1 + cw, 128);

        // ---- epilogue: O /= lp, lse, O through this warp's 16 rows of sQ ----
        float inv_l[1][2], lse[1][2];
        if constexpr (LP == LP_TENSOR) softmax.take_lp(*reinterpret_cast<const float(*)[4]>(&acc_o[HEAD_DIM / 2]));
        if constexpr (FEAT) {
            // A sink logit joins here, after the last key tile (softmax.cuh); -inf: none.
            const float* sink = p.mask.sink_logits;
            softmax.finalize(inv_l, lse, sink != nullptr ? sink[h] * CUFLASH_LOG2E : -CUFLASH_INF);
            // Rows past the sequence's valid length: out = 0 (set, since their Q rows may hold anything),
            // lse = -inf.
#pragma unroll
            for (int r = 0; r < 2; ++r)
                if (m0 + warp_row0 + g + r * 8 >= w.q_valid) {
                    inv_l[0][r] = 0.f;
                    lse[0][r] = -CUFLASH_INF;
#pragma unroll
                    for (int i = 0; i < HEAD_DIM / 2; ++i)
                        if ((i % 4) / 2 == r) acc_o[i] = 0.f;
                }
        } else {
            softmax.finalize(inv_l, lse);
        }
        // A split tile's part: its rows to the workspace; the warp of the last part merges and writes.
        bool writes = true;
        if constexpr (SPLIT) {
            if (w.split >= 0)
                writes = split_part_merge<HEAD_DIM, 4 * CONSUMERS>(
                    p.split_ws, p.split_parts, w.split / p.split_parts, w.split % p.split_parts, warp - 4, lane,
                    *reinterpret_cast<float(*)[HEAD_DIM / 2]>(&acc_o[0]), inv_l, lse);
        }
        if (writes) {
            const float(&o_acc)[HEAD_DIM / 2] = *reinterpret_cast<const float(*)[HEAD_DIM / 2]>(&acc_o[0]);
            if constexpr (HEAD_DIM > 128)  // fwd_sm90_steps.cuh: head_dim 256 keeps the word stores
                o_rows_to_smem_words<Ops, HEAD_DIM, BLOCK_M>(sQ_ptr + qb * Tr::SQ_BYTES, o_acc, inv_l, warp_row0, g, t);
            else
                o_rows_to_smem<Ops, HEAD_DIM, BLOCK_M>(sQ + qb * Tr::SQ_BYTES, o_acc, inv_l, warp_row0, lane);
            // lse == nullptr: the caller wants only O (an eager forward with no gradient and no lse).
            if (t == 0 && p.lse != nullptr) {
                float* g_lse = FEAT ? p.lse + b * p.mask.lse_batch_stride + h * p.mask.lse_head_stride + w.q_row0
                                    : p.lse + ((i64)b * p.nheads + h) * sq;
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const int row = m0 + warp_row0 + g + r * 8;
                    if (IS_EVEN || row < w.q_rows) g_lse[row] = lse[0][r];
                }
            }
            __syncwarp();

            T* gO = static_cast<T*>(p.o) + b * p.o_batch_stride + h * p.o_head_stride + ((i64)w.q_row0 + m0) * p.o_row_stride;
            if constexpr (HEAD_DIM > 128)
                o_rows_to_global_chunks<T, HEAD_DIM, BLOCK_M, IS_EVEN>(gO, p.o_row_stride, sQ_ptr + qb * Tr::SQ_BYTES,
                                                                       warp_row0, lane, m0, w.q_rows, p.d_cols);
            else
                o_rows_to_global<T, HEAD_DIM, BLOCK_M, IS_EVEN>(gO, p.o_row_stride, sQ + qb * Tr::SQ_BYTES, warp_row0, lane,
                                                                m0, w.q_rows, p.d_cols);
        }  // writes
        if constexpr (PERSISTENT) {
            // This warp's rows of sQ[qb] are read out: work tile u + 2's Q may land there (the fence
            // orders the generic accesses before the async proxy's copy).
            fence_proxy_async();
            __syncwarp();
            if (lane == 0) mbar_arrive(q_empty(qb));
        }
        j0 += n_blocks;
        if constexpr (!PERSISTENT) break;  // one work tile: let the compiler see it
    }  // work tiles
}

}  // namespace cuflash
