// paged_gather.cu: the keys (or values) of a paged prefill gathered into the packed layout; and
// attention_with_kvcache's paged chunks, their new tokens appended and their keys and values gathered
// in one pass.
//
// attention_varlen with a block_table: sequence b's key t (t < cu_seqlens_k[b + 1] - cu_seqlens_k[b])
// lives at block block_table[b * table_stride + t / page_size], row t % page_size of a paged cache
// (num_blocks, page_size, nheads_kv, head_dim). This kernel copies it to row
// cu_seqlens_k[b] - cu_seqlens_k[0] + t of a packed array (total_rows, nheads_kv, head_dim) and writes
// those offsets (cu_seqlens_k - cu_seqlens_k[0]) to cu_out, which the varlen forward then reads as it
// reads any packed batch (cu_seqlens_k only gives lengths: it may start anywhere). Offsets and block
// numbers stay on the device and are clamped: rows land only in [0, total_rows), blocks are read only
// in [0, num_blocks), so bad values cannot fault.
//
// attention_with_kvcache's paged chunks (chunk mode: lengths_out given; cuflash/_kvcache.py ChunkPlan):
// entry b holds s_b = clamp(cache_seqlens[b], 0, capacity) keys (capacity = max_seqlen_k; fixed_seqlen
// where cache_seqlens is null) and appends seqlen_new tokens; it sees L_b = min(s_b + seqlen_new,
// capacity) keys, as the decode kernels count them (flash_decode.cu decode_length_clamp), and L_b goes
// to lengths_out[b]. Its keys t < L_b are copied to rows b * capacity + t of a padded array (batch *
// capacity rows), which the feature forward reads with kv_lengths = lengths_out: t < s_b from the
// pages, t >= s_b from new token t - s_b, which is also written into its page slot (the append: the
// tokens past the capacity are dropped). K and V in the same block (src_v, dst_v; the new tokens
// new_k, new_v). A slot one entry appends into is never read by another (the caller's contract), so
// the blocks need no ordering.
//
// Grid: (batch, ceil(max_seqlen_k / ROWS)) flattened into x; 128 threads copy ROWS = 16 key rows of
// nheads_kv * head_dim 16-bit elements, 16 bytes at a time (each row's source is worked out once).
#include "common.cuh"

namespace cuflash {

struct GatherParams {
    const void* src;          // the paged cache (K in chunk mode)
    void* dst;                // the packed (padded) array
    const void* src_v;        // chunk mode: the V cache, copied to dst_v by the same blocks
    void* dst_v;
    const int* block_table;   // (batch, table_stride)
    const int* cu_seqlens_k;  // (batch + 1,)
    int* cu_out;              // (batch + 1,): cu_seqlens_k - cu_seqlens_k[0], clamped to [0, total_rows]
    const int* cache_seqlens; // chunk mode: (batch,), or null: fixed_seqlen for every entry
    int* lengths_out;         // (batch,) or null: chunk mode when set (above)
    const void* new_k;        // chunk mode: (batch, seqlen_new, nheads_kv, head_dim), or null (seqlen_new 0)
    const void* new_v;
    i64 src_block_stride, src_row_stride, src_head_stride;  // elements
    i64 srcv_block_stride, srcv_row_stride, srcv_head_stride;
    i64 dst_row_stride, dst_head_stride;                    // dst and dst_v alike
    i64 newk_batch_stride, newk_row_stride, newk_head_stride;
    i64 newv_batch_stride, newv_row_stride, newv_head_stride;
    i64 table_stride;
    int batch;
    int max_seqlen_k;         // chunk mode: the capacity
    int num_blocks;
    int page_size;
    int nheads_kv;
    int head_dim;             // a multiple of 8
    int total_rows;           // rows of dst
    int tiles;                // ceil(max_seqlen_k / 16): blocks per sequence
    int fixed_seqlen;
    int seqlen_new;
};

// The 16-byte chunks of the block's rows of one tensor: row r's source at cache offset s_src[r] (-1: no
// row), or, where s_new[r] >= 0, new token offset s_new[r], then also stored into the cache's slot.
__device__ __forceinline__ void gather_rows(const GatherParams& p, const void* cache, void* out, const void* fresh,
                                            const i64* s_src, const i64* s_new, const i64* s_dst, i64 src_head,
                                            i64 new_head, int rows) {
    const int chunks = p.head_dim / 8;                // 16-byte chunks per head
    const int per_row = p.nheads_kv * chunks;
    u16* c16 = static_cast<u16*>(const_cast<void*>(cache));
    u16* d16 = static_cast<u16*>(out);
    const u16* n16 = static_cast<const u16*>(fresh);
    for (int c = threadIdx.x; c < rows * per_row; c += blockDim.x) {
        const int r = c / per_row, rest = c % per_row;
        const int h = rest / chunks, col = (rest % chunks) * 8;
        const i64 so = s_src[r];
        if (so < 0) continue;
        uint4* slot = reinterpret_cast<uint4*>(c16 + so + h * src_head + col);
        uint4 x;
        if (s_new[r] >= 0) {
            x = *reinterpret_cast<const uint4*>(n16 + s_new[r] + h * new_head + col);
            *slot = x;
        } else {
            x = *slot;
        }
        *reinterpret_cast<uint4*>(d16 + s_dst[r] + h * p.dst_head_stride + col) = x;
    }
}

__global__ void __launch_bounds__(128)
paged_gather_kernel(const __grid_constant__ GatherParams p) {
    constexpr int ROWS = 16;
    __shared__ i64 s_src[ROWS], s_srcv[ROWS], s_dst[ROWS], s_new[ROWS], s_newv[ROWS];
    const int b = (int)(blockIdx.x / (unsigned)p.tiles);
    const int t0 = (int)(blockIdx.x % (unsigned)p.tiles) * ROWS;
    const int tid = threadIdx.x;
    const bool chunk = p.lengths_out != nullptr;
    const int base = chunk ? 0 : max(p.cu_seqlens_k[0], 0);
    if (!chunk && blockIdx.x == 0)
        for (int i = tid; i <= p.batch; i += blockDim.x)
            p.cu_out[i] = min(max(p.cu_seqlens_k[i] - base, 0), p.total_rows);
    if (tid < ROWS) {
        int k0, len, s = p.max_seqlen_k;  // s: the first key from the new tokens (none outside chunk mode)
        if (chunk) {
            k0 = b * p.max_seqlen_k;
            s = min(max(p.cache_seqlens != nullptr ? p.cache_seqlens[b] : p.fixed_seqlen, 0), p.max_seqlen_k);
            len = min(s + p.seqlen_new, p.max_seqlen_k);
            if (t0 == 0 && tid == 0) p.lengths_out[b] = len;
            s = p.new_k != nullptr ? s : p.max_seqlen_k;  // (no new tokens: every key from the pages)
            len = min(len, p.total_rows - k0);
        } else {
            k0 = min(max(p.cu_seqlens_k[b] - base, 0), p.total_rows);
            const int k1 = min(max(p.cu_seqlens_k[b + 1] - base, k0), p.total_rows);
            len = min(k1 - k0, p.max_seqlen_k);
        }
        const int t = t0 + tid;
        i64 src = -1, srcv = -1, dst = -1, nk = -1, nv = -1;
        if (t < len) {
            const int blk = min(max(p.block_table[b * p.table_stride + t / p.page_size], 0), p.num_blocks - 1);
            src = blk * p.src_block_stride + (i64)(t % p.page_size) * p.src_row_stride;
            srcv = blk * p.srcv_block_stride + (i64)(t % p.page_size) * p.srcv_row_stride;
            dst = (i64)(k0 + t) * p.dst_row_stride;
            if (t >= s) {
                nk = b * p.newk_batch_stride + (i64)(t - s) * p.newk_row_stride;
                nv = b * p.newv_batch_stride + (i64)(t - s) * p.newv_row_stride;
            }
        }
        s_src[tid] = src;
        s_srcv[tid] = srcv;
        s_dst[tid] = dst;
        s_new[tid] = nk;
        s_newv[tid] = nv;
    }
    __syncthreads();
    gather_rows(p, p.src, p.dst, p.new_k, s_src, s_new, s_dst, p.src_head_stride, p.newk_head_stride, ROWS);
    if (p.src_v != nullptr)
        gather_rows(p, p.src_v, p.dst_v, p.new_v, s_srcv, s_newv, s_dst, p.srcv_head_stride, p.newv_head_stride,
                    ROWS);
}

}  // namespace cuflash
