// paged_gather.cu: the keys (or values) of a paged prefill gathered into the packed layout.
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
// attention_with_kvcache's paged chunks (lengths given): entry b's keys t < lengths[b] (clamped to
// [0, max_seqlen_k]) to rows b * max_seqlen_k + t of a padded array (batch * max_seqlen_k rows), which
// the feature forward reads with kv_lengths = lengths; cu_seqlens_k and cu_out are not used.
//
// Grid: (batch, ceil(max_seqlen_k / ROWS)) flattened into x; 128 threads copy ROWS = 16 key rows of
// nheads_kv * head_dim 16-bit elements, 16 bytes at a time (each row's source is worked out once).
#include "common.cuh"

namespace cuflash {

struct GatherParams {
    const void* src;          // the paged cache
    void* dst;                // the packed array
    const int* block_table;   // (batch, table_stride)
    const int* cu_seqlens_k;  // (batch + 1,)
    int* cu_out;              // (batch + 1,): cu_seqlens_k - cu_seqlens_k[0], clamped to [0, total_rows]
    const int* lengths;       // (batch,) or null: the padded layout (above)
    i64 src_block_stride, src_row_stride, src_head_stride;  // elements
    i64 dst_row_stride, dst_head_stride;
    i64 table_stride;
    int batch;
    int max_seqlen_k;
    int num_blocks;
    int page_size;
    int nheads_kv;
    int head_dim;             // a multiple of 8
    int total_rows;           // rows of dst
    int tiles;                // ceil(max_seqlen_k / 16): blocks per sequence
};

__global__ void __launch_bounds__(128)
paged_gather_kernel(const __grid_constant__ GatherParams p) {
    constexpr int ROWS = 16;
    __shared__ i64 s_src[ROWS], s_dst[ROWS];
    const int b = (int)(blockIdx.x / (unsigned)p.tiles);
    const int t0 = (int)(blockIdx.x % (unsigned)p.tiles) * ROWS;
    const int tid = threadIdx.x;
    const bool padded = p.lengths != nullptr;
    const int base = padded ? 0 : max(p.cu_seqlens_k[0], 0);
    if (!padded && blockIdx.x == 0)
        for (int i = tid; i <= p.batch; i += blockDim.x)
            p.cu_out[i] = min(max(p.cu_seqlens_k[i] - base, 0), p.total_rows);
    if (tid < ROWS) {
        int k0, len;
        if (padded) {
            k0 = b * p.max_seqlen_k;
            len = min(max(p.lengths[b], 0), min(p.max_seqlen_k, p.total_rows - k0));
        } else {
            k0 = min(max(p.cu_seqlens_k[b] - base, 0), p.total_rows);
            const int k1 = min(max(p.cu_seqlens_k[b + 1] - base, k0), p.total_rows);
            len = min(k1 - k0, p.max_seqlen_k);
        }
        const int t = t0 + tid;
        i64 src = -1, dst = -1;
        if (t < len) {
            const int blk = min(max(p.block_table[b * p.table_stride + t / p.page_size], 0), p.num_blocks - 1);
            src = blk * p.src_block_stride + (i64)(t % p.page_size) * p.src_row_stride;
            dst = (i64)(k0 + t) * p.dst_row_stride;
        }
        s_src[tid] = src;
        s_dst[tid] = dst;
    }
    __syncthreads();
    const int chunks = p.head_dim / 8;                // 16-byte chunks per head
    const int per_row = p.nheads_kv * chunks;
    const u16* src = static_cast<const u16*>(p.src);
    u16* dst = static_cast<u16*>(p.dst);
    for (int c = tid; c < ROWS * per_row; c += blockDim.x) {
        const int r = c / per_row, rest = c % per_row;
        const int h = rest / chunks, col = (rest % chunks) * 8;
        const i64 so = s_src[r], d = s_dst[r];
        if (so < 0) continue;
        *reinterpret_cast<uint4*>(dst + d + h * p.dst_head_stride + col) =
            *reinterpret_cast<const uint4*>(src + so + h * p.src_head_stride + col);
    }
}

}  // namespace cuflash
