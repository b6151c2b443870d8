"""JAX adapter: eager calls, with gradients through jax.custom_vjp.

JAX arrays reach the kernels through DLPack: `cupy.from_dlpack` hands CuPy's current stream to the
array's __dlpack__(stream=...), so JAX makes the data ready for that stream, which the kernels then
run on; outputs are CuPy arrays exported back with jax.dlpack.from_dlpack (zero copy). DLPack is
the only route that also carries that stream handshake, so it stays even though it is most of a
JAX call's host time (bench/bench_host.py).

A call on concrete arrays runs the plan directly. A call on tracers (jax.grad / jax.vjp in eager
mode, which trace the primal) goes through a jax.custom_vjp whose rules receive concrete arrays
and run the forward and backward plans.

Under jax.jit (or vmap, or any transformation that hands the rules abstract values) the rules
build the call into the traced program with jax.lax.platform_dependent: on the CPU a
jax.pure_callback runs the NumPy path (the same entry points on NumPy arrays; vmap runs it once per
mapped element); on CUDA (CUFLASH_JAX_JIT_GPU=0 turns it off; below) a buffer_callback runs
the GPU plans on XLA's buffers and stream; on any other platform (and on CUDA with
CUFLASH_JAX_JIT_GPU=0) the branch is a primitive whose lowering raises NotImplementedError, so compiling fails with that
message before anything runs, rather than copying the arrays to the host behind XLA's back. The
checks run at trace time on the abstract shapes and dtypes.
"""

from __future__ import annotations

from functools import partial

import jax

from .. import _call
from .._call import ArrayInfo
from .._plan import contiguous_strides
from ._base import Adapter, info_of, option_infos

_Tracer = jax.core.Tracer


def jit_error(what: str = "attention", platform: str = "gpu") -> NotImplementedError:
    return NotImplementedError(
        f"cuflash.{what} under jax.jit (or vmap, or another JAX transformation that traces abstract values) "
        f"runs on the CPU only so far; this program is being compiled for {platform!r}, where its kernels run "
        "only from Python on concrete arrays. Call it outside jit there (jax.grad and jax.vjp work in eager "
        "mode).")


def _traced(*xs) -> bool:
    return any(isinstance(x, _Tracer) for x in xs)


# ---- under jit: the NumPy path on the CPU, a lowering error elsewhere ----

def _make_unsupported():
    """A primitive with the call's result shapes whose lowering raises jit_error: the branch of
    platform_dependent for the platforms cuflash cannot run under jit yet."""
    from jax.extend.core import Primitive
    from jax.interpreters import batching, mlir

    prim = Primitive("cuflash_unsupported_under_jit")
    prim.multiple_results = True
    prim.def_abstract_eval(lambda *args, shapes, what: shapes)
    prim.def_impl(lambda *args, shapes, what: (_ for _ in ()).throw(jit_error(what)))

    def lowering(ctx, *args, shapes, what):
        platforms = getattr(ctx.module_context, "platforms", None) or ("gpu",)
        raise jit_error(what, ",".join(platforms))

    def batch(args, dims, *, shapes, what):
        import jax.numpy as jnp

        size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)  # None: not mapped
        args = [a if d is None else jnp.moveaxis(a, d, 0) for a, d in zip(args, dims)]
        out = prim.bind(*args, shapes=tuple(s.update(shape=(size,) + s.shape) for s in shapes), what=what)
        return out, (0,) * len(shapes)

    mlir.register_lowering(prim, lowering)
    batching.primitive_batchers[prim] = batch
    return prim


_UNSUPPORTED = None


def _under_jit(host, result_types, args, what: str, gpu=None):
    """result_types (ShapeDtypeStructs) from host(*numpy arrays) on the CPU; on CUDA from gpu(*args)
    where given (see jit_gpu_enabled); a lowering error elsewhere."""
    global _UNSUPPORTED
    if _UNSUPPORTED is None:
        _UNSUPPORTED = _make_unsupported()
    shapes = tuple(jax.core.ShapedArray(t.shape, t.dtype) for t in result_types)

    def cpu(*a):
        return tuple(jax.pure_callback(host, tuple(result_types), *a, vmap_method="sequential"))

    def other(*a):
        return tuple(_UNSUPPORTED.bind(*a, shapes=shapes, what=what))

    if gpu is not None and jit_gpu_enabled():
        return jax.lax.platform_dependent(*args, cpu=cpu, cuda=gpu, default=other)
    return jax.lax.platform_dependent(*args, cpu=cpu, default=other)


# ---- under jit on CUDA: the GPU plans, launched from a buffer_callback on XLA's stream ----
#
# jax.experimental.buffer_callback hands a Python function XLA's stream and the device pointers of
# the call's operands and results (allocated by XLA: out and lse, or dq, dk, dv and the backward's
# scratch). The function runs the same Plan as an eager call: pointers patched into the Params
# bytes, cuLaunchKernel on that stream. The plan is made on first use per device, from the shapes
# and dtypes known at trace time (XLA's buffers are dense and row-major). Nothing is allocated
# behind XLA's back; the sink gradient is summed from the scratch output with jnp.
#
# Status: on by default since tests/test_jax_jit_route.py passed on an H100 (2026-11-23);
# CUFLASH_JAX_JIT_GPU=0 turns it off (compiling for a GPU then raises NotImplementedError).
# CUFLASH_JAX_JIT_CMD_BUFFER=1 also lets XLA record the launches into its command buffers (CUDA
# graphs), so that Python runs at capture only.


def jit_gpu_enabled() -> bool:
    import os

    return os.environ.get("CUFLASH_JAX_JIT_GPU", "1") != "0"


def _cmd_buffer() -> bool:
    import os

    return os.environ.get("CUFLASH_JAX_JIT_CMD_BUFFER") == "1"


def _buffer_ptr(b) -> int:
    return int(b.__cuda_array_interface__["data"][0])


def _xla_info(shape, dtype, device_id: int) -> ArrayInfo:
    import numpy as np

    shape = tuple(int(n) for n in shape)
    return ArrayInfo("jax", shape, contiguous_strides(shape), np.dtype(dtype).name, ("cuda", device_id), True,
                     "jax.Array")


def _trace_target() -> str:
    """The compile target of the GPU a traced program will run on (the first CUDA device; cuflash assumes
    one kind of GPU per process). A trace on a machine without one (lowering for 'cuda' elsewhere)
    gets sm_90a: the program is not run there."""
    from .. import _config

    try:
        major, minor = (int(x) for x in str(jax.devices("cuda")[0].compute_capability).split("."))
        return _config.compile_arch(major, minor)
    except Exception:
        return "sm_90a"


class _JitPlans:
    """The plans of one traced call, per device: made from the trace-time shapes and dtypes."""

    def __init__(self, q, k, v, names, arrays, scalars, plan_args, packed):
        self.avals = {"q": (q.shape, q.dtype), "k": (k.shape, k.dtype), "v": (v.shape, v.dtype)}
        self.avals.update({n: (a.shape, a.dtype) for n, a in zip(names, arrays)})
        self.names, self.scalars, self.plan_args, self.packed = tuple(names), dict(scalars), plan_args, packed
        self.plans: dict = {}

    def call(self, device_id: int):
        """The validated Call (on the trace device for device_id = 0)."""
        from .._features import ARRAY_OPTIONS

        info = {n: _xla_info(s, d, device_id) for n, (s, d) in self.avals.items()}
        causal, scale, det, _ = self.plan_args
        opts = {n: info.get(n) for n in ARRAY_OPTIONS if n not in ("cu_seqlens_q", "cu_seqlens_k")}
        opts.update(self.scalars)
        qkv = [info["q"], info["k"], info["v"]]
        if self.packed is None:
            return _call.describe_forward(qkv, causal, scale, det, True, **opts), info
        return _call.describe_varlen(qkv, info["cu_seqlens_q"], info["cu_seqlens_k"], self.packed[2], self.packed[3],
                                     causal, scale, det, True, **opts), info

    def plan(self, device_id: int):
        plan = self.plans.get(device_id)
        if plan is None:
            from .._plan import Plan

            call, info = self.call(device_id)
            plan = Plan(call, {n: info[n] for n in ("q", "k", "v") + tuple(call.arrays)})
            if plan.copy:  # XLA's buffers are dense and aligned: nothing should need a copy
                raise RuntimeError(f"cuflash under jax.jit: the plan wants copies of {plan.copy}")
            self.plans[device_id] = plan
        return plan

    def option_ptrs(self, plan, arrays) -> list:
        from .._features import ARRAY_OPTIONS
        from .._plan import NO_OPTIONS

        if not plan.options:
            return list(NO_OPTIONS)
        by_name = dict(zip(self.names, arrays))
        return [_buffer_ptr(by_name[n]) if n in by_name else 0 for n in ARRAY_OPTIONS]


def _device_now() -> int:
    from .. import _plan

    return _plan._current_device()


def forward_callback(plans: _JitPlans):
    """The buffer_callback of a forward: outs = (out, lse)."""
    def callback(ctx, outs, q, k, v, *arrays):
        plan = plans.plan(_device_now())
        ptrs = [_buffer_ptr(q), _buffer_ptr(k), _buffer_ptr(v), _buffer_ptr(outs[0]), _buffer_ptr(outs[1])]
        plan.launch(int(ctx.stream), ptrs + plans.option_ptrs(plan, arrays))

    return callback


def _gpu_forward(plans: _JitPlans, result_types):
    callback = forward_callback(plans)

    def gpu(*args):
        from jax.experimental.buffer_callback import buffer_callback

        return tuple(buffer_callback(callback, tuple(result_types), vmap_method="sequential",
                                     command_buffer_compatible=_cmd_buffer())(*args))

    return gpu


def _gpu_backward(plans: _JitPlans, grad_types, has_sink: bool):
    """The backward under jit: results dq, dk, dv (and d sink_logits), with the scratch a result too."""
    import numpy as np

    from .._plan import scratch_layout

    call, _ = plans.call(0)
    _, n_rows, n_acc, n_sink = scratch_layout(call, _trace_target(), has_sink)
    n_scratch = max(1, n_rows + n_acc + n_sink)
    types = tuple(grad_types[:3]) + (jax.ShapeDtypeStruct((n_scratch,), np.float32),)
    callback = backward_callback(plans, n_scratch, n_rows + n_acc if has_sink else None)

    def gpu(*args):
        import jax.numpy as jnp
        from jax.experimental.buffer_callback import buffer_callback

        dq, dk, dv, scratch = buffer_callback(callback, types, vmap_method="sequential",
                                               command_buffer_compatible=_cmd_buffer())(*args)
        if not has_sink:
            return dq, dk, dv
        b, h = call.batch, call.nheads
        rows = scratch[n_rows + n_acc:n_rows + n_acc + n_sink].reshape(b, h, n_sink // (b * h))
        return dq, dk, dv, jnp.sum(rows, axis=(0, 2))

    return gpu


def backward_callback(plans: _JitPlans, n_scratch: int, dsink_offset):
    """The buffer_callback of a backward: outs = (dq, dk, dv, scratch of n_scratch floats, with the sink
    rows at dsink_offset when there are sink logits)."""
    def callback(ctx, outs, dout, q, k, v, out, lse, *arrays):
        plan = plans.plan(_device_now())
        c = plan.call
        infos = {n: _xla_info(x.shape, x.dtype, plan.device_id) for n, x in (("dout", dout), ("out", out), ("lse", lse))}
        bp = plan.backward_plan(("jit",), infos)
        if bp.copy or bp.scratch_floats > n_scratch or (dsink_offset is not None and bp.dsink_offset != dsink_offset):
            raise RuntimeError(f"cuflash under jax.jit: the backward of {c} does not fit the scratch laid out at "
                               f"trace time for {_trace_target()} ({n_scratch} floats); is this a different GPU?")
        ptrs = [_buffer_ptr(x) for x in (dout, q, k, v, out, lse)] + [_buffer_ptr(x) for x in outs]
        bp.launch(int(ctx.stream), ptrs + plans.option_ptrs(plan, arrays))

    return callback


def _varying_axes(x) -> frozenset:
    """The manual mesh axes over which x varies inside shard_map (empty outside it). jax 0.10 keeps
    them in aval.mat.varying; earlier releases in aval.vma."""
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)
    if mat is not None:
        return frozenset(getattr(mat, "varying", ()))
    return frozenset(getattr(aval, "vma", ()))


def _to_varying(x, axes: frozenset):
    missing = tuple(sorted(axes - _varying_axes(x)))
    if not missing:
        return x
    return jax.lax.pcast(x, missing, to="varying") if hasattr(jax.lax, "pcast") else jax.lax.pvary(x, missing)


def _shard_types(results, operands, grads_of=None):
    """Inside shard_map: a callback's results carry no manual axes, but they depend on every operand,
    so they vary over the union U of the operands' varying axes. Forward results (grads_of None) are
    marked varying over U. A gradient of an input that varies over fewer axes (a replicated sink
    logit, a k shared by the shards of q) is the sum of the shards' parts: psum over the axes U has
    beyond that input's, as the transpose of JAX's implicit broadcast would give."""
    union = frozenset().union(*(_varying_axes(x) for x in operands))
    if not union:
        return list(results)
    out = [_to_varying(r, union) for r in results]
    if grads_of is None:
        return out
    summed = []
    for g, x in zip(out, grads_of):
        extra = tuple(sorted(union - _varying_axes(x)))
        summed.append(jax.lax.psum(g, extra) if extra else g)
    return summed


def _split_opts(opts):
    """(names of the array options, their arrays, the scalar options)."""
    names = [n for n, x in opts.items() if x is not None and hasattr(x, "shape")]
    return names, [opts[n] for n in names], {n: x for n, x in opts.items() if n not in names}


def _host_options(names, scalars, arrays):
    import numpy as np

    return dict(scalars, **{n: np.asarray(a) for n, a in zip(names, arrays)})


def traced_forward(q, k, v, opts, plan_args, packed):
    """(out, lse) of a call on tracers, built into the traced program (see the module docstring)."""
    import numpy as np

    from .. import _api

    causal, scale, det, _ = plan_args
    names, arrays, scalars = _split_opts(opts)
    lse_shape = (q.shape[0], q.shape[2], q.shape[1]) if packed is None else (q.shape[1], q.shape[0])
    types = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(lse_shape, np.float32))

    def host(q, k, v, *arrays):
        kw = _host_options(names, scalars, arrays)
        q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
        if packed is None:
            return _api.attention(q, k, v, causal, scale, True, det, **kw)
        cu = (kw.pop("cu_seqlens_q"), kw.pop("cu_seqlens_k"), packed[2], packed[3])
        return _api.attention_varlen(q, k, v, *cu, causal, scale, True, det, **kw)

    what = "attention" if packed is None else "attention_varlen"
    gpu = None
    if jit_gpu_enabled():
        gpu = _gpu_forward(_JitPlans(q, k, v, names, arrays, scalars, plan_args, packed), types)
    return tuple(_shard_types(_under_jit(host, types, (q, k, v, *arrays), what, gpu), (q, k, v, *arrays)))


def traced_backward(dout, q, k, v, out, lse, opts, plan_args, packed):
    """(dq, dk, dv, d sink_logits or None) of a call on tracers (see the module docstring)."""
    import numpy as np

    from .. import _api

    causal, scale, det, _ = plan_args
    names, arrays, scalars = _split_opts(opts)
    sink = opts.get("sink_logits")
    types = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v))
    if sink is not None:
        types += (jax.ShapeDtypeStruct(sink.shape, np.float32),)

    def host(dout, q, k, v, out, lse, *arrays):
        kw = _host_options(names, scalars, arrays)
        lead = [np.asarray(x) for x in (dout, q, k, v, out, lse)]
        if packed is None:
            return _api.attention_backward(*lead, causal, scale, det, **kw)
        cu = (kw.pop("cu_seqlens_q"), kw.pop("cu_seqlens_k"), packed[2], packed[3])
        return _api.attention_varlen_backward(*lead, *cu, causal, scale, det, **kw)

    what = "attention_backward" if packed is None else "attention_varlen_backward"
    gpu = None
    if jit_gpu_enabled():
        gpu = _gpu_backward(_JitPlans(q, k, v, names, arrays, scalars, plan_args, packed), types, sink is not None)
    grads = _under_jit(host, types, (dout, q, k, v, out, lse, *arrays), what, gpu)
    grads = _shard_types(grads, (dout, q, k, v, out, lse, *arrays), (q, k, v) + (() if sink is None else (sink,)))
    return tuple(grads) + ((None,) if sink is None else ())


def _device(x):
    if isinstance(x, _Tracer):
        return ("traced", 0)
    dev = next(iter(x.devices()))
    if dev.platform in ("gpu", "cuda"):
        hw = getattr(dev, "local_hardware_id", None)
        return ("cuda", hw if hw is not None else dev.id)
    return (dev.platform, dev.id)


class JaxAdapter(Adapter):
    lib = "jax"

    def info(self, x) -> ArrayInfo:
        import numpy as np

        shape = tuple(int(n) for n in x.shape)
        return ArrayInfo("jax", shape, contiguous_strides(shape), np.dtype(x.dtype).name, _device(x), True,
                         f"{type(x).__module__}.{type(x).__qualname__}")

    def sig(self, x) -> tuple:
        # JAX arrays are dense and row-major, and their buffers aligned: dtype, shape and device
        # say everything validation and planning read.
        return (type(x), x.dtype, x.shape, _device(x))

    # ---- primitives: CuPy views through DLPack ----
    def ptr(self, x, keep) -> int:
        if type(x).__module__.startswith("cupy"):
            return x.data.ptr
        import cupy

        c = cupy.from_dlpack(x)  # CuPy passes its current stream: the producer makes x ready on it
        keep.append(c)
        return c.data.ptr

    def stream(self, device_id: int) -> int:
        from . import _cupy

        return _cupy.ADAPTER.stream(device_id)

    def empty(self, shape, dtype, device_id):
        import cupy

        from . import _cupy

        try:
            return _cupy.ADAPTER.empty(shape, dtype, device_id)
        except cupy.cuda.memory.OutOfMemoryError as e:
            # JAX's own error for an allocation that does not fit, as a JAX op would raise it.
            raise jax.errors.JaxRuntimeError(f"RESOURCE_EXHAUSTED: cuflash could not allocate {shape} {dtype} "
                                             f"on GPU {device_id}: {e}") from e

    def contiguous(self, x, device_id, keep):
        import cupy

        with cupy.cuda.Device(device_id):
            c = cupy.from_dlpack(x).copy(order="C")  # always a new, aligned allocation
        keep.append(c)
        return c

    def export(self, x):
        return jax.dlpack.from_dlpack(x)

    def dsink_sum(self, scratch, offset, shape, device_id):
        from . import _cupy

        return _cupy.ADAPTER.dsink_sum(scratch, offset, shape, device_id)

    def to_numpy(self, x):
        import numpy as np

        return np.asarray(x)

    def from_numpy(self, a, like):
        return jax.device_put(a, next(iter(like.devices())))

    # ---- entry points ----
    def attention(self, q, k, v, causal, softmax_scale, return_lse, deterministic, opts):
        opts = opts or {}
        plan_args = (causal, softmax_scale, deterministic, return_lse)
        return self._entry(q, k, v, opts, plan_args, None, return_lse)

    def attention_varlen(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                         softmax_scale, return_lse, deterministic, opts):
        packed = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        opts = dict(opts, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
        return self._entry(q, k, v, opts, (causal, softmax_scale, deterministic, return_lse), packed, return_lse)

    def _plan(self, q, k, v, opts, plan_args, packed):
        causal, scale, det, ret = plan_args
        if packed is None:
            return self.forward_plan(q, k, v, causal, scale, det, ret, opts)
        rest = {n: x for n, x in opts.items() if n not in ("cu_seqlens_q", "cu_seqlens_k")}
        return self.varlen_plan(q, k, v, *packed, causal, scale, det, ret, rest)

    def _entry(self, q, k, v, opts, plan_args, packed, return_lse):
        arrays = [q, k, v] + [x for x in opts.values() if x is not None and hasattr(x, "shape")]
        if not any(isinstance(x, _Tracer) for x in arrays):
            # Concrete arrays: nothing differentiates this call, so no custom_vjp around it.
            plan = self._plan(q, k, v, opts, plan_args, packed)
            out, lse = self.run_forward(plan, q, k, v, opts, return_lse)
        else:
            self._validate(q, k, v, opts, plan_args, packed)
            out, lse = self._differentiable(q, k, v, opts, plan_args, packed)
        return (out, lse) if return_lse else out

    def _validate(self, q, k, v, opts, plan_args, packed):
        """The checks of a call on tracers (each call: tracers' devices are unknown)."""
        causal, scale, det, ret = plan_args
        infos = [info_of(x) for x in (q, k, v)]
        rest = {n: x for n, x in opts.items() if n not in ("cu_seqlens_q", "cu_seqlens_k")}
        if packed is None:
            _call.describe_forward(infos, causal, scale, det, ret, **option_infos(rest))
        else:
            cu_q, cu_k, mq, mk = packed
            _call.describe_varlen(infos, info_of(cu_q), info_of(cu_k), mq, mk, causal, scale, det, ret,
                                  **option_infos(rest))

    def _differentiable(self, q, k, v, opts, plan_args, packed):
        """Forward with gradients to q, k, v and sink_logits (jax.custom_vjp). The option arrays that get
        no gradient (lengths, offsets, ALiBi slopes) and the scalars are closed over."""
        sink = opts.get("sink_logits")
        if not opts:  # (a scalar option, window or softcap, is not plain either)
            return _plain(q, k, v, self, plan_args, packed)

        def fwd_impl(q, k, v, sink):
            a = dict(opts, sink_logits=sink) if sink is not None else opts
            if _traced(q, k, v, *(x for x in a.values() if x is not None and hasattr(x, "shape"))):
                return traced_forward(q, k, v, a, plan_args, packed)
            plan = self._plan(q, k, v, a, plan_args, packed)
            return self.run_forward(plan, q, k, v, a)

        def bwd_impl(res, cts):
            q, k, v, sink, out, lse = res
            dout, _ = cts  # lse is not differentiable
            a = dict(opts, sink_logits=sink) if sink is not None else opts
            if _traced(dout, q, k, v, out, lse, *(x for x in a.values() if x is not None and hasattr(x, "shape"))):
                return traced_backward(dout, q, k, v, out, lse, a, plan_args, packed)
            plan = self._plan(q, k, v, a, plan_args, packed)
            return self.backward(plan, dout, q, k, v, out, lse, a)

        @jax.custom_vjp
        def f(q, k, v, sink):
            return fwd_impl(q, k, v, sink)

        def f_fwd(q, k, v, sink):
            out, lse = fwd_impl(q, k, v, sink)
            return (out, lse), (q, k, v, sink, out, lse)

        f.defvjp(f_fwd, bwd_impl)
        if sink is None:
            # No sink: a function of q, k, v only (None is not a valid custom_vjp primal).
            @jax.custom_vjp
            def g(q, k, v):
                return fwd_impl(q, k, v, None)

            def g_fwd(q, k, v):
                out, lse = fwd_impl(q, k, v, None)
                return (out, lse), (q, k, v, None, out, lse)

            g.defvjp(g_fwd, lambda res, cts: bwd_impl(res, cts)[:3])
            return g(q, k, v)
        return f(q, k, v, sink)

    def backward(self, plan, dout, q, k, v, out, lse, opts):
        bp = self.backward_plan(plan, dout, out, lse)
        return self.run_backward(plan, bp, dout, q, k, v, out, lse, opts)

    def lengths_from_padding_mask(self, mask):
        import jax.numpy as jnp

        m = jnp.asarray(mask).astype(bool)
        lengths = m.sum(axis=1).astype(jnp.int32)
        return lengths, bool(jnp.all(m == (jnp.arange(m.shape[1])[None, :] < lengths[:, None])))


ADAPTER = JaxAdapter()


# The plain call's custom_vjp, built once: the adapter and the scalars are static arguments.
@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _plain(q, k, v, ad, plan_args, packed):
    return _plain_fwd(q, k, v, ad, plan_args, packed)[0]


def _plain_fwd(q, k, v, ad, plan_args, packed):
    if _traced(q, k, v):
        out, lse = traced_forward(q, k, v, {}, plan_args, packed)
        return (out, lse), (q, k, v, out, lse)
    plan = ad._plan(q, k, v, {}, plan_args, packed)
    out, lse = ad.run_forward(plan, q, k, v, {})
    return (out, lse), (q, k, v, out, lse)


def _plain_bwd(ad, plan_args, packed, residuals, cotangents):
    q, k, v, out, lse = residuals
    dout, _ = cotangents  # lse is not differentiable
    if _traced(q, k, v, out, lse, dout):
        return traced_backward(dout, q, k, v, out, lse, {}, plan_args, packed)[:3]
    plan = ad._plan(q, k, v, {}, plan_args, packed)
    return ad.backward(plan, dout, q, k, v, out, lse, {})[:3]


_plain.defvjp(_plain_fwd, _plain_bwd)
