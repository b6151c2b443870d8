"""The public entry points: the front door of the pipeline.

    adapter (_adapters/)  ->  Call (_call.py)  ->  Plan (_plan.py)  ->  run

Each function picks the adapter of q's library and hands it the call. The adapter looks the
call's signature up in the plan cache; on a miss the arguments are validated into a Call and
planned (kernels chosen, compiled or loaded, Params filled), and bad input gets its
ValueError / TypeError there, before anything runs. A repeat call with the same signature only
reads pointers, allocates the outputs and launches. `plan` / `plan_varlen` return the same plans as
objects a caller can hold for a fixed shape.
"""

from __future__ import annotations

from ._adapters import adapter_for, info_of
from ._adapters._base import Adapter

_NO_ADAPTER = Adapter()  # arguments of no known library: validation names the argument


def _adapter(q) -> Adapter:
    return adapter_for(q) or _NO_ADAPTER


def _options(q_lengths, kv_lengths, window, num_sink_tokens, sink_logits, alibi_slopes, softcap):
    """The options given (name -> value, the defaults left out: each entry costs host time in the
    signature key), or None when none is (the plain call: no option key, no checks)."""
    opts = {}
    if q_lengths is not None:
        opts["q_lengths"] = q_lengths
    if kv_lengths is not None:
        opts["kv_lengths"] = kv_lengths
    if window is not None:
        opts["window"] = window
    if num_sink_tokens.__class__ is not int or num_sink_tokens != 0:
        opts["num_sink_tokens"] = num_sink_tokens
    if sink_logits is not None:
        opts["sink_logits"] = sink_logits
    if alibi_slopes is not None:
        opts["alibi_slopes"] = alibi_slopes
    if softcap is not None:
        opts["softcap"] = softcap
    return opts or None


def attention(q, k, v, causal: bool = False, softmax_scale: float | None = None, return_lse: bool = False,
              deterministic: bool = False, *, q_lengths=None, kv_lengths=None, window=None, num_sink_tokens: int = 0,
              sink_logits=None, alibi_slopes=None, softcap: float | None = None):
    """Exact attention, softmax(scale * Q K^T) V, computed FlashAttention-style: tiled, online softmax,
    no seqlen_q x seqlen_k matrix in memory.

    Args:
        q: (batch, seqlen_q, nheads, head_dim)
        k: (batch, seqlen_k, nheads_kv, head_dim)
        v: (batch, seqlen_k, nheads_kv, head_dim)
            float16 or bfloat16; head_dim a multiple of 8 from 8 to 256; nheads a multiple of
            nheads_kv (MQA / GQA: query head h uses kv head h // (nheads // nheads_kv)).
            torch tensors, JAX arrays, CuPy arrays or NumPy arrays, all of one kind and on one
            device. CUDA arrays run the tensor-core kernels on the caller's current stream; CPU
            arrays (NumPy, torch or JAX on the CPU) run the NumPy implementation.
            Any strides with a contiguous last dimension are used in place, e.g. a torch
            (batch, nheads, seqlen, head_dim) tensor passed as ``.transpose(1, 2)``. An input whose
            last dimension is not contiguous, or (on the GPU) whose pointer or strides are not
            16-byte aligned, is copied first.
        causal: mask aligned to the bottom-right corner, as in flash-attn >= 2.1: query row i sees
            key j iff j <= i + seqlen_k - seqlen_q. For seqlen_q = 2, seqlen_k = 5 (1 = kept)::

                1 1 1 1 0
                1 1 1 1 1

            and for seqlen_q = 5, seqlen_k = 2::

                0 0
                0 0
                0 0
                1 0
                1 1

            A row that sees no key gets out = 0 and lse = -inf.
        softmax_scale: multiplies Q K^T before the softmax; default 1 / sqrt(head_dim). Must be > 0.
        return_lse: also return lse.
        deterministic: passed to the backward pass (see `attention_backward`) when gradients are
            taken through this call.
        q_lengths, kv_lengths: int32 (batch,) arrays of q's library on q's device: the valid query
            rows and keys of each batch entry (a padded batch). Keys at or past kv_lengths[b] are
            masked; query rows at or past q_lengths[b] get out = 0, lse = -inf and zero gradients.
            Causal and window alignment use the valid lengths. `lengths_from_padding_mask` makes
            them from a (batch, seqlen) padding mask. Values on the GPU are not read back (that
            would stall the stream): the kernels clamp them to [0, seqlen]; CPU values are checked.
        window: (left, right): query row i sees keys [i' - left, i' + right], i' = i + sk - sq the
            bottom-right aligned position (as causal); -1 = unbounded on that side. causal=True
            is window right = 0 (a right > 0 with causal=True is a ValueError).
        num_sink_tokens: the first n keys stay visible to every query in addition to the window
            (StreamingLLM); they lift the left bound only, never causality / the right bound.
        sink_logits: float32 (nheads,), one learned logit per head (gpt-oss): exp(sink_logits[h])
            joins every row's softmax denominator without a value. Differentiable (torch autograd,
            JAX, and `attention_backward` returns its gradient).
        alibi_slopes: float32 (nheads,) or (batch, nheads): adds -slope * |i' - j| to the scores.
        softcap: c > 0: scores become c * tanh(scores / c) before the softmax (Gemma); None or 0
            is off.

    Gradients: torch tensors that require grad record an autograd node (saving q, k, v, out and
    lse, never the probabilities); under torch.compile the call is a torch.library custom op, so
    it traces without a graph break. JAX arrays work with jax.grad / jax.vjp (jax.custom_vjp).
    Under jax.jit and vmap the call runs on the CPU (the NumPy path through jax.pure_callback;
    vmap calls it once per mapped element); compiling it for a GPU raises NotImplementedError at
    lowering, before anything runs. lse is not differentiable: no gradient flows back through it.

    Every combination of the options is accepted. Calls that use none of them (or only a window
    equivalent to plain / causal attention) run the plain kernels; the others run the feature
    kernels, which visit only the tiles the mask leaves visible.

    Host cost: the checks and the kernel choice are made once per call signature (dtypes,
    shapes, strides, devices, options) and cached; a repeat call only allocates the outputs,
    reads the pointers and launches. `plan` returns that work as an object.

    Returns:
        out: q's shape and dtype, the caller's kind of array on q's device.
        lse (if return_lse): (batch, nheads, seqlen_q) float32, the natural-log logsumexp of each
            row of scaled, masked scores (the sink logit included).

    Raises:
        TypeError / ValueError naming the argument, before anything runs on the device.
    """
    opts = _options(q_lengths, kv_lengths, window, num_sink_tokens, sink_logits, alibi_slopes, softcap)
    return _adapter(q).attention(q, k, v, causal, softmax_scale, return_lse, deterministic, opts)


def attention_backward(dout, q, k, v, out, lse, causal: bool = False, softmax_scale: float | None = None,
                       deterministic: bool = False, *, q_lengths=None, kv_lengths=None, window=None,
                       num_sink_tokens: int = 0, sink_logits=None, alibi_slopes=None, softcap: float | None = None):
    """Gradients of attention by recomputation: returns (dq, dk, dv).

    Args:
        dout: gradient of the loss with respect to out, q's shape and dtype.
        q, k, v, causal, softmax_scale and the feature options (q_lengths ... softcap): as given
            to `attention`.
        out, lse: what `attention(..., return_lse=True)` returned for them.
        deterministic: if True, dq, dk and dv are bitwise identical from run to run. dK and dV are
            always computed without atomics (a GQA group is summed inside one thread block). dQ has
            two implementations: float atomics inside the dK/dV kernel (run-to-run order varies), or
            a separate kernel over the forward's partition, which recomputes Q K^T and dO V^T but
            needs no atomics. On Hopper (sm_90a) at head_dim 64 and 128, the wgmma dK/dV kernel
            computes dQ from the dS it already holds and adds it with float atomics, and that is
            what deterministic=False runs; deterministic=True runs the separate pass instead (on
            an H100, bf16, batch 4, seqlen 4096, head_dim 128: 370 against 265 TFLOP/s, causal 311
            against 225; bench/NOTES.md). Elsewhere both settings run the separate pass, which
            measured faster there than the mma.sync kernel's atomics (cuflash/_config.py:
            BWD_ATOMIC_DQ), so deterministic=True costs nothing.

    Returns:
        dq, dk, dv with the shapes and dtype of q, k, v (dk and dv summed over the query heads of
        each GQA group), the caller's kind of array. Rows that see no key contribute zero gradient.
        With sink_logits, a fourth result: d sink_logits, float32 (nheads,).
    """
    ad = _adapter(q)
    opts = _options(q_lengths, kv_lengths, window, num_sink_tokens, sink_logits, alibi_slopes, softcap)
    plan = ad.forward_plan(q, k, v, causal, softmax_scale, deterministic, False, opts)
    if _traced(plan):
        from ._adapters._jax import traced_backward

        dq, dk, dv, dsink = traced_backward(dout, q, k, v, out, lse, opts or {},
                                            (causal, softmax_scale, deterministic, False), None)
    else:
        dq, dk, dv, dsink = ad.backward(plan, dout, q, k, v, out, lse, opts or {})
    return (dq, dk, dv, dsink) if sink_logits is not None else (dq, dk, dv)


def _traced(plan) -> bool:
    """Whether the call was planned on JAX tracers (under jit: see cuflash/_adapters/_jax.py)."""
    return plan.call.device[0] == "traced"


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                     causal: bool = False, softmax_scale: float | None = None, return_lse: bool = False,
                     deterministic: bool = False, *, window=None, num_sink_tokens: int = 0, sink_logits=None,
                     alibi_slopes=None, softcap: float | None = None, block_table=None):
    """Attention over a packed batch of sequences of different lengths (flash-attn's varlen form).

    Args:
        q: (total_q, nheads, head_dim); k, v: (total_k, nheads_kv, head_dim). Sequence b owns rows
            [cu_seqlens_q[b], cu_seqlens_q[b + 1]) of q and [cu_seqlens_k[b], cu_seqlens_k[b + 1])
            of k and v.
        cu_seqlens_q, cu_seqlens_k: int32 (batch + 1,) non-decreasing offsets, q's library and
            device. Sequences of length 0 are allowed. Rows past cu_seqlens[-1] belong to no
            sequence: out = 0, lse = -inf and zero gradients there.
        max_seqlen_q, max_seqlen_k: ints >= every sequence's length (they size the grid; values
            on the GPU are not read back, and a longer sequence is cut to them).
        causal, softmax_scale, deterministic, window, num_sink_tokens, sink_logits, alibi_slopes
            (float32 (nheads,) or (batch, nheads)), softcap: as for `attention`, per sequence.
        block_table: int32 (batch, max_blocks_per_seq), batch = len(cu_seqlens_q) - 1, or None. With
            it the keys come from a paged KV cache (a prefill that reads its prefix from the cache, as
            flash-attn's varlen call with block_table): k and v are (num_blocks, page_size,
            nheads_kv, head_dim), page_size a multiple of 16, and sequence b's key t, for t in
            [0, cu_seqlens_k[b + 1] - cu_seqlens_k[b]), is k[block_table[b, t // page_size],
            t % page_size]. cu_seqlens_k then only gives the key lengths (its differences; the
            offsets index nothing, and need not start at 0). Each length must be <= max_seqlen_k
            and <= max_blocks_per_seq * page_size; the table entries a sequence reads (its first
            ceil(length / page_size)) must be in [0, num_blocks), the rest may hold anything, and
            sequences may share blocks (a common prefix). q, out, lse and every option are as
            without it (masks bottom-right aligned on each sequence's lengths). Forward only, eager:
            torch inputs that require grad (with grad mode on) and JAX tracers (jax.jit, jax.grad,
            vmap) raise NotImplementedError before anything runs. On the CPU path (NumPy, torch or
            JAX CPU arrays) the values are checked (ValueError); on the GPU they are not read back
            (out-of-range block numbers are clamped into the cache), and on sm_90a the pages are read
            in place where the warp-specialized feature kernel serves the call and its TMA boxes have
            at least 32 rows (page sizes that are multiples of 32), or 16 rows copied as whole rows
            (head_dim 128 / 256, pages one after another in memory) for max_seqlen_q x the GQA group
            below 2048, else gathered into packed arrays first (README, Paged prefill).
    Returns:
        out (total_q, nheads, head_dim), and with return_lse lse (nheads, total_q) float32.
    Gradients flow as for `attention` (torch autograd, JAX eager); `attention_varlen_backward`
    computes them directly (not with block_table).
    """
    if block_table is not None:
        from ._kvcache import attention_varlen_paged

        return attention_varlen_paged(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                      softmax_scale, return_lse, deterministic, block_table=block_table,
                                      window=window, num_sink_tokens=num_sink_tokens, sink_logits=sink_logits,
                                      alibi_slopes=alibi_slopes, softcap=softcap)
    opts = _options(None, None, window, num_sink_tokens, sink_logits, alibi_slopes, softcap) or {}
    return _adapter(q).attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                        softmax_scale, return_lse, deterministic, opts)


def attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int,
                              max_seqlen_k: int, causal: bool = False, softmax_scale: float | None = None,
                              deterministic: bool = False, *, window=None, num_sink_tokens: int = 0,
                              sink_logits=None, alibi_slopes=None, softcap: float | None = None, block_table=None):
    """Gradients of `attention_varlen`: (dq, dk, dv), plus d sink_logits (float32 (nheads,)) when
    sink_logits is given. dout and out are (total_q, nheads, head_dim), lse (nheads, total_q).
    A paged call (block_table) has no backward yet: NotImplementedError."""
    if block_table is not None:
        from ._kvcache import refuse_paged_backward

        raise refuse_paged_backward()
    ad = _adapter(q)
    opts = _options(None, None, window, num_sink_tokens, sink_logits, alibi_slopes, softcap) or {}
    plan = ad.varlen_plan(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                          deterministic, False, opts)
    full = dict(opts, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    if _traced(plan):
        from ._adapters._jax import traced_backward

        dq, dk, dv, dsink = traced_backward(dout, q, k, v, out, lse, full, (causal, softmax_scale, deterministic, False),
                                            (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k))
    else:
        dq, dk, dv, dsink = ad.backward(plan, dout, q, k, v, out, lse, full)
    return (dq, dk, dv, dsink) if sink_logits is not None else (dq, dk, dv)


def lengths_from_padding_mask(mask):
    """Valid lengths from a boolean padding mask, the form transformers passes.

    Args:
        mask: (batch, seqlen) bool (or 0/1 integers), True / 1 where the token is real; each row
            must be right-padded: ones, then zeros. torch, JAX, CuPy or NumPy.
    Returns:
        int32 (batch,) lengths, the mask's kind of array on its device: pass them as q_lengths /
        kv_lengths.
    Raises:
        ValueError if a row is not right-padded (a 0 before a 1: left padding or a hole); this
        check reads one flag back from the device.
        TypeError for an unsupported array or dtype.
    """
    ad = adapter_for(mask)
    if ad is None:
        raise TypeError(f"mask: expected a torch.Tensor, jax.Array, cupy.ndarray or numpy.ndarray; got "
                        f"{type(mask).__module__}.{type(mask).__qualname__}")
    info = ad.info(mask)
    if len(info.shape) != 2:
        raise ValueError(f"mask: expected 2 dimensions (batch, seqlen); got shape {info.shape}")
    if info.dtype != "bool" and not info.dtype.startswith(("int", "uint")):
        raise TypeError(f"mask: expected a bool (or 0/1 integer) array; got dtype {info.dtype}")
    lengths, ok = ad.lengths_from_padding_mask(mask)
    if not ok:
        raise ValueError("mask: expected right padding (each row: True for the real tokens, then False); "
                         "a row has a False before a True (left padding or a hole)")
    return lengths


# The options an explicit plan fixes (scalars); the others are arrays, passed again on each call.
_PLAN_SCALARS = ("window", "num_sink_tokens", "softcap")


class AttentionPlan:
    """A call signature validated and planned once, held by the caller (see `plan`).

    Calling it runs the forward on arrays of that signature; `backward` runs the backward. Both
    check that the arrays match the signature (a cheap key comparison) and raise ValueError
    otherwise; the checks of the planned call are not repeated."""

    def __init__(self, ad, plan, example: tuple, names: tuple, describe: str):
        # names: the option arrays passed again on each call (by keyword, in any order); a call
        # matches when q, k, v and those arrays have the signatures (ad.sigs) of the example's,
        # (q, k, v, {name: array}) of the call the plan was made for; the plan fixes the scalars.
        self._ad, self._plan, self._names = ad, plan, names
        q, k, v, arrays = example
        self._key = ad.sigs((q, k, v) + tuple(arrays[n] for n in names))
        self._describe = describe
        self.call = plan.call

    def __repr__(self):
        return f"<cuflash.AttentionPlan {self._describe}>"

    def _check(self, q, k, v, arrays):
        names = self._names
        try:
            if len(arrays) != len(names):
                same = False
            elif names:
                same = self._ad.sigs((q, k, v) + tuple([arrays[n] for n in names])) == self._key
            else:
                same = self._ad.sigs((q, k, v)) == self._key
        except Exception:  # a missing name, a None, an array of another library
            same = False
        if not same:
            got = ", ".join(f"{n} {_brief(x)}" for n, x in dict(arrays, q=q, k=k, v=v).items() if x is not None)
            raise ValueError(f"q, k, v: this plan was made for {self._describe}; got {got}")

    def __call__(self, q, k, v, *, return_lse: bool = False, **arrays):
        """out (and lse with return_lse) for q, k, v and the plan's option arrays (passed again by
        name: q_lengths, kv_lengths, cu_seqlens_q, cu_seqlens_k, sink_logits, alibi_slopes). lse is
        computed only where asked for, or where autograd keeps it for the backward."""
        self._check(q, k, v, arrays)
        out, lse = self._ad.forward(self._plan, q, k, v, arrays, return_lse)
        return (out, lse) if return_lse else out

    def backward(self, dout, q, k, v, out, lse, **arrays):
        """(dq, dk, dv), plus d sink_logits when the plan has sink logits."""
        self._check(q, k, v, arrays)
        dq, dk, dv, dsink = self._ad.backward(self._plan, dout, q, k, v, out, lse, arrays)
        return (dq, dk, dv, dsink) if self._plan.has_sink else (dq, dk, dv)


def _brief(x) -> str:
    try:
        info = info_of(x)
        return f"{info.lib} {info.dtype}{list(info.shape)} strides {list(info.strides)} on {info.device[0]}:{info.device[1]}"
    except Exception:
        return type(x).__name__


def plan(q, k, v, causal: bool = False, softmax_scale: float | None = None, deterministic: bool = False, *,
         q_lengths=None, kv_lengths=None, window=None, num_sink_tokens: int = 0, sink_logits=None, alibi_slopes=None,
         softcap: float | None = None) -> AttentionPlan:
    """The plan of `attention(q, k, v, ...)` with these arguments, as an object.

    The arrays given here are examples: the plan serves every later call with arrays of the same
    library, dtypes, shapes, strides, device and pointer alignment (and option arrays of the same
    kind). `plan(...)(q, k, v)` is `attention(q, k, v, ...)`; `p.backward(dout, q, k, v, out, lse)`
    is `attention_backward`. Array options are passed again on each call, by name. This is the
    same work `attention` caches per signature on its own; holding it skips the cache lookup and
    makes the fixed shape explicit (for a serving loop or a CUDA graph capture)."""
    ad = _adapter(q)
    opts = _options(q_lengths, kv_lengths, window, num_sink_tokens, sink_logits, alibi_slopes, softcap)
    p = ad.forward_plan(q, k, v, causal, softmax_scale, deterministic, False, opts)
    given = {n: x for n, x in (opts or {}).items() if n not in _PLAN_SCALARS}
    return AttentionPlan(ad, p, (q, k, v, given), tuple(given), _brief(q) + f", causal={causal}")


def plan_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, causal: bool = False,
                softmax_scale: float | None = None, deterministic: bool = False, *, window=None,
                num_sink_tokens: int = 0, sink_logits=None, alibi_slopes=None,
                softcap: float | None = None) -> AttentionPlan:
    """The plan of `attention_varlen(...)` with these arguments (see `plan`). Call it as
    `p(q, k, v, cu_seqlens_q=..., cu_seqlens_k=..., [sink_logits=..., alibi_slopes=...])`."""
    ad = _adapter(q)
    opts = _options(None, None, window, num_sink_tokens, sink_logits, alibi_slopes, softcap) or {}
    p = ad.varlen_plan(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                       deterministic, False, opts)
    given = {n: x for n, x in opts.items() if n not in _PLAN_SCALARS}
    given.update(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    return AttentionPlan(ad, p, (q, k, v, given), tuple(given), _brief(q) + f", packed, causal={causal}")

