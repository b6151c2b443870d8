"""PyTorch adapter: torch tensors in, torch tensors out, on torch's current stream.

Eager calls take the hot path: a signature key from the tensors' dtype, shape, stride, device and
pointer alignment plus the scalars; a dict lookup for the plan; outputs from torch's caching
allocator; pointers from data_ptr(); the stream from torch's current raw stream; cuLaunchKernel.
No DLPack capsule, stream object or Params struct is made per call, and no dict of the option
arrays: they travel as a tuple in the plan's `options` order, and the plan holds their pointer
slots. Calls whose inputs require grad go through `_Attention`, an autograd.Function that saves
q, k, v, out and lse (never the probabilities) and whose backward runs the plan's backward.

Under torch.compile (and any other tracing, where tensors are fake) the call is validated, then
goes through the torch.library operators `cuflash::attention_fwd` / `attention_bwd` (plain) and
`attention_feat_fwd` / `attention_feat_bwd` (with options), applied inside autograd.Functions that
Dynamo traces; their fake implementations give the output shapes, so torch.compile traces a model
that calls cuflash with no graph break. Their real implementations take the same plans. Outputs and scratch buffers come from torch's allocator and
every kernel runs on torch.cuda.current_stream(), so a training step can be captured in a
torch.cuda.CUDAGraph once a warm-up call has compiled the kernels.
"""

from __future__ import annotations

import functools

import torch

from .. import _call
from .._call import ArrayInfo
from .._features import ARRAY_OPTIONS
from .._plan import CACHE, NO_OPTIONS, Plan
from ._base import _ARRAY_SET, Adapter, info_of, window_key

_empty = torch.empty
_empty_like = torch.empty_like
_data_ptr = torch.Tensor.data_ptr
_f32 = torch.float32
_grad_enabled = torch.is_grad_enabled
_is_compiling = torch.compiler.is_compiling
_functorch_active = torch._C._are_functorch_transforms_active
_unwrap_if_dead = torch._C._functorch.unwrap_if_dead


def _raw_stream(device_id: int) -> int:
    """The current stream of a CUDA device as a raw handle (what torch's own generated code reads)."""
    global _raw_stream
    fn = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if fn is None:  # a torch without it: the public (slower) route
        def fn(device_id):
            return torch.cuda.current_stream(device_id).cuda_stream
    _raw_stream = fn
    return fn(device_id)


def _like(shape, dtype, device):
    """A 1-element tensor seen with `shape` (stride 0): torch.empty_like of it is a contiguous
    tensor of that shape, and costs less host time than torch.empty (measured 1.7 against 2.9 us:
    no dtype / device arguments to parse)."""
    return _empty((1,), dtype=dtype, device=device).expand(shape)


class _State:
    """What the torch adapter keeps with a GPU plan: its device and the output templates."""

    __slots__ = ("device", "out", "lse", "kv")

    def __init__(self, plan: Plan):
        c = plan.call
        self.device = torch.device("cuda", plan.device_id)
        dt = getattr(torch, c.dtype)
        self.out = _like(plan.out_shape, dt, self.device)
        self.lse = _like(plan.lse_shape, _f32, self.device)
        kv_shape = (c.total_k, c.nheads_kv, c.head_dim) if c.packed else (c.batch, c.seqlen_k, c.nheads_kv, c.head_dim)
        self.kv = _like(kv_shape, dt, self.device)


def _state(plan) -> _State:
    st = plan.state.get("torch")
    if st is None:
        st = plan.state["torch"] = _State(plan)
    return st


def _arrays(plan: Plan, opts) -> tuple:
    """The option arrays of a call (name -> array) in the plan's `options` order."""
    return plan.take_options(opts) if plan.options else ()


def _copies(plan_or_bp, arrays: dict) -> dict:
    """Contiguous copies of the inputs the plan cannot read in place (on the current stream). Always
    a new allocation: .contiguous() would hand back a contiguous tensor whose pointer is not 16-byte
    aligned unchanged (the GPU fuzzer's CUDA_ERROR_MISALIGNED_ADDRESS)."""
    arrays = dict(arrays)
    for n in plan_or_bp.copy:
        arrays[n] = arrays[n].clone(memory_format=torch.contiguous_format)
    return arrays


def _option_ptrs(plan: Plan, arrays) -> list:
    """The option slots' pointers of a call: its option arrays' (in `plan.options` order) on their
    slots, 0 on the others."""
    pad = plan.option_pad
    if pad is not None:  # consecutive slots: the pointers in order after the pad
        ptrs = list(pad)
        ptrs += map(_data_ptr, arrays)
        return ptrs
    ptrs = list(NO_OPTIONS)
    for i, a in zip(plan.option_index, arrays):
        ptrs[i] = a.data_ptr()
    return ptrs


def _gpu_forward(plan: Plan, q, k, v, arrays=(), want_lse=True, lse_tail=True) -> tuple:
    """(out, lse) of a GPU plan; arrays: its option arrays in `plan.options` order. lse is None (and
    neither allocated nor written) unless wanted; lse_tail=False: wanted by the autograd node alone,
    so a packed batch's lse tail fill is left out (Plan.launch)."""
    st = plan.state.get("torch") or _state(plan)
    if plan.copy:
        a = _copies(plan, dict(zip(plan.options, arrays), q=q, k=k, v=v))
        q, k, v, arrays = a["q"], a["k"], a["v"], tuple(a[n] for n in plan.options)
    out = _empty_like(st.out)
    if want_lse:
        lse = _empty_like(st.lse)
        ptrs = [q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr()]
    else:
        lse = None
        ptrs = [q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), 0]
    if arrays:
        pad = plan.option_pad
        if pad is not None:  # _option_ptrs written out: this runs on every call with options
            ptrs += pad
            ptrs += map(_data_ptr, arrays)
        else:
            ptrs += _option_ptrs(plan, arrays)
    plan.launch(_raw_stream(plan.device_id), ptrs, lse_tail)
    return out, lse


def _gpu_backward(plan: Plan, dout, q, k, v, out, lse, arrays=(), bp=None) -> tuple:
    """(dq, dk, dv, dsink or None) of a GPU plan (arrays: its option arrays in `plan.options` order;
    bp: its backward plan for this dout, if known)."""
    if bp is None:
        try:
            key = ((dout.dtype, dout.shape, dout.stride(), dout.device, dout.data_ptr() & 15),
                   (out.dtype, out.shape, out.stride(), out.device, out.data_ptr() & 15),
                   (lse.dtype, lse.shape, lse.stride(), lse.device, lse.data_ptr() & 15))
            bp = plan._backward[key]
        except Exception:
            bp = ADAPTER.backward_plan(plan, dout, out, lse)
    if bp.copy:
        a = _copies(bp, dict(zip(plan.options, arrays), dout=dout, q=q, k=k, v=v, out=out, lse=lse))
        dout, q, k, v, out, lse = a["dout"], a["q"], a["k"], a["v"], a["out"], a["lse"]
        arrays = tuple(a[n] for n in plan.options)
    st = plan.state.get("torch") or _state(plan)
    scratch_t = bp.state.get("torch")
    if scratch_t is None:
        scratch_t = bp.state["torch"] = _like((max(1, bp.scratch_floats),), _f32, st.device)
    # (no scratch at all for the one-launch backward: BackwardPlan.scratch_floats 0)
    scratch = _empty_like(scratch_t) if bp.scratch_floats else None
    # The gradients' slots are 0 here: launch_split allocates them, after the preprocess has gone out
    # where there is one, so that a single eager backward's first kernel starts that much sooner.
    ptrs = [dout.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(),
            0, 0, 0, scratch.data_ptr() if scratch is not None else 0]
    if arrays:
        ptrs += _option_ptrs(plan, arrays)
    dq, dk, dv = bp.launch_split(_raw_stream(plan.device_id), ptrs, _empty_like, st.out, st.kv)
    dsink = None
    if bp.dsink_shape:
        b, h, rows = bp.dsink_shape
        dsink = scratch[bp.dsink_offset:bp.dsink_offset + b * h * rows].view(b, h, rows).sum(dim=(0, 2))
    return dq, dk, dv, dsink


def _forward(plan, q, k, v, opts):
    if plan.on_gpu:
        return _gpu_forward(plan, q, k, v, _arrays(plan, opts))
    return ADAPTER.run_forward(plan, q, k, v, opts)


def _backward(plan, dout, q, k, v, out, lse, opts):
    if plan.on_gpu:
        return _gpu_backward(plan, dout, q, k, v, out, lse, _arrays(plan, opts))
    bp = ADAPTER.backward_plan(plan, dout, out, lse)
    return ADAPTER.run_backward(plan, bp, dout, q, k, v, out, lse, opts)


class _Attention(torch.autograd.Function):
    """Eager autograd for every cuflash call: apply(plan, lse_seen, q, k, v, *option arrays in
    plan.options order). Gradients flow to q, k, v and sink_logits; lse is not differentiable.
    lse_seen: whether the caller gets lse (return_lse); if not, only the backward reads it, and a
    packed batch's forward leaves out its lse tail fill (a launch)."""

    @staticmethod
    def forward(ctx, plan, lse_seen, q, k, v, *arrays):
        if plan.on_gpu:
            out, lse = _gpu_forward(plan, q, k, v, arrays, True, lse_seen)
        else:
            out, lse = ADAPTER.run_forward(plan, q, k, v, dict(zip(plan.options, arrays)))
        # ctx.save_for_backward(q, k, v, out, lse, *arrays), ctx.mark_non_differentiable(lse) and
        # ctx.set_materialize_grads(False), written as the attribute stores those methods are
        # (torch/autograd/function.py: FunctionCtx), which the C++ apply reads: three Python calls
        # fewer per call.
        ctx.to_save = (q, k, v, out, lse, *arrays)
        ctx.non_differentiable = (lse,)
        # lse gets no gradient: without this, autograd hands backward a zero tensor of lse's shape
        # for it, an allocation that SDPA's backward does not make (measured: +2 MiB of peak at
        # head_dim 64).
        ctx.materialize_grads = False
        ctx.plan = plan
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, *arrays = ctx.saved_tensors
        plan = ctx.plan
        if dout is None:  # only lse was used: no gradient reaches q, k, v
            dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
            dsink = torch.zeros_like(arrays[plan.sink_index]) if plan.has_sink else None
        elif plan.on_gpu:
            # out and lse are this forward's own (contiguous), and autograd hands over dout of out's
            # shape and dtype: dout's layout alone picks the backward plan.
            try:
                bp = plan._backward[(dout.stride(), dout.data_ptr() & 15)]
            except KeyError:
                bp = plan._backward[(dout.stride(), dout.data_ptr() & 15)] = ADAPTER.backward_plan(plan, dout, out, lse)
            dq, dk, dv, dsink = _gpu_backward(plan, dout, q, k, v, out, lse, arrays, bp)
        else:
            dq, dk, dv, dsink = _backward(plan, dout, q, k, v, out, lse, dict(zip(plan.options, arrays)))
        if not arrays:
            return None, None, dq, dk, dv
        return (None, None, dq, dk, dv) + tuple(dsink if n == "sink_logits" else None for n in plan.options)


# torch.autograd.Function.apply is a Python wrapper (default-argument binding for setup_context
# style functions, functorch's dead-wrapper unwrapping over every argument) around the C++ apply;
# outside functorch transforms it reduces to unwrapping the tensors and calling the C++ apply
# directly, which saves ~3 us per call (bench/NOTES.md).
_c_apply = torch._C._FunctionBase.__dict__["apply"].__get__(None, _Attention)


def _apply(plan, lse_seen, q, k, v, arrays):
    if _functorch_active():
        return _Attention.apply(plan, lse_seen, q, k, v, *arrays)
    return _c_apply(plan, lse_seen, _unwrap_if_dead(q), _unwrap_if_dead(k), _unwrap_if_dead(v), *arrays)


def _needs_grad(plan, q, k, v, arrays) -> bool:
    if not _grad_enabled():
        return False
    if q.requires_grad or k.requires_grad or v.requires_grad:
        return True
    return plan.has_sink and arrays[plan.sink_index].requires_grad


def _gpu_call(plan, q, k, v, arrays, return_lse):
    """An eager call of a GPU plan (arrays: the option arrays in plan.options order): the autograd
    node when an input requires grad, else the bare forward without lse unless asked for."""
    if _grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                            or plan.has_sink and arrays[plan.sink_index].requires_grad):
        if _functorch_active():
            out, lse = _Attention.apply(plan, return_lse, q, k, v, *arrays)
        else:
            out, lse = _c_apply(plan, return_lse, _unwrap_if_dead(q), _unwrap_if_dead(k), _unwrap_if_dead(v),
                                *arrays)
    else:
        out, lse = _gpu_forward(plan, q, k, v, arrays, return_lse)
    return (out, lse) if return_lse else out


def _sig(x):
    """A torch tensor's signature (the base adapter's any_sig of it, written out); None for None."""
    if x is None:
        return None
    return (x.__class__, x.dtype, x.shape, x.stride(), x.device, x.data_ptr() & 15)


def _forward_key(q, k, v, causal, softmax_scale, deterministic, return_lse, opts) -> tuple:
    """The base adapter's forward key (sig of q, k, v, then the scalars with their types), written
    out for torch tensors: it is built on every call, as one flat tuple (the same facts as nested
    ones, at fixed positions, in one allocation)."""
    key = ("fwd", q.dtype, q.shape, q.stride(), q.device, q.data_ptr() & 15,
           k.dtype, k.shape, k.stride(), k.device, k.data_ptr() & 15,
           v.dtype, v.shape, v.stride(), v.device, v.data_ptr() & 15,
           causal.__class__, causal, softmax_scale.__class__, softmax_scale,
           deterministic.__class__, deterministic, return_lse.__class__, return_lse)
    if opts:
        key += _options_key(opts)
    return key


_SAME_ARRAY = "the previous option array"   # in an options key: that array's signature, not built twice


def _options_key(opts: dict) -> tuple:
    """The base adapter's options_key, written out for torch tensors and flat: per option its name,
    then for an array its class, dtype, shape, strides, device and pointer alignment (or a marker
    when it is the very tensor of the option before it: q_lengths = kv_lengths, self-attention's
    usual call), for the window window_key's tuple, for another scalar its type and value. Flat is
    unambiguous: names are strings, and each kind of entry has a fixed length."""
    key = ()
    last = None
    for n, x in opts.items():
        if n in _ARRAY_SET:
            if x is None:
                key += (n, None)
            elif x is last:
                key += (n, _SAME_ARRAY)
            else:
                key += (n, x.__class__, x.dtype, x.shape, x.stride(), x.device, x.data_ptr() & 15)
            last = x
        elif n == "window":
            key += (n, window_key(x))
        else:
            key += (n, x.__class__, x)
    return key


_SAME_OFFSETS = "cu_seqlens_k is cu_seqlens_q"   # in a varlen key: equal to no signature


def _varlen_key(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                deterministic, return_lse, opts) -> tuple:
    """The base adapter's varlen key, written out for torch tensors and flat as `_forward_key`: q, k,
    v, cu_seqlens_q (with its class, as `_sig`), then cu_seqlens_k's signature, or a marker when it
    is the very tensor cu_seqlens_q is (self-attention's usual call: its signature is then
    cu_seqlens_q's, and not built twice), then the scalars with their types, then the options."""
    key = ("varlen", q.dtype, q.shape, q.stride(), q.device, q.data_ptr() & 15,
           k.dtype, k.shape, k.stride(), k.device, k.data_ptr() & 15,
           v.dtype, v.shape, v.stride(), v.device, v.data_ptr() & 15,
           cu_seqlens_q.__class__, cu_seqlens_q.dtype, cu_seqlens_q.shape, cu_seqlens_q.stride(),
           cu_seqlens_q.device, cu_seqlens_q.data_ptr() & 15,
           _SAME_OFFSETS if cu_seqlens_k is cu_seqlens_q else _sig(cu_seqlens_k),
           max_seqlen_q.__class__, max_seqlen_q, max_seqlen_k.__class__, max_seqlen_k,
           causal.__class__, causal, softmax_scale.__class__, softmax_scale,
           deterministic.__class__, deterministic, return_lse.__class__, return_lse)
    if opts:
        key += _options_key(opts)
    return key


def _kvcache_key(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, causal, softmax_scale,
                 return_lse, window, num_sink_tokens, sink_logits, alibi_slopes, softcap, num_splits) -> tuple:
    """cuflash/_kvcache.py _fast_key over this adapter's sig, written out for torch tensors as one
    flat tuple (the same facts: every array's class, dtype, shape, strides, device and pointer
    alignment, every scalar with its type), read on every decode call. Raises TypeError for arrays
    of another class than q's (the full path names them)."""
    t = q.__class__
    if k_cache.__class__ is not t or v_cache.__class__ is not t:
        raise TypeError("mixed array types")
    s = cache_seqlens
    if s.__class__ is t:
        s = (s.dtype, s.shape, s.stride(), s.device, s.data_ptr() & 15)
    elif s is None or s.__class__ is int:
        s = (s.__class__, s)
    else:
        raise TypeError("mixed array types")
    if (k is None and v is None and cache_batch_idx is None and block_table is None and sink_logits is None
            and alibi_slopes is None):
        opt = None
    else:
        opt = []
        for x in (k, v, cache_batch_idx, block_table, sink_logits, alibi_slopes):
            if x is None:
                opt.append(None)
            elif x.__class__ is t:
                opt.append((x.dtype, x.shape, x.stride(), x.device, x.data_ptr() & 15))
            else:
                raise TypeError("mixed array types")
        opt = tuple(opt)
    return (t, q.dtype, q.shape, q.stride(), q.device, k_cache.dtype, k_cache.shape, k_cache.stride(),
            k_cache.device, v_cache.dtype, v_cache.shape, v_cache.stride(), v_cache.device,
            q.data_ptr() & 15 | (k_cache.data_ptr() & 15) << 4 | (v_cache.data_ptr() & 15) << 8, s, opt,
            causal.__class__, causal, softmax_scale.__class__, softmax_scale, return_lse.__class__, return_lse,
            window_key(window), num_sink_tokens.__class__, num_sink_tokens, softcap.__class__, softcap,
            num_splits.__class__, num_splits)


class TorchAdapter(Adapter):
    lib = "torch"
    ptr_fn = staticmethod(_data_ptr)
    kvcache_key = staticmethod(_kvcache_key)

    def info(self, x) -> ArrayInfo:
        d = x.device
        if d.type == "cuda":
            device = ("cuda", d.index if d.index is not None else torch.cuda.current_device())
        else:
            device = (d.type, 0)
        if _is_compiling():
            # Under torch.compile this code is traced (fake tensors, no pointers): the custom op's
            # real implementation checks the layout when it runs.
            return ArrayInfo("torch", tuple(x.shape), tuple(x.stride()), str(x.dtype)[6:], device, True,
                             "torch.Tensor")
        try:
            aligned = x.data_ptr() % 16 == 0
        except Exception:  # meta tensors have no storage
            aligned = True
        return ArrayInfo("torch", tuple(x.shape), tuple(x.stride()), str(x.dtype)[6:], device, aligned,
                         f"{type(x).__module__}.{type(x).__qualname__}")

    def sig(self, x) -> tuple:
        return (x.dtype, x.shape, x.stride(), x.device, x.data_ptr() & 15)

    def sigs(self, xs: tuple) -> tuple:
        key = ()
        for x in xs:  # flat, as _forward_key
            key += (x.dtype, x.shape, x.stride(), x.device, x.data_ptr() & 15)
        return key

    def forward_key(self, q, k, v, causal, softmax_scale, deterministic, return_lse, opts) -> tuple:
        return _forward_key(q, k, v, causal, softmax_scale, deterministic, return_lse, opts)

    def varlen_key(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                   deterministic, return_lse, opts) -> tuple:
        return _varlen_key(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                           deterministic, return_lse, opts)

    # ---- primitives of the generic pipeline (CPU tensors, the public backward) ----
    def ptr(self, x, keep) -> int:
        return x.data_ptr()

    def stream(self, device_id: int) -> int:
        return _raw_stream(device_id)

    def empty(self, shape, dtype: str, device_id: int):
        return _empty(shape, dtype=getattr(torch, dtype), device=torch.device("cuda", device_id))

    @staticmethod
    def _template(cache: dict, shape, dtype: str, device_id: int):
        """A stride-0 tensor of the shape, kept in cache: torch.empty_like of it allocates with no
        dtype / device arguments to parse per call (_like)."""
        key = (shape, dtype, device_id)
        t = cache.get(key)
        if t is None:
            t = cache[key] = _like(shape, getattr(torch, dtype), torch.device("cuda", device_id))
        return t

    def empty_from(self, cache: dict, shape, dtype: str, device_id: int):
        return _empty_like(self._template(cache, shape, dtype, device_id))

    def allocator(self, cache: dict, shape, dtype: str, device_id: int):
        return functools.partial(_empty_like, self._template(cache, shape, dtype, device_id))

    def contiguous(self, x, device_id, keep):
        return x.clone(memory_format=torch.contiguous_format)  # a new, aligned allocation (see _copies)

    def dsink_sum(self, scratch, offset, shape, device_id):
        b, h, rows = shape
        return scratch[offset:offset + b * h * rows].view(b, h, rows).sum(dim=(0, 2))

    def to_numpy(self, x):
        if x.dtype == torch.bfloat16:
            import ml_dtypes

            return x.detach().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return x.detach().numpy()

    def from_numpy(self, a, like):
        import numpy as np

        if a.dtype.name == "bfloat16":
            return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(np.ascontiguousarray(a))

    # ---- entry points ----
    def attention(self, q, k, v, causal, softmax_scale, return_lse, deterministic, opts):
        if _is_compiling():
            return _traced_attention(q, k, v, causal, softmax_scale, return_lse, deterministic, opts)
        try:  # the hot path: a repeat signature
            plan = CACHE[_forward_key(q, k, v, causal, softmax_scale, deterministic, return_lse, opts)]
        except Exception:
            plan = self.forward_plan(q, k, v, causal, softmax_scale, deterministic, return_lse, opts)
        if plan.on_gpu:
            return _gpu_call(plan, q, k, v, plan.take_options(opts) if plan.options else (), return_lse)
        out, lse = self.forward(plan, q, k, v, opts or {})
        return (out, lse) if return_lse else out

    def forward(self, plan, q, k, v, opts, want_lse=True):
        arrays = _arrays(plan, opts)
        if _needs_grad(plan, q, k, v, arrays):
            return _apply(plan, True, q, k, v, arrays)
        if plan.on_gpu:
            return _gpu_forward(plan, q, k, v, arrays, want_lse)
        return Adapter.run_forward(self, plan, q, k, v, opts)

    def run_forward(self, plan, q, k, v, opts, want_lse=True):
        if plan.on_gpu:
            return _gpu_forward(plan, q, k, v, _arrays(plan, opts), want_lse)
        return Adapter.run_forward(self, plan, q, k, v, opts)

    def attention_varlen(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                         softmax_scale, return_lse, deterministic, opts):
        if _is_compiling():
            return _traced_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                  softmax_scale, return_lse, deterministic, opts)
        try:  # the hot path, as attention's
            plan = CACHE[_varlen_key(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                     softmax_scale, deterministic, return_lse, opts)]
        except Exception:
            plan = self.varlen_plan(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                    softmax_scale, deterministic, return_lse, opts)
        if plan.on_gpu:
            if opts:
                arrays = plan.take_options(dict(opts, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k))
            else:  # no option: the plan's arrays are the offsets (its options are the key's, none here)
                arrays = (cu_seqlens_q, cu_seqlens_k)
            return _gpu_call(plan, q, k, v, arrays, return_lse)
        out, lse = self.forward(plan, q, k, v, dict(opts, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k))
        return (out, lse) if return_lse else out

    def backward(self, plan, dout, q, k, v, out, lse, opts):
        bp = self.backward_plan(plan, dout, out, lse)  # checks dout, out, lse on a miss
        if plan.on_gpu:
            return _gpu_backward(plan, dout, q, k, v, out, lse, _arrays(plan, opts), bp)
        return self.run_backward(plan, bp, dout, q, k, v, out, lse, opts)

    def lengths_from_padding_mask(self, mask):
        m = mask.to(torch.bool)
        lengths = m.sum(dim=1, dtype=torch.int32)
        pos = torch.arange(m.shape[1], device=m.device)
        return lengths, bool(torch.equal(m, pos[None, :] < lengths[:, None]))


ADAPTER = TorchAdapter()


def _announce():
    """adapter_for returns this adapter from now on without importing: under torch.compile the
    import would otherwise happen inside a trace and leave a guard on it (one recompilation)."""
    from .. import _adapters

    _adapters._TORCH = ADAPTER


_announce()



# ---------------------------------------------------------------------------------------------
# torch.compile: the operators, and the autograd.Function torch.compile traces around them.
#
# The four operators are defined with torch.library.Library (schema, a Python implementation for
# the CUDA and CPU keys, a fake implementation for tracing) and nothing else: a call from a
# compiled graph goes dispatcher -> Python implementation -> the same plans as eager calls.
# torch.library.custom_op wraps the same implementation in more Python and register_autograd adds
# a Python autograd kernel to every call, compiled or not: measured on a 2-core CPU host, 25 us a
# call against 6.6 (bench/NOTES.md). Gradients under torch.compile come instead from
# `_CompiledAttention` / `_CompiledFeatAttention`, autograd.Functions whose forward and backward are
# one operator call each: Dynamo traces them into the graph and AOTAutograd takes the backward
# from them. The operators themselves have no autograd formula: call cuflash.attention (which
# picks this route under tracing) rather than torch.ops.cuflash.* when gradients are needed.
# ---------------------------------------------------------------------------------------------

_LIB = torch.library.Library("cuflash", "DEF")
_LIB.define("attention_fwd(Tensor q, Tensor k, Tensor v, bool causal, float softmax_scale, bool deterministic)"
            " -> (Tensor, Tensor)")
_LIB.define("attention_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, bool causal,"
            " float softmax_scale, bool deterministic) -> (Tensor, Tensor, Tensor)")
_FEAT_ARGS = ("Tensor? q_lengths, Tensor? kv_lengths, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, Tensor? sink_logits,"
              " Tensor? alibi_slopes, float softmax_scale, bool deterministic, int window_left, int window_right,"
              " int num_sink_tokens, float softcap, int max_seqlen_q, int max_seqlen_k")
_LIB.define(f"attention_feat_fwd(Tensor q, Tensor k, Tensor v, {_FEAT_ARGS}) -> (Tensor, Tensor)")
_LIB.define(f"attention_feat_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, {_FEAT_ARGS})"
            " -> (Tensor, Tensor, Tensor, Tensor)")


def _impl(name):
    def register(fn):
        for key in ("CUDA", "CPU"):
            _LIB.impl(name, fn, key)
        return fn
    return register


def _fake(name):
    def register(fn):
        torch.library.register_fake(f"cuflash::{name}", fn, lib=_LIB)
        return fn
    return register


@_impl("attention_fwd")
def attention_fwd(q, k, v, causal, softmax_scale, deterministic):
    plan = ADAPTER.forward_plan(q, k, v, causal, softmax_scale, deterministic, False, None)
    return _forward(plan, q, k, v, {})


@_fake("attention_fwd")
def _attention_fwd_fake(q, k, v, causal, softmax_scale, deterministic):
    b, sq, h, d = q.shape
    return q.new_empty((b, sq, h, d)), q.new_empty((b, h, sq), dtype=torch.float32)


@_impl("attention_bwd")
def attention_bwd(dout, q, k, v, out, lse, causal, softmax_scale, deterministic):
    plan = ADAPTER.forward_plan(q, k, v, causal, softmax_scale, deterministic, False, None)
    return _backward(plan, dout, q, k, v, out, lse, {})[:3]


@_fake("attention_bwd")
def _attention_bwd_fake(dout, q, k, v, out, lse, causal, softmax_scale, deterministic):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


# The options: one op pair for padded and packed batches. Array options are optional tensors,
# scalars plain arguments (already normalized: causal folded into window_right). max_seqlen_q < 0
# marks a padded batch (q is 4-D); otherwise q, k, v are packed (3-D) and cu_seqlens_* are given.

def _feat_opts(arrays, window_left, window_right, num_sink_tokens, softcap):
    opts = {n: a for n, a in zip(ARRAY_OPTIONS, arrays) if a is not None}
    opts.update(window=(window_left, window_right), num_sink_tokens=num_sink_tokens,
                softcap=softcap if softcap > 0 else None)
    return opts


def _feat_plan(q, k, v, arrays, softmax_scale, deterministic, window_left, window_right, num_sink_tokens,
               softcap, max_seqlen_q, max_seqlen_k):
    opts = _feat_opts(arrays, window_left, window_right, num_sink_tokens, softcap)
    if max_seqlen_q >= 0:
        cu_q, cu_k = opts.pop("cu_seqlens_q"), opts.pop("cu_seqlens_k")
        plan = ADAPTER.varlen_plan(q, k, v, cu_q, cu_k, max_seqlen_q, max_seqlen_k, False, softmax_scale,
                                   deterministic, False, opts)
        opts.update(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
        return plan, opts
    return ADAPTER.forward_plan(q, k, v, False, softmax_scale, deterministic, False, opts), opts


@_impl("attention_feat_fwd")
def attention_feat_fwd(q, k, v, q_lengths, kv_lengths, cu_seqlens_q, cu_seqlens_k, sink_logits, alibi_slopes,
                       softmax_scale, deterministic, window_left, window_right, num_sink_tokens, softcap,
                       max_seqlen_q, max_seqlen_k):
    arrays = (q_lengths, kv_lengths, cu_seqlens_q, cu_seqlens_k, sink_logits, alibi_slopes)
    plan, opts = _feat_plan(q, k, v, arrays, softmax_scale, deterministic, window_left, window_right,
                            num_sink_tokens, softcap, max_seqlen_q, max_seqlen_k)
    return _forward(plan, q, k, v, opts)


@_fake("attention_feat_fwd")
def _attention_feat_fwd_fake(q, k, v, q_lengths, kv_lengths, cu_seqlens_q, cu_seqlens_k, sink_logits, alibi_slopes,
                             softmax_scale, deterministic, window_left, window_right, num_sink_tokens, softcap,
                             max_seqlen_q, max_seqlen_k):
    if max_seqlen_q >= 0:
        total_q, h, _ = q.shape
        return q.new_empty(q.shape), q.new_empty((h, total_q), dtype=torch.float32)
    b, sq, h, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((b, h, sq), dtype=torch.float32)


@_impl("attention_feat_bwd")
def attention_feat_bwd(dout, q, k, v, out, lse, q_lengths, kv_lengths, cu_seqlens_q, cu_seqlens_k, sink_logits,
                       alibi_slopes, softmax_scale, deterministic, window_left, window_right, num_sink_tokens,
                       softcap, max_seqlen_q, max_seqlen_k):
    """(dq, dk, dv, dsink); dsink is an empty tensor without sink logits."""
    arrays = (q_lengths, kv_lengths, cu_seqlens_q, cu_seqlens_k, sink_logits, alibi_slopes)
    plan, opts = _feat_plan(q, k, v, arrays, softmax_scale, deterministic, window_left, window_right,
                            num_sink_tokens, softcap, max_seqlen_q, max_seqlen_k)
    dq, dk, dv, dsink = _backward(plan, dout, q, k, v, out, lse, opts)
    if dsink is None:
        dsink = q.new_empty((0,), dtype=torch.float32)
    return dq, dk, dv, dsink


@_fake("attention_feat_bwd")
def _attention_feat_bwd_fake(dout, q, k, v, out, lse, q_lengths, kv_lengths, cu_seqlens_q, cu_seqlens_k, sink_logits,
                             alibi_slopes, softmax_scale, deterministic, window_left, window_right, num_sink_tokens,
                             softcap, max_seqlen_q, max_seqlen_k):
    n = 0 if sink_logits is None else sink_logits.shape[0]
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), q.new_empty((n,), dtype=torch.float32)


# The operators' namespace, read once: traced code that spells torch.ops.cuflash.<op> leaves a guard on
# each attribute of the chain.
_OPS = torch.ops.cuflash


class _CompiledAttention(torch.autograd.Function):
    """A plain call under tracing: forward and backward are one operator each."""

    @staticmethod
    def forward(ctx, q, k, v, causal, softmax_scale, deterministic):
        out, lse = _OPS.attention_fwd(q, k, v, causal, softmax_scale, deterministic)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.softmax_scale, ctx.deterministic = causal, softmax_scale, deterministic
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _OPS.attention_bwd(dout, q, k, v, out, lse, ctx.causal, ctx.softmax_scale,
                                                     ctx.deterministic)
        return dq, dk, dv, None, None, None


class _CompiledFeatAttention(torch.autograd.Function):
    """A call with options under tracing: apply(q, k, v, *6 option arrays (None where absent),
    *8 scalars of attention_feat_fwd)."""

    @staticmethod
    def forward(ctx, q, k, v, *args):
        arrays, scalars = args[:6], args[6:]
        out, lse = _OPS.attention_feat_fwd(q, k, v, *arrays, *scalars)
        ctx.save_for_backward(q, k, v, out, lse, *arrays)
        ctx.scalars = scalars
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, *arrays = ctx.saved_tensors
        dq, dk, dv, dsink = _OPS.attention_feat_bwd(dout, q, k, v, out, lse, *arrays, *ctx.scalars)
        sink = arrays[4]
        return (dq, dk, dv, None, None, None, None, dsink if sink is not None else None) + (None,) * 9


def _traced_call_ops(q, k, v, call, arrays: dict, return_lse):
    """Under tracing: the autograd.Function of a validated call."""
    if call.feats is None:
        out, lse = _CompiledAttention.apply(q, k, v, call.causal, call.scale, call.deterministic)
    else:
        f = call.feats
        mq, mk = call.packed if call.packed else (-1, -1)
        out, lse = _CompiledFeatAttention.apply(
            q, k, v, *(arrays.get(n) for n in ARRAY_OPTIONS), call.scale, call.deterministic, f.window_left,
            f.window_right, f.num_sink_tokens, float(f.softcap), int(mq), int(mk))
    return (out, lse) if return_lse else out


# ---- the checks under tracing ----
#
# Dynamo guards every global, function and constant tuple the code it traces reads: traced through
# describe_forward, the checks left ~110 guards (bench/NOTES.md), evaluated on every call of the
# compiled code. With static shapes the checks instead run once, at trace time, outside Dynamo's
# view: `_checked` takes the call's signature (dtypes, sizes, strides, devices, scalars: all
# constants then) as a torch.compiler.assume_constant_result function, and the traced code reads
# only its result. Dynamo still guards the tensors' dtypes, sizes and strides, so a call with
# another signature re-traces and is checked again. Symbolic shapes, or arguments that are not
# constants, take the traced checks below.

def _static_sig(x):
    """(dtype, sizes, strides, device) of a tensor whose sizes and strides are ints, else None."""
    shape, stride = tuple(x.shape), tuple(x.stride())
    for n in shape + stride:
        if n.__class__ is not int:  # under Dynamo, type(n) of a symbolic size says int; __class__ does not
            return None
    return (x.dtype, shape, stride, x.device)


def _scalar_sig(x):
    """x if it is a constant Dynamo can pass to `_checked` (a number, bool, None, or a pair of them), else
    a marker that sends the call to the traced checks."""
    # x.__class__, not type(x): under Dynamo type() of a symbolic int says int. Literal tuples of types,
    # not a module constant: Dynamo guards each element of a global tuple it reads.
    if x is None or x.__class__ in (bool, int, float):
        return x
    if x.__class__ is tuple and len(x) == 2 and x[0].__class__ in (bool, int, float) \
            and x[1].__class__ in (bool, int, float):
        return x
    return _scalar_sig


def _call_sig(q, k, v, causal, softmax_scale, deterministic, return_lse, opts, packed):
    """The signature `_checked` validates, or None when some part of it is not a trace-time constant."""
    sigs = (_static_sig(q), _static_sig(k), _static_sig(v))
    if sigs[0] is None or sigs[1] is None or sigs[2] is None:
        return None
    scalars = (_scalar_sig(causal), _scalar_sig(softmax_scale), _scalar_sig(deterministic), _scalar_sig(return_lse))
    items = []
    for name, x in (opts or {}).items():
        if isinstance(x, torch.Tensor):
            t = _static_sig(x)
            if t is None:
                return None
            items.append((name, True, t))
        else:
            items.append((name, False, _scalar_sig(x)))
    if packed is not None:
        cu_q, cu_k, mq, mk = packed
        if not (isinstance(cu_q, torch.Tensor) and isinstance(cu_k, torch.Tensor)):
            return None
        packed = (_static_sig(cu_q), _static_sig(cu_k), _scalar_sig(mq), _scalar_sig(mk))
        if packed[0] is None or packed[1] is None:
            return None
        scalars += packed[2:]
    for x in scalars:
        if x is _scalar_sig:
            return None
    for item in items:
        if item[2] is _scalar_sig:
            return None
    return (sigs, scalars[:4], tuple(items), packed)


def _info(sig) -> ArrayInfo:
    dtype, shape, stride, device = sig
    index = device.index if device.index is not None else (torch.cuda.current_device() if device.type == "cuda" else 0)
    return ArrayInfo("torch", shape, stride, str(dtype)[6:], (device.type, index if device.type == "cuda" else 0),
                     True, "torch.Tensor")


@torch.compiler.assume_constant_result
def _checked(sig):
    """Validates a call from its signature (see above): ("", what the traced code applies) or
    (the exception's type name, its message)."""
    sigs, (causal, scale, det, ret), items, packed = sig
    opts = {name: (_info(x) if is_tensor else x) for name, is_tensor, x in items}
    infos = [_info(x) for x in sigs]
    try:
        if packed is None:
            call = _call.describe_forward(infos, causal, scale, det, ret, **opts)
        else:
            call = _call.describe_varlen(infos, _info(packed[0]), _info(packed[1]), packed[2], packed[3], causal,
                                         scale, det, ret, **opts)
    except (TypeError, ValueError) as e:
        return (type(e).__name__, str(e))
    if call.feats is None:
        return ("", (True, call.causal, call.scale, call.deterministic))
    f = call.feats
    mq, mk = call.packed if call.packed else (-1, -1)
    return ("", (False, call.scale, call.deterministic, f.window_left, f.window_right, f.num_sink_tokens,
                 float(f.softcap), int(mq), int(mk)))


def _apply_checked(q, k, v, res, arrays: dict, return_lse):
    """The autograd.Function of a call `_checked` accepted."""
    if res[0]:
        raise (TypeError if res[0] == "TypeError" else ValueError)(res[1])
    a = res[1]
    if a[0]:
        out, lse = _CompiledAttention.apply(q, k, v, a[1], a[2], a[3])
    else:
        out, lse = _CompiledFeatAttention.apply(
            q, k, v, arrays.get("q_lengths"), arrays.get("kv_lengths"), arrays.get("cu_seqlens_q"),
            arrays.get("cu_seqlens_k"), arrays.get("sink_logits"), arrays.get("alibi_slopes"), *a[1:])
    return (out, lse) if return_lse else out


def _traced_attention(q, k, v, causal, softmax_scale, return_lse, deterministic, opts):
    sig = _call_sig(q, k, v, causal, softmax_scale, deterministic, return_lse, opts, None)
    if sig is not None:
        return _apply_checked(q, k, v, _checked(sig), opts or {}, return_lse)
    return _traced_attention_checks(q, k, v, causal, softmax_scale, return_lse, deterministic, opts)


def _traced_attention_checks(q, k, v, causal, softmax_scale, return_lse, deterministic, opts):
    from ._base import option_infos

    infos = [info_of(x) for x in (q, k, v)]
    call = _call.describe_forward(infos, causal, softmax_scale, deterministic, return_lse,
                                  **option_infos(opts or {}))
    return _traced_call_ops(q, k, v, call, opts or {}, return_lse)


def _traced_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                   return_lse, deterministic, opts):
    sig = _call_sig(q, k, v, causal, softmax_scale, deterministic, return_lse, opts,
                    (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k))
    if sig is not None:
        arrays = dict(opts, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
        return _apply_checked(q, k, v, _checked(sig), arrays, return_lse)
    return _traced_varlen_checks(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                 softmax_scale, return_lse, deterministic, opts)


def _traced_varlen_checks(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                          return_lse, deterministic, opts):
    from ._base import option_infos

    infos = [info_of(x) for x in (q, k, v)]
    call = _call.describe_varlen(infos, info_of(cu_seqlens_q), info_of(cu_seqlens_k), max_seqlen_q, max_seqlen_k,
                                 causal, softmax_scale, deterministic, return_lse, **option_infos(opts))
    arrays = dict(opts, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    return _traced_call_ops(q, k, v, call, arrays, return_lse)

