// mask.cuh: the optional features of the FEAT kernels (template flag FEAT of flash_fwd.cu and
// flash_bwd.cu): per-sequence lengths (padded or packed batches), sliding window, sink tokens,
// sink logits, ALiBi and softcap. cuflash/_features.py states the semantics; in short, for query
// row i and key j of one sequence (valid lengths sq, sk, bottom-right shift i' = i + sk - sq):
//   visible(i, j) = j < sk && (right < 0 || j <= i' + right)
//                          && (left < 0 || j >= i' - left || j < num_sink_tokens)
//   logit(i, j)   = cap(scale * q.k) - slope * |i' - j|,   cap(x) = c * tanh(x / c) (or x)
// and the sink logit joins each row's softmax denominator as a key of value 0.
//
// Which tiles a block visits. A query block visits the sink tiles [0, ceil(min(sinks, hi) / BN))
// and then the window's tiles [max(lo / BN, sink tiles), ceil(hi / BN)), where [lo, hi) bounds the
// keys any of its rows may see; a key block visits the query blocks whose rows may see one of its
// keys. Every other tile is fully masked: it is neither loaded nor computed. Of the visited tiles
// only those that cross a bound pay for the element-wise mask (needs_mask).
//
// Padded rows. Rows i >= sq of a padded batch are not masked in the forward's loop (they are
// finite garbage there); the epilogue writes out = 0 and lse = -inf for them. In the backward the
// preprocess gives them lse_log2 = +inf, hence P = 0 and no gradient.
#pragma once
#include "common.cuh"

namespace cuflash {

// Appended to FwdParams and BwdParams; cuflash/_launch.py mirrors it (MASK_PARAMS).
struct MaskParams {
    const int* cu_seqlens_q;   // (batch + 1,) row offsets of a packed batch; null for a padded batch
    const int* cu_seqlens_k;
    const int* q_lengths;      // (batch,) valid query rows of a padded batch; null: seqlen_q
    const int* kv_lengths;     // (batch,) valid keys; null: seqlen_k
    const float* alibi_slopes; // slope of (b, h) at b * alibi_batch_stride + h; null: no ALiBi
    const float* sink_logits;  // (nheads,), natural-log units; null: none
    float* dsink_rows;         // backward: (batch, nheads, seqlen_q_pad) per-row terms of d sink_logits
    i64 lse_batch_stride;      // lse element (b, h, row) = b * lse_batch_stride + h * lse_head_stride
    i64 lse_head_stride;       //   + row0 + row: padded (nheads * seqlen_q, seqlen_q), packed (0, total_q)
    int total_q, total_k;      // rows of the q / k arrays (cu_seqlens values are clamped to them)
    int alibi_batch_stride;    // 0 for slopes of shape (nheads,)
    int window_left;           // -1: unbounded
    int window_right;          // -1: unbounded (causal is right = 0)
    int num_sink_tokens;
    float softcap;             // 0: off
    float softcap_pre;         // softmax_scale / softcap: tanh's argument is s * softcap_pre
    float softcap_log2;        // softcap * log2(e)
};

// Where one sequence lives and how long it is.
struct SeqInfo {
    i64 q_row0, k_row0;  // first row of the sequence in q / k (0 in a padded batch)
    int sq, sk;          // valid query rows and keys
    int q_rows, k_rows;  // rows of the output arrays that belong to the sequence: written by it
};

// PAGED_KEYS (a packed batch whose keys come from paged caches: flash_fwd_sm90_ws.cu PAGED): cu_seqlens_k
// gives only the key lengths, cu_seqlens_k[b + 1] - cu_seqlens_k[b] (clamped to [0, seqlen_k]), and each
// sequence's keys start at its own key 0 (k_row0 0), as the gather into packed arrays would have them.
template <bool PAGED_KEYS = false>
__device__ __forceinline__ SeqInfo seq_info(const MaskParams& m, int b, int seqlen_q, int seqlen_k) {
    SeqInfo s;
    if (m.cu_seqlens_q != nullptr) {
        // Packed: seqlen_q / seqlen_k hold max_seqlen_q / max_seqlen_k, which bound the grid.
        const int q0 = min(max(m.cu_seqlens_q[b], 0), m.total_q);
        const int q1 = min(max(m.cu_seqlens_q[b + 1], q0), m.total_q);
        if constexpr (PAGED_KEYS) {
            const i64 len = (i64)m.cu_seqlens_k[b + 1] - m.cu_seqlens_k[b];
            s.q_row0 = q0;
            s.k_row0 = 0;
            s.sq = s.q_rows = min(q1 - q0, seqlen_q);
            s.sk = s.k_rows = (int)min(max(len, (i64)0), (i64)seqlen_k);
        } else {
            const int k0 = min(max(m.cu_seqlens_k[b], 0), m.total_k);
            const int k1 = min(max(m.cu_seqlens_k[b + 1], k0), m.total_k);
            s.q_row0 = q0;
            s.k_row0 = k0;
            s.sq = s.q_rows = min(q1 - q0, seqlen_q);
            s.sk = s.k_rows = min(k1 - k0, seqlen_k);
        }
    } else {
        s.q_row0 = s.k_row0 = 0;
        s.q_rows = seqlen_q;
        s.k_rows = seqlen_k;
        s.sq = m.q_lengths != nullptr ? min(max(m.q_lengths[b], 0), seqlen_q) : seqlen_q;
        s.sk = m.kv_lengths != nullptr ? min(max(m.kv_lengths[b], 0), seqlen_k) : seqlen_k;
    }
    return s;
}

constexpr int INT_LOWEST = -2147483647 - 1;
constexpr int INT_HIGHEST = 2147483647;

// The keys query row i sees: j in [lo, hi), or j < num_sink_tokens (the sink keys lift only the
// left bound). For keys j >= 0, has(m, j) == MaskInfo::visible(i, j).
struct KeySpan {
    int lo, hi;
    __device__ __forceinline__ bool has(const MaskParams& m, int j) const {
        return j < hi && (j >= lo || j < m.num_sink_tokens);
    }
};

// The queries that see key j: i in [lo, hi). has(i) == MaskInfo::visible(i, j).
struct QuerySpan {
    int lo, hi;
    __device__ __forceinline__ bool has(int i) const { return i >= lo && i < hi; }
};

// The mask and score modification of one (sequence, head). It holds only what differs per block;
// the window, sinks and softcap are read from the kernel's __grid_constant__ params at each use
// (constant-bank operands), which keeps them out of registers in kernels that sit near 255.
struct MaskInfo {
    int sq, sk, shift;  // shift = sk - sq: query i sits at key position i' = i + shift
    float alibi_log2;   // slope * log2(e) (0: off)

    __device__ __forceinline__ void init(const MaskParams& m, const SeqInfo& s, int b, int h) {
        sq = s.sq;
        sk = s.sk;
        shift = s.sk - s.sq;
        alibi_log2 = 0.f;
        set_head(m, b, h);
    }

    // ALiBi's slope belongs to the query head: the dK/dV kernel walks the heads of a GQA group.
    __device__ __forceinline__ void set_head(const MaskParams& m, int b, int h) {
        if (m.alibi_slopes != nullptr) alibi_log2 = m.alibi_slopes[(i64)b * m.alibi_batch_stride + h] * CUFLASH_LOG2E;
    }

    __device__ __forceinline__ bool visible(const MaskParams& m, int i, int j) const {
        const int ip = i + shift;
        return j < sk && (m.window_right < 0 || j - ip <= m.window_right)
               && (m.window_left < 0 || ip - j <= m.window_left || j < m.num_sink_tokens);
    }

    // visible() for one query row and many keys (query-major tiles: forward, dQ), or for one key and
    // many queries (key-major tiles: dK / dV): the bounds are worked out once per row / key, and each
    // element then costs two compares.
    __device__ __forceinline__ KeySpan key_span(const MaskParams& m, int i) const {
        const int ip = i + shift;
        KeySpan r;
        r.hi = m.window_right < 0 ? sk : min(sk, ip + m.window_right + 1);
        r.lo = m.window_left < 0 ? 0 : ip - m.window_left;
        return r;
    }
    __device__ __forceinline__ QuerySpan query_span(const MaskParams& m, int j) const {
        QuerySpan r;
        r.lo = m.window_right < 0 ? INT_LOWEST : j - m.window_right - shift;
        r.hi = (m.window_left < 0 || j < m.num_sink_tokens) ? INT_HIGHEST : j + m.window_left - shift + 1;
        if (j >= sk) r.hi = INT_LOWEST;
        return r;
    }

    // Keys [key_lo(r0), key_hi(r1)) hold every key that rows [r0, r1] (r1 inclusive) may see
    // through the window; sink keys come on top of key_lo.
    __device__ __forceinline__ int key_hi(const MaskParams& m, int r1) const {
        return m.window_right < 0 ? sk : max(0, min(sk, r1 + shift + m.window_right + 1));
    }
    __device__ __forceinline__ int key_lo(const MaskParams& m, int r0) const {
        return m.window_left < 0 ? 0 : max(0, r0 + shift - m.window_left);
    }

    // Whether the tile rows [m0, m0 + bm) x keys [n0, n0 + bn) has a key some row may not see.
    __device__ __forceinline__ bool needs_mask(const MaskParams& m, int m0, int bm, int n0, int bn) const {
        return n0 + bn > sk || (m.window_right >= 0 && n0 + bn - 1 > m0 + shift + m.window_right)
               || (m.window_left >= 0 && n0 < m0 + bm - 1 + shift - m.window_left);
    }

    // logit_log2 with ALiBi alone (no softcap), given the distance i + shift - j as a float: callers
    // form it from one integer conversion per row or key and a constant per element, since
    // integer-to-float conversions share the pipe of exp2 (exact below 2^24).
    __device__ __forceinline__ float alibi_logit_log2(float scale_log2, float s, float dist) const {
        return fmaf(-alibi_log2, fabsf(dist), s * scale_log2);
    }

    // The logit in log2 units of raw score s = q.k at (i, j); t gets tanh's value (softcap's
    // derivative is 1 - t^2; t = 0 without softcap).
    __device__ __forceinline__ float logit_log2(const MaskParams& m, float scale_log2, float s, int i, int j,
                                                float& t) const {
        float x;
        if (m.softcap > 0.f) {
            // tanh(y) = 1 - 2 / (exp(2y) + 1): saturates to +-1 without NaN (exp2 -> inf or 0); its
            // absolute error stays near 1e-7, so the logit's error is ~1e-7 * softcap.
            const float e = fast_exp2(s * m.softcap_pre * (2.f * CUFLASH_LOG2E));
            t = 1.f - __fdividef(2.f, e + 1.f);
            x = t * m.softcap_log2;
        } else {
            t = 0.f;
            x = s * scale_log2;
        }
        if (alibi_log2 != 0.f) x -= alibi_log2 * fabsf((float)(i + shift - j));
        return x;
    }
};

// The key tiles a query block walks: the sink tiles [0, n_sink), then [start, end).
struct KeyTiles {
    int n_sink, start, count;
    __device__ __forceinline__ int tile(int it) const { return it < n_sink ? it : start + (it - n_sink); }
};

template <int BLOCK_M, int BLOCK_N>
__device__ __forceinline__ KeyTiles key_tiles(const MaskParams& m, const MaskInfo& mi, int m0) {
    KeyTiles r;
    r.n_sink = r.start = r.count = 0;
    if (m0 >= mi.sq) return r;  // padding rows only
    const int r1 = min(m0 + BLOCK_M, mi.sq) - 1;
    const int hi = mi.key_hi(m, r1);
    const int lo = mi.key_lo(m, m0);
    const int sink_hi = (m.window_left < 0) ? 0 : min(m.num_sink_tokens, hi);
    r.n_sink = (sink_hi + BLOCK_N - 1) / BLOCK_N;
    const int end = (hi + BLOCK_N - 1) / BLOCK_N;
    r.start = max(lo / BLOCK_N, r.n_sink);
    r.count = r.n_sink + (lo < hi ? max(0, end - r.start) : 0);
    return r;
}

// What a query-block kernel (forward, dQ) knows of its sequence with FEAT.
struct QueryFeat {
    SeqInfo si;
    MaskInfo mi;
    KeyTiles kt;
    bool past_end;   // packed batch: the block lies past its sequence (it visits and writes nothing)
    bool score_mod;  // softcap or ALiBi: every tile's scores are modified
};

template <int BLOCK_M, int BLOCK_N, bool PAGED_KEYS = false>
__device__ __forceinline__ QueryFeat query_feat(const MaskParams& m, int b, int h, int m0, int seqlen_q, int seqlen_k) {
    QueryFeat f;
    f.si = seq_info<PAGED_KEYS>(m, b, seqlen_q, seqlen_k);
    f.past_end = m0 >= f.si.q_rows;
    f.mi.init(m, f.si, b, h);
    f.kt = key_tiles<BLOCK_M, BLOCK_N>(m, f.mi, m0);
    if (f.past_end) f.kt.count = 0;
    f.score_mod = m.softcap > 0.f || m.alibi_slopes != nullptr;
    return f;
}

// The setup a query-block kernel (forward, dQ) shares: with FEAT, query_feat, and the key tiles to
// visit and the rows / keys that hold data (past q_valid / k_valid shared memory is zero-filled)
// come from the sequence; without, the plain kernel's values stay and qf only carries the zero row
// offsets (and no score modification).
template <bool FEAT, int BLOCK_M, int BLOCK_N, bool PAGED_KEYS = false>
__device__ __forceinline__ QueryFeat query_setup(const MaskParams& m, int b, int h, int m0, int seqlen_q, int seqlen_k,
                                                 int& n_blocks, int& q_valid, int& k_valid) {
    QueryFeat qf;
    if constexpr (FEAT) {
        qf = query_feat<BLOCK_M, BLOCK_N, PAGED_KEYS>(m, b, h, m0, seqlen_q, seqlen_k);
        n_blocks = qf.kt.count;
        q_valid = qf.si.sq;
        k_valid = qf.si.sk;
    } else {
        qf.si.q_row0 = qf.si.k_row0 = 0;
        qf.score_mod = false;
    }
    return qf;
}

// A packed batch's rows that belong to no sequence, filled by a forward kernel's threads (thread i of
// n per block; varlen.cu's rule: rows at or past cu_seqlens_q[batch], and a sequence's rows past
// max_seqlen_q): out's first `cols` columns of every head with zeros, lse (when given) with -inf.
// Typically there are none: a load of cu_seqlens_q[batch], and two per sequence for blocks below
// `batch`.
__device__ __forceinline__ void fill_packed_tail(const MaskParams& m, u16* out, i64 o_row_stride, i64 o_head_stride,
                                                 float* lse, int batch, int nheads, int max_seqlen, int cols, int i,
                                                 int n) {
    const i64 per_row = (i64)nheads * cols;
    auto put = [&](i64 row, i64 k) {
        const int rest = (int)(k % per_row);
        const int head = rest / cols, e = rest % cols;
        out[row * o_row_stride + head * o_head_stride + e] = 0;  // +0 in float16 and bfloat16
        if (lse != nullptr && e == 0) lse[head * m.lse_head_stride + row] = -CUFLASH_INF;
    };
    const int start = min(max(m.cu_seqlens_q[batch], 0), m.total_q);
    const i64 count = (i64)(m.total_q - start) * per_row;
    for (i64 k = (i64)blockIdx.x * n + i; k < count; k += (i64)gridDim.x * n) put(start + k / per_row, k);
    for (int b = blockIdx.x; b < batch; b += gridDim.x) {
        const i64 from = (i64)min(max(m.cu_seqlens_q[b], 0), m.total_q) + max(max_seqlen, 0);
        const i64 to = min(max(m.cu_seqlens_q[b + 1], 0), m.total_q);
        for (i64 k = i; k < (to - from) * per_row; k += n) put(from + k / per_row, k);
    }
}

// The query blocks [m_begin, m_end) whose valid rows may see a key of [n0, n0 + BLOCK_N).
template <int BLOCK_M, int BLOCK_N>
__device__ __forceinline__ void query_range(const MaskParams& m, const MaskInfo& mi, int n0, int& m_begin, int& m_iters) {
    int q_lo = 0, q_hi = mi.sq;
    if (m.window_right >= 0) q_lo = max(q_lo, n0 - m.window_right - mi.shift);
    if (m.window_left >= 0 && n0 >= m.num_sink_tokens) q_hi = min(q_hi, n0 + BLOCK_N + m.window_left - mi.shift);
    if (n0 >= mi.sk || q_lo >= q_hi) {
        m_begin = 0;
        m_iters = 0;
        return;
    }
    m_begin = q_lo / BLOCK_M;
    m_iters = (q_hi + BLOCK_M - 1) / BLOCK_M - m_begin;
}

}  // namespace cuflash
