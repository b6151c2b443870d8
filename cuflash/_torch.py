"""PyTorch adapter: the forward and backward as torch.library custom ops, with autograd.

`cuflash.attention` on torch tensors calls torch.ops.cuflash.attention_fwd. Being custom ops with
fake (meta) implementations, both ops are opaque to torch.compile, which traces a model that calls
them with fullgraph=True and no graph break. Autograd saves q, k, v, out and lse (never the
probabilities) and calls torch.ops.cuflash.attention_bwd.

Outputs and scratch buffers come from torch's caching allocator and every kernel runs on
torch.cuda.current_stream(), so a training step that calls cuflash can be captured in a
torch.cuda.CUDAGraph once a warm-up call has compiled the kernels.
"""

from __future__ import annotations

import torch

from . import _api


def _device(t: torch.Tensor):
    return ("cuda", t.device.index if t.device.index is not None else torch.cuda.current_device()) \
        if t.device.type == "cuda" else (t.device.type, 0)


@torch.library.custom_op("cuflash::attention_fwd", mutates_args=())
def attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, softmax_scale: float,
                  deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    dtype = str(q.dtype).replace("torch.", "")
    return _api.forward_impl(q, k, v, "torch", _device(q), dtype, causal, softmax_scale)


@attention_fwd.register_fake
def _attention_fwd_fake(q, k, v, causal, softmax_scale, deterministic):
    b, sq, h, d = q.shape
    return q.new_empty((b, sq, h, d)), q.new_empty((b, h, sq), dtype=torch.float32)


@torch.library.custom_op("cuflash::attention_bwd", mutates_args=())
def attention_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, causal: bool, softmax_scale: float,
                  deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dtype = str(q.dtype).replace("torch.", "")
    return _api.backward_impl(dout, q, k, v, out, lse, "torch", _device(q), dtype, causal, softmax_scale,
                              deterministic)


@attention_bwd.register_fake
def _attention_bwd_fake(dout, q, k, v, out, lse, causal, softmax_scale, deterministic):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, causal, softmax_scale, deterministic = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.causal, ctx.softmax_scale, ctx.deterministic = causal, softmax_scale, deterministic
    ctx.mark_non_differentiable(lse)
    # lse gets no gradient: without this, autograd hands _backward a zero tensor of lse's shape for
    # it, an allocation that SDPA's backward does not make (measured: +2 MiB of peak at head_dim 64).
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    if dout is None:  # only lse was used: no gradient reaches q, k, v
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), None, None, None
    dq, dk, dv = torch.ops.cuflash.attention_bwd(dout, q, k, v, out, lse, ctx.causal, ctx.softmax_scale,
                                                 ctx.deterministic)
    return dq, dk, dv, None, None, None


attention_fwd.register_autograd(_backward, setup_context=_setup_context)


# ---- the optional features (cuflash/_features.py): one op pair for padded and packed batches ----
# Array options are optional tensors; scalars are plain arguments. max_seqlen_q < 0 marks a padded
# batch (q is 4-D); otherwise q, k, v are packed (3-D) and cu_seqlens_q / cu_seqlens_k are given.

def _feats(window_left, window_right, num_sink_tokens, softcap, has_lengths, sink_logits, alibi_slopes):
    from ._features import Features

    return Features(window_left, window_right, num_sink_tokens, softcap, has_lengths, sink_logits is not None,
                    alibi_slopes is not None)


def _arrays(q_lengths, kv_lengths, cu_seqlens_q, cu_seqlens_k, sink_logits, alibi_slopes):
    from ._features import FeatureArrays

    return FeatureArrays(q_lengths, kv_lengths, cu_seqlens_q, cu_seqlens_k, sink_logits, alibi_slopes)


def _feat_fwd_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_lengths: torch.Tensor | None,
                   kv_lengths: torch.Tensor | None, cu_seqlens_q: torch.Tensor | None,
                   cu_seqlens_k: torch.Tensor | None, sink_logits: torch.Tensor | None,
                   alibi_slopes: torch.Tensor | None, softmax_scale: float, deterministic: bool,
                   window_left: int, window_right: int, num_sink_tokens: int, softcap: float,
                   max_seqlen_q: int, max_seqlen_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    dtype = str(q.dtype).replace("torch.", "")
    packed = (max_seqlen_q, max_seqlen_k) if max_seqlen_q >= 0 else None
    has_lengths = packed is not None or q_lengths is not None or kv_lengths is not None
    feats = _feats(window_left, window_right, num_sink_tokens, softcap, has_lengths, sink_logits, alibi_slopes)
    arrays = _arrays(q_lengths, kv_lengths, cu_seqlens_q, cu_seqlens_k, sink_logits, alibi_slopes)
    return _api.forward_feat_impl(q, k, v, "torch", _device(q), dtype, softmax_scale, feats, arrays, packed)


attention_feat_fwd = torch.library.custom_op("cuflash::attention_feat_fwd", mutates_args=())(_feat_fwd_impl)


@attention_feat_fwd.register_fake
def _attention_feat_fwd_fake(q, k, v, q_lengths, kv_lengths, cu_seqlens_q, cu_seqlens_k, sink_logits, alibi_slopes,
                             softmax_scale, deterministic, window_left, window_right, num_sink_tokens, softcap,
                             max_seqlen_q, max_seqlen_k):
    if max_seqlen_q >= 0:
        total_q, h, _ = q.shape
        return q.new_empty(q.shape), q.new_empty((h, total_q), dtype=torch.float32)
    b, sq, h, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((b, h, sq), dtype=torch.float32)


def _feat_bwd_impl(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, q_lengths: torch.Tensor | None, kv_lengths: torch.Tensor | None,
                   cu_seqlens_q: torch.Tensor | None, cu_seqlens_k: torch.Tensor | None,
                   sink_logits: torch.Tensor | None, alibi_slopes: torch.Tensor | None, softmax_scale: float,
                   deterministic: bool, window_left: int, window_right: int, num_sink_tokens: int,
                   softcap: float, max_seqlen_q: int, max_seqlen_k: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dsink); dsink is an empty tensor without sink logits."""
    dtype = str(q.dtype).replace("torch.", "")
    packed = (max_seqlen_q, max_seqlen_k) if max_seqlen_q >= 0 else None
    has_lengths = packed is not None or q_lengths is not None or kv_lengths is not None
    feats = _feats(window_left, window_right, num_sink_tokens, softcap, has_lengths, sink_logits, alibi_slopes)
    arrays = _arrays(q_lengths, kv_lengths, cu_seqlens_q, cu_seqlens_k, sink_logits, alibi_slopes)
    dq, dk, dv, dsink = _api.backward_feat_impl(dout, q, k, v, out, lse, "torch", _device(q), dtype, softmax_scale,
                                                feats, arrays, packed, deterministic)
    if dsink is None:
        dsink = q.new_empty((0,), dtype=torch.float32)
    return dq, dk, dv, dsink


attention_feat_bwd = torch.library.custom_op("cuflash::attention_feat_bwd", mutates_args=())(_feat_bwd_impl)


@attention_feat_bwd.register_fake
def _attention_feat_bwd_fake(dout, q, k, v, out, lse, q_lengths, kv_lengths, cu_seqlens_q, cu_seqlens_k, sink_logits,
                             alibi_slopes, softmax_scale, deterministic, window_left, window_right, num_sink_tokens,
                             softcap, max_seqlen_q, max_seqlen_k):
    n = 0 if sink_logits is None else sink_logits.shape[0]
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), q.new_empty((n,), dtype=torch.float32)


_FEAT_ARRAYS = ("q_lengths", "kv_lengths", "cu_seqlens_q", "cu_seqlens_k", "sink_logits", "alibi_slopes")


def _feat_setup_context(ctx, inputs, output):
    q, k, v = inputs[:3]
    arrays = inputs[3:9]
    ctx.scalars = inputs[9:]  # softmax_scale, deterministic, window_left, window_right, sinks, softcap, max_q, max_k
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, *arrays)
    ctx.has_array = [a is not None for a in arrays]
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)


def _feat_backward(ctx, dout, dlse, bwd=None):
    """The autograd backward of the feature forward; bwd: the backward op (default: the custom op)."""
    bwd = bwd or torch.ops.cuflash.attention_feat_bwd
    q, k, v, out, lse, *arrays = ctx.saved_tensors
    arrays = [a if has else None for a, has in zip(arrays, ctx.has_array)]
    scale, det, left, right, sinks, cap, mq, mk = ctx.scalars
    none_rest = (None,) * 9  # alibi_slopes and the 8 scalars
    if dout is None:
        sink = arrays[4]
        return (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), None, None, None, None,
                None if sink is None else torch.zeros_like(sink)) + none_rest
    dq, dk, dv, dsink = bwd(dout, q, k, v, out, lse, *arrays, scale, det, left, right, sinks, cap, mq, mk)
    return (dq, dk, dv, None, None, None, None, dsink if arrays[4] is not None else None) + none_rest


attention_feat_fwd.register_autograd(_feat_backward, setup_context=_feat_setup_context)


class _FeatFunction(torch.autograd.Function):
    """The custom op pair's eager twin: the same forward, context and backward without the
    torch.library dispatch, whose Python argument handling (17 arguments) cost ~0.6 ms of host time
    per call on an H100 host (bench/dev/host_profile.py window), more than the kernels of a
    window (256, 0) at seqlen 16k take."""

    @staticmethod
    def forward(ctx, *inputs):
        out, lse = _feat_fwd_impl(*inputs)
        _feat_setup_context(ctx, inputs, (out, lse))
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        return _feat_backward(ctx, dout, dlse, bwd=_feat_bwd_impl)


def attention_features(q, k, v, scale, feats, arrays, packed, deterministic):
    """The feature forward with autograd: (out, lse). Under torch.compile (and any other tracing)
    through the custom op, which torch.compile sees as one opaque node; in eager mode through
    _FeatFunction, which runs the same code with less host time."""
    mq, mk = packed if packed is not None else (-1, -1)
    args = (q, k, v, arrays.q_lengths, arrays.kv_lengths, arrays.cu_seqlens_q, arrays.cu_seqlens_k,
            arrays.sink_logits, arrays.alibi_slopes, float(scale), bool(deterministic), feats.window_left,
            feats.window_right, feats.num_sink_tokens, float(feats.softcap), int(mq), int(mk))
    if torch.compiler.is_compiling():
        return torch.ops.cuflash.attention_feat_fwd(*args)
    return _FeatFunction.apply(*args)
