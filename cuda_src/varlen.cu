// varlen.cu: the rows of a packed batch that belong to no sequence.
//
// In attention_varlen, q is (total_q, nheads, head_dim) and sequence b owns rows
// [cu_seqlens_q[b], cu_seqlens_q[b + 1]). Rows at or past cu_seqlens_q[batch] belong to none; no
// attention kernel visits them, and this kernel fills them: out, dq, dk and dv with zeros, lse with
// -inf. The offsets are read on the device (cu_seqlens never travels to the host), so a sequence
// longer than the caller's max_seqlen (a broken promise the GPU path cannot check) is not refused:
// the attention kernels' grid covers its first max_seqlen rows only, and this kernel, launched
// after them, fills the rest, rows [cu_seqlens[b] + max_seqlen, cu_seqlens[b + 1]), the same way,
// so that no row is left as whatever the allocation held.
//
// Layout: element (row, head, e) at row * row_stride + head * head_stride + e, e < row_elems
// (row_elems = head_dim for out / dq / dk / dv; 1 for lse, viewed as rows = total_q,
// head_stride = total_q, row_stride = 1). Grid: any 1-D size; a grid-stride loop over
// (row, head, e) of the tail, then block-stride over the sequences for rows past max_seqlen (none
// in a valid call: two loads per sequence).
#include "common.cuh"

namespace cuflash {

struct TailParams {
    void* ptr;
    i64 row_stride, head_stride;  // elements
    const int* cu_seqlens;        // (batch + 1,): cu_seqlens[batch] is the first row of the tail
    int batch;
    int max_seqlen;               // the attention kernels visit rows [cu_seqlens[b], cu_seqlens[b] + max_seqlen)
    int total_rows;
    int nheads;
    int row_elems;
    u32 fill;                     // the element's bits (16-bit elements use the low half)
};

template <typename E>
__global__ void __launch_bounds__(256)
varlen_fill_tail_kernel(const __grid_constant__ TailParams p) {
    const int start = min(max(p.cu_seqlens[p.batch], 0), p.total_rows);
    const i64 per_row = (i64)p.nheads * p.row_elems;
    const E fill = static_cast<E>(p.fill);
    E* out = static_cast<E*>(p.ptr);
    auto put = [&](i64 row, i64 i) {
        const int rest = (int)(i % per_row);
        const int head = rest / p.row_elems, e = rest % p.row_elems;
        out[row * p.row_stride + head * p.head_stride + e] = fill;
    };
    const i64 count = (i64)(p.total_rows - start) * per_row;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += (i64)gridDim.x * blockDim.x)
        put(start + i / per_row, i);
    // Sequences longer than max_seqlen: their rows past it (offsets clamped to the array, as the
    // attention kernels clamp them).
    for (int b = blockIdx.x; b < p.batch; b += gridDim.x) {
        const i64 from = (i64)min(max(p.cu_seqlens[b], 0), p.total_rows) + max(p.max_seqlen, 0);
        const i64 to = min(max(p.cu_seqlens[b + 1], 0), p.total_rows);
        const i64 n = (to - from) * per_row;
        for (i64 i = threadIdx.x; i < n; i += blockDim.x) put(from + i / per_row, i);
    }
}

}  // namespace cuflash
