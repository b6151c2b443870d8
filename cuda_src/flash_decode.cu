// flash_decode.cu: attention of a few query rows against a long KV cache (decoding, speculative
// decoding), split-KV with GQA packing; the cache contiguous or paged. Plus the in-place append of
// the new tokens and the combine of the splits.
//
// Layouts (element strides, int64; the last dimension unit-stride):
//   q, o:           (batch, seqlen_q, nheads, head_dim)
//   k/v cache:      contiguous (batch_cache, capacity, nheads_kv, head_dim): entry b's key t at row
//                   cache_batch_idx[b] (or b), position t; paged (num_blocks, page_size, nheads_kv,
//                   head_dim): entry b's key t at block block_table[b * table_stride + t / page_size],
//                   row t % page_size. The "batch" strides step a cache row or a block.
//   k_new, v_new:   (batch, seqlen_new, nheads_kv, head_dim), appended at cache_seqlens[b] + i
//   lse:            (batch, nheads, seqlen_q) float32, natural log (null: not wanted)
//   o_part:         (num_splits, batch, nheads, seqlen_q, head_dim) float32: each split's output,
//                   already divided by its own row sum (of the rounded P, softmax.cuh);
//                   lse_part (num_splits, batch, nheads, seqlen_q) float32 in log2 units. Only
//                   when num_splits > 1.
// Entry b sees keys [0, L_b), L_b = min(cache_seqlens[b] + seqlen_new, capacity) (the lengths stay
// on the device; out-of-range values are clamped, block numbers too, so a bad table or length can
// never make a read or write out of bounds). The masks are those of mask.cuh with sq = seqlen_q,
// sk = L_b: query row i stands at key position i + L_b - seqlen_q.
//
// GQA packing. A thread block serves one kv head of one entry: its rows are the head_group query
// heads of that kv head times the seqlen_q positions, packed as row r = i * head_group + g (query
// position i, head h_kv * head_group + g), 16 rows per block (the mma's m), or 32 with two m16 tiles
// a warp (MT = 2: the TMA kernels on 4 warps, where a kv head has more than 16 rows, speculative
// decoding at GQA 4-8; Q stays in shared memory there, and the warps' merge runs once per m-tile).
// So each K/V tile is loaded once for all the query heads (and positions) that read it, and one
// decode step reads the cache once per kv head, not once per query head.
//
// Heads (HEADS > 1: the 4-warp TMA kernel, a contiguous cache, one m16 tile a warp; the host takes it
// where seqlen_q x nheads / nheads_kv x HEADS <= 16: cuflash/_config.py decode_heads). A block serves
// HEADS adjacent kv heads of one entry: the host passes nheads_kv / HEADS and head_group x HEADS, so
// the block's rows are the query heads of all HEADS kv heads (one row tile) and every Q, O, lse and
// partial index stays as above. A tile is KT = BN / HEADS keys of each head, one 4-D box {64, KT,
// HEADS, 1} per 64-column panel: it lands head-major as BN rows of the same SW128 panel, so warp w
// reads its 16 rows [16w, 16w + 16) where it always does, which are keys (w % HEAD_WARPS) x 16 of head
// w / HEAD_WARPS's KT. Every warp computes all 16 rows; at the merge it gives the rows of the other
// heads m = -inf and zeros, so each row sums its own head's warps. Where the memory is the limit, a
// block of two heads reads each key row's 512 bytes of K (and of V) in one box: H200, session 76
// (bench/dev/decode_read_bw.py, read-only kernels), 0.993-0.997 of the one-head readers' time at
// one-wave grids of 8k-128k keys.
//
// Split-KV. The keys a block's rows may see (sink tokens, then the window's span; mask.cuh) are
// numbered 0..n-1 ("virtual" keys) and cut into num_splits contiguous chunks of whole BN-key
// tiles; block (.., split) walks its chunk. With num_splits = 1 it writes o and lse directly;
// otherwise o_part / lse_part, and decode_combine_kernel merges the splits with their
// log-sum-exp (and the sink logit), one block per output row. With split_counters (the fused
// combine, CUFLASH_DECODE_FUSED_COMBINE=1) there is no second kernel: each split block, after its
// partials, counts itself on its row tile's counter (__threadfence first); the block that counts
// last merges all the tile's rows at once (merge_tile) and sets the counter back to 0. The
// counters are zero before the first call (the host clears them once) and after every call.
// With cluster_merge (sm_90, num_splits <= CLUSTER_MAX) neither: the host launches the grid in
// clusters of num_splits blocks, so a row tile's splits are one cluster (block = ... * num_splits +
// split, cluster rank = split); each block leaves its partials (O divided by its row sums, and
// log2-sum-exp) in its own shared memory, and after a cluster barrier the cluster's blocks merge the
// tile together, each taking a share of its (row, 4 columns) items and reading the S partials of an
// item from the S blocks' shared memory (cluster_merge_tile); a second barrier keeps every block's
// shared memory alive until the others have read it. No partials in global memory, no counter, no
// second kernel.
//
// Inside a block. WARPS warps (4, or 8 where the grid leaves SMs with a single block: twice the
// warps to hide latencies and twice the bytes in flight) split each BN = 16 * WARPS-key tile
// (64 or 128 keys): warp w takes keys [16w, 16w + 16), keeps its own online softmax (m, l) and O
// accumulator for all 16 (32) rows, and never waits for the others inside the loop. K/V tiles come
// through a STAGES-deep cp.async pipeline (tile it + STAGES - 1 is issued while tile it computes).
// At the end the warps' (m, l, O) are merged through shared memory in a fixed order
// (deterministic): each warp stores its O rescaled to the rows' common maximum in rows 8 banks
// apart (decode_o_pitch), and the block sums them 4 columns a thread. Q goes from shared memory
// into registers once (head_dim a multiple of 16 from 64; otherwise it is read at every tile);
// S = Q K^T and O += P V are mma.sync m16n8k16 (P re-packed from the S accumulators as the A
// operand). Per tile, a warp pays for the element-wise mask only where a bound crosses its 16 keys
// or a score modification applies, and for the rescale of O only where a row's maximum moved. Both
// tests are uniform across the warp: the rescale's by a vote, the mask's by a vote in the cp.async
// kernels and, in the TMA kernels, by the warp's range of plain keys, worked out once before the
// loop. The TMA kernels sum the rounded P on the tensor cores (P times ones) and take each ldmatrix
// address from registers set before the loop (the tile step, below).
//
// Copies. cp.async (every layout and target): the block's threads copy the K/V tile's rows into
// padded rows (load_tile below). TMA (TMA = true: sm_90a, head_dim 64 or 128, no sink tokens beside
// a window, so that a tile's keys are consecutive): tensor-map boxes complete on the stage's
// mbarrier (on 8 warps, K and V on one each: KV_APART): warp 0 issues one per 64-column panel of
// K and of V (a contiguous cache, or a paged one whose page_size is a multiple of the tile:
// page_tiles), or each warp one per panel for its 16-key group (another paged one: a group never
// straddles a page; at head_dim 128 one 5-D box for both panels, into group-major tiles:
// GROUP_BOX); the tiles are dense SW128 panels that the warps read with ldmatrix at swizzled
// addresses. The TMA unit reads a cache faster than the threads' 16-byte copies: H200, batch 64,
// 8k keys, 32 kv heads, reads alone
// (bench/dev/decode_read_bw.py) 4.66 TB/s against 4.26-4.31, the copy 4.23.
// Warp 0 issues tile it + STAGES - 1 at the loop's top, once every warp is done with tile it - 1, whose
// stage it takes; where the memory is the limit, tile it is then still in flight, so three tiles are
// (STAGES = 3). With late_issue (contiguous caches, 3+ stages; the host sets it for grids of one block per
// SM at most: cuflash/_config.py decode_late_issue) it issues the tile after its wait for tile it
// instead: two in flight throughout, as the fastest read-only reader of one block an item keeps
// (bench/dev/decode_read_bw.py: H200, 128 items of 128k keys, 2 stages 1873 us, 3 stages 1891).
// 16-key groups run a twin of each TMA kernel (GRP: paged and groups compile-time constants; the
// host takes it for exactly those calls), which leaves the other layouts' code as it was. H200,
// session 62: 0.94-0.96x the shared kernel's time at 512-key caches of 16-row pages. (Groups
// copied by the threads instead, cp.async into the boxes' layout with arrivals on the stage's
// barriers, took 1.03-1.17x the boxes' time there.)
//
// Grid. 1-D: block = ((b * nheads_kv + h_kv) * num_row_tiles + row_tile) * num_splits + split, a row
// tile being 16 MT rows. With a split tail (tail_first = W > 0, the fused combine): blocks x < W are row
// tiles x unsplit, and block W + j is split j % num_splits of row tile W + j / num_splits: the last
// row tiles, which the scheduler places last, go in shorter blocks, so that the grid's end, where too
// few blocks remain to keep the memory busy, is shorter (the many-wave decodes).
//
// Launch order. A call runs append -> decode -> combine (each where it applies). Each kernel waits
// for the grid before it (pdl_wait, common.cuh) ahead of its first global read and write, so that
// on sm_90, in a CUDA graph, the host launches the kernels after the first as programmatic
// dependents (cuflash/_launch.py PdlConfig): they start while the one before them finishes. An
// eager call launches all of its kernels so where the previous call's decode kernel has not begun
// yet (the stream is busy: its last block writes the call's number into host memory as it starts,
// DecodeParams::started), and none of them otherwise.
#include "common.cuh"
#include "mask.cuh"
#include "softmax.cuh"
#include "tma.cuh"
#include "warp_gemm.cuh"

// A timeline probe (CUFLASH_DECODE_TIMELINE=1 in the environment compiles it in: cuflash/_compile.py;
// absent from every normal build). Thread 0 of block x (x < DECODE_TL_BLOCKS) writes its SM clock at
// fixed points into slots x * DECODE_TL_SLOTS + i of this module's global (read back by
// bench/dev/decode_timeline.py), with the global timer at the block's start and end to align blocks.
#ifdef CUFLASH_DECODE_TIMELINE
#define DECODE_TL_BLOCKS 4096
#define DECODE_TL_SLOTS 40
extern "C" __device__ unsigned long long cuflash_decode_timeline[DECODE_TL_BLOCKS * DECODE_TL_SLOTS];
#define DECODE_TL(slot, value)                                                                   \
    do {                                                                                         \
        if (blockIdx.x < DECODE_TL_BLOCKS)                                                       \
            cuflash_decode_timeline[blockIdx.x * DECODE_TL_SLOTS + (slot)] = (value);            \
    } while (0)
#define DECODE_TL_CLK(slot) DECODE_TL(slot, (unsigned long long)clock64())
// The clock once `after` (a float register) is ready: the read waits for the instruction that writes it.
#define DECODE_TL_CLK_AFTER(slot, after)                                                         \
    do {                                                                                         \
        unsigned long long t_;                                                                   \
        asm volatile("mov.u64 %0, %%clock64;" : "=l"(t_) : "f"(after));                          \
        DECODE_TL(slot, t_);                                                                     \
    } while (0)
#define DECODE_TL_GT(slot)                                                                       \
    do {                                                                                         \
        unsigned long long t_;                                                                   \
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t_));                                   \
        DECODE_TL(slot, t_);                                                                     \
    } while (0)
#else
#define DECODE_TL(slot, value) do {} while (0)
#define DECODE_TL_CLK(slot) do {} while (0)
#define DECODE_TL_GT(slot) do {} while (0)
#define DECODE_TL_CLK_AFTER(slot, after) do {} while (0)
#endif

namespace cuflash {


struct DecodeParams {
    // What a decode block reads first (its indices from blockIdx, its entry's length and table row,
    // the early copies' keys, Q's address; then the mask's fields), together at the struct's start,
    // so that a block's prologue reads its parameters from four 64-byte lines of the constant bank
    // instead of six: each line is a miss at a block's first touch (bench/NOTES.md, session 45: 1-2 %
    // off the latency-bound decodes on an H200).
    int num_splits;
    int num_row_tiles;  // ceil(rows / 16)
    int nheads_kv;
    int head_group;     // nheads / nheads_kv
    int rows;           // seqlen_q * head_group
    int seqlen_q;
    int capacity;       // keys an entry can hold
    int page_size;      // 0: contiguous
    int fixed_seqlen;   // cache_seqlens when that pointer is null
    int seqlen_new;     // tokens appended per entry (counted in L_b)
    int cache_rows;     // batch_cache (contiguous) or num_blocks (paged)
    int page_tiles;     // TMA, paged: 1 where page_size is a multiple of the tile's BN keys (the maps'
                        // boxes are then BN rows: a tile is one box per panel, from one table entry)
    int cluster_merge;  // sm_90, 2 <= num_splits <= CLUSTER_MAX (8): the splits of a row tile are one
                        // thread block cluster, merged through distributed shared memory
    int batch;
    const int* cache_seqlens;   // (batch,) or null: fixed_seqlen for every entry
    const int* cache_batch_idx; // (batch,) or null: entry b uses cache row b (contiguous caches)
    const int* block_table;     // (batch, table_stride) or null: a contiguous cache
    i64 table_stride;
    int* split_counters;        // null, or (batch * nheads_kv * num_row_tiles) ints, zero between calls:
                                // the last split block of each row tile combines the splits itself
    unsigned long long seq;     // (with started, below) where seq != 0 (an eager call on sm_90), the
                                // decode kernel's last block writes seq into `started` as it starts,
                                // so the host's next call can tell whether this one has begun
                                // (cuflash/_kvcache.py DecodePlan.run: busy streams launch PDL)
    const void* q;
    i64 q_batch_stride, q_row_stride, q_head_stride;
    float scale_log2;   // softmax_scale * log2(e)
    int tail_first;     // the split tail: blocks [0, tail_first) are row tiles 0 .. tail_first - 1 unsplit,
                        // the others the later row tiles in num_splits blocks each (0: every row tile in
                        // num_splits blocks; the fused combine merges the tail's splits)
    MaskParams mask;    // window, sink tokens, sink logits, ALiBi, softcap (the rest unused)

    int nheads;
    int head_dim;       // the append kernel's (the others have it as a template argument)
    const void* k;              // k_cache
    const void* v;              // v_cache
    void* o;
    float* lse;                 // null: not wanted
    float* o_part;              // num_splits > 1 only
    float* lse_part;
    const void* k_new;          // append kernel only
    const void* v_new;
    unsigned long long* started;  // null, or a word of mapped host memory (seq, above)

    i64 k_batch_stride, k_row_stride, k_head_stride;
    i64 v_batch_stride, v_row_stride, v_head_stride;
    i64 o_batch_stride, o_row_stride, o_head_stride;
    i64 kn_batch_stride, kn_row_stride, kn_head_stride;
    i64 vn_batch_stride, vn_row_stride, vn_head_stride;
    int* kv_lengths;            // append kernel only: null, or (batch,) where it writes each entry's L_b
                                // (the chunk route's kv_lengths for the feature forward; last in the
                                // struct, so the other fields keep their offsets)
    int late_issue;             // TMA, 3+ stages, a contiguous cache: warp 0 issues tile it + STAGES - 1
                                // once tile it landed instead of before its wait (Copies, below;
                                // cuflash/_config.py decode_late_issue)
};

// The TMA kernel's Params (sm_90a): DecodeParams, then the tensor maps of the K and V caches,
// (cache_rows, capacity, nheads_kv, head_dim) described as 4-D (head_dim, capacity, nheads_kv,
// cache_rows) with a {64, BN, 1, 1} box and the 128-byte swizzle (cuflash/_tma.py kv_map); a paged
// cache's (num_blocks, page_size, ...) likewise, with {64, 16, 1, 1} boxes (at head_dim 128 5-D
// (64, page_size, 2 panels, nheads_kv, num_blocks) with {64, 16, 2, 1, 1} boxes), or {64, BN, 1, 1}
// where page_tiles.
struct DecodeTmaParams : DecodeParams {
    TmaDesc map_k;
    TmaDesc map_v;
};
template <bool TMA> struct DecodeParamsOf { using type = DecodeParams; };
template <> struct DecodeParamsOf<true> { using type = DecodeTmaParams; };

// Byte offset of 16-byte chunk c of row r in a tile of ROWS rows stored as SW128 panels (64 columns,
// 128 bytes a row, chunk c % 8 of row r at position (c % 8) ^ (r % 8); panel c / 8 after the others).
template <int ROWS>
__device__ __forceinline__ u32 decode_sw128(int r, int c) {
    return (u32)((c >> 3) * ROWS * 128 + r * 128 + (((c & 7) ^ (r & 7)) << 4));
}

// The row pitch (floats) of the warps' O in the merge buffer: at least head_dim, 8 (mod 32), so that
// the rows g = 0..7 of an mma fragment's store start 8 banks apart (four rows fill the 32 banks).
__host__ __device__ constexpr int decode_o_pitch(int head_dim) { return head_dim + ((8 - head_dim % 32) + 32) % 32; }

template <int HEAD_DIM, int STAGES, int WARPS_ = 4, bool TMA = false, int MT = 1>
struct DecodeTraits {
    static constexpr int WARPS = WARPS_;
    static constexpr int THREADS = WARPS * 32;
    static constexpr int WN = 16;               // keys per warp per tile
    static constexpr int BN = WARPS * WN;       // keys per tile
    static constexpr int ROWS = 16 * MT;        // packed query rows per block (MT m16 tiles a warp)
    static constexpr int PITCH = padded_pitch(HEAD_DIM);
    static constexpr int CHUNKS = HEAD_DIM / 8;
    static constexpr int D_TILES = HEAD_DIM / 8;
    static constexpr int SQ_ELEMS = ROWS * PITCH;
    // A K or V tile: padded rows (cp.async), or dense SW128 panels (TMA: HEAD_DIM / 64 panels of BN
    // rows x 128 bytes, 16-byte chunk c of row r at chunk c ^ (r % 8)).
    static constexpr int SKV_ELEMS = TMA ? BN * HEAD_DIM : BN * PITCH;
    static constexpr int KV_BYTES = 2 * STAGES * SKV_ELEMS * 2;
    static constexpr int O_PITCH = decode_o_pitch(HEAD_DIM);
    static constexpr int MERGE_BYTES = WARPS * 16 * O_PITCH * 4;  // the warps' O of one m-tile, in the K/V stages
    // cp.async: sQ, then sK[STAGES], sV[STAGES]. TMA: up to 1023 bytes of alignment, sK[STAGES],
    // sV[STAGES] (each 1024-byte aligned), then sQ. Must equal cuflash/_config.py:decode_smem_bytes.
    static constexpr int SMEM_BYTES = SQ_ELEMS * 2 + KV_BYTES + (TMA ? 1024 : 0);
    static_assert(!TMA || HEAD_DIM % 64 == 0, "TMA tiles are whole 64-column panels");

    static_assert(HEAD_DIM % 8 == 0 && HEAD_DIM >= 8 && HEAD_DIM <= 256, "head_dim: multiple of 8 in [8, 256]");
    static_assert(STAGES >= 2, "a pipeline needs two stages");
    static_assert(WARPS == 4 || WARPS == 8, "4 warps (64-key tiles) or 8 (128-key tiles)");
    static_assert(MT == 1 || (MT == 2 && TMA), "two m-tiles a warp: the TMA kernels");
    static_assert(MERGE_BYTES <= KV_BYTES, "the merge buffer lives in the K/V stages");
    static_assert(O_PITCH >= HEAD_DIM && O_PITCH % 32 == 8, "the merge buffer's rows: 8 banks apart");
};

// Keys an entry sees: min(cache_seqlens[b] + seqlen_new, capacity), every value clamped. Split in
// two so that the kernel can issue the load early and clamp late.
__device__ __forceinline__ int decode_length_raw(const DecodeParams& p, int b) {
    return p.cache_seqlens != nullptr ? p.cache_seqlens[b] : p.fixed_seqlen;
}
__device__ __forceinline__ int decode_length_clamp(const DecodeParams& p, int s) {
    return min(min(max(s, 0), p.capacity) + p.seqlen_new, p.capacity);
}

// (n / d, n % d) for n >= 0, d >= 1 by a runtime divisor: trunc((n + 0.5) / d) through the
// approximate float reciprocal (right while n < 2^20: (n + 0.5) / d lies at least 0.5 / d from an
// integer, farther than the float error), checked by the remainder, with the exact int division
// where the check fails: exact for every n. An int division by a runtime value compiles to about 20
// dependent instructions, and the kernel's prologue had several ahead of its first copies (the
// block's indices; the query position and head of a Q row by the GQA group).
__device__ __forceinline__ int2 divmod_rt(int n, int d) {
    float rcp;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(rcp) : "f"((float)d));
    int q = __float2int_rz(((float)n + 0.5f) * rcp);
    int m = n - q * d;
    if (m < 0 || m >= d) {  // n past 2^20 or so
        q = n / d;
        m = n - q * d;
    }
    return make_int2(q, m);
}

// Element offset of (entry b, key position t) in a cache, without the head and column: a row of a
// contiguous cache, or a block of a paged one (block numbers clamped into the cache).
__device__ __forceinline__ i64 cache_offset(const DecodeParams& p, i64 batch_stride, i64 row_stride, int cache_row,
                                            const int* table_row, int t) {
    if (p.page_size == 0) return cache_row * batch_stride + t * row_stride;
    const int blk = min(max(table_row[t / p.page_size], 0), p.cache_rows - 1);
    return blk * batch_stride + (i64)(t % p.page_size) * row_stride;
}

__device__ __forceinline__ int decode_cache_row(const DecodeParams& p, int b) {
    if (p.page_size != 0) return 0;
    return p.cache_batch_idx != nullptr ? min(max(p.cache_batch_idx[b], 0), p.cache_rows - 1) : b;
}

template <int HEAD_DIM>
struct CombineSmem {
    static constexpr int CQ = HEAD_DIM / 4;   // float4 columns
    static constexpr int P = 128 / CQ;        // phases over the splits
    float w[128];
    float red[4];
    float4 acc[P][CQ];
};

// One output row's combine by the 128 threads of a block (sm: the block's shared scratch).
template <typename T, int HEAD_DIM>
__device__ __forceinline__ void combine_row(const DecodeParams& p, i64 row, CombineSmem<HEAD_DIM>& sm) {
    constexpr int CQ = CombineSmem<HEAD_DIM>::CQ, P = CombineSmem<HEAD_DIM>::P;
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const i64 total = (i64)p.batch * p.nheads * p.seqlen_q;
    const int qi = (int)(row % p.seqlen_q);
    const int head = (int)((row / p.seqlen_q) % p.nheads);
    const int b = (int)(row / ((i64)p.seqlen_q * p.nheads));
    const int S = p.num_splits;
    const float sk2 = p.mask.sink_logits != nullptr ? p.mask.sink_logits[head] * CUFLASH_LOG2E : -CUFLASH_INF;

    // This thread's first U splits' partial outputs, loaded with lse_s, ahead of the weights they
    // are summed with (one memory round trip fewer than loading them after).
    constexpr int U = HEAD_DIM > 128 ? 2 : 8;  // (4 spilled on sm_80 at head_dim 184 and 224 to 248)
    const int c = tid % CQ, ph = tid / CQ;
    const float* src = p.o_part + row * HEAD_DIM + 4 * c;
    float4 v[U];
#pragma unroll
    for (int j = 0; j < U; ++j) {
        const int s = ph + j * P;
        v[j] = ph < P && s < S ? *reinterpret_cast<const float4*>(src + (i64)s * total * HEAD_DIM)
                               : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    const float l2 = tid < S ? p.lse_part[tid * total + row] : -CUFLASH_INF;
    float mx = l2;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    if (lane == 0) sm.red[warp] = mx;
    __syncthreads();
    mx = fmaxf(fmaxf(fmaxf(sm.red[0], sm.red[1]), fmaxf(sm.red[2], sm.red[3])), sk2);
    const float base = exp_base(mx);
    const float w = fast_exp2(l2 - base);  // 0 for splits that saw no key (and past num_splits)
    float sum = w;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    __syncthreads();  // every thread has read red's maxima
    if (lane == 0) sm.red[warp] = sum;
    __syncthreads();
    const float lt = ((sm.red[0] + sm.red[1]) + (sm.red[2] + sm.red[3])) + fast_exp2(sk2 - base);
    const bool empty = lt == 0.f;
    const float inv = empty ? 0.f : 1.f / lt;
    sm.w[tid] = w * inv;
    __syncthreads();

    if (ph < P) {
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int j = 0; j < U; ++j) {
            const int s = ph + j * P;
            const float ws = s < S ? sm.w[s] : 0.f;
            acc.x += ws * v[j].x;
            acc.y += ws * v[j].y;
            acc.z += ws * v[j].z;
            acc.w += ws * v[j].w;
        }
        // The rest, eight in flight (four at head_dim 256).
#pragma unroll(HEAD_DIM > 128 ? 4 : 8)
        for (int s = ph + U * P; s < S; s += P) {
            const float4 x = *reinterpret_cast<const float4*>(src + (i64)s * total * HEAD_DIM);
            const float ws = sm.w[s];
            acc.x += ws * x.x;
            acc.y += ws * x.y;
            acc.z += ws * x.z;
            acc.w += ws * x.w;
        }
        sm.acc[ph][c] = acc;
    }
    __syncthreads();
    if (tid < CQ) {
        float4 acc = sm.acc[0][tid];
#pragma unroll
        for (int q = 1; q < P; ++q) {
            acc.x += sm.acc[q][tid].x;
            acc.y += sm.acc[q][tid].y;
            acc.z += sm.acc[q][tid].z;
            acc.w += sm.acc[q][tid].w;
        }
        T* gO = static_cast<T*>(p.o) + b * p.o_batch_stride + qi * p.o_row_stride + head * p.o_head_stride;
        u32* dst = reinterpret_cast<u32*>(gO + 4 * tid);
        dst[0] = ElemOps<T>::pack(acc.x, acc.y);
        dst[1] = ElemOps<T>::pack(acc.z, acc.w);
    }
    if (tid == 0 && p.lse != nullptr) p.lse[row] = empty ? -CUFLASH_INF : (base + fast_log2(lt)) * 0.6931471805599453f;
    __syncthreads();  // sm is free for the next row
}

// The fused combine's merge of one row tile (rows r0 .. r_end of (b, h_kv), packed as in the decode
// kernel) by its last split block, all rows at once: (1) one thread per (row, split) reads lse_s;
// (2) one thread per row turns them into weights and writes the row's lse; (3) one thread per (row,
// 4 columns) sums the splits' outputs, 16-byte loads, four in flight. Three
// memory round trips for the tile, where combine_row takes about three per row. w: rows x num_splits
// floats of shared memory, at most 16 x 128 (the host caps num_splits at 128).
constexpr int TILE_MERGE_MAX = 16 * 128;

// The (batch, nheads, seqlen_q) index of packed row r of (b, h_kv).
__device__ __forceinline__ i64 merge_row_index(const DecodeParams& p, int b, int h_kv, int r) {
    return ((i64)b * p.nheads + h_kv * p.head_group + r % p.head_group) * p.seqlen_q + r / p.head_group;
}

template <typename T, int HEAD_DIM, int THREADS>
__device__ __forceinline__ void merge_tile(const DecodeParams& p, int b, int h_kv, int r0, int r_end, float* w) {
    constexpr int CQ = HEAD_DIM / 4;
    const int tid = threadIdx.x, G = p.head_group, S = p.num_splits, R = r_end - r0;
    const i64 total = (i64)p.batch * p.nheads * p.seqlen_q;
    for (int i = tid; i < R * S; i += THREADS) w[i] = p.lse_part[(i64)(i % S) * total + merge_row_index(p, b, h_kv, r0 + i / S)];
    __syncthreads();
    if (tid < R) {
        const int head = h_kv * G + (r0 + tid) % G;
        const float sk2 = p.mask.sink_logits != nullptr ? p.mask.sink_logits[head] * CUFLASH_LOG2E : -CUFLASH_INF;
        float* wr = w + tid * S;
        float mx = sk2;
        for (int s = 0; s < S; ++s) mx = fmaxf(mx, wr[s]);
        const float base = exp_base(mx);
        float lt = 0.f;
        for (int s = 0; s < S; ++s) {
            wr[s] = fast_exp2(wr[s] - base);  // 0 for splits that saw no key
            lt += wr[s];
        }
        lt += fast_exp2(sk2 - base);
        const bool empty = lt == 0.f;
        const float inv = empty ? 0.f : 1.f / lt;
        for (int s = 0; s < S; ++s) wr[s] *= inv;
        if (p.lse != nullptr) p.lse[merge_row_index(p, b, h_kv, r0 + tid)] = empty ? -CUFLASH_INF : (base + fast_log2(lt)) * 0.6931471805599453f;
    }
    __syncthreads();
    for (int i = tid; i < R * CQ; i += THREADS) {
        const int rr = i / CQ, c = i % CQ;
        const i64 row = merge_row_index(p, b, h_kv, r0 + rr);
        const float* src = p.o_part + row * HEAD_DIM + 4 * c;
        const float* wr = w + rr * S;
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
        for (int s = 0; s < S; ++s) {
            const float4 v = *reinterpret_cast<const float4*>(src + (i64)s * total * HEAD_DIM);
            acc.x += wr[s] * v.x;
            acc.y += wr[s] * v.y;
            acc.z += wr[s] * v.z;
            acc.w += wr[s] * v.w;
        }
        const int r = r0 + rr, qi = r / G, head = h_kv * G + r % G;
        T* gO = static_cast<T*>(p.o) + b * p.o_batch_stride + qi * p.o_row_stride + head * p.o_head_stride;
        u32* dst = reinterpret_cast<u32*>(gO + 4 * c);
        dst[0] = ElemOps<T>::pack(acc.x, acc.y);
        dst[1] = ElemOps<T>::pack(acc.z, acc.w);
    }
}

// The cluster merge (cluster_merge): block `rank` of the row tile's cluster of S = num_splits blocks
// takes items i = rank * THREADS + tid, + S * THREADS, ... of the tile's R x HEAD_DIM / 4 (row, 4
// columns) items; for each it reads the S blocks' log2-sum-exp of the row (s_lse) and their 4
// columns of the row's partial O (sO: 16 rows at decode_o_pitch) from their shared memory, and
// writes out = sum_s w_s O_s, w_s = exp2(lse_s - base) / (sum_s exp2(lse_s - base) + exp2(sink -
// base)), summed in split order (deterministic), and the row's lse (natural log) with its first
// item. The same weights as merge_tile and combine_row. Not inlined: inlined, it moved ptxas to spill
// 4-12 bytes in the 4-warp kernels at head_dim 40 and 48 (sm_90a), which a call does not.
// At most 8 blocks, the portable cluster size. (Built for 16, non-portable, every cluster merge of 2
// to 8 blocks took 0.4-1.1 us longer per step on an H200, session 31, and 16-block clusters were no
// faster than the fused combine or the combine kernel.)
constexpr int CLUSTER_MAX = 8;

#if __CUDA_ARCH__ >= 900
template <typename T, int HEAD_DIM, int THREADS>
__device__ __noinline__ void cluster_merge_tile(const DecodeParams& p, int b, int h_kv, int r0, int r_end, int rank,
                                                   u32 sO, u32 s_lse) {
    constexpr int CQ = HEAD_DIM / 4;
    const int S = p.num_splits, R = r_end - r0, G = p.head_group;
    for (int i = rank * THREADS + (int)threadIdx.x; i < R * CQ; i += S * THREADS) {
        const int rr = i / CQ, c = i % CQ;
        const int2 qh = divmod_rt(r0 + rr, G);
        const int qi = qh.x, head = h_kv * G + qh.y;
        const float sk2 = p.mask.sink_logits != nullptr ? p.mask.sink_logits[head] * CUFLASH_LOG2E : -CUFLASH_INF;
        // The S lse (their loads in flight together), their maximum, then the S partials weighted.
        float mx = sk2;
#pragma unroll
        for (int s = 0; s < CLUSTER_MAX; ++s)
            if (s < S) mx = fmaxf(mx, ld_cluster_f32(cluster_map(s_lse + 4 * rr, s)));
        const float base = exp_base(mx);
        float lt = fast_exp2(sk2 - base);
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int s = 0; s < CLUSTER_MAX; ++s) {
            if (s < S) {
                const float ws = fast_exp2(ld_cluster_f32(cluster_map(s_lse + 4 * rr, s)) - base);  // 0: no key
                const float4 v = ld_cluster_v4(cluster_map(sO + 4 * (rr * decode_o_pitch(HEAD_DIM) + 4 * c), s));
                lt += ws;
                acc.x += ws * v.x;
                acc.y += ws * v.y;
                acc.z += ws * v.z;
                acc.w += ws * v.w;
            }
        }
        const bool empty = lt == 0.f;
        const float inv = empty ? 0.f : 1.f / lt;
        acc.x *= inv;
        acc.y *= inv;
        acc.z *= inv;
        acc.w *= inv;
        T* gO = static_cast<T*>(p.o) + b * p.o_batch_stride + qi * p.o_row_stride + head * p.o_head_stride;
        u32* dst = reinterpret_cast<u32*>(gO + 4 * c);
        dst[0] = ElemOps<T>::pack(acc.x, acc.y);
        dst[1] = ElemOps<T>::pack(acc.z, acc.w);
        if (c == 0 && p.lse != nullptr)
            p.lse[((i64)b * p.nheads + head) * p.seqlen_q + qi] =
                empty ? -CUFLASH_INF : (base + fast_log2(lt)) * 0.6931471805599453f;
    }
}
#endif

template <typename T, int HEAD_DIM, int STAGES, int WARPS, bool TMA, bool GRP = false, int MT = 1, int HEADS = 1>
__global__ void __launch_bounds__(WARPS * 32)
flash_decode_kernel(const __grid_constant__ typename DecodeParamsOf<TMA>::type p) {
    using Tr = DecodeTraits<HEAD_DIM, STAGES, WARPS, TMA, MT>;
    using Ops = ElemOps<T>;
    constexpr int THREADS = Tr::THREADS, WN = Tr::WN, BN = Tr::BN, PITCH = Tr::PITCH, CHUNKS = Tr::CHUNKS;
    constexpr int D_TILES = Tr::D_TILES, N_TILES = WN / 8;
    // Several kv heads a block (HEADS > 1; Heads, above): a tile is KT keys of each of the block's
    // HEADS heads, head-major, and warp w serves head w / HEAD_WARPS at keys (w % HEAD_WARPS) * WN of
    // its KT.
    static_assert(HEADS == 1 || (TMA && !GRP && MT == 1 && WARPS % HEADS == 0), "several heads: the contiguous TMA kernel");
    constexpr int KT = BN / HEADS, HEAD_WARPS = WARPS / HEADS;

    extern __shared__ __align__(1024) unsigned char smem_raw[];
    T* sQ;  // (16 MT, PITCH)
    T* sK;  // STAGES x a tile
    T* sV;  // STAGES x a tile
    if constexpr (TMA) {
        T* base = reinterpret_cast<T*>(smem_raw + (((smem_addr(smem_raw) + 1023u) & ~1023u) - smem_addr(smem_raw)));
        sK = base;
        sV = sK + STAGES * Tr::SKV_ELEMS;
        sQ = sV + STAGES * Tr::SKV_ELEMS;
    } else {
        sQ = reinterpret_cast<T*>(smem_raw);
        sK = sQ + Tr::SQ_ELEMS;
        sV = sK + STAGES * Tr::SKV_ELEMS;
    }
    __shared__ float s_m[Tr::WARPS][16], s_l[Tr::WARPS][16], s_lp[Tr::WARPS][16], s_mx[16];
#if __CUDA_ARCH__ >= 900
    // The cluster merge is built (it runs where p.cluster_merge); not at head_dim 8, where its call
    // took a stack frame and spilled (sm_90a), and the host never asks (as for the fused combine).
    constexpr bool CLUSTER = HEAD_DIM >= 16 && MT == 1;  // (MT = 2: the host never asks)
    __shared__ float s_clse[16];    // the cluster merge: this split's log2-sum-exp of each row
#else
    constexpr bool CLUSTER = false;
    float* s_clse = nullptr;
#endif
    // TMA: stage s's tile landed (s_full[s]); on 8 warps (KV_APART) s_full[s] is its K and
    // s_full[STAGES + s] its V, so that a tile's S = Q K^T and softmax run while its V still arrives
    // (H200, session 48: 0.95-0.99 of the time of 8-warp plans at 64-128 blocks of 512-2048 keys; on
    // 4 warps, 1.003-1.017).
    constexpr bool KV_APART = TMA && WARPS == 8;
    constexpr int BARRIERS = KV_APART ? 2 * STAGES : STAGES;
    __shared__ alignas(8) unsigned long long s_full[TMA ? BARRIERS : 1];

    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, g = lane / 4, t4 = lane % 4;
#ifdef CUFLASH_DECODE_TIMELINE
    if (tid == 0) {
        DECODE_TL_GT(0);
        DECODE_TL_CLK(1);
        unsigned smid;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
        DECODE_TL(20, smid);
    }
#endif
    // The split tail (p.tail_first): row tiles before it in one block each (num_splits 1 for them),
    // the rest in num_splits blocks each, so that the blocks placed last are the short ones.
    const int bx = (int)blockIdx.x - p.tail_first;
    const int n_splits = bx < 0 ? 1 : p.num_splits;
    int2 split_rest = bx < 0 ? make_int2((int)blockIdx.x, 0) : divmod_rt(bx, p.num_splits);
    if (bx >= 0) split_rest.x += p.tail_first;
    const int2 tile_bh = divmod_rt(split_rest.x, p.num_row_tiles);
    const int2 b_h = divmod_rt(tile_bh.x, p.nheads_kv);
    const int split = split_rest.y, row_tile = tile_bh.y, h_kv = b_h.y, b = b_h.x;
    const int rest = split_rest.x;  // the row tile's index: its counter in the fused combine
    const int G = p.head_group;
    const int r0 = row_tile * Tr::ROWS;
    const int r_end = min(r0 + Tr::ROWS, p.rows);
    // Programmatic dependent launch (common.cuh). This kernel reads nothing an earlier kernel wrote
    // (the length first) before the previous grid is done. Where the combine kernel follows, it may
    // be scheduled as soon as every block of this one runs. Nowhere else: the kernel after a call's
    // last one is the caller's (the next call's, in a loop of decode calls), and its blocks, placed
    // on the SMs while these run, sat two on some SMs and none on others, where the split rule puts
    // one on each (H100, session 15: 16 x 8192 x 8, 128 blocks, 98.7 -> 111.0 us per call).
    if (p.num_splits > 1 && p.split_counters == nullptr && !p.cluster_merge) pdl_launch_dependents();
    // "This call's kernel has begun", for the host's next call (DecodeParams::started): the last
    // block, the last to be placed, so the whole grid is on the SMs.
    if (p.seq != 0 && tid == 0 && blockIdx.x == gridDim.x - 1)
        *reinterpret_cast<volatile unsigned long long*>(p.started) = p.seq;
    // GRP: a kernel of its own for a paged cache read through TMA in 16-key groups (the host takes it
    // for exactly those calls), where paged and groups are constants. Below, tests that could read
    // `paged` spell out p.page_size as the shared kernels always did: written as `paged`, ptxas
    // scheduled those kernels differently (session 62; their SASS is kept as measured).
    static_assert(!GRP || TMA, "GRP: the TMA kernel's 16-key groups");
    const bool paged = GRP || p.page_size != 0;
    // A paged cache through TMA: whole tiles (page_tiles: every tile lies in one page, and thread 0
    // issues it as the contiguous path does, from the block of the tile's first key), or 16-key
    // groups (each warp's lane 0 issues its own group's boxes).
    const bool whole = !GRP && TMA && paged && p.page_tiles != 0;
    const bool groups = GRP || (paged && !whole);
    // The late issue (late_issue): two tiles in flight while a tile is waited for and computed, where
    // the issue at the loop's top keeps three in flight while the block waits (the memory the limit).
    const bool late = TMA && STAGES >= 3 && !paged && p.late_issue != 0;
    // TMA: the maps and the barriers, ahead of pdl_wait (they read nothing another kernel writes), so
    // that a call launched as a programmatic dependent issues its first copies as soon as it may.
    if constexpr (TMA) {
        if (tid == 0) {
            tma_prefetch_desc(&p.map_k);
            tma_prefetch_desc(&p.map_v);
#pragma unroll
            for (int st = 0; st < BARRIERS; ++st) mbar_init(smem_addr(&s_full[st]), groups ? WARPS : 1);
            fence_mbar_init();
            DECODE_TL_CLK(31);
        }
    }
    pdl_wait();
    if (tid == 0) DECODE_TL_CLK(2);
    // The entry's length, loaded now and clamped below the early copies (which do not need it).
    const int L_raw = decode_length_raw(p, b);
    const int* table_row = p.block_table != nullptr ? p.block_table + b * p.table_stride : nullptr;
    const bool early = TMA && split == 0 && p.mask.window_left < 0 && p.cache_batch_idx == nullptr;
    // A paged cache's (block, row) pair: the table entry (clamped into the cache) and the key's row in
    // its page. page_of(key): (the key's table index, its row), one division through divmod_rt (an
    // int division by the runtime page_size is about 20 dependent instructions; the lookup lanes run
    // one per tile, off the issuing lanes' path).
    auto page_of = [&](int key) { return divmod_rt(key, p.page_size); };
    auto page_pair = [&](int entry, int row) { return make_int2(min(max(entry, 0), p.cache_rows - 1), row); };
    // Who issues which keys, and who looks them up. Issue: warp g's lane 0 issues group g (16-key
    // groups), or warp 0's lane 0 the whole tile (from its first key). Lookups in the loop: the last
    // warp's lanes, lane g for group g (or lane 0 for a whole tile), so that the table's loads and
    // the divisions stay off the issuing lanes' path and run as one warp's SIMT step.
    const int issue_off = whole ? 0 : 16 * warp;  // the first key of this warp's group in a tile
    const bool looks_up = warp == WARPS - 1 && lane < (whole ? 1 : BN / 16);
    const int look_off = whole ? 0 : 16 * lane;   // ... and of the looking-up lane's group
    constexpr int EARLY = STAGES - 1;  // tiles issued early
    // A paged cache's first table entries (tiles 0 .. EARLY - 1 by the issuing lanes, tiles EARLY and
    // STAGES by the lookup lanes). On 8 warps (one block an SM) they are loaded here, ahead of Q's
    // copies, so that the first tiles' copies do not wait for Q's address arithmetic and copies as
    // well as the table; the 4-warp kernels load them after Q's copies (below: the early block).
    constexpr bool ENTRIES_FIRST = TMA && WARPS == 8;
    const bool issues = lane == 0 && (!whole || warp == 0);
    int row[STAGES + 1], entry[STAGES + 1];
    auto load_entries = [&]() {
        if (issues) {
#pragma unroll
            for (int j = 0; j < EARLY; ++j) {
                const int2 ir = page_of(min(j * BN + issue_off, p.capacity - 1));
                row[j] = ir.y;
                entry[j] = table_row[ir.x];
            }
        }
        if (looks_up) {
#pragma unroll
            for (int j = EARLY; j <= STAGES; ++j) {
                const int2 ir = page_of(min(j * BN + look_off, p.capacity - 1));
                row[j] = ir.y;
                entry[j] = table_row[ir.x];
            }
        }
    };
    if (ENTRIES_FIRST && early && paged) load_entries();

    // ---- Q: the 16 MT packed rows (zeros past the last), in the first cp.async group ----
    {
        const T* gQ = static_cast<const T*>(p.q) + b * p.q_batch_stride;
        constexpr int Q_STEPS = (Tr::ROWS * CHUNKS + THREADS - 1) / THREADS;
#pragma unroll
        for (int i = 0; i < Q_STEPS; ++i) {
            const int c = tid + i * THREADS;
            if ((Tr::ROWS * CHUNKS) % THREADS == 0 || c < Tr::ROWS * CHUNKS) {
                const int rr = c / CHUNKS, col = (c % CHUNKS) * 8, r = r0 + rr;
                const bool ok = r < r_end;
                const int2 qh = divmod_rt(ok ? r : 0, G);
                cp_async_16(smem_addr(sQ + rr * PITCH + col),
                            gQ + qh.x * p.q_row_stride + (h_kv * G + qh.y) * p.q_head_stride + col, ok ? 16 : 0);
            }
        }
    }

    if (tid == 0) DECODE_TL_CLK(30);
    // ---- TMA: (where they are known already) the first tiles' copies ----
    // The tiles start at key 0 wherever the keys begin at 0 and the block is the first split (no
    // window; a contiguous cache: the entry's own cache row): then the pipeline's first STAGES - 1
    // copies go out (their barriers made before pdl_wait) before the mask and key arithmetic below,
    // which need the entry's length (a paged cache's after their table entries, with those of the
    // next two tiles). Tiles the block then
    // does not have are waited for before their stages are reused (the merge), and rows past the
    // length are treated as those of any tile (the loop zeroes the last tile's V rows past the
    // chunk). H200, 128 blocks of 512 keys, 16-row pages: 12.5 us per call with the first tile alone
    // issued early (paged), 10.3 contiguous. The length is loaded at the top, ahead of Q's copies,
    // and clamped only after this block, and Q's rows take no int division (divmod_rt), so the
    // early copies wait for neither the length nor Q's address arithmetic (session 13's source
    // counters found them waiting for both: ptxas had clamped the length right after its load, and
    // the Q loop's runtime divisions came first). A paged block's first table entries are loaded
    // after Q's copies on 4 warps (load_entries, above: ahead of them, they read 0.2-0.4 us faster at
    // latency-bound shapes but 2 % slower at bandwidth-bound paged ones, session 14, when the 8-warp
    // kernel took 192 registers instead of 165), ahead of them on 8. (Loaded after the early block,
    // a paged block waited for the table entries, then for the length: H100, 128 blocks of 512 keys,
    // 16-row pages, 13.2 us against 11.7 without the early copies.)
    const u32 tile_bytes = 2u * Tr::SKV_ELEMS * sizeof(T);
    auto tma_contig = [&](int stage, int key, int row) {  // a contiguous cache's tile, by one thread
        if constexpr (TMA) {
            const u32 dK = smem_addr(sK + stage * Tr::SKV_ELEMS), dV = smem_addr(sV + stage * Tr::SKV_ELEMS);
            if constexpr (KV_APART) {
                const u32 barK = smem_addr(&s_full[stage]), barV = smem_addr(&s_full[STAGES + stage]);
                mbar_arrive_expect_tx(barK, tile_bytes / 2);
#pragma unroll
                for (int c = 0; c < HEAD_DIM / 64; ++c)
                    tma_load_4d(dK + c * BN * 128, &p.map_k, barK, 64 * c, key, HEADS * h_kv, row);
                mbar_arrive_expect_tx(barV, tile_bytes / 2);
#pragma unroll
                for (int c = 0; c < HEAD_DIM / 64; ++c)
                    tma_load_4d(dV + c * BN * 128, &p.map_v, barV, 64 * c, key, HEADS * h_kv, row);
            } else {
                const u32 bar = smem_addr(&s_full[stage]);
                mbar_arrive_expect_tx(bar, tile_bytes);
#pragma unroll
                for (int c = 0; c < HEAD_DIM / 64; ++c) {
                    tma_load_4d(dK + c * BN * 128, &p.map_k, bar, 64 * c, key, HEADS * h_kv, row);
                    tma_load_4d(dV + c * BN * 128, &p.map_v, bar, 64 * c, key, HEADS * h_kv, row);
                }
            }
        }
    };
    // Tiles of 16-key groups at head_dim 128 (GROUP_BOX) are group-major: group g's 16 rows of both
    // panels at g * GROUP_BYTES, panel after panel (2 KB each, SW128), as one 5-D box fills them
    // (cuflash/_tma.py kv_map with panels=2), one copy per group and tensor where a box per panel
    // took two: a 64-key tile is 8 copies instead of 16. Every other tile is panel-major
    // (decode_sw128<BN>). kv_off(r, c): the byte offset of chunk c of row r of this warp's 16 keys.
    constexpr bool GROUP_BOX = TMA && HEAD_DIM == 128;
    constexpr u32 GROUP_BYTES = 16 * HEAD_DIM * 2;
    const bool gmajor = GROUP_BOX && groups;
    const u32 kv_wbase = gmajor ? warp * GROUP_BYTES : warp * WN * 128;
    const u32 kv_pstride = gmajor ? 16 * 128 : BN * 128;
    auto kv_off = [&](int r, int c) -> u32 {
        return kv_wbase + (c >> 3) * kv_pstride + r * 128 + (((c & 7) ^ (r & 7)) << 4);
    };
    auto tile_off = [&](int r, int c) -> u32 {  // chunk c of row r of the tile
        if (gmajor)
            return (u32)((r >> 4) * GROUP_BYTES + (c >> 3) * (16 * 128) + (r & 15) * 128 + (((c & 7) ^ (r & 7)) << 4));
        return decode_sw128<BN>(r, c);
    };
    auto tma_group = [&](int stage, int2 br) {  // this warp's 16 keys of a paged tile, by lane 0
        if constexpr (TMA) {
            const u32 barK = smem_addr(&s_full[stage]), barV = smem_addr(&s_full[KV_APART ? STAGES + stage : stage]);
            const u32 dK = smem_addr(sK + stage * Tr::SKV_ELEMS), dV = smem_addr(sV + stage * Tr::SKV_ELEMS);
            if constexpr (KV_APART) {
                mbar_arrive_expect_tx(barK, tile_bytes / 2 / WARPS);
                mbar_arrive_expect_tx(barV, tile_bytes / 2 / WARPS);
            } else {
                mbar_arrive_expect_tx(barK, tile_bytes / WARPS);
            }
            if constexpr (GROUP_BOX) {  // one 5-D box per group: both panels, group-major (kv_off)
                const u32 off = warp * GROUP_BYTES;
                tma_load_5d(dK + off, &p.map_k, barK, 0, br.y, 0, h_kv, br.x);
                tma_load_5d(dV + off, &p.map_v, barV, 0, br.y, 0, h_kv, br.x);
            } else {
#pragma unroll
                for (int c = 0; c < HEAD_DIM / 64; ++c)
                    tma_load_4d(dK + c * BN * 128 + warp * 16 * 128, &p.map_k, barK, 64 * c, br.y, h_kv, br.x);
#pragma unroll
                for (int c = 0; c < HEAD_DIM / 64; ++c)
                    tma_load_4d(dV + c * BN * 128 + warp * 16 * 128, &p.map_v, barV, 64 * c, br.y, h_kv, br.x);
            }
        }
    };
    constexpr int GROUPS = BN / 16;   // a paged tile's 16-key groups: warp g's keys
    static_assert(GROUPS == WARPS && STAGES <= 32, "a group per warp; a lane per first tile");
    __shared__ int2 s_blk[TMA ? STAGES : 1][GROUPS];  // (block, row) of each group of the next tiles
    int pend_row = 0, pend_entry = 0;  // paged, looks_up: a later tile's row and table entry, in flight
    if constexpr (TMA) {
        // (Thread 0's copies of the first tiles issued ahead of its share of Q's: Q then landed after
        // the first tile, and the loop began 0.25-0.4 us later; H200, session 48.)
        if (tid == 0 && early && !paged) {
#pragma unroll
            for (int st = 0; st < EARLY; ++st) tma_contig(st, st * KT, b);
            DECODE_TL_CLK(3);
        }
        if (early && paged) {
            // Tiles 0 .. EARLY - 1: issued by the issuing lanes; tiles EARLY and STAGES: into the
            // ring, and in flight for iteration 0, by the lookup lanes.
            if (!ENTRIES_FIRST) load_entries();
            __syncthreads();  // the barriers' init, before every warp arms one
            if (issues) {
#pragma unroll
                for (int st = 0; st < EARLY; ++st) {
                    const int2 br = page_pair(entry[st], row[st]);
                    if (whole)
                        tma_contig(st, br.y, br.x);
                    else
                        tma_group(st, br);
                }
            }
            if (looks_up) {
                s_blk[EARLY][lane] = page_pair(entry[EARLY], row[EARLY]);  // issued in iteration 0
                pend_row = row[STAGES];                                    // stored in iteration 0
                pend_entry = entry[STAGES];
            }
            if (tid == 0) DECODE_TL_CLK(3);
        }
    }

    // ---- the entry, its mask, and the keys this block's rows may see ----
    const int L = decode_length_clamp(p, L_raw);
    MaskInfo mi;
    mi.sq = p.seqlen_q;
    mi.sk = L;
    mi.shift = L - p.seqlen_q;
    mi.alibi_log2 = 0.f;
    const int qi0 = divmod_rt(r0, G).x, qi1 = divmod_rt(r_end - 1, G).x;
    const int hi = mi.key_hi(p.mask, qi1);
    int lo = mi.key_lo(p.mask, qi0);
    // A paged cache read through TMA loads 16-key groups, one box each, or whole tiles (page_tiles),
    // which must not straddle a page (page_size is a multiple of 16, or of BN for whole tiles): the
    // keys start at a multiple of 16, or of BN (the ones added in front are before every row's
    // window, and the mask drops them; the chunks of the splits are whole tiles).
    if (TMA && (GRP || p.page_size != 0)) lo &= whole ? ~(BN - 1) : ~15;
    const int sink_hi = p.mask.window_left < 0 ? 0 : min(p.mask.num_sink_tokens, hi);
    int n_sink = 0;  // virtual keys [0, n_sink) are keys [0, n_sink); the rest map to lo + (v - n_sink)
    if (lo <= sink_hi) lo = 0; else n_sink = sink_hi;
    const int n_keys = n_sink + max(0, hi - lo);
    const int key_off = lo - n_sink;
    // (KT = BN keys a tile, or with HEADS > 1 KT keys of each head: the chunks are whole tiles of a head)
    const int chunk = ((n_keys + n_splits - 1) / n_splits + KT - 1) / KT * KT;
    const int v_begin = min(split * chunk, n_keys);
    const int v_end = min(v_begin + chunk, n_keys);
    const int n_tiles = (v_end - v_begin + KT - 1) / KT;

    const T* gK = static_cast<const T*>(p.k) + h_kv * p.k_head_stride;
    const T* gV = static_cast<const T*>(p.v) + h_kv * p.v_head_stride;
    const int cache_row = GRP ? 0 : decode_cache_row(p, b);

    // Copies. Consecutive threads copy consecutive 16-byte chunks of a key row, so one warp
    // instruction moves whole rows (coalesced). Where head_dim's chunks divide the block's threads
    // (LANE_ROWS: head_dim 16, 32, 64 or 128), a thread keeps one column chunk and walks rows my_row,
    // my_row + RPP, ... of every tile; its shared-memory addresses are fixed per stage.
    //   Affine tiles (a contiguous cache, and no boundary between the sink tokens and the window's
    //   span inside the tile): the tile's keys are consecutive rows of the cache, and a thread walks
    //   them with one pointer per tensor: no table, no per-row arithmetic.
    //   Other tiles (paged caches, the tile at the sink boundary; and every tile without LANE_ROWS):
    //   where each key row lives is worked out once, by one thread per (row, K or V), into a ring of
    //   STAGES offset tables (-1: past the chunk, zero-filled); tile j's table is written in iteration
    //   j - STAGES and read (after the next block barrier) when tile j's copy is issued.
    // Keys past the chunk land as zeros either way (their P is 0, and 0 * V must not meet garbage).
    __shared__ i64 s_off[TMA ? 1 : STAGES][2][BN];
    static_assert(THREADS == 2 * BN, "one thread per (key row, K or V)");
    // (Not above head_dim 128, whose kernel is at 255 registers: ptxas spilled there on sm_90a.)
    constexpr bool LANE_ROWS = THREADS % CHUNKS == 0 && THREADS / CHUNKS <= BN && HEAD_DIM <= 128;
    constexpr int RPP = LANE_ROWS ? THREADS / CHUNKS : 1;  // rows per pass of the block
    constexpr int PASSES = BN / RPP;
    static_assert(BN % RPP == 0, "a tile is whole passes");
    constexpr u32 STAGE_BYTES = Tr::SKV_ELEMS * sizeof(T);
    // The L2 fetches a whole cache row (2 * head_dim bytes, at most 256) from memory at the first
    // request to it (measured at head_dim 128 on an H100: 2 % at batch 64, 8k keys, GQA 1).
    constexpr int PREFETCH = HEAD_DIM >= 128 ? 256 : (HEAD_DIM >= 64 ? 128 : 64);
    const int my_row = LANE_ROWS ? tid / CHUNKS : 0;
    const int my_col = LANE_ROWS ? (tid % CHUNKS) * 8 : 0;
    const u32 sK_lane = smem_addr(sK) + 2u * (my_row * PITCH + my_col);
    const u32 sV_lane = smem_addr(sV) + 2u * (my_row * PITCH + my_col);
    const bool contiguous = !GRP && p.page_size == 0;
    const T* gK_lane = gK + my_col + (contiguous ? cache_row * p.k_batch_stride : 0);
    const T* gV_lane = gV + my_col + (contiguous ? cache_row * p.v_batch_stride : 0);
    const i64 k_pass = RPP * p.k_row_stride, v_pass = RPP * p.v_row_stride;
    auto affine = [&](int it) {
        const int v0 = v_begin + it * BN;
        return LANE_ROWS && contiguous && (v0 >= n_sink || min(v0 + BN, v_end) <= n_sink);
    };
    auto tile_offsets = [&](int it) {
        const int row = tid % BN, which = tid / BN;
        const int vv = v_begin + it * BN + row;
        i64 off = -1;
        if (vv < v_end) {
            const int key = vv < n_sink ? vv : vv + key_off;
            off = which == 0 ? cache_offset(p, p.k_batch_stride, p.k_row_stride, cache_row, table_row, key)
                             : cache_offset(p, p.v_batch_stride, p.v_row_stride, cache_row, table_row, key);
        }
        s_off[it % STAGES][which][row] = off;
    };
    auto load_tile = [&](int it) {
        const int stage = it % STAGES;
        if constexpr (LANE_ROWS) {
            const u32 dK = sK_lane + stage * STAGE_BYTES, dV = sV_lane + stage * STAGE_BYTES;
            const int v0 = v_begin + it * BN;
            if (affine(it)) {
                const int key = (v0 < n_sink ? v0 : v0 + key_off) + my_row;
                const T* srcK = gK_lane + key * p.k_row_stride;
                const T* srcV = gV_lane + key * p.v_row_stride;
                const int left = v_end - v0 - my_row;  // pass i's row is in the chunk while i * RPP < left
#pragma unroll
                for (int i = 0; i < PASSES; ++i) {
                    const bool ok = i * RPP < left;
                    cp_async_16_l2<PREFETCH>(dK + i * RPP * PITCH * 2, ok ? srcK : gK_lane, ok ? 16 : 0);
                    cp_async_16_l2<PREFETCH>(dV + i * RPP * PITCH * 2, ok ? srcV : gV_lane, ok ? 16 : 0);
                    srcK += k_pass;
                    srcV += v_pass;
                }
            } else {
                const T* gKc = gK + my_col;
                const T* gVc = gV + my_col;
#pragma unroll
                for (int i = 0; i < PASSES; ++i) {
                    const i64 ko = s_off[stage][0][my_row + i * RPP], vo = s_off[stage][1][my_row + i * RPP];
                    cp_async_16_l2<PREFETCH>(dK + i * RPP * PITCH * 2, gKc + (ko < 0 ? 0 : ko), ko < 0 ? 0 : 16);
                    cp_async_16_l2<PREFETCH>(dV + i * RPP * PITCH * 2, gVc + (vo < 0 ? 0 : vo), vo < 0 ? 0 : 16);
                }
            }
        } else {
            T* dK = sK + stage * Tr::SKV_ELEMS;
            T* dV = sV + stage * Tr::SKV_ELEMS;
#if __CUDA_ARCH__ >= 900
#pragma unroll 4
#else
#pragma unroll 2  // sm_80's ptxas keeps head_dim 64 at 128 registers and spills with 4
#endif
            for (int i = 0; i < (BN * CHUNKS + THREADS - 1) / THREADS; ++i) {
                const int c = tid + i * THREADS;
                if ((BN * CHUNKS) % THREADS == 0 || c < BN * CHUNKS) {
                    const int row = c / CHUNKS, col = (c % CHUNKS) * 8;
                    const i64 ko = s_off[stage][0][row], vo = s_off[stage][1][row];
                    cp_async_16(smem_addr(dK + row * PITCH + col), gK + (ko < 0 ? 0 : ko) + col, ko < 0 ? 0 : 16);
                    cp_async_16(smem_addr(dV + row * PITCH + col), gV + (vo < 0 ? 0 : vo) + col, vo < 0 ? 0 : 16);
                }
            }
        }
    };

    // TMA (contiguous caches without a sink boundary: every tile is affine): thread 0 issues one box
    // per 64-column panel of K and of V for the tile's BN keys from key v0 + key_off, completing on
    // the stage's s_full barrier (KV_APART: K's and V's), at the same points where the cp.async path
    // issues its copies. Cache rows past the capacity land as zeros; rows past the chunk but inside
    // the capacity (the cache beyond an entry's length) are garbage, so the last tile's V rows past
    // the chunk are zeroed in shared memory before use (its K rows only give scores that the mask
    // drops).
    //   A paged cache: the maps describe (num_blocks, page_size, nheads_kv, head_dim) with 16-row
    //   boxes, and a tile is BN / 16 boxes per panel, group g's from block table_row[key / page_size]
    //   (clamped), row key % page_size; at head_dim 128 one 5-D box per group and tensor for both
    //   panels (GROUP_BOX; H200, session 30, 16-row pages, paged / contiguous at 1 x 8k x 1, 4 x 8k x
    //   4, 1 x 32k x 4 and 16 x 8k x 8: 1.11-1.13 with a box per panel, 1.05-1.08 with one per group).
    //   Group g is warp g's 16 keys, and lane 0 of warp g does all of its work: it arms the stage's
    //   barrier for the group's bytes (the barrier expects one arrival per warp) and issues the group's
    //   boxes, so no warp issues more than one group's copies (warp 0 issuing all 32 boxes of a 128-key
    //   tile at head_dim 128, the other warps waiting for it at the next barrier, took 14.1 us on an
    //   H100 at 128 blocks of 512 keys against 10.6 contiguous; a kernel that only reads the same pages
    //   took 7.4 against 6.7; on an H200 in session 30, warp 0's lanes issuing every group's boxes at
    //   once slowed the 4-warp plans by about 15 %). The (block, row) pairs go through the ring s_blk,
    //   STAGES tiles ahead, and the table itself is read one iteration earlier still, into a register:
    //   tile j's entry is loaded in iteration j - STAGES - 1 and stored into s_blk in iteration j -
    //   STAGES, after the slot's pairs were read (at the issue of tile j - STAGES, in iteration j - 2 *
    //   STAGES + 1, before the block barriers in between), so the table's latency stays off the loop's
    //   path. In the loop the last warp does every lookup, lane g for group g: the issuing lanes only
    //   read their pair and issue. Before the loop, lane st < STAGES of warp g looks up tile st's group
    //   g (or, issuing early, the issuing lanes look up their first tiles).
    //   Whole paged tiles (page_tiles: page_size a multiple of BN, and the keys start at a multiple
    //   of BN, so a tile lies in one page): the maps' boxes are BN rows, and warp 0's lane 0 issues
    //   each tile as the contiguous path does, from the pair in slot 0 (the tile's first key); the
    //   barrier expects its one arrival; the last warp's lane 0 does slot 0's lookups. (Session 29,
    //   H200, 128 blocks of 8k keys: a paged cache read 1.17x the contiguous time with the pages in
    //   order, the same addresses, and with pages of 32k rows, the same boxes; the lookups on the
    //   issuing lane's path, with two int divisions each, were the difference.)
    auto lookup_load = [&](int it) {
        if constexpr (TMA) {
            if (looks_up) {
                const int2 ir = page_of(min(v_begin + it * BN + key_off + look_off, p.capacity - 1));
                pend_row = ir.y;
                pend_entry = table_row[ir.x];
            }
        }
    };
    auto lookup_store = [&](int it) {
        if constexpr (TMA) {
            if (looks_up) s_blk[it % STAGES][lane] = page_pair(pend_entry, pend_row);
        }
    };
    auto tma_tile = [&](int it) {  // contiguous and whole paged tiles: by warp 0; 16-key groups: by every warp
        if constexpr (TMA) {
            if (lane != 0) return;
            if (groups)
                tma_group(it % STAGES, s_blk[it % STAGES][warp]);
            else if (whole)  // warp 0's pair: the tile's first key
                tma_contig(it % STAGES, s_blk[it % STAGES][0].y, s_blk[it % STAGES][0].x);
            else
                tma_contig(it % STAGES, v_begin + it * KT + key_off, cache_row);
        }
    };

    if constexpr (TMA) {
        if (paged && !early) {
            if (STAGES < n_tiles) lookup_load(STAGES);
            if (lane < STAGES && lane < n_tiles) {  // lane st: tile st's group
                const int2 ir = page_of(min(v_begin + lane * BN + key_off + issue_off, p.capacity - 1));
                s_blk[lane][warp] = page_pair(table_row[ir.x], ir.y);
            }
        }
        __syncthreads();
        if (!early && (groups || warp == 0))
            for (int st = 0; st < EARLY && st < n_tiles; ++st) tma_tile(st);
        cp_async_commit();  // Q's group
    } else {
        for (int st = 0; st < STAGES; ++st)
            if (st < n_tiles && !affine(st)) tile_offsets(st);
        __syncthreads();
#pragma unroll
        for (int st = 0; st < STAGES - 1; ++st) {
            if (st < n_tiles) load_tile(st);
            cp_async_commit();
        }
    }

    // ---- per-row facts of this thread's rows (g, g + 8 of each m-tile): key span, ALiBi slope ----
    // (HEADS > 1: mine_row, whether a row is a query head of this warp's kv head, for the plain range;
    // the warp's scores of the other heads' rows are dropped at the merge.)
    auto mine_row = [&](int row) {
        return HEADS == 1 || divmod_rt(divmod_rt(row, G).y, G / HEADS).x == warp / HEAD_WARPS;
    };
    KeySpan span[MT][2];
    float alibi[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = r0 + 16 * mt + g + 8 * r;
        if (row < r_end) {
            const int2 qh = divmod_rt(row, G);
            span[mt][r] = mi.key_span(p.mask, qh.x);
            const int head = h_kv * G + qh.y;
            alibi[mt][r] = p.mask.alibi_slopes != nullptr
                               ? p.mask.alibi_slopes[(i64)b * p.mask.alibi_batch_stride + head] * CUFLASH_LOG2E : 0.f;
        } else {
            span[mt][r].lo = INT_HIGHEST;
            span[mt][r].hi = INT_LOWEST;  // a padding row sees nothing
            alibi[mt][r] = 0.f;
        }
    }
    const bool score_mod = p.mask.softcap > 0.f || p.mask.alibi_slopes != nullptr;

    // A warp's scores need the element-wise mask and score modification only where some valid row
    // may not see a key of its 16, or softcap / ALiBi apply; elsewhere (most tiles of a plain
    // decode) they are only scaled. Padding rows (zero Q, never written) do not count.
    bool pad[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) pad[mt][r] = r0 + 16 * mt + g + 8 * r >= r_end;

    // Q as mma A fragments, loaded from shared memory once (at the first tile) where head_dim is a
    // multiple of 16 from 64 (at 32, ptxas spilled); otherwise warp_mma reads sQ at every tile. Two
    // m-tiles (MT = 2) load each k-step's fragments at every tile: kept, they would take 64 registers.
    constexpr bool Q_REGS = HEAD_DIM % 16 == 0 && HEAD_DIM >= 64 && MT == 1;
    u32 qa[Q_REGS ? HEAD_DIM / 16 : 1][4];

    // The tile step, in two forms. The TMA kernels (session 54; with the ldmatrix addresses below, this
    // took the warp instructions issued per 16 keys from 384 to 183: Nsight Compute's source counters,
    // 16 x 32k x 4, H200; the 4-warp kernel no longer slows down at a low SM clock, bench/NOTES.md):
    //   - the tile is "plain" (no element-wise mask, no score modification) where its first virtual
    //     key lies in [plain_lo, plain_hi], a range worked out once for the warp;
    //   - each p takes one fma, exp2(fma(s, sc, -base)) (prepare_in_place), sc the scale on plain
    //     tiles and 1 on the others (whose logits the mask step leaves in log2 units);
    //   - l is this thread's share (a quad sum at the end), and lp the row sums of the rounded P on the
    //     tensor cores, P times ones (acc_lp: LP_TENSOR), one mma a tile.
    // The cp.async kernels keep the earlier form: a vote per tile for "plain", a scaling pass, then
    // prepare and the per-tile quad sums of l and lp (LP_QUAD). With the new form's registers (the
    // range, acc_lp, the scale), ptxas held the head_dim 16 and the 8-warp head_dim 80 kernels at 80
    // and 128 registers and spilled (sm_90a).
    constexpr int LP = TMA ? LP_TENSOR : LP_QUAD;
    OnlineSoftmax<Ops, MT, N_TILES, LP> softmax;
    softmax.init();
    float acc_o[MT][D_TILES][4], acc_lp[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int dt = 0; dt < D_TILES; ++dt)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_o[mt][dt][e] = 0.f;
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_lp[mt][e] = 0.f;
    }
    // The TMA kernels' plain range: virtual keys [vw0, vw0 + 16) need no mask where they lie past the
    // sink tokens, inside the chunk and inside the key span of every valid row of the warp (padding
    // rows do not count), and no tile does with a score modification.
    int plain_lo = 0, plain_hi = -1;
    if constexpr (TMA) {
        int lo_w = INT_LOWEST, hi_w = INT_HIGHEST;
        bool own = false;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int r = 0; r < 2; ++r)
                if (!pad[mt][r] && mine_row(r0 + 16 * mt + g + 8 * r)) {
                    own = true;
                    lo_w = max(lo_w, span[mt][r].lo);
                    hi_w = min(hi_w, span[mt][r].hi);
                }
#pragma unroll
        for (int o = 1; o < 32; o *= 2) {
            lo_w = max(lo_w, __shfl_xor_sync(0xffffffffu, lo_w, o));
            hi_w = min(hi_w, __shfl_xor_sync(0xffffffffu, hi_w, o));
        }
        // (Row r0 is valid, so the warp has a valid row and lo_w, hi_w are a row's: no overflow. With
        // HEADS > 1 the host keeps the rows to one row tile, where each head has seqlen_q x G / HEADS
        // rows; a warp with none of its own, were there one, would take no tile as plain.)
        const bool none = HEADS > 1 && !__any_sync(0xffffffffu, own);
        plain_lo = none ? 0 : max(n_sink, lo_w - key_off);
        plain_hi = score_mod || none ? INT_LOWEST : min(v_end, hi_w - key_off) - WN;
    }

    // The epilogue's parameters lie in two 64-byte lines of the constant bank (o, lse, o_part,
    // lse_part, nheads; the o strides), and each line misses at a block's first read. One field of
    // each is read here, while the first tiles' copies are in flight, so that the writes after the
    // last tile find them cached (the prologue's lines: DecodeParams). The compare keeps the loads (a
    // store that never happens: o is an address, o_row_stride a row's element stride). The TMA kernels
    // only, where it was measured (H200, session 46: 0.988-0.997 of the time of latency-bound decodes);
    // at head_dim 16 the cp.async kernel spilled with it (sm_90a).
    if constexpr (TMA)
        asm volatile("{\n\t.reg .pred q;\n\tsetp.eq.u64 q, %0, %1;\n\t@q st.shared.u32 [%2], 0;\n\t}"
                     :: "l"(reinterpret_cast<unsigned long long>(p.o)), "l"(p.o_row_stride),
                        "r"(smem_addr(&s_m[warp][0]))
                     : "memory");
    // TMA: the chunk's last tile's V rows past the chunk (cache rows beyond the entry's length) zeroed
    // once they landed, before P V reads them (block-uniform: a block barrier follows).
    // (HEADS > 1: rows valid .. KT - 1 of each head's KT.)
    auto zero_v_tail = [&](int stage, int it) {
        const int valid = v_end - (v_begin + it * KT);
        if (valid < KT) {
            const u32 tV = smem_addr(sV + stage * Tr::SKV_ELEMS);
            for (int c = tid; c < HEADS * (KT - valid) * CHUNKS; c += THREADS) {
                int r = valid + c / CHUNKS;  // (HEADS = 1: the tile's row)
                if constexpr (HEADS > 1) r = (c / CHUNKS) / (KT - valid) * KT + valid + (c / CHUNKS) % (KT - valid);
                asm volatile("st.shared.v4.b32 [%0], {%1, %1, %1, %1};"
                             :: "r"(tV + tile_off(r, c % CHUNKS)), "r"(0u) : "memory");
            }
            __syncthreads();
        }
    };
    if constexpr (TMA) cp_async_wait<0>();  // Q (visible to all after the loop's first barrier)
    // TMA: each lane's ldmatrix addresses, worked out once. Lane (lrow, li) reads row lrow + 8 (li / 2)
    // of chunk 2 kc + li % 2 for K (S = Q K^T) and row lrow + 8 (li % 2) of chunk 2 dp + li / 2 for V
    // (P V). The SW128 swizzle XORs the chunk's bits 4-6 of the byte offset with the row's low 3 bits,
    // and a chunk 2j + b (j < 4, b < 2) differs from chunk b only in bits 5-6 (2j), so kv_off(r, 2j + b)
    // = kv_off(r, b) ^ (j << 5); chunks from 8 on lie a panel (kv_pstride) further. In the loop an
    // address is then the stage's base (warp-uniform) plus one of these registers. (Worked out at every
    // ldmatrix, the swizzle took about 100 of the 384 instructions a warp issued per 16 keys.)
    const int lrow = lane % 8, li = lane / 8;
    u32 k_lane[4], v_lane[4];
    {
        const u32 k0 = kv_off(lrow + (li / 2) * 8, li % 2), v0 = kv_off(lrow + (li % 2) * 8, li / 2);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            k_lane[j] = k0 ^ (u32)(j << 5);
            v_lane[j] = v0 ^ (u32)(j << 5);
        }
    }
    // Shared-memory addresses of the stages and barriers (each conversion from a generic pointer is
    // several instructions: out of the loop).
    const u32 sK_base = smem_addr(sK), sV_base = smem_addr(sV);
    const u32 full_base = TMA ? smem_addr(&s_full[0]) : 0u;
    if (tid == 0) {
        DECODE_TL_CLK(4);
        DECODE_TL(21, (unsigned long long)n_tiles);
    }
    for (int it = 0; it < n_tiles; ++it) {
        const int stage = it % STAGES;
        if constexpr (TMA) {
            __syncthreads();  // every warp is done with tile it - 1, whose stage tile it + STAGES - 1 takes
            if ((groups || (warp == 0 && !late)) && it + STAGES - 1 < n_tiles) tma_tile(it + STAGES - 1);
            if (tid == 0 && it == 1) DECODE_TL_CLK(23);
            // Lookups: the slot's pairs were read at the issue in iteration it - STAGES + 1 (a barrier since).
            if (paged && it + STAGES < n_tiles) {
                lookup_store(it + STAGES);
                if (it + STAGES + 1 < n_tiles) lookup_load(it + STAGES + 1);
            }
            mbar_wait(full_base + 8u * stage, (it / STAGES) & 1);  // the tile (KV_APART: its K)
            if (late && warp == 0 && it + STAGES - 1 < n_tiles) tma_tile(it + STAGES - 1);  // (its stage free)
            if (tid == 0 && it < 8) DECODE_TL_CLK(5 + it);
            if constexpr (!KV_APART) zero_v_tail(stage, it);
        } else {
            cp_async_wait<STAGES - 2>();
            __syncthreads();
            if (it + STAGES - 1 < n_tiles) load_tile(it + STAGES - 1);
            cp_async_commit();
            if (it + STAGES < n_tiles && !affine(it + STAGES)) tile_offsets(it + STAGES);  // its slot's table was read above
        }

        const T* sKw = sK + stage * Tr::SKV_ELEMS + warp * WN * PITCH;
        const T* sVw = sV + stage * Tr::SKV_ELEMS + warp * WN * PITCH;
        // (TMA) the stage's K and V, and their second panels (head_dim 128)
        const u32 sKt = sK_base + stage * (u32)(Tr::SKV_ELEMS * sizeof(T)), sVt = sV_base + stage * (u32)(Tr::SKV_ELEMS * sizeof(T));
        const u32 sKt1 = sKt + kv_pstride, sVt1 = sVt + kv_pstride;

        // ---- S = Q K^T for this warp's 16 keys ----
        float s[MT][N_TILES][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < N_TILES; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[mt][nt][e] = 0.f;
        if constexpr (MT > 1) {
            // Each k-step's K fragments once, for every m-tile; Q's from shared memory (TMA kernels only).
            static_assert(TMA && N_TILES == 2, "the TMA tile step");
#pragma unroll
            for (int kc = 0; kc < HEAD_DIM / 16; ++kc) {
                u32 bk[4];
                ldmatrix_x4(bk, (kc < 4 ? sKt : sKt1) + k_lane[kc % 4]);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    u32 a[4];
                    load_a_k16<false>(a, sQ + mt * 16 * PITCH, PITCH, kc * 16, lane);
                    Ops::mma16816(s[mt][0], a, bk[0], bk[1]);
                    Ops::mma16816(s[mt][1], a, bk[2], bk[3]);
                }
            }
        } else if constexpr (Q_REGS) {
            static_assert(N_TILES == 2, "one k16 B pair per step");
            if (it == 0) {
#pragma unroll
                for (int kc = 0; kc < HEAD_DIM / 16; ++kc) load_a_k16<false>(qa[kc], sQ, PITCH, kc * 16, lane);
            }
#pragma unroll
            for (int kc = 0; kc < HEAD_DIM / 16; ++kc) {
                u32 bk[4];
                if constexpr (TMA)  // load_b_pair_k16<false>'s rows and columns, in the SW128 panels
                    ldmatrix_x4(bk, (kc < 4 ? sKt : sKt1) + k_lane[kc % 4]);
                else
                    load_b_pair_k16<false>(bk, sKw, PITCH, kc * 16, 0, lane);
                Ops::mma16816(s[0][0], qa[kc], bk[0], bk[1]);
                Ops::mma16816(s[0][1], qa[kc], bk[2], bk[3]);
            }
        } else {
            static_assert(!TMA, "the TMA kernel keeps Q in registers");
            warp_mma<T, HEAD_DIM, N_TILES, false, false>(s[0], sQ, PITCH, sKw, PITCH, N_TILES, lane);
        }

        if (tid == 0 && (it == 0 || it == n_tiles - 1)) DECODE_TL_CLK_AFTER(it == 0 ? 24 : 27, s[0][N_TILES - 1][3]);
        // ---- logits in log2 units, masked; then the online softmax ----
        const int vw0 = v_begin + it * KT + (HEADS == 1 ? warp : warp % HEAD_WARPS) * WN;
        bool plain;
        if constexpr (TMA) {
            plain = vw0 >= plain_lo && vw0 <= plain_hi;
        } else {
            plain = !score_mod && vw0 >= n_sink && vw0 + WN <= v_end;
            if (plain) {
                const int k0 = vw0 + key_off;
                plain = (pad[0][0] || (k0 >= span[0][0].lo && k0 + WN <= span[0][0].hi))
                        && (pad[0][1] || (k0 >= span[0][1].lo && k0 + WN <= span[0][1].hi));
            }
            plain = __all_sync(0xffffffffu, plain);
        }
        if (!plain) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < N_TILES; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = e / 2;
                const int vv = vw0 + nt * 8 + 2 * t4 + (e % 2);
                const int key = vv < n_sink ? vv : vv + key_off;
                float x;
                if (score_mod) {
                    if (p.mask.softcap > 0.f) {
                        const float ex = fast_exp2(s[mt][nt][e] * p.mask.softcap_pre * (2.f * CUFLASH_LOG2E));
                        x = (1.f - __fdividef(2.f, ex + 1.f)) * p.mask.softcap_log2;
                    } else {
                        x = s[mt][nt][e] * p.scale_log2;
                    }
                    const int qi = (r0 + 16 * mt + g + 8 * r) / G;
                    x -= alibi[mt][r] * fabsf((float)(qi + mi.shift - key));
                } else {
                    x = s[mt][nt][e] * p.scale_log2;
                }
                s[mt][nt][e] = (vv < v_end && span[mt][r].has(p.mask, key)) ? x : -CUFLASH_INF;
            }
        }
        float alpha[MT][2];
        u32 pp[MT][N_TILES][2];  // P, rounded and packed
        if constexpr (TMA) {
            softmax.prepare_in_place(s, plain ? p.scale_log2 : 1.f, alpha);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int nt = 0; nt < N_TILES; ++nt)
#pragma unroll
                    for (int r = 0; r < 2; ++r) pp[mt][nt][r] = Ops::pack(s[mt][nt][2 * r], s[mt][nt][2 * r + 1]);
        } else {
            if (plain) {
#pragma unroll
                for (int nt = 0; nt < N_TILES; ++nt)
#pragma unroll
                    for (int e = 0; e < 4; ++e) s[0][nt][e] *= p.scale_log2;
            }
            softmax.prepare(s, 1.f, alpha, pp);
        }
        if (tid == 0 && (it == 0 || it == n_tiles - 1))
            DECODE_TL_CLK_AFTER(it == 0 ? 25 : 28, alpha[0][1] + __uint_as_float(pp[0][N_TILES - 1][1]));
        // Once the rows' maxima settle, alpha is exactly 1 (exp2(0)) and the rescale can go.
        bool moved = false;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) moved = moved || alpha[mt][0] != 1.f || alpha[mt][1] != 1.f;
        if (__any_sync(0xffffffffu, moved)) {
            scale_rows(acc_o, alpha);
            if constexpr (LP == LP_TENSOR) {
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    acc_lp[mt][0] *= alpha[mt][0];
                    acc_lp[mt][1] *= alpha[mt][0];
                    acc_lp[mt][2] *= alpha[mt][1];
                    acc_lp[mt][3] *= alpha[mt][1];
                }
            }
        }

        if constexpr (KV_APART) {
            mbar_wait(full_base + 8u * (STAGES + stage), (it / STAGES) & 1);  // V
            if (tid == 0 && (it == 0 || it == n_tiles - 1)) DECODE_TL_CLK(it == 0 ? 34 : 35);
            zero_v_tail(stage, it);
        }
        // ---- O += P V: P (16 rows of each m-tile, 16 keys) from registers, V (16 keys, HEAD_DIM) ----
        u32 pa[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            pa[mt][0] = pp[mt][0][0];
            pa[mt][1] = pp[mt][0][1];
            pa[mt][2] = pp[mt][1][0];
            pa[mt][3] = pp[mt][1][1];
        }
#pragma unroll
        for (int dp = 0; dp < D_TILES / 2; ++dp) {
            u32 bv[4];
            if constexpr (TMA)  // load_b_pair_k16<true>'s rows and columns, in the SW128 panels
                ldmatrix_x4_trans(bv, (dp < 4 ? sVt : sVt1) + v_lane[dp % 4]);
            else
                load_b_pair_k16<true>(bv, sVw, PITCH, 0, dp * 16, lane);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                Ops::mma16816(acc_o[mt][2 * dp], pa[mt], bv[0], bv[1]);
                Ops::mma16816(acc_o[mt][2 * dp + 1], pa[mt], bv[2], bv[3]);
            }
        }
        if (!TMA && D_TILES % 2) {
            u32 b0, b1;
            load_b_one_k16<true>(b0, b1, sVw, PITCH, 0, (D_TILES - 1) * 8, lane);
            Ops::mma16816(acc_o[0][D_TILES - 1], pa[0], b0, b1);
        }
        if constexpr (LP == LP_TENSOR) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
                Ops::mma16816(acc_lp[mt], pa[mt], Ops::ONES2, Ops::ONES2);  // lp: P times ones
        } else {
            softmax.commit(alpha, pp);  // with P V issued
        }
        if (tid == 0 && (it == 0 || it == n_tiles - 1)) DECODE_TL_CLK_AFTER(it == 0 ? 26 : 29, acc_o[0][D_TILES - 1][3]);
    }

    // ---- merge the warps: (m, l) per row, then O in a fixed order through shared memory ----
    if (lane == 0 && warp == 0) DECODE_TL_CLK(13);
    if (lane == 0 && warp == Tr::WARPS - 1) DECODE_TL_CLK(14);
    if (TMA && early)  // early copies of tiles the block did not have
        for (int st = n_tiles; st < EARLY; ++st) {
            mbar_wait(smem_addr(&s_full[st]), 0);
            if constexpr (KV_APART) mbar_wait(smem_addr(&s_full[STAGES + st]), 0);
        }
    cp_async_wait<0>();
    __syncthreads();  // every warp is done with the K/V stages, which now hold the merge buffer
    if (tid == 0) DECODE_TL_CLK(15);
    // Each warp's (m, l, lp) of its rows; O below. Rows past r_end (padding: a decode's rows are
    // head_group query heads, often fewer than 16) are neither written nor read. With two m-tiles a
    // warp (MT = 2), the merge below runs once per m-tile (rows m0 .. m0 + 15), through the same
    // buffers, a block barrier between the passes.
    if constexpr (LP == LP_TENSOR) softmax.take_lp(acc_lp);
    float* sO = reinterpret_cast<float*>(sK);  // the merge buffer (below)
    constexpr int OP = Tr::O_PITCH;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        if (mt > 0) __syncthreads();  // the pass before has read sO, s_l, s_lp and s_mx
        const int m0 = r0 + 16 * mt;  // this pass's first row
        float l_w[2], lp_w[2];
        bool own[2];  // (mine_row, worked out again here: kept through the loop, it took registers)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            own[r] = mine_row(m0 + g + 8 * r);
            l_w[r] = softmax.l_of(mt, r);
            lp_w[r] = softmax.lp_of(mt, r);
            if (t4 == 0) s_m[warp][g + 8 * r] = own[r] ? softmax.row_m[mt][r] : -CUFLASH_INF;
        }
        __syncthreads();
        // Each warp's O, l and lp rescaled to the rows' common maximum (f = 2^(m_w - m)): O into sO
        // (WARPS, 16, O_PITCH) floats, l and lp in place; the maximum in s_mx. O_PITCH = 8 (mod 32) words:
        // a store's 8 rows x 4 lanes x 8 bytes fall on distinct banks, two wavefronts (a pitch of
        // HEAD_DIM words put the 8 rows on the same 8 banks: 8 wavefronts a store, and the phase took 1.35
        // us of an 8.4 us block at 64 blocks of 512 keys, H200, bench/dev/decode_timeline.py).
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int rr = g + 8 * r;
            if (m0 + rr >= r_end) continue;
            float mx = -CUFLASH_INF;
#pragma unroll
            for (int w = 0; w < Tr::WARPS; ++w) mx = fmaxf(mx, s_m[w][rr]);
            // (HEADS > 1: another head's row takes zeros from this warp, its elements 2r, 2r + 1.)
            const float f = own[r] ? fast_exp2(softmax.row_m[mt][r] - exp_base(mx)) : 0.f;
            if (!own[r]) {
#pragma unroll
                for (int dt = 0; dt < D_TILES; ++dt) acc_o[mt][dt][2 * r] = acc_o[mt][dt][2 * r + 1] = 0.f;
                l_w[r] = lp_w[r] = 0.f;
            }
            float* dst = sO + (warp * 16 + rr) * OP + 2 * t4;
#pragma unroll
            for (int dt = 0; dt < D_TILES; ++dt)
                *reinterpret_cast<float2*>(dst + dt * 8) = make_float2(acc_o[mt][dt][2 * r] * f, acc_o[mt][dt][2 * r + 1] * f);
            if (t4 == 0) {
                s_l[warp][rr] = l_w[r] * f;
                s_lp[warp][rr] = lp_w[r] * f;
                if (warp == 0) s_mx[rr] = mx;
            }
        }
        __syncthreads();
        if (tid == 0) DECODE_TL_CLK(16);

        // ---- out: 4 columns per item, a warp's 32 items consecutive (one 512-byte row of sO at head_dim
        // 128: each of its 8 loads is four wavefronts, the fewest) ----
        constexpr int QUADS = HEAD_DIM / 4;
        const int pass_rows = MT == 1 ? r_end - m0 : min(16, r_end - m0);  // (MT = 1: r_end - r0 <= 16)
        for (int c = tid; c < pass_rows * QUADS; c += THREADS) {
            const int rr = c / QUADS, col = (c % QUADS) * 4, r = m0 + rr;
            const int2 qh = divmod_rt(r, G);
            const int qi = qh.x, head = h_kv * G + qh.y;
            const float mx = s_mx[rr];
            float l = 0.f, lp = 0.f;  // the sums of p and of p rounded (softmax.cuh: O is divided by lp)
            float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
            for (int w = 0; w < Tr::WARPS; ++w) {
                l += s_l[w][rr];
                lp += s_lp[w][rr];
                const float4 a = *reinterpret_cast<const float4*>(sO + (w * 16 + rr) * OP + col);
                o.x += a.x; o.y += a.y; o.z += a.z; o.w += a.w;
            }
            if (c == 0) DECODE_TL_CLK_AFTER(32, o.w + lp);
            const i64 row_index = ((i64)b * p.nheads + head) * p.seqlen_q + qi;  // (batch, nheads, seqlen_q)
            if (n_splits == 1) {
                // A sink logit joins after every key (softmax.cuh: finalize with a sink).
                const float sk2 = p.mask.sink_logits != nullptr ? p.mask.sink_logits[head] * CUFLASH_LOG2E : -CUFLASH_INF;
                const float m_new = fmaxf(mx, sk2);
                const float nb = exp_base(m_new);
                const float a = fast_exp2(mx - nb);
                const float ps = fast_exp2(sk2 - nb);
                const float lt = l * a + ps;
                const bool empty = lt == 0.f;
                const float sc = empty ? 0.f : a / (lp * a + ps);
                uint2 pk;
                pk.x = Ops::pack(o.x * sc, o.y * sc);
                pk.y = Ops::pack(o.z * sc, o.w * sc);
                T* gO = static_cast<T*>(p.o) + b * p.o_batch_stride + qi * p.o_row_stride + head * p.o_head_stride + col;
                *reinterpret_cast<uint2*>(gO) = pk;
                if (col == 0 && p.lse != nullptr)
                    p.lse[row_index] = empty ? -CUFLASH_INF : (m_new + fast_log2(lt)) * 0.6931471805599453f;
            } else if (CLUSTER && p.cluster_merge) {
                // The partial stays in this block's shared memory for the cluster merge: its 4 columns of
                // the row in warp 0's slice of sO, which only this thread has read; the row's lse in s_clse.
                const bool empty = l == 0.f;
                const float sc = empty ? 0.f : 1.f / lp;
                *reinterpret_cast<float4*>(sO + rr * OP + col) = make_float4(o.x * sc, o.y * sc, o.z * sc, o.w * sc);
                if (col == 0) s_clse[rr] = empty ? -CUFLASH_INF : mx + fast_log2(l);
            } else {
                const bool empty = l == 0.f;
                const float sc = empty ? 0.f : 1.f / lp;
                const i64 part = (i64)split * p.batch * p.nheads * p.seqlen_q + row_index;
                *reinterpret_cast<float4*>(p.o_part + part * HEAD_DIM + col) =
                    make_float4(o.x * sc, o.y * sc, o.z * sc, o.w * sc);
                if (col == 0) p.lse_part[part] = empty ? -CUFLASH_INF : mx + fast_log2(l);
            }
            if (c == 0) DECODE_TL_CLK(33);
        }
    }  // the m-tiles' passes

    if (tid == 0) {
        DECODE_TL_CLK(17);
        DECODE_TL_GT(22);
    }
#if __CUDA_ARCH__ >= 900
    // ---- the cluster merge (cluster_merge): the row tile's splits, one cluster, merge together ----
    if (CLUSTER && p.num_splits > 1 && p.cluster_merge) {
        u32 rank;
        asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
        cluster_sync();  // every block's partials are in its shared memory
        cluster_merge_tile<T, HEAD_DIM, THREADS>(p, b, h_kv, r0, r_end, (int)rank, smem_addr(sO), smem_addr(s_clse));
        cluster_sync();  // no block exits while another may still read its shared memory
        if (tid == 0) {
            DECODE_TL_CLK(18);
            DECODE_TL_GT(19);
        }
        return;
    }
#endif

    // ---- the fused combine (split_counters given): the last of this row tile's splits merges them ----
    // (Not at head_dim 8, where ptxas spilled the inlined combine on sm_90a; the host never asks.)
    if (HEAD_DIM >= 16 && n_splits > 1 && p.split_counters != nullptr) {
        __shared__ int s_last;
        __threadfence();  // this block's o_part / lse_part are visible device-wide before it is counted
        __syncthreads();
        if (tid == 0) s_last = atomicAdd(p.split_counters + rest, 1) == p.num_splits - 1;
        __syncthreads();
        if (!s_last) return;
        __threadfence();  // the other splits' partials, counted before this block's, are visible
        // The pipeline's shared memory is free: the combine's scratch goes where the K tiles were.
        static_assert(Tr::KV_BYTES >= TILE_MERGE_MAX * 4, "the merge's weights fit in the K/V stages");
        merge_tile<T, HEAD_DIM, THREADS>(p, b, h_kv, r0, r_end, reinterpret_cast<float*>(sK));
        if (tid == 0) p.split_counters[rest] = 0;  // zero again for the next call
        if (tid == 0) {
            DECODE_TL_CLK(18);
            DECODE_TL_GT(19);
        }
    }
}

// The splits of each output row merged: lse = log(sum_s exp(lse_s) + exp(sink)), out = sum_s
// exp(lse_s - lse) o_s. One block of 128 threads per row (b, head, i), rows in (batch, nheads,
// seqlen_q) order: thread s < num_splits (<= 128) reads lse_s, the weights go to shared memory; then
// thread t sums columns 4c .. 4c + 3 (c = t % (HEAD_DIM / 4)) over the splits s = ph, ph + P, ...
// (ph = t / (HEAD_DIM / 4), P phases), 16-byte loads, eight in flight (four at head_dim 256), the
// first eight issued with the lse_s loads, before the weights; the phases are added in a fixed order
// (deterministic). The block's memory round trips: one up to 8 P splits (32 at head_dim 128), then
// one per 8 P more.
template <typename T, int HEAD_DIM>
__global__ void __launch_bounds__(128)
decode_combine_kernel(const __grid_constant__ DecodeParams p) {
    __shared__ CombineSmem<HEAD_DIM> sm;
    pdl_wait();  // the decode kernel's partials (no trigger: the next kernel is the caller's)
    combine_row<T, HEAD_DIM>(p, (i64)blockIdx.x, sm);
}

// The new tokens written into the caches: k_new[b, i] at entry b's position cache_seqlens[b] + i
// (cache_seqlens clamped to [0, capacity]; positions past the cache are dropped), 16-bit elements
// one by one (the append is tiny next to the read).
// A grid-stride loop over (b, i, h_kv, e). With kv_lengths (attention_with_kvcache's chunks on the
// feature forward, cuflash/_kvcache.py ChunkPlan; seqlen_new may be 0 there) also each entry's L_b,
// the keys the decode kernels would let it see, into kv_lengths[b].
__global__ void __launch_bounds__(256)
decode_append_kernel(const __grid_constant__ DecodeParams p) {
    const int head_dim = p.head_dim;
    const i64 per_token = (i64)p.nheads_kv * head_dim;
    const i64 count = (i64)p.batch * p.seqlen_new * per_token;
    pdl_launch_dependents();  // the call's decode kernel, which waits for this grid before it reads the caches
    pdl_wait();
    if (p.kv_lengths != nullptr) {
        for (int b = blockIdx.x * blockDim.x + threadIdx.x; b < p.batch; b += gridDim.x * blockDim.x) {
            p.kv_lengths[b] = decode_length_clamp(p, decode_length_raw(p, b));
        }
    }
    for (i64 x = (i64)blockIdx.x * blockDim.x + threadIdx.x; x < count; x += (i64)gridDim.x * blockDim.x) {
        const int e = (int)(x % head_dim);
        const int hk = (int)((x / head_dim) % p.nheads_kv);
        const i64 bi = x / per_token;
        const int i = (int)(bi % p.seqlen_new), b = (int)(bi / p.seqlen_new);
        const int s = p.cache_seqlens != nullptr ? p.cache_seqlens[b] : p.fixed_seqlen;
        const int t = min(max(s, 0), p.capacity) + i;
        if (t >= p.capacity) continue;  // past the cache (bad cache_seqlens): dropped, never out of bounds
        const int cache_row = decode_cache_row(p, b);
        const int* table_row = p.block_table != nullptr ? p.block_table + b * p.table_stride : nullptr;
        const i64 ko = cache_offset(p, p.k_batch_stride, p.k_row_stride, cache_row, table_row, t);
        const i64 vo = cache_offset(p, p.v_batch_stride, p.v_row_stride, cache_row, table_row, t);
        const u16 kx = static_cast<const u16*>(p.k_new)[b * p.kn_batch_stride + i * p.kn_row_stride
                                                        + hk * p.kn_head_stride + e];
        const u16 vx = static_cast<const u16*>(p.v_new)[b * p.vn_batch_stride + i * p.vn_row_stride
                                                        + hk * p.vn_head_stride + e];
        static_cast<u16*>(const_cast<void*>(p.k))[ko + hk * p.k_head_stride + e] = kx;
        static_cast<u16*>(const_cast<void*>(p.v))[vo + hk * p.v_head_stride + e] = vx;
    }
}

}  // namespace cuflash
