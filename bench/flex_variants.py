"""The attention options as cuflash calls and as FlexAttention calls (torch.nn.attention.flex_attention)
that compute the same thing, for bench/bench_flex.py and tests/test_bench_flex_cpu.py.

Each variant is causal (bottom-right aligned on square sequences, so plain lower-triangular):
  window_<L>  cuflash window=(L, 0); Flex mask  q - L <= kv <= q
  alibi       cuflash alibi_slopes (nheads,); Flex score_mod  score - slope[h] * (q - kv), causal mask
              (cuflash's bias is -slope * |q - kv|, the same under the causal mask)
  softcap     cuflash softcap=c; Flex score_mod  c * tanh(score / c), causal mask (Flex's score is
              already scaled by softmax_scale, cuflash caps the scaled score too)
  packed      a packed batch of documents: cuflash attention_varlen with cu_seqlens, causal; Flex one
              sequence of all the tokens with the mask  doc[q] == doc[kv] and kv <= q
Layouts: cuflash (batch, seqlen, heads, head_dim) (packed: (tokens, heads, head_dim)); Flex (batch,
heads, seqlen, head_dim) (packed: (1, heads, tokens, head_dim)). `to_flex` / `from_flex` convert.
"""

from __future__ import annotations

VARIANTS = ("window_256", "window_4096", "alibi", "softcap", "packed")
SOFTCAP = 30.0


def alibi_slopes(torch, nheads, device):
    """The usual geometric slopes 2^(-8 (h + 1) / nheads), float32 (nheads,)."""
    return 2.0 ** (-8.0 * (torch.arange(nheads, device=device, dtype=torch.float32) + 1) / nheads)


def doc_lengths(tokens, seed=20261123, lo=64, hi=4096):
    """A fixed list of document lengths in [lo, hi] (log-uniform draws) summing to `tokens`."""
    import math
    import random

    rng = random.Random(seed)
    out = []
    while sum(out) < tokens:
        out.append(int(round(math.exp(rng.uniform(math.log(lo), math.log(hi))))))
    out[-1] -= sum(out) - tokens
    if out[-1] < 1:
        out[-2] += out.pop()
    return out


def to_flex(x, packed=False):
    """cuflash layout -> Flex layout (a view)."""
    return x.unsqueeze(0).transpose(1, 2) if packed else x.transpose(1, 2)


def from_flex(x, packed=False):
    """Flex layout -> cuflash layout (a view)."""
    return x.transpose(1, 2)[0] if packed else x.transpose(1, 2)


def cuflash_call(torch, cuflash, variant, q, k, v, lengths=None):
    """A zero-argument callable running the variant through cuflash on cuflash-layout tensors."""
    if variant.startswith("window_"):
        left = int(variant.split("_")[1])
        return lambda: cuflash.attention(q, k, v, causal=True, window=(left, 0))
    if variant == "alibi":
        slopes = alibi_slopes(torch, q.shape[-2], q.device)
        return lambda: cuflash.attention(q, k, v, causal=True, alibi_slopes=slopes)
    if variant == "softcap":
        return lambda: cuflash.attention(q, k, v, causal=True, softcap=SOFTCAP)
    if variant == "packed":
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        cu_t = torch.tensor(cu, dtype=torch.int32, device=q.device)
        mx = max(lengths)
        return lambda: cuflash.attention_varlen(q, k, v, cu_t, cu_t, mx, mx, causal=True)
    raise ValueError(variant)


def flex_call(torch, flex_attention, variant, q, k, v, lengths=None):
    """A zero-argument callable running the variant through `flex_attention` (compiled or not) on
    Flex-layout tensors; the block mask is built here, once (as a user would for a fixed shape)."""
    from torch.nn.attention.flex_attention import create_block_mask

    device = q.device
    seqlen, nheads = q.shape[-2], q.shape[1]

    def causal(b, h, qi, ki):
        return qi >= ki

    mask_mod, score_mod = causal, None
    if variant.startswith("window_"):
        left = int(variant.split("_")[1])

        def mask_mod(b, h, qi, ki):
            return (qi >= ki) & (qi - ki <= left)
    elif variant == "alibi":
        slopes = alibi_slopes(torch, nheads, device)

        def score_mod(score, b, h, qi, ki):
            return score - slopes[h].to(score.dtype) * (qi - ki).to(score.dtype)
    elif variant == "softcap":
        def score_mod(score, b, h, qi, ki):
            return SOFTCAP * torch.tanh(score / SOFTCAP)
    elif variant == "packed":
        doc = torch.cat([torch.full((n,), i, dtype=torch.int32, device=device) for i, n in enumerate(lengths)])

        def mask_mod(b, h, qi, ki):
            return (doc[qi] == doc[ki]) & (qi >= ki)
    else:
        raise ValueError(variant)
    block_mask = create_block_mask(mask_mod, B=None, H=None, Q_LEN=seqlen, KV_LEN=seqlen, device=device)
    return lambda: flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask)


def visible_pairs(variant, batch, seqlen, lengths=None) -> float:
    """(query, key) pairs the variant computes (for FLOPs): causal pairs, a window's, or the documents'."""
    if variant.startswith("window_"):
        left = int(variant.split("_")[1])
        n = (left + 1) * (seqlen - left) + left * (left + 1) // 2 if seqlen > left else seqlen * (seqlen + 1) // 2
        return float(batch) * n
    if variant == "packed":
        return float(sum(n * (n + 1) // 2 for n in lengths))
    return float(batch) * seqlen * (seqlen + 1) / 2
