"""The adapter interface and the pipeline every library shares.

An adapter supplies the library-specific pieces (facts about an array, a signature key, pointers,
allocation, the current stream, conversion to and from NumPy); `Adapter` strings them into the
pipeline: signature key -> cached Plan (or describe + plan on a miss) -> run. The torch adapter
overrides the hot paths with inlined versions of the same steps.

Signature keys: a key must be equal for two calls only when validation and planning would give
the same result for both. So it holds every fact those read (dtype, shape, strides, device,
pointer alignment of each array, and each scalar with its type: causal=1 must not hit the entry
of causal=True, since the first is a TypeError). Anything that cannot be keyed (an unhashable
argument, an object without the attributes) falls back to describe + plan without caching, and
that is where bad input gets its error.
"""

from __future__ import annotations

import functools

from .. import _call
from .._call import ArrayInfo, Foreign
from .._features import ARRAY_OPTIONS
from .._plan import CACHE, NO_OPTIONS, BackwardPlan, Plan, remember

SCALAR_OPTIONS = ("window", "num_sink_tokens", "softcap")


def type_name(x) -> str:
    t = type(x)
    return f"{t.__module__}.{t.__qualname__}"


def info_of(x):
    """ArrayInfo of any array cuflash knows, Foreign for anything else."""
    from . import adapter_for

    ad = adapter_for(x)
    return Foreign(type_name(x)) if ad is None else ad.info(x)


def scalar_key(x):
    """A scalar with its type, so that equal-but-differently-typed values key apart."""
    return (x.__class__, x)


def window_key(w):
    if w is None:
        return None
    a, b = w  # anything but a pair: no key (the slow path raises the error)
    return (w.__class__, a.__class__, a, b.__class__, b)


def any_sig(x):
    """The signature of an option array of any library (None stays None)."""
    if x is None:
        return None
    return (type(x),) + _adapter_for(x).sig(x)


def _adapter_for(x):
    from . import adapter_for

    return adapter_for(x)


_ARRAY_SET = frozenset(ARRAY_OPTIONS)


def options_key(opts: dict, sig=any_sig) -> tuple:
    """The key of the options given (sig: the signature of one option array, None for None): each
    entry with its name, arrays by signature, the window by its parts' types and values, other
    scalars with their type."""
    key = []
    for n, x in opts.items():
        if n in _ARRAY_SET:
            key.append((n, sig(x)))
        elif n == "window":
            key.append((n, window_key(x)))
        else:
            key.append((n, x.__class__, x))
    return tuple(key)


def option_infos(opts: dict) -> dict:
    """The arrays and scalars of opts as describe_* takes them."""
    out = {n: (None if opts.get(n) is None else info_of(opts[n])) for n in ARRAY_OPTIONS
           if n not in ("cu_seqlens_q", "cu_seqlens_k")}
    for n in SCALAR_OPTIONS:
        if n in opts:
            out[n] = opts[n]
    return out


def plan_infos(call: _call.Call, infos, opts: dict) -> dict:
    """name -> ArrayInfo of every array a plan reads: q, k, v and the option arrays given."""
    d = dict(zip(("q", "k", "v"), infos))
    for n in call.arrays:
        d[n] = info_of(opts[n])
    return d


class Adapter:
    """Base class: the generic pipeline over the primitives a library supplies."""

    lib = ""
    # Optional fast paths (None: the generic route):
    #   ptr_fn       a function of one array giving its device pointer, where reading it needs no
    #                `keep` list (ptr's), called directly by the decode plans' hot path
    #   kvcache_key  attention_with_kvcache's signature key written out for this library's arrays,
    #                the same facts as cuflash/_kvcache.py _fast_key over this adapter's sig
    ptr_fn = None
    kvcache_key = None

    # ---- primitives (each library implements these) ----
    def info(self, x) -> ArrayInfo:
        raise NotImplementedError

    def sig(self, x) -> tuple:
        """A hashable key that is equal for two arrays only when their infos are."""
        raise NotImplementedError

    def sigs(self, xs: tuple) -> tuple:
        """The signatures of several arrays as one key (an explicit plan's check)."""
        return tuple(map(self.sig, xs))

    def ptr(self, x, keep: list) -> int:
        raise NotImplementedError

    def empty(self, shape, dtype: str, device_id: int):
        raise NotImplementedError

    def empty_from(self, cache: dict, shape, dtype: str, device_id: int):
        """empty(shape, dtype, device_id) for a caller that allocates the same output on every call:
        `cache` (the caller's, per adapter) may keep what makes the next allocation cheaper."""
        return self.empty(shape, dtype, device_id)

    def allocator(self, cache: dict, shape, dtype: str, device_id: int):
        """A function of no argument giving empty_from(cache, shape, dtype, device_id): for a caller
        that keeps it and allocates the same output on every call."""
        return functools.partial(self.empty_from, cache, shape, dtype, device_id)

    def contiguous(self, x, device_id: int, keep: list):
        raise NotImplementedError

    def stream(self, device_id: int) -> int:
        raise NotImplementedError

    def export(self, x):
        return x

    def dsink_sum(self, scratch, offset: int, shape: tuple, device_id: int):
        raise NotImplementedError

    def to_numpy(self, x):
        raise NotImplementedError

    def from_numpy(self, a, like):
        raise NotImplementedError

    # ---- plans ----
    def forward_key(self, q, k, v, causal, softmax_scale, deterministic, return_lse, opts) -> tuple:
        key = ("fwd", self.sig(q), self.sig(k), self.sig(v), scalar_key(causal), scalar_key(softmax_scale),
               scalar_key(deterministic), scalar_key(return_lse))
        if opts:
            key += options_key(opts)
        return key

    def varlen_key(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                   deterministic, return_lse, opts) -> tuple:
        return (("varlen", self.sig(q), self.sig(k), self.sig(v), any_sig(cu_seqlens_q), any_sig(cu_seqlens_k),
                 scalar_key(max_seqlen_q), scalar_key(max_seqlen_k), scalar_key(causal), scalar_key(softmax_scale),
                 scalar_key(deterministic), scalar_key(return_lse)) + options_key(opts))

    def forward_plan(self, q, k, v, causal, softmax_scale, deterministic, return_lse, opts) -> Plan:
        """The plan of a padded call, from the cache or described and made now."""
        try:
            key = self.forward_key(q, k, v, causal, softmax_scale, deterministic, return_lse, opts)
            plan = CACHE.get(key)
        except Exception:  # cannot be keyed: the slow path checks (and raises)
            key = plan = None
        if plan is None:
            infos = [info_of(x) for x in (q, k, v)]
            call = _call.describe_forward(infos, causal, softmax_scale, deterministic, return_lse,
                                          **option_infos(opts or {}))
            plan = self.make_plan(call, plan_infos(call, infos, opts or {}))
            if key is not None and plan is not None:
                remember(key, plan)
        return plan

    def varlen_plan(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                    deterministic, return_lse, opts) -> Plan:
        try:
            key = self.varlen_key(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                  softmax_scale, deterministic, return_lse, opts)
            plan = CACHE.get(key)
        except Exception:
            key = plan = None
        if plan is None:
            infos = [info_of(x) for x in (q, k, v)]
            call = _call.describe_varlen(infos, info_of(cu_seqlens_q), info_of(cu_seqlens_k), max_seqlen_q,
                                         max_seqlen_k, causal, softmax_scale, deterministic, return_lse,
                                         **option_infos(opts))
            full = dict(opts, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
            plan = self.make_plan(call, plan_infos(call, infos, full))
            if key is not None and plan is not None:
                remember(key, plan)
        return plan

    def make_plan(self, call, infos) -> Plan:
        return Plan(call, infos)

    def backward_plan(self, plan: Plan, dout, out, lse) -> BackwardPlan:
        """The backward plan for dout / out / lse of this layout (checked against the call on a miss)."""
        try:
            key = (self.sig(dout), self.sig(out), self.sig(lse))
            bp = plan._backward.get(key)
        except Exception:
            key = bp = None
        if bp is None:
            infos = {n: info_of(x) for n, x in (("dout", dout), ("out", out), ("lse", lse))}
            _call.check_backward_arrays(plan.call, infos["dout"], infos["out"], infos["lse"])
            bp = plan.backward_plan(key, infos) if key is not None else BackwardPlan(plan, infos)
        return bp

    # ---- running ----
    def run_forward(self, plan: Plan, q, k, v, opts: dict, want_lse=True):
        """(out, lse) as the caller's arrays (lse None unless wanted: the GPU kernels then write
        none). opts: name -> array for the plan's option arrays."""
        if not plan.on_gpu:
            return self._forward_numpy(plan, q, k, v, opts)
        dev = plan.device_id
        keep = []
        arrays = {"q": q, "k": k, "v": v}
        for n in plan.options:
            arrays[n] = opts[n]
        for n in plan.copy:
            arrays[n] = self.contiguous(arrays[n], dev, keep)
        stream = self.stream(dev)
        out = self.empty(plan.out_shape, plan.call.dtype, dev)
        lse = self.empty(plan.lse_shape, "float32", dev) if want_lse else None
        ptrs = [self.ptr(arrays["q"], keep), self.ptr(arrays["k"], keep), self.ptr(arrays["v"], keep),
                self.ptr(out, keep), 0 if lse is None else self.ptr(lse, keep)]
        ptrs += self._option_ptrs(plan, arrays, keep)
        plan.launch(stream, ptrs)
        return self.export(out), (None if lse is None else self.export(lse))

    def _option_ptrs(self, plan, arrays, keep):
        if not plan.options:
            return NO_OPTIONS
        return [self.ptr(arrays[n], keep) if n in arrays else 0 for n in ARRAY_OPTIONS]

    def run_backward(self, plan: Plan, bp: BackwardPlan, dout, q, k, v, out, lse, opts: dict):
        """(dq, dk, dv, dsink or None) as the caller's arrays."""
        if not plan.on_gpu:
            return self._backward_numpy(plan, dout, q, k, v, out, lse, opts)
        dev = plan.device_id
        keep = []
        arrays = {"dout": dout, "q": q, "k": k, "v": v, "out": out, "lse": lse}
        for n in plan.options:
            arrays[n] = opts[n]
        for n in bp.copy:
            arrays[n] = self.contiguous(arrays[n], dev, keep)
        stream = self.stream(dev)
        c = plan.call
        dq = self.empty(c.q_shape, c.dtype, dev)
        dk = self.empty(tuple(_shape(k)), c.dtype, dev)
        dv = self.empty(tuple(_shape(v)), c.dtype, dev)
        scratch = self.empty((max(1, bp.scratch_floats),), "float32", dev)
        ptrs = [self.ptr(arrays[n], keep) for n in ("dout", "q", "k", "v", "out", "lse")]
        ptrs += [self.ptr(x, keep) for x in (dq, dk, dv, scratch)]
        ptrs += self._option_ptrs(plan, arrays, keep)
        bp.launch(stream, ptrs)
        dsink = None
        if bp.dsink_shape:
            dsink = self.export(self.dsink_sum(scratch, bp.dsink_offset, bp.dsink_shape, dev))
        return self.export(dq), self.export(dk), self.export(dv), dsink

    def _forward_numpy(self, plan, q, k, v, opts):
        qn, kn, vn = (self.to_numpy(x) for x in (q, k, v))
        out, lse = plan.forward_numpy(qn, kn, vn, {n: self.to_numpy(opts[n]) for n in plan.options})
        return self.from_numpy(out, q), self.from_numpy(lse, q)

    def _backward_numpy(self, plan, dout, q, k, v, out, lse, opts):
        arrs = [self.to_numpy(x) for x in (dout, q, k, v, out, lse)]
        grads = plan.backward_numpy(*arrs, {n: self.to_numpy(opts[n]) for n in plan.options})
        return tuple(None if g is None else self.from_numpy(g, q) for g in grads)

    # ---- entry points (the library's autograd, where it has one, wraps run_forward) ----
    def forward(self, plan, q, k, v, opts, want_lse=True):
        return self.run_forward(plan, q, k, v, opts, want_lse)

    def attention(self, q, k, v, causal, softmax_scale, return_lse, deterministic, opts):
        plan = self.forward_plan(q, k, v, causal, softmax_scale, deterministic, return_lse, opts)
        out, lse = self.forward(plan, q, k, v, opts or {}, return_lse)
        return (out, lse) if return_lse else out

    def attention_varlen(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                         softmax_scale, return_lse, deterministic, opts):
        plan = self.varlen_plan(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                softmax_scale, deterministic, return_lse, opts)
        out, lse = self.forward(plan, q, k, v, dict(opts, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k),
                                return_lse)
        return (out, lse) if return_lse else out

    def backward(self, plan, dout, q, k, v, out, lse, opts):
        """The backward of a validated forward plan on arrays of its signature."""
        bp = self.backward_plan(plan, dout, out, lse)
        return self.run_backward(plan, bp, dout, q, k, v, out, lse, opts)


def _shape(x) -> tuple:
    return tuple(int(n) for n in x.shape)
