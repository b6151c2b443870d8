// varlen.cu: the rows of a packed batch that belong to no sequence.
//
// In attention_varlen, q is (total_q, nheads, head_dim) and sequence b owns rows
// [cu_seqlens_q[b], cu_seqlens_q[b + 1]). Rows at or past cu_seqlens_q[batch] belong to none; no
// attention kernel visits them, and this kernel fills them: out, dq, dk and dv with zeros, lse with
// -inf. `start` is read on the device (cu_seqlens never travels to the host).
//
// Layout: element (row, head, e) at row * row_stride + head * head_stride + e, e < row_elems
// (row_elems = head_dim for out / dq / dk / dv; 1 for lse, viewed as rows = total_q,
// head_stride = total_q, row_stride = 1). Grid: any 1-D size; a grid-stride loop over
// (row, head, e) of the tail.
#include "common.cuh"

namespace cuflash {

struct TailParams {
    void* ptr;
    i64 row_stride, head_stride;  // elements
    const int* start;             // &cu_seqlens[batch]: the first row of the tail
    int total_rows;
    int nheads;
    int row_elems;
    u32 fill;                     // the element's bits (16-bit elements use the low half)
};

template <typename E>
__global__ void __launch_bounds__(256)
varlen_fill_tail_kernel(const __grid_constant__ TailParams p) {
    const int start = min(max(*p.start, 0), p.total_rows);
    const i64 per_row = (i64)p.nheads * p.row_elems;
    const i64 count = (i64)(p.total_rows - start) * per_row;
    const E fill = static_cast<E>(p.fill);
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += (i64)gridDim.x * blockDim.x) {
        const i64 row = start + i / per_row;
        const int rest = (int)(i % per_row);
        const int head = rest / p.row_elems, e = rest % p.row_elems;
        static_cast<E*>(p.ptr)[row * p.row_stride + head * p.head_stride + e] = fill;
    }
}

}  // namespace cuflash
