// params.cuh: the one struct every forward kernel takes, by value (__grid_constant__).
//
// Layouts (element strides, int64, so any view with a unit last-dim stride works without a copy):
//   q, o: (batch, seqlen_q, nheads,    head_dim)
//   k, v: (batch, seqlen_k, nheads_kv, head_dim)
//   lse:  (batch, nheads, seqlen_q) float32, contiguous
// Query head h reads kv head h / head_group (MQA / GQA); head_group = nheads / nheads_kv.
//
// cuflash/_launch.py mirrors this struct as an aligned NumPy dtype. Every module compiled at run
// time static_asserts sizeof against that dtype; the compile gate static_asserts each field's
// offset too, and a GPU test reads the offsets back from a probe kernel.
#pragma once
#include "common.cuh"
#include "mask.cuh"

namespace cuflash {

struct FwdParams {
    const void* q;
    const void* k;
    const void* v;
    void* o;
    float* lse;      // may be nullptr: the forward then writes no lse (cuflash/_plan.py: lse_optional)

    i64 q_batch_stride, q_row_stride, q_head_stride;
    i64 k_batch_stride, k_row_stride, k_head_stride;
    i64 v_batch_stride, v_row_stride, v_head_stride;
    i64 o_batch_stride, o_row_stride, o_head_stride;

    int batch;
    int nheads;
    int nheads_kv;
    int head_group;    // nheads / nheads_kv
    int seqlen_q;
    int seqlen_k;
    int num_m_blocks;  // ceil(seqlen_q / BLOCK_M): the grid is batch * nheads * num_m_blocks, on x
    int tail_heads;    // causal calls (feature calls: windows (left, 0)): the grid's last tail_heads
                       // (batch, head)s run query block by query block across them (blocks.cuh
                       // causal_block_order); 0: head by head
    float scale_log2;  // softmax_scale * log2(e): scores go straight into exp2
    MaskParams mask;   // read only by the FEAT kernels (mask.cuh); seqlen_q / seqlen_k are then the
                       // max lengths of a packed batch
};

// Backward. Extra layouts:
//   dout, dq: like q;  dk, dv: like k (strides of their own)
//   lse:      (batch, nheads, seqlen_q) float32, contiguous (as the forward writes it)
//   lse_log2, delta: (batch, nheads, seqlen_q_pad) float32 scratch written by the preprocess kernel:
//             lse * log2(e) (+inf for a row that sees no key, or past seqlen_q) and rowsum(dO * O);
//             lse_log2 is null when no kernel of the call reads it
//   dq_accum: (batch, nheads, seqlen_q_pad, head_dim) float32 scratch for the atomic dQ path
// seqlen_q_pad is seqlen_q rounded up to a multiple of every backward BLOCK_M, so tiles of the
// scratch arrays are read without bounds checks.
struct BwdParams {
    const void* q;
    const void* k;
    const void* v;
    const void* o;
    const void* dout;
    const float* lse;
    void* dq;
    void* dk;
    void* dv;
    float* dq_accum;
    float* lse_log2;
    float* delta;

    i64 q_batch_stride, q_row_stride, q_head_stride;
    i64 k_batch_stride, k_row_stride, k_head_stride;
    i64 v_batch_stride, v_row_stride, v_head_stride;
    i64 o_batch_stride, o_row_stride, o_head_stride;
    i64 do_batch_stride, do_row_stride, do_head_stride;
    i64 dq_batch_stride, dq_row_stride, dq_head_stride;
    i64 dk_batch_stride, dk_row_stride, dk_head_stride;
    i64 dv_batch_stride, dv_row_stride, dv_head_stride;

    int batch;
    int nheads;
    int nheads_kv;
    int head_group;
    int seqlen_q;
    int seqlen_k;
    int seqlen_q_pad;
    int num_blocks;    // blocks per (batch, head) of the kernel being launched, along its sequence
    float scale_log2;  // softmax_scale * log2(e)
    float scale;       // softmax_scale: dQ = scale * dS K, dK = scale * dS^T Q
    MaskParams mask;   // read only by the FEAT kernels (mask.cuh)
};

}  // namespace cuflash
